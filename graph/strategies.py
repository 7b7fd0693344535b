"""Hypothesis strategies for plans: model configs of every family and option, step shapes, compile options.

Use them on your own configs too:

    from graph.strategies import plan_cases
    @given(plan_cases(configs=st.just(my_config)))
    def test_mine(case): ...

and see tests/test_plan_equivalence.py for the check they feed.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from model.config import ModelConfig

from .compile import CompileOptions
from .fusion import RULES
from .lower import StepShape
from .tiling import TilingOptions


@st.composite
def llama_configs(draw) -> ModelConfig:
    heads = draw(st.sampled_from([2, 4]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    layers = draw(st.integers(1, 3))
    d = dict(architectures=["LlamaForCausalLM"], vocab_size=draw(st.sampled_from([64, 97, 128])),
             hidden_size=draw(st.sampled_from([32, 48])), intermediate_size=draw(st.sampled_from([40, 64])),
             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
             head_dim=draw(st.sampled_from([8, 16])), tie_word_embeddings=draw(st.booleans()),
             rope_theta=draw(st.sampled_from([10000.0, 500000.0])), torch_dtype="float32",
             num_nextn_predict_layers=draw(st.integers(0, 2)), hc_mult=draw(st.sampled_from([0, 0, 2, 4])))
    if draw(st.booleans()):
        d["rope_scaling"] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=32)
    if draw(st.booleans()):
        d["rope_theta_per_layer"] = [draw(st.sampled_from([1e4, 5e4])) for _ in range(layers)]
    return ModelConfig.from_hf_dict(d)


@st.composite
def deepseek_configs(draw) -> ModelConfig:
    v3 = draw(st.booleans())
    layers = draw(st.integers(1, 3))
    heads = draw(st.sampled_from([2, 4]))
    d = dict(architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
             vocab_size=draw(st.sampled_from([64, 97, 128])), hidden_size=draw(st.sampled_from([32, 48])),
             intermediate_size=draw(st.sampled_from([40, 64])), num_hidden_layers=layers,
             num_attention_heads=heads, num_key_value_heads=heads,
             q_lora_rank=draw(st.sampled_from([None, 16, 24])), kv_lora_rank=draw(st.sampled_from([16, 32])),
             qk_nope_head_dim=draw(st.sampled_from([8, 16])), qk_rope_head_dim=draw(st.sampled_from([4, 8])),
             v_head_dim=draw(st.sampled_from([8, 16])), torch_dtype="float32",
             tie_word_embeddings=draw(st.booleans()), rope_interleave=draw(st.booleans()),
             num_nextn_predict_layers=draw(st.integers(0, 2)), hc_mult=draw(st.sampled_from([0, 0, 2, 4])),
             first_k_dense_replace=draw(st.integers(0, layers)))
    if draw(st.booleans()):
        d["rope_scaling"] = dict(type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32,
                                 beta_slow=1, mscale=draw(st.sampled_from([0.707, 1.0])),
                                 mscale_all_dim=draw(st.sampled_from([0.707, 1.0])))
    if draw(st.booleans()):
        d["rope_theta_per_layer"] = [draw(st.sampled_from([1e4, 5e4])) for _ in range(layers)]
    if draw(st.integers(0, 3)):  # mostly MoE
        E = draw(st.sampled_from([4, 8]))
        method = draw(st.sampled_from(["greedy", "group_limited_greedy", "noaux_tc"]))
        n_group = 1 if method == "greedy" else draw(st.sampled_from([g for g in (1, 2, 4) if E // g >= 2]))
        k = draw(st.integers(1, 3))
        topk_group = draw(st.integers(1, n_group))
        if method != "greedy":
            topk_group = max(topk_group, -(-k // (E // n_group)))
        d.update(n_routed_experts=E, num_experts_per_tok=k, n_shared_experts=draw(st.integers(0, 2)),
                 moe_intermediate_size=draw(st.sampled_from([16, 24])), topk_method=method,
                 scoring_func="sigmoid" if method == "noaux_tc" else draw(st.sampled_from(["softmax", "sigmoid"])),
                 n_group=n_group, topk_group=topk_group, norm_topk_prob=draw(st.booleans()),
                 routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])))
    else:
        d.update(n_routed_experts=None)
    return ModelConfig.from_hf_dict(d)


def model_configs():
    return st.one_of(llama_configs(), deepseek_configs())


@st.composite
def compile_options(draw) -> CompileOptions:
    rules = tuple(r for r in RULES if draw(st.booleans()))
    return CompileOptions(
        workers=draw(st.one_of(st.integers(1, 8), st.integers(9, 64))),
        scheduler=draw(st.sampled_from(["critical_path", "round_robin"])),
        cse=draw(st.booleans()),
        fuse=bool(rules) and draw(st.booleans()),
        vocab_block=draw(st.sampled_from([16, 50, 4096])),
        tiling=TilingOptions(tile_bytes=draw(st.sampled_from([256, 1024, 4096, 65536])),
                             row_align=draw(st.sampled_from([1, 4, 16])), act_rows=draw(st.integers(1, 8)),
                             attn_heads=draw(st.integers(0, 4)), spread=draw(st.sampled_from([0, -1, 2, 5])),
                             rope_heads=draw(st.sampled_from([0, 1, 3])), balance=draw(st.sampled_from([0, 1])),
                             siblings=draw(st.sampled_from([0, 1, 2]))),
        fusion_rules=rules or RULES,
        shared_counters=draw(st.booleans()),
    )


@dataclass
class PlanCase:
    cfg: ModelConfig
    shape: StepShape
    options: CompileOptions
    cache_lens: list[int]
    order: str  # queue | random
    seed: int


@st.composite
def plan_cases(draw, configs=None) -> PlanCase:
    cfg = draw(configs if configs is not None else model_configs())
    T, B = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    passes = draw(st.integers(0, 2)) if cfg.num_nextn_predict_layers else 0
    max_len = T + passes + draw(st.integers(0, 24))
    shape = StepShape(T=T, B=B, max_len=max_len, mtp_passes=passes,
                      attn_split=draw(st.sampled_from([0, 2, 3, 8])))
    lens = [draw(st.integers(0, max_len - T - passes)) for _ in range(B)]
    return PlanCase(cfg, shape, draw(compile_options()), lens, draw(st.sampled_from(["queue", "random"])),
                    draw(st.integers(0, 2**16)))
