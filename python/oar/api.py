"""Functional API for custom training loops: rewards in, per-token advantages out, in one call.

:func:`token_advantages` = group advantages (method.md section 1) + the method of ``config.method`` (attribution
and reshaping, sections 2-6, or a baseline of section 8), through the one pipeline every trainer adapter uses
(:mod:`oar.pipeline`, cached per (tokenizer, config) by :mod:`oar.pipeline_cache`), so a method behaves identically everywhere.
"""

from __future__ import annotations

from typing import Sequence

import torch

from oar.batch import RolloutBatch, TokenAdvantages
from oar.groups import group_ids_from
from oar.pipeline_cache import pipeline_for

__all__ = ["token_advantages"]


def token_advantages(rewards: torch.Tensor, *, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                     offsets=None, group_ids=None, group_size: int | None = None, model=None, tokenizer=None,
                     prompt_ids: Sequence | None = None, answers: Sequence[str] | None = None, config=None,
                     eligible_mask: torch.Tensor | None = None, preset: str | None = None,
                     span_starts: torch.Tensor | None = None,
                     turn_rewards: Sequence | None = None) -> TokenAdvantages:
    """Group advantages + the configured method in one call (method.md sections 1-6 and 8).

    Args:
        rewards: (B,) real rewards of B rollouts.
        completion_ids: (B, C) integer, right-padded completions (response tokens only).
        completion_mask: (B, C) bool or 0/1, 1 on completion tokens.
        offsets / group_ids / group_size: the groups, exactly one (``group_ids`` in any row order; see
            :func:`oar.ops.group_advantages`).
        model: the policy (Hugging Face causal LM or a ProbeModel); needed by ``entropy``,
            ``entropy_shaping``, ``oar_p``, ``oar_g``. Parameter ``.grad`` is never written.
        tokenizer: the policy's tokenizer; needed by ``random``, ``entropy``, ``oar_p``, ``oar_g`` (reasoning
            span, probe context) and used by ``ktae`` to score EOS/PAD 0.
        prompt_ids: B unpadded prompts (lists or 1-D tensors); needed whenever ``model`` is.
        answers: B reference answers (strings); needed by ``oar_p`` and ``oar_g``.
        config: ``oar.OARConfig`` (default: OAR-G, answer_mean probe, q = 0.25, beta = 1, floor = 0.1).
        eligible_mask: (B, C) tokens that carry the loss, a subset of ``completion_mask`` (default
            ``completion_mask``); nothing outside it is masked, perturbed or scored.
        preset: trainer convention of the group statistics ("trl", "verl", "openrlhf"); default: the config's.
        span_starts: optional (B, C) bool, True on the tokens that begin a masking unit (your own spans, e.g.
            reasoning steps; docs/method.md section 11), used instead of the config's ``mask_unit``.
        turn_rewards: optional B sequences of per-turn rewards of multi-turn sessions (one per turn, or one per turn
            before an observation), read by ``turn_credit: rewards`` (docs/method.md section 13).

    Returns:
        :class:`oar.batch.TokenAdvantages` with ``advantages`` (B, C) float32 (0 off ``eligible_mask``),
        ``weights``, ``scores``, ``reasoning_mask``, ``metrics`` and ``sequence_advantages`` (B,) float32.
        For the reshaping methods (grpo, dr_grpo, random, entropy, oar_p, oar_g) each row keeps its mass:
        advantages[b].sum() == sequence_advantages[b] * eligible_mask[b].sum().

    Raises:
        ValueError: bad rewards/groups (see :func:`oar.ops.group_advantages`; a NaN reward names its group),
            ``config`` that is not an ``oar.OARConfig``, a method's missing input (model, tokenizer, prompt_ids,
            answers), shapes (naming the argument, rows in the caller's indexing).
    """
    pipe = pipeline_for(config, tokenizer)
    n = int(completion_ids.shape[0]) if isinstance(completion_ids, torch.Tensor) and completion_ids.dim() == 2 else 0
    groups = group_ids_from(n, offsets=offsets, group_ids=group_ids, group_size=group_size)
    if groups is None:
        raise ValueError("pass exactly one of offsets, group_ids, group_size; got none")
    batch = RolloutBatch(completion_ids, completion_mask, prompt_ids=prompt_ids, eligible_mask=eligible_mask,
                         rewards=rewards, group_ids=groups, answers=answers, span_starts=span_starts,
                         turn_rewards=turn_rewards)
    return pipe.compute(batch, model, preset=preset)
