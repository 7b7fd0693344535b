"""Split each op into tasks sized for one worker, with the memory each task touches and its cost.

A task's regions are rectangles of a tensor (rows × columns of its row-major
layout, columns may run past one row for flat views); the verifier checks them
for hazards.  Writes whose rows depend on run-time routing carry an
`exclusive` key: two such writes of one op with different keys are disjoint by
construction (each (token, k) pair belongs to exactly one expert slot).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .ir import Graph, Op, Tensor
from .isa import Buf


@dataclass(frozen=True)
class Region:
    tensor: str
    row0: int
    row1: int
    col0: int
    col1: int
    exclusive: tuple | None = None


@dataclass
class TilingOptions:
    tile_bytes: int = 256 * 1024  # weight bytes one task streams
    row_align: int = 16  # weight rows per task are a multiple of this (or all rows)
    act_rows: int = 16  # activation rows per task for row-parallel ops
    attn_heads: int = 0  # query heads per attention task (0: all for MLA, one KV group for GQA)
    vocab_block: int = 4096  # logits columns per argmax partial task


@dataclass
class Tile:
    fields: dict
    reads: list[Region]
    writes: list[Region]
    weight_bytes: int = 0
    act_bytes: int = 0
    flops: int = 0
    extra: dict = field(default_factory=dict)


def _blocks(n: int, size: int) -> list[tuple[int, int]]:
    size = max(1, size)
    return [(i, min(i + size, n)) for i in range(0, n, size)]


class Tiler:
    def __init__(self, graph: Graph, opts: TilingOptions, wbytes: int):
        self.g, self.opts, self.wbytes = graph, opts, wbytes

    def t(self, op: Op, key: str) -> Tensor:
        view = op.reads.get(key) or op.writes.get(key)
        return self.g.tensors[view.tensor]

    def region(self, op: Op, key: str, row0: int, row1: int, col0: int, col1: int, exclusive=None) -> Region:
        view = op.reads.get(key) or op.writes.get(key)
        return Region(view.tensor, row0, row1, view.col0 + col0, view.col0 + col1, exclusive)

    def whole(self, op: Op, key: str) -> Region:
        t = self.t(op, key)
        view = op.reads.get(key) or op.writes.get(key)
        return Region(view.tensor, 0, t.rows, view.col0, view.col0 + (view.cols or t.cols - view.col0 if view.col0 < t.cols else t.cols))

    def row_tiles(self, op: Op, rows: int, cols_in: dict[str, int], cols_out: dict[str, int], flops_per_row=0,
                  weights: tuple[str, ...] = ()) -> list[Tile]:
        """Row-parallel ops: each task handles rows r0..r1 of every operand."""
        tiles = []
        for r0, r1 in _blocks(rows, self.opts.act_rows):
            reads = [self.region(op, k, r0, r1, 0, c) for k, c in cols_in.items()]
            reads += [self.whole(op, k) for k in weights]
            writes = [self.region(op, k, r0, r1, 0, c) for k, c in cols_out.items()]
            act = 4 * (r1 - r0) * (sum(cols_in.values()) + sum(cols_out.values()))
            wb = sum(self.t(op, k).numel * self._itemsize(self.t(op, k)) for k in weights)
            tiles.append(Tile({"r0": r0, "r1": r1}, reads, writes, wb, act, flops_per_row * (r1 - r0)))
        return tiles

    def _itemsize(self, t: Tensor) -> int:
        return self.wbytes if t.buf in (Buf.W, Buf.C) else 4

    def weight_rows_per_task(self, bytes_per_row: int, rows: int) -> int:
        n = max(1, self.opts.tile_bytes // max(1, bytes_per_row))
        if n >= rows:
            return rows
        align = self.opts.row_align
        return max(align, n // align * align) if rows > align else rows

    # ---- per opcode ----------------------------------------------------------
    def tiles(self, op: Op) -> list[Tile]:
        return getattr(self, "tile_" + op.opcode.lower())(op)

    def tile_embed(self, op):
        a = op.attrs
        tiles = self.row_tiles(op, a["rows"], {"tok": 1}, {"out": a["H"] * a["copies"]})
        for tile in tiles:
            tile.weight_bytes = (tile.fields["r1"] - tile.fields["r0"]) * a["H"] * self.wbytes
            tile.reads.append(self.whole(op, "table"))
        return tiles

    def tile_rmsnorm(self, op):
        a = op.attrs
        ins = {"x": a["D"]}
        if "d" in op.reads:
            ins["d"] = a["D"]
        outs = {"out": a["D"]}
        if "xo" in op.writes:
            outs["xo"] = a["D"]
        return self.row_tiles(op, a["rows"], ins, outs, 4 * a["D"], weights=("w",) if "w" in op.reads else ())

    def tile_linear(self, op):
        a = op.attrs
        N, K, rows = a["N"], a["K"], a["rows"]
        nweights = 2 if "SILU_MUL" in op.flags else 1
        per = self.weight_rows_per_task(K * self.wbytes * nweights, rows)
        tiles = []
        for r0, r1 in _blocks(rows, per):
            reads = [self.region(op, "x", 0, N, 0, K)]
            reads += [self.region(op, w, r0, r1, 0, K) for w in ("w", "w2") if w in op.reads]
            if "res" in op.reads:
                reads.append(self.region(op, "res", 0, N, r0, r1))
            writes = [self.region(op, "out", 0, N, r0, r1)]
            tiles.append(Tile({"r0": r0, "r1": r1}, reads, writes, (r1 - r0) * K * self.wbytes * nweights,
                              4 * N * (K + 2 * (r1 - r0)), 2 * N * K * (r1 - r0) * nweights))
        return tiles

    def tile_ewise(self, op):
        a = op.attrs
        ins = {k: a["cols"] for k in ("a", "b") if k in op.reads}
        return self.row_tiles(op, a["rows"], ins, {"out": a["cols"]}, a["cols"])

    def tile_rope_table(self, op):
        a = op.attrs
        tiles = self.row_tiles(op, a["rows"], {}, {"out": 2 * a["half"]}, 4 * a["half"], weights=("f",))
        for tile in tiles:
            tile.reads.append(self.whole(op, "cl"))
        return tiles

    def tile_rope(self, op):
        a = op.attrs
        width = (a["heads"] - 1) * a["x_hs"] + a["x_col0"] + 2 * a["half"]
        tiles = self.row_tiles(op, a["rows"], {"x": width}, {"out": a["heads"] * 2 * a["half"]}, 6 * a["half"] * a["heads"])
        for tile in tiles:
            tile.reads.append(self.region(op, "tab", tile.fields["r0"], tile.fields["r1"], 0, 2 * a["half"]))
        return tiles

    def tile_cache_write(self, op):
        a = op.attrs
        tiles = self.row_tiles(op, a["rows"], {"src": a["cols"]}, {})
        for tile in tiles:
            tile.reads.append(self.whole(op, "cl"))
            # the rows written depend on the cache lengths at run time: claim every row of those columns
            tile.writes.append(self.region(op, "cache", 0, self.t(op, "cache").rows, a["col0"], a["col0"] + a["cols"]))
        return tiles

    def tile_head_matmul(self, op):
        a = op.attrs
        per_head = a["in_dim"] * a["out_dim"] * self.wbytes
        hpt = max(1, min(a["heads"], self.opts.tile_bytes // max(1, per_head)))
        tiles = []
        for h0, h1 in _blocks(a["heads"], hpt):
            reads = [self.region(op, "x", 0, a["N"], h0 * a["x_hs"], (h1 - 1) * a["x_hs"] + a["x_col0"] + a["in_dim"]),
                     self.whole(op, "w")]
            writes = [self.region(op, "out", 0, a["N"], h0 * a["out_hs"], (h1 - 1) * a["out_hs"] + a["out_dim"])]
            tiles.append(Tile({"h0": h0, "h1": h1}, reads, writes, (h1 - h0) * per_head,
                              4 * a["N"] * (h1 - h0) * (a["in_dim"] + a["out_dim"]),
                              2 * a["N"] * (h1 - h0) * a["in_dim"] * a["out_dim"]))
        return tiles

    def tile_attention(self, op):
        a = op.attrs
        nh, T, dim = a["nheads"], a["T"], a["dim"]
        mla = "MLA" in op.flags
        hpt = self.opts.attn_heads or (nh if mla else a["group"])
        hpt = max(1, min(hpt, nh))
        if not mla and hpt % a["group"] and a["group"] % hpt:
            hpt = a["group"]
        tiles = []
        cache_rows = self.t(op, "cache").rows
        for b in range(a["B"]):
            for h0, h1 in _blocks(nh, hpt):
                for split in range(a["nsplits"]):
                    r0 = b * T
                    reads = [self.region(op, "q", r0, r0 + T, h0 * a["q_hs"], (h1 - 1) * a["q_hs"] + dim),
                             self.region(op, "cache", 0, cache_rows, 0, a["width"]), self.whole(op, "cl")]
                    if mla:
                        reads.append(self.region(op, "pe", r0, r0 + T, h0 * a["pe_hs"], (h1 - 1) * a["pe_hs"] + a["rope_dim"]))
                    # partial rows: ((b·nsplits + split)·T + t)·nheads + h
                    base = (b * a["nsplits"] + split) * T * nh
                    writes = [self.region(op, "op", base, base + T * nh, 0, dim),
                              self.region(op, "lse", base, base + T * nh, 0, 1)]
                    kv_heads = 1 if mla else max(1, (h1 - h0) // a["group"])
                    width = a["width"] if mla else 2 * a["kv_hs"] * kv_heads
                    cache_bytes = a["split_len"] * width * self.wbytes
                    tiles.append(Tile({"b": b, "h0": h0, "h1": h1, "split": split}, reads, writes, 0,
                                      cache_bytes + 4 * T * (h1 - h0) * (2 * dim + a["rope_dim"]),
                                      4 * T * (h1 - h0) * a["split_len"] * (dim + a["rope_dim"])))
        return tiles

    def tile_attn_combine(self, op):
        a = op.attrs
        nh, T, dim, ns = a["nheads"], a["T"], a["dim"], a["nsplits"]
        tiles = []
        for b in range(a["B"]):
            reads = []
            for split in range(ns):
                base = (b * ns + split) * T * nh
                reads += [self.region(op, "op", base, base + T * nh, 0, dim), self.region(op, "lse", base, base + T * nh, 0, 1)]
            writes = [self.region(op, "out", b * T, (b + 1) * T, 0, nh * dim)]
            tiles.append(Tile({"b": b, "h0": 0, "h1": nh}, reads, writes, 0, 4 * T * nh * dim * (ns + 1), 3 * T * nh * dim * ns))
        return tiles

    def tile_route(self, op):
        a = op.attrs
        reads = [self.whole(op, k) for k in ("lg", "sc", "bias", "ids") if k in op.reads]
        writes = [self.whole(op, k) for k in ("sc", "ids", "wts", "st") if k in op.writes]
        return [Tile({}, reads, writes, 0, 4 * a["N"] * a["E"] * 2, 10 * a["N"] * a["E"])]

    def tile_expert_linear(self, op):
        a = op.attrs
        K, rows, S, pairs = a["K"], a["rows"], a["S"], a["N"] * a["topk"]
        nweights = 2 if "SILU_MUL" in op.flags else 1
        per = self.weight_rows_per_task(K * self.wbytes * nweights, rows)
        tiles = []
        for slot in range(S):
            for r0, r1 in _blocks(rows, per):
                x_rows = a["N"] if "GATHER" in op.flags else pairs
                reads = [self.region(op, "x", 0, x_rows, 0, K), self.whole(op, "st"), self.whole(op, "w")]
                writes = [self.region(op, "out", 0, pairs, r0, r1, exclusive=("slot", slot))]
                tiles.append(Tile({"slot": slot, "r0": r0, "r1": r1}, reads, writes,
                                  (r1 - r0) * K * self.wbytes * nweights, 4 * a["N"] * (K + r1 - r0),
                                  2 * a["N"] * K * (r1 - r0) * nweights, {"expert_slot": slot}))
        return tiles

    def tile_moe_combine(self, op):
        a = op.attrs
        H, k = a["H"], a["topk"]
        tiles = []
        for r0, r1 in _blocks(a["rows"], self.opts.act_rows):
            reads = [self.region(op, "y", r0 * k, r1 * k, 0, H), self.region(op, "wts", r0, r1, 0, k)]
            reads += [self.region(op, key, r0, r1, 0, H) for key in ("sh", "res") if key in op.reads]
            writes = [self.region(op, "out", r0, r1, 0, H)]
            tiles.append(Tile({"r0": r0, "r1": r1}, reads, writes, 0, 4 * (r1 - r0) * H * (k + 3), 2 * (r1 - r0) * H * k))
        return tiles

    def tile_hc_coeff(self, op):
        a = op.attrs
        n, H = a["n"], a["H"]
        width = (2 + n) * n
        ins, outs, weights = {}, {}, []
        if "st" in op.reads:
            ins["st"] = n * H
        for key in ("mix", "craw", "coef"):
            if key in op.reads:
                ins[key] = width
            if key in op.writes:
                outs[key] = width
        if "out" in op.writes:
            outs["out"] = H
        weights = tuple(k for k in ("fn", "base", "scale") if k in op.reads)
        return self.row_tiles(op, a["rows"], ins, outs, 2 * n * H * width, weights=weights)

    def tile_hc_expand(self, op):
        a = op.attrs
        n, H = a["n"], a["H"]
        return self.row_tiles(op, a["rows"], {"st": n * H, "sub": H, "coef": (2 + n) * n}, {"out": n * H}, 2 * n * n * H)

    def tile_hc_head(self, op):
        a = op.attrs
        n, H = a["n"], a["H"]
        return self.row_tiles(op, a["rows"], {"st": n * H}, {"out": H}, 2 * n * n * H, weights=("fn", "base", "scale"))

    def tile_argmax(self, op):
        a = op.attrs
        N, V, nparts = a["N"], a["V"], a["nparts"]
        if "PARTIAL" not in op.flags:  # FINAL alone: reduce the partials
            reads = [self.whole(op, "pv"), self.whole(op, "pi")]
            return [Tile({"part": 0, "nparts": nparts}, reads, [self.whole(op, "out")], 0, 8 * N * nparts, N * nparts)]
        tiles = []
        for part, (c0, c1) in enumerate(_blocks(V, a["block"])):
            reads = [self.region(op, "lg", 0, N, c0, c1)]
            if "FINAL" in op.flags:
                writes = [self.whole(op, "out")]
            else:
                writes = [self.region(op, "pv", 0, N, part, part + 1), self.region(op, "pi", 0, N, part, part + 1)]
            tiles.append(Tile({"c0": c0, "c1": c1, "part": part, "nparts": nparts}, reads, writes, 0,
                              4 * N * (c1 - c0), N * (c1 - c0)))
        return tiles

    def tile_accept(self, op):
        a = op.attrs
        return [Tile({"b0": 0, "b1": a["B"]}, [], [], 0, 16 * a["B"] * a["T"], a["B"] * a["T"])]

    def tile_gather(self, op):
        a = op.attrs
        return [Tile({"b0": 0, "b1": a["B"]}, [], [], 0, 8 * a["B"] * a["cols"], a["B"] * a["cols"])]
