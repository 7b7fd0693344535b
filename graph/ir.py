"""The op graph: tensors in buffers, and ops that read and write views of them.

Tensors are single-assignment: every op writes fresh tensors (or disjoint
column slices of one, as two norms writing the halves of a concatenation), so
dependencies are exactly "who wrote what I read".  An op carries the opcode it
will run as, its flags and dimensions; tiling later splits it into tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .isa import Buf

TRANSPOSED = "^T"  # a weight part packed transposed (fusion rules expert_mlp, dense_mlp: down projections read k-major)


@dataclass
class Tensor:
    name: str
    buf: Buf
    rows: int
    cols: int
    role: str = "act"  # act | weight | const | input | output | cache | mailbox
    # weights: (HF tensor name, element offset) packed into this tensor; a third entry derives the packed values:
    # a norm weight's name (its columns scaled: norm_into_linear, with "hi" / "lo" a fourth), or TRANSPOSED
    parts: tuple[tuple, ...] = ()
    data: tuple[float, ...] | None = None  # constants
    offset: int | None = None  # placement in its buffer, set by memory planning / weight layout

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def ld(self) -> int:
        return self.cols


@dataclass(frozen=True)
class View:
    """Columns [col0, col0 + cols) of every row of a tensor (cols None: to the end)."""

    tensor: str
    col0: int = 0
    cols: int | None = None


@dataclass
class Op:
    id: int
    opcode: str
    flags: frozenset[str]
    attrs: dict
    reads: dict[str, View]
    writes: dict[str, View]
    label: str
    layer: int | None = None
    fused_from: tuple[str, ...] = ()  # labels of the unfused ops this op replaced

    def describe(self) -> str:
        flags = "|".join(sorted(self.flags))
        return f"{self.label}: {self.opcode}{'[' + flags + ']' if flags else ''}"


@dataclass
class Graph:
    tensors: dict[str, Tensor] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)

    def add_tensor(self, t: Tensor) -> str:
        if t.name in self.tensors:
            raise ValueError(f"tensor {t.name} defined twice")
        self.tensors[t.name] = t
        return t.name

    def producers(self) -> dict[str, list[Op]]:
        out: dict[str, list[Op]] = {}
        for op in self.ops:
            for v in op.writes.values():
                out.setdefault(v.tensor, []).append(op)
        return out

    def consumers(self) -> dict[str, list[Op]]:
        out: dict[str, list[Op]] = {}
        for op in self.ops:
            for v in op.reads.values():
                out.setdefault(v.tensor, []).append(op)
        return out

    def op_deps(self) -> dict[int, set[int]]:
        """op id -> ids of the earlier ops that wrote a tensor it reads.

        Ops are in program order; only the cache is written by several ops over a step
        (each layer pass appends), and a read depends on the writes before it."""
        prod = self.producers()
        return {op.id: {p.id for v in op.reads.values() for p in prod.get(v.tensor, ()) if p.id < op.id}
                for op in self.ops}

    def renumber(self) -> None:
        for i, op in enumerate(self.ops):
            op.id = i

    def prune(self) -> int:
        """Drop activations and weights no op touches (after passes merged ops away, or folded a
        weight into a derived one); returns how many."""
        used = {v.tensor for op in self.ops for v in (*op.reads.values(), *op.writes.values())}
        dead = [n for n, t in self.tensors.items() if n not in used and t.role in ("act", "weight")]
        for n in dead:
            del self.tensors[n]
        return len(dead)

    def opcode_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for op in self.ops:
            counts[op.opcode] = counts.get(op.opcode, 0) + 1
        return counts
