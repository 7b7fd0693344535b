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

from .ops import argmax, attention, elementwise, embed, head_matmul, linear, mhc, moe, norm, rope
from .ops.fields import (OP_ARGMAX, OP_ATTENTION, OP_ATTN_COMBINE, OP_CACHE_WRITE, OP_EMBED, OP_EWISE,
                         OP_EXPERT_LINEAR, OP_HC_COEFF, OP_HC_EXPAND, OP_HC_HEAD, OP_HEAD_MATMUL, OP_LINEAR,
                         OP_MOE_COMBINE, OP_RMSNORM, OP_ROPE, OP_ROPE_TABLE, OP_ROUTE, WORD_SIGNAL, WORD_WAITS)

COUNTER_STRIDE = 32  # int32s: one counter per 128-byte line
ERR_HEADER = 4  # err[0]: flag; err[ERR_HEADER + 5·worker ...]: reason, task, counter, seen, target
ERR_PER_WORKER = 5


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
def wait_task(word, t, counters, epoch, err, pid, MAX_WAITS: tl.constexpr, TIMEOUT_NS: tl.constexpr,
              MAX_SPINS: tl.constexpr, USE_TIMER: tl.constexpr):
    """1 when every wait of the task holds, 0 when this worker must stop (timeout, or another failed)."""
    ok = 1
    for i in tl.static_range(MAX_WAITS):
        c = tl.load(word + WORD_WAITS + 2 * i)
        if (c >= 0) & (ok == 1):
            target = epoch * tl.load(word + WORD_WAITS + 2 * i + 1)
            ptr = counters + c.to(tl.int64) * 32
            seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
            start = now_ns(USE_TIMER)
            spins = 0
            reason = 0
            while (seen < target) & (reason == 0):
                seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
                spins += 1
                if spins % 32 == 0:
                    if tl.atomic_add(err, 0, sem="acquire", scope="gpu") != 0:
                        reason = 2  # another worker failed
                    elif USE_TIMER:
                        if now_ns(USE_TIMER) - start > TIMEOUT_NS:
                            reason = 1
                    elif spins > MAX_SPINS:
                        reason = 1
            if reason != 0:
                ok = 0
                state = err + 4 + pid * 5
                tl.store(state, reason)
                tl.store(state + 1, t)
                tl.store(state + 2, c)
                tl.store(state + 3, seen)
                tl.store(state + 4, target)
                if reason == 1:
                    tl.atomic_xchg(err, 1, sem="release", scope="gpu")
    return ok


@triton.jit
def megakernel(words, queue_ptr, counters, worker_epoch, err, prof, W, WF, A, I, C,
               WORDS: tl.constexpr, MAX_WAITS: tl.constexpr, TIMEOUT_NS: tl.constexpr, MAX_SPINS: tl.constexpr,
               USE_TIMER: tl.constexpr, PROFILE: tl.constexpr,
               BN: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
               BM: tl.constexpr, BJ: tl.constexpr, DMAX: tl.constexpr, RMAX: tl.constexpr, BI: tl.constexpr,
               BO: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr, BW: tl.constexpr, DOT_PREC: tl.constexpr):
    pid = tl.program_id(0)
    start = tl.load(queue_ptr + pid)
    end = tl.load(queue_ptr + pid + 1)
    epoch = tl.load(worker_epoch + pid) + 1
    tl.store(worker_epoch + pid, epoch)
    ok = (tl.atomic_add(err, 0, sem="acquire", scope="gpu") == 0).to(tl.int32)
    t = start
    while (t < end) & (ok == 1):
        word = words + t.to(tl.int64) * WORDS
        t_begin = now_ns(USE_TIMER)
        ok = wait_task(word, t, counters, epoch, err, pid, MAX_WAITS, TIMEOUT_NS, MAX_SPINS, USE_TIMER)
        if ok == 1:
            t_ready = now_ns(USE_TIMER)
            op = tl.load(word)
            if op == OP_LINEAR:
                linear.body(word, W, A, BN, BR, BK, DOT_PREC)
            elif op == OP_EXPERT_LINEAR:
                moe.expert_body(word, W, A, I, BN, BR, BK, DOT_PREC)
            elif op == OP_RMSNORM:
                norm.body(word, W, A, BD)
            elif op == OP_ATTENTION:
                attention.body(word, A, I, C, BM, BJ, DMAX, RMAX, DOT_PREC)
            elif op == OP_ATTN_COMBINE:
                attention.combine_body(word, A, BD)
            elif op == OP_HEAD_MATMUL:
                head_matmul.body(word, W, A, BN, BI, BO, DOT_PREC)
            elif op == OP_ROPE:
                rope.apply_body(word, A, BH)
            elif op == OP_CACHE_WRITE:
                rope.cache_write_body(word, A, I, C, BD)
            elif op == OP_ROPE_TABLE:
                rope.table_body(word, WF, A, I, BH)
            elif op == OP_MOE_COMBINE:
                moe.combine_body(word, A, BD)
            elif op == OP_ROUTE:
                moe.route_body(word, WF, A, I, BE, BP)
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
            tl.debug_barrier()  # every thread's stores happen before the release below
            tl.atomic_add(counters + tl.load(word + WORD_SIGNAL).to(tl.int64) * 32, 1, sem="release", scope="gpu")
            if PROFILE:
                rec = prof + t.to(tl.int64) * 4
                tl.store(rec, t_begin)
                tl.store(rec + 1, t_ready)
                tl.store(rec + 2, now_ns(USE_TIMER))
                tl.store(rec + 3, sm_id(USE_TIMER).to(tl.int64))
        t += 1
