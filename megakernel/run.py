"""Command line: ``python -m megakernel.run`` decodes with a model and reports what it did.

With no arguments it runs an embedded default that finishes in seconds: on a
CPU the tiny MoE model, on a GPU the DeepSeek-V2-Lite shape.  ``--describe``
prints sizes without allocating weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from model import ConfigError, CheckpointError, ModelConfig, PRESETS, Reference, init_weights, load_checkpoint, preset
from model.reference import Cache, CacheOverflowError
from model.schema import DTYPES
from model.stats import describe

DEFAULT_CPU_MODEL = "tiny-moe"
DEFAULT_GPU_MODEL = "dsv2-lite"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megakernel.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"preset name ({', '.join(PRESETS)}) or a directory with an HF config.json and optional "
                        f"*.safetensors (default: {DEFAULT_CPU_MODEL} on a CPU, {DEFAULT_GPU_MODEL} on a GPU)")
    p.add_argument("--steps", type=int, default=16, help="decode steps to run (default 16)")
    p.add_argument("--prompt-len", type=int, default=8, help="length of the seeded random prompt (default 8)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="compute dtype (default: float32 on a CPU, the config's dtype on a GPU)")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights and the prompt (default 0)")
    p.add_argument("--ctx", type=int, default=4096, help="context length --describe counts cache bytes for")
    p.add_argument("--describe", action="store_true",
                   help="print parameters, active parameters per token and bytes per decode step, allocate nothing")
    p.add_argument("--json", metavar="PATH", help="also write machine-readable results to PATH")
    return p.parse_args(argv)


def resolve_config(name: str) -> tuple[ModelConfig, Path | None]:
    if name in PRESETS:
        return preset(name), None
    path = Path(name)
    if path.is_dir():
        return ModelConfig.from_dir(path), path
    raise ConfigError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")


def load_weights(cfg: ModelConfig, path: Path | None, seed: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """Checkpoint weights if the directory has any, else seeded random ones (and say which)."""
    if path is not None and any(path.glob("*.safetensors")):
        cfg, weights = load_checkpoint(path, device=device, dtype=dtype)
        return cfg, weights, f"checkpoint {path}"
    return cfg, init_weights(cfg, seed=seed, device=device, dtype=dtype), f"seeded random weights (seed {seed})"


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def print_describe(name: str, d: dict) -> None:
    print(f"model {name}: {d['architecture']}, {d['layers']} layers ({d['moe_layers']} MoE), "
          f"{d['mtp_layers']} MTP, dtype {d['dtype']}")
    print(f"  parameters              {d['parameters'] / 1e9:.2f}B ({d['parameters_with_mtp'] / 1e9:.2f}B with MTP layers)")
    print(f"  active per token        {d['active_parameters_per_token'] / 1e9:.2f}B")
    for key, value in d.items():
        if key.startswith("step_bytes_T"):
            extra = (f", {value['expected_experts_per_layer']:.1f} experts/layer under uniform routing"
                     if "expected_experts_per_layer" in value and d["moe_layers"] else "")
            print(f"  decode step {key[11:]:>3}, B=1  reads {_fmt_bytes(value['total'])} "
                  f"(weights {_fmt_bytes(value['weights'])}, cache {_fmt_bytes(value['cache'])} at ctx {d['context']}{extra})")


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = args.model or (DEFAULT_GPU_MODEL if device.type == "cuda" else DEFAULT_CPU_MODEL)
    cfg, path = resolve_config(name)
    result: dict = {"model": name, "describe": describe(cfg, context=args.ctx)}
    if args.describe:
        print_describe(name, result["describe"])
        return result

    for flag in ("steps", "prompt_len", "batch"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    dtype = DTYPES[args.dtype] if args.dtype else (DTYPES[cfg.dtype] if device.type == "cuda" else torch.float32)
    cfg, weights, source = load_weights(cfg, path, args.seed, device, dtype)
    ref = Reference(cfg, weights)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=gen).to(device)
    cache = Cache.allocate(cfg, args.batch, args.prompt_len + args.steps, dtype, device)
    lens = torch.zeros(args.batch, dtype=torch.long, device=device)

    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out, time.perf_counter() - t0

    out, prefill_s = timed(lambda: ref.step(prompt, cache, lens))
    lens += args.prompt_len
    tokens = out.logits[:, -1].argmax(-1, keepdim=True)
    generated, step_s = [tokens], []
    for _ in range(args.steps - 1):
        out, dt = timed(lambda: ref.step(tokens, cache, lens))
        lens += 1
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(tokens)
        step_s.append(dt)
    generated_tokens = torch.cat(generated, dim=1).cpu()
    step_ms = statistics.median(step_s) * 1e3 if step_s else float("nan")
    result.update(
        weights=source, device=str(device), dtype=str(dtype).removeprefix("torch."), backend="reference",
        batch=args.batch, prompt_len=args.prompt_len, steps=args.steps, prefill_ms=prefill_s * 1e3,
        step_ms_median=step_ms, tokens_per_s=args.batch * 1e3 / step_ms if step_s else None,
        tokens=generated_tokens.tolist(),
    )
    print(f"model {name} ({cfg.architecture}) on {device}, {result['dtype']}, {source}")
    print(f"backend reference (unfused PyTorch): prompt of {args.prompt_len} random tokens x {args.batch} "
          f"sequence(s), {args.steps} greedy tokens each")
    print(f"  prefill {result['prefill_ms']:.1f} ms; decode step median {step_ms:.2f} ms "
          f"({result['tokens_per_s'] or 0:.1f} tokens/s)")
    for b, row in enumerate(generated_tokens.tolist()):
        print(f"  sequence {b}: {row}")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (ConfigError, CheckpointError, CacheOverflowError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
