#!/usr/bin/env bash
# Install test (issue 11, section 2): oar installs beside a trainer without moving the trainer's packages.
#
# In a fresh virtual environment that holds what a verl 0.9 user has (torch, transformers 5.10.4 since verl 0.9.1
# needs < 5.11, verl 0.9.1 installed as requirements/trainers*.txt install it), `pip install <oar wheel>` WITH
# its dependencies must leave every package as it was (pip freeze before/after: oar added, nothing changed,
# nothing removed); then `import oar` works, `import verl` leaves verl untouched and, with OAR_VERL_PLUGIN=1,
# registers the OAR advantage estimators through the verl.plugins entry point, and the modules of the `train` extra (absent here: no trl) fail with a message that
# names the extra.
#
# Usage: tests/install/verl_env.sh [WHEEL]
#   WHEEL   the oar wheel to install (default: $OAR_BUILD_DIR/dist/oar-*.whl, which ./setup.sh builds; no build here)
# Environment: OAR_VENV (venv whose base interpreter creates the test venv, default .venv), OAR_BUILD_DIR (build),
#   OAR_INSTALL_TEST_KEEP=1 keeps the temporary folder (printed) for inspection.
# About 4 CPU-minutes, most of it unpacking torch (pip's cache holds the wheels once setup.sh has run;
# transformers 5.10.4 comes from PyPI).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD_DIR=${OAR_BUILD_DIR:-$ROOT/build}
WHEEL=${1:-$(ls "$BUILD_DIR"/dist/oar-*.whl 2>/dev/null | head -1 || true)}
if [ -z "$WHEEL" ] || [ ! -f "$WHEEL" ]; then
  echo "[install-test] no oar wheel: run ./setup.sh (it leaves one in $BUILD_DIR/dist) or pass its path" >&2
  exit 2
fi
BASE_PY=${OAR_VENV:-$ROOT/.venv}/bin/python
[ -x "$BASE_PY" ] || BASE_PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/oar-install-test.XXXXXX")
# The venv takes about 6.3 GiB (torch's CUDA build and its nvidia-* wheels): refuse at once rather than halfway through pip.
NEED_KIB=$((8 * 1024 * 1024))
FREE_KIB=$(df -Pk "$WORK" | awk 'NR == 2 {print $4}')
if [ "$FREE_KIB" -lt "$NEED_KIB" ]; then
  rmdir "$WORK"
  echo "[install-test] $(dirname "$WORK") has $((FREE_KIB / 1024)) MiB free; the verl venv needs about 8 GiB" >&2
  exit 3
fi
if [ "${OAR_INSTALL_TEST_KEEP:-0}" = 1 ]; then echo "[install-test] keeping $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi
log() { echo "[install-test] $*"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1

# 1. The trainer's environment: a venv of the same interpreter as the wheel's.
"$BASE_PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
log "verl environment: $(grep -v '^#' requirements/verl-env.txt | xargs), verl (--no-deps) + requirements/trainers.txt"
"$VPY" -m pip install -q -r requirements/verl-env.txt
"$VPY" -m pip install -q --no-deps -c requirements/verl-env.txt $(grep -E '^verl==' requirements/trainers-nodeps.txt)
"$VPY" -m pip install -q -c requirements/verl-env.txt -r requirements/trainers.txt
"$VPY" -m pip freeze --all | sort > "$WORK/before.txt"

# 2. oar, its dependencies resolved by pip (no --no-deps: this is what a user runs).
log "pip install $(basename "$WHEEL")"
"$VPY" -m pip install -q "$WHEEL"
"$VPY" -m pip freeze --all | sort > "$WORK/after.txt"
log "pip freeze diff (before -> after):"
diff "$WORK/before.txt" "$WORK/after.txt" | sed 's/^/    /' || true

# 3. The checks (each failure names what differs).
"$VPY" - "$WORK/before.txt" "$WORK/after.txt" <<'PY'
import os
import re
import subprocess
import sys
import warnings


def freeze(path):
    out = {}
    for line in open(path):
        line = line.strip()
        m = re.match(r"([A-Za-z0-9_.\-]+)\s*(?:==\s*(\S+)|@\s*(\S+))", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2) or m.group(3)
    return out


before, after = freeze(sys.argv[1]), freeze(sys.argv[2])
changed = {k: (before[k], after[k]) for k in before if k in after and before[k] != after[k]}
removed = sorted(set(before) - set(after))
added = sorted(set(after) - set(before))
assert not changed and not removed, f"installing oar changed {changed} and removed {removed}"
assert added == ["oar"], f"installing oar added {added}, expected only oar (its runtime deps were already here)"
assert before["transformers"] == "5.10.4" and "trl" not in after, (before.get("transformers"), after.get("trl"))
print(f"[install-test] unchanged: torch {after['torch']}, transformers {after['transformers']}, trl absent; "
      f"added: oar {after['oar'][-60:]}")

import torch  # noqa: E402

# The plugin is opt-in: `import verl` alone leaves verl untouched ...
code = ("import sys, verl; from verl.trainer.ppo import core_algos, ray_trainer; "
        "assert 'oar.integrations.verl.plugin' in sys.modules; "
        "assert not sys.modules['oar.integrations.verl.plugin'].REGISTERED; "
        "assert not any(k.startswith('oar') for k in core_algos.ADV_ESTIMATOR_REGISTRY); "
        "assert not getattr(ray_trainer.compute_advantage, '__oar_wrapped__', False)")
env = {k: v for k, v in os.environ.items() if k != "OAR_VERL_PLUGIN"}
p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
assert p.returncode == 0, p.stderr[-3000:]
# ... and registers the estimators with OAR_VERL_PLUGIN=1 (set in Ray's runtime env by users).
os.environ["OAR_VERL_PLUGIN"] = "1"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")  # the verl plugin reports a failed registration as a RuntimeWarning
    import oar
    import verl  # noqa: F401  (imports the verl.plugins entry points: oar.integrations.verl.plugin)
    from verl.trainer.ppo import core_algos
# This venv holds verl without its TransferQueue package (not among verl's declared requirements), so the OAR v1
# trainers cannot register: the plugin must say so, once, and still register the estimators. Any other failure of
# the plugin ("oar verl plugin not loaded") fails the test.
said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "oar" in str(w.message)]
assert len(said) <= 1 and all("could not be registered" in s and "transfer_queue" in s for s in said), said

assert oar.__file__.startswith(sys.prefix), f"oar imported from {oar.__file__}, not the test venv"
assert oar.build_info()["torch_built_against"] == torch.__version__.split("+")[0]
assert sys.modules["oar.integrations.verl.plugin"].REGISTERED, "the verl plugin registered nothing"
for name in ("oar_g", "oar_p", "oar_grpo"):
    fn = core_algos.get_adv_estimator_fn(name)
    assert fn.__name__ == f"compute_{name}_advantage", (name, fn)
a = oar.ops.group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
assert abs(a[0].item() - 0.70710) < 1e-4 and a[2].item() == 0.0 and a[3].item() == 0.0, a
cfg = oar.OARConfig(method="oar_g", probe="answer_mean", q=0.25)
assert cfg.method == "oar_g" and cfg.reshape.q == 0.25

try:
    import oar.app.train  # noqa: F401
except ModuleNotFoundError as e:
    msg = str(e)
    assert msg.startswith("oar.app.train needs ") and "trl" in msg and msg.endswith('pip install "oar[train]"'), msg
else:
    raise AssertionError("import oar.app.train worked without trl")
p = subprocess.run([f"{sys.prefix}/bin/oar", "train"], capture_output=True, text=True)
assert p.returncode == 2 and p.stderr.startswith("oar: error: oar train needs "), (p.returncode, p.stderr)
p = subprocess.run([f"{sys.prefix}/bin/oar", "info"], capture_output=True, text=True)
assert p.returncode == 0 and '"torch_built_against"' in p.stdout, (p.returncode, p.stderr)
print("[install-test] import oar, verl estimators oar_g/oar_p/oar_grpo registered, oar.app.train and `oar train` "
      "name the train extra, `oar info` runs: OK")
PY
log "passed"
