"""Cost model: how long a task takes on one worker, calibrated by measured H200 figures.

Figures from ../shared/DESIGN.md (one H200, 2026-11-29): streaming read 4.10 TB/s
for the whole chip; a cross-CTA dependency hop 0.7-0.85 µs.  fp32 CUDA-core
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
    task_overhead: float = 0.4e-6  # decode the task word, address math, signal
    hop_latency: float = 0.8e-6  # producer's release -> consumer sees the counter

    def task_seconds(self, weight_bytes: int, act_bytes: int, flops: int, workers: int) -> float:
        active = max(1, min(workers, self.sms))
        bw = self.read_bw / active
        return self.task_overhead + max((weight_bytes + act_bytes) / bw, flops / (self.flops / self.sms))

    def floor_seconds(self, step_bytes: float) -> float:
        return step_bytes / self.read_bw
