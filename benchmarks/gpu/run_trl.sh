#!/usr/bin/env bash
# Prepared GPU check of issue 24 (TRL): OARGRPOTrainer with TRL's defaults, a few steps, on one H200.
#   accelerate launch (1 process) + FSDP2 (TrainingArguments fsdp="full_shard", fsdp_config version 2) on a
#   real-shaped random model: Qwen2.5-0.5B's layer shapes (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864)
#   as a Llama, random weights from the config, oar's 100-token minimal tokenizer (nothing is downloaded). TRL 1.13's
#   GRPOConfig defaults otherwise: loss_type "dapo", num_generations 8, per_device_train_batch_size 8,
#   max_completion_length 512, gradient_checkpointing on, beta 0, bf16 on the GPU, HF generate (no vLLM).
#   Run 1: method oar_g for $STEPS steps (default 3): attribution and generation seconds per step, peak GPU memory
#   of the attribution and of the whole run, OAR forwards. Run 2: method grpo for one step: TRL's compute_loss on
#   oar's (B, C) uniform advantages and on TRL's own (B,) advantages of the same batch (the parity check of
#   tests/python/integrations/test_trl.py::test_uniform_credit_is_trl_grpo, here under FSDP2 + bf16 on the GPU).
# Prints "[trl-gpu] OK" (exit 0) when every step finished with finite losses and the parity holds (difference
# <= 1e-6 of the loss with |advantages|: the loss itself nearly cancels), else "[trl-gpu] FAILED" (exit 1); exit 3
# when the environment lacks something (printed).
#
# Time budget on paper (one H200, device call timeout_s 300; the script stops itself at OAR_TRL_BUDGET_S = 270 s):
#   wheel install (only when trl / datasets are missing; .gpu-wheels)   <= 20 s
#   launch, imports (torch, transformers, trl, oar), model build        ~  25 s
#   run 1, per step: generate 8 x 512 tokens (24 layers, bf16)          ~  10 s
#                    OAR-G (clean pass + forward/backward per chunk)     ~   5 s
#                    TRL's loss + optimizer step                         ~   2 s    x 3 steps  ~ 50 s
#   run 2 (grpo, 1 step + 4 extra loss forwards)                        ~  15 s
#   total                                                              ~ 2 min (half the budget in reserve)
# Needs oar built with CUDA (benchmarks/gpu/run_gpu_checks.sh --build-only: its 255 s of caps + this script's 270 s
# fit one 600 s device call: `benchmarks/gpu/run_gpu_checks.sh --build-only && benchmarks/gpu/run_trl.sh`, carry
# [".gpu-debs", ".gpu-wheels"], timeout_s 600), trl + datasets (carried .gpu-wheels, prepare_carry.sh, installed
# here with --no-deps into /tmp/oar-gpu-site when missing) and accelerate (not carried by prepare_carry.sh: the
# script stops with exit 3 naming it when the device lacks it; OAR_TRL_WHEELS names another wheel folder).
#
# Usage: benchmarks/gpu/run_trl.sh [--cpu-check] [--dry-run]
#   --cpu-check  the same worker on the CPU (no accelerate launch, no FSDP, a 2-layer model, 1 step, 12 tokens):
#                checks the worker itself where there is no GPU (it prints the same lines).
#   --dry-run    prints the plan and the commands, checks the worker compiles; runs nothing.
# Knobs: PY (the interpreter; default: .venv/bin/python when its torch sees CUDA, else python3), STEPS (3),
#        OAR_TRL_MAX_COMPLETION (512), OAR_TRL_BUDGET_S (270), OAR_BUILD_DIR (build-gpu), OAR_TRL_WHEELS (.gpu-wheels).
# Results: $OUT/trl (default ./gpu_results/trl): trl.log, trl_gpu.json, trl_gpu_step.py (the worker, as run).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
MODE=gpu DRY=0
for a in "$@"; do
  case "$a" in
    --cpu-check) MODE=cpu ;;
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,/^set -uo/{/^set -uo/!p}' "$0"; exit 0 ;;
    *) echo "run_trl.sh: unknown argument '$a' (see --help)" >&2; exit 2 ;;
  esac
done
OUT_DIR=${OUT:-$ROOT/gpu_results}/trl
STEPS=${STEPS:-3}
BUDGET=${OAR_TRL_BUDGET_S:-270}
WHEELS=${OAR_TRL_WHEELS:-$ROOT/.gpu-wheels}
SITE=/tmp/oar-gpu-site
mkdir -p "$OUT_DIR"
if [ -z "${PY:-}" ]; then
  PY=python3
  if [ -x .venv/bin/python ] && { [ "$MODE" = cpu ] \
       || .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }; then
    PY=.venv/bin/python
  fi
fi
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" OAR_BUILD_DIR=${OAR_BUILD_DIR:-$ROOT/build-gpu}
export TOKENIZERS_PARALLELISM=false
WORKER=$OUT_DIR/trl_gpu_step.py

cat > "$WORKER" <<'PYEOF'
"""run_trl.sh's worker (written by benchmarks/gpu/run_trl.sh): argv = OUT_DIR DEVICE(cuda|cpu) STEPS MAX_COMPLETION."""
import json
import math
import os
import sys
import time

import torch
import trl
from datasets import Dataset

import oar
from oar.testing import tiny_random_llama
from oar.integrations.trl import OARGRPOTrainer

OUT, DEV, STEPS, MAXC = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
GPU = DEV == "cuda"
# Qwen2.5-0.5B's layer shapes on the GPU; a 2-layer model for the CPU check of this worker.
SHAPE = (dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864) if GPU
         else dict(hidden_size=32, num_layers=2, num_heads=2))
ROWS = [(a, b) for a in range(1, 9) for b in range(1, 5)]


def reward(prompts, completions, answer, **kw):
    out = []
    for c, a in zip(completions, answer):
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(float(sum(ch in text for ch in a)) / len(a) + 0.1 * (len(text) % 5))
    return out


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if GPU else float("nan")


class Measured(OARGRPOTrainer):
    """OARGRPOTrainer recording, per attribution call, its wall time and peak GPU memory, and, once, the parity of
    TRL's loss on oar's advantages with TRL's loss on its own (B,) advantages of the same batch."""

    rec: dict = {}

    def _oar_batch(self, inputs, out):
        self._trl_advantages = out["advantages"].detach().clone()  # TRL's (B,), before oar replaces them
        return super()._oar_batch(inputs, out)

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        compute = self.oar_pipeline.compute

        def timed(*a, **k):
            overall = peak_gib()
            if GPU:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            res = compute(*a, **k)
            if GPU:
                torch.cuda.synchronize()
            self.rec.setdefault("attribution_s", []).append(time.perf_counter() - t0)
            self.rec.setdefault("attribution_peak_gib", []).append(peak_gib())
            self.rec["overall_peak_gib"] = max(self.rec.get("overall_peak_gib", 0.0), overall)
            self.rec.setdefault("forwards", []).append(res.metrics.get("oar/forward_passes"))
            return res

        self.oar_pipeline.compute = timed
        t0 = time.perf_counter()
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self.oar_pipeline.compute = compute
        self.rec.setdefault("generate_and_score_s", []).append(time.perf_counter() - t0)
        if self.oar_config.method == "grpo" and "parity" not in self.rec:
            # The loss itself nearly cancels (group-centred advantages, ratios 1): the scale of the comparison is the
            # same loss with |advantages| (the same invariant: |A| broadcast on the mask vs |A| per row).
            seq = self._trl_advantages.to(out["advantages"].device)
            loss = {}
            with torch.no_grad():
                for name, adv in (("oar", out["advantages"]), ("trl", seq), ("oar_abs", out["advantages"].abs()),
                                  ("trl_abs", seq.abs())):
                    loss[name] = float(self.compute_loss(self.model_wrapped, dict(out, advantages=adv)))
            scale = max(abs(loss["trl_abs"]), 1e-30)
            self.rec["parity"] = {**{f"loss_{k}": v for k, v in loss.items()},
                                  "advantages_shape": list(out["advantages"].shape),
                                  "rel_diff": max(abs(loss["oar"] - loss["trl"]),
                                                  abs(loss["oar_abs"] - loss["trl_abs"])) / scale}
        return out


def run(method: str, steps: int) -> dict:
    model, tok = tiny_random_llama(tokenizer="minimal", seed=0, initializer_range=0.02, max_position_embeddings=2048,
                                   **SHAPE)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}?"}], "answer": str(a + b)}
                            for a, b in ROWS])
    extra = (dict(bf16=True, fsdp="full_shard", fsdp_config={"version": 2}) if GPU
             else dict(use_cpu=True, bf16=False, gradient_checkpointing=False))
    args = trl.GRPOConfig(output_dir=os.path.join(OUT, method), max_steps=steps, max_completion_length=MAXC,
                          report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, **extra)
    Measured.rec = {}
    trainer = Measured(model=model, reward_funcs=[reward], args=args, train_dataset=ds, processing_class=tok,
                       oar_config=oar.OARConfig.from_json(json.dumps({"method": method})))
    t0 = time.perf_counter()
    trainer.train()
    rec = dict(Measured.rec)
    rec.update(train_s=time.perf_counter() - t0, steps=trainer.state.global_step, overall_peak_gib=max(
        rec.get("overall_peak_gib", 0.0), peak_gib()), policy=type(trainer._oar_policy()).__name__,
        distributed_type=str(trainer.accelerator.distributed_type),
        losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
        time_attribution=[h.get("time/attribution") for h in trainer.state.log_history if "loss" in h])
    return rec


if __name__ == "__main__":
    if GPU:
        assert torch.cuda.is_available(), "no CUDA device"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    res = {"oar_g": run("oar_g", STEPS), "grpo": run("grpo", 1),
           "device": torch.cuda.get_device_name() if GPU else "cpu", "torch": torch.__version__,
           "trl": trl.__version__, "shape": SHAPE, "max_completion_length": MAXC}
    with open(os.path.join(OUT, "trl_gpu.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    g, p = res["oar_g"], res["grpo"].get("parity")
    print(f"[trl-gpu] {res['device']}, torch {res['torch']}, trl {res['trl']}, {g['distributed_type']}, "
          f"policy {g['policy']}, shape {SHAPE}, max_completion_length {MAXC}")
    print(f"[trl-gpu] oar_g: {g['steps']} steps in {g['train_s']:.1f} s; attribution s/step "
          f"{[round(x, 2) for x in g.get('attribution_s', [])]}; generate+score s/step "
          f"{[round(x, 2) for x in g.get('generate_and_score_s', [])]}; OAR forwards {g.get('forwards')}")
    print(f"[trl-gpu] peak GPU memory: attribution {[round(x, 2) for x in g.get('attribution_peak_gib', [])]} GiB, "
          f"whole run {g['overall_peak_gib']:.2f} GiB")
    print(f"[trl-gpu] parity (method grpo, TRL compute_loss): {p}")
    ok = (g["steps"] == STEPS and res["grpo"]["steps"] == 1 and p is not None and p["rel_diff"] <= 1e-6
          and all(math.isfinite(x) for x in g["losses"] + res["grpo"]["losses"]) and len(g["losses"]) > 0)
    print("[trl-gpu]", "OK" if ok else "FAILED")
    sys.stdout.flush()
    os._exit(0 if ok else 1)
PYEOF

if [ "$MODE" = cpu ]; then
  CMD=(timeout "$BUDGET" "$PY" "$WORKER" "$OUT_DIR" cpu 1 12)
else
  CMD=(timeout "$BUDGET" "$PY" -m accelerate.commands.launch --num_processes 1 --num_machines 1 --mixed_precision bf16
       --dynamo_backend no --main_process_port 0 "$WORKER" "$OUT_DIR" cuda "$STEPS" "${OAR_TRL_MAX_COMPLETION:-512}")
fi
echo "[trl-gpu] mode $MODE, python $PY, budget ${BUDGET} s, results $OUT_DIR"
echo "[trl-gpu] command: ${CMD[*]}"
if [ "$DRY" = 1 ]; then
  "$PY" -m py_compile "$WORKER" && echo "[trl-gpu] worker compiles"
  exit $?
fi

# Preflight: what the worker imports (trl / datasets from the carried wheels when missing).
missing=$("$PY" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ]; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 \
    || { echo "[trl-gpu] missing $missing and no wheels in $WHEELS (benchmarks/gpu/prepare_carry.sh)"; exit 3; }
  echo "[trl-gpu] installing $WHEELS/*.whl into $SITE (missing: $missing)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl || exit 3
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
"$PY" - "$MODE" <<'EOF' || exit 3
import importlib.util, sys
need = ["torch", "transformers", "accelerate", "trl", "datasets", "oar"]
miss = [m for m in need if importlib.util.find_spec(m) is None]
if miss:
    print(f"[trl-gpu] cannot run: missing {miss} (accelerate is not in .gpu-wheels: carry its wheel in OAR_TRL_WHEELS)")
    sys.exit(3)
import torch
if sys.argv[1] == "gpu" and not torch.cuda.is_available():
    print(f"[trl-gpu] cannot run: torch {torch.__version__} sees no CUDA device")
    sys.exit(3)
EOF

"${CMD[@]}" 2>&1 | tee "$OUT_DIR/trl.log" | grep -v "Warning\|warnings.warn\|return func" \
  | grep "\[trl-gpu\]\|Error\|error" | tail -n 30
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "[trl-gpu] stopped at the budget (${BUDGET} s): $OUT_DIR/trl.log"
[ "$rc" = 0 ] || { echo "[trl-gpu] FAILED (rc=$rc): $OUT_DIR/trl.log"; exit 1; }
