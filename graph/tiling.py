"""Split each op into tasks sized for one worker, with each task's cost.

A tile is the task-specific fields (row, head, split or slot range) plus the bytes
and flops the cost model turns into time.  What memory a task touches is not
recorded here: the verifier derives it from the encoded task word
(graph/footprint.py), independently of this code.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import Graph, Op
from .isa import Buf


@dataclass
class TilingOptions:
    tile_bytes: int = 256 * 1024  # weight bytes one task streams
    # weight rows per task are a multiple of this (or all rows): the stream's row block (BR = 8 at KC = 2048).
    # 16 until session 17: with siblings, llama-1b's q|k|v make 86 + 22 + 22 tasks for 132 workers, not 64 + 16 + 16
    row_align: int = 8
    act_rows: int = 16  # activation rows per task for row-parallel ops
    attn_heads: int = 0  # query heads per attention task (0: all for MLA, one KV group for GQA)
    # heads per ROPE task (0: all of a row's heads in one task; one block of them in the body).  4 made llama-1b's
    # 32-head query rope 8 tasks (-2.7 / -3.5%, session 19), before rope_into_attention moved GQA's ropes into
    # attention; a plan with separate ropes may still want it.  Left to MLA's q rope, 4 made dsv2-lite's phase
    # after q|kv_a 135 tasks for 132 workers, and the q ropes queued behind each other: 0 measured -0.75 / -1.1%
    # with norm_into_cache (docs/PERF.md session 27); logits bit-identical
    rope_heads: int = 0
    # > 0: split an op that would make fewer tasks than this (a layer's small projections, the
    # router, per-head matmuls, the attention combine) into up to this many, down to min_tile_bytes
    # each: such ops sit on the step's dependency chain, where only their slowest task counts
    spread: int = -1  # -1: the plan's worker count; 0: off
    min_tile_bytes: int = 16 * 1024
    # with spread: rows per task chosen so that the op's rounds over `spread` workers take the fewest
    # rows (tasks up to balance_bytes each).  Without it, a 2048-row expert slice in tasks of 80 rows
    # made 156 tasks for 132 workers: 24 of them ran two, a phase of 160 rows where 96 would do
    # (dsv2-lite 4.136 -> 3.693 ms, llama-1b 1.337 -> 1.319 at 384 KB: docs/PERF.md session 14)
    balance: int = 1
    # 4 MB since session 24: lm_head's 128256 rows in one round of 976-row tasks, not 9 of 112 (a phase of 976
    # rows' time, not 1008, and 131 fewer task boundaries): llama-1b -2.2%, dsv2-lite -0.5% (docs/PERF.md)
    balance_bytes: int = 4 * 1024 * 1024
    # with spread: LINEAR ops that read the same input (a layer's q, k and v projections) and would together
    # make more tasks than `spread` share the workers in proportion to their weight bytes, so the phase they
    # run in side by side is one round (llama-1b's q|k|v made 128 + 32 + 32 tasks for 132 workers).  With 8-row
    # alignment, GQA's cache prefetch and 128-position key blocks: llama-1b -3.3% (docs/PERF.md session 17).
    # 2: also the streamed ops one op reads side by side: dsv2-lite's shared and routed expert down projections
    # made 128 + 132 tasks, so 128 workers ran a shared tile before their routed one, on the chain; now 32 + 96,
    # one round: dsv2-lite -2.7%, llama-1b's plan unchanged (docs/PERF.md session 18)
    siblings: int = 2
    # with spread: the fewest output columns of a per-head matmul task (where the op has columns to spare).  128
    # until session 24 left dsv2-lite's v_up in 32 tasks of two 32 KB tiles (the second asked for only after the
    # wait) and q_absorb in 64 of 32 KB; 16 makes both 128 tasks of one 16 KB tile: dsv2-lite -1.5% (-2.6% with
    # balance_bytes at 4 MB, docs/PERF.md session 24)
    head_cols: int = 16
    # a streamed task's fixed cost as weight bytes (~1 us of a worker's stream: session 14's fit of
    # streamed tasks; CostModel.task_overhead's 3 us also covers the round trips of one-task ops)
    task_overhead_bytes: int = 32 * 1024


@dataclass
class Tile:
    fields: dict
    weight_bytes: int = 0
    act_bytes: int = 0
    flops: int = 0


def _spread_block(n: int, want: int, unit: int, preferred: int) -> int:
    """A block of a dimension n for about `want` blocks: a multiple of `unit`, at least `preferred`
    where n allows (else half of n, but not below unit), so small blocks only appear on small ops."""
    return max(min(preferred, max(unit, n // 2)), -(-n // max(1, want) // unit) * unit)


def _blocks(n: int, size: int) -> list[tuple[int, int]]:
    size = max(1, size)
    return [(i, min(i + size, n)) for i in range(0, n, size)]


class Tiler:
    def __init__(self, graph: Graph, opts: TilingOptions, wbytes: int):
        self.g, self.opts, self.wbytes = graph, opts, wbytes
        self.spread_of: dict[int, int] = {}  # op id -> its share of the workers (TilingOptions.siblings)
        if opts.siblings and opts.spread > 0 and graph is not None:  # (a Tiler for row arithmetic alone has none)
            self.spread_of = self.sibling_spreads()

    def sibling_spreads(self) -> dict[int, int]:
        """Workers per streamed op (LINEAR, EXPERT_LINEAR) where ops that run side by side would make more than
        `spread` tasks together: each op's share in proportion to its weight bytes (at least one).  Side by side:
        LINEAR ops reading one input (a layer's q, k and v), and with siblings=2 also streamed ops whose outputs
        one op reads (the routed and shared experts' down projections, both read by MOE_COMBINE), where none
        depends on another (an op that reads o_proj's residual beside the experts' rows does not make o_proj
        their sibling).  Routers never join a group, and a group keeps its shares only if they make fewer tasks
        and one round."""
        streamed = {op.id: op for op in self.g.ops if op.opcode in ("LINEAR", "EXPERT_LINEAR")}
        prod = {v.tensor: op.id for op in self.g.ops for v in op.writes.values()}
        by_input: dict[str, list[Op]] = {}
        for op in streamed.values():
            if op.opcode == "LINEAR":
                by_input.setdefault(op.reads["x"].tensor, []).append(op)
        candidates = list(by_input.values())
        for op in self.g.ops if self.opts.siblings >= 2 else ():
            ids = dict.fromkeys(prod[v.tensor] for v in op.reads.values() if prod.get(v.tensor) in streamed)
            candidates.append([streamed[i] for i in ids])
        ancestors = self.ancestors()
        routers = {prod[v.tensor] for op in self.g.ops if op.opcode == "ROUTE" for v in op.reads.values()
                   if v.tensor in prod}
        shares = {}
        for ops in candidates:
            # the latest candidates: none depends on another (an ancestor of a candidate runs before it, not beside
            # it), and no router (it sits on the chain, router -> route -> experts: a share by bytes would starve it)
            group = [op for op in ops if op.id not in shares and op.id not in routers
                     and not any(op.id in ancestors[o.id] for o in ops)]
            if len(group) < 2:
                continue
            alone = sum(self.task_count(op) for op in group)
            if alone <= self.opts.spread:
                continue
            nbytes = {op.id: self.streamed_bytes(op) for op in group}
            total = sum(nbytes.values())
            share = {i: max(1, self.opts.spread * b // max(1, total)) for i, b in nbytes.items()}
            shared = sum(self.task_count(op, share[op.id]) for op in group)
            if shared <= self.opts.spread and shared < alone:  # kept only where they make fewer tasks, one round
                shares.update(share)
        return shares

    def task_count(self, op: Op, spread: int = 0) -> int:
        """A streamed op's tasks, tiled for `spread` workers (0: the options')."""
        tile = self.tile_linear if op.opcode == "LINEAR" else self.tile_expert_linear
        return len(tile(op, spread))

    def ancestors(self) -> dict[int, set[int]]:
        """op id -> every op it depends on, directly or not (op ids are topological)."""
        out: dict[int, set[int]] = {}
        for op_id, deps in sorted(self.g.op_deps().items()):
            out[op_id] = set(deps).union(*(out[d] for d in deps))
        return out

    def streamed_bytes(self, op: Op) -> int:
        """The weight bytes a LINEAR or EXPERT_LINEAR op streams in a step (an expert op: every slot's rows)."""
        two = 3 if "DOWN_T" in op.flags else 2 if op.flags & {"SILU_MUL", "PAIR"} else 1
        if op.opcode == "LINEAR":
            return self.weight_bytes(op, "w") * two
        a = op.attrs
        return a["S"] * a["rows"] * a["K"] * self.wbytes * two

    def weight_bytes(self, op: Op, key: str) -> int:
        t = self.g.tensors[op.reads[key].tensor]
        return t.numel * (self.wbytes if t.buf in (Buf.W, Buf.C) else 4)

    def row_tiles(self, rows: int, cols: int, flops_per_row: int = 0, weight_bytes: int = 0) -> list[Tile]:
        """Row-parallel ops: each task handles rows r0..r1; `cols` fp32 values per row in and out."""
        return [Tile({"r0": r0, "r1": r1}, weight_bytes, 4 * (r1 - r0) * cols, flops_per_row * (r1 - r0))
                for r0, r1 in _blocks(rows, self.opts.act_rows)]

    def weight_rows_per_task(self, bytes_per_row: int, rows: int, copies: int = 1, align: int = 0,
                             spread: int = 0) -> int:
        """Rows per task: tile_bytes of weights; with `spread` (the options', unless given), fewer, so that
        the op (`copies` times over, e.g. once per expert slot) makes up to `spread` tasks of at least
        min_tile_bytes; a multiple of `align` rows (default: row_align)."""
        spread = spread or self.opts.spread
        n = max(1, self.opts.tile_bytes // max(1, bytes_per_row))
        if spread:
            want = max(1, spread // copies)
            n = min(n, max(-(-rows // want), self.opts.min_tile_bytes // max(1, bytes_per_row)))
        if n >= rows:
            return rows
        align = align or self.opts.row_align
        per = max(align, n // align * align) if rows > align else rows
        if self.opts.balance and spread > 0 and rows > align:
            per = self.balanced_rows(per, rows, copies, bytes_per_row, align, spread)
        return per

    def balanced_rows(self, per: int, rows: int, copies: int, bytes_per_row: int, align: int, spread: int) -> int:
        """Rows per task whose phase (rounds of tasks over `spread` workers x a task's bytes and fixed
        cost) is the shortest, keeping `per` unless another is strictly shorter; ties go to fewer,
        larger tasks."""

        def phase(p: int) -> int:
            return -(-copies * -(-rows // p) // spread) * (p * bytes_per_row + self.opts.task_overhead_bytes)

        most = max(per, self.opts.balance_bytes // max(1, bytes_per_row) // align * align)
        fewest = -(-self.opts.min_tile_bytes // max(1, bytes_per_row))  # no task below min_tile_bytes
        best = per
        for p in range(max(align, -(-fewest // align) * align), min(most, rows) + 1, align):
            if phase(p) < phase(best) or (phase(p) == phase(best) and best != per and p > best):
                best = p
        return best

    # ---- per opcode ----------------------------------------------------------
    def tiles(self, op: Op) -> list[Tile]:
        return getattr(self, "tile_" + op.opcode.lower())(op)

    def tile_embed(self, op):
        a = op.attrs
        tiles = self.row_tiles(a["rows"], 1 + a["H"] * a["copies"])
        for tile in tiles:
            tile.weight_bytes = (tile.fields["r1"] - tile.fields["r0"]) * a["H"] * self.wbytes
        return tiles

    def tile_rmsnorm(self, op):
        a = op.attrs
        cols = a["D"] * (2 + ("d" in op.reads) + ("xo" in op.writes))
        wb = self.weight_bytes(op, "w") if "w" in op.reads else 0
        return self.row_tiles(a["rows"], cols, 4 * a["D"], wb)

    def tile_linear(self, op, spread: int = 0):
        a = op.attrs
        N, K, rows = a["N"], a["K"], a["rows"]
        nweights = 2 if op.flags & {"SILU_MUL", "PAIR"} else 1
        if "DOWN_T" in op.flags:  # slices fixed by the model (expert_mlp, dense_mlp): a token's partials are summed
            per, nweights = a["slice_rows"], 3  # in one order whatever the step's shape; gate, up and down rows
        else:
            # a router's weights as a high and a low part (PAIR) take half the rows per task, so its tasks stream
            # what the one-part router's did (its 64 rows: 8 tasks of 8, not 4 of 16 with twice the bytes)
            per = self.weight_rows_per_task(K * self.wbytes * nweights, rows,
                                            align=max(1, self.opts.row_align // 2) if "PAIR" in op.flags else 0,
                                            spread=spread or self.spread_of.get(op.id, 0))
        return [Tile({"r0": r0, "r1": r1, **({"slice": r0 // per} if "DOWN_T" in op.flags else {})},
                     (r1 - r0) * K * self.wbytes * nweights, 4 * N * (K + 2 * (r1 - r0)),
                     2 * N * K * (r1 - r0) * nweights) for r0, r1 in _blocks(rows, per)]

    def tile_ewise(self, op):
        a = op.attrs
        ins = sum(1 for k in ("a", "b") if k in op.reads)
        return self.row_tiles(a["rows"], a["cols"] * (ins + 1), a["cols"])

    def tile_rope_table(self, op):
        a = op.attrs
        return self.row_tiles(a["rows"], 2 * a["half"], 4 * a["half"], self.weight_bytes(op, "f"))

    def tile_rope(self, op):
        """Rows, and with rope_heads, blocks of heads: a decode step's query rope is one row of every
        head, a single task on each layer's chain (docs/PERF.md session 12)."""
        a = op.attrs
        tiles = []
        for h0, h1 in _blocks(a["heads"], self.opts.rope_heads or a["heads"]):
            per_row = (h1 - h0) * (a["x_hs"] + 2 * a["half"])
            for tile in self.row_tiles(a["rows"], per_row, 6 * a["half"] * (h1 - h0)):
                tile.fields.update(h0=h0, heads=h1)
                tiles.append(tile)
        return tiles

    def tile_cache_write(self, op):
        return self.row_tiles(op.attrs["rows"], op.attrs["cols"])

    def tile_head_matmul(self, op):
        a = op.attrs
        per_head = a["in_dim"] * a["out_dim"] * self.wbytes
        hpt = max(1, min(a["heads"], self.opts.tile_bytes // max(1, per_head)))
        heads, O = _blocks(a["heads"], hpt), a["out_dim"]
        cols = O  # with spread, when heads alone make too few tasks: output column blocks too
        if self.opts.spread:
            heads = _blocks(a["heads"], max(1, min(hpt, -(-a["heads"] // self.opts.spread))))
            cols = _spread_block(O, self.opts.spread // len(heads), 16, self.opts.head_cols)
        return [Tile({"h0": h0, "h1": h1, "o0": o0, "o1": o1}, (h1 - h0) * a["in_dim"] * (o1 - o0) * self.wbytes,
                     4 * a["N"] * (h1 - h0) * (a["in_dim"] + o1 - o0), 2 * a["N"] * (h1 - h0) * a["in_dim"] * (o1 - o0))
                for h0, h1 in heads for o0, o1 in _blocks(O, cols)]

    def tile_attention(self, op):
        a = op.attrs
        nh, T, dim = a["nheads"], a["T"], a["dim"]
        mla = "MLA" in op.flags
        hpt = self.opts.attn_heads or (nh if mla else a["group"])
        hpt = max(1, min(hpt, nh))
        # GQA: a task reads one KV head (the body's keys are h0's group's) and, as ATTENTION[ROPE], writes that
        # head's new rows, so its heads are a divisor of the group, or with ROPE the whole group
        if not mla and (hpt > a["group"] or a["group"] % hpt or "ROPE" in op.flags):
            hpt = a["group"]
        tiles = []
        for b in range(a["B"]):
            for h0, h1 in _blocks(nh, hpt):
                width = a["width"] if mla else 2 * a["kv_hs"]
                for split in range(a["nsplits"]):
                    tiles.append(Tile({"b": b, "h0": h0, "h1": h1, "split": split}, 0,
                                      a["split_len"] * width * self.wbytes
                                      + 4 * T * (h1 - h0) * (2 * dim + a["rope_dim"]),
                                      4 * T * (h1 - h0) * a["split_len"] * (dim + a["rope_dim"])))
        return tiles

    def tile_attn_combine(self, op):
        a = op.attrs
        nh, T, dim, ns = a["nheads"], a["T"], a["dim"], a["nsplits"]
        hpt = max(1, -(-nh // max(1, self.opts.spread // a["B"]))) if self.opts.spread else nh
        heads = _blocks(nh, hpt)
        cols = dim  # with spread, when heads alone make too few tasks: column blocks too, so that each
        if self.opts.spread:  # task reads all splits of its columns in one memory round trip
            cols = _spread_block(dim, self.opts.spread // (a["B"] * len(heads)), 16, 64)
        return [Tile({"b": b, "h0": h0, "h1": h1, "c0": c0, "c1": c1}, 0, 4 * T * (h1 - h0) * (c1 - c0) * (ns + 1),
                     3 * T * (h1 - h0) * (c1 - c0) * ns)
                for b in range(a["B"]) for h0, h1 in heads for c0, c1 in _blocks(dim, cols)]

    def tile_route(self, op):
        a = op.attrs
        return [Tile({}, 0, 4 * a["N"] * a["E"] * 2, 10 * a["N"] * a["E"])]

    def tile_expert_linear(self, op, spread: int = 0):
        a = op.attrs
        K, rows = a["K"], a["rows"]
        nweights = 2 if "SILU_MUL" in op.flags else 1
        if "DOWN_T" in op.flags:  # slices fixed by the model (fusion rule expert_mlp): a pair's partials are summed
            per, nweights = a["slice_rows"], 3  # in one order whatever the step's shape; gate, up and down rows
        else:
            per = self.weight_rows_per_task(K * self.wbytes * nweights, rows, copies=a["S"],
                                            spread=spread or self.spread_of.get(op.id, 0))
        return [Tile({"slot": slot, "r0": r0, "r1": r1, "slice": r0 // per}, (r1 - r0) * K * self.wbytes * nweights,
                     4 * a["N"] * (K + r1 - r0), 2 * a["N"] * K * (r1 - r0) * nweights)
                for slot in range(a["S"]) for r0, r1 in _blocks(rows, per)]

    def tile_moe_combine(self, op):
        a = op.attrs
        H, k = a["H"], a["topk"]
        rows = _blocks(a["rows"], self.opts.act_rows)
        cols = H  # with spread: column blocks so that the op makes up to `spread` tasks
        if self.opts.spread:  # 16-column blocks where it sums slices of partials (expert_mlp: ops/moe.BDS)
            unit, preferred = (16, 16) if a.get("ns", 1) > 1 or a.get("nsh", 1) > 1 else (32, 256)
            cols = _spread_block(H, self.opts.spread // len(rows), unit, preferred)
        return [Tile({"r0": r0, "r1": r1, "c0": c0, "c1": c1}, 0, 4 * (r1 - r0) * (c1 - c0) * (k + 3),
                     2 * (r1 - r0) * (c1 - c0) * k) for r0, r1 in rows for c0, c1 in _blocks(H, cols)]

    def tile_hc_coeff(self, op):
        a = op.attrs
        n, H = a["n"], a["H"]
        width = (2 + n) * n
        cols = n * H * ("st" in op.reads) + H * ("out" in op.writes)
        cols += width * sum((key in op.reads) + (key in op.writes) for key in ("mix", "craw", "coef"))
        wb = sum(self.weight_bytes(op, k) for k in ("fn", "base", "scale") if k in op.reads)
        return self.row_tiles(a["rows"], cols, 2 * n * H * width, wb)

    def tile_hc_expand(self, op):
        n, H = op.attrs["n"], op.attrs["H"]
        return self.row_tiles(op.attrs["rows"], 2 * n * H + H + (2 + n) * n, 2 * n * n * H)

    def tile_hc_head(self, op):
        n, H = op.attrs["n"], op.attrs["H"]
        wb = sum(self.weight_bytes(op, k) for k in ("fn", "base", "scale"))
        return self.row_tiles(op.attrs["rows"], n * H + H, 2 * n * n * H, wb)

    def tile_argmax(self, op):
        a = op.attrs
        N, V, nparts = a["N"], a["V"], a["nparts"]
        if "PARTIAL" not in op.flags:  # FINAL alone: reduce the partials
            return [Tile({"part": 0, "nparts": nparts}, 0, 8 * N * nparts, N * nparts)]
        return [Tile({"c0": c0, "c1": c1, "part": part, "nparts": nparts}, 0, 4 * N * (c1 - c0), N * (c1 - c0))
                for part, (c0, c1) in enumerate(_blocks(V, a["block"]))]

    def tile_accept(self, op):
        a = op.attrs
        return [Tile({"b0": 0, "b1": a["B"]}, 0, 16 * a["B"] * a["T"], a["B"] * a["T"])]

    def tile_helper_call(self, op):
        a = op.attrs
        table = 2 * a["S"] + a["S"] * a["N"] * a["topk"]
        return [Tile({"layer": op.layer}, 0, 4 * (2 * table + a["E"] + a["N"] * a["K"]), table)]

    def tile_helper_wait(self, op):
        a = op.attrs
        return [Tile({"layer": op.layer}, 0, 8 * a["N"] * a["topk"] * a["H"], a["N"] * a["topk"] * a["H"])]

    def tile_gather(self, op):
        a = op.attrs
        return [Tile({"b0": 0, "b1": a["B"]}, 0, 8 * a["B"] * a["cols"], a["B"] * a["cols"])]
