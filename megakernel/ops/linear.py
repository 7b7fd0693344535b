"""LINEAR: a block of output columns of x @ W.T, with a fused SiLU·mul (gate/up) or residual epilogue."""

from __future__ import annotations

import torch.nn.functional as F


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


# ---- GPU body -----------------------------------------------------------------------------
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .common import fld, has, off, silu  # noqa: E402
from .fields import (FLAG_LINEAR_RES, FLAG_LINEAR_SILU_MUL, LINEAR_FLAGS, LINEAR_K, LINEAR_N, LINEAR_OUT_LD,  # noqa: E402
                     LINEAR_OUT_OFF, LINEAR_R0, LINEAR_R1, LINEAR_RES_LD, LINEAR_RES_OFF, LINEAR_W2_OFF, LINEAR_W_OFF,
                     LINEAR_X_LD, LINEAR_X_OFF)


@triton.jit
def dot_rows(acc, x_ptr, x_ld, toks, nmask, w_ptr, rows, rmask, K, BK: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc[BN, BR] += x[toks, :K] @ w[rows, :K].T, K in chunks of BK (fixed order: batch invariant)."""
    for kb in range(0, K, BK):
        ks = kb + tl.arange(0, BK)
        kmask = ks < K
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(x_ptr + toks[:, None].to(tl.int64) * x_ld + ks[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0, cache_modifier=".cg")
        acc = tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def body(word, W, A, BN: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr):
    flags = fld(word, LINEAR_FLAGS)
    N, K = fld(word, LINEAR_N), fld(word, LINEAR_K)
    r0, r1 = fld(word, LINEAR_R0), fld(word, LINEAR_R1)
    x_ptr, x_ld = A + off(word, LINEAR_X_OFF), fld(word, LINEAR_X_LD)
    w_ptr, w2_ptr = W + off(word, LINEAR_W_OFF), W + off(word, LINEAR_W2_OFF)
    out_ptr, out_ld = A + off(word, LINEAR_OUT_OFF), fld(word, LINEAR_OUT_LD)
    res_ptr, res_ld = A + off(word, LINEAR_RES_OFF), fld(word, LINEAR_RES_LD)
    for rb in range(r0, r1, BR):
        rows = rb + tl.arange(0, BR)
        rmask = rows < r1
        for nb in range(0, N, BN):
            toks = nb + tl.arange(0, BN)
            nmask = toks < N
            acc = dot_rows(tl.zeros((BN, BR), tl.float32), x_ptr, x_ld, toks, nmask, w_ptr, rows, rmask, K, BK, DOT_PREC)
            if has(flags, FLAG_LINEAR_SILU_MUL):
                up = dot_rows(tl.zeros((BN, BR), tl.float32), x_ptr, x_ld, toks, nmask, w2_ptr, rows, rmask, K, BK,
                              DOT_PREC)
                acc = silu(acc) * up
            mask = nmask[:, None] & rmask[None, :]
            if has(flags, FLAG_LINEAR_RES):
                acc += tl.load(res_ptr + toks[:, None] * res_ld + rows[None, :], mask=mask, other=0.0,
                               cache_modifier=".cg")
            tl.store(out_ptr + toks[:, None] * out_ld + rows[None, :], acc, mask=mask)
