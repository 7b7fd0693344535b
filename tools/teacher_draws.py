"""The 64-step teacher-forced greedy check over many random draws, on the CPU: how often two plans' greedy tokens
leave the plain model's (beyond the near-tie margin the GPU test allows), draw by draw.

    PYTHONPATH=. python tools/teacher_draws.py [--model tiny-moe] [--seeds 8] [--steps 64]

Each plan runs in the plan interpreter in bf16 (the megakernel's arithmetic, within fp32 rounding) beside the
plain model in fp32 on the same bf16 weights, both consuming the plain model's tokens.  Plans: the default
fusion rules and every rule (the opt-in norm_beside_experts, expert_mlp and dense_mlp too).  For a MoE model the
check is a property of the draw: top-k routing turns a ~1e-3 change into another expert set (docs/NOTES.md, session 16).
"""

from __future__ import annotations

import argparse

import torch

from graph.compile import CompileOptions, compile_step
from graph.fusion import DEFAULT_RULES, RULES
from graph.lower import StepShape
from megakernel.interpreter import Interpreter
from model import Cache, Reference, init_weights, preset

NEAR_TIE = 1e-2  # tests/test_gpu.py's BF16_TOL


def one_draw(cfg, weights, plans, seed: int, steps: int, B: int, max_len: int) -> tuple[list[int], list[float]]:
    """(tokens differing beyond a near tie, mean relative logit error) per plan, for one draw of first tokens."""
    runners = [Interpreter(plan, weights, "cpu", torch.bfloat16) for plan in plans]
    ref = Reference(cfg, {k: v.float() for k, v in weights.items()})
    cache = Cache.allocate(cfg, B, max_len, torch.bfloat16, "cpu")
    tokens = torch.randint(0, cfg.vocab_size, (B, 1), generator=torch.Generator().manual_seed(seed))
    lens = torch.zeros(B, dtype=torch.long)
    missed, err = [0] * len(plans), [0.0] * len(plans)
    for _ in range(steps):
        outs = [r.step(tokens, lens).logits.float() for r in runners]
        want = ref.step(tokens, cache, lens).logits.float()
        top = want.topk(2, dim=-1).values
        tie = (top[..., 0] - top[..., 1]) <= NEAR_TIE * top[..., 0].abs().clamp_min(1.0)
        for i, got in enumerate(outs):
            missed[i] += int(((got.argmax(-1) != want.argmax(-1)) & ~tie).sum())
            err[i] += float((got - want).norm() / want.norm()) / steps
        tokens, lens = want.argmax(-1), lens + 1
    return missed, err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-moe")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--sets", nargs="*", default=["all"], metavar="RULE,...",
                   help="rule sets beside the default: 'all' (every rule), or opt-in rules added to the default ones "
                        "(e.g. expert_mlp dense_mlp expert_mlp,dense_mlp)")
    args = p.parse_args()
    cfg = preset(args.model)
    max_len = args.steps + 16
    weights = init_weights(cfg, seed=0, device="cpu", dtype=torch.bfloat16)
    unknown = {r for spec in args.sets if spec != "all" for r in spec.split(",")} - set(RULES)
    if unknown:
        p.error(f"unknown rule(s) {sorted(unknown)}; rules are {', '.join(RULES)}")
    sets = [RULES if spec == "all" else DEFAULT_RULES + tuple(r for r in spec.split(",") if r not in DEFAULT_RULES)
            for spec in args.sets]
    names = ["default"] + ["all_rules" if spec == "all" else spec for spec in args.sets]
    plans = [compile_step(cfg, StepShape(T=1, B=args.B, max_len=max_len), CompileOptions(workers=16, fusion_rules=r))
             for r in [DEFAULT_RULES, *sets]]
    totals = [[0, 0] for _ in plans]  # [draws missed, tokens missed]
    print(f"{'seed':>4}  " + "  ".join(f"{n + ' missed':>16} {'mean rel err':>12}" for n in names))
    for seed in range(args.seeds):
        missed, err = one_draw(cfg, weights, plans, seed, args.steps, args.B, max_len)
        for t, m in zip(totals, missed):
            t[0] += m > 0
            t[1] += m
        print(f"{seed:>4}  " + "  ".join(f"{m:>16} {e:>12.5f}" for m, e in zip(missed, err)), flush=True)
    for n, (draws, toks) in zip(names, totals):
        print(f"{n}: {toks} tokens missed in {draws} of {args.seeds} draws")


if __name__ == "__main__":
    main()
