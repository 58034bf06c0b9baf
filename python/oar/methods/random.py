"""Random importance (method.md section 8, the control of the reshaping): i.i.d. scores on the reasoning tokens from
the pipeline's generator, reshaped as OAR's scores are."""

from __future__ import annotations

from oar.attribution import random_scores
from oar.methods.base import RESHAPE, MethodSpec, Step, TokenScorer


class RandomScorer(TokenScorer):
    """Uniform random scores (:func:`oar.attribution.random_scores`) on the reasoning tokens of the active rows."""

    def score(self, step: Step, pm, pbatch, positions):
        return random_scores(pbatch, rows=step.active, generator=step.generator)


SPEC = MethodSpec("random", RESHAPE, needs_tokenizer=True, scorer=RandomScorer)
