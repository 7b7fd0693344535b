"""Weights: random init scale, safetensors round trip with HF names, validation errors, mmap loading."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from model import (PRESETS, Cache, CheckpointError, ModelConfig, Reference, init_weights, load_checkpoint, preset,
                   save_checkpoint)
from model.schema import tensor_specs
from model.weights import init_tensor


def _probe(name: str, layers: int = 2) -> ModelConfig:
    """The preset at its real width, but few layers, at most 16 experts and a 4096-token vocabulary."""
    cfg = preset(name)
    changes = dict(num_hidden_layers=min(cfg.num_hidden_layers, layers), vocab_size=min(cfg.vocab_size, 4096),
                   dtype="float32", first_k_dense_replace=min(cfg.first_k_dense_replace, layers - 1))
    if cfg.n_routed_experts > 16:
        changes["n_routed_experts"] = 16
    return cfg.replace(**changes)


class _DrawnWhenRead(dict):
    """init_weights(cfg, seed) whose tensors are drawn when a step first reads them: each is
    init_tensor(spec, cfg, seed), the very values init_weights gives it (they depend only on the seed, the
    name and the config), so a step reads the same numbers; the tensors it never reads (the MTP layer,
    experts no token is routed to) are never drawn."""

    def __init__(self, cfg: ModelConfig, seed: int):
        super().__init__()
        self.cfg, self.seed = cfg, seed
        self.specs = {s.name: s for s in tensor_specs(cfg) if not s.optional}

    def __missing__(self, name):
        t = self[name] = init_tensor(self.specs[name], self.cfg, self.seed)
        return t

    def get(self, name, default=None):
        return self[name] if name in self or name in self.specs else default


def _reference(cfg: ModelConfig, seed: int, lazy: bool) -> Reference:
    if not lazy:
        return Reference(cfg, init_weights(cfg, seed=seed))
    w = _DrawnWhenRead(cfg, seed)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # what resolve_shared shares out
        w[name]  # drawn now
    ref = Reference(cfg, w)
    w.update(ref.w)  # the shared names resolve_shared adds
    ref.w = w
    return ref


def _check_activations(cfg: ModelConfig, seed: int = 0, tokens: int = 8, lazy: bool = False) -> Reference:
    """Finite, O(1) hidden states after every layer and logits spread in a sane band."""
    ref = _reference(cfg, seed, lazy)
    rms = []
    original = ref.decoder_layer

    def spy(layer, x, cache, pos):
        y = original(layer, x, cache, pos)
        rms.append(float(y.float().pow(2).mean().sqrt()))
        return y

    ref.decoder_layer = spy
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    logits = ref.step(ids, Cache.allocate(cfg, 1, tokens, torch.float32), torch.zeros(1, dtype=torch.long)).logits
    assert torch.isfinite(logits).all()
    assert all(0.05 <= r <= 20 for r in rms), rms
    assert 0.3 <= float(logits.std()) <= 10, float(logits.std())
    return ref


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "dsv3-slice"])
def test_init_keeps_activations_o1_at_real_width(name):
    _check_activations(_probe(name))


@pytest.mark.slow
def test_init_keeps_activations_o1_dsv3_width():
    """At DeepSeek-V3's width (2.6e9 parameters in the probe) only the tensors the step reads are drawn,
    each with init_weights' values (checked here on the small ones): the same statistics of the same
    numbers, without drawing the MTP layer (~1e9 parameters the step never reads) or unrouted experts."""
    cfg = _probe("dsv3-slice")
    drawn = _check_activations(cfg, tokens=2, lazy=True).w
    specs = {s.name: s for s in tensor_specs(cfg)}
    small = [n for n in drawn if n in specs and specs[n].numel <= 16 * cfg.hidden_size]
    # and an expert's down_proj: the out_proj scale, which depends on the layer count
    small += [next(n for n in drawn if n.endswith("down_proj.weight") and ".experts." in n)]
    assert len(small) > 10 and any(n.endswith("gate.weight") for n in small)
    full = init_weights(cfg, seed=0, names=small)
    assert all(torch.equal(drawn[n], full[n]) for n in small)


@pytest.mark.parametrize("base,layers", [("tiny-moe", 61), ("tiny-mhc", 40), ("tiny-dense", 32)])
def test_init_keeps_activations_o1_at_depth(base, layers):
    _check_activations(preset(base).replace(num_hidden_layers=layers))


def test_init_is_per_tensor_and_seeded():
    cfg = preset("tiny-moe")
    a, b = init_weights(cfg, seed=1), init_weights(cfg, seed=2)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    only = init_weights(cfg, seed=1, names=[name])
    assert list(only) == [name] and torch.equal(only[name], a[name])
    assert not torch.equal(a[name], b[name])


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense", "tiny-mhc"])
def test_save_load_round_trip_with_hf_names(tmp_path, name):
    cfg = preset(name)
    w = init_weights(cfg, seed=0)
    save_checkpoint(cfg, w, tmp_path)
    cfg2, w2 = load_checkpoint(tmp_path)
    assert cfg2 == cfg and w2.keys() == w.keys()
    assert all(torch.equal(w[k], w2[k]) for k in w)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [cfg.architecture]


def test_mtp_and_expert_keys_follow_deepseek_v3_names():
    names = {s.name for s in tensor_specs(preset("tiny-moe"))}
    for key in ("model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight", "model.layers.3.hnorm.weight",
                "model.layers.3.shared_head.norm.weight", "model.layers.3.shared_head.head.weight",
                "model.layers.3.embed_tokens.weight", "model.layers.1.mlp.experts.7.down_proj.weight",
                "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.shared_experts.up_proj.weight",
                "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"):
        assert key in names


# ---- one-line errors naming the problem -------------------------------------------------------
def _saved(tmp_path, name="tiny-dense"):
    cfg = preset(name)
    w = init_weights(cfg, seed=0)
    save_checkpoint(cfg, w, tmp_path)
    return cfg, w


def _resave(tmp_path, w):
    (tmp_path / "model.safetensors").unlink()
    save_file(w, str(tmp_path / "model.safetensors"))


def _one_line_error(tmp_path, pattern):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    message = str(info.value)
    assert "\n" not in message and re.search(pattern, message), message


def test_missing_tensor(tmp_path):
    cfg, w = _saved(tmp_path)
    del w["model.layers.1.mlp.up_proj.weight"]
    _resave(tmp_path, w)
    _one_line_error(tmp_path, r"missing tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight")


def test_unexpected_tensor(tmp_path):
    cfg, w = _saved(tmp_path)
    w["model.layers.9.foo.weight"] = torch.zeros(2)
    _resave(tmp_path, w)
    _one_line_error(tmp_path, r"unexpected tensor\(s\): model\.layers\.9\.foo\.weight")


def test_wrong_shape(tmp_path):
    cfg, w = _saved(tmp_path)
    w["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 64)
    _resave(tmp_path, w)
    _one_line_error(tmp_path, r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \(5, 64\), expected \(32, 64\)")


def test_wrong_dtype(tmp_path):
    cfg, w = _saved(tmp_path)
    w["model.norm.weight"] = w["model.norm.weight"].half()
    _resave(tmp_path, w)
    _one_line_error(tmp_path, r"model\.norm\.weight has dtype float16, expected float32")


def test_nan_weights(tmp_path):
    cfg, w = _saved(tmp_path)
    w["model.layers.1.self_attn.o_proj.weight"][3, 4] = float("nan")
    _resave(tmp_path, w)
    _one_line_error(tmp_path, r"model\.layers\.1\.self_attn\.o_proj\.weight contains NaN")


def test_truncated_file(tmp_path):
    _saved(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    _one_line_error(tmp_path, r"model\.safetensors: truncated safetensors file")


def test_truncated_header(tmp_path):
    _saved(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:20])
    _one_line_error(tmp_path, r"truncated safetensors file")


def test_save_refuses_mismatched_weights_and_writes_nothing(tmp_path):
    cfg = preset("tiny-dense")
    w = init_weights(cfg)
    del w["model.norm.weight"]
    with pytest.raises(CheckpointError, match="missing tensor"):
        save_checkpoint(cfg, w, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_loading_is_memory_mapped(tmp_path):
    """Loading ~200 MB of weights does not copy them into anonymous (heap) memory."""
    cfg = preset("tiny-dense").replace(vocab_size=200_000, hidden_size=256, num_attention_heads=4, head_dim=64)
    save_checkpoint(cfg, init_weights(cfg), tmp_path)

    def anon_kb():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1])

    before = anon_kb()
    _, w = load_checkpoint(tmp_path, check_finite=False)
    size_kb = sum(t.numel() * t.element_size() for t in w.values()) // 1024
    assert size_kb > 150_000
    assert anon_kb() - before < size_kb // 4
