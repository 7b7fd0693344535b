"""The host's helper service for the megakernel: answers helper calls through host-mapped mailboxes.

A megakernel step is one graph replay, so no host code runs between a layer's HELPER_CALL and
its HELPER_WAIT.  The call's body writes the request into its site's mailbox (graph.isa.box_layout:
the routed slot table, the token rows) and publishes the step's epoch as the sequence number.  A
thread here polls every site's sequence number and answers; HELPER_WAIT acquires the answer within
LaunchConfig.helper_timeout_s.  Two ways to answer:
- a helper GPU (cuda:N) runs the plan's own expert tiles with the megakernel (kernel_helper): the
  thread writes the helper's slot table and the row mask and replays the site's graph on GPU N,
  which copies the rows in and out and acknowledges by itself; the output is bit for bit the
  all-on-main engine's;
- any other helper (cpu) gets the call through its backend, computing whole experts
  (link.WholeExpertRunner); the thread writes the rows and their mask, then the acknowledgement.

Metrics come from the mailboxes too, at the step boundary: a site whose sequence number is the
step's epoch published (its helper rows are counted from its table), any other skipped; the wait
HELPER_WAIT measured on the device timer is the exposed wait.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from graph.isa import BOX_ACK, BOX_SEQ, BOX_T_ACKED, BOX_T_ANSWER, BOX_T_PUB, BOX_WAIT_NS, Buf, box_layout, decode

from .kernel_helper import KernelHelper, helper_table
from .link import HelperLink, HelperTimeout, WholeExpertRunner
from .persistent import PersistentHelper
from .placement import HELPER

IDLE_S = 0.05  # polling this long without a request (and no step in flight), the thread sleeps until a launch
# (at once after a step's boundary began: nothing can arrive before the next launch kicks it, and a thread
# polling through the boundary takes the GIL from the host's own work there, docs/PERF.md session 9)
BUSY_S = 10.0  # a launched step keeps the thread polling until its boundary (count_step), at most this long
# While a service thread runs, the interpreter hands the GIL to a waiting thread after this long instead
# of Python's default 5 ms: the host's own Python during a step (overlapped migration right after a
# launch, ~1 ms in phases of up to 0.4 ms) then delays a helper call's answer by at most about this
# (docs/PERF.md session 10: with the default, steps that migrated were up to 9% slower; session 12: at
# 50 us, a migrating step's exposed wait was still 0.1-0.5 ms over the same placements' without
# migration, so 10 us).  Process-wide, so it is restored when the last service closes.
SWITCH_S = 1e-5
_switch = {"services": 0, "saved": None}
_switch_lock = threading.Lock()


def _hold_switch_interval(on: bool) -> None:
    with _switch_lock:
        if on:
            if _switch["services"] == 0:
                _switch["saved"] = sys.getswitchinterval()
                sys.setswitchinterval(min(SWITCH_S, _switch["saved"]))
            _switch["services"] += 1
        else:
            _switch["services"] -= 1
            if _switch["services"] == 0:
                sys.setswitchinterval(_switch["saved"])


@dataclass(frozen=True)
class CallTimes:
    """One helper call's timeline, in nanoseconds: the main GPU's and the helper GPU's %globaltimer
    stamps (0 without a timer) and the host's time.time_ns().  Comparable only where the clocks agree
    (both GPUs' timers follow the host's clock; see tools/helper_bench.py's check of their order)."""

    layer: int
    published: int  # HELPER_CALL's rows and sequence number out (main GPU)
    noticed: int  # the service thread began the answer (host)
    handed: int  # ... and handed it over: the helper GPU's graph replayed, or the host's answer written (host)
    answered: int  # the helper GPU's rows out (helper GPU; 0 when the host answered)
    acked: int  # HELPER_WAIT saw the answer (main GPU)
    wait_ns: int  # HELPER_WAIT's exposed wait


@dataclass
class CallSite:
    """One HELPER_CALL of the plan and where its mailbox lies in Buf.H (words)."""

    signal: int  # the call's op id (helper_card.link.layer_programs keys its program by it)
    layer: int
    box: int
    S: int
    N: int
    K: int
    P: int

    @functools.cached_property
    def parts(self) -> dict[str, int]:
        """Word offsets of the mailbox's parts in Buf.H (read on every call and at every step boundary)."""
        return {k: self.box + v for k, v in box_layout(self.S, self.P, self.N, self.K).items()}


def call_sites(plan) -> list[CallSite]:
    sites = {}
    for w in plan.words:
        t = decode(w)
        if t.op.name == "HELPER_CALL" and t.signal not in sites:
            sites[t.signal] = CallSite(t.signal, t["layer"], t["box.off"], t["S"], t["N"], t["K"], t["N"] * t["topk"])
    return [sites[k] for k in sorted(sites)]


class MailboxService:
    """Serves one megakernel runner's helper calls from a thread.  `kick()` at every launch wakes it."""

    def __init__(self, link: HelperLink, runner, helper_workers: int = 0, persistent: bool = False):
        """persistent: a helper GPU answers with a persistent kernel per step (helper_card/persistent.py),
        and no host thread serves the calls."""
        self.link, self.runner = link, runner
        self.sites = call_sites(runner.plan)
        box = runner.mem.bufs[Buf.H]
        if box.device.type != "cpu":
            raise ValueError("the helper mailboxes must be in host memory (Buf.H of a helper plan)")
        self.words = box.numpy()  # views of the same host memory the GPU writes
        self.rows = self.words.view(np.float32)
        # a GPU helper runs the plan's own tiles with the megakernel, one graph per site (bit-exact);
        # another computes whole experts (the main side's Triton tiles round differently anyway)
        self.kernel: KernelHelper | None = None
        self.persistent: PersistentHelper | None = None
        self.program: WholeExpertRunner | None = None
        store = link.backend.store
        if persistent and not (runner.device.type == "cuda" and store.device.type == "cuda"):
            raise ValueError("a persistent helper kernel needs a CUDA main runner and a helper GPU (--helper cuda:N)")
        if persistent:
            workers = helper_workers or torch.cuda.get_device_properties(store.device).multi_processor_count
            self.persistent = PersistentHelper(runner, store, link.layers, link.n_experts, workers)
            self.persistent.capture()
        elif runner.device.type == "cuda" and store.device.type == "cuda":
            workers = helper_workers or torch.cuda.get_device_properties(store.device).multi_processor_count
            self.kernel = KernelHelper(runner, store, link.layers, link.n_experts, workers)
            self.kernel.capture(box, {s.signal: {**s.parts, "box": s.box} for s in self.sites})
        else:
            self.program = WholeExpertRunner(runner.mem.cfg, store, link.layers, link.n_experts)
        # every site's sequence word read in one gather per turn of the poll loop: the thread holds the
        # GIL for a few microseconds per turn, not one Python read per site (26 on DeepSeek-V2-Lite),
        # so the main thread's own Python between steps is not kept waiting
        self.seq_at = np.array([s.box + BOX_SEQ for s in self.sites], dtype=np.int64)
        self.served = self.words[self.seq_at].astype(np.int64)
        # each site's slot table (expert ids, then rows per slot) and wait word, for the step boundary's
        # counts as a few array operations (padded slots read word 0 and are masked off)
        width = max((s.S for s in self.sites), default=0)
        self.slot_valid = np.array([[j < s.S for j in range(width)] for s in self.sites], dtype=bool).reshape(-1, width)
        self.expert_at = np.array([[s.parts["table"] + min(j, s.S - 1) for j in range(width)] for s in self.sites],
                                  dtype=np.int64).reshape(-1, width)
        self.count_at = self.expert_at + np.array([[s.S] for s in self.sites], dtype=np.int64).reshape(-1, 1)
        self.wait_at = np.array([s.box + BOX_WAIT_NS for s in self.sites], dtype=np.int64)
        # a call's timeline (HelperMetrics.timeline): the device stamps' words, and the host's own
        self.stamps_at = np.array([[s.box + w for w in (BOX_T_PUB, BOX_T_ANSWER, BOX_T_ACKED)] for s in self.sites],
                                  dtype=np.int64).reshape(-1, 3)
        self.host_ns = np.zeros((len(self.sites), 2), dtype=np.int64)  # answer begun, answer handed over
        self.site_layers = [s.layer for s in self.sites]
        self.stat_rows = link.stats.rows_of(self.site_layers) if link.stats is not None else None
        self._rows: tuple = (None, None)  # (a placement's layer rows, each site's row in its grid)
        self.counted_epoch = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()  # the thread's answers against failures()/count_step on the main thread
        self.wake = threading.Event()
        self.busy_until = 0.0
        self.closing = False
        self.thread = None
        if self.persistent is None:  # the host answers: a thread polls the mailboxes
            self.thread = threading.Thread(target=self._serve, name="helper-mailbox", daemon=True)
            _hold_switch_interval(True)
            self.thread.start()

    def kick(self) -> None:
        """Before each launch of the runner: the persistent helper kernel of that step, or the thread's wake-up."""
        if self.persistent is not None:
            self.persistent.place(self.link.placement)  # what the step's maps route by (flips land between steps)
            self.persistent.launch(self.runner.epoch + 1)
            return
        self.busy_until = time.perf_counter() + BUSY_S  # before the wake-up, which the thread reads after
        self.wake.set()

    def failures(self) -> str:
        """What went wrong in the service thread or on a helper GPU, once ('' if nothing): a watchdog
        error names it."""
        with self.lock:  # no replay on the helper GPU while its sites are checked and repaired
            errors, self.errors = self.errors, []
            if self.kernel is not None:
                errors += self.kernel.failures()
            if self.persistent is not None:
                errors += self.persistent.failures()
        return ("helper service: " + "; ".join(errors[-3:])) if errors else ""

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        if self.persistent is not None:  # a helper kernel still waiting on the last step's sites ends
            self.persistent.close()
            return
        self.wake.set()
        self.thread.join(timeout=5)
        _hold_switch_interval(False)
        if self.thread.is_alive():
            raise RuntimeError("helper mailbox thread did not stop within 5 s (a call still running?)")
        if self.kernel is not None:  # graphs still queued on the helper GPU write the mailbox: let them land
            torch.cuda.synchronize(self.kernel.device)
            for site in self.kernel.sites.values():
                site.graph = None

    # ---- the service thread ----------------------------------------------------------------
    def _serve(self) -> None:
        if self.kernel is not None:
            torch.cuda.set_device(self.kernel.device)  # graphs replay on the helper GPU's stream
        last = time.perf_counter()
        while not self.closing:
            seqs = self.words[self.seq_at]
            new = np.flatnonzero(seqs > self.served)
            busy = len(new) > 0
            for i in new.tolist():
                site, seq = self.sites[i], int(seqs[i])
                try:
                    with self.lock:
                        self._answer(i, site, seq)
                except Exception as e:  # noqa: BLE001 - the thread must outlive one bad call
                    with self.lock:
                        self.errors.append(f"layer {site.layer} call {seq}: {e!r}")
            now = time.perf_counter()
            if busy:
                last = now
            elif now > self.busy_until and (self.busy_until == 0.0 or now - last > IDLE_S):
                self.wake.clear()
                if time.perf_counter() > self.busy_until:  # a kick after clear() set busy_until first
                    self.wake.wait(0.5)
                last = time.perf_counter()
            else:
                time.sleep(0)  # let the backend's worker thread run

    def _request(self, site: CallSite, seq: int):
        """(table, the helper's slots, x) of call `seq`, or None if the device overwrote it meanwhile (it gave
        up on it).  x (the token rows) only where the host computes: a helper GPU reads them from the mailbox."""
        at = site.parts
        table = self.words[at["table"]: at["table"] + 2 * site.S + site.S * site.P].copy()
        x = None if self.kernel is not None else self.rows[at["x"]: at["x"] + site.N * site.K].copy()
        if int(self.words[site.box + BOX_SEQ]) != seq:
            return None
        placement = self.link.placement
        chosen = [s for s in range(site.S) if table[s] >= 0 and placement.on_helper(site.layer, int(table[s]))]
        return table, chosen, None if x is None else torch.from_numpy(x).view(site.N, site.K)

    def _answer(self, i: int, site: CallSite, seq: int) -> None:
        self.host_ns[i] = time.time_ns(), 0
        self._answer_call(i, site, seq)
        self.host_ns[i, 1] = time.time_ns()

    def _answer_call(self, i: int, site: CallSite, seq: int) -> None:
        self.served[i] = seq
        request = self._request(site, seq)
        if request is None:
            return
        table, chosen, x = request
        S, P, at = site.S, site.P, site.parts
        pairs = {s: table[2 * S + s * P: 2 * S + s * P + table[S + s]].astype(np.int64) for s in chosen}
        mask = np.zeros(P, dtype=np.int32)  # the pair rows that are the helper's
        for p in pairs.values():
            mask[p] = 1
        if self.kernel is not None:  # the helper GPU copies the rows in and out and acknowledges itself
            self.words[at["mask"]: at["mask"] + P] = mask
            self.kernel.replay(site.signal, helper_table(table, S, chosen), seq)
            return
        backend = self.link.backend
        slots = [(int(table[s]), torch.from_numpy(p)) for s, p in pairs.items()]
        try:
            backend.submit(functools.partial(self.program.run, site.layer, P // site.N), site.layer, seq, slots, x)
            rows = backend.result(site.layer, seq, self.link.timeout_s)
        except HelperTimeout:
            backend.abandon(site.layer, seq)
            return  # no answer: HELPER_WAIT's bound turns it into the step's error
        # any other failure is recorded by _serve and raised at the step boundary (the device times out)
        ans = self.rows[at["ans"]: at["ans"] + P * site.K].reshape(P, site.K)
        for p, y in rows:
            ans[p.cpu().numpy()] = y.detach().to("cpu", torch.float32).numpy()
        self.words[at["mask"]: at["mask"] + P] = mask
        self.words[site.box + BOX_ACK] = seq  # after the rows (x86 stores stay in order)

    # ---- at the step boundary -------------------------------------------------------------
    def count_step(self) -> None:
        """Metrics and routing statistics of the runner's last step, read from its mailboxes."""
        self.busy_until = 0.0  # the step is over: the thread may sleep until the next launch
        with self.lock:
            errors, self.errors = self.errors, []
        if errors:
            raise RuntimeError("helper service failed: " + "; ".join(errors))
        epoch = self.runner.epoch
        if epoch == self.counted_epoch:
            return
        self.counted_epoch = epoch
        metrics, stats = self.link.metrics, self.link.stats
        if not self.sites:
            return
        called = self.words[self.seq_at] == epoch  # a site that skipped its call kept an older number
        experts, counts = self.words[self.expert_at], self.words[self.count_at]
        used = (experts >= 0) & self.slot_valid
        site, slot = np.nonzero(used)
        if stats is not None:  # routing of every site, called or not (a skipped call routed to main only)
            stats.add_at(self.stat_rows[site], experts[site, slot], counts[site, slot])
        placement = self.link.placement
        if placement.row is not self._rows[0]:  # copies share their original's row map
            self._rows = (placement.row, np.array([placement.row[layer] for layer in self.site_layers], dtype=np.int64))
        on_helper = placement.grid[self._rows[1][site], experts[site, slot]] == HELPER
        metrics.skipped += int((~called).sum())
        metrics.calls += int(called.sum())
        metrics.rows += int(counts[site, slot][on_helper & called[site]].sum())
        metrics.exposed_wait_s += float(self.words[self.wait_at][called].astype(np.int64).sum()) * 1e-9
        if metrics.timeline is not None and called.any():
            lo, hi = self.words[self.stamps_at[called]].astype(np.int64), self.words[self.stamps_at[called] + 1]
            pub, answer, acked = ((lo & 0xFFFFFFFF) | (hi.astype(np.int64) << 32)).T
            for k, i in enumerate(np.flatnonzero(called).tolist()):
                metrics.timeline.append(CallTimes(self.sites[i].layer, int(pub[k]), int(self.host_ns[i, 0]),
                                                  int(self.host_ns[i, 1]), int(answer[k]), int(acked[k]),
                                                  int(self.words[self.wait_at[i]])))
