"""OpenRLHF integration: OAR per-token advantages in ``RemoteExperienceMaker`` (docs/trainers.md, OpenRLHF;
docs/trainers/openrlhf.md).

Tested against openrlhf 0.11.2 (``openrlhf/trainer/ppo_utils/experience_maker.py``). OpenRLHF has no advantage
registry, so :func:`install` replaces ``RemoteExperienceMaker.compute_advantages_and_returns(self, experiences)``
by a wrapper that runs the original (group statistics: ``group_norm`` = (r - mean) / (std + 1e-9), ``dr_grpo`` =
r - mean, ``rloo``; returns = advantages, constant over each response) and then replaces every
``experience.advantages`` (B, A) by OAR per-token advantages of the configured method. The policy loss consumes
them elementwise.

Requirements, checked with a clear error by :func:`check_args` when the trainer starts (the launcher) and again
before each step's scoring: KL as a loss (``--algo.kl.use_loss``, else per-token KL would be mixed into the
returns) or a zero KL coefficient; ``--algo.advantage.estimator`` in :data:`SUPPORTED_ADVANTAGE_ESTIMATORS`;
method ``dr_grpo`` with estimator ``dr_grpo``; for the methods that run the policy, no ring attention
(``--ds.ring_attn_size`` 1) and text-only rollouts; ``--data.label_key`` for the methods that read the answers.

The experience maker lives in the ``PPOTrainer`` Ray actor, not in the driver. :func:`launch` (``python -m
oar.integrations.openrlhf <train_ppo_ray arguments>``) therefore runs OpenRLHF's ``train_ppo_ray`` with
``ray.init(runtime_env={"worker_process_setup_hook": "oar.integrations.openrlhf.worker_setup_hook",
"env_vars": {"OAR_CONFIG": ...}})``, which installs the patch in every Ray worker process, and attaches
:func:`actor_scores` to OpenRLHF's model actors there. ``oar_p`` / ``oar_g`` scores are then computed on the
policy actor group, with the weights that generated the rollouts: the experience maker sends each data-parallel
actor one chunk of rows through ``actor_model_group.async_run_method_batch(method_name="oar_scores", ...)`` (the
way it reaches the actors' own ``forward``) and folds the returned scores into the advantages. ``entropy`` /
``entropy_shaping`` need a model in the process that makes the experience (``install(model=...)``, a Hugging Face
causal LM or an :class:`oar.attribution.ProbeModel`; it also replaces the actor group for oar_p / oar_g).
``grpo``, ``dr_grpo``, ``random`` and ``ktae`` need none.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from typing import Any

import torch

from oar import pipeline_cache
from oar.integrations._config_env import CONFIG_ENV, config_from_env
from oar.integrations._worker_scoring import score_chunk, split_rows, trainer_budget_mb
from oar.batch import RolloutBatch
from oar.methods import method_spec
from oar.pipeline import Pipeline, scored_rows
from oar.groups import group_ids_from
from oar.schema import config_arg

SUPPORTED_OPENRLHF = ("0.11.2",)
#: OpenRLHF advantage estimators (``--algo.advantage.estimator``) whose advantages are one value per response (what
#: OAR reshapes).
SUPPORTED_ADVANTAGE_ESTIMATORS = ("group_norm", "dr_grpo", "rloo")
_STATE: dict[str, Any] = {"config": None, "model": None, "original": None}
#: Cache scope (:func:`oar.pipeline_cache.pipeline_for`) of this process's pipelines, emptied by :func:`install`.
PIPELINE_SCOPE = "oar.integrations.openrlhf"


def _experience_maker_cls():
    from oar.integrations._versions import check_tested, requirement

    try:
        from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    except ImportError as e:
        raise ImportError(f"oar.integrations.openrlhf needs the `openrlhf` package: pip install "
                          f"\"{requirement('openrlhf')}\" (what oar[openrlhf] installs)") from e
    check_tested("openrlhf")
    return RemoteExperienceMaker


def _check_signature(fn) -> None:
    params = list(inspect.signature(fn).parameters)
    if params != ["self", "experiences"]:
        import openrlhf

        raise RuntimeError(f"openrlhf {getattr(openrlhf, '__version__', '?')}: RemoteExperienceMaker."
                           f"compute_advantages_and_returns{tuple(params)} is not (self, experiences); oar supports "
                           f"openrlhf {SUPPORTED_OPENRLHF}")


def _check_config(config) -> None:

    config_arg(config)


def _arg(args, path: str, default=None):
    """``args.<path>`` of OpenRLHF's hierarchical arguments (``"ds.ring_attn_size"``), ``default`` when a level is
    missing (in-process callers hand a partial namespace)."""
    node = args
    for key in path.split("."):
        if node is None or not hasattr(node, key):
            return default
        node = getattr(node, key)
    return node


def check_args(args, config=None) -> None:
    """Refuses OpenRLHF arguments that oar cannot serve, before anything is generated: the launcher
    (:func:`launch`) runs it on ``train_ppo_ray``'s final arguments (after OpenRLHF's own fix-ups) when the trainer
    builds its strategy, before any Ray actor or vLLM engine exists; the patched
    ``compute_advantages_and_returns`` runs it again at each step, before scoring (in-process use).

    Refused (ValueError naming the argument, its value and what to set; docs/trainers/openrlhf.md):
    ``--algo.advantage.estimator`` outside :data:`SUPPORTED_ADVANTAGE_ESTIMATORS`; oar method ``dr_grpo`` without
    estimator ``dr_grpo``; KL in the reward (``--algo.kl.init_coef`` != 0 without ``--algo.kl.use_loss``); and for
    the methods that run the policy (oar_p, oar_g, entropy, entropy_shaping): ``--ds.ring_attn_size`` > 1
    (OpenRLHF swaps transformers' flash attention for ring attention process-wide, so oar's padded forwards
    would run through it), ``--data.max_images_per_prompt`` > 0 (oar's forwards are text-only); methods that need
    the reference answers without ``--data.label_key``. Arguments missing from ``args`` are not checked.

    Args:
        args: OpenRLHF's hierarchical arguments (``strategy.args``). config: ``oar.OARConfig`` (None:
            ``$OAR_CONFIG`` or the defaults).

    Raises:
        ValueError: one of the arguments above, named with its value and what to set.
    """
    cfg = config if config is not None else config_from_env()
    spec = method_spec(cfg.method)
    estimator = _arg(args, "algo.advantage.estimator")
    if estimator is not None and estimator not in SUPPORTED_ADVANTAGE_ESTIMATORS:
        raise ValueError(f"OAR reshapes one advantage per response: --algo.advantage.estimator must be one of "
                         f"{SUPPORTED_ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    if estimator is not None and cfg.advantages.estimator == "dr_grpo" and estimator != "dr_grpo":
        raise ValueError(f"oar estimator 'dr_grpo' (method {cfg.method!r}) needs --algo.advantage.estimator dr_grpo, "
                         f"got {estimator!r}")
    init_coef = _arg(args, "algo.kl.init_coef")
    if init_coef is not None and float(init_coef) != 0.0 and not _arg(args, "algo.kl.use_loss", False):
        raise ValueError(f"OAR needs the KL term as a loss (--algo.kl.use_loss) or --algo.kl.init_coef 0, got "
                         f"--algo.kl.init_coef {init_coef} without --algo.kl.use_loss: per-token KL would be mixed "
                         "into the returns that become advantages")
    if spec.needs_model:
        ring = _arg(args, "ds.ring_attn_size", 1)
        if ring is not None and int(ring) > 1:
            raise ValueError(f"oar method {cfg.method!r} runs the policy, and --ds.ring_attn_size {ring} makes "
                             "OpenRLHF replace transformers' flash attention by ring attention in every actor "
                             "process (ring_flash_attn.substitute_hf_flash_attn): oar's padded forwards would run "
                             "through it. Set --ds.ring_attn_size 1 (the default), or use a method that runs no "
                             "model (grpo, dr_grpo, random, ktae)")
        images = _arg(args, "data.max_images_per_prompt", 0)
        if images is not None and int(images) > 0:
            raise ValueError(f"oar method {cfg.method!r} runs the policy on text only, but "
                             f"--data.max_images_per_prompt is {images} (vision-language rollouts): set "
                             "--data.max_images_per_prompt 0, or use a method that runs no model (grpo, dr_grpo, "
                             "random, ktae)")
    if spec.needs_answers and hasattr(_arg(args, "data"), "label_key") and not _arg(args, "data.label_key"):
        raise ValueError(f"oar method {cfg.method!r} needs the reference answers: pass --data.label_key (the "
                         "dataset key of the answers, read into experience.labels), got --data.label_key None")


def install(config=None, *, model=None) -> None:
    """Patches ``RemoteExperienceMaker.compute_advantages_and_returns`` in this process (idempotent; a second call
    replaces the config and model).

    Args:
        config: ``oar.OARConfig`` (``None``: ``$OAR_CONFIG`` or the defaults); any method of ``oar.METHODS``, the
            tiers ablation and the probe.
        model: the policy for attribution (HF causal LM or ProbeModel), needed by oar_p, oar_g, entropy and
            entropy_shaping.

    Raises:
        ValueError: ``config`` that is not an ``oar.OARConfig`` / None (checked before openrlhf is imported).
        ImportError: openrlhf missing. RuntimeError: the method's signature differs from the supported version's.
    """
    _check_config(config)
    cls = _experience_maker_cls()
    current = cls.compute_advantages_and_returns
    original = getattr(current, "__oar_original__", current)
    _check_signature(original)
    _STATE.update(config=config, model=model, original=original)
    pipeline_cache.clear(PIPELINE_SCOPE)
    _attach_actor_method()
    if not getattr(current, "__oar_original__", None):
        def compute_advantages_and_returns(self, experiences):
            return _compute(self, experiences)

        compute_advantages_and_returns.__oar_original__ = original
        compute_advantages_and_returns.__doc__ = _compute.__doc__
        cls.compute_advantages_and_returns = compute_advantages_and_returns


def uninstall() -> None:
    """Restores OpenRLHF's own ``compute_advantages_and_returns``."""
    cls = _experience_maker_cls()
    original = getattr(cls.compute_advantages_and_returns, "__oar_original__", None)
    if original is not None:
        cls.compute_advantages_and_returns = original


def worker_setup_hook() -> None:
    """Ray ``worker_process_setup_hook``: installs the patch with ``$OAR_CONFIG`` in a worker process (no model:
    the model-free methods only, unless the process calls :func:`install` again with one)."""
    install(config_from_env())


def _pipeline(config, tokenizer) -> Pipeline:
    """This process's pipeline of (``config``, ``tokenizer``), cached for the process's lifetime so that random draws
    advance from step to step. The tokenizer is keyed by what identifies it, not by object: a policy actor receives
    it unpickled with every request."""
    return pipeline_cache.pipeline_for(config, tokenizer, scope=PIPELINE_SCOPE, by_name=True)


def _compute(self, experiences):
    """OpenRLHF's advantages, then OAR per-token advantages in ``experience.advantages`` (B, A) float32.

    Raises:
        ValueError: KL not used as a loss (with a non-zero KL coefficient), an unsupported estimator, method
            dr_grpo with another estimator, a method that needs a model without one, missing labels for
            oar_p / oar_g.
    """
    args = self.strategy.args
    cfg = _STATE["config"] if _STATE["config"] is not None else config_from_env()
    method = cfg.method
    kl_value = float(getattr(getattr(self, "kl_ctl", None), "value", 0.0) or 0.0)
    if not args.algo.kl.use_loss and kl_value != 0.0 and getattr(self, "initial_model_group", None) is not None:
        raise ValueError("OAR needs the KL term as a loss (--algo.kl.use_loss) or a zero KL coefficient: otherwise "
                         f"per-token KL (coefficient {kl_value}) is mixed into the returns that become advantages")
    check_args(args, cfg)  # the launcher ran it at start already; in-process use gets it here, before any scoring
    model = _STATE["model"]
    spec = method_spec(method)
    # oar_p / oar_g run on the policy actor group (the weights that generated the rollouts) unless a model was
    # installed in this process.
    remote = (spec.needs_model and model is None and spec.credit.name == "reshape"
              and getattr(self, "actor_model_group", None) is not None)
    if spec.needs_model and model is None and not remote:
        raise ValueError(f"oar method {method!r} runs the policy: call oar.integrations.openrlhf.install(config, "
                         "model=...) in the process that makes the experience"
                         + ("" if spec.credit.name != "reshape" else " (or make experiences with an actor_model_group)"))
    experiences = _STATE["original"](self, experiences)
    if not experiences:
        return experiences
    n = int(args.rollout.n_samples_per_prompt)
    # One batch in prompt order (experience.index = original positions), as OpenRLHF's own group statistics.
    pos = torch.tensor([int(i) for e in experiences for i in e.index])
    order = torch.argsort(pos)
    rows = [r for e in experiences for r in _experience_rows(e)]
    C = max(1, max(len(r["ids"]) for r in rows))
    rows = [rows[i] for i in order.tolist()]
    B = len(rows)
    if B % n:
        raise ValueError(f"the batch has {B} responses, not a multiple of n_samples_per_prompt = {n}")
    tokenizer = getattr(self, "tokenizer", None)
    if spec.needs_tokenizer and tokenizer is None:
        raise ValueError(f"oar method {method!r} needs the experience maker's tokenizer (reasoning span)")
    answers = None
    if spec.needs_answers:
        if any(r["label"] in (None, "") for r in rows):
            raise ValueError(f"oar method {method!r} needs the reference answers: pass --data.label_key so that "
                             "experience.labels holds them")
        answers = [str(r["label"]) for r in rows]

    def padded(key, value):  # (B, C): the rows' `key` tensors, right-padded with `value`
        out = torch.full((B, C), value, dtype=rows[0][key].dtype)
        for i, r in enumerate(rows):
            out[i, : len(r[key])] = r[key]
        return out

    pad = int(getattr(tokenizer, "pad_token_id", None) or 0)
    batch = RolloutBatch(padded("ids", pad), padded("completion", False), prompt_ids=[r["prompt"] for r in rows],
                         eligible_mask=padded("eligible", False), rewards=torch.tensor([r["reward"] for r in rows]),
                         group_ids=group_ids_from(B, group_size=n), answers=answers,
                         sequence_advantages=torch.tensor([r["adv"] for r in rows]))
    if remote:
        info: dict = {}
        batch.scores, batch.reasoning_mask = _actor_group_scores(self, batch, cfg, tokenizer, info)
        batch.turn_weights = info.get("turn_weights")
    tok = _pipeline(cfg, tokenizer).compute(batch, model).advantages
    back = torch.empty_like(order)
    back[order] = torch.arange(B)
    start = 0
    for e in experiences:
        k, w = e.action_mask.shape
        adv = torch.zeros((k, w), dtype=torch.float32)
        for b in range(k):
            i = int(back[start + b])
            r = rows[i]
            L = len(r["ids"])
            adv[b, r["column"]: r["column"] + L] = tok[i, :L]
        start += k
        e.advantages = adv.to(device=e.advantages.device)
    return experiences


#: Name of the policy actor method that computes scores (attached to OpenRLHF's ``BaseModelActor`` by
#: :func:`install`, reached through ``RayActorGroup.async_run_method_batch`` like the actor's own ``forward``).
ACTOR_METHOD = "oar_scores"


def _sub_batch(batch: RolloutBatch, lo: int, hi: int) -> RolloutBatch:
    """Rows [lo, hi) of ``batch`` (a RolloutBatch whose fields are tensors / lists / None)."""
    return _take_rows(batch, list(range(lo, hi)))


def _take_rows(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """The RolloutBatch of ``batch``'s rows ``rows`` (in that order, repeats allowed; fields are tensors / lists /
    None)."""
    import dataclasses

    idx = torch.tensor(rows, dtype=torch.int64)

    def take(value):
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            return value[idx]
        return [value[i] for i in rows]

    return RolloutBatch(**{f.name: take(getattr(batch, f.name)) for f in dataclasses.fields(RolloutBatch)})


def _actor_group_scores(maker, batch: RolloutBatch, cfg, tokenizer,
                        info: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of ``batch`` computed on OpenRLHF's policy actor group. Only the rows the pipeline scores are sent
    (:func:`oar.pipeline.scored_rows`: a row with advantage 0 gets token advantages 0 whatever its scores, a row
    outside ``credit_rows`` GRPO's uniform credit), in contiguous equal
    chunks, one per data-parallel actor (:func:`oar.integrations._worker_scoring.split_rows` with ``only_scored``:
    the last chunk is padded with advantage-0 copies of a sent row, which are not scored); tensor-parallel
    duplicates get the same chunk, as in OpenRLHF's own dispatch (ring attention is refused by :func:`check_args`).
    Each chunk is one call of :func:`actor_scores` on its actor. With ``--train.colocate_all`` or
    ``--train.colocate_actor_ref`` the actors then empty their CUDA cache (``BaseModelActor.empty_cache``), as
    OpenRLHF does after the actors' own forwards (openrlhf/trainer/ppo_utils/experience_maker.py:100-106, 154-158).
    No call at all when no row has a non-zero advantage. Returns ((B, C) float32 scores, (B, C) bool reasoning
    mask) on the CPU, zeros on the rows not sent; ``info`` (optional dict) receives ``turn_weights``: (B, C) float32
    when some actor scored a row turn by turn (docs/method.md section 13), else None.
    """
    import ray

    args = maker.strategy.args
    dup = int(args.ds.ring_attn_size) * int(args.ds.tensor_parallel_size)
    actors = int(args.actor.num_nodes) * int(args.actor.num_gpus_per_node) // dup
    B, C = batch.completion_ids.shape
    adv = batch.sequence_advantages if batch.sequence_advantages is not None else torch.zeros(B)
    if not scored_rows(adv, cfg.credit_rows):  # no row the pipeline scores
        return torch.zeros((B, C), dtype=torch.float32), torch.zeros((B, C), dtype=torch.bool)
    split = split_rows(adv, actors, only_scored=True, credit_rows=cfg.credit_rows)
    sent = _take_rows(batch, split.rows)
    sent.sequence_advantages = split.sequence_advantages(adv)
    requests = [dict(config=cfg.to_json(), tokenizer=tokenizer, batch=_sub_batch(sent, split.bounds[k],
                                                                                 split.bounds[k + 1]))
                for k in range(actors)]
    refs = maker.actor_model_group.async_run_method_batch(method_name=ACTOR_METHOD, request=requests)
    results = [r for per_actor in ray.get(refs)[::dup] for r in per_actor]
    train = getattr(args, "train", None)
    if getattr(train, "colocate_all", False) or getattr(train, "colocate_actor_ref", False):
        ray.get(maker.actor_model_group.async_run_method(method_name="empty_cache"))
    if info is not None:
        tws = [r.get("turn_weights") for r in results]
        info["turn_weights"] = None if all(t is None for t in tws) else split.place(
            torch.cat([t if t is not None else torch.ones_like(r["scores"]) for t, r in zip(tws, results)]), B,
            torch.float32)
    return (split.place(torch.cat([r["scores"] for r in results]), B, torch.float32),
            split.place(torch.cat([r["reasoning_mask"] for r in results]), B, torch.bool))


def actor_scores(self, request: dict) -> dict:
    """OpenRLHF policy actor method (``BaseModelActor.oar_scores``): importance scores of one chunk of rollouts,
    computed with this actor's own policy (``self.actor.model``, the DeepSpeed engine's module).

    Runs inside OpenRLHF's ``execute_batch`` (under ``make_experience``'s ``torch.no_grad``): the policy is put in
    eval mode and gradients are enabled for OAR-G's backward w.r.t. the input embeddings (no parameter ``.grad`` is
    written). Every actor of the group runs one call per step; their forwards are kept in step by the forward gate
    (ZeRO-3 gathers parameters in every forward), and actors given the same chunk (tensor-parallel / ring-attention
    duplicates) draw the same noise (same config seed, same data).

    Args:
        request: ``{"config": OARConfig JSON, "tokenizer": the policy's tokenizer, "batch": RolloutBatch}`` with
            the chunk's rows (prompt ids, completions, eligible mask, answers, sequence advantages).

    Returns:
        ``{"scores": (b, C) float32, "reasoning_mask": (b, C) bool, "turn_weights": (b, C) float32 or None}`` on the
        CPU (rows with advantage 0 unscored; turn weights of multi-turn rows, docs/method.md section 13).
    """
    actor = self.actor
    inner = getattr(actor, "model", actor)
    policy = getattr(inner, "module", inner)  # DeepSpeedEngine -> the Hugging Face model

    @contextlib.contextmanager
    def eval_mode():
        was_training = actor.training
        actor.eval()
        try:
            yield
        finally:
            if was_training:
                actor.train()

    cap = _token_budget_cap(getattr(getattr(self, "strategy", None), "args", None), policy, request["batch"])
    res = score_chunk(request["config"], request["tokenizer"], request["batch"], policy, budget_cap_mb=cap,
                      eval_mode=eval_mode, scope=PIPELINE_SCOPE, by_name=True)
    return {"scores": res.scores, "reasoning_mask": res.reasoning_mask, "turn_weights": res.turn_weights}


def _token_budget_cap(args, policy, batch: RolloutBatch) -> int | None:
    """Cap (MiB) of OAR's chunk budget from OpenRLHF's own forward budget (:func:`oar.integrations._worker_scoring.
    trainer_budget_mb`): ``--rollout.max_tokens_per_gpu`` tokens with ``--train.dynamic_batch_enable``, else
    ``--rollout.micro_batch_size`` sequences of the chunk's longest context. None without those arguments (or a
    chunk with no rows)."""
    from oar.attribution import as_probe_model

    rollout = getattr(args, "rollout", None)
    if rollout is None or batch.batch_size == 0:
        return None
    P = max((len(p) for p in batch.prompt_ids), default=0) if batch.prompt_ids is not None else 0
    width = P + int(batch.completion_ids.shape[1])
    return trainer_budget_mb(as_probe_model(policy), max(1, width),
                             dynamic=bool(getattr(getattr(args, "train", None), "dynamic_batch_enable", False)),
                             max_tokens=getattr(rollout, "max_tokens_per_gpu", None),
                             micro_batch_size=getattr(rollout, "micro_batch_size", None))


def _attach_actor_method() -> bool:
    """Adds :func:`actor_scores` to OpenRLHF's ``BaseModelActor`` in this process as :data:`ACTOR_METHOD` (in a
    Ray worker: before the actor class is instantiated, by the worker setup hook). False when the launcher module
    cannot be imported here (e.g. without deepspeed)."""
    try:
        from openrlhf.trainer.ray.launcher import BaseModelActor
    except ImportError:
        return False
    setattr(BaseModelActor, ACTOR_METHOD, actor_scores)
    return True


def _experience_rows(e) -> list[dict]:
    """The rows of one OpenRLHF ``Experience`` as prompt / completion / eligible tokens.

    OpenRLHF 0.11 stores each rollout as one right-padded sequence (B, T) of observation tokens (prompt,
    responses and, in multi-turn rollouts, environment observations between them) with ``attention_mask`` (B, T)
    and ``action_mask`` (B, A): column c of ``action_mask`` is token c + T - A (A = T - 1: the mask of predicted
    tokens). Earlier layouts (left-padded prompt, then A response columns) follow the same rule. A row's prompt is
    every attended token before its first action token; its completion runs from there to its last attended token
    (observations between turns included, as context); its eligible tokens are the action tokens (observations
    are never masked, perturbed or scored). ``column`` is the action-mask column of the completion's first token.

    Raises:
        ValueError: an ``action_mask`` wider than ``sequences`` allows, action tokens on padding, advantages that
            vary over a row's action tokens.
    """
    seqs = e.sequences.detach().cpu()
    attn = e.attention_mask.detach().bool().cpu()
    am = e.action_mask.detach().bool().cpu()
    B, T = seqs.shape
    if am.dim() != 2 or am.shape[0] != B or not 1 <= T - am.shape[1] < T:
        raise ValueError(f"experience.action_mask must be (B, A) with B = {B} and 1 <= A < T = {T} "
                         f"(sequences {tuple(seqs.shape)}), got {tuple(am.shape)}")
    off = T - am.shape[1]
    act = torch.zeros((B, T), dtype=torch.bool)
    act[:, off:] = am
    if bool((act & ~attn).any()):
        b, j = (int(x) for x in torch.nonzero(act & ~attn)[0])
        raise ValueError(f"experience.action_mask marks token {j} of row {b}, which attention_mask marks as padding")
    adv = e.advantages.detach().float().cpu()
    labels = list(e.labels) if e.labels else [None] * B
    rows = []
    for b in range(B):
        acts = torch.nonzero(act[b]).flatten()
        valid = torch.nonzero(attn[b]).flatten()
        end = int(valid[-1]) + 1 if len(valid) else 0
        first = int(acts[0]) if len(acts) else end
        # OpenRLHF's group estimators give one value per response, constant over its action tokens.
        vals = adv[b][am[b]]
        if len(vals) and not bool((vals == vals[0]).all()):
            raise ValueError(f"experience.advantages of row {b} vary over its action tokens ({float(vals.min())} .. "
                             f"{float(vals.max())}): OAR reshapes one advantage per response")
        rows.append(dict(prompt=seqs[b, :first][attn[b, :first]], ids=seqs[b, first:end],
                         completion=attn[b, first:end], eligible=act[b, first:end], column=max(first - off, 0),
                         adv=float(vals[0]) if len(vals) else 0.0, reward=float(e.rewards[b]), label=labels[b]))
    return rows


def _patched_ray_init(ray_mod, config_json: str):
    orig = ray_mod.init
    if getattr(orig, "__oar_wrapped__", False):
        return orig

    def init(*args, **kwargs):
        env = dict(kwargs.get("runtime_env") or {})
        if env.get("worker_process_setup_hook") not in (None, "oar.integrations.openrlhf.worker_setup_hook"):
            raise RuntimeError("oar launcher: ray.init already sets a worker_process_setup_hook "
                               f"({env['worker_process_setup_hook']!r})")
        env["worker_process_setup_hook"] = "oar.integrations.openrlhf.worker_setup_hook"
        env["env_vars"] = dict(env.get("env_vars") or {}, **{CONFIG_ENV: config_json})
        kwargs["runtime_env"] = env
        return orig(*args, **kwargs)

    init.__oar_wrapped__ = True
    return init


def _check_args_at_start(cfg) -> None:
    """Makes ``train_ppo_ray``'s ``train(args)`` refuse what :func:`check_args` refuses before it starts anything.

    ``train_ppo_ray`` parses and fixes up its arguments in its ``__main__`` block (e.g. ``--ds.ring_attn_size`` > 1
    turns ``--ds.packing_samples`` on), then ``train(args)`` calls ``ray.init`` and ``get_strategy(args)`` (imported
    from ``openrlhf.utils``) before creating any vLLM engine or model actor (openrlhf/cli/train_ppo_ray.py, 0.11.2).
    The module run by :func:`launch` imports ``get_strategy`` from ``openrlhf.utils`` when it runs, so wrapping that
    attribute here puts the check on the final arguments, at the earliest point they exist as one object."""
    import openrlhf.utils as orl_utils

    current = orl_utils.get_strategy
    original = getattr(current, "__oar_original__", current)

    def get_strategy(args, *a, **k):
        check_args(args, cfg)
        return original(args, *a, **k)

    get_strategy.__oar_original__ = original
    get_strategy.__doc__ = original.__doc__
    orl_utils.get_strategy = get_strategy


def launch(argv: list[str] | None = None, config=None) -> None:
    """Runs OpenRLHF's ``openrlhf.cli.train_ppo_ray`` with the OAR patch in every Ray worker.

    Args:
        argv: train_ppo_ray's arguments (default ``sys.argv[1:]``).
        config: ``oar.OARConfig`` (default ``$OAR_CONFIG``), forwarded to the workers as ``$OAR_CONFIG``.

    Raises:
        ValueError: ``config`` that is not an ``oar.OARConfig`` / None, or a bad ``$OAR_CONFIG``; OpenRLHF arguments
            that :func:`check_args` refuses (raised by ``train(args)`` before any actor or vLLM engine starts).
    """
    _check_config(config)
    import runpy

    import ray

    cfg = config if config is not None else config_from_env()
    ray.init = _patched_ray_init(ray, cfg.to_json())
    os.environ[CONFIG_ENV] = cfg.to_json()
    install(cfg)
    _check_args_at_start(cfg)
    sys.argv = ["openrlhf.cli.train_ppo_ray"] + list(sys.argv[1:] if argv is None else argv)
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":  # python -m oar.integrations.openrlhf <train_ppo_ray args>
    launch()
