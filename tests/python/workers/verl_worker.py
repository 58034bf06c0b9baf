"""Test worker script (tests/python/integrations/test_verl_workers.py): OAR scores on verl 0.9.1's REAL actor workers.

``python verl_worker.py OUT_DIR`` starts a local Ray (2 CPUs), saves the tiny model, builds a 2-rank worker group of
``OARDetachActorWorker`` (verl's ``ActorRolloutRefWorker`` subclass of its separate-async trainer with the FSDP2
engine over gloo; test scaffold ``_verl_cpu.py``) and runs, saving what the test checks in ``OUT_DIR/verl.pt``:

1. ``log_probs``: verl's own ``compute_log_prob`` (the old log-probs), as ``RayPPOTrainer._compute_old_log_prob``
   calls it, to check the scaffold runs verl's engine faithfully;
2. ``scores``: for oar_g and oar_p, ``WorkerGroupScorer(wg)(data, cfg, seq_adv)`` on a verl batch (rows in
   shuffled group order, 3 of 8 rows with a non-zero advantage: rank 0 scores 2, rank 1 one plus a padding row),
   with the policy forwards each rank ran;
3. ``legacy``: ``ray_trainer.compute_advantage(data, "oar_g")`` with the worker group recorded as the legacy
   trainer's ``init_workers`` wrapper records it (the scores the workers returned are captured);
4. ``v1``: verl's v1 ``_compute_advantage`` of the registered ``oar_sync`` trainer, with an in-memory stand-in
   for the transfer queue (``kv_batch_get`` / ``kv_batch_put``) holding the rollouts as verl's agent loop puts
   them (per-row prompts / responses / response_mask, ``rm_scores``, ``uid``, ``reward_model``);
5. ``pi_old``: which weights the ``oar_separate_async`` trainer scores with at the second mini-batch of a
   parameter-sync cycle (:func:`pi_old_steps`). The workers are verl's ``DetachActorWorker`` (the separate-async
   trainer's actor class) with the OAR mixin.
"""

import os
import sys
import tempfile

import numpy as np
import torch

# The shared test helper _verl_cpu, also when run as a script (the Ray workers get its folder from _verl_cpu).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))

import _verl_cpu  # noqa: E402

import oar  # noqa: E402
from oar.integrations import verl as oar_verl  # noqa: E402

oar_verl.register()
from oar.integrations.verl import context  # noqa: E402
from oar.integrations.verl import workers as verl_workers  # noqa: E402
from verl.single_controller.base.decorator import Dispatch, register  # noqa: E402

N = 4  # rollouts per prompt
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]  # group 0: all four rows active; group 1: none
ORDER = [4, 0, 5, 1, 6, 2, 7, 3]  # rows in shuffled group order (verl balances batches across ranks)


from verl.experimental.separation.engine_workers import DetachActorWorker  # noqa: E402


class Worker(verl_workers.oar_worker_class(DetachActorWorker)):
    """The OAR worker of verl's ``DetachActorWorker`` (``ActorRolloutRefWorker`` plus the CPU weight slots of the
    separate-async trainer, nothing else) plus test probes (counted policy forwards, parameter grads, a stand-in
    for an actor update)."""

    def _get_strategy_handlers(self):
        """verl's FSDP2 save / restore of the CPU weight slots, with the saved shards cloned. verl's save moves each
        local shard to the CPU with ``.cpu()``, a copy from a GPU but the same tensor on the CPU: on this scaffold
        a saved slot would alias the live parameters, and the next in-place update would change it too. Cloning
        gives the CPU what ``.cpu()`` gives on a GPU (CPU scaffold only; FSDP2, the scaffold's engine)."""
        save, load = super()._get_strategy_handlers()
        if self.config.actor.strategy != "fsdp2":
            return save, load

        def save_copy(module):
            state, spec = save(module)
            return {name: (t.clone(), s) for name, (t, s) in state.items()}, spec

        return save_copy, load

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def scale_weights(self, factor: float):
        """Multiplies every parameter shard by ``factor`` in place: a stand-in for an actor update (the weights
        change, identically on every rank)."""
        with torch.no_grad():
            for p in self.actor.engine.module.parameters():
                p.mul_(factor)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def count_forwards(self, reset: bool = True):
        module = self.actor.engine.module
        if not hasattr(self, "_forwards"):
            self._forwards = [0]
            module.register_forward_pre_hook(lambda *a: self._forwards.__setitem__(0, self._forwards[0] + 1))
        n = self._forwards[0]
        if reset:
            self._forwards[0] = 0
        grads = all(p.grad is None for p in module.parameters())
        return {"forwards": n, "no_grads": grads, "fsdp2": type(module).__name__,
                "peft": any("lora_" in name for name, _ in module.named_parameters()),
                "lm_head_dtypes": sorted(self._lm_head_dtypes) if hasattr(self, "_lm_head_dtypes") else [],
                "param_offload": bool(getattr(self.actor.engine, "_is_offload_param", False)),
                "gradient_checkpointing": any(getattr(m, "gradient_checkpointing", False)
                                              for m in module.modules())}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def peak_memory_gib(self):
        """Peak CUDA memory allocated on this rank since its start, GiB (0 without CUDA)."""
        return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def watch_compute_dtype(self):
        """Records the dtype of every input of the policy's ``lm_head`` from now on (the compute dtype under
        verl's mixed precision: FSDP casts the parameters to ``param_dtype`` for the forward)."""
        self._lm_head_dtypes = set()
        for name, mod in self.actor.engine.module.named_modules():
            if name.endswith("lm_head"):
                mod.register_forward_pre_hook(lambda m, args: self._lm_head_dtypes.add(str(args[0].dtype)))
        return True


def config(method):
    # sigma 0.05: OAR-G scores well above float32 rounding on this tiny model; 1 MB: OAR-P runs many forwards.
    return oar.OARConfig.from_json(f'{{"method": "{method}", "seed": 3, "sigma": 0.05, "max_variants_per_chunk": 3, '
                                   f'"memory_budget_mb": {1 if method == "oar_p" else 4096}}}')


def rollouts(tok):
    """Per-row token lists: prompts of 3-5 tokens, responses of 5-9 (row 1 multi-turn: a tool output in the
    middle, response_mask 0 there), answers '3' / '4' per group."""
    g = torch.Generator().manual_seed(5)
    vocab = len(tok)
    rows = []
    for i in range(2 * N):
        p = torch.randint(3, vocab, (3 + i % 3,), generator=g)
        r = torch.randint(3, vocab, (5 + i % 5,), generator=g)
        m = torch.ones_like(r)
        if i == 1:
            m[2:4] = 0
        rows.append(dict(prompt=p, response=r, mask=m, answer=str(3 + i // N), reward=REWARDS[i], uid=f"u{i // N}"))
    return [rows[i] for i in ORDER]


def data_proto(rows):
    """The legacy trainer's batch: prompts left-padded, responses right-padded, rewards at the last token."""
    from verl import DataProto

    B = len(rows)
    P = max(len(r["prompt"]) for r in rows)
    R = max(len(r["response"]) for r in rows)
    prompts = torch.zeros((B, P), dtype=torch.long)
    responses = torch.zeros((B, R), dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    rmask = torch.zeros((B, R), dtype=torch.long)
    scores = torch.zeros((B, R))
    for i, r in enumerate(rows):
        p, q = len(r["prompt"]), len(r["response"])
        prompts[i, P - p:] = r["prompt"]
        responses[i, :q] = r["response"]
        attn[i, P - p: P + q] = 1
        rmask[i, :q] = r["mask"]
        scores[i, q - 1] = r["reward"]
    input_ids = torch.cat([prompts, responses], 1)
    position_ids = torch.clamp(torch.cumsum(attn, 1) - 1, min=0)
    return DataProto.from_dict(
        tensors=dict(prompts=prompts, responses=responses, input_ids=input_ids, attention_mask=attn,
                     position_ids=position_ids, response_mask=rmask, token_level_rewards=scores,
                     token_level_scores=scores),
        non_tensors=dict(uid=np.array([r["uid"] for r in rows], dtype=object),
                         reward_model=np.array([{"ground_truth": r["answer"]} for r in rows], dtype=object)),
        meta_info={"temperature": 1.0})


def old_log_probs(wg, data):
    """verl's ``compute_log_prob`` as ``RayPPOTrainer._compute_old_log_prob`` calls it."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    out = wg.compute_log_prob(td)
    return no_padding_2_padding(tu.get(out, "log_probs"), td).float()


class FakeTQ:
    """In-memory stand-in for the transfer queue's kv_batch_get / kv_batch_put (rows stored per key)."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def put(self, keys, partition_id, fields):
        from transfer_queue import KVBatchMeta

        for k, key in enumerate(keys):
            row = self.rows.setdefault(key, {})
            for name in fields.keys():
                v = fields[name]
                row[name] = v.unbind(0)[k] if getattr(v, "is_nested", False) else (
                    v.tolist()[k] if not isinstance(v, torch.Tensor) else v[k])
        return KVBatchMeta(keys=list(keys), tags=[{} for _ in keys], partition_id=partition_id)

    def get(self, keys, partition_id, select_fields=None):
        from tensordict import NonTensorStack, TensorDict

        names = [f for f in select_fields if all(f in self.rows[k] for k in keys)]
        out = {}
        for f in names:
            vals = [self.rows[k][f] for k in keys]
            if isinstance(vals[0], torch.Tensor) and vals[0].dim() >= 1:
                out[f] = torch.nested.as_nested_tensor(vals, layout=torch.jagged)
            elif isinstance(vals[0], torch.Tensor):
                out[f] = torch.stack(vals)
            else:
                out[f] = NonTensorStack(*vals)
        return TensorDict(out, batch_size=[len(keys)])


def v1_step(wg, rows, method, mode: str = "sync", **attrs):
    """verl's v1 ``_compute_advantage`` of the ``oar_<mode>`` trainer on a fake transfer queue, the trainer's
    attributes ``attrs`` set as verl's ``step`` sets them (``parameter_sync_step``, ``local_trigger_step``); returns the
    advantages it wrote back (padded (B, R)) and the scores the workers returned for it."""
    import transfer_queue
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    fake = FakeTQ()
    keys = [f"{r['uid']}_{i}_0" for i, r in enumerate(rows)]
    fields = {"prompts": [r["prompt"] for r in rows], "responses": [r["response"] for r in rows],
              "response_mask": [r["mask"] for r in rows],
              "rm_scores": [torch.nn.functional.one_hot(torch.tensor(len(r["response"]) - 1), len(r["response"]))
                            .float() * r["reward"] for r in rows]}
    td = TensorDict({k: torch.nested.as_nested_tensor(v, layout=torch.jagged) for k, v in fields.items()},
                    batch_size=[len(rows)])
    from tensordict import NonTensorStack

    td["uid"] = NonTensorStack(*[r["uid"] for r in rows])
    td["reward_model"] = NonTensorStack(*[{"ground_truth": r["answer"]} for r in rows])
    meta = fake.put(keys, "train", td)
    saved = (transfer_queue.kv_batch_get, transfer_queue.kv_batch_put)
    transfer_queue.kv_batch_get, transfer_queue.kv_batch_put = fake.get, fake.put
    trainer = object.__new__(get_trainer_cls(f"oar_{mode}"))
    for k, v in attrs.items():
        setattr(trainer, k, v)
    trainer.config = OmegaConf.create({"algorithm": {"adv_estimator": method, "gamma": 1.0, "lam": 1.0,
                                                     "use_kl_in_reward": False, "norm_adv_by_std_in_grpo": True},
                                       "actor_rollout_ref": {"rollout": {"n": N}}})
    trainer.actor_rollout_wg = wg
    captured = {}
    orig = oar_verl.WorkerGroupScorer.__call__

    def capture(self, data, cfg, seq):
        out = orig(self, data, cfg, seq)
        captured.update(scores=out[0], reasoning_mask=out[1], seq=seq, config=cfg.to_json())
        return out

    oar_verl.WorkerGroupScorer.__call__ = capture
    try:
        trainer._compute_advantage(meta, metrics={})
    finally:
        oar_verl.WorkerGroupScorer.__call__ = orig
        transfer_queue.kv_batch_get, transfer_queue.kv_batch_put = saved
    adv = fake.get(keys, "train", ["advantages"])["advantages"].to_padded_tensor(0.0)
    return dict(advantages=adv, **captured)


def pi_old_steps(wg, rows) -> dict:
    """Which weights score in verl's separate-async trainer with ``parameter_sync_step`` 2 (OAR-P: deterministic, so
    equal weights give equal scores): the cycle's first mini-batch scores with the current weights after verl's
    ``_compute_old_log_prob`` saved them as slot 0; the actor is then updated (:meth:`Worker.scale_weights`); the
    second mini-batch scores (``first``, ``second``), and the sync trainer scores with whatever the workers hold just
    before and just after it (``changed_before``, ``changed_after``)."""
    oar_verl.configure(config("oar_p"))
    out = {}
    wg.save_model_to_cpu(0)  # verl's separate-async _compute_old_log_prob at local_trigger_step 0
    out["first"] = v1_step(wg, rows, "oar_p", "separate_async", parameter_sync_step=2, local_trigger_step=0)
    wg.scale_weights(1.25)  # the actor update after the first mini-batch
    out["changed_before"] = v1_step(wg, rows, "oar_p")
    out["second"] = v1_step(wg, rows, "oar_p", "separate_async", parameter_sync_step=2, local_trigger_step=1)
    out["changed_after"] = v1_step(wg, rows, "oar_p")
    wg.clear_cpu_model(0)
    return out


def gpu_worker_group(config, n: int):
    """An n-rank worker group of :class:`Worker` on GPUs, as verl's trainer builds it (no CPU scaffold)."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool(process_on_nodes=[n], use_gpu=True)
    return RayWorkerGroup(resource_pool=pool, device_name="cuda",
                          ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(Worker), config=config, role="actor"))


def main(out_dir, device: str = "cpu", model: str = "tiny", ranks: int = 2, lora_rank: int = 0):
    """``device="cuda"`` (benchmarks/gpu/run_verl_oar.sh): the same steps on ``ranks`` GPUs with verl's engine as
    verl runs it, on ``model`` (a name of oar.app.models.load_by_name, e.g. SmolLM2), with the time of each stage."""
    import time

    import ray
    from verl.trainer.ppo import ray_trainer

    times = {}
    ray.init(num_cpus=2 if device == "cpu" else None, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if model == "tiny":
                path = _verl_cpu.save_tiny_model(os.path.join(tmp, "tiny"))
            else:
                from oar.app.models import load_by_name

                m, t = load_by_name(model)
                path = os.path.join(tmp, "model")
                m.save_pretrained(path)
                t.save_pretrained(path)
            t0 = time.perf_counter()
            lora = {"model.lora_rank": lora_rank, "model.target_modules": "all-linear"} if lora_rank else {}
            if device == "cpu":
                wg = _verl_cpu.worker_group(Worker, _verl_cpu.actor_config(path, **lora), n=ranks)
            else:
                cfg = _verl_cpu.actor_config(path, **{"model.override_config": {"attn_implementation": "sdpa"}}, **lora)
                wg = gpu_worker_group(cfg, ranks)
            wg.init_model()
            times["init_model"] = time.perf_counter() - t0
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
            rows = rollouts(tok)
            data = data_proto(rows)
            t0 = time.perf_counter()
            out = {"rows": rows, "log_probs": old_log_probs(wg, data), "scores": {}, "times": times}
            times["compute_log_prob"] = time.perf_counter() - t0
            # group 0's advantages (rewards [1, 0, 0, 0]) with original row 3 made inactive: 3 active rows, so
            # rank 0 scores 2 rows and rank 1 one (plus a padding row)
            seq = torch.tensor([1.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0])[torch.tensor(ORDER)]
            for method in ("oar_g", "oar_p"):
                wg.count_forwards()
                cfg = config(method)
                scorer = oar_verl.WorkerGroupScorer(wg)
                t0 = time.perf_counter()
                scores, mask = scorer(data, cfg, seq)
                times[f"oar_scores {method}"] = time.perf_counter() - t0
                out["scores"][method] = dict(scores=scores, reasoning_mask=mask, seq=seq, config=cfg.to_json(),
                                             ranks=wg.count_forwards(), **scorer.last_info)
            # the legacy trainer: init_workers' wrapper records the actor worker group for the estimator
            oar_verl.configure(config("oar_g"))
            context.set_trainer_scorer(oar_verl.WorkerGroupScorer(wg))
            captured = {}
            orig = oar_verl.WorkerGroupScorer.__call__

            def capture(self, d, cfg, s):
                res = orig(self, d, cfg, s)
                captured.update(scores=res[0], reasoning_mask=res[1], seq=s)
                return res

            oar_verl.WorkerGroupScorer.__call__ = capture
            try:
                res = ray_trainer.compute_advantage(data, adv_estimator="oar_g", num_repeat=N,
                                                    norm_adv_by_std_in_grpo=True)
            finally:
                oar_verl.WorkerGroupScorer.__call__ = orig
                context.set_trainer_scorer(None)
            out["legacy"] = dict(advantages=res.batch["advantages"].clone(), **captured)
            out["v1"] = v1_step(wg, rows, "oar_g")
            out["v1_ranks"] = wg.count_forwards()
            out["pi_old"] = pi_old_steps(wg, rows)
            oar_verl.configure(None)
            torch.save(out, os.path.join(out_dir, "verl.pt"))
    finally:
        ray.shutdown()


#: verl's FSDP engine's mixed precision when ``fsdp_config.mixed_precision`` leaves it unset (``_build_fsdp_module``,
#: verl/workers/engine/fsdp/transformer_impl.py:393-399: ``param_dtype`` bf16, ``reduce_dtype`` / ``buffer_dtype``
#: fp32): the forward computes in bf16 over fp32 weights.
BF16 = {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}

#: Settings of verl's defaults on the CPU scaffold (tests/python/integrations/test_verl_defaults.py), as
#: ``actor_config`` overrides: name -> dotted keys under ``actor_rollout_ref``.
VARIANTS = {
    # the scaffold's own settings (FSDP2, float32, eager attention): the install test's check (test_install.py)
    "fsdp2": {},
    # verl's default engine (FSDP1) with its default mixed precision
    "fsdp1": {"actor.strategy": "fsdp", "actor.fsdp_config.mixed_precision": BF16},
    # FSDP2 in float32 with parameter offload and gradient checkpointing
    "fsdp2_offload_ckpt": {"actor.fsdp_config.param_offload": True, "model.enable_gradient_checkpointing": True},
    # verl's default mixed precision (bf16 compute) on FSDP2
    "fsdp2_bf16": {"actor.fsdp_config.mixed_precision": BF16},
    # verl's remove-padding forward (packed sequences), float32
    "remove_padding": {"model.use_remove_padding": True},
    # verl's defaults together (GPU only, benchmarks/gpu/run_verl_defaults.sh; FSDP1 does not build on CPU):
    # FSDP1, bf16 compute, remove-padding, gradient checkpointing (flash_attention_2: variants_main's attn)
    "verl_defaults": {"actor.strategy": "fsdp", "actor.fsdp_config.mixed_precision": BF16,
                      "model.use_remove_padding": True, "model.enable_gradient_checkpointing": True},
}


def grpo_parity(rows) -> dict:
    """verl's ``compute_advantage`` of the same batch with ``grpo`` and with oar's uniform credit (``oar_grpo``):
    ``{"grpo": (B, R), "oar_grpo": (B, R)}`` token advantages, which must be equal."""
    from verl.trainer.ppo import ray_trainer

    return {est: ray_trainer.compute_advantage(data_proto(rows), adv_estimator=est, num_repeat=N,
                                               norm_adv_by_std_in_grpo=True).batch["advantages"].clone()
            for est in ("grpo", "oar_grpo")}


def variants_main(out_dir, names, device: str = "cpu", model: str = "tiny", ranks: int = 2, steps: int = 1,
                  attn: str | None = None):
    """One worker group per setting of :data:`VARIANTS` (``names``), one after the other in one Ray session: for
    each, verl's ``compute_log_prob`` and ``WorkerGroupScorer`` scores for oar_g and oar_p (``steps`` times; the
    same rows as :func:`main`), the forward counts and compute dtypes per rank, and stage times; or the error
    ``init_model`` / the first call raised (``"error"``: type, message and the innermost frame). Saves
    ``OUT_DIR/variants.pt``. ``device="cuda"`` (benchmarks/gpu/run_verl_defaults.sh): GPU worker groups, peak CUDA
    memory per rank, ``attn`` the attention implementation (default: verl's own, flash_attention_2). ``model``:
    ``"tiny"`` (saved here), a directory holding a saved model and tokenizer, or a name of
    ``oar.app.models.load_by_name``."""
    import time
    import traceback

    import ray

    import transformers

    out = {"rows": None, "variants": {}, "versions": {"oar": oar.__file__, "transformers": transformers.__version__,
                                                      "python": sys.executable}}
    ray.init(num_cpus=ranks if device == "cpu" else None, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if model == "tiny":
                path = _verl_cpu.save_tiny_model(os.path.join(tmp, "tiny"))
            elif os.path.isdir(model):  # a saved model (and tokenizer), used as it is
                path = model
            else:
                from oar.app.models import load_by_name

                m, t = load_by_name(model)
                path = os.path.join(tmp, "model")
                m.save_pretrained(path)
                t.save_pretrained(path)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
            rows = rollouts(tok)
            data = data_proto(rows)
            out["rows"] = rows
            out["parity"] = grpo_parity(rows)
            seq = torch.tensor([1.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0])[torch.tensor(ORDER)]
            for name in names:
                overrides = dict(VARIANTS[name])
                if device == "cuda":
                    overrides.setdefault("model.override_config", {"attn_implementation": attn or "flash_attention_2"})
                cfg_node = _verl_cpu.actor_config(path, **overrides)
                res = {"overrides": overrides, "times": {}, "scores": {}}
                wg = None
                try:
                    t0 = time.perf_counter()
                    wg = (_verl_cpu.worker_group(Worker, cfg_node, n=ranks) if device == "cpu"
                          else gpu_worker_group(cfg_node, ranks))
                    wg.init_model()
                    wg.watch_compute_dtype()
                    res["times"]["init_model"] = time.perf_counter() - t0
                    for step in range(steps):
                        t0 = time.perf_counter()
                        res["log_probs"] = old_log_probs(wg, data)
                        res["times"].setdefault("compute_log_prob", []).append(time.perf_counter() - t0)
                        for method in ("oar_g", "oar_p"):
                            wg.count_forwards()
                            cfg = config(method)
                            scorer = oar_verl.WorkerGroupScorer(wg)
                            t0 = time.perf_counter()
                            scores, mask = scorer(data, cfg, seq)
                            res["times"].setdefault(f"oar_scores {method}", []).append(time.perf_counter() - t0)
                            res["scores"][method] = dict(scores=scores, reasoning_mask=mask, seq=seq,
                                                         config=cfg.to_json(), ranks=wg.count_forwards(),
                                                         **scorer.last_info)
                    if device == "cuda":
                        res["peak_memory_gib"] = wg.peak_memory_gib()
                except Exception as e:  # recorded: the test checks what fails and how
                    tb = traceback.extract_tb(e.__traceback__)
                    res["error"] = dict(type=type(e).__name__, message=str(e)[-3000:],
                                        frame=f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "")
                finally:
                    if wg is not None:
                        for w in wg.workers:
                            ray.kill(w)
                        for pg in wg.resource_pool.pgs or []:
                            ray.util.remove_placement_group(pg)
                out["variants"][name] = res
            torch.save(out, os.path.join(out_dir, "variants.pt"))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="tiny", help="tiny, or a model name of oar.app.models.load_by_name (GPU runs)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--lora-rank", type=int, default=0, help="> 0: a LoRA actor (verl's model.lora_rank)")
    ap.add_argument("--variants", default="",
                    help=f"comma-separated names of {sorted(VARIANTS)}: run those settings instead (variants_main)")
    ap.add_argument("--steps", type=int, default=1, help="with --variants: scoring steps per setting")
    ap.add_argument("--attn", default=None, help="with --variants on cuda: attn_implementation (flash_attention_2)")
    a = ap.parse_args()
    if a.variants:
        variants_main(a.out_dir, a.variants.split(","), a.device, a.model, a.ranks, a.steps, a.attn)
    else:
        main(a.out_dir, a.device, a.model, a.ranks, a.lora_rank)
