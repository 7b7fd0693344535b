#!/usr/bin/env bash
# session 15, call 3: the stream's depth (PFD rolling L2 prefetch, DEPTH=2) on both models, against the new
# defaults (AHEAD, ROUTE1, 32-position MLA splits) and torch.compile + CUDA graph in the same process.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton_cache
r=$OUT/r; mkdir -p "$r"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$r/gpu.txt"
bash tools/triton_cache.sh restore || true
timeout 500 python3 tools/bench.py --models dsv2-lite llama-1b --T 1 --profile --baselines compile --jobs 16 \
  --variants DEPTH=2 PFD=1 PFD=2 PFD=3 DEPTH=2,PFD=2 AHEAD=0,ROUTE1=0 \
  --plan-variants norm_beside_experts=1 balance_bytes=1048576 \
  --out "$r/b" 2>&1 | tee "$r/bench.log" | grep -v '^{"model\|^precompiled'
bash tools/triton_cache.sh pack "$OUT/triton_cache.txz" || true
cd "$OUT" && XZ_OPT=-T0 tar -cJf results.tar.xz r && rm -rf r
