"""Adaptive k: how many drafts the next speculative step verifies, from the acceptance so far.

Expected tokens per step with k drafts and conditional per-position acceptance p_i (draft i
accepted given drafts 1..i-1 were) is 1 + sum_{i<=k} prod_{j<=i} p_j; the best k maximises
that over the step time of k (one captured graph per k).  The policy keeps a moving average
of p_i per position, updated only where a step reached position i, starting optimistic (so
every position gets tried), and probes one draft deeper now and then so a position it stopped
drafting can recover.  Switching k is free of
risk: verification decides what is kept, so output is the same for any sequence of k.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


def load_sweep(path: str | Path) -> dict[int, float]:
    """Step time per k from a measured sweep: a JSON list of {"k": K, "step_ms": MS, ...}
    (tools/spec_sweep.py writes one)."""
    try:
        return {int(r["k"]): float(r["step_ms"]) for r in json.loads(Path(path).read_text())}
    except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"step-time sweep {path}: expected a JSON list of {{\"k\": K, \"step_ms\": MS}} objects "
                         f"({type(e).__name__}: {e})") from e


def expected_tokens(accept: list[float], k: int) -> float:
    total, chain = 1.0, 1.0
    for i in range(k):
        chain *= accept[i] if i < len(accept) else 0.0
        total += chain
    return total


@dataclass
class AdaptiveK:
    """kmax: the deepest captured graph; step_ms[k]: step time per k (a measured sweep, or a model)."""

    kmax: int
    step_ms: dict[int, float]
    decay: float = 0.8  # weight of the past in the moving average
    prior: float = 1.0  # acceptance assumed before a position is observed: optimistic, so it gets tried
    probe_every: int = 16  # steps between probes one draft beyond the current choice
    accept: list[float] = field(default_factory=list)
    steps: int = 0
    chosen: list[int] = field(default_factory=list)

    def __post_init__(self):
        missing = [k for k in range(self.kmax + 1) if k not in self.step_ms]
        if missing:
            raise ValueError(f"adaptive k needs a step time for every k in 0..{self.kmax}; missing {missing}")
        self.accept = self.accept or [self.prior] * self.kmax

    def choose(self) -> int:
        best = max(range(self.kmax + 1), key=lambda k: (expected_tokens(self.accept, k) / self.step_ms[k], -k))
        if self.probe_every and self.steps % self.probe_every == self.probe_every - 1:
            best = min(best + 1, self.kmax)
        self.chosen.append(best)
        return best

    def observe(self, k: int, accepted: list[int]) -> None:
        """One step verified k drafts; accepted[b] of them were kept for each live sequence b."""
        self.steps += 1
        for a in accepted:
            for i in range(min(a + 1, k)):  # positions 1..a accepted, a+1 rejected (if drafted)
                hit = 1.0 if i < a else 0.0
                self.accept[i] = self.decay * self.accept[i] + (1 - self.decay) * hit

    @classmethod
    def linear(cls, kmax: int, base_ms: float = 1.0, per_draft_ms: float = 0.05, **kw) -> "AdaptiveK":
        """Step times from the linear model base + k x per-draft (until a measured sweep exists)."""
        return cls(kmax, {k: base_ms + k * per_draft_ms for k in range(kmax + 1)}, **kw)
