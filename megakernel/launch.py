"""What the persistent kernel is compiled and launched with, decided on the host before anything runs.

- operand checks: every operand in the buffer its role expects (OPERAND_BUFFERS), sizes the bodies may
  assume aligned (ALIGNED_FIELDS, alignment);
- block sizes fitted to a plan's tasks (block_sizes), raised to a shared floor (shared_blocks: one compile
  for many small plans), then a launch config's overrides, each checked (check_block_overrides);
- the kernel's constexprs (kernel_constants), the wait bound, the warps beside a stream kernel, and a compile
  with no buffers (precompile).

runtime.Megakernel uses all of it; tools (sass_probe, attn_bench, bench) use it to compile what a plan would run.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch

from graph.isa import MAX_WAITS, WORDS, Buf, Decoded, decode
from graph.plan import Plan

from .kernel import megakernel
from .memory import STREAM_SLACK

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# the buffer each operand role must live in (the kernel indexes these pointers directly)
OPERAND_BUFFERS = {
    "EMBED": {"tok": Buf.I, "table": Buf.W, "out": Buf.A},
    "RMSNORM": {"x": Buf.A, "d": Buf.A, "xo": Buf.A, "w": Buf.W, "out": Buf.A, "cache": Buf.C, "cl": Buf.I},
    "LINEAR": {"x": Buf.A, "w": Buf.W, "w2": Buf.W, "res": Buf.A, "out": Buf.A, "wd": Buf.W, "y": Buf.A},
    "EWISE": {"a": Buf.A, "b": Buf.A, "out": Buf.A},
    "ROPE_TABLE": {"cl": Buf.I, "f": Buf.WF, "out": Buf.A},
    "ROPE": {"x": Buf.A, "tab": Buf.A, "out": Buf.A, "cache": Buf.C, "cl": Buf.I},
    "CACHE_WRITE": {"src": Buf.A, "cache": Buf.C, "cl": Buf.I},
    "HEAD_MATMUL": {"x": Buf.A, "w": Buf.W, "out": Buf.A},
    "ATTENTION": {"q": Buf.A, "pe": Buf.A, "cache": Buf.C, "cl": Buf.I, "op": Buf.A, "lse": Buf.A},
    "ATTN_COMBINE": {"op": Buf.A, "lse": Buf.A, "out": Buf.A},
    "ROUTE": {"lg": Buf.A, "sc": Buf.A, "bias": Buf.WF, "ids": Buf.I, "wts": Buf.A, "st": Buf.I},
    "EXPERT_LINEAR": {"x": Buf.A, "w": Buf.W, "w2": Buf.W, "out": Buf.A, "st": Buf.I, "map": Buf.I, "wd": Buf.W,
                      "y": Buf.A},
    "MOE_COMBINE": {"y": Buf.A, "wts": Buf.A, "sh": Buf.A, "res": Buf.A, "out": Buf.A},
    "HC_COEFF": {"st": Buf.A, "fn": Buf.WF, "base": Buf.WF, "scale": Buf.WF, "mix": Buf.A, "craw": Buf.A,
                 "coef": Buf.A, "out": Buf.A},
    "HC_EXPAND": {"st": Buf.A, "sub": Buf.A, "coef": Buf.A, "out": Buf.A},
    "HC_HEAD": {"st": Buf.A, "fn": Buf.WF, "base": Buf.WF, "scale": Buf.WF, "out": Buf.A},
    "ARGMAX": {"lg": Buf.A, "pv": Buf.A, "pi": Buf.I, "out": Buf.I},
    "ACCEPT": {**{k: Buf.I for k in ("tok", "tgt", "cl", "follow", "acc", "emit", "next", "base", "lens", "mtp",
                                      "rng")}, "lg": Buf.A},
    "GATHER": {"idx": Buf.I},  # src and out: A, or I with INT (checked below)
    "HELPER_CALL": {"st": Buf.I, "map": Buf.I, "x": Buf.A, "st2": Buf.I, "mail": Buf.I, "box": Buf.H},
    "HELPER_WAIT": {"y": Buf.A, "mail": Buf.I, "box": Buf.H, "out": Buf.A},
    "HELPER_RECV": {"box": Buf.H, "done": Buf.H, "st": Buf.I, "onh": Buf.I, "x": Buf.A, "seqw": Buf.I, "gaveup": Buf.I},
    "HELPER_SEND": {"y": Buf.A, "box": Buf.H, "st": Buf.I, "seqw": Buf.I},
}


class MegakernelError(RuntimeError):
    """A plan, or launch options, the kernel must not run (named: which task, operand, block size or limit)."""


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(1, n)))))


def check_operand_buffers(plan: Plan, tasks: list[Decoded]) -> None:
    for i, t in enumerate(tasks):
        if t.op.name in ("LINEAR", "EXPERT_LINEAR") and t["r1"] <= t["r0"]:
            raise MegakernelError(f"task {i} ({plan.task_labels[i]}): rows {t['r0']}..{t['r1']} are empty; the weight "
                                  "stream reads its first chunk before it knows (row r1 - 1 would be read)")
        if t.op.name == "ROUTE" and t["E"] > 64 and t["topk"] > 16:
            raise MegakernelError(f"task {i}: {t['topk']} of {t['E']} experts per token; with more than 64 experts "
                                  "the ROUTE body picks at most 16")
        if t.op.name == "ROUTE" and t.has("TOPK") and t.fields["ids.buf"] < 0:
            raise MegakernelError(f"task {i} ({plan.task_labels[i]}): ROUTE has no ids buffer; its body stores the "
                                  "top-k ids (and its slot-table stage reads them back) in memory")
        if t.op.name == "ATTENTION" and not t.has("MLA"):
            if t["h0"] // t["group"] != (t["h1"] - 1) // t["group"]:
                raise MegakernelError(f"task {i} ({plan.task_labels[i]}): query heads {t['h0']}..{t['h1'] - 1} span "
                                      f"KV groups of {t['group']}; the GQA body reads one KV head a task "
                                      "(graph/tiling.py)")
            if t.has("ROPE") and (t["h0"] % t["group"] or t["h1"] - t["h0"] != t["group"]):
                raise MegakernelError(f"task {i} ({plan.task_labels[i]}): ATTENTION[ROPE] over query heads "
                                      f"{t['h0']}..{t['h1'] - 1}, not one whole KV group of {t['group']}: another task "
                                      "of the group would write the same new rows")
        roles = dict(OPERAND_BUFFERS[t.op.name])
        if t.op.name == "GATHER":
            roles.update(src=Buf.I if t.has("INT") else Buf.A, out=Buf.I if t.has("INT") else Buf.A)
        for role, buf in roles.items():
            have = t.fields[role + ".buf"]
            if have >= 0 and have != buf:
                raise MegakernelError(f"task {i} ({plan.task_labels[i]}): operand {role} is in buffer "
                                      f"{Buf(have).name}, the kernel reads it from {buf.name}")


# fields whose values the kernel may assume are multiples of ALIGN (vector loads need it)
ALIGNED_FIELDS = {
    "LINEAR": ("K", "w.off", "w2.off", "x.off", "x.ld", "wd.off"),
    "EXPERT_LINEAR": ("K", "w.off", "w2.off", "w_es", "x.off", "x.ld", "wd.off"),
    "HEAD_MATMUL": ("w.off", "w_hs", "w_ld", "x.ld", "x_hs", "x_col0", "x.off", "o0"),
    "ATTENTION": ("width", "cache.off", "dim", "q.off", "q.ld", "q_hs", "q_col0", "kv_hs", "v_col0", "rope_dim",
                  "pe.off", "pe.ld", "pe_hs", "pe_col0", "op.off"),
    "ATTN_COMBINE": ("dim", "op.off", "out.off", "out.ld", "c0", "c1"),
}


def alignment(tasks: list[Decoded]) -> int:
    """The largest power of two (<= 8 elements) dividing every ALIGNED_FIELDS value of the plan."""
    g = 0
    for t in tasks:
        for name in ALIGNED_FIELDS.get(t.op.name, ()):
            key = name.split(".")[0]
            if "." in name and t.fields.get(key + ".buf", 0) < 0:
                continue
            g = math.gcd(g, int(t.fields[name]))
    align = 1
    while align < 8 and g % (2 * align) == 0:
        align *= 2
    return align


def block_sizes(tasks: list[Decoded], dtype: torch.dtype) -> dict:
    """Compile-time block sizes fitted to the plan's dimensions."""
    dmax = rmax = experts = width = spec_t = 16
    splits = norm_width = topk = 2
    sample = 0
    stream_k = 32
    stream_n = 1
    att_rows = 16  # query rows (tokens x heads) of the widest attention task
    pairs = combine_cols = 16
    head_in, head_out = [16, 16], [16, 16]  # [plain, TRANS] per-head matmuls
    att_kinds = set()
    for t in tasks:
        f = t.fields
        if t.op.name in ("LINEAR", "EXPERT_LINEAR"):
            stream_k = max(stream_k, _pow2(f["K"]))
            stream_n = max(stream_n, _pow2(f["N"], 1))
            if t.op.name == "LINEAR" and t.has("NORM"):  # x's norm, summed as RMSNORM sums a row
                norm_width = max(norm_width, _pow2(f["K"], 2))
        elif t.op.name == "HEAD_MATMUL":
            stream_n = max(stream_n, _pow2(f["N"], 1))
            k = 1 if t.has("TRANS") else 0
            head_in[k], head_out[k] = max(head_in[k], _pow2(f["in_dim"])), max(head_out[k], _pow2(f["o1"] - f["o0"]))
        elif t.op.name == "ATTENTION":
            dmax, rmax = max(dmax, _pow2(f["dim"])), max(rmax, _pow2(f["rope_dim"]))
            att_rows = max(att_rows, _pow2(f["T"] * (f["h1"] - f["h0"])))
            att_kinds.add(1 if t.has("MLA") else 2)
        elif t.op.name == "ROUTE":
            experts = max(experts, _pow2(f["E"]))
            pairs = max(pairs, _pow2(f["N"] * f["topk"]))
        elif t.op.name in ("HC_COEFF", "HC_HEAD", "HC_EXPAND"):
            width = max(width, _pow2((2 + f["n"]) * f["n"]))
        elif t.op.name == "ACCEPT":
            spec_t = max(spec_t, _pow2(f["T"]))
            sample = sample or int(t.has("SAMPLE"))
        elif t.op.name == "ATTN_COMBINE":
            splits = max(splits, _pow2(f["nsplits"], 2))
            combine_cols = max(combine_cols, _pow2(f["c1"] - f["c0"]))
        elif t.op.name == "RMSNORM":
            norm_width = max(norm_width, _pow2(f["D"], 2))
        elif t.op.name == "MOE_COMBINE":
            topk = max(topk, _pow2(f["topk"], 2))
    # Measured on an H200 (docs/PERF.md, run 7): with a wide attention row (MLA's 512-wide latent, the
    # heaviest body, which sets every worker's register budget) a cache-block prefetch spills and costs
    # 5%; with GQA it gains 3%.
    stages = 1 if dmax > 128 else 2
    # every block of BM query rows streams the task's whole cache split again: a GQA task's rows
    # (T x its heads, e.g. 6 x 4 at T=6) take one block up to 64; MLA's 512-wide rows keep 16, where
    # each doubling of BM costs another 32 accumulator registers in the heaviest body
    bm = 16 if dmax > 128 else min(64, att_rows)
    # cache positions per block: GQA's 64-wide rows take 128 at once (64: llama-1b -6.7%, docs/PERF.md session 11
    # call 2; 128 with APF=2: -1%, session 17; one BJ for every plan of a kind, so a token's sums do not depend
    # on T or B); MLA's 512-wide latent rows keep 32 (64 spilled 388 bytes in the heaviest body, session 5)
    bj = 32 if dmax > 128 else 128
    # 16K weights per step: 128 bytes per thread, one row per warp at KC = 2048 (docs/PERF.md run 13);
    # no wider than the widest matrix (small models: more rows per step instead of columns that
    # would only be multiplied by zero)
    kc = min(2048, stream_k)
    br = 16384 // kc
    # a weight chunk or per-head tile is multiplied by up to TB tokens before the next is needed
    # (T > 1, B > 1); past 16, sums of more tokens would need more registers than a stream leaves.
    # Only 1, 8 or 16: each distinct TB is another JIT compile (~25 s) of the kernel for every step
    # size the engine warms (prefill chunks, k + 1), and a wider TB costs only masked columns
    tb = 1 if stream_n == 1 else min(16, max(8, stream_n))
    # per-head matmuls: up to 16K weights per step (the stream's), so a q_absorb task of MLA is one
    # 128 x 128 tile, requested before its wait; TRANS tasks (v_up: 512 inputs, 64 outputs) take
    # as many inputs per step as their outputs leave room for
    bi, bo = min(128, head_in[0]), min(128, head_out[0])
    bot = min(128, head_out[1])
    bit = min(head_in[1], 16384 // bot)
    # the attention combine: all splits of a task's columns in one load where 8K values allow
    bcw = min(combine_cols, max(16, 8192 // splits))
    # bf16 weights: activations enter the tensor cores as a bf16 (high, low) pair, ~16 mantissa bits
    align = alignment(tasks)
    return dict(BR=br, KC=kc, STAGES=stages, BD=256, BH=32, BM=bm, BJ=bj, DMAX=dmax, RMAX=rmax, BI=bi, BO=bo, BIT=bit,
                BOT=bot, BE=experts, BP=min(256, pairs), BW=width, ALIGN=align, BT=spec_t,
                # whole rows per load where registers allow: each block is one memory round trip
                BSC=min(splits, max(1, 8192 // bcw)), BCW=bcw, BN=min(norm_width, 8192), BK=topk, CPF=0,
                SAMPLE=sample, BV=1024, TB=tb,
                # weights asked of the L2 in bulk, a task at a time (1) or a task ahead (2): a launch variant
                PF=0,
                # weight chunks in flight per warp: 2 is a launch variant (DEPTH=2 lost on the old,
                # instruction-bound stream: docs/PERF.md run 13)
                DEPTH=1,
                # 1: a one-token row block's sums kept in one layout, stored as a vector; 2: also stored
                # in place with inline PTX (no shared-memory conversion and barriers in the stream's
                # loop): the same bits, -7.5% on dsv2-lite and -0.5% on llama-1b (docs/PERF.md s. 13).
                # The interpreter runs no inline PTX: 0 there
                ROWVEC=0 if INTERPRET else 2,
                # 1: with ROWVEC, a listed token's out row looked up a step ahead: the same bits, -1.8% on
                # dsv2-lite (docs/PERF.md session 15); the interpreter's ROWVEC=0 epilogue ignores it
                AHEAD=1,
                # 1: LINEAR and expert slices that load a fifth fewer weights in 4·BR x KC/4 chunks stream
                # those (linear.narrow; a launch variant: +0.8% on dsv2-lite, docs/PERF.md session 15)
                NARROW=0,
                # 1: one token's slot table from its experts' ranks in registers: the same tables, -1.4% on
                # dsv2-lite (docs/PERF.md session 15)
                ROUTE1=1,
                # > 0: the weight stream asks the L2 for the row block this many blocks ahead (a launch variant,
                # compiled only: inline PTX; 1-3 were 0 to +7% slower in session 15); < 0: the L1 is asked for the
                # chunk -PFD steps after the one in flight to the registers, line by line (session 51, not timed)
                PFD=0,
                # > 0: a LINEAR task's next PFK KB of weights (after its first row block) asked of the L2 before its
                # wait (a launch variant, compiled only: inline PTX)
                PFK=0,
                # the L2's residency of what every hop reads (a step streams ~5 GB through a 50 MB L2): EF 1, the
                # weight stream loads with the evict-first policy (-7.8% on dsv2-lite, -1.7% on llama-1b; 2, a
                # launch variant: per-head matmul weights and attention's cache rows too, 0 and +0.7%); WPF 1
                # (inline PTX), the next task's word asked of the L1 right after a task's wait; APF 1 (inline PTX),
                # an MLA attention split's cache rows asked of the L2 before its wait; 2, GQA's head lines too (-0.7% on
                # llama-1b, session 17).  All three: -10.2% and -3.7%, the same bits (docs/PERF.md session 16).  No
                # inline PTX in the interpreter
                EF=1, WPF=0 if INTERPRET else 1,
                APF=2 * int(bulk_prefetch_refusal(align, dtype.itemsize) is None),
                DOT_PREC="ieee" if dtype == torch.float32 else "fp32" if INTERPRET else "bf16x2",
                # a persistent helper kernel's plan: HELPER_RECV / HELPER_SEND compiled in (only there)
                HELPER_SIDE=int(any(t.op.name == "HELPER_RECV" for t in tasks)),
                # LINEAR[PAIR] (norm_beside_experts' router, on exact scaled weights) compiled in (only where used)
                HILO=int(any(t.op.name == "LINEAR" and t.has("PAIR") for t in tasks)),
                # EXPERT_LINEAR[DOWN_T] and LINEAR[DOWN_T] (fusion rules expert_mlp, dense_mlp) compiled in, for
                # k-major rows of up to KD columns
                KD=max((_pow2(t["K"]) for t in tasks if t.op.name in ("EXPERT_LINEAR", "LINEAR") and t.has("DOWN_T")),
                       default=0),
                # attention compiled for the plan's one kind (MLA or GQA), else the flag read per task
                ATT_KIND=next(iter(att_kinds)) if len(att_kinds) == 1 else 0,
                # ATTENTION[ROPE] (fusion rule rope_into_attention) compiled in (only where used)
                ATT_ROPE=int(any(t.op.name == "ATTENTION" and t.has("ROPE") for t in tasks)),
                # 1 (a launch variant, inline PTX: not measured in a step yet): dependency waits poll with every
                # thread's ld.acquire.gpu, not one thread's atomic (ops/common.poll_counter; tools/hop_bench.py);
                # 2 (a launch variant, inline PTX): one thread's acquire load that also asks the L1 for the task's
                # word, so the fields a body reads after its wait are not L2 round trips (slower: +1.7% on dsv2-lite,
                # +1.2% on llama-1b, docs/PERF.md session 35)
                POLL=0,
                # 1: worker 0 copies the step's tokens and cache lengths from the pinned stage buffers and releases
                # them to the others (kernel.host_inputs_to_device), so the graph is one kernel and no copy nodes: 1
                # launch a step, not 3, at the same step time (docs/PERF.md session 28).  Fitted by launch_blocks
                # from the plan: 1 where it has those inputs and no stream workers
                HIN=0,
                # 1 (a launch variant, slower: +0.9% on dsv2-lite, docs/PERF.md session 35): an EXPERT_LINEAR task's
                # first weight chunk requested before its wait, for the expert its slot holds then (a guess the body
                # checks after the wait: moe.guess_first_chunk), as a LINEAR task's is; 2: guessed from the next slot
                # (a test hook)
                EPF=0,
                # ATTENTION's query rows (attention.body's QIX): bit 1, their token and head without integer division;
                # bit 2, the cache length requested after them.  3 where every attention task is MLA: -1.2% on
                # dsv2-lite, the same bits, a split 0.55 us shorter (H100, docs/PERF.md session 35); GQA's not timed
                QIX=3 if att_kinds == {1} else 0,
                # when a task reads the index of the counter it signals (kernel.py): 1 with its opcode (held through
                # the body); 0 after its closing barrier, 2 before that barrier (launch variants)
                SIG=1,
                # 1: a task's next wait slot read before its current wait's poll (common.wait_task), so no field load
                # follows its last poll; 0 (a launch variant) after it.  With SIG=1: -1.3% on llama-1b, -4.0% on
                # dsv2-lite, the same bits (H100, docs/PERF.md session 42).  2: and a weight task's first two slots
                # before the weights it requests before its wait; with PIN=1 the default where every attention task
                # is MLA: -1.8 to -2.1% on dsv2-lite, the same bits (H100, docs/PERF.md sessions 47, 49)
                WAITS=2 if att_kinds == {1} else 1,
                # 1 (inline PTX, so not in the interpreter): one-token LINEAR and expert slices stream through
                # linear.stream_pinned / stream_pinned_k, the next weight chunk in flight through the multiply: the
                # default with WAITS=2 where every attention task is MLA (above); +1.0 to +1.4% on llama-1b, whose
                # kernel it takes from 242 to 255 registers (H100, docs/PERF.md session 47);
                # 2 (a launch variant): and one-token expert slices of rows whose K is not a multiple of KC (KC/2 < K
                # < KC: dsv2-lite's routed downs) stream flat, no column wasted (ops/linear_flat.py): +4.2% on an
                # H100 and not the default's bits (docs/PERF.md session 49)
                PIN=1 if att_kinds == {1} and not INTERPRET else 0)


def bulk_prefetch_refusal(align: int, weight_bytes: int) -> str | None:
    """Why bulk L2 prefetches (PF, PFD, APF, PFK: inline PTX of whole 16-byte aligned rows) cannot run, or None."""
    if INTERPRET:
        return "the Triton interpreter runs no inline PTX"
    if align * weight_bytes % 16:
        return f"bulk prefetches need 16-byte aligned rows, and ALIGN={align} x {weight_bytes}-byte weights are not"
    return None


def check_block_overrides(blocks: dict, fitted: dict, weight_bytes: int = 2) -> None:
    """Overrides (launch variants) that would compute something else, or could not run."""
    unknown = sorted(set(blocks) - set(fitted))
    if unknown:
        raise MegakernelError(f"unknown block override {', '.join(unknown)}: "
                              f"the kernel takes {', '.join(sorted(fitted))}")
    if fitted["SAMPLE"] and not blocks["SAMPLE"]:
        raise MegakernelError("block override SAMPLE=0 on a sampling plan: ACCEPT would decode greedily")
    if blocks["KC"] > STREAM_SLACK or blocks["KC"] & (blocks["KC"] - 1):
        raise MegakernelError(f"block override KC={blocks['KC']}: weight chunks are a power of two <= {STREAM_SLACK} "
                              f"columns (the W arena's slack past its end)")
    if blocks["BR"] * blocks["KC"] > 32768:
        raise MegakernelError(f"block override BR={blocks['BR']}, KC={blocks['KC']}: a weight chunk of more than 32768 "
                              "weights (256 bytes per thread) would not fit the registers")
    for bi, bo in (("BI", "BO"), ("BIT", "BOT")):
        if max(blocks[bi], blocks[bo]) > STREAM_SLACK or blocks[bi] * blocks[bo] > 32768:
            raise MegakernelError(f"block override {bi}={blocks[bi]}, {bo}={blocks[bo]}: per-head weight tiles read "
                                  f"up to {bi} or {bo} past a matrix (at most {STREAM_SLACK}, the W arena's slack) "
                                  "and hold at most 32768 weights")
    if blocks["DOT_PREC"] != fitted["DOT_PREC"] and (fitted["DOT_PREC"], blocks["DOT_PREC"]) != ("bf16x2", "bf16"):
        raise MegakernelError(f"block override DOT_PREC={blocks['DOT_PREC']}: this plan's weights take "
                              f"{fitted['DOT_PREC']} (bf16 weights also take bf16, one MMA a product)")
    if blocks["ALIGN"] > fitted["ALIGN"]:
        raise MegakernelError(f"block override ALIGN={blocks['ALIGN']}: the plan's sizes and offsets are multiples of "
                              f"{fitted['ALIGN']} only (the bodies round them down to ALIGN)")
    if blocks["ATT_KIND"] not in (0, fitted["ATT_KIND"]):
        kinds = {0: "of both kinds", 1: "all MLA", 2: "all GQA"}[fitted["ATT_KIND"]]
        raise MegakernelError(f"block override ATT_KIND={blocks['ATT_KIND']}: this plan's attention tasks are {kinds} "
                              "(0 reads the flag per task)")
    if blocks["TB"] not in (1, 2, 4, 8, 16):
        raise MegakernelError(f"block override TB={blocks['TB']}: tokens per weight chunk are a power of two <= 16")
    if blocks["ROWVEC"] not in (0, 1, 2):
        raise MegakernelError(f"block override ROWVEC={blocks['ROWVEC']}: 0, 1 (a one-token store as a row vector) "
                              "or 2 (stored in place, with inline PTX)")
    if blocks["ROWVEC"] == 2 and INTERPRET:
        raise MegakernelError("block override ROWVEC=2: the Triton interpreter runs no inline PTX")
    for flag, what in (("AHEAD", "a listed token's out row looked up a step ahead"),
                       ("ROUTE1", "one token's slot table from registers"), ("NARROW", "narrow chunks"),
                       ("WPF", "the next task word's prefetch"), ("HILO", "LINEAR[PAIR] compiled in")):
        if blocks[flag] not in (0, 1):
            raise MegakernelError(f"block override {flag}={blocks[flag]}: 0, or 1 ({what})")
    if blocks["HIN"] not in (0, 1):
        raise MegakernelError(f"block override HIN={blocks['HIN']}: 0 (inputs copied into the plan's slots by the "
                              "graph's copy nodes) or 1 (worker 0 copies them from the pinned stage buffers; the "
                              "default)")
    if blocks["POLL"] not in (0, 1, 2):
        raise MegakernelError(f"block override POLL={blocks['POLL']}: 0 (a scalar acquire atomic), 1 (every "
                              "thread's ld.acquire.gpu) or 2 (one thread's acquire load that also asks the L1 "
                              "for the task's word)")
    if blocks["POLL"] and INTERPRET:
        raise MegakernelError(f"block override POLL={blocks['POLL']}: the Triton interpreter runs no inline PTX")
    if blocks["EPF"] not in (0, 1, 2):
        raise MegakernelError(f"block override EPF={blocks['EPF']}: 0, 1 (an expert task's first weights requested "
                              "before its wait, for the expert its slot holds then) or 2 (guessed from the next slot: "
                              "a test hook)")
    if blocks["QIX"] not in (0, 1, 2, 3):
        raise MegakernelError(f"block override QIX={blocks['QIX']}: 0, or bits 1 (attention's query rows indexed "
                              "without integer division) and 2 (the cache length requested after them)")
    if blocks["WAITS"] not in (0, 1, 2):
        raise MegakernelError(f"block override WAITS={blocks['WAITS']}: 0, 1 (a task's next wait slot read before "
                              "its current wait's poll) or 2 (and a task's first two slots before the first weights "
                              "it requests before its wait: LINEAR, HEAD_MATMUL, EXPERT_LINEAR with EPF)")
    if blocks["PIN"] not in (0, 1, 2):
        raise MegakernelError(f"block override PIN={blocks['PIN']}: 0, 1 (one-token slices stream with the next "
                              "weight chunk in flight through the multiply) or 2 (and one-token expert slices of rows "
                              "not a multiple of KC long stream flat: ops/linear_flat.py)")
    if blocks["PIN"] == 2 and blocks["EPF"]:
        raise MegakernelError(f"block override PIN=2 with EPF={blocks['EPF']}: a guessed first chunk is not a flat "
                              "stream's first tile")
    if blocks["PIN"] == 2 and (blocks["KC"] < 256 or weight_bytes != 2):
        raise MegakernelError(f"block override PIN=2: flat streams read bf16 pairs in chunks of KC >= 256 columns, "
                              f"and this kernel has KC={blocks['KC']} and {weight_bytes}-byte weights")
    if blocks["PIN"] and INTERPRET:
        raise MegakernelError(f"block override PIN={blocks['PIN']}: the Triton interpreter runs no inline PTX (its "
                              "CTA barrier's count)")
    if blocks["SIG"] not in (0, 1, 2):
        raise MegakernelError(f"block override SIG={blocks['SIG']}: 0, 1 or 2 (the signalled counter's index read "
                              "after the task's closing barrier, with its opcode, or before that barrier)")
    if blocks["APF"] not in (0, 1, 2):
        raise MegakernelError(f"block override APF={blocks['APF']}: 0, 1 (MLA attention's cache rows asked of the L2 "
                              "before the wait) or 2 (GQA's head lines too)")
    if blocks["EF"] not in (0, 1, 2):
        raise MegakernelError(f"block override EF={blocks['EF']}: 0, 1 (evict-first weight stream) or 2 (per-head "
                              "matmul weights and attention's cache rows too)")
    if blocks["NARROW"] and blocks["KC"] // 4 < 2 * blocks["ALIGN"]:
        raise MegakernelError(f"block override NARROW=1 needs KC/4 >= 2 x ALIGN (KC={blocks['KC']}, "
                              f"ALIGN={blocks['ALIGN']})")
    if blocks["DEPTH"] not in (1, 2):
        raise MegakernelError(f"block override DEPTH={blocks['DEPTH']}: 1 or 2 weight chunks in flight per warp")
    if blocks["PF"] not in (0, 1, 2):
        raise MegakernelError(f"block override PF={blocks['PF']}: 0 (no L2 prefetch), 1 (a task's weights at its "
                              "start) or 2 (the next task's too)")
    if blocks["PFD"] not in (-2, -1, 0, 1, 2, 3, 4):
        raise MegakernelError(f"block override PFD={blocks['PFD']}: 0 (no rolling prefetch), 1-4 row blocks ahead "
                              "into the L2 or -1, -2 chunks ahead into the L1")
    if blocks["PFD"] < 0 and blocks["DEPTH"] != 1:
        raise MegakernelError(f"block override PFD={blocks['PFD']} with DEPTH={blocks['DEPTH']}: the L1's rolling "
                              "prefetch runs beside one chunk in flight (DEPTH=1)")
    if blocks["WPF"] and INTERPRET:
        raise MegakernelError("block override WPF=1: the Triton interpreter runs no inline PTX")
    if blocks["PFD"] < 0 and INTERPRET:  # a line prefetch a thread: inline PTX, but no bulk copy's alignment
        raise MegakernelError(f"block override PFD={blocks['PFD']}: the Triton interpreter runs no inline PTX")
    if not 0 <= blocks["PFK"] <= 4096:
        raise MegakernelError(f"block override PFK={blocks['PFK']}: 0 (off) or up to 4096 KB of a task's weights")
    for key in ("PF", "PFD", "APF", "PFK"):  # bulk L2 prefetches (inline PTX) of whole weight or cache rows
        why = bulk_prefetch_refusal(blocks["ALIGN"], weight_bytes)
        if blocks[key] > 0 and why:
            raise MegakernelError(f"block override {key}={blocks[key]}: {why}")
    if blocks["KD"] != fitted["KD"]:
        raise MegakernelError(f"block override KD={blocks['KD']}: the plan's DOWN_T rows (expert_mlp, dense_mlp) "
                              f"need KD={fitted['KD']} (0: it has none)")
    if blocks["HILO"] < fitted["HILO"]:
        raise MegakernelError("block override HILO=0: this plan has LINEAR[PAIR] tasks (a router's weights as a high "
                              "and a low part), whose low part a kernel without HILO would not read")
    if blocks["ATT_ROPE"] < fitted["ATT_ROPE"]:
        raise MegakernelError("block override ATT_ROPE=0: this plan has ATTENTION[ROPE] tasks (fusion rule "
                              "rope_into_attention), whose rotation and new cache rows a kernel without it would skip")
    if blocks["HELPER_SIDE"] < fitted["HELPER_SIDE"]:
        raise MegakernelError("block override HELPER_SIDE=0: this plan has a persistent helper's HELPER_RECV and "
                              "HELPER_SEND tasks")
    if blocks["BK"] < fitted["BK"]:
        raise MegakernelError(f"block override BK={blocks['BK']}: MOE_COMBINE reads all of a token's expert rows "
                              f"in one block of BK, this plan needs {fitted['BK']}")


SHARED_BLOCKS: dict = {}  # set by shared_blocks()


def raised_to(fitted: dict, floor: dict) -> dict:
    """Block sizes at least `floor`'s: larger blocks only mask more (ALIGN the smaller; ATT_KIND 0, which
    reads each task's kind, where the two differ)."""
    out = dict(fitted)
    for key, value in floor.items():
        if key == "ATT_KIND":
            out[key] = fitted[key] if value == fitted[key] else 0
        elif key == "ALIGN":
            out[key] = min(value, fitted[key])
        else:
            out[key] = max(value, fitted[key])
    return out


@contextlib.contextmanager
def shared_blocks(floor: dict):
    """Within: every Megakernel takes block sizes of at least `floor`, so plans of several shapes and
    models compile to one kernel (each distinct set of block sizes is a JIT compile of ~30-40 s).
    For test suites that build dozens of small plans; a served model keeps the sizes fitted to it."""
    global SHARED_BLOCKS
    saved, SHARED_BLOCKS = SHARED_BLOCKS, dict(floor)
    try:
        yield
    finally:
        SHARED_BLOCKS = saved


@dataclass
class LaunchConfig:
    num_warps: int = 8
    num_stages: int = 1  # > 1: Triton pipelines weight loads through shared memory (cp.async)
    timeout_s: float = 0.25  # longest a task may wait for one counter
    max_spins: int = 200_000  # bound without a timer (TRITON_INTERPRET)
    helper_timeout_s: float = 1.0  # longest HELPER_WAIT waits for the helper's answer
    profile: bool = False
    blocks: dict | None = None  # overrides of block_sizes()

    def __post_init__(self):
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise MegakernelError(f"LaunchConfig.num_warps={self.num_warps}: a power of two from 1 to 16")
        if self.num_stages < 1:
            raise MegakernelError(f"LaunchConfig.num_stages={self.num_stages}: at least 1")
        for name in ("timeout_s", "helper_timeout_s"):  # a bound of 0 would fail every wait that is not already met
            if not getattr(self, name) > 0:
                raise MegakernelError(f"LaunchConfig.{name}={getattr(self, name)}: a wait's bound must be > 0 seconds")
        if self.max_spins < 1:
            raise MegakernelError(f"LaunchConfig.max_spins={self.max_spins}: at least 1 poll before the error")


# the plan's buffers the kernel takes after words, queue_ptr, counters, worker_epoch, err (int32) and prof (int64)
KERNEL_BUFFERS = (Buf.W, Buf.WF, Buf.A, Buf.I, Buf.C, Buf.H)


def buffer_dtype(buf: int, dtype: torch.dtype) -> torch.dtype:
    """A buffer's element type (memory.Memory allocates them so): weights and cache in the model dtype."""
    return dtype if buf in (Buf.W, Buf.C) else torch.int32 if buf in (Buf.I, Buf.H) else torch.float32


def wait_bound_s(tasks: list[Decoded], config: LaunchConfig) -> float:
    """The longest a task may wait for one counter.  A task after a HELPER_WAIT may wait for as long as
    the helper may take, and then some: its bound must not fire before the helper's (which names the call)."""
    helper = any(t.op.name in ("HELPER_WAIT", "HELPER_RECV") for t in tasks)
    return config.timeout_s + (config.helper_timeout_s if helper else 0.0)


def launch_blocks(tasks: list[Decoded], dtype: torch.dtype, config: LaunchConfig, plan: Plan) -> dict:
    """The block sizes a plan's kernel compiles with: fitted to its tasks (the plan's words, decoded) and HIN to
    its inputs, raised to SHARED_BLOCKS, then the config's overrides (checked)."""
    fitted = block_sizes(tasks, dtype)
    fitted["HIN"] = int(host_inputs_refusal(plan) is None)
    blocks = {**raised_to(fitted, SHARED_BLOCKS), **(config.blocks or {})}
    check_block_overrides(blocks, fitted, dtype.itemsize)
    return blocks


def kernel_constants(blocks: dict, bound_s: float, config: LaunchConfig, on_cuda: bool) -> dict:
    """Every constexpr of the persistent kernel: the block sizes and the launch's bounds and flags."""
    use_timer = on_cuda and not INTERPRET
    return dict(WORDS=WORDS, MAX_WAITS=MAX_WAITS, TIMEOUT_NS=int(bound_s * 1e9),
                MAX_SPINS=config.max_spins, HELPER_NS=int(config.helper_timeout_s * 1e9),
                USE_TIMER=use_timer, PROFILE=config.profile and use_timer, **blocks)


def precompile(plan: Plan, dtype: torch.dtype, config: LaunchConfig | None = None, device="cuda"):
    """JIT-compile the kernel a Megakernel of this plan and config would launch, into Triton's cache, with
    no buffers: tiny stand-ins of the same dtypes (the JIT specializes pointers on dtype and 16-byte
    alignment only), so a process can compile kernels for plans whose weights it never loads (tools/bench.py
    --jobs compiles a run's variants side by side).  Returns Triton's compiled kernel."""
    config = config or LaunchConfig()
    tasks = [decode(w) for w in plan.words]
    blocks = launch_blocks(tasks, dtype, config, plan)
    dev = torch.device(device)
    dtypes = ([torch.int32] * 5 + [torch.int64] + [buffer_dtype(b, dtype) for b in KERNEL_BUFFERS]
              + [torch.int32] * 3)  # as _args orders (HT, HL, HD last)
    args = [torch.zeros(64, dtype=t, device=dev) for t in dtypes]
    return megakernel.warmup(*args, **kernel_constants(blocks, wait_bound_s(tasks, config), config, dev.type == "cuda"),
                             grid=(plan.workers - stream_workers(plan),), num_warps=body_warps(plan, config),
                             num_stages=config.num_stages)


def precompile_side_by_side(plan: Plan, dtype: torch.dtype, configs: list[LaunchConfig], processes: int = 8) -> None:
    """precompile() each config's kernel for `plan` in up to `processes` processes at once (Triton compiles holding
    the GIL, ~40 s a kernel), so Megakernels of those configs launched afterwards find them in Triton's cache: for
    GPU tests that compare several launch variants of one plan.  A compile that fails here is left to the launch,
    which compiles it again and reports the error; the interpreter compiles nothing."""
    import concurrent.futures
    import multiprocessing
    if INTERPRET or not configs:
        return
    with concurrent.futures.ProcessPoolExecutor(min(processes, len(configs)),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        for done in [pool.submit(_precompile_job, plan, dtype, config, SHARED_BLOCKS) for config in configs]:
            with contextlib.suppress(Exception):
                done.result()


def _precompile_job(plan: Plan, dtype: torch.dtype, config: LaunchConfig, shared: dict) -> None:
    """precompile() in a process of its own, under its parent's shared_blocks (the kernel is not returned: Triton's
    compiled kernel does not pickle)."""
    with shared_blocks(shared):
        precompile(plan, dtype, config)


def host_inputs_refusal(plan: Plan) -> str | None:
    """Why the kernel cannot copy this plan's inputs from the host itself (HIN=1), or None."""
    missing = [name for name in ("in.tokens", "in.cache_lens") if name not in plan.io]
    if missing:
        return (f"this plan has no {' or '.join(missing)} input (a helper's site plan?): there is nothing to copy "
                "from the host")
    for name in ("in.tokens", "in.cache_lens"):
        slot = plan.io[name]
        if slot.buf != int(Buf.I) or slot.cols != 1:
            return (f"plan input {name} is not one int32 column of buffer I (buf {slot.buf}, {slot.cols} columns): "
                    "the kernel's input copy assumes it is")
    if stream_workers(plan):
        return "a stream_kernel plan's Gluon workers would run before the inputs are copied; HIN needs a plain plan"
    return None


def cta_registers(compiled) -> int:
    """Registers one CTA of a loaded kernel takes from its SM (allocated 8 a thread at a time)."""
    return -(-max(1, compiled.n_regs) // 8) * 8 * 32 * compiled.metadata.num_warps


def stream_workers(plan: Plan) -> int:
    """How many of the plan's queues (the last ones) a stream kernel runs: 0 for a plain plan."""
    return int(plan.options.get("stream_workers") or 0)


def body_warps(plan: Plan, config: LaunchConfig) -> int:
    """Warps of the Triton kernel's CTA: at most 4 beside a stream kernel, whose CTA takes half of each SM's
    registers (megakernel/stream_kernel.py), so that the two fit one SM whatever registers the Triton bodies need."""
    return min(config.num_warps, 4) if stream_workers(plan) else config.num_warps
