"""HELPER_CALL / HELPER_WAIT: experts that live on a helper device (see helper_card/).

The step routes as usual (ROUTE's slot table).  HELPER_CALL then splits the
table: slots whose expert the placement map marks ON_HELPER are published to the
helper (their token rows, expert ids and a sequence number) and emptied in the
main table, so the main expert tasks skip them.  The helper computes those
experts' rows (the same tiles, in the same order) into `hy`.  HELPER_WAIT runs
after the main experts: it waits, bounded, for the helper's acknowledgement of
that sequence number and merges the helper rows into the expert output.  A
layer none of whose tokens route to the helper publishes nothing and waits for
nothing.

Only the interpreter runs these ops so far: the link to the helper is the
`helper` object attached to the plan's Memory (helper_card.link.HelperLink).
"""

from __future__ import annotations

import torch

from graph.isa import ON_HELPER

from .moe import slot_pairs


def helper_slots(task, mem) -> list[tuple[int, int, torch.Tensor]]:
    """(slot, expert, pair ids) of the step's slots whose expert lives on the helper."""
    E = task["E"]
    emap = mem.flat(task, "map", 0, E)
    out = []
    for slot in range(task["S"]):
        expert, pairs = slot_pairs(task, mem, slot)
        if expert >= 0 and int(emap[expert]) == ON_HELPER:
            out.append((slot, expert, pairs))
    return out


def reference_call(task, mem) -> None:
    S, P = task["S"], task["N"] * task["topk"]
    size = 2 * S + S * P
    table = mem.flat(task, "st", 0, size).clone()
    routed = table.clone()
    remote = helper_slots(task, mem)
    for slot, _, _ in remote:  # the main expert tasks skip these slots
        table[slot] = -1
        table[S + slot] = 0
    mem.flat(task, "st2", 0, size).copy_(table)
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
    seq = link.publish(task["layer"], task.signal, [(e, pairs) for _, e, pairs in remote],
                       mem.mat(task, "x", task["N"], task["K"]))
    mail.copy_(torch.tensor([seq, len(remote)], dtype=torch.int32))


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
