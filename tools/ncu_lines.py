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
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sass_probe import sass_lines  # noqa: E402

NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"


def line_map(cubin: Path) -> dict[int, tuple[str, str]]:
    """SASS offset -> (file:line, opcode) of the cubin's one kernel."""
    with tempfile.TemporaryDirectory() as d:
        obj = Path(d) / "k.cubin"
        obj.write_bytes(cubin.read_bytes())
        sass = subprocess.run([NVDISASM, "-g", "-c", obj], capture_output=True, text=True, check=True).stdout
    return {addr: (where, re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]) for addr, where, ins in sass_lines(sass)}


def read_samples(path: Path) -> list[dict]:
    rows = list(csv.reader(path.open()))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = rows[header]
    return [dict(zip(cols, r)) for r in rows[header + 1:] if r and r[0].startswith("0x")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", type=Path)
    p.add_argument("cubin", type=Path)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    rows = read_samples(args.csv)
    lines = line_map(args.cubin)
    base = int(rows[0]["Address"], 16)
    stalls = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    per_file = collections.defaultdict(collections.Counter)
    per_line = collections.defaultdict(collections.Counter)
    mismatched = 0
    for r in rows:
        where, op = lines.get(int(r["Address"], 16) - base, ("?", "?"))
        if op != r["Source"].strip().split()[0].lstrip("@!UP0123456789T").split(".")[0] and not r["Source"].strip().startswith("@"):
            mismatched += op.split(".")[0] != r["Source"].split()[0].split(".")[0]
        n = int(r["Warp Stall Sampling (All Samples)"] or 0)
        for key, counter in ((where.split(":")[0], per_file), (where, per_line)):
            c = counter[key]
            c["samples"] += n
            c["executed"] += int(r["Instructions Executed"] or 0)
            for s in stalls:
                c[s] += int(r[s] or 0)
    if mismatched > len(rows) // 100:
        sys.exit(f"{mismatched} of {len(rows)} instructions differ between the CSV and the cubin: not the same kernel")
    total = sum(c["samples"] for c in per_file.values())
    print(f"{len(rows)} instructions, {total} samples")

    def top_stalls(c) -> str:
        parts = sorted(((c[s], s[6:]) for s in stalls if c[s]), reverse=True)[:4]
        return ", ".join(f"{name} {100 * v / max(1, c['samples']):.0f}%" for v, name in parts)

    print(f"{'file':22s} {'samples':>8s} {'share':>6s} {'warp instr':>11s}  top stalls")
    for name, c in sorted(per_file.items(), key=lambda kv: -kv[1]["samples"]):
        print(f"{name:22s} {c['samples']:8d} {100 * c['samples'] / total:5.1f}% {c['executed']:11d}  {top_stalls(c)}")
    print(f"\nlines with the most samples:\n{'line':28s} {'samples':>8s} {'share':>6s}  top stalls")
    for name, c in sorted(per_line.items(), key=lambda kv: -kv[1]["samples"])[:args.top]:
        print(f"{name:28s} {c['samples']:8d} {100 * c['samples'] / total:5.1f}%  {top_stalls(c)}")


if __name__ == "__main__":
    main()
