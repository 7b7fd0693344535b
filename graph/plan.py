"""The Plan: per-worker queues of instruction words plus everything a runtime needs to run them.

A plan is data: printable (`describe()`), dumpable and diffable (`to_json()`),
and verified (graph.verify) whenever it is built or loaded.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field

import numpy as np

from .isa import WORDS, decode


@dataclass
class WeightSlot:
    name: str
    buf: int
    offset: int
    rows: int
    cols: int
    parts: list  # [(HF tensor name, element offset within this slot)]


@dataclass
class IOSlot:
    buf: int
    offset: int
    rows: int
    cols: int


@dataclass
class Plan:
    config: dict  # the model's HF config.json
    shape: dict  # StepShape fields
    workers: int
    words: np.ndarray  # int32 [tasks, WORDS], worker-major
    queue_ptr: list[int]  # worker w runs tasks queue_ptr[w] .. queue_ptr[w+1]-1
    task_labels: list[str]
    counter_labels: list[str]
    buffers: dict[str, int]  # buffer name -> elements
    weights: list[WeightSlot]
    consts: list[dict]  # {name, offset, data}
    io: dict[str, IOSlot]
    passes: list[dict]
    estimate: dict
    options: dict = field(default_factory=dict)

    @property
    def num_tasks(self) -> int:
        return int(self.words.shape[0])

    @property
    def num_counters(self) -> int:
        return len(self.counter_labels)

    def queue(self, worker: int) -> range:
        return range(self.queue_ptr[worker], self.queue_ptr[worker + 1])

    def task(self, i: int):
        return decode(self.words[i])

    def opcode_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for i in range(self.num_tasks):
            name = self.task(i).op.name
            counts[name] = counts.get(name, 0) + 1
        return counts

    # ---- serialisation -------------------------------------------------------
    def to_json(self) -> str:
        d = {
            "format": "megakernel-plan/1",
            "config": self.config, "shape": self.shape, "workers": self.workers,
            "words": base64.b64encode(self.words.astype("<i4").tobytes()).decode(),
            "queue_ptr": self.queue_ptr, "task_labels": self.task_labels, "counter_labels": self.counter_labels,
            "buffers": self.buffers, "weights": [asdict(w) for w in self.weights], "consts": self.consts,
            "io": {k: asdict(v) for k, v in self.io.items()}, "passes": self.passes, "estimate": self.estimate,
            "options": self.options,
        }
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str, verify: bool = True) -> "Plan":
        d = json.loads(text)
        if d.get("format") != "megakernel-plan/1":
            raise ValueError(f"not a megakernel plan (format {d.get('format')!r})")
        words = np.frombuffer(base64.b64decode(d["words"]), dtype="<i4").reshape(-1, WORDS).astype(np.int32)
        plan = cls(
            config=d["config"], shape=d["shape"], workers=d["workers"], words=words, queue_ptr=d["queue_ptr"],
            task_labels=d["task_labels"], counter_labels=d["counter_labels"], buffers=d["buffers"],
            weights=[WeightSlot(**w) for w in d["weights"]], consts=d["consts"],
            io={k: IOSlot(**v) for k, v in d["io"].items()}, passes=d["passes"], estimate=d["estimate"],
            options=d.get("options", {}),
        )
        if verify:
            from .verify import verify_plan
            verify_plan(plan)
        return plan

    # ---- description ---------------------------------------------------------
    def describe(self) -> str:
        lines = [f"plan for {self.config.get('architectures', ['?'])[0]}: T={self.shape['T']} B={self.shape['B']} "
                 f"max_len={self.shape['max_len']} mtp_passes={self.shape['mtp_passes']}, {self.workers} workers"]
        lines.append("passes:")
        for p in self.passes:
            detail = ", ".join(f"{k}={v}" for k, v in p.items() if k not in ("pass", "by_opcode", "changes"))
            lines.append(f"  {p['pass']:<10} {detail}")
            for change in p.get("changes", [])[:12]:
                lines.append(f"      {change}")
            if len(p.get("changes", [])) > 12:
                lines.append(f"      ... {len(p['changes']) - 12} more")
        lines.append(f"tasks: {self.num_tasks} in {self.workers} queues, {self.num_counters} counters")
        counts = self.opcode_counts()
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])))
        est = self.estimate
        lines.append("buffers: " + ", ".join(f"{k} {v:,} elements" for k, v in self.buffers.items()))
        lines.append(f"estimate ({est['scheduler']}): critical path {est['critical_path_ms']:.3f} ms, "
                     f"work {est['work_ms']:.3f} ms over {self.workers} workers, balance {est['balance']:.2f}, "
                     f"bytes {est['bytes'] / 1e6:.2f} MB")
        loads = est["worker_ms"]
        lines.append(f"  per-worker load ms: min {min(loads):.4f} median {sorted(loads)[len(loads) // 2]:.4f} "
                     f"max {max(loads):.4f}")
        return "\n".join(lines)

    def dump_tasks(self, worker: int | None = None) -> str:
        """One line per task: queue, label, opcode, flags, waits, signal and fields."""
        lines = []
        workers = range(self.workers) if worker is None else [worker]
        for w in workers:
            for i in self.queue(w):
                t = self.task(i)
                waits = " ".join(f"c{c}>={n}e" for c, n in t.waits)
                fields = " ".join(f"{k}={v}" for k, v in t.fields.items() if not k.endswith(".buf") or v >= 0)
                lines.append(f"w{w} #{i} {self.task_labels[i]} {t.op.name}{list(t.op.flag_names(t.flags))} "
                             f"wait[{waits}] signal c{t.signal} {fields}")
        return "\n".join(lines)

