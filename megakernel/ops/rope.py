"""Positions and rotary embeddings: ROPE_TABLE (cos/sin per row), ROPE (rotate heads), CACHE_WRITE.

Row r of a step is token t = r mod T of sequence b = r div T, at position
cache_lens[b] + t + pos_offset (pos_offset > 0 for MTP draft passes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ffld, fld, has, off
from .fields import (CACHE_WRITE_CACHE_OFF, CACHE_WRITE_CL_OFF, CACHE_WRITE_COL0, CACHE_WRITE_COLS,
                     CACHE_WRITE_POS_OFFSET, CACHE_WRITE_R0, CACHE_WRITE_R1, CACHE_WRITE_S, CACHE_WRITE_SRC_LD,
                     CACHE_WRITE_SRC_OFF, CACHE_WRITE_T, CACHE_WRITE_WIDTH, FLAG_ROPE_CACHE, FLAG_ROPE_INTERLEAVE,
                     ROPE_CACHE_OFF, ROPE_CL_OFF, ROPE_COL0, ROPE_FLAGS, ROPE_H0, ROPE_HALF, ROPE_HEADS, ROPE_OUT_HS,
                     ROPE_OUT_LD, ROPE_OUT_OFF, ROPE_POS_OFFSET, ROPE_R0, ROPE_R1, ROPE_S, ROPE_T, ROPE_TABLE_CL_OFF,
                     ROPE_TABLE_F_OFF, ROPE_TABLE_HALF, ROPE_TABLE_OUT_OFF, ROPE_TABLE_POS_OFFSET, ROPE_TABLE_R0,
                     ROPE_TABLE_R1, ROPE_TABLE_SCALE, ROPE_TABLE_T, ROPE_TAB_OFF, ROPE_WIDTH, ROPE_X_COL0, ROPE_X_HS,
                     ROPE_X_LD, ROPE_X_OFF)


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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """x [rows, 2·half] rotated by the angles whose cos and sin are [rows, half]: pairs (i, i + half), or
    (2i, 2i + 1) interleaved.  ROPE, and ATTENTION[ROPE]'s query rows and new keys."""
    if interleave:
        x1, x2 = x[:, 0::2], x[:, 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    half = cos.shape[1]
    x1, x2 = x[:, :half], x[:, half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_apply(task, mem) -> None:
    r0, r1, half = task["r0"], task["r1"], task["half"]
    tab = mem.mat(task, "tab", r1 - r0, 2 * half, row0=r0, ld=2 * half)
    cos, sin = tab[:, :half], tab[:, half:]
    heads = []
    for h in range(task["h0"], task["heads"]):
        x = mem.mat(task, "x", r1 - r0, 2 * half, row0=r0, col0=h * task["x_hs"] + task["x_col0"]).float()
        y = rotate(x, cos, sin, task.has("INTERLEAVE"))
        if task.has("CACHE"):  # heads back to back (out_hs = 2·half: the compiler checks)
            heads.append(y)
        else:
            mem.mat(task, "out", r1 - r0, 2 * half, row0=r0, col0=h * task["out_hs"]).copy_(y)
    if heads:
        write_cache(task, mem, torch.cat(heads, dim=1), task["h0"] * task["out_hs"])


def reference_cache_write(task, mem) -> None:
    write_cache(task, mem, mem.mat(task, "src", task["r1"] - task["r0"], task["cols"], row0=task["r0"]))


def write_cache(task, mem, src: torch.Tensor, skip: int = 0) -> None:
    """cache[b, pos, col0 + skip : + src columns] = src[r] for rows r0..r1 (CACHE_WRITE, ROPE[CACHE]:
    skip, the columns of the heads before its first)."""
    r0, r1, T, S, width = task["r0"], task["r1"], task["T"], task["S"], task["width"]
    pos = positions(task, mem, r0, r1)
    if int(pos.max()) >= S:
        raise IndexError(f"{task.op.name} to cache position {int(pos.max())} of a cache with {S} positions")
    b = torch.arange(r0, r1, device=mem.device) // T
    cache = mem.bufs[task["cache.buf"]]
    index = task["cache.off"] + ((b * S + pos) * width + task["col0"])[:, None] \
        + skip + torch.arange(src.shape[1], device=mem.device)
    cache[index] = src.to(cache.dtype)


# ---- GPU body ----------------------------------------------------------------------------
@triton.jit
def cache_row(cl, cache, r, T, S, width, col0, pos_offset):
    """Where row r (sequence r // T, its r % T-th token) lands in the cache, and whether it fits (the
    host refuses steps that would not fit; never write past the cache): CACHE_WRITE and ROPE[CACHE]."""
    b = r // T
    pos = tl.load(cl + b, cache_modifier=".cg") + r % T + pos_offset
    return cache + (b.to(tl.int64) * S + pos) * width + col0, pos < S


@triton.jit
def table_body(word, WF, A, I, BH: tl.constexpr):
    T, half, scale = fld(word, ROPE_TABLE_T), fld(word, ROPE_TABLE_HALF), ffld(word, ROPE_TABLE_SCALE)
    cl, f = I + off(word, ROPE_TABLE_CL_OFF), WF + off(word, ROPE_TABLE_F_OFF)
    out = A + off(word, ROPE_TABLE_OUT_OFF)
    pos_offset = fld(word, ROPE_TABLE_POS_OFFSET)
    for r in range(fld(word, ROPE_TABLE_R0), fld(word, ROPE_TABLE_R1)):
        pos = (tl.load(cl + r // T, cache_modifier=".cg") + r % T + pos_offset).to(tl.float32)
        for hb in range(0, half, BH):
            i = hb + tl.arange(0, BH)
            m = i < half
            freq = pos * tl.load(f + i, mask=m, other=0.0)
            tl.store(out + r * 2 * half + i, tl.cos(freq) * scale, mask=m)
            tl.store(out + r * 2 * half + half + i, tl.sin(freq) * scale, mask=m)


@triton.jit
def apply_body(word, A, I, C, BH: tl.constexpr):
    """All heads of a row at once, [HB heads, BH pairs] per block: a head at a time cost a memory
    round trip each (9.4 µs for llama-1b's 32 query heads, on every layer's dependency chain).  CACHE:
    the rotated row goes to its cache position instead (a CACHE_WRITE fused in: one hop fewer)."""
    flags, half = fld(word, ROPE_FLAGS), fld(word, ROPE_HALF)
    h0, heads = fld(word, ROPE_H0), fld(word, ROPE_HEADS)  # this task's heads (TilingOptions.rope_heads)
    x_ptr, x_ld = A + off(word, ROPE_X_OFF), fld(word, ROPE_X_LD)
    x_hs, x_col0 = fld(word, ROPE_X_HS), fld(word, ROPE_X_COL0)
    o_ptr, o_ld, o_hs = A + off(word, ROPE_OUT_OFF), fld(word, ROPE_OUT_LD), fld(word, ROPE_OUT_HS)
    tab = A + off(word, ROPE_TAB_OFF)
    to_cache = has(flags, FLAG_ROPE_CACHE)
    T, S, width, col0 = fld(word, ROPE_T), fld(word, ROPE_S), fld(word, ROPE_WIDTH), fld(word, ROPE_COL0)
    cl, cache = I + off(word, ROPE_CL_OFF), C + off(word, ROPE_CACHE_OFF)
    HB: tl.constexpr = max(1, 1024 // BH)
    for r in range(fld(word, ROPE_R0), fld(word, ROPE_R1)):
        if to_cache:
            c_row, row_in = cache_row(cl, cache, r, T, S, width, col0, fld(word, ROPE_POS_OFFSET))
        else:
            row_in = r >= 0
            c_row = cache
        for hb in range(h0, heads, HB):
            h = hb + tl.arange(0, HB)[:, None]
            for ib in range(0, half, BH):
                i = ib + tl.arange(0, BH)[None, :]
                m = (i < half) & (h < heads)
                cos = tl.load(tab + r * 2 * half + i, mask=i < half, other=0.0, cache_modifier=".cg")
                sin = tl.load(tab + r * 2 * half + half + i, mask=i < half, other=0.0, cache_modifier=".cg")
                if has(flags, FLAG_ROPE_INTERLEAVE):
                    p1, p2 = 2 * i, 2 * i + 1
                else:
                    p1, p2 = i, i + half
                src = x_ptr + r * x_ld + h * x_hs + x_col0
                x1 = tl.load(src + p1, mask=m, other=0.0, cache_modifier=".cg")
                x2 = tl.load(src + p2, mask=m, other=0.0, cache_modifier=".cg")
                y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
                if to_cache:
                    dst_c = c_row + h * o_hs
                    tl.store(dst_c + p1, y1.to(C.dtype.element_ty), mask=m & row_in)
                    tl.store(dst_c + p2, y2.to(C.dtype.element_ty), mask=m & row_in)
                else:
                    dst = o_ptr + r * o_ld + h * o_hs
                    tl.store(dst + p1, y1, mask=m)
                    tl.store(dst + p2, y2, mask=m)


@triton.jit
def cache_write_body(word, A, I, C, BD: tl.constexpr):
    T, S, width = fld(word, CACHE_WRITE_T), fld(word, CACHE_WRITE_S), fld(word, CACHE_WRITE_WIDTH)
    col0, cols, pos_offset = fld(word, CACHE_WRITE_COL0), fld(word, CACHE_WRITE_COLS), fld(word, CACHE_WRITE_POS_OFFSET)
    src, src_ld = A + off(word, CACHE_WRITE_SRC_OFF), fld(word, CACHE_WRITE_SRC_LD)
    cl, cache = I + off(word, CACHE_WRITE_CL_OFF), C + off(word, CACHE_WRITE_CACHE_OFF)
    for r in range(fld(word, CACHE_WRITE_R0), fld(word, CACHE_WRITE_R1)):
        dst, row_in = cache_row(cl, cache, r, T, S, width, col0, pos_offset)
        if row_in:
            for cb in range(0, cols, BD):
                c = cb + tl.arange(0, BD)
                m = c < cols
                v = tl.load(src + r * src_ld + c, mask=m, other=0.0, cache_modifier=".cg")
                tl.store(dst + c, v.to(C.dtype.element_ty), mask=m)
