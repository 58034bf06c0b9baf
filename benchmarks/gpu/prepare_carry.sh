#!/usr/bin/env bash
# Fills the ignored folders that the device call of benchmarks/gpu/run_gpu_checks.sh carries (docs/gpu.md), on a
# machine with network access (Debian/Ubuntu with apt, and pip):
#   .gpu-debs/    Debian packages of the C++ build dependencies (Eigen, spdlog + fmt, nlohmann-json), through
#                 fetch_debs.sh; needed by every run (the device image has none of them). About 2 MB.
#   .gpu-wheels/  wheels of the `train` extra's packages that the device image lacks (trl, datasets, gguf,
#                 math-verify at the versions of requirements/train.txt; pure Python, --no-deps). Needed only by
#                 --step: benchmarks/python/bench_step.py imports oar.app.eval_attribution, which checks that the whole
#                 extra is installed; the step's code path imports none of the four. About 2 MB.
# The device image's own packages (torch, transformers, pytest, hypothesis, numpy, pyyaml, pybind11, cmake, ninja,
# ...) are used as they are: its package list was read on 2026-11-17 (the device tool's KINDS.md).
# Both folders are ignored by git (.gitignore), so they travel only when the call names them in `carry`.
# Usage: benchmarks/gpu/prepare_carry.sh [--no-wheels]      (then: benchmarks/gpu/run_gpu_checks.sh --dry-run)
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=1
for a in "$@"; do
  case "$a" in
    --no-wheels) WHEELS=0 ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/!p}' "$0"; exit 0 ;;
    *) echo "prepare_carry.sh: unknown argument '$a' (see --help)" >&2; exit 2 ;;
  esac
done

# 1. Debian packages. apt-get update needs root; without it, the lists already on the machine are used.
if [ "$(id -u)" = 0 ]; then
  apt-get update -qq
else
  echo "prepare_carry.sh: not root, skipping apt-get update (the packages come from the lists already here)"
fi
benchmarks/gpu/fetch_debs.sh .gpu-debs >/dev/null
echo "[carry] .gpu-debs: $(ls .gpu-debs/*.deb | wc -l) packages"

# 2. Wheels for --step: the device runs Python 3.12 (x86-64); these are pure-Python wheels.
if [ "$WHEELS" = 1 ]; then
  rm -rf .gpu-wheels
  mkdir -p .gpu-wheels
  specs=()
  for name in trl datasets gguf math-verify; do
    spec=$(grep -iE "^${name}==" requirements/train.txt | sed 's/[[:space:]]*#.*//') \
      || { echo "prepare_carry.sh: $name is not pinned in requirements/train.txt" >&2; exit 1; }
    specs+=("$spec")
  done
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu-wheels "${specs[@]}"
  echo "[carry] .gpu-wheels: $(ls .gpu-wheels/*.whl | xargs -n1 basename | tr '\n' ' ')"
fi

dirs=(.gpu-debs)
[ "$WHEELS" = 1 ] && dirs+=(.gpu-wheels)
du -sh "${dirs[@]}" | sed 's/^/[carry] /'
echo "[carry] next: benchmarks/gpu/run_gpu_checks.sh --dry-run   (the plan, the sizes that travel, the device call)"
