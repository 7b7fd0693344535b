"""Where each routed expert lives: a main-GPU slot or the helper.

The main GPU holds `capacity` expert slots (one arena for all MoE layers, each
slot one expert's gate | up | down); every other (layer, expert) lives on the
helper.  The step reads the placement as one int32 table per layer (expert ->
main slot, or HELPER), so moving an expert is a table flip at a step boundary
and never a recompile.  Both sides check the same digest at start.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from graph.isa import ON_HELPER as HELPER  # table value of an expert the helper computes


@dataclass
class Placement:
    """tables[layer][expert] = main slot id (0 <= id < capacity) or HELPER.  The tables are the rows of
    one array, `grid` (row[layer] its row): change entries in place, never rebind a layer's table."""

    capacity: int
    tables: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self):
        # one [layers, experts] array, each layer's table a view of its row: the step boundary reads
        # every table at once (the mailboxes' counts, helper_share, check) and copy() is one array copy
        sizes = {len(t) for t in self.tables.values()}
        if len(sizes) > 1:
            raise ValueError(f"placement tables of unequal lengths {sorted(sizes)}: every MoE layer has the same experts")
        self.grid = (np.stack([np.asarray(t, dtype=np.int32) for t in self.tables.values()]) if self.tables
                     else np.zeros((0, 0), dtype=np.int32))
        self.row = {layer: i for i, layer in enumerate(self.tables)}
        self.tables = dict(zip(self.tables, self.grid))

    @classmethod
    def build(cls, counts: dict[int, np.ndarray], capacity: int) -> "Placement":
        """The `capacity` experts with the highest counts go to main (ties: lower layer, then lower
        expert id, so the map is a pure function of the counts); slots are dealt in that order."""
        experts = sum(len(c) for c in counts.values())
        if not 0 <= capacity <= experts:
            raise ValueError(f"capacity {capacity} must be between 0 and the {experts} routed experts")
        order = sorted(((float(c[e]), layer, e) for layer, c in counts.items() for e in range(len(c))),
                       key=lambda item: (-item[0], item[1], item[2]))
        tables = {layer: np.full(len(c), HELPER, dtype=np.int32) for layer, c in counts.items()}
        for slot, (_, layer, e) in enumerate(order[:capacity]):
            tables[layer][e] = slot
        return cls(capacity, tables)

    @classmethod
    def with_fraction(cls, layers: list[int], n_experts: int, helper_fraction: float,
                      counts: dict[int, np.ndarray] | None = None) -> "Placement":
        """A placement that leaves `helper_fraction` of all routed experts on the helper."""
        if not 0.0 <= helper_fraction <= 1.0:
            raise ValueError(f"helper fraction must be in [0, 1], got {helper_fraction}")
        total = len(layers) * n_experts
        counts = counts or {layer: np.zeros(n_experts) for layer in layers}
        return cls.build(counts, total - round(helper_fraction * total))

    # ---- queries -------------------------------------------------------------
    def on_helper(self, layer: int, expert: int) -> bool:
        return int(self.tables[layer][expert]) == HELPER

    def helper_experts(self, layer: int) -> list[int]:
        return [int(e) for e in np.flatnonzero(self.tables[layer] == HELPER)]

    def main_experts(self) -> dict[int, tuple[int, int]]:
        """slot -> (layer, expert) for every occupied main slot."""
        return {int(s): (layer, int(e)) for layer, t in self.tables.items() for e, s in enumerate(t) if s != HELPER}

    def free_slots(self) -> list[int]:
        used = set(self.main_experts())
        return [s for s in range(self.capacity) if s not in used]

    @property
    def helper_share(self) -> float:
        return float((self.grid == HELPER).mean()) if self.grid.size else 0.0

    def digest(self) -> str:
        """A hash of the whole map; the main side and the helper compare it before the first step."""
        h = hashlib.sha256(f"capacity={self.capacity}".encode())
        for layer in sorted(self.tables):
            h.update(f"|{layer}:".encode())
            h.update(np.ascontiguousarray(self.tables[layer], dtype="<i4").tobytes())
        return h.hexdigest()[:16]

    def copy(self) -> "Placement":
        # one array copy and its row views, without __post_init__'s checks and stacking (a copy is made at
        # every flip; the row map is shared: readers that cache rows by it, the mailboxes, keep them)
        new = object.__new__(Placement)
        new.capacity, new.grid, new.row = self.capacity, self.grid.copy(), self.row
        new.tables = dict(zip(self.row, new.grid))
        return new

    def check(self) -> None:
        """Every main slot holds at most one expert and lies inside the arena.  Checked with array
        operations (it runs at every flip, between two decode steps); the loop below only names the
        first offender."""
        slots = self.grid[self.grid != HELPER]
        if not slots.size or (slots.min() >= 0 and slots.max() < self.capacity
                              and np.bincount(slots, minlength=self.capacity).max() <= 1):
            return
        seen: dict[int, tuple[int, int]] = {}
        for layer, t in self.tables.items():
            for e, s in enumerate(t.tolist()):
                if s == HELPER:
                    continue
                if not 0 <= s < self.capacity:
                    raise ValueError(f"layer {layer} expert {e}: slot {s} outside the arena of {self.capacity}")
                if s in seen:
                    raise ValueError(f"slot {s} holds both layer/expert {seen[s]} and {(layer, e)}")
                seen[s] = (layer, e)
