"""Manifold-constrained hyper-connections (mHC), as DeepSeek-V4 defines them.

The residual is ``n`` streams per token.  Before each sublayer, coefficients are
computed from the RMS-normalised, flattened streams: H_pre = sigmoid (collapse
the streams into the sublayer input), H_post = 2·sigmoid (expand the sublayer
output), H_res = softmax then Sinkhorn-Knopp (a doubly-stochastic mixing of the
streams).  x_{l+1} = H_resᵀ·x_l + H_post ⊗ F(H_pre·x_l).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig


def sinkhorn(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column/row normalisation of positive [..., n, n] matrices (iters column passes)."""
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def _normed_flat(streams: torch.Tensor, eps: float) -> torch.Tensor:
    flat = streams.flatten(-2).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def hc_coefficients(cfg: ModelConfig, w: dict[str, torch.Tensor], p: str, streams: torch.Tensor):
    """streams [N, n, H] -> (pre [N, n], post [N, n], comb [N, n, n]), all fp32."""
    n = cfg.hc_mult
    mix = _normed_flat(streams, cfg.rms_norm_eps) @ w[p + "fn"].float().T
    base, scale = w[p + "base"].float(), w[p + "scale"].float()
    pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = mix[..., 2 * n:].view(-1, n, n) * scale[2] + base[2 * n:].view(n, n)
    comb = sinkhorn(torch.softmax(logits, dim=-1) + cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre[..., None] * streams.float()).sum(dim=-2).to(streams.dtype)


def hc_expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: comb mixes the old ones (comb[j, k]: stream j into stream k), post spreads out."""
    mixed = torch.einsum("njk,njh->nkh", comb, streams.float())
    return (post[..., None] * out.float()[:, None, :] + mixed).to(streams.dtype)


def hc_head(cfg: ModelConfig, w: dict[str, torch.Tensor], p: str, streams: torch.Tensor) -> torch.Tensor:
    """Final collapse of the streams into one hidden state [N, H]."""
    mix = _normed_flat(streams, cfg.rms_norm_eps) @ w[p + "hc_fn"].float().T
    pre = torch.sigmoid(mix * w[p + "hc_scale"].float() + w[p + "hc_base"].float()) + cfg.hc_eps
    return hc_collapse(streams, pre)
