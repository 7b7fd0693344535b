"""L2 hints: weights asked of the L2 during the phases that stream none, for the tasks that stream them next.

A decode layer alternates weight phases (projections, MLP) with phases that read little but sit on the
dependency chain (attention over the cache, its combine).  During the latter the DRAM is nearly idle:
on llama-1b ~15 us a layer, with the L2 (50 MB) holding little that anyone reads again.  A worker's first
attention-phase task therefore asks the L2 for the first bytes of the LINEAR tasks that follow it in its
own queue (up to a budget per worker), so those tasks find part of their weights in the L2 when their
dependency is met.  The stream's weight loads are evict-first; prefetched lines are not, so the stream
does not push them out before their use.

Only the carriers' words change (word HINT points at a hint row); a hint changes no result, and a kernel
compiled without L2H ignores it.  Expert weights are not hinted: which experts a token uses is known
only once ROUTE has run, after the window.
"""

from __future__ import annotations

import numpy as np

from .isa import HINT, HINT_RANGES, WORDS, Decoded

# Opcodes whose phase streams (almost) no weights and sits on the chain: a window for other tasks' weights
WINDOW_OPCODES = frozenset({"ATTENTION", "ATTN_COMBINE"})
# Hinting stops at these: experts (their weights are chosen on the device) and the next window (it hints
# what follows it)
STOP_OPCODES = frozenset({"EXPERT_LINEAR"}) | WINDOW_OPCODES
# cp.async.bulk.prefetch.L2 takes a 16-byte aligned address and size: ranges are whole 8-element units,
# 16 bytes of bf16 weights (32 of fp32), whatever dtype the runtime loads the plan's weights in
UNIT = 8


def linear_ranges(task: Decoded, budget: int, wbytes: int) -> tuple[list[tuple[int, int]], int]:
    """A LINEAR task's first rows, at most `budget` bytes of them (whole rows, at least one): one (W element
    offset, elements) range per matrix it streams (two for gate|up and a router's high|low parts, whose
    rows the stream reads side by side).  -> (ranges, bytes)."""
    K, r0, r1 = task["K"], task["r0"], task["r1"]
    offs = [task["w.off"], task["w2.off"]] if task.has("SILU_MUL") or task.has("PAIR") else [task["w.off"]]
    row_bytes = K * wbytes * len(offs)
    rows = min(r1 - r0, max(1, -(-budget // row_bytes)))
    return [(off + r0 * K, rows * K) for off in offs], rows * row_bytes


def aligned_range(off: int, n: int, limit: int) -> tuple[int, int]:
    """(off, n) in elements widened to whole UNITs, and kept within `limit` elements of W."""
    start = off // UNIT * UNIT
    end = min(-(-(off + n) // UNIT) * UNIT, limit // UNIT * UNIT)
    return start, max(0, end - start)


def plan_hints(tasks: list[Decoded], queue_ptr: list[int], budget_bytes: int, wbytes: int,
               w_elements: int, last: bool = False) -> dict[int, list[tuple[int, int]]]:
    """Carrier task -> its ranges.  In each queue, the first task of each run of window tasks (with `last`,
    the run's last: its prefetches then start after the run's earlier tasks, e.g. once attention has read
    the cache) carries the ranges of the LINEAR tasks after the run, in queue order, until `budget_bytes`,
    HINT_RANGES ranges, or a STOP_OPCODES task."""
    hints: dict[int, list[tuple[int, int]]] = {}
    for w in range(len(queue_ptr) - 1):
        i, end = queue_ptr[w], queue_ptr[w + 1]
        while i < end:
            if tasks[i].op.name not in WINDOW_OPCODES:
                i += 1
                continue
            carrier = i
            while i < end and tasks[i].op.name in WINDOW_OPCODES:
                i += 1
            if last:
                carrier = i - 1
            ranges, left = [], budget_bytes
            for j in range(i, end):
                t = tasks[j]
                if t.op.name in STOP_OPCODES or left <= 0:
                    break
                if t.op.name != "LINEAR":
                    continue
                more, nbytes = linear_ranges(t, left, wbytes)
                if len(ranges) + len(more) > HINT_RANGES:
                    break
                ranges += [r for r in (aligned_range(o, n, w_elements) for o, n in more) if r[1] > 0]
                left -= nbytes
            if ranges:
                hints[carrier] = ranges
    return hints


def attach_hints(words: np.ndarray, hints: dict[int, list[tuple[int, int]]]) -> np.ndarray:
    """Point each carrier's HINT word at its row (rows follow the tasks: row k is at index tasks + k) and
    return the rows, int32 [len(hints), WORDS]."""
    rows = np.zeros((len(hints), WORDS), dtype=np.int32)
    for k, (task, ranges) in enumerate(sorted(hints.items())):
        words[task, HINT] = words.shape[0] + k
        for r, (off, n) in enumerate(ranges):
            lo = off & 0xFFFFFFFF
            rows[k, 4 * r: 4 * r + 3] = (lo - (1 << 32) if lo >= 1 << 31 else lo, off >> 32, n)
    return rows


def hint_ranges(row: np.ndarray) -> list[tuple[int, int]]:
    """A hint row's (W element offset, elements) ranges."""
    out = []
    for r in range(HINT_RANGES):
        n = int(row[4 * r + 2])
        if n:
            out.append(((int(row[4 * r]) & 0xFFFFFFFF) | (int(row[4 * r + 1]) << 32), n))
    return out
