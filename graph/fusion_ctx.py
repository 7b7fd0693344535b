"""What every fusion rule works with: the graph, who writes and reads each tensor, and how a chain of ops is
replaced by the fused op (graph/fusion.py applies the rules; graph/fusion_weights.py holds those that derive
packed weights)."""

from __future__ import annotations

from .ir import Graph, Op, View


class Ctx:
    """The graph being fused, with each tensor's producers (prod) and consumers (cons), refreshed after each
    rewrite."""

    def __init__(self, graph: Graph):
        self.g = graph
        self.refresh()

    def refresh(self) -> None:
        self.g.renumber()
        self.prod = {}
        self.cons: dict[str, list[Op]] = {}
        for op in self.g.ops:
            for v in op.writes.values():
                self.prod.setdefault(v.tensor, []).append(op)
            for v in op.reads.values():
                self.cons.setdefault(v.tensor, []).append(op)

    def sole_producer(self, view: View, opcode: str, flag: str | None = None) -> Op | None:
        """The single op writing this whole tensor, if it has that opcode (and flag)."""
        if view.col0 or view.cols is not None:
            return None
        ops = self.prod.get(view.tensor, [])
        if len(ops) != 1 or ops[0].opcode != opcode or (flag and flag not in ops[0].flags):
            return None
        return ops[0]

    def private(self, tensor: str, reader: Op) -> bool:
        """Only `reader` reads it and it is an ordinary activation."""
        t = self.g.tensors[tensor]
        return t.role == "act" and all(op is reader for op in self.cons.get(tensor, []))

    def replace(self, absorbed: list[Op], fused: Op) -> None:
        last = max(op.id for op in absorbed)
        fused.fused_from = tuple(op.label for op in sorted(absorbed, key=lambda o: o.id))
        gone = {id(op) for op in absorbed}
        ops = []
        for op in self.g.ops:
            if op.id == last:
                ops.append(fused)
            elif id(op) not in gone:
                ops.append(op)
        self.g.ops = ops
        self.refresh()


def new_op(op: Op, flags, reads, writes, attrs=None, label=None) -> Op:
    return Op(-1, op.opcode, frozenset(flags), dict(attrs or op.attrs), reads, writes, label or op.label, op.layer)



def whole(ctx: Ctx, view: View) -> bool:
    """The view is its tensor's every column."""
    return view.col0 == 0 and view.cols in (None, ctx.g.tensors[view.tensor].cols)

