#!/usr/bin/env bash
# The GPU check as one bounded command (issues 4 and 21; docs/gpu.md has the device call and how to read the output):
#   preflight  the Python whose torch has CUDA and sees the GPU, nvcc (same CUDA major as torch), CMake, ninja,
#              pybind11, Python.h, the GPU's architecture (nvidia-smi: 90 on an H100/H200);
#   deps       unpacks the carried Debian packages of the C++ dependencies (.gpu-debs, from prepare_carry.sh)
#              under /tmp: Eigen, spdlog + fmt, nlohmann-json (none is installed on the device image);
#   configure  CMake into build-gpu against that Python's torch (torch.utils.cmake_prefix_path, cmake/OarTorch.cmake),
#              CUDA kernels for the GPU's architecture only, no C++ tests or benchmarks, no compiler launcher (ccache);
#   build      the three targets the tests load (oar_core with the kernels, oar_torch, _C), -j16; ptxas's register,
#              spill and shared-memory report of the kernels goes to the log as a table;
#   import     oar from python/ + build-gpu loads, has CUDA kernels, and runs one op on the GPU;
#   pytest     every CUDA test (-m cuda) of the test files that take the device parameter
#              (tests/python/support/_devices.py), in 8 pytest-xdist workers when xdist is installed (a test that
#              crashes its worker is reported as failed and the worker replaced, instead of ending the phase: the
#              first H200 run, docs/gpu.md);
#   bench      benchmarks/gpu/bench_cuda.py: each kernel against PyTorch on the GPU, and the copy bandwidth;
#   step       (only with --step) benchmarks/python/bench_step.py --device cuda on the fixed-shape suite; installs the
#              carried wheels (.gpu-wheels) first when the `train` extra is incomplete.
# Every phase runs under `timeout` (the pytest, bench and step phases under `timeout -s INT -k 15`, so that a stopped
# pytest prints its tracebacks and summary and a stopped script its traceback): its time limit is what is left of the
# budget (OAR_GPU_BUDGET_S, default the sum of the caps of the phases that run: 480 s) minus the caps of the phases
# after it, so time a phase leaves unused goes to the next ones and every later phase keeps at least its cap. A failed
# build stops the run; a failed or timed-out test phase does not stop the benchmark. Everything printed goes to
# $OUT/gpu_checks.log as it is printed (a call stopped by its time limit still returns the log, a stopped pytest its
# tracebacks); $OUT/summary.txt has one line per phase and is rewritten after each phase. Files in $OUT (default
# ./gpu_results): gpu_checks.log, summary.txt, bench_cuda.csv, bench_cuda.md, bench_cuda_env.json (+ step.md,
# step.csv, step.json with --step): at most 8.
# Exit status: 0 when every phase that ran passed; 1 when one failed or timed out; 2 bad arguments; 3 preflight
# (no CUDA torch, no nvcc, a CUDA major version mismatch, missing C++ dependencies: printed first).
#
# Usage: benchmarks/gpu/run_gpu_checks.sh [--dry-run] [--step] [--no-tests] [--no-bench] [--build-only]
#   --dry-run     print the plan (phases, time limits, commands, what is found here, what travels and its size, the
#                 device call) and check what can be checked without a GPU: the carried packages unpack and hold
#                 the CMake packages, bench_cuda.py --dry-run on the CPU, the number of CUDA tests collected.
#                 Builds nothing (OAR_GPU_DRY_CONFIGURE=1 adds a CMake configure against the unpacked packages only).
#   --step        also run the step benchmark (cap 150 s); with the tests that is 630 s, more than one device call
#                 allows (600 s): use --step --no-tests (510 s).
#   --no-tests, --no-bench, --no-step (the default), --build-only (= --no-tests --no-bench).
# Knobs: OAR_GPU_BUDGET_S (total seconds), OAR_CUDA_ARCHITECTURES (default: the GPU's), OAR_JOBS (16),
#        OAR_GPU_BUILD_DIR (build-gpu), OAR_GPU_DEBS (.gpu-debs), OAR_GPU_WHEELS (.gpu-wheels), PYTHON (the
#        interpreter to try first), OAR_GPU_PYTEST_ARGS (replaces the xdist options; set it empty for one process),
#        BENCH_ARGS, STEP_ARGS (default: --suite fixed --lengths 128 512 --repeats 2 --naive-stride 8 --dtype
#        bfloat16), OAR_GPU_ALLOW_CUDA_MISMATCH=1.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
DRY=0 DO_TESTS=1 DO_BENCH=1 DO_STEP=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    --step) DO_STEP=1 ;;
    --no-step) DO_STEP=0 ;;
    --no-tests) DO_TESTS=0 ;;
    --no-bench) DO_BENCH=0 ;;
    --build-only) DO_TESTS=0; DO_BENCH=0; DO_STEP=0 ;;
    -h|--help) sed -n '2,/^set -uo/{/^set -uo/!p}' "$0"; exit 0 ;;
    *) echo "run_gpu_checks.sh: unknown argument '$a' (see --help)" >&2; exit 2 ;;
  esac
done

OUT_DIR=${OUT:-$ROOT/gpu_results}
BUILD_DIR=${OAR_GPU_BUILD_DIR:-$ROOT/build-gpu}
DEBS=${OAR_GPU_DEBS:-$ROOT/.gpu-debs}
WHEELS=${OAR_GPU_WHEELS:-$ROOT/.gpu-wheels}
DEPS_PREFIX=/tmp/oar-gpu-deps
SITE=/tmp/oar-gpu-site
BUILD_LOG=/tmp/oar-gpu-build.log
JOBS=${OAR_JOBS:-16}
STEP_ARGS=${STEP_ARGS:---suite fixed --lengths 128 512 --repeats 2 --naive-stride 8 --dtype bfloat16}
TOOL_LIMIT_S=600   # the device tool's limit on one command
TRAVEL_LIMIT=$((64 * 1024 * 1024))

# Phase caps (seconds). Measured on no device yet: the build was 1-2 min on 2 cores here for two architectures.
declare -A CAP=([preflight]=20 [deps]=15 [configure]=45 [build]=150 [import]=25 [pytest]=120 [bench]=105 [step]=150)
ENABLED=(preflight deps configure build import)
[ "$DO_TESTS" = 1 ] && ENABLED+=(pytest)
[ "$DO_BENCH" = 1 ] && ENABLED+=(bench)
[ "$DO_STEP" = 1 ] && ENABLED+=(step)
caps_sum=0
for p in "${ENABLED[@]}"; do caps_sum=$((caps_sum + CAP[$p])); done
BUDGET=${OAR_GPU_BUDGET_S:-$caps_sum}

q() { printf '%q' "$1"; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET))
log() { printf '[gpu %4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { log "STOP: $*"; record preflight FAILED "$(( $(date +%s) - T0 ))" "$*"; exit 3; }

# ---- phase bookkeeping ---------------------------------------------------------------------------------------------
SUMMARY=()
record() {  # phase status seconds note
  SUMMARY+=("$(printf '%-9s %-8s %4ss  %s' "$1" "$2" "$3" "$4")")
  [ "$DRY" = 1 ] && return 0
  { echo "phase     status    time  note (budget ${BUDGET}s; $(date -u +%FT%TZ))"; printf '%s\n' "${SUMMARY[@]}"; } \
    > "$OUT_DIR/summary.txt"
}
reserved_after() {  # sum of the caps of the enabled phases after $1
  local sum=0 seen=0 p
  for p in "${ENABLED[@]}"; do
    [ "$seen" = 1 ] && sum=$((sum + CAP[$p]))
    [ "$p" = "$1" ] && seen=1
  done
  echo "$sum"
}
FAIL=0
# The Python phases get SIGINT at their limit (`timeout -s INT`): pytest then prints "!!! KeyboardInterrupt !!!", the
# file:line it was at and the summary of the tests that ran (-rfEs, --durations), a script its traceback; the
# others get SIGTERM. A phase still running KILL_AFTER seconds later is killed.
declare -A KILL_AFTER=([pytest]=15 [bench]=15 [step]=15)
run_phase() {  # name command-string: runs it under timeout; returns its status (124/137: stopped at the limit)
  local name=$1 cmd=$2 now left reserve t t0 rc dt sig=TERM kill_after=${KILL_AFTER[$1]:-5}
  case "$name" in pytest|bench|step) sig=INT ;; esac
  now=$(date +%s); left=$((DEADLINE - now)); reserve=$(reserved_after "$name"); t=$((left - reserve))
  if [ "$t" -lt 5 ]; then
    log "phase $name: SKIPPED, no time left (${left}s of the budget, ${reserve}s kept for the phases after it)"
    record "$name" SKIPPED 0 "no time left"; FAIL=1; return 125
  fi
  log "phase $name: limit ${t}s (cap ${CAP[$name]}s; ${left}s of the ${BUDGET}s budget left, ${reserve}s kept for the phases after it)"
  echo "+ $cmd"
  t0=$(date +%s)
  timeout -s "$sig" -k "$kill_after" "$t" bash -c "set -o pipefail; $cmd"
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  case "$rc" in
    0) record "$name" ok "$dt" "" ;;
    124|137) record "$name" TIMEOUT "$dt" "stopped at its ${t}s limit by SIG$sig (rc=$rc; its output above)"; FAIL=1 ;;
    *) record "$name" FAILED "$dt" "rc=$rc"; FAIL=1 ;;
  esac
  log "phase $name: $( [ "$rc" = 0 ] && echo ok || echo "rc=$rc" ) in ${dt}s"
  return "$rc"
}

# ptxas -v report of the build log as one line per kernel: registers, spill stores/loads (bytes), static shared memory.
ptxas_table() {
  local f=$1 demangle=cat
  command -v c++filt >/dev/null 2>&1 && demangle=c++filt
  awk '
    /Compiling entry function/ { s = index($0, "\047"); r = substr($0, s + 1); name = substr(r, 1, index(r, "\047") - 1); st = ld = 0; next }
    /bytes stack frame/ { st = $5; ld = $9; next }
    /Used [0-9]+ registers/ && name != "" {
      n = $0; sub(/.*Used /, "", n); sub(/ registers.*/, "", n)
      sm = 0; if ($0 ~ /bytes smem/) { sm = $0; sub(/ bytes smem.*/, "", sm); sub(/.*, /, "", sm) }
      print n "\t" st "\t" ld "\t" sm "\t" name; name = ""
    }' "$f" | $demangle \
    | sed -E 's/oar::cuda::\(anonymous namespace\):://g; s/oar::core:://g; s/__nv_bfloat16/bf16/g; s/>\(.*$/>/; s/\tvoid /\t/' \
    | sort -t"$(printf '\t')" -k5 | awk -F'\t' 'BEGIN { printf "%5s %6s %6s %6s  %s\n", "regs", "spillS", "spillL", "smem", "kernel" }
                                                  { printf "%5s %6s %6s %6s  %s\n", $1, $2, $3, $4, $5 }'
}

# ---- what the run needs: Python + CUDA torch, nvcc, CMake, ninja, pybind11 -----------------------------------------
find_python() {  # sets PY, PY_INFO; in a dry run a CPU torch is accepted
  local cand info why=()
  PY=""
  for cand in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3; do
    [ -n "$cand" ] || continue
    if ! command -v "$cand" >/dev/null 2>&1 && [ ! -x "$cand" ]; then why+=("$cand: not found (a dangling link?)"); continue; fi
    info=$(timeout 60 "$cand" -c 'import sys, torch
ok, c = torch.cuda.is_available(), torch.version.cuda
print(sys.executable, "| torch", torch.__version__, "| CUDA", c or "none", "| GPU",
      torch.cuda.get_device_name() if ok else "none", "|", "%d%d" % (bool(c), ok))' 2>/dev/null) \
      || { why+=("$cand: cannot import torch"); continue; }
    case "${info##* }" in
      11) PY=$cand; PY_INFO=${info% |*}; return 0 ;;
      10) if [ "$DRY" = 1 ]; then PY=$cand; PY_INFO="${info% |*} (CUDA build, no GPU here: dry run)"; return 0; fi
          why+=("$cand: ${info% |*}: CUDA build of torch but no GPU visible") ;;
      *)  if [ "$DRY" = 1 ]; then PY=$cand; PY_INFO="${info% |*} (CPU-only torch: the device needs a CUDA one)"; return 0; fi
          why+=("$cand: ${info% |*}: torch has no CUDA") ;;
    esac
  done
  printf '  %s\n' "${why[@]}"
  return 1
}

preflight() {
  log "run_gpu_checks.sh $( [ "$DRY" = 1 ] && echo '--dry-run: nothing is built and no GPU code runs; the plan for the device' )"
  log "phases: ${ENABLED[*]}; budget ${BUDGET}s (sum of their caps: ${caps_sum}s); output: $OUT_DIR"
  if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.sm,clocks.max.sm \
      --format=csv,noheader 2>&1 | sed 's/^/  GPU: /'
  else
    echo "  GPU: no nvidia-smi here"
  fi
  PYBIND="" PYINC="" TORCH_PREFIX="" PYTEST_TIMEOUT="" PYTEST_XDIST=""
  find_python || die "no Python with a CUDA build of torch that sees a GPU (tried \$PYTHON, .venv/bin/python, python3; set PYTHON=...)"
  PATH="$(dirname "$(command -v "$PY")"):$PATH"; export PATH
  log "python: $PY_INFO"
  # Everything else the build needs from this Python, in one interpreter start (torch imports take seconds).
  local torch_cuda torch_ver cap key val
  while IFS='=' read -r key val; do
    case "$key" in
      torch_ver) torch_ver=$val ;; torch_cuda) torch_cuda=$val ;; prefix) TORCH_PREFIX=$val ;; pyinc) PYINC=$val ;;
      pybind) PYBIND=$val ;; cap) cap=$val ;; pytest_timeout) PYTEST_TIMEOUT=$val ;;
      pytest_xdist) PYTEST_XDIST=$val ;;
    esac
  done < <(timeout 60 "$PY" -c 'import importlib.util as u, sysconfig, torch, torch.utils
print("torch_ver=" + torch.__version__.split("+")[0])
print("torch_cuda=" + (torch.version.cuda or ""))
print("prefix=" + torch.utils.cmake_prefix_path)
print("pyinc=" + sysconfig.get_paths()["include"])
if u.find_spec("pybind11"):
    import pybind11
    print("pybind=" + pybind11.get_cmake_dir())
if torch.cuda.is_available():
    print("cap=%d%d" % torch.cuda.get_device_capability())
print("pytest_timeout=" + ("--timeout=120" if u.find_spec("pytest_timeout") else ""))
print("pytest_xdist=" + ("-n 8 --dist load --max-worker-restart 100" if u.find_spec("xdist") else ""))' 2>/dev/null)
  case "$torch_ver" in 2.1[1-9]*|2.[2-9][0-9]*|[3-9].*) ;; *) log "warning: torch $torch_ver is older than the oldest supported release, 2.11" ;; esac
  echo "  torch CMake prefix: $TORCH_PREFIX (cmake/OarTorch.cmake derives the include and lib folders from it)"

  NVCC=""
  if [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; else NVCC=$(command -v nvcc || true); fi
  if [ -z "$NVCC" ]; then
    [ "$DRY" = 1 ] && echo "  nvcc: not found here (the device has 13.0)" || die "nvcc not found (PATH, /usr/local/cuda/bin)"
  else
    NVCC_VER=$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
    echo "  nvcc: $NVCC ($NVCC_VER)"
    if [ -n "$torch_cuda" ] && [ "${NVCC_VER%%.*}" != "${torch_cuda%%.*}" ]; then
      if [ "${OAR_GPU_ALLOW_CUDA_MISMATCH:-0}" = 1 ] || [ "$DRY" = 1 ]; then
        log "warning: nvcc is CUDA $NVCC_VER but torch was built with CUDA $torch_cuda"
      else
        die "nvcc is CUDA $NVCC_VER but torch was built with CUDA $torch_cuda: the kernels would link another CUDA runtime than torch's (OAR_GPU_ALLOW_CUDA_MISMATCH=1 to try anyway)"
      fi
    fi
  fi
  [ -n "${TORCH_PREFIX:-}" ] || die "$PY could not report torch's CMake prefix (torch.utils.cmake_prefix_path)"
  CMAKE=$(command -v cmake || true)
  [ -n "$CMAKE" ] || die "cmake not found (the device image has it in its Python environment)"
  echo "  cmake: $CMAKE ($("$CMAKE" --version | head -1 | awk '{print $3}'))"
  GEN=(); if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); echo "  ninja: $(command -v ninja)"; else echo "  ninja: not found (Unix Makefiles)"; fi
  if [ -f "$BUILD_DIR/CMakeCache.txt" ] && [ ${#GEN[@]} -gt 0 ] && ! grep -q "^CMAKE_GENERATOR:INTERNAL=Ninja" "$BUILD_DIR/CMakeCache.txt"; then GEN=(); fi
  [ -n "${PYBIND:-}" ] || die "pybind11 is not importable by $PY (pip wheel pybind11; the device image has it)"
  echo "  pybind11: $PYBIND"
  if [ -f "$PYINC/Python.h" ]; then echo "  Python.h: $PYINC"; else
    [ "$DRY" = 1 ] && echo "  Python.h: missing in $PYINC" || die "no Python.h in $PYINC: the pybind11 module cannot be built with $PY"; fi
  if [ -n "${OAR_CUDA_ARCHITECTURES:-}" ]; then ARCH=$OAR_CUDA_ARCHITECTURES
  else
    ARCH=$(timeout 20 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    [ -n "$ARCH" ] || ARCH=${cap:-}
    [ -n "$ARCH" ] || ARCH=90
  fi
  if [ -z "${OAR_CUDA_ARCHITECTURES:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "  CUDA architecture: sm_$ARCH (no GPU here: the H200's)"
  else
    echo "  CUDA architecture: sm_$ARCH"
  fi
  PYTEST_FILES=()
  local f
  for f in tests/python/*/test_*.py; do grep -q "^from _devices import" "$f" && PYTEST_FILES+=("$f"); done
}

# Each CMake package the build needs: its config file under the unpacked packages or the system.
check_cxx_deps() {  # $1: prefix of the unpacked packages (may not exist); prints one line each; 1 if one is missing
  local missing=0 name pat hit
  for name in Eigen3:Eigen3Config.cmake spdlog:spdlogConfig.cmake fmt:fmt-config.cmake nlohmann_json:nlohmann_jsonConfig.cmake; do
    pat=${name#*:}
    hit=$( { find "$1/usr" -name "$pat"; find /usr/share /usr/lib /usr/local -maxdepth 5 -name "$pat"; } 2>/dev/null | head -1)
    if [ -n "$hit" ]; then echo "  ${name%%:*}: $hit"; else echo "  ${name%%:*}: NOT FOUND"; missing=1; fi
  done
  return $missing
}

# ---- the commands of the phases --------------------------------------------------------------------------------
make_commands() {
  local cudaflags="-Xptxas=-v"
  CMD_DEPS="rm -rf $DEPS_PREFIX && mkdir -p $DEPS_PREFIX && for f in $(q "$DEBS")/*.deb; do dpkg-deb -x \"\$f\" $DEPS_PREFIX || exit 1; done && ls $(q "$DEBS")"
  CMD_CONFIGURE="cmake -S $(q "$ROOT") -B $(q "$BUILD_DIR") ${GEN[*]} -DCMAKE_BUILD_TYPE=Release -DOAR_WITH_CUDA=ON"
  CMD_CONFIGURE+=" -DCMAKE_CUDA_COMPILER=$(q "${NVCC:-nvcc}") -DCMAKE_CUDA_ARCHITECTURES=$ARCH -DOAR_CUDA_ARCHITECTURES=$ARCH"
  CMD_CONFIGURE+=" -DCMAKE_CUDA_FLAGS=$cudaflags -DCMAKE_CXX_COMPILER_LAUNCHER= -DCMAKE_CUDA_COMPILER_LAUNCHER="
  CMD_CONFIGURE+=" -DOAR_BUILD_PYTHON=ON -DOAR_BUILD_TESTS=OFF -DOAR_BUILD_BENCHMARKS=OFF"
  CMD_CONFIGURE+=" -DPython_EXECUTABLE=$(q "$PY") -DOAR_PYTHON_EXECUTABLE=$(q "$PY") -Dpybind11_DIR=$(q "$PYBIND")"
  CMD_CONFIGURE+=" -DCMAKE_PREFIX_PATH=$DEPS_PREFIX/usr"
  CMD_BUILD="cmake --build $(q "$BUILD_DIR") -j $JOBS --target oar_core oar_torch _C 2>&1 | tee $BUILD_LOG"
  CMD_BUILD+=" | { grep -v -E '^ptxas info|bytes stack frame' || true; }"
  CMD_IMPORT="$(q "$PY") -c $(q 'import json, torch, oar
from oar import ops
info = oar.build_info()
print(json.dumps({k: str(v) for k, v in info.items()}))
if not oar.has_cuda_kernels():
    raise SystemExit("this oar build has no CUDA kernels")
a = ops.group_advantages(torch.tensor([0.0, 1.0, 1.0, 1.0], device="cuda"), group_size=2)
torch.cuda.synchronize()
print("one op on", torch.cuda.get_device_name(), "->", a.tolist())')"
  # 8 workers on the device's 16 cores: 2 CPU threads each (16 each oversubscribed the cores 8x, and the window
  # engine's float64 CPU reference then passed pytest-timeout's 120 s on the first H200 run of the flex tests)
  threads=""
  [ -n "$PYTEST_XDIST" ] && [ -z "${OAR_GPU_PYTEST_ARGS+x}" ] && threads="OMP_NUM_THREADS=2 "
  CMD_PYTEST="${threads}$(q "$PY") -m pytest -p no:cacheprovider -m cuda -v -rfEs --tb=short --durations=15 $PYTEST_TIMEOUT ${OAR_GPU_PYTEST_ARGS-$PYTEST_XDIST} ${PYTEST_FILES[*]}"
  CMD_BENCH="$(q "$PY") benchmarks/gpu/bench_cuda.py --out $(q "$OUT_DIR") ${BENCH_ARGS:-}"
  CMD_STEP="if [ -n \"\$($(q "$PY") -c 'from oar.app._extras import missing; print(*missing(\"train\"))')\" ] && ls $(q "$WHEELS")/*.whl >/dev/null 2>&1; then"
  CMD_STEP+=" $(q "$PY") -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE $(q "$WHEELS")/*.whl || exit 1;"
  CMD_STEP+=" export PYTHONPATH=\$PYTHONPATH:$SITE; fi;"
  CMD_STEP+=" m=\$($(q "$PY") -c 'from oar.app._extras import missing; print(*missing(\"train\"))');"
  CMD_STEP+=" [ -z \"\$m\" ] || { echo \"the step benchmark needs oar[train]; missing: \$m (carry .gpu-wheels: prepare_carry.sh)\"; exit 1; };"
  CMD_STEP+=" $(q "$PY") benchmarks/python/bench_step.py --device cuda --out $(q "$OUT_DIR/step") $STEP_ARGS"
}

# ---- dry run: the plan and the checks that need no GPU --------------------------------------------------------------
dry_run() {
  local ok=0 tmp travel tree_bytes b d n files
  tmp=$(mktemp -d /tmp/oar-gpu-dry.XXXXXX)
  echo
  log "C++ dependencies (phase deps): $DEBS"
  if compgen -G "$DEBS/*.deb" >/dev/null; then
    ls "$DEBS" | sed 's/^/  carried: /'
    for f in "$DEBS"/*.deb; do dpkg-deb -x "$f" "$tmp/deps" || ok=1; done
    echo "  unpacked here into $tmp/deps; the CMake packages found there (the device has none in /usr):"
    ( check_cxx_deps_only "$tmp/deps" ) || { ok=1; echo "  -> a package is missing from $DEBS: run benchmarks/gpu/prepare_carry.sh"; }
  else
    echo "  NONE: run benchmarks/gpu/prepare_carry.sh (the device image has no Eigen, spdlog, fmt, nlohmann-json)"; ok=1
  fi
  echo
  log "wheels (phase step only): $WHEELS"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then ls "$WHEELS" | sed 's/^/  carried: /'
  else echo "  none$( [ "$DO_STEP" = 1 ] && echo ': --step needs them (prepare_carry.sh)' || echo ' (not needed without --step)')"; fi
  echo "  the device image lacks trl, datasets, gguf, math-verify of the train extra (its package list, 2026-11-17)"

  echo
  log "what travels to the device (limit 64 MiB): tracked + untracked-not-ignored files, plus the carried folders"
  carry=("$(basename "$DEBS")"); [ "$DO_STEP" = 1 ] && carry+=("$(basename "$WHEELS")")
  if command -v git >/dev/null 2>&1 && git rev-parse --git-dir >/dev/null 2>&1; then
    tree_bytes=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    n=$(git ls-files -co --exclude-standard | wc -l)
    printf '  %-28s %8.1f MiB (%d files)\n' "working tree" "$(mib "$tree_bytes")" "$n"
    travel=$tree_bytes
    for d in "${carry[@]}"; do
      b=$(du -sb "$ROOT/$d" 2>/dev/null | cut -f1); b=${b:-0}; travel=$((travel + b))
      printf '  %-28s %8.1f MiB\n' "carry $d" "$(mib "$b")"
    done
    printf '  %-28s %8.1f MiB of 64 MiB\n' "total" "$(mib "$travel")"
    [ "$travel" -lt "$TRAVEL_LIMIT" ] || { echo "  -> over the limit"; ok=1; }
    for d in "$(basename "$BUILD_DIR")" .venv build; do
      [ -L "$ROOT/$d" ] && echo "  note: $d is a symbolic link: it would arrive dangling (the run does not use it)"
    done
  else
    echo "  (no git here: sizes not measured)"
  fi

  echo
  files="gpu_checks.log summary.txt bench_cuda.csv bench_cuda.md bench_cuda_env.json"
  [ "$DO_BENCH" = 1 ] || files="gpu_checks.log summary.txt"
  [ "$DO_STEP" = 1 ] && files+=" step.md step.csv step.json"
  n=$(echo "$files" | wc -w)
  log "files back in \$OUT: $files ($n of at most 8)"
  [ "$n" -le 8 ] || ok=1

  echo
  log "phases, in order (limit of each = budget left - caps of the phases after it; caps sum to ${caps_sum}s):"
  local p cmd
  for p in "${ENABLED[@]}"; do
    case "$p" in
      preflight) cmd="(the checks above: python + torch, nvcc, cmake, ninja, pybind11, Python.h, nvidia-smi)" ;;
      deps) cmd=$CMD_DEPS ;; configure) cmd=$CMD_CONFIGURE ;; build) cmd=$CMD_BUILD ;; import) cmd=$CMD_IMPORT ;;
      pytest) cmd=$CMD_PYTEST ;; bench) cmd=$CMD_BENCH ;; step) cmd=$CMD_STEP ;;
    esac
    printf '  %-9s cap %3ss  %s\n' "$p" "${CAP[$p]}" "$(echo "$cmd" | head -1)$( [ "$(echo "$cmd" | wc -l)" -gt 1 ] && echo ' ...')"
  done
  echo "  environment of the phases: OAR_BUILD_DIR=$BUILD_DIR PYTHONPATH=$ROOT/python PYTHONUNBUFFERED=1"
  echo "    LD_LIBRARY_PATH=$DEPS_PREFIX/usr/lib/x86_64-linux-gnu:... PATH=<the python's bin>:... CCACHE_DISABLE=1"
  local tool_timeout=$(( (BUDGET + 60 + 9) / 10 * 10 ))
  [ "$tool_timeout" -le "$TOOL_LIMIT_S" ] || tool_timeout=$TOOL_LIMIT_S
  if [ "$BUDGET" -gt $((TOOL_LIMIT_S - 30)) ]; then
    echo "  -> budget ${BUDGET}s does not fit one device call (${TOOL_LIMIT_S}s): drop a phase (--no-tests) or set OAR_GPU_BUDGET_S"; ok=1
  fi
  echo
  local args=""
  [ "$DO_STEP" = 1 ] && args+=" --step"; [ "$DO_TESTS" = 0 ] && args+=" --no-tests"; [ "$DO_BENCH" = 0 ] && args+=" --no-bench"
  log "the device call (docs/gpu.md):"
  printf '  command: "benchmarks/gpu/run_gpu_checks.sh%s"\n  carry: [%s]\n  timeout_s: %s   (budget %ss + %ss for the call to end on its own)\n' \
    "$args" "$(printf '"%s", ' "${carry[@]}" | sed 's/, $//')" "$tool_timeout" "$BUDGET" "$((tool_timeout - BUDGET))"
  echo "  device time: machine start (a minute or more) + at most ${tool_timeout}s, of the session's 15 minutes"

  echo
  log "checks here (no GPU):"
  if bash -n "$0" && bash -n benchmarks/gpu/fetch_debs.sh && bash -n benchmarks/gpu/prepare_carry.sh; then echo "  shell syntax: ok"; else ok=1; fi
  if (cd "$tmp" && "$PY" -c 'import oar' >/dev/null 2>&1); then
    if OUT=$tmp OMP_NUM_THREADS=1 timeout 300 "$PY" benchmarks/gpu/bench_cuda.py --dry-run --out "$tmp/bench" > "$tmp/bench.log" 2>&1; then
      echo "  bench_cuda.py --dry-run (CPU, tiny sizes): ok, $(($(grep -c . "$tmp/bench/bench_cuda.csv") - 1)) rows"
    else echo "  bench_cuda.py --dry-run FAILED:"; tail -n 20 "$tmp/bench.log"; ok=1; fi
    n=$(timeout 300 "$PY" -m pytest -p no:cacheprovider --collect-only -q -m cuda "${PYTEST_FILES[@]}" 2>&1 | tail -1)
    echo "  pytest --collect-only -m cuda (${#PYTEST_FILES[@]} files): $n"
  else
    echo "  oar is not importable by $PY here (no build): bench_cuda.py --dry-run and the test count skipped"
  fi
  if [ "${OAR_GPU_DRY_CONFIGURE:-0}" = 1 ] && [ -d "$tmp/deps" ]; then
    echo "  CMake configure against the unpacked packages only (/usr ignored as a prefix), into $tmp/build:"
    local dcmd=${CMD_CONFIGURE//$DEPS_PREFIX/$tmp\/deps}
    dcmd=${dcmd//$(q "$BUILD_DIR")/$tmp/build}
    if timeout 300 bash -c "$dcmd -DCMAKE_IGNORE_PREFIX_PATH=/usr" > "$tmp/configure.log" 2>&1; then
      echo "  configure: ok"; grep -E "oar: (torch|CUDA)" "$tmp/configure.log" | sed 's/^/    /'
      grep -E "^(Eigen3|spdlog|fmt|nlohmann_json)_DIR" "$tmp/build/CMakeCache.txt" | sed "s|$tmp|<tmp>|; s/^/    /"
    else echo "  configure FAILED:"; tail -n 30 "$tmp/configure.log"; ok=1; fi
  fi
  rm -rf "$tmp"
  echo
  log "dry run $( [ "$ok" = 0 ] && echo ok || echo 'found problems (above)' )"
  return $ok
}
check_cxx_deps_only() {  # the unpacked packages alone, not the system's
  local missing=0 name pat hit
  for name in Eigen3:Eigen3Config.cmake spdlog:spdlogConfig.cmake fmt:fmt-config.cmake nlohmann_json:nlohmann_jsonConfig.cmake; do
    pat=${name#*:}
    hit=$(find "$1/usr" -name "$pat" 2>/dev/null | head -1)
    if [ -n "$hit" ]; then echo "    ${name%%:*}: ${hit#$1/}"; else echo "    ${name%%:*}: NOT FOUND"; missing=1; fi
  done
  return $missing
}

# ---- the run ----------------------------------------------------------------------------------------------------
main() {
  preflight
  make_commands
  if [ "$DRY" = 1 ]; then dry_run; return $?; fi
  record preflight ok "$(( $(date +%s) - T0 ))" "$PY_INFO; sm_$ARCH"

  export OAR_BUILD_DIR=$BUILD_DIR PYTHONUNBUFFERED=1 CCACHE_DISABLE=1
  export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
  export LD_LIBRARY_PATH="$DEPS_PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

  if compgen -G "$DEBS/*.deb" >/dev/null; then
    run_phase deps "$CMD_DEPS" || { log "unpacking the carried packages failed"; return 1; }
  else
    log "phase deps: no packages in $DEBS: using the system's"; record deps skipped 0 "no $DEBS"
  fi
  check_cxx_deps "$DEPS_PREFIX" || die "C++ dependencies missing: run benchmarks/gpu/prepare_carry.sh where apt works and carry .gpu-debs"

  run_phase configure "$CMD_CONFIGURE" || { log "configure failed: the CMake output is above"; return 1; }
  run_phase build "$CMD_BUILD" || { log "build failed: the errors are above (full log: $BUILD_LOG)"; return 1; }
  if grep -q "^ptxas info" "$BUILD_LOG" 2>/dev/null; then
    log "ptxas (sm_$ARCH): registers, spill stores/loads (bytes), static shared memory (bytes) per kernel"
    ptxas_table "$BUILD_LOG" | grep -E "kernel$|dist_reduce|dist_grad|row_kernel|group_kernel|joint_reduce" | sed 's/^/  /'
  fi
  run_phase import "$CMD_IMPORT" || { log "oar does not load or its CUDA kernels do not run"; return 1; }
  [ "$DO_TESTS" = 1 ] && run_phase pytest "$CMD_PYTEST"
  [ "$DO_BENCH" = 1 ] && run_phase bench "$CMD_BENCH"
  [ "$DO_STEP" = 1 ] && run_phase step "$CMD_STEP"
  return $FAIL
}

if [ "$DRY" = 1 ]; then
  main
  exit $?
fi
mkdir -p "$OUT_DIR"
main 2>&1 | tee "$OUT_DIR/gpu_checks.log"
rc=${PIPESTATUS[0]}
{
  log "summary (exit status $rc; budget ${BUDGET}s, used $(( $(date +%s) - T0 ))s):"
  [ -f "$OUT_DIR/summary.txt" ] && sed 's/^/  /' "$OUT_DIR/summary.txt"
} 2>&1 | tee -a "$OUT_DIR/gpu_checks.log"
exit "$rc"
