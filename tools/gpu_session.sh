#!/usr/bin/env bash
# Everything a GPU session checks (device time is the scarce resource):
#   bash tools/gpu_session.sh [tests|bench|anchors|all] [OUT_DIR]
# tests: the gpu-marked tests; bench: floors, plain-PyTorch baselines, megakernel and per-op
# profile for llama-1b and dsv2-lite; anchors: the outside yardstick, if a copy of
# ../shared/anchors sits in .anchors/ (git-ignored; carry it with the device tool).
# One part per call keeps each under the device tool's 10-minute limit.
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:-all}"
out="${2:-${OUT:-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee -a "$out/gpu.txt"
if [ "$part" = tests ] || [ "$part" = all ]; then
    timeout 300 python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -15
fi
if [ "$part" = bench ] || [ "$part" = all ]; then
    timeout 560 python3 tools/bench.py --models llama-1b dsv2-lite --T 1 --profile --plan-variants spread=0,attn_split=320 --out "$out" 2>&1 \
        | tee "$out/bench.log" | grep -v '^{"model'
fi
if { [ "$part" = anchors ] || [ "$part" = all ]; } && [ -f .anchors/torch_baselines.py ]; then
    timeout 560 python3 .anchors/torch_baselines.py 2>&1 | tee "$out/anchors.log" | tail -12
fi
