"""A warp-specialized Gluon weight stream: does a producer warp running ahead of the dependency waits
lift the GEMV chain past what the plain-Triton body streams?  (issue 4: choose the technique by
measurement.)

    python tools/gluon_stream.py [--layers 16] [--variants gluon:6x4 triton:8x2048 ...] [--consumer-warps 4]
                                 [--iters 50] [--out DIR] [--compile-only]

The chain: Llama-3.2-1B's 64 GEMVs (per layer qkv 3072x2048, o 2048x2048, gate|up 16384x2048,
down 2048x8192; 1.95 GB of bf16), each GEMV's input the first K entries of the previous one's output,
so GEMV j cannot start before GEMV j-1 has finished everywhere (DESIGN.md measured this chain: cuBLAS
in a CUDA graph 0.68 ms, plain-Triton persistent kernels 0.95 ms at best).

The kernel is the megakernel's skeleton without its other ops: one CTA per SM runs a queue of tasks
(16 output rows of one GEMV each), waits on a per-GEMV counter (acquire, bounded), computes, and
signals (release).  What differs from megakernel/ops/linear.py is who reads the weights:
- the weights are packed tile-major (each task's [16, 256] bf16 tiles contiguous, in queue order),
  so one TMA descriptor addresses every tile of every matrix, K tails zero-filled by the packing;
  or (gluonrm variants) they stay row-major as the megakernel's arena has them, each matrix starting
  at a multiple of its K, and one descriptor per distinct K views the arena as [arena / K, K]: a
  task's tile is the box at (its first row, c x 256), the TMA zero-filling columns past K;
- a 1-warp producer partition walks the same queue and streams tiles into a ring of shared-memory
  slots by TMA, guarded by mbarriers (ready: bytes landed; empty: consumers done).  It never waits
  on a dependency counter, so the next tasks' weights are in flight while the consumers wait;
- the consumer warps wait, read each tile from shared memory, multiply by the activation slice and
  keep [16, 256] partial sums in registers; one reduction per task, fp32 throughout.

Beside it, triton:BRxKC variants run the same tasks through the plain-Triton LINEAR body
(ops/linear.stream_chunks over row-major weights, 8 warps as the megakernel), so the comparison is
the body's, not the skeleton's.  Reports, in one process: each variant with the waits (the chain) and
without (every GEMV reads the chain's input: the stream's ceiling), the same GEMVs as torch.mv in a
CUDA graph (cuBLAS), and the floor (bytes / x.sum()'s streaming read).  Results are checked against
torch in fp32 first; docs/PERF.md session 9 has the figures.  The dependency waits are bounded (an
error flag); the ring's mbarrier waits are not (a tool, not the engine).
Gluon does not run under TRITON_INTERPRET: tests/test_gluon_stream.py compiles it for sm_90 on a
CPU and checks it on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megakernel.memory import STREAM_SLACK  # noqa: E402
from megakernel.ops import linear  # noqa: E402
# the ring's pieces are the engine's (its stream kernel streams LINEAR tasks the same way)
from megakernel.ops.linear_ring import (COLS, MAX_K_CLASSES, ROWS, TILE_COLS, TILE_ROWS,  # noqa: E402,F401
                                        copy_by_k_class, ring_buffers, tile_sums)
from tools import mma_stream  # noqa: E402
from tools.tma_stream import flat_ring_kernel, plain_load, spin_wait  # noqa: E402

# a task: first tile, tiles, x offset, K, y offset, valid rows, its GEMV, that GEMV's predecessor's task count,
# its matrix's offset in the row-major arena and its first row (the plain-Triton kernel), and for row-major
# TMA its K class (which descriptor) and its first row in that class's [arena / K, K] view
FIELDS = gl.constexpr(12)
MAX_SPINS = gl.constexpr(1 << 24)  # a dependency wait polls at most this often, then flags an error (never hangs)
STRIDE = 32  # int32s between counters: one per 128-byte line
COUNTER_STRIDE = gl.constexpr(STRIDE)
LLAMA_1B = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # (N, K) of one layer's GEMVs


@gluon.jit
def _producer(d0, d1, d2, d3, tasks, queue, ring, ready, empty, SLOTS: gl.constexpr, SUB: gl.constexpr,
              RM: gl.constexpr):
    """Streams the worker's tiles into the ring in queue order, SLOTS ahead of the consumers: a slot holds
    SUB consecutive tiles of one task (its count of tiles is a multiple of SUB), one barrier for all.
    RM: tiles addressed in the row-major arena through the task's K class's descriptor (d0..d3: rows of
    K, columns past K zero-filled by the TMA), else tile-major through d0."""
    pid = gl.program_id(0)
    it = 0
    for t in range(gl.load(queue + pid), gl.load(queue + pid + 1)):
        task = tasks + t * FIELDS
        tile0 = gl.load(task)
        kclass = gl.load(task + 10)
        row0 = gl.load(task + 11)
        for c in range(0, gl.load(task + 1), SUB):
            s = it % SLOTS
            mbarrier.wait(empty.index(s), ((it // SLOTS) & 1) ^ 1)  # a fresh barrier passes parity 1
            mbarrier.expect(ready.index(s), SUB * ROWS * COLS * 2)
            for j in gl.static_range(SUB):
                if RM:
                    copy_by_k_class(d0, d1, d2, d3, kclass, [row0, (c + j) * COLS], ready.index(s),
                                    ring.index(s * SUB + j))
                else:
                    tma.async_copy_global_to_shared(d0, [(tile0 + c + j) * ROWS, 0], ready.index(s),
                                                    ring.index(s * SUB + j))
            it += 1


@triton.jit
def _wait(counter, target, err):
    """Polls counter (acquire) until it reaches target; False (and the error flag set) after MAX_SPINS.
    Scalar operations only, so both kernels call it (a Triton function called from a Gluon kernel
    compiles in the Gluon dialect)."""
    spins = 0
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while (seen < target) & (spins < MAX_SPINS):
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        tl.atomic_xchg(err, 1, sem="relaxed", scope="gpu")
    return seen >= target


@gluon.jit
def launch_epoch(epoch_ptr, err):
    """This launch's epoch for the worker (counters only grow: a wait's target is epoch x count) and whether no
    worker had flagged an error when it started."""
    pid = gl.program_id(0)
    epoch = gl.load(epoch_ptr + pid) + 1
    gl.store(epoch_ptr + pid, epoch)
    return epoch, gl.atomic_add(err, 0, sem="relaxed", scope="gpu") == 0


@gluon.jit
def _consumer(tasks, queue, counters, epoch_ptr, err, act, ring, ready, empty, WAIT: gl.constexpr,
              SLOTS: gl.constexpr, SUB: gl.constexpr, WARPS: gl.constexpr):
    """Runs the worker's tasks: wait on the previous GEMV's counter, stream its tiles, store, signal."""
    tile_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rows = gl.arange(0, ROWS, gl.SliceLayout(1, tile_l))
    pid = gl.program_id(0)
    epoch, ok = launch_epoch(epoch_ptr, err)
    it = 0
    for t in range(gl.load(queue + pid), gl.load(queue + pid + 1)):
        task = tasks + t * FIELDS
        ntiles = gl.load(task + 1)
        x_off = (gl.load(task + 2) // 8) * 8  # multiples of 8 (the host checks): 16-byte activation loads
        K = (gl.load(task + 3) // 8) * 8
        y_off = gl.load(task + 4)
        nrows = gl.load(task + 5)
        gemv = gl.load(task + 6)  # the GEMV this task belongs to; its predecessor's task count next
        if WAIT:
            if gemv > 0:
                if ok:
                    ok = _wait(counters + (gemv - 1) * COUNTER_STRIDE, epoch * gl.load(task + 7), err)
        out, it = tile_sums(ring, ready, empty, it, act + x_off, K, ntiles, SLOTS, SUB, WARPS)
        gl.store(act + y_off + rows, out, mask=(rows < nrows) & ok)
        gl.thread_barrier()  # every consumer's stores before the release
        gl.atomic_add(counters + gemv * COUNTER_STRIDE, 1, sem="release", scope="gpu")


@gluon.jit
def gemv_chain_kernel(d0, d1, d2, d3, tasks, queue, counters, epoch_ptr, err, act, WAIT: gl.constexpr,
                      SLOTS: gl.constexpr, SUB: gl.constexpr, WARPS: gl.constexpr, RM: gl.constexpr):
    ring, ready, empty = ring_buffers(d0, SLOTS, SUB)
    gl.warp_specialize([(_consumer, (tasks, queue, counters, epoch_ptr, err, act, ring, ready, empty, WAIT, SLOTS,
                                     SUB, WARPS)),
                        (_producer, (d0, d1, d2, d3, tasks, queue, ring, ready, empty, SLOTS, SUB, RM))], [1],
                       [40])


# ---- the same tasks through the plain-Triton body (megakernel/ops/linear.py), for the comparison ----------
@triton.jit
def row_major_task(task, W):
    """A task's (x offset, K, y offset, rows, GEMV, its weights in the row-major arena, first row); offsets and K
    multiples of 8 (the host checks), written so the compiler sees it: 16-byte loads."""
    return ((tl.load(task + 2) // 8) * 8, (tl.load(task + 3) // 8) * 8, tl.load(task + 4), tl.load(task + 5),
            tl.load(task + 6), W + (tl.load(task + 8) // 8) * 8, tl.load(task + 9))


@triton.jit
def triton_chain_kernel(W, A, tasks, queue, counters, epoch_ptr, err, WAIT: tl.constexpr, BR: tl.constexpr,
                        KC: tl.constexpr):
    """Each task as the megakernel runs a LINEAR one: its first weight chunk requested, the wait, then
    linear.stream_chunks over row-major weights (W, with memory.STREAM_SLACK after the last matrix)."""
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr + pid) + 1
    tl.store(epoch_ptr + pid, epoch)
    for t in range(tl.load(queue + pid), tl.load(queue + pid + 1)):
        task = tasks + t * FIELDS
        x_off, K, y_off, nrows, gemv, w_ptr, r0 = row_major_task(task, W)
        w = linear.first_chunk(w_ptr, r0, r0 + nrows, K, BR, KC, 8)
        if WAIT:
            if gemv > 0:
                _wait(counters + (gemv - 1) * COUNTER_STRIDE, epoch * tl.load(task + 7), err)
        no = gemv < 0  # no residual, no gate|up (a runtime False, as the megakernel's flags are)
        linear.stream_chunks(A + x_off, K, tasks, 0, 1, A + (y_off - r0), 0, A, 0, no, w_ptr, w_ptr, no, r0,
                             r0 + nrows, K, w, False, 0.0, BR, KC, 8, 1, 1, 16)
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_add(counters + gemv * COUNTER_STRIDE, 1, sem="release", scope="gpu")


@triton.jit
def tma_chain_kernel(W, A, tasks, queue, counters, epoch_ptr, err, WAIT: tl.constexpr, STAGES: tl.constexpr,
                     KC: tl.constexpr, EARLY: tl.constexpr = 0):
    """The CUDA-core GEMV over a ring of shared-memory tiles that plain Triton builds itself: a device-side
    tensor descriptor for the task's rows (TMA, columns past K zero-filled) and a K loop pipelined STAGES
    deep (tl.range(num_stages=...): the first STAGES - 1 tiles requested before the first is multiplied,
    mbarriers for each), so up to STAGES x 16 x KC weights per SM are in flight without registers holding
    them.  EARLY 0: the wait comes before the loop, so the ring starts filling only after it.  EARLY 1: the
    wait is the loop's first turn (spin_wait: one asm, so the loop is still pipelined), after the pipeliner's
    prologue has asked for the first STAGES - 1 tiles: a task's weights stream while it waits, and its
    activations are read only after it (asm loads, their address plus the wait's opaque zero: spin_wait).
    A timed-out spin is flagged by thread 0's (every thread polls the same counter, so all time out alike)."""
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr + pid) + 1
    tl.store(epoch_ptr + pid, epoch)
    rows = tl.arange(0, 16)
    cols = tl.arange(0, KC)
    for t in range(tl.load(queue + pid), tl.load(queue + pid + 1)):
        task = tasks + t * FIELDS
        x_off, K, y_off, nrows, gemv, w_ptr, r0 = row_major_task(task, W)
        desc = tl.make_tensor_descriptor(w_ptr + r0.to(tl.int64) * K, shape=[nrows, K], strides=[K, 1],
                                         block_shape=[16, KC])
        waits = WAIT & (gemv > 0)
        counter = counters + (gemv - 1) * COUNTER_STRIDE
        target = epoch * tl.load(task + 7)
        if not EARLY:
            if waits:
                _wait(counter, target, err)
        acc = tl.zeros((16, KC), tl.float32)
        x_ptr = A + x_off
        for k in tl.range(0, K, KC, num_stages=STAGES):
            w = desc.load([0, k])
            if EARLY:
                if k == 0:
                    if waits:
                        x_ptr += spin_wait(counter, target, err)  # + 0: the activations' loads after the wait
            if EARLY:  # an asm load: Triton's pipeliner would fetch a tl.load stages ahead, and so put the first
                x = plain_load(x_ptr + k + cols, k + cols < K)  # turn's wait before the weights' first requests
            else:
                x = tl.load(x_ptr + k + cols, mask=k + cols < K, other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        tl.store(A + y_off + rows, tl.sum(acc, axis=1), mask=rows < nrows)
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_add(counters + gemv * COUNTER_STRIDE, 1, sem="release", scope="gpu")


@triton.jit
def mma_chain_kernel(W, A, AH, AL, tasks, queue, counters, epoch_ptr, err, WAIT: tl.constexpr, SPLIT: tl.constexpr,
                     BUFS: tl.constexpr = 2):
    """Each task through the tensor-core stream (tools/mma_stream.py): its first two steps' weights requested,
    the wait, then mma_rows.  SPLIT: activations also kept as (high, low) bf16 parts (AH, AL), written by
    each GEMV's epilogue and read by the next.  A layout mismatch (an element not in its own thread) sets
    err = 2 and runs nothing."""
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr + pid) + 1
    tl.store(epoch_ptr + pid, epoch)
    held = mma_stream.layout_holds() == 1
    if not held:
        tl.atomic_xchg(err, 2, sem="relaxed", scope="gpu")
    if held:
        for t in range(tl.load(queue + pid), tl.load(queue + pid + 1)):
            task = tasks + t * FIELDS
            x_off, K, y_off, nrows, gemv, w_ptr, r0 = row_major_task(task, W)
            w_cur, w_nxt = mma_stream.first_weights(w_ptr, r0, nrows, K)
            if WAIT:
                if gemv > 0:
                    _wait(counters + (gemv - 1) * COUNTER_STRIDE, epoch * tl.load(task + 7), err)
            mma_stream.mma_rows(w_ptr, r0, nrows, K, A + x_off, A + y_off, w_cur, w_nxt, AH + x_off, AL + x_off,
                                AH + y_off, AL + y_off, SPLIT, BUFS)
            tl.debug_barrier()  # every thread's stores before the release
            tl.atomic_add(counters + gemv * COUNTER_STRIDE, 1, sem="release", scope="gpu")


# ---- host ----------------------------------------------------------------------------------------
@dataclass
class Chain:
    """The GEMVs, their weights packed tile-major, the task table and the per-worker queues."""
    shapes: list[tuple[int, int]]  # (N, K) per GEMV
    weights: list[torch.Tensor]  # [N, K] bf16, for the reference and cuBLAS
    arena: torch.Tensor  # [tiles x TILE_ROWS, TILE_COLS] bf16
    rowmajor: torch.Tensor  # every matrix row-major, one after another, then STREAM_SLACK zeros (Triton's)
    tasks: torch.Tensor  # [n_tasks, FIELDS] int32, in queue order
    queue: torch.Tensor  # [workers + 1] int32: worker w runs tasks queue[w]..queue[w+1]
    x_off: list[int]  # where each GEMV reads its input in the activation buffer
    y_off: list[int]  # where it writes its output
    act_size: int
    klasses: list[int]  # the distinct K, in K-class order


def k_tiles(k: int, sub: int = 1) -> int:
    """Tiles per row block: K in TILE_COLS-wide tiles, rounded up to whole ring slots of sub tiles."""
    return -(-k // (TILE_COLS * sub)) * sub


def tile_major(w: torch.Tensor, sub: int = 1) -> torch.Tensor:
    """[N, K] -> [tiles x TILE_ROWS, TILE_COLS]: row block r's K tiles one after another, zero-padded."""
    n, k = w.shape
    nr, nk = -(-n // TILE_ROWS), k_tiles(k, sub)
    padded = torch.zeros(nr * TILE_ROWS, nk * TILE_COLS, dtype=w.dtype, device=w.device)
    padded[:n, :k] = w
    return padded.view(nr, TILE_ROWS, nk, TILE_COLS).permute(0, 2, 1, 3).reshape(nr * nk * TILE_ROWS, TILE_COLS)


def build_chain(shapes, workers: int, chained: bool, device, seed: int = 0, sub: int = 1) -> Chain:
    """Random weights (~N(0, 1/K), so activations stay ~1 along the chain) and balanced queues: GEMV j's
    tasks go round-robin from where GEMV j-1's ended, each worker's queue in GEMV order (a task waits only
    on earlier GEMVs, which every queue runs first: no deadlock)."""
    g = torch.Generator(device=device).manual_seed(seed)
    weights = [(torch.randn(n, k, generator=g, device=device) / k ** 0.5).to(torch.bfloat16) for n, k in shapes]
    if any(k % 8 for _, k in shapes):
        raise ValueError(f"gluon_stream: every K must be a multiple of 8 (16-byte activation loads): {shapes}")
    if chained and any(k > shapes[j - 1][0] for j, (_, k) in enumerate(shapes) if j > 0):
        raise ValueError(f"gluon_stream: a chained GEMV reads K <= the previous one's N entries: {shapes}")
    arena = torch.cat([tile_major(w, sub) for w in weights])
    # row-major, each matrix starting at a multiple of its K: its rows are then rows of the arena viewed
    # as [arena / K, K], which one TMA descriptor per distinct K addresses (row-major TMA)
    klasses = sorted({k for _, k in shapes})
    if len(klasses) > MAX_K_CLASSES:
        raise ValueError(f"gluon_stream: at most {MAX_K_CLASSES} distinct K, got {klasses}")
    w_base, end = [], 0
    for n, k in shapes:
        w_base.append(-(-end // k) * k)
        end = w_base[-1] + n * k
    rowmajor = weights[0].new_zeros(end + STREAM_SLACK)
    for w, base in zip(weights, w_base):
        rowmajor[base: base + w.numel()] = w.reshape(-1)
    x_off, y_off, base = [], [], max(k for _, k in shapes)  # act[0:max K] is the chain's input
    for j, (n, k) in enumerate(shapes):
        x_off.append(y_off[j - 1] if chained and j > 0 else 0)
        y_off.append(base)
        base += -(-n // 8) * 8  # the next GEMV's input starts 16-byte aligned
    per_worker: list[list[list[int]]] = [[] for _ in range(workers)]
    tile, w = 0, 0
    for j, (n, k) in enumerate(shapes):
        nr, nk = -(-n // TILE_ROWS), k_tiles(k, sub)
        prev = -(-shapes[j - 1][0] // TILE_ROWS) if j > 0 else 0
        for r in range(nr):
            rows = min(TILE_ROWS, n - r * TILE_ROWS)
            per_worker[w].append([tile, nk, x_off[j], k, y_off[j] + r * TILE_ROWS, rows, j, prev, w_base[j],
                                  r * TILE_ROWS, klasses.index(k), w_base[j] // k + r * TILE_ROWS])
            tile += nk
            w = (w + 1) % workers
    table = [t for q in per_worker for t in q]
    queue = torch.tensor([0] + [len(q) for q in per_worker], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return Chain(list(shapes), weights, arena, rowmajor, torch.tensor(table, dtype=torch.int32, device=device),
                 queue.to(device), x_off, y_off, base, klasses)


def descriptors(chain: Chain, row_major: bool) -> list:
    """The kernel's four TMA descriptors: the tile-major arena's (four times), or one per K class over
    the row-major arena viewed as [arena / K, K] (the first repeated where a chain has fewer K)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    if not row_major:
        return [TensorDescriptor.from_tensor(chain.arena, [TILE_ROWS, TILE_COLS], layout)] * MAX_K_CLASSES
    views = [chain.rowmajor[: chain.rowmajor.numel() // k * k].view(-1, k) for k in chain.klasses]
    descs = [TensorDescriptor.from_tensor(v, [TILE_ROWS, TILE_COLS], layout) for v in views]
    return descs + descs[:1] * (MAX_K_CLASSES - len(descs))


def independent(chain: Chain) -> Chain:
    """The chain's GEMVs without their dependencies: every one reads the chain's input (act[0:K]), its
    weights and arenas shared, not copied (build_chain with chained=False builds the same tasks)."""
    tasks = chain.tasks.clone()
    tasks[:, 2] = 0
    return dataclasses.replace(chain, tasks=tasks, x_off=[0] * len(chain.shapes))


@dataclass(frozen=True)
class Variant:
    """gluon:SLOTSxSUB (ring slots of SUB 8 KB tiles, consumer warps; tile-major weights), gluonrm:SLOTSxSUB
    (the same ring fed from the row-major arena, one descriptor per K), triton:BRxKC (the LINEAR body's
    weight chunk: BR rows x KC columns, 8 warps as the megakernel), mma:16x512 (the tensor-core stream,
    tools/mma_stream.py: 16-row tasks, 512 columns a step over 8 warps, two steps' weights in flight; every K a
    multiple of 1024; mma:16x2048 four steps in flight, K a multiple of 2048) or mmas:16x512 / mmas:16x2048
    (the same, the activations kept as (high, low) bf16 parts by their producer), tma:STAGESxKC (the CUDA-core
    GEMV over a STAGES-deep ring of 16 x KC tiles that Triton's pipeliner builds from a tensor descriptor) or
    tmaw:STAGESxKC (the same with the dependency wait inside the ring's first turn: weights in flight while
    the task waits) or tmaf:STAGESxSUB (tools/tma_stream.py: one ring over all of a worker's tasks, STAGES slots
    of SUB 8 KB tiles, the weights repacked in queue order)."""
    kind: str
    a: int
    b: int
    warps: int = 4

    @staticmethod
    def parse(spec: str, warps: int = 4) -> "Variant":
        kind, _, shape = spec.partition(":")
        try:
            a, b = (int(v) for v in shape.split("x"))
        except ValueError:
            raise ValueError(f"variant {spec!r}: gluon:SLOTSxSUB, gluonrm:SLOTSxSUB, triton:BRxKC, mma[s]:16x512, "
                             "mma[s]:16x2048, tma:STAGESxKC, tmaw:STAGESxKC or tmaf:STAGESxSUB") from None
        if kind not in ("gluon", "gluonrm", "triton", "mma", "mmas", "tma", "tmaw", "tmaf"):
            raise ValueError(f"variant {spec!r}: the kind is gluon, gluonrm, triton, mma, mmas, tma, tmaw or tmaf")
        # Triton's pipeliner keeps STAGES - 1 loads in flight, each its own shared-memory buffer
        if kind == "tmaf" and (a < 2 or b not in (1, 2, 4, 8) or (a - 1) * b * TILE_ROWS * TILE_COLS * 2 > 200 * 1024):
            raise ValueError(f"variant {spec!r}: tmaf:STAGESxSUB takes 2 or more stages of SUB (1, 2, 4 or 8) tiles "
                             f"of {TILE_ROWS} x {TILE_COLS} bf16, STAGES - 1 of them at most 200 KB")
        if kind in ("tma", "tmaw") and (a < 2 or b not in (64, 128, 256, 512, 1024) or a * 16 * b * 2 > 200 * 1024):
            raise ValueError(f"variant {spec!r}: tma:STAGESxKC takes 2 or more stages of 16 x KC bf16 tiles, KC a "
                             "power of two from 64 to 1024 (Triton sends a tile wider than a TMA box as several), at "
                             "most 200 KB in all")
        if kind in ("mma", "mmas") and (a, b) not in ((TILE_ROWS, 512), (TILE_ROWS, 2048)):
            raise ValueError(f"variant {spec!r}: the tensor-core stream runs tasks of {TILE_ROWS} rows in steps of 512 "
                             "columns (mma:16x512)")
        return Variant(kind, a, b, warps if kind in ("gluon", "gluonrm") else 8)

    @property
    def gluon(self) -> bool:
        return self.kind in ("gluon", "gluonrm")

    @property
    def sub(self) -> int:
        return self.b if self.gluon or self.kind == "tmaf" else 1

    def __str__(self) -> str:
        return f"{self.kind}:{self.a}x{self.b}"


def mma_buffers(v: "Variant") -> int:
    """The tensor-core stream's register buffers: mma:16x512 two (1024 columns in flight), 16x2048 four."""
    return 2 if v.b == 512 else 4


def queue_ordered(chain: Chain, sub: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile-major arena's tiles in queue order, as [tiles, 16, 256] (so a worker's weight slots of sub tiles
    follow one another), and each worker's first slot: [workers + 1] int32, the last entry the slot count."""
    tasks, queue = chain.tasks.cpu(), chain.queue.cpu()
    order = torch.cat([torch.arange(int(t0), int(t0) + int(nk)) for t0, nk in tasks[:, :2].tolist()])
    slots = (tasks[:, 1] // sub).cumsum(0)
    ends = [int(slots[int(q) - 1]) if q > 0 else 0 for q in queue.tolist()]
    tiles = chain.arena.view(-1, TILE_ROWS, TILE_COLS)
    return tiles[order.to(tiles.device)], torch.tensor(ends, dtype=torch.int32, device=tiles.device)


def _descriptor_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


class ChainRun:
    """One variant's launch state over a chain: counters, epochs, error flag, activation buffer."""

    def __init__(self, chain: Chain, workers: int, wait: bool, variant: Variant):
        dev = chain.arena.device
        self.chain, self.workers, self.wait, self.v = chain, workers, wait, variant
        if variant.kind in ("mma", "mmas") and any(k % (mma_buffers(variant) * 512) for _, k in chain.shapes):
            raise ValueError(f"{variant}: every K must be a multiple of {mma_buffers(variant) * 512} (its buffers' "
                             f"512-column steps), got {chain.shapes}")
        if variant.gluon:
            self.descs = descriptors(chain, variant.kind == "gluonrm")
        if variant.kind == "tmaf":
            self.queued, self.first = queue_ordered(chain, variant.sub)
        self.counters = torch.zeros(len(chain.shapes) * STRIDE, dtype=torch.int32, device=dev)
        self.epochs = torch.zeros(workers, dtype=torch.int32, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        self.act = torch.zeros(chain.act_size, dtype=torch.float32, device=dev)
        self.act_hi = torch.zeros(chain.act_size, dtype=torch.bfloat16, device=dev)  # mmas: act's (high, low) parts
        self.act_lo = torch.zeros(chain.act_size, dtype=torch.bfloat16, device=dev)

    def set_input(self, x0: torch.Tensor) -> None:
        """The chain's input, act[0:len(x0)] (and its (high, low) bf16 parts); everything after it zeroed."""
        self.act.zero_()
        self.act[:x0.numel()] = x0
        hi = x0.to(torch.bfloat16)
        self.act_hi.zero_()
        self.act_lo.zero_()
        self.act_hi[:x0.numel()] = hi
        self.act_lo[:x0.numel()] = (x0 - hi.float()).to(torch.bfloat16)

    def launch(self) -> None:
        c, v = self.chain, self.v
        if v.gluon:
            gemv_chain_kernel[(self.workers,)](*self.descs, c.tasks, c.queue, self.counters, self.epochs, self.err,
                                                self.act, WAIT=self.wait, SLOTS=v.a, SUB=v.b, WARPS=v.warps,
                                                RM=v.kind == "gluonrm", num_warps=v.warps)
        elif v.kind in ("tma", "tmaw"):
            triton.set_allocator(_descriptor_scratch)  # device-side descriptors: 128 bytes each, in global memory
            tma_chain_kernel[(self.workers,)](c.rowmajor, self.act, c.tasks, c.queue, self.counters, self.epochs,
                                               self.err, WAIT=self.wait, STAGES=v.a, KC=v.b, EARLY=v.kind == "tmaw",
                                               num_warps=8)
        elif v.kind == "tmaf":
            triton.set_allocator(_descriptor_scratch)
            flat_ring_kernel[(self.workers,)](self.queued, self.act, c.tasks, c.queue, self.first, self.counters,
                                               self.epochs, self.err, WAIT=self.wait, STAGES=v.a, SUB=v.b,
                                               FIELDS=FIELDS.value, STRIDE=STRIDE, num_warps=8)
        elif v.kind in ("mma", "mmas"):
            mma_chain_kernel[(self.workers,)](c.rowmajor, self.act, self.act_hi, self.act_lo, c.tasks, c.queue,
                                               self.counters, self.epochs, self.err, WAIT=self.wait,
                                               SPLIT=v.kind == "mmas", BUFS=mma_buffers(v), num_warps=8)
        else:
            triton_chain_kernel[(self.workers,)](c.rowmajor, self.act, c.tasks, c.queue, self.counters, self.epochs,
                                                  self.err, WAIT=self.wait, BR=v.a, KC=v.b, num_warps=v.warps)

    def check_error(self) -> None:
        if int(self.err.item()) == 2:
            raise RuntimeError(f"{self.v}: a [256] tensor's element did not sit in its own thread (the layout "
                               "tools/mma_stream.py relies on)")
        if int(self.err.item()):
            raise RuntimeError(f"{self.v}: a dependency wait ran past MAX_SPINS polls "
                               f"(counters {self.counters[::STRIDE].tolist()}, epochs {self.epochs.tolist()})")

    def outputs(self) -> list[torch.Tensor]:
        return [self.act[o:o + n] for o, (n, _) in zip(self.chain.y_off, self.chain.shapes)]


def compile_sm90(slots: int, sub: int, warps: int, wait: bool = True, row_major: bool = False, maxnreg: int = 0):
    """The kernel compiled for an H100/H200 on any machine (Gluon has no interpreter: a CPU's check)."""
    return compile_ring_kernel_sm90(gemv_chain_kernel, {"WAIT": wait, "SLOTS": slots, "SUB": sub, "WARPS": warps,
                                                        "RM": row_major}, warps, maxnreg)


def compile_ring_kernel_sm90(fn, constexprs: dict, warps: int, maxnreg: int = 0):
    """A ring kernel with this file's arguments (four tile descriptors, the task table, queue, counters, epochs,
    error flag, activations) and these constexprs, compiled for sm_90 on any machine."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    tile = torch.zeros(TILE_ROWS, TILE_COLS, dtype=torch.bfloat16)
    desc = native_specialize_impl(BaseBackend, TensorDescriptor.from_tensor(tile, [TILE_ROWS, TILE_COLS], layout),
                                  False, True, True)[0]
    sig = {**{f"d{i}": desc for i in range(MAX_K_CLASSES)},
           **{n: "*i32" for n in ("tasks", "queue", "counters", "epoch_ptr", "err")}, "act": "*fp32",
           **{n: "constexpr" for n in constexprs}}
    first = MAX_K_CLASSES  # pointers follow the descriptors; 16-byte aligned, as the JIT finds torch tensors
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(first, first + 6)}
    return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})})


def _compile_triton_sm90(fn, pointers: dict, constexprs: dict, warps: int = 8):
    """A plain-Triton chain kernel compiled for sm_90a on any machine (a CPU's check of its TTGIR, PTX and SASS):
    `pointers` (name -> type) in the kernel's order, all 16-byte aligned as the JIT finds torch tensors."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {**pointers, **{n: "constexpr" for n in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def ptxas_registers(ptx: str) -> int:
    """Registers a thread of this PTX uses, as ptxas reports for sm_90a (offline: a CompiledKernel knows its
    registers only once loaded on a GPU)."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, "k.ptx").write_text(ptx)
        out = subprocess.run([str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"),
                              "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k.o"], capture_output=True, text=True,
                             check=True)
    return int(re.search(r"Used (\d+) registers", out.stderr).group(1))


_CHAIN_POINTERS = {n: "*i32" for n in ("tasks", "queue", "counters", "epoch_ptr", "err")}


def compile_tma_sm90(stages: int, kc: int, wait: bool = True, early: bool = False):
    """The plain-Triton TMA-ring chain kernel, compiled for sm_90a."""
    return _compile_triton_sm90(tma_chain_kernel, {"W": "*bf16", "A": "*fp32", **_CHAIN_POINTERS},
                                {"WAIT": wait, "STAGES": stages, "KC": kc, "EARLY": early})


def compile_flat_sm90(stages: int, sub: int, wait: bool = True):
    """tools/tma_stream.py's one-ring-per-worker chain kernel, compiled for sm_90a."""
    return _compile_triton_sm90(flat_ring_kernel, {"Q": "*bf16", "A": "*fp32", "tasks": "*i32", "queue": "*i32",
                                                   "first": "*i32", "counters": "*i32", "epoch_ptr": "*i32",
                                                   "err": "*i32"},
                                {"WAIT": wait, "STAGES": stages, "SUB": sub, "FIELDS": FIELDS.value,
                                 "STRIDE": STRIDE})


def compile_mma_sm90(wait: bool = True, split: bool = False, bufs: int = 2):
    """The tensor-core chain kernel, compiled for sm_90a."""
    return _compile_triton_sm90(mma_chain_kernel, {"W": "*bf16", "A": "*fp32", "AH": "*bf16", "AL": "*bf16",
                                                   **_CHAIN_POINTERS}, {"WAIT": wait, "SPLIT": split, "BUFS": bufs})


def reference(chain: Chain, x0: torch.Tensor, chained: bool) -> list[torch.Tensor]:
    """Each GEMV in fp32 from the same bf16 weights."""
    outs, x = [], x0
    for w, (n, k) in zip(chain.weights, chain.shapes):
        outs.append(w.float() @ (x[:k] if chained else x0[:k]))
        x = outs[-1]
    return outs


def graph_of(fn, warmup: int = 3) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--variants", nargs="*", default=["gluon:6x4", "gluon:12x2", "gluon:24x1", "triton:16x1024",
                                                    "triton:8x2048"], metavar="KIND:AxB",
                   help="gluon:SLOTSxSUB (a ring of SLOTS slots of SUB 8 KB tiles; at most ~220 KB in all) or "
                        "triton:BRxKC (the plain-Triton LINEAR body's chunk)")
    p.add_argument("--consumer-warps", type=int, default=4)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=".")
    p.add_argument("--compile-only", action="store_true", help="compile for sm_90 (no GPU needed), print its sizes")
    args = p.parse_args()
    variants = [Variant.parse(spec, args.consumer_warps) for spec in args.variants]
    if args.compile_only:
        for v in variants:
            if v.kind in ("tma", "tmaw"):
                k = compile_tma_sm90(v.a, v.b, early=v.kind == "tmaw")
                ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
                # with the wait in the first turn (tmaw), the ring's first STAGES - 1 requests must come before it
                ahead = (f" ({ttgir[:ttgir.find('SPIN:')].count('async_tma_copy_global_to_local')} before the wait)"
                         if v.kind == "tmaw" else "")
                print(f"sm_90a: {v}, {ptx.count('cp.async.bulk.tensor')} TMA loads{ahead}, shared "
                      f"{k.metadata.shared} bytes, ptx {len(ptx)} chars")
            if v.kind == "tmaf":
                k = compile_flat_sm90(v.a, v.b)
                ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
                ahead = ttgir[:ttgir.find('SPIN:')].count('async_tma_copy_global_to_local')
                print(f"sm_90a: {v}, {ptx.count('cp.async.bulk.tensor')} TMA loads ({ahead} before the wait), "
                      f"shared {k.metadata.shared} bytes, {ptxas_registers(ptx)} registers, "
                      f"ptx {len(ptx)} chars")
            if v.kind in ("mma", "mmas"):
                ptx = compile_mma_sm90(split=v.kind == "mmas", bufs=mma_buffers(v)).asm["ptx"]
                assert "ld.global.gpu.acquire" in ptx or "atom.global.gpu.acquire" in ptx  # the dependency counters
                print(f"sm_90a: {v}, {ptx.count('mma.sync.aligned.m16n8k16')} mma.sync, "
                      f"{ptx.count('ld.global.nc.L1::no_allocate.v4')} weight loads, ptx {len(ptx)} chars")
            if v.gluon:
                k = compile_sm90(v.a, v.b, v.warps, row_major=v.kind == "gluonrm")
                ptx = k.asm["ptx"]
                assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx and "setmaxnreg" in ptx
                assert "ld.global.gpu.acquire" in ptx and "atom.global.gpu.release" in ptx  # the dependency counters
                print(f"sm_90: {v}, shared {k.metadata.shared} bytes, ptx {len(ptx)} chars")
        return
    if not torch.cuda.is_available():
        raise SystemExit("gluon_stream times a Gluon kernel: it needs a GPU (Gluon has no interpreter)")
    from tools.bench import read_bandwidth, time_ms
    props = torch.cuda.get_device_properties(0)
    workers = props.multi_processor_count
    shapes = LLAMA_1B * args.layers
    nbytes = sum(n * k * 2 for n, k in shapes)
    bw = read_bandwidth()
    x0 = torch.randn(max(k for _, k in shapes), device="cuda")
    rows = []
    for sub in sorted({v.sub for v in variants}):
        chained = build_chain(shapes, workers, True, "cuda", sub=sub)
        # the same weights and arenas twice: as a chain, and every GEMV reading the chain's input
        for wait, chain in ((True, chained), (False, independent(chained))):
            ref = reference(chain, x0, wait)
            for v in [v for v in variants if v.sub == sub]:
                run = ChainRun(chain, workers, wait, v)
                run.set_input(x0)
                run.launch()
                torch.cuda.synchronize()
                run.check_error()
                err = max(float((o - r).norm() / r.norm()) for o, r in zip(run.outputs(), ref))
                graph = graph_of(run.launch)
                ms = time_ms(graph.replay, iters=args.iters, warmup=5)
                run.check_error()
                rows.append({"kernel": str(v), "waits": wait, "warps": v.warps, "ms": ms,
                             "TBps": nbytes / ms / 1e9, "rel_err": err})
                print(rows[-1], flush=True)
                del run, graph
        weights = chained.weights
        del chain, chained
    rows.sort(key=lambda r: not r["waits"])  # the chain's rows first
    # cuBLAS: the same chain as torch.mv launches in one CUDA graph (bf16 activations)
    xb = x0.to(torch.bfloat16)

    def cublas_chain():
        x = xb
        for w in weights:
            x = torch.mv(w, x[:w.shape[1]])
    ms = time_ms(graph_of(cublas_chain).replay, iters=args.iters, warmup=5)
    rows.append({"kernel": "cublas graph", "waits": True, "warps": 0, "ms": ms,
                 "TBps": nbytes / ms / 1e9, "rel_err": float("nan")})
    floor = nbytes / bw * 1e3
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gluon_stream.json").write_text(json.dumps({"gpu": props.name, "gemvs": len(shapes), "bytes": nbytes,
                                                       "read_TBps": bw / 1e12, "floor_ms": floor, "rows": rows},
                                                      indent=1))
    print(f"{props.name}: {len(shapes)} GEMVs, {nbytes / 1e9:.3f} GB; streaming read {bw / 1e12:.2f} TB/s, "
          f"floor {floor:.3f} ms")
    print(f"{'kernel':<18}{'waits':>6}{'warps':>6}{'ms':>9}{'TB/s':>7}{'x floor':>8}{'rel err':>10}")
    for r in rows:
        print(f"{r['kernel']:<18}{str(r['waits']):>6}{r['warps']:>6}{r['ms']:>9.3f}"
              f"{r['TBps']:>7.2f}{r['ms'] / floor:>8.2f}{r['rel_err']:>10.1e}")


if __name__ == "__main__":
    main()
