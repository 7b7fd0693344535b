"""Compile time of decode-step plans (CPU): python tools/compile_bench.py [MODEL ...] [--workers W] [--T T]."""

from __future__ import annotations

import argparse
import json
import time

from graph.compile import CompileOptions, compile_step
from graph.lower import StepShape
from model import preset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("models", nargs="*", default=["llama-1b", "dsv2-lite"])
    p.add_argument("--workers", type=int, default=132)
    p.add_argument("--T", type=int, default=1)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    rows = []
    for name in args.models:
        t0 = time.perf_counter()
        plan = compile_step(preset(name), StepShape(T=args.T, B=args.B, max_len=args.ctx),
                            CompileOptions(workers=args.workers))
        seconds = time.perf_counter() - t0
        per_pass = {p["pass"]: p for p in plan.passes}
        rows.append({"model": name, "compile_s": round(seconds, 2), "ops_lowered": per_pass["lower"]["ops"],
                     "ops_final": per_pass["fusion"]["ops_after"], "tasks": plan.num_tasks,
                     "est_ms": round(plan.estimate["critical_path_ms"], 3)})
    print(f"{'model':<12}{'compile s':>10}{'ops':>8}{'fused':>8}{'tasks':>8}{'est ms':>9}")
    for r in rows:
        print(f"{r['model']:<12}{r['compile_s']:>10}{r['ops_lowered']:>8}"
              f"{r['ops_final']:>8}{r['tasks']:>8}{r['est_ms']:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
