"""Triton helpers shared by the task bodies: task-word fields, the bounded dependency wait, MMA."""

from __future__ import annotations

import triton
import triton.language as tl

from .fields import WORD_WAITS

COUNTER_STRIDE = tl.constexpr(32)  # int32s between counters: one counter per 128-byte line
ERR_HEADER = tl.constexpr(4)  # err[0]: the flag; then per worker: reason, task, counter, seen, target
ERR_PER_WORKER = tl.constexpr(5)
SPIN_NS = tl.constexpr(2000)  # POLL 1: how long a thread polls alone before the CTA compares what it saw


@triton.jit
def fld(word, IDX: tl.constexpr):
    """A 32-bit integer field."""
    return tl.load(word + IDX)


@triton.jit
def off(word, IDX: tl.constexpr):
    """A 64-bit offset field (low word, high word)."""
    lo = tl.load(word + IDX).to(tl.int64) & 0xFFFFFFFF
    hi = tl.load(word + IDX + 1).to(tl.int64)
    return lo | (hi << 32)


@triton.jit
def ffld(word, IDX: tl.constexpr):
    """A float field (stored as its bit pattern)."""
    return tl.load(word + IDX).to(tl.float32, bitcast=True)


@triton.jit
def has(flags, BIT: tl.constexpr):
    return (flags & BIT) != 0


@triton.jit
def aligned(v, ALIGN: tl.constexpr):
    """v, written so the compiler can prove it is a multiple of ALIGN (the host checked it is:
    runtime.alignment); vector loads need that.  tl.multiple_of on a loaded value is lost when
    the load is merged with an identical one elsewhere."""
    return (v // ALIGN) * ALIGN


@triton.jit
def prefetch_l2(ptr, nbytes):
    """Asks the L2 for nbytes from ptr (16-byte aligned, a multiple of 16 bytes), issued by the CTA's
    thread 0 as one bulk prefetch (sm_90 copy engine): nothing waits on it and no register holds the
    data, so a worker can have a whole task's weights in flight while its registers stream the first
    chunks.  Compiled only (the Triton interpreter has no inline PTX): kernel launches with PF > 0."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


# System scope (another device or the host reads or writes the memory: the helper's mailbox in host-
# mapped memory).  Compiled, these are plain PTX loads, stores and fences: GPU atomics on host memory
# over PCIe are not atomic for the host, and none is needed (one writer per word).  The Triton
# interpreter has no inline PTX; there its atomics give the same ordering.
@triton.jit
def fence_sys(COMPILED: tl.constexpr):
    """This thread's earlier writes are visible system-wide before its later ones."""
    if COMPILED:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def store_release_sys(ptr, value, COMPILED: tl.constexpr):
    """ptr[0] = value (int32) by thread 0, after every write it has seen (call after a barrier)."""
    if COMPILED:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p st.release.sys.global.b32 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def load_acquire_sys(ptr, COMPILED: tl.constexpr, WIDTH: tl.constexpr):
    """ptr[0] (int32), ordered before every thread's later loads, the same value in every thread.
    Each thread's own acquire load (inline PTX runs per thread, unlike a scalar atomic, which one
    thread runs and shares) would let threads leave a polling loop at different turns: a barrier
    inside the loop then pairs with the task's closing one, and the task signals before its
    laggards have written.  So every thread loads (WIDTH >= 1 element each: fewer elements than
    threads are replicated) and the CTA takes the minimum: the loop ends for all threads at once,
    each after its own acquire saw the value."""
    if COMPILED:
        seen = tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l",
                                         [ptr + tl.zeros([WIDTH], tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        return tl.min(seen, axis=0)
    else:
        return tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def mma(a, b, acc, DOT_PREC: tl.constexpr):
    """acc + a @ b with b in the weights' dtype.  DOT_PREC 'bf16x2': fp32 `a` is split into bf16
    high and low parts (two MMAs), so activations keep ~16 mantissa bits; 'ieee': fp32 weights."""
    if DOT_PREC == "bf16x2":
        hi = a.to(b.dtype)
        lo = (a - hi.to(tl.float32)).to(b.dtype)
        acc = tl.dot(hi, b, acc)
        return tl.dot(lo, b, acc)
    else:
        return tl.dot(a.to(b.dtype), b, acc, input_precision=DOT_PREC)


@triton.jit
def now_ns(USE_TIMER: tl.constexpr):
    if USE_TIMER:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.zeros((), tl.int64)


@triton.jit
def sm_id(USE_TIMER: tl.constexpr):
    if USE_TIMER:
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.zeros((), tl.int32)


@triton.jit
def past(start, bound_ns):
    """Whether bound_ns have passed since start (a now_ns() read), decided alike in every thread.  Each
    thread reads its own timer (inline PTX runs per thread, a scalar atomic on one thread), so threads
    could disagree on the poll where the bound is crossed and leave a loop at different turns, their
    barriers no longer paired: the CTA takes the largest elapsed time instead (one reduction)."""
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r",
                                    [tl.zeros([tl.extra.cuda.num_threads()], tl.int32)], dtype=tl.int64,
                                    is_pure=False, pack=1)
    return tl.max((now - start > bound_ns).to(tl.int32), axis=0) > 0


@triton.jit
def spin_acquire(ptr, target, SPIN_NS: tl.constexpr):
    """Every thread polls ptr with its own acquire load until it reads >= target or SPIN_NS pass, in
    inline PTX with nothing shared between the polls; then the CTA's minimum of the last reads (one
    reduction): >= target means every thread's own acquire saw it, and all leave the wait together."""
    seen = tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u64 t0, t1; mov.u64 t0, %globaltimer; "
        "POLL: ld.acquire.gpu.global.b32 $0, [$1]; setp.ge.s32 p, $0, $2; @p bra DONE; "
        "mov.u64 t1, %globaltimer; sub.u64 t1, t1, t0; setp.lt.u64 p, t1, $3; @p bra POLL; DONE: }",
        "=r,l,r,l", [ptr + tl.zeros([tl.extra.cuda.num_threads()], tl.int32), target, SPIN_NS],
        dtype=tl.int32, is_pure=False, pack=1)
    return tl.min(seen, axis=0)


@triton.jit
def wait_task(word, t, counters, epoch, err, pid, MAX_WAITS: tl.constexpr, TIMEOUT_NS: tl.constexpr,
              MAX_SPINS: tl.constexpr, USE_TIMER: tl.constexpr, POLL: tl.constexpr):
    """1 when every wait of the task holds, 0 when this worker must stop (timeout, or another failed).
    POLL 0 polls with a scalar atomic (one thread's, shared through a barrier on every poll); POLL 1 (a
    launch variant, compiled only) with every thread's acquire load, the CTA agreeing once per
    SPIN_NS of polls (spin_acquire)."""
    ok = 1
    for i in tl.static_range(MAX_WAITS):
        c = tl.load(word + WORD_WAITS + 2 * i)
        if (c >= 0) & (ok == 1):
            target = epoch * tl.load(word + WORD_WAITS + 2 * i + 1)
            ptr = counters + c.to(tl.int64) * COUNTER_STRIDE
            reason = 0
            if POLL == 1:
                seen = spin_acquire(ptr, target, SPIN_NS)
                turns = 0  # each unmet turn has a thread that polled SPIN_NS: the bound, counted alike everywhere
                while (seen < target) & (reason == 0):
                    turns += 1
                    if tl.atomic_add(err, 0, sem="acquire", scope="gpu") != 0:
                        reason = 2  # another worker failed
                    elif turns * SPIN_NS > TIMEOUT_NS:
                        reason = 1
                    else:
                        seen = spin_acquire(ptr, target, SPIN_NS)
            else:
                seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
                start = now_ns(USE_TIMER)
                spins = 0
                while (seen < target) & (reason == 0):
                    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
                    spins += 1
                    if spins % 32 == 0:
                        if tl.atomic_add(err, 0, sem="acquire", scope="gpu") != 0:
                            reason = 2  # another worker failed
                        elif USE_TIMER:
                            if now_ns(USE_TIMER) - start > TIMEOUT_NS:  # per thread: see spin_acquire
                                reason = 1
                        elif spins > MAX_SPINS:
                            reason = 1
            if reason != 0:
                ok = 0
                state = err + ERR_HEADER + pid * ERR_PER_WORKER
                tl.store(state, reason)
                tl.store(state + 1, t)
                tl.store(state + 2, c)
                tl.store(state + 3, seen)
                tl.store(state + 4, target)
                if reason == 1:
                    tl.atomic_xchg(err, 1, sem="release", scope="gpu")
    return ok
