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
from megakernel.ops import linear, linear_flat

from .conftest import rel_err

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                       reason="CPU Triton interpreter only")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
# K, rows R, first row r0, tokens N, KC, BR, gate|up, rows from a list, residual, x's RMSNorm (NORM)
SHAPES = [(64, 16, 0, 1, 64, 8, False, False, False, False),
          (64, 8, 0, 1, 64, 8, False, False, True, False),  # one step
          (40, 24, 0, 1, 64, 8, False, False, False, False),  # an odd step count (the unrolled loop's remainder)
          (96, 21, 3, 3, 64, 8, True, False, False, True), (40, 9, 0, 2, 32, 8, False, True, False, False),
          (256, 12, 4, 2, 128, 16, True, True, False, False), (200, 40, 0, 2, 128, 128, False, False, True, True),
          (1408, 40, 0, 3, 2048, 8, True, True, False, True), (8192, 24, 8, 1, 2048, 8, False, False, True, True)]
BN = 2048  # the norm's chunk: K = 8192 takes four, K < 2048 one masked
GUARD = 256  # NaN before the weights and after the slack: a read outside [weights, slack] shows in the output


@triton.jit
def _stream_kernel(W, A, I, K, n_rows, xrows_div, x_ld, r0, r1, out_off, res_off, w_off, w2_off, flags, eps,
                   BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, TB: tl.constexpr, DEPTH: tl.constexpr,
                   BN: tl.constexpr, ROWVEC: tl.constexpr, AHEAD: tl.constexpr, PFD: tl.constexpr):
    w = linear.first_chunk(W + w_off, r0, r1, K, BR, KC, ALIGN)
    linear.stream_chunks(A, x_ld, I, xrows_div, n_rows, A + out_off, r1, A + res_off, r1, (flags & 2) != 0,
                         W + w_off, W + w2_off, (flags & 1) != 0, r0, r1, K, w, (flags & 4) != 0, eps, BR, KC, ALIGN,
                         TB, DEPTH, BN, ROWVEC, AHEAD, PFD)


@triton.jit
def _pinned_kernel(W, A, I, K, n_rows, xrows_div, x_ld, r0, r1, out_off, res_off, w_off, w2_off, flags, eps,
                   BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, TB: tl.constexpr, DEPTH: tl.constexpr,
                   BN: tl.constexpr, ROWVEC: tl.constexpr, AHEAD: tl.constexpr, PFD: tl.constexpr,
                   PINNED: tl.constexpr):
    """_stream_kernel's slice as launch variant PIN streams it (linear.body's choice; an expert slice's rows come
    from a list): linear.stream_pinned_k or stream_pinned where they take it, stream_chunks elsewhere."""
    w = linear.first_chunk(W + w_off, r0, r1, K, BR, KC, ALIGN)
    two, res, norm = (flags & 1) != 0, (flags & 2) != 0, (flags & 4) != 0
    if linear.pinnable_k(n_rows, K, two, KC, TB, ROWVEC) & (xrows_div == 0):
        linear.stream_pinned_k(A, x_ld, A + out_off, r1, A + res_off, r1, res, W + w_off, r0, r1, K, w, norm, eps, BR,
                               KC, ALIGN, BN, ROWVEC, 0, PINNED, PFD)
    elif linear.pinnable(n_rows, K, KC, TB, ROWVEC):
        linear.stream_pinned(A, x_ld, I, xrows_div, A + out_off, r1, A + res_off, r1, res, W + w_off, W + w2_off, two,
                             r0, r1, K, w, norm, eps, BR, KC, ALIGN, BN, ROWVEC, 0, 0, False, PINNED, PFD)
    else:
        linear.stream_chunks(A, x_ld, I, xrows_div, n_rows, A + out_off, r1, A + res_off, r1, res, W + w_off,
                             W + w2_off, two, r0, r1, K, w, norm, eps, BR, KC, ALIGN, TB, DEPTH, BN, ROWVEC, AHEAD, PFD)


@triton.jit
def _flat_kernel(W, A, I, K, n_rows, xrows_div, x_ld, r0, r1, out_off, res_off, w_off, w2_off, flags, eps,
                 BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, TB: tl.constexpr, DEPTH: tl.constexpr,
                 BN: tl.constexpr, ROWVEC: tl.constexpr, AHEAD: tl.constexpr, PFD: tl.constexpr,
                 PINNED: tl.constexpr):
    """Launch variant PIN=2's stream (linear_flat.stream_flat) where it takes the slice, else stream_chunks."""
    two, res, norm = (flags & 1) != 0, (flags & 2) != 0, (flags & 4) != 0
    if linear_flat.flat_ok(n_rows, K, two, norm | res, W, KC, ALIGN, TB, ROWVEC):
        w = linear_flat.flat_tile(W + w_off, r0, r1, K, 0, BR, KC, ALIGN, 0)
        linear_flat.stream_flat(A, x_ld, I, xrows_div, A + out_off, r1, W + w_off, r0, r1, K, w, BR, KC, ALIGN,
                                ROWVEC, 0, PINNED)
    else:
        w = linear.first_chunk(W + w_off, r0, r1, K, BR, KC, ALIGN)
        linear.stream_chunks(A, x_ld, I, xrows_div, n_rows, A + out_off, r1, A + res_off, r1, res, W + w_off,
                             W + w2_off, two, r0, r1, K, w, norm, eps, BR, KC, ALIGN, TB, DEPTH, BN, ROWVEC, AHEAD, PFD)


def _run(device, tb, dtype, K, R, r0, N, KC, BR, two, listed, res, norm, depth=1, eps=1e-5, rowvec=0, ahead=0,
         pfd=0, pinned=None, flat=False):
    g = torch.Generator().manual_seed(K + R + N)
    w1 = torch.randn(R, K, generator=g).to(dtype)
    w2 = torch.randn(R, K, generator=g).to(dtype)
    nan = torch.full((GUARD,), float("nan"), dtype=dtype)
    W = torch.cat([nan, w1.reshape(-1), w2.reshape(-1), torch.full((STREAM_SLACK,), 7.0, dtype=dtype), nan])
    x = torch.randn(max(N + 1, 3) if listed else N + 1, K, generator=g)  # listed rows 4, 1, 3 read x rows 2, 0, 1
    r = torch.randn(8, R, generator=g)
    rows = torch.tensor([4, 1, 3][:N], dtype=torch.int32) if listed else torch.arange(N, dtype=torch.int32)
    A = torch.cat([x.reshape(-1), torch.full((8 * R,), float("nan")), r.reshape(-1)])
    W, A, dev_rows = W.to(device), A.to(device), rows.to(device)
    # flags: bit 0 gate|up, bit 1 residual, bit 2 norm; + 8 so no argument is a literal 1 (Triton would make
    # it a constexpr)
    kernel, pin = (_stream_kernel, {}) if pinned is None else (_flat_kernel if flat else _pinned_kernel,
                                                                dict(PINNED=pinned))
    kernel[(1,)](W, A, dev_rows, K, N, 2 if listed else 0, K, r0, R, x.numel(), x.numel() + 8 * R, GUARD,
                 GUARD + R * K, 8 + int(two) + 2 * int(res) + 4 * int(norm), eps, BR=BR, KC=KC, ALIGN=8,
                 TB=tb, DEPTH=depth, BN=BN, ROWVEC=rowvec, AHEAD=ahead, PFD=pfd, num_warps=8, **pin)
    xs = (x[rows.long() // 2] if listed else x[:N]).double()
    scale = torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps) if norm else 1.0
    want = (xs @ w1[r0:].double().T) * scale
    if two:
        want = torch.nn.functional.silu(want) * ((xs @ w2[r0:].double().T) * scale)
    if res:
        want = want + r[rows.long(), r0:].double()
    out = A.cpu()[x.numel():x.numel() + 8 * R].view(8, R)
    return out, rows, want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tb,depth,rowvec,ahead", [(1, 1, 0, 0), (1, 1, 1, 0), (1, 1, 1, 1), (1, 2, 1, 1), (2, 2, 0, 0),
                                                   (4, 1, 0, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K,R,r0,N,KC,BR,two,listed,res,norm", SHAPES)
def test_weight_stream_irregular_shapes(device, tb, depth, rowvec, ahead, dtype, K, R, r0, N, KC, BR, two, listed, res,
                                        norm):
    """bf16 weights as 32-bit words of two columns (what the GPU runs), fp32 weights plainly; K not a
    multiple of KC, rows not a multiple of BR, a block that starts inside the matrix, one step and an
    odd number of steps, several tokens (in groups of TB per weight chunk, the last one partial), one
    or two chunks in flight (DEPTH), one token's rows stored as a vector (ROWVEC), its out row looked up a
    step ahead (AHEAD), gate|up, rows from a list, a residual, x's RMSNorm (a scale per token, per group); whole chunks
    read past the matrix's end into the arena's slack, and no read outside [weights, slack] reaches an output."""
    out, rows, want = _run(device, tb, dtype, K, R, r0, N, KC, BR, two, listed, res, norm, depth, rowvec=rowvec,
                           ahead=ahead)
    got = out[rows.long(), r0:]
    assert not got.isnan().any() and rel_err(got, want) <= 1e-5, rel_err(got, want)
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[rows.long()] = False
    assert out[untouched].isnan().all() and out[:, :r0].isnan().all()  # no other row or column written


# one-token shapes for the pinned streams: K <= KC (stream_pinned: plain, residual, odd steps, gate|up with a norm,
# an expert's listed row), K > KC (stream_pinned_k: 2, 5 and 15 row blocks, a residual, a norm)
PIN_SHAPES = [(64, 16, 0, 1, 64, 8, False, False, False, False), (64, 8, 0, 1, 64, 8, False, False, True, False),
              (40, 24, 0, 1, 64, 8, False, False, False, False), (96, 21, 3, 1, 64, 8, True, False, False, True),
              (1408, 40, 0, 1, 2048, 8, True, True, False, False), (8192, 24, 8, 1, 2048, 8, False, False, True, True),
              (200, 40, 2, 1, 64, 8, False, False, True, False), (200, 120, 0, 1, 64, 8, False, False, False, False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", PIN_SHAPES)
def test_pinned_streams_sum_what_the_stream_sums(device, shape):
    """Launch variant PIN's streams (linear.stream_pinned, stream_pinned_k) against stream_chunks on one-token
    slices, bit for bit, and nothing else written: under the interpreter without their barriers (PINNED 0: inline
    PTX), on the GPU with them.  ROWVEC 1 (ROWVEC 2's stores are inline PTX too)."""
    want, rows, _ = _run(device, 1, torch.bfloat16, *shape, rowvec=1)
    got, _, _ = _run(device, 1, torch.bfloat16, *shape, rowvec=1, pinned=int(device == "cuda"))
    assert torch.equal(want.nan_to_num(), got.nan_to_num()) and torch.equal(want.isnan(), got.isnan()), shape


# one-token shapes FLAT streams (KC/2 < K < KC, K a multiple of 128): one row, fewer rows than warps, a row a
# warp, parts of 2-3 rows that start inside the matrix, dsv2-lite's routed down tile (96 rows of 1408: 12 a warp,
# 9 steps), an expert's listed row; and two it leaves to stream_chunks (K = 320, a residual)
FLAT_SHAPES = [(384, 1, 0, 1, 512, 8, False, False, False, False), (384, 5, 0, 1, 512, 8, False, False, False, False),
               (384, 8, 0, 1, 512, 8, False, False, False, False), (384, 21, 3, 1, 512, 8, False, True, False, False),
               (384, 19, 2, 1, 512, 8, False, False, False, False),
               (1408, 96, 0, 1, 2048, 8, False, False, False, False), (1408, 40, 5, 1, 2048, 8, False, True, False, False),
               (320, 12, 0, 1, 512, 8, False, False, False, False), (384, 16, 0, 1, 512, 8, False, False, True, False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", FLAT_SHAPES)
def test_flat_stream_sums_what_the_stream_sums(device, shape):
    """Launch variant PIN=2's stream (linear_flat.stream_flat) on one-token slices: stream_chunks' rows, and nothing
    else written; under the interpreter bit for bit (each row's spans folded in the same order), pinned on the GPU
    within rounding (the two loops compile to other fused multiply-adds there: docs/PERF.md session 49)."""
    want, rows, _ = _run(device, 1, torch.bfloat16, *shape, rowvec=1)
    got, _, _ = _run(device, 1, torch.bfloat16, *shape, rowvec=1, pinned=int(device == "cuda"), flat=True)
    assert torch.equal(want.isnan(), got.isnan()), shape  # the same rows written
    if device == "cuda":
        assert rel_err(got[rows.long(), shape[2]:], want[rows.long(), shape[2]:]) <= 1e-5, shape
    else:
        assert torch.equal(want.nan_to_num(), got.nan_to_num()), shape


@pytest.mark.gpu
def test_weight_stream_stores_one_token_in_place():
    """ROWVEC 2 (inline PTX, GPU only), with and without AHEAD: every shape's rows stored from the sums'
    own layout are the ROWVEC 0 rows, bit for bit, and nothing else is written."""
    for shape in SHAPES:
        out0, rows, _ = _run("cuda", 1, torch.bfloat16, *shape)
        for ahead in (0, 1):
            out2, _, _ = _run("cuda", 1, torch.bfloat16, *shape, rowvec=2, ahead=ahead)
            assert torch.equal(out0.nan_to_num(), out2.nan_to_num()) and torch.equal(out0.isnan(), out2.isnan()), shape


@pytest.mark.gpu
def test_weight_stream_prefetch_ahead_changes_nothing():
    """PFD (inline PTX, GPU only): asking the L2 for the row blocks 1 or 3 ahead, alone and beside a second
    chunk in registers (DEPTH 2), or the L1 for the chunk 1 or 2 steps after the next (PFD < 0; also in the
    pinned streams, PIN's), moves no sum: every shape's rows equal the stream's without it, bit for bit, and
    nothing else is written.  (A prefetch writes nothing, so this cannot see one past the slice's last row;
    linear.prefetch_block stops there by construction, chunk_lines_l1 clamps its rows as weight_rows does.)"""
    for shape in SHAPES:
        for tb, rowvec in ((1, 2), (2, 0)):
            base, _, _ = _run("cuda", tb, torch.bfloat16, *shape, rowvec=rowvec, ahead=1)
            for depth, pfd in ((1, 1), (1, 3), (2, 2), (1, -1), (1, -2)):
                got, _, _ = _run("cuda", tb, torch.bfloat16, *shape, depth, rowvec=rowvec, ahead=1, pfd=pfd)
                assert torch.equal(base.nan_to_num(), got.nan_to_num()) and torch.equal(base.isnan(), got.isnan()), \
                    (shape, tb, depth, pfd)
        base, _, _ = _run("cuda", 1, torch.bfloat16, *shape, rowvec=2, ahead=1, pinned=1)
        for pfd in (-1, -2):
            got, _, _ = _run("cuda", 1, torch.bfloat16, *shape, rowvec=2, ahead=1, pfd=pfd, pinned=1)
            assert torch.equal(base.nan_to_num(), got.nan_to_num()) and torch.equal(base.isnan(), got.isnan()), \
                (shape, "pinned", pfd)


@pytest.mark.parametrize("device", DEVICES)
def test_weight_stream_without_rows_writes_nothing(device):
    """An expert slot's row count can be zero at run time: no step runs, nothing is written."""
    out, _, _ = _run(device, 1, torch.bfloat16, 64, 16, 0, 0, 64, 8, True, True, False, True)
    assert out.isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_weight_stream_token_groups_are_invisible(device):
    """A token's sums are bit-identical whether its weight chunk is shared with 0, 1 or 3 others
    (TB = 1, 2, 4), and whether a lone token's rows are stored as a vector (ROWVEC, AHEAD): the same products,
    summed in the same order, and the same norm scale (batch invariance)."""
    shape = (1408, 40, 0, 3, 2048, 8, True, True, True, True)
    outs = [_run(device, tb, torch.bfloat16, *shape)[0] for tb in (1, 2, 4)]
    outs.append(_run(device, 1, torch.bfloat16, *shape, rowvec=1)[0])
    outs.append(_run(device, 1, torch.bfloat16, *shape, rowvec=1, ahead=1)[0])
    assert all(torch.equal(o.nan_to_num(), outs[0].nan_to_num()) for o in outs[1:])
