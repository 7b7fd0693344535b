"""HELPER_RECV / HELPER_SEND: a persistent helper kernel's side of a helper call (helper_card/persistent.py).

The helper GPU of helper_card/kernel_helper.py is host-paced: a host thread notices each call in the
mailbox, writes the helper's slot table and replays a graph on the helper GPU.  A persistent helper
kernel takes the host out of the call: launched once per main step, beside it, per call site it runs
- HELPER_RECV: wait (bounded) until the main step publishes the site's mailbox (its sequence word
  equals the step's epoch: the kernel's own launch count plus a fixed offset, epoch0) or passes it
  without a call (its BOX_PASSED word, which HELPER_CALL writes instead, reaches the step; or the
  host's CTL_DONE does, after a failed step), then write the helper's slot table (the routed table
  with only the slots whose expert is the helper's, `onh`: the host's placement for the step, as the
  host-paced helper chooses them) and copy the token rows in;
- the site's expert tiles (the main plan's own, as kernel_helper's site plans run them: bit for bit);
- HELPER_SEND: the helper's rows, their mask and the acknowledgement into the mailbox, as
  ops.helper.publish_rows does for the host-paced helper.
A passed site's table is empty, so its tiles and its SEND do nothing.  A RECV whose wait outlives its
bound passes its site too (and marks `gaveup`, so the kernel's later sites pass at once) instead of
raising the error flag: the main step may have failed before the site, and a main step that does
publish later gets no answer and reports its own bounded error.  On the main side only HELPER_CALL's
skip changed: it writes BOX_PASSED.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graph import isa
from graph.isa import Buf, box_layout

from .common import (ERR_HEADER, ERR_PER_WORKER, fence_sys, fld, load_acquire_sys, off, past_bound, record_stop,
                     store_release_sys)
from .fields import (BOX_ACK, BOX_HEADER, BOX_PASSED, BOX_SEQ, BOX_T_ANSWER, HELPER_RECV_BOX_OFF,
                     HELPER_RECV_DONE_OFF, HELPER_RECV_EPOCH0, HELPER_RECV_GAVEUP_OFF, HELPER_RECV_K, HELPER_RECV_N,
                     HELPER_RECV_ONH_OFF, HELPER_RECV_S, HELPER_RECV_SEQW_OFF, HELPER_RECV_ST_OFF,
                     HELPER_RECV_TOPK, HELPER_RECV_X_LD, HELPER_RECV_X_OFF, HELPER_SEND_BOX_OFF, HELPER_SEND_K,
                     HELPER_SEND_N, HELPER_SEND_S, HELPER_SEND_SEQW_OFF, HELPER_SEND_ST_OFF, HELPER_SEND_TOPK,
                     HELPER_SEND_Y_LD, HELPER_SEND_Y_OFF)
from .helper import stamp

GAVE_UP = tl.constexpr(4)  # past_bound's reason for a RECV that outlived its bound: not an error


# ---- reference semantics (the plan interpreter cannot wait: the mailbox must already say) ----------
def reference_recv(task, mem) -> None:
    """mem.epoch: the helper kernel's launch number (the Triton kernel's own epoch) that runs the task."""
    S, N, K, P = task["S"], task["N"], task["K"], task["N"] * task["topk"]
    target = mem.epoch + task["epoch0"]
    seq = int(mem.flat(task, "box", isa.BOX_SEQ, 1)[0])
    far = max(int(mem.flat(task, "box", isa.BOX_PASSED, 1)[0]), int(mem.flat(task, "done", 0, 1)[0]),
              int(mem.flat(task, "gaveup", 0, 1)[0]))
    if seq < target and far < target:
        raise RuntimeError(f"layer {task['layer']}: HELPER_RECV found neither a call of step {target} nor the step "
                           "past it (the interpreter cannot wait for the main step)")
    st = mem.flat(task, "st", 0, 2 * S + S * P)
    if seq != target:  # passed (or a later step's call: that step's kernel answers it)
        st[:S], st[S: 2 * S] = -1, 0
        mem.flat(task, "seqw", 0, 1).fill_(0)
        return
    box = box_layout(S, P, N, K)
    table = mem.flat(task, "box", box["table"], 2 * S + S * P).to(st.device)
    experts = table[:S].long()
    onh = mem.flat(task, "onh", 0, task["E"]).to(st.device)
    mine = (experts >= 0) & (onh[experts.clamp(min=0)] != 0)
    st.copy_(table)
    st[:S] = torch.where(mine, table[:S], -1)
    st[S: 2 * S] = torch.where(mine, table[S: 2 * S], 0)
    rows = mem.flat(task, "box", box["x"], N * K).view(torch.float32).view(N, K)
    mem.mat(task, "x", N, K).copy_(rows)
    mem.flat(task, "seqw", 0, 1).fill_(seq)


def reference_send(task, mem) -> None:
    S, N, K, P = task["S"], task["N"], task["K"], task["N"] * task["topk"]
    seq = int(mem.flat(task, "seqw", 0, 1)[0])
    if seq == 0:
        return
    st = mem.flat(task, "st", 0, 2 * S + S * P).long().cpu()
    mask = torch.zeros(P, dtype=torch.bool)
    for s in range(S):
        if st[s] >= 0:
            mask[st[2 * S + s * P: 2 * S + s * P + st[S + s]]] = True
    box = box_layout(S, P, N, K)
    ans = mem.flat(task, "box", box["ans"], P * K).view(torch.float32).view(P, K)
    ans[mask.to(ans.device)] = mem.mat(task, "y", P, K)[mask.to(mem.bufs[Buf.A].device)].to(ans.device)
    mem.flat(task, "box", box["mask"], P).copy_(mask.to(torch.int32))
    mem.flat(task, "box", isa.BOX_ACK, 1).fill_(seq)


# ---- GPU bodies -------------------------------------------------------------------------------
@triton.jit
def passed(box, done, gaveup, COMPILED: tl.constexpr, BD: tl.constexpr):
    """The latest step known to have passed the site without a call: the box's BOX_PASSED word, CTL_DONE
    (both read with a system-scope acquire) and the kernel's gave-up mark, the same in every thread."""
    far = tl.maximum(load_acquire_sys(box + BOX_PASSED, COMPILED, BD), load_acquire_sys(done, COMPILED, BD))
    return tl.maximum(far, tl.load(gaveup, cache_modifier=".cg"))


@triton.jit
def recv_body(word, t, epoch, A, I, HB, err, pid, TIMEOUT_NS: tl.constexpr, MAX_SPINS: tl.constexpr,
              COMPILED: tl.constexpr, BD: tl.constexpr):
    """The site's call of the step this launch answers in, or an empty table when the step passed the
    site without one; 0 when this worker must stop (another worker failed)."""
    S, N, K = fld(word, HELPER_RECV_S), fld(word, HELPER_RECV_N), fld(word, HELPER_RECV_K)
    P = N * fld(word, HELPER_RECV_TOPK)
    box, done = HB + off(word, HELPER_RECV_BOX_OFF), HB + off(word, HELPER_RECV_DONE_OFF)
    st, onh = I + off(word, HELPER_RECV_ST_OFF), I + off(word, HELPER_RECV_ONH_OFF)
    seqw, gaveup = I + off(word, HELPER_RECV_SEQW_OFF), I + off(word, HELPER_RECV_GAVEUP_OFF)
    target = epoch + fld(word, HELPER_RECV_EPOCH0)  # fixed by the launch: no host word to race with
    state = err + ERR_HEADER + pid * ERR_PER_WORKER
    far = passed(box, done, gaveup, COMPILED, BD)
    seq = load_acquire_sys(box + BOX_SEQ, COMPILED, BD)
    spins = 0
    reason = 0
    first = tl.zeros((), tl.int32)
    while (seq < target) & (far < target) & (reason == 0):
        far = passed(box, done, gaveup, COMPILED, BD)
        seq = load_acquire_sys(box + BOX_SEQ, COMPILED, BD)
        spins += 1
        reason, first = past_bound(err, state, spins, first, TIMEOUT_NS, MAX_SPINS, COMPILED, GAVE_UP)
    ok = 1
    if reason == 2:  # another worker failed
        ok = 0
        record_stop(err, state, reason, t, -1, seq, target, GAVE_UP)
    else:
        if reason == GAVE_UP:
            tl.store(gaveup, target)  # the kernel's later sites pass at once (read after this task's release)
        called = seq == target  # (a later step's call, or pass, is that step's kernel's to answer)
        table = box + BOX_HEADER + (P + 31) // 32 * 32 + P * K  # box_layout's "table"
        for s0 in range(0, S, BD):
            s = s0 + tl.arange(0, BD)
            m = s < S
            expert = tl.load(table + s, mask=m & called, other=-1)
            count = tl.load(table + S + s, mask=m & called, other=0)
            mine = (expert >= 0) & (tl.load(onh + tl.maximum(expert, 0), mask=m & (expert >= 0), other=0) != 0)
            tl.store(st + s, tl.where(mine, expert, -1), mask=m)
            tl.store(st + S + s, tl.where(mine, count, 0), mask=m)
        if called:
            for i0 in range(0, S * P, BD):  # pair ids (read only where a slot is set)
                i = i0 + tl.arange(0, BD)
                tl.store(st + 2 * S + i, tl.load(table + 2 * S + i, mask=i < S * P), mask=i < S * P)
            x, x_ld = A + off(word, HELPER_RECV_X_OFF), fld(word, HELPER_RECV_X_LD)
            rows = table + (2 * S + S * P + 31) // 32 * 32  # box_layout's "x"
            for r in range(N):
                for c0 in range(0, K, BD):
                    c = c0 + tl.arange(0, BD)
                    v = tl.load(rows + r * K + c, mask=c < K)
                    tl.store(x + r * x_ld + c, v.to(tl.float32, bitcast=True), mask=c < K)
            tl.store(seqw, seq)
        else:
            tl.store(seqw, 0)
    return ok


@triton.jit
def send_body(word, A, I, HB, COMPILED: tl.constexpr, BD: tl.constexpr):
    """The helper's rows of a call out, their mask, then its acknowledgement (nothing for a skipped site)."""
    S, N, K = fld(word, HELPER_SEND_S), fld(word, HELPER_SEND_N), fld(word, HELPER_SEND_K)
    P = N * fld(word, HELPER_SEND_TOPK)
    st, seqw = I + off(word, HELPER_SEND_ST_OFF), I + off(word, HELPER_SEND_SEQW_OFF)
    seq = tl.load(seqw, cache_modifier=".cg")
    if seq != 0:
        box = HB + off(word, HELPER_SEND_BOX_OFF)
        y, y_ld = A + off(word, HELPER_SEND_Y_OFF), fld(word, HELPER_SEND_Y_LD)
        mask, ans = box + BOX_HEADER, box + BOX_HEADER + (P + 31) // 32 * 32
        for p0 in range(0, P, BD):
            p = p0 + tl.arange(0, BD)
            tl.store(mask + p, tl.zeros([BD], tl.int32), mask=p < P)
        tl.debug_barrier()  # every zero before any mark below (another thread may store it)
        for s in range(S):
            expert = tl.load(st + s, cache_modifier=".cg")
            if expert >= 0:
                for j in range(tl.load(st + S + s, cache_modifier=".cg")):
                    p = tl.load(st + 2 * S + s * P + j, cache_modifier=".cg")
                    for c0 in range(0, K, BD):
                        c = c0 + tl.arange(0, BD)
                        v = tl.load(y + p * y_ld + c, mask=c < K, cache_modifier=".cg")
                        tl.store(ans + p * K + c, v.to(tl.int32, bitcast=True), mask=c < K)
                    tl.store(mask + p, 1)
        stamp(box + BOX_T_ANSWER, COMPILED)
        fence_sys(COMPILED)  # this thread's rows and marks reach host memory before the barrier...
        tl.debug_barrier()
        store_release_sys(box + BOX_ACK, seq, COMPILED)  # ...and the acknowledgement after all of them
