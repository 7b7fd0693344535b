"""tools/replay.py's phase table: per op of a layer, when its tasks were ready and how late after its inputs."""

import importlib.util
from pathlib import Path

from graph.compile import CompileOptions, compile_step
from graph.lower import StepShape
from model import preset

_spec = importlib.util.spec_from_file_location("replay", Path(__file__).resolve().parents[1] / "tools" / "replay.py")
replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay)


def test_phases_measure_a_queued_op_late():
    """An op whose dependencies ended at 100 us and whose median task was ready at 105 us is 5 us late; the op
    one worker ran two tasks of reports 2 per worker; ops of other layers are left out."""
    plan = compile_step(preset("tiny-dense"), StepShape(T=1, B=1, max_len=16), CompileOptions(workers=4))
    parsed = replay.structure(plan)
    words, deps, _ = parsed
    tasks_of: dict[int, list[str]] = {}
    for w, label in zip(words, plan.task_labels):
        tasks_of.setdefault(w.signal, []).append(label)
    op = next(o for o, labels in tasks_of.items() if plan.counter_labels[o].startswith("L0.") and len(labels) >= 3
              and len(deps.get(o, ())) == 1)
    (dep,) = deps[op]
    events = {label: {"ready": 0.0, "end": 1.0, "worker": i} for i, label in enumerate(plan.task_labels)}
    for label in tasks_of[dep]:
        events[label] = {"ready": 90.0, "end": 100.0, "worker": 0}
    n = len(tasks_of[op])
    ready = [101.0] * (n // 2) + [105.0] + [120.0] * (n - n // 2 - 1)  # the median, index n // 2: 105
    for k, label in enumerate(tasks_of[op]):
        events[label] = {"ready": ready[k], "end": 140.0, "worker": 1 if k < 2 else 1 + k}
    rows = {r["op"]: r for r in replay.phases(plan, parsed, events, 0)}
    row = rows[plan.counter_labels[op]]
    assert row["late_us"] == 5.0 and row["median_ready_us"] == 105.0
    assert row["first_ready_us"] == 101.0 and row["last_end_us"] == 140.0 and row["span_us"] == 39.0
    assert row["tasks"] == n and row["most_per_worker"] == 2
    assert rows and all(name.startswith("L0.") for name in rows)
