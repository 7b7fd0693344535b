"""tools/step_diff.py's attribution, on a CPU: a bit changed inside one task's written region names that task."""

import torch

from graph.compile import CompileOptions, compile_step
from graph.footprint import footprint
from graph.isa import Buf
from graph.lower import StepShape
from model import preset
from tools.step_diff import written_tasks_that_differ


def test_a_changed_output_element_names_the_task_that_wrote_it():
    plan = compile_step(preset("tiny-dense"), StepShape(T=1, B=1, max_len=32),
                        CompileOptions(workers=4, reuse_memory=False))
    g = torch.Generator().manual_seed(0)
    a = {Buf.A: torch.randn(plan.buffers["A"], generator=g), Buf.I: torch.randint(0, 9, (plan.buffers["I"],))}
    a[Buf.A][::7] = float("nan")  # never-written elements are NaN in both snapshots: not a difference
    b = {buf: t.clone() for buf, t in a.items()}
    assert written_tasks_that_differ(plan, a, b) == []
    linear = next(t for t in range(plan.num_tasks) if plan.task(t).op.name == "LINEAR")
    out = next(acc for acc in footprint(plan.task(linear)) if acc.write)
    b[out.buf][out.lo + 1] = 12345.0  # randn or NaN before: another bit pattern either way
    assert written_tasks_that_differ(plan, a, b) == [linear]
