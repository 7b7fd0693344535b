"""Positions and rotary embeddings: ROPE_TABLE (cos/sin per row), ROPE (rotate heads), CACHE_WRITE.

Row r of a step is token t = r mod T of sequence b = r div T, at position
cache_lens[b] + t + pos_offset (pos_offset > 0 for MTP draft passes).
"""

from __future__ import annotations

import torch


def positions(task, mem, r0: int, r1: int) -> torch.Tensor:
    T = task["T"]
    rows = torch.arange(r0, r1, device=mem.device)
    lens = mem.flat(task, "cl", 0, (r1 - 1) // T + 1).long()
    return lens[rows // T] + rows % T + task["pos_offset"]


def reference_table(task, mem) -> None:
    r0, r1, half = task["r0"], task["r1"], task["half"]
    freqs = positions(task, mem, r0, r1).float()[:, None] * mem.flat(task, "f", 0, half)
    out = mem.mat(task, "out", r1 - r0, 2 * half, row0=r0, ld=2 * half)
    out[:, :half] = freqs.cos() * task["scale"]
    out[:, half:] = freqs.sin() * task["scale"]


def reference_apply(task, mem) -> None:
    r0, r1, half = task["r0"], task["r1"], task["half"]
    tab = mem.mat(task, "tab", r1 - r0, 2 * half, row0=r0, ld=2 * half)
    cos, sin = tab[:, :half], tab[:, half:]
    for h in range(task["heads"]):
        x = mem.mat(task, "x", r1 - r0, 2 * half, row0=r0, col0=h * task["x_hs"] + task["x_col0"]).float()
        if task.has("INTERLEAVE"):
            x1, x2 = x[:, 0::2], x[:, 1::2]
            y = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = x[:, :half], x[:, half:]
            y = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        mem.mat(task, "out", r1 - r0, 2 * half, row0=r0, col0=h * task["out_hs"]).copy_(y)


def reference_cache_write(task, mem) -> None:
    r0, r1, T, S, width = task["r0"], task["r1"], task["T"], task["S"], task["width"]
    pos = positions(task, mem, r0, r1)
    if int(pos.max()) >= S:
        raise IndexError(f"CACHE_WRITE to position {int(pos.max())} of a cache with {S} positions")
    src = mem.mat(task, "src", r1 - r0, task["cols"], row0=r0)
    b = torch.arange(r0, r1, device=mem.device) // T
    cache = mem.bufs[task["cache.buf"]]
    index = task["cache.off"] + ((b * S + pos) * width + task["col0"])[:, None] \
        + torch.arange(task["cols"], device=mem.device)
    cache[index] = src.to(cache.dtype)
