"""Command line: ``python -m megakernel.run`` decodes with a model and reports what it did.

With no arguments it runs an embedded default that finishes in seconds: on a
CPU the tiny MoE model through the compiled plan and the plan interpreter, on a
GPU the DeepSeek-V2-Lite shape.  ``--describe``
prints sizes without allocating weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from graph.compile import CompileOptions, compile_step
from graph.fusion import DEFAULT_RULES, WEIGHT_RULES
from graph.lower import StepShape
from model import ConfigError, CheckpointError, ModelConfig, PRESETS, init_weights, load_checkpoint, preset
from model.reference import CacheOverflowError
from model.schema import DTYPES
from model.stats import describe

from .engine import make_engine
from .launch import MegakernelError

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
    p.add_argument("--backend", choices=["reference", "interpret", "megakernel"], default=None,
                   help="reference: the unfused PyTorch model; interpret: the compiled plan run by the plan "
                        "interpreter; megakernel: the plan run by the persistent GPU kernel in a CUDA graph "
                        "(default: interpret on a CPU, megakernel on a GPU)")
    p.add_argument("--workers", type=int, default=None,
                   help="workers (queues) a plan is scheduled on (default: 8 on a CPU, the GPU's SM count)")
    p.add_argument("--plan", action="store_true", help="print the decode-step plan's description and exit")
    p.add_argument("--fuse-norms", action=argparse.BooleanOptionalAction, default=True,
                   help="fold each RMSNorm into the projections that read it (fusion rule norm_into_linear: the "
                        "norm's weight packed into theirs, one dependent hop fewer per norm; on by default, "
                        "--no-fuse-norms keeps the norms as tasks of their own)")
    p.add_argument("--spec-k", type=int, default=None, metavar="K",
                   help="speculative decoding: verify K drafts per step (0..7), accept on the device")
    p.add_argument("--adaptive-k", action="store_true",
                   help="with --spec-k K: choose each step's k in 0..K from the moving acceptance (one graph per k)")
    p.add_argument("--k-sweep", metavar="PATH",
                   help="with --adaptive-k: measured step times, JSON list of {\"k\": K, \"step_ms\": MS} "
                        "(default: a linear model, 5%% of a step per draft)")
    p.add_argument("--draft", default="mtp", metavar="SOURCE",
                   help="draft source with --spec-k: mtp (the model's MTP layers), oracle (this engine's own "
                        "greedy output: all accepted), noisy:P (the oracle, each draft wrong with probability P)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples on the speculative decoder (--spec-k 0 unless given), "
                        "with speculative rejection sampling that keeps the target distribution")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="with --temperature > 0: nucleus sampling mass, in (0, 1] (default 1)")
    p.add_argument("--check", action="store_true",
                   help="run the reference on the same tokens and exit non-zero on a mismatch")
    p.add_argument("--profile", metavar="PATH",
                   help="megakernel backend: profile one more decode step and write PATH (Perfetto/Chrome trace, "
                        "one track per worker), PATH with .png (timeline) and a per-op table into --json")
    p.add_argument("--helper", default="none", metavar="KIND",
                   help="routed experts partly on a helper: none (default), cpu (a host worker thread), emulate "
                        "(same device, for tests), cuda:N (a worker thread driving GPU N); the megakernel reaches it "
                        "through mailboxes in host memory that a host thread serves")
    p.add_argument("--helper-fraction", type=float, default=0.5,
                   help="share of routed experts placed on the helper (default 0.5)")
    p.add_argument("--migrate", choices=["on", "off"], default="off",
                   help="move hot experts to main slots in the background, by windowed routing counts")
    p.add_argument("--helper-timeout", type=float, default=1.0,
                   help="seconds the main side waits for a helper answer before the error (default 1)")
    p.add_argument("--helper-fallback", action="store_true",
                   help="on a helper timeout, recompute its experts on the main side instead of failing")
    p.add_argument("--helper-persistent", action="store_true",
                   help="with --helper cuda:N and the megakernel: GPU N answers the calls with one persistent kernel "
                        "per step, polling the mailboxes itself (no host thread on a call's path; not yet timed)")
    p.add_argument("--json", metavar="PATH", help="also write machine-readable results to PATH")
    return p.parse_args(argv)


def helper_options(args):
    from helper_card.setup import HelperOptions
    return HelperOptions(kind=args.helper, fraction=args.helper_fraction, migrate=args.migrate == "on",
                         timeout_s=args.helper_timeout, fallback=args.helper_fallback,
                         persistent=args.helper_persistent)


def helper_report(backend) -> dict | None:
    """The `helper` object of --json: placement, and per-step metrics summed and per step."""
    h = getattr(backend, "helper", None)
    if h is None:
        return None
    steps = backend.helper_steps
    total = {k: sum(s[k] for s in steps) for k in ("rows", "calls", "skipped", "exposed_wait_ms", "fallbacks",
                                                     "moves")} if steps else {}
    return {"kind": h.opts.kind, "fraction": h.opts.fraction, "main_slots": h.capacity,
            "placement_digest": h.placement.digest(), "helper_share_now": h.placement.helper_share,
            "migrate": h.opts.migrate, "steps": len(steps), "totals": total,
            "bytes_migrated": h.copier.bytes_moved if h.copier else 0, "per_step": steps}


def print_helper(report: dict | None) -> None:
    if report is None:
        return
    t, n = report["totals"], max(1, report["steps"])
    print(f"  helper {report['kind']}: {report['fraction']:.0%} of routed experts placed there "
          f"({report['main_slots']} main slots, map {report['placement_digest']}); per step: "
          f"{t.get('rows', 0) / n:.1f} rows, {t.get('calls', 0) / n:.1f} calls, {t.get('skipped', 0) / n:.1f} layers "
          f"skipped, {t.get('exposed_wait_ms', 0) / n:.2f} ms exposed wait; {t.get('moves', 0)} experts migrated "
          f"({report['bytes_migrated'] / 1e6:.1f} MB), helper share now {report['helper_share_now']:.0%}")


def resolve_config(name: str) -> tuple[ModelConfig, Path | None]:
    if name in PRESETS:
        return preset(name), None
    path = Path(name)
    if path.is_dir():
        return ModelConfig.from_dir(path), path
    raise ConfigError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")


def load_weights(cfg: ModelConfig, path: Path | None, seed: int, device: torch.device, dtype: torch.dtype,
                 host=None) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """Checkpoint weights if the directory has any, else seeded random ones (and say which); tensors
    `host` names stay in host memory."""
    if path is not None and any(path.glob("*.safetensors")):
        cfg, weights = load_checkpoint(path, device=device, dtype=dtype, host=host)
        return cfg, weights, f"checkpoint {path}"
    return (cfg, init_weights(cfg, seed=seed, device=device, dtype=dtype, host=host),
            f"seeded random weights (seed {seed})")


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def print_describe(name: str, d: dict) -> None:
    print(f"model {name}: {d['architecture']}, {d['layers']} layers ({d['moe_layers']} MoE), "
          f"{d['mtp_layers']} MTP, dtype {d['dtype']}")
    print(f"  parameters              {d['parameters'] / 1e9:.2f}B "
          f"({d['parameters_with_mtp'] / 1e9:.2f}B with MTP layers)")
    print(f"  active per token        {d['active_parameters_per_token'] / 1e9:.2f}B")
    for key, value in d.items():
        if key.startswith("step_bytes_T"):
            extra = (f", {value['expected_experts_per_layer']:.1f} experts/layer under uniform routing"
                     if "expected_experts_per_layer" in value and d["moe_layers"] else "")
            print(f"  decode step {key[11:]:>3}, B=1  reads {_fmt_bytes(value['total'])} "
                  f"(weights {_fmt_bytes(value['weights'])}, cache {_fmt_bytes(value['cache'])} "
                  f"at ctx {d['context']}{extra})")


def plan_summary(plan) -> dict:
    passes = {p["pass"]: p for p in plan.passes}
    fusion = passes.get("fusion", {})
    lowered = passes["lower"]["ops"]
    return {
        "ops_before": lowered,
        "ops_after": fusion.get("ops_after", passes.get("cse", {}).get("ops_after", lowered)),
        "cse_merged": passes.get("cse", {}).get("merged", 0),
        "fused": fusion.get("fused", 0),
        "tasks": plan.num_tasks,
        "workers": plan.workers,
        "critical_path_ms_est": plan.estimate["critical_path_ms"],
        "compile_s": passes["total"]["compile_s"],
    }


def measure_megakernel(engine, profile_path: str | None) -> dict:
    """Launches per step counted by the profiler on the decode graph; optionally a task timeline."""
    from .profiler import count_launches, task_trace
    from .runtime import LaunchConfig, Megakernel
    kernel = engine.backend.runner(1)
    out = count_launches(kernel.replay, steps=3)  # steps too (same tokens and positions)
    if profile_path:
        prof = Megakernel(kernel.plan, None, engine.device, share=kernel.mem, config=LaunchConfig(profile=True))
        lens = engine.lens - 1
        tokens = kernel.mem.io_view("in.tokens").view(kernel.B, kernel.T).long().clone()
        prof.step(tokens, lens)
        table = task_trace(prof, profile_path)
        out["profile"] = {"trace": profile_path, "step_us": table["step_us"],
                          "ops": {k: v for k, v in sorted(table["ops"].items(), key=lambda kv: -kv[1]["busy_us"])}}
    return out


def run_speculative(args, name, cfg, weights, source, backend, device, dtype, options, result, sweep) -> dict:
    """sweep: --k-sweep's step time per k (read before anything loaded), or None."""
    from .speculative import Drafts, SpeculativeDecoder, cache_positions
    if backend == "reference":
        raise ValueError("--spec-k and sampling (--temperature > 0) run on the interpret or megakernel backend")
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=gen)
    room = cache_positions(args.prompt_len, args.steps, args.spec_k) + 8
    oracle = None
    if args.draft != "mtp":  # the oracle: this engine's own plain greedy continuation
        plain = SpeculativeDecoder(cfg, weights, 0, args.batch, room, device, dtype, backend, options=options)
        oracle, _ = plain.generate(prompt, args.steps + args.spec_k + 1)
    drafts = Drafts(args.draft, oracle, cfg.vocab_size, args.seed)
    adaptive = None
    if args.adaptive_k:
        from .adaptive import AdaptiveK
        if sweep is not None:
            adaptive = AdaptiveK(args.spec_k, {k: sweep[k] for k in sweep if k <= args.spec_k})
        else:
            adaptive = AdaptiveK.linear(args.spec_k)
    decoder = SpeculativeDecoder(cfg, weights, args.spec_k, args.batch, room, device, dtype, backend, options=options,
                                 temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                 helper=helper_options(args), adaptive=adaptive)
    tokens, stats = decoder.generate(prompt, args.steps, drafts, eos=None)
    spec = stats.to_dict()
    result.update(weights=source, device=str(device), dtype=str(dtype).removeprefix("torch."), backend=backend,
                  batch=args.batch, prompt_len=args.prompt_len, steps=args.steps, spec_k=args.spec_k,
                  draft=args.draft, temperature=args.temperature, top_p=args.top_p, tokens=tokens,
                  **{k: spec[k] for k in ("tokens_per_step", "acceptance_length",
                                          "per_position_acceptance", "tokens_per_s")},
                  spec_steps=spec["steps"], step_ms_median=spec["step_ms_median"], k_mean=spec["k_mean"],
                  adaptive_k=args.adaptive_k)
    print(f"model {name} ({cfg.architecture}) on {device}, {result['dtype']}, {source}")
    mode = f"sampling at temperature {args.temperature}, top-p {args.top_p}" if args.temperature > 0 else "greedy"
    print(f"speculative decoding ({mode}), k={args.spec_k}, drafts from {args.draft}, backend {backend}: "
          f"{args.batch} sequence(s), {args.steps} tokens each")
    if args.adaptive_k:
        print(f"  adaptive k in 0..{args.spec_k}: mean k {spec['k_mean']:.2f}")
    print(f"  {spec['steps']} steps, {spec['tokens_per_step']:.2f} tokens per step per sequence (acceptance length), "
          f"per-position acceptance {[round(x, 2) for x in spec['per_position_acceptance']]}")
    print(f"  step median {spec['step_ms_median'] or 0:.2f} ms, {spec['tokens_per_s'] or 0:.1f} tokens/s "
          f"(tokens emitted / wall time of the decode loop, host work included)")
    for b, row in enumerate(tokens):
        print(f"  sequence {b}: {row}")
    result["helper"] = helper_report(decoder.engine)
    print_helper(result["helper"])
    return result


def check_options(args: argparse.Namespace, backend: str) -> None:
    """Options this run would ignore without a word, refused by name before anything loads (whoever gave one
    expects it to act)."""
    if args.spec_k is None:  # before sampling sets k = 0: drafts and their k need speculative decoding asked for
        for flag, given in (("adaptive-k", args.adaptive_k), ("draft", args.draft != "mtp")):
            if given:
                raise ValueError(f"--{flag} needs --spec-k K (speculative decoding)")
    if args.k_sweep and not args.adaptive_k:
        raise ValueError("--k-sweep needs --adaptive-k (it gives the step time of each k that the choice weighs)")
    if args.profile and backend != "megakernel":
        raise ValueError(f"--profile stamps the megakernel's tasks: it needs --backend megakernel, not {backend}")
    if args.helper == "none":
        for flag, given in (("migrate on", args.migrate == "on"), ("helper-fallback", args.helper_fallback),
                            ("helper-persistent", args.helper_persistent)):
            if given:
                raise ValueError(f"--{flag} needs --helper cpu|emulate|cuda:N (routed experts on a helper)")


def check_sampling(temperature: float, top_p: float, t_name: str = "temperature", p_name: str = "top_p") -> None:
    """Refuses a temperature below 0 or not finite, a top-p outside (0, 1], and a top-p below 1 without a
    temperature (greedy decoding samples nothing: it would be ignored without a word)."""
    if not 0 <= temperature < float("inf"):  # NaN too
        raise ValueError(f"{t_name} must be >= 0 and finite (0 decodes greedily), got {temperature}")
    if not 0 < top_p <= 1:  # NaN too
        raise ValueError(f"{p_name} must be in (0, 1] (the sampled tokens' probability mass), got {top_p}")
    if top_p < 1 and temperature == 0:
        raise ValueError(f"{p_name} {top_p} needs {t_name} > 0 (greedy decoding samples nothing)")


def resolve_device(asked: str | None, what: str = "--device") -> torch.device:
    """The device asked for (None or "": CUDA where torch has it, else the CPU), refused by name if this machine
    lacks it."""
    if not asked:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(asked)
    except RuntimeError as e:
        raise ValueError(f"{what} {asked}: not a device torch knows ({e})") from e
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise ValueError(f"{what} {asked}: this machine has {count} CUDA device(s) torch can use")
    return device


def defaults(device: torch.device) -> tuple[str, str, int]:
    """(model, backend, workers) a run on `device` takes when none is given: the real thing on the persistent
    kernel with a worker per SM on a GPU, the tiny model through the plan interpreter on a CPU."""
    if device.type == "cuda":
        return DEFAULT_GPU_MODEL, "megakernel", torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_CPU_MODEL, "interpret", 8


def default_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The model's dtype on a GPU; fp32 on a CPU (the interpreter's reference precision)."""
    return DTYPES[cfg.dtype] if device.type == "cuda" else torch.float32


def run(args: argparse.Namespace) -> dict:
    device = resolve_device(args.device)
    folder = Path(args.json).resolve().parent if args.json else None
    if folder is not None and not folder.is_dir():  # found now, not after the whole run
        raise ValueError(f"--json {args.json}: its folder {folder} does not exist")
    default_model, default_backend, default_workers = defaults(device)
    name = args.model or default_model
    backend = args.backend or default_backend
    check_options(args, backend)
    from .adaptive import load_sweep
    sweep = load_sweep(args.k_sweep) if args.k_sweep else None  # a bad file is an error before anything loads
    if args.workers is None:
        args.workers = default_workers
    cfg, path = resolve_config(name)
    if args.ctx < 0:
        raise ValueError(f"--ctx must be >= 0 (cache positions --describe counts), got {args.ctx}")
    result: dict = {"model": name, "describe": describe(cfg, context=args.ctx)}
    if args.describe:
        print_describe(name, result["describe"])
        return result
    for flag in ("steps", "prompt_len", "batch", "workers"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    check_sampling(args.temperature, args.top_p, "--temperature", "--top-p")
    if args.temperature > 0 and args.spec_k is None:
        args.spec_k = 0  # sampling (and its on-device accept) is the speculative decoder's: with no drafts, k = 0
    if args.spec_k is not None:  # the speculative decoder has no reference beside it and no profiled step
        for flag in ("check", "profile"):
            if getattr(args, flag):
                raise ValueError(f"--{flag} runs with the plain greedy decoder, not with --spec-k or --temperature > 0")
    max_len = args.prompt_len + args.steps
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"--prompt-len {args.prompt_len} + --steps {args.steps} = {max_len} positions, more than "
                         f"{name}'s max_position_embeddings ({cfg.max_position_embeddings})")
    options = CompileOptions(workers=args.workers,
                             fusion_rules=tuple(r for r in DEFAULT_RULES if args.fuse_norms or r not in WEIGHT_RULES))
    if args.plan:
        plan = compile_step(cfg, StepShape(T=1, B=args.batch, max_len=max_len), options)
        print(plan.describe())
        result["plan"] = plan_summary(plan)
        return result

    dtype = DTYPES[args.dtype] if args.dtype else default_dtype(cfg, device)
    host = None
    if args.helper == "cpu" and not args.check and cfg.n_routed_experts:  # --check's reference needs them all here
        from helper_card.setup import is_routed_expert
        host = is_routed_expert(cfg)  # main keeps only its slots: the experts never pass through the device
    cfg, weights, source = load_weights(cfg, path, args.seed, device, dtype, host)
    if args.spec_k is not None:
        return run_speculative(args, name, cfg, weights, source, backend, device, dtype, options, result, sweep)
    engine = make_engine(cfg, weights, backend, args.batch, max_len, device, dtype, workers=args.workers,
                         check=args.check, seed=args.seed, options=options, helper=helper_options(args))
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=gen).to(device)
    setup_s = engine.warm(args.prompt_len)
    tokens, prefill_s = engine.generate(prompt, args.steps)
    steps = engine.step_seconds
    step_ms = statistics.median(steps) * 1e3 if steps else float("nan")
    result.update(
        weights=source, device=str(device), dtype=str(dtype).removeprefix("torch."), backend=backend,
        batch=args.batch, prompt_len=args.prompt_len, steps=args.steps, setup_s=setup_s, prefill_ms=prefill_s * 1e3,
        step_ms_median=step_ms, tokens_per_s=args.batch * 1e3 / step_ms if steps else None,
        tokens=tokens.cpu().tolist(),
    )
    what = {"reference": "unfused PyTorch reference", "interpret": "compiled plan, run by the plan interpreter",
            "megakernel": "compiled plan, run by the persistent kernel, one CUDA graph replay per step"}
    print(f"model {name} ({cfg.architecture}) on {device}, {result['dtype']}, {source}")
    print(f"backend {backend} ({what[backend]}): prompt of {args.prompt_len} random tokens x {args.batch} "
          f"sequence(s), {args.steps} greedy tokens each")
    if backend in ("interpret", "megakernel"):
        plan = engine.backend.plan(1)
        result["plan"] = plan_summary(plan)
        p = result["plan"]
        print(f"  plan (T=1): {p['ops_before']} ops lowered -> {p['ops_after']} after CSE and fusion, "
              f"{p['tasks']} tasks on {p['workers']} workers; {len(engine.backend.plans)} plan(s) compiled "
              f"in {engine.backend.compile_s:.2f} s")
    print(f"  setup (compile plans, JIT, capture) {setup_s:.1f} s; prefill {result['prefill_ms']:.1f} ms; "
          f"decode step median {step_ms:.2f} ms "
          f"({result['tokens_per_s'] or 0:.1f} tokens/s)")
    for b, row in enumerate(result["tokens"]):
        print(f"  sequence {b}: {row}")
    result["helper"] = helper_report(engine.backend)
    print_helper(result["helper"])
    if backend == "megakernel" and device.type == "cuda":
        result.update(measure_megakernel(engine, args.profile))
        print(f"  launches per step (measured): {result['launches_per_step']:.0f} "
              f"({result['kernels_per_step']:.0f} kernel, {result['memcpy_per_step']:.0f} input copies)")
        if args.profile:
            print(f"  profile: {args.profile} (Perfetto), {Path(args.profile).with_suffix('.png')}; "
                  f"profiled step {result['profile']['step_us']:.0f} µs")
    if engine.check is not None:
        result["check"] = engine.check.to_dict()
        c = result["check"]
        verdict = "PASS" if c["ok"] else "FAIL"
        print(f"  check against the reference ({c['tokens_compared']} positions): max relative error "
              f"{c['max_rel_err']:.2e} (tolerance {c['tolerance']:.0e}), tokens equal {c['tokens_equal']}/"
              f"{c['tokens_compared']} -> {verdict}")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (ConfigError, CheckpointError, CacheOverflowError, ValueError, NotImplementedError, MegakernelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if "check" in result and not result["check"]["ok"]:
        print("error: the engine's output does not match the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
