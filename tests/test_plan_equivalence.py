"""Layer 2: the plan interpreter equals the reference in fp32, across configs, shapes, options and orders."""

import random

import torch
from hypothesis import given, note

from graph.compile import compile_step
from graph.strategies import plan_cases
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
