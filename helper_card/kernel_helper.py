"""A helper GPU that runs the main plan's own expert tiles, with the megakernel.

For each call site the layer's expert tasks (helper_card.link.layer_programs: EXPERT_LINEAR and
EWISE tiles rewritten to address the helper's store) become a small plan of their own: the same
words, counters renumbered, waits on anything outside the layer's experts dropped (the inputs are
copied in before the launch), queues dealt round-robin in program order.  The persistent kernel
runs it with the main runner's stream block sizes, so each row is summed exactly as the main side
would have summed it: bit for bit the all-on-main output, where the helper is the same kind of GPU.

On the helper GPU one CUDA graph per site holds the whole call: copy the helper's slot table and
the token rows in (from pinned staging and from the mailbox), launch, copy the rows out to the
mailbox and publish the acknowledgement (ops.helper.copy_rows and publish_rows: kernels, which
reach host memory from any GPU).  The mailbox thread's part of a call
is to write the table and the mask and replay the graph; it never waits for the helper GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graph.isa import BOX_ACK, Buf, encode
from graph.plan import Plan
from megakernel.memory import STREAM_SLACK
from megakernel.runtime import INTERPRET, LaunchConfig, Megakernel

from .link import HelperMemory, LayerProgram, layer_programs

STREAM_BLOCKS = ("BR", "KC", "TB", "DEPTH")  # with num_warps, what decides how a row is summed: main's


def site_plan(main: Plan, prog: LayerProgram, store_elems: int, workers: int) -> Plan:
    """The tasks of one call site as a plan over the helper's buffers (A and I shaped like main's)."""
    tasks = prog.tasks
    counters = sorted({t.signal for t in tasks})
    number = {c: i for i, c in enumerate(counters)}
    workers = max(1, min(workers, len(tasks)))
    queues = [[] for _ in range(workers)]
    for i, t in enumerate(tasks):  # program order within each queue: a task waits only on earlier ones
        waits = [(number[c], n) for c, n in t.waits if c in number]
        queues[i % workers].append((encode(t.op.name, t.flags, number[t.signal], waits, t.tile, t.fields),
                                    f"L{prog.layer}.helper.{t.op.name.lower()}[{i}]"))
    order = [item for q in queues for item in q]
    ptr = np.cumsum([0] + [len(q) for q in queues]).tolist()
    return Plan(config=main.config, shape=dict(main.shape), workers=workers,
                words=np.array([w for w, _ in order], dtype=np.int32), queue_ptr=ptr,
                task_labels=[label for _, label in order],
                counter_labels=[main.counter_labels[c] for c in counters],
                buffers={"W": store_elems, "WF": 1, "A": main.buffers["A"], "I": main.buffers["I"], "C": 1, "H": 0},
                weights=[], consts=[], io={}, passes=[], estimate={})


def with_slack(store: torch.Tensor) -> torch.Tensor:
    """The store as one flat arena with STREAM_SLACK readable elements past its end (the weight stream
    reads whole chunks): a view when the storage already has them (make_backend allocates so)."""
    flat = store.reshape(-1)
    room = store.untyped_storage().nbytes() // store.element_size() - store.storage_offset()
    if room >= flat.numel() + STREAM_SLACK:
        return torch.as_strided(store, (flat.numel() + STREAM_SLACK,), (1,), store.storage_offset())
    padded = torch.zeros(flat.numel() + STREAM_SLACK, dtype=store.dtype, device=store.device)
    padded[: flat.numel()] = flat
    return padded


@dataclass
class Site:
    prog: LayerProgram
    mk: Megakernel
    staging: torch.Tensor  # host (pinned on a GPU): the helper's slot table, then the sequence number
    seq: torch.Tensor  # on the helper's device: the sequence number of the table the call read
    x_ld: int  # the token rows' stride, as the gate/up tiles read them
    graph: torch.cuda.CUDAGraph | None = None

    @property
    def table_words(self) -> int:
        return self.staging.numel() - 1


class KernelHelper:
    """Per call site of `main` (a megakernel runner of a helper plan): the site's expert tiles as a
    Megakernel over `store` (every routed expert, on the helper's device)."""

    def __init__(self, main, store: torch.Tensor, layers: list[int], n_experts: int, workers: int = 32):
        self.device = store.device
        self.compiled = self.device.type == "cuda" and not INTERPRET
        flat = with_slack(store)
        blocks = {k: main.blocks[k] for k in STREAM_BLOCKS}
        row_of = {layer: i * n_experts for i, layer in enumerate(layers)}
        self.sites: dict[int, Site] = {}
        mem = None  # one set of buffers for every site: calls run one after another on the helper's stream
        for signal, prog in layer_programs(main.plan).items():
            plan = site_plan(main.plan, prog, flat.numel(), workers)
            if mem is None:
                mem = HelperMemory(plan, flat)
                mem.bufs[Buf.W] = flat
            # the layer's expert map (an input of main's plan: its place is never reused) -> store rows
            mem.bufs[Buf.I][prog.map: prog.map + n_experts] = (torch.arange(n_experts, dtype=torch.int32)
                                                                + row_of[prog.layer]).to(self.device)
            config = LaunchConfig(blocks=blocks, num_warps=main.config.num_warps, num_stages=main.config.num_stages)
            mk = Megakernel(plan, None, self.device, store.dtype, config=config, mem=mem)
            staging = torch.zeros(2 * prog.S + prog.S * prog.P + 1, dtype=torch.int32,
                                  pin_memory=self.device.type == "cuda")
            x_ld = next(t["x.ld"] for t in prog.tasks if t.op.name == "EXPERT_LINEAR" and t.has("GATHER"))
            self.sites[signal] = Site(prog, mk, staging, torch.zeros(1, dtype=torch.int32, device=self.device), x_ld)

    def rows_out(self, site: Site) -> torch.Tensor:
        """The site's expert output rows [P, K] (fp32), on the helper's device."""
        y_off, y_ld = site.prog.y
        return site.mk.mem.bufs[Buf.A].as_strided((site.prog.P, site.prog.x[2]), (y_ld, 1), y_off)

    def _call(self, site: Site, x: torch.Tensor, x_ld: int, ans: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, ack: torch.Tensor | None = None):
        """A call's kernels, in stream order: table and token rows in, the site's tiles, then (with a
        mailbox) the rows out and the acknowledgement.  x: [N, K] fp32, anywhere a kernel can read."""
        from megakernel.ops.helper import copy_rows, publish_rows
        prog, A, I = site.prog, site.mk.mem.bufs[Buf.A], site.mk.mem.bufs[Buf.I]
        N, K, P = prog.x[1], prog.x[2], prog.P
        gate = site.staging[site.table_words:]  # the call's sequence word, written by the host last
        # the table, and the sequence number its copy acquired: a graph that runs late (after main gave up
        # and the host staged the next call) acknowledges the call whose table it read, never the next one
        copy_rows[(1,)](site.staging, 0, I[prog.st:], 0, site.table_words, gate, site.seq, self.compiled, True,
                        BLOCK=1024)
        copy_rows[(N,)](x, x_ld, A[prog.x[0]:], site.x_ld, K, gate, site.seq, self.compiled, False, BLOCK=1024)
        site.mk.kernel()
        if ans is not None:
            publish_rows[(1,)](A[prog.y[0]:], prog.y[1], ans, mask, P, K, ack, gate, site.seq, site.mk.err,
                               self.compiled, BLOCK=1024)

    def run(self, signal: int, table: np.ndarray, x: torch.Tensor) -> torch.Tensor:
        """One call, synchronously (CPU tests under TRITON_INTERPRET): the helper's slot table and token
        rows in, the site's rows [P, K] out."""
        site = self.sites[signal]
        site.staging[: table.size] = torch.from_numpy(table.astype(np.int32))
        x = x.to(self.device, torch.float32)
        site.mk.compile()
        self._call(site, x, x.stride(0))
        site.mk.epoch += 1
        site.mk.check_error()
        return self.rows_out(site)

    # ---- on a GPU: one graph per site, replayed by the mailbox thread --------------------------
    def capture(self, box_words: torch.Tensor, box_offsets: dict[int, dict[str, int]]) -> None:
        """box_words: the main runner's mailboxes (pinned int32); box_offsets[signal]: that site's parts
        (absolute word offsets: x, mask, ans, and 'box' for its header)."""
        rows_f32 = box_words.view(torch.float32)
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device):
            for signal, site in self.sites.items():
                at, prog = box_offsets[signal], site.prog
                args = (site, rows_f32[at["x"]:], prog.x[2], rows_f32[at["ans"]:], box_words[at["mask"]:],
                        box_words[at["box"] + BOX_ACK:])
                site.staging.zero_()
                site.staging[: prog.S] = -1  # an empty table: the dry run below computes nothing
                site.mk.compile()
                self._call(*args)  # compiles and loads every kernel the graph holds (none may load mid-capture)
                site.mk.epoch += 1
                torch.cuda.synchronize(self.device)
                site.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(site.graph, stream=stream):
                    self._call(*args)

    def failures(self) -> list[str]:
        """Sites whose kernel stopped on its watchdog (their counters repaired, so the next call runs)."""
        from megakernel.runtime import WatchdogError
        out = []
        torch.cuda.synchronize(self.device)
        for site in self.sites.values():
            try:
                site.mk.check_error()
            except WatchdogError as e:
                out.append(f"helper GPU, layer {site.prog.layer}: {e}")
        return out

    def replay(self, signal: int, table: np.ndarray, seq: int) -> None:
        site = self.sites[signal]
        site.staging[: table.size] = torch.from_numpy(table.astype(np.int32))
        site.staging[-1] = seq
        site.graph.replay()
        site.mk.epoch += 1


def helper_table(table: np.ndarray, S: int, chosen) -> np.ndarray:
    """The routed slot table with only the slots in `chosen` (the helper's) kept, the others empty."""
    out = table.copy()
    for s in range(S):
        if out[s] >= 0 and s not in chosen:
            out[s], out[S + s] = -1, 0
    return out
