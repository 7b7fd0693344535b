"""Helper backends behind one interface: where the helper's experts are computed.

- `emulate`: on the main device, by the same code (tests: every protocol path, bit-exact).
- `cpu`: a worker thread on the host's own copy of the experts; rows travel through host
  memory.  Bit-exact with a CPU main side; against a GPU main side the CPU's fp32 matmuls
  differ in rounding (within bf16 tolerance).
- `cuda:N`: the same worker thread driving GPU N, which holds its own copy of the experts;
  rows move device to device (peer to peer where the driver allows).  The same kernels as a
  main side on the same kind of GPU: bit-exact there.  The thread waits for GPU N to finish a
  call before answering, so a timeout bounds the helper's whole work.  This serves the plan
  interpreter's steps; the megakernel's single-replay step would need a device-side mailbox
  (a persistent loop on GPU N polling flags in memory both GPUs map): not built.

Every backend answers `submit` at once and `result` within a bound (HelperTimeout otherwise),
and checks the placement digest before the first call.
"""

from __future__ import annotations

import abc
import queue
import threading
import time

import torch

from .link import HelperTimeout
from .placement import Placement


class HelperBackend(abc.ABC):
    """`store`: the helper's copy of every routed expert ([layers·E, 3·I·H], on the helper's device).
    Calls carry the program (helper_card.link.HelperProgramRunner) of the plan that published them."""

    name = "helper"

    def __init__(self, store: torch.Tensor, placement: Placement, fallback_store: torch.Tensor | None = None):
        self.store = store
        # what a main-side fallback computes from: never the helper's own device, which may be the
        # one that stopped answering (cuda:N keeps the host copy for it)
        self.fallback_store = store if fallback_store is None else fallback_store
        self.placement = placement.copy()  # the helper's own copy of the map, checked against main's
        self.stall_s = 0.0  # test hook: the helper stops answering for this long

    def digest(self) -> str:
        """The helper's own digest of the map it holds (compared by the main side)."""
        return self.placement.digest()

    def set_placement(self, placement: Placement) -> None:
        self.placement = placement.copy()

    @abc.abstractmethod
    def submit(self, job, layer: int, seq: int, slots, x) -> None:
        """Queue call `seq` of `layer`: job(slots, x) computes its rows (the plan's program for the call)."""

    @abc.abstractmethod
    def result(self, layer: int, seq: int, timeout_s: float):
        """Call `seq`'s rows once computed, waiting at most timeout_s (HelperTimeout past it)."""

    def abandon(self, layer: int, seq: int) -> None:
        """The main side gave up on this call (timeout): skip it if it has not started."""

    def close(self) -> None:
        pass


class EmulatedHelper(HelperBackend):
    """Computes at `result` time on the main device: deterministic, for tests of every path."""

    name = "emulate"

    def __init__(self, store, placement):
        super().__init__(store, placement)
        self.calls: dict[tuple[int, int], tuple] = {}

    def submit(self, job, layer, seq, slots, x):
        self.calls[(layer, seq)] = (job, slots, x.detach().clone())

    def result(self, layer, seq, timeout_s):
        if self.stall_s > timeout_s:
            time.sleep(timeout_s)
            raise HelperTimeout(f"emulated helper: layer {layer} call {seq} unanswered after {timeout_s:.3f} s")
        job, slots, x = self.calls.pop((layer, seq))
        return job(slots, x)


class ThreadHelper(HelperBackend):
    """A worker thread computing on the store's device (the host, or a GPU of its own); answers land
    in a per-call slot."""

    def __init__(self, store, placement, fallback_store=None):
        super().__init__(store, placement, fallback_store)
        self.device = store.device
        self.name = "cpu" if self.device.type == "cpu" else str(self.device)
        self.inbox: queue.Queue = queue.Queue()
        self.answers: dict[tuple[int, int], object] = {}
        self.abandoned: set[tuple[int, int]] = set()
        self.ready = threading.Condition()
        self.thread = threading.Thread(target=self._serve, name=f"helper-{self.name}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the thread's own current device: its work runs on GPU N
        while True:
            item = self.inbox.get()
            if item is None:
                return
            job, layer, seq, slots, x = item
            if self.stall_s:
                time.sleep(self.stall_s)
            with self.ready:
                if (layer, seq) in self.abandoned:
                    self.abandoned.discard((layer, seq))
                    continue
            try:
                answer = job([(e, p.to(self.device)) for e, p in slots], x)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # answered means computed
            except Exception as e:  # delivered to the waiting side, never swallowed
                answer = e
            with self.ready:
                self.answers[(layer, seq)] = answer
                self.ready.notify_all()

    def submit(self, job, layer, seq, slots, x):
        staged = x.detach().to(self.device, torch.float32).clone()
        self.inbox.put((job, layer, seq, slots, staged))

    def result(self, layer, seq, timeout_s):
        deadline = time.perf_counter() + timeout_s
        with self.ready:
            while (layer, seq) not in self.answers:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise HelperTimeout(f"{self.name} helper: layer {layer} call {seq} unanswered after {timeout_s:.3f} s "
                                        f"({self.inbox.qsize()} calls queued)")
                self.ready.wait(left)
            answer = self.answers.pop((layer, seq))
            for key in [k for k in self.answers if k[0] == layer and k[1] < seq]:
                del self.answers[key]  # late answers to calls that timed out
        if isinstance(answer, Exception):
            raise RuntimeError(f"{self.name} helper failed on layer {layer} call {seq}: {answer!r}") from answer
        return answer

    def abandon(self, layer, seq):
        with self.ready:
            if self.answers.pop((layer, seq), None) is None:
                self.abandoned.add((layer, seq))

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join(timeout=5)


def on_device(store: torch.Tensor, device) -> torch.Tensor:
    """A copy of the store on `device` whose storage runs STREAM_SLACK elements past its end: the
    megakernel's weight stream, which a GPU helper runs too (kernel_helper), reads whole chunks."""
    from megakernel.memory import STREAM_SLACK
    flat = torch.zeros(store.numel() + STREAM_SLACK, dtype=store.dtype, device=device)
    flat[: store.numel()].copy_(store.reshape(-1))
    return flat[: store.numel()].view(store.shape)


def make_backend(kind: str, store: torch.Tensor, placement: Placement) -> HelperBackend:
    """kind: emulate (store stays where it is) | cpu (store copied to host memory) | cuda:N (store
    copied to GPU N)."""
    if kind == "emulate":
        return EmulatedHelper(store, placement)
    if kind == "cpu":
        return ThreadHelper(store.to("cpu"), placement)
    if kind.startswith("cuda:"):
        index = kind[5:]
        if not index.isdigit():
            raise ValueError(f"--helper {kind}: write cuda:N with N a GPU index")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(index) >= count:
            raise ValueError(f"--helper {kind}: this machine has {count} CUDA device(s)")
        return ThreadHelper(on_device(store, kind), placement, fallback_store=store)
    raise ValueError(f"unknown helper backend {kind!r} (none, cpu, emulate, cuda:N)")
