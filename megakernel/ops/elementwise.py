"""EWISE: the unfused elementwise ops (add, mul, SiLU, copy); fusion removes most of them."""

from __future__ import annotations

import torch.nn.functional as F
import triton
import triton.language as tl

from .common import fld, has, off, silu
from .fields import (EWISE_A_LD, EWISE_A_OFF, EWISE_B_LD, EWISE_B_OFF, EWISE_COLS, EWISE_FLAGS,
                     EWISE_OUT_LD, EWISE_OUT_OFF, EWISE_R0, EWISE_R1, FLAG_EWISE_ADD, FLAG_EWISE_MUL, FLAG_EWISE_SILU)


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


# ---- GPU body ----------------------------------------------------------------------------
@triton.jit
def body(word, A, BD: tl.constexpr):
    flags, cols = fld(word, EWISE_FLAGS), fld(word, EWISE_COLS)
    a_ptr, a_ld = A + off(word, EWISE_A_OFF), fld(word, EWISE_A_LD)
    b_ptr, b_ld = A + off(word, EWISE_B_OFF), fld(word, EWISE_B_LD)
    o_ptr, o_ld = A + off(word, EWISE_OUT_OFF), fld(word, EWISE_OUT_LD)
    for r in range(fld(word, EWISE_R0), fld(word, EWISE_R1)):
        for cb in range(0, cols, BD):
            c = cb + tl.arange(0, BD)
            m = c < cols
            a = tl.load(a_ptr + r * a_ld + c, mask=m, other=0.0, cache_modifier=".cg")
            if has(flags, FLAG_EWISE_ADD):
                a = a + tl.load(b_ptr + r * b_ld + c, mask=m, other=0.0, cache_modifier=".cg")
            elif has(flags, FLAG_EWISE_MUL):
                a = a * tl.load(b_ptr + r * b_ld + c, mask=m, other=0.0, cache_modifier=".cg")
            elif has(flags, FLAG_EWISE_SILU):
                a = silu(a)
            tl.store(o_ptr + r * o_ld + c, a, mask=m)
