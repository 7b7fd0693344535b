"""Which ops' outputs differ between steps that should be bit-identical (a nondeterminism bisect, GPU).

    python tools/step_diff.py [--model dsv2-lite] [--layers 2] [--stream-kernel] [--steps 16] [--launches 4]
        [--set KEY=V ...]   # config fields overridden, e.g. moe_intermediate_size=1024

One plan (T = B = 1, every tensor in its own region: reuse_memory off, so a region's last writer is its only
writer), one token and one cache, stepped --steps times from the same cache: the first --launches as plain
launches, the rest as replays of one captured graph.  Each step's logits are compared with the most common
result; for every step that differs, the ops whose tasks wrote other bits than that step's reference are
listed (task counts per op, in plan order), so the first op in the dependency chain that differs is where the
nondeterminism starts.  Session 29 found the stream kernel's now-and-then wrong shared-expert down task this way
(a ring slot refilled under a warp's last loads: fixed in session 30, docs/PERF.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from graph.compile import CompileOptions, compile_step  # noqa: E402
from graph.footprint import footprint  # noqa: E402
from graph.isa import Buf  # noqa: E402
from graph.lower import StepShape  # noqa: E402
from model import init_weights, preset  # noqa: E402


def op_of(label: str) -> str:
    return label.split("[")[0]


def written_tasks_that_differ(plan, a: dict, b: dict) -> list[int]:
    """The tasks that wrote (A or I) elements that differ between snapshots a and b."""
    diff = {buf: ~((a[buf] == b[buf]) | (a[buf].isnan() & b[buf].isnan())) if a[buf].is_floating_point()
            else a[buf] != b[buf] for buf in a}
    return [t for t in range(plan.num_tasks)
            if any(acc.write and acc.buf in diff and not acc.empty and
                   any(diff[acc.buf][lo:hi].any().item() for lo, hi in acc.rows()) for acc in footprint(plan.task(t)))]


def step_diff(model: str, layers: int | None, stream_kernel: bool, steps: int, launches: int,
              max_len: int = 256, ctx: int = 200, overrides: dict | None = None) -> dict:
    from megakernel.runtime import Megakernel
    cfg = preset(model).replace(**(overrides or {}))
    if layers:
        cfg = cfg.replace(num_hidden_layers=layers)
    workers = torch.cuda.get_device_properties(0).multi_processor_count
    plan = compile_step(cfg, StepShape(T=1, B=1, max_len=max_len),
                        CompileOptions(workers=workers, stream_kernel=stream_kernel, reuse_memory=False))
    mk = Megakernel(plan, init_weights(cfg, seed=0, device="cuda", dtype=torch.bfloat16), "cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    mk.cache().copy_(torch.randn(mk.cache().shape, device="cuda", generator=g))
    saved = mk.cache().clone()
    tokens = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda", generator=g)
    lens = torch.tensor([ctx], device="cuda")
    logits, snaps = [], []
    for i in range(steps):
        mk.cache().copy_(saved)
        if i == launches:
            mk.capture()
        logits.append(mk.step(tokens, lens).logits.clone())
        snaps.append({Buf.A: mk.mem.bufs[Buf.A].clone(), Buf.I: mk.mem.bufs[Buf.I].clone()})
    same = [sum(torch.equal(x, y) for y in logits) for x in logits]
    ref_i = same.index(max(same))  # the most common result
    worker_of = {t: w for w in range(plan.workers) for t in plan.queue(w)}
    order = list(dict.fromkeys(op_of(label) for label in plan.task_labels))  # worker-major: read the chain by name
    report = {"model": model, "overrides": overrides or {}, "layers": layers, "stream_kernel": stream_kernel,
              "steps": steps, "launches": launches, "differing_steps": {}}
    for i in range(steps):
        if not torch.equal(logits[i], logits[ref_i]):
            tasks = written_tasks_that_differ(plan, snaps[i], snaps[ref_i])
            per_op = collections.Counter(op_of(plan.task_labels[t]) for t in tasks)
            report["differing_steps"][i] = {op: per_op[op] for op in order if per_op[op]}
            report.setdefault("differing_tasks", {})[i] = [
                f"{plan.task_labels[t]} (worker {worker_of[t]})" for t in tasks
                if per_op[op_of(plan.task_labels[t])] < 8]
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dsv2-lite")
    p.add_argument("--layers", type=int, default=2, help="the model's first N layers (0: all)")
    p.add_argument("--stream-kernel", action="store_true", help="compile with stream_kernel=1 (a Gluon LINEAR kernel)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--launches", type=int, default=4, help="steps run as plain launches before the graph's replays")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=V",
                   help="config fields to override (ints), e.g. moe_intermediate_size=1024")
    p.add_argument("--out", help="write the report as JSON here")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_diff needs a GPU: it looks for nondeterminism in the compiled kernel")
    overrides = {k: int(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    report = step_diff(a.model, a.layers or None, a.stream_kernel, a.steps, a.launches, overrides=overrides)
    n = len(report["differing_steps"])
    print(f"{a.model} layers={a.layers} stream_kernel={int(a.stream_kernel)}: {n} of {a.steps} steps differ from "
          "the most common result")
    for i, ops in report["differing_steps"].items():
        print(f"  step {i}: " + ", ".join(f"{op} {k}" for op, k in ops.items()))
        print(f"    tasks of ops with fewer than 8 differing: {', '.join(report['differing_tasks'][i])}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
