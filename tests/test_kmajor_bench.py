"""tools/kmajor_bench.py's k-major loop on a CPU (Triton's interpreter): each program's partial equals the naive sum
over its rows, on a width and a row count the GPU bench does not use."""

import os

import pytest
import torch

from tools.kmajor_bench import kmajor_kernel, reference_kmajor


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton interpreter only")
@pytest.mark.parametrize("H,R", [(256, 24), (512, 8)])
def test_kmajor_partials_equal_the_naive_sum(H, R):
    P = 3
    g = torch.Generator().manual_seed(0)
    w = torch.randn(P * R, H, generator=g).to(torch.bfloat16)
    h = torch.randn(P * R, generator=g)
    out = torch.full((P, H), float("nan"))
    kmajor_kernel[(P,)](w, h, out, R, H=H, BR=8, num_warps=8)
    want = reference_kmajor(w.view(P, R, H), h.view(P, R))
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-4)
