"""EMBED: gather embedding rows for the step's tokens (copied into each mHC stream)."""

from __future__ import annotations

import torch


def reference(task, mem) -> None:
    r0, r1, H, copies = task["r0"], task["r1"], task["H"], task["copies"]
    tokens = mem.flat(task, "tok", r0, r1 - r0).long()
    table = mem.bufs[task["table.buf"]]
    rows = table[task["table.off"] + tokens[:, None] * H + torch.arange(H, device=table.device)].float()
    out = mem.mat(task, "out", r1 - r0, H * copies, row0=r0)
    out.copy_(rows.repeat(1, copies))
