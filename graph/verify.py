"""Static verification of a plan before anything runs it.

Checks, with every violation named by its tasks:
- counters: ids in range; every wait expects exactly the number of tasks that signal its counter;
- deadlock freedom: dependency edges (signal -> counter -> wait) plus per-queue order edges are acyclic
  (with every worker co-resident, an acyclic plan always completes);
- hazards: two tasks whose accesses overlap, at least one writing, are ordered by happens-before
  (reachability in that same graph), unless they are routed writes of one op declared disjoint;
- bounds: every access lies inside its buffer;
- stream plans (plan.options["stream_workers"] = S, compile option stream_kernel): the last S queues
  (a second, co-resident kernel's workers) hold only LINEAR tasks and the others none; every LINEAR's
  weights (w, and w2 with SILU_MUL or PAIR) lie in W at a multiple of its K, K a multiple of 8, and at
  most STREAM_MAX_K distinct K (stream_violation).
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import numpy as np

from .footprint import READ_ONLY, Access, declared_disjoint, footprint, overlaps
from .isa import Buf, decode

STREAM_OPCODES = frozenset({"LINEAR"})  # what a stream plan's stream workers run, and only they
STREAM_MAX_K = 4  # distinct LINEAR K: the stream kernel's TMA descriptors (one per row length of the arena)
STREAM_K_ALIGN = 8  # elements: a TMA row's 16 bytes of bf16


class PlanError(ValueError):
    """A plan that must not run; the message names the tasks involved."""


def stream_violation(tasks: list, labels: list[str]) -> str | None:
    """Why a stream plan's LINEAR tasks do not fit the stream kernel, or None: its weights are read as the
    arena viewed [elements / K, K] through one TMA descriptor per K, a task's tile from row w.off // K + r0,
    so w.off (and w2.off, with SILU_MUL or PAIR) must be a multiple of K, in W; at most STREAM_MAX_K K."""
    ks: dict[int, str] = {}
    for i, t in enumerate(tasks):
        if t.op.name not in STREAM_OPCODES:
            continue
        K, op = t["K"], labels[i].split("[")[0]
        if K % STREAM_K_ALIGN:
            return f"LINEAR {op} (task {i}): K={K} is not a multiple of {STREAM_K_ALIGN}"
        for key in ("w", "w2") if t.has("SILU_MUL") or t.has("PAIR") else ("w",):
            if t[key + ".buf"] != Buf.W:
                return f"LINEAR {op} (task {i}): {key} is in buffer {t[key + '.buf']}, not W"
            if t[key + ".off"] % K:
                return (f"LINEAR {op} (task {i}): {key}.off={t[key + '.off']} is not a multiple of K={K} "
                        f"({t[key + '.off'] % K} past row {t[key + '.off'] // K} of the arena seen as [*, {K}])")
        ks.setdefault(K, op)
    if len(ks) > STREAM_MAX_K:
        return (f"LINEAR tasks have {len(ks)} distinct K ({', '.join(f'{k} ({op})' for k, op in sorted(ks.items()))}), "
                f"more than the stream kernel's {STREAM_MAX_K} weight descriptors")
    return None


def verify_plan(plan, check_hazards: bool = True, tasks: list | None = None) -> dict:
    """`tasks`: the plan's words already decoded, if the caller has them."""
    tasks = tasks if tasks is not None else [decode(w) for w in plan.words]
    n, C = len(tasks), plan.num_counters
    label = plan.task_labels

    def name(i: int) -> str:
        return f"task {i} ({label[i]}, worker {worker_of[i]})"

    worker_of = [0] * n
    for w in range(plan.workers):
        for i in plan.queue(w):
            worker_of[i] = w
    if plan.queue_ptr[0] != 0 or plan.queue_ptr[-1] != n or any(
            a > b for a, b in zip(plan.queue_ptr, plan.queue_ptr[1:])):
        raise PlanError(f"queue pointers {plan.queue_ptr[:4]}... do not partition {n} tasks")
    stream = plan.options.get("stream_workers") or 0
    if stream:
        body = plan.workers - stream
        if body < 1:
            raise PlanError(f"stream plan: {stream} stream workers of {plan.workers} leave no body worker")
        for i, t in enumerate(tasks):
            if (t.op.name in STREAM_OPCODES) != (worker_of[i] >= body):
                where = f"stream queue {worker_of[i]} (>= {body})" if worker_of[i] >= body else \
                    f"body queue {worker_of[i]} (< {body})"
                raise PlanError(f"stream plan: {name(i)}, a {t.op.name} task, is on {where}: LINEAR tasks go on "
                                f"the last {stream} queues (the stream kernel's workers), every other task before them")
        why = stream_violation(tasks, label)
        if why:
            raise PlanError(f"stream plan: {why}")

    # ---- counters -----------------------------------------------------------------
    signallers: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(tasks):
        if not 0 <= t.signal < C:
            raise PlanError(f"{name(i)} signals counter {t.signal}, plan has {C}")
        signallers[t.signal].append(i)
    for i, t in enumerate(tasks):
        for c, count in t.waits:
            if not 0 <= c < C:
                raise PlanError(f"{name(i)} waits on counter {c}, plan has {C}")
            have = len(signallers.get(c, []))
            if count != have:
                raise PlanError(f"{name(i)} waits for counter {c} ({plan.counter_labels[c]}) to reach {count} per "
                                f"step but {have} task(s) signal it")

    # ---- happens-before graph: tasks 0..n-1, counters n..n+C-1 ------------------------
    preds: list[list[int]] = [[] for _ in range(n + C)]
    for i, t in enumerate(tasks):
        preds[n + t.signal].append(i)
        for c, _ in t.waits:
            preds[i].append(n + c)
    pos = [0] * n
    for w in range(plan.workers):
        q = list(plan.queue(w))
        for k, i in enumerate(q):
            pos[i] = k
        for a, b in zip(q, q[1:]):
            preds[b].append(a)
    order = _topological(preds, n, name)
    clocks = _vector_clocks(order, preds, n, plan.workers, worker_of, pos)

    # ---- bounds and hazards ------------------------------------------------------------
    sizes = {Buf[k].value: v for k, v in plan.buffers.items()}
    groups: dict[int, dict[int, list[tuple[int, Access]]]] = defaultdict(lambda: defaultdict(list))
    for i, t in enumerate(tasks):
        for a in footprint(t):
            if a.buf not in sizes:
                raise PlanError(f"{name(i)} accesses unknown buffer {a.buf}")
            if a.lo < 0 or a.hi > sizes[a.buf]:
                raise PlanError(f"{name(i)} accesses {Buf(a.buf).name}[{a.lo}:{a.hi}] outside the buffer "
                                f"of {sizes[a.buf]} elements")
            if a.buf in READ_ONLY:
                if a.write:
                    raise PlanError(f"{name(i)} writes the read-only buffer {Buf(a.buf).name}")
                continue
            groups[t.signal][a.buf].append((i, a))
    checked = 0
    if check_hazards:
        hb = _HappensBefore(clocks, worker_of, pos, signallers)
        checked = _check_hazards(groups, signallers, hb, name)
    return {"tasks": n, "counters": C, "hazard_pairs_checked": checked}


def _topological(preds: list[list[int]], n: int, name) -> list[int]:
    succ: list[list[int]] = [[] for _ in preds]
    indeg = [len(p) for p in preds]
    for v, ps in enumerate(preds):
        for p in ps:
            succ[p].append(v)
    order = [v for v, d in enumerate(indeg) if d == 0]
    head = 0
    while head < len(order):
        v = order[head]
        head += 1
        for s in succ[v]:
            indeg[s] -= 1
            if indeg[s] == 0:
                order.append(s)
    if len(order) < len(preds):
        stuck = [v for v, d in enumerate(indeg) if d > 0 and v < n]
        raise PlanError("queues can deadlock: a cycle through dependency waits and queue order involves "
                        + ", ".join(name(v) for v in stuck[:4])
                        + (f" and {len(stuck) - 4} more" if len(stuck) > 4 else ""))
    return order


def _vector_clocks(order, preds, n, workers, worker_of, pos) -> np.ndarray:
    """clock[v][w] = the last position of worker w's queue that happens before node v (-1: none).

    Every edge is queue order or a full-count wait on a counter, so a task a happens before b
    exactly when pos[a] <= clock[b][worker[a]]."""
    clock = np.full((len(preds), workers), -1, dtype=np.int64)
    for v in order:
        row = clock[v]
        for p in preds[v]:
            np.maximum(row, clock[p], out=row)
            if p < n and pos[p] > row[worker_of[p]]:
                row[worker_of[p]] = pos[p]
    return clock


class _HappensBefore:
    def __init__(self, clocks, worker_of, pos, signallers):
        self.clocks, self.worker, self.pos = clocks, np.asarray(worker_of), np.asarray(pos)
        W = clocks.shape[1]
        # per group: the last queue position it occupies on each worker, and the earliest
        # clock among its tasks (what every one of its tasks is known to come after)
        self.last: dict[int, np.ndarray] = {}
        self.floor: dict[int, np.ndarray] = {}
        for g, members in signallers.items():
            members = np.asarray(members)
            last = np.full(W, -1, dtype=np.int64)
            np.maximum.at(last, self.worker[members], self.pos[members])
            self.last[g] = last
            self.floor[g] = clocks[members].min(axis=0)

    def task(self, a: int, b: int) -> bool:
        return self.pos[a] <= self.clocks[b][self.worker[a]]

    def group(self, first: int, then: int) -> bool:
        """Every task of group `first` happens before every task of group `then`."""
        last = self.last[first]
        used = last >= 0
        return bool((self.floor[then][used] >= last[used]).all())


def _conflict(i: int, a: Access, j: int, b: Access, hb: _HappensBefore, name) -> bool:
    """Raise if the two accesses race; returns whether the pair needed a check."""
    if i == j or not (a.write or b.write):
        return False
    if declared_disjoint(a, b):
        return False
    if overlaps(a, b) and not (hb.task(i, j) or hb.task(j, i)):
        kind = "write-after-write" if a.write and b.write else "read/write"
        raise PlanError(f"{kind} hazard on {Buf(a.buf).name}[{max(a.lo, b.lo)}:{min(a.hi, b.hi)}]: {name(i)} and "
                        f"{name(j)} may run concurrently")
    return True


def _within_class(same: list[tuple[int, Access]], hb, name) -> int:
    """Accesses of one group in one layout (usually tiles of one op on one tensor).

    Sweep along the dimension (rows or columns) whose start values spread more: every
    overlapping pair has one member starting inside the other in that dimension, and only
    pairs with a writer are enumerated."""
    writes = [(i, a) for i, a in same if a.write]
    if not writes:
        return 0
    checked = 0
    by_rows = len({a.row0 for _, a in same}) > len({a.col0 for _, a in same})
    lo = (lambda a: a.row0) if by_rows else (lambda a: a.col0)
    hi = (lambda a: a.row1) if by_rows else (lambda a: a.col1)
    writes.sort(key=lambda x: lo(x[1]))
    w_starts = [lo(a) for _, a in writes]
    everything = sorted(same, key=lambda x: lo(x[1]))
    starts = [lo(a) for _, a in everything]
    for i, a in same:
        for j, b in writes[bisect.bisect_left(w_starts, lo(a)):bisect.bisect_left(w_starts, hi(a))]:
            checked += _conflict(i, a, j, b, hb, name)
        if a.write:
            for j, b in everything[bisect.bisect_left(starts, lo(a)):bisect.bisect_left(starts, hi(a))]:
                if not b.write:
                    checked += _conflict(i, a, j, b, hb, name)
    return checked


def _check_hazards(groups, signallers, hb: _HappensBefore, name) -> int:
    """Access sets = one group's accesses in one layout; only sets whose address spans meet are compared."""
    checked = 0
    sets: dict[int, list[tuple[int, int, bool, int, tuple]]] = defaultdict(list)
    members: dict[tuple, list[tuple[int, Access]]] = {}
    for g, per_buf in groups.items():
        for buf, items in per_buf.items():
            by_layout: dict[tuple[int, int], list] = defaultdict(list)
            for i, a in items:
                by_layout[(a.base, a.ld)].append((i, a))
            for layout, same in by_layout.items():
                key = (g, buf) + layout
                members[key] = same
                checked += _within_class(same, hb, name)
                sets[buf].append((min(a.lo for _, a in same), max(a.hi for _, a in same),
                                  any(a.write for _, a in same), g, key))
    ordered: dict[tuple[int, int], bool] = {}
    for buf, entries in sets.items():
        entries.sort()
        for x, (lo_x, hi_x, wx, gx, kx) in enumerate(entries):
            for lo_y, hi_y, wy, gy, ky in entries[x + 1:]:
                if lo_y >= hi_x:
                    break
                if not (wx or wy):
                    continue
                if gx != gy:
                    pair = (min(gx, gy), max(gx, gy))
                    if pair not in ordered:
                        ordered[pair] = hb.group(gx, gy) or hb.group(gy, gx)
                    if ordered[pair]:
                        continue
                for i, a in members[kx]:
                    for j, b in members[ky]:
                        checked += _conflict(i, a, j, b, hb, name)
    return checked
