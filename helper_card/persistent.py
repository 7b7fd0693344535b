"""A persistent helper kernel: the helper GPU answers the main step's calls with no host on the call path.

The host-paced helper GPU (kernel_helper.py) costs each call a host thread's notice, its Python and a
graph replay on the helper GPU: 0.10-0.14 ms a call on dsv2-lite (docs/PERF.md, session 12), which is
what the per-step bar of issue 6 turns on.  Here one megakernel on the helper GPU is launched per step,
beside the main step (a launch hook of the main runner), and runs every call site in layer order:
HELPER_RECV (wait for the site's call, or for the main step to pass it), the site's expert tiles (the
main plan's own, as kernel_helper's site plans: bit for bit the all-on-main rows), HELPER_SEND (rows,
mask, acknowledgement into the mailbox).  See megakernel/ops/helper_side.py for the two bodies.

Each site's RECV waits for the previous site's SEND, so the sites run one after another on buffers
shaped like main's (main's memory plan reuses places across layers), at no cost to a call: the main
step publishes site s+1 only after it acquired site s's answer.  The step a launch answers is fixed on
the device (the kernel's own launch count + epoch0), so a late kernel never takes a newer step's call.
A site the step passes without a call says so itself (HELPER_CALL writes the step into the mailbox's
BOX_PASSED word), so a kernel ends with its main step, with nothing from the host: the host's part per
step is the placement's helper flags (`onh`, when the placement changed) and the launch, before the
main step's launch.  After a failed main step the host writes CTL_DONE, so the sites the step never
reached end their wait; a RECV that outlives its bound passes its site too, without an error (a main
step that does call later reports its own bounded error).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from graph.isa import CTL_DONE, MAX_WAITS, Buf, decode, encode
from graph.plan import Plan
from megakernel.runtime import INTERPRET, LaunchConfig, Megakernel

from .kernel_helper import STREAM_BLOCKS, with_slack
from .link import HelperMemory, LayerProgram, layer_programs
from .placement import HELPER, Placement


def persistent_plan(main: Plan, store_elems: int, n_experts: int, workers: int, epoch0: int = 0) -> tuple[Plan, dict]:
    """Every call site of `main` as RECV, its expert tiles, SEND, in layer order, over the helper's
    buffers (A like main's; I like main's, then the kernel's gave-up word, then per site its helper
    flags per expert and its sequence word).  The kernel's n-th launch answers the main runner's step
    n + epoch0.  Returns the plan and, per site (keyed by the call's op id), {"onh": the I offset of
    the helper flags the host writes, "layer"}."""
    calls = {t.signal: t for t in map(decode, main.words) if t.op.name == "HELPER_CALL"}
    progs: dict[int, LayerProgram] = layer_programs(main)
    order = sorted(progs)  # op ids follow program order: the main step calls the sites in this order
    if not order:
        raise ValueError("the main plan has no HELPER_CALL: nothing for a persistent helper to answer")
    gaveup = main.buffers["I"]
    i_end = gaveup + 1
    done = calls[order[0]]["box.off"] + CTL_DONE
    items, labels, sites = [], [], {}
    counter = 0
    last_send = None
    for k, signal in enumerate(order):
        prog, call = progs[signal], calls[signal]
        onh, seqw = i_end, i_end + n_experts
        i_end = seqw + 1
        sites[signal] = {"onh": onh, "layer": prog.layer}
        N, K, S, topk = call["N"], call["K"], call["S"], call["topk"]
        x_ld = next(t["x.ld"] for t in prog.tasks if t.op.name == "EXPERT_LINEAR" and t.has("GATHER"))
        common = {"box.buf": Buf.H, "box.off": call["box.off"], "st.buf": Buf.I, "st.off": prog.st,
                  "seqw.buf": Buf.I, "seqw.off": seqw, "N": N, "K": K, "S": S, "topk": topk, "layer": prog.layer}
        recv = counter
        counter += 1
        items.append(("HELPER_RECV", recv, [] if last_send is None else [(last_send, 1)],
                      {**common, "done.buf": Buf.H, "done.off": done, "onh.buf": Buf.I, "onh.off": onh, "x.buf": Buf.A,
                       "x.off": prog.x[0], "x.ld": x_ld, "gaveup.buf": Buf.I, "gaveup.off": gaveup,
                       "epoch0": epoch0, "E": n_experts}, 0, 0))
        labels.append(f"L{prog.layer}.helper.recv")
        number = {}  # the site's counters, renumbered
        for t in prog.tasks:
            number.setdefault(t.signal, counter + len(number))
        counter += len(number)
        waited = {c for t in prog.tasks for c, _ in t.waits if c in number}
        signalled: dict[int, int] = {}
        for i, t in enumerate(prog.tasks):
            waits = [(number[c], n) for c, n in t.waits if c in number] or [(recv, 1)]
            items.append((t.op.name, number[t.signal], waits, t.fields, t.tile, t.flags))
            labels.append(f"L{prog.layer}.helper.{t.op.name.lower()}[{i}]")
            signalled[t.signal] = signalled.get(t.signal, 0) + 1
        sinks = [(number[c], n) for c, n in signalled.items() if c not in waited]
        if len(sinks) > MAX_WAITS:
            raise ValueError(f"layer {prog.layer}: {len(sinks)} last ops in the site's tiles, a SEND waits on at most "
                             f"{MAX_WAITS}")
        last_send = counter
        counter += 1
        items.append(("HELPER_SEND", last_send, sinks,
                      {**common, "y.buf": Buf.A, "y.off": prog.y[0], "y.ld": prog.y[1]}, 0, 0))
        labels.append(f"L{prog.layer}.helper.send")
    workers = max(1, min(workers, len(items)))
    queues: list[list[int]] = [[] for _ in range(workers)]
    for i in range(len(items)):  # program order within each queue: a task waits only on earlier ones
        queues[i % workers].append(i)
    words, task_labels = [], []
    for q in queues:
        for i in q:
            op, signal, waits, fields, tile, flags = items[i]
            words.append(encode(op, flags, signal, waits, tile, fields))
            task_labels.append(labels[i])
    plan = Plan(config=main.config, shape=dict(main.shape), workers=workers,
                words=np.array(words, dtype=np.int32), queue_ptr=np.cumsum([0] + [len(q) for q in queues]).tolist(),
                task_labels=task_labels, counter_labels=[f"helper counter {c}" for c in range(counter)],
                buffers={"W": store_elems, "WF": 1, "A": main.buffers["A"], "I": i_end, "C": 1, "H": main.buffers["H"]},
                weights=[], consts=[], io={}, passes=[], estimate={})
    return plan, sites


class PersistentHelper:
    """The persistent helper kernel of one main runner (a helper plan's megakernel) on `store`'s device.
    Its n-th launch answers the runner's step n + epoch0: the runner must launch it before each of its
    own launches (MailboxService.kick, a launch hook), which `launch` checks."""

    def __init__(self, main, store: torch.Tensor, layers: list[int], n_experts: int, workers: int = 32):
        self.main, self.device = main, store.device
        flat = with_slack(store)
        self.epoch0 = main.epoch  # the helper kernel has not run yet (its epoch is 0)
        self.plan, self.sites = persistent_plan(main.plan, flat.numel(), n_experts, workers, self.epoch0)
        self.box = main.mem.bufs[Buf.H]  # the main runner's mailboxes, in host memory both GPUs reach
        done = self.plan.task(0)["done.off"]
        self.done = self.box.numpy()[done: done + 1]  # CTL_DONE
        mem = HelperMemory(self.plan, flat)
        mem.bufs[Buf.W], mem.bufs[Buf.H] = flat, self.box
        I = mem.bufs[Buf.I]
        row_of = {layer: i * n_experts for i, layer in enumerate(layers)}
        for prog in layer_programs(main.plan).values():  # each layer's expert map -> its store rows
            I[prog.map: prog.map + n_experts] = (torch.arange(n_experts, dtype=torch.int32) + row_of[prog.layer])
        # a tile may wait on its site's RECV from the kernel's start: its bound outlasts a RECV's (which
        # passes its site, no error), so a give-up never turns into a counter timeout
        config = LaunchConfig(blocks={k: main.blocks[k] for k in STREAM_BLOCKS}, num_warps=main.config.num_warps,
                              num_stages=main.config.num_stages,
                              timeout_s=main.config.timeout_s + main.config.helper_timeout_s,
                              max_spins=main.config.max_spins, helper_timeout_s=main.config.helper_timeout_s)
        self.mk = Megakernel(self.plan, None, self.device, store.dtype, config=config, mem=mem)
        cuda = self.device.type == "cuda"
        # the placement's helper flags, staged in pinned memory for a copy on the helper's stream that
        # never holds up the host; an event says when the staging may be written again
        self.flags = torch.zeros((len(self.sites), n_experts), dtype=torch.int32, pin_memory=cuda)
        self.flags_read = torch.cuda.Event() if cuda else None
        self.placed: np.ndarray | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def place(self, placement: Placement) -> None:
        """Each site's helper flags from `placement` (the one the main step routes by), copied on the
        helper's stream before the next launch when they changed."""
        flags = np.stack([placement.tables[s["layer"]] == HELPER for s in self.sites.values()]).astype(np.int32)
        if self.placed is not None and np.array_equal(flags, self.placed):
            return
        if self.flags_read is not None:
            self.flags_read.synchronize()  # the last copy out of the staging has run (long since, as a rule)
        self.placed = flags
        self.flags.numpy()[:] = flags
        I = self.mk.mem.bufs[Buf.I]
        with torch.cuda.device(self.device) if self.flags_read is not None else contextlib.nullcontext():
            for k, site in enumerate(self.sites.values()):
                I[site["onh"]: site["onh"] + flags.shape[1]].copy_(self.flags[k], non_blocking=True)
            if self.flags_read is not None:
                self.flags_read.record()

    def capture(self) -> None:
        """The helper kernel as a graph on its device: one replay per step, a few microseconds of the
        host's time before the main step's launch.  Compiled and loaded first (warmup runs nothing: a
        launch would wait for a main step)."""
        if INTERPRET or self.device.type != "cuda":
            return
        with torch.cuda.device(self.device):
            self.mk.compile()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.mk.kernel()

    def release(self, epoch: int) -> None:
        """CTL_DONE up to `epoch` (it only grows): a helper kernel still waiting on that step ends.  Only
        for a step known to be over (failed, or the last before close): a running step's sites still to
        come would pass unanswered."""
        self.done[0] = max(int(self.done[0]), epoch)

    def launch(self, epoch: int) -> None:
        """Answer step `epoch` of the main runner (call before the main step's launch, after `place`)."""
        if epoch != self.mk.epoch + 1 + self.epoch0:
            raise RuntimeError(f"persistent helper: the main runner launches step {epoch}, but the helper's next "
                               f"launch answers step {self.mk.epoch + 1 + self.epoch0} (a main launch without it)")
        if self.graph is not None:
            with torch.cuda.device(self.device):
                self.graph.replay()
            self.mk.epoch += 1
        else:
            self.mk.launch()

    def close(self) -> None:
        self.release(self.main.epoch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graph = None

    def failures(self) -> list[str]:
        """The helper kernel's watchdog error, if it stopped (its counters then repaired for the next step)."""
        from megakernel.runtime import WatchdogError
        self.release(self.main.epoch)  # a kernel still waiting for a failed step's sites ends first
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out = []
        try:
            self.mk.check_error()
        except WatchdogError as e:
            out.append(f"persistent helper: {e}")
        gaveup = int(self.mk.mem.bufs[Buf.I][self.plan.task(0)["gaveup.off"]])
        if gaveup == self.main.epoch:
            out.append(f"persistent helper: a site waited out its bound ({self.mk.config.helper_timeout_s} s) in "
                       f"step {gaveup}, and the step's later sites went unanswered")
        return out

