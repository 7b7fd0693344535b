"""Scheduling tasks onto W workers, and simulating a schedule with the cost model.

`critical_path` is list scheduling: tasks become ready when every task of the
ops they depend on has finished (plus a dependency hop); a free worker takes
the ready task with the longest remaining path to the end of the step.  With worker
classes (a second kernel's workers that run only LINEAR tasks: compile option
stream_kernel) a free worker takes only ready tasks of its own class.
`round_robin` deals tasks in program order and is kept as a baseline;
`blocked` gives each worker a contiguous slice of program order (for sequential
execution under TRITON_INTERPRET).  Both
produce queues whose order agrees with the dependencies, so the union of
queue order and dependency edges is acyclic.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass
class SchedTask:
    op: int
    seconds: float


@dataclass
class Schedule:
    queues: list[list[int]]
    makespan: float
    busy: list[float]  # seconds of work per worker

    @property
    def balance(self) -> float:
        """Mean over max worker load (1.0 = perfectly even)."""
        return (sum(self.busy) / len(self.busy)) / max(max(self.busy), 1e-30)


def _op_tasks(tasks: list[SchedTask]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, t in enumerate(tasks):
        out.setdefault(t.op, []).append(i)
    return out


def bottom_levels(tasks: list[SchedTask], op_deps: dict[int, set[int]], hop: float) -> dict[int, float]:
    """Longest remaining path (seconds) from the start of an op's slowest task to the end of the step."""
    by_op = _op_tasks(tasks)
    succ: dict[int, list[int]] = {op: [] for op in by_op}
    for op, deps in op_deps.items():
        for d in deps:
            succ.setdefault(d, []).append(op)
    level: dict[int, float] = {}
    for op in sorted(by_op, reverse=True):  # op ids are topological
        longest = max(tasks[i].seconds for i in by_op[op])
        level[op] = longest + max((hop + level[s] for s in succ.get(op, ()) if s in level), default=0.0)
    return level


def critical_path(tasks: list[SchedTask], op_deps: dict[int, set[int]], workers: int, hop: float,
                  classes: list[int] | None = None, class_workers: list[int] | None = None) -> Schedule:
    """classes: each task's worker class (indexed like `tasks`), for workers that run only some opcodes
    (compile option stream_kernel: a second kernel's workers take the LINEAR tasks); class k owns
    queues sum(class_workers[:k]) .. + class_workers[k] (default: `workers` per class), and a free
    worker takes only ready tasks of its own class, longest remaining path first.  Every class's
    workers run in the one timeline (two co-resident kernels).  None: one class of `workers`."""
    counts = [workers] if classes is None else list(class_workers or [workers] * (max(classes, default=0) + 1))
    cls = classes if classes is not None else [0] * len(tasks)
    if len(cls) != len(tasks) or any(not 0 <= c < len(counts) for c in cls):
        raise ValueError(f"classes: one class in 0..{len(counts) - 1} per task")
    empty = sorted({c for c in cls if counts[c] < 1})
    if empty:
        raise ValueError(f"worker class(es) {empty} have tasks but no workers")
    worker_class = [k for k, n in enumerate(counts) for _ in range(n)]
    by_op = _op_tasks(tasks)
    level = bottom_levels(tasks, op_deps, hop)
    succ: dict[int, list[int]] = {}
    pending = {op: len([d for d in op_deps.get(op, ()) if d in by_op]) for op in by_op}
    for op in by_op:
        for d in op_deps.get(op, ()):
            if d in by_op:
                succ.setdefault(d, []).append(op)
    op_finish: dict[int, float] = {}
    remaining = {op: len(ids) for op, ids in by_op.items()}
    waiting: list[list[tuple[float, float, int]]] = [[] for _ in counts]  # per class: (ready time, -level, task)
    ready: list[list[tuple[float, int, float]]] = [[] for _ in counts]  # per class: (-level, task, ready time)
    free = [(0.0, w) for w in range(len(worker_class))]
    parked: list[list[tuple[float, int]]] = [[] for _ in counts]  # free workers whose class had nothing released

    def release(op: int) -> None:
        t = max((op_finish[d] + hop for d in op_deps.get(op, ()) if d in by_op), default=0.0)
        for i in by_op[op]:
            heapq.heappush(waiting[cls[i]], (t, -level[op], i))
            for item in parked[cls[i]]:  # never with one class: some task is always released
                heapq.heappush(free, item)
            parked[cls[i]].clear()

    for op, n in pending.items():
        if n == 0:
            release(op)
    queues: list[list[int]] = [[] for _ in worker_class]
    busy = [0.0] * len(worker_class)
    makespan = 0.0
    placed = 0
    while placed < len(tasks):
        now, w = heapq.heappop(free)
        c = worker_class[w]
        if not waiting[c] and not ready[c]:
            parked[c].append((now, w))
            continue
        while waiting[c] and waiting[c][0][0] <= now:
            t, neg, i = heapq.heappop(waiting[c])
            heapq.heappush(ready[c], (neg, i, t))
        if ready[c]:
            _, i, _ = heapq.heappop(ready[c])
            start = now
        else:
            t, _, i = heapq.heappop(waiting[c])
            start = t
        placed += 1
        finish = start + tasks[i].seconds
        queues[w].append(i)
        busy[w] += tasks[i].seconds
        makespan = max(makespan, finish)
        heapq.heappush(free, (finish, w))
        op = tasks[i].op
        op_finish[op] = max(op_finish.get(op, 0.0), finish)
        remaining[op] -= 1
        if remaining[op] == 0:
            for s in succ.get(op, ()):
                pending[s] -= 1
                if pending[s] == 0:
                    release(s)
    return Schedule(queues, makespan, busy)


def round_robin(tasks: list[SchedTask], op_deps: dict[int, set[int]], workers: int, hop: float) -> Schedule:
    order = sorted(range(len(tasks)), key=lambda i: (tasks[i].op, i))
    queues: list[list[int]] = [[] for _ in range(workers)]
    for n, i in enumerate(order):
        queues[n % workers].append(i)
    makespan, busy = simulate(tasks, op_deps, queues, hop)
    return Schedule(queues, makespan, busy)


def blocked(tasks: list[SchedTask], op_deps: dict[int, set[int]], workers: int, hop: float) -> Schedule:
    """Contiguous slices of program order: worker w only waits on workers <= w.  Slow on a GPU, but
    it runs under TRITON_INTERPRET, where programs execute one after another."""
    order = sorted(range(len(tasks)), key=lambda i: (tasks[i].op, i))
    size = -(-len(order) // workers)
    queues = [order[w * size:(w + 1) * size] for w in range(workers)]
    makespan, busy = simulate(tasks, op_deps, queues, hop)
    return Schedule(queues, makespan, busy)


def simulate(tasks: list[SchedTask], op_deps: dict[int, set[int]], queues: list[list[int]],
             hop: float) -> tuple[float, list[float]]:
    """Run the queues in order under the cost model; returns (makespan, busy seconds per worker)."""
    by_op = _op_tasks(tasks)
    left = {op: len(ids) for op, ids in by_op.items()}
    finish_op: dict[int, float] = {}
    heads = [0] * len(queues)
    clock = [0.0] * len(queues)
    busy = [0.0] * len(queues)
    done = 0
    while done < len(tasks):
        progressed = False
        for w, q in enumerate(queues):
            while heads[w] < len(q):
                i = q[heads[w]]
                deps = [d for d in op_deps.get(tasks[i].op, ()) if d in by_op]
                if any(left[d] for d in deps):
                    break
                start = max([clock[w]] + [finish_op[d] + hop for d in deps])
                clock[w] = start + tasks[i].seconds
                busy[w] += tasks[i].seconds
                op = tasks[i].op
                finish_op[op] = max(finish_op.get(op, 0.0), clock[w])
                left[op] -= 1
                heads[w] += 1
                done += 1
                progressed = True
        if not progressed:
            raise ValueError("queues deadlock: no worker can start its next task")
    return max(clock), busy
