"""Exact OAR-P (method.md section 3): one PAD substitution per reasoning token, every later token re-run; two engines
with the same scores, ``"batched"`` (every variant a full left-padded context) and ``"prefix"`` (variants share the
clean key/value cache before their masked column; docs/design.md, "OAR-P: prefix key/value cache"). Chunks come
from :mod:`oar.attribution.planner`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from oar import _args, ops
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
    resolve_clean_logits,
    span_mask,
    store_scores,
    unit_variants,
)
from oar.attribution.context import ProbeBatch
from oar.attribution.model import ProbeCapabilities, ProbeModel, gather_probe_logits

_log = logging.getLogger("oar")

OAR_P_ENGINES = ("auto", "prefix", "batched")


@dataclass(frozen=True)
class _OarPRun:
    """The checked inputs of one :func:`oar_p_scores` call, built once after validation and read by the two
    engine paths (:func:`_oar_p_batched`, :func:`_oar_p_prefix`)."""

    model: ProbeModel
    caps: ProbeCapabilities
    batch: ProbeBatch
    rows: tuple[int, ...]  # rows with at least one token to score, ascending
    probe: str
    budget: int  # bytes
    max_variants: int  # 0 = no cap
    clean_logits: torch.Tensor | None  # (B, K_max, V) or None (the batched path only)
    max_prefix_waste: float  # in (0, 1] (the prefix path only)
    units: dict[int, list[tuple[int, int]]] | None  # {row: [(j0, j1)] masked together} or None = every token
    device: torch.device  # the model's
    clean_pass: CleanPass | None = None  # the prefix path's clean pass, already run (screened OAR-P)


def oar_p_scores(model: ProbeModel, batch: ProbeBatch, *, probe: str = "answer_mean", rows: Sequence[int] | None = None,
                 memory_budget_mb: int = planner.DEFAULT_MEMORY_BUDGET_MB, max_variants_per_chunk: int = 0,
                 clean_logits: torch.Tensor | None = None, engine: str = "auto",
                 max_prefix_waste: float = 0.1, positions: Mapping[int, Sequence[int]] | None = None,
                 clean_pass: CleanPass | None = None,
                 spans: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> Attribution:
    """OAR-P importance (method.md section 3): I_t = KL(p_clean || p_masked_t), or the clamped drop of the
    answer log-likelihood for ``probe="answer_joint"``.

    Each variant replaces reasoning token t by ``batch.pad_id`` (same length, still attended). Two exact
    engines compute the same scores (equal within fp32 rounding; tested):

    - ``"prefix"`` (docs/design.md, "OAR-P: prefix key/value cache"): variant t shares the clean prefix before t.
      One clean forward over the requested rows yields the clean probe logits and the key/value cache; variants
      are sorted by masked column and cut by the prefix planner (:func:`oar.attribution.planner.plan_prefix`) into
      chunks that each run only columns ``[p, T)`` on the cropped clean cache, p = the chunk's smallest masked
      column, under ``memory_budget_mb``. ``max_prefix_waste`` bounds the columns a chunk recomputes in vain.
    - ``"batched"``: every variant is a full left-padded context; chunks by
      :func:`oar.attribution.planner.plan_masked`.

    Both run the LM head on the probe window only. ``"auto"`` picks ``"prefix"`` when the model has the
    prefix-cache capability (:class:`~oar.attribution.model.PrefixCacheModel`, ``supports_prefix_cache``) and
    no ``clean_logits`` are given, else ``"batched"``. The prefix engine runs a chunk with
    ``tail_logits_shared_prefix`` when the model has that capability and the chunk's rows are not padded past
    its prefix.

    Args:
        model: a ProbeModel (``oar.attribution.hf_model.HFProbeModel`` for HF models).
        batch: probe contexts.
        probe: ``last`` | ``answer_mean`` | ``answer_joint``.
        rows: rows to score (default all).
        memory_budget_mb, max_variants_per_chunk: chunk planner limits (0 = no variant cap).
        clean_logits: optional (B, K_max, V) clean probe logits already computed for all rows ("batched" only;
            the prefix engine gets them from its own clean pass).
        engine: ``auto`` | ``prefix`` | ``batched``.
        max_prefix_waste: a real number in (0, 1], see above (checked whatever the engine).
        positions: optional {row: reasoning indices} to score only those tokens (others keep score 0 and stay
            in the mask); e.g. benchmarks that extrapolate from every k-th token. Keys must be rows being
            scored (``rows``), values sequences of int indices in [0, reasoning_len[row]).
        clean_pass: the :class:`CleanPass` of this batch over (at least) the rows scored, from
            :func:`~oar.attribution.window.oar_p_window_scores` (``keep_clean_pass=True``): the prefix engine uses it instead of running its
            own clean forward (same numbers); ignored by the batched engine.
        spans: optional {row: [(j0, j1), ...]} masking units (docs/method.md section 11): each variant replaces
            reasoning tokens [j0, j1) by PAD at once and its divergence is the score of every one of them
            (:mod:`oar.attribution.spans` computes word / line / sentence spans). Ranges sorted, disjoint,
            non-empty, within the row's reasoning tokens; tokens outside every span score 0. Exclusive with
            ``positions``; None = every reasoning token its own unit.

    Returns:
        Attribution with stats ``forward_passes`` (model calls), ``variants``, ``chunks``, ``engine``,
        ``tokens`` (context tokens run through the model), ``seconds``; the prefix engine adds
        ``shared_prefix_chunks`` (chunks run with :meth:`HFProbeModel.tail_logits_shared_prefix`).
    Raises:
        TypeError: ``model`` is not a ProbeModel (the message names every missing member).
        ValueError: unknown probe or engine, max_prefix_waste outside (0, 1], positions that are not a mapping of
            requested rows to int reasoning indices in range, rows out of range or not integers, memory_budget_mb not an int
            >= 1, max_variants_per_chunk not an int >= 0, token ids outside the model's vocabulary,
            clean_logits of the wrong shape, ``engine="prefix"`` on a model without a croppable cache, a
            masked variant whose divergence is infinite (zero probability where the clean distribution has
            mass); spans that are not sorted disjoint ranges of the row, or given with ``positions``.
    """
    max_variants = int_value("max_variants_per_chunk", max_variants_per_chunk)
    if max_variants < 0:
        raise ValueError(f"max_variants_per_chunk must be >= 0 (0 = no cap), got {max_variants}")
    if not isinstance(engine, str) or engine not in OAR_P_ENGINES:
        raise ValueError(f"engine must be one of {OAR_P_ENGINES}, got {engine!r}")
    max_prefix_waste = _args.float_arg("max_prefix_waste", max_prefix_waste)
    if not 0.0 < max_prefix_waste <= 1.0:  # checked for every engine: "auto" may pick either
        raise ValueError(f"max_prefix_waste must be in (0, 1], got {max_prefix_waste}")
    caps, probe, rows, budget, positions = engine_args(model, batch, probe, rows, positions, memory_budget_mb)
    batch = batch.probe_view()  # the columns after the last probe position never change a score
    units = masking_units(batch, rows, positions, spans)
    if engine == "prefix" and not caps.prefix_cache:
        raise ValueError("engine='prefix' needs a ProbeModel with the prefix-cache capability (oar.attribution."
                         "PrefixCacheModel: supports_prefix_cache = True, kv_bytes_per_token, tail_logits_and_cache, "
                         f"tail_logits_cached); {type(model).__name__} does not declare it: use engine='batched'")
    asked = engine
    if engine == "auto":
        engine = "prefix" if caps.prefix_cache and clean_logits is None else "batched"
    check_ids(model, batch)
    t0 = time.perf_counter()
    res = empty_attribution(batch, rows)
    rows = [r for r in rows if int(batch.reasoning_len[r]) > 0 and (units is None or units.get(r))]
    if _log.isEnabledFor(logging.DEBUG):
        why = ("requested" if asked != "auto" else "prefix cache" if engine == "prefix"
               else "clean_logits given" if caps.prefix_cache else "no prefix cache")
        _log.debug("oar_p_scores: engine %s (%s), %d rows to score, budget %d MiB, max %d variants/chunk, "
                   "shared-prefix attention %s", engine, why, len(rows), budget >> 20, max_variants,
                   "available" if caps.shared_prefix else "off")
    if not rows:
        res.stats.update(forward_passes=0, variants=0, chunks=0, tokens=0, engine=engine, seconds=0.0)
        return res
    if clean_pass is not None and not set(rows) <= set(clean_pass.rows):
        raise ValueError(f"clean_pass covers rows {list(clean_pass.rows)[:8]}, not every row scored ({rows[:8]})")
    run = _OarPRun(model=model, caps=caps, batch=batch, rows=tuple(rows), probe=probe, budget=budget,
                   max_variants=max_variants, clean_logits=clean_logits, max_prefix_waste=max_prefix_waste,
                   units=units, device=torch.device(model.device), clean_pass=clean_pass)
    stats = (_oar_p_prefix if engine == "prefix" else _oar_p_batched)(run, res)
    res.stats.update(engine=engine, seconds=time.perf_counter() - t0, **stats)
    _log.info("oar_p_scores: %s engine, %d rows, %d variants in %d chunks%s, %d forwards, %.3f s", engine, len(rows),
              res.stats["variants"], res.stats["chunks"],
              f" ({stats['shared_prefix_chunks']} with shared-prefix attention)" if engine == "prefix" else "",
              res.stats["forward_passes"], res.stats["seconds"])
    return res


def _oar_p_batched(run: _OarPRun, res: Attribution) -> dict:
    """Every variant a full left-padded context, chunks by :func:`~oar.attribution.planner.plan_masked`. Returns
    the stats."""
    model, batch, rows, probe, dev = run.model, run.batch, run.rows, run.probe, run.device
    clean_all, clean_row, passes = resolve_clean_logits(model, batch, rows, run.clean_logits, run.budget)
    var_row_t, var_col_t, var_j_t, var_len_t = unit_variants(batch, rows, run.units)
    T = batch.input_ids.shape[1]
    widths = [int(batch.context_len[r]) for r in rows]
    counts = [int((var_row_t == r).sum()) for r in rows]
    plan = planner.plan_masked(model, batch, widths, counts, run.budget, run.max_variants)
    clean_index_t = torch.tensor([clean_row[int(r)] for r in var_row_t], dtype=torch.long)
    tokens = min(passes, 1) * sum(widths)  # the clean pass runs each row once, in one or more chunks
    with torch.no_grad():
        for ch in plan:
            sl = slice(ch.begin, ch.end)
            width = ch.max_context_len
            off = T - width  # left padding: every context in the chunk lies within the last `width` columns
            row_index = var_row_t[sl]
            masked = ops.build_masked_batch(batch.input_ids[:, off:], row_index, var_col_t[sl] - off, batch.pad_id)
            if run.units is not None:  # spans: the unit's other tokens too
                masked.masked_fill_(span_mask(torch.arange(width), var_col_t[sl] - off, var_len_t[sl]), batch.pad_id)
            window = model.tail_logits(input_ids=masked.to(dev), attention_mask=batch.attention_mask[row_index, off:].to(dev),
                                       position_ids=batch.position_ids[row_index, off:].to(dev), keep=batch.keep)
            passes += 1
            tokens += masked.numel()
            pert = gather_probe_logits(window, batch.probe_start[row_index], batch.answer_ids.shape[1])
            clean = clean_all[clean_index_t[sl].to(clean_all.device)]
            store_scores(res, chunk_divergence(clean, pert, batch, row_index, probe), probe, row_index, var_j_t[sl], var_len_t[sl])
    return {"forward_passes": passes, "variants": int(var_row_t.numel()), "chunks": len(plan), "tokens": tokens}


def _oar_p_prefix(run: _OarPRun, res: Attribution) -> dict:
    """One clean pass with the key/value cache, then column-sorted variants in chunks by
    :func:`~oar.attribution.planner.plan_prefix`, each run on the clean prefix of its smallest column. Returns the
    stats."""
    model, batch, rows, probe, dev = run.model, run.batch, run.rows, run.probe, run.device
    budget = run.budget
    T = batch.input_ids.shape[1]
    K = batch.answer_ids.shape[1]
    with torch.no_grad():
        # 1. Clean pass over the requested rows: probe logits + key/value cache (or the one handed over).
        if run.clean_pass is not None:
            clean_all, kv_all, passes, tokens = run.clean_pass.logits, run.clean_pass.kv, 0, 0
            cached_rows = list(run.clean_pass.rows)
        else:
            clean_all, kv_all, passes, tokens = clean_pass_with_cache(model, batch, rows, budget, run.caps.prefix_extend)
            cached_rows = list(rows)
        # 2. Variants sorted by masked column; chunks share the prefix of their smallest column.
        var_row_t, var_col_t, var_j_t, var_len_t = unit_variants(batch, rows, run.units)
        order = torch.argsort(var_col_t, stable=True)
        var_row_t, var_col_t, var_j_t, var_len_t = var_row_t[order], var_col_t[order], var_j_t[order], var_len_t[order]
        slot = {r: i for i, r in enumerate(cached_rows)}  # row -> index in clean_all / kv_all
        var_slot_t = torch.tensor([slot[int(r)] for r in var_row_t], dtype=torch.long)
        plan = planner.plan_prefix(model, batch, var_col_t.tolist(), budget, run.max_variants, run.max_prefix_waste)
        # Left padding of each cached row (its first `pad` columns).
        pad_of_slot = [T - int(batch.context_len[r]) for r in cached_rows]
        shared = run.caps.shared_prefix
        shared_chunks = 0
        ids_dev, pos_dev, attn_dev = (t.to(dev) for t in (batch.input_ids, batch.position_ids, batch.attention_mask))
        for ch in plan:
            sl = slice(ch.begin, ch.end)
            # The run must cover the kept probe window: with a short conclude string the last reasoning tokens
            # lie inside it, and a prefix past T - keep would leave fewer than keep positions to read.
            p = min(ch.prefix_len, T - batch.keep)
            row_index, slots, cols, js, lens = var_row_t[sl], var_slot_t[sl], var_col_t[sl], var_j_t[sl], var_len_t[sl]
            # Shared-prefix attention reads each row's prefix in place and needs the suffixes free of padding
            # (a chunk may mix rows whose padding reaches past p: those chunks take the cached path).
            use_shared = shared and max(pad_of_slot[int(x)] for x in slots.unique()) <= p
            if use_shared:  # group the variants by cached row: one prefix attention call per row
                order = torch.argsort(slots, stable=True)
                row_index, slots, cols, js, lens = row_index[order], slots[order], cols[order], js[order], lens[order]
            rows_dev = row_index.to(dev)
            masked = ids_dev[rows_dev, p:]  # a gather on the device: a new tensor, no host copy per chunk
            masked.masked_fill_(span_mask(torch.arange(T - p, device=dev), (cols - p).to(dev), lens.to(dev)),
                                batch.pad_id)
            if use_shared:
                ids, counts = torch.unique_consecutive(slots, return_counts=True)
                ends = counts.cumsum(0).tolist()
                groups = [(int(x), e - int(c), e, pad_of_slot[int(x)]) for x, c, e in zip(ids, counts, ends)]
                window = model.tail_logits_shared_prefix(kv_all, groups, p, input_ids=masked,
                                                         position_ids=pos_dev[rows_dev, p:], keep=batch.keep)
                shared_chunks += 1
            else:
                dslots = slots.to(dev)
                # slice the prefix first, then gather per variant: copies p columns, not T
                prefix_kv = [(k[:, :, :p].index_select(0, dslots), v[:, :, :p].index_select(0, dslots))
                             for k, v in kv_all]
                window = model.tail_logits_cached(prefix_kv, input_ids=masked, attention_mask=attn_dev[rows_dev],
                                                  position_ids=pos_dev[rows_dev, p:], keep=batch.keep)
            passes += 1
            tokens += masked.numel()
            pert = gather_probe_logits(window, batch.probe_start[row_index], K)
            clean = clean_all[slots.to(clean_all.device)]
            store_scores(res, chunk_divergence(clean, pert, batch, row_index, probe), probe, row_index, js, lens)
    return {"forward_passes": passes, "variants": int(var_row_t.numel()), "chunks": len(plan), "tokens": tokens,
            "shared_prefix_chunks": shared_chunks}
