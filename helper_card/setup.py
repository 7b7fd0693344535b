"""One engine's helper: placement, backend, link, copy engine and migration, wired together.

    helper = Helper(cfg, weights, HelperOptions(kind="cpu", fraction=0.5, migrate=True), device, dtype)
    plan = compile_step(cfg, StepShape(..., helper_slots=helper.capacity))
    runner = Interpreter(plan, weights, device); helper.attach(runner)
    ... runner.step(...); helper.end_step()   # metrics, routing statistics, migration
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from graph.isa import Buf
from megakernel.interpreter import Interpreter
from model.config import ModelConfig
from model.schema import layer_prefix

from .backends import make_backend
from .copy_engine import CopyEngine
from .link import HelperLink, expert_store
from .mailbox import MailboxService
from .migration import CallAwarePolicy, MigrationPolicy, RoutingStats
from .placement import HELPER, Placement


def moe_layers(cfg: ModelConfig) -> list[int]:
    """Every layer with routed experts, MTP layers included."""
    return [layer for layer in range(cfg.num_layers_total) if cfg.is_moe_layer(layer)]


@dataclass
class HelperOptions:
    kind: str = "none"  # none | cpu | emulate | cuda:N
    fraction: float = 0.5  # share of routed experts on the helper
    migrate: bool = False
    timeout_s: float = 1.0
    fallback: bool = False  # on timeout, recompute on the main side instead of raising
    window: int = 32  # steps of routing statistics
    # by the helper calls a move saves (at decode a call costs about the same whatever its rows);
    # MigrationPolicy() moves by rows
    policy: MigrationPolicy = field(default_factory=CallAwarePolicy)
    # migration's planning, map writes and copies run right after the next step's launch (a megakernel's
    # step then runs on the device meanwhile; the plan interpreter's has run) and commit at the boundary
    # after it: a move decided from step n's routing takes effect at step n+2, not n+1, and the boundary
    # between two tokens keeps only the counts.  False: all of it at the boundary, effective at step n+1
    overlap: bool = True
    # a helper GPU's persistent kernel per call: 0 = one worker per SM of the helper GPU.  A call's tiles
    # stream its experts' weights (17 MB each on DeepSeek-V2-Lite), so fewer workers read them slower
    helper_workers: int = 0
    # a helper GPU answers with one persistent kernel per step (helper_card/persistent.py), polling the
    # mailboxes itself, instead of a host thread replaying a graph per call
    persistent: bool = False

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


def is_routed_expert(cfg: ModelConfig):
    """name -> whether it is a routed expert's weight.  With a cpu helper the loader keeps these in host
    memory from the start: main needs them only to fill its slots (from the helper's host store)."""
    marks = tuple(layer_prefix(layer) + "mlp.experts." for layer in moe_layers(cfg))
    return lambda name: name.startswith(marks)


def capacity_for(cfg: ModelConfig, fraction: float) -> int:
    total = len(moe_layers(cfg)) * cfg.n_routed_experts
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"helper fraction must be in [0, 1], got {fraction}")
    return total - round(fraction * total)


def make_helper(backend: str, cfg: ModelConfig, weights, opts: HelperOptions, device, dtype) -> "Helper":
    """The helper of an engine running on `backend` (interpret | megakernel), or a clear refusal."""
    device = torch.device(device)
    if not opts.timeout_s > 0:  # a bound of 0 would fail every call not already answered
        raise ValueError(f"--helper-timeout must be > 0 seconds, got {opts.timeout_s}")
    if backend == "megakernel" and opts.fallback:
        raise ValueError("--helper-fallback recomputes a late call on the main side between its call and its wait, "
                         "which a megakernel step (one graph replay) cannot: use --backend interpret")
    if backend == "megakernel" and opts.kind == "emulate" and device.type == "cuda":
        raise ValueError("--helper emulate computes on the main GPU, which the persistent megakernel fills while it "
                         "waits for the answer: use --helper cpu or cuda:N")
    return Helper(cfg, weights, opts, device, dtype or next(iter(weights.values())).dtype)


class Helper:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], opts: HelperOptions, device, dtype,
                 counts=None):
        if not cfg.n_routed_experts:
            raise ValueError("--helper needs a model with routed experts")
        self.cfg, self.opts = cfg, opts
        self.layers, E = moe_layers(cfg), cfg.n_routed_experts
        self.capacity = capacity_for(cfg, opts.fraction)
        self.placement = Placement.with_fraction(self.layers, E, opts.fraction, counts)
        # every routed expert, where the helper keeps them: the main device only for the same-device
        # emulation; otherwise host memory (the copy engine pins it), so main holds only its slots
        store = expert_store(cfg, weights, self.layers, device if opts.kind == "emulate" else "cpu", dtype)
        self.backend = make_backend(opts.kind, store, self.placement)
        self.link = HelperLink(self.backend, self.placement, self.layers, E, opts.timeout_s, opts.fallback)
        if opts.migrate:
            self.link.stats = RoutingStats(self.layers, E, opts.window)
        self.store = store
        self.runners: list = []
        self.copier: CopyEngine | None = None
        self.arena_ptr = None
        self.moves = 0
        self.stall_s = 0.0
        self.services: list[MailboxService] = []
        self.overlap: bool | None = None  # opts.migrate and opts.overlap, fixed when the first runner attaches
        self.pending: Placement | None = None  # decided during a step, maps written after it; committed next
        self.due = False  # the next launch plans a migration
        self.overlapped: dict = {}  # what the last after-launch migration did

    def row(self, layer: int, expert: int) -> int:
        return self.layers.index(layer) * self.cfg.n_routed_experts + expert

    def attach(self, runner) -> None:
        """Give a runner of a helper plan its link and the main slots their experts; a megakernel runner
        also a mailbox service (its calls cannot reach Python: the step is one graph replay)."""
        if runner.plan.shape.get("helper_slots", -1) != self.capacity:
            raise ValueError(f"plan has {runner.plan.shape.get('helper_slots', -1)} main expert slots, the helper "
                             f"placement needs {self.capacity}: compile with StepShape(helper_slots={self.capacity})")
        slot = next(w for w in runner.plan.weights if w.name == "experts.main")
        W = runner.mem.bufs[Buf.W]
        arena = W[slot.offset: slot.offset + slot.rows * slot.cols].view(slot.rows, slot.cols)
        if self.copier is None:
            # experts come from the helper GPU's copy where there is one (NVLink), else from host memory
            source = self.backend.store
            if not (source.device.type == "cuda" and source.device != arena.device):
                source = self.store
            self.copier = CopyEngine(arena, source, self.row)
            self.copier.fill(self.placement.main_experts())
            self.arena_ptr = arena.data_ptr()
        elif arena.data_ptr() != self.arena_ptr:
            raise ValueError("every plan of one engine must share the weight arena (Memory share=...)")
        megakernel = not isinstance(runner, Interpreter)
        if self.opts.persistent and not megakernel:
            raise ValueError("a persistent helper kernel (--helper-persistent) answers the megakernel's mailboxes: "
                             "the plan interpreter calls its helper directly")
        if self.overlap is None:
            self.overlap = self.opts.migrate and self.opts.overlap
        if self.overlap:
            runner.launch_hooks.append(self._before_launch)
            runner.after_launch_hooks.append(self._after_launch)
        self.link.attach(runner, program=not megakernel)  # no tile program (and its buffers) for mailboxes
        self.runners.append(runner)
        if megakernel:  # its calls reach the helper through mailboxes
            service = MailboxService(self.link, runner, self.opts.helper_workers, self.opts.persistent)
            runner.launch_hooks.append(service.kick)
            runner.diagnostics.append(service.failures)
            self.services.append(service)

    def end_step(self, decode: bool = True) -> dict:
        """At a step boundary: this step's metrics, then migration: here (flips take effect next step),
        or, overlapped, the commit of what the last step's launch decided and a mark for the next one."""
        t0 = time.perf_counter()
        for service in self.services:
            service.count_step()
        step = self.link.metrics.end_step()
        t1 = time.perf_counter()
        parts = {}
        if self.opts.migrate and self.overlap:
            self.link.stats.end_step(decode)
            parts = self._commit()
            self.due = True
        elif self.opts.migrate:
            parts = self._migrate(decode)
        step.update(moves=parts.pop("landed", 0), bytes_migrated=self.copier.bytes_moved if self.copier else 0,
                    migration_stall_ms=(time.perf_counter() - t1) * 1e3, count_ms=(t1 - t0) * 1e3,
                    migration_parts_ms=parts, helper_share=self.placement.helper_share)
        return step

    def _decide(self) -> tuple[Placement, list, int, dict]:
        """The next placement (landed copies in, planned moves' evictions out), the moves to start, how
        many copies landed, and each phase's ms (for tools/helper_bench.py)."""
        stats, copier = self.link.stats, self.copier
        t0 = time.perf_counter()
        placement = self.placement.copy()
        landed = copier.finished()
        for m in landed:  # copies done: the expert now reads from its main slot
            placement.tables[m.layer][m.expert] = m.slot
        t1 = time.perf_counter()
        moves = self.opts.policy.plan(placement, stats.counts(), busy=copier.busy_slots(), moving=copier.moving(),
                                      steps=stats.filled)
        for m in moves:
            if m.evict is not None:  # its rows go to the helper from then on (it has every expert)
                placement.tables[m.evict[0]][m.evict[1]] = HELPER
        return placement, moves, len(landed), {"land": (t1 - t0) * 1e3, "plan": (time.perf_counter() - t1) * 1e3}

    def _start_copies(self, moves) -> float:
        t0 = time.perf_counter()
        for m in moves:  # after the maps: no step that reads a slot's old expert overlaps its copy
            self.copier.start(m)
        return (time.perf_counter() - t0) * 1e3

    def _migrate(self, decode: bool) -> dict:
        """At the boundary: land finished copies, plan, flip, start copies (the moves landed and each
        phase's ms)."""
        self.link.stats.end_step(decode)
        placement, moves, landed, parts = self._decide()
        t0 = time.perf_counter()
        if landed or moves:  # the flip first: its small map copy must not queue behind the experts' copies
            self.placement = placement
            self.link.set_placement(placement, self.runners)
        parts["flip"] = (time.perf_counter() - t0) * 1e3
        parts["copies"] = self._start_copies(moves)
        self.moves += landed
        return {"landed": landed, **parts}

    def _before_launch(self) -> None:
        """A decision still pending at a launch: the step that made it ended without its boundary (it
        failed), but its maps were written behind it, so the device routes by it from this step on; the
        host must too, before this step's helper calls."""
        self._switch()

    def _after_launch(self) -> None:
        """Right after a step's launch (overlap): decide the next placement from the routing counted so far,
        write its maps behind this step on the step's stream (the step after it reads them) and start the
        copies behind this step; the host side (the mailboxes' and the helper's placement) switches at the
        next boundary, when this step has finished with the old one."""
        if not self.due:
            return
        self.due = False
        t0 = time.perf_counter()
        placement, moves, landed, parts = self._decide()
        time.sleep(0)  # a mailbox thread serving this step's first helper call gets the GIL between phases
        t1 = time.perf_counter()
        if landed or moves:
            self.link.write_maps(placement, self.runners)
            self.pending = placement
        parts["maps"] = (time.perf_counter() - t1) * 1e3
        time.sleep(0)
        parts["copies"] = self._start_copies(moves)
        self.overlapped = {"landed": landed, "overlapped": (time.perf_counter() - t0) * 1e3, **parts}

    def _commit(self) -> dict:
        """At the boundary after an overlapped decision: its placement becomes the host's (the device
        already reads it from the next step on); returns what that decision did."""
        t0 = time.perf_counter()
        self._switch()
        done, self.overlapped = self.overlapped, {}
        self.moves += done.get("landed", 0)
        return {**done, "commit": (time.perf_counter() - t0) * 1e3}

    def _switch(self) -> None:
        if self.pending is not None:
            self.link.commit(self.pending)
            self.placement, self.pending = self.pending, None

    def place_now(self, placement: Placement) -> None:
        """Between two steps, with no copy in flight: fill the slots that change and flip every map, all
        synchronously (tools/helper_bench.py's replay: a migrating run's placements, step by step,
        without migration running)."""
        if self.copier.in_flight:
            raise RuntimeError(f"place_now with {len(self.copier.in_flight)} expert copies in flight")
        old = self.placement.main_experts()
        self.copier.fill({s: le for s, le in placement.main_experts().items() if old.get(s) != le})
        self.link.set_placement(placement, self.runners)
        self.placement, self.pending = placement, None
        if self.copier.cuda:
            torch.cuda.synchronize(self.copier.arena.device)

    def close(self) -> None:
        for service in self.services:
            service.close()
        self.backend.close()
