"""OAR-G (method.md section 4): gradient x input of the probe divergence under Gaussian embedding noise on reasoning
positions, ``torch.autograd.grad`` w.r.t. the input embeddings only. Rows are chunked by
:func:`oar.attribution.planner.plan_masked` (forward + backward cost).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Mapping, Sequence

import torch

from oar import ops
from oar.attribution import planner
from oar.attribution.base import (
    Attribution,
    check_ids,
    chunk_divergence,
    empty_attribution,
    engine_args,
    int_value,
    resolve_clean_logits,
)
from oar.attribution.context import ProbeBatch
from oar.attribution.model import ProbeModel, gather_probe_logits

_log = logging.getLogger("oar")

_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive row indices over the seed space


def noise_base(generator: torch.Generator | None) -> int:
    """The one draw an :func:`oar_g_scores` call takes from ``generator`` (the global CPU RNG when None): an int in
    [0, 2^62) from which every row's noise is derived (:func:`row_noise`)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def row_noise(base: int, row: int, noise_draws: int, length: int, hidden_size: int) -> torch.Tensor:
    """OAR-G's embedding noise of batch row ``row``: (noise_draws, length, hidden_size) float32 N(0, 1), one
    ``torch.randn`` call on a CPU generator seeded with a mix of ``base`` (:func:`noise_base`) and the row index.
    Draw d's noise of reasoning token j is ``[d, j]``. A row's noise depends only on (base, row), not on which other
    rows are scored, how rows are chunked or the memory budget, so two settings that score the same row with the
    same generator state perturb it with the same numbers (common random numbers; docs/design.md)."""
    seed = (int(base) ^ ((int(row) + 1) * _GOLDEN)) & (2**63 - 1)
    g = torch.Generator().manual_seed(seed)
    return torch.randn((noise_draws, length, hidden_size), generator=g, dtype=torch.float32)



def _shared_prompt_cache(model, batch: ProbeBatch, chunk_rows: list[int], off: int, width: int, p: int, dev):
    """Key/value cache (per layer (keys, values), each (n, kv_heads, p, head_dim)) of window columns [0, p) of
    ``chunk_rows`` (window = batch columns [off, off + width)), computed once per distinct maximal prompt: rollouts
    of one group share their prompt, and a session's turn rows have nested prompts, so one forward serves them all
    and its cache is copied to each row.

    Row r's context starts at window column a_r = width - context_len[r]; columns [a_r, p) hold the first
    p - a_r tokens of its prompt (p never exceeds a row's reasoning start), and position ids restart at 0 at
    a row's first token, so those tokens' keys/values equal the first p - a_r of the distinct prompt's,
    wherever the padding put them. Columns before a_r are padding (masked by the attention mask; filled with
    any cached entry). Returns (cache, number of distinct prompts)."""
    starts = [int(batch.reasoning_start[r]) for r in chunk_rows]
    firsts = [int(batch.input_ids.shape[1]) - int(batch.context_len[r]) for r in chunk_rows]  # batch columns
    keys = [tuple(batch.input_ids[r, a:s].tolist()) for r, a, s in zip(chunk_rows, firsts, starts)]
    # A prompt that is a prefix of another (a multi-turn session's turn rows: turn k's prompt is the stored session
    # before turn k) reads its keys/values from the longer one's first columns (causal: equal up to float
    # rounding), so only maximal prompts run. In lexicographic order, a key with extensions is followed directly by
    # one of them, and its maximal extension is that one's.
    order = sorted(set(keys))
    longest = {}
    for i in range(len(order) - 1, -1, -1):
        k = order[i]
        nxt = order[i + 1] if i + 1 < len(order) else None
        longest[k] = longest[nxt] if nxt is not None and nxt[:len(k)] == k else k
    distinct = list(dict.fromkeys(longest[k] for k in keys))
    slot = {k: i for i, k in enumerate(distinct)}
    Pm = max(1, max(len(k) for k in distinct))
    n = len(distinct)
    ids = torch.full((n, Pm), int(batch.pad_id), dtype=torch.long)
    attn = torch.zeros((n, Pm), dtype=torch.long)
    pos = torch.zeros((n, Pm), dtype=torch.long)
    for i, k in enumerate(distinct):
        if k:
            ids[i, Pm - len(k):] = torch.tensor(k, dtype=torch.long)
            attn[i, Pm - len(k):] = 1
            pos[i, Pm - len(k):] = torch.arange(len(k))
    attn[:, -1] = 1  # an empty prompt (p = 0 never reaches here) keeps one attended column
    _, kv_u = model.tail_logits_and_cache(input_ids=ids.to(dev), attention_mask=attn.to(dev),
                                          position_ids=pos.to(dev), keep=1)
    # Source (prompt, column) of every (row, window column c < p).
    U = torch.empty((len(chunk_rows), p), dtype=torch.long)
    C = torch.zeros((len(chunk_rows), p), dtype=torch.long)
    for i, (k, a) in enumerate(zip(keys, firsts)):
        K = longest[k]  # k is K's first len(k) tokens
        U[i] = slot[K]
        a_w = a - off  # window column of the row's first token
        cols = torch.arange(p) - a_w
        C[i] = torch.where(cols >= 0, Pm - len(K) + cols, torch.zeros_like(cols))
    U, C = U.to(dev), C.to(dev)
    cache = [(k.permute(0, 2, 1, 3)[U, C].permute(0, 2, 1, 3).contiguous(),
              v.permute(0, 2, 1, 3)[U, C].permute(0, 2, 1, 3).contiguous()) for k, v in kv_u]
    return cache, n


def oar_g_scores(model: ProbeModel, batch: ProbeBatch, *, probe: str = "answer_mean", rows: Sequence[int] | None = None,
                 sigma: float = 1e-3, noise_draws: int = 1, generator: torch.Generator | None = None,
                 clean_logits: torch.Tensor | None = None, memory_budget_mb: int = planner.DEFAULT_MEMORY_BUDGET_MB,
                 positions: Mapping[int, Sequence[int]] | None = None) -> Attribution:
    """OAR-G importance (method.md section 4): I_t = |sum_h g[t,h] E[t,h]| with g = dJ/dE,
    J = KL(p_clean || p(E + delta)) (``answer_joint``: J = phi_clean - phi(E + delta)),
    delta ~ N(0, sigma^2) on reasoning positions only, averaged over ``noise_draws`` draws.

    Gradients are taken with ``torch.autograd.grad`` w.r.t. the embeddings only, so no parameter
    ``.grad`` is written (safe inside a trainer's gradient accumulation). Rows are processed in chunks
    whose estimated forward+backward memory stays under ``memory_budget_mb`` (plus the clean probe logits kept for
    the rows: :func:`oar.attribution.planner.resident_bytes`). When one row alone would exceed it and the model
    offers activation checkpointing (:class:`~oar.attribution.model.CheckpointModel`, e.g. HFProbeModel), every chunk
    runs checkpointed (each layer's input kept, the layer recomputed in the backward; same scores within float
    rounding; stats ``checkpointing``); a row that still does not fit runs alone, over the budget, with a warning
    on the ``"oar"`` logger. For models whose prefix cache may
    be differentiated (``PrefixCacheModel.supports_prefix_grad``) and no ``clean_logits`` given, the columns
    before a chunk's first reasoning token run once without grad and their key/value cache is shared by the
    clean pass and the noisy passes, which then run and differentiate only the suffix (same scores within fp32
    rounding). For models that take the embeddings inside the forward
    (:class:`~oar.attribution.model.EmbeddingNoiseModel`, e.g. HFProbeModel) ``embed`` is never called: every call
    is a forward on ids, as FSDP and ZeRO-3 require (same numbers).

    Args:
        sigma: noise std (absolute, > 0). noise_draws: K >= 1.
        generator: torch.Generator (CPU) of the noise: one int is drawn from it per call (:func:`noise_base`) and row
            r's noise is :func:`row_noise` (base, r, ...), so it does not depend on the other rows scored, the
            chunking or the memory budget; results are deterministic for a fixed seed.
        positions: optional {row: reasoning indices}: noise falls on those tokens only and only they are scored
            (the others keep score 0), e.g. to leave tool outputs unperturbed. Checked as in
            :func:`~oar.attribution.oar_p.oar_p_scores`.
        Other args as in :func:`~oar.attribution.oar_p.oar_p_scores`.
    Raises:
        TypeError: ``model`` is not a ProbeModel (the message names every missing member).
        ValueError: unknown probe, sigma not finite and > 0, noise_draws not an int >= 1, rows out of range,
            memory_budget_mb not an int >= 1, token ids outside the model's vocabulary.
        FloatingPointError: non-finite scores (NaN/Inf logits or gradients).
    """
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not (0 < sigma < float("inf")):
        raise ValueError(f"sigma must be > 0 and finite, got {sigma!r}")
    noise_draws = int_value("noise_draws", noise_draws)
    if noise_draws < 1:
        raise ValueError(f"noise_draws must be >= 1, got {noise_draws}")
    caps, probe, rows, budget, positions = engine_args(model, batch, probe, rows, positions, memory_budget_mb)
    check_ids(model, batch)
    if torch.is_inference_mode_enabled():
        raise RuntimeError("oar_g_scores differentiates the probe divergence w.r.t. the input embeddings, which "
                           "torch.inference_mode() forbids: call it outside inference_mode (torch.no_grad() is fine: "
                           "OAR-G enables grad for its own pass and writes no parameter .grad)")
    t0 = time.perf_counter()
    res = empty_attribution(batch, rows)
    rows = [r for r in rows if int(batch.reasoning_len[r]) > 0 and (positions is None or positions.get(r))]
    if not rows:
        res.stats.update(forward_passes=0, backward_passes=0, seconds=0.0)
        return res
    dev = torch.device(model.device)
    # Prefix path: the prompt before the first noised column is the same in the clean and every noisy pass
    # and needs no gradient, so it runs once per chunk without grad (its key/value cache is shared) and
    # only the suffix is run twice and differentiated. Same scores as the plain path within fp32 rounding.
    use_prefix = clean_logits is None and caps.prefix_grad
    if use_prefix:
        clean_all, clean_row, passes = None, {}, 0
    else:
        clean_all, clean_row, passes = resolve_clean_logits(model, batch, rows, clean_logits, budget)
    T = batch.input_ids.shape[1]
    K = batch.answer_ids.shape[1]
    widths = [int(batch.context_len[r]) for r in rows]
    # A row whose forward + backward alone exceeds the budget runs with activation checkpointing when the model
    # offers it (every layer's input kept, each layer recomputed in the backward); then every chunk does.
    wide = max(widths)
    head = (planner.probe_bytes(model, batch, backward=True)
            + planner.probe_bytes(model, batch, backward=True, per_chunk=True))  # the probe head, issue 41
    checkpoint = caps.activation_checkpointing and (
        wide * planner.masked_bytes_per_token(model, wide, backward=True) + head > budget)
    plan = planner.plan_masked(model, batch, widths, [1] * len(rows), budget, backward=True, checkpoint=checkpoint)
    if _log.isEnabledFor(logging.DEBUG):
        why = ("clean_logits given" if clean_logits is not None else "prefix cache with grad" if use_prefix
               else "no differentiable prefix cache")
        _log.debug("oar_g_scores: %s path (%s), %d rows in %d chunks, budget %d MiB, %d noise draws, activation "
                   "checkpointing %s", "prompt-once" if use_prefix else "plain", why, len(rows), len(plan),
                   budget >> 20, noise_draws, "on" if checkpoint else "off")
    backward = 0
    base = noise_base(generator)
    for ch in plan:
        chunk_rows = rows[ch.begin:ch.end]
        idx = torch.tensor(chunk_rows, dtype=torch.long)
        off = T - ch.max_context_len
        ids = batch.input_ids[idx, off:].to(dev)
        attn = batch.attention_mask[idx, off:].to(dev)
        pos = batch.position_ids[idx, off:].to(dev)
        width = ids.shape[1]
        noise_mask = torch.zeros(ids.shape, dtype=torch.bool)
        for i, r in enumerate(chunk_rows):
            s = int(batch.reasoning_start[r]) - off
            if positions is None:
                noise_mask[i, s: s + int(batch.reasoning_len[r])] = True
            else:
                noise_mask[i, [s + j for j in positions[r]]] = True
        noise_mask = noise_mask.to(dev).unsqueeze(-1)
        E = None  # models with embedding noise hand the embeddings over inside each forward (no embed call)
        if not caps.embedding_noise:
            with torch.no_grad():
                E = model.embed(ids).detach()
        # p: columns [0, p) of the window run once without grad (0: the plain path for this chunk).
        p = 0
        if use_prefix:
            p = max(0, min(min(int(batch.reasoning_start[r]) - off for r in chunk_rows), width - batch.keep))
        kv = None
        if use_prefix and p > 0:
            with torch.no_grad():
                kv, _ = _shared_prompt_cache(model, batch, chunk_rows, off, width, p, dev)
                window = model.tail_logits_cached(kv, input_ids=ids[:, p:], attention_mask=attn,
                                                  position_ids=pos[:, p:], keep=batch.keep)
            passes += 2
            clean = gather_probe_logits(window, batch.probe_start[idx], K)
        elif use_prefix:
            with torch.no_grad():
                window = model.tail_logits(input_ids=ids, attention_mask=attn, position_ids=pos, keep=batch.keep)
            passes += 1
            clean = gather_probe_logits(window, batch.probe_start[idx], K)
        else:
            clean = clean_all[torch.tensor([clean_row[r] for r in chunk_rows], dtype=torch.long).to(clean_all.device)]
        acc = torch.zeros(ids.shape, dtype=torch.float32, device=dev)
        # each row's noise on its own reasoning columns (row_noise: a function of (base, row) only); zero elsewhere
        spans = [(int(batch.reasoning_start[r]) - off, int(batch.reasoning_len[r])) for r in chunk_rows]
        per_row = [row_noise(base, r, noise_draws, L, model.hidden_size) for r, (_, L) in zip(chunk_rows, spans)]
        for d in range(noise_draws):
            noise = torch.zeros((len(chunk_rows), width, model.hidden_size), dtype=torch.float32)
            for i, (s, L) in enumerate(spans):
                noise[i, s:s + L] = per_row[i][d]
            ckpt = model.activation_checkpointing() if checkpoint else contextlib.nullcontext()
            with torch.enable_grad(), ckpt:  # grad also under the caller's torch.no_grad() (trainers make experiences so)
                g, Ep = _noisy_input_grad(model, clean, batch, idx, probe, noise, sigma, noise_mask, E, kv, ids, attn,
                                          pos, p, K)
            passes += 1
            backward += 1
            acc[:, p:] += ops.grad_x_input(g.detach(), Ep.contiguous())
        acc /= noise_draws
        acc = acc.cpu()
        for i, r in enumerate(chunk_rows):
            s = int(batch.reasoning_start[r]) - off
            L = int(batch.reasoning_len[r])
            res.scores[r, :L] = acc[i, s: s + L]
            if positions is not None:
                keep = torch.zeros(L, dtype=torch.bool)
                keep[positions[r]] = True
                res.scores[r, :L] = torch.where(keep, res.scores[r, :L], torch.zeros(()))
    if not torch.isfinite(res.scores).all():
        raise FloatingPointError("oar_g_scores: non-finite importance scores (check the model's logits for NaN/Inf)")
    res.stats.update(forward_passes=passes, backward_passes=backward, chunks=len(plan), checkpointing=bool(checkpoint),
                     seconds=time.perf_counter() - t0)
    _log.info("oar_g_scores: %s path, %d rows in %d chunks, %d forwards, %d backwards, %.3f s",
              "prompt-once" if use_prefix else "plain", len(rows), len(plan), passes, backward, res.stats["seconds"])
    return res


def _noisy_input_grad(model, clean, batch, idx, probe, noise, sigma, noise_mask, E, kv, ids, attn, pos, p, K):
    """One noise draw of OAR-G on one chunk (call under grad): the perturbed forward over columns [p, width) and
    dJ/dE of the probe divergence J w.r.t. the (noised) input embeddings. Returns (g, clean embeddings), both
    (n, width - p, H)."""
    dev = ids.device
    if E is None:
        def perturb(e, noise=noise):  # e: the embeddings of columns [p, width), inside the forward
            return e + (noise.to(dev, e.dtype) * sigma)[:, p:] * noise_mask[:, p:]

        with model.noised_embeddings(perturb) as rec:
            if kv is not None:
                window = model.tail_logits_cached(kv, input_ids=ids[:, p:], attention_mask=attn,
                                                  position_ids=pos[:, p:], keep=batch.keep)
            else:
                window = model.tail_logits(input_ids=ids, attention_mask=attn, position_ids=pos,
                                           keep=batch.keep)
        Ek, Ep = rec.noised, rec.clean
    else:
        Ep = E[:, p:]
        Ek = (Ep + (noise.to(dev, E.dtype) * sigma)[:, p:] * noise_mask[:, p:]).requires_grad_(True)
        if kv is not None:
            window = model.tail_logits_cached(kv, inputs_embeds=Ek, attention_mask=attn,
                                              position_ids=pos[:, p:], keep=batch.keep)
        else:
            window = model.tail_logits(inputs_embeds=Ek, attention_mask=attn, position_ids=pos,
                                       keep=batch.keep)
    pert = gather_probe_logits(window, batch.probe_start[idx], K)
    J = chunk_divergence(clean, pert, batch, idx, probe).sum()
    (g,) = torch.autograd.grad(J, Ek)
    return g, Ep
