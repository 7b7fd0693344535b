"""Elementwise and projection building blocks of the reference model."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back to x's dtype, then scaled (HF's order)."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight.to(x.dtype) * y


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T with weight in HF [out, in] layout."""
    return F.linear(x, weight.to(x.dtype))


def swiglu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)
