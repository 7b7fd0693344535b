"""LINEAR's Gluon body: the weights streamed by TMA into a shared-memory ring by a producer warp, summed by the
consumer warps (the stream kernel, megakernel/stream_kernel.py, runs it beside the Triton kernel).

Same semantics as linear.reference, for one token (N = 1): y = (x @ W.T) * r, r = rsqrt(mean(x^2) + eps) with
NORM (the norm's weight folded into W), silu(y) * (x @ W2.T) * r with SILU_MUL, y + (x @ W2.T) * r with PAIR, plus
the residual row with RES.  Why a ring: the plain-Triton body streams ~3.0-3.3 TB/s on Llama-1B's chain, this ring
3.8 (docs/PERF.md sessions 19-20), because its producer runs ahead of the dependency waits and each slot is released
by an mbarrier instead of a CTA-wide barrier.

Addressing: the weight arena W (bf16, row-major) seen through one TMA descriptor per distinct K as [W / K, K]; a
matrix starts at a multiple of its K (graph: the stream_kernel option), so a task's tile is the box at (w_off / K +
row, c x COLS), the TMA zero-filling columns past K.  A task streams its rows in blocks: for each block, its
W tiles, then its W2 tiles (SILU_MUL, PAIR); a slot holds SUB consecutive tiles of one matrix.  Blocks are BOX
rows, ROWS (16) or 8 where the plan's tasks are multiples of 8 rows only (a 16-row box would stream up to twice
their bytes).
Sums are fp32: each thread keeps [1, 8] partial products a tile, one reduction over the row per row block.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from graph.verify import STREAM_MAX_K

TILE_ROWS, TILE_COLS = 16, 256  # a weight tile: 16 output rows x 256 columns of bf16 (8 KB), one TMA box
ROWS, COLS = gl.constexpr(TILE_ROWS), gl.constexpr(TILE_COLS)  # the same, for kernels
MAX_K_CLASSES = STREAM_MAX_K  # distinct K a stream kernel addresses (one descriptor each; the verifier's limit)


@gluon.jit
def copy_by_k_class(d0, d1, d2, d3, kclass, at, bar, dst):
    """The TMA box at `at` of the row-major arena viewed as [arena / K, K] through K class kclass's descriptor."""
    if kclass == 0:
        tma.async_copy_global_to_shared(d0, at, bar, dst)
    elif kclass == 1:
        tma.async_copy_global_to_shared(d1, at, bar, dst)
    elif kclass == 2:
        tma.async_copy_global_to_shared(d2, at, bar, dst)
    else:
        tma.async_copy_global_to_shared(d3, at, bar, dst)


@gluon.jit
def ring_buffers(desc, SLOTS: gl.constexpr, SUB: gl.constexpr, BOX: gl.constexpr = ROWS):
    """The ring: SLOTS slots of SUB [BOX, COLS] bf16 tiles in shared memory, laid out as desc's TMA boxes land,
    and each slot's two mbarriers (ready: its bytes landed; empty: the consumers are done with it)."""
    ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS * SUB, BOX, COLS], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(SLOTS):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    return ring, ready, empty


@gluon.jit
def fill_slots(d0, d1, d2, d3, kclass, row, ntiles, ring, ready, empty, it, SLOTS: gl.constexpr, SUB: gl.constexpr,
               BOX: gl.constexpr = ROWS):
    """The producer's part of one matrix's row block: ntiles tiles (a multiple of SUB) from (row, 0) on, a slot
    at a time once the consumers have released it.  The ring position after them."""
    for c in range(0, ntiles, SUB):
        s = it % SLOTS
        mbarrier.wait(empty.index(s), ((it // SLOTS) & 1) ^ 1)  # a fresh barrier passes parity 1
        mbarrier.expect(ready.index(s), SUB * BOX * COLS * 2)
        for j in gl.static_range(SUB):
            copy_by_k_class(d0, d1, d2, d3, kclass, [row, (c + j) * COLS], ready.index(s), ring.index(s * SUB + j))
        it += 1
    return it


@gluon.jit
def tile_sums(ring, ready, empty, it, x_ptr, K, ntiles, SLOTS: gl.constexpr, SUB: gl.constexpr,
              WARPS: gl.constexpr, BOX: gl.constexpr = ROWS):
    """[BOX] row sums of the next ntiles tiles from the ring (SUB a slot) times x[:K]; the ring position after
    them.  Columns past K are zeros in both (the TMA's fill, the masked load)."""
    tile_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    cols = gl.arange(0, COLS, gl.SliceLayout(0, tile_l))
    acc = gl.zeros([BOX, COLS], gl.float32, tile_l)
    for c in range(0, ntiles, SUB):
        s = it % SLOTS
        mbarrier.wait(ready.index(s), (it // SLOTS) & 1)
        for j in gl.static_range(SUB):
            k = (c + j) * COLS + cols
            xs = gl.load(x_ptr + k, mask=k < K, other=0.0)
            acc += ring.index(s * SUB + j).load(tile_l).to(gl.float32) * xs[None, :]
        # release the slot read one step earlier, not this one: the barrier before the arrive orders the warps'
        # shared-memory loads only against other generic accesses, so a warp's last loads of this slot could
        # still be in flight when the producer's TMA refills it (session 30 caught one warp reading the next
        # fill's tile this way).  A step later every warp has used those values, which it cannot do before
        # they land.  The producer runs one slot less ahead.
        mbarrier.arrive(empty.index((it + SLOTS - 1) % SLOTS), count=1, pred=it > 0)
        it += 1
    return gl.sum(acc, axis=1), it


@gluon.jit
def norm_scale(x_ptr, K, eps, WARPS: gl.constexpr):
    """rsqrt(mean(x[:K]^2) + eps), summed in COLS-wide chunks in a fixed order."""
    tile_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    cols = gl.arange(0, COLS, gl.SliceLayout(0, tile_l))
    sq = gl.zeros([COLS], gl.float32, gl.SliceLayout(0, tile_l))
    for kb in range(0, K, COLS):
        v = gl.load(x_ptr + kb + cols, mask=kb + cols < K, other=0.0)
        sq += v * v
    return 1.0 / gl.sqrt(gl.sum(sq, axis=0) / K + eps)


@gluon.jit
def ntiles_of(K, SUB: gl.constexpr):
    """Tiles a row block of a K-wide matrix streams: K / COLS rounded up to a multiple of SUB (tiles wholly past
    K are the TMA's zeros)."""
    return (K + COLS * SUB - 1) // (COLS * SUB) * SUB
