"""Which experts should move: windowed routing counts, a swap policy with hysteresis, and a
skewed synthetic router (Zipf popularity, a hot set that shifts) for tests and benchmarks,
since random weights route almost uniformly."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from .placement import HELPER, Placement


class RoutingStats:
    """Per-(layer, expert) routing counts over the last `window` steps.  Decode steps count 1 per
    routed (token, k) pair; prefill chunks count `prefill_weight` (a long prompt should not
    decide what decode keeps hot)."""

    def __init__(self, layers: list[int], n_experts: int, window: int = 32, prefill_weight: float = 0.1):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.layers, self.n_experts, self.prefill_weight = list(layers), n_experts, prefill_weight
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        # one [layers, experts] array per step: the step boundary's work is a few array operations,
        # not one per layer (it runs between two decode steps, on every token's path)
        self.steps: deque[np.ndarray] = deque(maxlen=window)
        self.current = self._zeros()
        self.total = self._zeros()  # the window's sum, kept as steps enter and leave it

    def _zeros(self) -> np.ndarray:
        return np.zeros((len(self.layers), self.n_experts))

    def add(self, layer: int, experts, counts) -> None:
        """Rows routed to each of `experts` in `layer` during the current step."""
        np.add.at(self.current[self.row[layer]], np.asarray(experts, dtype=np.int64),
                  np.asarray(counts, dtype=np.float64))

    def rows_of(self, layers) -> np.ndarray:
        """The statistics' row of each layer (for add_at)."""
        return np.array([self.row[layer] for layer in layers], dtype=np.int64)

    def add_at(self, rows: np.ndarray, experts, counts) -> None:
        """Rows routed to experts[i] of the layer in row rows[i], for every i (repeats add up): a whole
        step's slot tables in one array operation."""
        np.add.at(self.current, (rows, np.asarray(experts, dtype=np.int64)), np.asarray(counts, dtype=np.float64))

    def end_step(self, decode: bool = True) -> None:
        step = (1.0 if decode else self.prefill_weight) * self.current
        if len(self.steps) == self.steps.maxlen:
            self.total -= self.steps[0]
        self.steps.append(step)
        self.total += step
        self.current = self._zeros()

    def observe(self, ids: dict[int, np.ndarray], decode: bool = True) -> None:
        """A whole step at once: ids[layer] are the expert ids its tokens were routed to (any shape)."""
        for layer, chosen in ids.items():
            chosen = np.asarray(chosen).reshape(-1)
            self.add(layer, np.arange(self.n_experts), np.bincount(chosen, minlength=self.n_experts)[: self.n_experts])
        self.end_step(decode)

    @property
    def filled(self) -> int:
        """Steps the window holds so far."""
        return len(self.steps)

    def counts(self) -> dict[int, np.ndarray]:
        total = self.total.copy()
        return {layer: total[i] for i, layer in enumerate(self.layers)}


@dataclass(frozen=True)
class Move:
    """Put (layer, expert) into main slot `slot`; `evict` is the (layer, expert) leaving it, if any."""

    layer: int
    expert: int
    slot: int
    evict: tuple[int, int] | None


@dataclass
class MigrationPolicy:
    """Promote the hottest helper experts into free slots, or in place of the coldest main experts
    when the newcomer's windowed count exceeds the incumbent's by `margin` (ratio) and `min_gain`
    (absolute): hysteresis, so two experts of similar heat do not swap back and forth.  At most
    `max_moves` per step bounds the copy traffic."""

    margin: float = 1.5
    min_gain: float = 2.0
    max_moves: int = 2

    def plan(self, placement: Placement, counts: dict[int, np.ndarray], busy: set[int] = frozenset(),
             moving: set[tuple[int, int]] = frozenset(), steps: int = 1) -> list[Move]:
        """Moves for this step boundary; slots in `busy` and experts in `moving` (a copy in flight)
        are left alone; `steps`: how many steps the counts cover.  Array operations over every
        (layer, expert) at once: this runs between two decode steps (as Python loops it took ~1.3 ms
        for DeepSeek-V2-Lite's 26 x 64 experts)."""
        a = _Arrays(placement, counts, busy, moving)
        if a.empty:
            return []
        # hot: helper experts with rows, hottest first (ties: lower layer, then lower expert)
        hl, he = np.nonzero(a.candidate)
        hot = np.lexsort((he, a.layer_of[hl], -a.C[hl, he]))
        # cold: main experts outside busy slots, coldest first (ties: lower slot)
        ml, me, slots = a.victims()
        cold = np.lexsort((slots, a.C[ml, me]))
        moves: list[Move] = []
        next_cold = 0
        for h in hot:
            if len(moves) >= self.max_moves:
                break
            layer, e, heat = int(a.layer_of[hl[h]]), int(he[h]), float(a.C[hl[h], he[h]])
            if a.free:
                moves.append(Move(layer, e, a.free.pop(0), None))
                continue
            if next_cold == len(cold):
                break
            c = cold[next_cold]
            if heat >= self.margin * float(a.C[ml[c], me[c]]) + self.min_gain:
                moves.append(Move(layer, e, int(slots[c]), (int(a.layer_of[ml[c]]), int(me[c]))))
                next_cold += 1
            else:
                break  # the hottest candidate cannot displace the coldest incumbent: nothing colder helps
        return moves


@dataclass
class CallAwarePolicy(MigrationPolicy):
    """Moves chosen by the helper calls they save, not the rows: at decode a call costs about the
    same whatever its rows (docs/PERF.md, session 11), so a layer with one helper row costs as much
    as a layer with six.  A layer is called unless none of its helper experts is routed:
    P(call) = 1 - prod(1 - p_e) over its helper experts, p_e the share of the window's steps that
    routed to e (counts / steps, at most 1).  Promote the expert whose move lowers the expected calls
    most (the last hot helper expert of a layer first), evict the one whose move raises them least,
    preferring layers that already keep the most experts on the helper, so that what is left on the
    helper stays in few layers and a shift of the hot set calls few new ones.  A row adds `row_cost`
    of a call (so where every layer is called anyway, as at a large batch, it moves by rows).  The same
    hysteresis (margin, min_gain on the counts) and max_moves as MigrationPolicy."""

    row_cost: float = 0.05

    def plan(self, placement: Placement, counts: dict[int, np.ndarray], busy: set[int] = frozenset(),
             moving: set[tuple[int, int]] = frozenset(), steps: int = 1) -> list[Move]:
        a = _Arrays(placement, counts, busy, moving)
        if a.empty:
            return []
        # log P(a layer's helper experts are all unrouted), summed over each layer's helper experts
        rate = a.C / max(1, steps)  # rows per step
        log_miss = np.log1p(-np.minimum(rate, 0.999))
        on_helper = a.T == HELPER
        for i, e in a.arriving:  # a copy in flight: on main from the next boundary on
            on_helper[i, e] = False
        S = (log_miss * on_helper).sum(1)
        ml, me, slots = a.victims()
        ok_victim = np.ones(len(slots), dtype=bool)
        moves: list[Move] = []
        candidate = a.candidate.copy()
        while len(moves) < self.max_moves and candidate.any():
            hl, he = np.nonzero(candidate)
            gain = np.exp(S[hl] - log_miss[hl, he]) - np.exp(S[hl]) + self.row_cost * rate[hl, he]
            order = np.lexsort((he, a.layer_of[hl], -a.C[hl, he], -gain))
            if a.free:
                best, slot, evict = order[0], a.free.pop(0), None
            else:
                if not ok_victim.any():
                    break
                loss = np.exp(S[ml]) - np.exp(S[ml] + log_miss[ml, me]) + self.row_cost * rate[ml, me]
                crowd = on_helper[ml].sum(1)  # the layer's experts already on the helper
                v = np.lexsort((slots, -crowd, a.C[ml, me], loss + np.where(ok_victim, 0.0, np.inf)))[0]
                heat, cold = a.C[hl[order], he[order]], a.C[ml[v], me[v]]
                fits = (heat >= self.margin * cold + self.min_gain) & (gain[order] > loss[v])
                if not fits.any():
                    break  # no candidate beats the cheapest incumbent to evict
                best, slot, evict = order[np.argmax(fits)], int(slots[v]), (int(a.layer_of[ml[v]]), int(me[v]))
                ok_victim[v] = False
                on_helper[ml[v], me[v]] = True
                S[ml[v]] += log_miss[ml[v], me[v]]
            i, e = int(hl[best]), int(he[best])
            moves.append(Move(int(a.layer_of[i]), e, slot, evict))
            candidate[i, e] = False
            on_helper[i, e] = False
            S[i] -= log_miss[i, e]
        return moves


class _Arrays:
    """A placement and its counts as [layers, experts] arrays (the placement's grid and its row order),
    and what a plan may touch: candidates, free slots and victims (main experts outside busy slots)."""

    def __init__(self, placement: Placement, counts, busy, moving):
        self.empty = not placement.row
        if self.empty:
            return
        self.T = placement.grid  # read only
        self.C = np.stack([np.asarray(counts[layer], dtype=np.float64) for layer in placement.row])
        self.layer_of = np.asarray(list(placement.row))
        self.arriving = [(placement.row[layer], e) for layer, e in moving if layer in placement.row]
        # candidates: helper experts with rows and no copy in flight
        self.candidate = (self.T == HELPER) & (self.C > 0)
        for i, e in self.arriving:
            self.candidate[i, e] = False
        busy_slot = np.zeros(placement.capacity, dtype=bool)
        busy_slot[[s for s in busy if 0 <= s < placement.capacity]] = True  # others ignored
        ml, me = np.nonzero(self.T != HELPER)
        slots = self.T[ml, me]
        taken = busy_slot.copy()
        taken[slots] = True
        self.free = np.flatnonzero(~taken).tolist()
        keep = ~busy_slot[slots]
        self._victims = ml[keep], me[keep], slots[keep]

    def victims(self):
        """Main experts outside busy slots: (layer rows, experts, slots)."""
        return self._victims


def apply_moves(placement: Placement, moves: list[Move]) -> Placement:
    """The placement after `moves` (a new object: the old one stays valid for the step in flight)."""
    new = placement.copy()
    for m in moves:
        if m.evict is not None:
            new.tables[m.evict[0]][m.evict[1]] = HELPER
        new.tables[m.layer][m.expert] = m.slot
    new.check()
    return new


class ShiftingHotSet:
    """Zipf(a) popularity over a per-layer permutation of the experts, redrawn every `shift_every`
    steps (the hot set moves, as when a session changes topic)."""

    def __init__(self, layers: list[int], n_experts: int, a: float = 1.2, shift_every: int = 0, seed: int = 0):
        self.layers, self.n_experts, self.shift_every = list(layers), n_experts, shift_every
        self.rng = np.random.default_rng(seed)
        self.zipf = np.arange(1, n_experts + 1, dtype=np.float64) ** -a  # by popularity rank
        self.steps = 0
        self._reshuffle()

    def _reshuffle(self) -> None:
        self.perm = {layer: self.rng.permutation(self.n_experts) for layer in self.layers}

    def hot_set(self, layer: int, n: int) -> set[int]:
        return {int(e) for e in self.perm[layer][:n]}

    def tick(self) -> bool:
        """A step boundary; True when the hot set moved."""
        self.steps += 1
        if self.shift_every and self.steps % self.shift_every == 0:
            self._reshuffle()
            return True
        return False


class SkewedRouter(ShiftingHotSet):
    """Synthetic routing drawn from a shifting Zipf popularity (tests and benchmarks of the policy)."""

    def __init__(self, layers: list[int], n_experts: int, top_k: int, a: float = 1.2, shift_every: int = 0,
                 seed: int = 0):
        super().__init__(layers, n_experts, a, shift_every, seed)
        self.top_k, self.started = top_k, False
        self.p = self.zipf / self.zipf.sum()

    def route(self, tokens: int) -> dict[int, np.ndarray]:
        """[tokens, top_k] distinct expert ids per layer for one step (the boundary before it first)."""
        if self.started:
            self.tick()
        self.started = True
        out = {}
        for layer in self.layers:
            picks = [self.rng.choice(self.n_experts, size=self.top_k, replace=False, p=self.p) for _ in range(tokens)]
            out[layer] = self.perm[layer][np.array(picks)]
        return out


def with_routing_bias(cfg):
    """A softmax-routed config (DeepSeek-V2) given DeepSeek-V3's correction bias, so that BiasSkew can
    steer it: experts are chosen by softmax score + bias, weighted by the softmax score alone, the
    bias zero until a skew writes it.  Scaling router rows instead does not skew: greedy decoding of
    a random model feeds the router nearly the same input every step, and a larger scale only
    amplifies each expert's sign (tried in session 5: a hot expert was never routed)."""
    if cfg.topk_method == "noaux_tc":
        return cfg
    if cfg.topk_method != "greedy":
        raise ValueError(f"with_routing_bias: topk_method {cfg.topk_method!r} ranks groups its own way; "
                         "only greedy (ungrouped) routing takes a bias unchanged")
    return cfg.replace(topk_method="noaux_tc", n_group=1, topk_group=1)


class BiasSkew(ShiftingHotSet):
    """A skewed router inside the model, for routing with a correction bias (noaux_tc; softmax
    routing through with_routing_bias): the bias, which steers which experts are chosen but not how
    they are weighted, set to scale x Zipf over the shifting permutation.  Written into a plan's
    fp32 weight arena, which every plan of an engine shares."""

    def __init__(self, cfg, layers: list[int], a: float = 1.2, scale: float = 1.0, shift_every: int = 0,
                 seed: int = 0):
        if cfg.topk_method != "noaux_tc":
            raise ValueError("BiasSkew needs routing with a correction bias (topk_method noaux_tc; "
                             "with_routing_bias gives a softmax-routed config one)")
        super().__init__(layers, cfg.n_routed_experts, a, shift_every, seed)
        self.profile = scale * self.zipf

    def bias(self, layer: int) -> np.ndarray:
        out = np.zeros(self.n_experts, dtype=np.float32)
        out[self.perm[layer]] = self.profile
        return out

    def apply(self, runner) -> None:
        """Write the current biases into the runner's weights (call before the first step)."""
        from graph.isa import Buf
        slots = {w.name: w for w in runner.plan.weights}
        WF = runner.mem.bufs[Buf.WF]
        for layer in self.layers:
            slot = slots.get(f"model.layers.{layer}.mlp.gate.e_score_correction_bias")
            if slot is not None:
                WF[slot.offset: slot.offset + self.n_experts] = torch.from_numpy(self.bias(layer)).to(WF.device)

    def step(self, runner) -> bool:
        """A step boundary: when the hot set moves, the new biases are written.  True when it moved."""
        moved = self.tick()
        if moved:
            self.apply(runner)
        return moved
