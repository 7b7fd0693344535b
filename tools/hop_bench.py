"""What one dependency hop costs, alone: two programs on two SMs hand an activation vector back and forth.

    python tools/hop_bench.py [--rounds 2000] [--sizes 64 2048] [--modes counter ldacq ll] [--out DIR]

Every layer of a step is a chain of ~6 (llama-1b) to ~10 (dsv2-lite) hops: a task's rows reach the L2, its
counter is released, the next op's tasks see the count, then load the rows.  In session 24's traces a consumer
was ready 1.1-1.7 us after its producer's end, and its first activation load is another L2 round trip after
that: 6 hops x ~2 us is ~10% of a llama-1b step.  This times the hop by itself, for each way of handing over:

- counter: the persistent kernel's (ops/common.py): every thread stores its part, a CTA barrier, one thread's
  release add on the counter; the consumer polls with a scalar acquire add (one thread's, shared through a
  barrier: poll_counter with POLL=0), then loads the rows;
- ldacq: the same with the poll an `ld.acquire.gpu` by every thread (a load, not an atomic), the CTA's minimum
  (the kernel's launch variant POLL=1);
- ll: no counter (NCCL's LL protocol): each 8-byte word carries a 4-byte value and a 4-byte flag (the hop's
  number), stored together, so a consumer polls the rows themselves and has them when every flag matches: no
  release, no second round trip.  Twice the bytes on the wire.

Hop h's rows are h + row index, written from the count the producer itself last read (row 0 + 1), so every hop
depends on the one before; each consumer checks every row (a stale or torn row is an error naming the mode).  Per mode and size: ns a hop
(the rounds' span on the device timer / rounds).  Polls are bounded (MAX_SPINS): a hop that never arrives ends
the run with an error naming the mode, not a hang.  Under TRITON_INTERPRET (programs one after another) only a
hop from program 0 to 1 can run: tests/test_hop_bench.py checks the protocols' values that way.
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

from megakernel.ops.common import now_ns, poll_counter  # noqa: E402

MODES = {"counter": 0, "ldacq": 1, "ll": 2}
MAX_SPINS = 10_000_000


@triton.jit
def wait_count(cnt, target, MODE: tl.constexpr, MAX_SPINS: tl.constexpr):
    """Spins until cnt >= target, polling as the kernel's waits do (ops/common.poll_counter: MODE 0 is POLL 0,
    1 is POLL 1); the polls it took, or -1 past MAX_SPINS."""
    spins = 0
    seen = tl.cast(-1, tl.int32)
    while (seen < target) & (spins >= 0):
        seen = poll_counter(cnt, MODE)
        spins += 1
        if spins > MAX_SPINS:
            spins = -1
    return spins


@triton.jit
def hand_over(rows, ll, cnt, g, vals, d, MODE: tl.constexpr):
    """Hop g's rows out: values (counter modes: then the release), or value | flag words (ll, flag g + 1)."""
    if MODE == 2:
        flag = (g + 1).to(tl.int64)
        bits = vals.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        tl.store(ll + d, (flag << 32) | bits)
    else:
        tl.store(rows + d, vals)
        tl.debug_barrier()  # every thread's rows before the release
        tl.atomic_add(cnt, 1, sem="release", scope="gpu")


@triton.jit
def take_over(rows, ll, cnt, g, d, MODE: tl.constexpr, MAX_SPINS: tl.constexpr):
    """(hop g's rows, polls it took or -1)."""
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
        # the counter counts this direction's hops over every launch: hop g is its number g // 2 + 1
        spins = wait_count(cnt, g // 2 + 1, MODE, MAX_SPINS)
        vals = tl.load(rows + d, cache_modifier=".cg")
    return vals, spins


@triton.jit
def ping_pong(rows, ll, counters, result, base, ROUNDS: tl.constexpr, N: tl.constexpr, MODE: tl.constexpr,
              MAX_SPINS: tl.constexpr, USE_TIMER: tl.constexpr):
    """Hops are numbered over every launch (base: the hops earlier launches ran); program p produces hops g with
    g % 2 == p and consumes the others, through direction g % 2's rows and counter (128 bytes apart).  result[8p:]: start, end, the count it last read,
    the hop that never arrived + 1, rows that were not what their hop wrote."""
    pid = tl.program_id(0)
    d = tl.arange(0, N)
    count = tl.cast(0, tl.int32) + base  # hops seen: what the next hop this program produces writes
    failed = tl.cast(0, tl.int32)
    bad = tl.cast(0, tl.int32)
    t0 = now_ns(USE_TIMER)
    for hop in range(ROUNDS):
        g = base + hop
        way = g % 2
        if failed == 0:
            if way == pid:
                hand_over(rows + way * N, ll + way * N, counters + way * 32, g, (count + d).to(tl.float32), d, MODE)
            else:
                vals, spins = take_over(rows + way * N, ll + way * N, counters + way * 32, g, d, MODE, MAX_SPINS)
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
    """Buffers for one (mode, size); run() launches one ping-pong of `rounds` hops and checks its sum."""

    def __init__(self, mode: str, n: int, device: str):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: {', '.join(MODES)}")
        if n & (n - 1) or n < 32:
            raise ValueError(f"size {n}: a power of two >= 32 (one value per lane at least)")
        self.mode, self.n, self.device = mode, n, torch.device(device)
        self.rows = torch.zeros(2 * n, dtype=torch.float32, device=device)
        self.ll = torch.zeros(2 * n, dtype=torch.int64, device=device)
        self.counters = torch.zeros(64, dtype=torch.int32, device=device)
        self.result = torch.zeros(16, dtype=torch.int64, device=device)
        self.hops_done = 0  # over every launch: the counters and flags only grow

    def run(self, rounds: int) -> dict:
        if rounds < 1:
            raise ValueError(f"rounds={rounds}: at least one hop")
        timer = self.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
        ping_pong[(2,)](self.rows, self.ll, self.counters, self.result, self.hops_done, ROUNDS=rounds, N=self.n,
                        MODE=MODES[self.mode], MAX_SPINS=MAX_SPINS, USE_TIMER=timer, num_warps=4)
        base, self.hops_done = self.hops_done, self.hops_done + rounds
        r = self.result.cpu().tolist()
        failed, bad = max(r[3], r[11]), r[4] + r[12]
        if failed:
            raise RuntimeError(f"hop_bench {self.mode} N={self.n}: hop {failed - 1} never arrived within "
                               f"{MAX_SPINS} polls (programs not co-resident, or a protocol bug)")
        last = 1 - (self.hops_done - 1) % 2  # the program that consumed the last hop
        if bad or r[8 * last + 2] != self.hops_done:
            raise RuntimeError(f"hop_bench {self.mode} N={self.n}: {bad} rows were not their hop's, the last count "
                               f"read {r[8 * last + 2]} (want {self.hops_done}): a stale or torn row was taken")
        span = max(r[1], r[9]) - min(r[0], r[8])
        return {"mode": self.mode, "N": self.n, "rounds": rounds, "ns_per_hop": span / rounds if timer else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--reps", type=int, default=5, help="launches per mode and size (the first is the warm-up)")
    p.add_argument("--sizes", type=int, nargs="*", default=[64, 2048])
    p.add_argument("--modes", nargs="*", default=list(MODES))
    p.add_argument("--out", default=".")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("hop_bench times the GPU; on a CPU, tests/test_hop_bench.py checks the protocols")
    rows = []
    for n in args.sizes:
        for mode in args.modes:
            bench = HopBench(mode, n, "cuda")
            times = [bench.run(args.rounds)["ns_per_hop"] for _ in range(args.reps)][1:] or [None]
            rows.append({"mode": mode, "N": n, "rounds": args.rounds, "ns_per_hop_median": sorted(times)[len(times) // 2],
                         "ns_per_hop_all": times})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "hop_bench.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                "rows": rows}, indent=1))
    print(f"{'mode':<9}{'N':>6}{'ns/hop':>9}")
    for r in rows:
        print(f"{r['mode']:<9}{r['N']:>6}{r['ns_per_hop_median']:>9.0f}")


if __name__ == "__main__":
    main()
