"""The down projection of a fused MLP, read k-major (DOWN_T: fusion rules expert_mlp and dense_mlp).

A task that has just computed its slice h = SiLU(x·Wg[r0:r1]ᵀ)·(x·Wu[r0:r1]ᵀ) of the intermediate rows multiplies
it by the same rows of the down projection packed transposed (Wdᵀ[r0:r1, :], rows of the hidden size H), into a
partial [H] row: out = sum_r h[r]·Wdᵀ[r, :].  The partials of a row's slices are summed by MOE_COMBINE.  Used by
EXPERT_LINEAR[DOWN_T] (routed experts) and LINEAR[DOWN_T] (shared experts, dense MLPs); its reference is theirs
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
def kmajor_layout(w_ptr, K, HB: tl.constexpr, ALIGN: tl.constexpr):
    """(pointer, columns, column mask, row stride) a chunk of rows of K loads with: bf16 rows as words of two
    columns, 16 bytes a thread a row where ALIGN allows (K and w_ptr are multiples of ALIGN elements: 16-byte loads
    need the compiler to see it); else HB columns of w_ptr's type."""
    K = aligned(K, ALIGN)
    PAIRS: tl.constexpr = (w_ptr.dtype.element_ty == tl.bfloat16) and (ALIGN % 2 == 0)
    if PAIRS:
        VW: tl.constexpr = min(ALIGN // 2, 4)  # words a thread loads at once
        KW = (K // (2 * VW)) * VW  # a row's words, written so the compiler sees the multiple of VW
        cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, HB // 2), VW), VW)
        return w_ptr.to(tl.pointer_type(tl.uint32)), cols, cols < KW, KW
    else:
        cols = tl.arange(0, HB)
        return w_ptr, cols, cols < K, K


@triton.jit
def kmajor_first(w_ptr, r1, K, HB: tl.constexpr, BR: tl.constexpr, ALIGN: tl.constexpr, EF: tl.constexpr = 1):
    """The first chunk (rows 0..BR) kmajor_rows sums: weights never depend on activations, so a task requests it
    before it waits for its h values (the CTA barrier after its gate|up stream)."""
    wp, cols, cmask, ld = kmajor_layout(w_ptr, K, HB, ALIGN)
    return kmajor_chunk(wp, tl.arange(0, BR), r1, cols, cmask, ld, EF)


@triton.jit
def kmajor_rows(w_ptr, h_ptr, r1, K, w, HB: tl.constexpr, BR: tl.constexpr, ALIGN: tl.constexpr,
                EF: tl.constexpr = 1):
    """[HB] fp32: sum_{0 <= r < r1} h[r] · W[r, :K] (zeros past K) over rows of K (a down projection's slice packed
    transposed), HB >= K a power of two; BR rows a chunk (w: the first, from kmajor_first), the next chunk requested
    before this one is summed.  Each thread keeps a sum per (row of the chunk, column) in its registers (one fused
    multiply-add a weight) and adds its BR rows once at the end: a fixed order, whatever the neighbours or T."""
    wp, cols, cmask, ld = kmajor_layout(w_ptr, K, HB, ALIGN)
    br = tl.arange(0, BR)
    if w.dtype == tl.uint32:  # bf16 pairs
        acc_lo = tl.zeros((BR, HB // 2), tl.float32)
        acc_hi = tl.zeros((BR, HB // 2), tl.float32)
        for rb in range(0, r1, BR):
            w_next = kmajor_chunk(wp, rb + BR + br, r1, cols, cmask, ld, EF)
            hv = tl.load(h_ptr + rb + br, mask=rb + br < r1, other=0.0)[:, None]
            acc_lo += (w << 16).to(tl.float32, bitcast=True) * hv  # the even column: the word's low half
            acc_hi += (w & 0xFFFF0000).to(tl.float32, bitcast=True) * hv
            w = w_next
        return tl.reshape(tl.join(tl.sum(acc_lo, axis=0), tl.sum(acc_hi, axis=0)), (HB,))
    else:
        acc = tl.zeros((BR, HB), tl.float32)
        for rb in range(0, r1, BR):
            w_next = kmajor_chunk(wp, rb + BR + br, r1, cols, cmask, ld, EF)
            hv = tl.load(h_ptr + rb + br, mask=rb + br < r1, other=0.0)[:, None]
            acc += w.to(tl.float32) * hv
            w = w_next
        return tl.sum(acc, axis=0)


@triton.jit
def down_partials(wd, r1, K, h_ptr, h_ld, y_ptr, y_ld, y_row0, rows_ptr, count, KD: tl.constexpr, BR: tl.constexpr,
                  ALIGN: tl.constexpr, EF: tl.constexpr, LISTED: tl.constexpr):
    """The second half of a DOWN_T task, after its gate|up stream stored the slice's SiLU·mul values h: for each of
    `count` rows n (LISTED: the rows rows_ptr[n], else n), y[y_row0 + n, :K] = sum over the slice's r1 rows r of
    h[n, r] · wd[r, :K] (h_ptr: row 0's first value of the slice; wd: the slice's first k-major down row).  The
    first chunk is requested before the CTA barrier that makes every thread's h stores visible to the others, so its
    load overlaps the barrier; each later row requests its own when it starts."""
    w = kmajor_first(wd, r1, K, KD, BR, ALIGN, EF)
    tl.debug_barrier()  # every thread's SiLU·mul stores before any thread reads them back
    c = tl.arange(0, KD)
    for n in range(count):
        row = n
        if LISTED:
            row = tl.load(rows_ptr + n, cache_modifier=".cg")
        if n > 0:
            w = kmajor_first(wd, r1, K, KD, BR, ALIGN, EF)
        y = kmajor_rows(wd, h_ptr + row * h_ld, r1, K, w, KD, BR, ALIGN, EF)
        tl.store(y_ptr + (y_row0 + row).to(tl.int64) * y_ld + c, y, mask=c < K)
