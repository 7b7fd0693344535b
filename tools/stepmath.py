"""Step math for speculative decoding: what a step time buys in tokens/s for an acceptance profile.

    python tools/stepmath.py --accept 0.8 0.7 0.6 0.5 0.45 0.4 0.35 --step-ms 1.2 --per-draft-ms 0.05
    python tools/stepmath.py --from-json run.json --sweep sweep.json

Per-position acceptance p_i is the probability that draft i is accepted given drafts 1..i-1
were (as `--json` of `--spec-k` reports it unconditioned, pass --unconditional).  Expected
tokens per step with k drafts = 1 + sum_{i<=k} prod_{j<=i} p_j.  Step time per k comes from a
measured sweep (JSON list of {"k", "step_ms"}) or the linear model step_ms + k * per_draft_ms.
Break-even: the step time at k+2 up to which it still beats k.
"""

from __future__ import annotations

import argparse
import json


def expected_tokens(accept: list[float], k: int) -> float:
    total, chain = 1.0, 1.0
    for i in range(k):
        chain *= accept[i] if i < len(accept) else 0.0
        total += chain
    return total


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
    p.add_argument("--from-json", help="a --json result of python -m megakernel.run --spec-k (its per-position acceptance)")
    p.add_argument("--unconditional", action="store_true", help="--accept values are unconditional (as --json reports)")
    p.add_argument("--step-ms", type=float, default=1.0, help="step time at k=0 (linear model)")
    p.add_argument("--per-draft-ms", type=float, default=0.05, help="extra step time per draft (linear model)")
    p.add_argument("--sweep", help="measured step times: JSON list of {\"k\": K, \"step_ms\": MS}")
    p.add_argument("--kmax", type=int, default=7)
    args = p.parse_args()
    accept = args.accept or []
    if args.from_json:
        accept = json.load(open(args.from_json))["per_position_acceptance"]
        args.unconditional = True
    if args.unconditional:
        accept = conditional(accept)
    if args.sweep:
        step_ms = {int(r["k"]): float(r["step_ms"]) for r in json.load(open(args.sweep))}
    else:
        step_ms = {k: args.step_ms + k * args.per_draft_ms for k in range(args.kmax + 1)}
    rows = table(accept, step_ms)
    print(f"{'k':>2}{'tokens/step':>13}{'step ms':>10}{'tokens/s':>10}{'k+2 wins below ms':>19}")
    for r in rows:
        be = f"{r['break_even_ms_k_plus_2']:>19.3f}" if "break_even_ms_k_plus_2" in r else f"{'':>19}"
        print(f"{r['k']:>2}{r['tokens_per_step']:>13.3f}{r['step_ms']:>10.3f}{r['tokens_per_s']:>10.1f}{be}")
    best = max(rows, key=lambda r: r["tokens_per_s"])
    print(f"best k = {best['k']} at {best['tokens_per_s']:.1f} tokens/s")


if __name__ == "__main__":
    main()
