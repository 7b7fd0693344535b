"""L2 hints (graph/l2_ahead.py): which tasks carry them, what they ask for, and the verifier's checks."""

import numpy as np
import pytest

from graph.compile import CompileOptions, compile_options, compile_step
from graph.isa import HINT, decode
from graph.l2_ahead import UNIT, WINDOW_OPCODES, hint_ranges
from graph.lower import StepShape
from graph.plan import Plan
from graph.verify import PlanError, verify_plan
from model import preset


def hinted(name: str, kb: int, last: bool = False, workers: int = 8) -> Plan:
    return compile_step(preset(name), StepShape(T=1, B=1, max_len=64, attn_split=16),
                        CompileOptions(workers=workers, l2_ahead_kb=kb, l2_ahead_last=last))


def weight_rows(task) -> list[tuple[int, int]]:
    """The W element ranges a LINEAR task streams (each matrix's rows r0..r1)."""
    K, r0, r1 = task["K"], task["r0"], task["r1"]
    keys = ("w.off", "w2.off") if task.has("SILU_MUL") or task.has("PAIR") else ("w.off",)
    return [(task[k] + r0 * K, task[k] + r1 * K) for k in keys]


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("last", [False, True])
def test_hints_ask_for_the_weights_a_workers_next_linears_stream(name, last):
    kb = 4
    plan = hinted(name, kb, last)
    tasks = [decode(w) for w in plan.words]
    carriers = 0
    for w in range(plan.workers):
        q = list(plan.queue(w))
        for pos, i in enumerate(q):
            if not tasks[i].hint:
                continue
            carriers += 1
            assert tasks[i].op.name in WINDOW_OPCODES
            # the carrier is the first (or with `last` the last) task of a run of window tasks
            edge = pos + 1 if last else pos - 1
            if 0 <= edge < len(q):
                assert tasks[q[edge]].op.name not in WINDOW_OPCODES
            run_end = pos + 1
            while run_end < len(q) and tasks[q[run_end]].op.name in WINDOW_OPCODES:
                run_end += 1
            later = [t for t in (tasks[j] for j in q[run_end:]) if t.op.name == "LINEAR"]
            ranges = hint_ranges(plan.hint_rows[tasks[i].hint - plan.num_tasks])
            assert ranges
            for off, n in ranges:
                assert off % UNIT == 0 and n % UNIT == 0
                # inside (up to the 16-byte rounding) the rows of one of this worker's later LINEAR tasks
                assert any(lo - UNIT < off and off + n < hi + UNIT for t in later for lo, hi in weight_rows(t)), \
                    (plan.task_labels[i], off, n)
            # within the budget, plus at most one row of each matrix of the last task hinted
            assert sum(n for _, n in ranges) * 2 <= kb * 1024 + 2 * max(t["K"] for t in later) * 2 + 4 * UNIT
    assert carriers >= plan.workers // 2  # attention and its combine are spread over the workers


def test_no_hints_without_the_option_and_none_for_experts():
    plain = hinted("tiny-moe", 0)
    assert len(plain.hint_rows) == 0 and not any(decode(w).hint for w in plain.words)
    plan = hinted("tiny-moe", 1 << 20)  # a budget larger than any layer: hinting stops at the experts
    tasks = [decode(w) for w in plan.words]
    expert = [r for t in tasks if t.op.name == "EXPERT_LINEAR" for r in ((t["w.off"], t["w.off"] + t["K"]),)]
    for row in plan.hint_rows:
        for off, n in hint_ranges(row):
            assert not any(lo <= off < hi for lo, hi in expert)


def test_hints_change_only_the_hint_words_and_round_trip_through_json():
    plain, plan = hinted("tiny-dense", 0), hinted("tiny-dense", 8)
    same = np.delete(plan.words, HINT, axis=1) == np.delete(plain.words, HINT, axis=1)
    assert same.all()
    again = Plan.from_json(plan.to_json())
    assert (again.words == plan.words).all() and (again.hint_rows == plan.hint_rows).all()
    assert compile_options("l2_ahead_kb=256,l2_ahead_last=1", 132)[0].l2_ahead_kb == 256


def test_the_verifier_names_a_bad_hint():
    plan = hinted("tiny-dense", 8)
    carrier = next(i for i, w in enumerate(plan.words) if decode(w).hint)
    row = plan.words[carrier, HINT] - plan.num_tasks
    bad = Plan.from_json(plan.to_json(), verify=False)
    bad.hint_rows[row, 0:3] = (plan.buffers["W"], 0, UNIT)  # past W's end
    with pytest.raises(PlanError, match=rf"task {carrier} .*L2 hint range 0 .*outside W"):
        verify_plan(bad)
    bad = Plan.from_json(plan.to_json(), verify=False)
    bad.words[carrier, HINT] = plan.num_tasks + len(plan.hint_rows)
    with pytest.raises(PlanError, match=rf"task {carrier} .*points at L2 hint row"):
        verify_plan(bad)
    with pytest.raises(ValueError, match="l2_ahead_kb=-1"):
        hinted("tiny-dense", -1)
