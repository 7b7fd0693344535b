"""Routed experts partly on a helper, the megakernel as the main side: step time, helper calls, exposed
wait and migration, beside the same engine with every expert on main.

    python tools/helper_bench.py --model dsv2-lite --helper cuda:1 --fractions 0 0.25 0.5 --migrate off on

Decode steps (T=1, B=1) at a fixed cache length of --ctx - 1 over a random cache, teacher-forced
on the all-on-main engine's greedy tokens, so every row sees the same inputs and its logits and
tokens are compared with that engine's.  Routing is skewed (a Zipf correction bias whose hot set
moves every --shift steps, helper_card.migration.BiasSkew) so migration has experts to move; the
all-on-main engine runs with the same bias.  A step's time is what a token costs: wall time around
the runner's step (host staging, one graph replay, the sync and the result read, the last row's
logits copied to the host; the helper service
answers inside it) and the step boundary after it (metrics, migration's planning and flips, also
listed per step as migration_stall_ms).  A table on screen, JSON in --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helper_card.migration import BiasSkew, CallAwarePolicy, MigrationPolicy, with_routing_bias  # noqa: E402
from helper_card.setup import HelperOptions, moe_layers  # noqa: E402
from megakernel.engine import make_engine  # noqa: E402
from model import init_weights, preset  # noqa: E402
from tools.bench import rel_err, step_max_len  # noqa: E402


class GcClock:
    """Time the interpreter spends in garbage collection (gc.callbacks), read per step: a collection that
    lands in a step or its boundary is host time no helper or migration change can explain."""

    def __init__(self):
        self.total_s, self.started = 0.0, 0.0

    def __call__(self, phase, info) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self.started

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def run(engine, cfg, args, tokens=None, placements=None) -> dict:
    """`args.steps` decode steps; tokens: the inputs to feed (None: greedy, recording them); placements:
    each step's expert placement, applied synchronously before the step and outside its time (replay)."""
    runner = engine.backend.runner(1)
    layers = [layer for layer in moe_layers(cfg) if layer < cfg.num_hidden_layers]
    skew = BiasSkew(cfg, layers, a=1.2, scale=1.0, shift_every=args.shift, seed=3)
    skew.apply(runner)
    cache = runner.cache()
    cache.normal_(generator=torch.Generator(device=cache.device).manual_seed(1))
    lens = torch.tensor([args.ctx - 1])
    feed = tokens or [torch.tensor([[11]])]
    times, boundary, logits, metrics, used, gc_ms = [], [], [], [], [], []
    helper = engine.backend.helper

    def step(n: int) -> None:
        tok = feed[n] if tokens else feed[-1]
        if placements is not None:
            helper.place_now(placements[n])
        if helper is not None:
            used.append(helper.placement.copy())  # what this step routes by (overlap: committed at the boundary)
        t0 = time.perf_counter()
        out = runner.step(tok, lens)
        logits.append(out.logits[0, -1].float().cpu())
        t1 = time.perf_counter()
        if helper is not None:  # the step boundary (metrics, migration) is part of what a token costs
            metrics.append(helper.end_step())
        times.append((time.perf_counter() - t0) * 1e3)
        boundary.append((time.perf_counter() - t1) * 1e3)
        if not tokens:
            feed.append(out.logits[:, -1].argmax(-1, keepdim=True).cpu())

    with GcClock() as gc_clock:
        for n in range(args.steps):
            if n == args.warmup and helper is not None:
                helper.link.metrics.timeline = []  # every call's timeline from here (call_phases)
            gc_before = gc_clock.total_s
            step(n)
            gc_ms.append((gc_clock.total_s - gc_before) * 1e3)
            skew.step(runner)
    row = {"step_ms_median": statistics.median(times[args.warmup:]), "step_ms": [round(t, 3) for t in times],
           # where a step's time goes: the boundary (helper metrics, routing statistics, migration) on the
           # host, and the rest (staging, the graph replay, the helper's calls inside it, the sync)
           "boundary_ms_median": statistics.median(boundary[args.warmup:]),
           "boundary_ms": [round(t, 3) for t in boundary], "gc_ms": [round(t, 3) for t in gc_ms],
           "logits": logits, "tokens": feed, "placements": used}
    if helper is not None:
        steps = metrics[args.warmup:]
        for key in ("calls", "skipped", "rows", "exposed_wait_ms", "moves"):
            row[key + "_per_step"] = sum(s[key] for s in steps) / len(steps)
        row["bytes_migrated"] = helper.copier.bytes_moved
        row["migration_stall_ms_max"] = max(s["migration_stall_ms"] for s in steps)
        row["migration_stall_ms"] = [round(s["migration_stall_ms"], 3) for s in metrics]
        # per step, to tell a slower answer (host) from a slower kernel: HELPER_WAIT's wait on the device timer
        row["exposed_wait_ms"] = [round(s["exposed_wait_ms"], 3) for s in metrics]
        # at decode a call costs about the same whatever its rows: the calls made, step by step
        row["calls"] = [s["calls"] for s in metrics]
        # the boundary's parts: reading the mailboxes' counts, then migration's phases
        row["count_ms_median"] = statistics.median(s["count_ms"] for s in steps)
        row["count_ms"] = [round(s["count_ms"], 3) for s in metrics]
        phases = {k for s in steps for k in s["migration_parts_ms"]}
        row["migration_parts_ms_median"] = {k: statistics.median(s["migration_parts_ms"].get(k, 0.0) for s in steps)
                                            for k in sorted(phases)}
        # what migration is for: the share of routed rows the helper computes, step by step (it should
        # fall after each move of the hot set, issue 6), and its mean over the first and last quarters
        routed = cfg.num_experts_per_tok * len(layers)
        share = [s["rows"] / routed for s in metrics]
        row["helper_row_share"] = [round(v, 3) for v in share]
        quarter = max(1, len(share) // 4)
        row["helper_row_share_first_last_quarter"] = [round(statistics.mean(share[:quarter]), 3),
                                                      round(statistics.mean(share[-quarter:]), 3)]
        row["call_phases_us"] = call_phases(helper.link.metrics.timeline or [])
        helper.link.metrics.timeline = None
        helper.close()
    return row


def call_phases(timeline: list) -> dict:
    """Where a helper call's time goes (issue 6: a call's cost is what the per-step bar turns on), from
    each call's stamps (helper_card.mailbox.CallTimes): median and 90th percentile in microseconds of
    - notice: the main GPU published -> the host's service thread began the answer;
    - host: the service's own work (table, mask, graph replay on the helper GPU, or the host's answer);
    - helper: that hand-over (with a persistent helper kernel: the publication) -> the helper GPU's rows
      out (its copies in, the site's tiles, rows out);
    - back: the helper's rows out -> the main GPU saw the acknowledgement;
    - total (published -> seen) and exposed (HELPER_WAIT's wait, the part of it the step pays).
    The phases cross clocks (two GPUs' timers and the host's), so `in_order` says for what share of the
    calls the stamps came in causal order: where it is low, only total and exposed mean anything."""
    if not timeline:
        return {}
    def q(values: list[int]) -> list[float]:
        values = sorted(values)
        return [round(statistics.median(values) / 1e3, 1), round(values[int(0.9 * (len(values) - 1))] / 1e3, 1)]
    out = {"calls": len(timeline), "total": q([c.acked - c.published for c in timeline]),
           "exposed": q([c.wait_ns for c in timeline])}
    hosted = all(c.noticed for c in timeline)  # a host thread served the calls (not a persistent helper kernel)
    if hosted:
        out["host"] = q([c.handed - c.noticed for c in timeline])
    if all(c.answered for c in timeline):  # a helper GPU answered (the host's own answer has no stamp)
        if hosted:
            order = [c.published <= c.noticed <= c.handed <= c.answered <= c.acked for c in timeline]
            out.update(notice=q([c.noticed - c.published for c in timeline]),
                       helper=q([c.answered - c.handed for c in timeline]))
        else:  # published on the main GPU, answered on the helper GPU: two devices' timers
            order = [c.published <= c.answered <= c.acked for c in timeline]
            out.update(helper=q([c.answered - c.published for c in timeline]))
        out.update(back=q([c.acked - c.answered for c in timeline]), in_order=round(sum(order) / len(order), 3))
    return out


def migration_costs(rows: list[dict], warmup: int) -> list[dict]:
    """Migration's cost (issue 6: no step more than 5% slower): each step (same inputs) with migration
    against the same step without, taking each step's fastest run where a mode ran more than once
    (--migrate off on off on).  That drops most of the host's jitter, which in one run is as large as
    the 5%; the noise a comparison carries: the slowest step without migration against its median, and
    with two runs without migration, those two step against step."""
    out = []
    for fraction in sorted({r["fraction"] for r in rows if r["fraction"] > 0}):
        runs = {}
        for r in rows:
            if r["fraction"] == fraction and "error" not in r and r["helper"] != "none":
                runs.setdefault(r["migrate"], []).append(r["step_ms"][warmup:])
        offs = runs.get("off", [])
        if not offs:
            continue
        fastest_off = [min(s) for s in zip(*offs)]
        replays = runs.get("replay", [])
        fastest_replay = [min(s) for s in zip(*replays)]
        for mode, ons in runs.items():
            if mode == "off":
                continue
            ratios = [min(s) / b for s, b in zip(zip(*ons), fastest_off)]
            row = {"fraction": fraction, "migrate": mode, "runs": len(ons), "off_runs": len(offs),
                   "max_step_ratio": max(ratios), "median_step_ratio": statistics.median(ratios),
                   "steps_over_1.05": sum(x > 1.05 for x in ratios),
                   "off_max_over_median": max(fastest_off) / statistics.median(fastest_off)}
            if len(offs) >= 2:
                row["off_vs_off_max"] = max(max(a / b, b / a) for a, b in zip(offs[0], offs[1]))
            if replays and mode != "replay":
                # migration's own cost: against the same steps with the same placements, none moving
                vs = [min(s) / b for s, b in zip(zip(*ons), fastest_replay)]
                row.update(max_step_ratio_vs_replay=max(vs), median_step_ratio_vs_replay=statistics.median(vs),
                           steps_over_1_05_vs_replay=sum(x > 1.05 for x in vs), replay_runs=len(replays))
            out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dsv2-lite")
    p.add_argument("--helper", default="cuda:1", help="cpu | cuda:N")
    p.add_argument("--fractions", nargs="*", type=float, default=[0.0, 0.25, 0.5],
                   help="0: a helper plan with every expert on main (the calls' own cost)")
    p.add_argument("--migrate", nargs="*", choices=["off", "on", "sync", "replay"], default=["off", "on"],
                   help="on: migration decided after each launch, overlapping the step (the default); sync: "
                        "all of it at the step boundary; replay: no migration, but each step runs on the placement "
                        "the last on/sync run of that fraction had at that step, set before the step, outside its "
                        "time (so on against replay is migration's own cost: the copies and the host's work).  "
                        "A mode given twice runs twice (each step's fastest run is compared, and off against off "
                        "shows the jitter)")
    p.add_argument("--policy", choices=["calls", "rows"], default="calls",
                   help="migration policy: by the helper calls a move saves (the default) or by rows")
    p.add_argument("--max-moves", type=int, default=2, help="migration's moves per step at most")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--shift", type=int, default=12, help="steps between moves of the routing hot set")
    p.add_argument("--timeout", type=float, default=10.0, help="helper bound, seconds")
    p.add_argument("--helper-workers", type=int, default=0,
                   help="a helper GPU's workers per call (0: one per SM, the default)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (a tiny preset)")
    p.add_argument("--persistent", action="store_true",
                   help="a cuda:N helper answers with one persistent kernel per step (no host on a call's path)")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    cfg = with_routing_bias(preset(args.model))
    device, dtype = torch.device(args.device), torch.bfloat16 if args.device == "cuda" else torch.float32
    weights = init_weights(cfg, seed=0, device=device, dtype=dtype)
    workers = torch.cuda.get_device_properties(0).multi_processor_count if device.type == "cuda" else 1
    rows = []

    def engine(opts):
        return make_engine(cfg, weights, "megakernel", 1, step_max_len(args.ctx, 1), device, dtype, workers=workers,
                           helper=opts)

    base = run(engine(None), cfg, args)
    rows.append({"helper": "none", "fraction": 0.0, "migrate": "off", "step_ms_median": base["step_ms_median"]})
    print(f"all on main: {base['step_ms_median']:.3f} ms/step", flush=True)
    policy = (CallAwarePolicy if args.policy == "calls" else MigrationPolicy)(max_moves=args.max_moves)
    for fraction in args.fractions:
        recorded = None  # the last migrating run's placements, step by step (for replay)
        for migrate in args.migrate if fraction > 0 else ["off"]:
            opts = HelperOptions(kind=args.helper, fraction=fraction, migrate=migrate in ("on", "sync"),
                                 overlap=migrate == "on", timeout_s=args.timeout, policy=policy,
                                 helper_workers=args.helper_workers, persistent=args.persistent)
            t0 = time.perf_counter()
            try:
                if migrate == "replay" and recorded is None:
                    raise ValueError("--migrate replay needs an on or sync run of the same fraction before it")
                got = run(engine(opts), cfg, args, base["tokens"][: args.steps],
                          recorded if migrate == "replay" else None)
            except Exception as e:  # a row that failed says why; the others still run
                rows.append({"helper": args.helper, "fraction": fraction, "migrate": migrate, "error": repr(e)[:400]})
                print(f"{fraction} {migrate}: {e!r}"[:300], flush=True)
                continue
            if migrate in ("on", "sync"):
                recorded = got["placements"]
            errs = [rel_err(a, b) for a, b in zip(got["logits"], base["logits"])]
            same = sum(int(a.argmax() == b.argmax()) for a, b in zip(got["logits"], base["logits"]))
            row = {"helper": args.helper, "fraction": fraction, "migrate": migrate,
                   **{k: v for k, v in got.items() if k not in ("logits", "tokens", "placements")},
                   "rel_err_max_vs_main": max(errs), "rel_err_vs_main": [float(f"{e:.2e}") for e in errs],
                   "tokens_equal": f"{same}/{len(errs)}",
                   "setup_s": round(time.perf_counter() - t0 - sum(got["step_ms"]) / 1e3, 1)}
            row["x_all_on_main"] = row["step_ms_median"] / base["step_ms_median"]
            rows.append(row)
            print(f"{args.helper} {fraction:.2f} migrate {migrate}: {row['step_ms_median']:.3f} ms/step, "
                  f"{row['calls_per_step']:.1f} calls, {row['skipped_per_step']:.1f} skipped, "
                  f"{row['exposed_wait_ms_per_step']:.3f} ms exposed wait, {row['moves_per_step']:.2f} moves/step, "
                  f"rel. err {row['rel_err_max_vs_main']:.1e}, tokens {row['tokens_equal']}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    costs = migration_costs(rows, args.warmup)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"helper_{args.model}.json").write_text(json.dumps({"runs": rows, "migration_costs": costs}, indent=1))
    print(f"\n{'helper':8} {'frac':>5} {'migr':>4} {'ms/step':>8} {'bound.':>7} {'x main':>7} {'calls':>6} {'skip':>5} "
          f"{'wait ms':>8} {'moves':>6} {'share 1st/last':>15} {'tokens':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['helper']:8} {r['fraction']:5.2f} {r['migrate']:>4} error: {r['error'][:60]}")
            continue
        print(f"{r['helper']:8} {r['fraction']:5.2f} {r['migrate']:>4} {r['step_ms_median']:8.3f} "
              f"{r.get('boundary_ms_median', 0):7.3f} {r.get('x_all_on_main', 1.0):7.2f} "
              f"{r.get('calls_per_step', 0):6.1f} {r.get('skipped_per_step', 0):5.1f} "
              f"{r.get('exposed_wait_ms_per_step', 0):8.3f} {r.get('moves_per_step', 0):6.2f} "
              f"{'/'.join(map(str, r.get('helper_row_share_first_last_quarter', ['-']))):>15} "
              f"{r.get('tokens_equal', '-'):>7}")
    for r in costs:
        print(f"{args.helper} {r['fraction']:.2f} migrate {r['migrate']} ({r['runs']} run(s), off {r['off_runs']}): "
              f"each step's fastest run is at most {r['max_step_ratio']:.3f}x (median {r['median_step_ratio']:.3f}x) "
              f"the same step's without; {r['steps_over_1.05']} steps over 1.05x; without migration the slowest step "
              f"is {r['off_max_over_median']:.3f}x the median"
              + (f", and off against off at most {r['off_vs_off_max']:.3f}x" if "off_vs_off_max" in r else "")
              + (f"; against replay (same placements, nothing moving; {r['replay_runs']} run(s)) at most "
                 f"{r['max_step_ratio_vs_replay']:.3f}x (median {r['median_step_ratio_vs_replay']:.3f}x), "
                 f"{r['steps_over_1_05_vs_replay']} steps over 1.05x" if "max_step_ratio_vs_replay" in r else ""))
    for r in rows:
        if r.get("call_phases_us"):
            print(f"{r['helper']} {r['fraction']:.2f} migrate {r['migrate']}: a call's phases, median/p90 us: "
                  + ", ".join(f"{k} {v[0]}/{v[1]}" if isinstance(v, list) else f"{k} {v}"
                              for k, v in r["call_phases_us"].items()))
    for r in rows:
        if "count_ms_median" in r:
            parts = ", ".join(f"{k} {v:.3f}" for k, v in r["migration_parts_ms_median"].items())
            print(f"{r['helper']} {r['fraction']:.2f} migrate {r['migrate']}: boundary medians (ms): mailbox counts "
                  f"{r['count_ms_median']:.3f}; {parts or 'no migration'}; garbage collection "
                  f"{sum(r['gc_ms']):.2f} ms in all, {sum(t > 0 for t in r['gc_ms'])} steps")


if __name__ == "__main__":
    main()
