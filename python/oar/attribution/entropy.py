"""Policy entropies: the full-vocabulary entropy H_t (nats, temperature 1) of the next-token distribution at the
position that predicts token t. One engine (:func:`_chunked_entropies`) runs them over rows in chunks planned by
:func:`oar.attribution.planner.plan_entropy`; two entry points use it:

- :func:`entropy_scores`: at the reasoning tokens of probe contexts, the entropy baseline of method.md section 8
  (an :class:`~oar.attribution.base.Attribution`);
- :func:`policy_entropies`: at the completion tokens of rollouts (prompt + completion), the input of entropy
  shaping (:func:`oar.baselines.entropy_shaping_advantages`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

from oar import _args
from oar.attribution import planner
from oar.attribution.base import Attribution, check_ids, check_rows, empty_attribution
from oar.attribution.context import ProbeBatch
from oar.attribution.hf_model import as_probe_model
from oar.attribution.model import ProbeModel, probe_capabilities

_log = logging.getLogger("oar")


def entropy_from_logits(logits: torch.Tensor, name: str = "logits") -> torch.Tensor:
    """Entropy H = -sum_v p_v log p_v (nats) of softmax(logits) over the last dimension, with 0 log 0 = 0, so
    -inf logits (tokens of zero probability, e.g. masked vocabularies) are allowed.

    Args:
        logits: (..., V) float tensor (any float dtype; computed in float32).
        name: how error messages name ``logits``.

    Returns:
        (...,) float32, >= 0.

    Raises:
        ValueError: a NaN or +inf logit, or a position whose logits are all -inf (no distribution).
    """
    x = logits.float()
    bad = torch.isnan(x) | (x == float("inf"))
    if bool(bad.any()):
        idx = [int(i) for i in torch.nonzero(bad)[0]]
        raise ValueError(f"{name} must not hold NaN or +inf, got {float(x[tuple(idx)])} at {idx}")
    empty = x.amax(-1) == float("-inf")
    if bool(empty.any()):
        idx = [int(i) for i in torch.nonzero(empty)[0]]
        raise ValueError(f"{name} at {idx} are all -inf: no next-token distribution")
    return entropy_from_logprobs(torch.log_softmax(x, dim=-1))


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy H = -sum_v p_v log p_v (nats) of a distribution given by its log-probabilities over the last
    dimension (a ``log_softmax`` output: finite or -inf, not checked), with 0 log 0 = 0. The one entropy formula of
    the package (:func:`entropy_from_logits` checks logits, then calls it).

    Args:
        logp: (..., V) float tensor of log-probabilities.

    Returns:
        (...,) tensor of ``logp``'s dtype, >= 0.
    """
    plogp = torch.where(torch.isneginf(logp), torch.zeros((), dtype=logp.dtype, device=logp.device), logp.exp() * logp)
    return (-plogp.sum(-1)).clamp_min(0)


def _chunked_entropies(model: ProbeModel, contexts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                       counts: Sequence[int], budget: int, name: Callable[[int], str],
                       pad_id: int = 0) -> tuple[list[torch.Tensor], int]:
    """The entropy engine: entropies of the positions predicting the last ``counts[i]`` tokens of each context.

    Contexts are left-padded together in chunks (:func:`oar.attribution.planner.plan_entropy`: the float32 logits of
    the kept positions under ``budget``), one no-grad ``tail_logits`` call per chunk keeping the last
    ``max(counts) + 1`` positions (fewer when a chunk is narrower).

    Args:
        model: a checked ProbeModel.
        contexts: per row, (ids, attention mask, position ids), 1-D int64 CPU tensors of one length n_i >
            counts[i]; the token before the last counts[i] is attended (it predicts the first of them).
        counts: per row, an int >= 1.
        budget: bytes (:func:`oar.attribution.planner.budget_bytes`).
        name: row index -> how error messages name that row's logits.
        pad_id: token id of the left padding (not attended).

    Returns:
        (per row a (counts[i],) float32 CPU tensor, forward passes run).

    Raises:
        ValueError: NaN / +inf logits or all -inf logits at a predicting position (:func:`entropy_from_logits`).
    """
    if not contexts:
        return [], 0
    dev = torch.device(model.device)
    keep = max(counts) + 1
    out: list[torch.Tensor] = []
    plan = planner.plan_entropy(int(model.vocab_size), keep, len(contexts), budget)
    with torch.no_grad():
        for ch in plan:
            part = range(ch.begin, ch.end)
            width = max(int(contexts[i][0].numel()) for i in part)
            ids = torch.full((len(part), width), int(pad_id), dtype=torch.long)
            attn = torch.zeros((len(part), width), dtype=torch.long)
            pos = torch.zeros((len(part), width), dtype=torch.long)
            for k, i in enumerate(part):
                x, a, p = contexts[i]
                ids[k, width - x.numel():] = x
                attn[k, width - x.numel():] = a
                pos[k, width - x.numel():] = p
            k_keep = min(keep, width)
            logits = model.tail_logits(input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev),
                                       keep=k_keep)
            for k, i in enumerate(part):
                L = counts[i]
                # window index of the position predicting the row's first counted token: k_keep - L - 1
                out.append(entropy_from_logits(logits[k, k_keep - L - 1: k_keep - 1], name(i)).cpu())
    return out, len(plan)


def entropy_scores(model: ProbeModel, batch: ProbeBatch, *, rows: Sequence[int] | None = None,
                   memory_budget_mb: int = planner.DEFAULT_MEMORY_BUDGET_MB) -> Attribution:
    """Entropy baseline (method.md section 8): I_t = H(softmax(logits predicting reasoning token t)), the
    full-vocabulary entropy of the policy at the step that produced token t (temperature 1), in nats. The probe
    context's prefix is exactly the generation context, so these equal the sampling-time entropies.

    The rows' contexts up to their last reasoning token run in no-grad chunks under ``memory_budget_mb``
    (:func:`_chunked_entropies`), the LM head on the positions from the one predicting the first reasoning token on.

    Args:
        model: a ProbeModel. batch: probe contexts. rows: rows to score (default all).
        memory_budget_mb: int >= 1, the chunks' float32 logits budget.

    Returns:
        Attribution with scores (B, L_max) float32 >= 0; stats ``forward_passes``, ``chunks``, ``seconds``.
    Raises:
        TypeError: ``model`` is not a ProbeModel.
        ValueError: rows out of range, memory_budget_mb not an int >= 1, token ids outside the model's vocabulary, a
            scored row with an empty prompt, NaN / +inf logits.
    """
    probe_capabilities(model)
    rows = check_rows(batch, rows)
    budget = planner.budget_bytes(memory_budget_mb)
    check_ids(model, batch)
    t0 = time.perf_counter()
    res = empty_attribution(batch, rows)
    T = int(batch.input_ids.shape[1])
    scored, contexts, counts = [], [], []
    for r in rows:
        L = int(batch.reasoning_len[r])
        if L == 0:
            continue
        s = int(batch.reasoning_start[r])
        if s < 1 or int(batch.attention_mask[r, s - 1]) == 0:
            raise ValueError(f"entropy_scores: row {r} has an empty prompt; the first reasoning token has no "
                             "predicting position")
        a = T - int(batch.context_len[r])  # the row's first column: before it, left padding only
        cols = slice(a, s + L)
        contexts.append((batch.input_ids[r, cols], batch.attention_mask[r, cols], batch.position_ids[r, cols]))
        counts.append(L)
        scored.append(r)
    ents, passes = _chunked_entropies(model, contexts, counts, budget,
                                      lambda i: f"entropy_scores: the model's logits of row {scored[i]}",
                                      pad_id=batch.pad_id)
    for r, e in zip(scored, ents):
        res.scores[r, : e.numel()] = e
    res.stats.update(forward_passes=passes, chunks=passes, seconds=time.perf_counter() - t0)
    _log.info("entropy_scores: %d rows, %d forwards, %.3f s", len(rows), passes, res.stats["seconds"])
    return res


def policy_entropies(model, prompt_ids: Sequence, completion_ids: torch.Tensor, completion_mask: torch.Tensor, *,
                     memory_budget_mb: int = planner.DEFAULT_MEMORY_BUDGET_MB) -> torch.Tensor:
    """Full-vocabulary entropy H_t (nats, temperature 1) of the policy at every completion token: the
    entropy of the next-token distribution at the position that predicts completion token t.

    One left-padded forward per chunk of rows (prompt + completion up to the row's last masked token), with
    the LM head run only on the completion window; chunks keep the float32 (rows x window x vocab) logits
    under ``memory_budget_mb`` (:func:`_chunked_entropies`). No grad.

    Args:
        model: Hugging Face causal LM or an :class:`oar.attribution.ProbeModel`.
        prompt_ids: B unpadded prompts (lists or 1-D integer tensors), non-empty.
        completion_ids: (B, C) integer, right-padded completions.
        completion_mask: (B, C) bool or 0/1; tokens after a row's last masked token are not run.
        memory_budget_mb: int >= 1.

    Returns:
        (B, C) float32 on CPU, 0 where ``completion_mask`` is false.

    Raises:
        TypeError: ``model`` is neither a Hugging Face causal LM nor a ProbeModel (names the missing members).
        ValueError: shapes/dtypes, an empty prompt (the first completion token has no predicting position),
            memory_budget_mb < 1, NaN / +inf logits (-inf logits are zero-probability tokens: 0 log 0 = 0).
    """
    cids = _args.ids_arg("completion_ids", completion_ids, "(B, T)")
    B, C = cids.shape
    cmask = _args.mask_arg("completion_mask", completion_mask, "(B, T)", (B, C)).cpu()
    cids = cids.detach().cpu().long()
    if len(prompt_ids) != B:
        raise ValueError(f"prompt_ids must have B = {B} entries, got {len(prompt_ids)}")
    budget = planner.budget_bytes(memory_budget_mb)
    out = torch.zeros((B, C), dtype=torch.float32)
    rows = [i for i in range(B) if bool(cmask[i].any())]
    if not rows:
        return out
    prompts = []
    for i in range(B):
        p = prompt_ids[i]
        p = p.detach().cpu().long().flatten() if isinstance(p, torch.Tensor) else torch.tensor(list(p), dtype=torch.long)
        prompts.append(p)
    lengths = [int(torch.nonzero(cmask[i]).max()) + 1 for i in rows]
    for i in rows:
        if prompts[i].numel() == 0:
            raise ValueError(f"prompt_ids[{i}] is empty: the first completion token has no predicting position")
    pm = as_probe_model(model)
    contexts = []
    for i, L in zip(rows, lengths):
        x = torch.cat([prompts[i], cids[i, :L]])
        contexts.append((x, torch.ones_like(x), torch.arange(x.numel())))
    ents, _ = _chunked_entropies(pm, contexts, lengths, budget,
                                 lambda i: "policy_entropies: the model's logits")
    for i, e in zip(rows, ents):
        out[i, : e.numel()] = e
    return torch.where(cmask, out, torch.zeros((), dtype=torch.float32))
