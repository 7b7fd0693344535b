"""Named model shapes, written as the HF config.json each would have.

The tiny presets run a decode step on a CPU in milliseconds and exercise every
feature between them; the large ones copy the dimensions of public models so
benchmarks read the same bytes the real models would.
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, ModelConfig

_TINY_MLA = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
    vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, torch_dtype="float32",
    eos_token_id=1, tie_word_embeddings=False,
)

PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3 style: q_lora, grouped sigmoid routing with correction bias, one dense layer, one MTP layer.
    "tiny-moe": dict(
        _TINY_MLA, num_hidden_layers=3, q_lora_rank=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
    ),
    # Llama style: GQA, tied embeddings; plus an MTP layer (this project's extension) for speculation tests.
    "tiny-dense": dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=512, tie_word_embeddings=True, torch_dtype="float32",
        eos_token_id=1, num_nextn_predict_layers=1,
    ),
    # DeepSeek-V2 style MLA without q_lora, softmax routing, with 4 hyper-connection streams.
    "tiny-mhc": dict(
        _TINY_MLA, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
        num_hidden_layers=2, q_lora_rank=None,
        n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, moe_intermediate_size=32,
        first_k_dense_replace=1, scoring_func="softmax", topk_method="greedy", norm_topk_prob=False,
        routed_scaling_factor=1.0, num_nextn_predict_layers=1, hc_mult=4, hc_sinkhorn_iters=20,
    ),
    # Llama-3.2-1B dimensions.
    "llama-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True, torch_dtype="bfloat16",
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        eos_token_id=128001,
    ),
    # DeepSeek-V2-Lite dimensions (15.7B parameters, 2.4B active).
    "dsv2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
        first_k_dense_replace=1, scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
                          beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
        max_position_embeddings=163840, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=100001,
    ),
    # DeepSeek-V3 dimensions, 4 layers (1 dense + 3 MoE) and its MTP layer, so it fits one GPU.
    "dsv3-slice": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=4,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048,
        first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
        norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
        rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=163840, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=1,
    ),
}

TINY_PRESETS = ("tiny-moe", "tiny-dense", "tiny-mhc")


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r} (presets: {', '.join(PRESETS)})")
    return ModelConfig.from_hf_dict(PRESETS[name], source=f"preset {name}")
