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
def weight_rows(w_ptr, row0, r1, K, kb, on, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr,
                FULL: tl.constexpr):
    """[BR, KC] of weights: rows row0.. (< r1), columns kb..kb+KC (nothing is read where `on` is false).
    K and the base are multiples of ALIGN (checked on the host), so rows load as 16-byte vectors.
    FULL (a launch variant): a chunk wholly inside the matrix loads without masks, through 32-bit
    offsets from its row block's base (offline SASS: the masked form spends ~330 instructions per
    chunk on 64-bit addresses and zero-fills)."""
    K = aligned(K, ALIGN)
    full = False  # FULL 0 compiles the masked load alone, with no branch
    if FULL:
        full = (row0 + BR <= r1) & (kb + KC <= K) & on
    if full:
        cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, KC), ALIGN), KC)
        w = tl.load(w_ptr + (row0.to(tl.int64) * K + kb) + (tl.arange(0, BR)[:, None] * K + cols[None, :]))
    else:
        ks = tl.max_contiguous(tl.multiple_of(kb + tl.arange(0, KC), ALIGN), KC)
        rows = row0 + tl.arange(0, BR)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
                    mask=(rows < r1)[:, None] & (ks[None, :] < K) & on, other=0.0)
    return w


@triton.jit
def step_row(j, total, xrows_ptr, xrows_div, n_rows, nsub, nk):
    """Step j's row: its entry in the row list (xrows_div > 0), else the token index itself.  Loaded
    an iteration before the activations it addresses, so no load waits on another inside the loop
    (that chain cost the expert tasks a memory round trip per chunk: docs/PERF.md)."""
    n = (j // (nsub * nk)) % n_rows
    if xrows_div > 0:
        n = tl.load(xrows_ptr + n, mask=j < total, other=0, cache_modifier=".cg")
    return n


@triton.jit
def step_act(j, row, total, x_ptr, x_ld, xrows_div, res_ptr, res_ld, use_res, nsub, nk, per_block, r0, r1, K,
             BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr):
    """Step j's activation chunk, output row and residual (row: step_row(j); nothing read when j >= total)."""
    on = j < total
    rows = r0 + (j // per_block) * BR + tl.arange(0, BR)
    xrow = row
    if xrows_div > 0:
        xrow = row // xrows_div
    ks = tl.max_contiguous(tl.multiple_of(((j // nsub) % nk) * KC + tl.arange(0, KC), ALIGN), KC)
    x = tl.load(x_ptr + xrow.to(tl.int64) * aligned(x_ld, ALIGN) + ks, mask=(ks < K) & on, other=0.0,
                cache_modifier=".cg")
    res = tl.load(res_ptr + row * res_ld + rows, mask=(rows < r1) & use_res & on, other=0.0, cache_modifier=".cg")
    return x, row, res


@triton.jit
def step_loads(j, row, total, x_ptr, x_ld, xrows_div, res_ptr, res_ld, use_res, w_ptr, w2_ptr, nsub, nk, per_block,
               r0, r1, K, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, FULL: tl.constexpr):
    """Step j's weight chunk, then step_act's loads."""
    w = weight_rows(tl.where((j % nsub) == 1, w2_ptr, w_ptr), r0 + (j // per_block) * BR, r1, K,
                    ((j // nsub) % nk) * KC, j < total, BR, KC, ALIGN, FULL)
    x, orow, res = step_act(j, row, total, x_ptr, x_ld, xrows_div, res_ptr, res_ld, use_res, nsub, nk, per_block, r0,
                            r1, K, BR, KC, ALIGN)
    return w, x, orow, res


@triton.jit
def stream_chunks(x_ptr, x_ld, xrows_ptr, xrows_div, n_rows, out_ptr, out_ld, res_ptr, res_ld, use_res,
                  w_ptr, w2_ptr, two, r0, r1, K, w, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr,
                  DEPTH: tl.constexpr, FULL: tl.constexpr):
    """out[orow(n), r0:r1] = f(x[xrow(n)] @ W[r0:r1].T) for n < n_rows, f = identity, + residual, or
    SiLU(x@W.T) * (x@W2.T).  Rows come from a list (xrows_div > 0: row = list[n] // xrows_div, out row
    = list[n]) or are n itself.  One token at a time on CUDA cores, fp32 products and sums, K in
    chunks of KC in a fixed order: a token's result never depends on its neighbours (batch
    invariance).  Every (row block, token, K chunk, gate|up) chunk is one step of a flat loop that
    requests step i+DEPTH's weights, activations and residual before reducing step i's, so load
    latency hides behind the arithmetic (waiting for each chunk cost 2x on the GPU: docs/PERF.md).
    DEPTH 2 keeps two chunks in flight (more registers).  w: step 0's weight chunk, already
    requested (before the dependency wait)."""
    nsub = 1 + two.to(tl.int32)
    nk = tl.cdiv(K, KC)
    per_block = nsub * nk * n_rows
    total = tl.cdiv(r1 - r0, BR) * per_block
    row0 = step_row(0, total, xrows_ptr, xrows_div, n_rows, nsub, nk)
    ahead = step_row(DEPTH, total, xrows_ptr, xrows_div, n_rows, nsub, nk)  # the first step the loop requests
    if DEPTH == 2:
        row1 = step_row(1, total, xrows_ptr, xrows_div, n_rows, nsub, nk)
    x, orow, res = step_act(0, row0, total, x_ptr, x_ld, xrows_div, res_ptr, res_ld, use_res, nsub, nk, per_block, r0,
                            r1, K, BR, KC, ALIGN)
    if DEPTH == 2:
        w1, x1, orow1, res1 = step_loads(1, row1, total, x_ptr, x_ld, xrows_div, res_ptr, res_ld, use_res, w_ptr,
                                         w2_ptr, nsub, nk, per_block, r0, r1, K, BR, KC, ALIGN, FULL)
    acc = tl.zeros((BR,), tl.float32)
    acc2 = tl.zeros((BR,), tl.float32)
    for i in range(total):
        row_next = step_row(i + DEPTH + 1, total, xrows_ptr, xrows_div, n_rows, nsub, nk)  # used next iteration
        w_j, x_j, orow_j, res_j = step_loads(i + DEPTH, ahead, total, x_ptr, x_ld, xrows_div, res_ptr, res_ld,
                                             use_res, w_ptr, w2_ptr, nsub, nk, per_block, r0, r1, K, BR, KC, ALIGN, FULL)
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
        ahead = row_next
        if DEPTH == 2:
            w, x, orow, res = w1, x1, orow1, res1
            w1, x1, orow1, res1 = w_j, x_j, orow_j, res_j
        else:
            w, x, orow, res = w_j, x_j, orow_j, res_j


@triton.jit
def first_chunk(w_ptr, r0, r1, K, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, FULL: tl.constexpr):
    """The first weight chunk stream_chunks expects, requested early (weights never depend on activations)."""
    return weight_rows(w_ptr, r0, r1, K, 0, True, BR, KC, ALIGN, FULL)


@triton.jit
def aligned_base(base, word, IDX: tl.constexpr, ALIGN: tl.constexpr):
    return base + aligned(off(word, IDX), ALIGN)


@triton.jit
def prefetch(word, W, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, FULL: tl.constexpr):
    """A LINEAR task's first weight chunk, requested before its dependency wait."""
    return first_chunk(aligned_base(W, word, LINEAR_W_OFF, ALIGN), fld(word, LINEAR_R0), fld(word, LINEAR_R1),
                       fld(word, LINEAR_K), BR, KC, ALIGN, FULL)


@triton.jit
def body(word, W, A, w, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, DEPTH: tl.constexpr,
         FULL: tl.constexpr):
    flags = fld(word, LINEAR_FLAGS)
    stream_chunks(aligned_base(A, word, LINEAR_X_OFF, ALIGN), fld(word, LINEAR_X_LD), A, 0, fld(word, LINEAR_N),
                  A + off(word, LINEAR_OUT_OFF), fld(word, LINEAR_OUT_LD), A + off(word, LINEAR_RES_OFF),
                  fld(word, LINEAR_RES_LD), has(flags, FLAG_LINEAR_RES), aligned_base(W, word, LINEAR_W_OFF, ALIGN),
                  aligned_base(W, word, LINEAR_W2_OFF, ALIGN), has(flags, FLAG_LINEAR_SILU_MUL), fld(word, LINEAR_R0),
                  fld(word, LINEAR_R1), fld(word, LINEAR_K), w, BR, KC, ALIGN, DEPTH, FULL)
