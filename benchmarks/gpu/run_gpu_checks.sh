#!/usr/bin/env bash
# The prepared GPU check of issue 4, for a machine with an NVIDIA GPU and this repository checked out:
#   1. builds oar from source with the CUDA kernels (one architecture, -j16 by default),
#   2. runs the CUDA tests (pytest -m cuda: the "cuda" cases of each op's test file and tests/python/test_cuda.py,
#      then ctest when GoogleTest was found),
#   3. times every kernel against the PyTorch reference on the same GPU and measures the device copy bandwidth
#      (benchmarks/gpu/bench_cuda.py), printing the table,
#   4. times one training step of GRPO, OAR-G and OAR-P (ours, naive batched, naive serial) on the fixed-shape
#      suite (benchmarks/python/bench_step.py --device cuda; issue 3's step goals), printing the table.
# Logs and results go to $OUT if set, else ./gpu_results: build.log, pytest.log, ctest.log, bench.log,
# bench_cuda.csv, bench_cuda.md, bench_cuda_env.json, step.log, step.md, step.csv, step.json (11 files).
# Exit status: 0 only if every step passed.
#
# Usage: benchmarks/gpu/run_gpu_checks.sh [--setup] [--no-tests] [--no-bench] [--no-step]
#   (default)  use an existing Python with a CUDA torch (.venv/bin/python if it has one, else $PYTHON or python3)
#              and build with CMake directly into $OAR_GPU_BUILD_DIR (default build-gpu). For machines without
#              network access (no pip, no apt): the C++ dependencies (Eigen, spdlog + fmt, nlohmann-json,
#              GoogleTest) must be installed, or their Debian packages lie in $OAR_GPU_DEBS (default .gpu-debs,
#              made by benchmarks/gpu/fetch_debs.sh on a machine with apt) and are unpacked under /tmp.
#   --setup    run ./setup.sh first (needs network: apt + pip), with the same single architecture and -j, then
#              use its .venv and build tree.
# Knobs: OAR_CUDA_ARCHITECTURES (default: the GPU's own, e.g. 90 on H100/H200), OAR_JOBS (16),
#        OAR_GPU_PYTEST_ARGS (extra pytest arguments), BENCH_ARGS (extra bench_cuda.py arguments),
#        STEP_ARGS (bench_step.py arguments; default: the fixed suite at 128 512 2048, 2 repeats, bfloat16).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT_DIR=${OUT:-$ROOT/gpu_results}
mkdir -p "$OUT_DIR"
JOBS=${OAR_JOBS:-16}
BUILD_DIR=${OAR_GPU_BUILD_DIR:-$ROOT/build-gpu}
DO_SETUP=0 DO_TESTS=1 DO_BENCH=1 DO_STEP=1
for a in "$@"; do
  case "$a" in
    --setup) DO_SETUP=1 ;;
    --no-tests) DO_TESTS=0 ;;
    --no-bench) DO_BENCH=0 ;;
    --no-step) DO_STEP=0 ;;
    -h|--help) sed -n '2,/^set -uo/{/^set -uo/!p}' "$0"; exit 0 ;;
    *) echo "run_gpu_checks.sh: unknown argument '$a' (see --help)" >&2; exit 2 ;;
  esac
done
T0=$(date +%s)
log() { printf '\033[1;32m[gpu %4ds]\033[0m %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
STATUS=()
fail=0

command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ -z "${OAR_CUDA_ARCHITECTURES:-}" ]; then
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
  OAR_CUDA_ARCHITECTURES=${cc:-90}
fi
log "CUDA architectures: $OAR_CUDA_ARCHITECTURES, jobs: $JOBS, output: $OUT_DIR"

# ---- 1. Python + build -----------------------------------------------------------------------------------------
NVCC=$(command -v nvcc || true)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ "$DO_SETUP" = 1 ]; then
  log "./setup.sh (CUDA ON, arch $OAR_CUDA_ARCHITECTURES)"
  CMAKE_ARGS="-DOAR_CUDA_ARCHITECTURES=$OAR_CUDA_ARCHITECTURES ${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
    OAR_WITH_CUDA=ON OAR_BUILD_DIR="$BUILD_DIR" ./setup.sh 2>&1 | tee "$OUT_DIR/build.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { log "setup.sh failed (rc=$rc): see $OUT_DIR/build.log"; exit 1; }
  PY=$ROOT/.venv/bin/python
else
  PY=""
  for cand in "$ROOT/.venv/bin/python" "${PYTHON:-}" python3; do
    [ -n "$cand" ] || continue
    if "$cand" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1; then PY=$cand; break; fi
  done
  [ -n "$PY" ] || { echo "no Python with a CUDA build of torch found (tried .venv, \$PYTHON, python3)" >&2; exit 1; }
  [ -n "$NVCC" ] || { echo "nvcc not found (PATH, /usr/local/cuda/bin)" >&2; exit 1; }
  # The environment's own tools (cmake, ninja, pybind11 from pip) come first.
  PATH="$(dirname "$(command -v "$PY")"):$PATH"
  log "python: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'))"

  # C++ dependencies from carried Debian packages, when the system has none (no network on the machine).
  DEBS=${OAR_GPU_DEBS:-$ROOT/.gpu-debs}
  if compgen -G "$DEBS/*.deb" >/dev/null; then
    DEPS=/tmp/oar-gpu-deps
    mkdir -p "$DEPS"
    for f in "$DEBS"/*.deb; do dpkg-deb -x "$f" "$DEPS"; done
    export CMAKE_PREFIX_PATH="$DEPS/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
    export LD_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    log "unpacked $(ls "$DEBS"/*.deb | wc -l) Debian packages from $DEBS into $DEPS"
  fi

  GEN=(); command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
  [ -f "$BUILD_DIR/CMakeCache.txt" ] && ! grep -q "^CMAKE_GENERATOR:INTERNAL=Ninja" "$BUILD_DIR/CMakeCache.txt" && GEN=()
  PYBIND=$("$PY" -m pybind11 --cmakedir 2>/dev/null || true)
  configure() {  # $1: ON/OFF for the GoogleTest tests
    cmake -S "$ROOT" -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DOAR_WITH_CUDA=ON \
      -DCMAKE_CUDA_COMPILER="$NVCC" -DOAR_CUDA_ARCHITECTURES="$OAR_CUDA_ARCHITECTURES" \
      -DOAR_BUILD_PYTHON=ON -DOAR_BUILD_TESTS="$1" -DOAR_BUILD_BENCHMARKS=OFF \
      -DPython_EXECUTABLE="$PY" -DOAR_PYTHON_EXECUTABLE="$PY" ${PYBIND:+-Dpybind11_DIR="$PYBIND"}
  }
  log "configure + build ($BUILD_DIR)"
  {
    if ! configure ON; then
      echo "[gpu] configure with the GoogleTest tests failed (GTest missing?): retrying without them"
      configure OFF || exit 1
    fi
    cmake --build "$BUILD_DIR" -j "$JOBS"
  } > "$OUT_DIR/build.log" 2>&1
  rc=$?
  tail -n 5 "$OUT_DIR/build.log"
  [ "$rc" = 0 ] || { log "build failed (rc=$rc): last lines of $OUT_DIR/build.log:"; tail -n 60 "$OUT_DIR/build.log"; exit 1; }
fi
STATUS+=("build: ok")
export OAR_BUILD_DIR=$BUILD_DIR
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" -c "import oar, json; i = oar.build_info(); print(json.dumps({k: str(v) for k, v in i.items()})); assert oar.has_cuda_kernels(), 'no CUDA kernels in this build'" \
  || { log "oar does not load or has no CUDA kernels"; exit 1; }

# ---- 2. tests ----------------------------------------------------------------------------------------------------
if [ "$DO_TESTS" = 1 ]; then
  log "pytest tests/python -m cuda"
  # shellcheck disable=SC2086
  "$PY" -m pytest tests/python -m cuda -q -rs -p no:cacheprovider --durations=10 ${OAR_GPU_PYTEST_ARGS:-} \
    2>&1 | tee "$OUT_DIR/pytest.log" | tail -n 40
  rc=${PIPESTATUS[0]}
  STATUS+=("pytest -m cuda: rc=$rc ($(tail -n 1 "$OUT_DIR/pytest.log"))"); [ "$rc" = 0 ] || fail=1
  if [ -f "$BUILD_DIR/CTestTestfile.cmake" ] && grep -q "^OAR_BUILD_TESTS:BOOL=ON" "$BUILD_DIR/CMakeCache.txt"; then
    log "ctest"
    ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" 2>&1 | tee "$OUT_DIR/ctest.log" | tail -n 5
    rc=${PIPESTATUS[0]}
    STATUS+=("ctest: rc=$rc"); [ "$rc" = 0 ] || fail=1
  else
    echo "ctest skipped: the build has no GoogleTest tests" | tee "$OUT_DIR/ctest.log"
    STATUS+=("ctest: skipped (no GoogleTest)")
  fi
fi

# ---- 3. timings --------------------------------------------------------------------------------------------------
if [ "$DO_BENCH" = 1 ]; then
  log "benchmarks/gpu/bench_cuda.py"
  # shellcheck disable=SC2086
  "$PY" benchmarks/gpu/bench_cuda.py --out "$OUT_DIR" ${BENCH_ARGS:-} 2>&1 | tee "$OUT_DIR/bench.log"
  rc=${PIPESTATUS[0]}
  STATUS+=("bench: rc=$rc"); [ "$rc" = 0 ] || fail=1
fi

# ---- 4. one training step (issue 3) ------------------------------------------------------------------------------
if [ "$DO_STEP" = 1 ]; then
  if "$PY" -c "import transformers" >/dev/null 2>&1; then
    log "benchmarks/python/bench_step.py --device cuda"
    # shellcheck disable=SC2086
    "$PY" benchmarks/python/bench_step.py --device cuda --out "$OUT_DIR/step" \
      ${STEP_ARGS:---suite fixed --lengths 128 512 2048 --repeats 2 --naive-stride 8 --dtype bfloat16} \
      2>&1 | tee "$OUT_DIR/step.log"
    rc=${PIPESTATUS[0]}
    STATUS+=("step: rc=$rc"); [ "$rc" = 0 ] || fail=1
  else
    echo "step benchmark skipped: transformers is not importable by $PY" | tee "$OUT_DIR/step.log"
    STATUS+=("step: skipped (no transformers)")
  fi
fi

log "summary"
printf '  %s\n' "${STATUS[@]}"
exit $fail
