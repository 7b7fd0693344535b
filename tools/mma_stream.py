"""A weight stream on the tensor cores (an experiment beside tools/gluon_stream.py's Gluon ring, not a megakernel
body): rows of W @ x through `mma.sync.m16n8k16` (bf16 in, fp32 sums) issued from inline PTX, the weights as
the A operand straight from global memory, x as the B operand in bf16 (high, low) pairs (~16 mantissa bits,
as ops/common.mma's bf16x2).  tools/gluon_stream.py's `mma` / `mmas` variants time it against the CUDA-core
body (megakernel/ops/linear.py).

Why: the CUDA-core body spends ~2 instructions per weight (unpack, fused multiply-add) and streams at
25-27 GB/s per SM at best where the floor needs ~33; here a warp's 16-byte load carries 8 weights of a row
and one mma multiplies 256 weights, so what is left per column is x's conversion to (high, low) bf16, shared
by the 16 rows of a tile and by up to 8 tokens (the B operand's 8 columns: what T > 1 wants).  Measured
(docs/PERF.md session 18): 3.03 TB/s against the CUDA-core body's 3.27 with no waits, with or without the
conversion (`mmas`: x split by its producer), so instructions are not what bounds the stream; BUFS=4 (twice
the weight bytes in flight) has not run on a GPU yet.

Layout: every tensor here is [256] (8 warps x 32 lanes), one element per thread, element i in thread i
(Triton's default layout for such a tensor; the kernel checks it and flags a mismatch), so each inline
asm sees exactly its thread's registers, as mma.sync's fragments require.  Thread (warp, lane): group
g = lane // 4, t = lane % 4.  A tile is 16 rows x 32 columns; per tile a thread loads 8 consecutive
weights of row g and of row g + 8 (columns 8t..8t+7) and token 0's 8 activations there (every lane: the
B operand's other columns make sums nobody reads; T > 1 would give lane g token g's).  The mma's
k index is permuted (k 2t, 2t+1, 2t+8, 2t+9 of the first mma are columns 8t..8t+3, the second's
8t+4..8t+7), the same for A and B, so the sums are the dot products, in a fixed order.  The 8 warps
split K: warp w takes columns w·64 .. w·64+63 of every 512, and the 8 partial sums are added in a
fixed order at the end (batch invariant: token n's sums never depend on the other columns).
Compiled only (inline PTX): the Triton interpreter runs none of this.
"""

from __future__ import annotations

import triton
import triton.language as tl

STEP_COLS = tl.constexpr(512)  # columns per step: 8 warps x 64 (two 32-column tiles each)

# two 32-column tiles of rows g ($16) and g + 8 ($18), 16 words; nothing loaded where the step is past K
# ($17 == 0: the registers are left as they are, never multiplied, so no zero-fill is spent on them)
_W_LOAD = tl.constexpr(
    "{ .reg .pred p; setp.ne.s32 p, $17, 0; "
    "@p ld.global.nc.L1::no_allocate.v4.b32 {$0,$1,$2,$3}, [$16]; "
    "@p ld.global.nc.L1::no_allocate.v4.b32 {$4,$5,$6,$7}, [$18]; "
    "@p ld.global.nc.L1::no_allocate.v4.b32 {$8,$9,$10,$11}, [$16+64]; "
    "@p ld.global.nc.L1::no_allocate.v4.b32 {$12,$13,$14,$15}, [$18+64]; }")

# a token's 16 activations of the two tiles ($16: 8 floats, then 8 more 128 bytes on) as bf16 pairs:
# $0..$7 the high parts, $8..$15 what the high parts leave out (x - hi, rounded); nothing where $17 == 0
_X_LOAD = tl.constexpr(
    "{ .reg .pred p; .reg .f32 x<16>; .reg .b32 h, l0, l1; setp.ne.s32 p, $17, 0; "
    "@p ld.global.v4.f32 {x0,x1,x2,x3}, [$16]; @p ld.global.v4.f32 {x4,x5,x6,x7}, [$16+16]; "
    "@p ld.global.v4.f32 {x8,x9,x10,x11}, [$16+128]; @p ld.global.v4.f32 {x12,x13,x14,x15}, [$16+144]; "
    + "".join(f"cvt.rn.bf16x2.f32 ${j}, x{2 * j + 1}, x{2 * j}; shl.b32 h, ${j}, 16; sub.f32 l0, x{2 * j}, h; "
              f"and.b32 h, ${j}, 0xffff0000; sub.f32 l1, x{2 * j + 1}, h; cvt.rn.bf16x2.f32 ${8 + j}, l1, l0; "
              for j in range(8)) + "}")


# a token's (high, low) bf16 parts of the two tiles, already split by the producer: $16 the high parts' 8 at
# the first tile (the second 64 bytes on), $18 the low parts'; the same 16 words _X_LOAD makes
_XS_LOAD = tl.constexpr(
    "{ .reg .pred p; setp.ne.s32 p, $17, 0; "
    "@p ld.global.v4.b32 {$0,$1,$2,$3}, [$16]; @p ld.global.v4.b32 {$4,$5,$6,$7}, [$16+64]; "
    "@p ld.global.v4.b32 {$8,$9,$10,$11}, [$18]; @p ld.global.v4.b32 {$12,$13,$14,$15}, [$18+64]; }")


def _mma_text() -> str:
    """8 mma.sync into one accumulator ($0..$3, from $36..$39): 2 tiles x 2 halves x (high, low) of x.
    Weights: tile b's row-g words at $4+8b.., its row-g+8 words at $8+8b..; x: high $20.., low $28.."""
    out, text, first = "{$0,$1,$2,$3}", "{ ", True
    for tile in range(2):
        rg, rg8 = 4 + 8 * tile, 8 + 8 * tile
        for half in range(2):
            a = f"{{${rg + 2 * half},${rg8 + 2 * half},${rg + 2 * half + 1},${rg8 + 2 * half + 1}}}"
            for part in range(2):
                xb = 20 + 8 * part + 4 * tile + 2 * half
                acc = "{$36,$37,$38,$39}" if first else out
                text += f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {out}, {a}, {{${xb},${xb + 1}}}, {acc}; "
                first = False
    return text + "}"


_MMA = tl.constexpr(_mma_text())


@triton.jit
def load_weights(pa, pb, on):
    return tl.inline_asm_elementwise(_W_LOAD, "=r," * 16 + "l,r,l", [pa, on.to(tl.int32), pb],
                                     dtype=(tl.uint32,) * 16, is_pure=False, pack=1)


@triton.jit
def load_x(px, on):
    return tl.inline_asm_elementwise(_X_LOAD, "=r," * 16 + "l,r", [px, on.to(tl.int32)], dtype=(tl.uint32,) * 16,
                                     is_pure=False, pack=1)


@triton.jit
def load_x_split(ph, pl, on):
    return tl.inline_asm_elementwise(_XS_LOAD, "=r," * 16 + "l,r,l", [ph, on.to(tl.int32), pl],
                                     dtype=(tl.uint32,) * 16, is_pure=False, pack=1)


@triton.jit
def load_x_any(px, ph, pl, on, SPLIT: tl.constexpr):
    if SPLIT:
        return load_x_split(ph, pl, on)
    else:
        return load_x(px, on)


@triton.jit
def mma_step(w, x, c0, c1, c2, c3):
    return tl.inline_asm_elementwise(_MMA, "=f,=f,=f,=f," + "r," * 32 + "f,f,f,f", w + x + (c0, c1, c2, c3),
                                     dtype=(tl.float32,) * 4, is_pure=False, pack=1)


@triton.jit
def mma_then_reload(w, x, c0, c1, c2, c3, pa, pb, px, ph, pl, at, more, SPLIT: tl.constexpr):
    """One step's mma, then its buffer reloaded with the step `at` columns on (if `more`)."""
    c0, c1, c2, c3 = mma_step(w, x, c0, c1, c2, c3)
    return c0, c1, c2, c3, load_weights(pa + at, pb + at, more), load_x_any(px + at, ph + at, pl + at, more, SPLIT)


@triton.jit
def thread_index():
    """Each element's thread (%tid.x): element i must sit in thread i (the layout this file relies on)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [tl.zeros((256,), tl.int32)], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def tile_pointers(w_ptr, r0, nrows, K, x_ptr):
    """This thread's weight pointers (rows g and g + 8 of the slice, clamped to its last row) and activation
    pointer at its first step."""
    i = tl.arange(0, 256)
    lane = i % 32
    g = lane // 4
    col = (i // 32) * 64 + (lane % 4) * 8
    pa = w_ptr + (r0 + tl.minimum(g, nrows - 1)).to(tl.int64) * K + col
    pb = w_ptr + (r0 + tl.minimum(g + 8, nrows - 1)).to(tl.int64) * K + col
    return pa, pb, x_ptr + col, col, g


@triton.jit
def first_weights(w_ptr, r0, nrows, K):
    """The first two steps' weights, requested before a dependency wait (weights never depend on it); with four
    buffers the other two are requested after it."""
    pa, pb, px, col, g = tile_pointers(w_ptr, r0, nrows, K, w_ptr)
    return load_weights(pa, pb, K > 0), load_weights(pa + STEP_COLS, pb + STEP_COLS, K > STEP_COLS)


@triton.jit
def layout_holds():
    """1 when every [256] tensor's element i sits in thread i (what the inline asm relies on), else 0."""
    return tl.min((thread_index() == tl.arange(0, 256)).to(tl.int32), axis=0)


@triton.jit
def mma_rows(w_ptr, r0, nrows, K, x_ptr, y_ptr, w_cur, w_nxt, xh_ptr, xl_ptr, yh_ptr, yl_ptr,
             SPLIT: tl.constexpr, BUFS: tl.constexpr = 2):
    """y[r] = W[r0 + r, :K] . x[:K] for r < nrows (<= 16); K a multiple of BUFS x 512 (the caller checks).
    w_cur, w_nxt: first_weights().  SPLIT: x is read as its (high, low) bf16 parts (xh, xl: the producer
    split it), and y is also written so (yh, yl) for the next consumer; else x is fp32, split here."""
    pa, pb, px, col, g = tile_pointers(w_ptr, r0, nrows, K, x_ptr)
    c0 = tl.zeros((256,), tl.float32)
    c1 = tl.zeros((256,), tl.float32)
    c2 = tl.zeros((256,), tl.float32)
    c3 = tl.zeros((256,), tl.float32)
    ph = xh_ptr + col
    pl = xl_ptr + col
    nsteps = tl.cdiv(K, STEP_COLS)
    # every lane reads token 0's activations (the B operand's other columns only make sums nobody reads), so
    # no lane needs a predicate beyond the step's own
    x_a = load_x_any(px, ph, pl, nsteps > 0, SPLIT)
    x_b = load_x_any(px + STEP_COLS, ph + STEP_COLS, pl + STEP_COLS, nsteps > 1, SPLIT)
    w_a, w_b = w_cur, w_nxt
    if BUFS == 4:  # four buffers: twice the bytes in flight (nsteps a multiple of 4: K % 2048 == 0)
        w_c = load_weights(pa + 2 * STEP_COLS, pb + 2 * STEP_COLS, nsteps > 2)
        w_d = load_weights(pa + 3 * STEP_COLS, pb + 3 * STEP_COLS, nsteps > 3)
        x_c = load_x_any(px + 2 * STEP_COLS, ph + 2 * STEP_COLS, pl + 2 * STEP_COLS, nsteps > 2, SPLIT)
        x_d = load_x_any(px + 3 * STEP_COLS, ph + 3 * STEP_COLS, pl + 3 * STEP_COLS, nsteps > 3, SPLIT)
        for s in range(0, nsteps, 4):
            more = s + 4 < nsteps
            at = (s + 4) * STEP_COLS
            c0, c1, c2, c3, w_a, x_a = mma_then_reload(w_a, x_a, c0, c1, c2, c3, pa, pb, px, ph, pl, at, more, SPLIT)
            at += STEP_COLS
            c0, c1, c2, c3, w_b, x_b = mma_then_reload(w_b, x_b, c0, c1, c2, c3, pa, pb, px, ph, pl, at, more, SPLIT)
            at += STEP_COLS
            c0, c1, c2, c3, w_c, x_c = mma_then_reload(w_c, x_c, c0, c1, c2, c3, pa, pb, px, ph, pl, at, more, SPLIT)
            at += STEP_COLS
            c0, c1, c2, c3, w_d, x_d = mma_then_reload(w_d, x_d, c0, c1, c2, c3, pa, pb, px, ph, pl, at, more, SPLIT)
    else:
        # two buffers, each reloaded right after its step's mma: a step's loads are in flight while the other
        # buffer is multiplied, and nothing is copied from one buffer to the other (K % 1024 == 0)
        for s in range(0, nsteps, 2):
            more = s + 2 < nsteps
            at = (s + 2) * STEP_COLS
            c0, c1, c2, c3, w_a, x_a = mma_then_reload(w_a, x_a, c0, c1, c2, c3, pa, pb, px, ph, pl, at, more, SPLIT)
            at += STEP_COLS
            c0, c1, c2, c3, w_b, x_b = mma_then_reload(w_b, x_b, c0, c1, c2, c3, pa, pb, px, ph, pl, at, more, SPLIT)
    # token 0 is the B operand's column 0: lanes t == 0 hold its sums of rows g (c0) and g + 8 (c2); one
    # reduction over [warp, g, t, row half] adds the 8 warps' parts in a fixed order
    t = tl.arange(0, 256) % 4
    both = tl.join(tl.where(t == 0, c0, 0.0), tl.where(t == 0, c2, 0.0))  # [256, 2]
    y = tl.sum(tl.sum(tl.reshape(both, (8, 8, 4, 2)), axis=2), axis=0)  # [g, half]: row g + 8 x half
    r = tl.arange(0, 8)[:, None] + 8 * tl.arange(0, 2)[None, :]
    m = r < nrows
    tl.store(y_ptr + r, y, mask=m)
    if SPLIT:
        hi = y.to(tl.bfloat16)
        tl.store(yh_ptr + r, hi, mask=m)
        tl.store(yl_ptr + r, (y - hi.to(tl.float32)).to(tl.bfloat16), mask=m)
