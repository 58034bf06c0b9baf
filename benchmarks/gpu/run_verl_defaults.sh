#!/usr/bin/env bash
# Prepared GPU check of issue 24 (verl's defaults): OAR scores on verl 0.9.1's real actor worker with verl's own
# default engine settings, on one GPU: FSDP1 (actor.strategy=fsdp), bf16 mixed precision (fsdp_config.mixed_precision
# unset -> param_dtype bf16), attn_implementation=flash_attention_2, use_remove_padding=True,
# enable_gradient_checkpointing=True (tests/python/workers/verl_worker.py, variant "verl_defaults"), on a random-weight
# model of SmolLM2-135M's shape (576 hidden, 30 layers, 9 / 3 heads, 1536 MLP, 49152 vocab; built from a config with
# oar.testing.tiny_random_llama, nothing downloaded) with oar's 100-token minimal tokenizer.
# For $STEPS steps (default 3): verl's compute_log_prob, then OAR-G and OAR-P scores through verl's dispatch (3 of 8
# rows active). Prints the attribution time per step, the peak CUDA memory, the forward counts and compute dtype,
# and the parity check: verl's compute_advantage with grpo and with oar_grpo (oar, uniform credit) gives the same
# advantages. Not a whole verl training step (that needs vLLM/SGLang and a dataset).
#
# Time budget (on paper; never run on a GPU yet): preflight 20 s + model 30 s + verl run 180 s (Ray start ~10 s,
# init_model ~30 s, 3 steps of a 135M-shaped model well under 10 s each) + report 10 s = 240 s cap, under 5 minutes.
# It needs oar already built with CUDA in the same warm session (benchmarks/gpu/run_gpu_checks.sh --build-only,
# 255 s cap; --build runs it first: 495 s cap). docs/gpu.md, "verl's defaults".
#
# Needs, importable by $PY: verl 0.9.1 with ray, tensordict, omegaconf, codetiming, torchdata, peft
# (requirements/trainers*.txt) and flash_attn (the CUDA flash-attention 2 package). The device image has none of
# verl, ray, tensordict, omegaconf, flash_attn (docs/gpu.md): they must be carried as wheels, which may not fit the
# carry limit; the preflight stops with exit status 3 and names what is missing. ATTN=sdpa runs without flash_attn
# (and says so).
#
# Usage: benchmarks/gpu/run_verl_defaults.sh [--dry-run | --cpu | --build]
#   --dry-run  the plan and the exact commands, `bash -n` of this script, which imports $PY has; runs nothing
#   --cpu      the same flow on CPU (2 Ray ranks, the tiny test model, FSDP2 bf16 and remove-padding: what runs on
#              CPU; FSDP1 does not, tests/python/integrations/test_verl_defaults.py), to check the script and its
#              report here
#   --build    benchmarks/gpu/run_gpu_checks.sh --build-only first
# Knobs: PY, OUT (results in $OUT/verl_defaults, default ./gpu_results), STEPS (3), ATTN (flash_attention_2).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=gpu
case "${1:-}" in
  "") ;;
  --dry-run) MODE=dry ;;
  --cpu) MODE=cpu ;;
  --build) MODE=build ;;
  *) echo "usage: $0 [--dry-run | --cpu | --build]" >&2; exit 2 ;;
esac
OUT_DIR=${OUT:-$PWD/gpu_results}/verl_defaults
STEPS=${STEPS:-3}
ATTN=${ATTN:-flash_attention_2}
if [ -z "${PY:-}" ]; then
  if [ "$MODE" = cpu ] || [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[ "$MODE" = cpu ] || export OAR_BUILD_DIR=${OAR_BUILD_DIR:-$PWD/build-gpu}
if [ "$MODE" = cpu ]; then
  RUN=(tests/python/workers/verl_worker.py "$OUT_DIR" --variants fsdp2_bf16,remove_padding --device cpu --model tiny
       --ranks 2 --steps "$STEPS")
else
  RUN=(tests/python/workers/verl_worker.py "$OUT_DIR" --variants verl_defaults --device cuda --model "$OUT_DIR/model"
       --ranks 1 --steps "$STEPS" --attn "$ATTN")
fi
log() { echo "[verl-defaults] $*"; }

if [ "$MODE" = dry ]; then
  bash -n "$0" && log "bash -n: OK"
  log "plan: preflight (20 s) -> model (30 s) -> timeout 180 $PY ${RUN[*]} -> report (10 s); 240 s cap"
  log "device call: run(command='benchmarks/gpu/run_verl_defaults.sh --build', timeout_s=560) (495 s cap + 65 s)"
  for m in verl ray tensordict omegaconf flash_attn oar; do
    if "$PY" -c "import $m" >/dev/null 2>&1; then log "  $PY imports $m"; else log "  $PY lacks $m"; fi
  done
  exit 0
fi
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/verl_defaults.log
: > "$LOG"
if [ "$MODE" = build ]; then
  OAR_GPU_BUDGET_S=255 OUT=${OUT:-$PWD/gpu_results} benchmarks/gpu/run_gpu_checks.sh --build-only 2>&1 | tail -n 15
  [ "${PIPESTATUS[0]}" = 0 ] || { log "build failed" | tee -a "$LOG"; exit 1; }
fi

# preflight: every module the run imports, and CUDA
need="verl ray tensordict omegaconf codetiming torchdata peft oar"
[ "$MODE" != cpu ] && [ "$ATTN" = flash_attention_2 ] && need="$need flash_attn"
missing=$(timeout 20 "$PY" - $need <<'PYEOF'
import importlib, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PYEOF
)
[ -n "$missing" ] && { log "missing for $PY: $missing" | tee -a "$LOG"; exit 3; }
if [ "$MODE" != cpu ]; then
  timeout 20 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { log "$PY's torch sees no CUDA device" | tee -a "$LOG"; exit 3; }
  # the model: SmolLM2-135M's shape, random weights, oar's minimal tokenizer, saved for verl's HFModelConfig
  timeout 30 "$PY" - "$OUT_DIR/model" <<'PYEOF' 2>&1 | tee -a "$LOG"
import sys

from oar.testing import tiny_random_llama

model, tok = tiny_random_llama(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                               intermediate_size=1536, tokenizer="minimal", seed=0, initializer_range=0.02)
model.save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
print(f"[verl-defaults] model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters -> {sys.argv[1]}")
PYEOF
  [ "${PIPESTATUS[0]}" = 0 ] || { log "model build failed" | tee -a "$LOG"; exit 1; }
fi

CAP=180  # --cpu: 420 s (2 busy CPU cores; not part of the GPU budget)
[ "$MODE" = cpu ] && CAP=420
log "run (cap $CAP s): $PY ${RUN[*]}" | tee -a "$LOG"
timeout "$CAP" "$PY" "${RUN[@]}" >>"$LOG" 2>&1
rc=$?
[ "$rc" = 0 ] || { tail -n 30 "$LOG"; log "verl_worker.py failed (rc=$rc): $LOG"; exit 1; }

timeout 10 "$PY" - "$OUT_DIR/variants.pt" <<'PYEOF' 2>&1 | tee -a "$LOG"
import sys

import torch

r = torch.load(sys.argv[1], weights_only=False)
ok = True
par = r["parity"]
diff = float((par["grpo"] - par["oar_grpo"]).abs().max())
print(f"[verl-defaults] parity: max |grpo - oar_grpo| advantages = {diff} ({'same' if diff == 0 else 'DIFFERENT'})")
ok &= diff == 0
for name, v in r["variants"].items():
    if "error" in v:
        print(f"[verl-defaults] {name}: FAILED {v['error']['type']}: {v['error']['message'][-800:]}")
        ok = False
        continue
    t = v["times"]
    print(f"[verl-defaults] {name} {v['overrides']}: init_model {t['init_model']:.1f} s, compute_log_prob "
          f"{[round(x, 3) for x in t['compute_log_prob']]} s")
    for m, s in v["scores"].items():
        fw = [x["forwards"] for x in s["ranks"]]
        dt = sorted({d for x in s["ranks"] for d in x["lm_head_dtypes"]})
        good = bool(torch.isfinite(s["scores"]).all() and (s["scores"] >= 0).all() and s["reasoning_mask"].any()
                    and len(set(fw)) == 1 and all(x["no_grads"] for x in s["ranks"]))
        print(f"[verl-defaults]   {m}: attribution s/step {[round(x, 3) for x in t['oar_scores ' + m]]}, forwards "
              f"per rank {fw}, lm_head dtype {dt}, memory budget {s['memory_budget_mb']} MiB, ok={good}")
        ok &= good
    if "peak_memory_gib" in v:
        print(f"[verl-defaults]   peak CUDA memory per rank: {[round(x, 2) for x in v['peak_memory_gib']]} GiB")
print(f"[verl-defaults] versions: {r['versions']}")
print("[verl-defaults]", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
PYEOF
exit "${PIPESTATUS[0]}"
