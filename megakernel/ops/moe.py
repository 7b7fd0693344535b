"""Mixture of experts on the device: ROUTE (scores, top-k, slot table), EXPERT_LINEAR, MOE_COMBINE.

The slot table lists the distinct experts the step's tokens chose (ascending),
and for each the (token, k) pairs routed to it, pair = token·k + j.  Expert
tasks are planned for every possible slot; a task whose slot is empty at run
time does nothing, and each chosen expert's weights are read once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_route(task, mem) -> None:
    N, E, k, S = task["N"], task["E"], task["k"], task["S"]
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
        table = torch.full((2 * S + S * N * k,), -1, dtype=torch.int32)
        flat = ids.reshape(-1).cpu()
        experts = torch.unique(flat)  # sorted ascending
        for s, e in enumerate(experts.tolist()):
            pairs = torch.nonzero(flat == e).flatten()
            table[s] = e
            table[S + s] = pairs.numel()
            table[2 * S + s * N * k: 2 * S + s * N * k + pairs.numel()] = pairs.int()
        for s in range(len(experts), S):
            table[S + s] = 0
        mem.flat(task, "st", 0, table.numel()).copy_(table.to(mem.device))


def slot_pairs(task, mem, slot: int) -> tuple[int, torch.Tensor]:
    """(expert id or -1, pair ids) of a slot."""
    S, P = task["S"], task["N"] * task["k"]
    expert = int(mem.flat(task, "st", slot, 1)[0])
    count = int(mem.flat(task, "st", S + slot, 1)[0])
    return expert, mem.flat(task, "st", 2 * S + slot * P, count).long()


def reference_expert(task, mem) -> None:
    expert, pairs = slot_pairs(task, mem, task["slot"])
    if expert < 0:
        return
    K, r0, r1 = task["K"], task["r0"], task["r1"]
    rows = pairs // task["k"] if task.has("GATHER") else pairs
    x_all = mem.mat(task, "x", int(rows.max()) + 1, K).float()
    x = x_all[rows]
    base = expert * task["w_es"]
    w = mem.mat(task, "w", r1 - r0, K, row0=r0, col0=base, ld=K).float()
    y = x @ w.T
    if task.has("SILU_MUL"):
        y = F.silu(y) * (x @ mem.mat(task, "w2", r1 - r0, K, row0=r0, col0=base, ld=K).float().T)
    out = mem.bufs[task["out.buf"]]
    index = task["out.off"] + (pairs * task["out.ld"])[:, None] + torch.arange(r0, r1, device=mem.device)
    out[index] = y


def reference_combine(task, mem) -> None:
    r0, r1, H, k = task["r0"], task["r1"], task["H"], task["k"]
    y = mem.mat(task, "y", (r1 - r0) * k, H, row0=r0 * k, ld=H).float().view(r1 - r0, k, H)
    w = mem.flat(task, "wts", r0 * k, (r1 - r0) * k).view(r1 - r0, k, 1)
    out = torch.zeros(r1 - r0, H, device=mem.device)
    for j in range(k):  # fixed order: a token's sum never depends on its neighbours
        out = out + w[:, j] * y[:, j]
    if task.has("SHARED"):
        out = out + mem.mat(task, "sh", r1 - r0, H, row0=r0).float()
    if task.has("RES"):
        out = out + mem.mat(task, "res", r1 - r0, H, row0=r0).float()
    mem.mat(task, "out", r1 - r0, H, row0=r0).copy_(out)
