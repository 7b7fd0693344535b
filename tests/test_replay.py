"""tools/replay.py's phase table: per op of a layer, when its tasks were ready and how late after its inputs."""

import importlib.util
from pathlib import Path

import pytest

from graph.compile import CompileOptions, compile_step
from graph.fusion import DEFAULT_RULES
from graph.lower import StepShape
from model import preset

_spec = importlib.util.spec_from_file_location("replay", Path(__file__).resolve().parents[1] / "tools" / "replay.py")
replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay)


def test_phases_measure_a_queued_op_late():
    """An op whose latest dependency ended at 100 us (the others earlier; an unrelated op later) and whose median
    task was ready at 105 us is 5 us late; one ready before its inputs ended counts 0; the op one worker ran two
    tasks of reports 2 per worker; ops of other layers are left out.  The events go through a Chrome trace file.
    Replay compiles plans with a counter per op (replay.per_op: attention waits on three ops here); a plan with
    shared counters is refused by name."""
    with pytest.raises(ValueError, match="shared_counters=0"):
        replay.structure(compile_step(preset("tiny-dense"), StepShape(T=1, B=1, max_len=16), CompileOptions(workers=4)))
    plan = compile_step(preset("tiny-dense"), StepShape(T=1, B=1, max_len=16), replay.per_op(CompileOptions(workers=4)))
    parsed = replay.structure(plan)
    words, deps, _ = parsed
    tasks_of: dict[int, list[str]] = {}
    for w, label in zip(words, plan.task_labels):
        tasks_of.setdefault(w.signal, []).append(label)
    layer0 = [o for o in tasks_of if plan.counter_labels[o].startswith("L0.")]
    op = max((o for o in layer0 if len(tasks_of[o]) >= 2), key=lambda o: len(deps.get(o, ())))
    dep_ops = sorted(deps[op])
    assert len(dep_ops) >= 2
    other = next(o for o in layer0 if o != op and o not in dep_ops and deps.get(o))
    events = {label: (0.0, 1.0, i) for i, label in enumerate(plan.task_labels)}  # (ready, end, worker)
    for k, d in enumerate(dep_ops):
        for label in tasks_of[d]:
            events[label] = (80.0, 100.0 if k == 0 else 95.0 - k, 0)
    n = len(tasks_of[op])
    ready = [101.0] * (n // 2) + [105.0] + [120.0] * (n - n // 2 - 1)  # the median, index n // 2: 105
    for k, label in enumerate(tasks_of[op]):
        events[label] = (ready[k], 140.0, 1 if k < 2 else 1 + k)
    for label in tasks_of[other]:
        events[label] = (1.0, 200.0, 9)  # ready before its inputs ended (at 1 us): not late
    trace = tmp_trace(events)
    rows = {r["op"]: r for r in replay.phases(plan, parsed, replay.load_events(trace), 0)}
    row = rows[plan.counter_labels[op]]
    assert row["late_us"] == 5.0 and row["median_ready_us"] == 105.0
    assert row["first_ready_us"] == 101.0 and row["last_end_us"] == 140.0 and row["span_us"] == 39.0
    assert row["tasks"] == n and row["most_per_worker"] == 2
    assert rows[plan.counter_labels[other]]["late_us"] == 0.0
    assert all(name.startswith("L0.") for name in rows)


def test_scale_multiplies_only_the_named_opcodes():
    """--scale LINEAR=0.5,ATTENTION=2: those tasks' times halved and doubled, every other task's kept; an opcode
    the plan lacks is refused by name."""
    plan = compile_step(preset("tiny-dense"), StepShape(T=1, B=1, max_len=16), replay.per_op(CompileOptions(workers=4)))
    words = replay.structure(plan)[0]
    seconds = [1e-6 * (i + 1) for i in range(len(words))]
    scaled = replay.scaled_seconds(words, seconds, "LINEAR=0.5,ATTENTION=2")
    factor = {"LINEAR": 0.5, "ATTENTION": 2.0}
    assert {w.op.name for w in words} >= set(factor)
    assert scaled == [s * factor.get(w.op.name, 1.0) for w, s in zip(words, seconds)]
    with pytest.raises(SystemExit, match="'ROUTE'"):
        replay.scaled_seconds(words, seconds, "ROUTE=2")


def test_scale_in_microseconds_shifts_each_task_of_the_opcode():
    """--scale LINEAR=-1.5us: each LINEAR task 1.5 us shorter (none below zero), the others kept; a value that is
    neither a factor nor microseconds is refused by name."""
    plan = compile_step(preset("tiny-dense"), StepShape(T=1, B=1, max_len=16), replay.per_op(CompileOptions(workers=4)))
    words = replay.structure(plan)[0]
    seconds = [1e-6 * (i % 3) for i in range(len(words))]
    shifted = replay.scaled_seconds(words, seconds, "LINEAR=-1.5us")
    assert any(w.op.name == "LINEAR" and s == 0.0 for w, s in zip(words, seconds))  # some would go below zero
    assert shifted == [max(0.0, s - 1.5e-6) if w.op.name == "LINEAR" else s for w, s in zip(words, seconds)]
    with pytest.raises(SystemExit, match="'fast'"):
        replay.scaled_seconds(words, seconds, "LINEAR=fast")


def tmp_trace(events: dict) -> str:
    """A Chrome trace as megakernel.profiler.task_trace writes it: an X event per task (ts = ready, dur), waits."""
    import json
    import tempfile
    out = [{"name": label, "ph": "X", "pid": 0, "tid": w, "ts": r, "dur": e - r, "args": {"wait_us": 0.5}}
           for label, (r, e, w) in events.items()]
    out.append({"name": "wait", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 0.5})
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"traceEvents": out}, f)
    f.close()
    return f.name


def test_report_relists_a_stream_plan_by_worker_class(monkeypatch):
    """A stream_kernel plan's relisted schedule keeps LINEAR tasks on the stream workers and the rest on the body
    workers, as the compiler placed them (a relisting across the classes would time a plan no kernel runs)."""
    plan = compile_step(preset("tiny-dense"), StepShape(T=1, B=1, max_len=16),
                        replay.per_op(CompileOptions(workers=4, stream_kernel=True)))
    parsed = replay.structure(plan)
    words = parsed[0]
    seen = {}
    real = replay.critical_path

    def spy(tasks, deps, workers, hop, classes=None, counts=None):
        schedule = real(tasks, deps, workers, hop, classes, counts)
        seen["queues"] = schedule.queues
        return schedule
    monkeypatch.setattr(replay, "critical_path", spy)
    replay.report("stream plan", plan, [1e-6] * len(words), 1e-6, parsed=parsed)
    body = plan.workers - plan.options["stream_workers"]
    for q, queue in enumerate(seen["queues"]):
        assert all((words[i].op.name == "LINEAR") == (q >= body) for i in queue), q


def test_a_variants_new_ops_borrow_their_opcodes_rate():
    """--variant with a fusion rule (dense_mlp on tiny-dense): the fused ops the trace has no tasks of are timed at
    the median rate of their opcode's measured tasks (LINEAR), or, with no task of their opcode measured
    (MOE_COMBINE), at every task's median rate; each is named.  An expert task's work counts the weight rows it
    streams, which its footprint leaves out (the expert is chosen at run time)."""
    import statistics
    cfg = preset("tiny-dense")
    plan = compile_step(cfg, StepShape(T=1, B=1, max_len=16), replay.per_op(CompileOptions(workers=4)))
    words = replay.structure(plan)[0]
    fixed = 1e-6
    by_opcode: dict = {}
    per_byte = {}
    for i, (w, label) in enumerate(zip(words, plan.task_labels)):  # LINEAR tasks 3 to 4 ns an element, others 1 to 2
        rate = 1e-9 * ((3 if w.op.name == "LINEAR" else 1) + i / len(words))
        by_opcode.setdefault(w.op.name, []).append(rate)
        per_byte[replay.family(label)] = rate
    fused = compile_step(cfg, StepShape(T=1, B=1, max_len=16),
                         replay.per_op(CompileOptions(workers=4, fusion_rules=DEFAULT_RULES + ("dense_mlp",))))
    fwords = replay.structure(fused)[0]
    seconds, borrowed = replay.variant_seconds(fwords, fused.task_labels, per_byte, by_opcode, fixed)
    assert borrowed == {"mlp": "LINEAR", "mlp.reduce": "no MOE_COMBINE measured: every task's"}
    everyone = statistics.median(r for v in by_opcode.values() for r in v)
    linear = statistics.median(by_opcode["LINEAR"])
    assert everyone != linear and "MOE_COMBINE" not in by_opcode
    for w, label, s in zip(fwords, fused.task_labels, seconds):
        fam = replay.family(label)
        rate = linear if fam == "mlp" else everyone if fam == "mlp.reduce" else per_byte[fam]
        assert s == pytest.approx(fixed + rate * replay.task_work(w))
    moe = compile_step(preset("tiny-moe"), StepShape(T=1, B=1, max_len=16), replay.per_op(CompileOptions(workers=4)))
    expert = next(w for w in replay.structure(moe)[0] if w.op.name == "EXPERT_LINEAR" and w.has("SILU_MUL"))
    f = expert.fields
    assert replay.task_work(expert) >= 2 * (f["r1"] - f["r0"]) * f["K"]
