"""RMSNORM: y = v · rsqrt(mean(v²) + eps) · w, optionally of v = x + d (the residual add, stored back), and
with CACHE written into the cache (MLA's normalized latent: a CACHE_WRITE fused in) instead of out."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import rope
from .common import ffld, fld, has, off
from .fields import (FLAG_RMSNORM_ADD, FLAG_RMSNORM_CACHE, FLAG_RMSNORM_NOWEIGHT, RMSNORM_CACHE_OFF, RMSNORM_CL_OFF,
                     RMSNORM_COL0, RMSNORM_D, RMSNORM_D_LD, RMSNORM_D_OFF, RMSNORM_EPS, RMSNORM_FLAGS, RMSNORM_OUT_LD,
                     RMSNORM_OUT_OFF, RMSNORM_POS_OFFSET, RMSNORM_R0, RMSNORM_R1, RMSNORM_S, RMSNORM_T, RMSNORM_W_OFF,
                     RMSNORM_WIDTH, RMSNORM_X_LD, RMSNORM_X_OFF, RMSNORM_XO_BUF, RMSNORM_XO_LD, RMSNORM_XO_OFF)


def reference(task, mem) -> None:
    r0, r1, D = task["r0"], task["r1"], task["D"]
    v = mem.mat(task, "x", r1 - r0, D, row0=r0).float()
    if task.has("ADD"):
        v = v + mem.mat(task, "d", r1 - r0, D, row0=r0).float()
        if mem.present(task, "xo"):
            mem.mat(task, "xo", r1 - r0, D, row0=r0).copy_(v)
    y = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + task["eps"])
    if not task.has("NOWEIGHT"):
        y = y * mem.flat(task, "w", 0, D).float()
    if task.has("CACHE"):  # the fp32 rows rounded to the cache dtype once, as CACHE_WRITE rounds them
        rope.write_cache(task, mem, y)
    else:
        mem.mat(task, "out", r1 - r0, D, row0=r0).copy_(y)


# ---- GPU body ----------------------------------------------------------------------------
@triton.jit
def _row_chunk(x_row, d_row, add, c, D):
    """Columns c of v = x (+ d): recomputed in the second pass rather than kept, rows can be long."""
    v = tl.load(x_row + c, mask=c < D, other=0.0, cache_modifier=".cg")
    if add:
        v += tl.load(d_row + c, mask=c < D, other=0.0, cache_modifier=".cg")
    return v


@triton.jit
def body(word, W, A, I, C, BN: tl.constexpr):
    """Rows of up to BN columns stay in registers: x, d and the weights are requested together, one
    memory round trip per row (chunk by chunk, a 2048-wide row took 16 dependent ones: 7 µs).
    Longer rows take two passes over BN-wide chunks.  CACHE: each row goes to its cache position
    (rope.cache_row), rounded to the cache dtype, instead of out."""
    flags, D, eps = fld(word, RMSNORM_FLAGS), fld(word, RMSNORM_D), ffld(word, RMSNORM_EPS)
    x_ptr, x_ld = A + off(word, RMSNORM_X_OFF), fld(word, RMSNORM_X_LD)
    d_ptr, d_ld = A + off(word, RMSNORM_D_OFF), fld(word, RMSNORM_D_LD)
    xo_ptr, xo_ld = A + off(word, RMSNORM_XO_OFF), fld(word, RMSNORM_XO_LD)
    add = has(flags, FLAG_RMSNORM_ADD)
    store_sum = add & (fld(word, RMSNORM_XO_BUF) >= 0)
    weighted = has(flags, FLAG_RMSNORM_NOWEIGHT) == 0
    to_cache = has(flags, FLAG_RMSNORM_CACHE)
    w_ptr = W + off(word, RMSNORM_W_OFF)
    o_ptr, o_ld = A + off(word, RMSNORM_OUT_OFF), fld(word, RMSNORM_OUT_LD)
    for r in range(fld(word, RMSNORM_R0), fld(word, RMSNORM_R1)):
        if to_cache:  # the cache fields read here, not kept through the loop
            c_row, row_in = rope.cache_row(I + off(word, RMSNORM_CL_OFF), C + off(word, RMSNORM_CACHE_OFF), r,
                                           fld(word, RMSNORM_T), fld(word, RMSNORM_S), fld(word, RMSNORM_WIDTH),
                                           fld(word, RMSNORM_COL0), fld(word, RMSNORM_POS_OFFSET))
        else:
            c_row, row_in = C, r >= 0
        if D <= BN:
            c = tl.arange(0, BN)
            v = _row_chunk(x_ptr + r * x_ld, d_ptr + r * d_ld, add, c, D)
            w = tl.load(w_ptr + c, mask=(c < D) & weighted, other=1.0).to(tl.float32)
            if store_sum:
                tl.store(xo_ptr + r * xo_ld + c, v, mask=c < D)
            inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
            if to_cache:
                tl.store(c_row + c, (v * inv * w).to(C.dtype.element_ty), mask=(c < D) & row_in)
            else:
                tl.store(o_ptr + r * o_ld + c, v * inv * w, mask=c < D)
        else:
            sq = tl.zeros((BN,), tl.float32)
            for cb in range(0, D, BN):  # pass 1: the sum of squares (and the residual sum, stored once)
                c = cb + tl.arange(0, BN)
                v = _row_chunk(x_ptr + r * x_ld, d_ptr + r * d_ld, add, c, D)
                if store_sum:
                    tl.store(xo_ptr + r * xo_ld + c, v, mask=c < D)
                sq += v * v
            inv = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / D + eps)
            for cb in range(0, D, BN):  # pass 2: normalise and scale
                c = cb + tl.arange(0, BN)
                y = _row_chunk(x_ptr + r * x_ld, d_ptr + r * d_ld, add, c, D) * inv
                w = tl.load(w_ptr + c, mask=(c < D) & weighted, other=1.0).to(tl.float32)
                if to_cache:
                    tl.store(c_row + c, (y * w).to(C.dtype.element_ty), mask=(c < D) & row_in)
                else:
                    tl.store(o_ptr + r * o_ld + c, y * w, mask=c < D)
