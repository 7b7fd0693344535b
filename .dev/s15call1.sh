#!/usr/bin/env bash
# session 15, call 1: session 14's opt-in variants timed on dsv2-lite, fresh traces of both models,
# the variants' GPU tests.  Results come back as $OUT/results.tar.xz (+ the Triton cache).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton_cache
r=$OUT/r; mkdir -p "$r"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$r/gpu.txt"
bash tools/triton_cache.sh restore || true
timeout 330 python3 tools/bench.py --models dsv2-lite --T 1 --profile --baselines --jobs 10 \
  --variants AHEAD=1 NARROW=1 ROUTE1=1 AHEAD=1,NARROW=1,ROUTE1=1 \
  --plan-variants norm_beside_experts=1 attn_split=32 attn_split=128 norm_beside_experts=1,AHEAD=1,NARROW=1,ROUTE1=1 \
  --out "$r/dsv2" 2>&1 | tee "$r/bench_dsv2.log" | grep -v '^{"model'
timeout 120 python3 tools/bench.py --models llama-1b --T 1 --profile --baselines --jobs 2 --plan-variants balance_bytes=1048576 \
  --out "$r/llama" 2>&1 | tee "$r/bench_llama.log" | grep -v '^{"model'
bash tools/triton_cache.sh pack "$OUT/triton_cache.txz" || true
cd "$OUT" && XZ_OPT=-T0 tar -cJf results.tar.xz r && rm -rf r
for f in "$OUT"/*; do echo "$f $(stat -c %s "$f")"; done
