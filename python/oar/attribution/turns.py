"""Multi-turn sessions (docs/method.md section 13, our extension): the turns of a row from its eligible mask, the
answer probe's log-likelihood at the turn boundaries, and the turn weights that split a session's advantage.

A session is one rollout row whose completion holds the model's turns and, between them, observations (tool
results, environment messages) that the trainer's own mask leaves out of the loss: TRL's ``completion_mask &
tool_mask``, verl's ``response_mask``, OpenRLHF's ``action_mask``, all of which the adapters pass as the batch's
``eligible_mask``. A turn is a maximal run of eligible tokens; everything here reads the stored ids and masks only.
"""

from __future__ import annotations

from typing import Sequence

import torch

from oar import ops
from oar.attribution.base import clean_probe_logits
from oar.attribution.context import ProbeContextBuilder

__all__ = ["turn_segments", "turn_runs", "answer_log_likelihoods", "turn_weights", "reward_turn_weights",
           "reshape_turns"]


def turn_runs(eligible: torch.Tensor) -> list[tuple[int, int]]:
    """The maximal runs ``[a, b)`` of True in ``eligible`` (1-D bool, one row's completion tokens in order): the
    model's turns of a session, in order. Empty when no token is eligible."""
    e = eligible.detach().bool().cpu().reshape(-1).tolist()
    runs, start = [], None
    for j, on in enumerate(e):
        if on and start is None:
            start = j
        elif not on and start is not None:
            runs.append((start, j))
            start = None
    if start is not None:
        runs.append((start, len(e)))
    return runs


def turn_segments(eligible: torch.Tensor) -> list[tuple[int, int]]:
    """The completion ranges ``[s, e)`` scored as one probe row each (docs/method.md section 13).

    Args:
        eligible: (n,) bool or 0/1, one row's completion tokens in order, True on the model's tokens.

    Returns:
        One range per turn, in order. The first starts at 0 (tokens before the first turn belong to it, unscored);
        turn k < K ends where its observation starts; the last runs to n (a trailing observation or EOS stays in it).
        A row with at most one turn is one range ``[(0, n)]``: the row itself, scored as without turns.
    """
    n = int(eligible.numel())
    runs = turn_runs(eligible)
    if len(runs) <= 1:
        return [(0, n)]
    starts = [0] + [a for a, _ in runs[1:]]
    ends = [b for _, b in runs[:-1]] + [n]
    return list(zip(starts, ends))


def answer_log_likelihoods(model, builder: ProbeContextBuilder, prompts: Sequence, prefixes: Sequence,
                           answers: Sequence[str], memory_budget_mb: int | None = None) -> tuple[torch.Tensor, int]:
    """Mean log-probability (nats per answer token) of each reference answer after ``prompt + prefix + conclude``.

    Args:
        model: the policy as an ``oar.attribution.ProbeModel``.
        builder: the pipeline's :class:`ProbeContextBuilder` (conclude string, answer suffix, PAD).
        prompts, prefixes: n token id sequences each; the probe reads ``prompt + prefix`` (the whole prefix, no
            marker cut: observations are context).
        answers: n reference answers (str).
        memory_budget_mb: activation budget of one forward chunk (None: one forward).

    Returns:
        ``(ll (n,) float64 CPU, forwards run)``: ll[i] = mean over the answer's tokens of log p(token | context),
        from the model's probe logits in float32.
    """
    n = len(prompts)
    if n == 0:
        return torch.zeros(0, dtype=torch.float64), 0
    pb = builder.build(list(prompts), list(prefixes), list(answers), [len(p) for p in prefixes])
    logits, forwards = clean_probe_logits(model, pb, memory_budget_mb=memory_budget_mb, return_forwards=True)
    logits = logits.float().cpu()
    logp = torch.log_softmax(logits, dim=-1)
    tok = torch.gather(logp, -1, pb.answer_ids[:, :, None]).squeeze(-1)
    on = torch.arange(pb.answer_ids.shape[1])[None, :] < pb.answer_len[:, None]
    ll = (tok.double() * on).sum(-1) / pb.answer_len.double()
    if not bool(torch.isfinite(ll).all()):
        i = int(torch.nonzero(~torch.isfinite(ll))[0])
        raise ValueError(f"the answer probe's log-likelihood is not finite at probe context {i} (got {float(ll[i])}): "
                         "the policy's probe logits hold -inf or NaN")
    return ll, int(forwards)


def turn_weights(gains: torch.Tensor, counts: torch.Tensor, floor: float) -> torch.Tensor:
    """Turn weights w (K,) float64 that split a session's advantage without changing its mass: ``sum_k counts[k] *
    w[k] == counts.sum()`` and ``w >= floor`` (docs/method.md section 13).

    Args:
        gains: (K,) real, turn k's change of the answer's log-likelihood (nats); only ``|gains|`` is read.
        counts: (K,) >= 0, eligible tokens of each turn (the tokens that carry the advantage).
        floor: in [0, 1): the share of the mass spread uniformly (the config's ``floor``).

    Returns:
        ``w = floor + (1 - floor) * |g| / s``, ``s = sum_k counts[k] |g[k]| / sum_k counts[k]``; all ones when
        ``s <= 1e-12`` nats (no turn moved the probe beyond float rounding) or no token is eligible.
    """
    g = gains.detach().double().abs().reshape(-1)
    c = counts.detach().double().reshape(-1)
    total = float(c.sum())
    mean = float((c * g).sum()) / total if total > 0 else 0.0
    if not mean > _NEGLIGIBLE_GAIN:
        return torch.ones_like(g)
    return floor + (1.0 - floor) * g / mean


def reward_turn_weights(rewards: Sequence[float], counts: torch.Tensor, sign: float, floor: float) -> torch.Tensor:
    """Turn weights w (K,) float64 from per-turn rewards (``turn_credit: rewards``, docs/method.md section 13): the
    session's mass moves toward the turns whose reward agrees with its outcome (a reward > 0 marks a good call, < 0 a
    bad one, 0 neutral: verl's tool rewards add to the score), ``sum_k counts[k] * w[k] == counts.sum()`` and
    ``w >= floor``.

    Args:
        rewards: K or K - 1 finite reals: one per turn, or one per turn that ends in an observation (verl's
            ``tool_rewards`` of one call a turn; the last turn, which answers, is then neutral). Empty: all ones.
        counts: (K,) >= 0, eligible tokens of each turn.
        sign: the sign of the session's advantage A_i (only its sign is read; 0 gives all ones).
        floor: in [0, 1): the share of the mass spread uniformly.

    Returns:
        ``w = floor + (1 - floor) u / u_bar`` with ``u_k = 1 + sign(A) r_k / max_j |r_j|`` in [0, 2] (a missing
        reward counts as 0) and ``u_bar = sum_k counts[k] u_k / sum_k counts[k]``; all ones when every |reward| is
        at most 1e-12, ``sign == 0`` or no token is eligible.

    Raises:
        ValueError: ``len(rewards)`` neither K nor K - 1; a reward that is not finite.
    """
    c = counts.detach().double().reshape(-1)
    K = int(c.numel())
    r = torch.tensor([float(x) for x in rewards], dtype=torch.float64)
    if r.numel() not in (0, K - 1, K):
        raise ValueError(f"rewards must hold one value per turn (K = {K}) or per turn before an observation "
                         f"(K - 1 = {K - 1}), got {r.numel()}")
    if not bool(torch.isfinite(r).all()):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    if r.numel() == 0 or sign == 0 or float(c.sum()) <= 0:
        return torch.ones(K, dtype=torch.float64)
    d = r
    if d.numel() < K:  # the answering turn: neutral
        d = torch.cat([d, torch.zeros(K - d.numel(), dtype=torch.float64)])
    spread = float(d.abs().max())
    if not spread > _NEGLIGIBLE_GAIN:
        return torch.ones(K, dtype=torch.float64)
    u = 1.0 + (1.0 if sign > 0 else -1.0) * d / spread
    mean = float((c * u).sum() / c.sum())
    if not mean > _NEGLIGIBLE_GAIN:  # every turn with tokens at u = 0: nothing to move toward
        return torch.ones(K, dtype=torch.float64)
    return floor + (1.0 - floor) * u / mean


#: a mean |gain| (nats) below this is float rounding, not a turn moving the probe (also keeps denormals out)
_NEGLIGIBLE_GAIN = 1e-12


def reshape_turns(advantages: torch.Tensor, scores: torch.Tensor, reasoning: torch.Tensor, eligible: torch.Tensor,
                  turns: dict, **reshape) -> tuple[torch.Tensor, torch.Tensor]:
    """Token advantages of a batch whose multi-turn rows are reshaped turn by turn (docs/method.md section 13).

    Args:
        advantages: (B,) float32 sequence advantages. scores, reasoning, eligible: (B, C) as
            :func:`oar.ops.reshape_advantages` takes them.
        turns: {row: [(columns (1-D int64), weight), ...]}: each turn's completion columns and weight w_k >= 0 of
            the rows reshaped by turn; every other row is reshaped as a whole.
        reshape: ``q``, ``beta``, ``floor``, ``tiers`` of :func:`oar.ops.reshape_advantages`.

    Returns:
        ``(advantages (B, C) float32, weights (B, C) float32)``: turn k of row i is reshaped on its own with
        sequence advantage ``A_i w_k`` (its mass ``A_i w_k n_k``, n_k its eligible tokens), so row i's mass is
        ``A_i sum_k w_k n_k``; ``weights`` are relative to ``A_i`` (``advantages = A_i x weights``).
    """
    if not turns:
        return ops.reshape_advantages(advantages, scores, reasoning, eligible, **reshape)
    B, C = eligible.shape
    src, adv, keep, w = [], [], [], []
    for i in range(B):
        for c, wk in turns.get(i, [(None, 1.0)]):
            m = torch.ones(C, dtype=torch.bool)
            if c is not None:
                m = torch.zeros(C, dtype=torch.bool)
                m[c] = True
            src.append(i), adv.append(float(advantages[i]) * float(wk)), keep.append(m), w.append(float(wk))
    idx = torch.tensor(src, dtype=torch.long)
    keep_v = torch.stack(keep)
    tok_v, weights_v = ops.reshape_advantages(torch.tensor(adv, dtype=torch.float32), scores[idx] * keep_v,
                                              reasoning[idx] & keep_v, eligible[idx] & keep_v, **reshape)
    tok = torch.zeros((B, C), dtype=tok_v.dtype).index_add_(0, idx, tok_v)
    weights = torch.zeros((B, C), dtype=weights_v.dtype).index_add_(
        0, idx, weights_v * torch.tensor(w, dtype=weights_v.dtype)[:, None])
    return tok, weights
