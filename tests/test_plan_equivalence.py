"""Layer 2: the plan interpreter equals the reference in fp32, across configs, shapes, options and orders."""

import random

import torch
from hypothesis import given, note

from graph.compile import compile_step
from graph.strategies import deepseek_configs, plan_cases
from megakernel.interpreter import Interpreter
from model import Cache, Reference, init_weights

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


def test_non_finite_weights_are_refused_by_name():
    """The weight stream reads past a matrix into its neighbour, so a non-finite weight anywhere in
    the arena would reach another matrix's outputs: Memory refuses it, naming the tensor."""
    import pytest

    from graph.compile import CompileOptions
    from graph.lower import StepShape
    from model import preset
    cfg = preset("tiny-dense")
    plan = compile_step(cfg, StepShape(T=1, B=1, max_len=16), CompileOptions(workers=2))
    w = init_weights(cfg, seed=0)
    name = "model.layers.1.mlp.up_proj.weight"
    w[name] = w[name].clone()
    w[name][3, 5] = float("inf")
    with pytest.raises(ValueError, match=r"mlp\.up_proj.*non-finite"):
        Interpreter(plan, w)


FOLD = "combine_into_v_up"


def _folded_and_not(cfg, shape, options, lens, order="queue", seed=0):
    """(plan, step result) without and with fusion rule combine_into_v_up, from the same weights, cache, tokens,
    lengths and order of tasks."""
    import dataclasses
    import random

    out = []
    for rules in (tuple(r for r in options.fusion_rules if r != FOLD), options.fusion_rules + (FOLD,)):
        plan = compile_step(cfg, shape, dataclasses.replace(options, fuse=True, fusion_rules=rules))
        interp = Interpreter(plan, init_weights(cfg, seed=seed))
        gen = torch.Generator().manual_seed(seed)
        interp.cache().copy_(torch.randn(interp.cache().shape, generator=gen))
        tokens = torch.randint(0, cfg.vocab_size, (shape.B, shape.T), generator=gen)
        out.append((plan, interp.step(tokens, torch.tensor(lens), order=order, rng=random.Random(seed))))
    return out


def _same_bits(default, folded) -> None:
    for key in ("logits", "hidden", "tokens"):
        assert torch.equal(getattr(default, key), getattr(folded, key)), key
    for a, b in zip(default.mtp_logits + default.mtp_hidden, folded.mtp_logits + folded.mtp_hidden):
        assert torch.equal(a, b)


def _check_fold(plan) -> None:
    """No ATTN_COMBINE task is left (every layer is MLA), and each v_up task takes whole heads: all outputs."""
    tasks = [plan.task(i) for i in range(plan.num_tasks)]
    assert not any(t.op.name == "ATTN_COMBINE" for t in tasks)
    folded = [t for t in tasks if t.op.name == "HEAD_MATMUL" and t.has("COMBINE")]
    assert folded and all(t["o0"] == 0 and t["o1"] == t["out_dim"] for t in folded)


@given(plan_cases(configs=deepseek_configs()))
def test_v_up_combining_its_inputs_changes_no_bit(case):
    """Fusion rule combine_into_v_up (opt-in): each MLA layer's ATTN_COMBINE goes and v_up's tasks combine their
    heads' split partials themselves; the interpreter's logits, hidden states and MTP outputs are bit-identical
    to the plan's without it, across configs, T, B, split counts (odd ones too), workers and valid orders."""
    note(f"{case.cfg}\n{case.shape}\n{case.options}\nlens={case.cache_lens} order={case.order}")
    (_, default), (plan, folded) = _folded_and_not(case.cfg, case.shape, case.options, case.cache_lens, case.order,
                                                   case.seed)
    _check_fold(plan)
    _same_bits(default, folded)


def test_v_up_combining_its_inputs_at_dsv2_lite_widths():
    """The same at dsv2-lite's head widths (512-wide latent rows, 128-wide values): there the default plan splits
    the combine into 64-column tasks and v_up into 64-output ones, the fold takes whole heads.  Two heads,
    small experts and vocabulary; 7 splits of 8 positions over B=2 sequences of T=2 tokens."""
    from graph.compile import CompileOptions
    from graph.lower import StepShape
    from model import preset
    cfg = preset("dsv2-lite").replace(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                      hidden_size=256, intermediate_size=256, n_routed_experts=8,
                                      moe_intermediate_size=64, vocab_size=512, dtype="float32")
    (plain, default), (plan, folded) = _folded_and_not(cfg, StepShape(T=2, B=2, max_len=56, attn_split=8),
                                                       CompileOptions(workers=64), [30, 53])
    combines = [plain.task(i) for i in range(plain.num_tasks) if plain.task(i).op.name == "ATTN_COMBINE"]
    assert combines and all(t["c1"] - t["c0"] < t["dim"] for t in combines)
    assert all(t["o1"] - t["o0"] < t["out_dim"] for t in map(plain.task, range(plain.num_tasks))
               if t.op.name == "HEAD_MATMUL" and t.has("TRANS"))
    _check_fold(plan)
    _same_bits(default, folded)
