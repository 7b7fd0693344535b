"""Triton helpers shared by the task bodies: reading fields of a task word."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fld(word, IDX: tl.constexpr):
    """A 32-bit integer field."""
    return tl.load(word + IDX)


@triton.jit
def off(word, IDX: tl.constexpr):
    """A 64-bit offset field (low word, high word)."""
    lo = tl.load(word + IDX).to(tl.int64) & 0xFFFFFFFF
    hi = tl.load(word + IDX + 1).to(tl.int64)
    return lo | (hi << 32)


@triton.jit
def ffld(word, IDX: tl.constexpr):
    """A float field (stored as its bit pattern)."""
    return tl.load(word + IDX).to(tl.float32, bitcast=True)


@triton.jit
def has(flags, BIT: tl.constexpr):
    return (flags & BIT) != 0


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))
