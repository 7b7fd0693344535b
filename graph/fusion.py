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
WEIGHT_RULES change the packed weights, so plans that differ in them cannot share a weight arena.
"""

from __future__ import annotations

from .ir import TRANSPOSED, Graph, Op, Tensor, View
from .isa import Buf

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
EXPERT_SLICE_ROWS = 64  # expert_mlp: intermediate rows a task takes (fixed by the model: batch invariance)
# and of the shared experts' MLP, smaller: its tasks run while the router and route decide the routed ones (~9 us
# on dsv2-lite), so its 2816 rows make one short task a worker (118 of 288 KB), not 44 of 768 KB that would hold
# a third of the workers well into the routed phase
SHARED_SLICE_ROWS = 24
# dense_mlp: about this many slices of a dense MLP's intermediate rows (multiples of 8 rows, fixed by the model):
# one a worker on a 132-SM H200 (llama-1b: 128 slices of 64 rows, 768 KB tasks)
DENSE_SLICES = 128


class _Ctx:
    def __init__(self, graph: Graph):
        self.g = graph
        self.refresh()

    def refresh(self) -> None:
        self.g.renumber()
        self.prod = {}
        self.cons: dict[str, list[Op]] = {}
        for op in self.g.ops:
            for v in op.writes.values():
                self.prod.setdefault(v.tensor, []).append(op)
            for v in op.reads.values():
                self.cons.setdefault(v.tensor, []).append(op)

    def sole_producer(self, view: View, opcode: str, flag: str | None = None) -> Op | None:
        """The single op writing this whole tensor, if it has that opcode (and flag)."""
        if view.col0 or view.cols is not None:
            return None
        ops = self.prod.get(view.tensor, [])
        if len(ops) != 1 or ops[0].opcode != opcode or (flag and flag not in ops[0].flags):
            return None
        return ops[0]

    def private(self, tensor: str, reader: Op) -> bool:
        """Only `reader` reads it and it is an ordinary activation."""
        t = self.g.tensors[tensor]
        return t.role == "act" and all(op is reader for op in self.cons.get(tensor, []))

    def replace(self, absorbed: list[Op], fused: Op) -> None:
        last = max(op.id for op in absorbed)
        fused.fused_from = tuple(op.label for op in sorted(absorbed, key=lambda o: o.id))
        gone = {id(op) for op in absorbed}
        ops = []
        for op in self.g.ops:
            if op.id == last:
                ops.append(fused)
            elif id(op) not in gone:
                ops.append(op)
        self.g.ops = ops
        self.refresh()


def _new(op: Op, flags, reads, writes, attrs=None, label=None) -> Op:
    return Op(-1, op.opcode, frozenset(flags), dict(attrs or op.attrs), reads, writes, label or op.label, op.layer)


def _swiglu(ctx: _Ctx) -> str | None:
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
            fused = _new(gate, gate.flags | {"SILU_MUL"}, reads, {"out": mul.writes["out"]},
                         label=gate.label.rsplit(".", 1)[0] + ".gate_up")
            ctx.replace([gate, up, silu, mul], fused)
            return f"{gate.label} + {up.label} + silu + mul -> {kind}[SILU_MUL]"
    return None


def _residual_into_linear(ctx: _Ctx) -> str | None:
    for add in ctx.g.ops:
        if add.opcode != "EWISE" or "ADD" not in add.flags or "b" not in add.reads:
            continue
        for res_key, lin_key in (("a", "b"), ("b", "a")):
            lin = ctx.sole_producer(add.reads[lin_key], "LINEAR")
            if lin is None or "RES" in lin.flags or not ctx.private(lin.writes["out"].tensor, add):
                continue
            reads = dict(lin.reads)
            reads["res"] = add.reads[res_key]
            fused = _new(lin, lin.flags | {"RES"}, reads, {"out": add.writes["out"]})
            ctx.replace([lin, add], fused)
            return f"{add.label} -> {lin.label} LINEAR[RES]"
    return None


def _moe_epilogue(ctx: _Ctx) -> str | None:
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
            fused = _new(comb, comb.flags | {"SHARED" if slot == "sh" else "RES"}, reads, {"out": add.writes["out"]})
            ctx.replace([comb, add], fused)
            return f"{add.label} -> {comb.label} MOE_COMBINE[{'SHARED' if slot == 'sh' else 'RES'}]"
    return None


def _residual_norm(ctx: _Ctx) -> str | None:
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
        fused = _new(norm, norm.flags | {"ADD"}, reads, writes)
        ctx.replace([add, norm], fused)
        return f"{add.label} -> {norm.label} RMSNORM[ADD]"
    return None


def _rope_into_cache(ctx: _Ctx) -> str | None:
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
        fused = _new(rope, rope.flags | {"CACHE"}, {**rope.reads, "cl": write.reads["cl"]},
                     {"cache": write.writes["cache"]}, attrs)
        ctx.replace([rope, write], fused)
        return f"{write.label} -> {rope.label} ROPE[CACHE]"
    return None


def _norm_into_cache(ctx: _Ctx) -> str | None:
    for write in ctx.g.ops:
        if write.opcode != "CACHE_WRITE":
            continue
        norm = ctx.sole_producer(write.reads["src"], "RMSNORM")
        if norm is None or "ADD" in norm.flags or set(norm.writes) != {"out"}:
            continue  # RMSNORM[ADD] also writes the sum (xo)
        out = norm.writes["out"]
        if not _whole(ctx, out) or not ctx.private(out.tensor, write) or norm.attrs["D"] != write.attrs["cols"] \
                or norm.attrs["rows"] != write.attrs["rows"]:
            continue  # rows that are not the whole tensor, or another reader of the norm's rows
        attrs = {**norm.attrs, **{k: write.attrs[k] for k in ("T", "S", "width", "col0", "pos_offset")}}
        fused = _new(norm, norm.flags | {"CACHE"}, {**norm.reads, "cl": write.reads["cl"]},
                     {"cache": write.writes["cache"]}, attrs)
        ctx.replace([norm, write], fused)
        return f"{write.label} -> {norm.label} RMSNORM[CACHE]"
    return None


def _rope_into_attention(ctx: _Ctx) -> str | None:
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
        if (qr.flags | kr.flags) & {"INTERLEAVE"} or "CACHE" in qr.flags or not ctx.private(qr.writes["out"].tensor, att):
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
        if not (full_heads and kv_layout and qr.reads["tab"] == kr.reads["tab"] and _whole(ctx, qr.reads["tab"])):
            continue
        reads = {**att.reads, "q": qr.reads["x"], "tab": qr.reads["tab"], "kn": kn, "vn": vn}
        attrs = {**a, "q_hs": q["x_hs"], "q_col0": q["x_col0"]}
        fused = _new(att, att.flags | {"ROPE"}, reads, {**att.writes, "cache": att.reads["cache"]}, attrs)
        ctx.replace([qr, kr, cw, att], fused)
        return f"{qr.label} + {kr.label} + {cw.label} -> {att.label} ATTENTION[ROPE]"
    return None


def _whole(ctx: _Ctx, view: View) -> bool:
    return view.col0 == 0 and view.cols in (None, ctx.g.tensors[view.tensor].cols)


def _scaled_weight(ctx: _Ctx, w: str, g: str, part: str = "") -> str:
    """The tensor of weight w with its columns scaled by the 1-row weight g (packed as such).  part "hi" or
    "lo": W·diag(g) rounded to the model dtype, or what that rounding left out, itself rounded (the two sum
    to W·diag(g) within ~2^-16 of it in bf16: megakernel/memory.py packs them)."""
    name = f"{w}*{g}" + (f"~{part}" if part else "")
    if name not in ctx.g.tensors:
        src, (g_part,) = ctx.g.tensors[w], ctx.g.tensors[g].parts
        ctx.g.add_tensor(Tensor(name, src.buf, src.rows, src.cols, role="weight",
                                parts=tuple((hf, rel, g_part[0], *([part] if part else [])) for hf, rel in src.parts)))
    return name


def _scaled_alike(ctx: _Ctx, op: Op, g: str) -> bool:
    """op would read its weights scaled by g too: a LINEAR of a norm with weight g (the same layer's
    projection in another MTP pass)."""
    norm = ctx.sole_producer(op.reads["x"], "RMSNORM") if op.opcode == "LINEAR" else None
    return norm is not None and "ADD" not in norm.flags and "w" in norm.reads and norm.reads["w"].tensor == g


def _feeds_route(ctx: _Ctx, op: Op) -> bool:
    """A router: a LINEAR whose sums a ROUTE ranks."""
    return any(c.opcode == "ROUTE" for c in ctx.cons.get(op.writes["out"].tensor, []))


def _norm_into_linear(ctx: _Ctx, beside_experts: bool = False) -> str | None:
    """beside_experts: only norms that routed experts read too, folded into the router alone."""
    for norm in ctx.g.ops:
        if norm.opcode != "RMSNORM" or "ADD" in norm.flags or "out" not in norm.writes \
                or not _whole(ctx, norm.writes["out"]):  # (an RMSNORM[CACHE] writes no rows)
            continue
        out = norm.writes["out"].tensor
        every = ctx.cons.get(out, [])
        if ctx.g.tensors[out].role != "act" or not every or len(ctx.prod.get(out, [])) != 1:
            continue
        readers = [op for op in every if op.opcode == "LINEAR" and "NORM" not in op.flags
                   and op.attrs.get("K") == norm.attrs["D"] and _whole(ctx, op.reads["x"])
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
            fused[id(lin)] = _new(lin, flags, reads, dict(lin.writes), attrs={**lin.attrs, "eps": norm.attrs["eps"]})
            fused[id(lin)].fused_from = lin.fused_from + (norm.label,)
        ctx.g.ops = [fused.get(id(op), op) for op in ctx.g.ops if op is not norm or others]
        ctx.refresh()
        kept = f" (kept for {', '.join(op.label for op in others)})" if others else ""
        return f"{norm.label} -> {', '.join(op.label for op in readers)} LINEAR[NORM]{kept}"
    return None


def _transposed(ctx: _Ctx, weight: str, expert_mlp: tuple[int, int] | None = None) -> str:
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


def _partials(ctx: _Ctx, base: str, rows: int, cols: int) -> View:
    """A fresh [rows, cols] fp32 tensor for an MLP's partial rows (named base, base#1, ... for an MTP layer lowered
    for several passes)."""
    name, copy = base, 0
    while name in ctx.g.tensors:
        copy += 1
        name = f"{base}#{copy}"
    return View(ctx.g.add_tensor(Tensor(name, Buf.A, rows, cols)))


def _expert_mlp(ctx: _Ctx) -> str | None:
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
                or not _whole(ctx, d.reads["x"])):
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
        fused = _new(g, g.flags | {"DOWN_T"}, reads, {"out": g.writes["out"], "y": y},
                     attrs={**g.attrs, "slice_rows": EXPERT_SLICE_ROWS}, label=g.label.rsplit(".", 1)[0] + ".mlp")
        ctx.replace([g, d], fused)
        summed = _new(comb, comb.flags, {**comb.reads, "y": y}, dict(comb.writes),
                      attrs={**comb.attrs, "ns": ns, "ys": pairs})
        ctx.replace([comb], summed)
        return f"{g.label} + {d.label} -> EXPERT_LINEAR[SILU_MUL|DOWN_T] ({ns} slices), {comb.label} sums them"
    return None


def _gate_up_of(ctx: _Ctx, d: Op) -> Op | None:
    """The LINEAR[SILU_MUL] (NORM allowed) whose rows only the down projection d reads, where d's weight (H x I, one
    part, read whole) can be packed transposed: the MLP a DOWN_T task can run whole."""
    g = ctx.sole_producer(d.reads["x"], "LINEAR", "SILU_MUL")
    if g is None or not g.flags <= {"SILU_MUL", "NORM"} or not ctx.private(g.writes["out"].tensor, d):
        return None
    w = d.reads["w"]
    if d.attrs["rows"] != g.attrs["K"] or d.attrs["K"] != g.attrs["rows"] or not _whole(ctx, w) \
            or len(ctx.g.tensors[w.tensor].parts) != 1:
        return None
    return g


def _fuse_mlp(ctx: _Ctx, g: Op, d: Op, rows: int, label: str) -> tuple[Op, View, int]:
    """g (gate|up) and d (down) -> one LINEAR[SILU_MUL, DOWN_T] over slices of `rows` intermediate rows: each task
    keeps its slice's SiLU·mul values (out, now its scratch) and streams the same rows of the down projection packed
    transposed into a partial row per token.  (The fused op; its partials, slices x N x H; the slice count.)"""
    I, H, N = g.attrs["rows"], g.attrs["K"], g.attrs["N"]
    slices = -(-I // rows)
    partials = _partials(ctx, g.label.rsplit(".", 1)[0] + ".down_partials", slices * N, H)
    fused = _new(g, g.flags | {"DOWN_T"}, {**g.reads, "wd": View(_transposed(ctx, d.reads["w"].tensor))},
                 {"out": g.writes["out"], "y": partials}, attrs={**g.attrs, "slice_rows": rows}, label=label)
    ctx.replace([g, d], fused)
    return fused, partials, slices


def _shared_mlp(ctx: _Ctx) -> str | None:
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
        ctx.replace([comb], _new(comb, comb.flags, {**comb.reads, "sh": sh}, dict(comb.writes),
                                 attrs={**comb.attrs, "nsh": nsh, "shs": g.attrs["N"]}))
        return f"{g.label} + {d.label} -> LINEAR[SILU_MUL|DOWN_T] ({nsh} slices), {comb.label} sums them"
    return None


def _dense_mlp(ctx: _Ctx) -> str | None:
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


def _merge_stages(ctx: _Ctx, opcode: str, stages: tuple[str, ...], label_suffix: str,
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
            fused = _new(first, flags, reads, writes, label=label)
            ctx.replace([first, second], fused)
            return f"{first.label} + {second.label} -> {opcode}[{'|'.join(s for s in stages if s in flags)}]"
    return None


def fuse(graph: Graph, rules: tuple[str, ...] = DEFAULT_RULES) -> dict:
    before = len(graph.ops)
    unknown = set(rules) - set(RULES)
    if unknown:
        raise ValueError(f"unknown fusion rule(s) {sorted(unknown)}; rules are {RULES}")
    ctx = _Ctx(graph)
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
        "norm_into_linear": _norm_into_linear,
        "norm_beside_experts": lambda c: _norm_into_linear(c, beside_experts=True),
        "expert_mlp": lambda c: _expert_mlp(c) or _shared_mlp(c),  # the routed experts first: see _shared_mlp
        "dense_mlp": _dense_mlp,
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
