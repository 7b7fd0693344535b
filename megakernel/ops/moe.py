"""Mixture of experts on the device: ROUTE (scores, top-k, slot table), EXPERT_LINEAR, MOE_COMBINE.

The slot table lists the distinct experts the step's tokens chose (ascending),
and for each the (token, k) pairs routed to it, pair = token·k + j.  Expert
tasks are planned for every possible slot; a task whose slot is empty at run
time does nothing, and each chosen expert's weights are read once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import after_slots, aligned, ffld, fld, has, off
from .fields import (EXPERT_LINEAR_E, EXPERT_LINEAR_FLAGS, EXPERT_LINEAR_K, EXPERT_LINEAR_MAP_BUF,
                     EXPERT_LINEAR_MAP_OFF, EXPERT_LINEAR_N, EXPERT_LINEAR_OUT_LD, EXPERT_LINEAR_OUT_OFF,
                     EXPERT_LINEAR_R0, EXPERT_LINEAR_R1, EXPERT_LINEAR_S, EXPERT_LINEAR_SLICE, EXPERT_LINEAR_SLOT,
                     EXPERT_LINEAR_ST_OFF, EXPERT_LINEAR_TOPK, EXPERT_LINEAR_W2_OFF, EXPERT_LINEAR_WD_OFF,
                     EXPERT_LINEAR_W_ES, EXPERT_LINEAR_W_OFF, EXPERT_LINEAR_X_LD, EXPERT_LINEAR_X_OFF,
                     EXPERT_LINEAR_Y_LD, EXPERT_LINEAR_Y_OFF, FLAG_EXPERT_LINEAR_DOWN_T, FLAG_EXPERT_LINEAR_GATHER,
                     FLAG_EXPERT_LINEAR_SILU_MUL, FLAG_MOE_COMBINE_RES, FLAG_MOE_COMBINE_SHARED, FLAG_ROUTE_GROUPED,
                     FLAG_ROUTE_NOAUX, FLAG_ROUTE_NORM, FLAG_ROUTE_SCORE, FLAG_ROUTE_SIGMOID, FLAG_ROUTE_SLOTS,
                     FLAG_ROUTE_TOPK, MOE_COMBINE_C0, MOE_COMBINE_C1, MOE_COMBINE_FLAGS, MOE_COMBINE_H, MOE_COMBINE_NS,
                     MOE_COMBINE_NSH, MOE_COMBINE_OUT_LD, MOE_COMBINE_OUT_OFF, MOE_COMBINE_R0, MOE_COMBINE_R1,
                     MOE_COMBINE_RES_LD, MOE_COMBINE_RES_OFF, MOE_COMBINE_SHS, MOE_COMBINE_SH_LD, MOE_COMBINE_SH_OFF,
                     MOE_COMBINE_TOPK, MOE_COMBINE_WTS_OFF, MOE_COMBINE_YS, MOE_COMBINE_Y_OFF, ROUTE_BIAS_OFF, ROUTE_E,
                     ROUTE_FLAGS, ROUTE_IDS_OFF, ROUTE_LG_LD, ROUTE_LG_OFF, ROUTE_N, ROUTE_N_GROUP, ROUTE_S,
                     ROUTE_SCALE, ROUTE_SC_BUF, ROUTE_SC_OFF, ROUTE_ST_OFF, ROUTE_TOPK, ROUTE_TOPK_GROUP,
                     ROUTE_WTS_OFF)
from .kmajor import down_partials
from .linear import aligned_base, first_chunk, narrow, pinnable, prefetch_rows, stream_chunks, stream_pinned
from .linear_flat import flat_ok, flat_tile, stream_flat


def reference_route(task, mem) -> None:
    N, E, k, S = task["N"], task["E"], task["topk"], task["S"]
    scores = None
    if task.has("SCORE"):
        logits = mem.mat(task, "lg", N, E).float()
        scores = torch.sigmoid(logits) if task.has("SIGMOID") else torch.softmax(logits, dim=-1)
        if mem.present(task, "sc"):
            mem.flat(task, "sc", 0, N * E).copy_(scores.reshape(-1))
    ids = None
    if task.has("TOPK"):
        if scores is None:
            scores = mem.flat(task, "sc", 0, N * E).view(N, E).clone()
        choice = scores + mem.flat(task, "bias", 0, E) if task.has("NOAUX") else scores
        if task.has("GROUPED"):
            G = task["n_group"]
            groups = choice.view(N, G, E // G)
            group_scores = groups.topk(2, dim=-1).values.sum(-1) if task.has("NOAUX") else groups.max(-1).values
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(task["topk_group"], dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
        ids = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
        if task.has("NORM"):
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        mem.flat(task, "wts", 0, N * k).copy_((weights * task["scale"]).reshape(-1))
        if mem.present(task, "ids"):
            mem.flat(task, "ids", 0, N * k).copy_(ids.reshape(-1))
    if task.has("SLOTS"):
        if ids is None:
            ids = mem.flat(task, "ids", 0, N * k).view(N, k).long()
        # experts and counts of all S slots; a slot's pair list only up to its count (the rest is not read)
        head = torch.full((2 * S,), -1, dtype=torch.int32)
        head[S:] = 0
        flat = ids.reshape(-1).cpu()
        experts = torch.unique(flat)  # sorted ascending
        st = mem.flat(task, "st", 0, 2 * S + S * N * k)
        for s, e in enumerate(experts.tolist()):
            pairs = torch.nonzero(flat == e).flatten()
            head[s] = e
            head[S + s] = pairs.numel()
            st[2 * S + s * N * k: 2 * S + s * N * k + pairs.numel()] = pairs.int().to(mem.device)
        st[:2 * S] = head.to(mem.device)


def slot_pairs(task, mem, slot: int) -> tuple[int, torch.Tensor]:
    """(expert id or -1, pair ids) of a slot."""
    S, P = task["S"], task["N"] * task["topk"]
    expert = int(mem.flat(task, "st", slot, 1)[0])
    count = int(mem.flat(task, "st", S + slot, 1)[0])
    return expert, mem.flat(task, "st", 2 * S + slot * P, count).long()


def main_slot(task, mem, expert: int) -> int:
    """Where the expert's weights sit: its own row, or (helper plans) the main slot its map names."""
    if not mem.present(task, "map"):
        return expert
    slot = int(mem.flat(task, "map", expert, 1)[0])
    if slot < 0:
        raise RuntimeError(f"expert {expert} reached a main expert task, but its map entry is {slot} (not on main); "
                           "was the expert map written before the step?")
    return slot


def reference_expert(task, mem) -> None:
    expert, pairs = slot_pairs(task, mem, task["slot"])
    if expert < 0:
        return
    K, r0, r1 = task["K"], task["r0"], task["r1"]
    rows = pairs // task["topk"] if task.has("GATHER") else pairs
    x_all = mem.mat(task, "x", int(rows.max()) + 1, K).float()
    x = x_all[rows]
    base = main_slot(task, mem, expert) * task["w_es"]
    w = mem.mat(task, "w", r1 - r0, K, row0=r0, col0=base, ld=K).float()
    y = x @ w.T
    if task.has("SILU_MUL"):
        y = F.silu(y) * (x @ mem.mat(task, "w2", r1 - r0, K, row0=r0, col0=base, ld=K).float().T)
    out = mem.bufs[task["out.buf"]]
    index = task["out.off"] + (pairs * task["out.ld"])[:, None] + torch.arange(r0, r1, device=mem.device)
    out[index] = y
    if task.has("DOWN_T"):  # the slice's rows of the down projection, packed transposed: a partial row per pair
        wd = mem.mat(task, "wd", r1 - r0, K, row0=r0, col0=base, ld=K).float()
        P = task["N"] * task["topk"]
        mem.bufs[task["y.buf"]][task["y.off"] + ((task["slice"] * P + pairs) * task["y.ld"])[:, None]
                                + torch.arange(K, device=mem.device)] = out[index] @ wd


def reference_combine(task, mem) -> None:
    r0, r1, H, k, c0, c1 = task["r0"], task["r1"], task["H"], task["topk"], task["c0"], task["c1"]
    C = c1 - c0
    out = torch.zeros(r1 - r0, C, device=mem.device)
    if k:  # (topk 0: a dense MLP's partials alone, fusion rule dense_mlp)
        y = mem.mat(task, "y", (r1 - r0) * k, C, row0=r0 * k, col0=c0, ld=H).float()
        for s in range(1, task["ns"]):  # the down projection's slices (EXPERT_LINEAR[DOWN_T]), added in order
            y = y + mem.mat(task, "y", (r1 - r0) * k, C, row0=s * task["ys"] + r0 * k, col0=c0, ld=H).float()
        y = y.view(r1 - r0, k, C)
        w = mem.flat(task, "wts", r0 * k, (r1 - r0) * k).view(r1 - r0, k, 1)
        for j in range(k):  # fixed order: a token's sum never depends on its neighbours
            out = out + w[:, j] * y[:, j]
    if task.has("SHARED"):
        shared = mem.mat(task, "sh", r1 - r0, C, row0=r0, col0=c0).float()
        for s in range(1, task["nsh"]):  # the shared experts' slices (LINEAR[DOWN_T]), added in order
            shared = shared + mem.mat(task, "sh", r1 - r0, C, row0=s * task["shs"] + r0, col0=c0).float()
        out = out + shared
    if task.has("RES"):
        out = out + mem.mat(task, "res", r1 - r0, C, row0=r0, col0=c0).float()
    mem.mat(task, "out", r1 - r0, C, row0=r0, col0=c0).copy_(out)


# ---- GPU body ----------------------------------------------------------------------------
KMAX = tl.constexpr(16)  # most experts per token topk_by_rounds handles (the runtime checks)


@triton.jit
def topk_by_rank(choice, scores, ex, emask, k, ids, wts, norm, scale, BE: tl.constexpr):
    """Every expert's place in the descending order of choice, ties to the lower id (the reference's
    sort), from one [experts x experts] comparison: k rounds of argmax were 2k cross-warp
    reductions in a row on the layer's dependency chain (15 us for dsv2-lite).  Up to 64 experts:
    the comparison is 16 values per thread."""
    c_e, c_other = choice[:, None], choice[None, :]
    ahead = (c_other > c_e) | ((c_other == c_e) & (ex[None, :] < ex[:, None]))
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    picked = (rank < k) & emask
    total = tl.sum(tl.where(picked, scores, 0.0), axis=0)
    denom = total + 1e-20 if norm else 1.0
    tl.store(ids + rank, ex.to(tl.int32), mask=picked)
    tl.store(wts + rank, scores / denom * scale, mask=picked)
    return rank, picked


@triton.jit
def topk_by_rounds(choice, scores, ex, k, ids, wts, norm, scale):
    """k rounds of argmax (ties to the lower id), for more experts than a [experts x experts]
    comparison fits in registers (256: 256 values per thread spilled the whole kernel); the
    choices stay in registers and are stored once, so no round waits on memory."""
    jj = tl.arange(0, KMAX)
    chosen = tl.zeros((KMAX,), tl.int32)
    weight = tl.zeros((KMAX,), tl.float32)
    total = 0.0
    for j in range(k):
        best = tl.argmax(choice, axis=0, tie_break_left=True)
        w = tl.sum(tl.where(ex == best, scores, 0.0), axis=0)
        chosen = tl.where(jj == j, best.to(tl.int32), chosen)
        weight = tl.where(jj == j, w, weight)
        total += w
        choice = tl.where(ex == best, float("-inf"), choice)
    denom = total + 1e-20 if norm else 1.0
    tl.store(ids + jj, chosen, mask=jj < k)
    tl.store(wts + jj, weight / denom * scale, mask=jj < k)


@triton.jit
def route_body(word, WF, A, I, BE: tl.constexpr, BP: tl.constexpr, ROUTE1: tl.constexpr):
    """ROUTE1 1 (a launch variant): one token's slot table straight from its experts' ranks in registers
    (slot_table_one), not from its ids read back from memory."""
    flags = fld(word, ROUTE_FLAGS)
    N, E, k, S = fld(word, ROUTE_N), fld(word, ROUTE_E), fld(word, ROUTE_TOPK), fld(word, ROUTE_S)
    G, keep_groups, scale = fld(word, ROUTE_N_GROUP), fld(word, ROUTE_TOPK_GROUP), ffld(word, ROUTE_SCALE)
    lg, lg_ld = A + off(word, ROUTE_LG_OFF), fld(word, ROUTE_LG_LD)
    sc, store_sc = A + off(word, ROUTE_SC_OFF), fld(word, ROUTE_SC_BUF) >= 0
    bias, ids, wts, st = (WF + off(word, ROUTE_BIAS_OFF), I + off(word, ROUTE_IDS_OFF), A + off(word, ROUTE_WTS_OFF),
                          I + off(word, ROUTE_ST_OFF))
    ex = tl.arange(0, BE)
    emask = ex < E
    per = E // G
    rank1 = tl.zeros((BE,), tl.int32)  # the last token's expert ranks (ROUTE1: token 0 of 1)
    picked1 = rank1 < 0
    for n in range(N):
        if has(flags, FLAG_ROUTE_SCORE):
            logits = tl.load(lg + n * lg_ld + ex, mask=emask, other=float("-inf"), cache_modifier=".cg")
            if has(flags, FLAG_ROUTE_SIGMOID):
                scores = 1.0 / (1.0 + tl.exp(-logits))
            else:
                z = tl.exp(logits - tl.max(logits, axis=0))
                scores = z / tl.sum(z, axis=0)
            scores = tl.where(emask, scores, 0.0)
            if store_sc:
                tl.store(sc + n * E + ex, scores, mask=emask)
        else:
            scores = tl.load(sc + n * E + ex, mask=emask, other=0.0, cache_modifier=".cg")
        if has(flags, FLAG_ROUTE_TOPK):
            choice = scores
            if has(flags, FLAG_ROUTE_NOAUX):
                choice += tl.load(bias + ex, mask=emask, other=0.0)
            choice = tl.where(emask, choice, float("-inf"))
            if has(flags, FLAG_ROUTE_GROUPED):
                gscore = tl.full((BE,), float("-inf"), tl.float32)  # indexed by group
                for g in range(G):
                    in_g = (ex // per == g) & emask
                    best = tl.max(tl.where(in_g, choice, float("-inf")), axis=0)
                    if has(flags, FLAG_ROUTE_NOAUX):  # sum of the group's two best
                        first = tl.argmax(tl.where(in_g, choice, float("-inf")), axis=0, tie_break_left=True)
                        best += tl.max(tl.where(in_g & (ex != first), choice, float("-inf")), axis=0)
                    gscore = tl.where(ex == g, best, gscore)
                kept = tl.zeros((BE,), tl.int1)
                for _ in range(keep_groups):
                    g = tl.argmax(gscore, axis=0, tie_break_left=True)
                    kept = kept | (ex // per == g)
                    gscore = tl.where(ex == g, float("-inf"), gscore)
                choice = tl.where(kept & emask, choice, float("-inf"))
            norm = has(flags, FLAG_ROUTE_NORM)
            if BE <= 64:
                rank1, picked1 = topk_by_rank(choice, scores, ex, emask, k, ids + n * k, wts + n * k, norm, scale, BE)
            else:
                topk_by_rounds(choice, scores, ex, k, ids + n * k, wts + n * k, norm, scale)
    if has(flags, FLAG_ROUTE_SLOTS):
        if ROUTE1 and (BE <= 64):  # compiled only into the launch variant
            if (N == 1) & has(flags, FLAG_ROUTE_TOPK):
                slot_table_one(rank1, picked1, ex, st, S, k, BE)
            else:
                slot_table(ids, st, N * k, E, S, BE, BP)
        else:
            slot_table(ids, st, N * k, E, S, BE, BP)


@triton.jit
def slot_table_one(rank, picked, ex, st, S, k, BE: tl.constexpr):
    """slot_table's result for one token (decode, B = 1): its k experts in ascending order are the slots,
    each holding one pair, pair = the expert's rank.  A decode step's route ran 8 us on each layer's
    chain (docs/PERF.md session 14); slot_table reads the ids back and sums [experts x pairs] twice."""
    slot_of = tl.cumsum(picked.to(tl.int32), axis=0) - 1
    tl.store(st + slot_of, ex, mask=picked)
    tl.store(st + S + slot_of, tl.full((BE,), 1, tl.int32), mask=picked)
    tl.store(st + 2 * S + slot_of * k, rank, mask=picked)
    tl.store(st + ex, tl.full((BE,), -1, tl.int32), mask=(ex >= k) & (ex < S))
    tl.store(st + S + ex, tl.zeros((BE,), tl.int32), mask=(ex >= k) & (ex < S))


@triton.jit
def slot_table(ids, st, P, E, S, BE: tl.constexpr, BP: tl.constexpr):
    """st = [expert of slot s] * S + [pairs in slot s] * S + [pair ids of slot s, ascending] * (S x P):
    the distinct experts of ids[0:P] in ascending order, found for all experts at once ([experts x
    pairs] comparisons, pairs in chunks) rather than expert by expert.  The ids were written by this
    program: a barrier first."""
    tl.debug_barrier()
    PC: tl.constexpr = min(BP, 8192 // BE)  # pairs per chunk: keeps the comparison matrix in registers
    ex = tl.arange(0, BE)
    count = tl.zeros((BE,), tl.int32)
    for pb in range(0, P, PC):
        p = pb + tl.arange(0, PC)
        e_of_p = tl.load(ids + p, mask=p < P, other=-1, cache_modifier=".cg")
        count += tl.sum((e_of_p[None, :] == ex[:, None]).to(tl.int32), axis=1)
    present = (count > 0) & (ex < E)
    slot_of = tl.cumsum(present.to(tl.int32), axis=0) - 1  # slots in ascending expert order
    used = tl.sum(present.to(tl.int32), axis=0)
    tl.store(st + slot_of, ex, mask=present)
    tl.store(st + S + slot_of, count, mask=present)
    tl.store(st + ex, tl.full((BE,), -1, tl.int32), mask=(ex >= used) & (ex < S))
    tl.store(st + S + ex, tl.zeros((BE,), tl.int32), mask=(ex >= used) & (ex < S))
    seen = tl.zeros((BE,), tl.int32)  # pairs of each expert already placed
    for pb in range(0, P, PC):
        p = pb + tl.arange(0, PC)
        e_of_p = tl.load(ids + p, mask=p < P, other=-1, cache_modifier=".cg")
        hit = (e_of_p[None, :] == ex[:, None]).to(tl.int32)  # [experts, pairs]
        rank = seen[:, None] + tl.cumsum(hit, axis=1) - 1  # the pair's place within its expert's slot
        where = tl.sum(hit * rank, axis=0)
        slot = tl.sum(hit * slot_of[:, None], axis=0)
        tl.store(st + 2 * S + slot * P + where, p.to(tl.int32), mask=p < P)
        seen += tl.sum(hit, axis=1)


@triton.jit
def expert_body(word, W, A, I, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, TB: tl.constexpr,
                PF: tl.constexpr, DEPTH: tl.constexpr, ROWVEC: tl.constexpr, AHEAD: tl.constexpr,
                NARROW: tl.constexpr, PFD: tl.constexpr = 0, EF: tl.constexpr = 0, KD: tl.constexpr = 0,
                EPF: tl.constexpr = 0, guess=-1, w_guess=0, PIN: tl.constexpr = 0):
    """NARROW 1 (a launch variant): a slice that linear.narrow() picks streams 4·BR x KC/4 chunks.  KD > 0: the plan
    has DOWN_T tasks (fusion rule expert_mlp), whose k-major down rows of up to KD columns are compiled in.
    EPF > 0: w_guess is the first chunk of expert `guess`, requested before the wait (guess_first_chunk); the
    stream takes it where the slot holds that expert.  After the wait the slot's expert and pair count are then
    requested together: without a guess the first chunk's load overlapped the count's, with one the count is
    what the stream waits for."""
    flags, S, slot = fld(word, EXPERT_LINEAR_FLAGS), fld(word, EXPERT_LINEAR_S), fld(word, EXPERT_LINEAR_SLOT)
    st = I + off(word, EXPERT_LINEAR_ST_OFF)
    expert = tl.load(st + slot, cache_modifier=".cg")
    filled = expert >= 0
    if EPF > 0:  # its pair count requested with it (the branch needs both, so the compiler cannot sink the count's
        count = tl.load(st + S + slot, cache_modifier=".cg")  # load into it): the loop bound one round trip sooner
        filled = filled & (count > 0)  # a slot with an expert has pairs: the same tasks run
    if filled:  # an empty slot does nothing (it still signals)
        if EPF == 0:
            count = tl.load(st + S + slot, cache_modifier=".cg")
        N, K, kk = fld(word, EXPERT_LINEAR_N), fld(word, EXPERT_LINEAR_K), fld(word, EXPERT_LINEAR_TOPK)
        r0, r1 = fld(word, EXPERT_LINEAR_R0), fld(word, EXPERT_LINEAR_R1)
        two = has(flags, FLAG_EXPERT_LINEAR_SILU_MUL)
        base = expert_base(word, I, expert, ALIGN)
        w_ptr = aligned_base(W, word, EXPERT_LINEAR_W_OFF, ALIGN) + base
        w2_ptr = aligned_base(W, word, EXPERT_LINEAR_W2_OFF, ALIGN) + base
        if PF > 0:  # the expert is known only now: its whole slice in flight at once
            prefetch_rows(w_ptr, w2_ptr, two, r0, r1, K, ALIGN)
        if NARROW and narrow(r1 - r0, K, BR, KC):
            expert_stream(word, A, st, S, slot, N, kk, flags, count, w_ptr, w2_ptr, two, r0, r1, K,
                          first_chunk(w_ptr, r0, r1, K, BR * 4, KC // 4, ALIGN, EF), BR * 4, KC // 4, ALIGN, TB,
                          DEPTH, ROWVEC, AHEAD, PFD, EF)
        # launch variant PIN=2 (no EPF); the constant test first, so other kernels compile no flat tile (Triton
        # prunes an `and` on a constant False, not a branch on a jit function's constant result)
        elif (PIN == 2) and flat_ok(count, K, two, False, w_ptr, KC, ALIGN, TB, ROWVEC):
            flat_expert_stream(word, A, st, S, slot, N, kk, flags, w_ptr, r0, r1, K,
                               flat_tile(w_ptr, r0, r1, K, 0, BR, KC, ALIGN, EF), BR, KC, ALIGN, ROWVEC, EF)
        else:
            if EPF and (expert == guess):
                w = w_guess
            else:  # no guess, or a stale one: the chunk requested now
                w = first_chunk(w_ptr, r0, r1, K, BR, KC, ALIGN, EF)
            if PIN:
                if pinnable(count, K, KC, TB, ROWVEC):
                    pinned_expert_stream(word, A, st, S, slot, N, kk, flags, w_ptr, w2_ptr, two, r0, r1, K, w, BR, KC,
                                         ALIGN, ROWVEC, EF, PFD)
                else:
                    expert_stream(word, A, st, S, slot, N, kk, flags, count, w_ptr, w2_ptr, two, r0, r1, K, w, BR,
                                  KC, ALIGN, TB, DEPTH, ROWVEC, AHEAD, PFD, EF)
            else:
                expert_stream(word, A, st, S, slot, N, kk, flags, count, w_ptr, w2_ptr, two, r0, r1, K, w, BR, KC,
                              ALIGN, TB, DEPTH, ROWVEC, AHEAD, PFD, EF)
        if KD > 0:
            if has(flags, FLAG_EXPERT_LINEAR_DOWN_T):
                expert_down(word, W, A, st, S, slot, N, kk, count, base, r0, r1, K, KD, BR, ALIGN, EF)


@triton.jit
def expert_base(word, I, expert, ALIGN: tl.constexpr):
    """Where an expert's rows start in each of its matrices (elements): its own block, or (helper plans) the block
    of the main slot its map names."""
    where = expert
    if fld(word, EXPERT_LINEAR_MAP_BUF) >= 0:
        where = tl.load(I + off(word, EXPERT_LINEAR_MAP_OFF) + expert, cache_modifier=".cg")
    return block_of(word, where, ALIGN)


@triton.jit
def block_of(word, where, ALIGN: tl.constexpr):
    """Where block `where` of the expert weights starts (elements past each matrix's offset)."""
    return where.to(tl.int64) * aligned(fld(word, EXPERT_LINEAR_W_ES), ALIGN)


@triton.jit
def guess_first_chunk(word, W, I, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, EF: tl.constexpr,
                      EPF: tl.constexpr, slots=None):
    """EPF (a launch variant): (guess, its first weight chunk) for an EXPERT_LINEAR task, requested before the
    dependency wait, as a LINEAR task's first chunk is, for the expert the task's slot holds now.  The route that
    writes the slot table may not have run yet (the table then holds another step's or layer's experts): the body
    compares the guess with the slot's expert after the wait and requests the chunk again where they differ, so a
    stale guess costs one chunk of bandwidth, never a wrong sum.  Guessing reads the table without acquiring it:
    any int may be there, so only an expert id below E is taken, and helper plans (an expert map) take none;
    where there is no guess (-1) one row of expert 0 is read, 1/BR of a chunk.  EPF 2 guesses from the next slot
    (a test hook: the stale guess's path, which the Triton interpreter, running the route first, never takes).
    slots: the task's wait slots, read first (WAITS 2: common.wait_slots)."""
    slot = fld(word, EXPERT_LINEAR_SLOT) + (1 if EPF == 2 else 0)
    guess = tl.load(I + off(word, EXPERT_LINEAR_ST_OFF) + slot, cache_modifier=".cg")
    usable = (guess >= 0) & (guess < fld(word, EXPERT_LINEAR_E)) & (fld(word, EXPERT_LINEAR_MAP_BUF) < 0)
    guess = tl.where(usable, guess, -1)
    r0 = fld(word, EXPERT_LINEAR_R0)
    r1 = tl.where(usable, fld(word, EXPERT_LINEAR_R1), r0 + 1)
    if slots is not None:
        r1 = after_slots(r1, slots)
    base = block_of(word, tl.maximum(guess, 0), ALIGN)  # no map: see above
    return guess, first_chunk(aligned_base(W, word, EXPERT_LINEAR_W_OFF, ALIGN) + base, r0, r1,
                              fld(word, EXPERT_LINEAR_K), BR, KC, ALIGN, EF)


@triton.jit
def expert_down(word, W, A, st, S, slot, N, kk, count, base, r0, r1, K, KD: tl.constexpr, BR: tl.constexpr,
                ALIGN: tl.constexpr, EF: tl.constexpr):
    """EXPERT_LINEAR[DOWN_T]'s second half: for each pair of the slot, its slice's SiLU·mul values (the task's own
    `out` rows r0..r1, just stored) times rows r0..r1 of the expert's transposed down projection, into the pair's
    partial row of this slice (kmajor.down_partials)."""
    wd = aligned_base(W, word, EXPERT_LINEAR_WD_OFF, ALIGN) + base + r0.to(tl.int64) * aligned(K, ALIGN)
    down_partials(wd, r1 - r0, K, A + off(word, EXPERT_LINEAR_OUT_OFF) + r0, fld(word, EXPERT_LINEAR_OUT_LD),
                  A + off(word, EXPERT_LINEAR_Y_OFF), fld(word, EXPERT_LINEAR_Y_LD),
                  fld(word, EXPERT_LINEAR_SLICE) * N * kk, st + 2 * S + slot * (N * kk), count, KD, BR, ALIGN, EF,
                  True)


@triton.jit
def expert_stream(word, A, st, S, slot, N, kk, flags, count, w_ptr, w2_ptr, two, r0, r1, K, w, BR: tl.constexpr,
                  KC: tl.constexpr, ALIGN: tl.constexpr, TB: tl.constexpr, DEPTH: tl.constexpr, ROWVEC: tl.constexpr,
                  AHEAD: tl.constexpr, PFD: tl.constexpr = 0, EF: tl.constexpr = 0):
    """An expert slice's weight stream in BR x KC chunks, w the first (requested by the caller before the rest of
    the address math)."""
    pairs = st + 2 * S + slot * (N * kk)
    div = tl.where(has(flags, FLAG_EXPERT_LINEAR_GATHER), kk, 1)  # gate/up read token rows, down pair rows
    o_ptr, o_ld = A + off(word, EXPERT_LINEAR_OUT_OFF), fld(word, EXPERT_LINEAR_OUT_LD)
    stream_chunks(aligned_base(A, word, EXPERT_LINEAR_X_OFF, ALIGN), fld(word, EXPERT_LINEAR_X_LD), pairs, div,
                  count, o_ptr, o_ld, o_ptr, o_ld, False, w_ptr, w2_ptr, two, r0, r1, K, w, False, 0.0, BR, KC,
                  ALIGN, TB, DEPTH, 16, ROWVEC, AHEAD, PFD, EF)


@triton.jit
def pinned_expert_stream(word, A, st, S, slot, N, kk, flags, w_ptr, w2_ptr, two, r0, r1, K, w, BR: tl.constexpr,
                         KC: tl.constexpr, ALIGN: tl.constexpr, ROWVEC: tl.constexpr, EF: tl.constexpr = 0,
                         PFD: tl.constexpr = 0):
    """expert_stream's slice for a slot of one pair (launch variant PIN: linear.stream_pinned).  No residual: its
    flag is a run-time False (r0 < 0), so that its predicated load stays as each step's wait (stream_pinned)."""
    div = tl.where(has(flags, FLAG_EXPERT_LINEAR_GATHER), kk, 1)
    o_ptr, o_ld = A + off(word, EXPERT_LINEAR_OUT_OFF), fld(word, EXPERT_LINEAR_OUT_LD)
    stream_pinned(aligned_base(A, word, EXPERT_LINEAR_X_OFF, ALIGN), fld(word, EXPERT_LINEAR_X_LD),
                  st + 2 * S + slot * (N * kk), div, o_ptr, o_ld, o_ptr, o_ld, r0 < 0, w_ptr, w2_ptr, two, r0, r1, K,
                  w, False, 0.0, BR, KC, ALIGN, 16, ROWVEC, EF, 0, False, 1, PFD)


@triton.jit
def flat_expert_stream(word, A, st, S, slot, N, kk, flags, w_ptr, r0, r1, K, w, BR: tl.constexpr, KC: tl.constexpr,
                       ALIGN: tl.constexpr, ROWVEC: tl.constexpr, EF: tl.constexpr = 0):
    """pinned_expert_stream's slice through linear_flat.stream_flat (launch variant PIN 2)."""
    div = tl.where(has(flags, FLAG_EXPERT_LINEAR_GATHER), kk, 1)
    o_ptr, o_ld = A + off(word, EXPERT_LINEAR_OUT_OFF), fld(word, EXPERT_LINEAR_OUT_LD)
    stream_flat(aligned_base(A, word, EXPERT_LINEAR_X_OFF, ALIGN), fld(word, EXPERT_LINEAR_X_LD),
                st + 2 * S + slot * (N * kk), div, o_ptr, o_ld, w_ptr, r0, r1, K, w, BR, KC, ALIGN, ROWVEC, EF)


@triton.jit
def combine_body(word, A, BD: tl.constexpr, BK: tl.constexpr, KD: tl.constexpr = 0):
    """out = sum_j wts[j] y[j] (+ shared) (+ residual): the k expert rows are requested together,
    [BK, BD] at a time (one memory round trip, not k), and summed in a fixed tree order.  KD > 0: the plan has
    EXPERT_LINEAR[DOWN_T] (combine_partials)."""
    flags, H, k = fld(word, MOE_COMBINE_FLAGS), fld(word, MOE_COMBINE_H), fld(word, MOE_COMBINE_TOPK)
    y, wts = A + off(word, MOE_COMBINE_Y_OFF), A + off(word, MOE_COMBINE_WTS_OFF)
    sh, sh_ld = A + off(word, MOE_COMBINE_SH_OFF), fld(word, MOE_COMBINE_SH_LD)
    res, res_ld = A + off(word, MOE_COMBINE_RES_OFF), fld(word, MOE_COMBINE_RES_LD)
    o_ptr, o_ld = A + off(word, MOE_COMBINE_OUT_OFF), fld(word, MOE_COMBINE_OUT_LD)
    c1 = fld(word, MOE_COMBINE_C1)
    j = tl.arange(0, BK)
    ns = 1
    nsh = 1
    if KD > 0:
        ns = tl.maximum(fld(word, MOE_COMBINE_NS), 1)
        nsh = tl.maximum(fld(word, MOE_COMBINE_NSH), 1)
    for r in range(fld(word, MOE_COMBINE_R0), fld(word, MOE_COMBINE_R1)):
        w = tl.load(wts + r * k + j, mask=j < k, other=0.0, cache_modifier=".cg")
        if (ns > 1) | (nsh > 1):  # (KD > 0 only)
            combine_partials(y, fld(word, MOE_COMBINE_YS), ns, w, r, k, H, fld(word, MOE_COMBINE_C0), c1, flags, sh,
                             sh_ld, nsh, fld(word, MOE_COMBINE_SHS), res, res_ld, o_ptr, o_ld, BK)
        else:
            for cb in range(fld(word, MOE_COMBINE_C0), c1, BD):
                c = cb + tl.arange(0, BD)
                m = c < c1
                rows = tl.load(y + (r * k + j)[:, None].to(tl.int64) * H + c[None, :],
                               mask=(j < k)[:, None] & m[None, :], other=0.0, cache_modifier=".cg")
                acc = tl.sum(w[:, None] * rows, axis=0)  # fixed order: a token's sum never depends on its neighbours
                combine_store(acc, flags, sh, sh_ld, res, res_ld, o_ptr, o_ld, r, c, m)


NSB = tl.constexpr(32)  # partial slices one combine load takes (expert_mlp: dsv2-lite's experts have 22)
BDS = tl.constexpr(16)  # and columns: NSB x BK x BDS values, one memory round trip, not one a slice
NSH = tl.constexpr(128)  # shared-expert slices one load takes (dsv2-lite's shared MLP has 118)


@triton.jit
def combine_partials(y, ys, ns, w, r, k, H, c0, c1, flags, sh, sh_ld, nsh, shs, res, res_ld, o_ptr, o_ld,
                     BK: tl.constexpr):
    """Token r's columns c0..c1 where y holds ns slices of partials (EXPERT_LINEAR[DOWN_T], ys rows apart) and sh
    nsh (LINEAR[DOWN_T], shs rows apart): each expert row summed over its slices in a fixed tree order, NSB slices x
    BK rows x BDS columns a load (tiling gives such tasks BDS-column blocks), then weighted as combine_body does,
    and the shared experts' slices and the residual added.  The first block of each and the residual are requested
    before any sum (flags and counts mask the loads rather than branch around them): one memory round trip where
    three were (session 33 measured this body at 5.9 us a task against the plain combine's 2.5)."""
    j = tl.arange(0, BK)
    s = tl.arange(0, NSB)
    sj = tl.arange(0, NSH)
    use_sh = has(flags, FLAG_MOE_COMBINE_SHARED)
    for cb in range(c0, c1, BDS):
        c = cb + tl.arange(0, BDS)
        m = c < c1
        sh_first = shared_slices(sh, 0, sj, shs, nsh, r, sh_ld, c, m, use_sh)
        y_first = expert_slices(y, 0, s, ys, ns, r, k, j, H, c, m)
        res_row = tl.load(res + r * res_ld + c, mask=m & has(flags, FLAG_MOE_COMBINE_RES), other=0.0,
                          cache_modifier=".cg")
        shared = tl.zeros((BDS,), tl.float32) + tl.sum(sh_first, axis=0)
        for s0 in range(NSH, nsh, NSH):  # (more slices than one load takes)
            shared += tl.sum(shared_slices(sh, s0, sj, shs, nsh, r, sh_ld, c, m, use_sh), axis=0)
        rows = tl.zeros((BK, BDS), tl.float32) + tl.sum(y_first, axis=0)
        for s0 in range(NSB, ns, NSB):
            rows += tl.sum(expert_slices(y, s0, s, ys, ns, r, k, j, H, c, m), axis=0)
        acc = tl.sum(w[:, None] * rows, axis=0) + shared
        if has(flags, FLAG_MOE_COMBINE_RES):
            acc += res_row
        tl.store(o_ptr + r * o_ld + c, acc, mask=m)


@triton.jit
def expert_slices(y, s0, s, ys, ns, r, k, j, H, c, m):
    """Slices s0 + s (below ns) of token r's k expert rows j, columns c where m: [NSB, BK, BDS], 0 elsewhere."""
    at = ((s0 + s) * ys)[:, None, None] + (r * k + j)[None, :, None]
    return tl.load(y + at.to(tl.int64) * H + c[None, None, :], other=0.0, cache_modifier=".cg",
                   mask=(s0 + s < ns)[:, None, None] & (j < k)[None, :, None] & m[None, None, :])


@triton.jit
def shared_slices(sh, s0, sj, shs, nsh, r, sh_ld, c, m, use_sh):
    """Slices s0 + sj (below nsh) of token r's shared-expert row, columns c where m: [NSH, BDS], 0 elsewhere
    and without use_sh."""
    at = (s0 + sj) * shs + r
    return tl.load(sh + at[:, None].to(tl.int64) * sh_ld + c[None, :], other=0.0, cache_modifier=".cg",
                   mask=use_sh & (s0 + sj < nsh)[:, None] & m[None, :])


@triton.jit
def combine_store(acc, flags, sh, sh_ld, res, res_ld, o_ptr, o_ld, r, c, m):
    """Token r's combined columns c, plus the shared experts' row and the residual's (SHARED, RES), stored."""
    if has(flags, FLAG_MOE_COMBINE_SHARED):
        acc += tl.load(sh + r * sh_ld + c, mask=m, other=0.0, cache_modifier=".cg")
    if has(flags, FLAG_MOE_COMBINE_RES):
        acc += tl.load(res + r * res_ld + c, mask=m, other=0.0, cache_modifier=".cg")
    tl.store(o_ptr + r * o_ld + c, acc, mask=m)
