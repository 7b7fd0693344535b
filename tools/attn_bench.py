"""ATTENTION's tasks alone on the GPU: what one layer's splits take outside the persistent kernel.

    python tools/attn_bench.py [--model llama-1b] [--ctx 4096] [--reps 100] [--out DIR] [VARIANT ...]
    ncu --section SourceCounters -k regex:attention_tasks --launch-skip 40 --launch-count 1 -o R \
        python tools/attn_bench.py --reps 2 --only VARIANT --cubin R.cubin    # then tools/ncu_lines.py

In a step's trace llama-1b's 104 GQA splits take ~9.5 us each for 82 KB of cache (session 21): ~9 GB/s
an SM, a third of what a LINEAR task streams.  This runs the same task words (the plan's, one program a
task, one layer a launch) through the same body, ops/attention.body, with nothing else on the GPU, so a
variant of the body is measured in seconds of device time, not a whole bench.  Each launch reads another
layer's cache (16 layers, 134 MB: past the L2) unless a variant says `warm=1`.

A VARIANT is KEY=V,...: the body's block sizes BJ, BM, STAGES, EF (evict-first cache loads), `warps`,
`prec1=1` (one bf16 MMA a product, not the fp32 operand's two halves), `qix=0..3` (the body's QIX, default the
plan's launch default: the query rows' token and head without integer division, the cache length requested after
the query rows, both), `keys=N` (each split cut to its first N positions: the time against N is a block's cost
and the fixed cost), `tasks=N` (only the layer's first N splits: N=1 is one split's latency with the memory to
itself), `warm=1`, `loads=1` (the same cache
rows loaded and summed, no arithmetic: what the access pattern costs), with `headmajor=1` from a
head-major layout of the same size instead.  `--plan KEY=V,...` compiles the plan with those options
(graph.compile.compile_options: e.g. attn_split=256, fusion_rules=...).  Per
variant: the time a launch takes in a CUDA graph of back-to-back launches; from per-program %globaltimer
stamps, the median program's time and the span from the first start to the last end; and where the
variant wrote the plan's partial rows for all of the layer's splits, its values there against the
default body's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph.compile import compile_options, compile_step  # noqa: E402
from graph.isa import WORDS, Buf, decode  # noqa: E402
from graph.lower import StepShape  # noqa: E402
from megakernel.memory import Memory  # noqa: E402
from megakernel.ops import attention  # noqa: E402
from megakernel.ops.common import now_ns  # noqa: E402
from megakernel.ops.fields import ATTENTION_SPLIT_LEN  # noqa: E402
from megakernel.launch import launch_blocks, LaunchConfig  # noqa: E402
from model import init_weights, preset  # noqa: E402
from tools.bench import step_max_len  # noqa: E402


@triton.jit
def attention_tasks(words, idx, A, I, C, stamps, BM: tl.constexpr, BJ: tl.constexpr, DMAX: tl.constexpr,
                    RMAX: tl.constexpr, STAGES: tl.constexpr, ALIGN: tl.constexpr, DOT_PREC: tl.constexpr,
                    KIND: tl.constexpr, EF: tl.constexpr, WORDS: tl.constexpr, ROPE: tl.constexpr, QIX: tl.constexpr):
    p = tl.program_id(0)
    word = words + tl.load(idx + p).to(tl.int64) * WORDS
    t0 = now_ns(True)
    attention.body(word, A, I, C, BM, BJ, DMAX, RMAX, STAGES, ALIGN, DOT_PREC, KIND, EF, ROPE, QIX)
    tl.debug_barrier()
    tl.store(stamps + 2 * p, t0)
    tl.store(stamps + 2 * p + 1, now_ns(True))


@triton.jit
def cache_loads(words, idx, A, I, C, out, stamps, BJ: tl.constexpr, DMAX: tl.constexpr, ALIGN: tl.constexpr,
                EF: tl.constexpr, WORDS: tl.constexpr, HEAD_MAJOR: tl.constexpr):
    """A GQA split's key and value rows loaded as the body loads them (attention.kv_block), summed.
    HEAD_MAJOR: as if the layer's cache were [kv head][position][keys | values] (a split's rows one
    contiguous run) instead of [position][kv heads' keys | kv heads' values]: same bytes, other addresses."""
    p = tl.program_id(0)
    word = words + tl.load(idx + p).to(tl.int64) * WORDS
    t0 = now_ns(True)
    (T, S, b, width, h0, h1, nh, ns, split, dim, scale, rope_dim, q_ptr, q_ld, q_hs, q_col0, pe_ptr, pe_ld, pe_hs,
     pe_col0, cache, limit, op_ptr, lse_ptr, k_col, v_col, j0, j1) = attention.split_of(word, A, I, C, False, ALIGN)
    if HEAD_MAJOR:
        cache += (k_col // dim) * S * 2 * dim
        width = 2 * dim
        k_col = 0
        v_col = dim
    d = tl.arange(0, DMAX)
    dmask = d < dim
    total = tl.zeros((BJ, DMAX), tl.float32)
    for jb in range(j0, j1, BJ):
        keys, kpe, values = attention.kv_block(cache, width, jb, j1, k_col, v_col, dim, d, dmask, d, dmask, False,
                                               BJ, 2, EF)
        total += keys.to(tl.float32) + values.to(tl.float32)
    tl.store(out + p, tl.sum(tl.sum(total, axis=1), axis=0))
    tl.debug_barrier()
    tl.store(stamps + 2 * p, t0)
    tl.store(stamps + 2 * p + 1, now_ns(True))


VARIANT_KEYS = ("BJ", "BM", "STAGES", "EF", "warps", "tasks", "warm", "loads", "headmajor", "keys", "prec1", "qix")


def parse_variant(spec: str) -> dict:
    v = {}
    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        if key not in VARIANT_KEYS:
            raise SystemExit(f"variant {spec!r}: unknown key {key!r}")
        v[key] = int(val)
    return v


def layer_tasks(plan) -> list[list[int]]:
    """Each layer's ATTENTION task indices, in plan order (labels L<n>.attn)."""
    layers: dict[int, list[int]] = {}
    for i, label in enumerate(plan.task_labels):
        if label.split("[")[0].endswith(".attn") and decode(plan.words[i]).op.name == "ATTENTION":
            layers.setdefault(int(label.split(".")[0][1:]), []).append(i)
    return [layers[k] for k in sorted(layers)]


def run_variant(spec, v, blocks, words, layers, mem, reps, reference: list, cubin: str = "") -> dict:
    """reference: [where the default body wrote in the activations running layer 0, what it wrote], filled
    by the first call; a body variant's values there are compared with it."""
    bj, bm = v.get("BJ", blocks["BJ"]), v.get("BM", blocks["BM"])
    stages, ef, warps = v.get("STAGES", blocks["STAGES"]), v.get("EF", blocks["EF"]), v.get("warps", 8)
    n = v.get("tasks", len(layers[0]))
    order = [layers[0]] * len(layers) if v.get("warm") else layers  # warm: one layer's cache again and again
    idx = [torch.tensor(ids[:n], dtype=torch.int32, device="cuda") for ids in order]
    if "keys" in v:  # the splits' words with split_len N (split s then starts at s·N)
        words = words.clone()
        words[torch.cat(idx).long(), ATTENTION_SPLIT_LEN.value] = v["keys"]
    stamps = torch.zeros(2 * n, dtype=torch.int64, device="cuda")
    out = torch.zeros(n, dtype=torch.float32, device="cuda")
    A, I, C = mem.bufs[Buf.A], mem.bufs[Buf.I], mem.bufs[Buf.C]

    def launch(i):
        if v.get("loads"):
            return cache_loads[(n,)](words, i, A, I, C, out, stamps, BJ=bj, DMAX=blocks["DMAX"], ALIGN=blocks["ALIGN"],
                                     EF=ef, WORDS=WORDS, HEAD_MAJOR=v.get("headmajor", 0), num_warps=warps)
        else:
            return attention_tasks[(n,)](words, i, A, I, C, stamps, BM=bm, BJ=bj, DMAX=blocks["DMAX"],
                                         RMAX=blocks["RMAX"], STAGES=stages, ALIGN=blocks["ALIGN"],
                                         DOT_PREC="bf16" if v.get("prec1") else blocks["DOT_PREC"],
                                         KIND=blocks["ATT_KIND"], EF=ef, WORDS=WORDS, ROPE=blocks["ATT_ROPE"],
                                         QIX=v.get("qix", blocks["QIX"]), num_warps=warps)

    before = A.clone()
    kernel = launch(idx[0])
    if cubin:  # for tools/ncu_lines.py
        Path(cubin).write_bytes(kernel.asm["cubin"])
    torch.cuda.synchronize()
    rel = None
    if not v.get("loads") and n == len(layers[0]) and "keys" not in v:
        if not reference:  # what the default wrote: the layer's partial outputs and log-sum-exps
            written = A != before
            reference += [written, A[written].clone()]
        got = A[reference[0]]
        rel = float((got - reference[1]).abs().max() / reference[1].abs().max())
    for i in idx:  # compile, warm up
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in idx:
            launch(i)
    times, per_prog, spans = [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(idx))
        s = stamps.view(n, 2).cpu()  # the last launch of the replay
        per_prog.append(float((s[:, 1] - s[:, 0]).double().median()) / 1e3)
        spans.append(float(s[:, 1].max() - s[:, 0].min()) / 1e3)
    return dict(variant=spec or "default", launch_us=statistics.median(times), program_us=statistics.median(per_prog),
                span_us=statistics.median(spans), rel_err_vs_default=rel, tasks=n, BJ=bj, BM=bm, STAGES=stages,
                warps=warps)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="*", default=[])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--out", default=".")
    p.add_argument("--plan", default="", metavar="KEY=V,...", help="compile options of the plan (e.g. attn_split=256)")
    p.add_argument("--only", default=None, metavar="VARIANT",
                   help="run this variant alone (no default beside it), e.g. under ncu")
    p.add_argument("--cubin", default="", help="write the (last) variant's kernel here, for tools/ncu_lines.py")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tools/attn_bench.py times kernels on a CUDA GPU; this machine has none "
                         "(tools/sass_probe.py attention counts the body's instructions offline)")
    cfg = preset(args.model)
    workers = torch.cuda.get_device_properties(0).multi_processor_count
    opts, split = compile_options(args.plan, workers)
    plan = compile_step(cfg, StepShape(T=1, B=1, max_len=step_max_len(args.ctx, 1), attn_split=split), opts)
    mem = Memory(plan, init_weights(cfg, seed=0, device="cuda", dtype=torch.bfloat16), "cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    mem.bufs[Buf.A].normal_(generator=gen)  # the activations: q rows among them (never zeros, never NaN)
    mem.bufs[Buf.C].normal_(generator=gen)  # the cache
    mem.io_view("in.cache_lens").fill_(args.ctx - 1)
    words = torch.from_numpy(plan.words.copy()).cuda()
    tasks = [decode(w) for w in plan.words]
    blocks = launch_blocks(tasks, torch.bfloat16, LaunchConfig(), plan)
    layers = layer_tasks(plan)
    t0 = tasks[layers[0][0]]
    split_bytes = 2 * t0["split_len"] * t0["dim"] * 2  # keys and values, bf16
    rows, reference = [], []
    for spec in [args.only] if args.only is not None else [""] + args.variants:
        row = run_variant(spec, parse_variant(spec), blocks, words, layers, mem, args.reps, reference, args.cubin)
        row["GBps_per_program"] = split_bytes / (row["program_us"] * 1e3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"attn_bench_{args.model}.json").write_text(json.dumps(dict(model=args.model, ctx=args.ctx, plan=args.plan,
                                                                       rows=rows,
                                                                       split_bytes=split_bytes), indent=1))
    print(f"\n{args.model} {args.plan or 'default plan'}: {len(layers)} layers x {len(layers[0])} splits of "
          f"{split_bytes // 1024} KB (BJ {blocks['BJ']}, BM {blocks['BM']}, STAGES {blocks['STAGES']})")
    print(f"{'variant':34} {'tasks':>5} {'launch us':>9} {'program us':>10} {'span us':>8} {'GB/s/prog':>9} "
          f"{'rel err':>8}")
    for r in rows:
        err = "-" if r["rel_err_vs_default"] is None else f"{r['rel_err_vs_default']:.1e}"
        print(f"{r['variant']:34} {r['tasks']:5d} {r['launch_us']:9.2f} {r['program_us']:10.2f} {r['span_us']:8.2f} "
              f"{r['GBps_per_program']:9.1f} {err:>8}")


if __name__ == "__main__":
    main()
