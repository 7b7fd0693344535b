"""LINEAR: a block of output columns of x @ W.T, with a fused SiLU·mul (gate/up) or residual epilogue."""

from __future__ import annotations

import torch.nn.functional as F
import triton
import triton.language as tl

from .common import aligned, fld, has, off, silu
from .fields import (FLAG_LINEAR_RES, FLAG_LINEAR_SILU_MUL, LINEAR_FLAGS, LINEAR_K, LINEAR_N, LINEAR_OUT_LD,
                     LINEAR_OUT_OFF, LINEAR_R0, LINEAR_R1, LINEAR_RES_LD, LINEAR_RES_OFF, LINEAR_W2_OFF, LINEAR_W_OFF,
                     LINEAR_X_LD, LINEAR_X_OFF)


def reference(task, mem) -> None:
    N, K, r0, r1 = task["N"], task["K"], task["r0"], task["r1"]
    x = mem.mat(task, "x", N, K).float()
    w = mem.mat(task, "w", r1 - r0, K, row0=r0, ld=K).float()
    y = x @ w.T
    if task.has("SILU_MUL"):
        y = F.silu(y) * (x @ mem.mat(task, "w2", r1 - r0, K, row0=r0, ld=K).float().T)
    if task.has("RES"):
        y = y + mem.mat(task, "res", N, r1 - r0, col0=r0).float()
    mem.mat(task, "out", N, r1 - r0, col0=r0).copy_(y)


# ---- GPU body ----------------------------------------------------------------------------
@triton.jit
def weight_rows(w_ptr, rows, rmask, K, kb, on, KC: tl.constexpr, ALIGN: tl.constexpr):
    """[BR, KC] of weights: rows `rows`, columns kb..kb+KC (nothing is read where `on` is false).
    K and the base are multiples of ALIGN (checked on the host), so rows load as 16-byte vectors."""
    K = aligned(K, ALIGN)
    ks = tl.max_contiguous(tl.multiple_of(kb + tl.arange(0, KC), ALIGN), KC)
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
                   mask=rmask[:, None] & (ks[None, :] < K) & on, other=0.0)


@triton.jit
def step_x(i, total, x_ptr, x_ld, xrows_ptr, xrows_div, n_rows, nsub, nk, K, KC: tl.constexpr, ALIGN: tl.constexpr):
    """Step i's activation chunk and output row (stream_chunks' step order; nothing read when i == total)."""
    on = i < total
    n = (i // (nsub * nk)) % n_rows
    xrow = n
    orow = n
    if xrows_div > 0:
        pair = tl.load(xrows_ptr + n, mask=on, other=0, cache_modifier=".cg")
        xrow = pair // xrows_div
        orow = pair
    ks = tl.max_contiguous(tl.multiple_of(((i // nsub) % nk) * KC + tl.arange(0, KC), ALIGN), KC)
    x = tl.load(x_ptr + xrow.to(tl.int64) * aligned(x_ld, ALIGN) + ks, mask=(ks < K) & on, other=0.0,
                cache_modifier=".cg")
    return x, orow


@triton.jit
def stream_chunks(x_ptr, x_ld, xrows_ptr, xrows_div, n_rows, out_ptr, out_ld, res_ptr, res_ld, use_res,
                  w_ptr, w2_ptr, two, r0, r1, K, w, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr):
    """out[orow(n), r0:r1] = f(x[xrow(n)] @ W[r0:r1].T) for n < n_rows, f = identity, + residual, or
    SiLU(x@W.T) * (x@W2.T).  Rows come from a list (xrows_div > 0: row = list[n] // xrows_div, out row
    = list[n]) or are n itself.  One token at a time on CUDA cores, fp32 products and sums, K in
    chunks of KC in a fixed order: a token's result never depends on its neighbours (batch
    invariance).  Every (row block, token, K chunk, gate|up) chunk is one step of a flat loop that
    requests the next step's weights, activations and residual before reducing its own, so load
    latency hides behind the arithmetic (waiting for each chunk cost 2x on the GPU: docs/PERF.md).
    w: step 0's weight chunk, already requested (before the dependency wait)."""
    nsub = 1 + two.to(tl.int32)
    nk = tl.cdiv(K, KC)
    per_block = nsub * nk * n_rows
    total = tl.cdiv(r1 - r0, BR) * per_block
    x, orow = step_x(0, total, x_ptr, x_ld, xrows_ptr, xrows_div, n_rows, nsub, nk, K, KC, ALIGN)
    rows0 = r0 + tl.arange(0, BR)
    res = tl.load(res_ptr + orow * res_ld + rows0, mask=(rows0 < r1) & use_res, other=0.0, cache_modifier=".cg")
    acc = tl.zeros((BR,), tl.float32)
    acc2 = tl.zeros((BR,), tl.float32)
    for i in range(total):
        j = i + 1  # request the next step's chunks now
        rows_j = r0 + (j // per_block) * BR + tl.arange(0, BR)
        w_next = weight_rows(tl.where((j % nsub) == 1, w2_ptr, w_ptr), rows_j, rows_j < r1, K, ((j // nsub) % nk) * KC,
                             j < total, KC, ALIGN)
        x_next, orow_next = step_x(j, total, x_ptr, x_ld, xrows_ptr, xrows_div, n_rows, nsub, nk, K, KC, ALIGN)
        res_next = tl.load(res_ptr + orow_next * res_ld + rows_j, mask=(rows_j < r1) & use_res & (j < total),
                           other=0.0, cache_modifier=".cg")  # the residual, if any, is ready too
        part = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        sub, kc = i % nsub, (i // nsub) % nk
        if sub == 0:
            acc += part
        else:
            acc2 += part
        if (kc == nk - 1) & (sub == nsub - 1):  # this token's rows are complete
            rows = r0 + (i // per_block) * BR + tl.arange(0, BR)
            rmask = rows < r1
            y = acc
            if two:
                y = silu(acc) * acc2
            tl.store(out_ptr + orow.to(tl.int64) * out_ld + rows, y + res, mask=rmask)
            acc = tl.zeros((BR,), tl.float32)
            acc2 = tl.zeros((BR,), tl.float32)
        w, x, orow, res = w_next, x_next, orow_next, res_next


@triton.jit
def first_chunk(w_ptr, r0, r1, K, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr):
    """The first weight chunk stream_chunks expects, requested early (weights never depend on activations)."""
    rows = r0 + tl.arange(0, BR)
    return weight_rows(w_ptr, rows, rows < r1, K, 0, True, KC, ALIGN)


@triton.jit
def aligned_base(base, word, IDX: tl.constexpr, ALIGN: tl.constexpr):
    return base + aligned(off(word, IDX), ALIGN)


@triton.jit
def prefetch(word, W, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr):
    """A LINEAR task's first weight chunk, requested before its dependency wait."""
    return first_chunk(aligned_base(W, word, LINEAR_W_OFF, ALIGN), fld(word, LINEAR_R0), fld(word, LINEAR_R1),
                       fld(word, LINEAR_K), BR, KC, ALIGN)


@triton.jit
def body(word, W, A, w, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr):
    flags = fld(word, LINEAR_FLAGS)
    stream_chunks(aligned_base(A, word, LINEAR_X_OFF, ALIGN), fld(word, LINEAR_X_LD), A, 0, fld(word, LINEAR_N),
                  A + off(word, LINEAR_OUT_OFF), fld(word, LINEAR_OUT_LD), A + off(word, LINEAR_RES_OFF),
                  fld(word, LINEAR_RES_LD), has(flags, FLAG_LINEAR_RES), aligned_base(W, word, LINEAR_W_OFF, ALIGN),
                  aligned_base(W, word, LINEAR_W2_OFF, ALIGN), has(flags, FLAG_LINEAR_SILU_MUL), fld(word, LINEAR_R0),
                  fld(word, LINEAR_R1), fld(word, LINEAR_K), w, BR, KC, ALIGN)
