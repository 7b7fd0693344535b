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
`prec1=1` (one bf16 MMA a product, not the fp32 operand's two halves), `keys=N` (each split cut to its
first N positions: the time against N is a block's cost and the fixed cost), `tasks=N` (only the layer's
first N splits: N=1 is one split's latency with the memory to itself), `warm=1`, `loads=1` (the same cache
rows loaded and summed, no arithmetic: what the access pattern costs), with `headmajor=1` from a
head-major layout of the same size instead; `KW=N` the prototype warp_splits (8 sub-splits of N positions
a round, a warp each), with `merge=1` merged in the CTA, else left as partials.  Per variant: the time a
launch takes in a CUDA graph of back-to-back launches; from per-program %globaltimer stamps, the median
program's time and the span from the first start to the last end; and where the variant wrote the plan's
partial rows for all of the layer's splits, its values there against the default body's.
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

from graph.compile import CompileOptions, compile_step  # noqa: E402
from graph.isa import WORDS, Buf, decode  # noqa: E402
from graph.lower import StepShape  # noqa: E402
from megakernel.memory import Memory  # noqa: E402
from megakernel.ops import attention  # noqa: E402
from megakernel.ops.common import mma, now_ns  # noqa: E402
from megakernel.ops.fields import ATTENTION_SPLIT_LEN  # noqa: E402
from megakernel.runtime import launch_blocks, LaunchConfig  # noqa: E402
from model import init_weights, preset  # noqa: E402


@triton.jit
def attention_tasks(words, idx, A, I, C, stamps, BM: tl.constexpr, BJ: tl.constexpr, DMAX: tl.constexpr,
                    RMAX: tl.constexpr, STAGES: tl.constexpr, ALIGN: tl.constexpr, DOT_PREC: tl.constexpr,
                    KIND: tl.constexpr, EF: tl.constexpr, WORDS: tl.constexpr, ROPE: tl.constexpr):
    p = tl.program_id(0)
    word = words + tl.load(idx + p).to(tl.int64) * WORDS
    t0 = now_ns(True)
    attention.body(word, A, I, C, BM, BJ, DMAX, RMAX, STAGES, ALIGN, DOT_PREC, KIND, EF, ROPE)
    tl.debug_barrier()
    tl.store(stamps + 2 * p, t0)
    tl.store(stamps + 2 * p + 1, now_ns(True))


@triton.jit
def by_warp(x, WS: tl.constexpr, KW: tl.constexpr, DMAX: tl.constexpr):
    """Rows r = (k // 4)·4·WS + 4·w + k % 4 of x ([WS·KW] or [WS·KW, DMAX]) as [WS, KW(, DMAX)] at [w, k]: the rows
    Triton's layout of a [WS·KW, DMAX] load gives warp w (4 rows a warp, the warps round-robin)."""
    if DMAX == 0:
        return tl.reshape(tl.permute(tl.reshape(x, (KW // 4, WS, 4)), (1, 0, 2)), (WS, KW))
    else:
        return tl.reshape(tl.permute(tl.reshape(x, (KW // 4, WS, 4, DMAX)), (1, 0, 2, 3)), (WS, KW, DMAX))


@triton.jit
def warp_splits(words, idx, A, I, C, scratch, stamps, BM: tl.constexpr, KW: tl.constexpr, WS: tl.constexpr,
                DMAX: tl.constexpr, ALIGN: tl.constexpr, DOT_PREC: tl.constexpr, WORDS: tl.constexpr,
                MERGE: tl.constexpr):
    """A prototype, not the engine's body: a GQA split as WS sub-splits side by side, a warp each (a 3-D dot
    puts the batch on the warps), each with its own running max, sum and output, so a key block's reductions
    stay inside a warp.  MERGE 1: the sub-splits merged in the CTA (Triton's cross-warp reduction) into the
    plan's partial rows; 0: each left as a partial of its own in `scratch`, for a combine to merge (what
    that would save the split)."""
    p = tl.program_id(0)
    word = words + tl.load(idx + p).to(tl.int64) * WORDS
    t0 = now_ns(True)
    (T, S, b, width, h0, h1, nh, ns, split, dim, scale, rope_dim, q_ptr, q_ld, q_hs, q_col0, pe_ptr, pe_ld, pe_hs,
     pe_col0, cache, limit, op_ptr, lse_ptr, k_col, v_col, j0, j1) = attention.split_of(word, A, I, C, False, ALIGN)
    heads = h1 - h0
    d = tl.arange(0, DMAX)
    dmask = d < dim
    r = tl.arange(0, WS * KW)
    for mb in range(0, T * heads, BM):
        rr = mb + tl.arange(0, BM)
        rvalid = rr < T * heads
        t = rr // heads
        h = h0 + rr % heads
        q = tl.load(q_ptr + (b * T + t)[:, None] * q_ld + h[:, None] * q_hs + q_col0 + d[None, :],
                    mask=rvalid[:, None] & dmask[None, :], other=0.0, cache_modifier=".cg")
        qs = tl.broadcast_to(q[None, :, :], (WS, BM, DMAX))
        m_i = tl.full((WS, BM), float("-inf"), tl.float32)
        l_i = tl.zeros((WS, BM), tl.float32)
        acc = tl.zeros((WS, BM, DMAX), tl.float32)
        for jb in range(j0, j1, WS * KW):
            rows = cache + (jb + r)[:, None].to(tl.int64) * width + d[None, :]
            kmask = ((jb + r) < j1)[:, None] & dmask[None, :]
            keys = by_warp(tl.load(rows + k_col, mask=kmask, other=0.0), WS, KW, DMAX)
            values = by_warp(tl.load(rows + v_col, mask=kmask, other=0.0), WS, KW, DMAX)
            js = by_warp(jb + r, WS, KW, 0)
            s = mma(qs, tl.permute(keys, (0, 2, 1)), tl.zeros((WS, BM, KW), tl.float32), DOT_PREC)
            ok = rvalid[None, :, None] & (js < j1)[:, None, :] & (js[:, None, :] <= (limit + t)[None, :, None])
            s = tl.where(ok, s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=2))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            pr = tl.exp(s - m_safe[:, :, None])
            l_i = l_i * alpha + tl.sum(pr, axis=2)
            acc = mma(pr, values, acc * alpha[:, :, None], DOT_PREC)
            m_i = m_new
        if MERGE:
            m = tl.max(m_i, axis=0)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            w = tl.exp(m_i - m_safe[None, :])
            l = tl.sum(l_i * w, axis=0)
            has_keys = l > 0
            o = tl.sum(acc * w[:, :, None], axis=0) / tl.where(has_keys, l, 1.0)[:, None]
            lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, l, 1.0)), float("-inf"))
            out_rows = ((b * ns + split) * T + t) * nh + h
            tl.store(op_ptr + out_rows[:, None].to(tl.int64) * dim + d[None, :], o,
                     mask=rvalid[:, None] & dmask[None, :])
            tl.store(lse_ptr + out_rows, lse, mask=rvalid)
        else:  # [WS, BM] maxima and sums, then [WS, BM, DMAX] outputs, per program and row block
            base = scratch + (p * T * heads + mb).to(tl.int64) * WS * (DMAX + 2)
            sub = tl.arange(0, WS)[:, None] * BM + tl.arange(0, BM)[None, :]
            ok2 = rvalid[None, :] & (tl.arange(0, WS) < WS)[:, None]
            tl.store(base + sub, m_i, mask=ok2)
            tl.store(base + WS * BM + sub, l_i, mask=ok2)
            tl.store(base + 2 * WS * BM + sub[:, :, None] * DMAX + d[None, None, :], acc,
                     mask=ok2[:, :, None] & dmask[None, None, :])
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


VARIANT_KEYS = ("BJ", "BM", "STAGES", "EF", "warps", "tasks", "warm", "loads", "headmajor", "keys", "prec1", "KW",
                "merge")


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
    scratch = torch.zeros(n * 64 * 8 * (blocks["DMAX"] + 2), dtype=torch.float32, device="cuda")  # warp_splits
    A, I, C = mem.bufs[Buf.A], mem.bufs[Buf.I], mem.bufs[Buf.C]

    def launch(i):
        if v.get("KW"):
            return warp_splits[(n,)](words, i, A, I, C, scratch, stamps, BM=bm, KW=v["KW"], WS=8, DMAX=blocks["DMAX"],
                                     ALIGN=blocks["ALIGN"], DOT_PREC=blocks["DOT_PREC"], WORDS=WORDS,
                                     MERGE=v.get("merge", 0), num_warps=warps)
        if v.get("loads"):
            return cache_loads[(n,)](words, i, A, I, C, out, stamps, BJ=bj, DMAX=blocks["DMAX"], ALIGN=blocks["ALIGN"],
                                     EF=ef, WORDS=WORDS, HEAD_MAJOR=v.get("headmajor", 0), num_warps=warps)
        else:
            return attention_tasks[(n,)](words, i, A, I, C, stamps, BM=bm, BJ=bj, DMAX=blocks["DMAX"],
                                  RMAX=blocks["RMAX"], STAGES=stages, ALIGN=blocks["ALIGN"],
                                  DOT_PREC="tf32" if v.get("prec1") else blocks["DOT_PREC"],
                                  KIND=blocks["ATT_KIND"], EF=ef, WORDS=WORDS, ROPE=blocks["ATT_ROPE"],
                                  num_warps=warps)

    before = A.clone()
    kernel = launch(idx[0])
    if cubin:  # for tools/ncu_lines.py
        Path(cubin).write_bytes(kernel.asm["cubin"])
    torch.cuda.synchronize()
    rel = None
    if not v.get("loads") and not (v.get("KW") and not v.get("merge")) and n == len(layers[0]) and "keys" not in v:
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
    p.add_argument("--only", default=None, metavar="VARIANT",
                   help="run this variant alone (no default beside it), e.g. under ncu")
    p.add_argument("--cubin", default="", help="write the (last) variant's kernel here, for tools/ncu_lines.py")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tools/attn_bench.py times kernels on a CUDA GPU; this machine has none "
                         "(tools/sass_probe.py attention counts the body's instructions offline)")
    cfg = preset(args.model)
    workers = torch.cuda.get_device_properties(0).multi_processor_count
    plan = compile_step(cfg, StepShape(T=1, B=1, max_len=args.ctx + 1), CompileOptions(workers=workers))
    mem = Memory(plan, init_weights(cfg, seed=0, device="cuda", dtype=torch.bfloat16), "cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    mem.bufs[Buf.A].normal_(generator=gen)  # the activations: q rows among them (never zeros, never NaN)
    mem.bufs[Buf.C].normal_(generator=gen)  # the cache
    mem.io_view("in.cache_lens").fill_(args.ctx - 1)
    words = torch.from_numpy(plan.words.copy()).cuda()
    tasks = [decode(w) for w in plan.words]
    blocks = launch_blocks(tasks, torch.bfloat16, LaunchConfig())
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
    (out / f"attn_bench_{args.model}.json").write_text(json.dumps(dict(model=args.model, ctx=args.ctx, rows=rows,
                                                                       split_bytes=split_bytes), indent=1))
    print(f"\n{args.model}: {len(layers)} layers x {len(layers[0])} splits of {split_bytes // 1024} KB "
          f"(BJ {blocks['BJ']}, BM {blocks['BM']}, STAGES {blocks['STAGES']})")
    print(f"{'variant':34} {'tasks':>5} {'launch us':>9} {'program us':>10} {'span us':>8} {'GB/s/prog':>9} "
          f"{'rel err':>8}")
    for r in rows:
        err = "-" if r["rel_err_vs_default"] is None else f"{r['rel_err_vs_default']:.1e}"
        print(f"{r['variant']:34} {r['tasks']:5d} {r['launch_us']:9.2f} {r['program_us']:10.2f} {r['span_us']:8.2f} "
              f"{r['GBps_per_program']:9.1f} {err:>8}")


if __name__ == "__main__":
    main()
