"""Side-by-side decode-step timing on one GPU, with the floor measured in the same run.

    python tools/bench.py [--models llama-1b dsv2-lite] [--T 1 6] [--ctx 4096] [--out DIR]

For each model and T: plain PyTorch (model/reference/static.py: the reference
step with fixed shapes) in eager mode, eager + CUDA graph and torch.compile +
CUDA graph; the megakernel (one CUDA graph replay per step); kernels per step
for each, counted by the profiler; the megakernel's agreement with the plan
interpreter on the same step; and the floor = bytes the step must read (weights
of the experts the step routes to, plus the cache) ÷ streaming read bandwidth
measured here.  Prints a table, writes JSON (and, with
--profile, a Perfetto trace and per-op table per model).

Context: the step's token(s) follow ctx - 1 cached ones, so its attention covers ctx - 1 + T positions, and the
plans are compiled for exactly that many (max_len; until session 28, ctx + T: one position more, which made
llama-1b's attention splits 320 positions, three key blocks, instead of 256).  A plan variant `max_len=N` times
a plan compiled for another max_len beside it (its own cache, the same weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import time
import traceback
from pathlib import Path

import torch

from graph.compile import CompileOptions, compile_options, compile_step
from graph.lower import StepShape
from megakernel.interpreter import Interpreter
from megakernel.memory import weight_layout
from megakernel.profiler import count_launches, task_trace
from megakernel.runtime import LaunchConfig, Megakernel
from model import Cache, Reference, init_weights, preset
from model.stats import step_bytes


def read_bandwidth(gib: float = 4.0) -> float:
    """Streaming read, bytes/s: a sum over a buffer far larger than L2."""
    x = torch.randn(int(gib * 2**30 / 4), device="cuda")
    for _ in range(3):
        x.sum()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        x.sum()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x
    return x_bytes(gib) / statistics.median(times)


def x_bytes(gib: float) -> float:
    return int(gib * 2**30 / 4) * 4


def time_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def plain_pytorch(cfg, weights, tokens, lens, max_len, cache_data, kinds) -> dict:
    """The static reference step: eager, eager + CUDA graph, torch.compile + CUDA graph."""
    from model.reference.static import StaticStep
    row: dict = {}
    step = StaticStep(cfg, weights, tokens.shape[0], tokens.shape[1], max_len, "cuda")
    step.cache.data.copy_(cache_data)
    if "eager" in kinds:
        row["eager_ms"] = time_ms(lambda: step(tokens, lens), iters=10, warmup=3)
        row["eager_kernels"] = count_launches(lambda: step(tokens, lens), steps=2)["kernels_per_step"]
    for kind in ("graph", "compile"):
        if kind not in kinds:
            continue
        try:
            fn = step.__call__ if kind == "graph" else torch.compile(step.__call__)
            for _ in range(3):  # compile and warm up outside capture
                fn(tokens, lens)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn(tokens, lens)
            row[f"{kind}_ms"] = time_ms(graph.replay, iters=30, warmup=5)
            row[f"{kind}_kernels"] = count_launches(graph.replay, steps=2)["kernels_per_step"]
        except Exception as e:  # report, keep going
            row[f"{kind}_error"] = repr(e)[:300]
    torch._dynamo.reset()  # let the compiled graphs (and the stacked experts they hold) go
    return row


def launch_config(spec: str) -> LaunchConfig:
    """'KEY=V,KEY=V': num_warps / num_stages set the launch, other keys override block_sizes()."""
    launch, blocks = {}, {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if not value:
            raise ValueError(f"variant {spec!r}: {item!r} is not KEY=VALUE")
        if key in ("num_warps", "num_stages"):
            launch[key] = int(value)
        else:
            blocks[key] = value if key == "DOT_PREC" else int(value)  # DOT_PREC names a policy: bf16x2, bf16
    return LaunchConfig(**launch, blocks=blocks)  # which checks the launch's values


def step_max_len(ctx: int, T: int) -> int:
    """The positions a step after ctx - 1 cached tokens attends to: what its plans are compiled for."""
    return ctx - 1 + T


def pop_max_len(spec: str, max_len: int) -> tuple[str, int]:
    """(spec without its max_len=N item, N or the given max_len): a plan variant's cache positions."""
    items = [item for item in spec.split(",") if item]
    for item in [i for i in items if i.startswith("max_len=")]:
        items.remove(item)
        max_len = int(item.partition("=")[2])
    return ",".join(items), max_len


def variant_plan(cfg, T: int, max_len: int, workers: int, spec: str):
    """(plan, launch config) of a plan variant: compile options (compile_options' keys), with the launch's
    (num_warps, num_stages, block sizes: upper-case keys) for that plan, e.g. workers=264,num_warps=4,KC=1024:
    two workers per SM; max_len=N compiles it for N cache positions instead."""
    spec, max_len = pop_max_len(spec, max_len)
    items = [item for item in spec.split(",") if item]
    launch = [item for item in items if item.partition("=")[0] in ("num_warps", "num_stages")
              or item.partition("=")[0].isupper()]
    opts, split = compile_options(",".join(i for i in items if i not in launch), workers)
    vplan = compile_step(cfg, StepShape(T=T, B=1, max_len=max_len, attn_split=split), opts)
    return vplan, launch_config(",".join(launch))


def _precompile_job(job) -> str:
    """One kernel of a run into Triton's cache (a process of its own: Triton compiles holding the GIL)."""
    name, T, ctx, workers, plan_spec, launch_spec, profile = job
    from megakernel.launch import precompile
    t0 = time.perf_counter()
    plan, config = variant_plan(preset(name), T, step_max_len(ctx, T), workers, plan_spec)
    if launch_spec:  # a launch variant of the default plan
        config = launch_config(launch_spec)
    config.profile = profile
    k = precompile(plan, torch.bfloat16, config)
    k._init_handles()  # loads it: registers and spills are known from then on
    return (f"{name} T={T} plan {plan_spec or 'default'} launch {launch_spec or 'default'}"
            f"{' profile' if profile else ''}: {k.n_regs} registers, {k.n_spills} spills, "
            f"{time.perf_counter() - t0:.0f} s")


def precompile_run(args, workers: int) -> None:
    """Every kernel the run will launch, compiled side by side in --jobs processes before it starts (each
    distinct set of constants is a ~30-60 s compile; the timed run then finds them in Triton's cache)."""
    import concurrent.futures
    import multiprocessing
    jobs = []
    for name in args.models:
        for T in args.T:
            jobs += [(name, T, args.ctx, workers, "", "", False)]
            jobs += [(name, T, args.ctx, workers, "", spec, False) for spec in args.variants]
            jobs += [(name, T, args.ctx, workers, spec, "", False) for spec in args.plan_variants]
            if args.profile_variants:
                jobs += [(name, T, args.ctx, workers, spec, "", True) for spec in args.plan_variants]
            if args.profile:
                jobs.append((name, T, args.ctx, workers, "", "", True))
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_precompile_job, job): job for job in jobs}
        for done in concurrent.futures.as_completed(futures):
            try:
                print("precompiled " + done.result(), flush=True)
            except Exception as e:  # the run compiles it itself then, and reports what fails
                print(f"precompile {futures[done]} failed: {e!r}"[:400], flush=True)
    print(f"precompiled {len(jobs)} kernels in {time.perf_counter() - t0:.0f} s ({args.jobs} processes)", flush=True)


def bench_model(name: str, T: int, ctx: int, bw: float, workers: int, out: Path, profile: bool | str,
                variants=(), baselines=("eager", "graph", "compile"), plan_variants=(), save=None) -> dict:
    """One model and T: floors, baselines, the megakernel, then its variants.  save(row), if given, is called
    whenever the row gains a measurement, so that a run cut by its time limit keeps what it measured."""
    save = save or (lambda row: None)
    cfg = preset(name)
    row: dict = {"model": name, "T": T, "ctx": ctx}
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    weights = init_weights(cfg, seed=0, device="cuda", dtype=dtype)
    row["init_s"] = round(time.perf_counter() - t0, 1)
    max_len = step_max_len(ctx, T)
    t0 = time.perf_counter()
    plan = compile_step(cfg, StepShape(T=T, B=1, max_len=max_len), CompileOptions(workers=workers))
    row["compile_s"] = round(time.perf_counter() - t0, 1)
    row["tasks"] = plan.num_tasks
    row["est_ms"] = plan.estimate["critical_path_ms"]
    bytes_needed = step_bytes(cfg, T, 1, ctx).total
    row["floor_ms"] = bytes_needed / bw * 1e3
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (1, T), device="cuda", generator=gen)
    lens = torch.tensor([ctx - 1], device="cuda")

    ref = Reference(cfg, weights)
    cache = Cache.allocate(cfg, 1, max_len, dtype, "cuda")
    cache.data.normal_(generator=gen)
    if baselines:
        row.update(plain_pytorch(cfg, weights, tokens, lens, max_len, cache.data, baselines))

    # megakernel
    t0 = time.perf_counter()
    mk = Megakernel(plan, weights, "cuda", dtype)
    mk.cache().copy_(cache.data)
    mk.capture()
    row["jit_capture_s"] = round(time.perf_counter() - t0, 1)
    row["registers"] = mk.compiled.n_regs
    row["spills"] = mk.compiled.n_spills
    first = mk.step(tokens, lens)
    ref_out = ref.step(tokens, cache, lens)
    del ref  # it holds the weights' tensors too: weights_with_room_for may need to let them go
    row["rel_err_vs_reference"] = rel_err(first.logits, ref_out.logits)
    row["token_vs_reference"] = bool(torch.equal(first.tokens, ref_out.logits.argmax(-1)))

    row["megakernel_ms"] = time_ms(mk.replay, iters=50, warmup=10)
    torch.cuda.synchronize()
    mk.check_error()
    row.update(count_launches(mk.replay, steps=5))
    row["x_floor"] = row["megakernel_ms"] / row["floor_ms"]
    row["achieved_TBps"] = bytes_needed / (row["megakernel_ms"] / 1e3) / 1e12

    # the plan interpreter on the same step (same cache contents), for the bf16 tolerance check
    interp = Interpreter(plan, None, "cuda", share=mk.mem)
    interp.cache().copy_(cache.data)
    mk_cache = mk.cache().clone()
    got = interp.step(tokens, lens)
    mk.cache().copy_(mk_cache)
    again = mk.step(tokens, lens)
    row["rel_err_vs_interpreter"] = rel_err(again.logits, got.logits)
    row["run_to_run_bitexact"] = bool(torch.equal(again.logits, first.logits))
    # as soon as it is known (a run cut short by its time limit keeps it in the log)
    print(f"{name} T={T}: megakernel {row['megakernel_ms']:.3f} ms ({row['x_floor']:.2f}x floor "
          f"{row['floor_ms']:.3f} ms), rel. error vs interpreter {row['rel_err_vs_interpreter']:.1e}, "
          f"bit-exact run to run {row['run_to_run_bitexact']}", flush=True)
    save(row)

    def time_variant(row_key: str, spec: str, build) -> None:
        """Time the megakernel build() returns (sharing weights and cache) against the main one."""
        v = {row_key: spec}
        try:
            vk = build()
            vk.capture()
            out_v = vk.step(tokens, lens)
            v.update(tasks=vk.plan.num_tasks, ms=time_ms(vk.replay, iters=50, warmup=10),
                     regs=vk.compiled.n_regs, spills=vk.compiled.n_spills,
                     rel_err_vs_main=rel_err(out_v.logits, first.logits),
                     launches_per_step=count_launches(vk.replay, steps=3)["launches_per_step"])
            if profile == "variants":
                # its trace beside the main plan's (a launch variant's: the same plan, its blocks)
                pk = Megakernel(vk.plan, None, "cuda", share=vk.mem,
                                config=dataclasses.replace(vk.config, profile=True))
                v["profiled_step_us"] = profiled(pk, f"trace_{name}_T{T}_{re.sub('[^A-Za-z0-9]+', '_', spec)}.json")
                del pk
            del vk
        except Exception as e:
            v["error"] = repr(e)[:300]
        row.setdefault(row_key + "s", []).append(v)
        save(row)
        print(f"{name} T={T}: {row_key} {spec}: " + (f"{v['ms']:.3f} ms" if "ms" in v else v["error"][:80]), flush=True)

    def profiled(pk, file: str, into: dict | None = None) -> float:
        """A profiled step's trace (the second step: the first loads what the kernel reads) into out / file;
        the per-op table's heaviest ops into `into`; the profiled step's time."""
        pk.step(tokens, lens)
        pk.step(tokens, lens)
        table = task_trace(pk, out / file)
        if into is not None:
            ops = sorted(table["ops"].items(), key=lambda kv: -kv[1]["busy_us"])
            into["top_ops"] = [(k, v["tasks"], round(v["busy_us"], 1), round(v["wait_us"], 1)) for k, v in ops[:12]]
        return table["step_us"]

    def weights_with_room_for(vplan) -> dict:
        """The weights to pack vplan's own arena from: moved to host memory first where the device lacks
        room for a second arena beside them (dsv2-lite on an 80 GB H100: weights 31 GB, arena 31, another 29);
        packing copies each from the host."""
        arena = vplan.buffers["W"] * dtype.itemsize
        torch.cuda.empty_cache()  # what an earlier variant freed counts as room
        if torch.cuda.mem_get_info()[0] < arena * 1.1 + (1 << 30) and weights["model.embed_tokens.weight"].is_cuda:
            for key, w in weights.items():
                weights[key] = w.cpu()
            torch.cuda.empty_cache()
        return weights

    def plan_variant(spec: str):
        vplan, config = variant_plan(cfg, T, max_len, workers, spec)
        same_cache = vplan.shape["max_len"] == max_len
        if weight_layout(vplan) == weight_layout(plan) and same_cache:
            return Megakernel(vplan, None, "cuda", share=mk.mem, config=config)
        # another choice of the rules that derive weights (norm_into_linear=0), or stream_kernel's row-aligned
        # matrices, packs its own arena; another max_len its own cache, the same rows where both have them
        vk = Megakernel(vplan, weights_with_room_for(vplan), "cuda", dtype, config=config)
        rows = min(max_len, vplan.shape["max_len"])
        vk.cache()[..., :rows, :].copy_(cache.data[..., :rows, :])
        return vk

    if profile:  # the main plan's trace before any variant's
        pk = Megakernel(plan, None, "cuda", share=mk.mem, config=LaunchConfig(profile=True))
        row["profiled_step_us"] = profiled(pk, f"trace_{name}_T{T}.json", row)
        del pk
        save(row)
    row["variants"], row["plan_variants"] = [], []
    for spec in variants:  # launch options of the same plan
        time_variant("variant", spec, lambda: Megakernel(plan, None, "cuda", share=mk.mem, config=launch_config(spec)))
    for spec in plan_variants:  # other compile options, same weights and cache
        time_variant("plan_variant", spec, lambda: plan_variant(spec))
    if variants or plan_variants:  # the default again after its variants (A, B.., A): drift shows as a difference
        row["megakernel_ms_again"] = time_ms(mk.replay, iters=50, warmup=10)
        save(row)
        print(f"{name} T={T}: megakernel again {row['megakernel_ms_again']:.3f} ms", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", nargs="*", default=["llama-1b", "dsv2-lite"])
    p.add_argument("--T", nargs="*", type=int, default=[1])
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--workers", type=int, default=0, help="default: the GPU's SM count")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-variants", action="store_true",
                   help="with --profile: a trace of each launch and plan variant too (tools/replay.py --layer N "
                        "reads it)")
    p.add_argument("--baselines", nargs="*", default=["eager", "graph", "compile"],
                   choices=["eager", "graph", "compile"], help="plain-PyTorch baselines to time (default: all)")
    p.add_argument("--variants", nargs="*", default=[], metavar="KEY=V,...",
                   help="also time these launch variants, e.g. TB=4 KC=1024,BR=16 num_warps=4")
    p.add_argument("--plan-variants", nargs="*", default=[], metavar="KEY=V,...",
                   help="also time plans compiled with these options, e.g. spread=0,attn_split=320 "
                        "(session 1's tiling)")
    p.add_argument("--jobs", type=int, default=0,
                   help="compile the run's kernels first in this many processes (0: each as the run reaches it)")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    workers = args.workers or props.multi_processor_count
    if args.jobs:
        precompile_run(args, workers)
    bw = read_bandwidth()
    result = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
              "read_TBps": bw / 1e12, "rows": []}
    print(f"{props.name}: streaming read {bw / 1e12:.2f} TB/s", flush=True)
    for name in args.models:
        for T in args.T:
            def save(row: dict) -> None:  # bench.json with the rows so far and this one as it stands
                (out / "bench.json").write_text(json.dumps({**result, "rows": result["rows"] + [row]}, indent=2))
            try:
                profile = "variants" if args.profile and args.profile_variants else args.profile
                row = bench_model(name, T, args.ctx, bw, workers, out, profile, args.variants, args.baselines,
                                  args.plan_variants, save)
            except Exception as e:  # keep going: one failure should not hide the other rows
                traceback.print_exc()
                row = {"model": name, "T": T, "error": repr(e)}
            result["rows"].append(row)
            torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            (out / "bench.json").write_text(json.dumps(result, indent=2))
    print(f"\n{'model':<11}{'T':>3}{'floor ms':>10}{'eager':>9}{'graph':>9}{'compile':>9}{'mk ms':>9}"
          f"{'x floor':>9}{'vs compile':>11}{'TB/s':>7}{'launch':>8}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['model']:<11}{r['T']:>3}  error: {r['error'][:80]}")
            continue
        def ms(key):
            return f"{r[key]:>9.3f}" if key in r else f"{'-':>9}"
        speedup = f"{r['compile_ms'] / r['megakernel_ms']:>10.2f}x" if "compile_ms" in r else f"{'-':>11}"
        print(f"{r['model']:<11}{r['T']:>3}{r['floor_ms']:>10.3f}{ms('eager_ms')}{ms('graph_ms')}{ms('compile_ms')}"
              f"{r['megakernel_ms']:>9.3f}{r['x_floor']:>9.2f}{speedup}{r['achieved_TBps']:>7.2f}"
              f"{r['launches_per_step']:>8.1f}")
        kernels = {k: r[k] for k in ("eager_kernels", "graph_kernels", "compile_kernels") if k in r}
        if kernels:
            print(f"{'':<14}kernels per step: {kernels}, megakernel {r['kernels_per_step']:.0f}")
        for v in r.get("plan_variants", []):
            print(f"{'':<14}plan {v['plan_variant']}: "
                  + (f"{v['ms']:.3f} ms, {v['tasks']} tasks" if "ms" in v else v["error"][:60]))
        for v in r.get("variants", []):
            print(f"{'':<14}variant {v['variant']}: "
                  + (f"{v['ms']:.3f} ms, {v['regs']} regs, {v['spills']} spills, {v['launches_per_step']:.1f} launches"
                     if "ms" in v else v["error"][:60]))


if __name__ == "__main__":
    main()
