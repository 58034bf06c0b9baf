#!/usr/bin/env bash
# Prepared GPU check of issue 24 (OpenRLHF): OAR in openrlhf 0.11.2's experience maker with its real DeepSpeed
# defaults, a few steps on one GPU (docs/trainers/openrlhf.md, "GPU check").
#   One policy actor as OpenRLHF builds it: openrlhf.models.Actor around a random-weight model of Qwen2.5-0.5B's
#   shape (24 layers, hidden 896, 14 heads / 2 KV heads, MLP 4864, vocabulary 151936; oar's tiny_random_llama from
#   a config, nothing downloaded), wrapped by deepspeed.initialize with OpenRLHF's get_train_ds_config (ZeRO-3,
#   bf16, --ds.zpg 1: OpenRLHF's defaults; AdamW through torch so that no DeepSpeed op is compiled), sdpa attention
#   (flash_attention_2, OpenRLHF's default, is not on the device image). Per step: fake rollouts (4 prompts x 8
#   samples, 64 + up to 256 tokens, 0/1 rewards) made into experiences by OpenRLHF's own SamplesGenerator /
#   split_rollout_samples, the policy's log-probs (Actor.forward), OpenRLHF's GRPO advantages (group_norm), then oar
#   (oar_p, oar_g) through the real RemoteExperienceMaker.compute_advantages_and_returns with the actor group's
#   oar_scores (BaseModelActor.execute_batch in process: no Ray), --train.colocate_all (empty_cache after scoring),
#   and one PPO update (PolicyLoss, engine.backward / step) on oar_p's advantages. Printed: attribution seconds per
#   method, rows shipped to the actor, peak CUDA memory (GRPO step vs oar), and the parity check (oar_p with uniform
#   credit gives OpenRLHF's advantages on the action mask and PolicyLoss bit for bit). Not a train_ppo_ray run: vLLM
#   and Ray are not on the device image.
# Time budget (on paper, never run on a GPU): device start 1-2 min (not in the script); wheel install 15 s; imports
#   + deepspeed.initialize 40 s; per step ~30 s (log-probs 2 s, oar_p ~1.1M tokens of masked variants ~15 s, oar_g
#   5 s, update 3 s) x 3 steps; total under 4 min: call with timeout_s 300.
# Needs (travels in carry): .gpu-wheels/openrlhf/ filled here by `benchmarks/gpu/run_openrlhf.sh --prepare`
#   (networked machine; after prepare_carry.sh, which empties .gpu-wheels/; 7 MiB): openrlhf 0.11.2, deepspeed
#   0.19.8, peft, accelerate, pydantic and deepspeed's small dependencies, CPython 3.12 wheels at the versions tested
#   here, installed --no-deps into /tmp/oar-orl-site and appended to sys.path (the device's own packages, torch and
#   transformers first, win). Missing packages that openrlhf imports at top level but this check never calls (vllm,
#   ray, flash_attn, aiohttp, bitsandbytes, datasets, torchdata, pylatexenc, wandb, tensorboard) get stand-ins. The
#   project built with a CUDA torch first (benchmarks/gpu/run_gpu_checks.sh --build-only; OAR_BUILD_DIR=build-gpu).
#   Risks not checkable here: the device's transformers 5.17 / torch 2.11 under openrlhf 0.11.2 and deepspeed 0.19.8
#   (tested here with transformers 5.24 / torch 2.14.1), and the device's pip.
# Usage: benchmarks/gpu/run_openrlhf.sh [--prepare | --dry-run]    (--dry-run: the same driver on the CPU, a tiny
#   model, one step, DeepSpeed's CPU accelerator and gloo; needs deepspeed importable, e.g. PYTHONPATH with
#   /work/site-openrlhf). Device call: command `benchmarks/gpu/run_openrlhf.sh`, carry [".gpu-wheels"],
#   timeout_s 300. Results: $OUT/openrlhf (default ./gpu_results/openrlhf): openrlhf.log, openrlhf.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PY:-}" ]; then PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python; fi
MODE=gpu
for a in "$@"; do
  case "$a" in
    --prepare) MODE=prepare ;;
    --dry-run) MODE=dry ;;
    -h|--help) sed -n '2,/^set -uo/{/^set -uo/!p}' "$0"; exit 0 ;;
    *) echo "run_openrlhf.sh: unknown argument '$a' (see --help)" >&2; exit 2 ;;
  esac
done
WHEELS=.gpu-wheels/openrlhf
if [ "$MODE" = prepare ]; then
  mkdir -p "$WHEELS"
  rm -f "$WHEELS"/*.whl
  # the device runs CPython 3.12 on x86-64: openrlhf, pydantic-core and msgpack have per-version wheels
  "$PY" -m pip download --no-deps -d "$WHEELS" --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi none --platform manylinux1_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform any \
    openrlhf==0.11.2 hjson==3.1.0 py-cpuinfo==9.0.0 einops==0.8.2 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 msgpack==1.2.4 peft==0.21.2 accelerate==1.15.0 || exit 1
  "$PY" -m pip wheel --no-deps -w "$WHEELS" deepspeed==0.19.8 || exit 1   # sdist: built here, pure Python
  ls -la "$WHEELS"; du -sh "$WHEELS"
  exit 0
fi
OUT_DIR=${OUT:-$PWD/gpu_results}/openrlhf
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "$MODE" = gpu ]; then
  export OAR_BUILD_DIR=${OAR_BUILD_DIR:-$PWD/build-gpu} OAR_ORL_SITE=/tmp/oar-orl-site
  ls "$WHEELS"/*.whl >/dev/null 2>&1 \
    || { echo "[openrlhf-gpu] no wheels in $WHEELS: run --prepare and carry .gpu-wheels"; exit 1; }
  timeout 60 "$PY" -m pip install -q --no-deps --no-index --target "$OAR_ORL_SITE" "$WHEELS"/*.whl \
    || { echo "[openrlhf-gpu] wheel install failed"; exit 1; }
  LIMIT=${OAR_ORL_LIMIT_S:-230}
else
  export OAR_ORL_DRY=1 DS_ACCELERATOR=cpu
  LIMIT=${OAR_ORL_LIMIT_S:-400}
fi
timeout "$LIMIT" "$PY" - "$OUT_DIR/openrlhf.json" <<'PYEOF' 2>&1 | tee "$OUT_DIR/openrlhf.log" \
  | grep -v "Warning\|warnings.warn\|it/s\]"
import copy
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import types
from types import SimpleNamespace as NS

if os.environ.get("OAR_ORL_SITE"):
    sys.path.append(os.environ["OAR_ORL_SITE"])  # after the device's own packages
DRY = os.environ.get("OAR_ORL_DRY") == "1"
#: imported by openrlhf's modules at top level, never called here: stand-ins when the device lacks them
STANDINS = [m for m in ("vllm", "ray", "flash_attn", "aiohttp", "bitsandbytes", "datasets", "torchdata", "pylatexenc",
                        "wandb", "tensorboard") if importlib.util.find_spec(m) is None]


class _Anything(types.ModuleType):  # a stand-in module: every attribute is another stand-in
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Anything(f"{self.__name__}.{name}")
        sub.__path__ = []
        setattr(self, name, sub)
        return sub

    def __call__(self, *a, **k):
        return self


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STANDINS and not name.startswith("flash_attn.ops"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Anything(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
import torch  # noqa: E402

cuda = torch.cuda.is_available() and not DRY
if not cuda and not DRY:
    sys.exit("[openrlhf-gpu] no CUDA device seen by this torch")
dev = torch.device("cuda" if cuda else "cpu")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
t_import = time.perf_counter()
import deepspeed  # noqa: E402
import ray  # noqa: E402  (real or stand-in; ray.get is the identity around the in-process actor group)
from openrlhf.models.actor import Actor  # noqa: E402
from openrlhf.models.loss import PolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402
from openrlhf.trainer.ray.launcher import BaseModelActor  # noqa: E402
from openrlhf.utils.deepspeed.deepspeed_utils import get_train_ds_config  # noqa: E402

import oar  # noqa: E402
from oar.testing import tiny_random_llama  # noqa: E402
from oar.integrations import openrlhf as oar_orl  # noqa: E402

deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
print(f"[openrlhf-gpu] device {torch.cuda.get_device_name() if cuda else 'cpu (dry run)'}, torch {torch.__version__}, "
      f"deepspeed {deepspeed.__version__}, stand-ins {STANDINS}, imports {time.perf_counter() - t_import:.1f} s",
      flush=True)
P, N, LP, LR, STEPS = (4, 8, 64, 256, 3) if not DRY else (2, 4, 8, 12, 1)
shape = (dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, vocab_size=151936)
         if not DRY else dict(hidden_size=32, num_layers=2, num_heads=2, initializer_range=0.12))
model, tok = tiny_random_llama(**shape, tokenizer="minimal", max_position_embeddings=2048)
model.config._attn_implementation = "sdpa"
actor = Actor(model)
actor.packing_samples = False  # Actor(model) leaves it unset
ds_config = get_train_ds_config(offload=False, adam_offload=False, stage=3, param_dtype="bf16" if cuda else "fp32",
                                zpg=1, optim_config={"type": "AdamW", "params": {"lr": 1e-6, "betas": [0.9, 0.95],
                                                                                 "eps": 1e-8, "weight_decay": 0.0,
                                                                                 "torch_adam": True}})
ds_config.update(train_micro_batch_size_per_gpu=8, train_batch_size=8)
if cuda:
    model.to(dev)
engine, optim, *_ = deepspeed.initialize(model=actor.model, config=ds_config,
                                         model_parameters=[p for p in actor.model.parameters() if p.requires_grad])
actor.model = engine
args = NS(rollout=NS(n_samples_per_prompt=N, micro_batch_size=8, max_tokens_per_gpu=None, max_new_tokens=LR),
          train=NS(dynamic_batch_enable=False, colocate_all=cuda, colocate_actor_ref=False),
          algo=NS(advantage=NS(estimator="group_norm", gamma=1.0, lambd=1.0, no_std_norm=False),
                  kl=NS(use_loss=True, init_coef=0.0, estimator="k3")),
          reward=NS(clip_range=(-10.0, 10.0)),
          data=NS(max_len=LP + LR + 8, label_key="answer", max_images_per_prompt=0),
          ds=NS(ring_attn_size=1, tensor_parallel_size=1), actor=NS(num_nodes=1, num_gpus_per_node=1))
me = object.__new__(BaseModelActor)  # the policy actor as Ray builds it, in process
me.actor, me.strategy = actor, NS(is_rank_0=lambda: True, args=args)


class Group:  # RayActorGroup's two calls, on the in-process actor
    def __init__(self, uniform=False):
        self.rows, self.cleared, self.uniform = 0, 0, uniform

    def async_run_method_batch(self, method_name, request):
        self.rows += sum(r["batch"].batch_size for r in request)
        if self.uniform:  # uniform credit: score 1 on every eligible token of the scored rows
            out = []
            for r in request:
                b = r["batch"]
                s = b.eligible_mask.bool() & (b.sequence_advantages != 0)[:, None]
                out.append([{"scores": s.float(), "reasoning_mask": s}])
            return out
        return [BaseModelActor.execute_batch(me, method_name, {"request": request}, 0, len(request))]

    def async_run_method(self, method_name, *a, **k):
        self.cleared += 1
        return [getattr(me, method_name)(*a, **k)]


def experience_maker(group):
    m = RemoteExperienceMaker(group, None, None, None, NS(value=0.0), NS(args=args), tok)
    return m


def rollouts(step):
    g = torch.Generator().manual_seed(step)
    samples = []
    for i in range(P * N):
        q = torch.randint(3, len(tok), (LP,), generator=g).tolist()
        a = torch.randint(3, len(tok), (int(torch.randint(LR // 2, LR + 1, (1,), generator=g)),), generator=g).tolist()
        reward = float(torch.randint(0, 2, (1,), generator=g)) if i // N != P - 1 else 1.0  # last group: all equal
        samples.append(SamplesGenerator._process_response_into_experience(
            None, dict(observation_tokens=q + a, action_ranges=[(len(q), len(q) + len(a))], reward=reward, scores=None,
                       rollout_log_probs=None, prompt="", label=str(3 + i // N % 5), extra_logs={}),
            max_len=args.data.max_len))
    return experience_maker(None).split_rollout_samples(samples)


def sync():
    if cuda:
        torch.cuda.synchronize()


def advantages(exps, config, group):
    if config is None:
        oar_orl.uninstall()
    else:
        oar_orl.install(config)
    m = experience_maker(group)
    get, ray.get = ray.get, (lambda refs: refs)
    try:
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        out = m.compute_advantages_and_returns(copy.deepcopy(exps))
        sync()
        return out, time.perf_counter() - t, (torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0)
    finally:
        ray.get = get


report = {"steps": []}
ok = True
loss_fn = PolicyLoss()
for step in range(STEPS):
    exps = rollouts(step)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    with torch.no_grad():
        for e in exps:
            lp = actor(e.sequences.to(dev), e.action_mask.to(dev), attention_mask=e.attention_mask.to(dev))
            e.action_log_probs, e.kl, e.base_action_log_probs = lp.float().cpu(), torch.zeros(lp.shape), None
    sync()
    rec = {"logprob_s": time.perf_counter() - t,
           "logprob_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else 0}
    grpo, rec["grpo_s"], _ = advantages(exps, None, None)
    for method in ("oar_p", "oar_g"):
        group = Group()
        got, sec, peak = advantages(exps, oar.OARConfig(method=method, seed=step), group)
        finite = all(bool(torch.isfinite(e.advantages).all()) for e in got)
        rec[method] = {"seconds": sec, "peak_mib": peak, "rows_shipped": group.rows, "rows": P * N,
                       "empty_cache_calls": group.cleared, "finite": finite}
        ok &= finite and group.rows < P * N and group.cleared == (1 if cuda else 0)
        if method == "oar_p":
            oar_p = got
    uniform, _, _ = advantages(exps, oar.OARConfig(method="oar_p"), Group(uniform=True))
    # on the action mask; outside it OpenRLHF's cumulative returns carry the value back over the prompt columns,
    # oar writes 0, and PolicyLoss masks both out
    adv_equal = all(torch.equal(a.advantages[a.action_mask.bool()], b.advantages[b.action_mask.bool()])
                    and not a.advantages[~a.action_mask.bool()].any() for a, b in zip(uniform, grpo))
    loss_equal = True
    with torch.no_grad():
        for a, b in zip(uniform, grpo):
            lp = actor(a.sequences.to(dev), a.action_mask.to(dev), attention_mask=a.attention_mask.to(dev)).float()
            la = loss_fn(lp, a.action_log_probs.to(dev), a.advantages.to(dev), action_mask=a.action_mask.to(dev))[0]
            lb = loss_fn(lp, b.action_log_probs.to(dev), b.advantages.to(dev), action_mask=b.action_mask.to(dev))[0]
            loss_equal &= bool(torch.equal(la, lb))
    rec["parity"] = {"advantages_equal": adv_equal, "policy_loss_equal": loss_equal,
                     "max_abs_diff_on_mask": max(float(((a.advantages.double() - b.advantages.double())
                                                        * a.action_mask).abs().max()) for a, b in zip(uniform, grpo)),
                     "dtypes": sorted({f"{a.advantages.dtype}/{b.advantages.dtype}" for a, b in zip(uniform, grpo)})}
    ok &= adv_equal and loss_equal
    sync()
    t = time.perf_counter()
    actor.train()
    for e in oar_p:  # one PPO update on oar_p's advantages (engine.backward / step per micro-batch, as OpenRLHF)
        lp = actor(e.sequences.to(dev), e.action_mask.to(dev), attention_mask=e.attention_mask.to(dev))
        loss = loss_fn(lp.float(), e.action_log_probs.to(dev), e.advantages.to(dev),
                       action_mask=e.action_mask.to(dev))[0]
        engine.backward(loss)
        engine.step()
        ok &= bool(torch.isfinite(loss))
    sync()
    rec["update_s"] = time.perf_counter() - t
    rec["peak_mib_total"] = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0
    report["steps"].append(rec)
    print(f"[openrlhf-gpu] step {step}: log-probs {rec['logprob_s']:.2f} s (peak {rec['logprob_peak_mib']:.0f} MiB), "
          f"GRPO advantages {rec['grpo_s'] * 1e3:.1f} ms; " + "; ".join(
              f"{m} {rec[m]['seconds']:.2f} s, peak {rec[m]['peak_mib']:.0f} MiB, rows shipped {rec[m]['rows_shipped']}"
              f"/{rec[m]['rows']}, empty_cache {rec[m]['empty_cache_calls']}" for m in ("oar_p", "oar_g"))
          + f"; update {rec['update_s']:.2f} s; parity {rec['parity']}", flush=True)
report["ok"] = bool(ok)
with open(sys.argv[1], "w") as f:
    json.dump(report, f, indent=1)
print("[openrlhf-gpu]", "OK" if ok else "FAILED", flush=True)
sys.exit(0 if ok else 1)
PYEOF
rc=${PIPESTATUS[0]}
if [ "$rc" != 0 ]; then
  echo "[openrlhf-gpu] failed (rc=$rc; 124: over ${LIMIT} s): $OUT_DIR/openrlhf.log"
  tail -n 30 "$OUT_DIR/openrlhf.log"
  exit 1
fi
