#!/usr/bin/env bash
# Everything a GPU session checks, in one call (device time is the scarce resource):
#   bash tools/gpu_session.sh [OUT_DIR]
# GPU tests, then the bench (floors, plain-PyTorch baselines, megakernel, per-op profile),
# then the outside yardstick if a copy of ../shared/anchors sits in .anchors/ (git-ignored;
# carry it with the device tool). Logs and JSON go to OUT_DIR (default $OUT or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
timeout 240 python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -15
timeout 420 python3 tools/bench.py --models llama-1b dsv2-lite --T 1 --profile --out "$out" 2>&1 \
    | tee "$out/bench.log" | grep -v '^{"model'
if [ -f .anchors/torch_baselines.py ]; then
    timeout 300 python3 .anchors/torch_baselines.py 2>&1 | tee "$out/anchors.log" | tail -12
fi
