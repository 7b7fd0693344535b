"""Attention against a cache: GQA (Llama) and MLA (DeepSeek), MLA in both formulations.

The cache holds, per layer, sequence and position, ``cfg.cache_width`` values:
GQA keys then values of every KV head; MLA the normalised latent (kv_lora_rank)
then the rotated shared rope key (qk_rope_head_dim).  Scores, softmax and the
weighted sum run in fp32 whatever the model dtype.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..rope import apply_rope
from .layers import linear, rms_norm


def causal_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, T, S] True where key j may be read by the token at positions[b, t] (j <= position)."""
    keys = torch.arange(num_keys, device=positions.device)
    return keys[None, None, :] <= positions[:, :, None]


def _softmax_attend(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scores [B, T, heads, S] -> probabilities, masked keys get zero weight."""
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


def write_cache(cache_layer: torch.Tensor, positions: torch.Tensor, entries: torch.Tensor) -> None:
    """cache_layer [B, S_max, W]; entries [B, T, W] go to positions [B, T]."""
    batch = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
    cache_layer[batch, positions] = entries.to(cache_layer.dtype)


def gqa_attention(cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, x: torch.Tensor,
                  cache_layer: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    a = prefix + "self_attn."
    q = linear(x, w[a + "q_proj.weight"]).view(B, T, nh, hd)
    k = linear(x, w[a + "k_proj.weight"]).view(B, T, nkv, hd)
    v = linear(x, w[a + "v_proj.weight"]).view(B, T, nkv, hd)
    q = apply_rope(q, cos[:, :, None, :], sin[:, :, None, :], cfg.rope.interleave)
    k = apply_rope(k, cos[:, :, None, :], sin[:, :, None, :], cfg.rope.interleave)
    write_cache(cache_layer, positions, torch.cat((k.flatten(2), v.flatten(2)), dim=-1))

    S = int(positions.max()) + 1
    keys = cache_layer[:, :S, : nkv * hd].float().view(B, S, nkv, hd)
    values = cache_layer[:, :S, nkv * hd:].float().view(B, S, nkv, hd)
    group = nh // nkv
    keys = keys.repeat_interleave(group, dim=2)
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bths", q.float(), keys) * cfg.softmax_scale
    probs = _softmax_attend(scores, causal_mask(positions, S))
    out = torch.einsum("bths,bshd->bthd", probs, values).to(x.dtype)
    return linear(out.reshape(B, T, nh * hd), w[a + "o_proj.weight"])


def mla_query(cfg: ModelConfig, w: dict[str, torch.Tensor], a: str, x: torch.Tensor) -> torch.Tensor:
    """[B, T, heads, qk_nope + qk_rope] before rope."""
    B, T, _ = x.shape
    if cfg.q_lora_rank is None:
        q = linear(x, w[a + "q_proj.weight"])
    else:
        q_lat = rms_norm(linear(x, w[a + "q_a_proj.weight"]), w[a + "q_a_layernorm.weight"], cfg.rms_norm_eps)
        q = linear(q_lat, w[a + "q_b_proj.weight"])
    return q.view(B, T, cfg.num_attention_heads, cfg.qk_head_dim)


def mla_attention(cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, x: torch.Tensor,
                  cache_layer: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  absorbed: bool = True) -> torch.Tensor:
    """MLA.  absorbed=True folds kv_b_proj into the query and output (attention over the
    latent cache, as a decode kernel runs it); absorbed=False expands per-head keys and
    values from the latent (as HF and training code do).  Both give the same result."""
    B, T, _ = x.shape
    nh, nope, vd, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    a = prefix + "self_attn."
    q = mla_query(cfg, w, a, x)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    q_pe = apply_rope(q_pe, cos[:, :, None, :], sin[:, :, None, :], cfg.rope.interleave)

    kv = linear(x, w[a + "kv_a_proj_with_mqa.weight"])
    latent = rms_norm(kv[..., :r], w[a + "kv_a_layernorm.weight"], cfg.rms_norm_eps)
    k_pe = apply_rope(kv[..., r:], cos, sin, cfg.rope.interleave)
    write_cache(cache_layer, positions, torch.cat((latent, k_pe), dim=-1))

    S = int(positions.max()) + 1
    c_all = cache_layer[:, :S, :r].float()  # [B, S, r]
    pe_all = cache_layer[:, :S, r:].float()  # [B, S, rope]
    w_kvb = w[a + "kv_b_proj.weight"].float().view(nh, nope + vd, r)
    w_uk, w_uv = w_kvb[:, :nope, :], w_kvb[:, nope:, :]
    mask = causal_mask(positions, S)
    scale = cfg.softmax_scale
    rope_scores = torch.einsum("bthd,bsd->bths", q_pe.float(), pe_all)
    if absorbed:
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope.float(), w_uk)
        probs = _softmax_attend((torch.einsum("bthc,bsc->bths", q_lat, c_all) + rope_scores) * scale, mask)
        out_lat = torch.einsum("bths,bsc->bthc", probs, c_all)
        out = torch.einsum("bthc,hvc->bthv", out_lat, w_uv)
    else:
        k_nope = torch.einsum("bsc,hnc->bshn", c_all, w_uk)
        values = torch.einsum("bsc,hvc->bshv", c_all, w_uv)
        probs = _softmax_attend((torch.einsum("bthn,bshn->bths", q_nope.float(), k_nope) + rope_scores) * scale, mask)
        out = torch.einsum("bths,bshv->bthv", probs, values)
    return linear(out.to(x.dtype).reshape(B, T, nh * vd), w[a + "o_proj.weight"])
