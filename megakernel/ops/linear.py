"""LINEAR: a block of output columns of x @ W.T, with a fused SiLU·mul (gate/up) or residual epilogue,
and optionally x's RMSNorm (NORM: the norm's weight is folded into W's columns, the task scales its
sums by rsqrt(mean(x²) + eps)); PAIR: W is two matrices (a high and a low part) whose sums are added;
DOWN_T: the SiLU·mul rows then times the same rows of a down projection packed transposed (ops/kmajor.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import after_slots, aligned, ffld, fld, has, off, prefetch_l2, silu
from .fields import (FLAG_LINEAR_DOWN_T, FLAG_LINEAR_NORM, FLAG_LINEAR_PAIR, FLAG_LINEAR_RES, FLAG_LINEAR_SILU_MUL,
                     LINEAR_EPS, LINEAR_FLAGS, LINEAR_K, LINEAR_N, LINEAR_OUT_LD, LINEAR_OUT_OFF, LINEAR_R0, LINEAR_R1,
                     LINEAR_RES_LD, LINEAR_RES_OFF, LINEAR_SLICE, LINEAR_W2_OFF, LINEAR_W_OFF, LINEAR_WD_OFF,
                     LINEAR_X_LD, LINEAR_X_OFF, LINEAR_Y_LD, LINEAR_Y_OFF)
from .kmajor import down_partials


def reference(task, mem) -> None:
    N, K, r0, r1 = task["N"], task["K"], task["r0"], task["r1"]
    x = mem.mat(task, "x", N, K).float()
    w = mem.mat(task, "w", r1 - r0, K, row0=r0, ld=K).float()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + task["eps"]) if task.has("NORM") else 1.0
    y = (x @ w.T) * r
    if task.has("SILU_MUL"):
        y = F.silu(y) * ((x @ mem.mat(task, "w2", r1 - r0, K, row0=r0, ld=K).float().T) * r)
    elif task.has("PAIR"):  # the matrix's low part: summed alone, then added (as the kernel sums it)
        y = y + (x @ mem.mat(task, "w2", r1 - r0, K, row0=r0, ld=K).float().T) * r
    if task.has("RES"):
        y = y + mem.mat(task, "res", N, r1 - r0, col0=r0).float()
    out = mem.mat(task, "out", N, r1 - r0, col0=r0)
    out.copy_(y)
    if task.has("DOWN_T"):  # the slice's rows of the down projection, packed transposed: a partial row per token
        wd = mem.mat(task, "wd", r1 - r0, K, row0=r0, ld=K).float()
        mem.mat(task, "y", N, K, row0=task["slice"] * N).copy_(out.float() @ wd)


# ---- GPU body ----------------------------------------------------------------------------
# A weight chunk is a [BR, KC // SPAN, SPAN] tile: row r's columns kb + c·SPAN + s.  One warp's
# 16-byte activation vectors side by side span SPAN columns, and rows have the largest stride, so
# the compiler lays warps along the rows: each warp sums whole rows in its own registers and lanes,
# with no shared memory and no barrier per step (a [BR, KC] tile put warps along K: a cross-warp
# reduction per chunk, ~730 instructions per 4 KB, docs/PERF.md run 13).  bf16 weights load as
# 32-bit words of two columns each, 8 bytes per lane, matching the activations' (even, odd) split:
# a shift or a mask turns each half into its fp32 value, one instruction per weight instead of an
# unpack and a shift.
@triton.jit
def chunk_cols(kb, KC: tl.constexpr, SPAN: tl.constexpr, VEC: tl.constexpr):
    """[1, KC // SPAN, SPAN] column indices kb + c·SPAN + s, in runs of VEC the compiler vectorizes."""
    s = tl.max_contiguous(tl.multiple_of(tl.arange(0, SPAN), VEC), VEC)
    return kb + tl.arange(0, KC // SPAN)[None, :, None] * SPAN + s[None, None, :]


@triton.jit
def weight_rows(w_ptr, row0, r1, K, kb, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, EF: tl.constexpr = 0):
    """Rows row0.. (< r1), columns kb..kb+KC of the weights as a chunk tile.  K and the base are
    multiples of ALIGN (checked on the host).  Unmasked, so each vector is one load from a base
    register: rows past r1 read row r1 - 1 again (their sums are never stored) and columns past K
    read on into the next row, at most KC past the matrix (the arena has that much slack:
    memory.STREAM_SLACK); the activations are zero there.  EF 1 (the default): loaded with the L2's
    evict-first policy (a step reads each weight once), so the stream does not push the task words,
    counters and activations that every hop reads out of the L2."""
    K = aligned(K, ALIGN)
    rows = tl.minimum(row0 + tl.arange(0, BR), r1 - 1)[:, None, None]
    PAIRS: tl.constexpr = (w_ptr.dtype.element_ty == tl.bfloat16) and (ALIGN % 2 == 0)
    if PAIRS:
        ks = chunk_cols(kb // 2, KC // 2, min(KC, 128) // 2, 2)
        w = tl.load(w_ptr.to(tl.pointer_type(tl.uint32)) + rows.to(tl.int64) * (K // 2) + ks,
                    eviction_policy="evict_first" if EF else "")
    else:
        ks = chunk_cols(kb, KC, min(KC, 128), min(ALIGN, 4))
        w = tl.load(w_ptr + rows.to(tl.int64) * K + ks, eviction_policy="evict_first" if EF else "")
    return w


@triton.jit
def act_chunk(x_ptr, xrow, x_ld, kb, K, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr):
    """Activation row xrow, columns kb..kb+KC, as the chunk tile's columns for every row: each warp reads
    the columns it multiplies (L1 hits after the first warp: the wait's acquire invalidated L1).  Masked
    only in a chunk that ends past K (its weights read on into the next row, so those columns must be
    zeros): a compare and a zero-fill per vector, ~60 of a step's instructions (offline SASS)."""
    ks = chunk_cols(kb, KC, min(KC, 128), min(ALIGN, 4)) + tl.zeros((BR, 1, 1), tl.int32)
    ptrs = x_ptr + xrow.to(tl.int64) * aligned(x_ld, ALIGN) + ks
    if kb + KC <= aligned(K, ALIGN):
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=ks < aligned(K, ALIGN), other=0.0)
    return x


@triton.jit
def chunk_dot(w, x, w_ptr, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr):
    """[BR] fp32 sums of a weight chunk's rows times the activation chunk."""
    SPAN: tl.constexpr = min(KC, 128)
    PAIRS: tl.constexpr = (w_ptr.dtype.element_ty == tl.bfloat16) and (ALIGN % 2 == 0)
    if PAIRS:
        x_even, x_odd = tl.split(tl.reshape(x, (BR, KC // SPAN, SPAN // 2, 2)))
        lo = (w << 16).to(tl.float32, bitcast=True)  # the even column: the word's low half
        hi = (w & 0xFFFF0000).to(tl.float32, bitcast=True)
        # one in-thread sum per half: each is a chain of fused multiply-adds (the sum of lo*x + hi*x
        # pairs compiled to a multiply, a fused add and a tree of adds per pair: ~40 more per step)
        part = tl.sum(lo * x_even, axis=1) + tl.sum(hi * x_odd, axis=1)
    else:
        part = tl.sum(w.to(tl.float32) * x, axis=1)
    return tl.sum(part, axis=1)


@triton.jit
def store_in_place(ptrs, values, mask):
    """values[i] to ptrs[i] where mask[i], stored from the values' own layout by every thread holding one
    (the copies a warp holds land on one address): tl.store would first convert a reduction's layout
    to a coalesced one through shared memory.  Inline PTX: GPU only (ROWVEC 2 is refused under the
    interpreter)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.global.f32 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,f,r", [ptrs.to(tl.int64), values, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def advance(sub, kc, g, blk, nsub, nk, ngroups):
    """The step after (block blk, token group g, K chunk kc, gate|up sub), in loop order, without divisions."""
    sub += 1
    wrap = sub == nsub
    sub = tl.where(wrap, 0, sub)
    kc += wrap.to(tl.int32)
    wrap = kc == nk
    kc = tl.where(wrap, 0, kc)
    g += wrap.to(tl.int32)
    wrap = g == ngroups
    g = tl.where(wrap, 0, g)
    blk += wrap.to(tl.int32)
    return sub, kc, g, blk


@triton.jit
def list_rows(n, on, xrows_ptr, xrows_div):
    """Token n's (out row, activation row): its row-list entry and entry // xrows_div (xrows_div > 0),
    else n and n.  n may be a scalar or a vector of tokens."""
    row = n
    xrow = n
    if xrows_div > 0:
        row = tl.load(xrows_ptr + n, mask=on, other=0)
        xrow = row // xrows_div
    return row, xrow


@triton.jit
def token_sums(w, x_ptr, xrow, x_ld, kb, K, sub, t, acc, acc2, w_ptr, BR: tl.constexpr, KC: tl.constexpr,
               ALIGN: tl.constexpr, TB: tl.constexpr):
    """Token t of a group (activation row xrow) times the step's weight chunk, added to its column of
    acc (gate or plain rows, sub 0) or acc2 (up rows, sub 1)."""
    x = act_chunk(x_ptr, xrow, x_ld, kb, K, BR, KC, ALIGN)
    part = chunk_dot(w, x, w_ptr, BR, KC, ALIGN)[:, None]
    hit = tl.arange(0, TB)[None, :] == t
    if sub == 0:
        acc = tl.where(hit, acc + part, acc)
    else:
        acc2 = tl.where(hit, acc2 + part, acc2)
    return acc, acc2


@triton.jit
def norm_scales(x_ptr, x_ld, xrows_ptr, xrows_div, n0, n_rows, K, eps, TB: tl.constexpr, BN: tl.constexpr,
                ALIGN: tl.constexpr):
    """[TB] rsqrt(mean(x[xrow(n)]²) + eps) for the group's tokens n0.. (NORM; 1 past n_rows).  Each row is
    summed alone over BN-wide chunks in a fixed order (RMSNORM's), so a token's scale never depends on
    its neighbours or on TB.  Its loads go out behind the first weight chunk's, so at T = 1 the row's
    one round trip hides under that chunk's."""
    rs = tl.full((TB,), 1.0, tl.float32)
    c = tl.arange(0, BN)
    for t in range(0, tl.minimum(TB, n_rows - n0)):
        row = x_ptr + list_rows(n0 + t, True, xrows_ptr, xrows_div)[1].to(tl.int64) * aligned(x_ld, ALIGN)
        sq = tl.zeros((BN,), tl.float32)
        for kb in range(0, K, BN):
            v = tl.load(row + kb + c, mask=kb + c < K, other=0.0)
            sq += v * v
        rs = tl.where(tl.arange(0, TB) == t, 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps), rs)
    return rs


@triton.jit
def stream_chunks(x_ptr, x_ld, xrows_ptr, xrows_div, n_rows, out_ptr, out_ld, res_ptr, res_ld, use_res,
                  w_ptr, w2_ptr, two, r0, r1, K, w, norm, eps, BR: tl.constexpr, KC: tl.constexpr,
                  ALIGN: tl.constexpr, TB: tl.constexpr, DEPTH: tl.constexpr, BN: tl.constexpr,
                  ROWVEC: tl.constexpr = 0, AHEAD: tl.constexpr = 0, PFD: tl.constexpr = 0, EF: tl.constexpr = 0,
                  HILO: tl.constexpr = 0, pair=False):
    """out[orow(n), r0:r1] = f(x[xrow(n)] @ W[r0:r1].T) for n < n_rows, f = identity, + residual, or
    SiLU(x@W.T) * (x@W2.T); with norm, each x@W.T scaled by x's rsqrt(mean(x²) + eps) first (the
    norm's weight is in W).  Rows come from a list (xrows_div > 0: row = list[n] // xrows_div, out row
    = list[n]) or are n itself.  CUDA cores, fp32 products and sums, K in chunks of KC in a fixed
    order, one token at a time against a chunk: a token's result never depends on its neighbours
    (batch invariance).  Steps run (row block, group of TB tokens, K chunk, gate|up) in a flat loop
    that requests step i+1's weights before multiplying step i's by each token of the group, so a
    weight chunk is read once for up to TB tokens (T > 1, B > 1: the weights are what a step
    streams) and its load latency hides behind the arithmetic (waiting for each chunk cost 2x on
    the GPU: docs/PERF.md); the step counters advance by compares, not divisions.
    DEPTH 2 (a launch variant) keeps a second chunk in flight: step i+2's is requested in step i.
    ROWVEC 1 (a launch variant, TB = 1): the rows stored as a vector from the sums' own layout, the norm
    scale a scalar (the [BR, TB] epilogue kept the sums in a second layout, converted through shared
    memory with barriers on every step); ROWVEC 2 also stores without tl.store's conversion.
    AHEAD 1 (a launch variant; it acts only with TB = 1 and ROWVEC, elsewhere the epilogue is as with 0):
    a listed token's out row is looked up a step ahead with its activation row, not at each row block's
    end, where the store (and a residual's address) waited on that load: an expert tile's epilogue paid
    one memory round trip per row block.
    PFD > 0 (a launch variant, compiled only): the L2 is asked for the weights of the row block PFD blocks
    ahead whenever a row block starts (one bulk prefetch per matrix from thread 0, no registers), and for
    the first PFD blocks before the loop (a LINEAR task also before its dependency wait: prefetch_blocks), so
    a register load finds its chunk in the L2 or on its way: the stream keeps more bytes in flight than the
    one chunk its registers hold.
    PFD < 0 (a launch variant, compiled only; DEPTH 1): the step -PFD after the one requested into registers is
    asked of the L1 line by line (chunk_lines_l1), every step: more bytes in flight, no registers held.
    HILO 1 (the plan has LINEAR[PAIR] tasks; compiled out of every other kernel): with `pair`, W and W2 are one
    matrix's high and low parts, streamed as gate|up are, and the two sums are added instead of SiLU·mul.
    w: step 0's weight chunk, already requested (before the dependency wait)."""
    nsub = 1 + two.to(tl.int32)
    nk = tl.cdiv(K, KC)
    ngroups = tl.cdiv(n_rows, TB)
    total = tl.cdiv(r1 - r0, BR) * ngroups * nk * nsub
    zero = r0 * 0
    sub, kc, g, blk = zero, zero, zero, zero
    sub_a, kc_a, g_a, blk_a = advance(sub, kc, g, blk, nsub, nk, ngroups)
    w_a = w  # DEPTH 2: step i+1's chunk, in flight since step i-1
    if DEPTH == 2:
        sub_b, kc_b, g_b, blk_b = advance(sub_a, kc_a, g_a, blk_a, nsub, nk, ngroups)
        w_a = weight_rows(tl.where(sub_a == 1, w2_ptr, w_ptr), r0 + blk_a * BR, r1, K, kc_a * KC, BR, KC, ALIGN, EF)
    # one column of sums per token of the group (sums of gate rows; acc2: of up rows)
    acc = tl.zeros((BR, TB), tl.float32)
    acc2 = tl.zeros((BR, TB), tl.float32)
    col = tl.arange(0, TB)[None, :]
    # the activation row of each step's first token is looked up a step ahead, so the step's first
    # activation load never waits on a row-list load (a T=1 expert task's only token); later tokens
    # of a group (T > 1, B > 1) look theirs up in turn
    orow0, xrow0 = list_rows(zero, zero < total, xrows_ptr, xrows_div)
    if PFD > 0:
        for b in tl.static_range(PFD):
            prefetch_block(w_ptr, w2_ptr, two, r0 + b * BR, r1, K, BR, ALIGN)
    if PFD < 0:  # the step the L1 is asked for
        sub_p, kc_p, g_p, blk_p = sub_a, kc_a, g_a, blk_a
        for _ in tl.static_range(-PFD):
            sub_p, kc_p, g_p, blk_p = advance(sub_p, kc_p, g_p, blk_p, nsub, nk, ngroups)
    rs = tl.full((TB,), 1.0, tl.float32)
    if norm:
        rs = norm_scales(x_ptr, x_ld, xrows_ptr, xrows_div, zero, n_rows, K, eps, TB, BN, ALIGN)
    for i in tl.range(total, loop_unroll_factor=2):
        if PFD > 0:
            if (kc == 0) & (sub == 0) & (g == 0):  # row block blk starts: ask for block blk + PFD
                prefetch_block(w_ptr, w2_ptr, two, r0 + (blk + PFD) * BR, r1, K, BR, ALIGN)
        if DEPTH == 2:
            w_next = weight_rows(tl.where(sub_b == 1, w2_ptr, w_ptr), r0 + blk_b * BR, r1, K, kc_b * KC, BR, KC, ALIGN,
                                 EF)
        else:
            w_next = weight_rows(tl.where(sub_a == 1, w2_ptr, w_ptr), r0 + blk_a * BR, r1, K, kc_a * KC, BR, KC, ALIGN,
                                 EF)
            if PFD < 0:
                chunk_lines_l1(tl.where(sub_p == 1, w2_ptr, w_ptr), r0 + blk_p * BR, r1, K, kc_p * KC, BR, KC, ALIGN)
                sub_p, kc_p, g_p, blk_p = advance(sub_p, kc_p, g_p, blk_p, nsub, nk, ngroups)
        xrow0_a = xrow0
        orow0_a = orow0
        if g_a != g:
            orow0_a, xrow0_a = list_rows(g_a * TB, True, xrows_ptr, xrows_div)
        n0 = g * TB
        acc, acc2 = token_sums(w, x_ptr, xrow0, x_ld, kc * KC, K, sub, 0, acc, acc2, w_ptr, BR, KC, ALIGN, TB)
        if TB > 1:
            for t in range(1, tl.minimum(TB, n_rows - n0)):
                xrow = list_rows(n0 + t, True, xrows_ptr, xrows_div)[1]
                acc, acc2 = token_sums(w, x_ptr, xrow, x_ld, kc * KC, K, sub, t, acc, acc2, w_ptr, BR, KC, ALIGN, TB)
        if (kc == nk - 1) & (sub == nsub - 1):  # the group's rows are complete
            if (TB == 1) and (ROWVEC > 0):
                # one token: its rows as a vector in the sums' own layout and its norm scale as a scalar,
                # so the sums carried between steps need no second layout (a shared-memory conversion
                # with barriers on every step); ROWVEC 2 also stores from that layout (docs/PERF.md s. 12)
                rows1 = r0 + blk * BR + tl.arange(0, BR)
                if AHEAD:
                    orow1 = orow0  # token n0's, looked up a step ahead with its activation row
                else:
                    orow1 = list_rows(n0, True, xrows_ptr, xrows_div)[0]
                m1 = rows1 < r1
                scale = tl.sum(rs, axis=0)
                y1 = tl.sum(acc, axis=1) * scale
                if two:
                    y2 = tl.sum(acc2, axis=1) * scale
                    if HILO:
                        y1 = tl.where(pair, y1 + y2, silu(y1) * y2)
                    else:
                        y1 = silu(y1) * y2
                y1 += tl.load(res_ptr + orow1 * res_ld + rows1, mask=m1 & use_res, other=0.0)
                dst = out_ptr + orow1.to(tl.int64) * out_ld + rows1
                if ROWVEC == 2:
                    store_in_place(dst, y1, m1)
                else:
                    tl.store(dst, y1, mask=m1)
            else:
                rows = (r0 + blk * BR + tl.arange(0, BR))[:, None]
                n = n0 + col
                orow = list_rows(n, n < n_rows, xrows_ptr, xrows_div)[0]
                mask = (rows < r1) & (n < n_rows)
                if norm:
                    acc = acc * rs[None, :]
                    acc2 = acc2 * rs[None, :]
                y = acc
                if two:
                    if HILO:
                        y = tl.where(pair, acc + acc2, silu(acc) * acc2)
                    else:
                        y = silu(acc) * acc2
                res = tl.load(res_ptr + orow * res_ld + rows, mask=mask & use_res, other=0.0)
                tl.store(out_ptr + orow.to(tl.int64) * out_ld + rows, y + res, mask=mask)
            acc = tl.zeros((BR, TB), tl.float32)
            acc2 = tl.zeros((BR, TB), tl.float32)
            if norm:
                if (ngroups > 1) & (i + 1 < total):  # the next step starts group g_a
                    rs = norm_scales(x_ptr, x_ld, xrows_ptr, xrows_div, g_a * TB, n_rows, K, eps, TB, BN, ALIGN)
        xrow0 = xrow0_a
        orow0 = orow0_a
        sub, kc, g, blk = sub_a, kc_a, g_a, blk_a
        if DEPTH == 2:
            w, w_a = w_a, w_next
            sub_a, kc_a, g_a, blk_a = sub_b, kc_b, g_b, blk_b
            sub_b, kc_b, g_b, blk_b = advance(sub_b, kc_b, g_b, blk_b, nsub, nk, ngroups)
        else:
            w = w_next
            sub_a, kc_a, g_a, blk_a = advance(sub_a, kc_a, g_a, blk_a, nsub, nk, ngroups)


@triton.jit
def pin_barrier():
    """0 in every thread, from a CTA barrier that counts no thread (bar.red.popc of a false predicate): no load
    crosses the barrier, and what depends on its result cannot be scheduled above it (ptxas moves arithmetic
    across a plain bar.sync).  Inline PTX: GPU only."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.ne.u32 p, t, t; bar.red.popc.u32 $0, 0, p; }",
        "=r", [], dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def pin(PINNED: tl.constexpr):
    """pin_barrier() where PINNED, else 0 with no barrier: the same sums in an order ptxas may change (the
    interpreter's, which runs no inline PTX: tests/test_weight_stream.py checks the pinned streams' sums there)."""
    if PINNED:
        return pin_barrier()
    else:
        return tl.cast(0, tl.uint32)


@triton.jit
def pinned(w, PINNED: tl.constexpr):
    """A weight chunk that nothing after pin()'s barrier can be computed without: its bits ORed with the barrier's
    0 (bf16 pairs are 32-bit words already; fp32 or 16-bit weights are ORed as their bits and cast back)."""
    if w.dtype == tl.uint32:
        return w | pin(PINNED)
    elif w.dtype.primitive_bitwidth == 16:
        return (w.to(tl.uint16, bitcast=True) | pin(PINNED).to(tl.uint16)).to(w.dtype, bitcast=True)
    else:
        return (w.to(tl.uint32, bitcast=True) | pin(PINNED)).to(w.dtype, bitcast=True)


@triton.jit
def scaled(part, scale, PINNED: tl.constexpr):
    """part * scale rounded on its own, as stream_chunks rounds it before adding the residual: ptxas fuses a plain
    multiply and the add after it into one FFMA here (one rounding: other bits), but never a mul.rn.  The
    interpreter (PINNED 0) fuses nothing."""
    if PINNED:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [part, tl.zeros_like(part) + scale],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return part * scale


@triton.jit
def store_rows(dst, y, m, ROWVEC: tl.constexpr):
    """A pinned stream's finished rows: stored in place from the sums' layout (ROWVEC 2, inline PTX) or by
    tl.store."""
    if ROWVEC == 2:
        store_in_place(dst, y, m)
    else:
        tl.store(dst, y, mask=m)


@triton.jit
def pinnable(n_rows, K, KC: tl.constexpr, TB: tl.constexpr, ROWVEC: tl.constexpr):
    """Whether stream_pinned runs a slice: one token (its activation chunk is then every step's) and K <= KC."""
    return (n_rows == 1) & (K <= KC) & (TB == 1) & (ROWVEC > 0)


@triton.jit
def next_step(sub, blk, nsub):
    """The pinned streams' step after (row block blk, gate|up sub or K chunk); their loops spell it out for their
    own step (the default kernel's SASS as it was), the L1's rolling prefetch calls it."""
    sub += 1
    wrap = sub == nsub
    return tl.where(wrap, 0, sub), blk + wrap.to(tl.int32)


@triton.jit
def stream_pinned(x_ptr, x_ld, xrows_ptr, xrows_div, out_ptr, out_ld, res_ptr, res_ld, use_res, w_ptr, w2_ptr, two,
                  r0, r1, K, w, norm, eps, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, BN: tl.constexpr,
                  ROWVEC: tl.constexpr, EF: tl.constexpr = 0, HILO: tl.constexpr = 0, pair=False,
                  PINNED: tl.constexpr = 1, PFD: tl.constexpr = 0):
    """stream_chunks' result for one token and K <= KC (pinnable), with the next chunk in flight through the
    multiply (PIN=1: MLA plans' default).  In stream_chunks' SASS it is not: an SM_90 wait on a scoreboard waits for
    every load counted on it and ptxas counts all of a loop's loads on one, so the multiply's wait for the
    activation chunk (reloaded every step) drains the chunk requested just before it, or ptxas issues that request
    only after the multiply; a step then takes the multiply plus a load's latency (tools/sass_probe.py's weight
    waits).  Here the activation chunk is loaded once, before the loop; the next chunk is requested first and a CTA
    barrier keeps the request above the multiply (no load crosses it); and every step ends with a wait on the chunk
    it requested (the residual's load, predicated off where it adds nothing: use_res must be a run-time value, or
    the load compiles away), so the next step's multiply waits for nothing.  PFD < 0: as in stream_chunks.
    The same sums in the same order as stream_chunks (one token, TB 1): the same bits."""
    nsub = 1 + two.to(tl.int32)
    total = tl.cdiv(r1 - r0, BR) * nsub
    zero = r0 * 0
    orow, xrow = list_rows(zero, True, xrows_ptr, xrows_div)
    x = act_chunk(x_ptr, xrow, x_ld, 0, K, BR, KC, ALIGN)
    scale = 1.0
    if norm:
        scale = tl.sum(norm_scales(x_ptr, x_ld, xrows_ptr, xrows_div, zero, 1, K, eps, 1, BN, ALIGN), axis=0)
    # the first chunk (requested before the task's wait) and the activations waited for before the loop: else
    # the first multiply's wait would drain the second chunk, requested just before it
    w = pinned(w, PINNED)
    sub, blk = zero, zero
    if PFD < 0:  # the step the L1 is asked for, -PFD after the one requested
        sub_p, blk_p = zero, zero
        for _ in tl.static_range(1 - PFD):
            sub_p, blk_p = next_step(sub_p, blk_p, nsub)
    gate = tl.zeros((BR,), tl.float32)
    for i in tl.range(total, loop_unroll_factor=1):  # unrolled by 2: 360 B spilled in dsv2-lite's kernel, not 216
        sub_a = sub + 1
        wrap = sub_a == nsub
        sub_a = tl.where(wrap, 0, sub_a)
        blk_a = blk + wrap.to(tl.int32)
        w_next = weight_rows(tl.where(sub_a == 1, w2_ptr, w_ptr), r0 + blk_a * BR, r1, K, 0, BR, KC, ALIGN, EF)
        if PFD < 0:
            chunk_lines_l1(tl.where(sub_p == 1, w2_ptr, w_ptr), r0 + blk_p * BR, r1, K, 0, BR, KC, ALIGN)
            sub_p, blk_p = next_step(sub_p, blk_p, nsub)
        part = chunk_dot(pinned(w, PINNED), x, w_ptr, BR, KC, ALIGN)
        rows1 = r0 + blk * BR + tl.arange(0, BR)
        m1 = rows1 < r1
        done = sub == nsub - 1
        res = tl.load(res_ptr + orow * res_ld + rows1, mask=m1 & use_res & done, other=0.0)
        if done:  # the rows are complete
            y1 = scaled(part, scale, PINNED)
            if two:
                if HILO:
                    y1 = tl.where(pair, gate * scale + y1, silu(gate * scale) * y1)
                else:
                    y1 = silu(gate * scale) * y1
            store_rows(out_ptr + orow.to(tl.int64) * out_ld + rows1, y1 + res, m1, ROWVEC)
        else:  # a gate (or high-part) step: its sums wait for the up rows; res (0 here) is the step's wait
            gate = part + res * 0.0
        w = w_next
        sub = sub_a
        blk = blk_a


@triton.jit
def pinnable_k(n_rows, K, two, KC: tl.constexpr, TB: tl.constexpr, ROWVEC: tl.constexpr):
    """Whether stream_pinned_k runs a slice: one token, K > KC, one matrix."""
    return (n_rows == 1) & (K > KC) & (two == 0) & (TB == 1) & (ROWVEC > 0)


@triton.jit
def prefetch_lines_l1(ptrs):
    """The 128-byte line of each pointer asked of this SM's L1 (no register waits for it).  Compiled only."""
    tl.inline_asm_elementwise("prefetch.global.L1 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def chunk_lines_l1(w_ptr, row0, r1, K, kb, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr):
    """PFD < 0: the 128-byte lines of the chunk weight_rows(w_ptr, row0, r1, K, kb) loads asked of the L1, one a
    thread at 8 x 2048 bf16 (rows past r1 clamped as there).  No register holds them: a later register load of
    the chunk finds its lines in the L1 or on their way, so the SM has more bytes in flight than its registers."""
    LINE: tl.constexpr = 128 // (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    NL: tl.constexpr = max(KC // LINE, 1)
    rows = tl.minimum(row0 + tl.arange(0, BR), r1 - 1)
    prefetch_lines_l1(w_ptr + rows[:, None].to(tl.int64) * aligned(K, ALIGN) + kb + tl.arange(0, NL)[None, :] * LINE)


@triton.jit
def stream_pinned_k(x_ptr, x_ld, out_ptr, out_ld, res_ptr, res_ld, use_res, w_ptr, r0, r1, K, w, norm, eps,
                    BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, BN: tl.constexpr, ROWVEC: tl.constexpr,
                    EF: tl.constexpr = 0, PINNED: tl.constexpr = 1, PFD: tl.constexpr = 0):
    """stream_pinned for K > KC (pinnable_k: a one-token LINEAR, e.g. a down projection): stream_chunks' steps
    (row block by row block, each over its K chunks), each step's activation chunk asked of the L1 a step ahead
    (no register holds it) and loaded at the step's end, where the step waits for it and for the chunk it
    requested (the pin on that chunk), before the next weights are requested.  Each row's K chunks are summed in
    stream_chunks' order: the same bits.  PFD < 0: as in stream_chunks."""
    nk = tl.cdiv(K, KC)
    zero = r0 * 0
    x = act_chunk(x_ptr, zero, x_ld, 0, K, BR, KC, ALIGN)
    scale = 1.0
    if norm:
        scale = tl.sum(norm_scales(x_ptr, x_ld, x_ptr, 0, zero, 1, K, eps, 1, BN, ALIGN), axis=0)
    w = pinned(w, PINNED)  # the first chunk and the activations waited for before the loop (stream_pinned)
    acc = tl.zeros((BR,), tl.float32)
    kc, blk = zero, zero
    if PFD < 0:  # the step the L1 is asked for, -PFD after the one requested
        kc_p, blk_p = zero, zero
        for _ in tl.static_range(1 - PFD):
            kc_p, blk_p = next_step(kc_p, blk_p, nk)
    for i in tl.range(tl.cdiv(r1 - r0, BR) * nk, loop_unroll_factor=1):
        kc_a = kc + 1
        wrap = kc_a == nk
        kc_a = tl.where(wrap, 0, kc_a)
        blk_a = blk + wrap.to(tl.int32)
        w_next = weight_rows(w_ptr, r0 + blk_a * BR, r1, K, kc_a * KC, BR, KC, ALIGN, EF)
        if PFD < 0:
            chunk_lines_l1(w_ptr, r0 + blk_p * BR, r1, K, kc_p * KC, BR, KC, ALIGN)
            kc_p, blk_p = next_step(kc_p, blk_p, nk)
        if PINNED:
            prefetch_lines_l1(x_ptr + kc_a * KC + tl.minimum(tl.arange(0, KC // 32) * 32, K - 1 - kc_a * KC))
        part = chunk_dot(pinned(w, PINNED), x, w_ptr, BR, KC, ALIGN)
        acc = tl.where(kc == 0, 0.0, acc) + part
        rows1 = r0 + blk * BR + tl.arange(0, BR)
        m1 = rows1 < r1
        if kc == nk - 1:  # the block's rows are complete
            res = tl.load(res_ptr + rows1, mask=m1 & use_res, other=0.0)
            store_rows(out_ptr + rows1, scaled(acc, scale, PINNED) + res, m1, ROWVEC)
        # the next step's activations (L1 hits), waited for with this step's request before the next one
        x = act_chunk(x_ptr, zero, x_ld, kc_a * KC, K, BR, KC, ALIGN)
        w = pinned(w_next, PINNED)
        kc = kc_a
        blk = blk_a


@triton.jit
def narrow(rows, K, BR: tl.constexpr, KC: tl.constexpr):
    """Launch variant NARROW: whether a slice of `rows` rows loads at least a fifth fewer weights in 4·BR x
    KC/4 chunks than in BR x KC ones.  A chunk reads whole KC-wide rows (past K it reads the next row's
    columns, unused), so dsv2-lite's routed down tiles (96 rows of K = 1408) carry 2048 columns a row
    in flight, 1536 narrow; a 16-row tile of K = 2816 would read 32 rows narrow, so it stays wide."""
    KCN: tl.constexpr = KC // 4
    BRN: tl.constexpr = BR * 4
    return tl.cdiv(rows, BRN) * BRN * tl.cdiv(K, KCN) * KCN * 5 <= tl.cdiv(rows, BR) * BR * tl.cdiv(K, KC) * KC * 4


@triton.jit
def first_chunk(w_ptr, r0, r1, K, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, EF: tl.constexpr = 0):
    """The first weight chunk stream_chunks expects, requested early (weights never depend on activations)."""
    return weight_rows(w_ptr, r0, r1, K, 0, BR, KC, ALIGN, EF)


@triton.jit
def aligned_base(base, word, IDX: tl.constexpr, ALIGN: tl.constexpr):
    return base + aligned(off(word, IDX), ALIGN)


@triton.jit
def prefetch_rows(w_ptr, w2_ptr, two, r0, r1, K, ALIGN: tl.constexpr):
    """Rows r0..r1 of a weight matrix (and of its up half), each a contiguous slice of the arena (row
    stride K), asked of the L2 in bulk: the stream's register loads then find them there or in flight."""
    K = aligned(K, ALIGN)
    nbytes = (r1 - r0) * K * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    prefetch_l2(w_ptr + r0.to(tl.int64) * K, nbytes)
    if two:
        prefetch_l2(w2_ptr + r0.to(tl.int64) * K, nbytes)


@triton.jit
def prefetch_block(w_ptr, w2_ptr, two, row0, r1, K, BR: tl.constexpr, ALIGN: tl.constexpr):
    """Rows row0..row0+BR (< r1) of a weight matrix (and of its up half) asked of the L2: one contiguous
    slice each (row stride K); nothing past r1."""
    if row0 < r1:
        prefetch_rows(w_ptr, w2_ptr, two, row0, tl.minimum(row0 + BR, r1), K, ALIGN)


@triton.jit
def prefetch_task(word, W, ALIGN: tl.constexpr, HILO: tl.constexpr = 0):
    """A LINEAR task's whole weight slice asked of the L2 (launch variant PF)."""
    prefetch_rows(aligned_base(W, word, LINEAR_W_OFF, ALIGN), aligned_base(W, word, LINEAR_W2_OFF, ALIGN),
                  streams_two(fld(word, LINEAR_FLAGS), HILO), fld(word, LINEAR_R0), fld(word, LINEAR_R1),
                  fld(word, LINEAR_K), ALIGN)


@triton.jit
def prefetch_ahead(word, W, BR: tl.constexpr, ALIGN: tl.constexpr, PFK: tl.constexpr, HILO: tl.constexpr = 0):
    """Launch variant PFK: the rows after a LINEAR task's first row block (which its registers request), up to
    PFK KB of its weights, asked of the L2 before its dependency wait: the workers that wait on a layer's chain
    fill the L2 with what they will stream next, a bounded amount (132 workers x 128 KB: a third of the L2)."""
    flags, r0, r1, K = fld(word, LINEAR_FLAGS), fld(word, LINEAR_R0), fld(word, LINEAR_R1), fld(word, LINEAR_K)
    two = streams_two(flags, HILO)
    row_bytes = aligned(K, ALIGN) * (W.dtype.element_ty.primitive_bitwidth // 8) * (1 + two.to(tl.int32))
    last = tl.minimum(r1, r0 + BR + tl.maximum(1, PFK * 1024 // row_bytes))
    if r0 + BR < last:
        prefetch_rows(aligned_base(W, word, LINEAR_W_OFF, ALIGN), aligned_base(W, word, LINEAR_W2_OFF, ALIGN), two,
                      r0 + BR, last, K, ALIGN)


@triton.jit
def prefetch_blocks(word, W, BR: tl.constexpr, ALIGN: tl.constexpr, PFD: tl.constexpr, HILO: tl.constexpr = 0):
    """Launch variant PFD: a LINEAR task's first PFD row blocks asked of the L2 before its dependency wait
    (the stream asks for the rest as it goes; it asks for these again before its loop, which costs a
    prefetch of lines already on their way)."""
    flags, r0 = fld(word, LINEAR_FLAGS), fld(word, LINEAR_R0)
    for b in tl.static_range(PFD):
        prefetch_block(aligned_base(W, word, LINEAR_W_OFF, ALIGN), aligned_base(W, word, LINEAR_W2_OFF, ALIGN),
                       streams_two(flags, HILO), r0 + b * BR, fld(word, LINEAR_R1), fld(word, LINEAR_K), BR, ALIGN)


@triton.jit
def needs_narrow(word, BR: tl.constexpr, KC: tl.constexpr):
    return narrow(fld(word, LINEAR_R1) - fld(word, LINEAR_R0), fld(word, LINEAR_K), BR, KC)


@triton.jit
def prefetch(word, W, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, EF: tl.constexpr = 0, slots=None):
    """A LINEAR task's first weight chunk, requested before its dependency wait (after its wait slots: WAITS 2)."""
    if slots is not None:
        return first_chunk(aligned_base(W, word, LINEAR_W_OFF, ALIGN), fld(word, LINEAR_R0),
                           after_slots(fld(word, LINEAR_R1), slots), fld(word, LINEAR_K), BR, KC, ALIGN, EF)
    return first_chunk(aligned_base(W, word, LINEAR_W_OFF, ALIGN), fld(word, LINEAR_R0), fld(word, LINEAR_R1),
                       fld(word, LINEAR_K), BR, KC, ALIGN, EF)


@triton.jit
def streams_two(flags, HILO: tl.constexpr):
    """Whether a task streams two matrices: gate|up (SILU_MUL), or with HILO a router's weights' high and low
    parts (PAIR: the kernel of a plan without PAIR tasks compiles none of it)."""
    if HILO:
        return has(flags, FLAG_LINEAR_SILU_MUL) | has(flags, FLAG_LINEAR_PAIR)
    else:
        return has(flags, FLAG_LINEAR_SILU_MUL)


@triton.jit
def pair_flag(flags, HILO: tl.constexpr):
    if HILO:
        return has(flags, FLAG_LINEAR_PAIR)
    else:
        return False


@triton.jit
def body(word, W, A, w, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, TB: tl.constexpr,
         DEPTH: tl.constexpr, BN: tl.constexpr, ROWVEC: tl.constexpr, AHEAD: tl.constexpr, PFD: tl.constexpr = 0,
         EF: tl.constexpr = 0, HILO: tl.constexpr = 0, KD: tl.constexpr = 0, BRD: tl.constexpr = 8,
         PIN: tl.constexpr = 0):
    """KD > 0: the plan has DOWN_T tasks (fusion rules expert_mlp, dense_mlp), whose k-major down rows of up to KD
    columns are compiled in (down_rows), BRD rows a chunk: the launch's BR, also where launch variant NARROW
    streams this task's gate|up in 4·BR-row chunks (4·BR k-major rows spilled 3.7 KB, offline).  PIN 1 (MLA plans'
    default, launch.block_sizes): a one-token task streams through stream_pinned (K <= KC) or stream_pinned_k (one
    matrix, K > KC)."""
    flags = fld(word, LINEAR_FLAGS)
    if PIN:
        if pinnable_k(fld(word, LINEAR_N), fld(word, LINEAR_K), streams_two(flags, HILO), KC, TB, ROWVEC):
            stream_pinned_k(aligned_base(A, word, LINEAR_X_OFF, ALIGN), fld(word, LINEAR_X_LD),
                            A + off(word, LINEAR_OUT_OFF), fld(word, LINEAR_OUT_LD), A + off(word, LINEAR_RES_OFF),
                            fld(word, LINEAR_RES_LD), has(flags, FLAG_LINEAR_RES),
                            aligned_base(W, word, LINEAR_W_OFF, ALIGN), fld(word, LINEAR_R0), fld(word, LINEAR_R1),
                            fld(word, LINEAR_K), w, has(flags, FLAG_LINEAR_NORM), ffld(word, LINEAR_EPS), BR, KC, ALIGN,
                            BN, ROWVEC, EF, 1, PFD)
        elif pinnable(fld(word, LINEAR_N), fld(word, LINEAR_K), KC, TB, ROWVEC):
            stream_pinned(aligned_base(A, word, LINEAR_X_OFF, ALIGN), fld(word, LINEAR_X_LD), A, 0,
                          A + off(word, LINEAR_OUT_OFF), fld(word, LINEAR_OUT_LD), A + off(word, LINEAR_RES_OFF),
                          fld(word, LINEAR_RES_LD), has(flags, FLAG_LINEAR_RES),
                          aligned_base(W, word, LINEAR_W_OFF, ALIGN), aligned_base(W, word, LINEAR_W2_OFF, ALIGN),
                          streams_two(flags, HILO), fld(word, LINEAR_R0), fld(word, LINEAR_R1), fld(word, LINEAR_K), w,
                          has(flags, FLAG_LINEAR_NORM), ffld(word, LINEAR_EPS), BR, KC, ALIGN, BN, ROWVEC, EF, HILO,
                          pair_flag(flags, HILO), 1, PFD)
        else:
            whole_task_stream(word, W, A, w, flags, BR, KC, ALIGN, TB, DEPTH, BN, ROWVEC, AHEAD, PFD, EF, HILO)
    else:  # the call as it stood before PIN (an extra inlined level moves ptxas's schedule: NOTES session 42)
        stream_chunks(aligned_base(A, word, LINEAR_X_OFF, ALIGN), fld(word, LINEAR_X_LD), A, 0, fld(word, LINEAR_N),
                      A + off(word, LINEAR_OUT_OFF), fld(word, LINEAR_OUT_LD), A + off(word, LINEAR_RES_OFF),
                      fld(word, LINEAR_RES_LD), has(flags, FLAG_LINEAR_RES), aligned_base(W, word, LINEAR_W_OFF, ALIGN),
                      aligned_base(W, word, LINEAR_W2_OFF, ALIGN), streams_two(flags, HILO), fld(word, LINEAR_R0),
                      fld(word, LINEAR_R1), fld(word, LINEAR_K), w, has(flags, FLAG_LINEAR_NORM),
                      ffld(word, LINEAR_EPS), BR, KC, ALIGN, TB, DEPTH, BN, ROWVEC, AHEAD, PFD, EF, HILO,
                      pair_flag(flags, HILO))
    if KD > 0:
        if has(flags, FLAG_LINEAR_DOWN_T):
            down_rows(word, W, A, KD, BRD, ALIGN, EF)


@triton.jit
def whole_task_stream(word, W, A, w, flags, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, TB: tl.constexpr,
                      DEPTH: tl.constexpr, BN: tl.constexpr, ROWVEC: tl.constexpr, AHEAD: tl.constexpr,
                      PFD: tl.constexpr, EF: tl.constexpr, HILO: tl.constexpr):
    """A LINEAR task's stream_chunks, its arguments read from the task word."""
    stream_chunks(aligned_base(A, word, LINEAR_X_OFF, ALIGN), fld(word, LINEAR_X_LD), A, 0, fld(word, LINEAR_N),
                  A + off(word, LINEAR_OUT_OFF), fld(word, LINEAR_OUT_LD), A + off(word, LINEAR_RES_OFF),
                  fld(word, LINEAR_RES_LD), has(flags, FLAG_LINEAR_RES), aligned_base(W, word, LINEAR_W_OFF, ALIGN),
                  aligned_base(W, word, LINEAR_W2_OFF, ALIGN), streams_two(flags, HILO), fld(word, LINEAR_R0),
                  fld(word, LINEAR_R1), fld(word, LINEAR_K), w, has(flags, FLAG_LINEAR_NORM), ffld(word, LINEAR_EPS),
                  BR, KC, ALIGN, TB, DEPTH, BN, ROWVEC, AHEAD, PFD, EF, HILO, pair_flag(flags, HILO))


@triton.jit
def down_rows(word, W, A, KD: tl.constexpr, BR: tl.constexpr, ALIGN: tl.constexpr, EF: tl.constexpr):
    """LINEAR[DOWN_T]'s second half: each token's SiLU·mul values of rows r0..r1 (the task's own `out` columns)
    times the same rows of the transposed down projection, into the token's partial row of this slice."""
    N, K, r0, r1 = fld(word, LINEAR_N), fld(word, LINEAR_K), fld(word, LINEAR_R0), fld(word, LINEAR_R1)
    wd = aligned_base(W, word, LINEAR_WD_OFF, ALIGN) + r0.to(tl.int64) * aligned(K, ALIGN)
    down_partials(wd, r1 - r0, K, A + off(word, LINEAR_OUT_OFF) + r0, fld(word, LINEAR_OUT_LD),
                  A + off(word, LINEAR_Y_OFF), fld(word, LINEAR_Y_LD), fld(word, LINEAR_SLICE) * N, A, N, KD, BR,
                  ALIGN, EF, False)
