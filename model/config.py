"""Model configuration read from Hugging Face ``config.json`` conventions.

One frozen dataclass describes every model the engine runs: Llama-style dense
models (GQA attention) and DeepSeek-style models (MLA attention, routed and
shared experts, MTP draft layers, optional manifold-constrained
hyper-connections).  Keys follow the HF configs of ``LlamaForCausalLM``,
``DeepseekV2ForCausalLM`` and ``DeepseekV3ForCausalLM``; the mHC keys follow
``DeepseekV4`` (``hc_mult``, ``hc_sinkhorn_iters``, ``hc_eps``).  Two keys are
this project's own and documented in the README: ``num_nextn_predict_layers``
on a Llama config (an MTP head for a dense model) and ``rope_theta_per_layer``
(layers that share one of a few rope tables).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model; the message names the key."""


ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"),
    "DeepseekV2ForCausalLM": ("deepseek", "deepseek_v2"),
    "DeepseekV3ForCausalLM": ("deepseek", "deepseek_v3"),
}
MODEL_TYPES = {model_type: arch for arch, (_, model_type) in ARCHITECTURES.items()}

_REQUIRED = {
    "llama": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"),
    "deepseek": (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    ),
}
_MOE_REQUIRED = ("num_experts_per_tok", "moe_intermediate_size")
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer: base, scaling rule and pair layout."""

    theta: float = 10000.0
    dim: int = 64
    kind: str = "default"  # default | yarn | llama3 | linear
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    interleave: bool = False  # rotate (x0,x1),(x2,x3)... pairs instead of the two halves

    def key(self) -> tuple:
        """Identity of the table this layer needs (equal keys share one table)."""
        return dataclasses.astuple(self)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    rope: RopeSpec = field(default_factory=RopeSpec)
    rope_theta_per_layer: tuple[float, ...] | None = None
    eos_token_id: int | None = None
    # MLA (deepseek family)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE (n_routed_experts == 0: every layer dense)
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    scoring_func: str = "softmax"  # softmax | sigmoid
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # MTP draft layers, named as DeepSeek-V3 names them (model.layers.{L+i}.*)
    num_nextn_predict_layers: int = 0
    # manifold-constrained hyper-connections (0: plain residual)
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6

    # ---- derived facts -------------------------------------------------
    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture][0]

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture][1]

    @property
    def is_mla(self) -> bool:
        return self.family == "deepseek"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def num_layers_total(self) -> int:
        """Decoder layers including the MTP layers (each MTP layer holds one decoder layer)."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def cache_width(self) -> int:
        """Values cached per token and layer: the MLA latent + rope key, or K and V of every KV head."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_key_value_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.is_mla and self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    def rope_for_layer(self, layer: int) -> RopeSpec:
        if self.rope_theta_per_layer is None or layer >= self.num_hidden_layers:
            return self.rope
        return dataclasses.replace(self.rope, theta=self.rope_theta_per_layer[layer])

    def replace(self, **changes: Any) -> "ModelConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.check()
        return cfg

    # ---- validation ----------------------------------------------------
    def check(self) -> None:
        """Raise ConfigError naming the first inconsistent key."""
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "num_key_value_heads"]
        if self.is_mla:
            positive += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        else:
            positive += ["head_dim"]
        for key in positive:
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config key '{key}' must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")
        if self.rope.dim % 2:
            raise ConfigError(f"rope dimension {self.rope.dim} must be even")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ConfigError(f"config key 'q_lora_rank' must be null or a positive integer, got {self.q_lora_rank!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"config key 'torch_dtype' must be one of {_DTYPES}, got {self.dtype!r}")
        if self.n_routed_experts:
            if not self.is_mla:
                raise ConfigError("routed experts are supported for DeepSeek architectures only")
            for key in ("num_experts_per_tok", "moe_intermediate_size"):
                if getattr(self, key) <= 0:
                    raise ConfigError(f"config key '{key}' must be a positive integer with n_routed_experts > 0")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                                  f"n_routed_experts={self.n_routed_experts}")
            if self.scoring_func not in ("softmax", "sigmoid"):
                raise ConfigError("config key 'scoring_func' must be 'softmax' or 'sigmoid', "
                                  f"got {self.scoring_func!r}")
            if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise ConfigError(f"config key 'topk_method' {self.topk_method!r} is not supported "
                                  "(greedy, group_limited_greedy, noaux_tc)")
            if self.n_group < 1 or self.n_routed_experts % self.n_group:
                raise ConfigError(f"n_routed_experts={self.n_routed_experts} is not divisible by "
                                  f"n_group={self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"topk_group={self.topk_group} must be within 1..n_group={self.n_group}")
            per_group = self.n_routed_experts // self.n_group
            if self.topk_method != "greedy" and self.topk_group * per_group < self.num_experts_per_tok:
                raise ConfigError(f"topk_group={self.topk_group} groups of {per_group} experts cannot supply "
                                  f"num_experts_per_tok={self.num_experts_per_tok}")
            if self.topk_method == "noaux_tc" and per_group < 2:
                raise ConfigError("topk_method 'noaux_tc' scores groups by their top-2 experts: "
                                  f"n_routed_experts/n_group={per_group} must be >= 2")
        if self.hc_mult < 0 or self.hc_sinkhorn_iters < 1:
            raise ConfigError(f"hc_mult={self.hc_mult} must be >= 0 and "
                              f"hc_sinkhorn_iters={self.hc_sinkhorn_iters} >= 1")
        if self.num_nextn_predict_layers < 0:
            raise ConfigError("num_nextn_predict_layers must be >= 0")
        if self.rope_theta_per_layer is not None and len(self.rope_theta_per_layer) != self.num_hidden_layers:
            raise ConfigError(f"rope_theta_per_layer has {len(self.rope_theta_per_layer)} entries, "
                              f"expected num_hidden_layers={self.num_hidden_layers}")

    # ---- HF round trip ---------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that both this project and HF transformers read."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.dtype,
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_theta": self.rope.theta,
        }
        if self.eos_token_id is not None:
            d["eos_token_id"] = self.eos_token_id
        scaling = _rope_scaling_dict(self.rope)
        if scaling is not None:
            d["rope_scaling"] = scaling
        if self.rope_theta_per_layer is not None:
            d["rope_theta_per_layer"] = list(self.rope_theta_per_layer)
        if self.num_nextn_predict_layers:
            d["num_nextn_predict_layers"] = self.num_nextn_predict_layers
        if self.hc_mult:
            d.update(hc_mult=self.hc_mult, hc_sinkhorn_iters=self.hc_sinkhorn_iters, hc_eps=self.hc_eps)
        if not self.is_mla:
            d["head_dim"] = self.head_dim
            return d
        d.update(
            q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim, first_k_dense_replace=self.first_k_dense_replace,
        )
        if self.model_type == "deepseek_v3":
            d["rope_interleave"] = self.rope.interleave
        if self.n_routed_experts:
            d.update(
                n_routed_experts=self.n_routed_experts, n_shared_experts=self.n_shared_experts,
                num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                scoring_func=self.scoring_func, topk_method=self.topk_method, n_group=self.n_group,
                topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                routed_scaling_factor=self.routed_scaling_factor,
            )
        else:
            d.update(n_routed_experts=None, first_k_dense_replace=self.num_hidden_layers)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        return _from_hf_dict(d, source)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        file = path / "config.json"
        if not file.is_file():
            raise ConfigError(f"{path}: no config.json in this directory")
        try:
            d = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from None
        return _from_hf_dict(d, str(file))

    def save(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_scaling_dict(rope: RopeSpec) -> dict[str, Any] | None:
    if rope.kind == "default":
        return None
    d: dict[str, Any] = {"rope_type": rope.kind, "factor": rope.factor}
    if rope.kind == "yarn":
        d.update(original_max_position_embeddings=rope.original_max_position_embeddings,
                 beta_fast=rope.beta_fast, beta_slow=rope.beta_slow,
                 mscale=rope.mscale, mscale_all_dim=rope.mscale_all_dim)
    elif rope.kind == "llama3":
        d.update(original_max_position_embeddings=rope.original_max_position_embeddings,
                 low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
    return d


def _architecture(d: dict[str, Any], source: str) -> str:
    archs = d.get("architectures")
    if archs:
        if not isinstance(archs, list) or not archs:
            raise ConfigError(f"{source}: key 'architectures' must be a non-empty list")
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ConfigError(f"{source}: unknown architecture {arch!r} "
                              f"(supported: {', '.join(sorted(ARCHITECTURES))})")
        return arch
    model_type = d.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: missing key 'architectures' (or 'model_type')")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"{source}: unknown model_type {model_type!r} (supported: {', '.join(sorted(MODEL_TYPES))})")
    return MODEL_TYPES[model_type]


def _rope_spec(d: dict[str, Any], dim: int, interleave: bool, source: str) -> RopeSpec:
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"{source}: 'rope_scaling'/'rope_parameters' must be objects")
    merged = {**params, **scaling}
    theta = float(d.get("rope_theta", merged.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ("default", "yarn", "llama3", "linear"):
        raise ConfigError(f"{source}: rope_scaling type {kind!r} is not supported (default, yarn, llama3, linear)")
    spec = RopeSpec(theta=theta, dim=dim, kind=kind, interleave=interleave)
    if kind == "default":
        return spec
    if "factor" not in merged:
        raise ConfigError(f"{source}: missing key 'rope_scaling.factor' for rope type {kind!r}")
    fields: dict[str, Any] = {"factor": float(merged["factor"])}
    if kind in ("yarn", "llama3"):
        if "original_max_position_embeddings" not in merged:
            raise ConfigError(f"{source}: missing key 'rope_scaling.original_max_position_embeddings'")
        fields["original_max_position_embeddings"] = int(merged["original_max_position_embeddings"])
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "low_freq_factor", "high_freq_factor"):
        if merged.get(key) is not None:
            fields[key] = float(merged[key])
    return dataclasses.replace(spec, **fields)


class _Keys:
    """Typed reads of config.json keys; a bad value is an error naming its key."""

    def __init__(self, d: dict[str, Any], source: str):
        self.d, self.source = d, source

    def _cast(self, key: str, cast, default):
        value = self.d.get(key)
        if value is None:
            return default
        if isinstance(value, bool) and cast is not bool:
            raise ConfigError(f"{self.source}: key '{key}' must be a number, got {value!r}")
        try:
            out = cast(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{self.source}: key '{key}' has value {value!r} of the wrong type") from None
        if cast is int and out != value:
            raise ConfigError(f"{self.source}: key '{key}' must be an integer, got {value!r}")
        return out

    def int(self, key: str, default: int | None = 0) -> int | None:
        return self._cast(key, int, default)

    def float(self, key: str, default: float) -> float:
        return self._cast(key, float, default)

    def bool(self, key: str, default: bool) -> bool:
        return self._cast(key, bool, default)


def _from_hf_dict(d: dict[str, Any], source: str) -> ModelConfig:
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    arch = _architecture(d, source)
    family = ARCHITECTURES[arch][0]
    k = _Keys(d, source)
    missing = [key for key in _REQUIRED[family] if d.get(key) is None]
    n_experts = k.int("n_routed_experts")
    if n_experts:
        missing += [key for key in _MOE_REQUIRED if d.get(key) is None]
    if missing:
        raise ConfigError(f"{source}: missing key(s) {', '.join(repr(m) for m in missing)} required by {arch}")
    if d.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias=true is not supported")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {d['hidden_act']!r} is not supported (silu)")

    heads = k.int("num_attention_heads")
    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    common = dict(
        architecture=arch,
        vocab_size=k.int("vocab_size"),
        hidden_size=k.int("hidden_size"),
        num_hidden_layers=k.int("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=k.int("num_key_value_heads", heads),
        intermediate_size=k.int("intermediate_size"),
        rms_norm_eps=k.float("rms_norm_eps", 1e-6),
        tie_word_embeddings=k.bool("tie_word_embeddings", False),
        max_position_embeddings=k.int("max_position_embeddings", 4096),
        dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
        eos_token_id=None if eos is None else _Keys({"eos_token_id": eos}, source).int("eos_token_id"),
        num_nextn_predict_layers=k.int("num_nextn_predict_layers"),
        hc_mult=k.int("hc_mult"),
        hc_sinkhorn_iters=k.int("hc_sinkhorn_iters", 20),
        hc_eps=k.float("hc_eps", 1e-6),
    )
    per_layer = d.get("rope_theta_per_layer")
    if per_layer is not None:
        if not isinstance(per_layer, list):
            raise ConfigError(f"{source}: key 'rope_theta_per_layer' must be a list of numbers")
        common["rope_theta_per_layer"] = tuple(
            _Keys({"rope_theta_per_layer": t}, source).float("rope_theta_per_layer", 0.0) for t in per_layer)

    if family == "llama":
        head_dim = k.int("head_dim")
        if not head_dim:
            if common["hidden_size"] % heads:
                raise ConfigError(f"{source}: hidden_size is not divisible by num_attention_heads "
                                  "and no head_dim is given")
            head_dim = common["hidden_size"] // heads
        cfg = ModelConfig(head_dim=head_dim, rope=_rope_spec(d, head_dim, False, source), **common)
    else:
        rope_dim = k.int("qk_rope_head_dim")
        # DeepSeek-V2 always rotates interleaved pairs; V3 says so with rope_interleave (default true).
        interleave = k.bool("rope_interleave", True)
        v3 = arch == "DeepseekV3ForCausalLM"
        first_dense = k.int("first_k_dense_replace")
        cfg = ModelConfig(
            head_dim=rope_dim,
            rope=_rope_spec(d, rope_dim, interleave, source),
            q_lora_rank=k.int("q_lora_rank", None),
            kv_lora_rank=k.int("kv_lora_rank"),
            qk_nope_head_dim=k.int("qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=k.int("v_head_dim"),
            n_routed_experts=n_experts,
            n_shared_experts=k.int("n_shared_experts"),
            num_experts_per_tok=k.int("num_experts_per_tok"),
            moe_intermediate_size=k.int("moe_intermediate_size"),
            first_k_dense_replace=first_dense,
            scoring_func=str(d.get("scoring_func") or ("sigmoid" if v3 else "softmax")),
            topk_method=str(d.get("topk_method") or ("noaux_tc" if v3 else "greedy")),
            n_group=k.int("n_group", 1),
            topk_group=k.int("topk_group", 1),
            norm_topk_prob=k.bool("norm_topk_prob", False),
            routed_scaling_factor=k.float("routed_scaling_factor", 1.0),
            **common,
        )
    try:
        cfg.check()
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg
