"""Rotary position embeddings: frequencies (default, linear, YaRN, Llama-3), tables, application.

The frequency rules follow the HF ``modeling_rope_utils`` definitions so that a
checkpoint's ``rope_scaling`` means the same thing here as there.
"""

from __future__ import annotations

import math

import torch

from .config import RopeSpec, yarn_mscale


def inv_freq_and_scale(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (fp32) and the factor applied to cos/sin."""
    dim, base = spec.dim, spec.theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if spec.kind == "default":
        return inv_freq, 1.0
    if spec.kind == "linear":
        return inv_freq / spec.factor, 1.0
    if spec.kind == "llama3":
        return _llama3(spec, inv_freq), 1.0
    if spec.kind == "yarn":
        return _yarn(spec)
    raise ValueError(f"unsupported rope kind {spec.kind!r}")


def _llama3(spec: RopeSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    old_len = spec.original_max_position_embeddings
    low_wavelen = old_len / spec.low_freq_factor
    high_wavelen = old_len / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old_len / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    dim, base, factor = spec.dim, spec.theta, spec.factor
    original = spec.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(spec.beta_fast)), 0)
    high = min(math.ceil(correction_dim(spec.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    if spec.mscale and spec.mscale_all_dim:
        scale = yarn_mscale(factor, spec.mscale) / yarn_mscale(factor, spec.mscale_all_dim)
    else:
        scale = yarn_mscale(factor)
    return inv_freq, float(scale)


def rope_table(spec: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [*positions.shape, dim/2] in fp32, already multiplied by the scale."""
    inv_freq, scale = inv_freq_and_scale(spec)
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    return freqs.cos() * scale, freqs.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the last dim of x; cos/sin broadcast against x[..., :dim/2].

    interleave=True rotates pairs (x0,x1),(x2,x3),... and keeps that layout
    (DeepSeek); otherwise the first half pairs with the second (Llama).  Both
    are computed in fp32 and cast back to x's dtype.
    """
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
