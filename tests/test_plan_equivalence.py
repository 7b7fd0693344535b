"""Layer 2: the plan interpreter equals the reference in fp32, across configs, shapes, options and orders."""

import random

import pytest
import torch
from hypothesis import given, note

from graph.compile import CompileOptions, compile_step
from graph.fusion import DEFAULT_RULES
from graph.isa import decode
from graph.lower import StepShape
from graph.strategies import PlanCase, plan_cases
from megakernel.interpreter import Interpreter
from model import Cache, Reference, init_weights, preset

from .conftest import rel_err

TOL = 1e-5


def run_case(case):
    cfg = case.cfg
    weights = init_weights(cfg, seed=case.seed)
    plan = compile_step(cfg, case.shape, case.options)
    interp = Interpreter(plan, weights)
    ref = Reference(cfg, weights)
    gen = torch.Generator().manual_seed(case.seed)
    T, B, S = case.shape.T, case.shape.B, case.shape.max_len
    cache = Cache.allocate(cfg, B, S)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))  # earlier steps' entries (and stale ones)
    interp.cache().copy_(cache.data)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    lens = torch.tensor(case.cache_lens)
    got = interp.step(tokens, lens, order=case.order, rng=random.Random(case.seed))
    want = ref.step(tokens, cache, lens)
    return cfg, plan, interp, ref, cache, tokens, lens, got, want


@given(plan_cases())
def test_interpreter_equals_reference(case):
    note(f"{case.cfg}\n{case.shape}\n{case.options}\nlens={case.cache_lens} order={case.order}")
    check_case(case)


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-mhc"])
def test_expert_mlp_equals_reference(name, monkeypatch):
    """Fusion rule expert_mlp (opt-in) with several slices of every MLP it fuses: the routed experts' 32 rows in
    16-row slices, the shared ones' 32 (tiny-moe) and 64 (tiny-mhc, two shared experts) in slices of 24 and the
    rest; six tokens in two sequences, an MTP pass, tasks run in a random order.  Hypothesis draws the rule too,
    but rarely with more than one routed slice."""
    import graph.fusion_weights
    monkeypatch.setattr(graph.fusion_weights, "EXPERT_SLICE_ROWS", 16)
    case = PlanCase(preset(name), StepShape(T=3, B=2, max_len=16, mtp_passes=1),
                    CompileOptions(workers=8, fusion_rules=DEFAULT_RULES + ("expert_mlp",)), cache_lens=[4, 9],
                    order="random", seed=5)
    plan = check_case(case)
    ops = {(decode(w).op.name, decode(w)["slice"]) for w in plan.words
           if decode(w).op.name in ("LINEAR", "EXPERT_LINEAR") and decode(w).has("DOWN_T")}
    shared_slices = -(-32 * case.cfg.n_shared_experts // 24)
    assert ops == {("EXPERT_LINEAR", 0), ("EXPERT_LINEAR", 1)} | {("LINEAR", s) for s in range(shared_slices)}


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_dense_mlp_equals_reference(name):
    """Fusion rule dense_mlp (opt-in): every dense MLP (tiny-dense's layers and MTP layer, tiny-moe's first layer)
    as LINEAR[SILU_MUL, DOWN_T] over slices of 8 rows and a MOE_COMBINE with topk 0 that sums them and adds the
    residual; the MoE layers' shared experts are left to expert_mlp."""
    case = PlanCase(preset(name), StepShape(T=3, B=2, max_len=16, mtp_passes=1),
                    CompileOptions(workers=8, fusion_rules=DEFAULT_RULES + ("dense_mlp",)), cache_lens=[4, 9],
                    order="random", seed=6)
    plan = check_case(case)
    tasks = [decode(w) for w in plan.words]
    reduce = [t for t in tasks if t.op.name == "MOE_COMBINE" and t["topk"] == 0]
    assert reduce and all(t["nsh"] == -(-case.cfg.intermediate_size // 8) and t.has("RES") for t in reduce)
    assert not any(".mlp.down" in label for label in plan.task_labels)


def check_case(case):
    """The case's interpreted step equals the reference's (and its MTP passes, and the cache it wrote); its plan."""
    cfg, plan, interp, ref, cache, tokens, lens, got, want = run_case(case)
    assert rel_err(got.logits, want.logits) <= TOL
    assert rel_err(got.hidden, want.hidden) <= TOL
    assert torch.equal(got.tokens, want.logits.argmax(-1))
    hidden, nxt = want.hidden, want.logits.argmax(-1)
    for i in range(case.shape.mtp_passes):
        m = ref.mtp(i % cfg.num_nextn_predict_layers, hidden, nxt, cache, lens + i)
        assert rel_err(got.mtp_logits[i], m.logits) <= TOL
        assert rel_err(got.mtp_hidden[i], m.hidden) <= TOL
        assert torch.equal(got.mtp_tokens[i], m.logits.argmax(-1))
        hidden, nxt = m.hidden, m.logits.argmax(-1)
    # every cache entry the step wrote, and none it should not have
    assert rel_err(interp.cache(), cache.data) <= TOL
    return plan


def test_non_finite_weights_are_refused_by_name():
    """The weight stream reads past a matrix into its neighbour, so a non-finite weight anywhere in
    the arena would reach another matrix's outputs: Memory refuses it, naming the tensor."""
    cfg = preset("tiny-dense")
    plan = compile_step(cfg, StepShape(T=1, B=1, max_len=16), CompileOptions(workers=2))
    w = init_weights(cfg, seed=0)
    name = "model.layers.1.mlp.up_proj.weight"
    w[name] = w[name].clone()
    w[name][3, 5] = float("inf")
    with pytest.raises(ValueError, match=r"mlp\.up_proj.*non-finite"):
        Interpreter(plan, w)


def test_bad_step_inputs_are_refused_by_name():
    """A token id outside the vocabulary would make the kernel's EMBED gather another tensor's bytes, and a
    negative or missing cache length would put the step's writes outside its rows: refused before anything
    runs, naming what was wrong, and the cache untouched."""
    cfg = preset("tiny-dense")
    plan = compile_step(cfg, StepShape(T=2, B=2, max_len=16), CompileOptions(workers=2))
    interp = Interpreter(plan, init_weights(cfg, seed=0))
    interp.cache().copy_(torch.randn(interp.cache().shape))
    before = interp.cache().clone()
    ok = torch.tensor([[1, 2], [3, 4]])
    V = cfg.vocab_size
    for tokens, lens, says in ((ok.T.reshape(1, 4), torch.tensor([3, 5]), r"shape \(1, 4\).*\(2, 2\)"),
                               (torch.tensor([[1, V], [3, 4]]), torch.tensor([3, 5]), rf"ids 1..{V}.*0..{V - 1}"),
                               (torch.tensor([[1, 2], [-1, 4]]), torch.tensor([3, 5]), rf"ids -1..4.*0..{V - 1}"),
                               (ok, torch.tensor([3, -2]), r"negative length \(-2\)"),
                               (ok, torch.tensor([3]), r"cache_lens has shape \(1,\).*compiled for 2"),
                               (ok, torch.tensor([3, 15]), "exceeds the cache of 16 positions")):
        with pytest.raises(ValueError, match=says):
            interp.step(tokens, lens)
    assert torch.equal(interp.cache(), before)
    interp.step(ok, torch.tensor([3, 5]))  # and the same interpreter still runs a good step
