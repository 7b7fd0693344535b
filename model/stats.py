"""Sizes from shapes alone (no tensor is allocated): parameters, active parameters, bytes a step reads."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .config import ModelConfig
from .schema import TensorSpec, tensor_specs

_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


@dataclass(frozen=True)
class StepBytes:
    tokens: int  # T
    batch: int  # B
    context: int
    weight_bytes: float
    cache_bytes: float
    expected_experts_per_layer: float

    @property
    def total(self) -> float:
        return self.weight_bytes + self.cache_bytes


def _itemsize(spec: TensorSpec) -> int:
    return spec.dtype.itemsize


def _is_mtp(cfg: ModelConfig, name: str) -> bool:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= cfg.num_hidden_layers


def parameter_count(cfg: ModelConfig, include_mtp: bool = False) -> int:
    return sum(s.numel for s in tensor_specs(cfg)
               if not s.optional and (include_mtp or not _is_mtp(cfg, s.name)))


def expected_distinct_experts(cfg: ModelConfig, tokens: int) -> float:
    """Experts a MoE layer reads when `tokens` tokens route independently and uniformly."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if not E:
        return 0.0
    if tokens == 1:
        return float(k)
    return E * (1 - (1 - k / E) ** tokens)


def _split(cfg: ModelConfig):
    """Main-model specs split into (embedding table, routed-expert tensors, everything else)."""
    embed, experts, rest = [], [], []
    for s in tensor_specs(cfg):
        if s.optional or _is_mtp(cfg, s.name):
            continue
        if s.name == "model.embed_tokens.weight":
            embed.append(s)
        elif _EXPERT.search(s.name):
            experts.append(s)
        else:
            rest.append(s)
    return embed, experts, rest


def active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token's decode reads: all but the embedding table (one row is read)
    and the routed experts it is not sent to; the head counts even when tied."""
    embed, experts, rest = _split(cfg)
    active = sum(s.numel for s in rest) + cfg.hidden_size
    if cfg.tie_word_embeddings:
        active += cfg.vocab_size * cfg.hidden_size
    if experts:
        moe_layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_hidden_layers))
        per_expert = sum(s.numel for s in experts) // (moe_layers * cfg.n_routed_experts)
        active += moe_layers * cfg.num_experts_per_tok * per_expert
    return active


def step_bytes(cfg: ModelConfig, tokens: int = 1, batch: int = 1, context: int = 4096) -> StepBytes:
    """Bytes a plain decode step must read: weights it touches plus every sequence's cache."""
    embed, experts, rest = _split(cfg)
    weight = sum(s.numel * _itemsize(s) for s in rest)
    weight += tokens * batch * cfg.hidden_size * embed[0].dtype.itemsize
    if cfg.tie_word_embeddings:
        weight += embed[0].numel * embed[0].dtype.itemsize
    distinct = expected_distinct_experts(cfg, tokens * batch)
    if experts:
        moe_layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_hidden_layers))
        per_expert = sum(s.numel * _itemsize(s) for s in experts) / (moe_layers * cfg.n_routed_experts)
        weight += moe_layers * distinct * per_expert
    cache_itemsize = embed[0].dtype.itemsize
    cache = cfg.num_hidden_layers * batch * context * cfg.cache_width * cache_itemsize
    return StepBytes(tokens, batch, context, float(weight), float(cache), distinct)


def describe(cfg: ModelConfig, context: int = 4096, spec_tokens: int = 6) -> dict:
    """Everything --describe prints, as plain data."""
    one = step_bytes(cfg, 1, 1, context)
    many = step_bytes(cfg, spec_tokens, 1, context)
    return {
        "architecture": cfg.architecture,
        "parameters": parameter_count(cfg),
        "parameters_with_mtp": parameter_count(cfg, include_mtp=True),
        "active_parameters_per_token": active_parameters(cfg),
        "layers": cfg.num_hidden_layers,
        "moe_layers": sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_hidden_layers)),
        "mtp_layers": cfg.num_nextn_predict_layers,
        "dtype": cfg.dtype,
        "context": context,
        "step_bytes_T1": {"weights": one.weight_bytes, "cache": one.cache_bytes, "total": one.total},
        f"step_bytes_T{spec_tokens}": {"weights": many.weight_bytes, "cache": many.cache_bytes, "total": many.total,
                                       "expected_experts_per_layer": many.expected_experts_per_layer},
    }
