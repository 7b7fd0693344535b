#!/usr/bin/env bash
# Everything a GPU session checks (device time is the scarce resource):
#   [MODELS="..."] [TS="1 6"] [VARIANTS="..."] [PLAN_VARIANTS="..."] [BASELINES="eager graph compile"] [JOBS=8]
#   [TESTS_K="..."] [TESTS_PROCS=3] [TESTS_TIMEOUT=570] [BENCH_TIMEOUT=560] bash tools/gpu_session.sh PARTS [OUT_DIR]
# PARTS: a comma list of
#   tests    the gpu-marked tests (TESTS_K: a pytest -k selection of them);
#   bench    floors, plain-PyTorch baselines, the megakernel, launch/plan variants and a per-op
#            profile for $MODELS (default: llama-1b dsv2-lite);
#   spec     the speculative k sweep (k = 0..7, one graph replay each) and speculative-equals-plain
#            check on dsv2-lite and llama-1b, each with one MTP layer (tools/spec_sweep.py);
#   hop      dependency hops alone (tools/hop_bench.py: all to all on 2 programs and one per SM): the kernel's
#            counter hand-over against an ld.acquire poll, NCCL-style flagged rows, the task word's field read
#            before the wait (early) and through ld.global.nc after it (nc), ns a hop (~1 min);
#   stream   the weight stream alone (tools/stream_bench.py): GB/s per SM of LINEAR and expert
#            tasks, default launch beside $STREAM_VARIANTS;
#   ncu      Nsight Compute's warp-state samples of one step of each of $MODELS (tools/ncu_step.py; the
#            report, its per-instruction CSV and the cubin come back; tools/ncu_lines.py reads them offline);
#   helper   experts on a helper with the megakernel as main: its GPU tests (tests/test_helper_megakernel.py)
#            and tools/helper_bench.py on $HELPER (default cuda:1: the nvidia-h200-x2 kind) for dsv2-lite;
#   gluon    the warp-specialized Gluon GEMV chain (tools/gluon_stream.py): its GPU tests, then Llama-1B's 64
#            GEMVs with and without dependency waits beside cuBLAS in a CUDA graph, for $GLUON_VARIANTS; then
#            LINEAR's epilogues in the ring (tools/gluon_linear.py) and the ring beside a Triton kernel on the
#            same SMs (tools/cokernel_chain.py), each after its GPU tests (~5 min in all);
#   anchors  the outside yardstick, if a copy of ../shared/anchors sits in .anchors/ (git-ignored;
#            carry it with the device tool);
#   all      tests,bench,spec,anchors.
# Keep each call under the device tool's 10-minute limit (tests: each distinct set of block sizes is
# a ~40 s JIT compile; session 7's first call passed only 13 tests in 570 s, before the tiny presets'
# tests shared one kernel (tests/conftest.py TINY_BLOCKS); split them with TESTS_K if they still do
# not fit; bench ~250 s per model and T with two variants, spec ~300 s, stream ~150 s, helper ~450 s).
# Exits with the worst part's status.
# Compiled kernels: Triton's cache lives in .triton_cache (git-ignored) and comes back packed as
# $OUT/triton_cache.txz when it fits (16 MiB); `bash tools/triton_cache.sh keep FILE` here and
# `carry: [".triton_cache.txz"]` in the next device call skip the compiles of unchanged kernels (~40 s
# each for the megakernel): this script restores it first.
set -uo pipefail
cd "$(dirname "$0")/.."
parts=",${1:-all},"
[ "$parts" = ",all," ] && parts=",tests,bench,spec,stream,anchors,"
out="${2:-${OUT:-out}}"
models="${MODELS:-llama-1b dsv2-lite}"
ts="${TS:-1}"
variants="${VARIANTS-DEPTH=2}"
plan_variants="${PLAN_VARIANTS-}"
baselines="${BASELINES-eager graph compile}"  # bench's plain-PyTorch baselines ("" for none)
jobs="${JOBS:-8}"  # bench compiles its kernels side by side in this many processes first
stream_variants="${STREAM_VARIANTS-DEPTH=2 BR=16,KC=1024}"
gluon_variants="${GLUON_VARIANTS:-gluon:6x4 gluonrm:6x4 gluon:8x3 triton:8x2048}"
mkdir -p "$out"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.triton_cache}"
rc=0  # the worst part's status (a part cut by its timeout gives 124), not the last test's
worst() { [ "$1" -gt "$rc" ] && rc=$1; return 0; }
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee -a "$out/gpu.txt"
bash tools/triton_cache.sh restore || true
if [[ "$parts" == *,tests,* ]]; then
    # pytest-xdist (on the GPU machine's image) runs TESTS_PROCS test processes on the one GPU, so their kernels
    # compile side by side (session 15: 40 tests in 357 s with 3)
    procs=""
    python3 -c "import xdist" 2>/dev/null && procs="-n ${TESTS_PROCS:-3}"
    # each failure's reason as it happens (tests/conftest.py): the timeout below kills pytest before its summary
    export MEGAKERNEL_FAILURES_LOG="$out/gpu_failures.log"
    : > "$MEGAKERNEL_FAILURES_LOG"
    # shellcheck disable=SC2086
    timeout "${TESTS_TIMEOUT:-570}" python3 -m pytest $procs -m gpu tests/test_gpu.py tests/test_weight_stream.py \
        tests/test_helper.py tests/test_gluon_stream.py tests/test_gluon_linear.py tests/test_cokernel_chain.py \
        tests/test_stream_kernel.py tests/test_capi.py -v \
        -p no:cacheprovider --durations=25 ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
        | tee "$out/gpu_tests.log" | tail -40 || worst $?
    [ -s "$MEGAKERNEL_FAILURES_LOG" ] && { echo "--- failures (tail of $MEGAKERNEL_FAILURES_LOG):"; tail -c 6000 "$MEGAKERNEL_FAILURES_LOG"; }
    unset MEGAKERNEL_FAILURES_LOG
fi
if [[ "$parts" == *,bench,* ]]; then
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-560}" python3 tools/bench.py --models $models --T $ts --profile --variants $variants \
        --plan-variants $plan_variants --baselines $baselines --jobs "$jobs" --out "$out" 2>&1 | tee "$out/bench.log" \
        | { grep -v '^{"model\|^precompiled ' || true; } || worst $?
fi
if [[ "$parts" == *,spec,* ]]; then
    timeout 500 python3 tools/spec_sweep.py --models dsv2-lite llama-1b --mtp 1 --ctx 4096 --kmax 7 --out "$out" 2>&1 \
        | tee "$out/spec.log" | tail -20 || worst $?
fi
if [[ "$parts" == *,hop,* ]]; then
    timeout 120 python3 tools/hop_bench.py --out "$out" 2>&1 | tee "$out/hop.log" | tail -8 || worst $?
fi
if [[ "$parts" == *,stream,* ]]; then
    for kind in dense moe; do
        # shellcheck disable=SC2086
        timeout 280 python3 tools/stream_bench.py --kind $kind --variants $stream_variants --out "$out" 2>&1 \
            | tee "$out/stream_$kind.log" | tail -6 || worst $?
    done
fi
if [[ "$parts" == *,ncu,* ]]; then
    for m in $models; do
        timeout 250 ncu --clock-control none -k regex:megakernel --launch-skip 2 --launch-count 1 \
            --section SourceCounters --section WarpStateStats -o "$out/$m" -f \
            python3 tools/ncu_step.py --model "$m" --cubin "$out/$m.cubin" 2>&1 | tail -3 || worst $?
        ncu --import "$out/$m.ncu-rep" --page source --csv --print-source sass > "$out/${m}_sass.csv"
    done
fi
if [[ "$parts" == *,helper,* ]]; then
    timeout 200 python3 -m pytest -m gpu tests/test_helper_megakernel.py -q -p no:cacheprovider --durations=0 2>&1 \
        | tee "$out/helper_tests.log" | tail -12 || worst $?
    # 96 steps, the hot set moving at step 48: migration moves at most 2 experts per step, so the helper's
    # share of rows can only be seen falling over tens of steps
    # migration overlapped with the next step (on, the default) beside off, each twice: two runs of one
    # mode differ step by step by up to 1.2x (session 10), so a step's fastest run is what is compared
    timeout 420 python3 tools/helper_bench.py --model dsv2-lite --helper "${HELPER:-cuda:1}" --fractions 0.25 0.5 \
        --migrate off on off on --steps 96 --warmup 4 --shift 48 --out "$out" 2>&1 | tee "$out/helper_bench.log" \
        | tail -16 || worst $?
fi
if [[ "$parts" == *,gluon,* ]]; then
    timeout 150 python3 -m pytest -m gpu tests/test_gluon_stream.py tests/test_gluon_linear.py \
        tests/test_cokernel_chain.py -q -p no:cacheprovider 2>&1 | tee "$out/gluon_tests.log" | tail -8 || worst $?
    # shellcheck disable=SC2086
    timeout 200 python3 tools/gluon_stream.py --variants $gluon_variants --iters 30 --out "$out" 2>&1 \
        | tee "$out/gluon_stream.log" | grep -v "^{" | tail -14 || worst $?
    timeout 120 python3 tools/gluon_linear.py --variants 6x4 12x2 3x8 --out "$out" 2>&1 \
        | tee "$out/gluon_linear.log" | grep -v "^{" | tail -8 || worst $?
    timeout 120 python3 tools/cokernel_chain.py --out "$out" 2>&1 | tee "$out/cokernel_chain.log" | tail -5 || worst $?
fi
if [[ "$parts" == *,anchors,* ]] && [ -f .anchors/torch_baselines.py ]; then
    timeout 560 python3 .anchors/torch_baselines.py 2>&1 | tee "$out/anchors.log" | tail -12 || worst $?
fi
bash tools/triton_cache.sh pack "$out/triton_cache.txz" || true
# the device tool returns at most 8 files: under it, everything but the Triton cache goes back as one archive
if [ -n "${OUT:-}" ] && [ "$out" = "$OUT" ]; then
    (cd "$out" && find . -maxdepth 1 -type f ! -name triton_cache.txz ! -name 'results_*.tar.xz' -printf '%P\n' \
        | XZ_OPT=-T0 tar -cJf "results_$(echo "${1:-all}" | tr , _).tar.xz" -T - --remove-files) || true
fi
[ "$rc" = 0 ] || echo "gpu_session: a part failed or ran out of time (status $rc): see the logs in $out" >&2
exit "$rc"
