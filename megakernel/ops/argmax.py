"""ARGMAX of logit rows: per-block (max, first index) partials, then the first index of the overall max."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import fld, has, off
from .fields import (ARGMAX_C0, ARGMAX_C1, ARGMAX_FLAGS, ARGMAX_LG_LD, ARGMAX_LG_OFF, ARGMAX_N, ARGMAX_NPARTS,
                     ARGMAX_OUT_LD, ARGMAX_OUT_OFF, ARGMAX_PART, ARGMAX_PI_OFF, ARGMAX_PV_OFF, FLAG_ARGMAX_FINAL,
                     FLAG_ARGMAX_PARTIAL)


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
    flags, N = fld(word, ARGMAX_FLAGS), fld(word, ARGMAX_N)
    nparts, part = fld(word, ARGMAX_NPARTS), fld(word, ARGMAX_PART)
    lg_off, lg_ld, pv_off = off(word, ARGMAX_LG_OFF), fld(word, ARGMAX_LG_LD), off(word, ARGMAX_PV_OFF)
    pv, pi, out = A + pv_off, I + off(word, ARGMAX_PI_OFF), I + off(word, ARGMAX_OUT_OFF)
    partial = has(flags, FLAG_ARGMAX_PARTIAL)
    final = has(flags, FLAG_ARGMAX_FINAL)
    c0 = tl.where(partial, fld(word, ARGMAX_C0), 0)
    c1 = tl.where(partial, fld(word, ARGMAX_C1), nparts)
    # BA-wide pieces, kept lane by lane (a strict > keeps each lane's first maximum), reduced once at the end: a
    # vocab block (4096 logits) is two pieces, two round trips.  A max and an argmax per 256-wide piece made it 16
    # dependent round trips and cross-warp reductions: 12 us of llama-1b's step (docs/PERF.md session 23)
    BA: tl.constexpr = BD * 8
    lane = tl.arange(0, BA)
    for n in range(N):
        src = A + tl.where(partial, lg_off + n * lg_ld, pv_off + n * nparts)  # logits, or the partial maxima
        best = tl.full((BA,), float("-inf"), tl.float32)
        # each lane's first index so far: its own in the first piece until a larger value comes (past c1 on masked
        # lanes, so never the first maximum while a real lane ties them; all -inf keeps c0 + lane)
        best_c = c0 + lane
        for cb in range(c0, c1, BA):
            c = cb + lane
            v = tl.load(src + c, mask=c < c1, other=float("-inf"), cache_modifier=".cg")
            better = v > best
            best_c = tl.where(better, c, best_c)
            best = tl.where(better, v, best)
        top = tl.max(best, axis=0)
        first = tl.min(tl.where(best == top, best_c, 2147483647), axis=0)  # the first index of the maximum
        if final:
            dst = out + n * fld(word, ARGMAX_OUT_LD)
            if partial:
                tl.store(dst, first)
            else:
                tl.store(dst, tl.load(pi + n * nparts + first, cache_modifier=".cg"))
        else:
            tl.store(pv + n * nparts + part, top)
            tl.store(pi + n * nparts + part, first)
