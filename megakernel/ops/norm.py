"""RMSNORM: y = v · rsqrt(mean(v²) + eps) · w, optionally of v = x + d (the residual add, stored back)."""

from __future__ import annotations

import torch


def reference(task, mem) -> None:
    r0, r1, D = task["r0"], task["r1"], task["D"]
    v = mem.mat(task, "x", r1 - r0, D, row0=r0).float()
    if task.has("ADD"):
        v = v + mem.mat(task, "d", r1 - r0, D, row0=r0).float()
        if mem.present(task, "xo"):
            mem.mat(task, "xo", r1 - r0, D, row0=r0).copy_(v)
    y = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + task["eps"])
    if not task.has("NOWEIGHT"):
        y = y * mem.flat(task, "w", 0, D).float()
    mem.mat(task, "out", r1 - r0, D, row0=r0).copy_(y)
