"""The reference decode step with fixed shapes and no host synchronisation.

Same math as `Reference.step`, written so it can be captured in a CUDA graph or
compiled by torch.compile: attention always spans the whole cache (masked), and
MoE gathers each token's top-k experts' weights from per-layer stacks (it reads
the k experts each token routes to, as any step must, but copies them first).
It is the plain-PyTorch baseline tools/bench.py times; tests check it equals
`Reference.step`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..rope import apply_rope, inv_freq_and_scale
from ..schema import DTYPES, layer_prefix
from ..weights import resolve_shared
from .layers import linear, rms_norm, swiglu_mlp
from .mhc import hc_head
from .model import Cache, decoder_layer
from .moe import route, router_logits


class StaticStep:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], batch: int, T: int, max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
        self.cfg, self.B, self.T = cfg, batch, T
        self.w = resolve_shared(cfg, weights)
        self.dtype = dtype or DTYPES[cfg.dtype]
        self.cache = Cache.allocate(cfg, batch, max_len, self.dtype, device)
        self.stacks: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for layer in range(cfg.num_hidden_layers):
            if cfg.is_moe_layer(layer):
                p = layer_prefix(layer) + "mlp.experts."
                E = cfg.n_routed_experts
                self.stacks[layer] = tuple(
                    torch.stack([self.w[f"{p}{e}.{proj}.weight"] for e in range(E)])
                    for proj in ("gate_proj", "up_proj", "down_proj"))
        self.rope = {}
        for layer in range(cfg.num_hidden_layers):
            spec = cfg.rope_for_layer(layer)
            if spec.key() not in self.rope:
                inv_freq, scale = inv_freq_and_scale(spec)
                self.rope[spec.key()] = (inv_freq.to(device), scale)
        self.keys = torch.arange(max_len, device=device)

    def _rope(self, layer: int, pos: torch.Tensor):
        inv_freq, scale = self.rope[self.cfg.rope_for_layer(layer).key()]
        freqs = pos.float()[..., None] * inv_freq
        return freqs.cos() * scale, freqs.sin() * scale

    def _write(self, layer: int, pos: torch.Tensor, entries: torch.Tensor) -> None:
        b = torch.arange(self.B, device=pos.device)[:, None].expand_as(pos)
        self.cache.data[layer][b, pos] = entries.to(self.cache.data.dtype)

    def _attend(self, scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        mask = self.keys[None, None, :] <= pos[:, :, None]
        return torch.softmax(scores.masked_fill(~mask[:, :, None, :], float("-inf")), dim=-1)

    def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        a = layer_prefix(layer) + "self_attn."
        B, T, _ = x.shape
        cos, sin = self._rope(layer, pos)
        cache = self.cache.data[layer]
        if not cfg.is_mla:
            nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            q = apply_rope(linear(x, w[a + "q_proj.weight"]).view(B, T, nh, hd),
                           cos[:, :, None], sin[:, :, None], False)
            k = apply_rope(linear(x, w[a + "k_proj.weight"]).view(B, T, nkv, hd),
                           cos[:, :, None], sin[:, :, None], False)
            v = linear(x, w[a + "v_proj.weight"])
            self._write(layer, pos, torch.cat((k.flatten(2), v), dim=-1))
            keys = cache[..., : nkv * hd].float().view(B, -1, nkv, hd).repeat_interleave(nh // nkv, dim=2)
            values = cache[..., nkv * hd:].float().view(B, -1, nkv, hd).repeat_interleave(nh // nkv, dim=2)
            probs = self._attend(torch.einsum("bthd,bshd->bths", q.float(), keys) * cfg.softmax_scale, pos)
            out = torch.einsum("bths,bshd->bthd", probs, values).to(x.dtype)
            return linear(out.reshape(B, T, nh * hd), w[a + "o_proj.weight"])
        nh, nope, vd, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            q = linear(x, w[a + "q_proj.weight"])
        else:
            q = linear(rms_norm(linear(x, w[a + "q_a_proj.weight"]), w[a + "q_a_layernorm.weight"], cfg.rms_norm_eps),
                       w[a + "q_b_proj.weight"])
        q = q.view(B, T, nh, cfg.qk_head_dim)
        q_pe = apply_rope(q[..., nope:], cos[:, :, None], sin[:, :, None], cfg.rope.interleave)
        kv = linear(x, w[a + "kv_a_proj_with_mqa.weight"])
        latent = rms_norm(kv[..., :r], w[a + "kv_a_layernorm.weight"], cfg.rms_norm_eps)
        self._write(layer, pos, torch.cat((latent, apply_rope(kv[..., r:], cos, sin, cfg.rope.interleave)), dim=-1))
        w_kvb = w[a + "kv_b_proj.weight"].float().view(nh, nope + vd, r)
        q_lat = torch.einsum("bthn,hnc->bthc", q[..., :nope].float(), w_kvb[:, :nope])
        scores = torch.einsum("bthc,bsc->bths", q_lat, cache[..., :r].float())
        scores = scores + torch.einsum("bthd,bsd->bths", q_pe.float(), cache[..., r:].float())
        probs = self._attend(scores * cfg.softmax_scale, pos)
        out = torch.einsum("bthc,hvc->bthv", torch.einsum("bths,bsc->bthc", probs, cache[..., :r].float()),
                           w_kvb[:, nope:])
        return linear(out.to(x.dtype).reshape(B, T, nh * vd), w[a + "o_proj.weight"])

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        p = layer_prefix(layer) + "mlp."
        if not cfg.is_moe_layer(layer):
            return swiglu_mlp(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])
        B, T, H = x.shape
        flat = x.reshape(B * T, H)
        weights, ids = route(cfg, router_logits(w, p, flat), w.get(p + "gate.e_score_correction_bias"))
        gate, up, down = self.stacks[layer]
        g = torch.einsum("nh,nkih->nki", flat, gate[ids].to(x.dtype))
        u = torch.einsum("nh,nkih->nki", flat, up[ids].to(x.dtype))
        y = torch.einsum("nki,nkhi->nkh", F.silu(g) * u, down[ids].to(x.dtype))
        out = (y.float() * weights[..., None]).sum(1)
        if cfg.n_shared_experts:
            s = p + "shared_experts."
            out = out + swiglu_mlp(flat, w[s + "gate_proj.weight"], w[s + "up_proj.weight"],
                                   w[s + "down_proj.weight"]).float()
        return out.to(x.dtype).view(B, T, H)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, cache_lens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] (fp32); writes the cache at cache_lens[b] + t like Reference.step."""
        cfg, w = self.cfg, self.w
        pos = cache_lens[:, None] + torch.arange(self.T, device=tokens.device)
        x = w["model.embed_tokens.weight"][tokens]
        if cfg.hc_mult:
            x = x[:, :, None, :].expand(-1, -1, cfg.hc_mult, -1).contiguous()
        for layer in range(cfg.num_hidden_layers):
            x = self.layer(layer, x, pos)
        if cfg.hc_mult:
            B, T, n, H = x.shape
            x = hc_head(cfg, w, "model.hc_head.", x.reshape(B * T, n, H)).view(B, T, H)
        return linear(rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps), w["lm_head.weight"]).float()

    def layer(self, layer: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return decoder_layer(self.cfg, self.w, layer, x, lambda h: self.attention(layer, h, pos),
                             lambda h: self.mlp(layer, h))
