"""The compiler pipeline: lower -> CSE -> fuse -> memory -> tile -> schedule -> encode -> verify."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from model.config import ModelConfig
from model.stats import step_bytes

from .cost import CostModel
from .counters import shared_counters
from .cse import cse
from .fusion import DEFAULT_RULES, RULES, WEIGHT_RULES, fuse
from .ir import Graph, Op
from .isa import MAX_WAITS, OPCODES, WORDS, decode, encode
from .lower import StepShape, lower
from .memory import ancestors, plan_memory, weight_order
from .plan import IOSlot, Plan, WeightSlot
from .schedule import SchedTask, blocked, critical_path, round_robin
from .tiling import Tiler, TilingOptions
from .verify import STREAM_OPCODES, stream_violation, verify_plan

@dataclass
class CompileOptions:
    workers: int = 132
    scheduler: str = "critical_path"  # critical_path | round_robin | blocked
    cse: bool = True
    fuse: bool = True
    reuse_memory: bool = True
    vocab_block: int = 4096
    fusion_rules: tuple[str, ...] = DEFAULT_RULES
    tiling: TilingOptions = field(default_factory=TilingOptions)
    cost: CostModel = field(default_factory=CostModel)
    verify: bool = True
    # a plan for two co-resident kernels: queues 0..workers-1 run every task but LINEAR (this kernel),
    # queues workers..2·workers-1 only LINEAR (a stream kernel's workers), each LINEAR's weights at a
    # multiple of its K in W (plan.options["stream_workers"] = workers; graph/verify.py's stream rules)
    stream_kernel: bool = False
    # producers that every consumer waits on together signal one counter: one poll where there were several
    # (graph/counters.py; llama-1b -1.0%, dsv2-lite -0.2% on an H200, the same bits: docs/PERF.md session 36)
    shared_counters: bool = True


class CompileError(ValueError):
    pass


def compile_options(spec: str, workers: int) -> tuple[CompileOptions, int]:
    """'KEY=V,...' of TilingOptions fields, CostModel fields (the scheduler's task times: task_overhead=3e-6),
    attn_split, workers (overriding the argument), vocab_block, stream_kernel and shared_counters (0/1), and
    fusion rules, removed from the default ones (rope_into_cache=0) or put back (tools: bench, replay) ->
    (options, attn_split)."""
    tiling, cost, attn_split, rules, vocab_block = {}, {}, 0, DEFAULT_RULES, CompileOptions.vocab_block
    stream_kernel, shared = CompileOptions.stream_kernel, CompileOptions.shared_counters
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key == "attn_split":
            attn_split = int(value)
        elif key == "workers":
            workers = int(value)
        elif key == "vocab_block":
            vocab_block = int(value)
        elif key == "stream_kernel":
            stream_kernel = bool(int(value))
        elif key == "shared_counters":
            shared = bool(int(value))
        elif key in RULES:
            chosen = set(rules) | {key} if int(value) else set(rules) - {key}
            rules = tuple(r for r in RULES if r in chosen)  # in the order fuse() applies them
        elif key in {f.name for f in dataclasses.fields(TilingOptions)}:
            tiling[key] = int(value)
        elif key in {f.name for f in dataclasses.fields(CostModel)}:
            cost[key] = type(getattr(CostModel, key))(float(value))
        else:
            raise CompileError(f"plan options {spec!r}: unknown key {key!r} (TilingOptions or CostModel fields, "
                               f"attn_split, workers, vocab_block, stream_kernel, shared_counters or a fusion rule: "
                               f"{', '.join(RULES)})")
    return (CompileOptions(workers=workers, vocab_block=vocab_block, tiling=TilingOptions(**tiling),
                           cost=CostModel(**cost), fusion_rules=rules, stream_kernel=stream_kernel,
                           shared_counters=shared), attn_split)


def compile_step(cfg: ModelConfig, shape: StepShape, options: CompileOptions | None = None) -> Plan:
    opts = options or CompileOptions()
    if opts.workers < 1:
        raise CompileError("workers must be >= 1")
    if opts.stream_kernel and opts.scheduler != "critical_path":
        raise CompileError(f"stream_kernel needs the critical_path scheduler, not {opts.scheduler}")
    down_t = [r for r in ("expert_mlp", "dense_mlp") if r in opts.fusion_rules] if opts.fuse else []
    if opts.stream_kernel and down_t:
        raise CompileError(f"stream_kernel with fusion rule(s) {', '.join(down_t)}: they make LINEAR[DOWN_T] tasks, "
                           "which the stream kernel's Gluon ring has no body for")
    t0 = time.perf_counter()
    if shape.attn_split == 0:
        shape = dataclasses.replace(shape, attn_split=attention_split(cfg, shape, opts.workers))
    graph = lower(cfg, shape, opts.vocab_block)
    passes = [{"pass": "lower", "ops": len(graph.ops), "tensors": len(graph.tensors)}]
    if opts.cse:
        passes.append(cse(graph))
    if opts.fuse:
        passes.append(fuse(graph, opts.fusion_rules))
    graph.renumber()
    graph.prune()
    layout = (cfg, shape.helper_slots, tuple(opts.fusion_rules) if opts.fuse else ())
    mem = plan_memory(graph, reuse=opts.reuse_memory, weights=canonical_weights(*layout),
                      row_align=dict(canonical_linear_rows(*layout)) if opts.stream_kernel else None)
    passes.append({"pass": "memory", "A_bytes": mem.sizes["A"] * 4, "I_bytes": mem.sizes["I"] * 4,
                   "unshared_bytes": mem.activation_bytes_unshared, "reused_blocks": mem.reused,
                   "W_elements": mem.sizes["W"], "WF_elements": mem.sizes["WF"]})
    wbytes = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.dtype]
    tiling = opts.tiling if opts.tiling.spread >= 0 else dataclasses.replace(opts.tiling, spread=opts.workers)
    tiler = Tiler(graph, tiling, wbytes)
    op_tiles = {op.id: tiler.tiles(op) for op in graph.ops}
    passes.append({"pass": "tiling", "tasks": sum(len(t) for t in op_tiles.values()),
                   "tile_bytes": opts.tiling.tile_bytes})

    deps = graph.op_deps()
    sched_tasks: list[SchedTask] = []
    task_tile: list[tuple[Op, int]] = []
    total_bytes = 0
    for op in graph.ops:
        for k, tile in enumerate(op_tiles[op.id]):
            secs = opts.cost.task_seconds(tile.weight_bytes, tile.act_bytes, tile.flops, opts.workers)
            sched_tasks.append(SchedTask(op.id, secs))
            task_tile.append((op, k))
            total_bytes += tile.weight_bytes + tile.act_bytes
    scheduler = {"critical_path": critical_path, "round_robin": round_robin, "blocked": blocked}[opts.scheduler]
    if opts.stream_kernel:  # class 1: the stream kernel's workers, queues W..2W-1
        classes = [int(op.opcode in STREAM_OPCODES) for op, _ in task_tile]
        sched = critical_path(sched_tasks, deps, opts.workers, opts.cost.hop_latency, classes=classes,
                              class_workers=[opts.workers, opts.workers])
    else:
        sched = scheduler(sched_tasks, deps, opts.workers, opts.cost.hop_latency)
    passes.append({"pass": "schedule", "scheduler": opts.scheduler, "workers": opts.workers,
                   **({"stream_workers": opts.workers} if opts.stream_kernel else {}),
                   "critical_path_ms": round(sched.makespan * 1e3, 4), "balance": round(sched.balance, 3)})

    words, labels, ptr, counter_labels = _encode(graph, op_tiles, task_tile, sched.queues, deps, opts.shared_counters)
    decoded = [decode(w) for w in words] if opts.stream_kernel else None  # the verifier reads them too
    if decoded is not None:
        why = stream_violation(decoded, labels)
        if why:
            raise CompileError(f"stream_kernel: {why}")
    plan = Plan(
        config=cfg.to_hf_dict(), shape=dataclasses.asdict(shape), workers=len(sched.queues), words=words,
        queue_ptr=ptr,
        task_labels=labels, counter_labels=counter_labels, buffers=mem.sizes,
        weights=[WeightSlot(t.name, int(t.buf), t.offset, t.rows, t.cols, [list(p) for p in t.parts])
                 for t in graph.tensors.values() if t.role == "weight"],
        consts=[{"name": t.name, "offset": t.offset, "data": list(t.data)} for t in graph.tensors.values()
                if t.role == "const"],
        io={t.name: IOSlot(int(t.buf), t.offset, t.rows, t.cols) for t in graph.tensors.values()
            if t.role in ("input", "output")},
        passes=passes,
        estimate={"scheduler": opts.scheduler, "critical_path_ms": sched.makespan * 1e3,
                  "work_ms": sum(sched.busy) * 1e3, "balance": sched.balance,
                  "worker_ms": [b * 1e3 for b in sched.busy], "bytes": total_bytes,
                  "floor_ms": opts.cost.floor_seconds(step_bytes(cfg, shape.T, shape.B, shape.max_len).total) * 1e3},
        options={"workers": opts.workers, "scheduler": opts.scheduler, "cse": opts.cse, "fuse": opts.fuse,
                 "fusion_rules": list(opts.fusion_rules), "tiling": dataclasses.asdict(tiling),
                 "cost": dataclasses.asdict(opts.cost), **({"shared_counters": True} if opts.shared_counters else {}),
                 **({"stream_kernel": True, "stream_workers": opts.workers} if opts.stream_kernel else {})},
    )
    if opts.verify:
        report = verify_plan(plan, tasks=decoded)
        passes.append({"pass": "verify", **report})
    passes.append({"pass": "total", "compile_s": round(time.perf_counter() - t0, 3)})
    return plan


def attention_split(cfg: ModelConfig, shape: StepShape, workers: int) -> int:
    """Cache positions per attention task when the shape leaves it open: enough splits that the
    step's attention tasks (sequences x head groups x splits) cover the workers, since attention
    sits on every layer's dependency chain (docs/PERF.md, session 2); a whole number of the kernel's
    key blocks (32 positions for MLA's 512-wide latent rows, 64 for GQA: launch.block_sizes' BJ).
    dsv2-lite at ctx 4096: 128 tasks of 32 positions (64 of 64 until session 15: -1.2%)."""
    groups = 1 if cfg.is_mla else cfg.num_key_value_heads
    splits = max(1, workers // (shape.B * groups))
    block = 32 if cfg.is_mla and cfg.kv_lora_rank > 128 else 64  # launch.block_sizes' BJ: 32 when dmax > 128
    return max(block, block * math.ceil(shape.max_len / splits / block))


def canonical_weights(cfg: ModelConfig, helper_slots: int = -1, rules: tuple[str, ...] = ()) -> tuple:
    """The weight arena's order for every plan of a model: the order in which one decode step
    and every MTP layer, as the unfused graph first reads them.  Helper plans (helper_slots >= 0)
    have their own layout: one arena of main expert slots instead of every layer's experts.
    Fusion rules that derive weights (WEIGHT_RULES: the norm folds) lay out the graph fused by all of
    `rules` instead (which norms fold depends on the others: residual_norm keeps its norms): the
    derived weights, without those only they read.  Cached: every compile of a model asks for it, and
    plan_memory only reads the tensors it returns."""
    return _canonical(cfg, helper_slots, rules)[0]


def canonical_linear_rows(cfg: ModelConfig, helper_slots: int = -1, rules: tuple[str, ...] = ()) -> tuple:
    """(weight, K) for every weight the canonical graph's LINEAR ops read as w or w2 (K: the lcm of
    their K, the matrix's row length): where stream plans start a weight (plan_memory's row_align), so
    every stream plan of a model has one layout, whichever of those weights it reads."""
    return _canonical(cfg, helper_slots, rules)[1]


@functools.lru_cache(maxsize=16)  # one lowering (and, with a weight rule, fusion) per model and layout
def _canonical(cfg: ModelConfig, helper_slots: int, rules: tuple[str, ...]) -> tuple[tuple, tuple]:
    n = cfg.num_nextn_predict_layers
    graph = lower(cfg, StepShape(T=1, B=1, max_len=1 + n, mtp_passes=n, helper_slots=helper_slots))
    if any(r in WEIGHT_RULES for r in rules):
        cse(graph)
        fuse(graph, rules)
    rows: dict[str, int] = {}
    for op in graph.ops:
        if op.opcode in STREAM_OPCODES:
            for key in ("w", "w2"):
                if key in op.reads:
                    name = op.reads[key].tensor
                    rows[name] = math.lcm(rows.get(name, 1), int(op.attrs["K"]))
    return tuple(weight_order(graph)), tuple(rows.items())


def _wait_list(op: Op, deps: dict[int, set[int]], anc: list[int], ntasks: dict[int, int]) -> list[int]:
    """The producers op waits on: dependencies not implied by another dependency (transitive reduction)."""
    direct = [d for d in deps[op.id] if ntasks.get(d)]
    kept = [d for d in direct if not any(e != d and anc[e] >> d & 1 for e in direct)]
    if len(kept) > MAX_WAITS:
        raise CompileError(f"op {op.label} waits on {len(kept)} producers, more than the {MAX_WAITS} a task word holds")
    return sorted(kept)


def _fields(graph: Graph, op: Op, tile_fields: dict) -> dict:
    fields: dict = {}
    for name in OPCODES[op.opcode].fields:
        if "." in name:
            key, part = name.split(".")
            view = op.reads.get(key) or op.writes.get(key)
            if view is None:
                fields[name] = -1 if part == "buf" else 0
                continue
            t = graph.tensors[view.tensor]
            fields[name] = {"buf": int(t.buf), "off": t.offset + view.col0, "ld": t.ld}[part]
        elif name in tile_fields:
            fields[name] = tile_fields[name]
        else:
            fields[name] = op.attrs.get(name, 0)
    return fields


def _encode(graph: Graph, op_tiles, task_tile, queues, deps, shared: bool):
    """(words, task labels, queue pointers, counter labels).  Each op's tasks signal its counter (op id), or with
    `shared` the counter of its group (graph/counters.py), which then counts every member's tasks."""
    anc = ancestors(graph)
    ntasks = {op_id: len(t) for op_id, t in op_tiles.items()}
    producers = {op.id: _wait_list(op, deps, anc, ntasks) for op in graph.ops}
    counter = shared_counters(graph, producers, anc) if shared else {op.id: op.id for op in graph.ops}
    count: dict[int, int] = {}
    members: dict[int, list[str]] = {}
    for op in graph.ops:
        count[counter[op.id]] = count.get(counter[op.id], 0) + ntasks[op.id]
        members.setdefault(counter[op.id], []).append(op.label)
    waits = {op.id: sorted({(counter[d], count[counter[d]]) for d in producers[op.id]}) for op in graph.ops}
    rows, labels, ptr = [], [], [0]
    for queue in queues:
        for i in queue:
            op, k = task_tile[i]
            tile = op_tiles[op.id][k]
            opcode = OPCODES[op.opcode]
            flags = opcode.flag_bits(f for f in op.flags if f in opcode.flags)
            rows.append(encode(op.opcode, flags, counter[op.id], waits[op.id], k, _fields(graph, op, tile.fields)))
            labels.append(f"{op.label}[{k}]")
        ptr.append(len(rows))
    words = np.array(rows, dtype=np.int32).reshape(-1, WORDS)
    counter_labels = ["+".join(members[op.id]) if len(members.get(op.id, ())) > 1 else op.label for op in graph.ops]
    return words, labels, ptr, counter_labels
