"""Functional API for custom training loops: rewards in, per-token advantages out, in one call.

:func:`token_advantages` = group advantages (method.md section 1) + attribution (sections 2-4, or a
baseline of section 8) + reshaping (sections 5-6, or the additive baselines). Every method of
:data:`METHODS` is selectable by name through ``config.method``; the ablations through ``config.reshape.tiers``
(``boost`` / ``suppress``) and the probe through ``config.probe``.

Trainer adapters (TRL, verl, OpenRLHF) and :class:`oar.hook.TokenAdvantageHook` call the same functions, so a
method behaves identically everywhere.
"""

from __future__ import annotations

import time
import weakref
from typing import Sequence

import torch

from oar import ops
from oar._lib import load_extension

_C = load_extension()

#: Every selectable credit-assignment method (the C++ schema's names, oar::core::method_names()).
METHODS: tuple[str, ...] = tuple(_C.METHOD_NAMES)
#: Methods that run the policy (need ``model``), that read the reasoning span (need ``tokenizer``), that build the
#: outcome probe (need ``answers``).
NEEDS_MODEL = ("entropy", "entropy_shaping", "oar_p", "oar_g")
NEEDS_TOKENIZER = ("random", "entropy", "oar_p", "oar_g")
NEEDS_ANSWERS = ("oar_p", "oar_g")

__all__ = ["token_advantages", "sequence_advantages", "additive_baseline", "METHODS"]


def _metrics(tok_adv: torch.Tensor, weights: torch.Tensor, eligible: torch.Tensor, active: list[int]) -> dict:
    from oar.metrics import ess_ratio, top_mass

    rows = torch.tensor(active, dtype=torch.long)
    return {
        "oar/ess_ratio": float(ess_ratio(weights[rows], eligible[rows]).mean()) if active else 1.0,
        "oar/top10_mass": float(top_mass(tok_adv[rows], weights[rows], eligible[rows], 0.1).mean()) if active else 0.1,
    }


def additive_baseline(hook, model, prompt_ids: Sequence, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                      advantages: torch.Tensor, eligible: torch.Tensor, out_device, t0: float | None = None, *,
                      rewards: torch.Tensor | None = None, group_offsets=None, config=None):
    """Methods ``entropy_shaping`` and ``ktae`` (method.md section 8): a bonus ADDED to A, no reshaping.

    Called by :meth:`oar.hook.TokenAdvantageHook.compute` (and by :func:`token_advantages`); the arguments are
    the hook's, already validated: ``advantages`` (B,) float32 CPU, ``eligible`` (B, C) bool CPU.

    - ``entropy_shaping``: A_t = A + min(alpha H_t, |A| / kappa) with H_t from :func:`oar.baselines.policy_entropies`
      (one forward per chunk of rows with A != 0, kept in step across ranks like the attribution forwards).
    - ``ktae``: A_t = A + KTAE score of token t within its group. Needs ``group_offsets`` (CSR offsets (G + 1,)
      or an int group size). Correctness: ``rewards > ktae.threshold``; **[decided]** without ``rewards``, a
      rollout is correct when its sequence advantage is > 0 (the same split as reward > 0 for 0/1 rewards in a
      group with both outcomes; such a group is the only one KTAE scores). NaN rewards (possible only with
      ``skip_nan``) count as wrong; bool / integer rewards are read as numbers.

    Returns:
        :class:`oar.hook.TokenAdvantages`. ``weights`` = A_t / A on rows with A != 0 (1 elsewhere on eligible
        tokens, 0 off them): the multiplicative view of an additive bonus, for the diagnostics only.
        ``scores`` = H_t (entropy shaping) or the KTAE token score; ``reasoning_mask`` = eligible tokens.

    Raises:
        ValueError: ``ktae`` without ``group_offsets``, ``rewards`` of the wrong shape.
    """
    from oar import baselines
    from oar.hook import TokenAdvantages

    t0 = time.perf_counter() if t0 is None else t0
    cfg = config if config is not None else hook.config
    method = cfg.method
    B, C = eligible.shape
    adv = advantages.detach().cpu().float()
    active = [i for i in range(B) if float(adv[i]) != 0.0]
    forwards = 0
    padding = 0
    if method == "entropy_shaping":
        from oar.attribution import as_probe_model
        from oar.distributed import ForwardGate, distributed_world

        sync = hook.sync_forwards if hook is not None else None
        pm = as_probe_model(model)
        gate = ForwardGate(pm, pad_id=hook.builder.pad_id if hook is not None else 0) if (
            sync or (sync is None and distributed_world())) else None
        rows_mask = completion_mask.detach().bool().cpu() & torch.tensor([a != 0.0 for a in adv.tolist()])[:, None]
        ctx = pm.eval_mode() if hasattr(pm, "eval_mode") else None
        if ctx is not None:
            with ctx:
                H = baselines.policy_entropies(gate if gate is not None else pm, prompt_ids, completion_ids, rows_mask,
                                               memory_budget_mb=int(cfg.memory_budget_mb))
        else:
            H = baselines.policy_entropies(gate if gate is not None else pm, prompt_ids, completion_ids, rows_mask,
                                           memory_budget_mb=int(cfg.memory_budget_mb))
        if gate is not None:
            gate.finish()
            forwards = gate.real_calls[1]
            padding = sum(gate.dummy_calls.values())
        else:
            forwards = 1 if active else 0  # at least one chunk; exact chunking is an implementation detail
        scores = torch.where(eligible, H, torch.zeros((), dtype=torch.float32))
        tok = baselines.entropy_shaping_advantages(adv, scores, eligible, alpha=cfg.entropy_shaping.alpha,
                                                   kappa=cfg.entropy_shaping.kappa)
    elif method == "ktae":
        if group_offsets is None:
            raise ValueError("method 'ktae' needs the groups: pass group_offsets (CSR offsets (G + 1,) or an int "
                             "group size) so that token tables are built per prompt")
        if isinstance(group_offsets, int) and not isinstance(group_offsets, bool):
            grp = {"group_size": group_offsets}
        else:
            grp = {"offsets": group_offsets}
        kt = cfg.ktae
        if rewards is None:
            r, threshold = adv, 0.0
        else:
            if not isinstance(rewards, torch.Tensor) or tuple(rewards.shape) != (B,):
                got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
                raise ValueError(f"rewards must be a (B,) = ({B},) tensor, got {got}")
            if rewards.dtype.is_complex:
                raise ValueError(f"rewards must be real, got dtype {rewards.dtype}")
            # bool / integer rewards are 0/1 outcomes; NaN rewards (kept only under skip_nan, which gives them A = 0)
            # count as wrong, like the TRL adapter's unscorable rollouts.
            r = torch.nan_to_num(rewards.detach().cpu().double(), nan=float("-inf")).clamp_min(-3e38)
            threshold = kt.threshold
        ignore = list(hook.builder.stop_ids) if hook is not None else []
        scores = baselines.ktae_token_scores(completion_ids.detach().cpu(), eligible, r, alpha=kt.alpha, beta=kt.beta,
                                             tf=kt.tf, scale=kt.scale, threshold=threshold, ignore_ids=ignore, **grp)
        tok = ((adv.double()[:, None] + scores.double()) * eligible).float()
        active = list(range(B))
    else:
        raise ValueError(f"additive_baseline: method must be 'entropy_shaping' or 'ktae', got {method!r}")
    safe = torch.where(adv != 0, adv, torch.ones_like(adv))
    weights = torch.where(eligible, torch.where((adv != 0)[:, None], tok / safe[:, None], torch.ones_like(tok)),
                          torch.zeros_like(tok))
    metrics = _metrics(tok, weights.abs(), eligible, [i for i in active if bool(eligible[i].any())])
    metrics.update({
        "oar/reasoning_frac": 1.0 if bool(eligible.any()) else 0.0,
        "oar/skipped_rows_frac": 1.0 - len(active) / max(B, 1),
        "oar/forward_passes": float(forwards),
        "oar/padding_forwards": float(padding),
        "oar/attribution_seconds": time.perf_counter() - t0,
    })
    if hook is not None:
        hook.calls += 1
    return TokenAdvantages(tok.to(out_device), weights.to(out_device), scores.to(out_device),
                           eligible.to(out_device), metrics)


def sequence_advantages(rewards: torch.Tensor, config=None, *, offsets=None, group_ids=None,
                        group_size: int | None = None, preset: str | None = None) -> torch.Tensor:
    """(N,) float32 group advantages with the estimator and conventions of ``config`` (method.md section 1).

    ``config.method == "dr_grpo"`` uses the ``dr_grpo`` estimator (no std scaling); otherwise
    ``config.advantages.estimator``. ``std``, ``eps``, ``singleton``, ``skip_nan`` come from
    ``config.advantages`` unless ``preset`` ("trl", "verl", "openrlhf", "default") is given, which then decides
    std, eps and singleton exactly as :func:`oar.ops.group_advantages` does.
    """
    from oar import OARConfig

    cfg = config if config is not None else OARConfig()
    a = cfg.advantages
    estimator = "dr_grpo" if cfg.method == "dr_grpo" else a.estimator
    if preset is not None:
        return ops.group_advantages(rewards, offsets, group_ids=group_ids, group_size=group_size, estimator=estimator,
                                    preset=preset, skip_nan=a.skip_nan)
    return ops.group_advantages(rewards, offsets, group_ids=group_ids, group_size=group_size, estimator=estimator,
                                std=a.std, eps=a.eps, singleton=a.singleton, skip_nan=a.skip_nan)


# One hook per (tokenizer, config): its random generator (random baseline, OAR-G noise) then advances from call
# to call as in a trainer, instead of replaying the same draws every step.
_HOOKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _hook_for(config, tokenizer):
    from oar.hook import TokenAdvantageHook

    key = config.to_json()
    try:
        per_tok = _HOOKS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no caching
        return TokenAdvantageHook(config, tokenizer)
    if key not in per_tok:
        per_tok[key] = TokenAdvantageHook(config, tokenizer)
    return per_tok[key]


def token_advantages(rewards: torch.Tensor, *, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                     offsets=None, group_ids=None, group_size: int | None = None, model=None, tokenizer=None,
                     prompt_ids: Sequence | None = None, answers: Sequence[str] | None = None, config=None,
                     eligible_mask: torch.Tensor | None = None, preset: str | None = None):
    """Group advantages + attribution + reshaping in one call (method.md sections 1-6 and 8).

    Args:
        rewards: (B,) real rewards of B rollouts; the rows of one prompt's group must be contiguous.
        completion_ids: (B, C) integer, right-padded completions (response tokens only).
        completion_mask: (B, C) bool or 0/1, 1 on completion tokens.
        offsets / group_ids / group_size: the groups, exactly one (see :func:`oar.ops.group_advantages`).
        model: the policy (Hugging Face causal LM or a ProbeModel); needed by ``entropy``,
            ``entropy_shaping``, ``oar_p``, ``oar_g``. Parameter ``.grad`` is never written.
        tokenizer: the policy's tokenizer; needed by ``random``, ``entropy``, ``oar_p``, ``oar_g`` (reasoning
            span, probe context) and used by ``ktae`` to score EOS/PAD 0.
        prompt_ids: B unpadded prompts (lists or 1-D tensors); needed whenever ``model`` is.
        answers: B reference answers (strings); needed by ``oar_p`` and ``oar_g``.
        config: ``oar.OARConfig`` (default: OAR-G, answer_mean probe, q = 0.25, beta = 1, floor = 0.1).
        eligible_mask: (B, C) tokens that carry the loss (default ``completion_mask``).
        preset: trainer convention of the group statistics ("trl", "verl", "openrlhf"); default: the config's.

    Returns:
        :class:`oar.hook.TokenAdvantages` with ``advantages`` (B, C) float32 (0 off ``eligible_mask``),
        ``weights``, ``scores``, ``reasoning_mask``, ``metrics`` and ``sequence_advantages`` (B,) float32.
        For the reshaping methods (grpo, dr_grpo, random, entropy, oar_p, oar_g) each row keeps its mass:
        advantages[b].sum() == sequence_advantages[b] * eligible_mask[b].sum().

    Raises:
        ValueError: bad rewards/groups (see :func:`oar.ops.group_advantages`), rewards on the meta device,
            ``config`` that is not an ``oar.OARConfig``, a method's missing input (model, tokenizer, prompt_ids,
            answers), shapes (naming the argument).
    """
    from oar import OARConfig
    from oar.hook import TokenAdvantages

    if config is not None and not isinstance(config, OARConfig):
        raise ValueError(f"config must be an oar.OARConfig or None, got {type(config).__name__} "
                         "(build one with oar.OARConfig.from_json(...))")
    cfg = config if config is not None else OARConfig()
    method = cfg.method
    if not isinstance(completion_ids, torch.Tensor) or completion_ids.dim() != 2:
        got = tuple(completion_ids.shape) if isinstance(completion_ids, torch.Tensor) else type(completion_ids).__name__
        raise ValueError(f"completion_ids must be a (B, C) tensor, got {got}")
    B, C = completion_ids.shape
    if not isinstance(rewards, torch.Tensor) or tuple(rewards.shape) != (B,):
        got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a (B,) = ({B},) tensor, one per completion row, got {got}")
    if rewards.device.type == "meta":
        raise ValueError("rewards must hold data, got a tensor on the meta device")
    for name, needed, value in (("model", NEEDS_MODEL, model), ("tokenizer", NEEDS_TOKENIZER, tokenizer),
                                ("prompt_ids", NEEDS_MODEL, prompt_ids), ("answers", NEEDS_ANSWERS, answers)):
        if method in needed and value is None:
            raise ValueError(f"method {method!r} needs {name} (methods that need it: {', '.join(needed)})")
    seq = sequence_advantages(rewards, cfg, offsets=offsets, group_ids=group_ids, group_size=group_size, preset=preset)
    off = ops._resolve_offsets(rewards, offsets, group_ids, group_size).cpu()
    if prompt_ids is None:
        prompt_ids = [[] for _ in range(B)]
    if answers is None:
        answers = [""] * B
    if tokenizer is not None:
        hook = _hook_for(cfg, tokenizer)
        res = hook.compute(model, prompt_ids, completion_ids, completion_mask, seq, answers, eligible_mask=eligible_mask,
                           rewards=rewards, group_offsets=off)
    else:
        # grpo, dr_grpo, ktae: no tokenizer needed.
        if not isinstance(completion_mask, torch.Tensor) or tuple(completion_mask.shape) != (B, C):
            got = tuple(completion_mask.shape) if isinstance(completion_mask, torch.Tensor) else type(completion_mask).__name__
            raise ValueError(f"completion_mask must be (B, C) = {(B, C)}, got {got}")
        elig = (completion_mask if eligible_mask is None else eligible_mask)
        if not isinstance(elig, torch.Tensor) or tuple(elig.shape) != (B, C):
            raise ValueError(f"eligible_mask must be (B, C) = {(B, C)}, got {tuple(getattr(elig, 'shape', ()))}")
        elig = elig.detach().bool().cpu()
        t0 = time.perf_counter()
        if method == "ktae":
            res = additive_baseline(None, model, prompt_ids, completion_ids, completion_mask, seq.cpu(), elig,
                                    seq.device, t0, rewards=rewards, group_offsets=off, config=cfg)
        else:
            w = elig.float()
            tok = seq.detach().cpu().float()[:, None] * w
            active = [i for i in range(B) if float(seq[i]) != 0.0]
            metrics = _metrics(tok, w, elig, active)
            metrics.update({"oar/reasoning_frac": 0.0, "oar/skipped_rows_frac": 1.0 - len(active) / max(B, 1),
                            "oar/forward_passes": 0.0, "oar/padding_forwards": 0.0,
                            "oar/attribution_seconds": time.perf_counter() - t0})
            dev = seq.device
            res = TokenAdvantages(tok.to(dev), w.to(dev), torch.zeros((B, C), device=dev),
                                  torch.zeros((B, C), dtype=torch.bool, device=dev), metrics)
    res.sequence_advantages = seq
    return res
