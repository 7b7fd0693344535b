"""Every tensor a config implies: HF key name, shape, dtype and how to initialise it.

The order is the order a decode step reads the tensors (embedding, layer by
layer, final norm, head, then the MTP layers), which is also the order the
runtime lays weights out in its arena.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str  # linear | out_proj | embedding | norm | router | bias | hc_fn | hc_base | hc_scale
    optional: bool = False  # may be absent from a checkpoint (then shared with another tensor)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def model_dtype(cfg: ModelConfig) -> torch.dtype:
    return DTYPES[cfg.dtype]


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """All tensors of the model, main layers first, MTP layers last."""
    dt = model_dtype(cfg)
    H, V = cfg.hidden_size, cfg.vocab_size
    specs = [TensorSpec("model.embed_tokens.weight", (V, H), dt, "embedding")]
    for layer in range(cfg.num_hidden_layers):
        specs += decoder_layer_specs(cfg, layer)
    specs.append(TensorSpec("model.norm.weight", (H,), dt, "norm"))
    if cfg.hc_mult:
        specs += _hc_head_specs(cfg, "model.hc_head.")
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (V, H), dt, "linear"))
    for i in range(cfg.num_nextn_predict_layers):
        specs += mtp_layer_specs(cfg, cfg.num_hidden_layers + i)
    return specs


def mtp_layer_specs(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    """DeepSeek-V3's MTP module: enorm/hnorm, eh_proj, a decoder layer, shared_head."""
    dt, H, V = model_dtype(cfg), cfg.hidden_size, cfg.vocab_size
    p = layer_prefix(layer)
    specs = [
        TensorSpec(p + "embed_tokens.weight", (V, H), dt, "embedding", optional=True),
        TensorSpec(p + "enorm.weight", (H,), dt, "norm"),
        TensorSpec(p + "hnorm.weight", (H,), dt, "norm"),
        TensorSpec(p + "eh_proj.weight", (H, 2 * H), dt, "linear"),
    ]
    specs += decoder_layer_specs(cfg, layer)
    if cfg.hc_mult:
        specs += _hc_head_specs(cfg, p + "hc_head.")
    specs += [
        TensorSpec(p + "shared_head.norm.weight", (H,), dt, "norm"),
        TensorSpec(p + "shared_head.head.weight", (V, H), dt, "linear", optional=True),
    ]
    return specs


def decoder_layer_specs(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    dt, H = model_dtype(cfg), cfg.hidden_size
    p = layer_prefix(layer)
    specs: list[TensorSpec] = []
    if cfg.hc_mult:
        specs += _hc_specs(cfg, p + "attn_hc.")
    specs.append(TensorSpec(p + "input_layernorm.weight", (H,), dt, "norm"))
    specs += _mla_specs(cfg, p) if cfg.is_mla else _gqa_specs(cfg, p)
    if cfg.hc_mult:
        specs += _hc_specs(cfg, p + "ffn_hc.")
    specs.append(TensorSpec(p + "post_attention_layernorm.weight", (H,), dt, "norm"))
    if cfg.is_moe_layer(layer):
        specs += _moe_specs(cfg, p + "mlp.")
    else:
        specs += _mlp_specs(p + "mlp.", H, cfg.intermediate_size, dt)
    return specs


def _gqa_specs(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    dt, H, hd = model_dtype(cfg), cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    a = p + "self_attn."
    return [
        TensorSpec(a + "q_proj.weight", (q, H), dt, "linear"),
        TensorSpec(a + "k_proj.weight", (kv, H), dt, "linear"),
        TensorSpec(a + "v_proj.weight", (kv, H), dt, "linear"),
        TensorSpec(a + "o_proj.weight", (H, q), dt, "out_proj"),
    ]


def _mla_specs(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    dt, H, nh = model_dtype(cfg), cfg.hidden_size, cfg.num_attention_heads
    a = p + "self_attn."
    q_out = nh * cfg.qk_head_dim
    if cfg.q_lora_rank is None:
        specs = [TensorSpec(a + "q_proj.weight", (q_out, H), dt, "linear")]
    else:
        r = cfg.q_lora_rank
        specs = [
            TensorSpec(a + "q_a_proj.weight", (r, H), dt, "linear"),
            TensorSpec(a + "q_a_layernorm.weight", (r,), dt, "norm"),
            TensorSpec(a + "q_b_proj.weight", (q_out, r), dt, "linear"),
        ]
    return specs + [
        TensorSpec(a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H), dt, "linear"),
        TensorSpec(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), dt, "norm"),
        TensorSpec(a + "kv_b_proj.weight",
                   (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), dt, "linear"),
        TensorSpec(a + "o_proj.weight", (H, nh * cfg.v_head_dim), dt, "out_proj"),
    ]


def _mlp_specs(p: str, hidden: int, inter: int, dt: torch.dtype) -> list[TensorSpec]:
    return [
        TensorSpec(p + "gate_proj.weight", (inter, hidden), dt, "linear"),
        TensorSpec(p + "up_proj.weight", (inter, hidden), dt, "linear"),
        TensorSpec(p + "down_proj.weight", (hidden, inter), dt, "out_proj"),
    ]


def _moe_specs(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    dt, H, E = model_dtype(cfg), cfg.hidden_size, cfg.n_routed_experts
    specs = [TensorSpec(p + "gate.weight", (E, H), dt, "router")]
    if cfg.topk_method == "noaux_tc":
        specs.append(TensorSpec(p + "gate.e_score_correction_bias", (E,), torch.float32, "bias"))
    for e in range(E):
        specs += _mlp_specs(f"{p}experts.{e}.", H, cfg.moe_intermediate_size, dt)
    if cfg.n_shared_experts:
        specs += _mlp_specs(p + "shared_experts.", H, cfg.moe_intermediate_size * cfg.n_shared_experts, dt)
    return specs


def _hc_specs(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    n, H = cfg.hc_mult, cfg.hidden_size
    width = (2 + n) * n
    return [
        TensorSpec(p + "fn", (width, n * H), torch.float32, "hc_fn"),
        TensorSpec(p + "base", (width,), torch.float32, "hc_base"),
        TensorSpec(p + "scale", (3,), torch.float32, "hc_scale"),
    ]


def _hc_head_specs(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    n, H = cfg.hc_mult, cfg.hidden_size
    return [
        TensorSpec(p + "hc_fn", (n, n * H), torch.float32, "hc_fn"),
        TensorSpec(p + "hc_base", (n,), torch.float32, "hc_base"),
        TensorSpec(p + "hc_scale", (1,), torch.float32, "hc_scale"),
    ]
