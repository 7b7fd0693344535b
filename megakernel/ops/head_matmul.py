"""HEAD_MATMUL: a small matmul per attention head (MLA's absorbed W_UK and W_UV)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import after_slots, aligned, fld, has, off
from .fields import (FLAG_HEAD_MATMUL_TRANS, HEAD_MATMUL_FLAGS, HEAD_MATMUL_H0, HEAD_MATMUL_H1, HEAD_MATMUL_IN_DIM,
                     HEAD_MATMUL_N, HEAD_MATMUL_O0, HEAD_MATMUL_O1, HEAD_MATMUL_OUT_HS, HEAD_MATMUL_OUT_LD,
                     HEAD_MATMUL_OUT_OFF, HEAD_MATMUL_W_HS, HEAD_MATMUL_W_LD, HEAD_MATMUL_W_OFF, HEAD_MATMUL_X_COL0,
                     HEAD_MATMUL_X_HS, HEAD_MATMUL_X_LD, HEAD_MATMUL_X_OFF)


def reference(task, mem) -> None:
    N, i_dim, o0, o1 = task["N"], task["in_dim"], task["o0"], task["o1"]
    w_buf = mem.bufs[task["w.buf"]]
    for h in range(task["h0"], task["h1"]):
        x = mem.mat(task, "x", N, i_dim, col0=h * task["x_hs"] + task["x_col0"]).float()
        base = task["w.off"] + h * task["w_hs"]
        if task.has("TRANS"):  # W_h[i, o] at o*ld + i
            w = w_buf.as_strided((o1 - o0, i_dim), (task["w_ld"], 1), base + o0 * task["w_ld"]).float().T
        else:
            w = w_buf.as_strided((i_dim, o1 - o0), (task["w_ld"], 1), base + o0).float()
        mem.mat(task, "out", N, o1 - o0, col0=h * task["out_hs"] + o0).copy_(x @ w)


# ---- GPU body ----------------------------------------------------------------------------
@triton.jit
def step_coords(s, h0, nob, nib, ngroups, o0, BI: tl.constexpr, BO: tl.constexpr):
    """Step s's (first input, token group, first output, head): steps run head, output block, token
    group, input block, innermost last."""
    return ((s % nib) * BI, (s // nib) % ngroups, o0 + ((s // (nib * ngroups)) % nob) * BO,
            h0 + s // (nib * ngroups * nob))


@triton.jit
def weight_tile(s, total, h0, nob, nib, ngroups, w_ptr, w_hs, w_ld, i_dim, o0, o1, BI: tl.constexpr, BO: tl.constexpr,
                TRANS: tl.constexpr, EF: tl.constexpr = 0):
    """Step s's [BI, BO] weight tile (steps: head, output block, token group, input block, innermost last).
    Unmasked, like the weight stream's chunks, so each thread's vector is one load: the strided index
    is clamped to its last valid value, the contiguous one reads on past the block (at most BI or BO
    elements past the matrix; the W arena has that much slack, memory.STREAM_SLACK) and those
    products are either multiplied by zero activations or never stored.  Nothing is read when
    s == total (a scalar mask keeps the vector loads)."""
    on = s < total
    ib, _, ob, h = step_coords(s, h0, nob, nib, ngroups, o0, BI, BO)
    i = ib + tl.arange(0, BI)
    o = ob + tl.arange(0, BO)
    if TRANS:  # W_h[i, o] at o*ld + i: rows o, contiguous i
        w_offs = tl.minimum(o, o1 - 1)[None, :] * w_ld + i[:, None]
    else:
        w_offs = tl.minimum(i, i_dim - 1)[:, None] * w_ld + o[None, :]
    # EF 2 (a launch variant): evict-first, as EF 1 loads the weight stream (a step reads each weight once)
    return tl.load(w_ptr + h * w_hs.to(tl.int64) + w_offs, mask=on, other=0.0,
                   eviction_policy="evict_first" if EF >= 2 else "")


@triton.jit
def task_fields(word, W, ALIGN: tl.constexpr):
    """(w_ptr, w_hs, w_ld, h0, h1, i_dim, o0, o1, N) of a HEAD_MATMUL task word."""
    w_ptr = W + aligned(off(word, HEAD_MATMUL_W_OFF), ALIGN)
    w_hs, w_ld = aligned(fld(word, HEAD_MATMUL_W_HS), ALIGN), aligned(fld(word, HEAD_MATMUL_W_LD), ALIGN)
    h0, h1, N = fld(word, HEAD_MATMUL_H0), fld(word, HEAD_MATMUL_H1), fld(word, HEAD_MATMUL_N)
    i_dim = fld(word, HEAD_MATMUL_IN_DIM)
    o0, o1 = aligned(fld(word, HEAD_MATMUL_O0), ALIGN), fld(word, HEAD_MATMUL_O1)  # output columns of this task
    return w_ptr, w_hs, w_ld, h0, h1, i_dim, o0, o1, N


@triton.jit
def transposed(word):
    """The kernel runs TRANS tasks and the others through separate copies of prefetch and body: with
    the layout a runtime choice, the weights' contiguous axis was unknown and every load was 2 bytes."""
    return has(fld(word, HEAD_MATMUL_FLAGS), FLAG_HEAD_MATMUL_TRANS)


@triton.jit
def prefetch(word, W, BI: tl.constexpr, BO: tl.constexpr, ALIGN: tl.constexpr, TRANS: tl.constexpr,
             EF: tl.constexpr = 0, slots=None):
    """The task's first weight tile, requested before its dependency wait (weights never depend on
    activations): a q_absorb task is a single tile, so its wait hides all of its weight latency.  slots: its
    wait slots, read first (WAITS 2: common.wait_slots)."""
    w_ptr, w_hs, w_ld, h0, h1, i_dim, o0, o1, N = task_fields(word, W, ALIGN)
    if slots is not None:
        o1 = after_slots(o1, slots)
    nib, nob = tl.cdiv(i_dim, BI), tl.cdiv(o1 - o0, BO)
    return weight_tile(0, 1, h0, nob, nib, 1, w_ptr, w_hs, w_ld, i_dim, o0, o1, BI, BO, TRANS, EF)


@triton.jit
def body(word, W, A, w, BI: tl.constexpr, BO: tl.constexpr, ALIGN: tl.constexpr, TRANS: tl.constexpr,
         TB: tl.constexpr, EF: tl.constexpr = 0):
    """Per head and token, a GEMV on CUDA cores over whole [BI, BO] weight tiles (fp32 sums in a
    fixed order: batch invariant).  One flat loop over (head, output block, group of TB tokens,
    input block) requests the next step's tile before multiplying the current one by each token of
    the group (a tile is read once for up to TB tokens).  w: step 0's tile (prefetch)."""
    w_ptr, w_hs, w_ld, h0, h1, i_dim, o0, o1, N = task_fields(word, W, ALIGN)
    x_ptr, x_ld, x_hs, x_col0 = (A + off(word, HEAD_MATMUL_X_OFF), fld(word, HEAD_MATMUL_X_LD),
                                 fld(word, HEAD_MATMUL_X_HS), fld(word, HEAD_MATMUL_X_COL0))
    o_ptr, o_ld, o_hs = A + off(word, HEAD_MATMUL_OUT_OFF), fld(word, HEAD_MATMUL_OUT_LD), fld(word, HEAD_MATMUL_OUT_HS)
    nib, nob, ngroups = tl.cdiv(i_dim, BI), tl.cdiv(o1 - o0, BO), tl.cdiv(N, TB)
    total = (h1 - h0) * nob * ngroups * nib
    acc = tl.zeros((TB, BO), tl.float32)  # a row of sums per token of the group
    tok = tl.arange(0, TB)[:, None]
    for s in range(total):
        w_next = weight_tile(s + 1, total, h0, nob, nib, ngroups, w_ptr, w_hs, w_ld, i_dim, o0, o1, BI, BO, TRANS,
                             EF)
        ib, g, ob, h = step_coords(s, h0, nob, nib, ngroups, o0, BI, BO)
        i = ib + tl.arange(0, BI)
        wf = w.to(tl.float32)
        n0 = g * TB
        for t in range(tl.minimum(TB, N - n0)):
            x = tl.load(x_ptr + (n0 + t) * x_ld + h * x_hs + x_col0 + i, mask=i < i_dim, other=0.0,
                        cache_modifier=".cg")
            acc = tl.where(tok == t, acc + tl.sum(wf * x[:, None], axis=0)[None, :], acc)
        if s % nib == nib - 1:  # this (head, output block, token group) is complete
            o = ob + tl.arange(0, BO)[None, :]
            n = n0 + tok
            tl.store(o_ptr + n * o_ld + h * o_hs + o, acc, mask=(o < o1) & (n < N))
            acc = tl.zeros((TB, BO), tl.float32)
        w = w_next
