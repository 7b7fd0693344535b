"""Step math for speculative decoding: what a step time buys in tokens/s for an acceptance profile.

    python tools/stepmath.py --accept 0.8 0.7 0.6 0.5 0.45 0.4 0.35 --step-ms 1.2 --per-draft-ms 0.05
    python tools/stepmath.py --from-json run.json --sweep sweep.json

Per-position acceptance p_i is the probability that draft i is accepted given drafts 1..i-1
were (as `--json` of `--spec-k` reports it unconditioned, pass --unconditional).  Expected
tokens per step with k drafts = 1 + sum_{i<=k} prod_{j<=i} p_j.  Step time per k comes from a
measured sweep (JSON list of {"k", "step_ms"}) or the linear model step_ms + k * per_draft_ms.
Break-even: the step time at k+2 up to which it still beats k.  --adaptive N simulates the
adaptive-k policy (megakernel/adaptive.py) on N steps drawn from the profile, against every fixed k.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megakernel.adaptive import AdaptiveK, expected_tokens, load_sweep  # noqa: E402


def simulate_adaptive(accept: list[float], step_ms: dict[int, float], steps: int, seed: int = 0,
                      shift: list[float] | None = None) -> dict:
    """Tokens/s of the adaptive-k policy against every fixed k on draws from the acceptance profile
    (conditional per position); with `shift`, the profile changes to it halfway (a topic change)."""
    rng = random.Random(seed)
    kmax = max(step_ms)
    policy = AdaptiveK(kmax, step_ms)
    tokens = {k: 0.0 for k in step_ms}
    ms = {k: 0.0 for k in step_ms}
    ad_tokens = ad_ms = 0.0
    for n in range(steps):
        profile = shift if shift and n >= steps // 2 else accept
        run = 0  # how many drafts this step's target would accept in a row
        while run < kmax and rng.random() < (profile[run] if run < len(profile) else 0.0):
            run += 1
        for k in step_ms:
            tokens[k] += 1 + min(run, k)
            ms[k] += step_ms[k]
        k = policy.choose()
        ad_tokens += 1 + min(run, k)
        ad_ms += step_ms[k]
        policy.observe(k, [min(run, k)])
    fixed = {k: tokens[k] / ms[k] * 1e3 for k in step_ms}
    best = max(fixed, key=fixed.get)
    return {"adaptive_tokens_per_s": ad_tokens / ad_ms * 1e3, "fixed_tokens_per_s": fixed, "best_fixed_k": best,
            "gain_over_best_fixed": ad_tokens / ad_ms * 1e3 / fixed[best] - 1, "k_mean": sum(policy.chosen) / steps}


def conditional(unconditional: list[float]) -> list[float]:
    """P(draft i accepted) -> P(draft i accepted | drafts < i accepted)."""
    out, prev = [], 1.0
    for p in unconditional:
        out.append(p / prev if prev > 0 else 0.0)
        prev = p
    return out


def table(accept: list[float], step_ms: dict[int, float]) -> list[dict]:
    rows = []
    for k in sorted(step_ms):
        tokens = expected_tokens(accept, k)
        rows.append({"k": k, "tokens_per_step": tokens, "step_ms": step_ms[k],
                     "tokens_per_s": tokens / step_ms[k] * 1e3})
    for row in rows:
        k = row["k"]
        if k + 2 in step_ms:  # the step time at k+2 that ties with k
            row["break_even_ms_k_plus_2"] = expected_tokens(accept, k + 2) / row["tokens_per_s"] * 1e3
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accept", nargs="*", type=float, help="conditional acceptance per draft position")
    p.add_argument("--from-json",
                   help="a --json result of python -m megakernel.run --spec-k (its per-position acceptance)")
    p.add_argument("--unconditional", action="store_true", help="--accept values are unconditional (as --json reports)")
    p.add_argument("--step-ms", type=float, default=1.0, help="step time at k=0 (linear model)")
    p.add_argument("--per-draft-ms", type=float, default=0.05, help="extra step time per draft (linear model)")
    p.add_argument("--sweep", help="measured step times: JSON list of {\"k\": K, \"step_ms\": MS}")
    p.add_argument("--kmax", type=int, default=7)
    p.add_argument("--adaptive", type=int, default=0, metavar="STEPS",
                   help="also simulate the adaptive-k policy over STEPS steps drawn from the profile")
    p.add_argument("--shift", nargs="*", type=float, help="with --adaptive: the profile after a topic change halfway")
    args = p.parse_args()
    accept = args.accept or []
    if args.from_json:
        accept = json.load(open(args.from_json))["per_position_acceptance"]
        args.unconditional = True
    if args.unconditional:
        accept = conditional(accept)
    if args.sweep:
        step_ms = load_sweep(args.sweep)
    else:
        step_ms = {k: args.step_ms + k * args.per_draft_ms for k in range(args.kmax + 1)}
    rows = table(accept, step_ms)
    print(f"{'k':>2}{'tokens/step':>13}{'step ms':>10}{'tokens/s':>10}{'k+2 wins below ms':>19}")
    for r in rows:
        be = f"{r['break_even_ms_k_plus_2']:>19.3f}" if "break_even_ms_k_plus_2" in r else f"{'':>19}"
        print(f"{r['k']:>2}{r['tokens_per_step']:>13.3f}{r['step_ms']:>10.3f}{r['tokens_per_s']:>10.1f}{be}")
    best = max(rows, key=lambda r: r["tokens_per_s"])
    print(f"best k = {best['k']} at {best['tokens_per_s']:.1f} tokens/s")
    if args.adaptive:
        sim = simulate_adaptive(accept, step_ms, args.adaptive, shift=args.shift)
        fixed = sim["fixed_tokens_per_s"]
        print(f"adaptive k over {args.adaptive} simulated steps{' (profile shifts halfway)' if args.shift else ''}: "
              f"{sim['adaptive_tokens_per_s']:.1f} tokens/s, mean k {sim['k_mean']:.2f}; best fixed k="
              f"{sim['best_fixed_k']} {fixed[sim['best_fixed_k']]:.1f} tokens/s ({sim['gain_over_best_fixed']:+.1%})")


if __name__ == "__main__":
    main()
