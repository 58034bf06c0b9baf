"""Entropy-advantage shaping (Cheng et al., arXiv 2506.14758; method.md section 8): A_t = A + min(alpha H_t, |A| /
kappa) on the eligible tokens, H_t the policy's entropy (the trainer's own, ``RolloutBatch.entropy``, else one
forward over the rows with A != 0)."""

from __future__ import annotations

import torch

from oar import baselines
from oar.attribution import policy_entropies
from oar.batch import check_token_ids
from oar.methods.base import ADD, BonusScorer, MethodSpec, Step


class EntropyShapingBonus(BonusScorer):
    """The capped entropy bonus (:func:`oar.baselines.entropy_shaping_advantages`)."""

    def bonus(self, step: Step):
        b = step.b
        if b.entropy is not None:
            H = b.entropy
        else:
            for name, value in (("model", step.model), ("prompt_ids", b.prompt_ids)):
                SPEC.require(name, value, "to compute the policy entropies, or pass the batch's entropy (B, C)")
            on = torch.zeros(b.B, dtype=torch.bool)
            on[step.active] = True
            with step.model_pass() as pm:
                prompts = check_token_ids(b.cids, b.cmask, b.prompt_ids, step.active, int(pm.vocab_size))
                H = policy_entropies(pm, prompts, b.cids, b.cmask & on[:, None],
                                     memory_budget_mb=step.memory_budget_mb)
            step.stats["forward_passes"] = step.gate.real_calls[1] if step.gate is not None else int(bool(step.active))
        sc = torch.where(b.eligible, H, torch.zeros(()))
        es = self.config.entropy_shaping
        tok = baselines.entropy_shaping_advantages(step.adv, sc, b.eligible, alpha=es.alpha, kappa=es.kappa)
        return tok, sc, b.eligible.clone()


SPEC = MethodSpec("entropy_shaping", ADD, needs_model=True, scorer=EntropyShapingBonus)
