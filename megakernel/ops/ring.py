"""The weight ring (launch variant RING = S > 0): a worker's weight chunks copied into S shared-memory slots by
the SM's bulk-copy engine (cp.async.bulk, one copy per weight row piece, completion counted on a slot's
mbarrier), so a task can have S chunks in flight before its dependency wait and while it multiplies, with no
register holding them: the register stream keeps one 32 KB chunk in flight (DEPTH=2, a second, cost more
registers than it won: docs/PERF.md run 13).  The consumer reads its tile from the slot with the very layout a
global load would give it, so the arithmetic, and every bit of the result, is the register stream's.

Layout: the last RING_BYTES of the CTA's dynamic shared memory (the host reserves them past what Triton's own
code uses: runtime.reserve_ring), S slots of BR x KC weights (row stride KC), then S mbarriers of 8 bytes.
Fill number f (a worker's running count, carried across tasks by the persistent loop) lands in slot f % S,
whose mbarrier completes phase f // S.  Inline PTX only: the Triton interpreter refuses the variant.

Nothing here waits unboundedly: a slot that does not fill within RING_TIMEOUT_NS traps (a copy that never lands
is a bug in its sizes, not a stalled dependency, which the counter watchdog reports)."""

from __future__ import annotations

import ctypes

import triton
import triton.language as tl

RING_TIMEOUT_NS = tl.constexpr(1_000_000_000)
RING_TAIL = 128  # bytes after the slots: the mbarriers (8 each, S <= 16)
MAX_SLOTS = 16
RING_BARS = tl.constexpr(MAX_SLOTS)  # mbarriers the init loop covers (those past S are left alone)


def ring_bytes(slots: int, br: int, kc: int, itemsize: int) -> int:
    """Shared memory the ring takes: the slots, then the mbarriers."""
    return slots * br * kc * itemsize + RING_TAIL


def reserve_ring(compiled, nbytes: int) -> None:
    """A loaded Triton kernel (CompiledKernel) launched from now on with nbytes more dynamic shared memory than its
    own code uses, and allowed to: the ring lives there.  Once per kernel object (Triton's cache shares it).
    A ring that does not fit beside the kernel's own shared memory in a block (the current device's opt-in limit)
    is refused, naming both."""
    if getattr(compiled, "ring_reserved", 0) == nbytes:
        return
    own = -(-compiled.metadata.shared // RING_TAIL) * RING_TAIL
    if own == 0:  # global_smem, the ring's base symbol, is declared only by kernels that use shared memory
        raise RuntimeError(f"{compiled.name} uses no shared memory of its own: the weight ring has no base symbol")
    total = own + nbytes
    driver = triton.runtime.driver.active
    limit = driver.utils.get_device_properties(driver.get_current_device())["max_shared_mem"]
    if total > limit:
        raise RuntimeError(f"a {nbytes} B weight ring beside {compiled.name}'s own {own} B of shared memory needs "
                           f"{total} B, more than the {limit} B a block may have: fewer slots (RING)")
    cuda = ctypes.CDLL("libcuda.so.1")
    fn = ctypes.c_void_p(compiled.function)
    max_dynamic, carveout, prefer_shared = 8, 9, 1  # cuda.h: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ...
    for call, rc in (("cuFuncSetCacheConfig", cuda.cuFuncSetCacheConfig(fn, prefer_shared)),
                     ("cuFuncSetAttribute(carveout)", cuda.cuFuncSetAttribute(fn, carveout, 100)),
                     ("cuFuncSetAttribute(max dynamic shared)", cuda.cuFuncSetAttribute(fn, max_dynamic, total))):
        if rc:
            raise RuntimeError(f"{call} on {compiled.name} for a {nbytes} B weight ring beside {own} B of its own "
                               f"returned CUresult {rc}")
    compiled.metadata = compiled.metadata._replace(shared=total)
    compiled.packed_metadata = (compiled.metadata.num_warps, compiled.metadata.num_ctas, total)
    compiled.ring_reserved = nbytes


@triton.jit
def ring_base(RING_BYTES: tl.constexpr):
    """The ring's shared-memory address (32 bits): the last RING_BYTES of the dynamic shared memory.
    Triton's code uses the first metadata.shared bytes from global_smem."""
    return tl.inline_asm_elementwise(
        "{ .reg .u32 d; mov.u32 d, %dynamic_smem_size; mov.u32 $0, global_smem; add.u32 $0, $0, d; "
        "sub.u32 $0, $0, $1; }", "=r,r", [tl.cast(RING_BYTES, tl.int32)], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def ring_init(S: tl.constexpr, SLOT: tl.constexpr, RING_BYTES: tl.constexpr):
    """At the kernel's start: every slot zeroed (a chunk's columns past K are copied from nowhere and are
    multiplied by zero activations, so they must hold finite values) and each mbarrier set to one arrival
    (the issuing thread's expect-tx) a phase; ordered before any bulk copy (the async proxy) by a fence and the
    CTA barrier."""
    base = ring_base(RING_BYTES)
    v16 = tl.arange(0, SLOT // 16)  # a slot's 16-byte pieces, spread over the CTA's threads
    for s in tl.static_range(S):
        tl.inline_asm_elementwise(
            "{ .reg .u32 z; mov.u32 z, 0; st.shared.v4.b32 [$1], {z, z, z, z}; mov.u32 $0, 0; }",
            "=r,r", [base + s * SLOT + v16 * 16], dtype=tl.int32, is_pure=False, pack=1)
    bars = tl.arange(0, RING_BARS)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.lt.s32 p, $2, $3; @p mbarrier.init.shared::cta.b64 [$1], 1; mov.u32 $0, 0; }",
        "=r,r,r,r", [base + S * SLOT + bars * 8, bars, tl.full((RING_BARS,), S, tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1)
    tl.inline_asm_elementwise("fence.mbarrier_init.release.cluster; fence.proxy.async.shared::cta; mov.u32 $0, 0;",
                              "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def ring_issue(base, slot, src, row_bytes, nbytes, nrows, after, S: tl.constexpr, SLOT: tl.constexpr,
               ROW: tl.constexpr):
    """Fill `slot` with nrows (<= the CTA's threads) row pieces of nbytes each: row i from src + i * row_bytes
    (global, 16-byte aligned) to the slot's row i (ROW bytes apart).  Thread 0 arms the slot's mbarrier with the
    total bytes (its one arrival), threads 0..nrows-1 each issue their row's copy, evict-first in the L2 (a step
    reads each weight once).  `after` (an operand the copy does not use): a value every thread of the CTA has
    computed from its last reads of the slot (a cross-warp sum: a barrier), so no copy can start before them."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p, q; .reg .u32 t, d, b, n; .reg .u64 g, o, pol; "
        "mov.u32 t, %tid.x; add.u32 b, $1, $6; "
        "setp.eq.u32 p, t, 0; mul.lo.u32 n, $4, $5; "
        "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [b], n; "
        "setp.lt.u32 q, t, $5; mad.lo.u32 d, t, $7, $8; "
        "cvt.u64.u32 o, t; mad.lo.u64 g, o, $3, $2; "
        "createpolicy.fractional.L2::evict_first.b64 pol, 1.0; "
        "@q cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [d], [g], $4, [b], pol; "
        "mov.u32 $0, 0; }",
        "=r,r,l,l,r,r,r,r,r,f",
        [base, src.to(tl.int64), row_bytes.to(tl.int64), nbytes, nrows, S * SLOT + slot * 8, tl.cast(ROW, tl.int32),
         base + slot * SLOT, after.to(tl.float32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def ring_wait(base, slot, parity, S: tl.constexpr, SLOT: tl.constexpr):
    """Every thread waits for `slot`'s mbarrier to complete phase `parity` (the copies landed), up to
    RING_TIMEOUT_NS of the device timer, then traps.  Returns 0, a value the slot's reads must add to their
    addresses: the compiler knows nothing of it, so it cannot move them before the wait."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p, q; .reg .u32 b; .reg .u64 t0, t1; add.u32 b, $1, $2; mov.u64 t0, %globaltimer; "
        "RING_WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [b], $3; @p bra RING_DONE; "
        "mov.u64 t1, %globaltimer; sub.u64 t1, t1, t0; setp.lt.u64 q, t1, $4; @q bra RING_WAIT; trap; "
        "RING_DONE: mov.u32 $0, 0; }",
        "=r,r,r,r,l", [base, S * SLOT + slot * 8, parity, tl.cast(RING_TIMEOUT_NS, tl.int64)], dtype=tl.int32,
        is_pure=False, pack=1)


@triton.jit
def ring_read(addrs):
    """32-bit words from shared-memory addresses, each thread its own elements.  Pure, so the copies Triton's
    layout passes make of it (one per layout a consumer wants) leave no dead loads behind; ordered by data alone:
    after the wait through its address (ring_wait's 0), before the slot's refill through ring_issue's `after`."""
    return tl.inline_asm_elementwise("ld.shared.b32 $0, [$1];", "=r,r", [addrs], dtype=tl.uint32, is_pure=True,
                                     pack=1)


@triton.jit
def ring_next(slot, parity, S: tl.constexpr):
    """The fill after (slot, parity): the next slot, its phase flipping when the ring wraps."""
    slot += 1
    wrap = slot == S
    return tl.where(wrap, 0, slot), tl.where(wrap, parity ^ 1, parity)
