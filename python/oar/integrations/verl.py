"""verl integration: OAR advantage estimators in verl's registry (docs/trainers.md, verl; docs/trainers/verl.md).

Tested against verl 0.9.1 (``verl/trainer/ppo/core_algos.py``, ``verl/trainer/ppo/ray_trainer.py``,
``verl/trainer/ppo/v1``). :func:`register` (called by the opt-in ``verl.plugins`` entry point,
:mod:`oar.integrations.verl_plugin`, when ``$OAR_VERL_PLUGIN=1``)

1. registers one advantage estimator per OAR method (:data:`ESTIMATORS`: ``oar_p``, ``oar_g``, ``oar_grpo``,
   ``oar_dr_grpo``, ``oar_random``, ``oar_entropy``, ``oar_entropy_shaping``, ``oar_ktae``, and ``oar``, whose
   method comes from the config) with ``core_algos.register_adv_est``; select one with
   ``algorithm.adv_estimator=oar_g``;
2. registers the OAR v1 trainers (``trainer.v1.trainer_mode=oar_sync`` etc.,
   :mod:`oar.integrations.verl_workers`), which compute ``oar_p`` / ``oar_g`` scores on the actor workers;
3. wraps ``ray_trainer.compute_advantage``: verl passes custom estimators only ``token_level_rewards``,
   ``response_mask``, ``index`` and ``config``, so per-token scores cannot reach them as arguments. The wrapper
   makes the whole ``DataProto`` (prompts, responses, ground truths, attached scores) and the actor worker group
   visible to the OAR estimator for the duration of the call (context variables; nothing is global across calls);
4. wraps the legacy trainer's ``RayPPOTrainer.init_workers`` (actor role on the OAR worker class, worker group
   recorded for the estimator) and ``RayPPOTrainer._compute_old_log_prob`` (keeps the policy entropies verl
   computes there, and then drops, on the batch as ``oar_entropy``; methods ``entropy`` and ``entropy_shaping``).

The estimator computes verl's own GRPO sequence advantages (preset ``verl``: unbiased std, eps = the
``epsilon`` argument, singleton = mean 0 / std 1; ``norm_adv_by_std_in_grpo=False`` or method ``dr_grpo``: no std
scaling) over the groups given by ``index`` (in any row order), then per-token advantages, and returns them as
both advantages and returns (B, R). Only ``batch["advantages"]`` reaches the actor loss.

Scores for ``oar_p`` / ``oar_g`` (and ``random`` / ``entropy``, which need the reasoning span) come from, in
order: ``batch["oar_scores"]`` + ``batch["oar_reasoning_mask"]`` attached earlier (:func:`attach_scores`), the
scorer set with :func:`configure` (:class:`HFScorer` runs a Hugging Face policy held by the driver process), or
the actor worker group of the running OAR trainer (:class:`WorkerGroupScorer`).

Config: :func:`configure` in the driver process, else ``$OAR_CONFIG`` (JSON or a JSON/YAML file; set it in
the Ray runtime env so the TaskRunner sees it); the estimator name overrides ``method``.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable

import torch

from oar.integrations._common import config_from_env
from oar.pipeline import Pipeline, RolloutBatch, with_method
from oar.schema import OARConfig

SUPPORTED_VERL = ("0.9.1",)

#: verl estimator name -> OAR method ("oar": the configured method).
ESTIMATORS: dict[str, str | None] = {
    "oar": None,
    "oar_p": "oar_p",
    "oar_g": "oar_g",
    "oar_grpo": "grpo",
    "oar_dr_grpo": "dr_grpo",
    "oar_random": "random",
    "oar_entropy": "entropy",
    "oar_entropy_shaping": "entropy_shaping",
    "oar_ktae": "ktae",
}

_DATA: contextvars.ContextVar = contextvars.ContextVar("oar_verl_data", default=None)
#: The rollouts (prompts, responses, masks, answers) of the current ``compute_advantage`` call in verl's padded
#: layout, when the batch itself lacks them (the v1 trainer's batch holds only the reward fields).
_EXTRA: contextvars.ContextVar = contextvars.ContextVar("oar_verl_rollouts", default=None)
#: The scorer of the current call on the actor worker group (:class:`WorkerGroupScorer`), set by the OAR trainers.
_WORKERS: contextvars.ContextVar = contextvars.ContextVar("oar_verl_workers", default=None)
_STATE: dict[str, Any] = {"config": None, "scorer": None, "ignore_ids": (), "pipelines": {}, "workers": None,
                          "trainers": [], "trainers_error": None}
_REGISTERED: dict[str, Any] = {}


def configure(config=None, scorer: Callable | None = None, ignore_ids=()) -> None:
    """Sets the driver-side OAR config and scorer used by the registered estimators.

    Args:
        config: ``oar.OARConfig`` (``None``: ``$OAR_CONFIG`` or the defaults). The estimator name overrides its
            method unless the estimator is ``oar``.
        scorer: callable ``(data: verl.DataProto, config, seq_adv: (B,) float32) -> (scores (B, R) float >= 0,
            reasoning_mask (B, R) bool)``, e.g. :class:`HFScorer`.
        ignore_ids: token ids KTAE scores 0 (the tokenizer's EOS / PAD), a sequence of ints.

    Raises:
        ValueError: ``config`` not an ``oar.OARConfig`` / None, ``scorer`` not callable / None, ``ignore_ids`` not a
            sequence of ints (checked here, not at the first training step).
    """
    from oar import _args

    if config is not None and not isinstance(config, OARConfig):
        raise ValueError(f"config must be an oar.OARConfig or None, got {type(config).__name__} "
                         "(build one with oar.OARConfig(method=..., ...))")
    if scorer is not None and not callable(scorer):
        raise ValueError(f"scorer must be callable (data, config, seq_adv) -> (scores, reasoning_mask) or None, "
                         f"got {type(scorer).__name__}")
    if isinstance(ignore_ids, (str, bytes, torch.Tensor)) or not hasattr(ignore_ids, "__iter__"):
        raise ValueError(f"ignore_ids must be a sequence of int token ids, got {type(ignore_ids).__name__} {ignore_ids!r}")
    ids = tuple(_args.int_arg("ignore_ids[i]", x) for x in ignore_ids)
    _STATE.update(config=config, scorer=scorer, ignore_ids=ids, pipelines={})


def _pipeline(config) -> Pipeline:
    """The driver's pipeline of ``config`` (cached: random draws advance from step to step)."""
    key = config.to_json()
    if key not in _STATE["pipelines"]:
        _STATE["pipelines"][key] = Pipeline(config, ignore_ids=_STATE["ignore_ids"])
    return _STATE["pipelines"][key]


def _masks(b, R: int, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(completion_mask, eligible_mask), both (B, R) bool CPU: every response token (the attention mask's response
    part, tool outputs of multi-turn rollouts included: they are part of the context) and the tokens that carry
    the loss (``response_mask``, which excludes tool outputs)."""
    eligible = response_mask.detach().bool().cpu()
    attn = b["attention_mask"] if b is not None and "attention_mask" in b.keys() else None
    completion = attn[:, -R:].detach().bool().cpu() | eligible if attn is not None else eligible
    return completion, eligible


def attach_scores(data, scores: torch.Tensor, reasoning_mask: torch.Tensor) -> None:
    """Attaches per-token importance scores to a verl ``DataProto`` (``batch["oar_scores"]``, ``["oar_reasoning_mask"]``).

    Args:
        data: ``verl.DataProto`` with ``batch["responses"]`` (B, R).
        scores: (B, R) real, >= 0 on the reasoning mask (raw importance; normalized by the reshaping).
        reasoning_mask: (B, R) bool, the scored reasoning tokens.

    Raises:
        ValueError: shapes that are not the responses' (B, R), tensors on the meta device, complex or bool
            scores, a reasoning_mask that is not bool or 0/1, scores that are NaN/Inf or < 0 on the reasoning mask.
        KeyError: ``data`` without ``batch["responses"]``.
    """
    batch = getattr(data, "batch", None)
    if batch is None or "responses" not in batch.keys():
        raise KeyError(f"data must be a verl DataProto with batch['responses'] (B, R), got {type(data).__name__}"
                       + ("" if batch is None else f" with batch keys {sorted(batch.keys())}"))
    shape = tuple(batch["responses"].shape)
    for name, t in (("scores", scores), ("reasoning_mask", reasoning_mask)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be (B, R) = {shape} like batch['responses'], got {got}")
        if t.device.type == "meta":
            raise ValueError(f"{name} must hold data, got a tensor on the meta device")
    if scores.dtype.is_complex or scores.dtype == torch.bool:
        raise ValueError(f"scores must be real importance values, got dtype {scores.dtype}")
    if reasoning_mask.dtype != torch.bool and not bool(((reasoning_mask == 0) | (reasoning_mask == 1)).all()):
        raise ValueError("reasoning_mask must be bool or 0/1, got other values")
    rm = reasoning_mask.detach().bool()
    s = scores.detach().float()
    bad = rm & ~(torch.isfinite(s) & (s >= 0))
    if bool(bad.any()):
        i, j = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(f"scores must be finite and >= 0 on reasoning_mask, got scores[{i}, {j}] = {float(s[i, j])}")
    data.batch["oar_scores"] = s
    data.batch["oar_reasoning_mask"] = rm


def rollout_rows(data, config, answer_key: tuple[str, str] = ("reward_model", "ground_truth")) -> dict:
    """The rollouts of a verl ``DataProto`` in verl's padded layout, as the pipeline reads them.

    Args:
        data: ``verl.DataProto`` with ``batch["prompts"]`` (B, P) left-padded, ``["responses"]`` (B, R)
            right-padded, ``["attention_mask"]`` (B, P + R), ``["response_mask"]`` (B, R) and, for methods that need
            reference answers, ``non_tensor_batch[answer_key[0]][i][answer_key[1]]``.
        config: ``oar.OARConfig`` (its method decides whether answers are needed).

    Returns:
        ``{"prompt_ids": B 1-D int64 tensors (unpadded), "responses": (B, R) int64, "completion_mask": (B, R) bool,
        "eligible_mask": (B, R) bool, "answers": B str or None}``, all on the CPU.

    Raises:
        KeyError: a missing batch key, or answers missing for ``oar_p`` / ``oar_g`` (naming the rows).
        ValueError: no ``non_tensor_batch[answer_key[0]]`` for a method that needs answers.
    """
    from oar.pipeline import method_spec

    b = data.batch
    for key in ("prompts", "responses", "attention_mask", "response_mask"):
        if key not in b.keys():
            raise KeyError(f"data.batch must hold {key!r} (verl's padded rollout layout), got keys {sorted(b.keys())}")
    responses = b["responses"].detach().cpu()
    R = responses.shape[1]
    completion, eligible = _masks(b, R, b["response_mask"])
    P = b["prompts"].shape[1]
    pmask = b["attention_mask"][:, :P].bool().cpu()
    prompt_ids = [row[m] for row, m in zip(b["prompts"].detach().cpu(), pmask)]
    answers = None
    if method_spec(config.method).needs_answers:
        k0, k1 = answer_key
        if k0 not in data.non_tensor_batch:
            raise ValueError(f"method {config.method!r} needs the reference answers in non_tensor_batch[{k0!r}]"
                             f"[i][{k1!r}] (answer_key=... to change)")
        raw = [x.get(k1) if isinstance(x, dict) else x for x in data.non_tensor_batch[k0]]
        missing = [i for i, x in enumerate(raw) if x is None]
        if missing:
            raise KeyError(f"method {config.method!r} needs the reference answers in non_tensor_batch[{k0!r}]"
                           f"[i][{k1!r}]; rows {missing[:5]} have none (answer_key=... to change)")
        answers = [str(x) for x in raw]
    return dict(prompt_ids=prompt_ids, responses=responses, completion_mask=completion, eligible_mask=eligible,
                answers=answers)


class HFScorer:
    """Importance scores of a verl batch from a Hugging Face policy held by this (driver) process.

    Args:
        tokenizer: the policy's tokenizer (reasoning span, probe context).
        model: HF causal LM (``None`` is enough for ``random``, and for ``entropy`` when the batch carries
            ``oar_entropy``).
        answer_key: where the reference answer is: ``non_tensor_batch[answer_key[0]][i][answer_key[1]]`` (verl's
            RL datasets: ``reward_model.ground_truth``).

    Calling it with ``(data, config, seq_adv)`` returns ``(scores, reasoning_mask)``, both (B, R) (rows with
    seq_adv == 0 are not scored). For ``oar_p`` / ``oar_g`` a row without an answer (no key, or None) raises
    KeyError instead of probing a placeholder. On verl's actor workers use :class:`WorkerGroupScorer` instead
    (the policy's own weights, sharded as verl holds them).
    """

    def __init__(self, tokenizer, model=None, answer_key: tuple[str, str] = ("reward_model", "ground_truth")):
        self.tokenizer = tokenizer
        self.model = model
        self.answer_key = answer_key
        self._pipelines: dict = {}

    def _pipeline(self, config) -> Pipeline:
        key = config.to_json()
        if key not in self._pipelines:
            self._pipelines[key] = Pipeline(config, self.tokenizer)
        return self._pipelines[key]

    def __call__(self, data, config, seq_adv: torch.Tensor):
        rows = rollout_rows(data, config, self.answer_key)
        b = data.batch
        entropy = b["oar_entropy"] if "oar_entropy" in b.keys() else None  # read by the entropy methods only
        batch = RolloutBatch(rows["responses"], rows["completion_mask"], prompt_ids=rows["prompt_ids"],
                             eligible_mask=rows["eligible_mask"], answers=rows["answers"],
                             sequence_advantages=seq_adv.float().cpu(), entropy=entropy)
        res = self._pipeline(config).scores(batch, self.model)
        return res.scores, res.reasoning_mask


class WorkerGroupScorer:
    """Importance scores of a verl batch computed on verl's actor worker group (the policy that generated the
    rollouts, as verl's FSDP / FSDP2 engine holds it).

    Args:
        worker_group: verl ``RayWorkerGroup`` of :class:`oar.integrations.verl_workers.OARActorRolloutRefWorker`
            (or any ``ActorRolloutRefWorker`` subclass with :class:`~oar.integrations.verl_workers.OARWorkerMixin`).
        answer_key: as :class:`HFScorer`.

    Calling it with ``(data, config, seq_adv)`` sends only the rows with ``seq_adv != 0`` to the workers
    (:func:`oar.integrations.verl_workers.scores_request`: contiguous chunks, one per data-parallel rank, padded
    with unscored rows to a multiple of the data-parallel size), calls the workers' ``oar_scores`` through verl's
    dispatch, and returns ``(scores (B, R) float32, reasoning_mask (B, R) bool)`` on the CPU in ``data``'s row
    order (0 / False on the rows not sent). ``last_info["memory_budget_mb"]``: the activation budget the workers
    used (the config's, capped by verl's own old-log-prob token budget).

    Raises:
        AttributeError: the worker group has no ``oar_scores`` method (verl's plain worker class).
    """

    def __init__(self, worker_group, answer_key: tuple[str, str] = ("reward_model", "ground_truth")):
        self.worker_group = worker_group
        self.answer_key = answer_key
        self.calls = 0
        self.last_info: dict = {}

    def __call__(self, data, config, seq_adv: torch.Tensor):
        from oar.integrations import verl_workers

        rows = rollout_rows(data, config, self.answer_key)
        self.calls += 1
        self.last_info = {"memory_budget_mb": None}
        return verl_workers.group_scores(self.worker_group, rows, config, seq_adv, info=self.last_info)


def estimator_config(name: str):
    """The ``oar.OARConfig`` a registered estimator runs: :func:`configure`'s config, else ``$OAR_CONFIG``, with the
    estimator's method (:data:`ESTIMATORS`; ``oar`` keeps the config's method).

    Raises:
        KeyError: ``name`` is not one of :data:`ESTIMATORS`. ValueError: an invalid ``$OAR_CONFIG``.
    """
    if name not in ESTIMATORS:
        raise KeyError(f"not an OAR estimator: {name!r} (one of {sorted(ESTIMATORS)})")
    base = _STATE["config"] if _STATE["config"] is not None else config_from_env()
    method = ESTIMATORS[name]
    return with_method(base, method) if method is not None else base


def _estimator(name: str, method: str | None):
    def estimator(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None, epsilon: float = 1e-6,
                  norm_adv_by_std_in_grpo: bool = True, config=None, **kwargs):
        """OAR advantage estimator for verl (registered by oar.integrations.verl.register).

        Args:
            token_level_rewards: (bs, R) float, the outcome reward summed over the response is the sequence reward.
            response_mask: (bs, R) 0/1.
            index: (bs,) group ids (verl's ``uid``), rows of a group in any order. Required.
            epsilon: std epsilon (verl's default 1e-6). norm_adv_by_std_in_grpo: False = no std scaling.
            config: verl's AlgoConfig (read for ``norm_adv_by_std_in_grpo`` when present).

        Returns:
            ``(advantages, returns)``: both the (bs, R) float32 per-token advantages, on the rewards' device.

        Raises:
            ValueError: no ``index`` or one of another length than the batch; token_level_rewards not 2-D;
                a method whose inputs (scores, entropies, responses) are not available.
        """
        from oar import _args, ops

        if index is None:
            raise ValueError(f"verl estimator {name!r} needs the group ids (index = non_tensor_batch['uid'])")
        if not isinstance(token_level_rewards, torch.Tensor) or token_level_rewards.dim() != 2:
            got = tuple(token_level_rewards.shape) if isinstance(token_level_rewards, torch.Tensor) else \
                type(token_level_rewards).__name__
            raise ValueError(f"token_level_rewards must be a (bs, R) tensor, got {got}")
        B, R = token_level_rewards.shape
        if len(index) != B:
            raise ValueError(f"index must hold one group id per row: (bs,) = ({B},), got {len(index)} ids")
        epsilon = _args.float_arg("epsilon", epsilon)
        if tuple(response_mask.shape) != (B, R):
            raise ValueError(f"response_mask must be (bs, R) = {(B, R)}, got {tuple(response_mask.shape)}")
        cfg = estimator_config(name)
        if config is not None and hasattr(config, "get"):
            norm_adv_by_std_in_grpo = bool(config.get("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo))
        data = _DATA.get()
        # the rollouts in verl's padded layout: the batch itself (legacy trainer), or the one the OAR v1 trainer
        # rebuilt from the transfer queue (verl's v1 trainer hands the estimator only the reward fields)
        extra = _EXTRA.get()
        src = extra if extra is not None else data
        if extra is not None and len(extra) != B:
            raise ValueError(f"verl estimator {name!r}: the rollouts of this call hold {len(extra)} rows, the "
                             f"rewards {B}")
        batches = [d.batch for d in (data, extra) if d is not None]

        def get(key):
            for bb in batches:
                if key in bb.keys():
                    return bb[key]
            return None

        # verl's own GRPO sequence advantages over the groups of `index`, in any row order
        rewards = token_level_rewards.detach().sum(-1).float().cpu()
        estimator = "dr_grpo" if (cfg.advantages.estimator == "dr_grpo" or not norm_adv_by_std_in_grpo) else "grpo"
        seq = ops.group_advantages(rewards, group_ids=list(index), estimator=estimator, std="unbiased",
                                   eps=float(epsilon), singleton="verl")
        completion, eligible = _masks(src.batch if src is not None else None, R, response_mask)
        responses = get("responses")
        pipe = _pipeline(cfg)
        if pipe.method.needs_groups and responses is None:
            raise ValueError(f"verl estimator {name!r} (method {cfg.method!r}) needs batch['responses'] (call through "
                             "verl.trainer.ppo.ray_trainer.compute_advantage after oar.integrations.verl.register())")
        batch = RolloutBatch(responses.cpu() if responses is not None else torch.zeros((B, R), dtype=torch.long),
                             completion, eligible_mask=eligible, rewards=rewards, group_ids=list(index),
                             sequence_advantages=seq)
        batch.entropy = get("oar_entropy")  # verl's own entropies, read by the entropy methods only
        if pipe.method.credit == "add" and pipe.method.needs_model and batch.entropy is None:
            raise ValueError(f"verl estimator {name!r} (method {cfg.method!r}) needs batch['oar_entropy'] (kept by "
                             "the plugin's RayPPOTrainer._compute_old_log_prob wrapper)")
        if pipe.method.credit == "reshape":
            scores, reasoning = get("oar_scores"), get("oar_reasoning_mask")
            if scores is None or reasoning is None:
                scorer = _STATE["scorer"] if _STATE["scorer"] is not None else _WORKERS.get()
                if scorer is None or src is None:
                    raise ValueError(
                        f"verl estimator {name!r} (method {cfg.method!r}) needs per-token scores: run verl with the "
                        "OAR trainer (trainer.v1.trainer_mode=oar_sync; legacy trainer: oar.integrations.verl."
                        "register() in the TaskRunner), attach them with oar.integrations.verl.attach_scores(batch, "
                        "scores, reasoning_mask) before compute_advantage, or configure(scorer=HFScorer(tokenizer, "
                        "model)) in the driver process")
                scores, reasoning = scorer(src, cfg, seq)
            batch.scores, batch.reasoning_mask = scores, reasoning
        tok = pipe.compute(batch).advantages.to(token_level_rewards.device)
        return tok, tok

    estimator.__name__ = f"compute_{name}_advantage"
    estimator.__qualname__ = estimator.__name__
    return estimator


def _wrap_compute_advantage(orig):
    if getattr(orig, "__oar_wrapped__", False):
        return orig

    @functools.wraps(orig)
    def compute_advantage(data, adv_estimator, *args, **kwargs):
        name = getattr(adv_estimator, "value", adv_estimator)
        if name not in ESTIMATORS:
            return orig(data, adv_estimator, *args, **kwargs)
        token = _DATA.set(data)
        # the legacy trainer's actor worker group (recorded by the init_workers wrapper), unless an OAR v1 trainer
        # already set this call's scorer
        workers = _STATE.get("workers")
        wtoken = _WORKERS.set(workers) if _WORKERS.get() is None and workers is not None else None
        try:
            return orig(data, adv_estimator, *args, **kwargs)
        finally:
            if wtoken is not None:
                _WORKERS.reset(wtoken)
            _DATA.reset(token)

    compute_advantage.__oar_wrapped__ = True
    return compute_advantage


def _wrap_init_workers(orig):
    """``RayPPOTrainer.init_workers`` (legacy trainer) with an OAR estimator: the actor role runs on
    :class:`oar.integrations.verl_workers.OARActorRolloutRefWorker`, and the estimator gets a
    :class:`WorkerGroupScorer` of the trainer's actor worker group."""
    if getattr(orig, "__oar_wrapped__", False):
        return orig

    @functools.wraps(orig)
    def init_workers(self, *args, **kwargs):
        name = getattr(self.config.algorithm.adv_estimator, "value", self.config.algorithm.adv_estimator)
        if name not in ESTIMATORS:
            return orig(self, *args, **kwargs)
        from oar.integrations import verl_workers

        has_method = verl_workers.use_oar_workers(self.role_worker_mapping)
        out = orig(self, *args, **kwargs)
        if has_method:
            _STATE["workers"] = WorkerGroupScorer(self.actor_rollout_wg)
        return out

    init_workers.__oar_wrapped__ = True
    return init_workers


def _wrap_compute_old_log_prob(orig):
    if getattr(orig, "__oar_wrapped__", False):
        return orig

    @functools.wraps(orig)
    def _compute_old_log_prob(self, batch, *args, **kwargs):
        out = orig(self, batch, *args, **kwargs)
        old = out[0] if isinstance(out, tuple) else out
        try:
            ent = old.batch["entropys"]
        except (AttributeError, KeyError, TypeError):
            ent = None
        if ent is not None:  # verl pops "entropys" after logging; keep a copy for the OAR entropy methods
            batch.batch["oar_entropy"] = ent.detach().float().clone()
        return out

    _compute_old_log_prob.__oar_wrapped__ = True
    return _compute_old_log_prob


def register() -> list[str]:
    """Registers the OAR estimators and v1 trainers with verl and installs the wrappers (idempotent).

    Returns:
        The registered estimator names (:data:`ESTIMATORS`). The v1 trainers registered (``oar_sync``, ...) are
        in ``_STATE["trainers"]`` (empty, with the reason in ``_STATE["trainers_error"]``, when verl's v1 trainer
        cannot be imported, e.g. without the TransferQueue package).

    Raises:
        ImportError: verl is not installed. RuntimeError: the verl version lacks the hook points.
    """
    import warnings

    try:
        import verl
        from verl.trainer.ppo import core_algos
    except ImportError as e:
        raise ImportError("oar.integrations.verl needs the `verl` package (pip install 'oar[verl]')") from e
    version = getattr(verl, "__version__", "?")
    for attr in ("register_adv_est", "get_adv_estimator_fn", "ADV_ESTIMATOR_REGISTRY"):
        if not hasattr(core_algos, attr):
            raise RuntimeError(f"verl {version}: core_algos has no {attr}; oar supports verl {SUPPORTED_VERL}")
    if version not in SUPPORTED_VERL:
        warnings.warn(f"oar.integrations.verl is tested with verl {SUPPORTED_VERL}, found {version}", stacklevel=2)
    for name, method in ESTIMATORS.items():
        if name not in _REGISTERED:
            _REGISTERED[name] = _estimator(name, method)
        if core_algos.ADV_ESTIMATOR_REGISTRY.get(name) is not _REGISTERED[name]:
            core_algos.register_adv_est(name)(_REGISTERED[name])
    from verl.trainer.ppo import ray_trainer

    ray_trainer.compute_advantage = _wrap_compute_advantage(ray_trainer.compute_advantage)
    trainer_cls = getattr(ray_trainer, "RayPPOTrainer", None)
    if trainer_cls is not None and hasattr(trainer_cls, "_compute_old_log_prob"):
        trainer_cls._compute_old_log_prob = _wrap_compute_old_log_prob(trainer_cls._compute_old_log_prob)
    if trainer_cls is not None and hasattr(trainer_cls, "init_workers"):
        trainer_cls.init_workers = _wrap_init_workers(trainer_cls.init_workers)
    try:  # verl's v1 trainers (need the transfer queue package) and the worker class
        from oar.integrations import verl_workers

        _STATE["trainers"] = verl_workers.register_trainers()
    except Exception as e:  # noqa: BLE001 - the estimators above work without them (e.g. verl without its extras)
        _STATE["trainers"] = []
        _STATE["trainers_error"] = f"{type(e).__name__}: {e}"
    import sys

    v1 = sys.modules.get("verl.trainer.ppo.v1.utils")  # binds compute_advantage by name at import
    if v1 is not None and hasattr(v1, "compute_advantage"):
        v1.compute_advantage = _wrap_compute_advantage(v1.compute_advantage)
    return list(ESTIMATORS)
