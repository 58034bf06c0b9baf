"""Random inputs shared by the test files of the ops that take the same arguments (normalize_importance and
reshape_advantages; probe_divergence and its backward). Drawn on the CPU from a seeded generator, so every device
sees the same values."""

from __future__ import annotations

import torch


def make_batch(B, T, seed=0, p_resp=0.85, p_reason=0.8, zeros=0.2, dtype=torch.float32):
    """Right-padded responses of random length; the reasoning span is a random subset of the response."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    resp = torch.arange(T)[None, :] < lengths[:, None]
    reason = resp & (torch.rand(B, T, generator=g) < p_reason)
    scores = torch.rand(B, T, generator=g) ** 3 * 20
    scores[torch.rand(B, T, generator=g) < zeros] = 0.0
    adv = torch.randn(B, generator=g)
    return adv, scores.to(dtype), reason, resp


def reshape_case(B, T, dtype, seed, ties=False, empty_rows=(), equal_rows=()):
    """Responses whose first token is always on (scores in [0, 3)), optional ties (few distinct values: radix-select
    multiplicities of the CUDA quantile), rows with an empty span and rows of all-equal scores."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    if ties:
        scores = (scores * 4).round() / 4
    resp = torch.rand(B, T, generator=g) < 0.9
    resp[:, 0] = True
    reason = resp & (torch.rand(B, T, generator=g) < 0.75)
    for b in empty_rows:
        reason[b] = False
    for b in equal_rows:
        scores[b] = 0.5
    adv = torch.randn(B, generator=g)
    return adv, scores.to(dtype), reason, resp


def make_inputs(N, S, V, dtype, seed=0, noise=0.5, scale=2.0):
    """Probe logits: clean (N, S, V), perturbed = clean + noise, answer ids (N, S) and lengths (N,) in [1, S]."""
    g = torch.Generator().manual_seed(seed)
    clean = (scale * torch.randn(N, S, V, generator=g)).to(dtype)
    pert = (clean.float() + noise * torch.randn(N, S, V, generator=g)).to(dtype)
    ids = torch.randint(0, V, (N, S), generator=g)
    lengths = torch.randint(1, S + 1, (N,), generator=g)
    return clean, pert, ids, lengths
