"""ARGMAX of logit rows: per-block (max, first index) partials, then the first index of the overall max."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import fld, has, off
from .fields import (ARGMAX_C0, ARGMAX_C1, ARGMAX_FLAGS, ARGMAX_LG_LD, ARGMAX_LG_OFF, ARGMAX_N, ARGMAX_NPARTS,
                     ARGMAX_OUT_LD, ARGMAX_OUT_OFF, ARGMAX_PART, ARGMAX_PI_OFF, ARGMAX_PV_OFF, FLAG_ARGMAX_FINAL, FLAG_ARGMAX_PARTIAL)


def reference(task, mem) -> None:
    N, nparts, part = task["N"], task["nparts"], task["part"]
    if task.has("PARTIAL"):
        c0, c1 = task["c0"], task["c1"]
        vals = mem.mat(task, "lg", N, c1 - c0, col0=c0).float()
        idx = vals.argmax(dim=-1)  # first maximal index on ties
        best = vals.gather(1, idx[:, None])[:, 0]
        idx = idx + c0
        if task.has("FINAL"):
            mem.mat(task, "out", N, 1)[:, 0].copy_(idx.int())
            return
        mem.mat(task, "pv", N, 1, col0=part, ld=nparts).copy_(best[:, None])
        mem.mat(task, "pi", N, 1, col0=part, ld=nparts).copy_(idx[:, None].int())
        return
    pv = mem.mat(task, "pv", N, nparts, ld=nparts).float()
    pi = mem.mat(task, "pi", N, nparts, ld=nparts)
    best = pv.argmax(dim=-1)  # earliest part wins ties, and parts are in column order
    mem.mat(task, "out", N, 1)[:, 0].copy_(pi.gather(1, best[:, None])[:, 0])


# ---- GPU body ----------------------------------------------------------------------------
@triton.jit
def body(word, A, I, BD: tl.constexpr):
    flags, N, nparts, part = fld(word, ARGMAX_FLAGS), fld(word, ARGMAX_N), fld(word, ARGMAX_NPARTS), fld(word, ARGMAX_PART)
    pv, pi, out = A + off(word, ARGMAX_PV_OFF), I + off(word, ARGMAX_PI_OFF), I + off(word, ARGMAX_OUT_OFF)
    lg, lg_ld = A + off(word, ARGMAX_LG_OFF), fld(word, ARGMAX_LG_LD)
    partial = has(flags, FLAG_ARGMAX_PARTIAL)
    final = has(flags, FLAG_ARGMAX_FINAL)
    c0 = tl.where(partial, fld(word, ARGMAX_C0), 0)
    c1 = tl.where(partial, fld(word, ARGMAX_C1), nparts)
    for n in range(N):
        best = float("-inf")
        best_i = 0
        for cb in range(c0, c1, BD):
            c = cb + tl.arange(0, BD)
            m = c < c1
            if partial:
                v = tl.load(lg + n * lg_ld + c, mask=m, other=float("-inf"), cache_modifier=".cg")
            else:
                v = tl.load(pv + n * nparts + c, mask=m, other=float("-inf"), cache_modifier=".cg")
            top = tl.max(v, axis=0)
            where = tl.argmax(v, axis=0, tie_break_left=True)
            if partial:
                idx = cb + where
            else:
                idx = tl.load(pi + n * nparts + cb + where, cache_modifier=".cg")
            better = top > best  # strictly: the earlier block keeps ties
            best_i = tl.where(better, idx, best_i)
            best = tl.where(better, top, best)
        if final:
            tl.store(out + n * fld(word, ARGMAX_OUT_LD), best_i)
        else:
            tl.store(pv + n * nparts + part, best)
            tl.store(pi + n * nparts + part, best_i)
