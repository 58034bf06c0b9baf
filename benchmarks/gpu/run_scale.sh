#!/usr/bin/env bash
# Prepared GPU check of issue 23 (OAR at scale), one bounded command, about 5 minutes on one H200:
#   build   benchmarks/gpu/run_gpu_checks.sh --build-only (preflight, carried C++ packages, CMake, the three targets,
#           import; caps 20+15+45+150+25 = 255 s);
#   tests   the CUDA tests of the shared-prefix attention on FlexAttention (tests/python/test_shared_prefix_flex.py
#           -m cuda: the prefix and windowed engines, fp32 and bf16, against the float64 CPU references; cap 120 s,
#           the first call compiles the kernel);
#   time    benchmarks/python/bench_scale.py time: a random-weight Qwen2.5-1.5B-shaped model in bf16, one row of
#           L = 4096 reasoning tokens (units of 25 tokens), the GRPO-update proxy, OAR-G, windowed OAR-P (W = 8),
#           span OAR-P and windowed span OAR-P: seconds, first-call seconds (compilation), peak GiB (cap 180 s).
# Results in $OUT (default ./gpu_results): scale.log, time_qwen2.5-1.5b_L4096_cuda.{md,csv}. Exit 0 when all passed.
# Knobs: SCALE_LENGTH (4096), SCALE_SHAPE (qwen2.5-1.5b), SCALE_SETTINGS (a subset, e.g. "span window"),
# SCALE_PROFILE=1 (then one profiled call per setting: profile_*.txt, the top kernels by device time),
# SCALE_NO_FULL_BLOCKS=1 (FlexAttention with every block partial: the A/B of full-block lists),
# SCALE_TIMEOUT_S (180; the 7 settings took 119 s on the H200, 17 s of it the first window call's compilation),
# PY (the interpreter with a CUDA torch; default the one
# run_gpu_checks.sh finds), OAR_GPU_BUDGET_S for the build (default 255).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT:-$PWD/gpu_results}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/scale.log
rc=0
OAR_GPU_BUDGET_S=${OAR_GPU_BUDGET_S:-255} OUT=$OUT_DIR benchmarks/gpu/run_gpu_checks.sh --build-only 2>&1 | tail -n 15 | tee "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "[scale] build failed: $OUT_DIR/gpu_checks.log" | tee -a "$LOG"; exit 1; }
PY=${PY:-$(grep -o 'python: [^ |]*' "$OUT_DIR/gpu_checks.log" | head -1 | cut -d' ' -f2)}
PY=${PY:-python3}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" OAR_BUILD_DIR=${OAR_BUILD_DIR:-$PWD/build-gpu} PYTHONUNBUFFERED=1
echo "[scale] tests ($PY)" | tee -a "$LOG"
timeout 120 "$PY" -m pytest -p no:cacheprovider -m cuda -v -rfEs --tb=short tests/python/test_shared_prefix_flex.py \
  2>&1 | tail -n 25 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "[scale] timings" | tee -a "$LOG"
timeout "${SCALE_TIMEOUT_S:-180}" "$PY" benchmarks/python/bench_scale.py time --shape "${SCALE_SHAPE:-qwen2.5-1.5b}" \
  --length "${SCALE_LENGTH:-4096}" --device cuda --dtype bfloat16 --window 8 --unit-len 25 --out "$OUT_DIR" \
  ${SCALE_PROFILE:+--profile} ${SCALE_NO_FULL_BLOCKS:+--no-full-blocks} ${SCALE_SETTINGS:+--settings $SCALE_SETTINGS} \
  2>&1 | grep -v "Warning\|warnings.warn" | tail -n 12 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "[scale] $([ $rc = 0 ] && echo OK || echo FAILED)" | tee -a "$LOG"
exit $rc
