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
def gemv_rows(x_ptr, x_ld, xrow, w_ptr, w2_ptr, two, rows, rmask, K, w, w2, KC: tl.constexpr, ALIGN: tl.constexpr):
    """One token: x[xrow] @ W[rows].T on CUDA cores, fp32 products and sums, K in chunks of KC in a
    fixed order (the result never depends on other tokens: batch invariant).  w, w2: chunk 0,
    already requested.  A chunk is a whole-row tile (e.g. 16 x 2048 bf16 = 64 KB): few, large loads."""
    acc = tl.zeros((rows.shape[0],), tl.float32)
    acc2 = tl.zeros((rows.shape[0],), tl.float32)
    for kb in range(0, K, KC):
        if kb > 0:
            w = weight_rows(w_ptr, rows, rmask, K, kb, True, KC, ALIGN)
            w2 = weight_rows(w2_ptr, rows, rmask, K, kb, two, KC, ALIGN)
        ks = tl.max_contiguous(tl.multiple_of(kb + tl.arange(0, KC), ALIGN), KC)
        x_row = xrow.to(tl.int64) * aligned(x_ld, ALIGN)
        x = tl.load(x_ptr + x_row + ks, mask=ks < K, other=0.0, cache_modifier=".cg")
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        acc2 += tl.sum(w2.to(tl.float32) * x[None, :], axis=1)
    if two:
        acc = silu(acc) * acc2
    return acc


@triton.jit
def stream_rows(x_ptr, x_ld, xrows_ptr, xrows_div, n_rows, out_ptr, out_ld, orows_ptr, res_ptr, res_ld, use_res,
                w_ptr, w2_ptr, two, r0, r1, K, w, w2, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr):
    """out[orow(n), r0:r1] = f(x[xrow(n)] @ W[r0:r1].T) for n < n_rows.  Rows come from a list
    (xrows_ptr != 0: row = list[n] // xrows_div, out row = list[n]) or are n itself.  w, w2: the
    first chunk of the first row block, already requested."""
    for rb in range(r0, r1, BR):
        rows = rb + tl.arange(0, BR)
        rmask = rows < r1
        for n in range(n_rows):
            if (rb > r0) | (n > 0):  # the first block's first chunk was requested early
                w = weight_rows(w_ptr, rows, rmask, K, 0, True, KC, ALIGN)
                w2 = weight_rows(w2_ptr, rows, rmask, K, 0, two, KC, ALIGN)
            xrow = n
            orow = n
            if xrows_div > 0:
                pair = tl.load(xrows_ptr + n, cache_modifier=".cg")
                xrow = pair // xrows_div
                orow = pair
            y = gemv_rows(x_ptr, x_ld, xrow, w_ptr, w2_ptr, two, rows, rmask, K, w, w2, KC, ALIGN)
            if use_res:
                y += tl.load(res_ptr + orow * res_ld + rows, mask=rmask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + orow.to(tl.int64) * out_ld + rows, y, mask=rmask)


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
    """stream_rows' result, the same sums in the same order, with the next chunk always in flight:
    every (row block, token, K chunk, gate|up) chunk is one step of a flat loop that requests the
    next step's weights and activations before reducing its own, so load latency hides behind the
    arithmetic.  w: step 0's weight chunk, already requested (before the dependency wait)."""
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
def stream(x_ptr, x_ld, xrows_ptr, xrows_div, n_rows, out_ptr, out_ld, res_ptr, res_ld, use_res,
           w_ptr, w2_ptr, two, r0, r1, K, w, w2, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr,
           PIPE: tl.constexpr):
    """The weight stream of LINEAR and EXPERT_LINEAR: PIPE 1 keeps a chunk in flight, PIPE 0 does not."""
    if PIPE:
        stream_chunks(x_ptr, x_ld, xrows_ptr, xrows_div, n_rows, out_ptr, out_ld, res_ptr, res_ld, use_res,
                      w_ptr, w2_ptr, two, r0, r1, K, w, BR, KC, ALIGN)
    else:
        stream_rows(x_ptr, x_ld, xrows_ptr, xrows_div, n_rows, out_ptr, out_ld, xrows_ptr, res_ptr, res_ld,
                    use_res, w_ptr, w2_ptr, two, r0, r1, K, w, w2, BR, KC, ALIGN)


@triton.jit
def first_chunk(w_ptr, w2_ptr, two, r0, r1, K, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr,
                PIPE: tl.constexpr):
    """The first weight chunk(s) `stream` expects, requested early (weights never depend on activations)."""
    rows = r0 + tl.arange(0, BR)
    w = weight_rows(w_ptr, rows, rows < r1, K, 0, True, KC, ALIGN)
    w2 = weight_rows(w2_ptr, rows, rows < r1, K, 0, two & (PIPE == 0), KC, ALIGN)
    return w, w2


@triton.jit
def aligned_base(base, word, IDX: tl.constexpr, ALIGN: tl.constexpr):
    return base + aligned(off(word, IDX), ALIGN)


@triton.jit
def prefetch(word, W, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, PIPE: tl.constexpr):
    """A LINEAR task's first weight chunk, requested before its dependency wait."""
    two = has(fld(word, LINEAR_FLAGS), FLAG_LINEAR_SILU_MUL)
    return first_chunk(aligned_base(W, word, LINEAR_W_OFF, ALIGN), aligned_base(W, word, LINEAR_W2_OFF, ALIGN), two,
                       fld(word, LINEAR_R0), fld(word, LINEAR_R1), fld(word, LINEAR_K), BR, KC, ALIGN, PIPE)


@triton.jit
def body(word, W, A, w, w2, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, PIPE: tl.constexpr):
    flags = fld(word, LINEAR_FLAGS)
    stream(aligned_base(A, word, LINEAR_X_OFF, ALIGN), fld(word, LINEAR_X_LD), A, 0, fld(word, LINEAR_N),
           A + off(word, LINEAR_OUT_OFF), fld(word, LINEAR_OUT_LD), A + off(word, LINEAR_RES_OFF),
           fld(word, LINEAR_RES_LD), has(flags, FLAG_LINEAR_RES), aligned_base(W, word, LINEAR_W_OFF, ALIGN),
           aligned_base(W, word, LINEAR_W2_OFF, ALIGN), has(flags, FLAG_LINEAR_SILU_MUL), fld(word, LINEAR_R0),
           fld(word, LINEAR_R1), fld(word, LINEAR_K), w, w2, BR, KC, ALIGN, PIPE)
