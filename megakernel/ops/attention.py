"""ATTENTION over one split of a sequence's cache (MLA absorbed, or GQA), and ATTN_COMBINE of the splits.

A split covers cache positions [split·split_len, (split+1)·split_len); token t
of sequence b may read positions <= cache_lens[b] + t + pos_offset.  Each split
writes its normalised partial output and log-sum-exp; a split with no readable
position writes lse = -inf and zeros.
"""

from __future__ import annotations

import torch


def reference(task, mem) -> None:
    b, T, S, width, dim = task["b"], task["T"], task["S"], task["width"], task["dim"]
    nh, ns, split_len = task["nheads"], task["nsplits"], task["split_len"]
    j0 = task["split"] * split_len
    j1 = min(j0 + split_len, S)
    cache = mem.bufs[task["cache.buf"]].as_strided((S, width), (width, 1), task["cache.off"] + b * S * width)[j0:j1].float()
    limit = int(mem.flat(task, "cl", b, 1)[0]) + task["pos_offset"] + torch.arange(T, device=mem.device)
    valid = torch.arange(j0, j1, device=mem.device)[None, :] <= limit[:, None]  # [T, keys]
    for h in range(task["h0"], task["h1"]):
        q = mem.mat(task, "q", T, dim, row0=b * T, col0=h * task["q_hs"] + task["q_col0"]).float()
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


def reference_combine(task, mem) -> None:
    b, T, nh, ns, dim = task["b"], task["T"], task["nheads"], task["nsplits"], task["dim"]
    h0, h1 = task["h0"], task["h1"]
    for t in range(T):
        rows = torch.tensor([((b * ns + s) * T + t) * nh for s in range(ns)], device=mem.device)
        for h in range(h0, h1):
            lse = mem.bufs[task["lse.buf"]][task["lse.off"] + rows + h]
            parts = mem.bufs[task["op.buf"]][task["op.off"] + ((rows + h) * dim)[:, None]
                                             + torch.arange(dim, device=mem.device)]
            weights = torch.softmax(lse, dim=0)  # exp(lse_s - logsumexp(lse))
            out = (weights[:, None] * parts).sum(0)
            mem.mat(task, "out", 1, dim, row0=b * T + t, col0=h * dim).copy_(out[None])
