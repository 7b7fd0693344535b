"""The stream kernel: a persistent Gluon kernel that runs a plan's LINEAR tasks beside the Triton megakernel.

A plan compiled with the `stream_kernel` option has 2W queues: the first W (body workers) hold every task but
LINEAR and run in megakernel.kernel; the last W (stream workers) hold only LINEAR tasks and run here, one CTA per
SM next to the Triton CTA (both persistent, co-resident: refused otherwise).  They hand work over through the same
counters, epochs and error flag, so a stream task waits and signals exactly as a Triton task does (common.py's
bounded wait_task and signal_done, scalar Triton functions that compile inside Gluon).  Why two kernels: on
Llama-1B's GEMV chain the Gluon ring streams faster than any plain-Triton body (docs/PERF.md session 19), and this
takes it into the engine without porting every other op body to Gluon's explicit layouts.  Measured (session 20):
correct, but slower (llama-1b 1.27 against 1.13 ms): inside the megakernel the Triton LINEAR body already streams
a large task at the ring's per-SM rate, and the Triton bodies at 4 warps beside a streaming CTA take 30-60% longer.
So it is an opt-in plan option (`stream_kernel=1`), not the default.  A consumer releases a ring slot a step
after reading it (ops/linear_ring.tile_sums: released at once, the TMA sometimes refilled a slot under a warp's
last loads; session 30).

Per worker: a 1-warp producer walks the queue and streams each task's weight tiles into the shared-memory ring
(ops/linear_ring.py), never waiting on a counter; the consumer warps wait for the task's inputs, sum the tiles,
apply the epilogue, store and signal.  After an error the consumers keep draining the ring (stores and signals off),
so the producer never blocks on a slot nobody frees: the kernel always ends.  One token per task (N = 1); the
runtime refuses other plans.  Gluon has no interpreter: on a CPU this compiles for sm_90 only (tests).
"""

from __future__ import annotations

import ctypes

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from graph.isa import Buf, decode
from .ops.common import aligned, ffld, fld, now_ns, off, signal_done, signal_of, wait_task
from .ops.fields import (FLAG_LINEAR_NORM, FLAG_LINEAR_PAIR, FLAG_LINEAR_RES, FLAG_LINEAR_SILU_MUL, LINEAR_EPS,
                         LINEAR_FLAGS, LINEAR_K, LINEAR_OUT_OFF, LINEAR_R0, LINEAR_R1, LINEAR_RES_OFF, LINEAR_W2_OFF,
                         LINEAR_W_OFF, LINEAR_X_OFF)
from .launch import cta_registers, stream_workers
from .ops.linear_ring import (MAX_K_CLASSES, TILE_COLS, TILE_ROWS, fill_slots, norm_scale, ntiles_of, ring_buffers,
                              tile_sums)

# 4 consumer warps + the producer's: Gluon launches 8 (two warpgroups); capped at 128 registers a thread they take
# half the register file, leaving the Triton CTA 32K (4 warps of up to 255)
CONSUMER_WARPS = 4
MAXNREG = 128
PRODUCER_REGS = gl.constexpr(40)
SLOTS, SUB = 4, 4  # 16 tiles of 8 KB in flight: 128 KB of shared memory, the rest is the Triton CTA's
SUPPORTED_FLAGS = ("NORM", "SILU_MUL", "PAIR", "RES")


@gluon.jit
def _k_class(K, K1, K2, K3):
    """Which descriptor views the arena in rows of K (the host passes the distinct K in order; K0 otherwise)."""
    return (K == K1).to(gl.int32) + 2 * (K == K2).to(gl.int32) + 3 * (K == K3).to(gl.int32)


@gluon.jit
def _producer(d0, d1, d2, d3, K1, K2, K3, words, queue_ptr, ring, ready, empty, WORKER0, WORDS: gl.constexpr,
              SLOTS: gl.constexpr, SUB: gl.constexpr, BOX: gl.constexpr):
    """The worker's weight tiles in queue order: per task and row block, W's tiles, then W2's (SILU_MUL, PAIR)."""
    pid = gl.program_id(0) + WORKER0
    it = 0
    for t in range(gl.load(queue_ptr + pid), gl.load(queue_ptr + pid + 1)):
        word = words + t.to(gl.int64) * WORDS
        K = fld(word, LINEAR_K)
        kclass = _k_class(K, K1, K2, K3)
        flags = fld(word, LINEAR_FLAGS)
        two = (flags & (FLAG_LINEAR_SILU_MUL | FLAG_LINEAR_PAIR)) != 0
        row_w = (off(word, LINEAR_W_OFF) // K).to(gl.int32)
        row_w2 = (off(word, LINEAR_W2_OFF) // K).to(gl.int32)
        ntiles = ntiles_of(K, SUB)
        for rb in range(fld(word, LINEAR_R0), fld(word, LINEAR_R1), BOX):
            it = fill_slots(d0, d1, d2, d3, kclass, row_w + rb, ntiles, ring, ready, empty, it, SLOTS, SUB, BOX)
            if two:
                it = fill_slots(d0, d1, d2, d3, kclass, row_w2 + rb, ntiles, ring, ready, empty, it, SLOTS, SUB, BOX)


@gluon.jit
def _consumer(words, queue_ptr, counters, worker_epoch, err, prof, A, ring, ready, empty, WORKER0,
              WORDS: gl.constexpr, MAX_WAITS: gl.constexpr, TIMEOUT_NS: gl.constexpr, MAX_SPINS: gl.constexpr,
              USE_TIMER: gl.constexpr, PROFILE: gl.constexpr, ALIGN: gl.constexpr, SLOTS: gl.constexpr,
              SUB: gl.constexpr, WARPS: gl.constexpr, BOX: gl.constexpr):
    """Each task: its waits (bounded), the norm scale, the row blocks' sums and epilogue, the signal."""
    tile_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rows = gl.arange(0, BOX, gl.SliceLayout(1, tile_l))
    pid = gl.program_id(0) + WORKER0
    epoch = gl.load(worker_epoch + pid) + 1
    gl.store(worker_epoch + pid, epoch)
    ok = (gl.atomic_add(err, 0, sem="acquire", scope="gpu") == 0).to(gl.int32)
    it = 0
    for t in range(gl.load(queue_ptr + pid), gl.load(queue_ptr + pid + 1)):
        word = words + t.to(gl.int64) * WORDS
        t_begin = now_ns(USE_TIMER)
        if ok == 1:
            ok = wait_task(word, t, counters, epoch, err, pid, MAX_WAITS, TIMEOUT_NS, MAX_SPINS, USE_TIMER)
        t_ready = now_ns(USE_TIMER)
        K = aligned(fld(word, LINEAR_K), ALIGN)
        flags = fld(word, LINEAR_FLAGS)
        x_ptr = A + aligned(off(word, LINEAR_X_OFF), ALIGN)
        out_ptr = A + off(word, LINEAR_OUT_OFF)
        res_ptr = A + off(word, LINEAR_RES_OFF)
        r1 = fld(word, LINEAR_R1)
        ntiles = ntiles_of(K, SUB)
        r = 1.0
        if (flags & FLAG_LINEAR_NORM) != 0:
            r = norm_scale(x_ptr, K, ffld(word, LINEAR_EPS), WARPS)
        for rb in range(fld(word, LINEAR_R0), r1, BOX):
            y, it = tile_sums(ring, ready, empty, it, x_ptr, K, ntiles, SLOTS, SUB, WARPS, BOX)
            y = y * r
            if (flags & (FLAG_LINEAR_SILU_MUL | FLAG_LINEAR_PAIR)) != 0:
                u, it = tile_sums(ring, ready, empty, it, x_ptr, K, ntiles, SLOTS, SUB, WARPS, BOX)
                if (flags & FLAG_LINEAR_SILU_MUL) != 0:
                    y = y / (1.0 + gl.exp(-y)) * (u * r)
                else:
                    y = y + u * r
            mask = (rows < r1 - rb) & (ok == 1)
            if (flags & FLAG_LINEAR_RES) != 0:
                y += gl.load(res_ptr + rb + rows, mask=mask, other=0.0)
            gl.store(out_ptr + rb + rows, y, mask=mask)
        gl.thread_barrier()  # every consumer's stores before the release
        if ok == 1:
            signal_done(signal_of(word), t, counters, prof, t_begin, t_ready, PROFILE, USE_TIMER)


@gluon.jit
def stream_kernel(d0, d1, d2, d3, K1, K2, K3, words, queue_ptr, counters, worker_epoch, err, prof, A, WORKER0,
                  WORDS: gl.constexpr, MAX_WAITS: gl.constexpr, TIMEOUT_NS: gl.constexpr, MAX_SPINS: gl.constexpr,
                  USE_TIMER: gl.constexpr, PROFILE: gl.constexpr, ALIGN: gl.constexpr, SLOTS: gl.constexpr,
                  SUB: gl.constexpr, WARPS: gl.constexpr, BOX: gl.constexpr):
    ring, ready, empty = ring_buffers(d0, SLOTS, SUB, BOX)
    gl.warp_specialize([(_consumer, (words, queue_ptr, counters, worker_epoch, err, prof, A, ring, ready, empty,
                                     WORKER0, WORDS, MAX_WAITS, TIMEOUT_NS, MAX_SPINS, USE_TIMER, PROFILE, ALIGN,
                                     SLOTS, SUB, WARPS, BOX)),
                        (_producer, (d0, d1, d2, d3, K1, K2, K3, words, queue_ptr, ring, ready, empty, WORKER0, WORDS,
                                     SLOTS, SUB, BOX))], [1], [PRODUCER_REGS])


# ---- host ----------------------------------------------------------------------------------------
class StreamKernelError(RuntimeError):
    pass


def stream_k_classes(plan, tasks=None) -> list[int]:
    """The distinct K of the stream workers' LINEAR tasks, refused unless the kernel runs them: one token, flags it
    knows.  (Which queues hold LINEAR, K a multiple of 8, each matrix at a multiple of its K and at most
    MAX_K_CLASSES of them: graph/verify.py's stream rules, which every Megakernel checks first.)"""
    tasks = tasks if tasks is not None else [decode(w) for w in plan.words]
    ks = set()
    for i in range(plan.queue_ptr[plan.workers - stream_workers(plan)], plan.num_tasks):
        t = tasks[i]
        extra = [n for n in t.op.flag_names(t.flags) if n not in SUPPORTED_FLAGS]
        if t["N"] != 1 or extra:
            raise StreamKernelError(f"stream task {plan.task_labels[i]}: N={t['N']} flags {extra}: the stream kernel "
                                    f"runs one token per task with flags {SUPPORTED_FLAGS} (compile T=B=1 plans only)")
        ks.add(t["K"])
    return sorted(ks) or [8]


def box_rows(plan, tasks=None) -> int:
    """Rows of a TMA box: 16, or 8 where 16-row boxes would stream over 1% more bytes than the stream tasks' rows
    (row_align=8 tilings: a task of 24 rows takes two 16-row boxes)."""
    tasks = tasks if tasks is not None else [decode(w) for w in plan.words]
    used = boxed = 0
    for t in tasks[plan.queue_ptr[plan.workers - stream_workers(plan)]:]:
        rows, K = t.fields["r1"] - t.fields["r0"], t.fields["K"]
        used += rows * K
        boxed += -(-rows // TILE_ROWS) * TILE_ROWS * K
    return TILE_ROWS if boxed <= 1.01 * used else TILE_ROWS // 2


def largest_shared_split(kernel) -> None:
    """Has a loaded kernel prefer the SM's largest shared-memory split, as both co-resident kernels must: an SM's
    L1/shared split is one for all its CTAs, and Triton sets a preference only on kernels above 48 KB, so a
    small-shared kernel's CTAs could hold SMs in a split where the other's CTA does not fit."""
    cuda = ctypes.CDLL("libcuda.so.1")
    fn = ctypes.c_void_p(kernel.function)
    prefer_shared, carveout_attr, max_shared = 1, 9, 100  # cuda.h: CU_FUNC_CACHE_PREFER_SHARED, carveout %, max
    for call, rc in (("cuFuncSetCacheConfig", cuda.cuFuncSetCacheConfig(fn, prefer_shared)),
                     ("cuFuncSetAttribute", cuda.cuFuncSetAttribute(fn, carveout_attr, max_shared))):
        if rc:
            raise StreamKernelError(f"{call} on {kernel.name} returned CUresult {rc}")


class StreamKernel:
    """The stream workers' launch for a Megakernel `mk` whose plan has them: descriptors over its weight arena,
    its counters, epochs, error flag and profile records."""

    def __init__(self, mk, tasks: list, slots: int = SLOTS):
        """tasks: the plan's words decoded (the Megakernel has them)."""
        plan = mk.plan
        self.klasses = stream_k_classes(plan, tasks)
        self.box = box_rows(plan, tasks)
        self.mk, self.slots, self.sub = mk, slots, SUB * TILE_ROWS // self.box  # a slot: 32 KB either way
        self.workers = stream_workers(plan)
        self.worker0 = plan.workers - self.workers
        self.compiled = None
        w = mk.mem.bufs[Buf.W]
        if w.dtype != torch.bfloat16:
            raise StreamKernelError(f"the stream kernel streams bf16 weights, this arena is {w.dtype}")
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        descs = [TensorDescriptor.from_tensor(w[: w.numel() // k * k].view(-1, k), [self.box, TILE_COLS], layout)
                 for k in self.klasses]
        self.descs = descs + descs[:1] * (MAX_K_CLASSES - len(descs))
        ks = self.klasses + [-1] * (MAX_K_CLASSES - len(self.klasses))
        self.ks = ks[1:]  # K1..K3 (K0 is the default class)

    def _run(self, warmup: bool = False):
        mk = self.mk
        c = mk._constexprs()
        return stream_kernel.run(*self.descs, *self.ks, mk.words, mk.queue_ptr, mk.counters, mk.worker_epoch, mk.err,
                                 mk.prof, mk.mem.bufs[Buf.A], self.worker0, grid=(self.workers,), warmup=warmup,
                                 WORDS=c["WORDS"], MAX_WAITS=c["MAX_WAITS"], TIMEOUT_NS=c["TIMEOUT_NS"],
                                 MAX_SPINS=c["MAX_SPINS"], USE_TIMER=c["USE_TIMER"], PROFILE=c["PROFILE"],
                                 ALIGN=min(c["ALIGN"], 4), SLOTS=self.slots, SUB=self.sub, WARPS=CONSUMER_WARPS,
                                 BOX=self.box, num_warps=CONSUMER_WARPS, maxnreg=MAXNREG)

    def compile(self, triton_kernel):
        """Compiled and loaded, both kernels set to the largest shared split, and refused unless one CTA of each
        fits an SM together (otherwise a stream task could wait forever on a body task that never starts)."""
        if self.compiled is None:
            self.compiled = self._run(warmup=True)
            self.compiled._init_handles()
            largest_shared_split(self.compiled)
            largest_shared_split(triton_kernel)
            props = torch.cuda.get_device_properties(self.mk.device)
            g, t = self.compiled, triton_kernel
            regs = cta_registers(g) + cta_registers(t)
            shared = g.metadata.shared + t.metadata.shared + 2 * 1024  # the hardware keeps 1 KB a CTA
            if (regs > props.regs_per_multiprocessor or shared > props.shared_memory_per_multiprocessor
                    or self.workers > props.multi_processor_count):
                raise StreamKernelError(
                    f"stream kernel ({g.n_regs} registers x {g.metadata.num_warps} warps, "
                    f"{g.metadata.shared} B shared) "
                    f"and megakernel ({t.n_regs} x {t.metadata.num_warps}, {t.metadata.shared} B) do not fit one SM "
                    f"together ({regs} of {props.regs_per_multiprocessor} registers, {shared} of "
                    f"{props.shared_memory_per_multiprocessor} B shared) on {self.workers} workers: refusing a launch "
                    "that could hang")
        return self.compiled

    def kernel(self) -> None:
        """Issue the stream kernel on the current stream (compiled before: a graph captures it)."""
        self._run()

