"""The random-credit baseline (method.md section 8): I_t ~ U(0, 1) i.i.d. on the reasoning tokens of the rows asked
for."""

from __future__ import annotations

from typing import Sequence

import torch

from oar.attribution.base import Attribution, check_rows, empty_attribution
from oar.attribution.context import ProbeBatch


def random_scores(batch: ProbeBatch, *, rows: Sequence[int] | None = None,
                  generator: torch.Generator | None = None) -> Attribution:
    """Random-credit baseline (method.md section 8): I_t ~ U(0, 1) i.i.d.

    Args:
        batch: probe contexts. rows: rows to score (default all). generator: CPU generator of the draws.

    Returns:
        Attribution with scores (B, L_max) float32 in [0, 1) on the mask, 0 elsewhere; stats ``forward_passes`` (0),
        ``seconds``.
    Raises:
        ValueError: rows out of range or not integers.
    """
    rows = check_rows(batch, rows)
    res = empty_attribution(batch, rows)
    rand = torch.rand(res.scores.shape, generator=generator)
    res.scores = torch.where(res.mask, rand, torch.zeros_like(rand))
    res.stats.update(forward_passes=0, seconds=0.0)
    return res
