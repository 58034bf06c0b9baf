"""Weight diagnostics of reshaped advantages (method.md section 9).

All functions take weights / token advantages (B, T) and a response mask (B, T) and return per-row
float32 values (B,); rows with an empty mask give NaN-free defaults documented per function.
"""

from __future__ import annotations

import time

import torch

from oar.groups import resolve_groups


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


def pipeline_metrics(tok: torch.Tensor, weights: torch.Tensor, eligible: torch.Tensor, reasoning: torch.Tensor,
                     active: list, stats: dict, adv: torch.Tensor, groups: list | None, t0: float) -> dict:
    """The diagnostics of method.md section 9 of one pipeline call, one definition for every method and adapter.

    Args: token advantages ``tok``, ``weights`` (B, C) float32, ``eligible`` / ``reasoning`` (B, C) bool, the scored
    rows ``active``, the engines' ``stats``, sequence advantages ``adv`` (B,), the rows' group ids (or None) and the
    call's start ``t0`` (``time.perf_counter()``).

    Returns: ``oar/ess_ratio``, ``oar/top10_mass``, ``oar/reasoning_frac``, ``oar/skipped_rows_frac``,
    ``oar/skipped_groups_frac`` (with groups), ``oar/screen_fraction`` and ``oar/masked_frac`` (screened OAR-P),
    ``oar/forward_passes``, ``oar/padding_forwards``, ``oar/attribution_seconds`` (floats).
    """
    B = tok.shape[0]
    rows = [i for i in active if bool(eligible[i].any())]
    idx = torch.tensor(rows, dtype=torch.long)
    w = weights.abs()
    out = {
        "oar/ess_ratio": float(ess_ratio(w[idx], eligible[idx]).mean()) if rows else 1.0,
        "oar/top10_mass": float(top_mass(tok[idx], w[idx], eligible[idx], 0.1).mean()) if rows else 0.1,
        "oar/reasoning_frac": float(reasoning.sum() / eligible.sum().clamp_min(1)),
        "oar/skipped_rows_frac": 1.0 - len(active) / max(B, 1),
    }
    if groups is not None and B:
        g = resolve_groups(adv, group_ids=groups)
        a, off = g.gather(adv), g.offsets.tolist()
        spans = [(int(x), int(y)) for x, y in zip(off, off[1:]) if y > x]
        out["oar/skipped_groups_frac"] = sum(bool((a[x:y] == 0).all()) for x, y in spans) / max(len(spans), 1)
    if "screen_fraction" in stats:  # screened OAR-P: the share taken from the screen, the share masked
        out["oar/screen_fraction"] = float(stats["screen_fraction"])
        # windowed OAR-P (screen_fraction = screen_sample = 0) masks nothing exactly and reports no counts
        out["oar/masked_frac"] = float(stats.get("masked", 0)) / max(int(stats.get("scored_tokens", 0)), 1)
    out["oar/forward_passes"] = float(stats.get("forward_passes", 0))
    out["oar/padding_forwards"] = float(stats.get("padding_forwards", 0))
    out["oar/attribution_seconds"] = time.perf_counter() - t0
    return out
