"""ATTENTION over one split of a sequence's cache (MLA absorbed, or GQA), and ATTN_COMBINE of the splits.

A split covers cache positions [split·split_len, (split+1)·split_len); token t
of sequence b may read positions <= cache_lens[b] + t + pos_offset.  Each split
writes its normalised partial output and log-sum-exp; a split with no readable
position writes lse = -inf and zeros.  ATTENTION[ROPE] (GQA, fusion rule
rope_into_attention) rotates its query rows itself, and the split whose rows hold
the step's new positions writes their rotated keys and values into the cache first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import aligned, ffld, fld, has, mma, off, prefetch_l2, prefetch_lines_l2
from .fields import (ATTENTION_B, ATTENTION_CACHE_OFF, ATTENTION_CL_OFF, ATTENTION_DIM, ATTENTION_FLAGS,
                     ATTENTION_GROUP, ATTENTION_H0, ATTENTION_H1, ATTENTION_KV_HS, ATTENTION_LSE_OFF,
                     ATTENTION_NHEADS, ATTENTION_NSPLITS, ATTENTION_OP_OFF, ATTENTION_PE_COL0, ATTENTION_PE_HS,
                     ATTENTION_PE_LD, ATTENTION_PE_OFF, ATTENTION_POS_OFFSET, ATTENTION_Q_COL0, ATTENTION_Q_HS,
                     ATTENTION_Q_LD, ATTENTION_Q_OFF, ATTENTION_ROPE_DIM, ATTENTION_S, ATTENTION_SCALE, ATTENTION_SPLIT,
                     ATTENTION_SPLIT_LEN, ATTENTION_T, ATTENTION_V_COL0, ATTENTION_WIDTH, ATTN_COMBINE_B,
                     ATTN_COMBINE_C0, ATTN_COMBINE_C1, ATTN_COMBINE_DIM, ATTN_COMBINE_H0, ATTN_COMBINE_H1,
                     ATTN_COMBINE_LSE_OFF, ATTN_COMBINE_NHEADS, ATTN_COMBINE_NSPLITS, ATTN_COMBINE_OP_OFF,
                     ATTN_COMBINE_OUT_LD, ATTN_COMBINE_OUT_OFF, ATTN_COMBINE_T, FLAG_ATTENTION_MLA, FLAG_ATTENTION_ROPE,
                     ATTENTION_KN_LD, ATTENTION_KN_OFF, ATTENTION_TAB_OFF, ATTENTION_VN_OFF)
from .rope import rotate


def reference(task, mem) -> None:
    b, T, S, width, dim = task["b"], task["T"], task["S"], task["width"], task["dim"]
    nh, ns, split_len = task["nheads"], task["nsplits"], task["split_len"]
    j0 = task["split"] * split_len
    j1 = min(j0 + split_len, S)
    rows = mem.bufs[task["cache.buf"]].as_strided((S, width), (width, 1), task["cache.off"] + b * S * width)
    limit = int(mem.flat(task, "cl", b, 1)[0]) + task["pos_offset"] + torch.arange(T, device=mem.device)
    if task.has("ROPE"):
        tab = mem.mat(task, "tab", T, dim, row0=b * T, ld=dim).float()
        cos, sin = tab[:, :dim // 2], tab[:, dim // 2:]
        write_new_rows(task, mem, rows, limit, cos, sin, j0, j1)
    cache = rows[j0:j1].float()
    valid = torch.arange(j0, j1, device=mem.device)[None, :] <= limit[:, None]  # [T, keys]
    for h in range(task["h0"], task["h1"]):
        q = mem.mat(task, "q", T, dim, row0=b * T, col0=h * task["q_hs"] + task["q_col0"]).float()
        if task.has("ROPE"):
            q = rotate(q, cos, sin)
        if task.has("MLA"):
            r, rope = dim, task["rope_dim"]
            pe = mem.mat(task, "pe", T, rope, row0=b * T, col0=h * task["pe_hs"] + task["pe_col0"]).float()
            keys, values = cache[:, :r], cache[:, :r]
            scores = q @ keys.T + pe @ cache[:, r:r + rope].T
        else:
            g = h // task["group"]
            keys = cache[:, g * task["kv_hs"]: g * task["kv_hs"] + dim]
            values = cache[:, task["v_col0"] + g * task["kv_hs"]: task["v_col0"] + g * task["kv_hs"] + dim]
            scores = q @ keys.T
        scores = (scores * task["scale"]).masked_fill(~valid, float("-inf"))
        m = scores.max(dim=-1, keepdim=True).values
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(scores - m_safe)
        l = p.sum(-1, keepdim=True)
        o = torch.where(l > 0, (p @ values) / l.clamp_min(1e-30), torch.zeros(T, dim, device=mem.device))
        lse = torch.where(l[:, 0] > 0, m_safe[:, 0] + torch.log(l[:, 0].clamp_min(1e-30)),
                          torch.full((T,), float("-inf"), device=mem.device))
        for t in range(T):
            row = ((b * ns + task["split"]) * T + t) * nh + h
            mem.mat(task, "op", 1, dim, row0=row, ld=dim).copy_(o[t:t + 1])
            mem.flat(task, "lse", row, 1).copy_(lse[t:t + 1])


def write_new_rows(task, mem, rows: torch.Tensor, limit: torch.Tensor, cos, sin, j0: int, j1: int) -> None:
    """ATTENTION[ROPE]: the step's new keys (rotated) and values of the task's KV head into the cache
    rows [j0, j1) that hold their positions."""
    b, T, dim = task["b"], task["T"], task["dim"]
    k_col = (task["h0"] // task["group"]) * task["kv_hs"]
    v_col = task["v_col0"] + k_col
    for t in range(T):
        pos = int(limit[t])
        if j0 <= pos < j1:
            r = b * T + t
            k = mem.mat(task, "kn", 1, dim, row0=r, col0=k_col).float()
            v = mem.mat(task, "vn", 1, dim, row0=r, col0=k_col, ld=task["kn.ld"])
            rows[pos, k_col:k_col + dim] = rotate(k, cos[t:t + 1], sin[t:t + 1]).to(rows.dtype)[0]
            rows[pos, v_col:v_col + dim] = v.to(rows.dtype)[0]


def reference_combine(task, mem) -> None:
    b, T, nh, ns, dim = task["b"], task["T"], task["nheads"], task["nsplits"], task["dim"]
    h0, h1, c0, c1 = task["h0"], task["h1"], task["c0"], task["c1"]
    for t in range(T):
        rows = torch.tensor([((b * ns + s) * T + t) * nh for s in range(ns)], device=mem.device)
        for h in range(h0, h1):
            lse = mem.bufs[task["lse.buf"]][task["lse.off"] + rows + h]
            parts = mem.bufs[task["op.buf"]][task["op.off"] + ((rows + h) * dim)[:, None]
                                             + torch.arange(c0, c1, device=mem.device)]
            weights = torch.softmax(lse, dim=0)  # exp(lse_s - logsumexp(lse))
            out = (weights[:, None] * parts).sum(0)
            mem.mat(task, "out", 1, c1 - c0, row0=b * T + t, col0=h * dim + c0).copy_(out[None])


# ---- GPU body ----------------------------------------------------------------------------
@triton.jit
def kv_block(cache, width, jb, j1, k_col, v_col, dim, d, dmask, e, emask, mla, BJ: tl.constexpr,
             KIND: tl.constexpr, EF: tl.constexpr = 0):
    """Cache positions jb..jb+BJ (< j1): keys, MLA rope keys, GQA values (MLA's values are its keys).
    KIND 1 (every task MLA) or 2 (none) leaves out the other kind's load: a load predicated off at
    run time still costs its address arithmetic and its registers (the values' 32 per thread made
    MLA attention spill).  EF 2 (a launch variant): evict-first, since a step reads each cache row once."""
    ev: tl.constexpr = "evict_first" if EF >= 2 else ""
    js = jb + tl.arange(0, BJ)
    jmask = js < j1
    rows = cache + js[:, None].to(tl.int64) * width
    keys = tl.load(rows + k_col + d[None, :], mask=jmask[:, None] & dmask[None, :], other=0.0, eviction_policy=ev)
    if KIND == 1:
        kpe = tl.load(rows + dim + e[None, :], mask=jmask[:, None] & emask[None, :], other=0.0, eviction_policy=ev)
        values = keys
    elif KIND == 2:
        kpe = keys  # never read
        values = tl.load(rows + v_col + d[None, :], mask=jmask[:, None] & dmask[None, :], other=0.0,
                         eviction_policy=ev)
    else:
        kpe = tl.load(rows + dim + e[None, :], mask=jmask[:, None] & emask[None, :] & mla, other=0.0,
                      eviction_policy=ev)
        values = tl.load(rows + v_col + d[None, :], mask=jmask[:, None] & dmask[None, :] & (mla == 0), other=0.0,
                         eviction_policy=ev)
    return keys, kpe, values


@triton.jit
def rotate_half(x, src, tab, d, dim, m):
    """x = src[d] (rows of a [.., dim] tile) rotated by the angles of table rows tab ([cos | sin], dim wide):
    pairs (i, i + dim/2), as ROPE's body does it."""
    half = dim // 2
    first = d < half
    x2 = tl.load(src + tl.where(first, d + half, d - half), mask=m, other=0.0, cache_modifier=".cg")
    i = tl.where(first, d, d - half)
    cos = tl.load(tab + i, mask=m, other=0.0, cache_modifier=".cg")
    sin = tl.load(tab + half + i, mask=m, other=0.0, cache_modifier=".cg")
    return tl.where(first, x * cos - x2 * sin, x * cos + x2 * sin)


@triton.jit
def new_rows(word, A, cache, width, limit, T, b, j0, j_end, k_col, v_col, dim, d):
    """ATTENTION[ROPE]: the step's new keys of this KV head (rotated) and values into the cache rows [j0, j_end)
    that hold their positions, then a barrier, so the split's loads see them."""
    kn, kn_ld, vn = A + off(word, ATTENTION_KN_OFF), fld(word, ATTENTION_KN_LD), A + off(word, ATTENTION_VN_OFF)
    tab = A + off(word, ATTENTION_TAB_OFF)
    m = d < dim
    for t in range(0, T):
        pos = limit + t
        if (pos >= j0) & (pos < j_end):
            r = b * T + t
            x = tl.load(kn + r * kn_ld + k_col + d, mask=m, other=0.0, cache_modifier=".cg")
            k = rotate_half(x, kn + r * kn_ld + k_col, tab + r * dim, d, dim, m)
            v = tl.load(vn + r * kn_ld + k_col + d, mask=m, other=0.0, cache_modifier=".cg")
            row = cache + pos.to(tl.int64) * width
            tl.store(row + k_col + d, k.to(cache.dtype.element_ty), mask=m)
            tl.store(row + v_col + d, v.to(cache.dtype.element_ty), mask=m)
    tl.debug_barrier()


@triton.jit
def split_of(word, A, I, C, mla, ALIGN: tl.constexpr):
    """A task's sizes and pointers (mla: a constant where the plan has one kind)."""
    T, S, b = fld(word, ATTENTION_T), fld(word, ATTENTION_S), fld(word, ATTENTION_B)
    width = aligned(fld(word, ATTENTION_WIDTH), ALIGN)
    h0, h1 = fld(word, ATTENTION_H0), fld(word, ATTENTION_H1)
    nh, ns = fld(word, ATTENTION_NHEADS), fld(word, ATTENTION_NSPLITS)
    split, split_len = fld(word, ATTENTION_SPLIT), fld(word, ATTENTION_SPLIT_LEN)
    dim, scale = aligned(fld(word, ATTENTION_DIM), ALIGN), ffld(word, ATTENTION_SCALE)
    rope_dim = aligned(fld(word, ATTENTION_ROPE_DIM), ALIGN)
    # sizes and offsets the host checked are multiples of ALIGN (launch.ALIGNED_FIELDS), written so the
    # compiler sees it: the query rows load as 16-byte vectors, not 32 scalar loads per thread
    q_ptr, q_ld = A + aligned(off(word, ATTENTION_Q_OFF), ALIGN), aligned(fld(word, ATTENTION_Q_LD), ALIGN)
    q_hs, q_col0 = aligned(fld(word, ATTENTION_Q_HS), ALIGN), aligned(fld(word, ATTENTION_Q_COL0), ALIGN)
    pe_ptr, pe_ld = A + aligned(off(word, ATTENTION_PE_OFF), ALIGN), aligned(fld(word, ATTENTION_PE_LD), ALIGN)
    pe_hs, pe_col0 = aligned(fld(word, ATTENTION_PE_HS), ALIGN), aligned(fld(word, ATTENTION_PE_COL0), ALIGN)
    cache = C + aligned(off(word, ATTENTION_CACHE_OFF), ALIGN) + b.to(tl.int64) * S * width
    limit = cache_limit(word, I, b, ".cg")
    op_ptr, lse_ptr = A + aligned(off(word, ATTENTION_OP_OFF), ALIGN), A + off(word, ATTENTION_LSE_OFF)
    group = fld(word, ATTENTION_GROUP)
    k_col = (h0 // group) * aligned(fld(word, ATTENTION_KV_HS), ALIGN)  # GQA: one KV head per task
    v_col = aligned(fld(word, ATTENTION_V_COL0), ALIGN) + k_col
    if mla:
        k_col = 0
        v_col = 0
    j0 = split * split_len
    j1 = split_end(j0, split_len, S, limit, T)
    return (T, S, b, width, h0, h1, nh, ns, split, dim, scale, rope_dim, q_ptr, q_ld, q_hs, q_col0, pe_ptr, pe_ld,
            pe_hs, pe_col0, cache, limit, op_ptr, lse_ptr, k_col, v_col, j0, j1)


@triton.jit
def cache_limit(word, I, b, CACHE: tl.constexpr):
    """Sequence b's cache length + the step's position offset: token t reads positions <= limit + t.
    CACHE: the length's load modifier (".cg" after the task's wait; prefetch_split's, before it, "")."""
    return tl.load(I + off(word, ATTENTION_CL_OFF) + b, cache_modifier=CACHE) + fld(word, ATTENTION_POS_OFFSET)


@triton.jit
def split_end(j0, split_len, S, limit, T):
    """The end of a split's readable positions: the last token reads positions <= limit + T - 1."""
    return tl.minimum(tl.minimum(j0 + split_len, S), limit + T)


@triton.jit
def body(word, A, I, C, BM: tl.constexpr, BJ: tl.constexpr, DMAX: tl.constexpr, RMAX: tl.constexpr,
         STAGES: tl.constexpr, ALIGN: tl.constexpr, DOT_PREC: tl.constexpr, KIND: tl.constexpr, EF: tl.constexpr = 0,
         ROPE: tl.constexpr = 0, QIX: tl.constexpr = 0):
    """STAGES 2: the next cache block is in flight while this one is reduced; 3: the next two (a launch
    variant, +3% on llama-1b: a block's ~2 us is its arithmetic's dependent chain, not its loads, session 21);
    1: one at a time.  The sums are the same in every order of loads.
    KIND: 1 every attention task of the plan is MLA, 2 none is (compiled for that kind alone), 0 read
    the flag per task.  ROPE 1: the plan has ATTENTION[ROPE] tasks (compiled in only then; the flag read per task).
    QIX (3 for MLA plans, 0 for GQA; launch.block_sizes): bit 1, a query row's token and head by a float
    reciprocal, not the emulated integer division (~20 instructions an element); bit 2, the cache length loaded
    after the query rows, so its L2 round trip overlaps theirs (QIX=0's first use of it, j1, stalls before they
    are requested).  The same rows either way: the same bits."""
    if KIND == 0:
        mla = has(fld(word, ATTENTION_FLAGS), FLAG_ATTENTION_MLA)
    else:
        mla: tl.constexpr = KIND == 1
    (T, S, b, width, h0, h1, nh, ns, split, dim, scale, rope_dim, q_ptr, q_ld, q_hs, q_col0, pe_ptr, pe_ld, pe_hs,
     pe_col0, cache, limit, op_ptr, lse_ptr, k_col, v_col, j0, j1) = split_of(word, A, I, C, mla, ALIGN)
    heads = h1 - h0
    d = tl.arange(0, DMAX)
    dmask = d < dim
    e = tl.arange(0, RMAX)
    emask = e < rope_dim
    rotated = False
    if ROPE:
        rotated = has(fld(word, ATTENTION_FLAGS), FLAG_ATTENTION_ROPE)
        if rotated:  # before any thread reads the split's rows
            new_rows(word, A, cache, width, limit, T, b, j0, tl.minimum(j0 + fld(word, ATTENTION_SPLIT_LEN), S), k_col,
                     v_col, dim, d)
    for mb in range(0, T * heads, BM):
        rr = mb + tl.arange(0, BM)
        rvalid = rr < T * heads
        # (rr + 0.5) / heads lies 0.5 / heads from an integer: exact while rr < 2^20 with the reciprocal's
        # approximate division (div.full.f32, 2 ulp); rr < T·heads + BM here, a few thousand at most
        if QIX & 1:
            t = ((rr.to(tl.float32) + 0.5) * (1.0 / heads)).to(tl.int32)
            h = h0 + rr - t * heads
        else:
            t = rr // heads
            h = h0 + rr % heads
        q_rows = b * T + t
        q = tl.load(q_ptr + q_rows[:, None] * q_ld + h[:, None] * q_hs + q_col0 + d[None, :],
                    mask=rvalid[:, None] & dmask[None, :], other=0.0, cache_modifier=".cg")
        if QIX & 2:  # the same length, requested only now (split_of's load of it is then dead code unless ROPE)
            limit = cache_limit(word, I, b, ".cg")
            j1 = split_end(j0, fld(word, ATTENTION_SPLIT_LEN), S, limit, T)
        if rotated:
            q = rotate_half(q, q_ptr + q_rows[:, None] * q_ld + h[:, None] * q_hs + q_col0,
                            A + off(word, ATTENTION_TAB_OFF) + q_rows[:, None] * dim, d[None, :], dim,
                            rvalid[:, None] & dmask[None, :])
        pe = tl.load(pe_ptr + q_rows[:, None] * pe_ld + h[:, None] * pe_hs + pe_col0 + e[None, :],
                     mask=rvalid[:, None] & emask[None, :] & mla, other=0.0, cache_modifier=".cg")
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, DMAX), tl.float32)
        keys, kpe, values = kv_block(cache, width, j0, j1, k_col, v_col, dim, d, dmask, e, emask, mla, BJ, KIND, EF)
        if STAGES > 2:  # the block after it too, before the loop (rows past j1 are masked off: no traffic)
            keys_1, kpe_1, values_1 = kv_block(cache, width, j0 + BJ, j1, k_col, v_col, dim, d, dmask, e, emask, mla,
                                               BJ, KIND, EF)
        for jb in range(j0, j1, BJ):
            if STAGES > 1:  # request the block STAGES - 1 ahead before this one's arithmetic
                keys_n, kpe_n, values_n = kv_block(cache, width, jb + (STAGES - 1) * BJ, j1, k_col, v_col, dim, d,
                                                   dmask, e, emask, mla, BJ, KIND, EF)
            js = jb + tl.arange(0, BJ)
            jmask = js < j1
            s = mma(q, tl.trans(keys), tl.zeros((BM, BJ), tl.float32), DOT_PREC)
            if mla:
                s = mma(pe, tl.trans(kpe), s, DOT_PREC)
                values = keys
            ok = rvalid[:, None] & jmask[None, :] & (js[None, :] <= (limit + t)[:, None])
            s = tl.where(ok, s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = mma(p, values, acc * alpha[:, None], DOT_PREC)
            m_i = m_new
            if STAGES > 2:
                keys, kpe, values = keys_1, kpe_1, values_1
                keys_1, kpe_1, values_1 = keys_n, kpe_n, values_n
            elif STAGES > 1:
                keys, kpe, values = keys_n, kpe_n, values_n
            else:
                keys, kpe, values = kv_block(cache, width, jb + BJ, j1, k_col, v_col, dim, d, dmask, e, emask, mla, BJ,
                                             KIND, EF)
        has_keys = l_i > 0
        o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        out_rows = ((b * ns + split) * T + t) * nh + h
        tl.store(op_ptr + out_rows[:, None].to(tl.int64) * dim + d[None, :], o, mask=rvalid[:, None] & dmask[None, :])
        tl.store(lse_ptr + out_rows, lse, mask=rvalid)


@triton.jit
def prefetch_split(word, I, C, ALIGN: tl.constexpr, DMAX: tl.constexpr, APF: tl.constexpr, KIND: tl.constexpr):
    """APF (on by default on the GPU): a split's cache rows asked of the L2 before the task's dependency wait.
    Always safe: rows an earlier step wrote are final, and a row this step writes reaches the L2 after the
    prefetch or over it (the L2 is where every SM's writes land; the body loads after its acquire, which
    invalidated this SM's L1), so the body's loads find fresh rows, sooner.  Rows stop at the positions the step
    may read: the cache length is read before the wait, so it may be a step old, which only changes what is
    asked for.  MLA (APF >= 1): the rows in one bulk prefetch (thread 0).  GQA (APF 2): a row holds every KV
    head's keys and values and a task reads one head's, so each thread asks for the lines of that head's key and
    value in some rows (prefetch.global.L2, one instruction per line).  Compiled to nothing where neither
    applies (APF 1 in a GQA-only kernel)."""
    if (KIND != 2) or (APF == 2):
        mla = has(fld(word, ATTENTION_FLAGS), FLAG_ATTENTION_MLA)
        S, b, split_len = fld(word, ATTENTION_S), fld(word, ATTENTION_B), fld(word, ATTENTION_SPLIT_LEN)
        width = aligned(fld(word, ATTENTION_WIDTH), ALIGN)
        j0 = fld(word, ATTENTION_SPLIT) * split_len
        limit = cache_limit(word, I, b, "") + fld(word, ATTENTION_T)
        rows = tl.maximum(tl.minimum(tl.minimum(split_len, S - j0), limit - j0), 0)
        cache = C + aligned(off(word, ATTENTION_CACHE_OFF), ALIGN) + (b.to(tl.int64) * S + j0) * width
        if KIND != 2:
            if mla & (rows > 0):
                nbytes = rows.to(tl.int64) * width * (C.dtype.element_ty.primitive_bitwidth // 8)
                prefetch_l2(cache, tl.minimum(nbytes, 1 << 30).to(tl.int32))  # a hint: at most 1 GiB of it
        if APF == 2 and KIND != 1:
            if (not mla) & (rows > 0):
                head_lines(cache, rows, width, word, ALIGN, DMAX)


@triton.jit
def head_lines(cache, rows, width, word, ALIGN: tl.constexpr, DMAX: tl.constexpr):
    """APF 2's GQA prefetch: in rows 0..rows of a split, the 128-byte lines that hold the task's KV head's key
    and value columns (one every 128 bytes from the first column, and the last column's; a head of 64 bf16
    columns is one line, or two where its start is not a line's)."""
    LINE: tl.constexpr = 1024 // cache.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
    NL: tl.constexpr = 2 * DMAX // LINE if DMAX >= LINE else 2  # a power of two, at least the lines a head spans
    BJP: tl.constexpr = 128
    dim, group = aligned(fld(word, ATTENTION_DIM), ALIGN), fld(word, ATTENTION_GROUP)
    k_col = (fld(word, ATTENTION_H0) // group) * aligned(fld(word, ATTENTION_KV_HS), ALIGN)
    v_col = aligned(fld(word, ATTENTION_V_COL0), ALIGN) + k_col
    cols = tl.minimum(tl.arange(0, NL) * LINE, dim - 1)
    for jb in range(0, rows, BJP):
        js = tl.minimum(jb + tl.arange(0, BJP), rows - 1)  # past the split's end: its last row again
        at = js[:, None].to(tl.int64) * width + cols[None, :]
        prefetch_lines_l2(cache + k_col + at)
        prefetch_lines_l2(cache + v_col + at)


@triton.jit
def combine_block(sb, first, stride, ns, dim, d, dmask, lse_ptr, op_ptr, BSC: tl.constexpr):
    """Splits sb..sb+BSC of one (token, head): their log-sum-exps and partial outputs (-inf / 0 past ns)."""
    s = sb + tl.arange(0, BSC)
    rows = first + s * stride
    lse = tl.load(lse_ptr + rows, mask=s < ns, other=-float("inf"), cache_modifier=".cg")
    part = tl.load(op_ptr + rows[:, None].to(tl.int64) * dim + d[None, :], mask=(s < ns)[:, None] & dmask[None, :],
                   other=0.0, cache_modifier=".cg")
    return lse, part


@triton.jit
def combine_body(word, A, BSC: tl.constexpr, BCW: tl.constexpr, CPF: tl.constexpr, ALIGN: tl.constexpr):
    """Per token and head, columns c0..c1: out = sum_s exp(lse[s] - LSE) o[s, :], LSE = log sum_s exp(lse[s]).
    [BSC splits, BCW columns] per load and an online maximum: ceil(nsplits / BSC) memory round trips
    per column block, not 2 x nsplits dependent ones (that serial loop took 33 µs per dsv2-lite layer:
    docs/PERF.md); the plan splits columns over tasks so that one round trip reads every split.
    CPF 1: the next block is requested before this one is summed (more registers).
    Each lane keeps its own partial sum until the end: a fixed order, whatever the neighbours."""
    b, T, nh, ns, dim = (fld(word, ATTN_COMBINE_B), fld(word, ATTN_COMBINE_T), fld(word, ATTN_COMBINE_NHEADS),
                         fld(word, ATTN_COMBINE_NSPLITS), aligned(fld(word, ATTN_COMBINE_DIM), ALIGN))
    h0, h1 = fld(word, ATTN_COMBINE_H0), fld(word, ATTN_COMBINE_H1)
    c0, c1 = aligned(fld(word, ATTN_COMBINE_C0), ALIGN), aligned(fld(word, ATTN_COMBINE_C1), ALIGN)
    op_ptr, lse_ptr = A + aligned(off(word, ATTN_COMBINE_OP_OFF), ALIGN), A + off(word, ATTN_COMBINE_LSE_OFF)
    o_ptr, o_ld = A + aligned(off(word, ATTN_COMBINE_OUT_OFF), ALIGN), aligned(fld(word, ATTN_COMBINE_OUT_LD), ALIGN)
    stride = T * nh  # from one split's row of a (token, head) to the next split's
    nc = tl.cdiv(c1 - c0, BCW)
    for i in range(T * (h1 - h0) * nc):  # (token, head, column block)
        t, h, cb = i // (nc * (h1 - h0)), h0 + (i // nc) % (h1 - h0), c0 + (i % nc) * BCW
        d = cb + tl.arange(0, BCW)
        dmask = d < c1
        first = (b * ns * T + t) * nh + h
        m = tl.full([], -float("inf"), tl.float32)
        total = tl.zeros((BSC,), tl.float32)
        acc = tl.zeros((BSC, BCW), tl.float32)
        lse, part = combine_block(0, first, stride, ns, dim, d, dmask, lse_ptr, op_ptr, BSC)
        for sb in range(0, ns, BSC):
            if CPF:
                lse_n, part_n = combine_block(sb + BSC, first, stride, ns, dim, d, dmask, lse_ptr, op_ptr, BSC)
            m_new = tl.maximum(m, tl.max(lse, axis=0))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            scale = tl.exp(m - m_safe)  # rescales what the earlier blocks summed
            wgt = tl.exp(lse - m_safe)
            total = total * scale + wgt
            acc = acc * scale + wgt[:, None] * part
            m = m_new
            if CPF:
                lse, part = lse_n, part_n
            else:
                lse, part = combine_block(sb + BSC, first, stride, ns, dim, d, dmask, lse_ptr, op_ptr, BSC)
        den = tl.sum(total, axis=0)
        out = tl.sum(acc, axis=0) / tl.where(den > 0, den, 1.0)
        tl.store(o_ptr + (b * T + t) * o_ld + h * dim + d, out, mask=dmask)
