"""A weight stream that never drains between tasks, in plain Triton: one pipelined loop over all of a worker's
weight slots (tools/gluon_stream.py's tmaf variants).

The per-task TMA ring (gluon_stream.tma_chain_kernel) refills from empty at every task: its tasks are 16 rows x
K, 8-32 tiles, so the pipeliner's prologue and drain are most of each task, and it streamed 1.7-2.4 TB/s where
the Gluon ring (a producer warp that never waits) reached 3.85.  Here the loop runs over the worker's slots in
queue order, across task boundaries, with the weights packed so that slot i of worker w is rows
(first[w] + i) x SUB x 16 of one tile-major arena: the address depends on i alone, so Triton's pipeliner keeps
STAGES - 1 slots in flight through every task's start, wait and epilogue.  Each task's dependency wait is a
bounded spin in its first slot's turn (spin_wait: one asm, so the loop still pipelines), its activations read
after it by asm loads the pipeliner cannot move above the wait, its row sums stored and signalled in its last
slot's turn.

Measured (docs/PERF.md session 19): 2.34 TB/s without waits and 1.15 ms on the chain, below the LINEAR body's
3.27 TB/s / 0.82 ms with the Gluon ring's bytes in flight, so bytes in flight are not what plain Triton lacks.
Kept as that evidence, and as the way to make Triton's pipeliner run a loop with waits and releases in it.
"""

import triton
import triton.language as tl

# a bounded spin on a counter inside one asm (no loop in the IR, so Triton's pipeliner still pipelines the K loop
# it sits in): each thread polls with its own acquire load, at most 2**24 times; returns the value seen and a
# zero the compiler cannot see through.  Added to the activations' address, the zero keeps Triton's pipeliner
# from moving their loads above the wait (ptxas later folds it; by then the loads sit after the spin's branch,
# and each thread's acquire orders them after the producer's writes)
_SPIN = tl.constexpr("{ .reg .pred p, q; .reg .b32 n; "
                     f"mov.b32 n, {1 << 24}; SPIN: ld.acquire.gpu.global.b32 $0, [$2]; "
                     "setp.lt.s32 p, $0, $3; sub.s32 n, n, 1; setp.gt.s32 q, n, 0; and.pred p, p, q; @p bra SPIN; "
                     "mov.b32 $1, 0; }")


@triton.jit
def spin_wait(counter, target, err):
    seen, zero = tl.inline_asm_elementwise(_SPIN, "=r,=r,l,r", [counter, target], dtype=(tl.int32, tl.int32),
                                           is_pure=False, pack=1)
    if seen < target:
        tl.atomic_xchg(err, 1, sem="relaxed", scope="gpu")
    return zero


@triton.jit
def plain_load(ptrs, mask):
    """ptrs' fp32 values where mask, else 0, loaded by inline asm (elementwise): loads Triton's pipeliner leaves
    where they are."""
    return tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.f32 $0, 0f00000000; "
                                     "@p ld.global.f32 $0, [$1]; }", "=f,l,r", [ptrs, mask.to(tl.int32)],
                                     dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def flat_ring_kernel(Q, A, tasks, queue, first, counters, epoch_ptr, err, WAIT: tl.constexpr, STAGES: tl.constexpr,
                     SUB: tl.constexpr, FIELDS: tl.constexpr, STRIDE: tl.constexpr):
    """Q: the weights as [slots x SUB, 16, 256] bf16 tiles in queue order (a task's K tiles one after another, its
    count a multiple of SUB), first[w]: worker w's first slot.  A task's fields as gluon_stream.build_chain
    writes them: 1 tiles, 2 x offset, 3 K, 4 y offset, 5 rows, 6 GEMV, 7 its predecessor's task count."""
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr + pid) + 1
    tl.store(epoch_ptr + pid, epoch)
    t = tl.load(queue + pid)
    t_end = tl.load(queue + pid + 1)
    slot0 = tl.load(first + pid)
    n_slots = tl.load(first + pid + 1) - slot0
    desc = tl.make_tensor_descriptor(Q, shape=[(slot0 + n_slots) * SUB, 16, 256], strides=[16 * 256, 256, 1],
                                     block_shape=[SUB, 16, 256])
    sub = tl.arange(0, SUB)[:, None, None]
    cols = tl.arange(0, 256)[None, None, :]
    # the current task's fields, loop-carried: a task ends in its last slot's turn, which loads the next one's (a
    # load at the loop's top level whose address is loop-carried keeps the pipeliner from running ahead)
    c = 0  # the task's slot that this turn multiplies
    task = tasks + tl.maximum(tl.minimum(t, t_end - 1), 0) * FIELDS  # (a worker with no task reads task 0)
    last, x_ptr, K, gemv = tl.load(task + 1) // SUB - 1, A + tl.load(task + 2), tl.load(task + 3), tl.load(task + 6)
    acc = tl.zeros((SUB, 16, 256), tl.float32)
    for i in tl.range(0, n_slots, num_stages=STAGES):
        w = desc.load([(slot0 + i) * SUB, 0, 0])
        if c == 0:
            if WAIT & (gemv > 0):
                x_ptr += spin_wait(counters + (gemv - 1) * STRIDE, epoch * tl.load(task + 7), err)
        k = (c * SUB + sub) * 256 + cols
        acc += w.to(tl.float32) * plain_load(x_ptr + k, k < K)
        if c == last:
            out = tl.sum(tl.sum(acc, axis=2), axis=0)
            r = tl.arange(0, 16)
            tl.store(A + tl.load(task + 4) + r, out, mask=r < tl.load(task + 5))
            # every thread's stores before the release; an asm barrier, since tl.debug_barrier in the loop keeps
            # Triton from pipelining it (its zero, added to the counter's address, keeps the release after it)
            zero = tl.inline_asm_elementwise("bar.sync 0; mov.b32 $0, 0;", "=r,r", [gemv], dtype=tl.int32,
                                             is_pure=False, pack=1)
            tl.atomic_add(counters + gemv * STRIDE + zero, 1, sem="release", scope="gpu")
            acc = tl.zeros((SUB, 16, 256), tl.float32)
            t += 1
            task = tasks + tl.minimum(t, t_end - 1) * FIELDS  # (the worker's last task: no next one to read)
            last, x_ptr, K = tl.load(task + 1) // SUB - 1, A + tl.load(task + 2), tl.load(task + 3)
            gemv = tl.load(task + 6)
            c = 0
        else:
            c += 1
