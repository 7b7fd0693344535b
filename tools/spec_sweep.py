"""Speculative decoding on the GPU: the step time for each k, and speculative output equal to plain.

    python tools/spec_sweep.py [--models dsv2-lite llama-1b] [--mtp 1] [--ctx 4096] [--kmax 7]
                               [--tokens 48] [--batch 1] [--temperature T --top-p P] [--out DIR]

For each model (with --mtp N MTP layers added where the preset has none: DeepSeek-V2-Lite and
Llama ship without, the seed's engine drafts with DeepSeek-V3's one):
1. the k sweep: for k = 0..kmax, one CUDA-graph replay of the verify step (k+1 tokens, accept on
   the device, k MTP draft passes) against a cache of ctx positions, median of many replays, and
   the launches one replay makes (torch.profiler);
2. equality: from the same start tokens (one per sequence, --batch of them), greedy output for
   every k and every draft source of --sources (default: MTP drafts, oracle drafts (every draft
   right: k+1 tokens per step, checked), and noisy:0.5 oracle drafts (half the drafts wrong: every
   accept length occurs)) equals k=0's, token for token, for every sequence.  Every k runs on one
   engine, so one set of plans serves both parts (compiling them is most of a sweep's time).
With --temperature > 0 the steps accept by speculative sampling (the SAMPLE body) and only the
sweep runs (sampled output is not greedy output): beside a greedy sweep, the sampling body's cost.
Writes DIR/sweep_<model>.json (a list of {"k", "step_ms", ...}: `tools/stepmath.py --sweep` reads it)
and prints a table.  Random weights: MTP acceptance here says nothing about a trained model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph.compile import CompileOptions  # noqa: E402
from megakernel.profiler import count_launches  # noqa: E402
from megakernel.speculative import Drafts, SpeculativeDecoder  # noqa: E402
from model import init_weights  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.presets import PRESETS  # noqa: E402
from tools.bench import time_ms  # noqa: E402


def with_mtp(name: str, mtp: int) -> ModelConfig:
    hf = dict(PRESETS[name])
    if mtp and not hf.get("num_nextn_predict_layers"):
        hf["num_nextn_predict_layers"] = mtp
    return ModelConfig.from_hf_dict(hf, source=f"preset {name}" + (f" + {mtp} MTP layer(s)" if mtp else ""))


def time_step(dec: SpeculativeDecoder, k: int, ctx: int, gen: torch.Generator) -> dict:
    """One verify step of k+1 tokens at cache length ctx-1: median graph replay and launches
    (on a CPU, a dry run of the tool: the interpreter's wall time, no launches)."""
    runner = dec.runner(k + 1, False)
    tokens = torch.randint(0, dec.cfg.vocab_size, (dec.batch, k + 1), generator=gen)
    lens = torch.full((dec.batch,), ctx - 1)
    t0 = time.perf_counter()
    runner.step(tokens, lens, seeds=dec.step_seeds())  # on the GPU: stages the inputs every replay copies in
    if getattr(runner, "graph", None) is None:
        return {"k": k, "step_ms": (time.perf_counter() - t0) * 1e3, "tasks": runner.plan.num_tasks}
    ms = time_ms(runner.replay, iters=50, warmup=10)
    launches = count_launches(runner.replay, steps=3)
    torch.cuda.synchronize()
    runner.check_error()
    return {"k": k, "step_ms": ms, "tasks": runner.plan.num_tasks, **launches}


def sweep_model(name: str, args, workers: int) -> list[dict]:
    cfg = with_mtp(name, args.mtp)
    t0 = time.perf_counter()
    gpu = args.device.startswith("cuda")
    dtype = torch.bfloat16 if gpu else torch.float32
    weights = init_weights(cfg, seed=0, device=args.device, dtype=dtype)
    max_len = args.ctx + 2 * (args.kmax + 1) + args.tokens
    dec = SpeculativeDecoder(cfg, weights, k=args.kmax, batch=args.batch, max_len=max_len, device=args.device,
                             dtype=dtype, backend="megakernel" if gpu else "interpret",
                             options=CompileOptions(workers=workers), temperature=args.temperature, top_p=args.top_p)
    del weights  # the engine packed its own copy
    # every plan the sweep and the equality check use, compiled side by side (most of a sweep's setup)
    dec.precompile(range(args.kmax + 1), 1, args.compile_processes)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for k in range(args.kmax + 1):
        if k == 0:  # a random (not zero) cache for the timing
            first = dec.runner(1, False)
            first.cache().normal_(generator=torch.Generator(device=args.device).manual_seed(2))
        rows.append(time_step(dec, k, args.ctx, gen))
        print(f"{name} k={k}: {rows[-1]['step_ms']:.3f} ms", flush=True)

    if args.temperature > 0:  # sampled output is not greedy output: the sweep alone
        rows[0].update(reference=True, sampling=True, temperature=args.temperature, top_p=args.top_p,
                       batch=args.batch, setup_s=time.perf_counter() - t0)
        return rows
    # equality: one start token per sequence (every k shares the one prefill plan), greedy
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, 1), generator=gen)
    plain, _ = dec.with_k(0).generate(prompt, args.tokens + args.kmax + 1)
    for row in rows[1:]:
        k = row["k"]
        for source in args.sources:
            drafts = Drafts(source, plain, cfg.vocab_size, seed=k)
            out, stats = dec.with_k(k).generate(prompt, args.tokens, drafts)
            key = source.split(":")[0]
            row[f"equal_{key}"] = out == [seq[:args.tokens] for seq in plain]
            row[f"acceptance_length_{key}"] = stats.acceptance_length
            if source == "oracle":  # every draft accepted: exactly k+1 tokens per step
                row["oracle_k_plus_1"] = stats.acceptance_length == k + 1 == stats.tokens_per_step
    rows[0].update(reference=True, tokens_checked=args.tokens, batch=args.batch,
                   setup_s=time.perf_counter() - t0)  # what k >= 1 equal
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=["dsv2-lite"])
    p.add_argument("--mtp", type=int, default=1, help="MTP layers to add where a preset has none (default 1)")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--kmax", type=int, default=7)
    p.add_argument("--tokens", type=int, default=48, help="tokens generated per equality check (default 48)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run on the interpreter)")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: accept by speculative sampling (sweep only)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sources", nargs="*", default=["mtp", "oracle", "noisy:0.5"],
                   help="draft sources of the equality check (mtp, oracle, noisy:P)")
    p.add_argument("--compile-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="plans compiled side by side (default: half the CPUs, at most 8)")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("spec_sweep times CUDA-graph replays: it needs a GPU (or --device cpu for a dry run)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workers = torch.cuda.get_device_properties(0).multi_processor_count if args.device.startswith("cuda") else 4
    table = []
    for name in args.models:
        rows = sweep_model(name, args, workers)
        (out / f"sweep_{name}.json").write_text(json.dumps(rows, indent=1))
        table += [(name, r) for r in rows]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    keys = [source.split(":")[0] for source in args.sources]
    print(f"\n{'model':<11}{'k':>3}{'step ms':>9}{'launch':>8}{'tasks':>7}  equal {'/'.join(keys)}  "
          f"accept len {'/'.join(keys)}")
    for name, r in table:
        launch = r.get("launches_per_step", 0.0)
        if args.temperature > 0:
            equal, acc = "(sampling)", "-"
        elif r.get("reference"):
            equal, acc = "(reference)", "/".join("1.00" for _ in keys)
        else:
            equal = "/".join(str(r[f"equal_{key}"]) for key in keys)
            acc = "/".join(f"{r[f'acceptance_length_{key}']:.2f}" for key in keys)
            if "oracle_k_plus_1" in r:
                acc += f" (oracle k+1: {r['oracle_k_plus_1']})"
        print(f"{name:<11}{r['k']:>3}{r['step_ms']:>9.3f}{launch:>8.1f}{r['tasks']:>7}  {equal:<17}  {acc}")


if __name__ == "__main__":
    main()
