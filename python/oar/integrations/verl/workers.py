"""verl integration, worker side: OAR scores computed on verl's actor workers (docs/trainers/verl.md).

Tested against verl 0.9.1 (``verl/workers/engine_workers.py``, ``verl/trainer/ppo/v1/trainer_base.py``,
``verl/trainer/ppo/ray_trainer.py``). Importing this module imports verl; :func:`oar.integrations.verl.register`
imports it (opt-in, see docs/trainers/verl.md), nothing else in oar does.

* :class:`OARWorkerMixin` adds one worker method, ``oar_scores``, registered with verl's own dispatch
  (``make_nd_compute_dataproto_dispatch_fn(mesh_name="actor")``, like ``compute_log_prob``): the driver's
  ``TensorDict`` of rows (:func:`oar.integrations.verl.dispatch.scores_request`) is split into one chunk per
  data-parallel rank, each rank scores its chunk with the policy as verl's FSDP / FSDP2 engine holds it (inside
  the engine's ``eval_mode``: parameters reloaded if offloaded, the root resharded after;
  :func:`oar.integrations._worker_scoring.score_chunk`), and the chunks come back concatenated. The forward gate
  keeps the number of policy forwards equal on every rank of the data-parallel group (FSDP gathers parameters in
  every forward). :class:`OARActorRolloutRefWorker` is verl's ``ActorRolloutRefWorker`` with the mixin.
* :class:`OARTrainerMixin` is verl's v1 trainer extension (``register_trainer``): it runs the actor role on the
  class verl's trainer of that mode picks plus :class:`OARWorkerMixin` (:func:`oar_worker_class`: verl's
  ``ActorRolloutRefWorker``, or the ``separate_async`` trainer's ``DetachActorWorker``) and, in
  ``_compute_advantage``, hands the OAR estimator the rollouts (read from the transfer queue), their session keys
  and a :class:`oar.integrations.verl.WorkerGroupScorer` of its actor worker group
  (:func:`oar.integrations.verl.context.advantage_call`). One trainer is registered per verl trainer mode:
  ``oar_sync``, ``oar_colocate_async``, ``oar_separate_async``.
* :func:`wrap_init_workers` makes the legacy ``RayPPOTrainer.init_workers`` run the actor role on its class plus
  :class:`OARWorkerMixin` (:func:`require_oar_workers`) and record its worker-group scorer.

Refused when the trainer starts (:func:`check_trainer_config`, :func:`require_oar_workers`), and again by the
workers: the Megatron engine, Ulysses sequence parallelism > 1, verl's fused-kernel forward, an actor class that
cannot get ``oar_scores``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from tensordict import TensorDict
from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from oar.integrations._worker_scoring import score_chunk, trainer_budget_mb
from oar.integrations.verl import context
from oar.integrations.verl.checks import (
    _REWRITTEN,
    ACTOR_ROLES,
    SUPPORTED_STRATEGIES,
    _estimator_name,
    check_trainer_config,
    check_dataset_answers,
    fused_kernels_refusal,
    scores_on_workers,
    sequence_parallel_refusal,
    start_checks,
    strategy_refusal,
)
from oar.integrations.verl.dispatch import WorkerGroupScorer, request_batch
from oar.integrations.verl.estimators import ADV_ESTIMATORS, estimator_config

#: verl's own ``ActorRolloutRefWorker`` subclasses that a verl trainer picks for the actor role, by class name ->
#: module. Their OAR subclass (:func:`oar_worker_class`) is importable from this module by name in any process
#: (``OAR<name>``, made on first access), so Ray pickles it by reference. verl 0.9.1: the ``separate_async`` trainer
#: runs the actor on ``DetachActorWorker`` (``PPOTrainerSeparateAsync._init_resource_pool_mgr``).
VERL_ACTOR_WORKERS = {"DetachActorWorker": "verl.experimental.separation.engine_workers"}


def _separate_async(trainer) -> bool:
    """Whether ``trainer`` is (a subclass of) verl's separate-async v1 trainer (its own pi_old slots)."""
    try:
        from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
    except ImportError:  # pragma: no cover - verl without the separate-async trainer
        return False
    return isinstance(trainer, PPOTrainerSeparateAsync)


def wrap_v1_trainer_init() -> None:
    """Makes verl's v1 ``PPOTrainer.__init__`` refuse an OAR advantage estimator on one of verl's own trainer modes
    (the user forgot ``trainer.v1.trainer_mode=oar_<mode>``) when the trainer is built, instead of at the first
    advantage step after a whole generation (:func:`start_checks`). Check only: verl's ``__init__`` then runs
    unchanged, and nothing changes for any other estimator. verl has no extension point at trainer construction,
    so this wraps the method (idempotent)."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    orig = PPOTrainer.__init__
    if getattr(orig, "__oar_wrapped__", False):
        return

    @functools.wraps(orig)
    def __init__(self, config, *args, **kwargs):
        if not isinstance(self, OARTrainerMixin):
            start_checks(config, oar_trainer=False)
        return orig(self, config, *args, **kwargs)

    __init__.__oar_wrapped__ = True
    PPOTrainer.__init__ = __init__


def worker_scores(worker, data: TensorDict) -> TensorDict:
    """Body of ``oar_scores`` on one rank: the importance scores of this rank's chunk with the actor's policy.

    Args:
        worker: verl ``ActorRolloutRefWorker`` with an actor (``worker.actor.engine``: FSDP / FSDP2 engine).
        data: this rank's chunk of a :func:`oar.integrations.verl.dispatch.scores_request` (n rows, responses
            (n, R)).

    Returns:
        ``TensorDict`` of n rows: ``oar_scores`` (n, R) float32, ``oar_reasoning_mask`` (n, R) bool and
        ``oar_turn_weights`` (n, R) float32 (1 on rows of one turn; docs/method.md section 13), on the CPU.

    Raises:
        RuntimeError: a worker without an actor (role ``ref`` / ``rollout``).
        NotImplementedError: the Megatron engine, Ulysses sequence parallelism > 1 (each rank of a sequence-
            parallel group holds a slice of every sequence; OAR's probes need whole sequences), or verl's fused-
            kernel forward (no logits). The driver refuses these at trainer start (:func:`check_trainer_config`).
    """
    from verl.utils import tensordict_utils as tu

    actor = getattr(worker, "actor", None)
    if actor is None:
        raise RuntimeError(f"oar_scores runs on the actor: this worker's role is {getattr(worker, 'role', '?')!r}")
    strategy = str(worker.config.actor.get("strategy", "fsdp"))
    if strategy not in SUPPORTED_STRATEGIES:
        raise NotImplementedError(strategy_refusal(strategy))
    engine = actor.engine
    sp = int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1)
    if sp > 1:
        raise NotImplementedError(sequence_parallel_refusal(sp))
    if bool(getattr(getattr(engine, "engine_config", None), "use_fused_kernels", False)):
        raise NotImplementedError(fused_kernels_refusal())
    from oar.attribution import as_probe_model

    batch = request_batch(data)
    width = int(data["oar_prompt_ids"].shape[1] + data["oar_responses"].shape[1])
    res = score_chunk(tu.get(data, "oar_config"), actor.model_config.tokenizer, batch, engine.module,
                      budget_cap_mb=trainer_memory_budget_mb(engine, as_probe_model(engine.module), width),
                      eval_mode=engine.eval_mode)
    tw = res.turn_weights if res.turn_weights is not None else torch.ones_like(res.scores)
    out = TensorDict({"oar_scores": res.scores, "oar_reasoning_mask": res.reasoning_mask, "oar_turn_weights": tw},
                     batch_size=[batch.batch_size])
    tu.assign_non_tensor(out, oar_memory_budget_mb=res.memory_budget_mb)
    return out


def trainer_memory_budget_mb(engine, probe_model, width: int) -> int | None:
    """The activation memory (MiB, >= 1) verl lets one rank's old-log-prob pass use
    (:func:`oar.integrations._worker_scoring.trainer_budget_mb` of its token budget): ``infer_max_token_len_per_gpu``
    tokens with dynamic batch size, else ``infer_micro_batch_size_per_gpu`` sequences of ``width`` tokens. The
    workers cap the config's ``memory_budget_mb`` with it.

    Args:
        engine: verl engine with ``engine_config`` (``use_dynamic_bsz``, ``infer_max_token_len_per_gpu``,
            ``infer_micro_batch_size_per_gpu``).
        probe_model: the policy as an :class:`oar.attribution.ProbeModel`.
        width: longest context of the request (prompt + response tokens).

    Returns:
        The budget in MiB, or None when the engine states no token budget.
    """
    ec = getattr(engine, "engine_config", None)
    if ec is None:
        return None
    return trainer_budget_mb(probe_model, width, dynamic=bool(getattr(ec, "use_dynamic_bsz", False)),
                             max_tokens=getattr(ec, "infer_max_token_len_per_gpu", None),
                             micro_batch_size=getattr(ec, "infer_micro_batch_size_per_gpu", None))


class OARWorkerMixin:
    """Adds the ``oar_scores`` worker method to a verl ``ActorRolloutRefWorker`` (sub)class.

    ``oar_scores(data: TensorDict) -> TensorDict`` is registered with ``make_nd_compute_dataproto_dispatch_fn(
    mesh_name="actor")``: called on the worker group with a :func:`scores_request`, it returns the concatenated
    replies of :func:`worker_scores` (``oar_scores`` (n, R) float32, ``oar_reasoning_mask`` (n, R) bool).
    """

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def oar_scores(self, data: TensorDict) -> TensorDict:
        return worker_scores(self, data)


class OARActorRolloutRefWorker(OARWorkerMixin, ActorRolloutRefWorker):
    """verl's ``ActorRolloutRefWorker`` with :class:`OARWorkerMixin` (nothing else changes)."""


#: verl actor worker class -> its OAR subclass (one per base class, made by :func:`oar_worker_class`).
_MIXED: dict[type, type] = {ActorRolloutRefWorker: OARActorRolloutRefWorker}


def oar_worker_class(cls: type) -> type:
    """The class of ``cls``'s actor workers with :class:`OARWorkerMixin`: ``cls`` itself when it has
    ``oar_scores``; :class:`OARActorRolloutRefWorker` for verl's ``ActorRolloutRefWorker``; for a subclass of it,
    ``OAR<cls name>(OARWorkerMixin, cls)``, made once per class. Those of verl's own classes
    (:data:`VERL_ACTOR_WORKERS`) are importable from this module by name, in any process, so Ray pickles them by
    reference; other subclasses (a user's) are pickled by value by Ray's cloudpickle.

    Raises:
        TypeError: ``cls`` is no ``ActorRolloutRefWorker`` subclass and has no ``oar_scores`` (mix
            :class:`OARWorkerMixin` into it yourself).
    """
    if hasattr(cls, "oar_scores"):
        return cls
    if not (isinstance(cls, type) and issubclass(cls, ActorRolloutRefWorker)):
        name = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"
        raise TypeError(f"the actor role runs on {name}, which has no oar_scores and is no subclass of verl's "
                        "ActorRolloutRefWorker: mix oar.integrations.verl.workers.OARWorkerMixin into it "
                        "(class MyWorker(OARWorkerMixin, YourWorker))")
    mixed = _MIXED.get(cls)
    if mixed is None:
        name = f"OAR{cls.__name__}"
        mixed = type(name, (OARWorkerMixin, cls), {
            "__module__": __name__, "__qualname__": name,
            "__doc__": f"{cls.__module__}.{cls.__qualname__} with :class:`OARWorkerMixin` (nothing else changes)."})
        _MIXED[cls] = mixed
        if VERL_ACTOR_WORKERS.get(cls.__name__) == cls.__module__:
            globals()[name] = mixed  # importable by name (Ray pickles classes by reference)
    return mixed


def __getattr__(name: str):
    """``OAR<name>`` for verl's actor worker classes of :data:`VERL_ACTOR_WORKERS` (made on first access: a Ray
    worker unpickling the class by reference imports it from here)."""
    module = VERL_ACTOR_WORKERS.get(name[3:]) if name.startswith("OAR") else None
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return oar_worker_class(getattr(importlib.import_module(module), name[3:]))


def use_oar_workers(role_worker_mapping: dict) -> bool:
    """Runs the actor role of a verl trainer on its class with :class:`OARWorkerMixin` (:func:`oar_worker_class`:
    whichever ``ActorRolloutRefWorker`` subclass the trainer picked, e.g. verl's ``DetachActorWorker``).

    Args:
        role_worker_mapping: verl's ``{Role: ray.remote(worker class)}`` (modified in place; other roles are kept).

    Returns:
        True when the actor role has ``oar_scores`` afterwards; False when its class has none and is no
        ``ActorRolloutRefWorker`` subclass (left alone; the trainers refuse to start then, see
        :func:`require_oar_workers`).
    """
    import ray

    ok = False
    for role, cls in list(role_worker_mapping.items()):
        if str(role) not in ACTOR_ROLES:
            continue
        inner = getattr(cls, "__ray_actor_class__", cls)
        try:
            mixed = oar_worker_class(inner)
        except TypeError:
            continue
        if mixed is not inner:
            role_worker_mapping[role] = ray.remote(mixed)
        ok = True
    return ok


def require_oar_workers(config, role_worker_mapping: dict) -> bool:
    """:func:`use_oar_workers` at trainer start, refusing to start when the estimator scores on the workers
    (:func:`scores_on_workers`) and the actor role cannot get ``oar_scores``.

    Returns:
        Whether the actor role has ``oar_scores``.

    Raises:
        TypeError: the estimator needs the workers' scores, and the actor class (named) has no ``oar_scores`` and
            is no ``ActorRolloutRefWorker`` subclass.
    """
    if use_oar_workers(role_worker_mapping):
        return True
    if scores_on_workers(config):
        actors = [getattr(c, "__ray_actor_class__", c) for r, c in role_worker_mapping.items()
                  if str(r) in ACTOR_ROLES]
        if not actors:
            raise TypeError(f"algorithm.adv_estimator={_estimator_name(config)!r} scores on the actor workers, "
                            f"but the trainer has no actor role ({ACTOR_ROLES}) in "
                            f"{[str(r) for r in role_worker_mapping]}")
        try:
            oar_worker_class(actors[0])
        except TypeError as e:
            raise TypeError(f"algorithm.adv_estimator={_estimator_name(config)!r} scores on the actor workers: {e}") \
                from None
    return False


def wrap_init_workers(orig):
    """``RayPPOTrainer.init_workers`` (legacy trainer) with an OAR advantage estimator: first the start checks
    (:func:`start_checks`: the OAR config and :func:`check_trainer_config`; :func:`require_oar_workers`: ValueError /
    NotImplementedError / TypeError before verl starts any worker), then the actor role runs on its class plus :class:`OARWorkerMixin`, and the estimator gets a
    :class:`oar.integrations.verl.WorkerGroupScorer` of the trainer's actor worker group
    (:func:`oar.integrations.verl.context.set_trainer_scorer`). Idempotent: returns ``orig`` when it is already
    wrapped."""
    if getattr(orig, "__oar_wrapped__", False):
        return orig

    @functools.wraps(orig)
    def init_workers(self, *args, **kwargs):
        name = getattr(self.config.algorithm.adv_estimator, "value", self.config.algorithm.adv_estimator)
        if name not in ADV_ESTIMATORS:
            start_checks(self.config, oar_trainer=True)  # OAR keys with another estimator: refused
            return orig(self, *args, **kwargs)
        start_checks(self.config, oar_trainer=True)  # before any worker starts or any generation
        check_dataset_answers(self.config, getattr(self, "train_dataset", None),
                              tokenizer=getattr(self, "tokenizer", None))
        has_method = require_oar_workers(self.config, self.role_worker_mapping)
        out = orig(self, *args, **kwargs)
        if has_method:
            context.set_trainer_scorer(WorkerGroupScorer(self.actor_rollout_wg))
        return out

    init_workers.__oar_wrapped__ = True
    return init_workers


def _v1_rollouts(fields: TensorDict, answer_key: tuple[str, str]) -> Any:
    """verl's padded ``DataProto`` layout (prompts left-padded, responses right-padded, attention mask) of the
    v1 trainer's rollouts, read from the transfer queue's per-row (nested) ``prompts`` / ``responses`` /
    ``response_mask`` (and ``entropy``, written by verl's old-log-prob step, as ``oar_entropy`` (B, R))."""
    import numpy as np
    from verl import DataProto

    def rows(key):
        t = fields[key]
        return list(t.unbind(0)) if getattr(t, "is_nested", False) else list(t)

    prompts, responses, rmask = rows("prompts"), rows("responses"), rows("response_mask")
    B = len(prompts)
    P = max(1, max(int(p.numel()) for p in prompts))
    R = max(1, max(int(r.numel()) for r in responses))
    p_ids = torch.zeros((B, P), dtype=torch.int64)
    r_ids = torch.zeros((B, R), dtype=torch.int64)
    attn = torch.zeros((B, P + R), dtype=torch.int64)
    resp_mask = torch.zeros((B, R), dtype=torch.int64)
    for i in range(B):
        p, r = prompts[i].reshape(-1), responses[i].reshape(-1)
        p_ids[i, P - p.numel():] = p
        r_ids[i, : r.numel()] = r
        attn[i, P - p.numel(): P + r.numel()] = 1
        resp_mask[i, : r.numel()] = rmask[i].reshape(-1)[: r.numel()].to(torch.int64)
    tensors = {"prompts": p_ids, "responses": r_ids, "attention_mask": attn, "response_mask": resp_mask}
    if "entropy" in fields.keys():  # verl's own entropies of the old-log-prob step (methods entropy*)
        ent = torch.zeros((B, R), dtype=torch.float32)
        for i, e in enumerate(rows("entropy")):
            e = e.reshape(-1).float()
            ent[i, : min(e.numel(), R)] = e[:R]
        tensors["oar_entropy"] = ent
    non_tensors = {}
    if answer_key[0] in fields.keys():
        non_tensors[answer_key[0]] = np.array(list(fields[answer_key[0]].tolist()), dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


#: The CPU slot of verl's ``DetachActorWorker`` where oar keeps the weights of the start of a parameter-sync cycle
#: when verl keeps none (``algorithm.rollout_correction.bypass_mode``: verl's pi_old is the rollout's log-probs).
PI_OLD_SLOT = "oar_pi_old"
#: The slot holding the current weights while the workers score with pi_old (cleared after).
CURRENT_SLOT = "oar_current"


def _bypass_mode(config) -> bool:
    rc = config.algorithm.get("rollout_correction", None) if hasattr(config.algorithm, "get") else None
    return bool(rc and rc.get("bypass_mode", False))


class _PiOldScorer:
    """A :class:`oar.integrations.verl.WorkerGroupScorer` that scores with the weights of CPU slot ``slot`` of
    verl's ``DetachActorWorker`` (pi_old) and puts the current weights back after, the sequence verl's
    separate-async ``_compute_old_log_prob`` runs (verl 0.9.1 ``trainer_separate_async.py:187-211``): save the
    current weights, restore pi_old, compute, restore the current weights, clear their copy."""

    def __init__(self, scorer, wg, slot):
        self.scorer, self.wg, self.slot = scorer, wg, slot

    def __getattr__(self, name):  # last_info, answer_key, ...: the wrapped scorer's
        if name == "scorer":  # not set yet (copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scorer, name)

    def __call__(self, data, config, seq_adv):
        from oar.pipeline import scored_rows

        if not scored_rows(seq_adv, config.credit_rows):  # nothing goes to the workers: no weights to swap
            return self.scorer(data, config, seq_adv)
        self.wg.save_model_to_cpu(CURRENT_SLOT)
        try:
            self.wg.restore_model_from_cpu(self.slot)
            return self.scorer(data, config, seq_adv)
        finally:
            try:
                self.wg.restore_model_from_cpu(CURRENT_SLOT)
            finally:
                self.wg.clear_cpu_model(CURRENT_SLOT)


class OARTrainerMixin:
    """verl v1 trainer extension (``trainer.v1.trainer_mode=oar_sync``, ...): OAR scores on the actor workers.

    * ``__init__``: the trainer of ``oar_<mode>`` is verl's trainer of ``<mode>`` (:attr:`oar_base_mode`) and must
      behave exactly as it: verl decides its parameter sync, replay buffer, data-loader refill, checkpointed
      transfer queue and staleness from the literal ``trainer.v1.trainer_mode`` (verl 0.9.1 ``trainer_base.py``
      lines 129-130, 153-157, 731, 902, 912, 1004, 1499; ``utils/skip/rollout_skip.py:189``), so the config's
      ``trainer_mode`` is set to ``<mode>`` before verl reads it (the trainer's class stays the OAR one). The
      ``oar`` section of verl's config (``+oar.probe=answer_mean``) is read and checked
      (:func:`oar.integrations.verl.estimators.use_trainer_config`), and the start checks run
      (:func:`check_trainer_config`): everything is refused here, before any worker or generation.
    * ``_init_resource_pool_mgr``: refuses what the workers cannot serve (:func:`check_trainer_config`, before
      verl's own), then the actor role runs on the class verl's trainer picked plus :class:`OARWorkerMixin`
      (:func:`require_oar_workers`; TypeError when that class cannot get it).
    * ``_compute_advantage``: for an OAR advantage estimator (``algorithm.adv_estimator`` in
      :data:`oar.integrations.verl.ADV_ESTIMATORS`), reads the rollouts of the batch from the transfer queue (prompts,
      responses, response mask and, for ``oar_p`` / ``oar_g``, the answers under ``reward_model``) and runs verl's
      own ``_compute_advantage`` with them, the rows' session keys (``batch.keys``: group statistics over each
      agent session's final output, as verl's GRPO) and a :class:`oar.integrations.verl.WorkerGroupScorer` of the
      actor worker group visible to the estimator. The old log-probs were computed before (the behaviour policy);
      the estimator sends only the rows with a non-zero sequence advantage to the workers.
    """

    #: where the reference answers are (``reward_model.ground_truth``, verl's RL datasets)
    oar_answer_key: tuple[str, str] = ("reward_model", "ground_truth")
    #: verl's trainer mode this trainer extends (set per registered class by :func:`register_trainers`)
    oar_base_mode: str = "sync"

    def __init__(self, config, *args, **kwargs):
        start_checks(config, oar_trainer=True)
        v1 = config.trainer.v1
        mode = str(v1.get("trainer_mode", ""))
        if mode not in (self.oar_base_mode, f"oar_{self.oar_base_mode}"):
            raise ValueError(f"{type(self).__name__} is the OAR trainer of verl's trainer mode "
                             f"{self.oar_base_mode!r}: trainer.v1.trainer_mode must be 'oar_{self.oar_base_mode}', "
                             f"got {mode!r}")
        own = f"oar_{self.oar_base_mode}"
        if v1.get(own, None):
            raise ValueError(f"trainer.v1.{own} is not read by verl: the OAR trainer of mode {self.oar_base_mode!r} "
                             f"runs verl's trainer of that mode, which reads trainer.v1.{self.oar_base_mode}; move "
                             f"these keys there: {list(v1.get(own))}")
        if mode != self.oar_base_mode:
            from omegaconf import read_write

            with read_write(v1):
                v1.trainer_mode = self.oar_base_mode  # what verl reads to decide the mode's behaviour
            _REWRITTEN[id(config)] = own
            import logging

            logging.getLogger(__name__).info(
                "oar: trainer.v1.trainer_mode=%s runs verl's %r trainer with OAR scores on the actor workers "
                "(trainer.v1.trainer_mode is now %r, as verl reads it)", own, self.oar_base_mode, self.oar_base_mode)
        super().__init__(config, *args, **kwargs)

    def _oar_scorer(self, method: str):
        """The worker-group scorer of this advantage step, scoring with the weights verl computed this mini-batch's
        old log-probs with (pi_old, the weights of GRPO's ratio denominator). verl's separate-async trainer with
        ``parameter_sync_step`` > 1 updates the actor after each mini-batch while the rollouts come from the
        weights of the cycle's start: from the second mini-batch on (``local_trigger_step`` >= 1) the workers
        score with those (verl's CPU slot 0; with ``rollout_correction.bypass_mode`` verl keeps none, so oar
        saves them at the cycle's first mini-batch, :data:`PI_OLD_SLOT`). Elsewhere the actor's current weights
        are pi_old (verl's base ``_compute_old_log_prob`` uses them)."""
        from oar.methods import method_spec

        scorer = WorkerGroupScorer(self.actor_rollout_wg, self.oar_answer_key)
        cycle = int(getattr(self, "parameter_sync_step", 1) or 1)
        k = int(getattr(self, "local_trigger_step", 0) or 0)
        if cycle <= 1 or not method_spec(method).needs_model or not _separate_async(self):
            return scorer
        bypass = _bypass_mode(self.config)
        if k == 0:
            if bypass:  # the weights at the cycle's start are the rollouts' (verl keeps no copy in bypass mode)
                self.actor_rollout_wg.save_model_to_cpu(PI_OLD_SLOT)
            return scorer
        return _PiOldScorer(scorer, self.actor_rollout_wg, PI_OLD_SLOT if bypass else 0)

    def _init_dataloader(self):
        super()._init_dataloader()  # verl's: the train dataset, before any worker or generation (trainer.init())
        check_dataset_answers(self.config, getattr(self, "train_dataset", None), self.oar_answer_key,
                              tokenizer=getattr(self, "tokenizer", None))

    def _init_resource_pool_mgr(self):
        check_trainer_config(self.config)  # before any worker starts or any generation
        super()._init_resource_pool_mgr()  # verl's trainer of the mode picks the actor class (separate_async: its own)
        require_oar_workers(self.config, self.role_worker_mapping)

    def _compute_advantage(self, batch, metrics: dict):
        name = getattr(self.config.algorithm.adv_estimator, "value", self.config.algorithm.adv_estimator)
        if name not in ADV_ESTIMATORS:
            return super()._compute_advantage(batch, metrics)
        import transfer_queue as tq

        from oar.methods import method_spec

        select = ["prompts", "responses", "response_mask"]
        spec = method_spec(estimator_config(name).method)
        if spec.needs_answers:
            select.append(self.oar_answer_key[0])
        if spec.credit.name == "add" and spec.needs_model:  # entropy / entropy_shaping: verl's own entropies
            select.append("entropy")
        try:
            fields = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=select)
        except ValueError as e:
            raise ValueError(f"OAR trainer: cannot read the rollouts' fields {select} from the transfer queue "
                             f"(the reference answers are read from the dataset field {self.oar_answer_key[0]!r}"
                             f"[{self.oar_answer_key[1]!r}]): {e}") from e
        rollouts = _v1_rollouts(fields, self.oar_answer_key)
        scorer = self._oar_scorer(spec.name)
        # verl's v1 GRPO takes the group statistics from each agent session's final output (the keys say which)
        with context.advantage_call(rollouts=rollouts, scorer=scorer, sessions=list(batch.keys)):
            return super()._compute_advantage(batch, metrics)


def register_trainers() -> list[str]:
    """Registers one OAR trainer per verl v1 trainer mode with verl's ``register_trainer`` (idempotent):
    ``oar_<mode>`` = ``(OARTrainerMixin, verl's trainer of <mode>)``.

    Returns:
        The registered names (``oar_sync``, ``oar_colocate_async``, ``oar_separate_async`` in verl 0.9.1).
    """
    from verl.trainer.ppo.v1 import trainer_base

    names = []
    for mode, base in list(trainer_base.TRAINER_REGISTRY.items()):
        if mode.startswith("oar_") or issubclass(base, OARTrainerMixin):
            continue
        name = f"oar_{mode}"
        if name not in trainer_base.TRAINER_REGISTRY:
            cls = type(f"OAR{base.__name__}", (OARTrainerMixin, base), {
                "__module__": __name__, "oar_base_mode": mode,
                "__doc__": f"verl's {base.__name__} (trainer mode {mode!r}) with :class:`OARTrainerMixin`."})
            globals()[cls.__name__] = cls  # importable by name (Ray pickles classes by reference)
            trainer_base.register_trainer(name)(cls)
        names.append(name)
    return names
