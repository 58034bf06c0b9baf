"""KTAE (Sun et al., arXiv 2505.16826; method.md section 8): A_t = A + a token-level bonus from per-prompt
contingency tables of token occurrence in correct and wrong rollouts. Correctness: reward > threshold (NaN =
unscorable = wrong), or A > 0 when the batch carries no rewards."""

from __future__ import annotations

import torch

from oar import baselines
from oar.methods.base import ADD, BonusScorer, MethodSpec, Step


class KTAEBonus(BonusScorer):
    """The KTAE bonus (:func:`oar.baselines.ktae_token_scores`) added to A (:func:`oar.baselines.add_token_bonus`)."""

    def bonus(self, step: Step):
        b = step.b
        SPEC.require("group_ids", b.group_ids, "the token tables are built per prompt")
        kt = self.config.ktae
        if b.rewards is None:
            r, threshold = step.adv.double(), 0.0  # [decided] correct = A > 0 (method.md section 8)
        else:
            r = torch.nan_to_num(b.rewards.cpu().double(), nan=float("-inf")).clamp_min(-3e38)
            threshold = kt.threshold
        sc = baselines.ktae_token_scores(b.cids, b.eligible, r, group_ids=b.group_ids, alpha=kt.alpha, beta=kt.beta,
                                         tf=kt.tf, scale=kt.scale, threshold=threshold, ignore_ids=step.ignore_ids)
        tok = baselines.add_token_bonus(step.adv, sc, b.eligible)
        return tok, sc, b.eligible.clone()


SPEC = MethodSpec("ktae", ADD, needs_groups=True, scores_all_rows=True, scorer=KTAEBonus)
