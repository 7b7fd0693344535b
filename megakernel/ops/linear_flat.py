"""Launch variant PIN=2: a one-token expert slice of rows whose length K is not a multiple of the chunk width,
streamed with no column wasted (an experiment, off by default and untimed; docs/NOTES.md session 49).

stream_chunks reads a row of K = 1408 (dsv2-lite's routed down projections) as a KC = 2048-wide chunk: 640 of its
columns are the next row's, multiplied by zeros, so a step carries 69% useful bytes and the phase streams at ~0.7x
a 2048-wide one's rate.  Here each warp streams a contiguous run of whole rows (a part: the slice's rows split in
BR parts) in KC-element steps, so a step's span of 128 columns may start a new row: every warp's part starts at a
row and has the same length, so where rows start in a step is the same for the whole CTA (a uniform branch).
Each row is summed in stream_chunks' order (per lane, a left fold of its spans in column order, its even and its
odd columns apart; then the lanes' tree): the same bits under the interpreter, but not on the GPU, where the two
loops compile to other fused multiply-adds (H100, docs/PERF.md session 49: equal within rounding).  Until they
agree, a token's routed down rows depend on whether its slot had one token (this stream) or two (stream_chunks),
so PIN=2 breaks batch invariance; and it measured +4% on an H100.
Needs bf16 weights (words of two columns), K a multiple of 128 with KC/2 < K < KC (at most two rows end in a
step), one matrix, no norm, no residual (an expert slice's).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import aligned
from .linear import chunk_cols, list_rows, pinned, prefetch_lines_l1, store_rows


@triton.jit
def flat_ok(n_rows, K, two, epilogue, w_ptr, KC: tl.constexpr, ALIGN: tl.constexpr, TB: tl.constexpr,
            ROWVEC: tl.constexpr):
    """Whether stream_flat runs a slice (the module's note; epilogue: a norm or a residual, which it has neither
    of).  False where the weights are not bf16 pairs; callers test PIN == 2 first, in the same `and`,
    or the flat tiles compile in (a branch on this function's constant result is not pruned)."""
    # KC <= 2048: a step's row starts are bits of an int32 (stream_flat's starts_row)
    PAIRS: tl.constexpr = ((w_ptr.dtype.element_ty == tl.bfloat16) and (ALIGN % 2 == 0) and (KC >= 256)
                           and (KC <= 2048))
    if PAIRS:
        return ((n_rows == 1) & (two == 0) & (epilogue == 0) & (K * 2 > KC) & (K < KC) & (K % 128 == 0)
                & (TB == 1) & (ROWVEC > 0))
    else:
        return False


@triton.jit
def flat_tile(w_ptr, r0, r1, K, i, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, EF: tl.constexpr):
    """Step i of every warp's part: KC elements from element i·KC of part w (rows r0 + w·RPW..), as a
    [BR, KC/128, 64] tile of words.  A step past the slice's last element reads from there instead (at most KC past
    the slice: the arena's slack); what it reads sums into rows that are never stored."""
    K = aligned(K, ALIGN)
    rpw = tl.cdiv(r1 - r0, BR)
    start = (r0 + tl.arange(0, BR) * rpw).to(tl.int64) * K + i * KC
    start = tl.minimum(start, K.to(tl.int64) * r1)  # (r1 may be a constant: a JIT argument equal to 1)
    ks = chunk_cols(0, KC // 2, 64, 2)
    return tl.load(w_ptr.to(tl.pointer_type(tl.uint32)) + (start // 2)[:, None, None] + ks,
                   eviction_policy="evict_first" if EF else "")


@triton.jit
def flat_store(v, krow, orow, out_ptr, out_ld, r0, r1, rpw, BR: tl.constexpr, ROWVEC: tl.constexpr):
    """Row krow of every warp's part: its lanes' [BR, 64] sums added (stream_chunks' tree).  No load: one here,
    inside the multiply, would drain the next tile's loads (ptxas counts a loop's loads on one scoreboard)."""
    rows = r0 + tl.arange(0, BR) * rpw + krow
    store_rows(out_ptr + orow.to(tl.int64) * out_ld + rows, tl.sum(v, axis=1), (krow < rpw) & (rows < r1), ROWVEC)


@triton.jit
def span_starts(o, K128, NS: tl.constexpr):
    """[1, NS, 1]: the first activation column of each span of a step whose first span starts at column o of its
    row (the spans run on into the next rows; o and K128 multiples of 128, so the loads are 16 bytes a lane)."""
    return wrapped((o // 128) * 128 + tl.arange(0, NS)[None, :, None] * 128, K128)


@triton.jit
def step_activations(x_row, starts, BR: tl.constexpr, NS: tl.constexpr):
    """A step's activations (span_starts) as its weight tile's columns: ([BR, NS, 64] even columns, odd columns),
    as int32 bits: span_of takes a span out of them with integer sums of zeros, which fold away."""
    s = tl.max_contiguous(tl.multiple_of(tl.arange(0, 128), 4), 4)[None, None, :] + tl.zeros((BR, 1, 1), tl.int32)
    x = tl.load(x_row + starts + s).to(tl.int32, bitcast=True)
    return tl.split(tl.reshape(x, (BR, NS, 64, 2)))


@triton.jit
def span_of(t, c: tl.constexpr, NS: tl.constexpr):
    """Span c of a [BR, NS, 64] integer tile, [BR, 64]: selects of constants and adds of zeros, which the compiler
    folds into the registers themselves (a float tile would keep an add per element: x + 0.0 is not x for -0.0)."""
    return tl.sum(tl.where(tl.arange(0, NS)[None, :, None] == c, t, 0), axis=1)


@triton.jit
def wrapped(col, K):
    """A column up to two rows past its row's start taken back into that row (KC < 2K: a step crosses at most two
    row ends)."""
    col -= tl.where(col >= K, K, 0)
    return col - tl.where(col >= K, K, 0)


@triton.jit
def stream_flat(x_ptr, x_ld, xrows_ptr, xrows_div, out_ptr, out_ld, w_ptr, r0, r1, K, w, BR: tl.constexpr,
                KC: tl.constexpr, ALIGN: tl.constexpr, ROWVEC: tl.constexpr, EF: tl.constexpr = 0,
                PINNED: tl.constexpr = 1):
    """out[orow, r0:r1] = x[xrow] @ W[r0:r1].T for a flat_ok slice (no residual), w its first tile (flat_tile at
    step 0).  As in linear.stream_pinned_k: the next tile is requested before the multiply and held there by a CTA
    barrier (PINNED); the next step's activations are asked of the L1 a step ahead and loaded after the multiply,
    where the step waits for them and for that tile."""
    NS: tl.constexpr = KC // 128  # spans a step
    orow, xrow = list_rows(r0 * 0, True, xrows_ptr, xrows_div)
    x_row = x_ptr + xrow.to(tl.int64) * aligned(x_ld, ALIGN)
    rpw = tl.cdiv(r1 - r0, BR)
    nsteps = tl.cdiv(rpw * K, KC)
    K128 = (K // 128) * 128  # K, written so the compiler sees the multiple of 128
    cur_lo = tl.zeros((BR, 64), tl.float32)  # the row being summed, per lane: its even columns, its odd ones
    cur_hi = tl.zeros((BR, 64), tl.float32)
    o = r0 * 0  # the column of the step's first span in its row
    k = r0 * 0  # that row's index in each part
    x_even, x_odd = step_activations(x_row, span_starts(o, K128, NS), BR, NS)
    w = pinned(w, PINNED)
    for i in tl.range(nsteps, loop_unroll_factor=1):
        w_next = flat_tile(w_ptr, r0, r1, K, i + 1, BR, KC, ALIGN, EF)
        o_next = wrapped(o + KC, K)  # the column where the next step's first span starts
        starts = span_starts(o_next, K128, NS)
        if PINNED:  # the next step's activations, a 128-byte line a pointer
            prefetch_lines_l1(x_row + tl.reshape(starts + tl.arange(0, 4)[None, None, :] * 32, (NS * 4,)))
        # bit c: span c starts a row (0: the last step's last span ended one; then K - o and 2K - o columns on)
        b1 = (K - o) // 128
        starts_row = (1 << b1) | (1 << (b1 + K // 128)) | ((o == 0) & (i > 0)).to(tl.int32)
        for c in tl.static_range(NS):
            if (starts_row & (1 << c)) != 0:  # a uniform branch, once or twice a step (its store keeps it one)
                flat_store(cur_lo + cur_hi, k, orow, out_ptr, out_ld, r0, r1, rpw, BR, ROWVEC)
                cur_lo = tl.zeros((BR, 64), tl.float32)
                cur_hi = tl.zeros((BR, 64), tl.float32)
                k += 1
            wc = span_of(w, c, NS)
            xe = span_of(x_even, c, NS).to(tl.float32, bitcast=True)
            xo = span_of(x_odd, c, NS).to(tl.float32, bitcast=True)
            cur_lo += (wc << 16).to(tl.float32, bitcast=True) * xe
            cur_hi += (wc & 0xFFFF0000).to(tl.float32, bitcast=True) * xo
        o = o_next
        x_even, x_odd = step_activations(x_row, starts, BR, NS)
        w = pinned(w_next, PINNED)
    if o == 0:  # the last row ended with the last step
        flat_store(cur_lo + cur_hi, k, orow, out_ptr, out_ld, r0, r1, rpw, BR, ROWVEC)
