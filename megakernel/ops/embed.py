"""EMBED: gather embedding rows for the step's tokens (copied into each mHC stream)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import fld, off
from .fields import (EMBED_COPIES, EMBED_H, EMBED_OUT_LD, EMBED_OUT_OFF, EMBED_R0, EMBED_R1, EMBED_TABLE_OFF,
                     EMBED_TOK_LD, EMBED_TOK_OFF)


def reference(task, mem) -> None:
    r0, r1, H, copies = task["r0"], task["r1"], task["H"], task["copies"]
    tokens = mem.mat(task, "tok", r1 - r0, 1, row0=r0)[:, 0].long()
    table = mem.bufs[task["table.buf"]]
    rows = table[task["table.off"] + tokens[:, None] * H + torch.arange(H, device=table.device)].float()
    out = mem.mat(task, "out", r1 - r0, H * copies, row0=r0)
    out.copy_(rows.repeat(1, copies))


# ---- GPU body ----------------------------------------------------------------------------
@triton.jit
def body(word, W, A, I, BD: tl.constexpr):
    H, copies = fld(word, EMBED_H), fld(word, EMBED_COPIES)
    tok_ptr, table = I + off(word, EMBED_TOK_OFF), W + off(word, EMBED_TABLE_OFF)
    o_ptr, o_ld = A + off(word, EMBED_OUT_OFF), fld(word, EMBED_OUT_LD)
    # 8·BD-wide chunks: a 2048-wide row in one round trip (BD-wide ones made it 8 dependent ones, ~6 us at the
    # head of every step's chain: docs/PERF.md session 23)
    BE: tl.constexpr = BD * 8
    for r in range(fld(word, EMBED_R0), fld(word, EMBED_R1)):
        tok = tl.load(tok_ptr + r * fld(word, EMBED_TOK_LD), cache_modifier=".cg").to(tl.int64)
        for cb in range(0, H, BE):
            c = cb + tl.arange(0, BE)
            m = c < H
            v = tl.load(table + tok * H + c, mask=m, other=0.0).to(tl.float32)
            for j in range(copies):
                tl.store(o_ptr + r * o_ld + j * H + c, v, mask=m)
