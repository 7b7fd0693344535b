"""The instruction set: opcodes, their flags and fields, and the fixed-width task word.

A task is WORDS int32 words:

    0 opcode | 1 flags | 2 signal counter | 3..10 up to MAX_WAITS (counter, count) pairs | 11 tile id
    12.. the opcode's fields, in the order listed below

A wait (c, n) is satisfied when counters[c] >= epoch * n; unused waits have
c = -1.  Operands are (buffer, offset[, ld]) in elements of that buffer; an
offset takes two words (low, high: weight arenas and caches pass 2^31
elements); floats are stored as their IEEE-754 bit pattern.  The runtime (megakernel/ops) gives
each opcode its meaning; this file is the contract between compiler and runtime.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

WORDS = 64
MAX_WAITS = 4
HEADER = 12
NO_COUNTER = -1
ON_HELPER = -1  # expert-map value (helper plans' in.L{l}.expert_map) of an expert the helper computes


class Buf(IntEnum):
    W = 0  # weights in the model dtype (one arena, laid out in the order tasks read it)
    WF = 1  # fp32 weights and compile-time constants (router bias, mHC parameters, rope frequencies)
    A = 2  # fp32 activations
    I = 3  # int32 activations and inputs (tokens, cache lengths, routing tables, argmax)
    C = 4  # the KV / latent cache, model dtype, [layers, B, S_max, width]
    H = 5  # int32 mailboxes in host-mapped memory (helper plans): what a helper device reads and answers


# A helper call site's mailbox (int32 words of Buf.H; rows are fp32 bit patterns), written by
# HELPER_CALL, answered by the host's helper service, read by HELPER_WAIT:
#   header  [BOX_SEQ] request sequence number (the step's epoch; written last, release, system scope)
#           [BOX_ACK] answered sequence number (host, written after the answer)
#           [BOX_WAIT_NS] how long HELPER_WAIT waited for it (device timer; 0 without one)
#           [BOX_PASSED] the step's epoch, when the step passed the site without a call (one word, no
#           wait: a persistent helper kernel learns from it that the site has nothing for it)
#           a call's timeline, int64 %globaltimer stamps (nanoseconds; 0 without a timer), read at the step
#           boundary: [BOX_T_PUB] HELPER_CALL published (main GPU), [BOX_T_ANSWER] a helper GPU
#           published its rows (helper GPU), [BOX_T_ACKED] HELPER_WAIT saw the answer (main GPU)
#           [CTL_DONE] (the plan's first mailbox only) the last step of the main runner known to be
#           over (host-written when a step failed, or at close; it only grows): a persistent helper
#           kernel's sites still waiting on it end
#   mask    P words: 1 where pair row p is the helper's (host)
#   ans     P x K: the helper's rows (host)
#   table   the routed slot table (ROUTE's st, 2S + S·P words), written every step (device): the host
#           takes the helper's slots by its placement, and routing statistics from all of them
#   x       N x K token rows (device)
BOX_SEQ, BOX_ACK, BOX_WAIT_NS, BOX_PASSED = 0, 1, 2, 3
BOX_T_PUB, BOX_T_ANSWER, BOX_T_ACKED = 4, 6, 8  # int64 stamps: even words of a 128-byte aligned header
CTL_DONE = 10
BOX_HEADER = 32  # one 128-byte line


def box_layout(S: int, P: int, N: int, K: int) -> dict[str, int]:
    """Word offsets of a mailbox's parts, and its size (P = N·topk pair rows, K = hidden size)."""
    mask = BOX_HEADER
    ans = mask + -(-P // 32) * 32
    table = ans + P * K
    x = table + -(-(2 * S + S * P) // 32) * 32
    return {"mask": mask, "ans": ans, "table": table, "x": x, "size": x + N * K}


@dataclass(frozen=True)
class Opcode:
    name: str
    code: int
    fields: tuple[str, ...]
    flags: tuple[str, ...] = ()

    def flag(self, name: str) -> int:
        return 1 << self.flags.index(name)

    def flag_bits(self, names) -> int:
        bits = 0
        for n in names:
            bits |= self.flag(n)
        return bits

    def flag_names(self, bits: int) -> tuple[str, ...]:
        return tuple(n for i, n in enumerate(self.flags) if bits >> i & 1)


def _f(spec: str) -> tuple[str, ...]:
    """'x* w* N' -> x.buf x.off x.ld w.buf w.off N ('*' adds buf/off/ld, '+' adds buf/off)."""
    out: list[str] = []
    for token in spec.split():
        if token.endswith("*"):
            out += [token[:-1] + ".buf", token[:-1] + ".off", token[:-1] + ".ld"]
        elif token.endswith("+"):
            out += [token[:-1] + ".buf", token[:-1] + ".off"]
        else:
            out.append(token)
    return tuple(out)


_OPS = [
    # out[r, c*H:(c+1)*H] = table[tok[r·ld]] for each of `copies` (mHC streams) — rows r0..r1
    Opcode("EMBED", 1, _f("tok* table+ out* H copies r0 r1")),
    # v = x[r] (+ d[r] with ADD, v also stored to xo); out[r] = v * rsqrt(mean(v²) + eps) * w;
    # CACHE: into cache[b, pos, col0 : col0 + D] instead (in the cache dtype), b and pos as in CACHE_WRITE
    Opcode("RMSNORM", 2, _f("x* d* xo* w+ out* D r0 r1 eps cache+ cl+ T S width col0 pos_offset"),
           ("ADD", "NOWEIGHT", "CACHE")),
    # out[:, r0:r1] = x[:N, :K] @ W[r0:r1].T (+ res with RES); SILU_MUL: silu(x@W.T) * (x@W2.T);
    # NORM: each x@W.T times rsqrt(mean(x[n]²) + eps), x's RMSNorm (its weight folded into W's columns);
    # PAIR: x@W.T + x@W2.T, W and W2 one matrix's bf16 high and low parts (a router's folded weights, kept exact)
    # DOWN_T (with SILU_MUL; fusion rules expert_mlp's shared experts, dense_mlp): then also y[slice·N + n, :K] =
    # sum over rows r0..r1 of out[n, r] · wd[r, :K], wd the down projection transposed (its row r at wd.off + r·K)
    Opcode("LINEAR", 3, _f("x* w+ w2+ res* out* N K r0 r1 eps wd+ y* slice"),
           ("SILU_MUL", "RES", "NORM", "PAIR", "DOWN_T")),
    # out = a + b | a * b | silu(a) | a, rows r0..r1, cols columns
    Opcode("EWISE", 4, _f("a* b* out* cols r0 r1"), ("ADD", "MUL", "SILU", "COPY")),
    # out[r] = [cos(pos·f) · scale, sin(pos·f) · scale], pos = cache_lens[r // T] + r % T + pos_offset
    Opcode("ROPE_TABLE", 5, _f("cl+ f+ out+ T half scale pos_offset r0 r1")),
    # out[r, h*out_hs : +2·half] = rotate(x[r, h*x_hs + x_col0 : +2·half]) for each head h0 <= h < heads;
    # CACHE: into cache[b, pos, col0 + h*out_hs : +2·half] instead, b and pos as in CACHE_WRITE
    Opcode("ROPE", 6, _f("x* tab+ out* heads x_hs x_col0 out_hs half r0 r1 cache+ cl+ T S width col0 pos_offset h0"),
           ("INTERLEAVE", "CACHE")),
    # cache[b, pos, col0:col0+cols] = src[r, :cols], b = r // T, pos as in ROPE_TABLE
    Opcode("CACHE_WRITE", 7, _f("src* cache+ cl+ T S width col0 cols pos_offset r0 r1")),
    # out[n, h*out_hs + o] = sum_i x[n, h*x_hs + x_col0 + i] · W_h[i, o] for heads h0..h1, o in o0..o1;
    # W_h[i, o] at w.off + h*w_hs + i*w_ld + o, or o*w_ld + i with TRANS
    Opcode("HEAD_MATMUL", 8, _f("x* x_hs x_col0 w+ w_hs w_ld out* out_hs N in_dim out_dim h0 h1 o0 o1"), ("TRANS",)),
    # partial attention of sequence b, heads h0..h1 over cache rows [split·split_len, +split_len):
    # o_part[b, split, t, h, :dim], lse_part[b, split, t, h]
    # ROPE (GQA, one KV head g a task): q is rotated here (rotate-half, cos/sin from tab's rows b·T + t, ld dim);
    # the step's new keys kn[b·T + t, g·kv_hs : +dim], rotated, and values vn[..] (vn's ld: kn.ld) are written
    # into the cache at their positions, by the split whose rows hold them, before it reads its rows
    Opcode("ATTENTION", 9, _f("q* q_hs q_col0 pe* pe_hs pe_col0 cache+ cl+ T S width b h0 h1 split split_len "
                              "dim rope_dim v_col0 kv_hs group scale op+ lse+ nheads nsplits pos_offset tab+ kn* vn+"),
           ("MLA", "ROPE")),
    # out[b*T + t, h*dim : +dim] = sum_s exp(lse_s - LSE) · o_part_s
    Opcode("ATTN_COMBINE", 10, _f("op+ lse+ out* b T h0 h1 nheads nsplits dim c0 c1")),
    # SCORE: scores = softmax|sigmoid(logits); TOPK: ids, weights; SLOTS: distinct experts -> slot table
    # st = [expert of slot s (-1: empty)] * S + [pairs in slot s] * S + [pair ids (token·topk + j)] * S·N·topk
    Opcode("ROUTE", 11, _f("lg* sc+ bias+ ids+ wts+ st+ N E topk n_group topk_group scale S"),
           ("SCORE", "TOPK", "SLOTS", "SIGMOID", "NOAUX", "GROUPED", "NORM")),
    # rows of expert slot_expert[slot]'s weights r0..r1 applied to the tokens routed to `slot`
    # with a map (helper plans): the weights sit in main slot map[expert] of a shared arena
    # DOWN_T (with SILU_MUL; fusion rule expert_mlp): then also y[slice·N·topk + pair, :K] = sum over rows r0..r1 of
    # out[pair, r] · wd[r, :K], wd the expert's down projection transposed (its row r at expert·w_es + r·K)
    Opcode("EXPERT_LINEAR", 12, _f("x* w+ w2+ w_es out* st+ N K r0 r1 slot S topk map+ E wd+ y* slice"),
           ("GATHER", "SCATTER", "SILU_MUL", "DOWN_T")),
    # out[r, c0:c1] = sum_j wts[r, j] · y[r·topk + j] (+ shared[r]) (+ res[r]), summed in a fixed order; with ns > 1,
    # y[r·topk + j] is itself the sum of ns slices' rows, ys rows apart (EXPERT_LINEAR[DOWN_T]'s partials), in order;
    # with nsh > 1, shared[r] the sum of nsh slices' rows of sh, shs rows apart (LINEAR[DOWN_T]'s); topk 0: no routed
    # experts, a dense MLP's partials summed (fusion rule dense_mlp)
    Opcode("MOE_COMBINE", 13, _f("y+ wts+ sh* res* out* H topk r0 r1 c0 c1 ns ys nsh shs"), ("SHARED", "RES")),
    # MIX: mix = rmsnorm(streams) @ fn.T; ACT: raw coefficients; SINK: Sinkhorn; COLLAPSE: sum_j pre_j stream_j
    Opcode("HC_COEFF", 14, _f("st* fn+ base+ scale+ mix+ craw+ coef+ out* n H iters eps hc_eps r0 r1"),
           ("MIX", "ACT", "SINK", "COLLAPSE")),
    # new[r, k] = post_k · sub[r] + sum_j comb[j, k] · st[r, j]
    Opcode("HC_EXPAND", 15, _f("st* sub* coef+ out* n H r0 r1")),
    # out[r] = sum_j (sigmoid(rmsnorm(st[r]) @ fn.T · scale + base) + hc_eps)_j · st[r, j]
    Opcode("HC_HEAD", 16, _f("st* fn+ base+ scale+ out* n H eps hc_eps r0 r1")),
    # PARTIAL: (max, first argmax) of logits[:, c0:c1] -> pv/pi[row*nparts + part]; FINAL: out[row·ld]
    Opcode("ARGMAX", 17, _f("lg* N c0 c1 pv+ pi+ part nparts out*"), ("PARTIAL", "FINAL")),
    # speculative acceptance for sequences b0..b1 of a T-token step (tokens x, d_1..d_{T-1}; targets y):
    # GREEDY: a = longest prefix with d_{i+1} == y_i; ALL (prefill): a = T-1.  Writes accepted[b] = a,
    # emitted[b, :] = d_1..d_a, y_a, -1..., next[b·nld] = y_a, base[b] = cl[b] + a, lens[b] = base + 1,
    # mtp[b·T + i] = (i < a ? d_{i+1} : y_a), or follow[b] for i = T-1 in ALL mode when follow[b] >= 0
    # SAMPLE: speculative sampling from softmax(lg / temperature) within top_p: draft d (a point-mass
    # guess) is kept with probability p(d); the first rejection resamples from p without d; the bonus
    # token is sampled from p.  Uniforms come from a hash of (rng[b], row, draw): reproducible.
    Opcode("ACCEPT", 18, _f("tok+ tgt+ cl+ follow+ acc+ emit+ next* base+ lens+ mtp+ lg* rng+ V temperature top_p "
                            "T b0 b1"), ("GREEDY", "ALL", "SAMPLE")),
    # out[b, :cols] = src[b·T + idx[b], :cols] for b in b0..b1 (fp32, or int32 with INT)
    Opcode("GATHER", 19, _f("src* idx+ out* T cols b0 b1"), ("INT",)),
    # st2 = st without the slots whose expert map[e] sends to the helper; those slots' token rows
    # x (N x K), expert ids and a sequence number are published (into mailbox `box`, see box_layout):
    # mail = [seq, helper slots], [0, 0] when no slot goes to the helper (nothing published)
    Opcode("HELPER_CALL", 20, _f("st+ map+ x* st2+ mail+ box+ N K E topk S layer")),
    # out = y, then the helper's rows (acknowledged call mail[0], waited for with a bound) merged in
    Opcode("HELPER_WAIT", 21, _f("y+ mail+ box+ out+ N H topk layer")),
    # A persistent helper kernel's side of a call (helper_card/persistent.py), in the helper's buffers.
    # The main step it answers is its own launch's epoch + epoch0.  Waits (bounded) until that step
    # published mailbox `box` (its sequence word equals the step: a call) or passed it (the box's
    # BOX_PASSED word or `done`, CTL_DONE, reaches the step, or a later step called it; or the wait
    # outlived its bound: then gaveup[0] = the step, and the kernel's later sites pass at once), then
    # st = the call's slot table with only the helper's slots (onh[expert] != 0) kept, x = its token
    # rows, seqw[0] = its sequence number (0: passed, every slot empty)
    Opcode("HELPER_RECV", 22, _f("box+ done+ st+ onh+ x* seqw+ gaveup+ epoch0 N K E topk S layer")),
    # If seqw[0] != 0: the rows of st's slots' pairs from y into the mailbox's answer, its mask, then
    # the acknowledgement seqw[0] (system-scope release); nothing for a skipped call
    Opcode("HELPER_SEND", 23, _f("y* box+ st+ seqw+ N K S topk layer")),
]

OPCODES: dict[str, Opcode] = {op.name: op for op in _OPS}
BY_CODE: dict[int, Opcode] = {op.code: op for op in _OPS}
FLOAT_FIELDS = frozenset({"eps", "scale", "hc_eps", "temperature", "top_p"})


def is_wide(name: str) -> bool:
    return name.endswith(".off")


def layout(op: Opcode) -> dict[str, int]:
    """Word index of each field (wide fields take two words: low, high)."""
    pos, out = HEADER, {}
    for name in op.fields:
        out[name] = pos
        pos += 2 if is_wide(name) else 1
    return out


LAYOUTS = {op.name: layout(op) for op in _OPS}
assert all(pos + (2 if is_wide(name) else 1) <= WORDS for op in _OPS for name, pos in LAYOUTS[op.name].items())


def f2i(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def i2f(x: int) -> float:
    return struct.unpack("<f", struct.pack("<i", int(x)))[0]


def encode(opcode: str, flags: int, signal: int, waits: list[tuple[int, int]], tile: int,
           fields: dict[str, float | int]) -> list[int]:
    op = OPCODES[opcode]
    if len(waits) > MAX_WAITS:
        raise ValueError(f"{opcode} task has {len(waits)} waits, at most {MAX_WAITS} fit a task word")
    unknown = set(fields) - set(op.fields)
    if unknown:
        raise ValueError(f"{opcode} has no field(s) {sorted(unknown)}")
    word = [0] * WORDS
    word[0], word[1], word[2], word[11] = op.code, flags, signal, tile
    for i in range(MAX_WAITS):
        c, n = waits[i] if i < len(waits) else (NO_COUNTER, 0)
        word[3 + 2 * i], word[4 + 2 * i] = c, n
    for name, pos in LAYOUTS[opcode].items():
        value = fields.get(name, 0)
        if name in FLOAT_FIELDS:
            word[pos] = f2i(value)
        elif is_wide(name):
            value = int(value)
            lo = value & 0xFFFFFFFF
            word[pos], word[pos + 1] = lo - (1 << 32) if lo >= 1 << 31 else lo, value >> 32
        else:
            if not -(1 << 31) <= int(value) < 1 << 31:
                raise ValueError(f"{opcode} field {name}={value} does not fit 32 bits")
            word[pos] = int(value)
    return word


@dataclass(frozen=True)
class Decoded:
    op: Opcode
    flags: int
    signal: int
    waits: tuple[tuple[int, int], ...]
    tile: int
    fields: dict

    def has(self, flag: str) -> bool:
        return bool(self.flags & self.op.flag(flag))

    def __getitem__(self, name: str):
        return self.fields[name]


def decode(word) -> Decoded:
    word = [int(v) for v in word]
    op = BY_CODE.get(word[0])
    if op is None:
        raise ValueError(f"unknown opcode {word[0]} in task word")
    waits = tuple((word[3 + 2 * i], word[4 + 2 * i]) for i in range(MAX_WAITS) if word[3 + 2 * i] != NO_COUNTER)
    fields = {}
    for name, pos in LAYOUTS[op.name].items():
        if name in FLOAT_FIELDS:
            fields[name] = i2f(word[pos])
        elif is_wide(name):
            fields[name] = (word[pos] & 0xFFFFFFFF) | (word[pos + 1] << 32)
        else:
            fields[name] = word[pos]
    return Decoded(op, word[1], word[2], waits, word[11], fields)
