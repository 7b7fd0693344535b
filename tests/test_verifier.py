"""Mutation tests: the static verifier rejects plans that could deadlock, race or read out of bounds."""

import copy
import dataclasses
import re

import numpy as np
import pytest

import graph.memory
from graph.compile import CompileOptions, compile_step
from graph.footprint import footprint
from graph.isa import HEADER, LAYOUTS, decode
from graph.lower import StepShape
from graph.verify import PlanError, verify_plan
from model import preset


def _plan(workers=2, scheduler="round_robin", name="tiny-moe"):
    return compile_step(preset(name), StepShape(T=2, B=2, max_len=16, mtp_passes=1),
                        CompileOptions(workers=workers, scheduler=scheduler))


def _worker_of(plan):
    out = {}
    for w in range(plan.workers):
        for i in plan.queue(w):
            out[i] = w
    return out


def test_compiled_plans_pass():
    for name in ("tiny-moe", "tiny-dense", "tiny-mhc"):
        verify_plan(_plan(name=name, workers=5, scheduler="critical_path"))


def test_dropped_dependency_is_a_hazard():
    plan = _plan()
    worker, tasks = _worker_of(plan), [decode(w) for w in plan.words]
    signallers = {}
    for i, t in enumerate(tasks):
        signallers.setdefault(t.signal, []).append(i)
    for i, t in enumerate(tasks):
        if len(t.waits) != 1:
            continue
        c, _ = t.waits[0]
        producers = signallers[c]
        prev = i - 1 if i > plan.queue_ptr[worker[i]] else None
        # the producer runs elsewhere and nothing earlier in this queue comes after it
        if all(worker[p] != worker[i] for p in producers) and (prev is None or tasks[prev].signal < c):
            bad = copy.deepcopy(plan)
            bad.words[i, 3:5] = (-1, 0)
            with pytest.raises(PlanError, match="hazard"):
                verify_plan(bad)
            return
    pytest.fail("no task to mutate")


def test_queue_order_cycle_is_a_deadlock():
    plan = _plan(workers=1)
    tasks = [decode(w) for w in plan.words]
    for i, t in enumerate(tasks):
        for c, _ in t.waits:
            producer = next(j for j, u in enumerate(tasks) if u.signal == c)
            bad = copy.deepcopy(plan)
            bad.words[[producer, i]] = bad.words[[i, producer]]
            bad.task_labels[producer], bad.task_labels[i] = bad.task_labels[i], bad.task_labels[producer]
            with pytest.raises(PlanError, match="deadlock"):
                verify_plan(bad)
            return


@pytest.mark.parametrize("delta", [1, -1])
def test_wrong_wait_count(delta):
    plan = _plan()
    i = next(i for i in range(plan.num_tasks) if decode(plan.words[i]).waits)
    bad = copy.deepcopy(plan)
    bad.words[i, 4] += delta
    with pytest.raises(PlanError, match=r"to reach \d+ per step but \d+ task\(s\) signal it"):
        verify_plan(bad)


def test_overlapping_live_buffers(monkeypatch):
    """A memory planner that puts every activation at the start of its buffer must be caught."""
    def overlapping(segs, size, before, users, base):
        size = max([size] + [s.size for s in segs])
        segs[:] = [graph.memory._Segment(base, size, users)]
        return base, True
    monkeypatch.setattr(graph.memory, "_place", overlapping)
    with pytest.raises(PlanError, match="hazard"):
        _plan(workers=4, scheduler="critical_path")


def test_reuse_without_ordering(monkeypatch):
    """Reusing a block while a reader of the old tensor may still run must be caught."""
    real = graph.memory._place

    def careless(segs, size, before, users, base):
        return real(segs, size, -1, users, base)  # pretend every op is an ancestor
    monkeypatch.setattr(graph.memory, "_place", careless)
    with pytest.raises(PlanError, match="hazard"):
        _plan(workers=4, scheduler="critical_path")


def test_out_of_bounds_access():
    plan = _plan()
    i = next(i for i in range(plan.num_tasks) if decode(plan.words[i]).op.name == "LINEAR")
    bad = copy.deepcopy(plan)
    bad.words[i, LAYOUTS["LINEAR"]["out.off"]] = plan.buffers["A"]
    with pytest.raises(PlanError, match="outside the buffer"):
        verify_plan(bad)


def test_attention_splits_writing_one_cache_region_are_a_hazard():
    """ATTENTION[ROPE] (rope_into_attention) writes the step's new keys and values into its own split's cache
    rows.  Split 2s of a KV head cut to half a split's length reads rows of split s (its partial rows stay its
    own): with both on other workers, that is a race on the cache the verifier names."""
    plan = compile_step(preset("tiny-dense"), StepShape(T=2, B=2, max_len=16, attn_split=4), CompileOptions(workers=4))
    worker, tasks = _worker_of(plan), [decode(w) for w in plan.words]
    splits = [i for i, t in enumerate(tasks) if t.op.name == "ATTENTION" and t.has("ROPE")]
    assert splits
    for i in splits:
        for j in splits:
            a, b = tasks[i], tasks[j]
            if a.signal == b.signal and a["b"] == b["b"] and a["h0"] == b["h0"] and a["split"] >= 1 \
                    and b["split"] == 2 * a["split"] and worker[i] != worker[j]:
                bad = copy.deepcopy(plan)
                bad.words[j, LAYOUTS["ATTENTION"]["split_len"]] = a["split_len"] // 2
                with pytest.raises(PlanError, match="hazard"):
                    verify_plan(bad)
                return
    pytest.fail("no splits s and 2s of one head on two workers")


def test_attention_that_does_not_wait_for_the_latent_norm_races_on_the_cache():
    """RMSNORM[CACHE] (norm_into_cache) writes an MLA layer's normalized latent into the cache: its footprint claims
    those cache columns (and the cache lengths it reads), so an attention task that no longer waits for it is a
    race on the cache the verifier names (16 workers and no memory reuse: nothing else orders the two).  Without
    shared_counters, whose one counter for attention's producers would cut its waits on the ropes and q_absorb too."""
    plan = compile_step(preset("tiny-moe"), StepShape(T=2, B=2, max_len=16, mtp_passes=1),
                        CompileOptions(workers=16, reuse_memory=False, shared_counters=False))
    tasks = [decode(w) for w in plan.words]
    norms = {t.signal for t in tasks if t.op.name == "RMSNORM" and t.has("CACHE")}
    cuts = [(i, k) for i, t in enumerate(tasks) if t.op.name == "ATTENTION"
            for k, (c, _) in enumerate(t.waits) if c in norms]
    assert norms and cuts
    for i, k in cuts:
        bad = copy.deepcopy(plan)
        bad.words[i, 3 + 2 * k: 5 + 2 * k] = (-1, 0)
        with pytest.raises(PlanError, match=r"hazard on C\[.*kv_a_norm"):
            verify_plan(bad)


def test_a_shared_counter_counts_every_task_of_its_ops():
    """With shared_counters (the default) an MLA attention task's one wait stands for its four producers: cut, it
    races with them; counting one op's tasks short of the group's, the verifier names the count it expects."""
    plan = compile_step(preset("tiny-moe"), StepShape(T=2, B=2, max_len=16), CompileOptions(workers=16,
                                                                                         reuse_memory=False))
    tasks = [decode(w) for w in plan.words]
    i = next(k for k, t in enumerate(tasks) if t.op.name == "ATTENTION")
    (c, n), = tasks[i].waits
    assert "+" in plan.counter_labels[c] and n == sum(t.signal == c for t in tasks)
    bad = copy.deepcopy(plan)
    bad.words[i, 3:5] = (-1, 0)
    with pytest.raises(PlanError, match=r"hazard on .*" + re.escape(plan.task_labels[i])):
        verify_plan(bad)
    bad = copy.deepcopy(plan)
    bad.words[i, 4] = n - 1
    with pytest.raises(PlanError, match=rf"to reach {n - 1} per step but {n} task"):
        verify_plan(bad)


def test_unknown_counter_and_opcode():
    plan = _plan()
    bad = copy.deepcopy(plan)
    bad.words[0, 2] = plan.num_counters + 5
    with pytest.raises(PlanError, match="signals counter"):
        verify_plan(bad)
    bad = copy.deepcopy(plan)
    bad.words[0, 0] = 99
    with pytest.raises(ValueError, match="unknown opcode 99"):
        verify_plan(bad)


def test_loaded_plans_are_verified():
    from graph.plan import Plan
    plan = _plan()
    bad = copy.deepcopy(plan)
    i = next(i for i in range(plan.num_tasks) if decode(plan.words[i]).waits)
    bad.words[i, 4] += 3
    with pytest.raises(PlanError):
        Plan.from_json(bad.to_json())
    assert np.array_equal(Plan.from_json(plan.to_json()).words, plan.words)
    assert HEADER == 12


def _elements(accesses) -> dict[tuple[int, bool], set[int]]:
    out: dict[tuple[int, bool], set[int]] = {}
    for a in accesses:
        for lo, hi in a.rows():
            out.setdefault((a.buf, a.write), set()).update(range(lo, hi))
    return out


@pytest.mark.parametrize("name,T,B", [("tiny-moe", 2, 2), ("tiny-dense", 3, 1), ("tiny-mhc", 1, 3)])
def test_combine_footprint_is_every_split_partial_it_reads(name, T, B):
    """ATTN_COMBINE's footprint (one strided access per token and head, not one per split) holds exactly the
    elements the body reads: split s's partial of token t, head h at row ((b·ns + s)·T + t)·nh + h of the
    partials (dim columns, c0..c1 of them) and of the lse, and writes its output columns."""
    plan = compile_step(preset(name), StepShape(T=T, B=B, max_len=64, attn_split=8),
                        CompileOptions(workers=7))
    combines = [t for t in map(decode, plan.words) if t.op.name == "ATTN_COMBINE"]
    assert combines and any(t.fields["nsplits"] > 2 for t in combines)
    for t in combines:
        f = t.fields
        b, T_, h0, h1, nh, ns, dim, c0, c1 = (f[k] for k in ("b", "T", "h0", "h1", "nheads", "nsplits", "dim", "c0",
                                                             "c1"))
        parts, lse, out = set(), set(), set()
        for s in range(ns):
            for tok in range(T_):
                for h in range(h0, h1):
                    row = ((b * ns + s) * T_ + tok) * nh + h
                    parts.update(f["op.off"] + row * dim + c for c in range(c0, c1))
                    lse.add(f["lse.off"] + row)
        for tok in range(T_):
            for h in range(h0, h1):
                out.update(f["out.off"] + (b * T_ + tok) * f["out.ld"] + h * dim + c for c in range(c0, c1))
        want = {(f["op.buf"], False): parts, (f["out.buf"], True): out}
        want[(f["lse.buf"], False)] = want.get((f["lse.buf"], False), set()) | lse
        assert _elements(footprint(t)) == want, t


@pytest.mark.parametrize("name,T,B", [("tiny-moe", 2, 2), ("tiny-dense", 3, 1), ("tiny-mhc", 1, 3)])
def test_attention_footprint_reads_every_head_of_its_query_rows(name, T, B):
    """ATTENTION's query reads: of its tokens' rows of q, exactly columns h·q_hs + q_col0 + [0, dim) for heads
    h0..h1, and MLA's rope part the same way (pe_hs, pe_col0, rope_dim); also with the columns moved (q_col0,
    pe_col0 > 0, as a plan reading q out of a wider tensor has them)."""
    plan = compile_step(preset(name), StepShape(T=T, B=B, max_len=64, attn_split=8), CompileOptions(workers=7))
    tasks = [t for t in map(decode, plan.words) if t.op.name == "ATTENTION"]
    assert tasks and any(t.fields["h1"] - t.fields["h0"] > 1 for t in tasks)
    moved = [dataclasses.replace(t, fields=dict(t.fields, q_col0=t.fields["q_col0"] + 4,
                                                pe_col0=t.fields["pe_col0"] + 2)) for t in tasks]
    for t in tasks + moved:
        f = t.fields
        parts = [("q", "q_hs", "q_col0", "dim")] + ([("pe", "pe_hs", "pe_col0", "rope_dim")] if t.has("MLA") else [])
        want = {f[key + ".off"] + r * f[key + ".ld"] + h * f[hs] + f[col0] + d for key, hs, col0, width in parts
                for r in range(f["b"] * f["T"], (f["b"] + 1) * f["T"]) for h in range(f["h0"], f["h1"])
                for d in range(f[width])}
        assert len({f[key + ".buf"] for key, *_ in parts}) == 1
        # the task's other reads of that buffer: its footprint with no heads
        headless = dataclasses.replace(t, fields=dict(f, h1=f["h0"]))
        other = _elements(footprint(headless)).get((f["q.buf"], False), set())
        assert _elements(footprint(t)).get((f["q.buf"], False), set()) == want | other, (f["q_col0"], t)
