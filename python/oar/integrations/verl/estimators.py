"""verl integration, driver side: the OAR advantage estimators of verl's registry (docs/trainers/verl.md).

Tested against verl 0.9.1 (``verl/trainer/ppo/core_algos.py``, ``verl/trainer/ppo/ray_trainer.py``,
``verl/trainer/ppo/v1``). :func:`register_estimators` (called by :func:`oar.integrations.verl.register`)

1. registers one advantage estimator per OAR method (:data:`ADV_ESTIMATORS`: ``oar_p``, ``oar_g``, ``oar_grpo``,
   ``oar_dr_grpo``, ``oar_random``, ``oar_entropy``, ``oar_entropy_shaping``, ``oar_ktae``, and ``oar``, whose
   method comes from the config) with ``core_algos.register_adv_est``; select one with
   ``algorithm.adv_estimator=oar_g``;
2. wraps ``ray_trainer.compute_advantage``: verl passes custom estimators only ``token_level_rewards``,
   ``response_mask``, ``index`` and ``config``, so per-token scores cannot reach them as arguments. The wrapper
   makes the whole ``DataProto`` (prompts, responses, ground truths, attached scores) and the actor worker group
   visible to the OAR estimator for the duration of the call (:mod:`oar.integrations.verl.context`);
3. wraps the legacy trainer's ``RayPPOTrainer._compute_old_log_prob`` (keeps the policy entropies verl computes
   there, and then drops, on the batch as ``oar_entropy``; methods ``entropy`` and ``entropy_shaping``).

The estimator computes verl's own GRPO sequence advantages (preset ``verl``: unbiased std, eps = the
``epsilon`` argument, singleton = mean 0 / std 1; ``norm_adv_by_std_in_grpo=False`` or oar's estimator
``dr_grpo``: no std scaling) over the groups given by ``index`` (in any row order), then per-token advantages,
and returns them as both advantages and returns (B, R). Only ``batch["advantages"]`` reaches the actor loss.

Scores for ``oar_p`` / ``oar_g`` (and ``random`` / ``entropy``, which need the reasoning span) come from, in
order: ``batch["oar_scores"]`` + ``batch["oar_reasoning_mask"]`` attached earlier
(:func:`oar.integrations.verl.attach_scores`), the scorer set with :func:`configure` (:class:`HFScorer` runs a
Hugging Face policy held by the driver process), or the actor worker group of the running OAR trainer
(:class:`oar.integrations.verl.WorkerGroupScorer`, set in the call's context by :mod:`oar.integrations.verl.workers`).

Config: :func:`configure` in the driver process, else the ``oar`` section of verl's own config
(``+oar.probe=answer_mean`` on the command line, :func:`use_trainer_config`), else ``$OAR_CONFIG`` (JSON or a
JSON/YAML file, in the Ray runtime env); the advantage estimator's name overrides ``method``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from oar import pipeline_cache
from oar.integrations._config_env import config_from_env
from oar.integrations.verl import context
from oar.integrations.verl.rollouts import response_masks, rollout_rows
from oar.batch import RolloutBatch
from oar.schema import METHODS, config_arg, with_method

#: verl versions the tests ran (the tested range, which pyproject's ``oar[verl]`` extra installs, is
#: :data:`oar.integrations._versions.TESTED`; another version gets a warning at :func:`register_estimators`).
SUPPORTED_VERL = ("0.9.1",)

#: verl advantage estimator name (``algorithm.adv_estimator``) -> OAR method: ``oar`` (None: the configured method)
#: and one per method of :data:`oar.schema.METHODS`, named ``oar_<method>`` (``oar_p`` and ``oar_g`` as they are).
ADV_ESTIMATORS: dict[str, str | None] = {"oar": None, **{m if m.startswith("oar_") else f"oar_{m}": m for m in METHODS}}


@dataclass(eq=False)
class _Settings:
    """What :func:`configure` set; a new object per call, which is also the cache scope of the driver's pipelines
    (:func:`oar.pipeline_cache.pipeline_for`: reconfiguring starts fresh ones)."""

    config: Any = None
    scorer: Callable | None = None
    ignore_ids: tuple = ()


_SETTINGS = [_Settings()]
#: The OAR config of the running verl trainer's own config (``+oar.<key>=<value>``), set by
#: :func:`use_trainer_config` when the trainer is built; None when it has no ``oar`` section.
_TRAINER_CONFIG: list = [None]
#: The registered estimator function of each name (one function per name for the process: idempotent).
_REGISTERED: dict[str, Callable] = {}


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

    A trainer config's ``oar`` section read earlier (:func:`use_trainer_config`) is forgotten.
    """
    from oar import _args

    config_arg(config)
    if scorer is not None and not callable(scorer):
        raise ValueError(f"scorer must be callable (data, config, seq_adv) -> (scores, reasoning_mask) or None, "
                         f"got {type(scorer).__name__}")
    ids = _args.token_ids_arg("ignore_ids", ignore_ids)
    _SETTINGS[0] = _Settings(config=config, scorer=scorer, ignore_ids=ids)
    _TRAINER_CONFIG[0] = None


def driver_scorer():
    """The scorer set with :func:`configure` (driver side), or None."""
    return _SETTINGS[0].scorer


def session_rows(keys) -> tuple[list[int], list[int]]:
    """verl's multi-output agent sessions (``verl/trainer/ppo/v1/utils.py``,
    ``compute_advantage_for_multi_trajectories``): each row's transfer-queue key is
    ``"{uid}_{session_id}_{output index}"``; a session's final output is its row with the largest index.

    Args:
        keys: one key per row (B), in row order.

    Returns:
        ``(final, session)``: the row of each session's final output (sessions in order of first appearance),
        and for each row the position in ``final`` of its session.

    Raises:
        ValueError: a key not of the form ``"{uid}_{session_id}_{int}"``.
    """
    final: dict[str, tuple[int, int]] = {}
    row_session = []
    for i, key in enumerate(keys):
        parts = str(key).rsplit("_", 2)
        try:
            if len(parts) != 3:
                raise ValueError
            index = int(parts[2])
        except ValueError:
            raise ValueError(f"transfer-queue key {i} must be '{{uid}}_{{session_id}}_{{output index}}' (verl's "
                             f"agent loop), got {key!r}") from None
        session = f"{parts[0]}_{parts[1]}"
        row_session.append(session)
        if session not in final or final[session][0] < index:
            final[session] = (index, i)
    pos = {session: k for k, session in enumerate(final)}
    return [row for _, row in final.values()], [pos[session] for session in row_session]


def _pipeline(config):
    """The driver's pipeline of ``config`` (cached: random draws advance from step to step)."""
    s = _SETTINGS[0]
    return pipeline_cache.pipeline_for(config, scope=s, ignore_ids=s.ignore_ids)


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
        #: ``{"turn_weights": (B, R) or None}`` of the last call (docs/method.md section 13), read by the estimator
        self.last_info: dict = {}

    def __call__(self, data, config, seq_adv: torch.Tensor):
        rows = rollout_rows(data, config, self.answer_key)
        b = data.batch
        entropy = b["oar_entropy"] if "oar_entropy" in b.keys() else None  # read by the entropy methods only
        batch = RolloutBatch(rows["responses"], rows["completion_mask"], prompt_ids=rows["prompt_ids"],
                             eligible_mask=rows["eligible_mask"], answers=rows["answers"],
                             sequence_advantages=seq_adv.float().cpu(), entropy=entropy)
        res = pipeline_cache.pipeline_for(config, self.tokenizer, scope=self).scores(batch, self.model)
        self.last_info = {"turn_weights": res.turn_weights}
        return res.scores, res.reasoning_mask


def use_trainer_config(config):
    """Reads the ``oar`` section of verl's trainer config (``+oar.probe=answer_mean``, docs/trainers/verl.md) into
    the config the estimators run (:func:`estimator_config`), checked against the schema now, when the trainer is
    built, not at the first advantage step. Called by the OAR v1 trainers' constructor and the legacy
    ``init_workers`` wrapper.

    Args:
        config: verl's trainer config (``DictConfig``).

    Returns:
        The ``oar.OARConfig`` the estimators will run (method not yet set by the estimator name).

    Raises:
        ValueError: a key or value the schema refuses (naming ``oar.<key>``); the OAR config given twice (``+oar.*``
            and ``$OAR_CONFIG``, or ``+oar.*`` and :func:`configure`); an invalid ``$OAR_CONFIG``.
    """
    import os

    from oar.integrations._config_env import CONFIG_ENV
    from oar.integrations.verl.launch import CONFIG_LINE, trainer_oar_section
    from oar.schema import config_from_mapping

    section = trainer_oar_section(config)
    if section is None:
        _TRAINER_CONFIG[0] = None
        return estimator_config("oar")
    if os.environ.get(CONFIG_ENV, "").strip():
        raise ValueError(f"the OAR config is given twice: as verl config keys (+oar.*: {sorted(section)}) and as "
                         f"${CONFIG_ENV}; keep one (e.g. {CONFIG_LINE})")
    if _SETTINGS[0].config is not None:
        raise ValueError(f"the OAR config is given twice: as verl config keys (+oar.*: {sorted(section)}) and by "
                         "oar.integrations.verl.configure(config=...); keep one")
    try:
        cfg = config_from_mapping(section)
    except ValueError as e:
        raise ValueError(f"verl config key 'oar' (+oar.<key>=<value>, docs/config.md): {e}") from None
    _TRAINER_CONFIG[0] = cfg
    return cfg


def estimator_config(name: str):
    """The ``oar.OARConfig`` a registered estimator runs: :func:`configure`'s config, else the verl trainer config's
    ``oar`` section (:func:`use_trainer_config`), else ``$OAR_CONFIG``, with the estimator's method
    (:data:`ADV_ESTIMATORS`; ``oar`` keeps the config's method).

    Raises:
        KeyError: ``name`` is not one of :data:`ADV_ESTIMATORS`. ValueError: an invalid ``$OAR_CONFIG``.
    """
    if name not in ADV_ESTIMATORS:
        raise KeyError(f"not an OAR estimator: {name!r} (one of {sorted(ADV_ESTIMATORS)})")
    config = _SETTINGS[0].config if _SETTINGS[0].config is not None else _TRAINER_CONFIG[0]
    base = config if config is not None else config_from_env()
    method = ADV_ESTIMATORS[name]
    return with_method(base, method) if method is not None else base


def _estimator(name: str, method: str | None):
    def estimator(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None, epsilon: float = 1e-6,
                  norm_adv_by_std_in_grpo: bool = True, config=None, **kwargs):
        """OAR advantage estimator for verl (registered by oar.integrations.verl.register).

        Args:
            token_level_rewards: (bs, R) float, the outcome reward summed over the response is the sequence reward.
            response_mask: (bs, R) 0/1.
            index: (bs,) group ids (verl's ``uid``), rows of a group in any order. Required. Under an OAR v1
                trainer, rows of one agent session share its final output's sequence advantage, and the group
                statistics are taken over final outputs only (:func:`session_rows`), as verl's v1 GRPO does.
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
        data = context.call_batch()
        # the rollouts in verl's padded layout: the batch itself (legacy trainer), or the one the OAR v1 trainer
        # rebuilt from the transfer queue (verl's v1 trainer hands the estimator only the reward fields)
        extra = context.call_rollouts()
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
        sessions = context.call_sessions()
        if sessions is not None and len(sessions) != B:
            raise ValueError(f"verl estimator {name!r}: the session keys of this call hold {len(sessions)} rows, the "
                             f"rewards {B}")
        if sessions is None:
            seq = ops.group_advantages(rewards, group_ids=list(index), estimator=estimator, std="unbiased",
                                       eps=float(epsilon), singleton="verl")
        else:  # as verl's v1 GRPO: group statistics over each session's final output, broadcast to its outputs
            final, session = session_rows(sessions)
            seq = ops.group_advantages(rewards[final], group_ids=[index[i] for i in final], estimator=estimator,
                                       std="unbiased", eps=float(epsilon), singleton="verl")[torch.tensor(session)]
        completion, eligible = response_masks(src.batch if src is not None else None, R, response_mask)
        responses = get("responses")
        pipe = _pipeline(cfg)
        if pipe.method.needs_groups and responses is None:
            raise ValueError(f"verl estimator {name!r} (method {cfg.method!r}) needs batch['responses'] (call through "
                             "verl.trainer.ppo.ray_trainer.compute_advantage after oar.integrations.verl.register())")
        batch = RolloutBatch(responses.cpu() if responses is not None else torch.zeros((B, R), dtype=torch.long),
                             completion, eligible_mask=eligible, rewards=rewards, group_ids=list(index),
                             sequence_advantages=seq)
        batch.entropy = get("oar_entropy")  # verl's own entropies, read by the entropy methods only
        if cfg.turn_credit == "rewards":  # verl's agent loops record each tool call's reward (docs/method.md s. 13)
            batch.turn_rewards = next((d.non_tensor_batch["tool_rewards"] for d in (data, extra) if d is not None
                                       and "tool_rewards" in getattr(d, "non_tensor_batch", {})), None)
        if pipe.method.credit.name == "add" and pipe.method.needs_model and batch.entropy is None:
            raise ValueError(f"verl estimator {name!r} (method {cfg.method!r}) needs batch['oar_entropy'] (kept by "
                             "the plugin's RayPPOTrainer._compute_old_log_prob wrapper)")
        if pipe.method.credit.name == "reshape":
            scores, reasoning = get("oar_scores"), get("oar_reasoning_mask")
            batch.turn_weights = get("oar_turn_weights")
            if scores is None or reasoning is None:
                scorer = _SETTINGS[0].scorer if _SETTINGS[0].scorer is not None else context.call_scorer()
                if scorer is None or src is None:
                    raise ValueError(
                        f"verl estimator {name!r} (method {cfg.method!r}) needs per-token scores: run verl with the "
                        "OAR trainer (trainer.v1.trainer_mode=oar_sync; legacy trainer: oar.integrations.verl."
                        "register() in the TaskRunner), attach them with oar.integrations.verl.attach_scores(batch, "
                        "scores, reasoning_mask) before compute_advantage, or configure(scorer=HFScorer(tokenizer, "
                        "model)) in the driver process")
                scores, reasoning = scorer(src, cfg, seq)
                batch.turn_weights = getattr(scorer, "last_info", {}).get("turn_weights")
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
        if name not in ADV_ESTIMATORS:
            return orig(data, adv_estimator, *args, **kwargs)
        # the legacy trainer's actor worker group (recorded by the init_workers wrapper), unless an OAR v1 trainer
        # already set this call's scorer
        workers = context.trainer_scorer() if context.call_scorer() is None else None
        with context.advantage_call(batch=data, scorer=workers):
            return orig(data, adv_estimator, *args, **kwargs)

    compute_advantage.__oar_wrapped__ = True
    return compute_advantage


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


def register_estimators() -> list[str]:
    """Registers the OAR advantage estimators with verl and wraps ``ray_trainer.compute_advantage`` and
    ``RayPPOTrainer._compute_old_log_prob`` (idempotent).

    Returns:
        The registered names (:data:`ADV_ESTIMATORS`).

    Raises:
        ImportError: verl is not installed. RuntimeError: the verl version lacks the hook points.
    """
    from oar.integrations._versions import requirement

    try:
        import verl
        from verl.trainer.ppo import core_algos
    except ImportError as e:
        raise ImportError(f"oar.integrations.verl needs the `verl` package: pip install \"{requirement('verl')}\" "
                          "(what oar[verl] installs)") from e
    version = getattr(verl, "__version__", "?")
    for attr in ("register_adv_est", "get_adv_estimator_fn", "ADV_ESTIMATOR_REGISTRY"):
        if not hasattr(core_algos, attr):
            raise RuntimeError(f"verl {version}: core_algos has no {attr}; oar supports verl {SUPPORTED_VERL}")
    from oar.integrations._versions import check_tested

    check_tested("verl")  # the installed distribution's version
    for name, method in ADV_ESTIMATORS.items():
        if name not in _REGISTERED:
            _REGISTERED[name] = _estimator(name, method)
        if core_algos.ADV_ESTIMATOR_REGISTRY.get(name) is not _REGISTERED[name]:
            core_algos.register_adv_est(name)(_REGISTERED[name])
    from verl.trainer.ppo import ray_trainer

    ray_trainer.compute_advantage = _wrap_compute_advantage(ray_trainer.compute_advantage)
    trainer_cls = getattr(ray_trainer, "RayPPOTrainer", None)
    if trainer_cls is not None and hasattr(trainer_cls, "_compute_old_log_prob"):
        trainer_cls._compute_old_log_prob = _wrap_compute_old_log_prob(trainer_cls._compute_old_log_prob)
    return list(ADV_ESTIMATORS)


def wrap_v1_compute_advantage() -> None:
    """Wraps the ``compute_advantage`` verl's v1 trainer utilities bound by name at import (when that module is
    imported; :func:`oar.integrations.verl.register` calls it after registering the v1 trainers)."""
    import sys

    v1 = sys.modules.get("verl.trainer.ppo.v1.utils")
    if v1 is not None and hasattr(v1, "compute_advantage"):
        v1.compute_advantage = _wrap_compute_advantage(v1.compute_advantage)
