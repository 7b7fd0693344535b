"""The main side's link to a helper: publish rows, wait (bounded) for the answer, count.

A helper runs, for the experts it owns, the very task tiles the main expert
tasks would have run (the layer's EXPERT_LINEAR and EWISE tasks, rewritten to
address the helper's own weight store), so where the helper computes on the
same kind of device with the same code its rows are bit-identical to the
all-on-main engine's.  Backends (backends.py) differ only in where that
program runs and how rows travel.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from graph.isa import Buf, Decoded, decode
from graph.plan import Plan
from megakernel.memory import Memory
from megakernel.ops import REFERENCE

from .placement import Placement


class HelperTimeout(RuntimeError):
    """The helper did not acknowledge a published call within the bound."""


@dataclass
class HelperMetrics:
    """Per-step counters (reset by the engine at each step boundary) and running totals."""

    rows: int = 0  # (token, expert) rows sent to the helper
    calls: int = 0  # layers that published to the helper
    skipped: int = 0  # layers with no helper rows: no publish, no wait
    exposed_wait_s: float = 0.0  # main side blocked in HELPER_WAIT
    fallbacks: int = 0  # calls recomputed on the main side after a timeout
    timeline: list | None = None  # a list: each megakernel call's mailbox.CallTimes, appended (helper_bench)
    totals: dict = field(default_factory=dict)

    def end_step(self) -> dict:
        step = {"rows": self.rows, "calls": self.calls, "skipped": self.skipped,
                "exposed_wait_ms": self.exposed_wait_s * 1e3, "fallbacks": self.fallbacks}
        for k, v in step.items():
            self.totals[k] = self.totals.get(k, 0) + v
        self.rows = self.calls = self.skipped = self.fallbacks = 0
        self.exposed_wait_s = 0.0
        return step


class HelperMemory(Memory):
    """The buffers a helper program addresses: private activations (A, I) shaped like the plan's,
    and a weight arena holding the helper's whole expert store."""

    def __init__(self, plan: Plan, store: torch.Tensor):
        self.shape, self.io, self.device, self.dtype = plan.shape, plan.io, store.device, store.dtype
        dev = store.device
        self.bufs = {Buf.W: store.reshape(-1),
                     Buf.A: torch.zeros(max(1, plan.buffers["A"]), dtype=torch.float32, device=dev),
                     Buf.I: torch.zeros(max(1, plan.buffers["I"]), dtype=torch.int32, device=dev),
                     # unused by expert tasks; the megakernel (helper_card.kernel_helper) takes a pointer to each
                     Buf.WF: torch.zeros(1, dtype=torch.float32, device=dev),
                     Buf.C: torch.zeros(1, dtype=store.dtype, device=dev),
                     Buf.H: torch.zeros(1, dtype=torch.int32, device=dev)}


@dataclass
class LayerProgram:
    """One MoE layer's expert work as plan tasks, rewritten for the helper's store."""

    layer: int
    tasks: list[Decoded]  # EXPERT_LINEAR (all slots) and the EWISE tasks between them, in queue-free order
    st: int  # offset (I) of the slot table the expert tasks read
    map: int  # offset (I) of the expert map they read
    x: tuple[int, int, int]  # (offset, rows, cols) in A of the token rows
    y: tuple[int, int]  # (offset, cols) in A of the expert output rows
    S: int
    P: int  # pair rows: tokens x top-k


def layer_programs(plan: Plan) -> dict[int, LayerProgram]:
    """The expert work behind each HELPER_CALL, keyed by the call's op id (its counter: an MTP layer
    lowered for several draft passes has one call per pass).  A call's EXPERT_LINEAR and EWISE ops
    lie between it and its HELPER_WAIT in program order (op ids follow it), and the EWISE ones
    are found by data flow from the expert outputs."""
    tasks = [decode(w) for w in plan.words]
    arena = next(w for w in plan.weights if w.name == "experts.main").offset
    calls = sorted((t for t in tasks if t.op.name == "HELPER_CALL"), key=lambda t: t.signal)
    waits = sorted((t for t in tasks if t.op.name == "HELPER_WAIT"), key=lambda t: t.signal)
    progs = {}
    for call in calls:
        wait = next(t for t in waits if t.signal > call.signal and t["layer"] == call["layer"])
        between = sorted((t for t in tasks if call.signal < t.signal < wait.signal), key=lambda t: (t.signal, t.tile))
        experts = [t for t in between if t.op.name == "EXPERT_LINEAR" and t["st.off"] == call["st2.off"]]
        produced = {t["out.off"] for t in experts}
        ewise = []
        for t in between:  # program order: SiLU before the MUL that reads it
            if t.op.name == "EWISE" and t["a.off"] in produced:
                ewise.append(t)
                produced.add(t["out.off"])
        down = [t for t in experts if not t.has("GATHER")]
        first = [t for t in experts if t.has("GATHER")]
        rewritten = [dataclasses.replace(t, fields={**t.fields, "w.off": t["w.off"] - arena,
                                                   "w2.off": t["w2.off"] - arena if t["w2.buf"] >= 0 else 0})
                     for t in first] + ewise + [dataclasses.replace(t, fields={**t.fields, "w.off": t["w.off"] - arena})
                                                for t in down]
        progs[call.signal] = LayerProgram(
            call["layer"], rewritten, call["st2.off"], call["map.off"], (call["x.off"], call["N"], call["K"]),
            (down[0]["out.off"], down[0]["out.ld"]), call["S"], call["N"] * call["topk"])
    return progs


class HelperProgramRunner:
    """Runs layer programs against a helper store (the compute half of every backend)."""

    def __init__(self, plan: Plan, store: torch.Tensor, layers: list[int], n_experts: int):
        self.plan = plan
        self.mem = HelperMemory(plan, store)
        self.task_delay_s = 0.0  # test hook: a slow helper, mid-computation when the main side gives up
        self.programs = layer_programs(plan)
        self.row_of = {layer: i * n_experts for i, layer in enumerate(layers)}  # store row of (layer, 0)
        self.n_experts = n_experts

    def run(self, site: int, slots: list[tuple[int, torch.Tensor]], x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rows of experts `slots` [(expert, pair ids)] for token rows x at call `site`: [(pair ids, y rows)]."""
        prog, mem = self.programs[site], self.mem
        S, P = prog.S, prog.P
        table = torch.full((2 * S + S * P,), -1, dtype=torch.int32)
        table[S: 2 * S] = 0
        for s, (expert, pairs) in enumerate(slots):
            table[s], table[S + s] = expert, pairs.numel()
            table[2 * S + s * P: 2 * S + s * P + pairs.numel()] = pairs.to(torch.int32).cpu()
        I, A = mem.bufs[Buf.I], mem.bufs[Buf.A]
        I[prog.st: prog.st + table.numel()] = table.to(I.device)
        I[prog.map: prog.map + self.n_experts] = torch.arange(self.n_experts, dtype=torch.int32) + self.row_of[prog.layer]
        off, rows, cols = prog.x
        A[off: off + rows * cols] = x.reshape(-1).to(A.device, torch.float32)
        for task in prog.tasks:
            REFERENCE[task.op.name](task, mem)
            if self.task_delay_s:
                time.sleep(self.task_delay_s)
        y_off, y_ld = prog.y
        y = A[y_off: y_off + P * y_ld].view(P, y_ld)
        return [(pairs, y[pairs.to(y.device)].clone()) for _, pairs in slots]


class WholeExpertRunner:
    """The experts of a call as whole matrices: per slot, one matmul per projection over its rows.  A
    layer call is a few dozen tensor ops instead of the tiles' hundreds of tasks (420 per dsv2-lite
    call at T=1, each with host syncs: ~100 ms on a GPU).  It rounds differently from the tiles
    (another summation blocking), which only matters where the helper could be bit-exact with main:
    the megakernel's main side computes its tiles in Triton, so its host-side helper uses this."""

    def __init__(self, cfg, store: torch.Tensor, layers: list[int], n_experts: int):
        self.I, self.H = cfg.moe_intermediate_size, cfg.hidden_size
        self.rows = store.reshape(-1, 3 * self.I * self.H)
        self.row_of = {layer: i * n_experts for i, layer in enumerate(layers)}  # store row of (layer, 0)

    def run(self, layer: int, topk: int, slots: list[tuple[int, torch.Tensor]],
            x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rows of experts `slots` [(expert, pair ids)] of `layer` for token rows x: [(pair ids, y rows)]."""
        I, H = self.I, self.H
        x = x.to(self.rows.device, torch.float32)
        out = []
        for expert, pairs in slots:
            w = self.rows[self.row_of[layer] + expert]
            pairs = pairs.to(self.rows.device)
            tokens = x[pairs // topk]
            gate, up = tokens @ w[: I * H].view(I, H).float().T, tokens @ w[I * H: 2 * I * H].view(I, H).float().T
            y = (torch.nn.functional.silu(gate) * up) @ w[2 * I * H:].view(H, I).float().T
            out.append((pairs, y))
        return out


def expert_store(cfg, weights: dict[str, torch.Tensor], layers: list[int], device, dtype) -> torch.Tensor:
    """Every routed expert of `layers` as one [layers·E, 3·I·H] tensor: row = gate | up | down
    (the layout of the main arena's slots)."""
    from model.schema import layer_prefix
    E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    store = torch.empty(len(layers) * E, 3 * I * H, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        p = layer_prefix(layer) + "mlp.experts."
        for e in range(E):
            row = store[i * E + e]
            for j, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
                row[j * I * H:(j + 1) * I * H] = weights[f"{p}{e}.{proj}.weight"].reshape(-1).to(device, dtype)
    return store


class HelperLink:
    """The main side's state for one helper: placement, sequence numbers, pending calls, metrics.
    `attach(runner)` gives a plan's Memory its own PlanLink (the program of that plan)."""

    def __init__(self, backend, placement: Placement, layers: list[int], n_experts: int, timeout_s: float = 1.0,
                 fallback: bool = False):
        self.backend, self.placement, self.layers, self.n_experts = backend, placement, layers, n_experts
        self.timeout_s, self.fallback = timeout_s, fallback
        self.metrics = HelperMetrics()
        self.stats = None  # a migration.RoutingStats, when migration is on
        self.seq: dict[int, int] = {}
        self.pending: dict[tuple[int, int], tuple] = {}
        if backend.digest() != placement.digest():
            raise RuntimeError("helper and main disagree on the expert placement (digest mismatch)")

    def attach(self, runner, program: bool = True) -> None:
        """Write the current expert maps into a runner's inputs and, for the plan interpreter (whose
        HELPER_CALL/HELPER_WAIT call the link: program=True), give its plan a link with the plan's tile
        program.  A megakernel's calls go through mailboxes instead (helper_card/mailbox.py)."""
        if program:
            runner.mem.helper = PlanLink(self, HelperProgramRunner(runner.plan, self.backend.store, self.layers,
                                                                   self.n_experts))
        write_expert_maps(runner.mem, self.placement)

    def set_placement(self, placement: Placement, runners) -> None:
        """A step-boundary flip: the helper's map and every plan's expert maps change together."""
        self.write_maps(placement, runners)
        self.commit(placement)

    def write_maps(self, placement: Placement, runners) -> None:
        """Every plan's expert maps, on the current stream: from the next step launched on, the device
        routes by `placement`.  Checked first: no map the device reads puts two experts in one slot."""
        placement.check()
        for r in runners:
            write_expert_maps(r.mem, placement)

    def commit(self, placement: Placement) -> None:
        """The host side of a flip (of maps write_maps checked and wrote): the helper's map and the
        placement the link's calls are checked and chosen against."""
        self.backend.set_placement(placement)
        self.placement = placement


@dataclass
class PlanLink:
    """What HELPER_CALL / HELPER_WAIT of one plan talk to."""

    link: HelperLink
    program: HelperProgramRunner
    fallback_program: HelperProgramRunner | None = None  # its own buffers: a timed-out call may still be running

    def skipped(self, layer: int) -> None:
        self.link.metrics.skipped += 1

    def routed(self, layer: int, experts: torch.Tensor, counts: torch.Tensor) -> None:
        """The layer's slot table (expert ids, -1 for empty slots; rows per slot) for routing statistics."""
        if self.link.stats is not None:
            keep = experts >= 0
            self.link.stats.add(layer, experts[keep].cpu().numpy(), counts[keep].cpu().numpy())

    def publish(self, layer: int, site: int, slots: list[tuple[int, torch.Tensor]], x: torch.Tensor) -> int:
        link = self.link
        for expert, _ in slots:
            if not link.placement.on_helper(layer, expert):
                raise RuntimeError(f"layer {layer} expert {expert} published to the helper, which the placement "
                                   f"keeps on main")
        seq = link.seq.get(layer, 0) + 1
        link.seq[layer] = seq
        x = x.detach().clone()
        link.pending[(layer, seq)] = (site, slots, x)
        link.backend.submit(functools.partial(self.program.run, site), layer, seq, slots, x)
        link.metrics.calls += 1
        link.metrics.rows += sum(int(p.numel()) for _, p in slots)
        return seq

    def wait(self, layer: int, seq: int):
        link = self.link
        t0 = time.perf_counter()
        site, slots, x = link.pending.pop((layer, seq))
        try:
            return link.backend.result(layer, seq, link.timeout_s)
        except HelperTimeout:
            link.backend.abandon(layer, seq)
            if not link.fallback:
                raise
            link.metrics.fallbacks += 1
            if self.fallback_program is None:
                self.fallback_program = HelperProgramRunner(self.program.plan, link.backend.fallback_store,
                                                            link.layers, link.n_experts)
            return self.fallback_program.run(site, slots, x)  # the same program, main side, own buffers
        finally:
            link.metrics.exposed_wait_s += time.perf_counter() - t0


class ExpertMaps:
    """Writes a plan's expert maps (expert -> main slot, or HELPER: one int32 input per MoE layer; a plan
    without the MTP layers has none for them).  The maps' word positions are fixed per plan, so their
    index goes to the device once; a flip copies only the values, from one pinned staging buffer, and
    scatters them: a flip happens between two decode steps, on every token's path (docs/PERF.md,
    sessions 8 and 9: a synchronous copy per layer waited behind the copy engine's expert transfers,
    and rebuilding the index per flip was host time between steps)."""

    def __init__(self, mem: Memory, placement: Placement):
        self.layers = [layer for layer in placement.tables if f"in.L{layer}.expert_map" in mem.io]
        where = []
        for layer in self.layers:
            slot, n = mem.io[f"in.L{layer}.expert_map"], len(placement.tables[layer])
            if slot.buf != Buf.I or slot.rows * slot.cols != n:
                raise ValueError(f"expert map {slot} of layer {layer} is not {n} int32 words of the I buffer")
            where.append(slot.offset + np.arange(n))
        self.buf = mem.bufs[Buf.I]
        cuda = mem.device.type == "cuda"
        self.index = torch.from_numpy(np.concatenate(where or [np.zeros(0, np.int64)])).to(mem.device)
        # pinned, so the host does not wait for the copy (stream order suffices)
        self.staging = torch.empty(len(self.index), dtype=torch.int32, pin_memory=cuda)
        self.copied = torch.cuda.Event() if cuda else None  # the staging buffer's last copy

    def write(self, placement: Placement) -> None:
        if not self.layers:
            return
        if self.copied is not None:
            self.copied.synchronize()  # the previous flip's copy has read the staging buffer (long since)
        np.concatenate([placement.tables[layer] for layer in self.layers], out=self.staging.numpy(),
                       casting="same_kind")
        values = self.staging.to(self.buf.device, non_blocking=True)
        self.buf.index_copy_(0, self.index, values)
        if self.copied is not None:  # on the stream the copy went to (the map's device), whatever is current
            self.copied.record(torch.cuda.current_stream(self.buf.device))


_expert_maps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Memory -> its ExpertMaps


def write_expert_maps(mem: Memory, placement: Placement) -> None:
    """Every MoE layer's expert map of `placement` into a plan's memory (its ExpertMaps, made once: a
    helper's placements all cover the same layers)."""
    maps = _expert_maps.get(mem)
    if maps is None:
        maps = _expert_maps[mem] = ExpertMaps(mem, placement)
    maps.write(placement)
