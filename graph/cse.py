"""Common-subexpression elimination: an op identical to an earlier one on identical inputs is dropped
and its readers read the earlier op's outputs (e.g. per-layer rope tables down to the rope groups)."""

from __future__ import annotations

from .ir import Graph, View


def _key(op) -> tuple | None:
    if any(v.col0 or v.cols is not None for v in op.writes.values()):
        return None  # writes a slice of a shared tensor
    try:
        attrs = tuple(sorted(op.attrs.items()))
        hash(attrs)
    except TypeError:
        return None
    reads = tuple(sorted((k, v.tensor, v.col0, v.cols) for k, v in op.reads.items()))
    return (op.opcode, tuple(sorted(op.flags)), attrs, reads, tuple(sorted(op.writes)))


def cse(graph: Graph) -> dict:
    before = len(graph.ops)
    seen: dict[tuple, object] = {}
    rename: dict[str, str] = {}
    kept, changes = [], []
    for op in graph.ops:
        op.reads = {k: View(rename.get(v.tensor, v.tensor), v.col0, v.cols) for k, v in op.reads.items()}
        key = _key(op)
        outputs_private = all(graph.tensors[v.tensor].role == "act" for v in op.writes.values())
        if key is not None and outputs_private and key in seen:
            first = seen[key]
            for k, v in op.writes.items():
                rename[v.tensor] = first.writes[k].tensor
            changes.append(f"{op.label} -> {first.label}")
            continue
        if key is not None:
            seen[key] = op
        kept.append(op)
    graph.ops = kept
    graph.renumber()
    graph.prune()
    counts = graph.opcode_counts()
    return {"pass": "cse", "ops_before": before, "ops_after": len(kept), "merged": len(changes),
            "rope_tables": counts.get("ROPE_TABLE", 0), "changes": changes}
