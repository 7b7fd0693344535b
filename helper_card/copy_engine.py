"""The async copy engine: fills main expert slots from the helper's store in the background.

On a GPU a copy runs on its own stream, from pinned host staging (or a device
store), after an event that marks the end of every step that may still read
the slot, and records its own event; on the CPU it runs on a worker thread.
The placement flips to the new slot only at a step boundary after the copy has
finished, so a step never reads a slot being written.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

import torch

from .migration import Move


@dataclass
class _Copy:
    move: Move
    done_event: torch.cuda.Event | None = None
    future: concurrent.futures.Future | None = None

    def done(self) -> bool:
        if self.future is not None:
            return self.future.done()
        return self.done_event.query()

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
        else:
            self.done_event.synchronize()


class CopyEngine:
    """arena: the main slots [capacity, 3·I·H]; store: every expert [layers·E, 3·I·H]; row(layer, e)
    is the store row of an expert."""

    def __init__(self, arena: torch.Tensor, store: torch.Tensor, row):
        self.arena, self.row = arena, row
        self.cuda = arena.device.type == "cuda"
        if self.cuda:
            # the stream's source must be pinned host memory (or device memory) for a true async copy
            self.store = store if store.device.type == "cuda" else store.pin_memory()
            self.stream = torch.cuda.Stream(device=arena.device)
            # a store on another GPU (a cuda:N helper's): peer copies run on a stream of that GPU, beside
            # (not behind) the helper's own work there, and leave PCIe to the step's input copies
            peer = self.store.device.type == "cuda" and self.store.device != arena.device
            self.src_stream = torch.cuda.Stream(device=self.store.device) if peer else None
        else:
            self.store = store
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="expert-copy")
        self.in_flight: list[_Copy] = []
        self.bytes_moved = 0

    def fill(self, slots: dict[int, tuple[int, int]]) -> None:
        """Synchronous initial fill: slot -> (layer, expert)."""
        for slot, (layer, e) in slots.items():
            self.arena[slot].copy_(self.store[self.row(layer, e)])

    def start(self, move: Move) -> None:
        """Copy move's expert into its slot once the steps launched so far are done with the slot."""
        src, dst = self.store[self.row(move.layer, move.expert)], self.arena[move.slot]
        if self.cuda:
            after = torch.cuda.current_stream(self.arena.device).record_event()
            with torch.cuda.stream(self.stream), torch.cuda.stream(self.src_stream):
                self.stream.wait_event(after)
                # across GPUs PyTorch copies on the source's current stream, fenced both ways with
                # the destination's (here self.stream), so done_event still marks the copy's end
                dst.copy_(src, non_blocking=True)
                copy = _Copy(move, done_event=self.stream.record_event())
        else:
            copy = _Copy(move, future=self.pool.submit(dst.copy_, src))
        self.in_flight.append(copy)
        self.bytes_moved += dst.numel() * dst.element_size()

    def finished(self) -> list[Move]:
        """Moves whose copy has landed (removed from the in-flight list)."""
        flags = [(c, c.done()) for c in self.in_flight]  # once each: a copy may land in between
        done = [c for c, d in flags if d]
        self.in_flight = [c for c, d in flags if not d]
        for c in done:
            c.wait()  # re-raises a failed CPU copy
        return [c.move for c in done]

    def busy_slots(self) -> set[int]:
        return {c.move.slot for c in self.in_flight}

    def moving(self) -> set[tuple[int, int]]:
        """(layer, expert) of every copy in flight."""
        return {(c.move.layer, c.move.expert) for c in self.in_flight}

    def drain(self, timeout_s: float = 10.0) -> list[Move]:
        """Wait for every copy in flight (tests, shutdown); bounded."""
        deadline = time.perf_counter() + timeout_s
        landed: list[Move] = []
        while self.in_flight:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{len(self.in_flight)} expert copies still in flight after {timeout_s} s")
            time.sleep(0.001)
            landed += self.finished()
        return landed
