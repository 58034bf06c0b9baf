"""OAR-G (method.md section 4): gradient x input of the probe divergence under embedding noise, reshaped
(sections 5-6)."""

from __future__ import annotations

from oar.attribution import oar_g_scores
from oar.methods.base import RESHAPE, MethodSpec, Step, TokenScorer


class OARGScorer(TokenScorer):
    """OAR-G scores of the eligible reasoning tokens (:func:`oar.attribution.oar_g_scores`) with the config's probe,
    sigma and noise draws, the noise drawn from the pipeline's generator."""

    def score(self, step: Step, pm, pbatch, positions):
        cfg = self.config
        return oar_g_scores(pm, pbatch, probe=cfg.probe, rows=step.active, sigma=cfg.sigma,
                            noise_draws=cfg.noise_draws, generator=step.generator,
                            memory_budget_mb=step.memory_budget_mb, positions=positions)


SPEC = MethodSpec("oar_g", RESHAPE, needs_model=True, needs_tokenizer=True, needs_answers=True, scorer=OARGScorer)
