#!/usr/bin/env bash
# Prepared GPU session of issues 23 and 41 (OAR at scale): phases in priority order within one time budget, so that
# a call returns what matters most first, and a phase stopped at its cap still returns what it measured.
#   build     cap 120 s cold, 60 s warm. Cold: run_gpu_checks.sh --build-only (preflight, carried C++ packages,
#             CMake, the three targets, import; measured 45-60 s on the H200). Warm (build-gpu/CMakeCache.txt and
#             the unpacked packages in /tmp/oar-gpu-deps of an earlier call on the same machine): an incremental
#             `cmake --build` of the three targets and the import check.
#   time1.5b  cap 150 s: benchmarks/python/bench_scale.py time, a random-weight Qwen2.5-1.5B-shaped model in bf16,
#             one row of L = 4096 reasoning tokens (units of 25 tokens, W = 8), settings
#             `dense grpo oar_g window_probe window window_linear`: seconds, first-call seconds, peak GiB, engine
#             efficiency E (window_linear, the linearized tail, last: never run on a GPU; a capped run keeps the rows
#             measured before it).
#   time7b    cap 270 s: the same on Qwen2.5-7B's shape (bf16 weights 15 GB, built on the device in bf16; the GRPO
#             proxy's forward + backward needs about 57 GiB on paper, inside an H100's 78 GiB; not yet run).
#   tests     cap 120 s: the CUDA tests of tests/python/attribution/test_shared_prefix_flex.py (FlexAttention engines
#             against the float64 CPU references).
#   ab        cap  90 s: time1.5b's flex settings (`window_probe window`) with --no-full-blocks (the A/B of the
#             full-block lists; the baseline is time1.5b's rows on the same machine).
#   profile   cap  90 s: bench_scale.py --profile on `oar_g window_probe`: the top kernels by device time.
# (bench_scale.py always adds its reference rows, dense_forward and grpo_update_proxy, and rewrites its table after
# every call, so a stopped run leaves the rows of what ran.)
# Rules: the phases run in this order; a phase starts only when the budget left (SCALE_BUDGET_S, default 540) is at
# least its cap, else it is SKIPPED and the log says so. Each runs under `timeout -s INT -k 15 <cap>`: Python stops
# with a KeyboardInterrupt traceback, pytest prints its interrupted summary (-rfEs, --durations), and
# bench_scale.py has already written the rows of what ran; 15 s later a phase still running is
# killed. The budget is thus overrun by at most those 15 s: call with timeout_s >= budget + 40 (590 by default).
# A failed build skips the rest. Every phase's full output is appended, as it is printed, to $OUT/phases.log.
# Files in $OUT (default ./gpu_results), at most 8: scale.log (the plan, each phase's start and result, the tables,
# the tail of a failed or stopped phase, one summary line per phase at the end: ok / FAILED rc=N / STOPPED at cap /
# SKIPPED), phases.log, time_qwen2.5-1.5b_L4096_cuda.{md,csv}, time_qwen2.5-7b_L4096_cuda.{md,csv},
# time_qwen2.5-1.5b_L4096_cuda_no_full_blocks.md, profiles.txt. Exit status: 0 when every phase that ran passed
# (skipped phases are named in the summary with the call that runs them), 1 otherwise, 2 bad arguments.
#
# Usage: benchmarks/gpu/run_scale.sh [--dry-run]
#   --dry-run  print the plan (phases, caps, their running sum against the budget, the commands, the files, the
#              device call) and run nothing.
# Knobs: SCALE_BUDGET_S (540), SCALE_PHASES (a subset in any order, run in the order above; build is always
#        first), SCALE_CAPS ("time7b=300 tests=90": caps replaced), SCALE_LENGTH (4096), SCALE_SETTINGS (the time
#        phases' settings), SCALE_AB_SETTINGS, SCALE_PROFILE_SETTINGS, PY (the interpreter with a CUDA torch;
#        default the one the build found), OAR_GPU_BUILD_DIR (build-gpu), OAR_JOBS (16).
# Replaces SCALE_PROFILE=1 / SCALE_NO_FULL_BLOCKS=1 / SCALE_SHAPE / SCALE_TIMEOUT_S of the earlier single-run script.

ALL_PHASES=(build time1.5b time7b tests ab profile)
declare -A CAP=([build]=120 [time1.5b]=150 [time7b]=270 [tests]=120 [ab]=90 [profile]=90)
# Expected seconds on the H200: build from the first runs (45-60 s), time1.5b from the 7-setting run's rows (window 12.5 +
# 17.0 s, window_probe 3.2 + 3.3 s, the rest < 2 s) + import and model build; time7b estimated (never run): those rows
# x 3-4.6 (attention x 2.3, the rest x 4.6) + about 20 s to build 7B's weights on the device.
declare -A EXPECT=([build]=60 [time1.5b]=60 [time7b]=220 [tests]=60 [ab]=45 [profile]=60)
WARM_BUILD_CAP=60 WARM_BUILD_EXPECT=15
KILL_AFTER=15

log() {  # to stdout and scale.log
  local m
  m=$(printf '[scale %4ds] %s' "$(( $(date +%s) - T0 ))" "$*")
  echo "$m"
  [ -n "${LOG:-}" ] && echo "$m" >> "$LOG"
  return 0
}
emit() { if [ -n "${LOG:-}" ]; then tee -a "$LOG"; else cat; fi; }  # stdin to stdout and scale.log
say() { sed 's/^/  /' | emit; }  # the same, indented

# run_capped NAME CAP COMMAND...: runs COMMAND under `timeout -s INT -k $KILL_AFTER CAP`, its output (stdout and
# stderr) appended as it is printed to $FULL_LOG under a header line. Returns the command's status (124: stopped at
# the cap by SIGINT; 137: killed $KILL_AFTER s later). PHASE_OFFSET: where this phase's output starts in $FULL_LOG.
run_capped() {
  local name=$1 cap=$2 rc
  shift 2
  printf '\n==== [%s] cap %ss (timeout -s INT -k %s): %s\n' "$name" "$cap" "$KILL_AFTER" "$*" >> "$FULL_LOG"
  PHASE_OFFSET=$(stat -c %s "$FULL_LOG")
  timeout -s INT -k "$KILL_AFTER" "$cap" "$@" >> "$FULL_LOG" 2>&1
  rc=$?
  printf '==== [%s] exit status %s\n' "$name" "$rc" >> "$FULL_LOG"
  return "$rc"
}
phase_output() { tail -c "+$(( ${PHASE_OFFSET:-0} + 1 ))" "$FULL_LOG"; }

# pytest_capped NAME CAP PYTEST-ARGS...: pytest under run_capped, with one line per test (-v, so the test that was
# running when the cap came is named), the failures' short tracebacks, the skip reasons (-rfEs) and the slowest
# tests (--durations=15). On the cap's SIGINT pytest prints "!!! KeyboardInterrupt !!!", the file:line it was at,
# and the summary of what ran so far.
pytest_capped() {
  local name=$1 cap=$2
  shift 2
  run_capped "$name" "$cap" "$PY" -m pytest -p no:cacheprovider -v -rfEs --tb=short --durations=15 "$@"
}

# Sourced (tests/python/project/test_gpu_scripts.py): the functions above only.
[[ "${BASH_SOURCE[0]}" != "$0" ]] && return 0

set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
DRY=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,/^$/p' "$0"; exit 0 ;;
    *) echo "run_scale.sh: unknown argument '$a' (see --help)" >&2; exit 2 ;;
  esac
done

T0=$(date +%s)
BUDGET=${SCALE_BUDGET_S:-540}
LENGTH=${SCALE_LENGTH:-4096}
SETTINGS=${SCALE_SETTINGS:-dense grpo oar_g window_probe window window_linear}
AB_SETTINGS=${SCALE_AB_SETTINGS:-window_probe window}
PROFILE_SETTINGS=${SCALE_PROFILE_SETTINGS:-oar_g window_probe}
BUILD_DIR=${OAR_GPU_BUILD_DIR:-$ROOT/build-gpu}
DEPS_PREFIX=${SCALE_DEPS_PREFIX:-/tmp/oar-gpu-deps}   # where run_gpu_checks.sh unpacks .gpu-debs (tests change it)
SCRATCH=${SCALE_SCRATCH:-/tmp/oar-scale}   # outputs that are not returned as they are (tests change it)
JOBS=${OAR_JOBS:-16}
OUT_DIR=${OUT:-$ROOT/gpu_results}
TOOL_LIMIT_S=600
TOOL_TIMEOUT=$(( BUDGET + 50 ))
[ "$TOOL_TIMEOUT" -le "$TOOL_LIMIT_S" ] || TOOL_TIMEOUT=$TOOL_LIMIT_S

# Warm: this machine built oar in an earlier call (the ignored build-gpu/ and /tmp stay while it is warm).
cache_var() { sed -n "s/^$1:[A-Z]*=//p" "$BUILD_DIR/CMakeCache.txt" 2>/dev/null | head -1; }
WARM=0 CMAKE_BIN="" CACHE_PY=""
if [ -f "$BUILD_DIR/CMakeCache.txt" ] && [ -d "$DEPS_PREFIX/usr" ]; then
  CMAKE_BIN=$(cache_var CMAKE_COMMAND); CACHE_PY=$(cache_var OAR_PYTHON_EXECUTABLE)
  CACHE_PY=$(command -v "$CACHE_PY" 2>/dev/null)
  if [ -x "$CMAKE_BIN" ] && [ -n "$CACHE_PY" ]; then WARM=1; fi
fi
[ "$WARM" = 1 ] && CAP[build]=$WARM_BUILD_CAP EXPECT[build]=$WARM_BUILD_EXPECT
for kv in ${SCALE_CAPS:-}; do
  k=${kv%%=*} v=${kv#*=}
  [ -n "${CAP[$k]:-}" ] && [[ "$v" =~ ^[0-9]+$ ]] || { echo "run_scale.sh: bad SCALE_CAPS entry '$kv'" >&2; exit 2; }
  CAP[$k]=$v
done

PHASES=()
for p in "${ALL_PHASES[@]}"; do
  if [ "$p" = build ] || [ -z "${SCALE_PHASES:-}" ] || [[ " $SCALE_PHASES " == *" $p "* ]]; then PHASES+=("$p"); fi
done
for p in ${SCALE_PHASES:-}; do
  [ -n "${CAP[$p]:-}" ] || { echo "run_scale.sh: unknown phase '$p' in SCALE_PHASES (${ALL_PHASES[*]})" >&2; exit 2; }
done

IMPORT_CHECK='import torch, oar
assert oar.has_cuda_kernels(), "this oar build has no CUDA kernels"
print("oar", oar.build_info().get("version", "?"), "with CUDA kernels; torch", torch.__version__, "on", torch.cuda.get_device_name())'
bench_args() {  # shape: the common arguments of bench_scale.py time
  echo "benchmarks/python/bench_scale.py time --shape $1 --length $LENGTH --device cuda --dtype bfloat16 --window 8 --unit-len 25"
}
describe() {  # phase: the command, as printed by the plan
  case "$1" in
    build) if [ "$WARM" = 1 ]; then echo "(warm) $CMAKE_BIN --build $BUILD_DIR -j $JOBS --target oar_core oar_torch _C; $CACHE_PY -c 'import oar ...'"
           else echo "(cold) OAR_GPU_BUDGET_S=255 OUT=$SCRATCH/build benchmarks/gpu/run_gpu_checks.sh --build-only"; fi ;;
    time1.5b) echo "\$PY $(bench_args qwen2.5-1.5b) --out \$OUT --settings $SETTINGS" ;;
    time7b) echo "\$PY $(bench_args qwen2.5-7b) --out \$OUT --settings $SETTINGS" ;;
    tests) echo "\$PY -m pytest -p no:cacheprovider -v -rfEs --tb=short --durations=15 -m cuda tests/python/attribution/test_shared_prefix_flex.py" ;;
    ab) echo "\$PY $(bench_args qwen2.5-1.5b) --out $SCRATCH/ab --settings $AB_SETTINGS --no-full-blocks (the .md copied to \$OUT)" ;;
    profile) echo "\$PY $(bench_args qwen2.5-1.5b) --out $SCRATCH/profile --settings $PROFILE_SETTINGS --profile (profile_*.txt -> \$OUT/profiles.txt)" ;;
  esac
}
OUT_FILES="scale.log phases.log time_qwen2.5-1.5b_L${LENGTH}_cuda.md time_qwen2.5-1.5b_L${LENGTH}_cuda.csv"
OUT_FILES+=" time_qwen2.5-7b_L${LENGTH}_cuda.md time_qwen2.5-7b_L${LENGTH}_cuda.csv"
OUT_FILES+=" time_qwen2.5-1.5b_L${LENGTH}_cuda_no_full_blocks.md profiles.txt"

plan() {
  local i=0 sum=0 p fit
  log "plan: budget ${BUDGET}s (SCALE_BUDGET_S); a phase starts only with its cap left; build: $( [ "$WARM" = 1 ] && echo "warm ($BUILD_DIR)" || echo "cold (no build of an earlier call here)")"
  printf '  %s %-9s %5s %5s %7s  %-7s %s\n' "#" phase cap sum expect fits command | emit
  for p in "${PHASES[@]}"; do
    i=$((i + 1)); sum=$((sum + CAP[$p]))
    if [ "$sum" -le "$BUDGET" ]; then fit=yes; else fit=if-left; fi
    printf '  %s %-9s %4ss %4ss %6ss  %-7s %s\n' "$i" "$p" "${CAP[$p]}" "$sum" "~${EXPECT[$p]}" "$fit" "$(describe "$p")" | emit
  done
  echo "  (fits: yes = within the budget even if every phase before it used its cap; if-left = runs when the phases before it leave its cap; expect: seconds on the H200, time7b estimated)" | emit
}

if [ "$DRY" = 1 ]; then
  echo "run_scale.sh --dry-run: nothing runs; the plan of the device call"
  plan
  echo "files back in \$OUT ($(echo "$OUT_FILES" | wc -w) of at most 8): $OUT_FILES"
  echo "device call: command \"benchmarks/gpu/run_scale.sh\", carry [\".gpu-debs\"], timeout_s $TOOL_TIMEOUT (budget ${BUDGET}s + the ${KILL_AFTER}s kill grace + the summary)"
  ok=0
  [ "$BUDGET" -le $((TOOL_LIMIT_S - KILL_AFTER - 25)) ] || { echo "  -> budget ${BUDGET}s does not fit one device call (${TOOL_LIMIT_S}s): lower SCALE_BUDGET_S"; ok=1; }
  [ "${CAP[build]}" -le "$BUDGET" ] || { echo "  -> the build's cap (${CAP[build]}s) exceeds the budget: nothing would run"; ok=1; }
  compgen -G "$ROOT/.gpu-debs/*.deb" >/dev/null || echo "  note: no .gpu-debs here: run benchmarks/gpu/prepare_carry.sh before a cold call"
  bash -n "$0" && bash -n benchmarks/gpu/run_gpu_checks.sh && echo "shell syntax: ok" || ok=1
  exit "$ok"
fi

mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/scale.log FULL_LOG=$OUT_DIR/phases.log
: > "$LOG"; : > "$FULL_LOG"
rm -rf "$SCRATCH"; mkdir -p "$SCRATCH"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" OAR_BUILD_DIR=$BUILD_DIR PYTHONUNBUFFERED=1 CCACHE_DISABLE=1
export LD_LIBRARY_PATH="$DEPS_PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log "run_scale.sh at $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $(timeout 20 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo 'no nvidia-smi')"
plan

SUMMARY=() STATUS=() FAIL=0 BUILD_OK=0
result() {  # phase status seconds note
  SUMMARY+=("$(printf '%-9s %-16s %4ss  cap %4ss  %s' "$1" "$2" "$3" "${CAP[$1]}" "$4")")
  [ "$2" = SKIPPED ] && STATUS+=("$1")
  return 0
}
rows_of() { [ -f "$1" ] && echo "$(( $(grep -c . "$1") - 1 )) rows in $(basename "$1")" || echo "no $(basename "$1")"; }

run_phase() {
  local p=$1 cap=${CAP[$1]} left t0 rc dt st note=""
  left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$p" != build ] && [ "$BUILD_OK" != 1 ]; then
    log "phase $p: SKIPPED (the build failed)"; result "$p" SKIPPED 0 "the build failed"; return
  fi
  if [ "$left" -lt "$cap" ]; then
    log "phase $p: SKIPPED: needs its cap ${cap}s, ${left}s of the budget left"; result "$p" SKIPPED 0 "needs ${cap}s, ${left}s left"; return
  fi
  log "phase $p: cap ${cap}s (${left}s of the ${BUDGET}s budget left): $(describe "$p")"
  t0=$(date +%s)
  case "$p" in
    build)
      if [ "$WARM" = 1 ]; then
        PY=${PY:-$CACHE_PY}
        run_capped build "$cap" bash -c "$(printf '%q' "$CMAKE_BIN") --build $(printf '%q' "$BUILD_DIR") -j $JOBS --target oar_core oar_torch _C && $(printf '%q' "$PY") -c $(printf '%q' "$IMPORT_CHECK")"
      else
        OAR_GPU_BUDGET_S=255 OUT=$SCRATCH/build run_capped build "$cap" benchmarks/gpu/run_gpu_checks.sh --build-only
      fi ;;
    time1.5b) run_capped "$p" "$cap" "$PY" $(bench_args qwen2.5-1.5b) --out "$OUT_DIR" --settings $SETTINGS ;;
    time7b) run_capped "$p" "$cap" "$PY" $(bench_args qwen2.5-7b) --out "$OUT_DIR" --settings $SETTINGS ;;
    tests) pytest_capped "$p" "$cap" -m cuda tests/python/attribution/test_shared_prefix_flex.py ;;
    ab) run_capped "$p" "$cap" "$PY" $(bench_args qwen2.5-1.5b) --out "$SCRATCH/ab" --settings $AB_SETTINGS --no-full-blocks ;;
    profile) run_capped "$p" "$cap" "$PY" $(bench_args qwen2.5-1.5b) --out "$SCRATCH/profile" --settings $PROFILE_SETTINGS --profile ;;
  esac
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  case "$rc" in
    0) st=ok ;;
    124|137) st="STOPPED at cap"; FAIL=1 ;;
    *) st="FAILED rc=$rc"; FAIL=1 ;;
  esac
  rm -f "$OUT_DIR"/*.tmp   # a table being renamed into place when the cap came (at most 8 files come back)
  # what the phase returns
  case "$p" in
    build)
      if [ "$rc" = 0 ]; then
        BUILD_OK=1
        [ -z "${PY:-}" ] && PY=$(grep -o 'python: [^ |]*' "$SCRATCH/build/gpu_checks.log" 2>/dev/null | head -1 | cut -d' ' -f2)
        PY=${PY:-python3}
        note="$( [ "$WARM" = 1 ] && echo warm || echo cold); python $PY"
        phase_output | grep -E "^oar |one op on|phase [a-z]+: (ok|rc=)" | say
      else
        phase_output | tail -n 30 | say
      fi ;;
    time1.5b|time7b|ab)
      local f
      case "$p" in
        time1.5b) f=$OUT_DIR/time_qwen2.5-1.5b_L${LENGTH}_cuda ;;
        time7b) f=$OUT_DIR/time_qwen2.5-7b_L${LENGTH}_cuda ;;
        ab) f=$SCRATCH/ab/time_qwen2.5-1.5b_L${LENGTH}_cuda_no_full_blocks
            [ -f "$f.md" ] && cp "$f.md" "$OUT_DIR/" ;;
      esac
      note=$(rows_of "$f.csv")
      if [ -f "$f.md" ]; then say < "$f.md"; else phase_output | grep '^{' | say; fi ;;
    tests) note=$(phase_output | grep -E '^=+ .*(passed|failed|error|skipped|no tests).* =+$' | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//') ;;
    profile)
      if compgen -G "$SCRATCH/profile/profile_*.txt" >/dev/null; then
        for f in "$SCRATCH"/profile/profile_*.txt; do printf '==== %s\n' "$(basename "$f")"; cat "$f"; echo; done > "$OUT_DIR/profiles.txt"
        note="$(ls "$SCRATCH"/profile/profile_*.txt | wc -l) profiles in profiles.txt"
      else note="no profile written"; fi ;;
  esac
  if [ "$rc" != 0 ] && [ "$p" != build ]; then
    log "phase $p: last lines of its output (all of it: phases.log)"
    phase_output | tail -n 25 | say
  fi
  log "phase $p: $st in ${dt}s${note:+ ($note)}"
  result "$p" "$st" "$dt" "$note"
}

for p in "${PHASES[@]}"; do run_phase "$p"; done

log "summary (budget ${BUDGET}s, used $(( $(date +%s) - T0 ))s; full output of each phase: phases.log):"
printf '%s\n' "${SUMMARY[@]}" | say
if [ "${#STATUS[@]}" -gt 0 ] && [ "$BUILD_OK" = 1 ]; then
  log "next call for the skipped phases (within 30 s, while the machine is warm: build ${WARM_BUILD_CAP}s): SCALE_PHASES=\"${STATUS[*]}\" SCALE_BUDGET_S=<device seconds left - 60> benchmarks/gpu/run_scale.sh, timeout_s = SCALE_BUDGET_S + 50"
fi
log "$( [ "$FAIL" = 0 ] && echo "OK: every phase that ran passed" || echo "FAILED or STOPPED: see the summary" )"
exit "$FAIL"
