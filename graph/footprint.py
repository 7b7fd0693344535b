"""What memory a task touches, derived from its instruction word alone.

This is a second statement of each opcode's access pattern, independent of the
tiler that produced the task, so the verifier can check any plan (including
one loaded from disk).  Weights (buffers W, WF) are read-only and only bounds-
checked; an `exclusive` key marks writes whose rows are chosen at run time but
are disjoint by construction from other writes of the same pattern with another range.
"""

from __future__ import annotations

from typing import NamedTuple

from .isa import BOX_HEADER, BOX_T_ACKED, BOX_WAIT_NS, Buf, Decoded, box_layout


class Access(NamedTuple):
    """Rows [row0, row1) x columns [col0, col1) of a buffer at base with row stride ld (0: one flat range).
    A tuple with its bounding interval [lo, hi) and emptiness computed once (`access` builds it): the verifier
    reads them ~3 million times for dsv2-lite's plan."""
    buf: int
    base: int
    ld: int
    row0: int
    row1: int
    col0: int
    col1: int
    write: bool
    exclusive: tuple | None
    lo: int
    hi: int  # one past the last element
    empty: bool

    def rows(self):
        for r in range(self.row0, self.row1):
            yield self.base + r * self.ld + self.col0, self.base + r * self.ld + self.col1


def access(buf: int, base: int, ld: int, row0: int, row1: int, col0: int, col1: int, write: bool,
           exclusive: tuple | None = None) -> Access:
    return Access(buf, base, ld, row0, row1, col0, col1, write, exclusive, base + row0 * ld + col0,
                  base + (row1 - 1) * ld + col1, row1 <= row0 or col1 <= col0)


def declared_disjoint(a: Access, b: Access) -> bool:
    """Run-time-addressed writes that cannot meet: different expert slots, or different token rows.

    The key holds everything that fixes the write pattern (counter, kind, the operands that choose
    the rows) and then a [lo, hi) range; equal patterns with disjoint ranges cannot overlap, whichever
    op wrote them (with shared_counters several ops signal one counter: the operands alone fix the rows)."""
    if a.exclusive is None or b.exclusive is None or a.exclusive[:-2] != b.exclusive[:-2]:
        return False
    lo_a, hi_a = a.exclusive[-2:]
    lo_b, hi_b = b.exclusive[-2:]
    return hi_a <= lo_b or hi_b <= lo_a


def overlaps(a: Access, b: Access) -> bool:
    if a.buf != b.buf or a.empty or b.empty or a.hi <= b.lo or b.hi <= a.lo:
        return False
    if a.base == b.base and a.ld == b.ld and a.ld > 0:
        return a.row0 < b.row1 and b.row0 < a.row1 and a.col0 < b.col1 and b.col0 < a.col1
    contiguous = [x for x in (a, b) if x.ld == 0 or x.col1 - x.col0 >= x.ld]
    if contiguous:
        return True  # bounding intervals overlap and one side has no holes
    small, big = (a, b) if a.row1 - a.row0 <= b.row1 - b.row0 else (b, a)
    for lo, hi in small.rows():
        if hi <= big.lo or lo >= big.hi:
            continue
        # rows of `big` that can meet [lo, hi)
        first = max(big.row0, (lo - big.base - big.col1) // big.ld)
        last = min(big.row1, (hi - big.base - big.col0) // big.ld + 1)
        for r in range(first, last):
            s = big.base + r * big.ld
            if s + big.col0 < hi and lo < s + big.col1:
                return True
    return False


def _acc(task: Decoded, key: str, row0: int, row1: int, col0: int, col1: int, write: bool, ld: int | None = None,
         exclusive=None, shift: int = 0) -> list[Access]:
    """Operand `key`'s rows x columns; `shift`: elements past its offset where row 0 starts."""
    f = task.fields
    buf = f[key + ".buf"]
    if buf < 0:
        return []
    if ld is None:
        ld = f.get(key + ".ld", 0)
    return [access(buf, f[key + ".off"] + shift, ld, row0, row1, col0, col1, write, exclusive)]


def _flat(task: Decoded, key: str, start: int, stop: int, write: bool) -> list[Access]:
    return _acc(task, key, 0, 1, start, stop, write, ld=0)


def footprint(task: Decoded) -> list[Access]:
    """Every buffer access of a task (weights included, for bounds checks)."""
    f, name = task.fields, task.op.name
    out: list[Access] = []
    if name == "EMBED":
        r0, r1 = f["r0"], f["r1"]
        out += _acc(task, "tok", r0, r1, 0, 1, False)
        out += _acc(task, "out", r0, r1, 0, f["H"] * f["copies"], True)
    elif name == "RMSNORM":
        r0, r1, D = f["r0"], f["r1"], f["D"]
        out += _acc(task, "x", r0, r1, 0, D, False)
        if task.has("ADD"):
            out += _acc(task, "d", r0, r1, 0, D, False) + _acc(task, "xo", r0, r1, 0, D, True)
        if not task.has("NOWEIGHT"):
            out += _flat(task, "w", 0, D, False)
        if task.has("CACHE"):  # the normalized rows go to the cache (a CACHE_WRITE fused in)
            out += _cache_rows(task, f, D)
        else:
            out += _acc(task, "out", r0, r1, 0, D, True)
    elif name == "LINEAR":
        N, K, r0, r1 = f["N"], f["K"], f["r0"], f["r1"]
        out += _acc(task, "x", 0, N, 0, K, False)
        out += _acc(task, "w", r0, r1, 0, K, False, ld=K)
        if task.has("SILU_MUL") or task.has("PAIR"):
            out += _acc(task, "w2", r0, r1, 0, K, False, ld=K)
        if task.has("RES"):
            out += _acc(task, "res", 0, N, r0, r1, False)
        out += _acc(task, "out", 0, N, r0, r1, True)
        if task.has("DOWN_T"):  # the down projection's rows, k-major, into its slice's partial rows (it reads back
            out += _acc(task, "wd", r0, r1, 0, K, False, ld=K)  # only the `out` columns it wrote itself)
            out += _acc(task, "y", f["slice"] * N, f["slice"] * N + N, 0, K, True)
    elif name == "EWISE":
        r0, r1, c = f["r0"], f["r1"], f["cols"]
        out += _acc(task, "a", r0, r1, 0, c, False)
        if task.has("ADD") or task.has("MUL"):
            out += _acc(task, "b", r0, r1, 0, c, False)
        out += _acc(task, "out", r0, r1, 0, c, True)
    elif name == "ROPE_TABLE":
        r0, r1, T = f["r0"], f["r1"], f["T"]
        out += _flat(task, "cl", r0 // T, (r1 - 1) // T + 1, False) + _flat(task, "f", 0, f["half"], False)
        out += _acc(task, "out", r0, r1, 0, 2 * f["half"], True, ld=2 * f["half"])
    elif name == "ROPE":
        r0, r1, half, h0 = f["r0"], f["r1"], f["half"], f["h0"]
        for h in range(h0, f["heads"]):
            c = h * f["x_hs"] + f["x_col0"]
            out += _acc(task, "x", r0, r1, c, c + 2 * half, False)
            if not task.has("CACHE"):
                out += _acc(task, "out", r0, r1, h * f["out_hs"], h * f["out_hs"] + 2 * half, True)
        out += _acc(task, "tab", r0, r1, 0, 2 * half, False, ld=2 * half)
        if task.has("CACHE"):
            out += _cache_rows(task, f, (f["heads"] - h0) * f["out_hs"], h0 * f["out_hs"])
    elif name == "CACHE_WRITE":
        out += _acc(task, "src", f["r0"], f["r1"], 0, f["cols"], False)
        out += _cache_rows(task, f, f["cols"])
    elif name == "HEAD_MATMUL":
        N, h0, h1 = f["N"], f["h0"], f["h1"]
        for h in range(h0, h1):
            c = h * f["x_hs"] + f["x_col0"]
            out += _acc(task, "x", 0, N, c, c + f["in_dim"], False)
            out += _acc(task, "out", 0, N, h * f["out_hs"] + f["o0"], h * f["out_hs"] + f["o1"], True)
        span = (f["in_dim"] - 1) * f["w_ld"] + f["out_dim"] if not task.has("TRANS") else \
            (f["out_dim"] - 1) * f["w_ld"] + f["in_dim"]
        out += _flat(task, "w", h0 * f["w_hs"], (h1 - 1) * f["w_hs"] + span, False)
    elif name == "ATTENTION":
        b, T, S, h0, h1, nh, ns = f["b"], f["T"], f["S"], f["h0"], f["h1"], f["nheads"], f["nsplits"]
        # token r's query of head h is columns h·q_hs + q_col0 + [0, dim) of row r: for one token the heads are
        # rows of stride q_hs (one access a token, not one a head), and the same for MLA's rope part
        for r in range(b * T, (b + 1) * T):
            out += _acc(task, "q", h0, h1, 0, f["dim"], False, ld=f["q_hs"], shift=r * f["q.ld"] + f["q_col0"])
            if task.has("MLA"):
                out += _acc(task, "pe", h0, h1, 0, f["rope_dim"], False, ld=f["pe_hs"],
                            shift=r * f["pe.ld"] + f["pe_col0"])
        # the split's rows (all of MLA's latent row; GQA: its KV head's keys and values)
        j0 = f["split"] * f["split_len"]
        rows = (b * S + j0, b * S + min(S, j0 + f["split_len"]))
        if task.has("MLA"):
            out += _acc(task, "cache", *rows, 0, f["width"], False, ld=f["width"])
        else:
            k_col = (h0 // f["group"]) * f["kv_hs"]
            for c in (k_col, f["v_col0"] + k_col):
                out += _acc(task, "cache", *rows, c, c + f["dim"], False, ld=f["width"])
                if task.has("ROPE"):  # the step's new positions among them: claim the split's rows
                    out += _acc(task, "cache", *rows, c, c + f["dim"], True, ld=f["width"])
            if task.has("ROPE"):
                out += _acc(task, "tab", b * T, (b + 1) * T, 0, f["dim"], False, ld=f["dim"])
                for key in ("kn", "vn"):
                    out += _acc(task, key, b * T, (b + 1) * T, k_col, k_col + f["dim"], False, ld=f["kn.ld"])
        out += _flat(task, "cl", b, b + 1, False)
        for t in range(T):
            row = ((b * ns + f["split"]) * T + t) * nh
            out += _acc(task, "op", row + h0, row + h1, 0, f["dim"], True, ld=f["dim"])
            out += _flat(task, "lse", row + h0, row + h1, True)
    elif name == "ATTN_COMBINE":
        b, T, h0, h1, nh, ns, dim = f["b"], f["T"], f["h0"], f["h1"], f["nheads"], f["nsplits"], f["dim"]
        c0, c1 = f["c0"], f["c1"]
        # split s's partial of (token t, head h) is row ((b·ns + s)·T + t)·nh + h: for one (t, h) the splits are
        # rows of stride T·nh (one access, not one per split: ns = 128 made ~80% of dsv2-lite's accesses)
        for t in range(T):
            for h in range(h0, h1):
                out += _acc(task, "op", b * ns, (b + 1) * ns, c0, c1, False, ld=T * nh * dim,
                            shift=(t * nh + h) * dim)
            out += _acc(task, "lse", b * ns, (b + 1) * ns, h0, h1, False, ld=T * nh, shift=t * nh)
        for h in range(h0, h1):
            out += _acc(task, "out", b * T, (b + 1) * T, h * dim + c0, h * dim + c1, True)
    elif name == "ROUTE":
        N, E, k, S = f["N"], f["E"], f["topk"], f["S"]
        score, topk, slots = task.has("SCORE"), task.has("TOPK"), task.has("SLOTS")
        # a stage's output is stored when its operand is present; a stage's input is loaded
        # when no earlier stage of this task produced it
        if score:
            out += _acc(task, "lg", 0, N, 0, E, False) + _flat(task, "sc", 0, N * E, True)
        if topk:
            out += _flat(task, "bias", 0, E, False) + _flat(task, "wts", 0, N * k, True)
            out += _flat(task, "ids", 0, N * k, True)
            if not score:
                out += _flat(task, "sc", 0, N * E, False)
        if slots:
            out += _flat(task, "st", 0, 2 * S + S * N * k, True)
            if not topk:
                out += _flat(task, "ids", 0, N * k, False)
    elif name == "EXPERT_LINEAR":
        N, K, k, S, r0, r1 = f["N"], f["K"], f["topk"], f["S"], f["r0"], f["r1"]
        out += _acc(task, "x", 0, N if task.has("GATHER") else N * k, 0, K, False)
        out += _flat(task, "st", 0, 2 * S + S * N * k, False) + _flat(task, "map", 0, f["E"], False)
        out += _acc(task, "out", 0, N * k, r0, r1, True,
                    exclusive=(task.signal, "slot", f["st.off"], f["out.off"], f["slot"], f["slot"] + 1))
        if task.has("DOWN_T"):  # its slice's partial rows (it reads back only the `out` rows it wrote itself)
            base = f["slice"] * N * k
            out += _acc(task, "y", base, base + N * k, 0, K, True,
                        exclusive=(task.signal, "slot", f["st.off"], f["y.off"], f["slot"], f["slot"] + 1))
    elif name == "MOE_COMBINE":
        r0, r1, H, k, c0, c1 = f["r0"], f["r1"], f["H"], f["topk"], f["c0"], f["c1"]
        for s in range(max(1, f["ns"])):  # ns slices of partials (EXPERT_LINEAR[DOWN_T]), ys rows apart
            out += _acc(task, "y", s * f["ys"] + r0 * k, s * f["ys"] + r1 * k, c0, c1, False, ld=H)
        out += _flat(task, "wts", r0 * k, r1 * k, False)
        if task.has("SHARED"):  # nsh slices of partials (LINEAR[DOWN_T]), shs rows apart
            for s in range(max(1, f["nsh"])):
                out += _acc(task, "sh", s * f["shs"] + r0, s * f["shs"] + r1, c0, c1, False)
        if task.has("RES"):
            out += _acc(task, "res", r0, r1, c0, c1, False)
        out += _acc(task, "out", r0, r1, c0, c1, True)
    elif name == "HC_COEFF":
        r0, r1, n, H = f["r0"], f["r1"], f["n"], f["H"]
        width = (2 + n) * n
        mix, act, sink, collapse = (task.has(s) for s in ("MIX", "ACT", "SINK", "COLLAPSE"))
        if mix or collapse:
            out += _acc(task, "st", r0, r1, 0, n * H, False)
        for key, producer, consumer in (("mix", mix, act), ("craw", act, sink), ("coef", sink, collapse)):
            if producer:
                out += _acc(task, key, r0, r1, 0, width, True, ld=width)
            elif consumer:
                out += _acc(task, key, r0, r1, 0, width, False, ld=width)
        if collapse:
            out += _acc(task, "out", r0, r1, 0, H, True)
    elif name == "HC_EXPAND":
        r0, r1, n, H = f["r0"], f["r1"], f["n"], f["H"]
        out += _acc(task, "st", r0, r1, 0, n * H, False) + _acc(task, "sub", r0, r1, 0, H, False)
        out += _acc(task, "coef", r0, r1, 0, (2 + n) * n, False, ld=(2 + n) * n)
        out += _acc(task, "out", r0, r1, 0, n * H, True)
    elif name == "HC_HEAD":
        r0, r1, n, H = f["r0"], f["r1"], f["n"], f["H"]
        out += _acc(task, "st", r0, r1, 0, n * H, False) + _acc(task, "out", r0, r1, 0, H, True)
    elif name == "ARGMAX":
        N, nparts, part = f["N"], f["nparts"], f["part"]
        partial, final = task.has("PARTIAL"), task.has("FINAL")
        if partial:
            out += _acc(task, "lg", 0, N, f["c0"], f["c1"], False)
        if partial:
            out += _acc(task, "pv", 0, N, part, part + 1, True, ld=nparts)
            out += _acc(task, "pi", 0, N, part, part + 1, True, ld=nparts)
        else:
            out += (_acc(task, "pv", 0, N, 0, nparts, False, ld=nparts)
                    + _acc(task, "pi", 0, N, 0, nparts, False, ld=nparts))
        if final:
            out += _acc(task, "out", 0, N, 0, 1, True)
    elif name == "ACCEPT":
        T, b0, b1 = f["T"], f["b0"], f["b1"]
        out += _flat(task, "tok", b0 * T, b1 * T, False) + _flat(task, "tgt", b0 * T, b1 * T, False)
        out += _flat(task, "cl", b0, b1, False) + _flat(task, "follow", b0, b1, False)
        for key in ("acc", "base", "lens"):
            out += _flat(task, key, b0, b1, True)
        out += _flat(task, "emit", b0 * T, b1 * T, True) + _flat(task, "mtp", b0 * T, b1 * T, True)
        out += _acc(task, "next", b0, b1, 0, 1, True)
        if task.has("SAMPLE"):
            out += _acc(task, "lg", b0 * T, b1 * T, 0, f["V"], False) + _flat(task, "rng", b0, b1, False)
    elif name == "GATHER":
        T, b0, b1, cols = f["T"], f["b0"], f["b1"], f["cols"]
        out += _acc(task, "src", b0 * T, b1 * T, 0, cols, False)  # the row chosen at run time
        out += _flat(task, "idx", b0, b1, False) + _acc(task, "out", b0, b1, 0, cols, True)
    elif name == "HELPER_CALL":
        N, k, S = f["N"], f["topk"], f["S"]
        out += _flat(task, "st", 0, 2 * S + S * N * k, False) + _flat(task, "map", 0, f["E"], False)
        out += _acc(task, "x", 0, N, 0, f["K"], False)
        out += _flat(task, "st2", 0, 2 * S + S * N * k, True) + _flat(task, "mail", 0, 2, True)
        box = box_layout(S, N * k, N, f["K"])  # the request (the host writes the answer parts)
        out += _flat(task, "box", 0, BOX_HEADER, True) + _flat(task, "box", box["table"], box["size"], True)
    elif name == "HELPER_WAIT":
        P, H = f["N"] * f["topk"], f["H"]
        out += _acc(task, "y", 0, P, 0, H, False, ld=H) + _flat(task, "mail", 0, 2, False)
        box = box_layout(0, P, f["N"], H)
        out += _flat(task, "box", 0, box["table"], False) + _flat(task, "box", BOX_WAIT_NS, BOX_WAIT_NS + 1, True)
        out += _flat(task, "box", BOX_T_ACKED, BOX_T_ACKED + 2, True) + _acc(task, "out", 0, P, 0, H, True, ld=H)
    elif name == "HELPER_RECV":
        N, K, S, P = f["N"], f["K"], f["S"], f["N"] * f["topk"]
        box = box_layout(S, P, N, K)
        out += _flat(task, "box", 0, BOX_HEADER, False) + _flat(task, "box", box["table"], box["size"], False)
        out += _flat(task, "done", 0, 1, False) + _flat(task, "onh", 0, f["E"], False)
        out += _flat(task, "st", 0, 2 * S + S * P, True) + _acc(task, "x", 0, N, 0, K, True)
        out += _flat(task, "seqw", 0, 1, True) + _flat(task, "gaveup", 0, 1, True)
    elif name == "HELPER_SEND":
        N, K, S, P = f["N"], f["K"], f["S"], f["N"] * f["topk"]
        box = box_layout(S, P, N, K)
        out += _acc(task, "y", 0, P, 0, K, False) + _flat(task, "st", 0, 2 * S + S * P, False)
        out += _flat(task, "seqw", 0, 1, False) + _flat(task, "box", 0, box["table"], True)
    else:
        raise ValueError(f"no footprint for opcode {name}")
    return [a for a in out if not a.empty]


READ_ONLY = (Buf.W, Buf.WF)


def _cache_rows(task, f, cols: int, skip: int = 0) -> list:
    """A cache write of rows r0..r1 (CACHE_WRITE, ROPE[CACHE], RMSNORM[CACHE]): the cache lengths it reads and the
    cache columns col0+skip..col0+skip+cols it writes.  Positions come from the cache lengths at run time: claim every
    position of those sequences; tiles of one op with disjoint rows write distinct positions
    (cache_lens[b] + t differs per t)."""
    r0, r1, T, S, c0 = f["r0"], f["r1"], f["T"], f["S"], f["col0"] + skip
    return (_flat(task, "cl", r0 // T, (r1 - 1) // T + 1, False)
            + _acc(task, "cache", (r0 // T) * S, ((r1 - 1) // T + 1) * S, c0, c0 + cols, True,
                   ld=f["width"], exclusive=(task.signal, "rows", f["cl.off"], f["cache.off"], T,
                                             f["pos_offset"], r0, r1)))
