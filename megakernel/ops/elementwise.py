"""EWISE: the unfused elementwise ops (add, mul, SiLU, copy); fusion removes most of them."""

from __future__ import annotations

import torch.nn.functional as F


def reference(task, mem) -> None:
    r0, r1, cols = task["r0"], task["r1"], task["cols"]
    a = mem.mat(task, "a", r1 - r0, cols, row0=r0).float()
    if task.has("ADD"):
        y = a + mem.mat(task, "b", r1 - r0, cols, row0=r0).float()
    elif task.has("MUL"):
        y = a * mem.mat(task, "b", r1 - r0, cols, row0=r0).float()
    elif task.has("SILU"):
        y = F.silu(a)
    else:
        y = a
    mem.mat(task, "out", r1 - r0, cols, row0=r0).copy_(y)
