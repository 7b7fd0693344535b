"""Triton helpers shared by the task bodies: task-word fields, the bounded dependency wait, MMA."""

from __future__ import annotations

import triton
import triton.language as tl

from .fields import WORD_SIGNAL, WORD_WAITS

COUNTER_STRIDE = tl.constexpr(32)  # int32s between counters: one counter per 128-byte line
ERR_HEADER = tl.constexpr(4)  # err[0]: the flag; then per worker: reason, task, counter, seen, target
ERR_PER_WORKER = tl.constexpr(5)


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
    launch.alignment); vector loads need that.  tl.multiple_of on a loaded value is lost when
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


@triton.jit
def prefetch_lines_l2(ptrs):
    """The 128-byte line of each pointer asked of the L2, one prefetch per element (each thread its own):
    for rows whose wanted bytes are not contiguous (a GQA head's columns of a cache row).  Compiled only."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_word_l1(ptr):
    """The two 128-byte lines of a task word (64 int32s from ptr, 256-byte aligned) asked of this SM's L1,
    issued by thread 0.  Compiled only (inline PTX): WPF, on by default on the GPU."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p prefetch.global.L1 [$1]; @p prefetch.global.L1 [$1+128]; mov.u32 $0, 0; }",
        "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)


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
    high and low parts (two MMAs), so activations keep ~16 mantissa bits; 'bf16': `a` rounded to bf16, one MMA
    (FlashAttention's policy: a launch variant, attention's only mma user on bf16 models); 'ieee': fp32 weights;
    'fp32': bf16 weights under Triton's CPU interpreter, whose tl.dot multiplies bf16 operands' bit patterns
    (triton-lang/triton#11584: not supported), so both sides are converted to fp32 first."""
    if DOT_PREC == "fp32":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif DOT_PREC == "bf16":
        return tl.dot(a.to(b.dtype), b, acc)
    elif DOT_PREC == "bf16x2":
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
        return tl.cast(0, tl.int64)  # a scalar (tl.zeros needs a layout in Gluon, whose stream kernel calls this)


@triton.jit
def sm_id(USE_TIMER: tl.constexpr):
    if USE_TIMER:
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.cast(0, tl.int32)


@triton.jit
def signal_of(word):
    """The counter a task signals when it is done."""
    return tl.load(word + WORD_SIGNAL)


@triton.jit
def signal_done(signal, t, counters, prof, t_begin, t_ready, PROFILE: tl.constexpr, USE_TIMER: tl.constexpr):
    """A finished task's release of its counter `signal` (signal_of(word); call after the barrier that orders every
    thread's stores) and, with PROFILE, its record (begin, ready, end, SM).  Scalars only: the stream kernel (Gluon)
    calls it too."""
    tl.atomic_add(counters + signal.to(tl.int64) * COUNTER_STRIDE, 1, sem="release", scope="gpu")
    if PROFILE:
        rec = prof + t.to(tl.int64) * 4
        tl.store(rec, t_begin)
        tl.store(rec + 1, t_ready)
        tl.store(rec + 2, now_ns(USE_TIMER))
        tl.store(rec + 3, sm_id(USE_TIMER).to(tl.int64))


@triton.jit
def poll_stop(err, scratch, USE_TIMER: tl.constexpr):
    """(another worker failed, the device timer in ticks of 1024 ns, 32 bits: 73 minutes before it wraps),
    the same in every thread of the CTA.
    A thread's own %globaltimer read (inline PTX runs per thread) could differ from its neighbours' on
    the poll where a bound is crossed; threads that then left a wait loop at different turns would no
    longer pair their barriers.  So thread 0 stores its reading in `scratch` (a word of this worker's
    watchdog state), the error flag's poll follows (a scalar atomic: thread 0's, shared through a
    barrier, which also orders that store before the others' loads), and every thread reads it."""
    if USE_TIMER:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; .reg .u64 g; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "mov.u64 g, %globaltimer; shr.u64 g, g, 10; cvt.u32.u64 t, g; @p st.global.b32 [$1], t; mov.u32 $0, 0; }",
            "=r,l", [scratch], dtype=tl.int32, is_pure=False, pack=1)
    failed = tl.atomic_add(err, 0, sem="acquire", scope="gpu") != 0
    now = tl.cast(0, tl.int32)
    if USE_TIMER:
        now = tl.inline_asm_elementwise("ld.volatile.global.b32 $0, [$1];", "=r,l", [scratch], dtype=tl.int32,
                                        is_pure=False, pack=1)
        tl.debug_barrier()  # every thread has read it before thread 0's next reading (a loop may have no barrier)
    return failed, now


@triton.jit
def elapsed_ns(now, start):
    """Nanoseconds from start to now, two poll_stop() timer words (to 1 us, modulo 73 minutes)."""
    return ((now.to(tl.int64) - start.to(tl.int64)) & 0xFFFFFFFF) * 1024


@triton.jit
def past_bound(err, state, spins, first, TIMEOUT_NS: tl.constexpr, MAX_SPINS: tl.constexpr,
               USE_TIMER: tl.constexpr, TIMEOUT_REASON: tl.constexpr):
    """A bounded wait's check, on every 32nd poll: (why it must stop: 2 when another worker failed,
    TIMEOUT_REASON when it outlived TIMEOUT_NS since the 32nd poll, or MAX_SPINS polls without a timer;
    else 0, the timer word at the 32nd poll), alike in every thread (poll_stop)."""
    reason = 0
    if spins % 32 == 0:
        failed, now = poll_stop(err, state + 3, USE_TIMER)
        if failed:
            reason = 2
        elif USE_TIMER:
            if spins == 32:
                first = now
            elif elapsed_ns(now, first) > TIMEOUT_NS:
                reason = TIMEOUT_REASON
        elif spins > MAX_SPINS:
            reason = TIMEOUT_REASON
    return reason, first


@triton.jit
def record_stop(err, state, reason, t, counter, seen, target, TIMEOUT_REASON: tl.constexpr):
    """This worker's watchdog state (why, task, counter or -1, value seen, target), and the error flag
    raised when it timed out itself (2: another worker had)."""
    tl.store(state, reason)
    tl.store(state + 1, t)
    tl.store(state + 2, counter)
    tl.store(state + 3, seen)
    tl.store(state + 4, target)
    if reason == TIMEOUT_REASON:
        tl.atomic_xchg(err, 1, sem="release", scope="gpu")


@triton.jit
def poll_counter(ptr, POLL: tl.constexpr, near=None):
    """A counter's value, acquired, the same in every thread.  POLL 0: a scalar atomic (one thread's, shared
    through a barrier); 1 (a launch variant, inline PTX): every thread's own ld.acquire.gpu and the CTA's
    minimum, a load rather than a read-modify-write at the L2's atomic unit (tools/hop_bench.py times both:
    `counter` and `ldacq`).  The row is 256 wide, at least one element per thread up to 8 warps: a row that warps
    replicate is reduced per warp, and warps that saw different values would leave the wait at different turns.
    POLL 2 (a launch variant, inline PTX): POLL 0's one acquire load (Triton lowers the atomic add of 0 to one), by
    thread 0, which then asks this SM's L1 for the two lines at `near` (the waiting task's word) while the poll is
    out; the value reaches the other threads through a word of static shared memory, as Triton shares POLL 0's (a
    CTA maximum cost llama-1b's kernel 13 registers).  An acquire invalidates the L1 (SASS: the poll's load, then
    CCTL.IVALL), so a task's fields, read after its wait, came from the L2, one round trip and more where a field
    decides which fields come next; the word's lines asked for after that invalidation arrive with the poll's
    answer.  Only words that never change may be asked for so early: the answer has not yet ordered anything."""
    if POLL == 1:
        return tl.min(tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l",
                                                [ptr + tl.zeros([256], tl.int32)], dtype=tl.int32, is_pure=False,
                                                pack=1), axis=0)
    elif POLL == 2:  # every thread runs it: thread 0 polls and asks for the lines, a shared word tells the rest.
        # prefetch_word_l1's two prefetches, written here because they must sit between the poll and the store that
        # waits for it; the second line's address is an operand (near + 32 ints), as [$2+128] was computed only
        # after that store (SASS)
        return tl.inline_asm_elementwise(
            "{ .shared .align 4 .b32 seen; .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p ld.acquire.gpu.global.b32 t, [$1]; @p prefetch.global.L1 [$2]; @p prefetch.global.L1 [$3]; "
            "@p st.shared.b32 [seen], t; bar.sync 0; ld.shared.b32 $0, [seen]; bar.sync 0; }",
            "=r,l,l,l", [ptr, near, near + 32], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def wait_task(word, t, counters, epoch, err, pid, MAX_WAITS: tl.constexpr, TIMEOUT_NS: tl.constexpr,
              MAX_SPINS: tl.constexpr, USE_TIMER: tl.constexpr, POLL: tl.constexpr = 0, WAITS: tl.constexpr = 0,
              slots=None):
    """1 when every wait of the task holds, 0 when this worker must stop (timeout, or another failed).
    A poll (poll_counter) gives every thread the same value, so every thread leaves the loop at the same
    turn; the bound is decided alike in every thread too (poll_stop), from the 32nd poll.
    Waits fill the word's slots from the first (graph.isa.encode), a counter of -1 after the last.  WAITS 0 reads
    a slot after the previous slot's poll, whose acquire invalidated the L1: a task with one wait reads its second
    slot (-1) from the L2 after its wait.  WAITS 1 (the default) reads the next slot before polling, masked off
    past the last wait, so no field load follows the last poll.  slots (WAITS 2, tasks that request weights before
    their wait): the first two slots, already read by wait_slots."""
    ok = 1
    if slots is not None:  # WAITS 2: the first two slots read before the task's first weights (wait_slots)
        if slots[0] >= 0:
            ok = wait_counter(counters + slots[0].to(tl.int64) * COUNTER_STRIDE, epoch * slots[1], err, pid, t,
                              slots[0], TIMEOUT_NS, MAX_SPINS, USE_TIMER, POLL, word)
        # nested, so a task with one wait reads no slot after its poll: ptxas would count that read on the weights'
        # scoreboard, and the slot's compare would wait for the weights
        if (slots[2] >= 0) & (ok == 1):
            ok = wait_counter(counters + slots[2].to(tl.int64) * COUNTER_STRIDE, epoch * slots[3], err, pid, t,
                              slots[2], TIMEOUT_NS, MAX_SPINS, USE_TIMER, POLL, word)
            for i in tl.static_range(2, MAX_WAITS):  # any further slots, as WAITS 0 reads them
                c = tl.load(word + WORD_WAITS + 2 * i)
                if (c >= 0) & (ok == 1):
                    target = epoch * tl.load(word + WORD_WAITS + 2 * i + 1)
                    ok = wait_counter(counters + c.to(tl.int64) * COUNTER_STRIDE, target, err, pid, t, c, TIMEOUT_NS,
                                      MAX_SPINS, USE_TIMER, POLL, word)
    elif WAITS >= 1:
        c = tl.load(word + WORD_WAITS)
        n = tl.load(word + WORD_WAITS + 1)
        for i in tl.static_range(MAX_WAITS):
            if i + 1 < MAX_WAITS:
                more = c >= 0
                c_next = tl.load(word + WORD_WAITS + 2 * (i + 1), mask=more, other=-1)
                n_next = tl.load(word + WORD_WAITS + 2 * (i + 1) + 1, mask=more, other=0)
            if (c >= 0) & (ok == 1):
                ptr = counters + c.to(tl.int64) * COUNTER_STRIDE
                ok = wait_counter(ptr, epoch * n, err, pid, t, c, TIMEOUT_NS, MAX_SPINS, USE_TIMER, POLL, word)
            if i + 1 < MAX_WAITS:
                c = c_next
                n = n_next
    else:
        for i in tl.static_range(MAX_WAITS):
            c = tl.load(word + WORD_WAITS + 2 * i)
            if (c >= 0) & (ok == 1):
                target = epoch * tl.load(word + WORD_WAITS + 2 * i + 1)
                ptr = counters + c.to(tl.int64) * COUNTER_STRIDE
                ok = wait_counter(ptr, target, err, pid, t, c, TIMEOUT_NS, MAX_SPINS, USE_TIMER, POLL, word)
    return ok


@triton.jit
def wait_slots(word):
    """A task's first two wait slots (counter, count, next counter, next count), read before its first weights are
    requested (launch variant WAITS 2).  ptxas puts a task's global loads on one scoreboard, so the poll's compare,
    which waits for these loads, waited for the weight chunk requested before them too (sass_probe: the weight
    loads first waited on at the target's multiply): the chunk's latency, then the poll's, in series."""
    c = tl.load(word + WORD_WAITS)
    n = tl.load(word + WORD_WAITS + 1)
    more = c >= 0
    c_next = tl.load(word + WORD_WAITS + 2, mask=more, other=-1)
    n_next = tl.load(word + WORD_WAITS + 3, mask=more, other=0)
    return c, n, c_next, n_next


@triton.jit
def after_slots(x, slots):
    """x, made to depend on the slots' values (always x: counts are >= 0, counters >= -1), so the weight loads
    that use it go out only once the slots have arrived (an L1 hit: the word's lines are there, WPF) and
    no later wait on the slots' scoreboard waits for the weights."""
    return tl.minimum(x, x + slots[1] + slots[3] + (slots[0] + 1) + (slots[2] + 1))


@triton.jit
def wait_counter(ptr, target, err, pid, t, c, TIMEOUT_NS: tl.constexpr, MAX_SPINS: tl.constexpr,
                 USE_TIMER: tl.constexpr, POLL: tl.constexpr = 0, word=None):
    """1 once counter c (at ptr) reaches target (acquire), 0 when this worker must stop: a timeout (recorded as
    task t waiting on c) or another worker's failure.  word: the waiting task's (POLL 2 asks the L1 for it)."""
    state = err + ERR_HEADER + pid * ERR_PER_WORKER
    seen = poll_counter(ptr, POLL, word)
    start = tl.cast(0, tl.int32)  # scalars as tl.cast: these compile inside Gluon too
    spins = 0
    reason = 0
    while (seen < target) & (reason == 0):
        seen = poll_counter(ptr, POLL, word)
        spins += 1
        reason, start = past_bound(err, state, spins, start, TIMEOUT_NS, MAX_SPINS, USE_TIMER, 1)
    ok = 1
    if reason != 0:
        ok = 0
        record_stop(err, state, reason, t, c, seen, target, 1)
    return ok
