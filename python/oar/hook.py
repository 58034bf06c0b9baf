"""Framework-agnostic hook: the sequence advantages of a generation batch in, per-token advantages out.

:class:`TokenAdvantageHook` is a thin adapter from a trainer's tensors to :class:`oar.pipeline.RolloutBatch`;
the methods themselves live in :mod:`oar.pipeline` (one implementation for every adapter).
"""

from __future__ import annotations

from typing import Sequence

import torch

from oar.attribution import DEFAULT_MARKERS
from oar.pipeline import Pipeline, RolloutBatch, TokenAdvantages, group_ids_from

__all__ = ["TokenAdvantageHook", "TokenAdvantages"]


class TokenAdvantageHook:
    """Turns GRPO sequence advantages into per-token advantages (method.md sections 2-8), one batch per call.

    Args:
        config: ``oar.OARConfig`` (method, probe, reshape, sigma, noise_draws, conclude, budget, seed).
        tokenizer: the policy's Hugging Face tokenizer.
        markers: final-answer markers that end the reasoning span.
        pad_id: PAD id for OAR-P masking (default: tokenizer pad, then eos).
        sync_forwards: keep attribution forwards in step across ranks (:class:`oar.distributed.ForwardGate`);
            None = whenever torch.distributed runs with more than one process (required under ZeRO-3 / FSDP).

    Rollouts whose sequence advantage is exactly 0 are not scored (their token advantages are 0 whatever the
    weights); the skipped share is reported as ``oar/skipped_rows_frac``.

    Raises:
        ValueError: ``config`` not an ``oar.OARConfig``; a tokenizer without pad and eos ids.
    """

    def __init__(self, config, tokenizer, markers: Sequence[str] = DEFAULT_MARKERS, pad_id: int | None = None,
                 sync_forwards: bool | None = None):
        self.pipeline = Pipeline(config, tokenizer, markers=markers, pad_id=pad_id, sync_forwards=sync_forwards)

    @property
    def config(self):
        return self.pipeline.config

    @property
    def tokenizer(self):
        return self.pipeline.tokenizer

    @property
    def builder(self):
        return self.pipeline.builder

    @property
    def calls(self) -> int:
        return self.pipeline.calls

    def reasoning_lengths(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[int]:
        """L_i of each completion row (right-padded completions, mask 1 on real tokens)."""
        return self.pipeline.reasoning_lengths(completion_ids, completion_mask)

    def compute(self, model, prompt_ids: Sequence, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                advantages: torch.Tensor, answers: Sequence[str], eligible_mask: torch.Tensor | None = None,
                rewards: torch.Tensor | None = None, group_offsets=None) -> TokenAdvantages:
        """Per-token advantages for one generation batch.

        Args:
            model: the policy (HF causal LM or a ProbeModel); used without touching parameter grads.
            prompt_ids: B unpadded prompt id sequences (lists or 1-D tensors).
            completion_ids: (B, C) integer, right-padded completions.
            completion_mask: (B, C) 0/1 or bool, 1 on completion tokens (TRL's completion_mask).
            advantages: (B,) real, finite sequence advantages.
            answers: B reference answers (strings).
            eligible_mask: (B, C) tokens that carry the loss, a subset of completion_mask (default
                completion_mask; e.g. completion_mask * tool_mask). Nothing outside it is masked, perturbed or
                scored.
            rewards: (B,) rewards: KTAE's correctness (NaN = unscorable = wrong).
            group_offsets: the groups, CSR offsets (G + 1,) or an int group size: KTAE's token tables and the
                ``oar/skipped_groups_frac`` metric.

        Returns:
            :class:`oar.pipeline.TokenAdvantages` on ``advantages.device``.

        Raises:
            ValueError: as :meth:`oar.pipeline.Pipeline.compute` (arguments named, rows in the caller's indexing).
        """
        if not isinstance(advantages, torch.Tensor) or advantages.dim() != 1:
            got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
            raise ValueError(f"advantages must be a (B,) tensor of sequence advantages, got {got}")
        B = advantages.shape[0]
        if isinstance(completion_ids, torch.Tensor) and completion_ids.dim() == 2 and completion_ids.shape[0] != B:
            raise ValueError(f"advantages must be (B,) = ({completion_ids.shape[0]},) like completion_ids' rows, got "
                             f"{tuple(advantages.shape)}")
        groups = None
        if group_offsets is None and self.pipeline.method.needs("groups"):
            raise ValueError(f"method {self.config.method!r} needs the groups: pass group_offsets (CSR offsets (G + 1,) "
                             "or an int group size) so that token tables are built per prompt")
        if group_offsets is not None:
            size = group_offsets if isinstance(group_offsets, int) and not isinstance(group_offsets, bool) else None
            groups = group_ids_from(B, offsets=None if size is not None else group_offsets, group_size=size)
        batch = RolloutBatch(completion_ids, completion_mask, prompt_ids=prompt_ids, eligible_mask=eligible_mask,
                             rewards=rewards, group_ids=groups, answers=answers, sequence_advantages=advantages)
        return self.pipeline.compute(batch, model)
