"""Fusion rules that derive packed weights (fusion.WEIGHT_RULES): plans that differ in them cannot share a weight
arena.

- norm_into_linear / norm_beside_experts: an RMSNorm's weight g folded into the projections that read it,
  W' = W diag(g) (the router's exactly, as a bf16 high and low pair);
- expert_mlp: a MoE layer's routed, then shared, expert MLPs as one phase of tasks over fixed slices of
  intermediate rows, their down projections packed transposed (k-major), MOE_COMBINE summing the partial rows;
- dense_mlp: a dense MLP the same way, with a MOE_COMBINE of no routed experts as its reduction.
The rules' texts are in graph/fusion.py's docstring.
"""

from __future__ import annotations

from .fusion_ctx import Ctx, new_op, whole
from .ir import TRANSPOSED, Op, Tensor, View
from .isa import Buf

EXPERT_SLICE_ROWS = 64  # expert_mlp: intermediate rows a task takes (fixed by the model: batch invariance)
# and of the shared experts' MLP, smaller: its tasks run while the router and route decide the routed ones (~9 us
# on dsv2-lite), so its 2816 rows make one short task a worker (118 of 288 KB), not 44 of 768 KB that would hold
# a third of the workers well into the routed phase
SHARED_SLICE_ROWS = 24
# dense_mlp: about this many slices of a dense MLP's intermediate rows (multiples of 8 rows, fixed by the model):
# one a worker on a 132-SM H200 (llama-1b: 128 slices of 64 rows, 768 KB tasks)
DENSE_SLICES = 128


def _scaled_weight(ctx: Ctx, w: str, g: str, part: str = "") -> str:
    """The tensor of weight w with its columns scaled by the 1-row weight g (packed as such).  part "hi" or
    "lo": W·diag(g) rounded to the model dtype, or what that rounding left out, itself rounded (the two sum
    to W·diag(g) within ~2^-16 of it in bf16: megakernel/memory.py packs them)."""
    name = f"{w}*{g}" + (f"~{part}" if part else "")
    if name not in ctx.g.tensors:
        src, (g_part,) = ctx.g.tensors[w], ctx.g.tensors[g].parts
        ctx.g.add_tensor(Tensor(name, src.buf, src.rows, src.cols, role="weight",
                                parts=tuple((hf, rel, g_part[0], *([part] if part else [])) for hf, rel in src.parts)))
    return name


def _scaled_alike(ctx: Ctx, op: Op, g: str) -> bool:
    """op would read its weights scaled by g too: a LINEAR of a norm with weight g (the same layer's
    projection in another MTP pass)."""
    norm = ctx.sole_producer(op.reads["x"], "RMSNORM") if op.opcode == "LINEAR" else None
    return norm is not None and "ADD" not in norm.flags and "w" in norm.reads and norm.reads["w"].tensor == g


def _feeds_route(ctx: Ctx, op: Op) -> bool:
    """A router: a LINEAR whose sums a ROUTE ranks."""
    return any(c.opcode == "ROUTE" for c in ctx.cons.get(op.writes["out"].tensor, []))


def norm_into_linear(ctx: Ctx, beside_experts: bool = False) -> str | None:
    """beside_experts: only norms that routed experts read too, folded into the router alone."""
    for norm in ctx.g.ops:
        if norm.opcode != "RMSNORM" or "ADD" in norm.flags or "out" not in norm.writes \
                or not whole(ctx, norm.writes["out"]):  # (an RMSNORM[CACHE] writes no rows)
            continue
        out = norm.writes["out"].tensor
        every = ctx.cons.get(out, [])
        if ctx.g.tensors[out].role != "act" or not every or len(ctx.prod.get(out, [])) != 1:
            continue
        readers = [op for op in every if op.opcode == "LINEAR" and "NORM" not in op.flags
                   and op.attrs.get("K") == norm.attrs["D"] and whole(ctx, op.reads["x"])
                   and [k for k, v in op.reads.items() if v.tensor == out] == ["x"]]
        others = [op for op in every if op not in readers]
        # beside experts, the norm stays for the routed experts' rows (and a helper call's copy of them)
        if not readers or bool(others) != beside_experts or any(op.opcode not in ("EXPERT_LINEAR", "HELPER_CALL")
                                                                 for op in others):
            continue
        if beside_experts:  # only the router folds it (exactly); the shared experts read the norm's rows too, so
            # every expert's input stays the default plan's (a bf16 fold there moved a greedy token of tiny-moe's
            # 64-step teacher-forced GPU test, docs/PERF.md session 16)
            others += [op for op in readers if not _feeds_route(ctx, op)]
            readers = [op for op in readers if _feeds_route(ctx, op)]
            if not readers:
                continue
        g = norm.reads.get("w")
        if g is not None and (len(ctx.g.tensors[g.tensor].parts) != 1 or any(
                not _scaled_alike(ctx, other, g.tensor) for op in readers for k in ("w", "w2") if k in op.reads
                for other in ctx.cons[op.reads[k].tensor])):
            continue  # a weight another op reads unscaled (a tied or shared head) would need a scaled copy
        fused = {}
        for lin in readers:
            reads = dict(lin.reads)
            reads["x"] = norm.reads["x"]
            flags = lin.flags | {"NORM"}
            # a router's sums pick experts by rank: rounded scaled weights would move tokens to other experts
            # (1.2% of tokens per layer on dsv2-lite's router with random weights), so it reads W·diag(g) as
            # two matrices, exact to ~2^-16 (docs/NOTES.md, session 15)
            exact = g is not None and "w2" not in reads and _feeds_route(ctx, lin)
            if exact:
                w = reads["w"].tensor
                reads["w"], reads["w2"] = (View(_scaled_weight(ctx, w, g.tensor, part)) for part in ("hi", "lo"))
                flags |= {"PAIR"}
            elif g is not None:
                for key in ("w", "w2"):
                    if key in reads:
                        reads[key] = View(_scaled_weight(ctx, reads[key].tensor, g.tensor))
            fused[id(lin)] = new_op(lin, flags, reads, dict(lin.writes), attrs={**lin.attrs, "eps": norm.attrs["eps"]})
            fused[id(lin)].fused_from = lin.fused_from + (norm.label,)
        ctx.g.ops = [fused.get(id(op), op) for op in ctx.g.ops if op is not norm or others]
        ctx.refresh()
        kept = f" (kept for {', '.join(op.label for op in others)})" if others else ""
        return f"{norm.label} -> {', '.join(op.label for op in readers)} LINEAR[NORM]{kept}"
    return None


def _transposed(ctx: Ctx, weight: str, expert_mlp: tuple[int, int] | None = None) -> str:
    """The weight with its down projections packed transposed, so a task reads rows r0..r1 of one (one per
    intermediate row, H wide) as contiguous k-major rows: a one-part down projection (H x I, stored I x H), or with
    expert_mlp = (I, H) the routed experts' tensor (row e = gate | up | down), only each expert's down block."""
    name = weight + TRANSPOSED
    if name not in ctx.g.tensors:
        src = ctx.g.tensors[weight]
        if expert_mlp is None:
            rows, cols, downs = src.cols, src.rows, src.parts
        else:
            I, H = expert_mlp
            rows, cols, downs = src.rows, src.cols, [p for p in src.parts if p[1] % (3 * I * H) >= 2 * I * H]
        parts = tuple((hf, rel, TRANSPOSED) if (hf, rel) in downs else (hf, rel) for hf, rel in src.parts)
        ctx.g.add_tensor(Tensor(name, src.buf, rows, cols, role="weight", parts=parts))
    return name


def _partials(ctx: Ctx, base: str, rows: int, cols: int) -> View:
    """A fresh [rows, cols] fp32 tensor for an MLP's partial rows (named base, base#1, ... for an MTP layer lowered
    for several passes)."""
    name, copy = base, 0
    while name in ctx.g.tensors:
        copy += 1
        name = f"{base}#{copy}"
    return View(ctx.g.add_tensor(Tensor(name, Buf.A, rows, cols)))


def _expert_mlp(ctx: Ctx) -> str | None:
    """EXPERT_LINEAR[SILU_MUL] (gate|up) and the down projection that alone reads its rows -> one
    EXPERT_LINEAR[SILU_MUL, DOWN_T]: a task takes EXPERT_SLICE_ROWS intermediate rows of its slot's expert, keeps
    their SiLU·mul values (out, now its scratch), and streams the same rows of the down projection packed
    transposed into a partial row per pair (y: slices x pairs x H); MOE_COMBINE sums the slices.  The gate|up ->
    down hop and its phase go, and the down projection's rows are read as they are packed (K = 1408 rows no longer
    stream in 2048-column chunks).  Not in helper plans (a map, or a HELPER_WAIT between down and combine)."""
    for g in ctx.g.ops:
        if g.opcode != "EXPERT_LINEAR" or "SILU_MUL" not in g.flags or "DOWN_T" in g.flags or "map" in g.reads:
            continue
        h = g.writes["out"].tensor
        downs = ctx.cons.get(h, [])
        if len(downs) != 1 or downs[0].opcode != "EXPERT_LINEAR" or downs[0].flags or "map" in downs[0].reads:
            continue
        d = downs[0]
        combines = ctx.cons.get(d.writes["out"].tensor, [])
        if (len(combines) != 1 or combines[0].opcode != "MOE_COMBINE" or combines[0].attrs.get("ns", 1) > 1
                or d.reads["st"] != g.reads["st"] or d.reads["w"].tensor != g.reads["w"].tensor
                or not whole(ctx, d.reads["x"])):
            continue
        comb, I, H = combines[0], g.attrs["rows"], d.attrs["rows"]
        if H != g.attrs["K"] or I % EXPERT_SLICE_ROWS % 8:
            continue
        experts = _transposed(ctx, g.reads["w"].tensor, expert_mlp=(I, H))
        pairs = g.attrs["N"] * g.attrs["topk"]
        ns = -(-I // EXPERT_SLICE_ROWS)
        y = _partials(ctx, g.label.rsplit(".", 1)[0] + ".down_partials", ns * pairs, H)
        reads = dict(g.reads)
        reads.update(w=View(experts, g.reads["w"].col0), w2=View(experts, g.reads["w2"].col0),
                     wd=View(experts, d.reads["w"].col0))
        fused = new_op(g, g.flags | {"DOWN_T"}, reads, {"out": g.writes["out"], "y": y},
                     attrs={**g.attrs, "slice_rows": EXPERT_SLICE_ROWS}, label=g.label.rsplit(".", 1)[0] + ".mlp")
        ctx.replace([g, d], fused)
        summed = new_op(comb, comb.flags, {**comb.reads, "y": y}, dict(comb.writes),
                      attrs={**comb.attrs, "ns": ns, "ys": pairs})
        ctx.replace([comb], summed)
        return f"{g.label} + {d.label} -> EXPERT_LINEAR[SILU_MUL|DOWN_T] ({ns} slices), {comb.label} sums them"
    return None


def _gate_up_of(ctx: Ctx, d: Op) -> Op | None:
    """The LINEAR[SILU_MUL] (NORM allowed) whose rows only the down projection d reads, where d's weight (H x I, one
    part, read whole) can be packed transposed: the MLP a DOWN_T task can run whole."""
    g = ctx.sole_producer(d.reads["x"], "LINEAR", "SILU_MUL")
    if g is None or not g.flags <= {"SILU_MUL", "NORM"} or not ctx.private(g.writes["out"].tensor, d):
        return None
    w = d.reads["w"]
    if d.attrs["rows"] != g.attrs["K"] or d.attrs["K"] != g.attrs["rows"] or not whole(ctx, w) \
            or len(ctx.g.tensors[w.tensor].parts) != 1:
        return None
    return g


def _fuse_mlp(ctx: Ctx, g: Op, d: Op, rows: int, label: str) -> tuple[Op, View, int]:
    """g (gate|up) and d (down) -> one LINEAR[SILU_MUL, DOWN_T] over slices of `rows` intermediate rows: each task
    keeps its slice's SiLU·mul values (out, now its scratch) and streams the same rows of the down projection packed
    transposed into a partial row per token.  (The fused op; its partials, slices x N x H; the slice count.)"""
    I, H, N = g.attrs["rows"], g.attrs["K"], g.attrs["N"]
    slices = -(-I // rows)
    partials = _partials(ctx, g.label.rsplit(".", 1)[0] + ".down_partials", slices * N, H)
    fused = new_op(g, g.flags | {"DOWN_T"}, {**g.reads, "wd": View(_transposed(ctx, d.reads["w"].tensor))},
                 {"out": g.writes["out"], "y": partials}, attrs={**g.attrs, "slice_rows": rows}, label=label)
    ctx.replace([g, d], fused)
    return fused, partials, slices


def _shared_mlp(ctx: Ctx) -> str | None:
    """The shared experts beside fused routed ones (expert_mlp): LINEAR[SILU_MUL] (gate|up) and the plain LINEAR down,
    whose rows MOE_COMBINE[SHARED] alone adds -> LINEAR[SILU_MUL, DOWN_T] over fixed slices of SHARED_SLICE_ROWS
    (_fuse_mlp), whose partials MOE_COMBINE sums.  Its tasks need no gate|up -> down hop, so they fill the route's
    wait."""
    for comb in ctx.g.ops:
        if comb.opcode != "MOE_COMBINE" or "SHARED" not in comb.flags or "ns" not in comb.attrs \
                or "nsh" in comb.attrs:
            continue  # only beside routed experts this rule fused (helper plans keep both as they are), once
        d = ctx.sole_producer(comb.reads["sh"], "LINEAR")
        g = None if d is None or d.flags or not ctx.private(d.writes["out"].tensor, comb) else _gate_up_of(ctx, d)
        if g is None or g.attrs["rows"] % SHARED_SLICE_ROWS % 8:
            continue
        _, sh, nsh = _fuse_mlp(ctx, g, d, SHARED_SLICE_ROWS, g.label.rsplit(".", 1)[0] + ".mlp")
        ctx.replace([comb], new_op(comb, comb.flags, {**comb.reads, "sh": sh}, dict(comb.writes),
                                 attrs={**comb.attrs, "nsh": nsh, "shs": g.attrs["N"]}))
        return f"{g.label} + {d.label} -> LINEAR[SILU_MUL|DOWN_T] ({nsh} slices), {comb.label} sums them"
    return None


def dense_mlp(ctx: Ctx) -> str | None:
    """A dense MLP (not a MoE layer's shared experts: expert_mlp's): LINEAR[SILU_MUL] (gate|up) and the LINEAR down
    (RES allowed) that alone reads its rows -> LINEAR[SILU_MUL, DOWN_T] over fixed slices of ~I / DENSE_SLICES rows
    (_fuse_mlp), and a MOE_COMBINE[SHARED(, RES)] with topk 0 (a dense MLP is an always-chosen expert: the shared
    experts' path) that sums the partials in a fixed order and adds the residual."""
    for d in ctx.g.ops:
        if d.opcode != "LINEAR" or not d.flags <= {"RES"} \
                or any(op.opcode == "MOE_COMBINE" for op in ctx.cons.get(d.writes["out"].tensor, [])):
            continue
        g = _gate_up_of(ctx, d)
        if g is None:
            continue
        I, H, N = g.attrs["rows"], g.attrs["K"], g.attrs["N"]
        base = g.label.rsplit(".", 1)[0]
        rows = 8 * -(-I // (8 * DENSE_SLICES))
        fused, sh, nsh = _fuse_mlp(ctx, g, d, rows, base)
        reads, flags = {"sh": sh}, {"SHARED"}
        if "RES" in d.flags:
            reads["res"], flags = d.reads["res"], flags | {"RES"}
        reduce = Op(-1, "MOE_COMBINE", frozenset(flags), {"H": H, "topk": 0, "rows": N, "nsh": nsh, "shs": N}, reads,
                    dict(d.writes), base + ".reduce", d.layer, fused_from=(g.label, d.label))
        ctx.g.ops.insert(next(i for i, op in enumerate(ctx.g.ops) if op is fused) + 1, reduce)
        ctx.refresh()
        return f"{g.label} + {d.label} -> LINEAR[SILU_MUL|DOWN_T] ({nsh} slices of {rows}) + MOE_COMBINE sum"
    return None


def expert_mlp(ctx: Ctx) -> str | None:
    """Rule expert_mlp: the routed experts first (their fused combine is what marks a MoE layer's shared experts
    for _shared_mlp)."""
    return _expert_mlp(ctx) or _shared_mlp(ctx)
