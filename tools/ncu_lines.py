"""Nsight Compute's warp-state samples of the megakernel, summed per op body and per Python source line.

    python tools/ncu_lines.py OUT/mk_sass.csv OUT/mk.cubin [--top 25]

The CSV is `ncu --import REP --page source --csv --print-source sass` of a report that
tools/ncu_step.py's run collected (SourceCounters); the cubin is the kernel that run compiled.
nvdisasm -g gives each SASS offset its source line (Triton keeps line info), and the CSV's
addresses, less the first, are those offsets: the two must list the same instructions, which is
checked.  Prints the samples per source file (one op family per file under megakernel/ops), their
main stall reasons, and the lines with the most samples.  No GPU needed.
"""

from __future__ import annotations

import argparse
import collections
import csv
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sass_probe import opcode, sass_lines  # noqa: E402

NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"


def line_map(cubin: Path) -> dict[int, tuple[str, str]]:
    """SASS offset -> (file:line, opcode) of the cubin's one kernel."""
    with tempfile.TemporaryDirectory() as d:
        obj = Path(d) / "k.cubin"
        obj.write_bytes(cubin.read_bytes())
        sass = subprocess.run([NVDISASM, "-g", "-c", obj], capture_output=True, text=True, check=True).stdout
    return {addr: (where, opcode(ins)) for addr, where, ins in sass_lines(sass)}


def read_samples(path: Path) -> list[dict]:
    rows = list(csv.reader(path.open()))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = rows[header]
    return [dict(zip(cols, r)) for r in rows[header + 1:] if r and r[0].startswith("0x")]


def attribute(rows: list[dict], lines: dict[int, tuple[str, str]]) -> tuple[dict, dict, list[str]]:
    """(per file, per line, stall names): samples, executed warp instructions and each stall reason
    summed.  The CSV's addresses less the first are the cubin's offsets; if more than 1% of the
    opcodes differ, the two are not the same kernel (ValueError)."""
    base = int(rows[0]["Address"], 16)
    stalls = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    per_file = collections.defaultdict(collections.Counter)
    per_line = collections.defaultdict(collections.Counter)
    mismatched = 0
    for r in rows:
        where, op = lines.get(int(r["Address"], 16) - base, ("?", "?"))
        mismatched += op != opcode(r["Source"].strip())
        for key, counter in ((where.split(":")[0], per_file), (where, per_line)):
            c = counter[key]
            c["samples"] += int(r["Warp Stall Sampling (All Samples)"] or 0)
            c["executed"] += int(r["Instructions Executed"] or 0)
            for s in stalls:
                c[s] += int(r[s] or 0)
    if mismatched > len(rows) // 100:
        raise ValueError(f"{mismatched} of {len(rows)} instructions differ between the CSV and the cubin: "
                         "not the same kernel")
    return per_file, per_line, stalls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", type=Path)
    p.add_argument("cubin", type=Path)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    rows = read_samples(args.csv)
    try:
        per_file, per_line, stalls = attribute(rows, line_map(args.cubin))
    except ValueError as e:
        sys.exit(str(e))
    total = sum(c["samples"] for c in per_file.values())
    print(f"{len(rows)} instructions, {total} samples")

    def top_stalls(c) -> str:
        parts = sorted(((c[s], s[6:]) for s in stalls if c[s]), reverse=True)[:4]
        return ", ".join(f"{name} {100 * v / max(1, c['samples']):.0f}%" for v, name in parts)

    print(f"{'file':22s} {'samples':>8s} {'share':>6s} {'warp instr':>11s}  top stalls")
    for name, c in sorted(per_file.items(), key=lambda kv: -kv[1]["samples"]):
        print(f"{name:22s} {c['samples']:8d} {100 * c['samples'] / max(1, total):5.1f}% {c['executed']:11d}  "
              f"{top_stalls(c)}")
    print(f"\nlines with the most samples:\n{'line':28s} {'samples':>8s} {'share':>6s}  top stalls")
    for name, c in sorted(per_line.items(), key=lambda kv: -kv[1]["samples"])[:args.top]:
        print(f"{name:28s} {c['samples']:8d} {100 * c['samples'] / max(1, total):5.1f}%  {top_stalls(c)}")


if __name__ == "__main__":
    main()
