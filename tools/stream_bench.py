"""The weight stream alone: how fast the persistent kernel's workers read weights, per launch variant.

    python tools/stream_bench.py [--kind dense|moe] [--layers 2] [--width 32768]
                                 [--variants BR=16,KC=1024 KC=4096 ...] [--out DIR]

A model whose decode step is almost all MLP weights isolates the weight stream from the
dependency chain that sets a real model's step: Llama-shaped (`dense`: LINEAR tasks) or
DeepSeek-V2-shaped (`moe`: EXPERT_LINEAR tasks behind a router, the row-list path), hidden 2048,
a wide MLP (--width), vocab 256, a 16-position cache.  Reports bytes read per step / step time
(TB/s and GB/s per SM) against x.sum()'s streaming read in the same run, for the default launch
and each variant (block-size overrides as tools/bench.py takes them).  docs/PERF.md: the real
models' expert tasks ran ~12 GB/s per SM where the floor needs ~32.

For a profiler's view of one step of the same kernel (stall reasons, local-memory traffic):
    ncu --kernel-name megakernel --launch-skip 3 --launch-count 1 --set full \\
        python tools/stream_bench.py --iters 1 --warmup 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph.compile import CompileOptions, compile_step  # noqa: E402
from graph.lower import StepShape  # noqa: E402
from megakernel.runtime import Megakernel  # noqa: E402
from model import init_weights  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.presets import PRESETS  # noqa: E402
from model.stats import step_bytes  # noqa: E402
from tools.bench import launch_config, read_bandwidth, step_max_len, time_ms  # noqa: E402


def stream_config(kind: str, layers: int, width: int) -> ModelConfig:
    if kind == "dense":
        hf = dict(PRESETS["llama-1b"], num_hidden_layers=layers, intermediate_size=width, vocab_size=256,
                  max_position_embeddings=64)
    elif kind == "moe":  # every layer MoE; each token's 6 experts are width/4 wide
        hf = dict(PRESETS["dsv2-lite"], num_hidden_layers=layers, first_k_dense_replace=0, vocab_size=256,
                  moe_intermediate_size=width // 4, n_shared_experts=0, max_position_embeddings=64)
    else:
        raise SystemExit(f"--kind {kind!r}: dense or moe")
    return ModelConfig.from_hf_dict(hf, source=f"stream bench ({kind}, {layers} layers, width {width})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="dense", choices=["dense", "moe"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=32768, help="MLP intermediate width (moe: 4 x each expert's)")
    p.add_argument("--variants", nargs="*", default=[], metavar="KEY=V,...")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("stream_bench times the persistent kernel: it needs a GPU")
    cfg = stream_config(args.kind, args.layers, args.width)
    props = torch.cuda.get_device_properties(0)
    bw = read_bandwidth()
    ctx = 16
    plan = compile_step(cfg, StepShape(T=1, B=1, max_len=step_max_len(ctx, 1)),
                        CompileOptions(workers=props.multi_processor_count))
    weights = init_weights(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    base = Megakernel(plan, weights, "cuda", torch.bfloat16)
    del weights
    base.cache().normal_()
    tokens = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda")
    lens = torch.tensor([ctx - 1], device="cuda")
    nbytes = step_bytes(cfg, 1, 1, ctx).total
    rows = []
    for spec in [""] + args.variants:
        mk = base if not spec else Megakernel(plan, None, "cuda", share=base.mem, config=launch_config(spec))
        mk.capture()
        first = mk.step(tokens, lens)
        ms = time_ms(mk.replay, iters=args.iters, warmup=args.warmup)
        torch.cuda.synchronize()
        mk.check_error()
        row = {"variant": spec or "default", "ms": ms, "TBps": nbytes / ms / 1e9,
               "GBps_per_SM": nbytes / ms / 1e6 / props.multi_processor_count,
               "regs": mk.compiled.n_regs, "spills": mk.compiled.n_spills}
        if spec:
            ref = rows[0]["logits"]
            row["rel_err_vs_default"] = float((first.logits - ref).norm() / ref.norm().clamp_min(1e-30))
        row["logits"] = first.logits
        rows.append(row)
    for r in rows:
        r.pop("logits")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": props.name, "kind": args.kind, "layers": args.layers, "width": args.width, "tasks": plan.num_tasks,
              "bytes_per_step": nbytes, "read_TBps": bw / 1e12, "rows": rows}
    (out / f"stream_{args.kind}.json").write_text(json.dumps(result, indent=1))
    print(f"{props.name}: streaming read {bw / 1e12:.2f} TB/s ({bw / 1e9 / props.multi_processor_count:.1f} GB/s "
          f"per SM); {args.kind} step reads {nbytes / 1e9:.3f} GB in {plan.num_tasks} tasks")
    print(f"{'variant':<24}{'ms':>9}{'TB/s':>7}{'GB/s/SM':>9}{'regs':>6}{'spills':>8}")
    for r in rows:
        print(f"{r['variant']:<24}{r['ms']:>9.3f}{r['TBps']:>7.2f}"
              f"{r['GBps_per_SM']:>9.1f}{r['regs']:>6}{r['spills']:>8}")


if __name__ == "__main__":
    main()
