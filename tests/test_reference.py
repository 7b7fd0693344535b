"""The reference model's internal equivalences: formulations, caching, MoE, mHC."""

import pytest
import torch

from model import Cache, CacheOverflowError, Reference, TINY_PRESETS, init_weights, preset
from model.reference.mhc import hc_coefficients, hc_collapse, sinkhorn
from model.reference.moe import moe, route, router_logits
from model.reference.layers import swiglu_mlp

from .conftest import rel_err


def _ref(name, seed=0, **kw):
    cfg = preset(name)
    return cfg, Reference(cfg, init_weights(cfg, seed=seed), **kw)


def _zeros(b):
    return torch.zeros(b, dtype=torch.long)


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-mhc"])
def test_absorbed_mla_equals_naive(name):
    cfg = preset(name)
    w = init_weights(cfg, seed=3)
    absorbed, naive = Reference(cfg, w, absorbed_mla=True), Reference(cfg, w, absorbed_mla=False)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (2, 7), generator=gen)
    ca, cn = Cache.allocate(cfg, 2, 24), Cache.allocate(cfg, 2, 24)
    lens = _zeros(2)
    for tokens in (prompt, prompt[:, :3], prompt[:, :1]):
        a, n = absorbed.step(tokens, ca, lens), naive.step(tokens, cn, lens)
        assert rel_err(a.logits, n.logits) <= 1e-5
        lens = lens + tokens.shape[1]


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_cached_decode_equals_full_forward(name):
    """Sequences at different cache lengths, decoded T tokens at a time, equal one full forward each."""
    cfg, ref = _ref(name, seed=1)
    gen = torch.Generator().manual_seed(5)
    seqs = torch.randint(0, cfg.vocab_size, (2, 13), generator=gen)
    full = [ref.step(seqs[b:b + 1], Cache.allocate(cfg, 1, 16), _zeros(1)).logits[0] for b in range(2)]
    cache = Cache.allocate(cfg, 2, 16)
    # sequence 0 starts with 5 cached tokens, sequence 1 with 2; then both decode chunks of T tokens
    ref.step(seqs[0:1, :5], cache.sequences(slice(0, 1)), _zeros(1))
    ref.step(seqs[1:2, :2], cache.sequences(slice(1, 2)), _zeros(1))
    lens = torch.tensor([5, 2])
    for T in (1, 3, 2):
        idx = lens[:, None] + torch.arange(T)
        got = ref.step(torch.gather(seqs, 1, idx), cache, lens).logits
        for b in range(2):
            assert rel_err(got[b], full[b][idx[b]]) <= 1e-5
        lens = lens + T


def test_writing_past_the_cache_is_an_error():
    cfg, ref = _ref("tiny-dense")
    cache = Cache.allocate(cfg, 2, 8)
    with pytest.raises(CacheOverflowError, match="sequence 1 would write cache position 9 but the cache holds 8"):
        ref.step(torch.zeros(2, 3, dtype=torch.long), cache, torch.tensor([2, 7]))


def test_moe_equals_per_token_loop():
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=2)
    p = "model.layers.1.mlp."
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, ids = route(cfg, router_logits(w, p, x), w[p + "gate.e_score_correction_bias"])
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(cfg.num_experts_per_tok):
            e = f"{p}experts.{int(ids[t, slot])}."
            y = swiglu_mlp(x[t:t + 1], w[e + "gate_proj.weight"], w[e + "up_proj.weight"], w[e + "down_proj.weight"])
            expected[t] += weights[t, slot] * y[0]
        s = p + "shared_experts."
        expected[t] += swiglu_mlp(x[t:t + 1], w[s + "gate_proj.weight"], w[s + "up_proj.weight"],
                                  w[s + "down_proj.weight"])[0]
    assert rel_err(moe(cfg, w, p, x), expected) <= 1e-6


def test_grouped_routing_respects_groups():
    cfg = preset("tiny-moe")  # 8 experts in 4 groups, 2 groups kept, top-2
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(8) * 0.05
    weights, ids = route(cfg, logits, bias)
    groups = ids // 2
    assert (groups.unique(dim=1).shape[1] <= 2)
    for t in range(64):
        assert len(set(groups[t].tolist())) <= cfg.topk_group
    # normalised then scaled: each token's weights sum to routed_scaling_factor
    assert torch.allclose(weights.sum(-1), torch.full((64,), cfg.routed_scaling_factor), atol=1e-5)


def test_sinkhorn_is_doubly_stochastic_on_the_models_coefficients(monkeypatch):
    """Every H_res the model computes (all layers, 512 random tokens) is doubly stochastic to 1e-5.

    20 iterations converge for matrices like these; sharp ones converge more slowly
    (softmax of N(0,1) logits: worst row error 1.3e-3 over 10k draws), see docs/NOTES.md.
    """
    import model.reference.model as reference_model
    cfg = preset("tiny-mhc")
    combs = []

    def spy(*args):
        pre, post, comb = hc_coefficients(*args)
        combs.append(comb)
        return pre, post, comb

    monkeypatch.setattr(reference_model, "hc_coefficients", spy)
    ref = Reference(cfg, init_weights(cfg, seed=11))
    tokens = torch.randint(0, cfg.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
    ref.step(tokens, Cache.allocate(cfg, 8, 64), _zeros(8))
    assert len(combs) == 2 * cfg.num_hidden_layers
    for d in combs:
        assert (d > 0).all()
        assert (d.sum(-1) - 1).abs().max() <= 1e-5 and (d.sum(-2) - 1).abs().max() <= 1e-5
    # and for any mildly peaked positive matrix
    m = torch.softmax(torch.randn(1000, 4, 4, generator=torch.Generator().manual_seed(0)) * 0.5, -1)
    d = sinkhorn(m + cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    assert (d.sum(-1) - 1).abs().max() <= 1e-5 and (d.sum(-2) - 1).abs().max() <= 1e-5


def test_mhc_matches_hf_deepseek_v4_hyper_connection():
    """The outside check for mHC: HF's DeepseekV4HyperConnection with our weights."""
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers import DeepseekV4Config
    cfg = preset("tiny-mhc")
    w = init_weights(cfg, seed=4)
    p = "model.layers.0.attn_hc."
    hf_cfg = DeepseekV4Config(hidden_size=cfg.hidden_size, hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
                              hc_eps=cfg.hc_eps, rms_norm_eps=cfg.rms_norm_eps)
    module = v4.DeepseekV4HyperConnection(hf_cfg)
    with torch.no_grad():
        module.fn.copy_(w[p + "fn"]), module.base.copy_(w[p + "base"]), module.scale.copy_(w[p + "scale"])
        streams = torch.randn(2, 3, cfg.hc_mult, cfg.hidden_size)
        post, comb, collapsed = module(streams)
    pre, my_post, my_comb = hc_coefficients(cfg, w, p, streams.view(6, cfg.hc_mult, cfg.hidden_size))
    assert rel_err(my_post, post.view(6, -1)) <= 1e-6
    assert rel_err(my_comb, comb.view(6, cfg.hc_mult, cfg.hc_mult)) <= 1e-6
    assert rel_err(hc_collapse(streams.view(6, cfg.hc_mult, -1), pre), collapsed.view(6, -1)) <= 1e-6


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_mtp_chunked_equals_single_tokens_and_leaves_main_cache(name):
    cfg, ref = _ref(name, seed=6)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 4, cfg.hidden_size, generator=gen)
    nxt = torch.randint(0, cfg.vocab_size, (2, 4), generator=gen)
    c1, c2 = Cache.allocate(cfg, 2, 8), Cache.allocate(cfg, 2, 8)
    whole = ref.mtp(0, hidden, nxt, c1, _zeros(2))
    for t in range(4):
        one = ref.mtp(0, hidden[:, t:t + 1], nxt[:, t:t + 1], c2, torch.full((2,), t))
        assert rel_err(one.logits[:, 0], whole.logits[:, t]) <= 1e-5
    assert c1.data[: cfg.num_hidden_layers].abs().sum() == 0  # only the MTP layer's cache is written
    assert c1.data[cfg.num_hidden_layers].abs().sum() > 0
    assert whole.logits.shape == (2, 4, cfg.vocab_size) and whole.hidden.shape == (2, 4, cfg.hidden_size)


def test_generate_equals_argmax_of_full_forward():
    cfg, ref = _ref("tiny-moe", seed=8)
    prompt = torch.randint(0, cfg.vocab_size, (2, 4), generator=torch.Generator().manual_seed(3))
    new = ref.generate(prompt, 6)
    seq = prompt
    for i in range(6):
        logits = ref.step(seq, Cache.allocate(cfg, 2, 16), _zeros(2)).logits
        assert torch.equal(logits[:, -1].argmax(-1), new[:, i])
        seq = torch.cat((seq, new[:, i:i + 1]), dim=1)


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_bf16_reference_tracks_fp32(name):
    cfg = preset(name)
    w = init_weights(cfg, seed=0)
    f32 = Reference(cfg, w)
    b16 = Reference(cfg, {k: (v if v.dtype == torch.float32 and "hc" in k or "bias" in k else v.bfloat16())
                          for k, v in w.items()})
    tokens = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    a = f32.step(tokens, Cache.allocate(cfg, 1, 8, torch.float32), _zeros(1)).logits
    b = b16.step(tokens, Cache.allocate(cfg, 1, 8, torch.bfloat16), _zeros(1)).logits
    assert torch.isfinite(b).all() and rel_err(b, a) <= 5e-2


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_static_step_equals_reference(name):
    """The capture-friendly step the benchmarks time computes what the reference computes."""
    from model.reference.static import StaticStep
    cfg = preset(name)
    w = init_weights(cfg, seed=9)
    ref, static = Reference(cfg, w), StaticStep(cfg, w, batch=2, T=3, max_len=16)
    cache = Cache.allocate(cfg, 2, 16)
    noise = torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(0))
    cache.data.copy_(noise)
    static.cache.data.copy_(noise)
    lens = torch.tensor([0, 6])
    for _ in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (2, 3))
        assert rel_err(static(tokens, lens), ref.step(tokens, cache, lens).logits) <= 1e-5
        lens = lens + 3
    assert rel_err(static.cache.data, cache.data) <= 1e-5
