"""Rollout batches in and token advantages out: the pipeline's I/O types, their validation and the sequence
advantages (method.md section 1).

- :class:`RolloutBatch`: what every trainer adapter builds (B rollouts, in the caller's row order).
- :class:`TokenAdvantages`, :class:`TokenScores`: what :class:`oar.pipeline.Pipeline` returns.
- :func:`validate`: a :class:`RolloutBatch` checked and on the CPU (:class:`Batch`); messages name the field and the
  caller's row.
- :func:`sequence_advantages`: group advantages with the config's estimator and conventions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from oar import _args, ops
from oar.groups import group_ids_from
from oar.schema import OARConfig

__all__ = ["RolloutBatch", "TokenAdvantages", "TokenScores", "Batch", "validate", "sequence_advantages",
           "batch_sequence_advantages", "check_token_ids", "check_scores"]


@dataclass
class RolloutBatch:
    """One generation batch of B rollouts, in the caller's row order (what every trainer adapter builds).

    Attributes:
        completion_ids: (B, C) integer, right-padded completion (response) token ids.
        completion_mask: (B, C) bool or 0/1, True on completion tokens.
        prompt_ids: B unpadded prompts (lists or 1-D integer tensors); needed when the policy is run.
        eligible_mask: (B, C) bool or 0/1, the tokens that carry the loss, a subset of ``completion_mask``
            (default: ``completion_mask``; e.g. ``completion_mask * tool_mask``). Nothing outside it is masked,
            perturbed or scored, and its token advantages are 0.
        rewards: (B,) real rewards; NaN marks an unscorable rollout (see ``skip_nan``; a failure for KTAE).
        group_ids: B group ids (one per row, hashable: ints, strings such as verl's ``uid``), rows of a group in
            any order. Needed to compute sequence advantages from rewards and by KTAE.
        answers: B reference answers (str); needed by ``oar_p`` / ``oar_g``.
        sequence_advantages: (B,) real, finite: the trainer's own sequence advantages (else computed from
            ``rewards`` and ``group_ids`` with the config's estimator).
        entropy: optional (B, C) policy entropies (nats) at completion tokens, already computed by the trainer
            (methods ``entropy`` and ``entropy_shaping`` then run no forward).
        scores, reasoning_mask: optional (B, C) importance scores (>= 0 on the mask) and bool reasoning mask
            computed elsewhere (e.g. on the trainer's workers); the reshaping methods then run no scorer.
        span_starts: optional (B, C) bool or 0/1, True on the completion tokens that begin a masking unit (the
            caller's own span boundaries, docs/method.md section 11): used instead of the config's ``mask_unit``.
            A span runs from a start to the token before the next start (or the end of the reasoning) and never
            crosses a token outside ``eligible_mask``.
        turn_weights: optional (B, C) real, >= 0 and finite on eligible tokens: the turn weights that came with
            ``scores`` computed elsewhere (:attr:`TokenScores.turn_weights`), read only with ``scores`` or a
            scorer's precomputed scores (docs/method.md section 13). A session's turns are the runs of
            ``eligible_mask`` inside ``completion_mask``: the observations between them (tool results) are not
            eligible.
        turn_rewards: optional B entries, each None or a sequence of finite per-turn rewards of that row's session
            (one per turn, or one per turn that ends in an observation: verl's ``non_tensor_batch["tool_rewards"]``
            when each turn makes one call); read by ``turn_credit: rewards`` only (docs/method.md section 13).
    """

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    prompt_ids: Sequence | None = None
    eligible_mask: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    group_ids: Sequence | torch.Tensor | None = None
    answers: Sequence[str] | None = None
    sequence_advantages: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    reasoning_mask: torch.Tensor | None = None
    span_starts: torch.Tensor | None = None
    turn_weights: torch.Tensor | None = None
    turn_rewards: Sequence | None = None

    @property
    def batch_size(self) -> int:
        return int(self.completion_ids.shape[0])


@dataclass
class TokenAdvantages:
    """Per-token advantages of one batch (output of :meth:`Pipeline.compute`).

    Attributes:
        advantages: (B, C) float32 per-token advantages, 0 off the eligible mask.
        weights: (B, C) float32 reshaping weights (1 outside the reasoning span, 0 off the eligible mask); for the
            additive methods A_t / A on rows with A != 0 (a diagnostic view).
        scores: (B, C) float32 raw importance scores on scored tokens (entropies for entropy shaping, KTAE token
            scores for KTAE), 0 elsewhere.
        reasoning_mask: (B, C) bool, the tokens that were scored.
        metrics: scalars (``oar/ess_ratio``, ``oar/top10_mass``, ``oar/reasoning_frac``, ``oar/skipped_rows_frac``,
            ``oar/skipped_groups_frac`` when the groups are known, ``oar/forward_passes``,
            ``oar/padding_forwards``, ``oar/attribution_seconds``).
        sequence_advantages: (B,) float32 sequence advantages the token advantages were built from.
    """

    advantages: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor
    reasoning_mask: torch.Tensor
    metrics: dict = field(default_factory=dict)
    sequence_advantages: torch.Tensor | None = None


@dataclass
class TokenScores:
    """Importance scores of one batch (output of :meth:`Pipeline.scores`).

    Attributes:
        scores: (B, C) float32, >= 0 and finite on ``reasoning_mask``, 0 elsewhere.
        reasoning_mask: (B, C) bool, the scored reasoning tokens (eligible tokens of rows with A != 0 only).
        stats: engine counters (``forward_passes``, ``padding_forwards``, ...).
        turn_weights: (B, C) float32, each completion token's turn weight (1 on rows of one turn), or None when
            no row was scored turn by turn (docs/method.md section 13); pass it on as
            :attr:`RolloutBatch.turn_weights` with the scores.
    """

    scores: torch.Tensor
    reasoning_mask: torch.Tensor
    stats: dict = field(default_factory=dict)
    turn_weights: torch.Tensor | None = None


def check_token_ids(cids: torch.Tensor, cmask: torch.Tensor, prompt_ids: Sequence, rows: list[int],
                     vocab: int) -> list[torch.Tensor]:
    """Completion tokens under the mask and the prompts of ``rows`` must be ids in [0, vocab) (vocab 0: only >= 0
    is checked); returns the B prompts as 1-D int64 CPU tensors (unchecked rows as given, converted)."""
    hi = vocab if vocab > 0 else None
    sel = cids[rows][cmask[rows]]
    if sel.numel() and (int(sel.min()) < 0 or (hi is not None and int(sel.max()) >= hi)):
        bad = int(sel.min()) if int(sel.min()) < 0 else int(sel.max())
        r, c = torch.nonzero((cids == bad) & cmask)[0].tolist()
        raise ValueError(f"completion_ids must be token ids in [0, {hi or 'inf'}), got {bad} at [{r}, {c}]")
    out = []
    check = set(rows)
    for i, p in enumerate(prompt_ids):
        if isinstance(p, torch.Tensor):
            p = p.detach().cpu()
            if p.dim() != 1 or p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
                raise ValueError(f"prompt_ids[{i}] must be a 1-D integer tensor of token ids, got shape "
                                 f"{tuple(p.shape)} and dtype {p.dtype}")
            p = p.long()
        else:
            vals = list(p)
            for j, x in enumerate(vals):
                if isinstance(x, (bool, float)) or not hasattr(x, "__index__"):
                    raise ValueError(f"prompt_ids[{i}] must hold integer token ids, got {x!r} at position {j}")
            p = torch.tensor([int(x) for x in vals], dtype=torch.long)
        if i in check and p.numel():
            bad = (p < 0) | (p >= hi) if hi is not None else p < 0
            if bool(bad.any()):
                j = int(torch.nonzero(bad)[0])
                raise ValueError(f"prompt_ids[{i}] must be token ids in [0, {hi or 'inf'}), got {int(p[j])} at "
                                 f"position {j}")
        out.append(p)
    return out


@dataclass
class Batch:
    """A validated :class:`RolloutBatch` on the CPU (:func:`validate`): ``cids`` (B, C) int64, ``cmask`` /
    ``eligible`` (B, C) bool, ``rewards`` (B,) or None, ``group_ids`` B ids or None, ``entropy`` / ``scores`` (B, C)
    float32 or None, ``reasoning`` (B, C) bool or None, ``span_starts`` (B, C) bool or None, ``turn_weights`` (B, C)
    float32 or None, ``turn_rewards`` B lists of floats (empty for None) or None; ``out_device``: where the outputs
    go."""

    B: int
    C: int
    cids: torch.Tensor
    cmask: torch.Tensor
    eligible: torch.Tensor
    prompt_ids: Sequence | None
    rewards: torch.Tensor | None
    group_ids: list | None
    answers: list | None
    entropy: torch.Tensor | None
    scores: torch.Tensor | None
    reasoning: torch.Tensor | None
    out_device: torch.device
    span_starts: torch.Tensor | None = None
    turn_weights: torch.Tensor | None = None
    turn_rewards: list | None = None


def check_scores(scores, reasoning_mask, dims: str, shape: tuple, eligible: torch.Tensor | None = None):
    """Importance scores computed elsewhere (the trainer's workers, a scorer): ``scores`` real and ``reasoning_mask``
    bool or 0/1, both of ``shape``, the scores finite and >= 0 on the reasoning mask (and ``eligible``, when given).
    Returns (scores float32 CPU, reasoning mask bool CPU). Raises ValueError naming the argument and the first bad
    element."""
    s = _args.real_arg("scores", scores, dims, shape).detach().float().cpu()
    rm = _args.mask_arg("reasoning_mask", reasoning_mask, dims, shape).cpu()
    on = rm if eligible is None else rm & eligible
    bad = on & ~(torch.isfinite(s) & (s >= 0))
    if bool(bad.any()):
        r, c = torch.nonzero(bad)[0].tolist()
        raise ValueError(f"scores must be finite and >= 0 on reasoning_mask, got scores[{r}, {c}] = {float(s[r, c])}")
    return s, rm


def validate(batch: RolloutBatch) -> Batch:
    """``batch`` checked and copied to the CPU. Raises ValueError naming the field, the expected and the actual
    shape/dtype/value and the caller's row."""
    if not isinstance(batch, RolloutBatch):
        raise ValueError(f"batch must be an oar.RolloutBatch, got {type(batch).__name__}")
    cids = _args.ids_arg("completion_ids", batch.completion_ids, "(B, C)")
    B, C = (int(x) for x in cids.shape)
    cmask = _args.mask_arg("completion_mask", batch.completion_mask, "(B, C)", (B, C)).cpu()
    eligible = cmask if batch.eligible_mask is None else _args.mask_arg("eligible_mask", batch.eligible_mask, "(B, C)", (B, C)).cpu()
    outside = eligible & ~cmask
    if bool(outside.any()):
        r, c = torch.nonzero(outside)[0].tolist()
        raise ValueError(f"eligible_mask must be a subset of completion_mask, got True at [{r}, {c}] where "
                         "completion_mask is False")
    rewards = None
    if batch.rewards is not None:
        rewards = _args.real_arg("rewards", batch.rewards, "(B,)", (B,)).detach()
    for name, seq in (("prompt_ids", batch.prompt_ids), ("answers", batch.answers)):
        if seq is not None and (isinstance(seq, (str, bytes)) or len(seq) != B):
            raise ValueError(f"{name} must have B = {B} entries (one per row), got "
                             f"{type(seq).__name__ if isinstance(seq, (str, bytes)) else len(seq)}")
    groups = None if batch.group_ids is None else group_ids_from(B, group_ids=batch.group_ids)
    entropy = None
    if batch.entropy is not None:
        entropy = _args.real_arg("entropy", batch.entropy, "(B, C)", (B, C)).detach().float().cpu()
    scores = reasoning = None
    if (batch.scores is None) != (batch.reasoning_mask is None):
        raise ValueError("scores and reasoning_mask must be given together (both (B, C)) or not at all")
    if batch.scores is not None:
        scores, reasoning = check_scores(batch.scores, batch.reasoning_mask, "(B, C)", (B, C), eligible)
    span_starts = (None if batch.span_starts is None
                   else _args.mask_arg("span_starts", batch.span_starts, "(B, C)", (B, C)).cpu())
    turn_weights = None
    if batch.turn_weights is not None:
        turn_weights = _args.real_arg("turn_weights", batch.turn_weights, "(B, C)", (B, C)).detach().float().cpu()
        bad = eligible & ~(torch.isfinite(turn_weights) & (turn_weights >= 0))
        if bool(bad.any()):
            r, c = torch.nonzero(bad)[0].tolist()
            raise ValueError(f"turn_weights must be finite and >= 0 on eligible_mask, got turn_weights[{r}, {c}] = "
                             f"{float(turn_weights[r, c])}")
    turn_rewards = None if batch.turn_rewards is None else _turn_rewards(batch.turn_rewards, B)
    dev = (batch.sequence_advantages.device if isinstance(batch.sequence_advantages, torch.Tensor)
           else rewards.device if rewards is not None else cids.device)
    return Batch(B, C, cids.detach().cpu(), cmask, eligible, batch.prompt_ids, rewards, groups,
                  None if batch.answers is None else list(batch.answers), entropy, scores, reasoning, dev,
                  span_starts, turn_weights, turn_rewards)


def _turn_rewards(turn_rewards, B: int) -> list[list[float]]:
    """``RolloutBatch.turn_rewards`` as B lists of floats (None -> []); raises ValueError naming the row."""
    if isinstance(turn_rewards, (str, bytes)) or not hasattr(turn_rewards, "__len__") or len(turn_rewards) != B:
        got = len(turn_rewards) if hasattr(turn_rewards, "__len__") and not isinstance(turn_rewards, (str, bytes)) \
            else type(turn_rewards).__name__
        raise ValueError(f"turn_rewards must have B = {B} entries (one sequence of per-turn rewards per row), "
                         f"got {got}")
    out = []
    for i, row in enumerate(turn_rewards):
        if row is None:
            out.append([])
            continue
        if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
            raise ValueError(f"turn_rewards[{i}] must be a sequence of per-turn rewards, got {type(row).__name__}")
        vals = []
        for k, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, (int, float)) and not hasattr(x, "__float__"):
                raise ValueError(f"turn_rewards[{i}][{k}] must be a real number, got {x!r}")
            v = float(x)
            if v != v or v in (float("inf"), float("-inf")):
                raise ValueError(f"turn_rewards[{i}][{k}] must be finite, got {v}")
            vals.append(v)
        out.append(vals)
    return out


def _nan_reward_error(rewards: torch.Tensor, groups: list, skip_hint: bool = True) -> ValueError:
    i = int(torch.nonzero(torch.isnan(rewards))[0])
    g = groups[i]
    members = [k for k, x in enumerate(groups) if x == g]
    hint = ("; set skip_nan=True (OARConfig) to leave unscorable rollouts out of the group statistics with A = 0"
            if skip_hint else "")
    return ValueError(f"rewards[{i}] is NaN (group {g!r}, rows {members[:8]}{'...' if len(members) > 8 else ''})"
                      f"{hint}")


def batch_sequence_advantages(b: Batch, batch: RolloutBatch, config, preset: str | None) -> torch.Tensor:
    """(B,) float32 CPU sequence advantages of a validated batch: the batch's own (finite, within float32), or
    :func:`sequence_advantages` of its rewards and groups. Raises ValueError naming the field."""
    if batch.sequence_advantages is not None:
        raw = _args.real_arg("sequence_advantages", batch.sequence_advantages, "(B,)", (b.B,)).detach().cpu()
        return _args.fits_float32("sequence_advantages", _args.finite_arg("sequence_advantages", raw))
    if b.rewards is None or b.group_ids is None:
        raise ValueError("the batch needs sequence_advantages, or rewards and group_ids to compute them")
    return sequence_advantages(b.rewards.cpu(), config, group_ids=b.group_ids, preset=preset)


def sequence_advantages(rewards: torch.Tensor, config=None, *, offsets=None, group_ids=None,
                        group_size: int | None = None, preset: str | None = None) -> torch.Tensor:
    """(N,) float32 group advantages with the estimator and conventions of ``config`` (method.md section 1).

    Args:
        rewards: (N,) real rewards (NaN only with ``config.advantages.skip_nan``).
        config: ``oar.OARConfig``: ``advantages.estimator`` (``dr_grpo`` for method ``dr_grpo``), ``std``, ``eps``,
            ``singleton``, ``skip_nan``.
        offsets / group_ids / group_size: the groups, exactly one (``group_ids`` in any row order).
        preset: ``"trl"``, ``"verl"``, ``"openrlhf"`` or ``"default"``: decides std, eps and singleton as
            :func:`oar.ops.group_advantages` does, instead of the config's.

    Returns:
        (N,) float32 on ``rewards.device``, in the caller's row order.

    Raises:
        ValueError: as :func:`oar.ops.group_advantages`; a NaN reward without ``skip_nan`` names its group.
    """

    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-D (N,) tensor, got {got}")
    a = (config if config is not None else OARConfig()).advantages
    if rewards.is_floating_point() and not a.skip_nan and rewards.device.type != "meta" and bool(rewards.isnan().any()):
        groups = group_ids_from(rewards.shape[0], offsets=offsets, group_ids=group_ids, group_size=group_size)
        raise _nan_reward_error(rewards.detach().cpu(), groups)
    kw = dict(estimator=a.estimator, skip_nan=a.skip_nan)
    kw.update(dict(preset=preset) if preset is not None else dict(std=a.std, eps=a.eps, singleton=a.singleton))
    return ops.group_advantages(rewards, offsets, group_ids=group_ids, group_size=group_size, **kw)


