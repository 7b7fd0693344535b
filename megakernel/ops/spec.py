"""Speculative decoding on the device: ACCEPT (verify drafts, choose the bonus token, advance
positions) and GATHER (the accepted row of each sequence)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ffld, fld, has, off
from .fields import (ACCEPT_ACC_OFF, ACCEPT_B0, ACCEPT_B1, ACCEPT_BASE_OFF, ACCEPT_CL_OFF, ACCEPT_EMIT_OFF,
                     ACCEPT_FLAGS, ACCEPT_FOLLOW_OFF, ACCEPT_LENS_OFF, ACCEPT_LG_LD, ACCEPT_LG_OFF, ACCEPT_MTP_OFF,
                     ACCEPT_NEXT_LD, ACCEPT_NEXT_OFF, ACCEPT_RNG_OFF, ACCEPT_T, ACCEPT_TEMPERATURE, ACCEPT_TGT_OFF,
                     ACCEPT_TOK_OFF, ACCEPT_TOP_P, ACCEPT_V, FLAG_ACCEPT_ALL, FLAG_ACCEPT_SAMPLE, FLAG_GATHER_INT,
                     GATHER_B0, GATHER_B1,
                     GATHER_COLS, GATHER_FLAGS, GATHER_IDX_OFF, GATHER_OUT_LD, GATHER_OUT_OFF, GATHER_SRC_LD,
                     GATHER_SRC_OFF, GATHER_T)


MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a counter-based generator the GPU can reproduce."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, row: int, draw: int) -> float:
    """A uniform in [0, 1) for (step seed, row, draw)."""
    return (_mix(((seed & 0xFFFFFFFF) << 32) ^ (row << 8) ^ draw) >> 11) / 2.0**53


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / temperature) restricted to the smallest top set with mass >= top_p, and the
    tokens tied with its least likely one (fp64)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p = p.sort(descending=True).values
        keep = sorted_p.cumsum(0) - sorted_p < top_p  # the tokens needed to reach top_p
        # tokens tied with the last one needed all stay: the set does not depend on how a sort orders ties
        p = torch.where(p >= sorted_p[keep].min(), p, torch.zeros_like(p))
        p = p / p.sum()
    return p


def sample(p: torch.Tensor, u: float) -> int:
    """Inverse CDF: the first token whose cumulative mass exceeds u."""
    c = p.cumsum(0)
    target = torch.tensor(u * float(c[-1]), dtype=c.dtype, device=c.device)
    return int(min(int(torch.searchsorted(c, target, right=True)), p.numel() - 1))


def _accept_sampling(task, mem, b: int, tokens: torch.Tensor) -> tuple[int, int]:
    """Speculative sampling with point-mass drafts: keep draft d with probability p(d); on the first
    rejection resample from p without d; if every draft stays, sample the bonus token from p."""
    T, V = task["T"], task["V"]
    seed = int(mem.flat(task, "rng", b, 1)[0])
    temp, top_p = task["temperature"], task["top_p"]
    drafts = 0 if task.has("ALL") else T - 1
    for i in range(drafts):
        p = target_probs(mem.mat(task, "lg", 1, V, row0=b * T + i)[0], temp, top_p)
        d = int(tokens[i + 1])
        if uniform(seed, i, 0) < float(p[d]):
            continue
        p[d] = 0.0
        return i, sample(p / p.sum(), uniform(seed, i, 1))
    last = T - 1
    p = target_probs(mem.mat(task, "lg", 1, V, row0=b * T + last)[0], temp, top_p)
    return (T - 1, sample(p, uniform(seed, last, 1)))


def reference_accept(task, mem) -> None:
    T, b0, b1 = task["T"], task["b0"], task["b1"]
    for b in range(b0, b1):
        tokens = mem.flat(task, "tok", b * T, T).long()
        targets = mem.flat(task, "tgt", b * T, T).long()
        if task.has("SAMPLE"):
            a, bonus = _accept_sampling(task, mem, b, tokens)
        elif task.has("ALL"):
            a, bonus = T - 1, int(targets[T - 1])
        else:
            a = 0
            while a < T - 1 and int(tokens[a + 1]) == int(targets[a]):
                a += 1
            bonus = int(targets[a])
        emitted = torch.full((T,), -1, dtype=torch.int32)
        emitted[:a] = tokens[1:a + 1].int().cpu()
        emitted[a] = bonus
        mtp = torch.full((T,), bonus, dtype=torch.int32)
        mtp[:a] = tokens[1:a + 1].int().cpu()
        follow = int(mem.flat(task, "follow", b, 1)[0])
        if task.has("ALL") and follow >= 0:
            mtp[T - 1] = follow
        length = int(mem.flat(task, "cl", b, 1)[0])
        mem.flat(task, "acc", b, 1).fill_(a)
        mem.flat(task, "emit", b * T, T).copy_(emitted.to(mem.device))
        mem.mat(task, "next", 1, 1, row0=b).fill_(bonus)
        mem.flat(task, "base", b, 1).fill_(length + a)
        mem.flat(task, "lens", b, 1).fill_(length + a + 1)
        mem.flat(task, "mtp", b * T, T).copy_(mtp.to(mem.device))


def reference_gather(task, mem) -> None:
    T, cols = task["T"], task["cols"]
    for b in range(task["b0"], task["b1"]):
        row = b * T + int(mem.flat(task, "idx", b, 1)[0])
        mem.mat(task, "out", 1, cols, row0=b).copy_(mem.mat(task, "src", 1, cols, row0=row))


# ---- GPU bodies ------------------------------------------------------------------------------
@triton.jit
def mix64(x):
    """_mix on uint64 (wrapping arithmetic)."""
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def uniform_dev(seed, row, draw: tl.constexpr):
    """uniform() on the device: the same bits."""
    zero = tl.zeros([], tl.int64)  # row may be a constant
    x = (((zero + seed) & 0xFFFFFFFF).to(tl.uint64) << 32) ^ ((zero + row).to(tl.uint64) << 8) ^ draw
    return (mix64(x) >> 11).to(tl.float64) / 9007199254740992.0


@triton.jit
def probs_chunk(row, v, V, temp, mx, z, cut):
    """softmax(logits / temp) at columns v, fp64, zero outside the vocabulary and at or below `cut`."""
    lg = tl.load(row + v, mask=v < V, other=-float("inf"), cache_modifier=".cg").to(tl.float64)
    p = tl.exp(lg / temp - mx) / z
    return tl.where((v < V) & (p > cut), p, 0.0)


@triton.jit
def row_dist(row, V, temp, top_p, BV: tl.constexpr):
    """target_probs() of one logits row, as (max, partition, cut, kept mass): p_j = exp(l_j/temp - max)
    / partition, kept where p_j > cut (the smallest top set with mass >= top_p), then / kept mass.
    The cut is found without sorting: bisection on the probability value until one probability
    lies between the bounds (the mass strictly above a value falls as the value rises), or only
    tied ones do (they all stay, as in target_probs)."""
    v0 = tl.arange(0, BV)
    mx = tl.full([], -float("inf"), tl.float64)
    for vb in range(0, V, BV):
        lg = tl.load(row + vb + v0, mask=vb + v0 < V, other=-float("inf"), cache_modifier=".cg").to(tl.float64)
        mx = tl.maximum(mx, tl.max(lg / temp, axis=0))
    z = tl.zeros([], tl.float64)
    for vb in range(0, V, BV):
        lg = tl.load(row + vb + v0, mask=vb + v0 < V, other=-float("inf"), cache_modifier=".cg").to(tl.float64)
        z += tl.sum(tl.exp(lg / temp - mx), axis=0)
    cut = tl.full([], -1.0, tl.float64)
    kept = tl.full([], 1.0, tl.float64)
    if top_p < 1.0:
        lo = tl.zeros([], tl.float64)  # mass above lo >= top_p
        hi = 1.0 / z  # the largest probability: nothing above it
        between = V
        progress = 1
        while (between > 1) & (progress == 1):  # > 1 left only when tied: stops where fp64 cannot split
            mid = (lo + hi) * 0.5
            progress = ((mid > lo) & (mid < hi)).to(tl.int32)
            above = tl.zeros([], tl.float64)
            n_low = 0
            n_high = 0
            for vb in range(0, V, BV):
                p = probs_chunk(row, vb + v0, V, temp, mx, z, -1.0)
                above += tl.sum(tl.where(p > mid, p, 0.0), axis=0)
                n_low += tl.sum(((p > lo) & (p <= mid)).to(tl.int32), axis=0)
                n_high += tl.sum(((p > mid) & (p <= hi)).to(tl.int32), axis=0)
            if above >= top_p:
                lo = mid
                between = n_high
            else:
                hi = mid
                between = n_low
        cut = lo
        kept = tl.zeros([], tl.float64)
        for vb in range(0, V, BV):
            kept += tl.sum(probs_chunk(row, vb + v0, V, temp, mx, z, cut), axis=0)
    return mx, z, cut, kept


@triton.jit
def sample_row(row, V, temp, mx, z, cut, kept, exclude, u, BV: tl.constexpr):
    """sample(): the first column whose cumulative mass exceeds u x total, over the kept
    probabilities without column `exclude`.  The total comes from the same chunked scan the
    search runs, so the search always ends on a column with mass."""
    v0 = tl.arange(0, BV)
    total = tl.zeros([], tl.float64)
    for vb in range(0, V, BV):
        q = tl.where(vb + v0 == exclude, 0.0, probs_chunk(row, vb + v0, V, temp, mx, z, cut) / kept)
        total += tl.sum(tl.where(v0 == BV - 1, tl.cumsum(q, axis=0), 0.0), axis=0)
    target = u * total
    run = tl.zeros([], tl.float64)
    pick = V - 1
    found = 0
    for vb in range(0, V, BV):
        q = tl.where(vb + v0 == exclude, 0.0, probs_chunk(row, vb + v0, V, temp, mx, z, cut) / kept)
        c = run + tl.cumsum(q, axis=0)
        # q > 0: a parallel scan may round a zero-mass column above its neighbour; never pick one
        first = tl.min(tl.where((c > target) & (q > 0), vb + v0, V), axis=0)
        if (found == 0) & (first < V):
            pick = first
            found = 1
        run += tl.sum(tl.where(v0 == BV - 1, tl.cumsum(q, axis=0), 0.0), axis=0)
    return pick


@triton.jit
def sample_accept(word, A, I, b, T, all_mode, tok, BV: tl.constexpr):
    """_accept_sampling() on the device: (accepted drafts, bonus token) of sequence b."""
    lg, lg_ld, V = A + off(word, ACCEPT_LG_OFF), fld(word, ACCEPT_LG_LD), fld(word, ACCEPT_V)
    temp = ffld(word, ACCEPT_TEMPERATURE).to(tl.float64)
    top_p = ffld(word, ACCEPT_TOP_P).to(tl.float64)
    seed = tl.load(I + off(word, ACCEPT_RNG_OFF) + b, cache_modifier=".cg")
    drafts = tl.where(all_mode, 0, T - 1)
    a = T - 1
    bonus = 0
    rejected = 0
    i = 0
    while (i < drafts) & (rejected == 0):
        row = lg + (b * T + i).to(tl.int64) * lg_ld
        mx, z, cut, kept = row_dist(row, V, temp, top_p, BV)
        d = tl.load(tok + b * T + i + 1, cache_modifier=".cg")
        two = d + tl.arange(0, 2)
        p_d = tl.sum(tl.where(two == d, probs_chunk(row, two, V, temp, mx, z, cut), 0.0), axis=0) / kept
        if uniform_dev(seed, i, 0) >= p_d:
            rejected = 1
            a = i
            bonus = sample_row(row, V, temp, mx, z, cut, kept, d, uniform_dev(seed, i, 1), BV)
        i += 1
    if rejected == 0:
        row = lg + (b * T + T - 1).to(tl.int64) * lg_ld
        mx, z, cut, kept = row_dist(row, V, temp, top_p, BV)
        bonus = sample_row(row, V, temp, mx, z, cut, kept, -1, uniform_dev(seed, T - 1, 1), BV)
    return a, bonus


@triton.jit
def accept_body(word, A, I, BT: tl.constexpr, SAMPLE: tl.constexpr, BV: tl.constexpr):
    """Greedy: the longest prefix of drafts equal to the targets, then the target after it.  SAMPLE
    (a constexpr: compiled only into kernels for sampling plans): speculative sampling."""
    T, all_mode = fld(word, ACCEPT_T), has(fld(word, ACCEPT_FLAGS), FLAG_ACCEPT_ALL)
    tok, tgt, cl, follow = (I + off(word, ACCEPT_TOK_OFF), I + off(word, ACCEPT_TGT_OFF), I + off(word, ACCEPT_CL_OFF),
                            I + off(word, ACCEPT_FOLLOW_OFF))
    acc, emit, base, lens, mtp = (I + off(word, ACCEPT_ACC_OFF), I + off(word, ACCEPT_EMIT_OFF),
                                  I + off(word, ACCEPT_BASE_OFF), I + off(word, ACCEPT_LENS_OFF),
                                  I + off(word, ACCEPT_MTP_OFF))
    nxt, nxt_ld = I + off(word, ACCEPT_NEXT_OFF), fld(word, ACCEPT_NEXT_LD)
    i = tl.arange(0, BT)
    valid = i < T
    for b in range(fld(word, ACCEPT_B0), fld(word, ACCEPT_B1)):
        drafts = tl.load(tok + b * T + i + 1, mask=i + 1 < T, other=-1, cache_modifier=".cg")
        targets = tl.load(tgt + b * T + i, mask=valid, other=-2, cache_modifier=".cg")
        # a = the first i where draft i+1 disagrees with target i (T-1 if all agree)
        miss = tl.where((drafts != targets) & (i < T - 1), i, T - 1)
        a = tl.where(all_mode, T - 1, tl.min(miss, axis=0))
        bonus = tl.sum(tl.where(i == a, targets, 0), axis=0)
        if SAMPLE:
            if has(fld(word, ACCEPT_FLAGS), FLAG_ACCEPT_SAMPLE):
                a, bonus = sample_accept(word, A, I, b, T, all_mode, tok, BV)
        tl.store(emit + b * T + i, tl.where(i < a, drafts, tl.where(i == a, bonus, -1)), mask=valid)
        f = tl.load(follow + b, cache_modifier=".cg")
        m = tl.where(i < a, drafts, bonus)
        m = tl.where(all_mode & (i == T - 1) & (f >= 0), f, m)
        tl.store(mtp + b * T + i, m, mask=valid)
        length = tl.load(cl + b, cache_modifier=".cg")
        tl.store(acc + b, a)
        tl.store(nxt + b * nxt_ld, bonus)
        tl.store(base + b, length + a)
        tl.store(lens + b, length + a + 1)


@triton.jit
def gather_body(word, A, I, BD: tl.constexpr):
    T, cols, is_int = fld(word, GATHER_T), fld(word, GATHER_COLS), has(fld(word, GATHER_FLAGS), FLAG_GATHER_INT)
    idx = I + off(word, GATHER_IDX_OFF)
    src_ld, out_ld = fld(word, GATHER_SRC_LD), fld(word, GATHER_OUT_LD)
    for b in range(fld(word, GATHER_B0), fld(word, GATHER_B1)):
        row = b * T + tl.load(idx + b, cache_modifier=".cg")
        for cb in range(0, cols, BD):
            c = cb + tl.arange(0, BD)
            m = c < cols
            if is_int:
                iv = tl.load(I + off(word, GATHER_SRC_OFF) + row * src_ld + c, mask=m, other=0, cache_modifier=".cg")
                tl.store(I + off(word, GATHER_OUT_OFF) + b * out_ld + c, iv, mask=m)
            else:
                fv = tl.load(A + off(word, GATHER_SRC_OFF) + row * src_ld + c, mask=m, other=0.0, cache_modifier=".cg")
                tl.store(A + off(word, GATHER_OUT_OFF) + b * out_ld + c, fv, mask=m)
