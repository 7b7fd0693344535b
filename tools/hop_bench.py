"""What one dependency hop costs, alone: programs on their own SMs hand activation rows on, hop after hop.

    python tools/hop_bench.py [--rounds 2000] [--programs 2 0] [--sizes 256 2048]
        [--modes counter ldacq word ll early nc] [--out DIR]

Every layer of a step is a chain of 6 (llama-1b) to 13 (dsv2-lite) hops: a task's rows reach the L2, its
counter is released, the next op's tasks see the count, then load the rows.  In session 24's traces a consumer
was ready 1.1-1.7 us after its producer's end, and its first activation load is another L2 round trip after
that: 6 hops x ~2 us is ~10% of a llama-1b step.  This times the hop by itself, all to all as a chain of LINEAR
ops is (each program writes its share of a hop's rows, then waits for and reads all of them), on 2 programs or
one per SM (`--programs 0`), for each way of handing over:

- counter: the persistent kernel's (ops/common.py): every thread stores its part, a CTA barrier, one thread's
  release add on the counter; the consumer polls with a scalar acquire add (one thread's, shared through a
  barrier: poll_counter with POLL=0), reads where its rows are from a field of its task word, as a kernel body
  does after its wait (since session 34: the acquire invalidated the L1, so the field is an L2 round trip), then
  loads the rows;
- ldacq: the same with the poll an `ld.acquire.gpu` by every thread (a load, not an atomic), the CTA's minimum
  (the kernel's launch variant POLL=1);
- word: the same with POLL=2's poll: one thread's acquire load that asks the L1 for the task word's lines while it
  is out, so the field is an L1 hit (GPU only: inline PTX, as ldacq);
- early: counter's, with the field read before the wait (in a register through it): what a task pays for its
  fields after its wait, counter's time less this one's (session 37's HOIST read them so, and lost in a step);
- nc: counter's, with the field read through the non-coherent path (`ld.global.nc`, GPU only: inline PTX).  Task
  words never change during a launch, so the kernel may read them so.  ptxas may move such a load above an
  acquire (a lone `ld.acquire` then `ld.global.nc`: `LDG.E.CONSTANT` first), though not out of a poll loop: here
  it stays after the poll's `LDG.E.STRONG.GPU` + `CCTL.IVALL`, so this mode times whether its line outlives the
  acquire's L1 invalidation: `early`'s time if it does, `counter`'s if not;
- ll: no counter (NCCL's LL protocol): each 8-byte word carries a 4-byte value and a 4-byte flag (the hop's
  number), stored together, so a consumer polls the rows themselves and has them when every flag matches: no
  release, no second round trip.  Twice the bytes on the wire.

Hop g's rows are g + row index, written from the count each program read in hop g - 1 (row 0 + 1), so every hop
depends on the one before; every program checks every row it reads (a stale or torn row is an error naming the
mode).  Per programs, mode and size: ns a hop (the rounds' span on the device timer / rounds), the median of the
launches after the first.  Polls are bounded (MAX_SPINS): a hop that never arrives ends the run with an error,
not a hang.  Under TRITON_INTERPRET (programs one after another) only one program can run a chain:
tests/test_hop_bench.py checks the protocols' values that way, and that two programs end in the bound's error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megakernel.ops.common import COUNTER_STRIDE, now_ns, poll_counter  # noqa: E402

MODES = {"counter": 0, "ldacq": 1, "ll": 2, "word": 3, "early": 4, "nc": 5}  # polls: POLL 1 ldacq, 2 word, else 0
MAX_SPINS = 10_000_000
WORD_FIELD = tl.constexpr(17)  # a field past the word's header, in its first 128-byte line


@triton.jit
def wait_count(cnt, target, word, POLL: tl.constexpr, MAX_SPINS: tl.constexpr):
    """Spins until cnt >= target, polling as the kernel's waits do (ops/common.poll_counter with POLL; POLL 2 asks
    the L1 for `word`); the polls it took, or -1 past MAX_SPINS."""
    spins = 0
    seen = tl.cast(-1, tl.int32)
    while (seen < target) & (spins >= 0):
        seen = poll_counter(cnt, POLL, word)
        spins += 1
        if spins > MAX_SPINS:
            spins = -1
    return spins


@triton.jit
def load_nc(ptr):
    """ptr[0] (int32) through the non-coherent path: for memory no one writes during the launch.  Not marked pure,
    so that LLVM keeps it in the hop where it stands (pure, it would be hoisted out of the hop loop: the same word
    every hop); ptxas keeps it after the poll's `CCTL.IVALL`, where counter's `LDG` stands (SASS, sm_90)."""
    return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit
def hand_over(rows, ll, cnt, g, vals, d, mine, MODE: tl.constexpr):
    """This program's rows of hop g out: values (counter modes: then the release), or value | flag words (ll, flag
    g + 1)."""
    if MODE == 2:
        flag = (g + 1).to(tl.int64)
        bits = vals.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        tl.store(ll + d, (flag << 32) | bits, mask=mine)
    else:
        tl.store(rows + d, vals, mask=mine)
        tl.debug_barrier()  # every thread's rows before the release
        tl.atomic_add(cnt, 1, sem="release", scope="gpu")


@triton.jit
def take_over(rows, ll, cnt, g, target, d, word, MODE: tl.constexpr, MAX_SPINS: tl.constexpr):
    """(every row of hop g, polls it took or -1); target: the count its buffer's counter reaches with it; word: this
    program's task word, whose field WORD_FIELD (always 0) offsets the rows (the counter modes)."""
    if MODE == 2:
        flag = (g + 1).to(tl.int64)
        words = tl.load(ll + d, volatile=True)
        spins = 0
        while (tl.min(((words >> 32) == flag).to(tl.int32), axis=0) == 0) & (spins >= 0):
            words = tl.load(ll + d, volatile=True)
            spins += 1
            if spins > MAX_SPINS:
                spins = -1
        vals = (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        if MODE == 4:  # early: the field before the wait
            field = tl.load(word + WORD_FIELD)
        spins = wait_count(cnt, target, word, 1 if MODE == 1 else (2 if MODE == 3 else 0), MAX_SPINS)
        if MODE == 5:
            field = load_nc(word + WORD_FIELD)
        elif MODE != 4:
            field = tl.load(word + WORD_FIELD)
        vals = tl.load(rows + field + d, cache_modifier=".cg")
    return vals, spins


@triton.jit
def chain(rows, ll, counters, words, result, base, ROUNDS: tl.constexpr, N: tl.constexpr, MODE: tl.constexpr,
          MAX_SPINS: tl.constexpr, USE_TIMER: tl.constexpr):
    """G programs (the grid), each hop all to all, as a chain of LINEAR ops is: every program writes its rows of
    hop g (rows r with r % G == its id), then waits for and reads every row, and writes hop g + 1 from what it
    read.  Hops are numbered over every launch (base: the hops earlier launches ran) and alternate between two
    buffers, each with its counter (a line apart, as the kernel's); a buffer is written again only after every
    program has read it (each has written the next hop, which it does after its reads).  words: a task word per
    program (64 int32s, never written).  result[8p:]: start, end, the count it last read, the hop that never
    arrived + 1, rows that were not what their hop wrote."""
    pid, G = tl.program_id(0), tl.num_programs(0)
    d = tl.arange(0, N)
    mine = d % G == pid
    count = tl.cast(0, tl.int32) + base  # hop g's rows are g + row: written from the count read in hop g - 1
    failed = tl.cast(0, tl.int32)
    bad = tl.cast(0, tl.int32)
    t0 = now_ns(USE_TIMER)
    for hop in range(ROUNDS):
        g = base + hop
        way = g % 2
        if failed == 0:
            cnt = counters + way * COUNTER_STRIDE
            hand_over(rows + way * N, ll + way * N, cnt, g, (count + d).to(tl.float32), d, mine, MODE)
            vals, spins = take_over(rows + way * N, ll + way * N, cnt, g, G * (g // 2 + 1), d, words + 64 * pid, MODE,
                                    MAX_SPINS)
            bad += tl.sum((vals != (g + d).to(tl.float32)).to(tl.int32), axis=0)
            count = tl.sum(tl.where(d == 0, vals, 0.0), axis=0).to(tl.int32) + 1
            if spins < 0:
                failed = hop + 1
    t1 = now_ns(USE_TIMER)
    tl.store(result + 8 * pid, t0)
    tl.store(result + 8 * pid + 1, t1)
    tl.store(result + 8 * pid + 2, count.to(tl.int64))
    tl.store(result + 8 * pid + 3, failed.to(tl.int64))
    tl.store(result + 8 * pid + 4, bad.to(tl.int64))


class HopBench:
    """Buffers for one (mode, rows, programs); run() launches one chain of `rounds` hops and checks every row."""

    def __init__(self, mode: str, n: int, programs: int, device: str):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: {', '.join(MODES)}")
        if n & (n - 1) or n < 32:
            raise ValueError(f"size {n}: a power of two >= 32 (one value per lane at least)")
        if not 1 <= programs <= n:
            raise ValueError(f"programs={programs}: 1 to the {n} rows (each writes at least one)")
        interpreted = torch.device(device).type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        if mode in ("ldacq", "word", "nc") and interpreted:
            raise ValueError(f"mode {mode!r} uses inline PTX: GPU only (the Triton interpreter runs none)")
        if torch.device(device).type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            if programs > sms:
                raise ValueError(f"programs={programs}: more than the {sms} SMs, which one CTA each must hold "
                                 "(they wait on one another)")
        self.mode, self.n, self.programs, self.device = mode, n, programs, torch.device(device)
        self.rows = torch.zeros(2 * n, dtype=torch.float32, device=device)
        self.ll = torch.zeros(2 * n, dtype=torch.int64, device=device)
        self.counters = torch.zeros(2 * COUNTER_STRIDE.value, dtype=torch.int32, device=device)
        self.words = torch.zeros(64 * programs, dtype=torch.int32, device=device)  # a task word each, never written
        self.result = torch.zeros(8 * programs, dtype=torch.int64, device=device)
        self.hops_done = 0  # over every launch: the counters and flags only grow

    def run(self, rounds: int) -> dict:
        if rounds < 1:
            raise ValueError(f"rounds={rounds}: at least one hop")
        timer = self.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
        chain[(self.programs,)](self.rows, self.ll, self.counters, self.words, self.result, self.hops_done,
                                ROUNDS=rounds,
                                N=self.n, MODE=MODES[self.mode], MAX_SPINS=MAX_SPINS, USE_TIMER=timer, num_warps=4)
        self.hops_done += rounds
        r = self.result.view(self.programs, 8).cpu()
        stuck = r[:, 3][r[:, 3] > 0]  # hop + 1 where a program gave up: the first is the one to look at
        failed, bad = int(stuck.min()) if len(stuck) else 0, int(r[:, 4].sum())
        what = f"hop_bench {self.mode} N={self.n} programs={self.programs}"
        if failed:
            raise RuntimeError(f"{what}: hop {failed - 1} never arrived within {MAX_SPINS} polls (programs not "
                               "co-resident, or a protocol bug)")
        if bad or (r[:, 2] != self.hops_done).any():
            raise RuntimeError(f"{what}: {bad} rows were not their hop's, last counts read {r[:, 2].unique().tolist()} "
                               f"(want {self.hops_done}): a stale or torn row was taken")
        span = int(r[:, 1].max() - r[:, 0].min())
        return {"mode": self.mode, "N": self.n, "programs": self.programs, "rounds": rounds,
                "ns_per_hop": span / rounds if timer else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--reps", type=int, default=5, help="launches per mode and size (the first is the warm-up)")
    p.add_argument("--sizes", type=int, nargs="*", default=[256, 2048])
    p.add_argument("--programs", type=int, nargs="*", default=[2, 0], help="0: one per SM (a layer's all-to-all hop)")
    p.add_argument("--modes", nargs="*", default=list(MODES))
    p.add_argument("--out", default=".")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("hop_bench times the GPU; on a CPU, tests/test_hop_bench.py checks the protocols")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for programs in [g or sms for g in args.programs]:
        for n in args.sizes:
            if programs > n:  # each program writes at least one row of a hop
                print(f"skipped: {programs} programs over {n} rows")
                continue
            for mode in args.modes:
                bench = HopBench(mode, n, programs, "cuda")
                times = [bench.run(args.rounds)["ns_per_hop"] for _ in range(args.reps)][1:] or [None]
                rows.append({"mode": mode, "N": n, "programs": programs, "rounds": args.rounds,
                             "ns_per_hop_median": sorted(times)[len(times) // 2], "ns_per_hop_all": times})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "hop_bench.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                "rows": rows}, indent=1))
    print(f"{'programs':>8} {'mode':<9}{'N':>6}{'ns/hop':>9}")
    for r in rows:
        print(f"{r['programs']:>8} {r['mode']:<9}{r['N']:>6}{r['ns_per_hop_median']:>9.0f}")


if __name__ == "__main__":
    main()
