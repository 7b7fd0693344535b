"""The unfused reference model: decode step of T tokens for B sequences, prefill, MTP head, greedy generate.

Everything the fused engine does is judged against these functions.  They are
plain PyTorch over a dict of HF-named weights, run on any device in fp32 or
bf16, and take positions and cache lengths explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..rope import rope_table
from ..schema import DTYPES, layer_prefix
from ..weights import resolve_shared
from .attention import gqa_attention, mla_attention
from .layers import linear, rms_norm, swiglu_mlp
from .mhc import hc_coefficients, hc_collapse, hc_expand, hc_head
from .moe import moe


class CacheOverflowError(ValueError):
    """A step would write past the end of the cache."""


@dataclass
class Cache:
    """data [layers incl. MTP, B, max_len, cache_width]; see attention.py for the per-token layout."""

    data: torch.Tensor

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> "Cache":
        dtype = dtype or DTYPES[cfg.dtype]
        data = torch.zeros(cfg.num_layers_total, batch, max_len, cfg.cache_width, dtype=dtype, device=device)
        return cls(data)

    @property
    def batch(self) -> int:
        return self.data.shape[1]

    @property
    def max_len(self) -> int:
        return self.data.shape[2]

    def sequences(self, index: slice) -> "Cache":
        """A view over some sequences; writes land in this cache."""
        return Cache(self.data[:, index])


@dataclass
class StepOutput:
    logits: torch.Tensor  # [B, T, vocab] fp32
    hidden: torch.Tensor  # [B, T, hidden]: final-normed hidden state (main model) / MTP block output


def decoder_layer(cfg: ModelConfig, w: dict[str, torch.Tensor], layer: int, x: torch.Tensor, attention, mlp):
    """Pre-norm residual block around attention(h) and mlp(h) (both [B, T, H] -> [B, T, H]), or, with
    mHC, the same sublayers between hyper-connection collapse and expand."""
    p, eps = layer_prefix(layer), cfg.rms_norm_eps
    if not cfg.hc_mult:
        x = x + attention(rms_norm(x, w[p + "input_layernorm.weight"], eps))
        return x + mlp(rms_norm(x, w[p + "post_attention_layernorm.weight"], eps))
    B, T, n, H = x.shape
    for sub, norm, fn in (("attn_hc.", "input_layernorm.weight", attention),
                          ("ffn_hc.", "post_attention_layernorm.weight", mlp)):
        streams = x.reshape(B * T, n, H)
        pre, post, comb = hc_coefficients(cfg, w, p + sub, streams)
        inner = rms_norm(hc_collapse(streams, pre), w[p + norm], eps).view(B, T, H)
        x = hc_expand(streams, fn(inner).reshape(B * T, H), post, comb).view(B, T, n, H)
    return x


class Reference:
    """Binds a config to its weights (optional tensors resolved) and runs the model."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], absorbed_mla: bool = True):
        self.cfg = cfg
        self.w = resolve_shared(cfg, weights)
        self.absorbed_mla = absorbed_mla

    # ---- building blocks -------------------------------------------------
    def positions(self, cache: Cache, cache_lens: torch.Tensor, T: int) -> torch.Tensor:
        if cache_lens.shape != (cache.batch,):
            raise ValueError(f"cache_lens has shape {tuple(cache_lens.shape)}, expected ({cache.batch},)")
        pos = cache_lens.to(cache.data.device).long()[:, None] + torch.arange(T, device=cache.data.device)
        if T and int(pos.max()) >= cache.max_len:
            b = int(pos[:, -1].argmax())
            raise CacheOverflowError(f"sequence {b} would write cache position {int(pos[b, -1])} but the cache "
                                     f"holds {cache.max_len} positions")
        if T and int(pos.min()) < 0:
            raise ValueError("cache_lens must be >= 0")
        return pos

    def attention(self, layer: int, x: torch.Tensor, cache: Cache, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_table(self.cfg.rope_for_layer(layer), pos)
        fn = mla_attention if self.cfg.is_mla else gqa_attention
        kwargs = {"absorbed": self.absorbed_mla} if self.cfg.is_mla else {}
        return fn(self.cfg, self.w, layer_prefix(layer), x, cache.data[layer], pos, cos, sin, **kwargs)

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = layer_prefix(layer) + "mlp."
        if self.cfg.is_moe_layer(layer):
            B, T, H = x.shape
            return moe(self.cfg, self.w, p, x.reshape(B * T, H)).view(B, T, H)
        return swiglu_mlp(x, self.w[p + "gate_proj.weight"], self.w[p + "up_proj.weight"],
                          self.w[p + "down_proj.weight"])

    def decoder_layer(self, layer: int, x: torch.Tensor, cache: Cache, pos: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] (or [B, T, n, H] streams with mHC) -> same shape."""
        return decoder_layer(self.cfg, self.w, layer, x, lambda h: self.attention(layer, h, cache, pos),
                             lambda h: self.mlp(layer, h))

    def _streams_in(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, None, :].expand(-1, -1, self.cfg.hc_mult, -1).contiguous() if self.cfg.hc_mult else x

    def _streams_out(self, x: torch.Tensor, head_prefix: str) -> torch.Tensor:
        if not self.cfg.hc_mult:
            return x
        B, T, n, H = x.shape
        return hc_head(self.cfg, self.w, head_prefix, x.reshape(B * T, n, H)).view(B, T, H)

    # ---- public entry points ----------------------------------------------
    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: Cache, cache_lens: torch.Tensor) -> StepOutput:
        """Decode T tokens for each of B sequences: tokens [B, T] go to positions cache_lens[b] + t.

        Writes the cache at those positions (the caller advances cache_lens).
        Also serves as prefill: a prompt is a step with T = its length.
        """
        cfg, w = self.cfg, self.w
        B, T = tokens.shape
        pos = self.positions(cache, cache_lens, T)
        if int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size}), "
                             f"got {int(tokens.min())}..{int(tokens.max())}")
        emb = w["model.embed_tokens.weight"]
        x = self._streams_in(emb[tokens.to(emb.device)])
        for layer in range(cfg.num_hidden_layers):
            x = self.decoder_layer(layer, x, cache, pos)
        hidden = rms_norm(self._streams_out(x, "model.hc_head."), w["model.norm.weight"], cfg.rms_norm_eps)
        return StepOutput(linear(hidden, w["lm_head.weight"]).float(), hidden)

    @torch.no_grad()
    def mtp(self, depth: int, hidden: torch.Tensor, next_tokens: torch.Tensor, cache: Cache,
            cache_lens: torch.Tensor) -> StepOutput:
        """One MTP layer (DeepSeek-V3): at position p it combines hidden[p] (the previous depth's output)
        with the embedding of the token at p+1 and predicts the token at p+2.  Rope position and cache
        slot are p (vLLM's convention), in the MTP layer's own cache."""
        cfg, w = self.cfg, self.w
        if not 0 <= depth < cfg.num_nextn_predict_layers:
            raise ValueError(f"MTP depth {depth} out of range: the model has {cfg.num_nextn_predict_layers} MTP layers")
        layer = cfg.num_hidden_layers + depth
        p = layer_prefix(layer)
        pos = self.positions(cache, cache_lens, next_tokens.shape[1])
        eps = cfg.rms_norm_eps
        e = rms_norm(w[p + "embed_tokens.weight"][next_tokens], w[p + "enorm.weight"], eps)
        h = rms_norm(hidden, w[p + "hnorm.weight"], eps)
        x = linear(torch.cat((e, h.to(e.dtype)), dim=-1), w[p + "eh_proj.weight"])
        x = self._streams_out(self.decoder_layer(layer, self._streams_in(x), cache, pos), p + "hc_head.")
        logits = linear(rms_norm(x, w[p + "shared_head.norm.weight"], eps), w[p + "shared_head.head.weight"])
        return StepOutput(logits.float(), x)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, max_new_tokens: int, max_len: int | None = None) -> torch.Tensor:
        """Greedy decoding: prompts [B, S] (equal lengths) -> new tokens [B, max_new_tokens]."""
        B, S = prompts.shape
        device = self.w["model.embed_tokens.weight"].device
        cache = Cache.allocate(self.cfg, B, max_len or S + max_new_tokens,
                               self.w["model.embed_tokens.weight"].dtype, device)
        lens = torch.zeros(B, dtype=torch.long, device=device)
        tokens = prompts.to(device)
        out = []
        for _ in range(max_new_tokens):
            logits = self.step(tokens, cache, lens).logits
            lens = lens + tokens.shape[1]
            tokens = logits[:, -1].argmax(dim=-1, keepdim=True)
            out.append(tokens)
        return torch.cat(out, dim=1) if out else prompts.new_zeros(B, 0)
