"""The persistent kernel: one program per worker runs its queue of task words.

For each task: wait until every (counter, count) wait holds for this step
(counter >= epoch × count, acquire), run the opcode's body, barrier, then
signal its counter (release).  Counters sit 128 bytes apart and only grow;
each worker keeps its own epoch in device memory and bumps it at launch, so a
captured graph replays forever without resets or recompiles.

Waits are bounded: a wait that outlives TIMEOUT_NS (or MAX_SPINS polls where no
timer exists, e.g. under TRITON_INTERPRET) sets the error flag and records
(task, counter, value seen, target) for its worker; every other waiter sees the
flag and stops.  The host turns that into an exception and repairs the counters.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .ops import (argmax, attention, elementwise, embed, head_matmul, helper, helper_side, linear, mhc, moe, norm, rope,
                  spec)
from .ops.common import (COUNTER_STRIDE, now_ns, prefetch_word_l1, signal_done, signal_of, wait_counter, wait_slots,
                         wait_task)
from .ops.fields import (OP_ACCEPT, OP_ARGMAX, OP_ATTENTION, OP_ATTN_COMBINE, OP_CACHE_WRITE, OP_EMBED, OP_EWISE,
                         OP_EXPERT_LINEAR, OP_GATHER, OP_HC_COEFF, OP_HC_EXPAND, OP_HC_HEAD, OP_HEAD_MATMUL,
                         OP_HELPER_CALL, OP_HELPER_RECV, OP_HELPER_SEND, OP_HELPER_WAIT, OP_LINEAR, OP_MOE_COMBINE,
                         OP_RMSNORM, OP_ROPE, OP_ROPE_TABLE, OP_ROUTE)



@triton.jit
def next_word_to_l1(word, t, end, WORDS: tl.constexpr, WPF: tl.constexpr):
    """WPF (on by default on the GPU), right after a task's wait: the next task's word asked of the L1.  The
    wait's acquire has just invalidated this SM's L1; the next task's first loads (its opcode, the fields it
    reads before waiting) then find the word there, unless something in between acquires again (the helper
    bodies' system-scope polls), which costs only the prefetch.  Task words never change during a launch."""
    if WPF:
        if t + 1 < end:
            prefetch_word_l1(word + WORDS)


@triton.jit
def host_inputs_to_device(HT, HL, HD, I, words, counters, epoch, err, pid, TIMEOUT_NS: tl.constexpr,
                          MAX_SPINS: tl.constexpr, USE_TIMER: tl.constexpr, POLL: tl.constexpr):
    """HIN (1 by default, where a plan has those inputs): the step's tokens and cache lengths copied from the
    host's pinned stage buffers (HT, HL: mapped, read over the bus) into their plan slots in I (offsets and counts
    in HD), so a step is one kernel and no copy nodes.  Worker 0 alone reads the host (the plans put EMBED first
    in its queue), then releases the inputs counter (HD[4], a line past the plan's); every other worker acquires
    it before its first task, bounded and polled like a task's wait (POLL).  A first version had every worker
    read the host itself: 1.35 ms a llama-1b step against 1.06 (docs/PERF.md session 28), as if the bus served
    those 264 reads one by one.  No task of a step writes an input slot (graph/memory.py keeps them).  1 when
    this worker may go on.  words: the plan's first task word (POLL 2's wait asks the L1 for a word; any that
    never changes will do)."""
    c = tl.load(HD + 4)
    inputs = counters + c.to(tl.int64) * COUNTER_STRIDE
    ok = 1
    if pid == 0:
        tok_off, n_tok, len_off, n_len = tl.load(HD), tl.load(HD + 1), tl.load(HD + 2), tl.load(HD + 3)
        i = tl.arange(0, 256)
        for b in range(0, n_tok, 256):
            m = b + i < n_tok
            tl.store(I + tok_off + b + i, tl.load(HT + b + i, mask=m, other=0, volatile=True), mask=m)
        for b in range(0, n_len, 256):
            m = b + i < n_len
            tl.store(I + len_off + b + i, tl.load(HL + b + i, mask=m, other=0, volatile=True), mask=m)
        tl.debug_barrier()  # every thread's copies before the release
        tl.atomic_add(inputs, 1, sem="release", scope="gpu")
    else:
        ok = wait_counter(inputs, epoch, err, pid, -1, c, TIMEOUT_NS, MAX_SPINS, USE_TIMER, POLL, words)
    return ok


@triton.jit
def head_matmul_task(word, t, end, counters, epoch, err, pid, W, A, MAX_WAITS: tl.constexpr, TIMEOUT_NS: tl.constexpr,
                     MAX_SPINS: tl.constexpr, USE_TIMER: tl.constexpr, BI: tl.constexpr, BO: tl.constexpr,
                     ALIGN: tl.constexpr, TRANS: tl.constexpr, TB: tl.constexpr, WORDS: tl.constexpr,
                     WPF: tl.constexpr, EF: tl.constexpr, POLL: tl.constexpr, WAITS: tl.constexpr):
    """A HEAD_MATMUL task as a LINEAR one runs: first weights requested, wait, body.  (ok, ready time)."""
    slots = wait_slots(word) if WAITS == 2 else None
    w = head_matmul.prefetch(word, W, BI, BO, ALIGN, TRANS, EF, slots)
    ok = wait_task(word, t, counters, epoch, err, pid, MAX_WAITS, TIMEOUT_NS, MAX_SPINS, USE_TIMER, POLL, WAITS, slots)
    t_ready = now_ns(USE_TIMER)
    next_word_to_l1(word, t, end, WORDS, WPF)
    if ok == 1:
        head_matmul.body(word, W, A, w, BI, BO, ALIGN, TRANS, TB, EF)
    return ok, t_ready


@triton.jit
def linear_task(word, t, end, counters, epoch, err, pid, W, A, MAX_WAITS: tl.constexpr, TIMEOUT_NS: tl.constexpr,
                MAX_SPINS: tl.constexpr, USE_TIMER: tl.constexpr, BR: tl.constexpr, KC: tl.constexpr,
                ALIGN: tl.constexpr, TB: tl.constexpr, DEPTH: tl.constexpr, BN: tl.constexpr, ROWVEC: tl.constexpr,
                AHEAD: tl.constexpr, PFD: tl.constexpr, EF: tl.constexpr, WORDS: tl.constexpr, WPF: tl.constexpr,
                HILO: tl.constexpr, POLL: tl.constexpr, KD: tl.constexpr, BRD: tl.constexpr, WAITS: tl.constexpr,
                PIN: tl.constexpr = 0):
    """A LINEAR task: its first weights requested before the wait (weights never depend on activations),
    then the body.  BRD: the k-major down rows' chunk (DOWN_T), BR whatever the stream's chunk.  (ok, ready time)."""
    slots = wait_slots(word) if WAITS == 2 else None
    w = linear.prefetch(word, W, BR, KC, ALIGN, EF, slots)
    if PFD > 0:
        linear.prefetch_blocks(word, W, BR, ALIGN, PFD, HILO)
    ok = wait_task(word, t, counters, epoch, err, pid, MAX_WAITS, TIMEOUT_NS, MAX_SPINS, USE_TIMER, POLL, WAITS, slots)
    t_ready = now_ns(USE_TIMER)
    next_word_to_l1(word, t, end, WORDS, WPF)
    if ok == 1:
        linear.body(word, W, A, w, BR, KC, ALIGN, TB, DEPTH, BN, ROWVEC, AHEAD, PFD, EF, HILO, KD, BRD, PIN)
    return ok, t_ready


@triton.jit
def expert_task(word, t, end, counters, epoch, err, pid, W, A, I, MAX_WAITS: tl.constexpr, TIMEOUT_NS: tl.constexpr,
                MAX_SPINS: tl.constexpr, USE_TIMER: tl.constexpr, BR: tl.constexpr, KC: tl.constexpr,
                ALIGN: tl.constexpr, TB: tl.constexpr, PF: tl.constexpr, DEPTH: tl.constexpr, ROWVEC: tl.constexpr,
                AHEAD: tl.constexpr, NARROW: tl.constexpr, PFD: tl.constexpr, EF: tl.constexpr, KD: tl.constexpr,
                EPF: tl.constexpr, WORDS: tl.constexpr, WPF: tl.constexpr, POLL: tl.constexpr,
                WAITS: tl.constexpr, PIN: tl.constexpr = 0):
    """An EXPERT_LINEAR task with EPF: the first weights of the expert its slot holds now requested before the
    wait (a guess the body checks: moe.guess_first_chunk), then the body.  (ok, ready time)."""
    slots = wait_slots(word) if WAITS == 2 else None
    guess, w = moe.guess_first_chunk(word, W, I, BR, KC, ALIGN, EF, EPF, slots)
    ok = wait_task(word, t, counters, epoch, err, pid, MAX_WAITS, TIMEOUT_NS, MAX_SPINS, USE_TIMER, POLL, WAITS, slots)
    t_ready = now_ns(USE_TIMER)
    next_word_to_l1(word, t, end, WORDS, WPF)
    if ok == 1:
        moe.expert_body(word, W, A, I, BR, KC, ALIGN, TB, PF, DEPTH, ROWVEC, AHEAD, NARROW, PFD, EF, KD, EPF, guess, w,
                        PIN)
    return ok, t_ready


@triton.jit
def megakernel(words, queue_ptr, counters, worker_epoch, err, prof, W, WF, A, I, C, HB, HT, HL, HD,
               WORDS: tl.constexpr, MAX_WAITS: tl.constexpr, TIMEOUT_NS: tl.constexpr, MAX_SPINS: tl.constexpr,
               HELPER_NS: tl.constexpr,
               USE_TIMER: tl.constexpr, PROFILE: tl.constexpr,
               BR: tl.constexpr, KC: tl.constexpr, STAGES: tl.constexpr, BD: tl.constexpr,
               BH: tl.constexpr, BIT: tl.constexpr, BOT: tl.constexpr,
               BM: tl.constexpr, BJ: tl.constexpr, DMAX: tl.constexpr, RMAX: tl.constexpr, BI: tl.constexpr,
               BO: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr, BW: tl.constexpr, BSC: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, CPF: tl.constexpr, BCW: tl.constexpr,
               SAMPLE: tl.constexpr, BV: tl.constexpr, TB: tl.constexpr, PF: tl.constexpr, DEPTH: tl.constexpr,
               ALIGN: tl.constexpr, BT: tl.constexpr, DOT_PREC: tl.constexpr, ATT_KIND: tl.constexpr,
               ROWVEC: tl.constexpr, AHEAD: tl.constexpr, NARROW: tl.constexpr, ROUTE1: tl.constexpr, PFD: tl.constexpr,
               EF: tl.constexpr, WPF: tl.constexpr, APF: tl.constexpr, PFK: tl.constexpr, HILO: tl.constexpr,
               HELPER_SIDE: tl.constexpr, ATT_ROPE: tl.constexpr, POLL: tl.constexpr, HIN: tl.constexpr,
               KD: tl.constexpr, EPF: tl.constexpr, QIX: tl.constexpr, SIG: tl.constexpr,
               WAITS: tl.constexpr, PIN: tl.constexpr):
    pid = tl.program_id(0)
    start = tl.load(queue_ptr + pid)
    end = tl.load(queue_ptr + pid + 1)
    epoch = tl.load(worker_epoch + pid) + 1
    tl.store(worker_epoch + pid, epoch)
    ok = 1
    if HIN:
        ok = host_inputs_to_device(HT, HL, HD, I, words, counters, epoch, err, pid, TIMEOUT_NS, MAX_SPINS, USE_TIMER,
                                   POLL)
    ok = ok & (tl.atomic_add(err, 0, sem="acquire", scope="gpu") == 0).to(tl.int32)
    t = start
    while (t < end) & (ok == 1):
        word = words + t.to(tl.int64) * WORDS
        t_begin = now_ns(USE_TIMER)
        op = tl.load(word)
        if SIG == 1:  # the counter to signal, read with the opcode (an L1 hit: WPF) and held through the body
            signal = signal_of(word)
        if PF == 2:  # the next task's weights asked of the L2 a whole task ahead
            if t + 1 < end:
                if tl.load(word + WORDS) == OP_LINEAR:
                    linear.prefetch_task(word + WORDS, W, ALIGN, HILO)
        if op == OP_LINEAR:
            if PF == 1 or (PF == 2 and t == start):
                linear.prefetch_task(word, W, ALIGN, HILO)
            if PFK > 0:  # a launch variant: the task's next PFK KB asked of the L2 while it waits
                linear.prefetch_ahead(word, W, BR, ALIGN, PFK, HILO)
            if NARROW and linear.needs_narrow(word, BR, KC):  # a launch variant: a copy with 4·BR x KC/4 chunks
                ok, t_ready = linear_task(word, t, end, counters, epoch, err, pid, W, A, MAX_WAITS, TIMEOUT_NS,
                                          MAX_SPINS, USE_TIMER, BR * 4, KC // 4, ALIGN, TB, DEPTH, BN, ROWVEC, AHEAD,
                                          PFD, EF, WORDS, WPF, HILO, POLL, KD, BR, WAITS)
            else:
                ok, t_ready = linear_task(word, t, end, counters, epoch, err, pid, W, A, MAX_WAITS, TIMEOUT_NS,
                                          MAX_SPINS, USE_TIMER, BR, KC, ALIGN, TB, DEPTH, BN, ROWVEC, AHEAD, PFD, EF,
                                          WORDS, WPF, HILO, POLL, KD, BR, WAITS, PIN)
        elif op == OP_HEAD_MATMUL:  # a copy per weight layout, so each vectorizes its loads
            if head_matmul.transposed(word):
                ok, t_ready = head_matmul_task(word, t, end, counters, epoch, err, pid, W, A, MAX_WAITS, TIMEOUT_NS,
                                               MAX_SPINS, USE_TIMER, BIT, BOT, ALIGN, True, TB, WORDS, WPF, EF, POLL,
                                               WAITS)
            else:
                ok, t_ready = head_matmul_task(word, t, end, counters, epoch, err, pid, W, A, MAX_WAITS, TIMEOUT_NS,
                                               MAX_SPINS, USE_TIMER, BI, BO, ALIGN, False, TB, WORDS, WPF, EF, POLL,
                                               WAITS)
        elif EPF and (op == OP_EXPERT_LINEAR):
            ok, t_ready = expert_task(word, t, end, counters, epoch, err, pid, W, A, I, MAX_WAITS, TIMEOUT_NS,
                                      MAX_SPINS, USE_TIMER, BR, KC, ALIGN, TB, PF, DEPTH, ROWVEC, AHEAD, NARROW, PFD,
                                      EF, KD, EPF, WORDS, WPF, POLL, WAITS, PIN)
        else:
            if APF:  # a split's cache rows asked of the L2 while it waits
                if op == OP_ATTENTION:
                    attention.prefetch_split(word, I, C, ALIGN, DMAX, APF, ATT_KIND)
            ok = wait_task(word, t, counters, epoch, err, pid, MAX_WAITS, TIMEOUT_NS, MAX_SPINS, USE_TIMER, POLL, WAITS)
            t_ready = now_ns(USE_TIMER)
            next_word_to_l1(word, t, end, WORDS, WPF)
            if ok == 1:  # the other opcodes' bodies
                if (EPF == 0) and (op == OP_EXPERT_LINEAR):
                    moe.expert_body(word, W, A, I, BR, KC, ALIGN, TB, PF, DEPTH, ROWVEC, AHEAD, NARROW, PFD, EF, KD,
                                    PIN=PIN)
                elif op == OP_RMSNORM:
                    norm.body(word, W, A, I, C, BN)
                elif op == OP_ATTENTION:
                    attention.body(word, A, I, C, BM, BJ, DMAX, RMAX, STAGES, ALIGN, DOT_PREC, ATT_KIND, EF, ATT_ROPE,
                                   QIX)
                elif op == OP_ATTN_COMBINE:
                    attention.combine_body(word, A, BSC, BCW, CPF, ALIGN)
                elif op == OP_ROPE:
                    rope.apply_body(word, A, I, C, BH)
                elif op == OP_CACHE_WRITE:
                    rope.cache_write_body(word, A, I, C, BD)
                elif op == OP_ROPE_TABLE:
                    rope.table_body(word, WF, A, I, BH)
                elif op == OP_MOE_COMBINE:
                    moe.combine_body(word, A, BD, BK, KD)
                elif op == OP_ROUTE:
                    moe.route_body(word, WF, A, I, BE, BP, ROUTE1)
                elif op == OP_EMBED:
                    embed.body(word, W, A, I, BD)
                elif op == OP_EWISE:
                    elementwise.body(word, A, BD)
                elif op == OP_HC_COEFF:
                    mhc.coeff_body(word, WF, A, BW, BD)
                elif op == OP_HC_EXPAND:
                    mhc.expand_body(word, A, BW, BD)
                elif op == OP_HC_HEAD:
                    mhc.head_body(word, WF, A, BW, BD)
                elif op == OP_ARGMAX:
                    argmax.body(word, A, I, BD)
                elif op == OP_ACCEPT:
                    spec.accept_body(word, A, I, BT, SAMPLE, BV)
                elif op == OP_GATHER:
                    spec.gather_body(word, A, I, BD)
                elif op == OP_HELPER_CALL:
                    helper.call_body(word, A, I, HB, epoch, USE_TIMER, BD)
                elif op == OP_HELPER_WAIT:
                    ok = helper.wait_body(word, t, A, I, HB, err, pid, HELPER_NS, MAX_SPINS, USE_TIMER, BD)
                elif HELPER_SIDE:  # a persistent helper kernel's plan (compiled out of every other)
                    if op == OP_HELPER_RECV:
                        ok = helper_side.recv_body(word, t, epoch, A, I, HB, err, pid, HELPER_NS, MAX_SPINS, USE_TIMER,
                                                   BD)
                    elif op == OP_HELPER_SEND:
                        helper_side.send_body(word, A, I, HB, USE_TIMER, BD)
        if ok == 1:
            # SIG: when the signalled counter's index is read.  1 (the default), with the opcode; 0, after the
            # barrier below: the body's stream may have pushed the word's line out of the L1, an L2 round trip
            # before the release; 2, before the barrier, so the round trip overlaps the warps' arrivals
            if SIG == 2:
                signal = signal_of(word)
            tl.debug_barrier()  # every thread's stores happen before the release below
            if SIG == 0:
                signal = signal_of(word)
            signal_done(signal, t, counters, prof, t_begin, t_ready, PROFILE, USE_TIMER)
        t += 1
