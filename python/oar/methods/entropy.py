"""Entropy importance (method.md section 8): the policy's next-token entropy at each reasoning token, reshaped as
OAR's scores are. The trainer's own entropies (``RolloutBatch.entropy``) are used when given: no forward."""

from __future__ import annotations

import torch

from oar.attribution import entropy_scores
from oar.methods.base import RESHAPE, MethodSpec, Step, TokenScorer


class EntropyScorer(TokenScorer):
    """Entropies of the policy at the reasoning tokens (:func:`oar.attribution.entropy_scores`)."""

    def precomputed(self, step: Step) -> torch.Tensor | None:
        """(B, C) float32 entropies the trainer passed with the batch, else None."""
        return step.b.entropy

    def score(self, step: Step, pm, pbatch, positions):
        return entropy_scores(pm, pbatch, rows=step.active, memory_budget_mb=step.memory_budget_mb)


SPEC = MethodSpec("entropy", RESHAPE, needs_model=True, needs_tokenizer=True, scorer=EntropyScorer)
