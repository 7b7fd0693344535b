"""Layer 1: the reference against HF transformers' own modeling code, from the same safetensors."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model import Cache, Reference, init_weights, preset, save_checkpoint  # noqa: E402
from model.config import ModelConfig  # noqa: E402

from .conftest import rel_err  # noqa: E402

transformers.logging.set_verbosity_error()
try:  # silence the loading progress bars
    transformers.utils.logging.disable_progress_bar()
except AttributeError:
    pass

TOL = 1e-4
YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
            mscale=0.707, mscale_all_dim=0.707)


def _cfg(name: str, **changes) -> ModelConfig:
    d = preset(name).to_hf_dict()
    d.update(changes)
    return ModelConfig.from_hf_dict(d)


CASES = {
    "llama-tied-gqa": _cfg("tiny-dense", num_nextn_predict_layers=0),
    "llama-untied-llama3-rope": _cfg("tiny-dense", tie_word_embeddings=False, num_key_value_heads=1,
                                     rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0, original_max_position_embeddings=64)),
    "v3-qlora-grouped-sigmoid": _cfg("tiny-moe", num_nextn_predict_layers=0),
    "v3-no-qlora-grouped-sigmoid-yarn": _cfg("tiny-moe", q_lora_rank=None, num_nextn_predict_layers=0,
                                             rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=1.0)),
    "v3-rope-not-interleaved": _cfg("tiny-moe", rope_interleave=False, num_nextn_predict_layers=0),
    "v2-no-qlora-softmax-greedy-yarn": _cfg("tiny-mhc", hc_mult=0, num_nextn_predict_layers=0, rope_scaling=YARN),
    "v2-qlora-softmax-group-limited": _cfg("tiny-mhc", hc_mult=0, num_nextn_predict_layers=0, q_lora_rank=24,
                                           topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                           routed_scaling_factor=1.5),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    cfg = CASES[request.param]
    weights = init_weights(cfg, seed=7)
    path = tmp_path_factory.mktemp(request.param)
    save_checkpoint(cfg, weights, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    return cfg, Reference(cfg, weights), hf


def test_prefill_logits_match_hf(pair):
    cfg, ref, hf = pair
    tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    got = ref.step(tokens, Cache.allocate(cfg, 2, 32, torch.float32), torch.zeros(2, dtype=torch.long)).logits
    assert rel_err(got, expected) <= TOL


@pytest.mark.parametrize("T", [1, 3])
def test_cached_decode_logits_match_hf(pair, T):
    cfg, ref, hf = pair
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, cfg.vocab_size, (2, 9), generator=gen)
    steps = [torch.randint(0, cfg.vocab_size, (2, T), generator=gen) for _ in range(3)]
    with torch.no_grad():
        out = hf(prompt, use_cache=True)
        hf_cache = out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values
        expected = []
        for tok in steps:
            out = hf(tok, cache=hf_cache, use_cache=True)
            expected.append(out.logits)
    cache = Cache.allocate(cfg, 2, 32, torch.float32)
    lens = torch.zeros(2, dtype=torch.long)
    ref.step(prompt, cache, lens)
    lens += prompt.shape[1]
    for tok, exp in zip(steps, expected):
        got = ref.step(tok, cache, lens).logits
        lens += T
        assert rel_err(got, exp) <= TOL
