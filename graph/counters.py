"""Which ops signal one counter together (compile option shared_counters, on by default).

A task polls its waits one after the other, each poll an L2 round trip (ops/common.wait_task); a task that
waits on three producers ending together pays two round trips after the last one ends.  llama-1b's attention
waits on q_proj, k_proj and v_proj, dsv2-lite's on q_absorb, q_rope, k_rope and kv_a_norm: ~0.7 us later
than a one-wait op on each layer's chain in session 30's traces (tools/replay.py --layer).  Ops that every
one of their consumers waits on together can signal one counter instead, whose count is their tasks' sum:
one poll, the same order of every task (no consumer waits for more than it did), so the same results bit for
bit and no new deadlock.
"""

from __future__ import annotations

from .ir import Graph

# helper plans keep a counter per op: helper_card (link, persistent) orders a layer's tasks by their counters
_HELPER = frozenset({"HELPER_CALL", "HELPER_WAIT", "HELPER_RECV", "HELPER_SEND"})


def shared_counters(graph: Graph, waits: dict[int, list[int]], anc: list[int]) -> dict[int, int]:
    """op id -> the op id whose counter it signals (its own unless grouped).  `waits`: each op's producers
    it waits on (already transitively reduced); `anc`: ancestor bitsets (graph.memory.ancestors).

    A group is the producers one op waits on, taken when every op waiting on any of them has all of them as
    ancestors (so waiting for the whole group adds nothing to what that op already needed) and none
    of them is in another group.  A plan with helper ops keeps one counter per op."""
    counter = {op.id: op.id for op in graph.ops}
    if any(op.opcode in _HELPER for op in graph.ops):
        return counter
    consumers: dict[int, list[int]] = {}
    for op_id, producers in waits.items():
        for p in producers:
            consumers.setdefault(p, []).append(op_id)
    grouped: set[int] = set()
    for op in graph.ops:
        group = sorted(waits.get(op.id, ()))
        if len(group) < 2 or grouped.intersection(group):
            continue
        users = {c for p in group for c in consumers[p]}
        if all(anc[u] >> p & 1 for u in users for p in group):
            grouped.update(group)
            for p in group:  # the last op's counter: waits still name counters below the waiting op's id
                counter[p] = group[-1]
    return counter
