"""Fusion: merge chains of ops into one op whose opcode runs the chain in a single task body.

Rules, applied in this order (each names what it merged in the report):
- swiglu:        LINEAR gate, LINEAR up, SiLU, mul        -> LINEAR[SILU_MUL]   (also for EXPERT_LINEAR)
- moe_epilogue:  ADD(MOE_COMBINE, shared); ADD(res, ...)   -> MOE_COMBINE[SHARED, RES]
                 (before residual_into_linear, so shared experts run beside the routed ones)
- residual_into_linear:  ADD(res, LINEAR out)             -> LINEAR[RES]
- residual_norm: ADD(a, b) feeding an RMSNORM              -> RMSNORM[ADD] (writes the sum too)
- rope_into_cache: CACHE_WRITE of a ROPE's whole output     -> ROPE[CACHE] (rotated keys go straight
                 into the cache: one hop fewer before attention; the same values, rounded once)
- norm_into_cache: CACHE_WRITE of an RMSNORM's whole output  -> RMSNORM[CACHE] (MLA's kv_a_norm writes the
                 normalized latent straight into the cache: one hop fewer per MLA layer; the same values,
                 computed in fp32 and rounded to the cache dtype once)
- rope_into_attention: GQA's ROPE of q, ROPE[CACHE] of k, CACHE_WRITE of v -> ATTENTION[ROPE] (each split
                 rotates its query rows, and the split whose rows hold the step's new positions rotates their
                 keys and writes them and their values into the cache before reading its rows: attention
                 waits on the projections, one phase and one hop fewer a layer)
- route:         ROUTE[SCORE], ROUTE[TOPK], ROUTE[SLOTS]   -> one ROUTE
- hc_coeff:      HC_COEFF mix, act, sinkhorn, collapse     -> one HC_COEFF
- norm_into_linear: RMSNORM read only as x by LINEARs      -> each LINEAR[NORM], the norm gone
                 (its weight g folded into each reader's weight columns, W' = W diag(g), rounded to
                 the model dtype when packed: megakernel/memory.py; the task scales its sums by
                 rsqrt(mean(x²) + eps)).  One hop fewer between a residual and its projections.
                 Not where a reader's weight has other readers (tied or shared heads): no copies.
- norm_beside_experts: the same for a MoE layer's norm, which its experts read too: the norm stays for
                 them (routed: EXPERT_LINEAR, and a HELPER_CALL sending their rows; shared: LINEAR), the
                 router alone folds it, exactly (LINEAR[NORM, PAIR] on W·diag(g)'s bf16 high and low
                 parts, since its sums rank experts), so the router starts one hop earlier, the norm runs
                 beside it (the route leaves it time), and every expert reads what the default plan's do.
- expert_mlp (opt-in): EXPERT_LINEAR[SILU_MUL] and the down projection reading it -> EXPERT_LINEAR[SILU_MUL,
                 DOWN_T]: each task's slice of intermediate rows also streams those rows of the down projection,
                 packed transposed, into partial rows that MOE_COMBINE sums (one phase and hop fewer a MoE layer,
                 and no down rows read in 2048-column chunks); then the shared experts beside them alike, as
                 LINEAR[SILU_MUL, DOWN_T] (their tasks fill the route's wait).  Not yet timed on a GPU.
- dense_mlp (opt-in): a dense MLP's LINEAR[SILU_MUL] and its down LINEAR (RES allowed) -> LINEAR[SILU_MUL, DOWN_T]
                 over fixed slices and a MOE_COMBINE with no routed experts (topk 0) that sums the slices' partial
                 rows and the residual: one phase of the MLP's bytes in tasks of ~768 KB, then a short reduction,
                 where gate|up and down were two phases of smaller tasks.  Not yet timed on a GPU.
A tensor is absorbed only when the fused op is its sole reader and it is not
an output.  The fused op takes the program position of the chain's last op.
CompileOptions.fusion_rules names the rules a plan applies (DEFAULT_RULES unless told).  Those in
WEIGHT_RULES change the packed weights, so plans that differ in them cannot share a weight arena; their code
is in graph/fusion_weights.py, what all rules share (the graph's producers and consumers, replacing a chain)
in graph/fusion_ctx.py.
"""

from __future__ import annotations

from . import fusion_weights
from .fusion_ctx import Ctx, new_op, whole
from .ir import Graph

RULES = ("swiglu", "moe_epilogue", "residual_into_linear", "residual_norm", "rope_into_cache", "norm_into_cache",
         "rope_into_attention", "route", "hc_coeff", "norm_into_linear", "norm_beside_experts", "expert_mlp",
         "dense_mlp")
# rules that derive packed weights (W' = W diag(g); expert_mlp, dense_mlp: down projections transposed)
WEIGHT_RULES = ("norm_into_linear", "norm_beside_experts", "expert_mlp", "dense_mlp")
# what a plan applies unless told.  norm_beside_experts stays opt-in: its first version (session 15: -2.8%,
# -3.1% on dsv2-lite) rounded the router's W·diag(g) to bf16, which moved routing decisions (1.2% of tokens per
# layer on random weights); its second (the router exact, the shared experts folded: -1.1%, session 16) still
# moved one greedy token of tiny-moe's 64-step teacher-forced GPU test.  This one, where only the router folds
# and every expert reads the norm's rows, has not run on a GPU
# expert_mlp and dense_mlp are opt-in until they are timed on a GPU (docs/NOTES.md, sessions 30-31)
DEFAULT_RULES = tuple(r for r in RULES if r not in ("norm_beside_experts", "expert_mlp", "dense_mlp"))


def _swiglu(ctx: Ctx) -> str | None:
    for mul in ctx.g.ops:
        if mul.opcode != "EWISE" or "MUL" not in mul.flags:
            continue
        silu = ctx.sole_producer(mul.reads["a"], "EWISE", "SILU")
        if silu is None or not ctx.private(silu.writes["out"].tensor, mul):
            continue
        for kind in ("LINEAR", "EXPERT_LINEAR"):
            gate = ctx.sole_producer(silu.reads["a"], kind)
            up = ctx.sole_producer(mul.reads["b"], kind)
            if gate is None or up is None or gate is up or gate.reads["x"] != up.reads["x"] \
                    or gate.flags != up.flags or gate.attrs.get("K") != up.attrs.get("K"):
                continue
            if not (ctx.private(gate.writes["out"].tensor, silu) and ctx.private(up.writes["out"].tensor, mul)):
                continue
            reads = dict(gate.reads)
            reads["w2"] = up.reads["w"]
            fused = new_op(gate, gate.flags | {"SILU_MUL"}, reads, {"out": mul.writes["out"]},
                         label=gate.label.rsplit(".", 1)[0] + ".gate_up")
            ctx.replace([gate, up, silu, mul], fused)
            return f"{gate.label} + {up.label} + silu + mul -> {kind}[SILU_MUL]"
    return None


def _residual_into_linear(ctx: Ctx) -> str | None:
    for add in ctx.g.ops:
        if add.opcode != "EWISE" or "ADD" not in add.flags or "b" not in add.reads:
            continue
        for res_key, lin_key in (("a", "b"), ("b", "a")):
            lin = ctx.sole_producer(add.reads[lin_key], "LINEAR")
            if lin is None or "RES" in lin.flags or not ctx.private(lin.writes["out"].tensor, add):
                continue
            reads = dict(lin.reads)
            reads["res"] = add.reads[res_key]
            fused = new_op(lin, lin.flags | {"RES"}, reads, {"out": add.writes["out"]})
            ctx.replace([lin, add], fused)
            return f"{add.label} -> {lin.label} LINEAR[RES]"
    return None


def _moe_epilogue(ctx: Ctx) -> str | None:
    for add in ctx.g.ops:
        if add.opcode != "EWISE" or "ADD" not in add.flags or "b" not in add.reads:
            continue
        for mine, other in (("a", "b"), ("b", "a")):
            comb = ctx.sole_producer(add.reads[mine], "MOE_COMBINE")
            if comb is None or not ctx.private(comb.writes["out"].tensor, add):
                continue
            slot = "sh" if "SHARED" not in comb.flags else "res" if "RES" not in comb.flags else None
            if slot is None:
                continue
            reads = dict(comb.reads)
            reads[slot] = add.reads[other]
            fused = new_op(comb, comb.flags | {"SHARED" if slot == "sh" else "RES"}, reads, {"out": add.writes["out"]})
            ctx.replace([comb, add], fused)
            return f"{add.label} -> {comb.label} MOE_COMBINE[{'SHARED' if slot == 'sh' else 'RES'}]"
    return None


def _residual_norm(ctx: Ctx) -> str | None:
    for norm in ctx.g.ops:
        if norm.opcode != "RMSNORM" or "ADD" in norm.flags:
            continue
        add = ctx.sole_producer(norm.reads["x"], "EWISE", "ADD")
        if add is None or "b" not in add.reads or norm.reads["x"].col0:
            continue
        summed = add.writes["out"].tensor
        if any(op.id < norm.id for op in ctx.cons.get(summed, []) if op is not norm):
            continue  # another reader sits between the add and the norm
        reads = dict(norm.reads)
        reads["x"], reads["d"] = add.reads["a"], add.reads["b"]
        writes = dict(norm.writes)
        if ctx.g.tensors[summed].role == "output" or not ctx.private(summed, norm):
            writes["xo"] = add.writes["out"]
        fused = new_op(norm, norm.flags | {"ADD"}, reads, writes)
        ctx.replace([add, norm], fused)
        return f"{add.label} -> {norm.label} RMSNORM[ADD]"
    return None


def _rope_into_cache(ctx: Ctx) -> str | None:
    for write in ctx.g.ops:
        if write.opcode != "CACHE_WRITE":
            continue
        rope = ctx.sole_producer(write.reads["src"], "ROPE")
        if rope is None or not ctx.private(rope.writes["out"].tensor, write):
            continue
        a = rope.attrs
        if write.attrs["cols"] != a["heads"] * a["out_hs"] or a["out_hs"] != 2 * a["half"]:
            continue  # heads not packed back to back in the cache row
        attrs = {**a, **{k: write.attrs[k] for k in ("T", "S", "width", "col0", "pos_offset")}}
        fused = new_op(rope, rope.flags | {"CACHE"}, {**rope.reads, "cl": write.reads["cl"]},
                     {"cache": write.writes["cache"]}, attrs)
        ctx.replace([rope, write], fused)
        return f"{write.label} -> {rope.label} ROPE[CACHE]"
    return None


def _norm_into_cache(ctx: Ctx) -> str | None:
    for write in ctx.g.ops:
        if write.opcode != "CACHE_WRITE":
            continue
        norm = ctx.sole_producer(write.reads["src"], "RMSNORM")
        if norm is None or "ADD" in norm.flags or set(norm.writes) != {"out"}:
            continue  # RMSNORM[ADD] also writes the sum (xo)
        out = norm.writes["out"]
        if not whole(ctx, out) or not ctx.private(out.tensor, write) or norm.attrs["D"] != write.attrs["cols"] \
                or norm.attrs["rows"] != write.attrs["rows"]:
            continue  # rows that are not the whole tensor, or another reader of the norm's rows
        attrs = {**norm.attrs, **{k: write.attrs[k] for k in ("T", "S", "width", "col0", "pos_offset")}}
        fused = new_op(norm, norm.flags | {"CACHE"}, {**norm.reads, "cl": write.reads["cl"]},
                     {"cache": write.writes["cache"]}, attrs)
        ctx.replace([norm, write], fused)
        return f"{write.label} -> {norm.label} RMSNORM[CACHE]"
    return None


def _rope_into_attention(ctx: Ctx) -> str | None:
    for att in ctx.g.ops:
        if att.opcode != "ATTENTION" or att.flags & {"MLA", "ROPE"}:
            continue
        a = att.attrs
        qr = ctx.sole_producer(att.reads["q"], "ROPE")
        cache = att.reads["cache"].tensor
        writers = ctx.prod.get(cache, [])
        kr = next((op for op in writers if op.opcode == "ROPE" and "CACHE" in op.flags), None)
        cw = next((op for op in writers if op.opcode == "CACHE_WRITE"), None)
        if qr is None or kr is None or cw is None or len(writers) != 2 or ctx.cons.get(cache) != [att]:
            continue  # another pass writes or reads this cache in the step (draft passes): left as it is
        if ((qr.flags | kr.flags) & {"INTERLEAVE"} or "CACHE" in qr.flags
                or not ctx.private(qr.writes["out"].tensor, att)):
            continue
        q, k = qr.attrs, kr.attrs
        kn, vn = kr.reads["x"], cw.reads["src"]
        full_heads = (2 * q["half"] == a["dim"] and q["out_hs"] == a["q_hs"] and a["q_col0"] == 0
                      and q["heads"] == a["nheads"] and k["half"] == q["half"])
        kv_layout = (k["col0"] == 0 and k["out_hs"] == k["x_hs"] == a["kv_hs"] and k["x_col0"] == 0
                     and cw.attrs["col0"] == a["v_col0"] and cw.attrs["cols"] == k["heads"] * a["kv_hs"]
                     and kn.col0 == 0 and vn.col0 == 0
                     and ctx.g.tensors[kn.tensor].ld == ctx.g.tensors[vn.tensor].ld
                     and k["pos_offset"] == cw.attrs["pos_offset"] == a["pos_offset"])
        if not (full_heads and kv_layout and qr.reads["tab"] == kr.reads["tab"] and whole(ctx, qr.reads["tab"])):
            continue
        reads = {**att.reads, "q": qr.reads["x"], "tab": qr.reads["tab"], "kn": kn, "vn": vn}
        attrs = {**a, "q_hs": q["x_hs"], "q_col0": q["x_col0"]}
        fused = new_op(att, att.flags | {"ROPE"}, reads, {**att.writes, "cache": att.reads["cache"]}, attrs)
        ctx.replace([qr, kr, cw, att], fused)
        return f"{qr.label} + {kr.label} + {cw.label} -> {att.label} ATTENTION[ROPE]"
    return None


def _merge_stages(ctx: Ctx, opcode: str, stages: tuple[str, ...], label_suffix: str,
                  scratch: tuple[str, ...] = ()) -> str | None:
    """Merge an op running stage s with the op running the next stage on its private outputs.
    Outputs named in `scratch` stay in memory even when private: the fused task body hands them
    from one stage to the next through memory."""
    for first in ctx.g.ops:
        if first.opcode != opcode:
            continue
        for second in ctx.g.ops[first.id + 1:]:
            if second.opcode != opcode or second.layer != first.layer:
                continue
            produced = {v.tensor for v in first.writes.values()}
            used = [k for k, v in second.reads.items() if v.tensor in produced]
            if not used:
                continue
            mine = [s for s in stages if s in first.flags]
            theirs = [s for s in stages if s in second.flags]
            if not mine or not theirs or stages.index(theirs[0]) != stages.index(mine[-1]) + 1:
                break
            between = [op for t in produced for op in ctx.cons.get(t, []) if first.id < op.id < second.id]
            if between:
                break  # another op reads a stage output before the second stage: fusing would move the write past it
            reads = dict(first.reads)
            reads.update({k: v for k, v in second.reads.items() if v.tensor not in produced})
            writes = {k: v for k, v in first.writes.items() if k in scratch or not ctx.private(v.tensor, second)}
            writes.update(second.writes)
            flags = first.flags | second.flags
            label = first.label.rsplit(".", 1)[0] + label_suffix
            fused = new_op(first, flags, reads, writes, label=label)
            ctx.replace([first, second], fused)
            return f"{first.label} + {second.label} -> {opcode}[{'|'.join(s for s in stages if s in flags)}]"
    return None


def fuse(graph: Graph, rules: tuple[str, ...] = DEFAULT_RULES) -> dict:
    before = len(graph.ops)
    unknown = set(rules) - set(RULES)
    if unknown:
        raise ValueError(f"unknown fusion rule(s) {sorted(unknown)}; rules are {RULES}")
    ctx = Ctx(graph)
    impl = {
        "swiglu": _swiglu,
        "residual_into_linear": _residual_into_linear,
        "moe_epilogue": _moe_epilogue,
        "residual_norm": _residual_norm,
        "rope_into_cache": _rope_into_cache,
        "norm_into_cache": _norm_into_cache,
        "rope_into_attention": _rope_into_attention,
        # ROUTE's slot-table stage reads the top-k ids back from memory (megakernel/ops/moe.py)
        "route": lambda c: _merge_stages(c, "ROUTE", ("SCORE", "TOPK", "SLOTS"), ".route", scratch=("ids",)),
        "hc_coeff": lambda c: _merge_stages(c, "HC_COEFF", ("MIX", "ACT", "SINK", "COLLAPSE"), ".coeff"),
        "norm_into_linear": fusion_weights.norm_into_linear,
        "norm_beside_experts": lambda c: fusion_weights.norm_into_linear(c, beside_experts=True),
        "expert_mlp": fusion_weights.expert_mlp,
        "dense_mlp": fusion_weights.dense_mlp,
    }
    changes, per_rule = [], {}
    for rule in RULES:
        if rule not in rules:
            continue
        while (change := impl[rule](ctx)) is not None:
            changes.append(change)
            per_rule[rule] = per_rule.get(rule, 0) + 1
    graph.prune()
    return {"pass": "fusion", "ops_before": before, "ops_after": len(graph.ops), "fused": len(changes),
            "per_rule": per_rule, "changes": changes}
