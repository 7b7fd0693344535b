"""HELPER_CALL / HELPER_WAIT: experts that live on a helper device (see helper_card/).

The step routes as usual (ROUTE's slot table).  HELPER_CALL then splits the
table: slots whose expert the placement map marks ON_HELPER are published to the
helper (their token rows, expert ids and a sequence number) and emptied in the
main table, so the main expert tasks skip them.  The helper computes those
experts' rows (the same tiles, in the same order) into `hy`.  HELPER_WAIT runs
after the main experts: it waits, bounded, for the helper's acknowledgement of
that sequence number and merges the helper rows into the expert output.  A
layer none of whose tokens route to the helper publishes no request and waits for
nothing (the megakernel writes the step into one word of the mailbox, BOX_PASSED,
a system-scope store nothing waits on: a persistent helper kernel reads there that
the site has nothing for it).

Two runners, one contract (graph.isa.box_layout):
- the plan interpreter calls the link attached to the plan's Memory
  (helper_card.link.PlanLink) directly, and mirrors the request into the mailbox;
- the megakernel's bodies below write the request into the call site's mailbox in
  host-mapped memory (Buf.H) and publish the step's epoch as its sequence number
  with a system-scope release; the host's helper service (helper_card/mailbox.py)
  answers there, and HELPER_WAIT acquires the acknowledgement, bounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graph.isa import box_layout

from .common import (ERR_HEADER, ERR_PER_WORKER, fence_sys, fld, load_acquire_sys, now_ns, off, past_bound,
                     record_stop, store_release_sys)
from .fields import (BOX_ACK, BOX_HEADER, BOX_PASSED, BOX_SEQ, BOX_T_ACKED, BOX_T_ANSWER, BOX_T_PUB, BOX_WAIT_NS,
                     HELPER_CALL_BOX_OFF, HELPER_CALL_K, HELPER_CALL_MAIL_OFF, HELPER_CALL_MAP_OFF, HELPER_CALL_N,
                     HELPER_CALL_S, HELPER_CALL_ST2_OFF, HELPER_CALL_ST_OFF, HELPER_CALL_TOPK, HELPER_CALL_X_LD,
                     HELPER_CALL_X_OFF, HELPER_WAIT_BOX_OFF, HELPER_WAIT_H, HELPER_WAIT_MAIL_OFF, HELPER_WAIT_N,
                     HELPER_WAIT_OUT_OFF, HELPER_WAIT_TOPK, HELPER_WAIT_Y_OFF, ON_HELPER)
from .moe import slot_pairs

HELPER_TIMEOUT = tl.constexpr(3)  # the watchdog reason HELPER_WAIT records (1: a counter wait, 2: stopped by another)


def helper_slots(task, mem) -> list[tuple[int, int, torch.Tensor]]:
    """(slot, expert, pair ids) of the step's slots whose expert lives on the helper."""
    E = task["E"]
    emap = mem.flat(task, "map", 0, E)
    out = []
    for slot in range(task["S"]):
        expert, pairs = slot_pairs(task, mem, slot)
        if expert >= 0 and int(emap[expert]) == ON_HELPER.value:
            out.append((slot, expert, pairs))
    return out


def reference_call(task, mem) -> None:
    S, N, K, P = task["S"], task["N"], task["K"], task["N"] * task["topk"]
    size = 2 * S + S * P
    table = mem.flat(task, "st", 0, size).clone()
    routed = table.clone()
    remote = helper_slots(task, mem)
    for slot, _, _ in remote:  # the main expert tasks skip these slots
        table[slot] = -1
        table[S + slot] = 0
    mem.flat(task, "st2", 0, size).copy_(table)
    box = box_layout(S, P, N, K)
    # the request as the megakernel's body writes it; not BOX_PASSED (the link numbers calls per layer,
    # not by step, and no persistent helper reads an interpreted step's mailboxes)
    if mem.present(task, "box"):
        mem.flat(task, "box", box["table"], size).copy_(routed)
    link = getattr(mem, "helper", None)
    if link is not None:  # routing statistics for the migration policy
        link.routed(task["layer"], routed[:S], routed[S: 2 * S])
    mail = mem.flat(task, "mail", 0, 2)
    if not remote:
        mail.copy_(torch.tensor([0, 0], dtype=torch.int32))
        if link is not None:
            link.skipped(task["layer"])
        return
    if link is None:
        raise RuntimeError(f"layer {task['layer']}: the expert map sends experts "
                           f"{[e for _, e, _ in remote]} to a helper, but no helper is attached to this runner")
    x = mem.mat(task, "x", N, K)
    seq = link.publish(task["layer"], task.signal, [(e, pairs) for _, e, pairs in remote], x)
    mail.copy_(torch.tensor([seq, len(remote)], dtype=torch.int32))
    if mem.present(task, "box"):
        mem.flat(task, "box", box["x"], N * K).copy_(x.float().reshape(-1).view(torch.int32))
        mem.flat(task, "box", BOX_SEQ.value, 1).fill_(seq)


def reference_wait(task, mem) -> None:
    P, H = task["N"] * task["topk"], task["H"]
    out = mem.mat(task, "out", P, H, ld=H)
    out.copy_(mem.mat(task, "y", P, H, ld=H))
    seq, calls = (int(v) for v in mem.flat(task, "mail", 0, 2))
    if calls == 0:
        return
    rows = mem.helper.wait(task["layer"], seq)  # bounded; raises HelperTimeout or falls back
    for pairs, y in rows:
        out[pairs.to(out.device)] = y.to(out.device, out.dtype)


# ---- GPU bodies ----------------------------------------------------------------------------
@triton.jit
def stamp(word, COMPILED: tl.constexpr):
    """The device timer into the int64 at int32 pointer `word` (8-byte aligned): a call's timeline."""
    if COMPILED:
        tl.store(word.to(tl.pointer_type(tl.int64)), now_ns(COMPILED))


@triton.jit
def call_body(word, A, I, HB, epoch, COMPILED: tl.constexpr, BD: tl.constexpr):
    """Split the slot table; publish it (whole: routing statistics) and the token rows, with the step's
    epoch as sequence number, when a slot's expert is on the helper."""
    S, N, K = fld(word, HELPER_CALL_S), fld(word, HELPER_CALL_N), fld(word, HELPER_CALL_K)
    P = N * fld(word, HELPER_CALL_TOPK)
    st, st2 = I + off(word, HELPER_CALL_ST_OFF), I + off(word, HELPER_CALL_ST2_OFF)
    emap, mail = I + off(word, HELPER_CALL_MAP_OFF), I + off(word, HELPER_CALL_MAIL_OFF)
    box = HB + off(word, HELPER_CALL_BOX_OFF)
    table = box + BOX_HEADER + (P + 31) // 32 * 32 + P * K  # box_layout's "table"
    remote = 0
    for s0 in range(0, S, BD):
        s = s0 + tl.arange(0, BD)
        m = s < S
        expert = tl.load(st + s, mask=m, other=-1, cache_modifier=".cg")
        count = tl.load(st + S + s, mask=m, other=0, cache_modifier=".cg")
        where = tl.load(emap + tl.maximum(expert, 0), mask=m & (expert >= 0), other=0, cache_modifier=".cg")
        helper = (expert >= 0) & (where == ON_HELPER)
        remote += tl.sum(helper.to(tl.int32), axis=0)
        tl.store(st2 + s, tl.where(helper, -1, expert), mask=m)
        tl.store(st2 + S + s, tl.where(helper, 0, count), mask=m)
        tl.store(table + s, expert, mask=m)
        tl.store(table + S + s, count, mask=m)
    for i0 in range(0, S * P, BD):  # pair ids: the same in both tables (read only where a slot is set)
        i = i0 + tl.arange(0, BD)
        ids = tl.load(st + 2 * S + i, mask=i < S * P, cache_modifier=".cg")
        tl.store(st2 + 2 * S + i, ids, mask=i < S * P)
        tl.store(table + 2 * S + i, ids, mask=i < S * P)
    if remote > 0:
        x, x_ld = A + off(word, HELPER_CALL_X_OFF), fld(word, HELPER_CALL_X_LD)
        rows = table + (2 * S + S * P + 31) // 32 * 32  # box_layout's "x"
        for r in range(N):
            for c0 in range(0, K, BD):
                c = c0 + tl.arange(0, BD)
                v = tl.load(x + r * x_ld + c, mask=c < K, cache_modifier=".cg")
                tl.store(rows + r * K + c, v.to(tl.int32, bitcast=True), mask=c < K)
        stamp(box + BOX_T_PUB, COMPILED)
        fence_sys(COMPILED)  # this thread's rows reach host memory before the barrier...
        tl.debug_barrier()
        store_release_sys(box + BOX_SEQ, epoch, COMPILED)  # ...and the sequence number after all of them
        tl.store(mail, epoch)
    else:
        # no request: only this word, for a persistent helper kernel (a system-scope store: seen in time)
        store_release_sys(box + BOX_PASSED, epoch, COMPILED)
        tl.store(mail, 0)
    tl.store(mail + 1, remote)


@triton.jit
def wait_body(word, t, A, I, HB, err, pid, TIMEOUT_NS: tl.constexpr, MAX_SPINS: tl.constexpr,
              COMPILED: tl.constexpr, BD: tl.constexpr):
    """out = y with the helper's rows merged in, once the helper acknowledged mail[0] (bounded wait).
    Returns 0 when this worker must stop (the helper timed out, or another worker failed)."""
    P, K = fld(word, HELPER_WAIT_N) * fld(word, HELPER_WAIT_TOPK), fld(word, HELPER_WAIT_H)
    y, out = A + off(word, HELPER_WAIT_Y_OFF), A + off(word, HELPER_WAIT_OUT_OFF)
    mail, box = I + off(word, HELPER_WAIT_MAIL_OFF), HB + off(word, HELPER_WAIT_BOX_OFF)
    seq = tl.load(mail, cache_modifier=".cg")
    calls = tl.load(mail + 1, cache_modifier=".cg")
    ok = 1
    if calls > 0:
        start = now_ns(COMPILED)  # this thread's: the wait it measures is a metric, not a decision
        state = err + ERR_HEADER + pid * ERR_PER_WORKER
        seen = load_acquire_sys(box + BOX_ACK, COMPILED, BD)
        spins = 0
        reason = 0
        first = tl.zeros((), tl.int32)
        while (seen < seq) & (reason == 0):
            seen = load_acquire_sys(box + BOX_ACK, COMPILED, BD)
            spins += 1
            reason, first = past_bound(err, state, spins, first, TIMEOUT_NS, MAX_SPINS, COMPILED, HELPER_TIMEOUT)
        if reason != 0:
            ok = 0
            record_stop(err, state, reason, t, -1, seen, seq, HELPER_TIMEOUT)
        else:
            t_acked = now_ns(COMPILED)
            tl.store(box + BOX_WAIT_NS, tl.minimum(t_acked - start, 2147483647).to(tl.int32))
            tl.store((box + BOX_T_ACKED).to(tl.pointer_type(tl.int64)), t_acked)
    if ok == 1:
        mask, ans = box + BOX_HEADER, box + BOX_HEADER + (P + 31) // 32 * 32
        for p0 in range(0, P, BD):
            lane = tl.arange(0, BD)
            marks = tl.zeros([BD], tl.int32)
            if calls > 0:  # host memory the helper wrote, after this thread's acquire above: one read a block
                marks = tl.load(mask + p0 + lane, mask=p0 + lane < P, other=0)
            for p in range(p0, tl.minimum(p0 + BD, P)):
                mine = tl.sum(tl.where(lane == p - p0, marks, 0), axis=0)
                for c0 in range(0, K, BD):
                    c = c0 + tl.arange(0, BD)
                    if mine != 0:
                        v = tl.load(ans + p * K + c, mask=c < K).to(tl.float32, bitcast=True)
                    else:
                        v = tl.load(y + p * K + c, mask=c < K, cache_modifier=".cg")
                    tl.store(out + p * K + c, v, mask=c < K)
    return ok


# ---- a helper GPU's call (helper_card/kernel_helper.py): plain kernels around the site's megakernel ----
# Either side of a copy may be host memory the GPU maps (a mailbox, pinned staging): kernels reach it
# from any GPU, where a copy engine might not treat another context's pinned memory as pinned.
@triton.jit
def copy_rows(src, src_ld, dst, dst_ld, cols, gate, seq_out, COMPILED: tl.constexpr, SAVE_SEQ: tl.constexpr,
              BLOCK: tl.constexpr):
    """dst[r, :cols] = src[r, :cols] for row r = program id, each thread's loads after its own acquire of
    `gate` (the call's sequence word, which the host writes after the rows): nothing read from host
    memory comes from a cache filled by an earlier call.  SAVE_SEQ: the value acquired is also kept
    in seq_out, so the acknowledgement names the call whose table this copy read."""
    seq = load_acquire_sys(gate, COMPILED, 128)
    r = tl.program_id(0).to(tl.int64)
    if SAVE_SEQ:
        if r == 0:
            tl.store(seq_out, seq)
    for c0 in range(0, cols, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        tl.store(dst + r * dst_ld + c, tl.load(src + r * src_ld + c, mask=c < cols), mask=c < cols)


@triton.jit
def publish_rows(src, src_ld, dst, mask, rows, cols, ack, gate, seq, err, COMPILED: tl.constexpr,
                 BLOCK: tl.constexpr):
    """A helper GPU's answer, in one program: dst[r, :cols] = src[r, :cols] for the rows the host marked
    in `mask` (the mailbox's rows; the others are main's), then the acknowledgement seq[0] (on the
    device: the call whose table was read), released at system scope after every thread's rows.
    Nothing when the site's kernel stopped on its watchdog (err[0] != 0): its rows are stale, and
    main's bounded wait reports the helper instead."""
    if tl.load(err, cache_modifier=".cg") == 0:
        load_acquire_sys(gate, COMPILED, 128)  # the host wrote the mask before the sequence word `gate`
        for r in range(rows):
            if tl.load(mask + r) != 0:
                for c0 in range(0, cols, BLOCK):
                    c = c0 + tl.arange(0, BLOCK)
                    tl.store(dst + r * cols + c, tl.load(src + r * src_ld + c, mask=c < cols), mask=c < cols)
        stamp(ack + (BOX_T_ANSWER - BOX_ACK), COMPILED)
        fence_sys(COMPILED)
        tl.debug_barrier()
        store_release_sys(ack, tl.load(seq), COMPILED)
