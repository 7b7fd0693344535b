"""Offline SASS for sm_90 on a machine without a GPU: what a body executes, before spending device time.

    python tools/sass_probe.py kernel [--model dsv2-lite] [--plan KEY=V,...] [--lines] [KEY=V,...]...
        registers, spills, shared memory, 16-byte loads and the SASS instruction stream's count and hash (equal
        hashes: the same code) of the whole persistent kernel, with the block sizes
        launch.launch_blocks() fits to the model's T=1 plan (--plan: plan options as bench.py's --plan-variants
        take them, e.g. expert_mlp=1), then once per variant (block overrides);
        --lines adds instructions, spill loads/stores and barriers per source file and the worst lines, and per
        loop of the weight stream which instruction first waits on its weight loads' scoreboard and across how
        many of the loop's multiply-adds they are in flight (print_weight_waits, fmas_in_flight: 0-10 of a step's
        64 in every stream_chunks loop of both models' kernels; 64-74 in PIN's);
        --source FILE:LO-HI prints those source lines' instructions in address order (what a body's loads wait on)
    python tools/sass_probe.py stream [--lines] [KEY=V,...]...
        the weight stream alone (ops/linear.stream_chunks, bf16 weights): its hot loop's instructions
        by opcode, how many of them run every step (not in a block a forward branch skips), and the first wait
        on its weight loads' scoreboard, per variant (BR, KC, TB: tokens per weight
        chunk, DEPTH: chunks in flight, PFD: L2 prefetch distance (< 0: L1), PIN=1: linear.stream_pinned instead,
        FLAT=1: linear_flat.stream_flat); --lines
        adds them by source line
    python tools/sass_probe.py attention [--lines] [KEY=V,...]...
        ATTENTION's body alone (GQA, bf16 cache, llama-1b's T=1 block sizes by default: BM=16, BJ=128, DMAX=64,
        STAGES=2, 8 warps): its key-block loop's instructions by opcode, barriers and shared-memory traffic;
        --lines adds them by source line and where the next key block's loads are first waited on

How the weight stream was rebuilt in session 4 (docs/PERF.md): ncu said ~730 instructions per 4 KB a
warp streams; this tool showed where they came from (a cross-warp reduction per chunk, divisions,
masks) and counted each fix before the GPU ran it.  Counts are static: the loop body once (it is
unrolled by 2, so a step is about half), branches included whether or not they run.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megakernel.ops import attention, linear, linear_flat  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


@triton.jit
def stream_probe(W, A, I, x_off, x_ld, xrows_div, n_rows, out_off, out_ld, res_off, res_ld, use_res, w_off, w2_off,
                 two, r0, r1, K, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr, TB: tl.constexpr,
                 DEPTH: tl.constexpr, ROWVEC: tl.constexpr, AHEAD: tl.constexpr, PFD: tl.constexpr,
                 PIN: tl.constexpr = 0, FLAT: tl.constexpr = 0):
    """A LINEAR task's stream with runtime sizes, offsets rounded to ALIGN as the kernel's are (PIN 1: the
    pinned stream alone, linear.stream_pinned, whatever the sizes; FLAT 1: linear_flat.stream_flat, pinned)."""
    if FLAT:
        w = linear_flat.flat_tile(W + (w_off // ALIGN) * ALIGN, r0, r1, K, 0, BR, KC, ALIGN, 0)
        linear_flat.stream_flat(A + (x_off // ALIGN) * ALIGN, x_ld, I, xrows_div, A + out_off, out_ld,
                                W + (w_off // ALIGN) * ALIGN, r0, r1, K, w, BR, KC, ALIGN, ROWVEC)
        return
    w = linear.first_chunk(W + (w_off // ALIGN) * ALIGN, r0, r1, K, BR, KC, ALIGN)
    if PIN:
        linear.stream_pinned(A + (x_off // ALIGN) * ALIGN, x_ld, I, xrows_div, A + out_off, out_ld, A + res_off,
                             res_ld, use_res != 0, W + (w_off // ALIGN) * ALIGN, W + (w2_off // ALIGN) * ALIGN,
                             two != 0, r0, r1, K, w, False, 0.0, BR, KC, ALIGN, 16, ROWVEC, 0, 0, False, 1, PFD)
    else:
        linear.stream_chunks(A + (x_off // ALIGN) * ALIGN, x_ld, I, xrows_div, n_rows, A + out_off, out_ld,
                             A + res_off, res_ld, use_res != 0, W + (w_off // ALIGN) * ALIGN,
                             W + (w2_off // ALIGN) * ALIGN, two != 0, r0, r1, K, w, False, 0.0, BR, KC, ALIGN, TB,
                             DEPTH, 16, ROWVEC, AHEAD, PFD)


def compile_kernel(fn, pointers: dict, scalars: list[str], const: dict, num_warps: int = 8):
    """fn compiled for sm_90 (Triton's CompiledKernel: asm["ptx"], asm["cubin"])."""
    sig = {**pointers, **{n: "i32" for n in scalars}, **{k: "constexpr" for k in const}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}  # as the JIT finds tensors
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1})


STREAM_PROBE_ARGS = ({"W": "*bf16", "A": "*fp32", "I": "*i32"},
                     ("x_off x_ld xrows_div n_rows out_off out_ld res_off res_ld use_res "
                      "w_off w2_off two r0 r1 K").split())


def compile_sass(fn, pointers: dict, scalars: list[str], const: dict, num_warps: int = 8) -> tuple[str, str]:
    """(ptxas -v summary, SASS with line info) of fn compiled for sm_90a."""
    k = compile_kernel(fn, pointers, scalars, const, num_warps)
    with tempfile.TemporaryDirectory() as d:
        ptx, obj = Path(d) / "k.ptx", Path(d) / "k.o"
        ptx.write_text(k.asm["ptx"])
        res = subprocess.run([BIN / "ptxas", "-v", "-lineinfo", "--gpu-name=sm_90a", ptx, "-o", obj],
                             capture_output=True, text=True, check=True)
        # -hex: each instruction's encoding, whose control bits say which scoreboard a load sets and which an
        # instruction waits on (scoreboards())
        sass = subprocess.run([BIN / "nvdisasm", "-g", "-hex", "-c", obj], capture_output=True, text=True,
                              check=True).stdout
    info = " ".join(re.findall(r"Used \d+ registers|\d+ bytes spill stores|\d+ bytes stack frame", res.stderr))
    return info + f" | {k.metadata.shared} B shared | {k.asm['ptx'].count('ld.global.v4')} ld.global.v4 in PTX", sass


@triton.jit
def attention_probe(words, A, I, C, BM: tl.constexpr, BJ: tl.constexpr, DMAX: tl.constexpr, RMAX: tl.constexpr,
                    STAGES: tl.constexpr, ALIGN: tl.constexpr, KIND: tl.constexpr, EF: tl.constexpr,
                    QIX: tl.constexpr = 0):
    """One ATTENTION task (its word's fields read at run time), as the persistent kernel runs it."""
    attention.body(words, A, I, C, BM, BJ, DMAX, RMAX, STAGES, ALIGN, "bf16x2", KIND, EF, 0, QIX)


ATTENTION_PROBE_ARGS = ({"words": "*i32", "A": "*fp32", "I": "*i32", "C": "*bf16"}, [])


def sass_lines(sass: str, labels: dict | None = None) -> list[tuple[int, str, str]]:
    """(offset, source file:line, instruction) of every instruction of nvdisasm -g output; labels,
    if given, gets each branch label's offset."""
    items, where, pending = [], "?", []
    for line in sass.splitlines():
        m = re.match(r"^\.(L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = f"{Path(m.group(1)).name}:{m.group(2)}"
            continue
        m = INSTR.match(line)
        if m:
            addr = int(m.group(1), 16)
            if labels is not None:
                labels.update({p: addr for p in pending})
            pending = []
            items.append((addr, where, m.group(2)))
    return items


HEX = re.compile(r"/\*\s*0x([0-9a-f]{16})\s*\*/")


def scoreboards(sass: str) -> dict[int, tuple[int, int, int]]:
    """offset -> (scoreboard the instruction sets when it writes, when it has read its operands, wait mask) from
    `nvdisasm -hex` output (sm_90's 128-bit encoding: the control bits are the top 23 of the second 64-bit word;
    7 = none).  A variable-latency instruction (a global load) counts up one of six scoreboards and down when it
    completes; an instruction that waits on a scoreboard stalls until *every* instruction counted on it has
    completed (this kernel has no DEPBAR.LE that waits for some), so a load a chunk ahead is only in flight
    across a wait if its scoreboard differs from that wait's."""
    out, lines = {}, sass.splitlines()
    for k, line in enumerate(lines[:-1]):
        m = INSTR.match(line)
        hi = HEX.search(lines[k + 1]) if m else None
        if hi and not INSTR.match(lines[k + 1]):
            h = int(hi.group(1), 16)
            out[int(m.group(1), 16)] = ((h >> 46) & 7, (h >> 49) & 7, (h >> 52) & 0x3F)
    return out


def source_lines(fn) -> tuple[str, range]:
    """A @triton.jit function's file name and line numbers, as nvdisasm -g names them."""
    lines, first = inspect.getsourcelines(fn.fn)
    return Path(inspect.getsourcefile(fn.fn)).name, range(first, first + len(lines))


def load_drains(sass: str, span: list[tuple[int, str, str]], loads, sb: dict | None = None):
    """For each global load in span (a loop body, in address order) of the function `loads` (a @triton.jit
    function, e.g. linear.weight_rows): (its offset, source line, instruction, scoreboard, the loop's instructions
    after it going round, the index there of the first that waits on its scoreboard, or None).  sb:
    scoreboards(sass), if the caller has it."""
    sb = scoreboards(sass) if sb is None else sb
    name, numbers = source_lines(loads)
    for i, (addr, where, ins) in enumerate(span):
        f, _, ln = where.partition(":")
        if opcode(ins) != "LDG" or f != name or not ln.isdigit() or int(ln) not in numbers:
            continue
        bar = sb.get(addr, (7, 7, 0))[0]
        after = span[i + 1:] + span[:i + 1]
        drain = next((k for k, (a2, _, _) in enumerate(after) if sb.get(a2, (7, 7, 0))[2] >> bar & 1), None)
        yield addr, where, ins, bar, after, drain


def first_waits(sass: str, span: list[tuple[int, str, str]], loads,
                sb: dict | None = None) -> list[tuple[int, str, int, str, int | None]]:
    """For each load of load_drains: its offset, source line and scoreboard; the source line and opcode of the
    first instruction after it, going round the loop, that waits on that scoreboard; and how many instructions
    that wait comes before the first one that reads what the load wrote (None: no reader in the loop).  A chunk
    requested a step ahead is in flight through the step's multiply only if that count is 0: a wait before its
    first reader (on a scoreboard it shares with another load) drains it early, and the instructions between run
    with nothing in flight."""
    found = []
    for addr, where, ins, bar, after, drain in load_drains(sass, span, loads, sb):
        dest = loaded_registers(ins)
        reader = next((k for k, (_, _, ins2) in enumerate(after) if dest & read_registers(ins2)), None)
        if drain is not None:
            gap = None if reader is None else max(0, reader - drain)
            found.append((addr, where, bar, f"{after[drain][1]} {opcode(after[drain][2])}", gap))
    return found


def fmas_in_flight(sass: str, span: list[tuple[int, str, str]], loads, sb: dict | None = None) -> dict[int, int]:
    """For each load of load_drains: how many of the loop's FFMA and FMUL instructions come between it and the
    first instruction that waits on its scoreboard, going round the loop: the arithmetic its latency overlaps.  A
    chunk requested a step ahead that overlaps none of the multiply (requested after it, or drained before it)
    costs its whole latency in series with the step."""
    return {addr: sum(opcode(x) in ("FFMA", "FMUL") for _, _, x in after[:len(after) if drain is None else drain])
            for addr, _, _, _, after, drain in load_drains(sass, span, loads, sb)}


def loaded_registers(ins: str) -> set[int]:
    """The registers a load writes: its first operand, 1, 2 or 4 of them by its width (.64, .128)."""
    m = re.match(r"(LDG\S*)\s+R(\d+)", unpredicated(ins))
    if not m:
        return set()
    width = 4 if ".128" in m.group(1) else 2 if ".64" in m.group(1) else 1
    return set(range(int(m.group(2)), int(m.group(2)) + width))


def read_registers(ins: str) -> set[int]:
    """The registers an instruction reads (its operands after the first; a store's all), as numbers; a 64-bit
    address operand (R28.64) names two."""
    op, _, operands = unpredicated(ins).partition(" ")
    parts = [p.strip() for p in operands.split(",")]
    if not op.startswith(("ST", "RED", "ATOM")):
        parts = parts[1:]
    regs = set()
    for part in parts:
        for m in re.finditer(r"\bR(\d+)(\.64)?", part):
            regs.update({int(m.group(1)), int(m.group(1)) + 1} if m.group(2) else {int(m.group(1))})
    return regs


def loop_spans(sass: str) -> list[list[tuple[int, str, str]]]:
    """(offset, source line, instruction) of each backward branch's span, widest first."""
    labels = {}
    items = sass_lines(sass, labels)
    spans = set()
    for addr, _, ins in items:
        m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", ins)
        if m and labels.get(m.group(1), addr) < addr:
            spans.add((labels[m.group(1)], addr))
    return [[item for item in items if a <= item[0] <= b] for a, b in sorted(spans, key=lambda span: span[0] - span[1])]


def run_every_step(sass: str, span: list[tuple[int, str, str]]) -> tuple[int, list[int]]:
    """(how many of a loop's instructions no forward conditional branch inside it skips, the sizes of the blocks
    such branches skip): what a step issues when none of those branches is taken (PIN=2's row stores)."""
    labels = {}
    sass_lines(sass, labels)
    addrs = [a for a, _, _ in span]
    skipped, blocks = set(), []
    for addr, _, ins in span:
        m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", ins)
        if m and ins.startswith("@") and addr < labels.get(m.group(1), -1) <= addrs[-1]:
            block = [a for a in addrs if addr < a < labels[m.group(1)]]
            blocks.append(len(block))
            skipped.update(block)
    return len(span) - len(skipped), blocks


def loops(sass: str) -> list[list[tuple[str, str]]]:
    """(source line, instruction) of each backward branch's span, widest first."""
    return [[(w, ins) for _, w, ins in span] for span in loop_spans(sass)]


def hot_loop(sass: str) -> list[tuple[str, str]]:
    """(source line, instruction) inside the widest backward branch."""
    return (loops(sass) or [[]])[0]


def unpredicated(ins: str) -> str:
    """The instruction without its guard predicate (@P0, @!UP1)."""
    return re.sub(r"^@!?U?P\w+\s+", "", ins)


def opcode(ins: str) -> str:
    return unpredicated(ins).split()[0].split(".")[0]


def parse_variant(spec: str) -> dict:
    return {k: int(v) for k, _, v in (kv.partition("=") for kv in spec.split(",") if kv)}


def probe_stream(variants: list[str], lines: bool) -> None:
    for spec in variants or [""]:
        const = {**dict(BR=8, KC=2048, ALIGN=8, TB=1, DEPTH=1, ROWVEC=0, AHEAD=0, PFD=0, PIN=0, FLAT=0),
                 **parse_variant(spec)}
        info, sass = compile_sass(stream_probe, *STREAM_PROBE_ARGS, const)
        loop = hot_loop(sass)
        ops = collections.Counter(opcode(ins) for _, ins in loop)
        print(f"stream {spec or 'default'} ({const}): {info}")
        print(f"  hot loop {len(loop)} instructions: " + ", ".join(f"{o} {n}" for o, n in ops.most_common(16)))
        spans = loop_spans(sass)
        always, blocks = run_every_step(sass, spans[0])
        print(f"  run every step: {always} (branch-skipped blocks: {blocks or 'none'})")
        print_weight_waits(sass, spans[:1], linear_flat.flat_tile if const["FLAT"] else None)
        if lines:
            by_line = collections.Counter(w for w, _ in loop)
            for w, n in sorted(by_line.items(), key=lambda kv: -kv[1])[:20]:
                print(f"    {w:28s} {n}")


def print_weight_waits(sass: str, spans: list[list[tuple[int, str, str]]], loads=None, what_loads="weight") -> None:
    """Per loop that loads weight chunks (linear.weight_rows, or the @triton.jit function `loads`): which
    instruction first waits for them.  The stream requests step i+1's chunk before multiplying step i's; if an
    instruction of step i waits on the chunk's scoreboard, the chunk is drained there and the next one is not in
    flight during the multiply."""
    gaps, fmas, sb = collections.defaultdict(list), collections.defaultdict(list), scoreboards(sass)
    for span in spans:
        flight = fmas_in_flight(sass, span, loads or linear.weight_rows, sb)
        for addr, where, bar, wait, gap in first_waits(sass, span, loads or linear.weight_rows, sb):
            # each load is read in the narrowest loop around it
            if min((s for s in spans if s[0][0] <= addr <= s[-1][0]), key=len) is span:
                gaps[(span[0][0], f"{where} sb{bar}", wait)].append(gap)
                fmas[(span[0][0], f"{where} sb{bar}", wait)].append(flight[addr])
    for (start, load, wait), gap in sorted(gaps.items()):
        early = [g for g in gap if g]
        what = (f"{len(early)} of them {min(early)}-{max(early)} instructions before their first reader (drained "
                "early)") if early else "their first reader" if None not in gap else "no reader in this loop"
        over = fmas[(start, load, wait)]
        print(f"  loop at {start:x}: {len(gap)} {what_loads} loads ({load}) first waited on at {wait}: {what}; "
              f"in flight across {min(over)}-{max(over)} FFMA/FMUL")


def probe_attention(variants: list[str], lines: bool) -> None:
    """The narrowest loop with tensor-core instructions: one key block (ATTENTION's inner loop)."""
    for spec in variants or [""]:
        const = {**dict(BM=16, BJ=128, DMAX=64, RMAX=16, STAGES=2, ALIGN=8, KIND=2, EF=0, QIX=0), **parse_variant(spec)}
        num_warps = const.pop("num_warps", 8)
        info, sass = compile_sass(attention_probe, *ATTENTION_PROBE_ARGS, const, num_warps)
        with_mma = [lp for lp in loop_spans(sass) if any(opcode(ins) in ("HMMA", "HGMMA") for _, _, ins in lp)]
        span = min(with_mma, key=len) if with_mma else []
        block = [(w, ins) for _, w, ins in span]
        ops = collections.Counter(opcode(ins) for _, ins in block)
        print(f"attention {spec or 'default'} ({const}, {num_warps} warps): {info}")
        print(f"  key-block loop {len(block)} instructions; barriers {ops['BAR']}, shared stores {ops['STS']}, "
              f"shared loads {ops['LDS'] + ops['LDSM']} (LDSM {ops['LDSM']}), global loads {ops['LDG']}, "
              f"shuffles {ops['SHFL']}, tensor-core {ops['HMMA'] + ops['HGMMA']}")
        print("  " + ", ".join(f"{o} {n}" for o, n in ops.most_common(18)))
        if lines:
            by_line = collections.Counter(w for w, _ in block)
            for w, n in sorted(by_line.items(), key=lambda kv: -kv[1])[:20]:
                print(f"    {w:28s} {n}")
            # the next key block, requested before this one's arithmetic (STAGES 2): in flight through it?
            print_weight_waits(sass, [span] if span else [], attention.kv_block, "key-block")


def print_spills(sass: str) -> None:
    """Instructions, local-memory spill traffic (STL/LDL) and CTA barriers (BAR) per source file, then
    the worst lines of each."""
    items = [(where, ins) for _, where, ins in sass_lines(sass)]
    per_file = collections.defaultdict(collections.Counter)
    spills, bars = collections.Counter(), collections.Counter()
    for where, ins in items:
        op = opcode(ins)
        f = per_file[where.split(":")[0]]
        f["instr"] += 1
        if op in ("STL", "LDL", "BAR"):
            f[op] += 1
            (bars if op == "BAR" else spills)[where] += 1
    for name, c in sorted(per_file.items(), key=lambda kv: -kv[1]["instr"]):
        print(f"    {name:20s} {c['instr']:6d} instructions, STL {c['STL']:4d}, LDL {c['LDL']:4d}, BAR {c['BAR']:3d}")
    print("    spill traffic by line: " + ", ".join(f"{w} {n}" for w, n in spills.most_common(12)))
    print("    barriers by line: " + ", ".join(f"{w} {n}" for w, n in bars.most_common(12)))


def probe_kernel(model: str, variants: list[str], lines: bool = False, plan_spec: str = "", source: str = "") -> None:
    import torch

    from graph.compile import compile_options, compile_step
    from graph.isa import decode
    from graph.lower import StepShape
    from megakernel.kernel import megakernel
    from megakernel.launch import LaunchConfig, kernel_constants, launch_blocks, wait_bound_s
    from model import preset

    options, attn_split = compile_options(plan_spec, 132)
    plan = compile_step(preset(model), StepShape(T=1, B=1, max_len=4096, attn_split=attn_split), options)
    tasks = [decode(w) for w in plan.words]
    pointers = {"words": "*i32", "queue_ptr": "*i32", "counters": "*i32", "worker_epoch": "*i32", "err": "*i32",
                "prof": "*i64", "W": "*bf16", "WF": "*fp32", "A": "*fp32", "I": "*i32", "C": "*bf16", "HB": "*i32",
                "HT": "*i32", "HL": "*i32", "HD": "*i32"}
    for spec in variants or [""]:
        blocks = parse_variant(spec)
        num_warps = blocks.pop("num_warps", 8)  # a launch option, not a constant of the kernel
        config = LaunchConfig(blocks=blocks)  # the constants a Megakernel of this plan would launch with
        const = kernel_constants(launch_blocks(tasks, torch.bfloat16, config, plan), wait_bound_s(tasks, config),
                                 config, on_cuda=True)
        info, sass = compile_sass(megakernel, pointers, [], const, num_warps)
        # the instruction stream's hash: a change meant to leave a kernel alone must leave it equal (debug labels
        # alone can move ptxas's scheduling: docs/NOTES.md session 42)
        stream = [m.group(2) for m in INSTR.finditer(sass)]
        digest = hashlib.sha1("\n".join(stream).encode()).hexdigest()[:12]
        print(f"kernel {model}{' ' + plan_spec if plan_spec else ''} {spec or 'fitted'}: {info}, "
              f"{len(stream)} instructions, SASS {digest}")
        if lines:
            print_spills(sass)
            spans = loop_spans(sass)
            print_weight_waits(sass, spans)
            print_weight_waits(sass, spans, linear_flat.flat_tile, "flat weight")  # PIN=2's
        if source:
            print_source_sass(sass, source)


def print_source_sass(sass: str, source: str) -> None:
    """The instructions of source lines FILE:LO-HI (e.g. moe.py:300-372), in address order: where a body's loads
    go out and what waits on them (session 34 read two latencies off these: a load the compiler sank into a branch,
    and the fields a body reads after the L1 invalidation that ends every poll, CCTL.IVALL)."""
    name, _, span = source.partition(":")
    lo, _, hi = span.partition("-")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise SystemExit(f"--source {source!r}: FILE:LO-HI, e.g. moe.py:300-372")
    for addr, where, ins in sass_lines(sass):
        f, _, ln = where.partition(":")
        if f == name and ln.isdigit() and lo <= int(ln) <= hi:
            print(f"  {addr:6x} {where:16s} {ins}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["kernel", "stream", "attention"])
    p.add_argument("variants", nargs="*", metavar="KEY=V,...")
    p.add_argument("--model", default="dsv2-lite")
    p.add_argument("--plan", default="", metavar="KEY=V,...", help="plan options (kernel): e.g. expert_mlp=1")
    p.add_argument("--lines", action="store_true")
    p.add_argument("--source", default="", metavar="FILE:LO-HI",
                   help="kernel: also print the SASS of these source lines, e.g. moe.py:300-372")
    args = p.parse_intermixed_args()  # options before or after the variants, as the usage lines write them
    if args.what == "stream":
        probe_stream(args.variants, args.lines)
    elif args.what == "attention":
        probe_attention(args.variants, args.lines)
    else:
        probe_kernel(args.model, args.variants, args.lines, args.plan, args.source)


if __name__ == "__main__":
    main()
