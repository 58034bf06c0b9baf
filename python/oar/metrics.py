"""Weight diagnostics of reshaped advantages (method.md section 9).

All functions take weights / token advantages (B, T) and a response mask (B, T) and return per-row
float32 values (B,); rows with an empty mask give NaN-free defaults documented per function.
"""

from __future__ import annotations

import torch


def ess_ratio(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Effective-sample-size ratio per row: (sum w)^2 / (L * sum w^2) over masked tokens, in (0, 1];
    1 for uniform weights. Rows with no masked token or all-zero weights give 1."""
    m = mask.bool()
    w = torch.where(m, weights.float(), torch.zeros((), dtype=torch.float32, device=weights.device))
    L = m.sum(-1).float()
    s1 = w.sum(-1)
    s2 = (w * w).sum(-1)
    out = torch.ones_like(s1)
    ok = (L > 0) & (s2 > 0)
    out[ok] = s1[ok] ** 2 / (L[ok] * s2[ok])
    return out


def top_mass(token_advantages: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, frac: float = 0.1) -> torch.Tensor:
    """Share of sum_t |A_t| carried by the ceil(frac * L) highest-weighted masked tokens of each row, in
    [0, 1]; equals about ``frac`` for uniform weights. Rows with zero advantage mass give ``frac``.

    Raises ValueError when frac is outside (0, 1]."""
    if not 0 < frac <= 1:
        raise ValueError(f"frac must be in (0, 1], got {frac}")
    m = mask.bool()
    a = torch.where(m, token_advantages.float().abs(), torch.zeros((), device=token_advantages.device))
    w = torch.where(m, weights.float(), torch.full((), -float("inf"), device=weights.device))
    out = torch.full((a.shape[0],), float(frac), dtype=torch.float32, device=a.device)
    L = m.sum(-1)
    for b in range(a.shape[0]):
        n = int(L[b])
        total = float(a[b].sum())
        if n == 0 or total <= 0:
            continue
        k = max(1, int(-(-frac * n // 1)))
        top = torch.topk(w[b], k).indices
        out[b] = a[b, top].sum() / total
    return out
