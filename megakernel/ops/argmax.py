"""ARGMAX of logit rows: per-block (max, first index) partials, then the first index of the overall max."""

from __future__ import annotations

import torch


def reference(task, mem) -> None:
    N, nparts, part = task["N"], task["nparts"], task["part"]
    if task.has("PARTIAL"):
        c0, c1 = task["c0"], task["c1"]
        vals = mem.mat(task, "lg", N, c1 - c0, col0=c0).float()
        idx = vals.argmax(dim=-1)  # first maximal index on ties
        best = vals.gather(1, idx[:, None])[:, 0]
        idx = idx + c0
        if task.has("FINAL"):
            mem.flat(task, "out", 0, N).copy_(idx.int())
            return
        mem.mat(task, "pv", N, 1, col0=part, ld=nparts).copy_(best[:, None])
        mem.mat(task, "pi", N, 1, col0=part, ld=nparts).copy_(idx[:, None].int())
        return
    pv = mem.mat(task, "pv", N, nparts, ld=nparts).float()
    pi = mem.mat(task, "pi", N, nparts, ld=nparts)
    best = pv.argmax(dim=-1)  # earliest part wins ties, and parts are in column order
    mem.flat(task, "out", 0, N).copy_(pi.gather(1, best[:, None])[:, 0])
