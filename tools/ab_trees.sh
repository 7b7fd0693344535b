#!/usr/bin/env bash
# Two trees timed on one machine in one device call: machines differ by up to ~13% on the same
# CUDA graph (docs/PERF.md, session 6), so a change is judged only against its parent measured
# beside it.
#   here:       bash tools/ab_trees.sh prepare REV        # REV's tree into .ab/REV (git-ignored)
#   device:     bash tools/ab_trees.sh run REV [bench.py args...]   (carry .ab)
# `run` runs tools/bench.py with the same arguments in REV's tree, then in this one, alternating
# twice (old, new, old, new), each writing under $OUT/REV-1, $OUT/head-1, ...
set -uo pipefail
cd "$(dirname "$0")/.."
verb="${1:?prepare REV | run REV [bench args]}"
rev="${2:?a git revision}"
shift 2
case "$verb" in
prepare)
    exclude="$(git rev-parse --git-common-dir)/info/exclude"
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.ab/' "$exclude" 2>/dev/null || echo '/.ab/' >> "$exclude"
    rm -rf ".ab/$rev" && mkdir -p ".ab/$rev"
    git archive "$rev" | tar -x -C ".ab/$rev"
    echo "prepared .ab/$rev ($(git rev-parse --short "$rev")); carry .ab in the device call"
    ;;
run)
    [ -d ".ab/$rev" ] || { echo "no .ab/$rev: run 'bash tools/ab_trees.sh prepare $rev' here and carry .ab" >&2; exit 2; }
    out="${OUT:-out}"
    mkdir -p "$out"
    rc=0
    for round in 1 2; do
        (cd ".ab/$rev" && PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 python3 tools/bench.py "$@" --out "$out/$rev-$round") \
            2>&1 | tee "$out/$rev-$round.log" | { grep -v '^{"model' || true; } || rc=$?
        PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 python3 tools/bench.py "$@" --out "$out/head-$round" \
            2>&1 | tee "$out/head-$round.log" | { grep -v '^{"model' || true; } || rc=$?
    done
    exit "$rc"
    ;;
*)
    echo "unknown verb $verb: prepare or run" >&2
    exit 2
    ;;
esac
