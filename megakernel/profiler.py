"""Measuring the megakernel: launches per step (torch.profiler), per-task timelines (device global timer).

`count_launches` counts the CUDA kernels and memory copies a step really issues.
`task_trace` reads the (begin, ready, end, SM) stamps the kernel writes when
launched with profile=True and turns them into a Chrome/Perfetto trace (one
track per worker), a per-op table and, with matplotlib, a PNG timeline.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch


def count_launches(step, steps: int = 5) -> dict:
    """Run `step()` `steps` times under the profiler; device activities per step, by kind."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = memcpy = memset = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        if "memcpy" in name:
            memcpy += 1
        elif "memset" in name:
            memset += 1
        else:
            kernels += 1
    return {"kernels_per_step": kernels / steps, "memcpy_per_step": memcpy / steps, "memset_per_step": memset / steps,
            "launches_per_step": (kernels + memcpy + memset) / steps}


def _op_name(label: str) -> str:
    """'L3.attn.q_proj[2]' -> 'attn.q_proj' (the op family within a layer)."""
    label = re.sub(r"\[\d+\]$", "", label)
    return re.sub(r"^(L\d+|mtp\d+)\.", "", label)


def task_trace(kernel, path: str | Path, png: bool = True) -> dict:
    """Write a Chrome trace (Perfetto opens it) of the last profiled step; returns the per-op table."""
    plan = kernel.plan
    stamps = kernel.prof.view(-1, 4).cpu().numpy()
    t0 = stamps[:, 0][stamps[:, 0] > 0].min()
    events, per_op = [], defaultdict(lambda: {"tasks": 0, "busy_us": 0.0, "wait_us": 0.0})
    for w in range(plan.workers):
        for i in plan.queue(w):
            begin, ready, end, sm = stamps[i]
            if end == 0:
                continue
            name = plan.task_labels[i]
            events.append({"name": name, "ph": "X", "pid": 0, "tid": w, "ts": (ready - t0) / 1e3,
                           "dur": max(0.001, (end - ready) / 1e3),
                           "args": {"sm": int(sm), "wait_us": (ready - begin) / 1e3}})
            if ready > begin:
                events.append({"name": "wait", "ph": "X", "pid": 0, "tid": w, "ts": (begin - t0) / 1e3,
                               "dur": (ready - begin) / 1e3})
            row = per_op[_op_name(name)]
            row["tasks"] += 1
            row["busy_us"] += (end - ready) / 1e3
            row["wait_us"] += (ready - begin) / 1e3
    path = Path(path)
    meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": w, "args": {"name": f"worker {w}"}}
            for w in range(plan.workers)]
    path.write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ns"}))
    span_us = (stamps[:, 2].max() - t0) / 1e3
    table = {"step_us": float(span_us), "ops": dict(per_op)}
    if png:
        _timeline_png(stamps, plan, t0, path.with_suffix(".png"))
    return table


def _timeline_png(stamps: np.ndarray, plan, t0: int, out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(14, max(3, plan.workers * 0.06)))
    colors = {}
    for w in range(plan.workers):  # one collection per worker: an artist per task took minutes on 40k tasks
        spans, faces = [], []
        for i in plan.queue(w):
            begin, ready, end, _ = stamps[i]
            if end == 0:
                continue
            op = _op_name(plan.task_labels[i]).split(".")[-1]
            spans.append(((ready - t0) / 1e3, max(0.01, (end - ready) / 1e3)))
            faces.append(colors.setdefault(op, plt.cm.tab20(len(colors) % 20)))
        if spans:
            ax.broken_barh(spans, (w, 0.9), facecolors=faces, linewidth=0)
    ax.set_xlabel("µs since the first task started")
    ax.set_ylabel("worker")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), fontsize=6, ncol=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
