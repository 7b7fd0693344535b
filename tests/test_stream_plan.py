"""Compile option stream_kernel: plans for two co-resident persistent kernels, the Triton megakernel on
queues 0..W-1 (every opcode but LINEAR) and a stream kernel on queues W..2W-1 (only LINEAR), each
LINEAR's weights at a multiple of its K in the W arena (the stream kernel's one TMA descriptor per K)."""

import random

import pytest
import torch

import graph.compile
import graph.verify
from graph.compile import CompileError, CompileOptions, compile_options, compile_step
from graph.fusion import DEFAULT_RULES
from graph.isa import LAYOUTS, Buf, decode
from graph.lower import StepShape
from graph.memory import ALIGN
from graph.plan import Plan
from graph.schedule import SchedTask, critical_path, simulate
from graph.verify import PlanError, verify_plan
from model import preset

SHAPE = StepShape(T=2, B=2, max_len=16, mtp_passes=2)


def _pair(name: str, workers: int = 4, shape: StepShape = SHAPE) -> tuple[Plan, Plan]:
    cfg = preset(name)
    return (compile_step(cfg, shape, compile_options("", workers)[0]),
            compile_step(cfg, shape, compile_options("stream_kernel=1", workers)[0]))


def _check_stream_plan(plan: Plan, workers: int) -> set[int]:
    """The stream plan's shape: 2W queues split by opcode, aligned LINEAR weights; its distinct K."""
    assert plan.workers == 2 * workers and len(plan.queue_ptr) == 2 * workers + 1
    assert plan.options["stream_workers"] == workers and plan.options["stream_kernel"] is True
    assert plan.options["workers"] == workers
    ks = set()
    for w in range(plan.workers):
        for i in plan.queue(w):
            t = plan.task(i)
            assert (t.op.name == "LINEAR") == (w >= workers), (w, plan.task_labels[i])
            if t.op.name != "LINEAR":
                continue
            K = t["K"]
            ks.add(K)
            assert K % 8 == 0
            for key in ("w", "w2") if t.has("SILU_MUL") or t.has("PAIR") else ("w",):
                assert t[key + ".buf"] == Buf.W and t[key + ".off"] % K == 0 and t[key + ".off"] % ALIGN == 0
    assert 1 <= len(ks) <= 4
    assert any(plan.queue(w) for w in range(workers)) and any(plan.queue(w) for w in range(workers, 2 * workers))
    return ks


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "tiny-mhc"])
def test_stream_plan_runs_the_same_step(name):
    """Queue classes and alignment hold, the verifier passes, and the interpreter (in queue order, and in a
    random order of the 2W queues) writes the same cache and logits, MTP's included, bit for bit, as the
    plan compiled without the option: the same tasks on other queues, over other weight offsets."""
    from megakernel.interpreter import Interpreter
    from model import init_weights
    cfg = preset(name)
    plain, stream = _pair(name)
    _check_stream_plan(stream, 4)
    verify_plan(stream)
    assert Plan.from_json(stream.to_json()).options == stream.options  # verified again on load
    assert sorted(plain.task_labels) == sorted(stream.task_labels)
    assert "stream_workers" not in plain.options and plain.workers == 4
    w = init_weights(cfg, seed=4)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 2), generator=gen)
    prefix = torch.randn(Interpreter(plain, w).cache().shape, generator=gen)
    outs = []
    for plan, order in ((plain, "queue"), (stream, "queue"), (stream, "random")):
        interp = Interpreter(plan, w)
        interp.cache().copy_(prefix)
        outs.append((interp.step(tokens, torch.tensor([3, 9]), order=order, rng=random.Random(5)),
                     interp.cache().clone()))
    (a, cache_a) = outs[0]
    for b, cache_b in outs[1:]:
        assert torch.equal(cache_a, cache_b) and torch.equal(a.logits, b.logits)
        assert len(a.mtp_logits) == 2 and all(torch.equal(x, y) for x, y in zip(a.mtp_logits, b.mtp_logits))


def test_stream_plans_of_a_model_share_one_weight_layout():
    """The alignment is a function of the model and the option only: stream plans of other shapes lay the
    arena out alike (so they can share it), and the weight slots LINEARs read start at multiples of K."""
    cfg = preset("tiny-moe")
    a = compile_step(cfg, SHAPE, CompileOptions(workers=4, stream_kernel=True))
    b = compile_step(cfg, StepShape(T=1, B=2, max_len=16), CompileOptions(workers=3, stream_kernel=True))
    slots = [{w.name: (w.buf, w.offset) for w in p.weights} for p in (a, b)]
    assert all(slots[0][n] == slots[1][n] for n in slots[1]) and len(slots[1]) > 10
    assert {c["name"]: c["offset"] for c in a.consts} == {c["name"]: c["offset"] for c in b.consts}
    assert (a.buffers["W"], a.buffers["WF"]) == (b.buffers["W"], b.buffers["WF"])
    _check_stream_plan(b, 3)
    plain = compile_step(cfg, SHAPE, CompileOptions(workers=4))
    assert plain.buffers["W"] < a.buffers["W"]  # some K=128 matrix moved to a multiple of 128


def test_llama_1b_stream_plan():
    """llama-1b's decode step (no weights loaded): 2 x 132 queues, LINEAR K of 2048 and 8192 only."""
    plan = compile_step(preset("llama-1b"), StepShape(T=1, B=1, max_len=4096),
                        CompileOptions(workers=132, stream_kernel=True))
    assert _check_stream_plan(plan, 132) == {2048, 8192}


def test_option_parsing_and_schedulers():
    opts, _ = compile_options("stream_kernel=1,workers=6", 4)
    assert opts.stream_kernel and opts.workers == 6
    assert not compile_options("stream_kernel=0", 4)[0].stream_kernel and not CompileOptions().stream_kernel
    with pytest.raises(CompileError, match="critical_path"):
        compile_step(preset("tiny-dense"), SHAPE, CompileOptions(workers=4, scheduler="round_robin",
                                                                  stream_kernel=True))


def test_worker_classes_in_the_scheduler():
    """A free worker takes only its class's tasks; one class given explicitly schedules as no class."""
    tasks = [SchedTask(op, s) for op, s in [(0, 1.0), (0, 1.0), (1, 2.0), (1, 2.0), (1, 2.0), (2, 1.0), (3, 1.0)]]
    deps = {0: set(), 1: {0}, 2: {0}, 3: {1, 2}}
    plain = critical_path(tasks, deps, 2, 0.1)
    assert critical_path(tasks, deps, 2, 0.1, classes=[0] * 7) == plain
    classes = [0, 0, 1, 1, 1, 0, 0]
    s = critical_path(tasks, deps, 2, 0.1, classes=classes, class_workers=[2, 3])
    assert len(s.queues) == 5 and sorted(i for q in s.queues for i in q) == list(range(7))
    assert all(classes[i] == (w >= 2) for w, q in enumerate(s.queues) for i in q)
    assert simulate(tasks, deps, s.queues, 0.1)[0] == pytest.approx(s.makespan)
    assert s.makespan == pytest.approx(1.0 + 0.1 + 2.0 + 0.1 + 1.0)  # op 2 runs beside op 1
    with pytest.raises(ValueError, match="no workers"):
        critical_path(tasks, deps, 2, 0.1, classes=classes, class_workers=[2, 0])


def _linear_task(plan: Plan, K: int | None = None) -> int:
    return next(i for i in range(plan.num_tasks) if plan.task(i).op.name == "LINEAR"
                and (K is None or plan.task(i)["K"] == K))


def test_verifier_refuses_a_misaligned_linear():
    _, plan = _pair("tiny-dense")
    i = _linear_task(plan, 128)
    label = plan.task_labels[i].split("[")[0]
    bad = Plan.from_json(plan.to_json(), verify=False)
    pos = LAYOUTS["LINEAR"]["w.off"]
    bad.words[i, pos] += ALIGN  # still inside W, a multiple of 64, not of 128
    assert decode(bad.words[i])["w.off"] % 128 == ALIGN
    with pytest.raises(PlanError, match=rf"LINEAR {label} \(task {i}\): w\.off=\d+ is not a multiple of K=128"):
        verify_plan(bad)
    verify_plan(plan)  # the unmodified plan still verifies


def test_verifier_refuses_linears_on_body_queues():
    plain, _ = _pair("tiny-dense")
    verify_plan(plain)
    plain.options["stream_workers"] = 2  # queues 2..3 as stream workers: LINEARs on 0..1, others on 2..3
    with pytest.raises(PlanError, match=r"a (LINEAR|\w+) task, is on (body|stream) queue \d"):
        verify_plan(plain)


def test_compile_refuses_what_the_stream_kernel_cannot_run(monkeypatch):
    cfg = preset("tiny-moe")
    monkeypatch.setattr(graph.verify, "STREAM_MAX_K", 2)  # tiny-moe's LINEARs have K 32, 64 and 128
    with pytest.raises(CompileError, match=r"3 distinct K \(32 \(\S+\), 64 \(\S+\), 128 \(\S+\)\)"):
        compile_step(cfg, SHAPE, CompileOptions(workers=4, stream_kernel=True))
    monkeypatch.undo()
    monkeypatch.setattr(graph.compile, "canonical_linear_rows", lambda *a: ())  # weights at multiples of 64 only
    with pytest.raises(CompileError, match=r"stream_kernel: LINEAR \S+ \(task \d+\): w2?\.off=\d+ is not a multiple "
                                           r"of K=128"):
        compile_step(cfg, SHAPE, CompileOptions(workers=4, stream_kernel=True))
    for rule in ("expert_mlp", "dense_mlp"):  # LINEAR[DOWN_T]: no body in the Gluon ring
        with pytest.raises(CompileError, match=f"stream_kernel with fusion rule\\(s\\) {rule}: .*LINEAR\\[DOWN_T\\]"):
            compile_step(cfg, SHAPE, CompileOptions(workers=4, stream_kernel=True,
                                                    fusion_rules=DEFAULT_RULES + (rule,)))
