"""Memory planning: weights in one arena in the order tasks read them; activations reuse space by liveness.

An activation block is reused for a new tensor only when every op that
touched its previous tensor is an ancestor of every op that writes the new one,
so the reuse can never race (the verifier checks this again on the tasks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .ir import Graph, Tensor
from .isa import Buf

ALIGN = 64  # elements: keeps rows of bf16 weights 128-byte aligned


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def ancestors(graph: Graph) -> list[int]:
    """Bitset per op (indexed by op id, ops in topological order) of the ops it transitively depends on."""
    deps = graph.op_deps()
    anc = [0] * len(graph.ops)
    for op in graph.ops:
        bits = 0
        for d in deps[op.id]:
            if d > op.id:
                raise ValueError(f"op {op.label} depends on a later op: the op list is not topological")
            bits |= anc[d] | (1 << d)
        anc[op.id] = bits
    return anc


@dataclass
class _Segment:
    offset: int
    size: int
    users: int  # bitset of ops that touched the tensor living here


@dataclass
class MemoryReport:
    sizes: dict  # buffer -> elements
    activation_bytes_unshared: int
    activation_bytes_planned: int
    reused: int


def weight_order(graph: Graph) -> list[Tensor]:
    """Weights and constants in the order the graph's ops first read them."""
    seen: dict[str, Tensor] = {}
    for op in graph.ops:
        for view in op.reads.values():
            t = graph.tensors[view.tensor]
            if t.role in ("weight", "const") and t.name not in seen:
                seen[t.name] = t
    return list(seen.values())


def plan_memory(graph: Graph, reuse: bool = True, weights: list[Tensor] | None = None,
                row_align: dict[str, int] | None = None) -> MemoryReport:
    """`weights`: the arena order (default: this graph's first-use order).  Passing one canonical
    order for every shape gives all plans of a model one weight layout, so they can share it.
    `row_align`: weight name -> a row length K whose multiple the weight must start at (also a multiple
    of ALIGN), so the arena seen as [elements / K, K] rows holds the matrix from a whole row on
    (compile option stream_kernel: the stream kernel's one TMA descriptor per K); the gaps are zeros."""
    anc = ancestors(graph)
    sizes = {b: 0 for b in Buf}
    row_align = row_align or {}
    for w in weights if weights is not None else weight_order(graph):
        t = graph.tensors.setdefault(w.name, Tensor(w.name, w.buf, w.rows, w.cols, w.role, w.parts, w.data))
        t.offset = _align(sizes[t.buf], math.lcm(ALIGN, row_align[w.name]) if w.name in row_align else ALIGN)
        sizes[t.buf] = t.offset + t.numel
    unplaced = [t.name for t in graph.tensors.values() if t.role in ("weight", "const") and t.offset is None]
    if unplaced:
        raise ValueError(f"weight(s) {', '.join(unplaced[:4])} are not in the arena layout given (every plan of a "
                         "model shares one: compile it with the same fusion rules)")
    for t in graph.tensors.values():
        if t.role == "cache":
            t.offset = sizes[Buf.C]
            sizes[Buf.C] += t.numel
    # pinned inputs and outputs first, so the host finds them at fixed places; mailboxes keep theirs
    # across steps (a request's sequence number and the helper's answer outlive the step)
    for t in graph.tensors.values():
        if t.role in ("input", "output", "mailbox"):
            t.offset = _align(sizes[t.buf])
            sizes[t.buf] = t.offset + t.numel
    users: dict[str, int] = {}
    writers: dict[str, list[int]] = {}
    for op in graph.ops:
        for v in op.reads.values():
            users[v.tensor] = users.get(v.tensor, 0) | (1 << op.id)
        for v in op.writes.values():
            users[v.tensor] = users.get(v.tensor, 0) | (1 << op.id)
            writers.setdefault(v.tensor, []).append(op.id)
    segments: dict[Buf, list[_Segment]] = {Buf.A: [], Buf.I: []}
    unshared = planned_reused = 0
    for op in graph.ops:
        for view in op.writes.values():
            t = graph.tensors[view.tensor]
            if t.role != "act" or t.offset is not None:
                continue
            size = _align(t.numel, 16)
            unshared += size * 4
            before = 0
            for w in writers[t.name]:
                before = anc[w] if before == 0 else before & anc[w]
            t.offset, reused = _place(segments[t.buf], size, before if reuse else 0, users[t.name], sizes[t.buf])
            planned_reused += reused
    for buf, segs in segments.items():
        if segs:
            sizes[buf] = max(sizes[buf], segs[-1].offset + segs[-1].size)
    planned = sum(sizes[b] * 4 for b in (Buf.A, Buf.I))
    return MemoryReport({b.name: sizes[b] for b in Buf}, unshared, planned, planned_reused)


def _place(segs: list[_Segment], size: int, before: int, users: int, base: int) -> tuple[int, bool]:
    """First run of adjacent dead segments that fits `size`, else grow at the end; (offset, reused)."""
    i = 0
    while i < len(segs):
        j, total = i, 0
        while j < len(segs) and segs[j].users & ~before == 0 and total < size:
            total += segs[j].size
            j += 1
        if total >= size or (j == len(segs) and total):  # fits, or a dead tail that can grow
            offset = segs[i].offset
            rest_users = 0
            for s in segs[i:j]:
                rest_users |= s.users
            new = [_Segment(offset, size, users)]
            if total > size:
                new.append(_Segment(offset + size, total - size, rest_users))
            segs[i:j] = new
            return offset, True
        i = j + 1
    end = segs[-1].offset + segs[-1].size if segs else _align(base, 16)
    segs.append(_Segment(end, size, users))
    return end, False
