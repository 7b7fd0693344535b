"""A down projection read k-major, alone: the loop a fused expert MLP would stream its down slice with.

    python tools/kmajor_bench.py [--rows 64 256] [--iters 50] [--out DIR]

Why (docs/NOTES.md, session 30): dsv2-lite's down projections (K = 1408 routed, 2816 shared) stream ~20 GB/s
a worker because today's LINEAR loop reads each row in 2048-column chunks, and a gate|up -> down hop separates
two phases.  An expert MLP task could instead take a slice of intermediate rows [r0, r1), stream their gate|up
rows as now, then the same rows of the down projection packed transposed (W^T[r0:r1, :], rows of H = 2048, no
waste) into an [H] partial that MOE_COMBINE sums.  Before building that, this times the k-major loop
(`ops/kmajor.kmajor_rows`, the body of fusion rule expert_mlp's EXPERT_LINEAR[DOWN_T] and LINEAR[DOWN_T]:
out[:] = sum_r h[r] * W^T[r, :]) against today's LINEAR body (`ops/linear.stream_chunks`,
out[r] = W[r, :] . x) on the same bytes: one program per SM, each streaming its own `rows` rows of 2048 bf16,
matrices rotated past the L2.  Prints GB/s per SM for each, and each one's error against torch.

The naive version is `reference_kmajor`; the loop asks for the next chunk of BR rows before it sums this one, as
stream_chunks does, and each thread owns 8 output columns for every row: its sums never leave the thread until the
end (no shuffle, no cross-warp reduction), and a 32 KB chunk costs 8 16-byte weight loads a thread where
stream_chunks spends 16 8-byte weight loads, 16 activation loads and a lane reduction.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megakernel.ops import kmajor, linear  # noqa: E402
from tools.bench import time_ms  # noqa: E402

H = 2048  # dsv2-lite's and llama-1b's hidden size: a k-major row's length


def reference_kmajor(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """[P, R, H] weights (k-major rows), [P, R] h -> [P, H]: each program's sum over its rows of h[r] * W[r, :]."""
    return torch.einsum("prh,pr->ph", w.float(), h.float())


@triton.jit
def kmajor_kernel(w_ptr, h_ptr, out_ptr, R, H: tl.constexpr, BR: tl.constexpr):
    """Program p: out[p] = sum over its R rows (p·R ..) of h[r] * W[r, :]."""
    p = tl.program_id(0)
    c = tl.arange(0, H)
    w_ptr += p.to(tl.int64) * R * H
    w = kmajor.kmajor_first(w_ptr, R, H, H, BR, 8)
    tl.store(out_ptr + p * H + c, kmajor.kmajor_rows(w_ptr, h_ptr + p * R, R, H, w, H, BR, 8))


@triton.jit
def rowmajor_kernel(W, A, I, R, K, BR: tl.constexpr, KC: tl.constexpr, ALIGN: tl.constexpr):
    """Program p: today's LINEAR stream over rows p·R .. (p+1)·R of W (K columns) times x = A[0:K], into A[K + ..]
    (the megakernel's T = 1 launch constants: one token, ROWVEC 2, AHEAD 1, evict-first weights)."""
    p = tl.program_id(0)
    r0, r1 = p * R, p * R + R
    no = p < 0  # a run-time False, as the kernel's flags are
    w = linear.first_chunk(W, r0, r1, K, BR, KC, ALIGN, 1)
    linear.stream_chunks(A, K, I, 0, 1, A + K, 1, A, 0, no, W, W, no, r0, r1, K, w, False, 0.0,
                         BR, KC, ALIGN, 1, 1, 16, 2, 1, 0, 1)


def bench(rows: int, iters: int, BR: int = 8) -> dict:
    dev = torch.device("cuda")
    P = torch.cuda.get_device_properties(dev).multi_processor_count
    nbytes = P * rows * H * 2
    copies = max(2, -(-200 * 2**20 // nbytes))  # rotate past the L2 (50 MB on an H200)
    g = torch.Generator(device=dev).manual_seed(0)
    ws = [torch.randn(P * rows, H, device=dev, generator=g).to(torch.bfloat16) for _ in range(copies)]
    h = torch.randn(P * rows, device=dev, generator=g)
    x = torch.randn(H, device=dev, generator=g)
    out = torch.empty(P, H, device=dev)
    A = torch.zeros(H + P * rows, device=dev)
    A[:H] = x
    I = torch.zeros(16, dtype=torch.int32, device=dev)
    turn = [0]

    def run(kind: str):
        w = ws[turn[0] % copies]
        turn[0] += 1
        if kind == "kmajor":
            kmajor_kernel[(P,)](w, h, out, rows, H=H, BR=BR, num_warps=8)
        else:
            rowmajor_kernel[(P,)](w, A, I, rows, H, BR=BR, KC=2048, ALIGN=8, num_warps=8)

    result = {"rows": rows, "programs": P, "MB": nbytes / 1e6}
    for kind in ("kmajor", "rowmajor"):
        turn[0] = 0
        run(kind)
        torch.cuda.synchronize()
        w = ws[0].view(P, rows, H)
        if kind == "kmajor":
            want, got = reference_kmajor(w, h.view(P, rows)), out
        else:
            want, got = (w.float() @ x).reshape(-1), A[H:]
        err = ((got - want).abs().max() / want.abs().max()).item()
        ms = time_ms(lambda: run(kind), iters)
        result[kind] = {"ms": ms, "TBps": nbytes / ms / 1e9, "GBps_per_sm": nbytes / ms / 1e6 / P, "rel_err": err}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="*", type=int, default=[64, 256], help="rows of 2048 a program streams")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", help="write the results as JSON into this folder")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kmajor_bench times the loops on a GPU (tests/test_kmajor_bench.py checks the math on a CPU)")
    results = [bench(rows, a.iters) for rows in a.rows]
    print(f"{'rows':>5} {'MB':>7} {'loop':>9} {'ms':>8} {'TB/s':>6} {'GB/s/SM':>8} {'rel err':>8}")
    for r in results:
        for kind in ("kmajor", "rowmajor"):
            k = r[kind]
            print(f"{r['rows']:>5} {r['MB']:>7.1f} {kind:>9} {k['ms']:>8.4f} {k['TBps']:>6.2f} "
                  f"{k['GBps_per_sm']:>8.1f} {k['rel_err']:>8.1e}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "kmajor_bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
