"""Windowed OAR-P (the screen of screened OAR-P; docs/design.md, "Screened OAR-P"): masking a token re-runs only the
next W reasoning tokens and the probe tail on the row's clean key/value cache. Chunks come from
:func:`oar.attribution.planner.plan_window`.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping, Sequence

import torch

from oar.attribution import planner
from oar.attribution.base import (
    Attribution,
    CleanPass,
    check_ids,
    chunk_divergence,
    clean_pass_with_cache,
    empty_attribution,
    engine_args,
    int_value,
    masking_units,
    store_scores,
    unit_variants,
)
from oar.attribution.context import ProbeBatch
from oar.attribution.model import ProbeModel, WindowMasks, gather_probe_logits, require_dense_mask

_log = logging.getLogger("oar")


#: ``rerun_tail`` values of :func:`oar_p_window_scores`: the config's ``screen_tail`` values
#: (``oar.schema.SCREEN_TAILS``) but ``linear``, which re-runs no tail (:func:`oar.attribution.oar_p_linear_tail_scores`).
RERUN_TAILS = ("conclude", "probe")


def oar_p_window_scores(model: ProbeModel, batch: ProbeBatch, *, window: int, probe: str = "answer_mean",
                        rows: Sequence[int] | None = None, positions: Mapping[int, Sequence[int]] | None = None,
                        memory_budget_mb: int = planner.DEFAULT_MEMORY_BUDGET_MB, keep_clean_pass: bool = False,
                        spans: Mapping[int, Sequence[tuple[int, int]]] | None = None,
                        rerun_tail: str = "conclude") -> Attribution:
    """Windowed OAR-P (the screen of screened OAR-P; docs/design.md "Screened OAR-P"): I_t as in
    :func:`~oar.attribution.oar_p.oar_p_scores` (token t replaced by PAD, KL or clamped phi drop of the probe), but the masked context re-runs only token t,
    the ``window`` reasoning tokens after it and the probe tail (conclude + answer, or the probe window alone:
    ``rerun_tail``); the reasoning tokens further on keep their clean keys/values. It measures the effect of token t
    that reaches the answer directly or through its next ``window`` tokens, at a cost of (1 + window + tail) tokens
    per masked token instead of the whole suffix. ``window >= L - 1`` re-runs every later token: exact OAR-P (equal within fp32 rounding; tested).

    One clean pass yields the clean probe logits and the key/value cache; each chunk of masked variants runs its
    re-run columns on its row's clean cache: a re-run token attends to the clean columns before it that are not
    re-run, and causally to the re-run tokens. Models with shared-prefix attention
    (:meth:`HFProbeModel.tail_logits_shared_prefix`, CPU) read each row's cache in place with these masks; others
    get the cache copied per variant and one 4-D mask (``tail_logits_cached``).

    Args:
        model: a ProbeModel with the prefix-cache capability (:class:`~oar.attribution.model.PrefixCacheModel`)
            whose ``tail_logits_cached`` takes a 4-D attention mask (N, 1, S, T + S) of 0 / dtype-min floats
            (``HFProbeModel``: transformers passes a 4-D mask through as it is).
        window: int >= 0, the later reasoning tokens re-run with each masked token.
        probe, rows, positions, memory_budget_mb: as :func:`~oar.attribution.oar_p.oar_p_scores`.
        spans: optional {row: [(j0, j1), ...]} masking units, as :func:`~oar.attribution.oar_p.oar_p_scores`: a
            span's variant masks all its tokens and re-runs them plus the ``window`` reasoning tokens after the
            span's last token (the window counts tokens whatever the unit).
        rerun_tail: the probe-side columns each variant re-runs: ``"conclude"`` (default: from the end of the
            reasoning, i.e. the conclude string and the probe window) or ``"probe"`` (only the last ``batch.keep``
            columns, the probe window; the conclude tokens keep their clean keys/values, like the reasoning tokens
            past the window: (1 + window + keep) tokens per variant; docs/design.md "Windowed OAR-P: the tail").
        keep_clean_pass: attach the clean pass (:class:`CleanPass`: probe logits and key/value cache of the rows
            scored) to the result, for the exact pass of screened OAR-P (memory: the cache of those rows).
    Returns:
        Attribution (B, L_max) float32 >= 0, stats ``forward_passes``, ``variants``, ``chunks``, ``tokens`` (tokens
        run through the model), ``engine`` (``"window"``), ``seconds``; ``clean_pass`` when asked.
    Raises:
        TypeError: ``model`` is not a ProbeModel.
        ValueError: window not an int >= 0, a model without the prefix-cache capability, and as
            :func:`~oar.attribution.oar_p.oar_p_scores`.
    """
    window = int_value("window", window)
    if window < 0:
        raise ValueError(f"window must be an int >= 0, got {window}")
    if not isinstance(rerun_tail, str) or rerun_tail not in RERUN_TAILS:
        raise ValueError(f"rerun_tail must be one of {RERUN_TAILS}, got {rerun_tail!r}")
    caps, probe, rows, budget, positions = engine_args(model, batch, probe, rows, positions, memory_budget_mb)
    batch = batch.probe_view()  # the columns after the last probe position never change a score
    units = masking_units(batch, rows, positions, spans)
    if not caps.prefix_cache:
        raise ValueError("oar_p_window_scores needs a ProbeModel with the prefix-cache capability (oar.attribution."
                         f"PrefixCacheModel: supports_prefix_cache = True); {type(model).__name__} does not declare "
                         "it: use oar_p_scores")
    require_dense_mask(caps, "oar_p_window_scores")  # a 4-D mask for the model: refused for flash attention
    check_ids(model, batch)
    t0 = time.perf_counter()
    res = empty_attribution(batch, rows)
    rows = [r for r in rows if int(batch.reasoning_len[r]) > 0 and (units is None or units.get(r))]
    if not rows:
        res.stats.update(forward_passes=0, variants=0, chunks=0, tokens=0, engine="window", seconds=0.0)
        return res
    dev = torch.device(model.device)
    T = int(batch.input_ids.shape[1])
    K = batch.answer_ids.shape[1]
    keep = int(batch.keep)
    with torch.no_grad():
        clean_all, kv_all, passes, tokens = clean_pass_with_cache(model, batch, rows, budget, caps.prefix_extend)
        dtype = kv_all[0][0].dtype
        var_row_t, var_col_t, var_j_t, var_len_t = unit_variants(batch, rows, units)
        slot = {r: i for i, r in enumerate(rows)}
        # Re-run columns of each variant (masked columns [t, t + n)): [t, t + n + window) and the tail
        # [min(end of reasoning, T - keep), T) ("conclude") or [T - keep, T) ("probe"), in closed form
        # (:func:`_run_columns`), built on the model's device per chunk: no per-variant host work or copies.
        ends = (batch.reasoning_start + batch.reasoning_len)[var_row_t]
        tails_t = ends.clamp_max(T - keep) if rerun_tail == "conclude" else torch.full_like(ends, T - keep)
        win_end_t = torch.clamp(var_col_t + var_len_t + window, max=T)
        run_len_t = _run_lengths(var_col_t, win_end_t, tails_t, T)
        shared = caps.shared_prefix
        plan = planner.plan_window(model, batch, len(run_len_t), int(run_len_t.max()), budget, shared=shared)
        chunks = 0
        ids_dev, pos_dev = batch.input_ids.to(dev), batch.position_ids.to(dev)
        first_t = (T - batch.context_len).long()
        slot_t = torch.tensor([slot[int(r)] for r in var_row_t.tolist()], dtype=torch.long)
        low = torch.finfo(dtype).min
        for ch in plan:
            sl = slice(ch.begin, ch.end)
            row_index, cols_t, js, lens = var_row_t[sl], var_col_t[sl], var_j_t[sl], var_len_t[sl]
            colq = _run_columns(cols_t.to(dev), win_end_t[sl].to(dev), tails_t[sl].to(dev), run_len_t[sl].to(dev),
                                int(run_len_t[sl].max()))  # (N, S) original column of each slot, -1 = padding
            valid = colq >= 0
            rows_dev = row_index.to(dev).view(-1, 1)
            c0 = colq.clamp_min(0)
            cols_dev, lens_dev = cols_t.to(dev).view(-1, 1), lens.to(dev).view(-1, 1)
            ids = ids_dev[rows_dev, c0].masked_fill_(~valid | ((colq >= cols_dev) & (colq < cols_dev + lens_dev)),
                                                     batch.pad_id)  # padding slots and the masked unit
            pos = pos_dev[rows_dev, c0].masked_fill_(~valid, 0)
            # what each re-run query sees, in closed form: its row's clean columns before it, except the re-run
            # ones (the unit, its window, the tail), and the re-run columns of its own variant up to itself
            masks = WindowMasks(colq, first_t[row_index].to(dev), cols_t.to(dev), win_end_t[sl].to(dev),
                                tails_t[sl].to(dev))
            dslots = slot_t[sl].to(dev)
            if shared:  # each row's clean cache read in place (variants are row-major: one group per row)
                ids_u, counts = torch.unique_consecutive(slot_t[sl], return_counts=True)
                ends_c = counts.cumsum(0).tolist()
                groups = [(int(x), e - int(c), e, 0) for x, c, e in zip(ids_u, counts, ends_c)]
                win = model.tail_logits_shared_prefix(kv_all, groups, T, input_ids=ids, position_ids=pos, keep=keep,
                                                      window=masks)
            else:  # the row's clean cache copied per variant, one 4-D mask over prefix + suffix
                allowed = torch.cat([masks.see_prefix(T), masks.see_self()], dim=-1).unsqueeze(1)
                mask = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, low)
                prefix_kv = [(k.index_select(0, dslots), v.index_select(0, dslots)) for k, v in kv_all]
                win = model.tail_logits_cached(prefix_kv, input_ids=ids, attention_mask=mask, position_ids=pos,
                                               keep=keep)
            passes += 1
            chunks += 1
            tokens += int(run_len_t[sl].sum())
            pert = gather_probe_logits(win, batch.probe_start[row_index], K)
            clean = clean_all[dslots.to(clean_all.device)]
            store_scores(res, chunk_divergence(clean, pert, batch, row_index, probe), probe, row_index, js, lens)
    res.stats.update(forward_passes=passes, variants=int(var_row_t.numel()), chunks=chunks, tokens=tokens,
                     engine="window", seconds=time.perf_counter() - t0)
    if keep_clean_pass:
        res.clean_pass = CleanPass(tuple(rows), clean_all, kv_all)
    _log.info("oar_p_window_scores: window %d, %d rows, %d variants in %d chunks, %.3f s", window, len(rows),
              res.stats["variants"], chunks, res.stats["seconds"])
    return res


def _run_lengths(t: torch.Tensor, win_end: torch.Tensor, tail: torch.Tensor, T: int) -> torch.Tensor:
    """(N,) int64: columns each variant re-runs, |[t, win_end) u [tail, T)| (t < win_end <= T, tail <= T)."""
    disjoint = win_end < tail
    return torch.where(disjoint, (win_end - t) + (T - tail), T - torch.minimum(t, tail))


def _run_columns(t: torch.Tensor, win_end: torch.Tensor, tail: torch.Tensor, run_len: torch.Tensor,
                 S: int) -> torch.Tensor:
    """(N, S) int64 on ``t``'s device: the sorted columns of [t, win_end) u [tail, T) of each variant, right-aligned
    (left padding -1), S >= max(run_len). The closed form of ``sorted(set(range(t, win_end)) | set(range(tail, T)))``:
    slot j of a run is t + j before the window ends and tail + (j - (win_end - t)) after it when the two ranges are
    disjoint, min(t, tail) + j when they overlap."""
    j = torch.arange(S, device=t.device).view(1, -1) - (S - run_len).view(-1, 1)  # index inside the run
    t, win_end, tail = t.view(-1, 1), win_end.view(-1, 1), tail.view(-1, 1)
    w = win_end - t
    disjoint = win_end < tail
    col = torch.where(disjoint, torch.where(j < w, t + j, tail + (j - w)), torch.minimum(t, tail) + j)
    return torch.where(j >= 0, col, torch.full_like(col, -1))
