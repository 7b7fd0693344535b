"""The weight stream (ops/linear.stream_chunks, the body of LINEAR and EXPERT_LINEAR) alone against
x @ W.T on irregular shapes: under TRITON_INTERPRET on a CPU and compiled on a GPU.  Both matter:
the Triton frontend once compiled a loop-carried update differently from what the interpreter ran
(docs/PERF.md, run 15), and only the GPU showed it."""

import os

import pytest
import torch
import triton
import triton.language as tl

from megakernel.memory import STREAM_SLACK
from megakernel.ops import linear

from .conftest import rel_err

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                       reason="CPU Triton interpreter only")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
# K, rows R, first row r0, tokens N, KC, gate|up, rows from a list
SHAPES = [(64, 16, 0, 1, 64, False, False), (96, 21, 3, 3, 64, True, False), (40, 9, 0, 2, 32, False, True),
          (256, 12, 4, 2, 128, True, True), (1408, 40, 0, 3, 2048, True, True), (8192, 24, 8, 1, 2048, False, False)]


@triton.jit
def _stream_kernel(W, A, I, K, n_rows, xrows_div, x_ld, r0, r1, out_off, w2_off, flags, BR: tl.constexpr,
                   KC: tl.constexpr, ALIGN: tl.constexpr, XKEEP: tl.constexpr):
    w = linear.first_chunk(W, r0, r1, K, BR, KC, ALIGN)
    linear.stream_chunks(A, x_ld, I, xrows_div, n_rows, A + out_off, r1, A, r1, (flags & 2) != 0, W, W + w2_off,
                         (flags & 1) != 0, r0, r1, K, w, BR, KC, ALIGN, XKEEP)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("xkeep", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K,R,r0,N,KC,two,listed", SHAPES)
def test_weight_stream_irregular_shapes(device, xkeep, dtype, K, R, r0, N, KC, two, listed):
    """bf16 weights as 32-bit words of two columns (what the GPU runs), fp32 weights plainly; K not a
    multiple of KC, rows not a multiple of BR, a block that starts inside the matrix, several tokens,
    gate|up, rows from a list; whole chunks read past the matrix's end into the arena's slack."""
    g = torch.Generator().manual_seed(K + R)
    w1 = torch.randn(R, K, generator=g).to(dtype)
    w2 = torch.randn(R, K, generator=g).to(dtype)
    W = torch.cat([w1.reshape(-1), w2.reshape(-1), torch.full((STREAM_SLACK,), 7.0, dtype=dtype)])
    x = torch.randn(N + 1, K, generator=g)
    rows = torch.tensor([4, 1, 3][:N], dtype=torch.int32) if listed else torch.arange(N, dtype=torch.int32)
    A = torch.cat([x.reshape(-1), torch.full((8 * R,), float("nan"))])
    W, A, dev_rows = W.to(device), A.to(device), rows.to(device)
    # flags: bit 0 gate|up, bit 1 residual; + 4 so no argument is a literal 1 (Triton would make it a constexpr)
    _stream_kernel[(1,)](W, A, dev_rows, K, N, 2 if listed else 0, K, r0, R, x.numel(), R * K, 4 + int(two), BR=8,
                         KC=KC, ALIGN=8, XKEEP=xkeep, num_warps=8)
    xs = x[rows.long() // 2] if listed else x[:N]
    want = xs @ w1[r0:].float().T
    if two:
        want = torch.nn.functional.silu(want) * (xs @ w2[r0:].float().T)
    got = A.cpu()[x.numel():].view(-1, R)[rows.long(), r0:]
    assert not got.isnan().any() and rel_err(got, want) <= 1e-6, rel_err(got, want)
