"""Experts on a helper: any placement (and migration) gives the all-on-main engine's output bit
for bit; empty layers make no calls; a silent helper is a bounded error or a fallback; the
migration policy brings a shifting hot set to main and stops moving when routing is stable."""

import json
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graph.compile import CompileOptions, compile_step
from graph.isa import Buf
from graph.lower import StepShape
from helper_card.link import HelperTimeout
from helper_card.migration import CallAwarePolicy, MigrationPolicy, RoutingStats, SkewedRouter, apply_moves
from helper_card.placement import HELPER, Placement
from helper_card.setup import Helper, HelperOptions, capacity_for, moe_layers
from megakernel.engine import make_engine
from megakernel.interpreter import Interpreter
from megakernel.run import main
from megakernel.speculative import Drafts, SpeculativeDecoder
from model import init_weights, preset

MOE_PRESETS = ["tiny-moe", "tiny-mhc"]


def _decode(cfg, w, prompts, steps, helper=None, device="cpu"):
    engine = make_engine(cfg, w, "interpret", prompts.shape[0], prompts.shape[1] + steps, device, torch.float32,
                         workers=4, helper=helper)
    logits = [engine.prefill(prompts)]
    tok = logits[0].argmax(-1, keepdim=True)
    for _ in range(steps - 1):
        logits.append(engine._step(tok)[:, -1])
        tok = logits[-1].argmax(-1, keepdim=True)
    return torch.stack(logits), engine


# ---- placement -------------------------------------------------------------------------------
def test_placement_keeps_the_hottest_experts_on_main_within_the_budget():
    counts = {1: np.array([5, 0, 9, 1]), 2: np.array([9, 3, 0, 7])}
    p = Placement.build(counts, capacity=3)
    assert p.main_experts() == {0: (1, 2), 1: (2, 0), 2: (2, 3)}  # 9, 9 (layer order), 7
    assert p.helper_experts(1) == [0, 1, 3] and p.free_slots() == []
    assert p.helper_share == 5 / 8
    digest = p.digest()
    assert Placement.build(counts, capacity=3).digest() == digest  # both sides compute the same map
    q = p.copy()
    q.tables[1][0] = HELPER if q.tables[1][0] != HELPER else 2
    assert q.digest() != digest
    q.tables[1][0] = 0  # slot 0 twice
    with pytest.raises(ValueError, match="slot 0 holds both"):
        q.check()
    with pytest.raises(ValueError, match="capacity 9"):
        Placement.build(counts, capacity=9)
    with pytest.raises(ValueError, match="fraction"):
        capacity_for(preset("tiny-moe"), 1.5)


# ---- bit-exact output for any placement -----------------------------------------------------
@pytest.mark.parametrize("name", MOE_PRESETS)
@pytest.mark.parametrize("kind", ["emulate", "cpu"])
def test_any_placement_gives_the_all_on_main_output_bit_for_bit(name, kind):
    cfg = preset(name)
    w = init_weights(cfg, seed=1)
    prompts = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    want, _ = _decode(cfg, w, prompts, 6)
    for fraction in (0.0, 0.25, 0.5, 0.9, 1.0):
        opts = HelperOptions(kind=kind, fraction=fraction, migrate=fraction in (0.25, 0.5))
        got, engine = _decode(cfg, w, prompts, 6, opts)
        assert torch.equal(got, want), (kind, fraction)
        steps, layers = engine.backend.helper_steps, len(moe_layers(cfg)) - cfg.num_nextn_predict_layers
        # every MoE layer of every step either called the helper or skipped it
        assert all(s["calls"] + s["skipped"] == layers for s in steps)
        if fraction == 0.0:
            assert sum(s["calls"] for s in steps) == 0 and sum(s["rows"] for s in steps) == 0
        if fraction == 1.0:
            assert all(s["skipped"] == 0 for s in steps)
            assert sum(s["rows"] for s in steps) == (5 + 5) * 2 * cfg.num_experts_per_tok * layers
        engine.backend.helper.close()


def test_speculative_decoding_with_a_helper_equals_plain_greedy():
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=2)
    prompts = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    plain, _ = SpeculativeDecoder(cfg, w, 0, 2, 32).generate(prompts, 8)
    for k in (1, 3):
        helper = HelperOptions(kind="cpu", fraction=0.5, migrate=True)
        dec = SpeculativeDecoder(cfg, w, k, 2, 40, helper=helper)
        out, _ = dec.generate(prompts, 8, Drafts("mtp"))
        assert out == plain
        assert sum(s["calls"] for s in dec.engine.helper_steps) > 0
        dec.engine.helper.close()


def test_rows_sent_to_the_helper_are_the_rows_routed_to_helper_experts():
    cfg = preset("tiny-mhc")
    w = init_weights(cfg, seed=3)
    opts = HelperOptions(kind="emulate", fraction=0.5, migrate=True, window=1)
    prompts = torch.randint(0, cfg.vocab_size, (4, 1), generator=torch.Generator().manual_seed(3))  # a decode step
    engine = make_engine(cfg, w, "interpret", 4, 16, "cpu", torch.float32, workers=4, helper=opts)
    helper = engine.backend.helper
    placement = helper.placement.copy()  # the map this step runs with (migration may flip it after)
    engine._step(prompts)
    counts = helper.link.stats.counts()  # window 1: exactly this step's routing, from the slot tables
    on_helper = sum(c[e] for layer, c in counts.items() for e in placement.helper_experts(layer))
    assert engine.backend.helper_steps[0]["rows"] == on_helper
    total = sum(c.sum() for c in counts.values())
    assert total == 4 * cfg.num_experts_per_tok * (cfg.num_hidden_layers - cfg.first_k_dense_replace)


# ---- a helper that stops answering ----------------------------------------------------------
def _stalled_runner(cfg, w, fallback):
    opts = HelperOptions(kind="cpu", fraction=1.0, timeout_s=0.2, fallback=fallback)
    helper = Helper(cfg, w, opts, "cpu", torch.float32)
    runner = Interpreter(compile_step(cfg, StepShape(T=1, B=1, max_len=16, helper_slots=helper.capacity),
                                      CompileOptions(workers=4)), w)
    helper.attach(runner)
    return helper, runner


def test_a_silent_helper_is_a_bounded_error_and_the_next_step_runs():
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=4)
    plain = Interpreter(compile_step(cfg, StepShape(T=1, B=1, max_len=16), CompileOptions(workers=4)), w)
    helper, runner = _stalled_runner(cfg, w, fallback=False)
    tok, lens = torch.tensor([[7]]), torch.tensor([3])
    helper.backend.stall_s = 0.5
    t0 = time.perf_counter()
    with pytest.raises(HelperTimeout, match="unanswered after 0.200 s"):
        runner.step(tok, lens)
    assert time.perf_counter() - t0 < 1.0  # the bound, not the stall, ends the wait
    helper.backend.stall_s = 0.0
    helper.link.timeout_s = 5.0  # the late answer to the stalled call still sits ahead in the queue
    got = runner.step(tok, lens)
    assert torch.equal(got.logits, plain.step(tok, lens).logits)
    helper.close()


def test_a_silent_helper_with_fallback_still_gives_the_right_tokens():
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=4)
    plain = Interpreter(compile_step(cfg, StepShape(T=1, B=1, max_len=16), CompileOptions(workers=4)), w)
    helper, runner = _stalled_runner(cfg, w, fallback=True)
    helper.backend.stall_s = 0.3
    tok, lens = torch.tensor([[9]]), torch.tensor([2])
    got = runner.step(tok, lens)
    assert torch.equal(got.logits, plain.step(tok, lens).logits)
    assert helper.end_step()["fallbacks"] == 2  # both MoE layers timed out and were recomputed
    helper.close()


# ---- migration --------------------------------------------------------------------------------
def _simulate(router, placement, policy, stats, steps, tokens=4):
    """Route `steps` steps; moves land at once.  Returns (helper row share per step, moves per step)."""
    share, moved = [], []
    for _ in range(steps):
        ids = router.route(tokens)
        rows = sum(len(v.reshape(-1)) for v in ids.values())
        remote = sum(int(placement.on_helper(layer, int(e))) for layer, v in ids.items() for e in v.reshape(-1))
        share.append(remote / rows)
        stats.observe(ids)
        moves = policy.plan(placement, stats.counts(), steps=stats.filled)
        placement = apply_moves(placement, moves)
        moved.append(len(moves))
    return share, moved, placement


@pytest.mark.parametrize("policy", [MigrationPolicy(max_moves=2), CallAwarePolicy(max_moves=2)], ids=["rows", "calls"])
def test_migration_brings_a_shifting_hot_set_to_main_and_then_holds_still(policy):
    layers, E, k = [1, 2], 32, 4
    router = SkewedRouter(layers, E, k, a=1.5, shift_every=60, seed=0)
    placement = Placement.with_fraction(layers, E, 0.75)  # 16 main slots for 64 experts
    stats = RoutingStats(layers, E, window=16)
    share, moved, placement = _simulate(router, placement, policy, stats, 60)
    hot = {(layer, e) for layer in layers for e in router.hot_set(layer, 4)}
    assert all(not placement.on_helper(layer, e) for layer, e in hot)  # the 4 hottest of each layer
    assert np.mean(share[-20:]) < np.mean(share[:5]) - 0.2  # the share of helper rows falls
    assert sum(moved[-15:]) <= 2  # stable routing: hysteresis stops the churn
    # the hot set moves; within a bounded number of steps the new one is on main
    share2, _, placement = _simulate(router, placement, policy, stats, 40)
    hot = {(layer, e) for layer in layers for e in router.hot_set(layer, 4)}
    assert all(not placement.on_helper(layer, e) for layer, e in hot)
    assert np.mean(share2[-10:]) < np.mean(share2[:3])


@pytest.mark.parametrize("overlap", [True, False])
def test_migration_in_the_engine_moves_experts_and_keeps_the_output_bit_exact(overlap):
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=5)
    prompts = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(5))
    want, _ = _decode(cfg, w, prompts, 14)
    opts = HelperOptions(kind="cpu", fraction=0.5, migrate=True, window=4, overlap=overlap,
                         policy=MigrationPolicy(margin=1.0, min_gain=1.0, max_moves=2))
    got, engine = _decode(cfg, w, prompts, 14, opts)
    helper = engine.backend.helper
    assert torch.equal(got, want)
    assert helper.moves > 0 and helper.copier.bytes_moved > 0
    for slot, (layer, e) in helper.placement.main_experts().items():  # each slot holds its expert's weights
        assert torch.equal(helper.copier.arena[slot], helper.store[helper.row(layer, e)])
    helper.close()


def _migrating_engine(steps: int):
    """tiny-moe with half its experts on a cpu helper, an eager migration policy and the default (overlapped)
    migration; its prompts and the all-on-main engine's logits over `steps` tokens."""
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=5)
    prompts = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(5))
    want, _ = _decode(cfg, w, prompts, steps)
    opts = HelperOptions(kind="cpu", fraction=0.5, migrate=True, window=4,
                         policy=MigrationPolicy(margin=1.0, min_gain=1.0, max_moves=2))
    engine = make_engine(cfg, w, "interpret", 2, prompts.shape[1] + steps, "cpu", torch.float32, workers=4,
                         helper=opts)
    return engine, prompts, want


def test_overlapped_migration_decides_after_a_launch_and_commits_at_the_next_boundary():
    """opts.overlap (the default): a migration is decided right after a step's launch, its maps are
    written behind that step (the device routes by them from the step after it) and the host's
    placement switches at the next boundary.  So at every boundary the device maps equal the host's
    placement, a decision is pending only between a launch and the boundary after it, and the output
    stays the all-on-main engine's, bit for bit."""
    from helper_card.link import _expert_maps
    engine, prompts, want = _migrating_engine(14)
    helper = engine.backend.helper
    assert not helper.runners and helper.overlap is None  # runners attach (and decide it) at their first step

    def device_maps(runner) -> dict[int, np.ndarray]:
        maps = _expert_maps[runner.mem]
        words = runner.mem.bufs[Buf.I][maps.index].numpy()
        sizes = np.cumsum([0] + [len(helper.placement.tables[layer]) for layer in maps.layers])
        return {layer: words[a:b] for layer, a, b in zip(maps.layers, sizes[:-1], sizes[1:])}

    seen = {"decided": 0, "switched_late": 0}

    def after_helper():  # runs after the helper's own after-launch hook
        if helper.pending is not None:
            seen["decided"] += 1
            runner = helper.runners[-1]
            assert all((device_maps(runner)[layer] == t).all() for layer, t in helper.pending.tables.items()
                       if layer in device_maps(runner))
            if any((helper.link.placement.tables[layer] != t).any() for layer, t in helper.pending.tables.items()):
                seen["switched_late"] += 1  # the host still routes this step's calls by the old placement

    decide = helper._after_launch  # every runner attached from now on calls it, then the check

    def decide_then_check():
        decide()
        after_helper()
    helper._after_launch = decide_then_check
    logits = [engine.prefill(prompts)]
    tok = logits[0].argmax(-1, keepdim=True)
    for _ in range(13):
        logits.append(engine._step(tok)[:, -1])
        tok = logits[-1].argmax(-1, keepdim=True)
        assert helper.pending is None  # committed at the boundary
        for r in helper.runners:
            for layer, words in device_maps(r).items():
                assert (words == helper.placement.tables[layer]).all()
    assert helper.overlap and seen["decided"] > 0 and seen["switched_late"] > 0, seen
    assert torch.equal(torch.stack(logits), want)
    assert helper.moves > 0
    for slot, (layer, e) in helper.placement.main_experts().items():
        assert torch.equal(helper.copier.arena[slot], helper.store[helper.row(layer, e)])
    helper.close()


def test_a_decision_pending_when_its_step_fails_switches_before_the_next_launch():
    """A step that fails after its launch never reaches its boundary, but the maps of the decision made
    after that launch were written: the next launch switches the host to that placement first, so the
    helper's calls and the device's maps agree and the output stays the all-on-main engine's."""
    engine, prompts, want = _migrating_engine(14)
    helper = engine.backend.helper
    decide, failed = helper._after_launch, []

    class StepFailed(Exception):
        pass

    def decide_then_fail_once():
        decide()
        if helper.pending is not None and not failed:
            failed.append(helper.pending)
            raise StepFailed("a step that fails after its launch")
    helper._after_launch = decide_then_fail_once
    logits = [engine.prefill(prompts)]
    tok = logits[0].argmax(-1, keepdim=True)
    for _ in range(14):
        if len(logits) == 14:
            break
        try:
            out = engine._step(tok)[:, -1]
        except StepFailed:
            assert helper.pending is failed[0] and helper.placement is not failed[0]
            continue  # the engine did not advance: the next step redoes this one
        logits.append(out)
        tok = out.argmax(-1, keepdim=True)
    assert failed and helper.pending is None and helper.moves > 0
    assert torch.equal(torch.stack(logits), want)
    helper.close()


# ---- the CLI -----------------------------------------------------------------------------------
def test_cli_reports_the_helper_and_refuses_what_is_not_built(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--steps", "4", "--helper", "cpu", "--helper-fraction", "0.25", "--migrate", "on",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())["helper"]
    assert report["kind"] == "cpu" and report["steps"] > 0 and report["main_slots"] == capacity_for(
        preset("tiny-moe"), 0.25)
    assert {"rows", "calls", "skipped", "exposed_wait_ms", "moves"} <= set(report["per_step"][0])
    if torch.cuda.device_count() < 2:
        assert main(["--steps", "2", "--helper", "cuda:1"]) == 2
        assert "CUDA device(s)" in capsys.readouterr().err
    assert main(["--steps", "2", "--helper", "emulate", "--backend", "reference"]) == 2
    capsys.readouterr()
    assert main(["--steps", "2", "--helper", "cpu", "--helper-persistent", "--backend", "interpret"]) == 2
    assert ("persistent helper kernel (--helper-persistent) answers the megakernel's mailboxes"
            in capsys.readouterr().err)


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-mhc"])
def test_migration_follows_a_skewed_router_inside_the_model(name):
    """A Zipf routing bias whose hot set moves: the hot experts reach main slots within a bounded
    number of steps after each shift, the helper's share of rows falls, and the output stays the
    all-on-main engine's.  tiny-moe routes by sigmoid with its own correction bias; tiny-mhc by
    softmax, given one (with_routing_bias)."""
    from helper_card.migration import BiasSkew, with_routing_bias
    cfg = with_routing_bias(preset(name).replace(n_routed_experts=16))
    w = init_weights(cfg, seed=7)
    layers = [layer for layer in moe_layers(cfg) if layer < cfg.num_hidden_layers]
    shift, steps, B = 40, 80, 2
    opts = HelperOptions(kind="emulate", fraction=0.75, migrate=True, window=8)
    engines = [make_engine(cfg, w, "interpret", B, 4 + steps, "cpu", torch.float32, workers=4, helper=h)
               for h in (None, opts)]
    skews = [BiasSkew(cfg, layers, a=1.2, scale=1.0, shift_every=shift, seed=3) for _ in engines]
    runners = [e.backend.runner(1) for e in engines]
    for s, r in zip(skews, runners):
        s.apply(r)
    prompts = torch.randint(0, cfg.vocab_size, (B, 1), generator=torch.Generator().manual_seed(7))
    tok, settled = prompts, {}
    helper = engines[1].backend.helper
    for n in range(steps):
        a, b = (e._step(tok)[:, -1] for e in engines)
        assert torch.equal(a, b), n
        tok = a.argmax(-1, keepdim=True)
        for s, r in zip(skews, runners):
            s.step(r)
        hot = {(layer, e) for layer in layers for e in skews[1].hot_set(layer, 2)}
        if all(not helper.placement.on_helper(layer, e) for layer, e in hot):
            settled.setdefault(n // shift, n % shift)
    assert set(settled) == {0, 1} and max(settled.values()) <= 20, settled  # within 20 steps of each shift
    share = [s["rows"] / (B * cfg.num_experts_per_tok * len(layers)) for s in engines[1].backend.helper_steps]
    for start in (0, shift):
        assert np.mean(share[start + 25: start + shift]) < np.mean(share[start: start + 3]) - 0.2, share
    helper.close()


def test_fallback_never_shares_buffers_with_a_late_helper():
    """Every call times out while the helper keeps computing the late ones: the fallback must not
    read or write the helper's buffers (it did, and returned the other call's rows)."""
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=4)
    plain = Interpreter(compile_step(cfg, StepShape(T=1, B=1, max_len=24), CompileOptions(workers=4)), w)
    opts = HelperOptions(kind="cpu", fraction=1.0, timeout_s=0.02, fallback=True)
    helper = Helper(cfg, w, opts, "cpu", torch.float32)
    runner = Interpreter(compile_step(cfg, StepShape(T=1, B=1, max_len=24, helper_slots=helper.capacity),
                                      CompileOptions(workers=4)), w)
    helper.attach(runner)
    runner.mem.helper.program.task_delay_s = 0.01  # every call times out while the helper is mid-computation
    tok = torch.tensor([[5]])
    for n in range(8):
        lens = torch.tensor([n])
        got, want = runner.step(tok, lens), plain.step(tok, lens)
        assert torch.equal(got.logits, want.logits), n
        tok = want.tokens
    assert helper.end_step()["fallbacks"] == 16
    helper.close()


@pytest.mark.parametrize("policy", [MigrationPolicy(max_moves=1), CallAwarePolicy(max_moves=1)], ids=["rows", "calls"])
def test_an_expert_being_copied_is_not_planned_again(policy):
    placement = Placement(2, {1: np.array([0, 1, HELPER, HELPER], dtype=np.int32)})
    counts = {1: np.array([1.0, 1.0, 50.0, 0.0])}
    first = policy.plan(placement, counts, steps=50)
    assert [(m.expert, m.evict) for m in first] == [(2, (1, 0))]
    assert policy.plan(placement, counts, busy={first[0].slot}, moving={(1, 2)}, steps=50) == []


def test_the_call_aware_policy_empties_a_layer_of_helper_rows_first():
    """One free slot: the rows policy takes the hottest expert (layer 2, which keeps two more hot helper
    experts, so it is called anyway); the call-aware one takes layer 1's only routed helper expert, which
    ends that layer's calls."""
    placement = Placement(3, {1: np.array([0, 1, HELPER, HELPER], dtype=np.int32),
                              2: np.array([HELPER, HELPER, HELPER, HELPER], dtype=np.int32)})
    counts = {1: np.array([10.0, 10.0, 8.0, 0.0]), 2: np.array([10.0, 10.0, 10.0, 0.0])}
    assert [(m.layer, m.expert) for m in MigrationPolicy(max_moves=1).plan(placement, counts, steps=10)] == [(2, 0)]
    assert [(m.layer, m.expert) for m in CallAwarePolicy(max_moves=1).plan(placement, counts, steps=10)] == [(1, 2)]


def test_the_call_aware_policy_evicts_where_the_helper_already_holds_most():
    """No free slot; two unrouted incumbents: the one in the layer that keeps the most experts on the
    helper goes, so the helper's experts stay in few layers (a later shift of the hot set calls fewer)."""
    placement = Placement(4, {1: np.array([0, 1, 2, HELPER], dtype=np.int32),
                              2: np.array([3, HELPER, HELPER, HELPER], dtype=np.int32)})
    counts = {1: np.array([5.0, 5.0, 0.0, 0.0]), 2: np.array([0.0, 9.0, 0.0, 0.0])}
    moves = CallAwarePolicy(max_moves=1).plan(placement, counts, steps=10)
    assert [(m.layer, m.expert, m.slot, m.evict) for m in moves] == [(2, 1, 3, (2, 0))]
    # the rows policy evicts the coldest, ties to the lower slot: layer 1's, which starts calling layer 1
    moves = MigrationPolicy(max_moves=1).plan(placement, counts, steps=10)
    assert [(m.layer, m.expert, m.slot, m.evict) for m in moves] == [(2, 1, 2, (1, 2))]


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from([MigrationPolicy, CallAwarePolicy]))
def test_the_migration_plan_keeps_its_rules_on_any_placement(data, kind):
    """Whatever the placement, counts, busy slots and copies in flight: at most max_moves moves, each of
    a helper expert with rows and no copy in flight, into a slot no copy is filling; free slots first
    (lowest first), then in place of an incumbent only past the hysteresis; the hottest candidates
    first (the rows policy); and the result is a valid placement."""
    layers = data.draw(st.lists(st.integers(0, 30), min_size=1, max_size=4, unique=True), "layers")
    E = data.draw(st.integers(1, 6), "experts")
    pairs = [(layer, e) for layer in layers for e in range(E)]
    capacity = data.draw(st.integers(0, len(pairs) + 2), "capacity")
    on_main = data.draw(st.permutations(pairs), "order")[: data.draw(st.integers(0, min(capacity, len(pairs))))]
    slots = data.draw(st.permutations(range(capacity)), "slots")
    placement = Placement(capacity, {layer: np.full(E, HELPER, dtype=np.int32) for layer in layers})
    for (layer, e), slot in zip(on_main, slots):
        placement.tables[layer][e] = slot
    counts = {layer: np.array(data.draw(st.lists(st.integers(0, 6), min_size=E, max_size=E)), dtype=float) / 2
              for layer in layers}
    busy = set(data.draw(st.lists(st.integers(0, capacity - 1), max_size=3))) if capacity else set()
    moving = set(data.draw(st.lists(st.sampled_from(pairs), max_size=2), "moving"))
    policy = kind(margin=1.5, min_gain=1.0, max_moves=data.draw(st.integers(0, 3), "max_moves"))
    moves = policy.plan(placement, counts, busy=busy, moving=moving, steps=data.draw(st.integers(1, 4), "steps"))
    free = [s for s in placement.free_slots() if s not in busy]
    eligible = {(layer, e) for layer, e in pairs if placement.on_helper(layer, e) and counts[layer][e] > 0
                and (layer, e) not in moving}
    assert len(moves) <= policy.max_moves
    assert len({(m.layer, m.expert) for m in moves}) == len({m.slot for m in moves}) == len(moves)
    for i, m in enumerate(moves):
        assert (m.layer, m.expert) in eligible and m.slot not in busy
        heat = counts[m.layer][m.expert]
        if kind is MigrationPolicy:
            assert all(heat >= counts[layer][e] for layer, e in eligible - {(n.layer, n.expert) for n in moves})
        if i < len(free):
            assert m.evict is None and m.slot == free[i]
        else:
            cl, ce = m.evict
            assert placement.tables[cl][ce] == m.slot and heat >= policy.margin * counts[cl][ce] + policy.min_gain
    apply_moves(placement, moves)  # raises unless every slot holds at most one expert


def test_offload_moves_only_the_routed_experts():
    from helper_card.setup import is_routed_expert
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=0)
    routed = set(filter(is_routed_expert(cfg), w))
    E, layers = cfg.n_routed_experts, len(moe_layers(cfg))
    assert len(routed) == 3 * E * layers  # gate, up, down of every routed expert, MTP layers included
    assert not any("shared_experts" in k or ".gate." in k for k in routed)


def test_loader_keeps_host_tensors_in_host_memory(tmp_path):
    """With a cpu helper the loader never puts routed experts on the device (peak memory): the
    predicate reaches both the seeded init and the checkpoint reader, values unchanged."""
    from helper_card.setup import is_routed_expert
    from model import load_checkpoint, save_checkpoint
    cfg = preset("tiny-moe")
    routed = is_routed_expert(cfg)
    seen = []
    w = init_weights(cfg, seed=0, host=lambda name: seen.append(name) or routed(name))
    assert set(seen) == set(w) and torch.equal(w["model.layers.1.mlp.experts.0.up_proj.weight"],
                                               init_weights(cfg, seed=0)["model.layers.1.mlp.experts.0.up_proj.weight"])
    save_checkpoint(cfg, w, tmp_path)
    asked = []
    _, loaded = load_checkpoint(tmp_path, host=lambda name: asked.append(name) or routed(name))
    assert sorted(asked) == sorted(w) and all(torch.equal(loaded[k], w[k]) for k in w)


def test_routing_bias_for_softmax_routing_only_where_it_keeps_the_rule():
    from helper_card.migration import BiasSkew, with_routing_bias
    v2 = preset("tiny-mhc")
    assert v2.scoring_func == "softmax" and v2.topk_method == "greedy"
    biased = with_routing_bias(v2)
    assert (biased.topk_method, biased.n_group, biased.scoring_func) == ("noaux_tc", 1, "softmax")
    assert with_routing_bias(preset("tiny-moe")) == preset("tiny-moe")
    with pytest.raises(ValueError, match="group_limited_greedy"):
        with_routing_bias(v2.replace(topk_method="group_limited_greedy", n_group=2, topk_group=1))
    with pytest.raises(ValueError, match="with_routing_bias"):
        BiasSkew(v2, [1])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cuda:0", "cuda:1"])
def test_gpu_helper_equals_all_on_main(kind):
    """The cuda:N backend (a worker thread driving GPU N, its own copy of the experts) against the
    all-on-main engine on GPU 0: the same kernels, so the same logits bit for bit, with migration
    running.  cuda:0 exercises the backend on a one-GPU machine."""
    if int(kind[5:]) >= torch.cuda.device_count():
        pytest.skip(f"{kind} needs {int(kind[5:]) + 1} GPUs")
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=6)
    prompts = torch.randint(0, cfg.vocab_size, (2, 3), generator=torch.Generator().manual_seed(6)).cuda()
    want, _ = _decode(cfg, w, prompts, 12, device="cuda")
    got, engine = _decode(cfg, w, prompts, 12, HelperOptions(kind=kind, fraction=0.5, migrate=True), device="cuda")
    assert engine.backend.helper.backend.name == kind
    assert torch.equal(got, want)
    assert sum(s["rows"] for s in engine.backend.helper_steps) > 0  # the helper did compute rows
    engine.backend.helper.close()
