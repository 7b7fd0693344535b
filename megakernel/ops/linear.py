"""LINEAR: a block of output columns of x @ W.T, with a fused SiLU·mul (gate/up) or residual epilogue."""

from __future__ import annotations

import torch.nn.functional as F


def reference(task, mem) -> None:
    N, K, r0, r1 = task["N"], task["K"], task["r0"], task["r1"]
    x = mem.mat(task, "x", N, K).float()
    w = mem.mat(task, "w", r1 - r0, K, row0=r0, ld=K).float()
    y = x @ w.T
    if task.has("SILU_MUL"):
        y = F.silu(y) * (x @ mem.mat(task, "w2", r1 - r0, K, row0=r0, ld=K).float().T)
    if task.has("RES"):
        y = y + mem.mat(task, "res", N, r1 - r0, col0=r0).float()
    mem.mat(task, "out", N, r1 - r0, col0=r0).copy_(y)
