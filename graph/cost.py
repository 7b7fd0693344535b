"""Cost model: how long a task takes on one worker, calibrated by measured H200 figures.

Figures from ../shared/DESIGN.md (one H200, 2026-11-29): streaming read 4.10 TB/s
for the whole chip; a cross-CTA dependency hop 0.7-0.85 µs; a task's fixed cost from
the megakernel's own trace (session 14).  fp32 CUDA-core
rate ~67 TFLOP/s (datasheet).  A task's time is its fixed overhead plus the
larger of its bytes over the worker's share of bandwidth and its flops over the
worker's share of arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    read_bw: float = 4.10e12  # bytes/s, whole chip
    flops: float = 67e12  # fp32 FMA rate, whole chip
    sms: int = 132
    # a task's fixed cost: the word, its waits, address math, the first loads' round trips, the signal.
    # Session 14's dsv2-lite trace: streamed tasks ~1 us + bytes / 23 GB/s, one-task ops (norms, rope,
    # the route) 2-8 us.  At 0.4 us the scheduler thought the route window short and stacked two
    # shared-expert tiles on the workers idle in it: 3 us made dsv2-lite 5% faster (docs/PERF.md)
    task_overhead: float = 3e-6
    hop_latency: float = 0.8e-6  # producer's release -> consumer sees the counter

    def task_seconds(self, weight_bytes: int, act_bytes: int, flops: int, workers: int) -> float:
        active = max(1, min(workers, self.sms))
        bw = self.read_bw / active
        return self.task_overhead + max((weight_bytes + act_bytes) / bw, flops / (self.flops / self.sms))

    def floor_seconds(self, step_bytes: float) -> float:
        return step_bytes / self.read_bw
