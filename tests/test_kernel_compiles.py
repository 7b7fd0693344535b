"""The persistent kernel compiles for Hopper (sm_90) on a CPU: frontend, layouts and ptxas errors
show up here, before any GPU time is spent."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

COMMON = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megakernel.kernel import megakernel
from graph.isa import WORDS, MAX_WAITS
sig = {"words": "*i32", "queue_ptr": "*i32", "counters": "*i32", "worker_epoch": "*i32", "err": "*i32",
       "prof": "*i64", "W": "*bf16", "WF": "*fp32", "A": "*fp32", "I": "*i32", "C": "*bf16", "HB": "*i32",
       "HT": "*i32", "HL": "*i32", "HD": "*i32"}
const = dict(WORDS=WORDS, MAX_WAITS=MAX_WAITS, TIMEOUT_NS=250_000_000, MAX_SPINS=1000, HELPER_NS=1_000_000_000,
             USE_TIMER=True, PROFILE=True,
             BR=8, KC=2048, STAGES=2, BD=256, BH=32, BM=16, BJ=32, DMAX=512, RMAX=64, BI=64, BO=128, BIT=256, BOT=64,
             BE=256, BP=256, BW=32, BSC=16, BCW=64, BN=2048, BK=8, CPF=1, SAMPLE=1, BV=1024, TB=8, PF=2, DEPTH=2,
             ALIGN=8, BT=16, DOT_PREC="tf32",
             ATT_KIND=0, ROWVEC=1, AHEAD=1, NARROW=1, ROUTE1=1, PFD=0, EF=0, WPF=0, APF=0, PFK=0,
             HILO=1, HELPER_SIDE=1, ATT_ROPE=1, POLL=0, HIN=1, KD=2048, EPF=0, QIX=0, SIG=1, WAITS=1, PIN=0)
sig.update({k: "constexpr" for k in const})
# pointers are 16-byte aligned, as Triton's JIT finds them at launch
attrs = {(i,): [["tt.divisibility", 16]] for i in range(15)}


def compile_megakernel(constexprs, weights="*bf16"):
    return triton.compile(ASTSource(fn=megakernel, signature=dict(sig, W=weights), constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 1})
"""

ONE_TOKEN = r"""
# the one-token decode kernel's launch variants, compiled out of the default kernel (TB=8, BE=256): AHEAD and
# ROWVEC=2's stores in place, NARROW's second chunk shape, ROUTE1's slot table from registers (BE <= 64), PFD's
# rolling L2 prefetch of the row blocks ahead (PF off: every bulk prefetch here is the stream's)
one = dict(const, TB=1, BE=64, BP=8, PF=0, DEPTH=1, ROWVEC=2, AHEAD=1, NARROW=1, ROUTE1=1, PFD=2, ATT_KIND=1)
# and the L2's residency hints: evict-first weights and cache rows (EF=2), the next task word into the L1,
# attention's cache rows into the L2 (APF=2: MLA's in bulk, counted among the bulk prefetches below, and GQA's
# head lines one per thread, so both attention kinds compiled in)
one.update(EF=2, WPF=1, APF=2, ATT_KIND=0, PFK=128)
# and the dependency waits' poll as every thread's ld.acquire.gpu (POLL=1), and the inputs copied into their slots
# by the graph's copy nodes (HIN=0; the default, HIN=1, is the first kernel's: worker 0 copies them from the host's
# stage buffers and releases them to the others)
one.update(POLL=1, HIN=0)
# and an expert task's first weights requested before its wait, for the expert its slot holds then (EPF=1), and
# attention's query rows indexed without integer division, the cache length requested after them (QIX=3), and the
# signalled counter's index read before the closing barrier (SIG=2; the default reads it with the opcode), and a
# wait slot read after the previous slot's poll (WAITS=0; the default reads it before)
one.update(EPF=1, QIX=3, SIG=2, WAITS=0)
# and one-token slices streamed with the next chunk pinned above the multiply by a counting CTA barrier, and
# one-token expert slices of K = 1408-like rows streamed flat (PIN=2; EPF's guessed chunk is not a flat tile, so
# EPF=1 is compiled in the gqa kernel below)
one.update(PIN=2, EPF=0)
"""

# three kernels, each its own process so they compile side by side (~60 s each on one core)
PARTS = {"default": COMMON + r"""
k = compile_megakernel(const)
ptx = k.asm["ptx"]
assert "atom.global.gpu.release" in ptx and "ld.global.gpu.acquire" in ptx
# the wait's bound: thread 0's timer reading, which every thread then reads (common.poll_stop)
assert "ld.volatile.global.b32" in ptx and "%globaltimer" in ptx
# weights and the cache stream as 16-byte vectors, not one load per element
assert ptx.count("ld.global.v4") >= 64, ptx.count("ld.global.v4")
# PF=2: weight slices asked of the L2 in bulk (a LINEAR task's, the next task's, an expert's)
assert ptx.count("cp.async.bulk.prefetch.L2.global") >= 3, ptx.count("cp.async.bulk.prefetch.L2.global")
# the helper mailbox: a system-scope release publishes a request, an acquire polls the answer
assert "st.release.sys.global.b32" in ptx and "ld.acquire.sys.global.b32" in ptx and "fence.acq_rel.sys" in ptx
# a helper GPU's kernels around its site megakernel (helper_card/kernel_helper.py)
from megakernel.ops.helper import copy_rows, publish_rows
rows = triton.compile(ASTSource(fn=publish_rows, signature={"src": "*fp32", "src_ld": "i32", "dst": "*fp32",
                                                            "mask": "*i32", "rows": "i32", "cols": "i32", "ack": "*i32",
                                                            "gate": "*i32", "seq": "*i32", "err": "*i32",
                                                            "COMPILED": "constexpr", "BLOCK": "constexpr"},
                                constexprs={"COMPILED": True, "BLOCK": 1024}), target=GPUTarget("cuda", 90, 32))
assert "st.release.sys.global.b32" in rows.asm["ptx"] and "fence.acq_rel.sys" in rows.asm["ptx"]
copy = triton.compile(ASTSource(fn=copy_rows, signature={"src": "*fp32", "src_ld": "i32", "dst": "*fp32",
                                                         "dst_ld": "i32", "cols": "i32", "gate": "*i32",
                                                         "seq_out": "*i32", "COMPILED": "constexpr",
                                                         "SAVE_SEQ": "constexpr", "BLOCK": "constexpr"},
                                constexprs={"COMPILED": True, "SAVE_SEQ": True, "BLOCK": 1024}),
                      target=GPUTarget("cuda", 90, 32))
assert "ld.acquire.sys.global.b32" in copy.asm["ptx"]
assert "prefetch.global.L2 " not in ptx  # the variants' hints are off: the default stream is unchanged
assert "ld.acquire.gpu.global.b32" not in ptx  # nor is the default's poll (POLL=0)
assert "evict_first" not in ptx and "prefetch.global.L1" not in ptx and "bar.red.popc" not in ptx
print("shared", k.metadata.shared)
""",
         "variants": COMMON + ONE_TOKEN + r"""
k1 = compile_megakernel(one)
assert "st.global.f32" in k1.asm["ptx"] and k1.asm["cubin"]
assert k1.asm["ptx"].count("cp.async.bulk.prefetch.L2.global") >= 5, k1.asm["ptx"].count(
    "cp.async.bulk.prefetch.L2.global")
assert "prefetch.global.L1" in k1.asm["ptx"] and "evict_first" in k1.asm["ptx"]
assert "prefetch.global.L2 " in k1.asm["ptx"]
assert "ld.acquire.gpu.global.b32" in k1.asm["ptx"]  # POLL=1's waits
assert "bar.red.popc.u32" in k1.asm["ptx"]  # PIN's streams
print("bulk", k1.asm["ptx"].count("cp.async.bulk.prefetch.L2.global"))
print("l1", k1.asm["ptx"].count("prefetch.global.L1"))
""",
         "gqa": COMMON + ONE_TOKEN + r"""
# the attention kind a GQA-only plan compiles (llama-1b's: launch.block_sizes sets ATT_KIND=2), its head-line
# prefetch (APF=2) compiled in and MLA's bulk one out; and the waits' POLL=2 (one thread's acquire load that asks
# the L1 for the task's word, its value shared through a word of static shared memory); and a task's first two wait
# slots read before the weights it requests before its wait (WAITS=2, with EPF=1's guessed expert chunk); with fp32
# weights (the tiny presets' on a GPU), whose pinned streams hold the chunk behind the barrier as its bits (PIN=1:
# an fp32 chunk ORed with the barrier's count did not compile, session 49), in the tiny presets' 64-column chunks
# (PIN=2's flat tiles, empty at KC < 256, must not compile into a PIN=1 kernel: session 50); and the streams'
# chunk after the next asked of the L1 (PFD=-1: two 32-float lines a row of a 64-column chunk)
gqa = compile_megakernel(dict(one, ATT_KIND=2, POLL=2, WAITS=2, EPF=1, PIN=1, KC=64, BN=64, KD=64, PFD=-1),
                         weights="*fp32")
assert "bar.red.popc.u32" in gqa.asm["ptx"]
assert gqa.asm["cubin"] and "prefetch.global.L2 " in gqa.asm["ptx"]
assert "prefetch.global.L1" in gqa.asm["ptx"] and ".shared .align 4 .b32 seen" in gqa.asm["ptx"]
print("bulk", gqa.asm["ptx"].count("cp.async.bulk.prefetch.L2.global"))
print("l1", gqa.asm["ptx"].count("prefetch.global.L1"))
"""}


@pytest.mark.slow
def test_megakernel_compiles_for_sm90():
    import os
    env = {"PATH": "/usr/bin:/bin"}
    env.update({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    procs = {name: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env) for name, code in PARTS.items()}
    outs = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, f"{name}: {err[-3000:]}"
            outs[name] = out
    finally:  # a failed or timed-out part leaves no compile running
        for proc in procs.values():
            proc.kill()
    assert "shared" in outs["default"]
    bulk = {name: int(re.search(r"bulk (\d+)", outs[name]).group(1)) for name in ("variants", "gqa")}
    # a GQA-only kernel compiles MLA's bulk cache prefetch out
    assert bulk["gqa"] < bulk["variants"], bulk
    # PFD=-1's line prefetches in three streams (stream_chunks, stream_pinned, stream_pinned_k) beyond the task
    # word's (WPF) and the activations' (stream_pinned_k) that both kernels have
    l1 = {name: int(re.search(r"l1 (\d+)", outs[name]).group(1)) for name in ("variants", "gqa")}
    assert l1["gqa"] >= l1["variants"] + 3, l1


@pytest.mark.slow
def test_sass_probe_reads_the_stream_loop():
    """tools/sass_probe.py (offline SASS of the weight stream) finds the hot loop and its loads."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = Path(__file__).resolve().parents[1] / "tools" / "sass_probe.py"
    out = subprocess.run([sys.executable, str(tool), "stream", "KC=256"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loop = re.search(r"hot loop (\d+) instructions: (.*)", out.stdout)
    assert loop and int(loop.group(1)) > 50 and "LDG" in loop.group(2) and "FFMA" in loop.group(2), out.stdout


SOURCE_SASS_SCRIPT = r"""
import contextlib, io, sys
sys.path.insert(0, "tools")
import sass_probe as sp
info, sass = sp.compile_sass(sp.stream_probe, *sp.STREAM_PROBE_ARGS, dict(BR=8, KC=2048, ALIGN=8, TB=1, DEPTH=1,
                                                                           ROWVEC=2, AHEAD=1, PFD=0))
out = io.StringIO()
with contextlib.redirect_stdout(out):
    sp.print_source_sass(sass, "linear.py:1-2000")
rows = out.getvalue().splitlines()
assert rows and all(" linear.py:" in r for r in rows) and any("LDG" in r for r in rows), rows[:5]
addrs = [int(r.split()[0], 16) for r in rows]
assert addrs == sorted(addrs)
try:
    sp.print_source_sass(sass, "linear.py:a-b")
    raise SystemExit("a span that is not FILE:LO-HI was accepted")
except SystemExit as e:
    assert "FILE:LO-HI" in str(e), e
# scoreboards: every weight load of the hot loop sets one of the six, and some instruction of the loop waits on it
waits = sp.first_waits(sass, sp.loop_spans(sass)[0], sp.linear.weight_rows)
assert len(waits) >= 16 and all(bar < 6 and gap is not None and gap >= 0 for _, _, bar, _, gap in waits), waits[:3]
# the decoding and the drain rule on a hand-made loop: a weight load on scoreboard 5, then an instruction that
# waits on 5 without reading the load's registers (a drain, when it waits), then the load's reader
name, lines = sp.source_lines(sp.linear.weight_rows)
def ins(addr, text, wbar=7, wait=0):
    control = (wbar << 46) | (7 << 49) | (wait << 52)
    return f"  /*{addr:04x}*/  {text} ;  /* 0x0000000000000000 */\n  /* 0x{control:016x} */"
def fake_loop(fadd_wait, fmul_wait):
    return "\n".join([".L_x_1:", f'\t//## File "/x/{name}", line {lines[1]}',
                      ins(0x10, "LDG.E.64 R10, desc[UR4][R2.64]", wbar=5), '\t//## File "/x/other.py", line 7',
                      ins(0x20, "FADD R3, R4, R5", wait=fadd_wait), ins(0x30, "FMUL R6, R10, R4", wait=fmul_wait),
                      ins(0x40, "BRA `(.L_x_1)")])
fake = fake_loop(1 << 5, 0)
assert sp.scoreboards(fake) == {0x10: (5, 7, 0), 0x20: (7, 7, 32), 0x30: (7, 7, 0), 0x40: (7, 7, 0)}, fake
assert sp.first_waits(fake, sp.loop_spans(fake)[0], sp.linear.weight_rows) == [
    (0x10, f"{name}:{lines[1]}", 5, "other.py:7 FADD", 1)]
fake = fake_loop(0, 1 << 5)  # the reader is the first to wait: no drain
assert sp.first_waits(fake, sp.loop_spans(fake)[0], sp.linear.weight_rows)[0][3:] == ("other.py:7 FMUL", 0)
# the multiply-adds a load's latency overlaps: those before its first waiter (the FFMA here; not the waiting FMUL)
fake = fake.replace("FADD R3, R4, R5", "FFMA R3, R4, R5, R3")
assert sp.fmas_in_flight(fake, sp.loop_spans(fake)[0], sp.linear.weight_rows) == {0x10: 1}
print("ok", len(rows))
"""


@pytest.mark.slow
def test_sass_probe_prints_a_source_span():
    """sass_probe's --source FILE:LO-HI: the instructions of those lines in address order (the stream probe's
    linear.py lines hold its weight loads); a span that is not FILE:LO-HI is refused by name.  Its scoreboard
    reading: each weight load's scoreboard and first waiter, from nvdisasm -hex's control bits, and whether that
    waiter comes before the load's first reader (on the probe and on a hand-made loop)."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SOURCE_SASS_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:] + out.stdout[-1000:]


NCU_LINES_SCRIPT = r"""
import sys, tempfile
from pathlib import Path
sys.path.insert(0, "tools")
import sass_probe as sp
import ncu_lines as nl
k = sp.compile_kernel(sp.stream_probe, *sp.STREAM_PROBE_ARGS, dict(BR=8, KC=2048, ALIGN=8, TB=1, DEPTH=1, ROWVEC=2,
                                                                   AHEAD=1, PFD=0))
with tempfile.TemporaryDirectory() as d:
    cubin = Path(d) / "k.cubin"
    cubin.write_bytes(k.asm["cubin"])
    lines = nl.line_map(cubin)
base = 0x7f0000000000
# an ncu source-page export as ncu writes it: 3 samples on each of linear.py's instructions, 1 elsewhere
rows = [{"Address": hex(base + off), "Source": "  " + op + " R1, R2", "Instructions Executed": "10",
         "Warp Stall Sampling (All Samples)": str(3 if where.startswith("linear.py") else 1),
         "stall_long_sb": str(3 if where.startswith("linear.py") else 0), "stall_wait": "0"}
        for off, (where, op) in sorted(lines.items())]
per_file, per_line, stalls = nl.attribute(rows, lines)
n_linear = sum(1 for where, _ in lines.values() if where.startswith("linear.py"))
assert n_linear > 100 and per_file["linear.py"]["samples"] == 3 * n_linear, per_file["linear.py"]
assert (sum(c["samples"] for c in per_file.values()) == sum(c["samples"] for c in per_line.values())
        == 2 * n_linear + len(rows))
assert per_file["linear.py"]["stall_long_sb"] == 3 * n_linear and set(stalls) == {"stall_long_sb", "stall_wait"}
for r in rows:
    r["Source"] = "NOP"
try:
    nl.attribute(rows, lines)
    raise SystemExit("a CSV of another kernel was accepted")
except ValueError as e:
    assert "not the same kernel" in str(e)
print("ok", n_linear)
"""


@pytest.mark.slow
def test_ncu_lines_attributes_samples_to_source_lines():
    """tools/ncu_lines.py maps an ncu export's addresses to the cubin's source lines, sums per file and
    line, and refuses a CSV of another kernel (a compiled weight stream stands in for the megakernel)."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", NCU_LINES_SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


L1_PREFETCH_SCRIPT = r"""
import sys
sys.path.insert(0, "tools")
import sass_probe as sp
count = {}
for pin in (0, 1):
    for pfd in (0, -1, -2):
        const = dict(BR=8, KC=2048, ALIGN=8, TB=1, DEPTH=1, ROWVEC=2, AHEAD=1, PFD=pfd, PIN=pin, FLAT=0)
        count[pin, pfd] = sp.compile_kernel(sp.stream_probe, *sp.STREAM_PROBE_ARGS, const).asm["ptx"].count(
            "prefetch.global.L1")
# stream_pinned asks the L1 for nothing else; stream_chunks for nothing at all: PFD < 0's lines are all there is
assert count[0, 0] == 0 and count[1, 0] == 0, count
assert all(count[pin, pfd] > 0 for pin in (0, 1) for pfd in (-1, -2)), count
print("ok", count)
"""


@pytest.mark.slow
def test_l1_prefetch_of_the_stream_compiles_only_where_asked():
    """Launch variant PFD < 0 (the chunk one or two steps after the next asked of the L1, line by line) compiles
    its prefetches into stream_chunks and stream_pinned for sm_90, and PFD = 0 compiles none (their values are the
    GPU tests': tests/test_weight_stream.py, tests/test_gpu.py)."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", L1_PREFETCH_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:] + out.stdout[-1000:]
