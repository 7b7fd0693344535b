"""Replay a measured megakernel step offline: where the time goes, and what another plan would take.

    python tools/replay.py TRACE.json --model dsv2-lite [--ctx 4096] [--workers 132]
        [--plan KEY=V,...]      # the traced plan's compile options, if not today's defaults
        [--variant KEY=V,...]   # also predict a plan compiled with these options

TRACE.json is the Perfetto trace `tools/bench.py --profile` (or `--profile` on the CLI)
writes: one event per task with its measured busy time.  The tool recompiles the plan the
trace came from, then:
1. replays its queues with the measured task times and a dependency hop: if this lands near
   the measured step, the queue/dependency model explains the step;
2. computes the critical path with unlimited workers and sums it by op: the ops that set
   the step time when the chain, not the queue placement, is the limit;
3. with --variant (tiling options of graph.tiling.TilingOptions, attn_split, or fusion rules: expert_mlp=1),
   compiles that plan, gives each task a time from its op family's measured bandwidth (work from the task
   word, plus a fixed per-task overhead; a fused op the trace lacks takes its opcode's median rate, and
   is named), and replays it the same way: a prediction to check on the GPU, not a measurement.  Compare it
   with `--variant workers=132` (today's plan timed the same way), not with the measured replay;
4. with --layer N, the measured phases of layer N, op by op: when its first task was ready, its
   median and last, how late the median was after the ops it waits on had ended (a queue that put
   another op's task first), its span and the most tasks one worker ran.  Session 17 found both of
   its tiling fixes here (llama-1b's q|k|v in two rounds, dsv2-lite's routed down tiles queued
   behind the shared experts').
Plans are compiled here without shared counters (compile option shared_counters=0): the same queues and tasks,
with one counter per op, so each op's own producers are its dependencies (a shared counter stands for several
ops; the hop model charges one hop a dependency either way).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph.compile import compile_options, compile_step  # noqa: E402
from graph.footprint import footprint  # noqa: E402
from graph.isa import decode  # noqa: E402
from graph.lower import StepShape  # noqa: E402
from graph.schedule import SchedTask, critical_path, simulate  # noqa: E402
from model import preset  # noqa: E402
from tools.bench import pop_max_len, step_max_len  # noqa: E402


def family(label: str) -> str:
    """'L5.moe.expert_down[68]' -> 'moe.expert_down'."""
    return re.sub(r"^L\d+\.", "", label.split("[")[0])


def task_work(word) -> int:
    """What a task's time scales with: elements it touches (its footprint), except where the footprint
    is deliberately wider than the reads (attention: the whole cache; per-head matmuls: whole heads)."""
    f = word.fields
    if word.op.name == "ATTENTION":
        return f["split_len"] * f["width"] * (f["h1"] - f["h0"] if not word.has("MLA") else 1)
    if word.op.name == "HEAD_MATMUL":  # its footprint spans each head's whole weight block
        return (f["h1"] - f["h0"]) * f["in_dim"] * (f["o1"] - f["o0"])
    if word.op.name == "ATTN_COMBINE":
        return f["nsplits"] * (f["h1"] - f["h0"]) * f["dim"]
    work = sum((a.row1 - a.row0) * (a.col1 - a.col0) for a in footprint(word))
    if word.op.name == "EXPERT_LINEAR":  # its footprint leaves out the weights of the expert chosen at run time
        rows = f["r1"] - f["r0"]
        work += rows * f["K"] * (2 if word.has("SILU_MUL") else 1) + (rows * f["y.ld"] if word.has("DOWN_T") else 0)
    return work


def variant_seconds(words, labels, per_byte: dict, by_opcode: dict, fixed: float) -> tuple[list[float], dict]:
    """A variant's task times: the fixed overhead plus its work at its op family's measured rate, or, for a family
    the trace has no tasks of (a fusion rule's new op), at the median rate of the measured tasks of its opcode, or
    where the trace has none of those either, of every measured task.  Returns the times and {family: whose rate}
    of those borrowed rates."""
    out, borrowed = [], {}
    opcode_rate = {op: statistics.median(rates) for op, rates in by_opcode.items()}
    every_rate = None
    for w, label in zip(words, labels):
        fam = family(label)
        if fam in per_byte:
            rate = per_byte[fam]
        elif w.op.name in opcode_rate:
            rate, borrowed[fam] = opcode_rate[w.op.name], w.op.name
        else:
            if every_rate is None:
                every_rate = statistics.median(r for rates in by_opcode.values() for r in rates)
            rate, borrowed[fam] = every_rate, f"no {w.op.name} measured: every task's"
        out.append(fixed + rate * task_work(w))
    return out, borrowed


def load_trace(path: str) -> dict[str, float]:
    events = json.loads(Path(path).read_text())["traceEvents"]
    return {e["name"]: e["dur"] * 1e-6 for e in events if e.get("ph") == "X" and e["name"] != "wait"}


def load_events(path: str) -> dict[str, dict]:
    """label -> {ready, end, worker} in us from the step's start, as profiler.task_trace writes them."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return {e["name"]: {"ready": e["ts"], "end": e["ts"] + e["dur"], "worker": e["tid"]}
            for e in events if e.get("ph") == "X" and e["name"] != "wait"}


def phases(plan, parsed, events: dict[str, dict], layer: int) -> list[dict]:
    """Layer `layer`'s ops in the order their first task was ready, with the lateness of their median task:
    its ready time less the end of the latest op it waits on (0 when nothing else was in its way)."""
    words, deps, _ = parsed
    by_op: dict[int, list[dict]] = defaultdict(list)
    for w, label in zip(words, plan.task_labels):
        by_op[w.signal].append(events[label])
    prefix = f"L{layer}."
    rows = []
    for op, tasks in by_op.items():
        label = plan.counter_labels[op]
        if not label.startswith(prefix):
            continue
        ready = sorted(t["ready"] for t in tasks)
        deps_end = max((max(t["end"] for t in by_op[d]) for d in deps.get(op, ()) if d in by_op), default=0.0)
        per_worker = defaultdict(int)
        for t in tasks:
            per_worker[t["worker"]] += 1
        rows.append({"op": label, "tasks": len(tasks), "most_per_worker": max(per_worker.values()),
                     "first_ready_us": ready[0], "median_ready_us": ready[len(ready) // 2],
                     "late_us": max(0.0, ready[len(ready) // 2] - deps_end),
                     "last_end_us": max(t["end"] for t in tasks),
                     "span_us": max(t["end"] for t in tasks) - ready[0]})
    return sorted(rows, key=lambda r: r["first_ready_us"])


def print_phases(rows: list[dict], layer: int) -> None:
    print(f"\nlayer {layer}, measured (us from the step's start):")
    print(f"  {'op':<30}{'tasks':>6}{'most/w':>7}{'ready':>9}{'median':>9}{'late':>7}{'end':>9}{'span':>7}")
    for r in rows:
        print(f"  {r['op']:<30}{r['tasks']:>6}{r['most_per_worker']:>7}{r['first_ready_us']:>9.1f}"
              f"{r['median_ready_us']:>9.1f}{r['late_us']:>7.1f}{r['last_end_us']:>9.1f}{r['span_us']:>7.1f}")


def per_op(opts):
    """opts without shared counters (the module docstring says why)."""
    return dataclasses.replace(opts, shared_counters=False)


def structure(plan):
    if any("+" in label for label in plan.counter_labels):
        raise ValueError("replay reads a counter as one op: compile the plan with shared_counters=0 (per_op)")
    words = [decode(w) for w in plan.words]
    deps: dict[int, set[int]] = defaultdict(set)
    for w in words:
        deps[w.signal].update(c for c, _ in w.waits)
    queues = [list(range(plan.queue_ptr[q], plan.queue_ptr[q + 1])) for q in range(plan.workers)]
    return words, deps, queues


def scaled_seconds(words, seconds: list[float], spec: str) -> list[float]:
    """Task times with those of the opcodes in spec ('LINEAR=0.85,ATTENTION=0.5') multiplied by their factor, or
    with a change in microseconds given instead ('EXPERT_LINEAR=-1.5us': each task 1.5 us shorter, never below 0):
    a change that removes a latency from every task, whatever its length."""
    factors, shifts = {}, {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name not in {w.op.name for w in words}:
            raise SystemExit(f"--scale {spec!r}: the plan has no {name!r} tasks")
        try:
            if value.endswith("us"):
                shifts[name] = float(value[:-2]) * 1e-6
            else:
                factors[name] = float(value)
        except ValueError:
            raise SystemExit(f"--scale {spec!r}: {value!r} is neither a factor (0.85) nor microseconds (-1.5us)")
    return [max(0.0, s * factors.get(w.op.name, 1.0) + shifts.get(w.op.name, 0.0)) for w, s in zip(words, seconds)]


def critical_chain(plan, words, deps, seconds: list[float], hop: float):
    """(length, [(family, seconds, tasks of the op)]) of the longest dependency chain, unlimited workers."""
    by_op: dict[int, list[int]] = defaultdict(list)
    for i, w in enumerate(words):
        by_op[w.signal].append(i)
    finish, parent = {}, {}
    for op in sorted(by_op):  # op ids are topological
        start, par = 0.0, None
        for d in deps.get(op, ()):
            if d in finish and finish[d] + hop > start:
                start, par = finish[d] + hop, d
        finish[op] = start + max(seconds[i] for i in by_op[op])
        parent[op] = par
    op = max(finish, key=finish.get)
    length, chain = finish[op], []
    while op is not None:
        slowest = max(by_op[op], key=lambda i: seconds[i])
        chain.append((family(plan.task_labels[slowest]), seconds[slowest], len(by_op[op])))
        op = parent[op]
    return length, chain[::-1]


def report(title: str, plan, seconds: list[float], hop: float, top: int = 12, parsed=None) -> dict:
    words, deps, queues = parsed or structure(plan)
    tasks = [SchedTask(w.signal, s) for w, s in zip(words, seconds)]
    replay, busy = simulate(tasks, deps, queues, hop)
    # the same tasks list-scheduled knowing these times (what a calibrated cost model would do)
    stream = int(plan.options.get("stream_workers") or 0)  # a stream_kernel plan: LINEAR on its own workers
    classes = [int(w.op.name == "LINEAR") for w in words] if stream else None
    counts = [plan.workers - stream, stream] if stream else None
    relisted, _ = simulate(tasks, deps, critical_path(tasks, deps, plan.workers, hop, classes, counts).queues, hop)
    length, chain = critical_chain(plan, words, deps, seconds, hop)
    per: dict[str, list] = defaultdict(lambda: [0, 0.0, 0])
    for fam, s, n in chain:
        per[fam][0] += 1
        per[fam][1] += s
        per[fam][2] = n
    print(f"\n{title}: {plan.num_tasks} tasks; replayed step {replay * 1e3:.3f} ms, mean worker busy "
          f"{statistics.mean(busy) * 1e3:.3f} ms; critical path {length * 1e3:.3f} ms over {len(chain)} ops; "
          f"list-scheduled with these times {relisted * 1e3:.3f} ms")
    print(f"  {'op on the critical path':<28}{'times':>6}{'us each':>9}{'ms':>8}{'tasks/op':>9}")
    for fam, (n, s, k) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {fam:<28}{n:>6}{s / n * 1e6:>9.1f}{s * 1e3:>8.3f}{k:>9}")
    return {"tasks": plan.num_tasks, "replay_ms": replay * 1e3, "critical_path_ms": length * 1e3,
            "relisted_ms": relisted * 1e3,
            "chain": {fam: {"times": n, "ms": s * 1e3, "tasks_per_op": k} for fam, (n, s, k) in per.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--model", required=True)
    p.add_argument("--T", type=int, default=1)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--workers", type=int, default=132)
    p.add_argument("--hop-us", type=float, default=0.8)
    p.add_argument("--overhead-us", type=float, default=2.0, help="fixed time of any task (predictions)")
    p.add_argument("--plan", default="", metavar="KEY=V,...",
                   help="compile options of the plan the trace came from, when not today's defaults (session "
                        "2's traces: spread=0,attn_split=320)")
    p.add_argument("--variant", nargs="*", default=[], metavar="KEY=V,...")
    p.add_argument("--layer", type=int, help="also print this layer's measured phases, op by op")
    p.add_argument("--scale", nargs="*", default=[], metavar="OPCODE=FACTOR",
                   help="also replay the measured plan with these opcodes' task times scaled (LINEAR=0.85: its "
                        "tasks at the Gluon ring's rate, 0.505 against 0.595 ms on the GEMV chain), or shifted "
                        "(EXPERT_LINEAR=-1.5us: each task 1.5 us shorter)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    cfg, hop, fixed = preset(args.model), args.hop_us * 1e-6, args.overhead_us * 1e-6
    measured = load_trace(args.trace)
    # as tools/bench.py compiles it (a plan variant's max_len=N too)
    plan_spec, max_len = pop_max_len(args.plan, step_max_len(args.ctx, args.T))
    shape = StepShape(T=args.T, B=1, max_len=max_len)
    opts, attn_split = compile_options(plan_spec, args.workers)
    plan = compile_step(cfg, dataclasses.replace(shape, attn_split=attn_split), per_op(opts))
    missing = [label for label in plan.task_labels if label not in measured]
    if missing:
        raise SystemExit(f"the trace is not of this plan: {len(missing)} tasks missing, e.g. {missing[:3]}")
    seconds = [measured[label] for label in plan.task_labels]
    parsed = structure(plan)
    out = {"measured": report("measured plan", plan, seconds, hop, parsed=parsed)}
    if args.layer is not None:
        out["phases"] = phases(plan, parsed, load_events(args.trace), args.layer)
        print_phases(out["phases"], args.layer)
    for spec in args.scale:  # the measured plan, some opcodes' tasks faster or slower
        out[f"scale {spec}"] = report(f"measured plan, {spec}", plan, scaled_seconds(parsed[0], seconds, spec), hop,
                                      parsed=parsed)
    # per op family: seconds per byte beyond the fixed overhead, from the measured tasks
    rate: dict[str, list[float]] = defaultdict(list)
    by_opcode: dict[str, list[float]] = defaultdict(list)
    for w, label, s in zip(parsed[0], plan.task_labels, seconds):
        rate[family(label)].append(max(s - fixed, 0.0) / max(1, task_work(w)))
        by_opcode[w.op.name].append(rate[family(label)][-1])
    per_byte = {fam: statistics.median(v) for fam, v in rate.items()}
    for spec in args.variant:
        vspec, vmax_len = pop_max_len(spec, max_len)
        opts, attn_split = compile_options(vspec, args.workers)
        vplan = compile_step(cfg, dataclasses.replace(shape, max_len=vmax_len, attn_split=attn_split), per_op(opts))
        vparsed = structure(vplan)
        vsec, borrowed = variant_seconds(vparsed[0], vplan.task_labels, per_byte, by_opcode, fixed)
        out[spec] = report(f"predicted for {spec}", vplan, vsec, hop, parsed=vparsed)
        if borrowed:  # a fused op the measured plan did not have: its opcode's median rate stands in for its own
            print("  ops the trace has no tasks of, timed at their opcode's median rate: "
                  + ", ".join(f"{fam} ({op})" for fam, op in sorted(borrowed.items())))
            out[spec]["borrowed_rates"] = borrowed
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
