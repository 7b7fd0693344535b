"""The down projection of a fused MLP, read k-major (DOWN_T: fusion rule expert_mlp).

A task that has just computed its slice h = SiLU(x·Wg[r0:r1]ᵀ)·(x·Wu[r0:r1]ᵀ) of the intermediate rows multiplies
it by the same rows of the down projection packed transposed (Wdᵀ[r0:r1, :], rows of the hidden size H), into a
partial [H] row: out = sum_r h[r]·Wdᵀ[r, :].  The partials of a row's slices are summed by MOE_COMBINE.  Used by
EXPERT_LINEAR[DOWN_T] (routed experts) and LINEAR[DOWN_T] (shared experts); its reference is theirs
(ops/moe.reference_expert, ops/linear.reference).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import aligned


@triton.jit
def kmajor_chunk(wp, rows, r1, cols, cmask, ld, EF: tl.constexpr):
    """Rows `rows` (clamped below r1: a row past it reads row r1 - 1 again, times h = 0) of a k-major matrix with
    row stride ld (in wp's elements), columns `cols`."""
    return tl.load(wp + tl.minimum(rows, r1 - 1)[:, None].to(tl.int64) * ld + cols[None, :], mask=cmask[None, :],
                   other=0, eviction_policy="evict_first" if EF else "")


@triton.jit
def kmajor_rows(w_ptr, h_ptr, r1, K, HB: tl.constexpr, BR: tl.constexpr, ALIGN: tl.constexpr, EF: tl.constexpr = 1):
    """[HB] fp32: sum_{0 <= r < r1} h[r] · W[r, :K] (zeros past K) over rows of K (a down projection's slice packed
    transposed: EXPERT_LINEAR[DOWN_T]), HB >= K a power of two; BR rows a chunk, the next chunk requested before
    this one is summed.  bf16 rows load as words of two columns, 16 bytes a thread a row.  Each thread keeps a sum
    per (row of the chunk, column) in its registers (one fused multiply-add a weight) and adds its BR rows once at
    the end: a fixed order, whatever the neighbours or T.  K and w_ptr are multiples of ALIGN elements (16-byte
    loads need the compiler to see it)."""
    K = aligned(K, ALIGN)
    PAIRS: tl.constexpr = (w_ptr.dtype.element_ty == tl.bfloat16) and (ALIGN % 2 == 0)
    br = tl.arange(0, BR)
    if PAIRS:
        HW: tl.constexpr = HB // 2
        VW: tl.constexpr = min(ALIGN // 2, 4)  # words a thread loads at once: 16 bytes where ALIGN allows
        KW = (K // (2 * VW)) * VW  # a row's words, written so the compiler sees the multiple of VW
        wp = w_ptr.to(tl.pointer_type(tl.uint32))
        cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, HW), VW), VW)
        cmask = cols < KW
        w = kmajor_chunk(wp, br, r1, cols, cmask, KW, EF)
        acc_lo = tl.zeros((BR, HW), tl.float32)
        acc_hi = tl.zeros((BR, HW), tl.float32)
        for rb in range(0, r1, BR):
            w_next = kmajor_chunk(wp, rb + BR + br, r1, cols, cmask, KW, EF)
            hv = tl.load(h_ptr + rb + br, mask=rb + br < r1, other=0.0)[:, None]
            acc_lo += (w << 16).to(tl.float32, bitcast=True) * hv  # the even column: the word's low half
            acc_hi += (w & 0xFFFF0000).to(tl.float32, bitcast=True) * hv
            w = w_next
        return tl.reshape(tl.join(tl.sum(acc_lo, axis=0), tl.sum(acc_hi, axis=0)), (HB,))
    else:
        cols = tl.arange(0, HB)
        cmask = cols < K
        w = kmajor_chunk(w_ptr, br, r1, cols, cmask, K, EF)
        acc = tl.zeros((BR, HB), tl.float32)
        for rb in range(0, r1, BR):
            w_next = kmajor_chunk(w_ptr, rb + BR + br, r1, cols, cmask, K, EF)
            hv = tl.load(h_ptr + rb + br, mask=rb + br < r1, other=0.0)[:, None]
            acc += w.to(tl.float32) * hv
            w = w_next
        return tl.sum(acc, axis=0)


@triton.jit
def down_partial(wd, h_ptr, rows, K, y_ptr, KD: tl.constexpr, BR: tl.constexpr, ALIGN: tl.constexpr,
                 EF: tl.constexpr):
    """y[:K] = sum over rows r < rows of h[r] · wd[r, :K] (wd: the slice's first k-major down row), stored."""
    c = tl.arange(0, KD)
    tl.store(y_ptr + c, kmajor_rows(wd, h_ptr, rows, K, KD, BR, ALIGN, EF), mask=c < K)
