"""Attribution engines: per-reasoning-token importance scores I_t >= 0 (method.md sections 3, 4, 8).

Every engine takes a :class:`~oar.attribution.model.ProbeModel`, a :class:`~oar.attribution.context.ProbeBatch`
and the rows to score, and returns an :class:`Attribution`: scores (B, L_max) float32 aligned with each
row's reasoning tokens (column j = reasoning token j, i.e. completion column j), a mask of valid entries
and timing/size stats. Rows not asked for get all-False masks. Nothing here writes parameter ``.grad``.
Each engine checks the model once (:func:`~oar.attribution.model.probe_capabilities`: a ``TypeError`` naming
the missing members of a model that is no ProbeModel) and takes its optional capabilities from that check.
Which path ran is logged on the ``"oar"`` logger (info: one summary per call; debug: the decision and its
reason; ``oar.set_log_level``).

- :func:`oar_p_scores`  OAR-P, exact: one PAD substitution per reasoning token, batched across rollouts
  in chunks planned in C++ (``oar._C.plan_masked_chunks``) under a memory budget.
- :func:`oar_p_window_scores`  windowed OAR-P (docs/design.md, "Screened OAR-P"): masking a token re-runs only the next W reasoning tokens
  and the probe tail; the default screen of screened OAR-P (:mod:`oar.attribution.screened`).
- :func:`oar_g_scores`  OAR-G: gradient x input of the probe divergence under Gaussian embedding noise
  on reasoning positions, ``torch.autograd.grad`` w.r.t. the input embeddings only.
- :func:`entropy_scores`, :func:`random_scores`: the baselines of method.md section 8.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from oar import _args, ops
from oar._lib import load_extension
from oar.attribution.context import ProbeBatch
from oar.attribution.model import ProbeCapabilities, ProbeModel, gather_probe_logits, probe_capabilities

_C = load_extension()
_log = logging.getLogger("oar")

PROBES = ops.PROBES


@dataclass
class Attribution:
    """Per-token importance of a batch of rollouts.

    Attributes:
        scores: (B, L_max) float32, >= 0, finite; column j is reasoning token j of the row.
        mask: (B, L_max) bool, True on the first L_i columns of scored rows.
        stats: counters and seconds (``forward_passes``, ``variants``, ``chunks``, ``seconds``).
    """

    scores: torch.Tensor
    mask: torch.Tensor
    stats: dict = field(default_factory=dict)
    #: The clean pass of :func:`oar_p_window_scores` (``keep_clean_pass=True``): handed to the exact pass of screened
    #: OAR-P, which then needs no clean forward of its own; None otherwise.
    clean_pass: "CleanPass | None" = None


@dataclass
class CleanPass:
    """One clean forward over ``rows`` of a batch: probe logits (n, K_max, V) and the key/value cache (per layer
    (keys, values), each (n, kv_heads, T, head_dim)); row ``rows[i]`` is index i."""

    rows: tuple[int, ...]
    logits: torch.Tensor
    kv: list


def _check_probe(probe: str) -> str:
    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {probe!r}")
    return probe


def _int_value(name: str, v) -> int:
    """``v`` as an int, integer 0-d tensors included (:func:`oar._args.int_arg`)."""
    return _args.int_arg(name, v, tensors=True)


def _rows(batch: ProbeBatch, rows: Sequence[int] | None) -> list[int]:
    if rows is None:
        return list(range(batch.batch_size))
    if isinstance(rows, (str, bytes)) or (isinstance(rows, torch.Tensor) and rows.dim() != 1):
        raise ValueError(f"rows must be a sequence of row indices, got {rows!r}")
    out = sorted(set(_int_value("rows[i]", r) for r in rows))
    for r in out:
        if not 0 <= r < batch.batch_size:
            raise ValueError(f"rows must index the batch (0 <= row < {batch.batch_size}), got {r}")
    return out


def _positions(batch: ProbeBatch, rows: list[int], positions) -> dict[int, list[int]] | None:
    """``positions`` checked: a mapping {requested row: reasoning indices in [0, L_row)} of ints."""
    if positions is None:
        return None
    if not isinstance(positions, Mapping):
        raise ValueError(f"positions must be a mapping {{row: reasoning indices}} or None, got {type(positions).__name__}")
    out: dict[int, list[int]] = {}
    for key, js in positions.items():
        r = _int_value("positions key", key)
        if r not in rows:
            raise ValueError(f"positions has row {r}, which is not among the rows scored ({rows[:8]}"
                             f"{'...' if len(rows) > 8 else ''})")
        if (isinstance(js, (str, bytes, Mapping)) or not hasattr(js, "__iter__")
                or (isinstance(js, torch.Tensor) and js.dim() != 1)):
            raise ValueError(f"positions[{r}] must be a sequence of reasoning indices, got {type(js).__name__} {js!r}")
        L = int(batch.reasoning_len[r])
        idx = [_int_value(f"positions[{r}][i]", j) for j in js]
        if any(not 0 <= j < L for j in idx):
            raise ValueError(f"positions[{r}] must be reasoning indices in [0, {L}), got {idx[:8]}")
        out[r] = idx
    return out


def _budget_bytes(memory_budget_mb) -> int:
    """memory_budget_mb (an int >= 1) in bytes, capped so that the planner's int64 never overflows."""
    try:
        mb = _int_value("memory_budget_mb", memory_budget_mb)
    except ValueError:
        mb = None
    if mb is None or mb < 1:
        raise ValueError(f"memory_budget_mb must be an int >= 1, got {memory_budget_mb!r}")
    return min(mb, (1 << 43) - 1) << 20


def _check_ids(model: ProbeModel, batch: ProbeBatch) -> None:
    """Token ids the model will embed must be valid rows of its embedding table (else an opaque IndexError,
    or a device-side assert on CUDA). ``model`` is checked: ``vocab_size`` is an int >= 1."""
    vocab = int(model.vocab_size)
    if not 0 <= batch.pad_id < vocab:
        raise ValueError(f"pad_id must be a token id in [0, vocab_size={vocab}), got {batch.pad_id}")
    ids = batch.input_ids[batch.attention_mask.bool()]
    if ids.numel() == 0:
        return
    lo, top = int(ids.min()), int(ids.max())
    if lo < 0 or top >= vocab:
        bad = lo if lo < 0 else top
        r, c = (torch.nonzero((batch.input_ids == bad) & batch.attention_mask.bool())[0]).tolist()
        raise ValueError(f"batch.input_ids must be token ids in [0, vocab_size={vocab}) of the model, got {bad} at "
                         f"row {r}, column {c} (prompt, reasoning or answer token)")


def _empty(batch: ProbeBatch, rows: list[int]) -> Attribution:
    L = int(batch.reasoning_len.max()) if batch.batch_size else 0
    mask = torch.zeros((batch.batch_size, L), dtype=torch.bool)
    for r in rows:
        mask[r, : int(batch.reasoning_len[r])] = True
    return Attribution(torch.zeros((batch.batch_size, L), dtype=torch.float32), mask)


def clean_probe_logits(model: ProbeModel, batch: ProbeBatch, rows: Sequence[int] | None = None) -> torch.Tensor:
    """Probe logits (n, K_max, V) (the model's dtype, on its device) of the unperturbed contexts of ``rows`` (all
    rows by default), one forward without grad."""
    idx = torch.tensor(list(rows) if rows is not None else list(range(batch.batch_size)), dtype=torch.long)
    dev = torch.device(model.device)
    with torch.no_grad():
        window = model.tail_logits(input_ids=batch.input_ids[idx].to(dev), attention_mask=batch.attention_mask[idx].to(dev),
                                   position_ids=batch.position_ids[idx].to(dev), keep=batch.keep)
        return gather_probe_logits(window, batch.probe_start[idx], batch.answer_ids.shape[1])


def _clean(model: ProbeModel, batch: ProbeBatch, rows: Sequence[int], clean_logits: torch.Tensor | None):
    """Clean probe logits for ``rows``: (logits, row -> index into logits, forward passes spent)."""
    if clean_logits is None:
        return clean_probe_logits(model, batch, rows), {r: i for i, r in enumerate(rows)}, 1
    want = (batch.batch_size, batch.answer_ids.shape[1])
    if not isinstance(clean_logits, torch.Tensor) or clean_logits.dim() != 3 or tuple(clean_logits.shape[:2]) != want:
        got = tuple(clean_logits.shape) if isinstance(clean_logits, torch.Tensor) else type(clean_logits).__name__
        raise ValueError(f"clean_logits must be (B, K_max, V) with (B, K_max) = {want}, got {got}")
    return clean_logits, {r: r for r in rows}, 0


def _divergence(clean: torch.Tensor, pert: torch.Tensor, batch: ProbeBatch, row_index: torch.Tensor,
                probe: str) -> torch.Tensor:
    dev = pert.device
    lengths = batch.answer_len[row_index].to(dev)
    answer_ids = batch.answer_ids[row_index].to(dev) if probe == "answer_joint" else None
    return ops.probe_divergence(clean.to(pert.dtype), pert, probe=probe, answer_ids=answer_ids, lengths=lengths)


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
    positions: dict[int, list[int]] | None  # {row: reasoning indices} or None = every reasoning token
    device: torch.device  # the model's
    clean_pass: CleanPass | None = None  # the prefix path's clean pass, already run (screened OAR-P)


def oar_p_scores(model: ProbeModel, batch: ProbeBatch, *, probe: str = "answer_mean", rows: Sequence[int] | None = None,
                 memory_budget_mb: int = 1024, max_variants_per_chunk: int = 0,
                 clean_logits: torch.Tensor | None = None, engine: str = "auto",
                 max_prefix_waste: float = 0.1, positions: Mapping[int, Sequence[int]] | None = None,
                 clean_pass: CleanPass | None = None) -> Attribution:
    """OAR-P importance (method.md section 3): I_t = KL(p_clean || p_masked_t), or the clamped drop of the
    answer log-likelihood for ``probe="answer_joint"``.

    Each variant replaces reasoning token t by ``batch.pad_id`` (same length, still attended). Two exact
    engines compute the same scores (equal within fp32 rounding; tested):

    - ``"prefix"`` (docs/design.md, "OAR-P: prefix key/value cache"): variant t shares the clean prefix before t. One clean forward over the
      requested rows yields the clean probe logits and the key/value cache; variants are sorted by masked
      column and cut by the C++ planner (``oar._C.plan_prefix_chunks``) into chunks that each run only
      columns ``[p, T)`` on the cropped clean cache, p = the chunk's smallest masked column, under
      ``memory_budget_mb``. ``max_prefix_waste`` bounds the columns a chunk recomputes in vain.
    - ``"batched"``: every variant is a full left-padded context; chunks by ``oar._C.plan_masked_chunks``.

    Both run the LM head on the probe window only. ``"auto"`` picks ``"prefix"`` when the model has the
    prefix-cache capability (:class:`~oar.attribution.model.PrefixCacheModel`, ``supports_prefix_cache``) and
    no ``clean_logits`` are given, else ``"batched"``. The prefix engine runs a chunk with
    ``tail_logits_shared_prefix`` when the model has that capability and the chunk's rows are not padded past
    its prefix.

    Args:
        model: a ProbeModel (``oar.attribution.model.HFProbeModel`` for HF models).
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
            :func:`oar_p_window_scores` (``keep_clean_pass=True``): the prefix engine uses it instead of running its
            own clean forward (same numbers); ignored by the batched engine.

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
            mass).
    """
    caps = probe_capabilities(model)
    probe = _check_probe(probe)
    rows = _rows(batch, rows)
    budget = _budget_bytes(memory_budget_mb)
    max_variants = _int_value("max_variants_per_chunk", max_variants_per_chunk)
    if max_variants < 0:
        raise ValueError(f"max_variants_per_chunk must be >= 0 (0 = no cap), got {max_variants}")
    if not isinstance(engine, str) or engine not in OAR_P_ENGINES:
        raise ValueError(f"engine must be one of {OAR_P_ENGINES}, got {engine!r}")
    max_prefix_waste = _args.float_arg("max_prefix_waste", max_prefix_waste)
    if not 0.0 < max_prefix_waste <= 1.0:  # checked for every engine: "auto" may pick either
        raise ValueError(f"max_prefix_waste must be in (0, 1], got {max_prefix_waste}")
    positions = _positions(batch, rows, positions)
    if engine == "prefix" and not caps.prefix_cache:
        raise ValueError("engine='prefix' needs a ProbeModel with the prefix-cache capability (oar.attribution."
                         "PrefixCacheModel: supports_prefix_cache = True, kv_bytes_per_token, tail_logits_and_cache, "
                         f"tail_logits_cached); {type(model).__name__} does not declare it: use engine='batched'")
    asked = engine
    if engine == "auto":
        engine = "prefix" if caps.prefix_cache and clean_logits is None else "batched"
    _check_ids(model, batch)
    t0 = time.perf_counter()
    res = _empty(batch, rows)
    rows = [r for r in rows if int(batch.reasoning_len[r]) > 0 and (positions is None or positions.get(r))]
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
                   positions=positions, device=torch.device(model.device), clean_pass=clean_pass)
    stats = (_oar_p_prefix if engine == "prefix" else _oar_p_batched)(run, res)
    res.stats.update(engine=engine, seconds=time.perf_counter() - t0, **stats)
    _log.info("oar_p_scores: %s engine, %d rows, %d variants in %d chunks%s, %d forwards, %.3f s", engine, len(rows),
              res.stats["variants"], res.stats["chunks"],
              f" ({stats['shared_prefix_chunks']} with shared-prefix attention)" if engine == "prefix" else "",
              res.stats["forward_passes"], res.stats["seconds"])
    return res


def _variants(batch: ProbeBatch, rows: Sequence[int], positions=None):
    """Flattened variant list, rollout-major: rows, masked columns, reasoning indices j (int64 tensors)."""
    var_row, var_col, var_j = [], [], []
    for r in rows:
        L = int(batch.reasoning_len[r])
        s = int(batch.reasoning_start[r])
        js = range(L) if positions is None else sorted(set(int(j) for j in positions.get(r, ())))
        var_row += [r] * len(js)
        var_col += [s + j for j in js]
        var_j += list(js)
    as_t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return as_t(var_row), as_t(var_col), as_t(var_j)


def _store(res: Attribution, d: torch.Tensor, probe: str, row_index: torch.Tensor, j_index: torch.Tensor) -> None:
    """Checks a chunk's divergences and writes them into ``res.scores``."""
    if not bool(torch.isfinite(d).all()):
        # probe_divergence returns +inf when the masked model gives zero probability (a -inf logit) to a token
        # the clean model predicts; such a score cannot be normalized.
        k = int(torch.nonzero(~torch.isfinite(d))[0])
        raise ValueError(
            f"oar_p_scores: masking reasoning token {int(j_index[k])} of row {int(row_index[k])} gives a non-finite "
            f"divergence ({float(d[k])}): the masked probe distribution puts zero probability (-inf logits) where "
            "the clean one has mass"
        )
    if probe == "answer_joint":
        d = d.clamp_min(0.0)  # method.md section 2: I = max(0, phi_clean - phi_masked)
    res.scores[row_index, j_index] = d.float().cpu()


def _probe_bytes(model: ProbeModel, batch: ProbeBatch) -> int:
    """Bytes of one variant's probe logits in the planners' estimates: ``keep`` positions x V, 8 bytes each (the
    logits and their float32 copy in the divergence)."""
    return 8 * batch.keep * int(model.vocab_size)


def _oar_p_batched(run: _OarPRun, res: Attribution) -> dict:
    """Every variant a full left-padded context, chunks by ``plan_masked_chunks``. Returns the stats."""
    model, batch, rows, probe, dev = run.model, run.batch, run.rows, run.probe, run.device
    clean_all, clean_row, passes = _clean(model, batch, rows, run.clean_logits)
    var_row_t, var_col_t, var_j_t = _variants(batch, rows, run.positions)
    T = batch.input_ids.shape[1]
    widths = [int(batch.context_len[r]) for r in rows]
    counts = [int((var_row_t == r).sum()) for r in rows]
    bytes_tok = int(model.activation_bytes_per_token(max(widths)))
    plan = _C.plan_masked_chunks(widths, counts, bytes_tok, _probe_bytes(model, batch), run.budget, run.max_variants)
    clean_index_t = torch.tensor([clean_row[int(r)] for r in var_row_t], dtype=torch.long)
    tokens = passes * sum(widths)
    with torch.no_grad():
        for ch in plan:
            sl = slice(ch.begin, ch.end)
            width = ch.max_context_len
            off = T - width  # left padding: every context in the chunk lies within the last `width` columns
            row_index = var_row_t[sl]
            masked = ops.build_masked_batch(batch.input_ids[:, off:], row_index, var_col_t[sl] - off, batch.pad_id)
            window = model.tail_logits(input_ids=masked.to(dev), attention_mask=batch.attention_mask[row_index, off:].to(dev),
                                       position_ids=batch.position_ids[row_index, off:].to(dev), keep=batch.keep)
            passes += 1
            tokens += masked.numel()
            pert = gather_probe_logits(window, batch.probe_start[row_index], batch.answer_ids.shape[1])
            clean = clean_all[clean_index_t[sl].to(clean_all.device)]
            _store(res, _divergence(clean, pert, batch, row_index, probe), probe, row_index, var_j_t[sl])
    return {"forward_passes": passes, "variants": int(var_row_t.numel()), "chunks": len(plan), "tokens": tokens}


def _clean_with_cache(model, batch: ProbeBatch, rows: Sequence[int], budget: int):
    """Clean pass over ``rows`` (chunked under ``budget`` bytes, no grad): probe logits (n, K_max, V), the
    key/value cache (per layer (keys, values), each (n, kv_heads, T, head_dim)), forward passes, tokens run."""
    T = batch.input_ids.shape[1]
    K = batch.answer_ids.shape[1]
    dev = torch.device(model.device)
    idx_rows = torch.tensor(list(rows), dtype=torch.long)
    bytes_tok = int(model.activation_bytes_per_token(T))
    kv_tok = int(model.kv_bytes_per_token())
    plan = _C.plan_masked_chunks([T] * len(rows), [1] * len(rows), bytes_tok + kv_tok, _probe_bytes(model, batch),
                                 budget, 0)
    clean_parts, kv_parts, passes, tokens = [], [], 0, 0
    for ch in plan:
        sel = idx_rows[ch.begin:ch.end]
        window, kv = model.tail_logits_and_cache(input_ids=batch.input_ids[sel].to(dev),
                                                 attention_mask=batch.attention_mask[sel].to(dev),
                                                 position_ids=batch.position_ids[sel].to(dev), keep=batch.keep)
        clean_parts.append(gather_probe_logits(window, batch.probe_start[sel], K))
        kv_parts.append(kv)
        passes += 1
        tokens += int(sel.numel()) * T
    clean_all = torch.cat(clean_parts)
    kv_all = [(torch.cat([p[l][0] for p in kv_parts]), torch.cat([p[l][1] for p in kv_parts]))
              for l in range(len(kv_parts[0]))]
    return clean_all, kv_all, passes, tokens


def _oar_p_prefix(run: _OarPRun, res: Attribution) -> dict:
    """One clean pass with the key/value cache, then column-sorted variants in chunks by ``plan_prefix_chunks``,
    each run on the clean prefix of its smallest column. Returns the stats."""
    model, batch, rows, probe, dev = run.model, run.batch, run.rows, run.probe, run.device
    budget = run.budget
    T = batch.input_ids.shape[1]
    K = batch.answer_ids.shape[1]
    bytes_tok = int(model.activation_bytes_per_token(T))
    kv_tok = int(model.kv_bytes_per_token())
    bytes_var = _probe_bytes(model, batch)
    with torch.no_grad():
        # 1. Clean pass over the requested rows: probe logits + key/value cache (or the one handed over).
        if run.clean_pass is not None:
            clean_all, kv_all, passes, tokens = run.clean_pass.logits, run.clean_pass.kv, 0, 0
            cached_rows = list(run.clean_pass.rows)
        else:
            clean_all, kv_all, passes, tokens = _clean_with_cache(model, batch, rows, budget)
            cached_rows = list(rows)
        # 2. Variants sorted by masked column; chunks share the prefix of their smallest column.
        var_row_t, var_col_t, var_j_t = _variants(batch, rows, run.positions)
        order = torch.argsort(var_col_t, stable=True)
        var_row_t, var_col_t, var_j_t = var_row_t[order], var_col_t[order], var_j_t[order]
        slot = {r: i for i, r in enumerate(cached_rows)}  # row -> index in clean_all / kv_all
        var_slot_t = torch.tensor([slot[int(r)] for r in var_row_t], dtype=torch.long)
        plan = _C.plan_prefix_chunks(var_col_t.tolist(), T, bytes_tok, kv_tok, bytes_var, budget, run.max_variants,
                                     float(run.max_prefix_waste))
        # Left padding of each cached row (its first `pad` columns).
        pad_of_slot = [T - int(batch.context_len[r]) for r in cached_rows]
        shared = run.caps.shared_prefix
        shared_chunks = 0
        for ch in plan:
            sl = slice(ch.begin, ch.end)
            # The run must cover the kept probe window: with a short conclude string the last reasoning tokens
            # lie inside it, and a prefix past T - keep would leave fewer than keep positions to read.
            p = min(ch.prefix_len, T - batch.keep)
            row_index, slots, cols, js = var_row_t[sl], var_slot_t[sl], var_col_t[sl], var_j_t[sl]
            # Shared-prefix attention reads each row's prefix in place and needs the suffixes free of padding
            # (a chunk may mix rows whose padding reaches past p: those chunks take the cached path).
            use_shared = shared and max(pad_of_slot[int(x)] for x in slots.unique()) <= p
            if use_shared:  # group the variants by cached row: one prefix attention call per row
                order = torch.argsort(slots, stable=True)
                row_index, slots, cols, js = row_index[order], slots[order], cols[order], js[order]
            masked = batch.input_ids[row_index, p:].clone()
            masked[torch.arange(masked.shape[0]), cols - p] = batch.pad_id
            if use_shared:
                ids, counts = torch.unique_consecutive(slots, return_counts=True)
                ends = counts.cumsum(0).tolist()
                groups = [(int(x), e - int(c), e, pad_of_slot[int(x)]) for x, c, e in zip(ids, counts, ends)]
                window = model.tail_logits_shared_prefix(kv_all, groups, p, input_ids=masked.to(dev),
                                                         position_ids=batch.position_ids[row_index, p:].to(dev),
                                                         keep=batch.keep)
                shared_chunks += 1
            else:
                dslots = slots.to(dev)
                # slice the prefix first, then gather per variant: copies p columns, not T
                prefix_kv = [(k[:, :, :p].index_select(0, dslots), v[:, :, :p].index_select(0, dslots))
                             for k, v in kv_all]
                window = model.tail_logits_cached(prefix_kv, input_ids=masked.to(dev),
                                                  attention_mask=batch.attention_mask[row_index].to(dev),
                                                  position_ids=batch.position_ids[row_index, p:].to(dev),
                                                  keep=batch.keep)
            passes += 1
            tokens += masked.numel()
            pert = gather_probe_logits(window, batch.probe_start[row_index], K)
            clean = clean_all[slots.to(clean_all.device)]
            _store(res, _divergence(clean, pert, batch, row_index, probe), probe, row_index, js)
    return {"forward_passes": passes, "variants": int(var_row_t.numel()), "chunks": len(plan), "tokens": tokens,
            "shared_prefix_chunks": shared_chunks}


def oar_p_window_scores(model: ProbeModel, batch: ProbeBatch, *, window: int, probe: str = "answer_mean",
                        rows: Sequence[int] | None = None, positions: Mapping[int, Sequence[int]] | None = None,
                        memory_budget_mb: int = 1024, keep_clean_pass: bool = False) -> Attribution:
    """Windowed OAR-P (the screen of screened OAR-P; docs/design.md "Screened OAR-P"): I_t as in :func:`oar_p_scores`
    (token t replaced by PAD, KL or clamped phi drop of the probe), but the masked context re-runs only token t,
    the ``window`` reasoning tokens after it and the probe tail (conclude + answer); the reasoning tokens further
    on keep their clean keys/values. It measures the effect of token t that reaches the answer directly or
    through its next ``window`` tokens, at a cost of (1 + window + tail) tokens per masked token instead of the
    whole suffix. ``window >= L - 1`` re-runs every later token: exact OAR-P (equal within fp32 rounding; tested).

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
        probe, rows, positions, memory_budget_mb: as :func:`oar_p_scores`.
        keep_clean_pass: attach the clean pass (:class:`CleanPass`: probe logits and key/value cache of the rows
            scored) to the result, for the exact pass of screened OAR-P (memory: the cache of those rows).
    Returns:
        Attribution (B, L_max) float32 >= 0, stats ``forward_passes``, ``variants``, ``chunks``, ``tokens`` (tokens
        run through the model), ``engine`` (``"window"``), ``seconds``; ``clean_pass`` when asked.
    Raises:
        TypeError: ``model`` is not a ProbeModel.
        ValueError: window not an int >= 0, a model without the prefix-cache capability, and as
            :func:`oar_p_scores`.
    """
    caps = probe_capabilities(model)
    probe = _check_probe(probe)
    window = _int_value("window", window)
    if window < 0:
        raise ValueError(f"window must be an int >= 0, got {window}")
    rows = _rows(batch, rows)
    budget = _budget_bytes(memory_budget_mb)
    positions = _positions(batch, rows, positions)
    if not caps.prefix_cache:
        raise ValueError("oar_p_window_scores needs a ProbeModel with the prefix-cache capability (oar.attribution."
                         f"PrefixCacheModel: supports_prefix_cache = True); {type(model).__name__} does not declare "
                         "it: use oar_p_scores")
    _check_ids(model, batch)
    t0 = time.perf_counter()
    res = _empty(batch, rows)
    rows = [r for r in rows if int(batch.reasoning_len[r]) > 0 and (positions is None or positions.get(r))]
    if not rows:
        res.stats.update(forward_passes=0, variants=0, chunks=0, tokens=0, engine="window", seconds=0.0)
        return res
    dev = torch.device(model.device)
    T = int(batch.input_ids.shape[1])
    K = batch.answer_ids.shape[1]
    keep = int(batch.keep)
    with torch.no_grad():
        clean_all, kv_all, passes, tokens = _clean_with_cache(model, batch, rows, budget)
        dtype = kv_all[0][0].dtype
        var_row_t, var_col_t, var_j_t = _variants(batch, rows, positions)
        slot = {r: i for i, r in enumerate(rows)}
        # Re-run columns of each variant: [t, t + 1 + window) and the tail [min(end of reasoning, T - keep), T).
        runs = []
        for r, t in zip(var_row_t.tolist(), var_col_t.tolist()):
            tail = min(int(batch.reasoning_start[r]) + int(batch.reasoning_len[r]), T - keep)
            runs.append(sorted(set(range(t, min(t + 1 + window, T))) | set(range(tail, T))))
        kv_tok = int(model.kv_bytes_per_token())
        shared = caps.shared_prefix
        S_max = max(len(c) for c in runs)
        per_var = ((S_max if shared else 2 * T + S_max)) * kv_tok + S_max * int(model.activation_bytes_per_token(T + S_max)) \
            + 4 * S_max * (T + S_max) + _probe_bytes(model, batch)
        n_chunk = max(1, budget // max(per_var, 1))
        chunks = 0
        for b0 in range(0, len(runs), n_chunk):
            sl = slice(b0, min(b0 + n_chunk, len(runs)))
            row_index, cols_t, js = var_row_t[sl], var_col_t[sl], var_j_t[sl]
            part = runs[sl]
            N, S = len(part), max(len(c) for c in part)
            colq = torch.full((N, S), -1, dtype=torch.long)  # original column of each suffix slot, -1 = padding
            for n, c in enumerate(part):
                colq[n, S - len(c):] = torch.tensor(c, dtype=torch.long)
            valid = colq >= 0
            ids = batch.input_ids[row_index.view(-1, 1), colq.clamp_min(0)]
            ids[~valid] = batch.pad_id
            ids[torch.arange(N), (colq == cols_t.view(-1, 1)).long().argmax(1)] = batch.pad_id  # the masked token
            pos = torch.where(valid, batch.position_ids[row_index.view(-1, 1), colq.clamp_min(0)], torch.zeros(()))
            rerun = torch.zeros((N, T), dtype=torch.bool)
            rerun[torch.arange(N).view(-1, 1).expand_as(colq)[valid], colq[valid]] = True
            first = (T - batch.context_len[row_index]).view(-1, 1, 1)
            k_cols = torch.arange(T).view(1, 1, T)
            see_prefix = (k_cols < colq.unsqueeze(-1)) & (k_cols >= first) & ~rerun.unsqueeze(1)
            see_self = ((colq.unsqueeze(1) <= colq.unsqueeze(-1)) & valid.unsqueeze(1)) | torch.eye(S, dtype=torch.bool)
            dslots = torch.tensor([slot[int(r)] for r in row_index], dtype=torch.long, device=dev)
            low = torch.finfo(dtype).min
            if shared:  # each row's clean cache read in place (variants are row-major: one group per row)
                ids_u, counts = torch.unique_consecutive(dslots.cpu(), return_counts=True)
                ends = counts.cumsum(0).tolist()
                groups = [(int(x), e - int(c), e, 0) for x, c, e in zip(ids_u, counts, ends)]
                prefix_bias = torch.zeros(see_prefix.shape, dtype=dtype).masked_fill_(~see_prefix, low)
                self_bias = torch.zeros(see_self.shape, dtype=dtype).masked_fill_(~see_self, low).unsqueeze(1)
                win = model.tail_logits_shared_prefix(kv_all, groups, T, input_ids=ids.to(dev),
                                                      position_ids=pos.to(dev), keep=keep,
                                                      prefix_bias=prefix_bias.to(dev), self_bias=self_bias.to(dev))
            else:  # the row's clean cache copied per variant, one 4-D mask over prefix + suffix
                allowed = torch.cat([see_prefix, see_self], dim=-1).unsqueeze(1)
                mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, low)
                prefix_kv = [(k.index_select(0, dslots), v.index_select(0, dslots)) for k, v in kv_all]
                win = model.tail_logits_cached(prefix_kv, input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                               position_ids=pos.to(dev), keep=keep)
            passes += 1
            chunks += 1
            tokens += int(valid.sum())
            pert = gather_probe_logits(win, batch.probe_start[row_index], K)
            clean = clean_all[dslots.to(clean_all.device)]
            _store(res, _divergence(clean, pert, batch, row_index, probe), probe, row_index, js)
    res.stats.update(forward_passes=passes, variants=int(var_row_t.numel()), chunks=chunks, tokens=tokens,
                     engine="window", seconds=time.perf_counter() - t0)
    if keep_clean_pass:
        res.clean_pass = CleanPass(tuple(rows), clean_all, kv_all)
    _log.info("oar_p_window_scores: window %d, %d rows, %d variants in %d chunks, %.3f s", window, len(rows),
              res.stats["variants"], chunks, res.stats["seconds"])
    return res


def _shared_prompt_cache(model, batch: ProbeBatch, chunk_rows: list[int], off: int, width: int, p: int, dev):
    """Key/value cache (per layer (keys, values), each (n, kv_heads, p, head_dim)) of window columns [0, p) of
    ``chunk_rows`` (window = batch columns [off, off + width)), computed once per distinct prompt: rollouts of
    one group share their prompt, so its forward runs once and its cache is copied to each row.

    Row r's context starts at window column a_r = width - context_len[r]; columns [a_r, p) hold the first
    p - a_r tokens of its prompt (p never exceeds a row's reasoning start), and position ids restart at 0 at
    a row's first token, so those tokens' keys/values equal the first p - a_r of the distinct prompt's,
    wherever the padding put them. Columns before a_r are padding (masked by the attention mask; filled with
    any cached entry). Returns (cache, number of distinct prompts)."""
    starts = [int(batch.reasoning_start[r]) for r in chunk_rows]
    firsts = [int(batch.input_ids.shape[1]) - int(batch.context_len[r]) for r in chunk_rows]  # batch columns
    keys = [tuple(batch.input_ids[r, a:s].tolist()) for r, a, s in zip(chunk_rows, firsts, starts)]
    distinct = list(dict.fromkeys(keys))
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
        U[i] = slot[k]
        a_w = a - off  # window column of the row's first token
        cols = torch.arange(p) - a_w
        C[i] = torch.where(cols >= 0, Pm - len(k) + cols, torch.zeros_like(cols))
    U, C = U.to(dev), C.to(dev)
    cache = [(k.permute(0, 2, 1, 3)[U, C].permute(0, 2, 1, 3).contiguous(),
              v.permute(0, 2, 1, 3)[U, C].permute(0, 2, 1, 3).contiguous()) for k, v in kv_u]
    return cache, n


def oar_g_scores(model: ProbeModel, batch: ProbeBatch, *, probe: str = "answer_mean", rows: Sequence[int] | None = None,
                 sigma: float = 1e-3, noise_draws: int = 1, generator: torch.Generator | None = None,
                 clean_logits: torch.Tensor | None = None, memory_budget_mb: int = 4096,
                 positions: Mapping[int, Sequence[int]] | None = None) -> Attribution:
    """OAR-G importance (method.md section 4): I_t = |sum_h g[t,h] E[t,h]| with g = dJ/dE,
    J = KL(p_clean || p(E + delta)) (``answer_joint``: J = phi_clean - phi(E + delta)),
    delta ~ N(0, sigma^2) on reasoning positions only, averaged over ``noise_draws`` draws.

    Gradients are taken with ``torch.autograd.grad`` w.r.t. the embeddings only, so no parameter
    ``.grad`` is written (safe inside a trainer's gradient accumulation). Rows are processed in chunks
    whose estimated forward+backward memory stays under ``memory_budget_mb``. For models whose prefix cache may
    be differentiated (``PrefixCacheModel.supports_prefix_grad``) and no ``clean_logits`` given, the columns
    before a chunk's first reasoning token run once without grad and their key/value cache is shared by the
    clean pass and the noisy passes, which then run and differentiate only the suffix (same scores within fp32
    rounding). For models that take the embeddings inside the forward
    (:class:`~oar.attribution.model.EmbeddingNoiseModel`, e.g. HFProbeModel) ``embed`` is never called: every call
    is a forward on ids, as FSDP and ZeRO-3 require (same numbers).

    Args:
        sigma: noise std (absolute, > 0). noise_draws: K >= 1.
        generator: torch.Generator for the noise (CPU); results are deterministic for a fixed seed.
        positions: optional {row: reasoning indices}: noise falls on those tokens only and only they are scored
            (the others keep score 0), e.g. to leave tool outputs unperturbed. Checked as in :func:`oar_p_scores`.
        Other args as in :func:`oar_p_scores`.
    Raises:
        TypeError: ``model`` is not a ProbeModel (the message names every missing member).
        ValueError: unknown probe, sigma not finite and > 0, noise_draws not an int >= 1, rows out of range,
            memory_budget_mb not an int >= 1, token ids outside the model's vocabulary.
        FloatingPointError: non-finite scores (NaN/Inf logits or gradients).
    """
    caps = probe_capabilities(model)
    probe = _check_probe(probe)
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not (0 < sigma < float("inf")):
        raise ValueError(f"sigma must be > 0 and finite, got {sigma!r}")
    noise_draws = _int_value("noise_draws", noise_draws)
    if noise_draws < 1:
        raise ValueError(f"noise_draws must be >= 1, got {noise_draws}")
    rows = _rows(batch, rows)
    budget = _budget_bytes(memory_budget_mb)
    positions = _positions(batch, rows, positions)
    _check_ids(model, batch)
    t0 = time.perf_counter()
    res = _empty(batch, rows)
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
        clean_all, clean_row, passes = _clean(model, batch, rows, clean_logits)
    T = batch.input_ids.shape[1]
    K = batch.answer_ids.shape[1]
    widths = [int(batch.context_len[r]) for r in rows]
    bytes_tok = int(model.activation_bytes_per_token(max(widths), backward=True))
    plan = _C.plan_masked_chunks(widths, [1] * len(rows), bytes_tok, _probe_bytes(model, batch), budget, 0)
    if _log.isEnabledFor(logging.DEBUG):
        why = ("clean_logits given" if clean_logits is not None else "prefix cache with grad" if use_prefix
               else "no differentiable prefix cache")
        _log.debug("oar_g_scores: %s path (%s), %d rows in %d chunks, budget %d MiB, %d noise draws",
                   "prompt-once" if use_prefix else "plain", why, len(rows), len(plan), budget >> 20, noise_draws)
    backward = 0
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
        for _ in range(noise_draws):
            # Noise is drawn over the whole window either way, so every path uses the same numbers.
            noise = torch.randn((len(chunk_rows), width, model.hidden_size), generator=generator, dtype=torch.float32)
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
            J = _divergence(clean, pert, batch, idx, probe).sum()
            (g,) = torch.autograd.grad(J, Ek)
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
    res.stats.update(forward_passes=passes, backward_passes=backward, chunks=len(plan), seconds=time.perf_counter() - t0)
    _log.info("oar_g_scores: %s path, %d rows in %d chunks, %d forwards, %d backwards, %.3f s",
              "prompt-once" if use_prefix else "plain", len(rows), len(plan), passes, backward, res.stats["seconds"])
    return res


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
    logp = torch.log_softmax(x, dim=-1)
    plogp = torch.where(torch.isneginf(logp), torch.zeros((), device=x.device), logp.exp() * logp)
    return (-plogp.sum(-1)).clamp_min(0)


def entropy_scores(model: ProbeModel, batch: ProbeBatch, *, rows: Sequence[int] | None = None) -> Attribution:
    """Entropy baseline: I_t = H(softmax(logits predicting reasoning token t)), the full-vocabulary
    entropy of the policy at the step that produced token t (temperature 1), in nats. The probe context's
    prefix is exactly the generation context, so these equal the sampling-time entropies.

    One no-grad ``tail_logits`` call per row, keeping the positions from the one predicting the first reasoning
    token to the end of the context.

    Returns:
        Attribution with scores (B, L_max) float32 >= 0; stats ``forward_passes``, ``seconds``.
    Raises:
        TypeError: ``model`` is not a ProbeModel.
        ValueError: rows out of range, token ids outside the model's vocabulary, a scored row with an empty prompt,
            NaN / +inf logits.
    """
    probe_capabilities(model)
    rows = _rows(batch, rows)
    _check_ids(model, batch)
    t0 = time.perf_counter()
    res = _empty(batch, rows)
    dev = torch.device(model.device)
    T = batch.input_ids.shape[1]
    with torch.no_grad():
        for r in rows:
            L = int(batch.reasoning_len[r])
            if L == 0:
                continue
            s = int(batch.reasoning_start[r])
            if s < 1 or int(batch.attention_mask[r, s - 1]) == 0:
                raise ValueError(f"entropy_scores: row {r} has an empty prompt; the first reasoning token has no "
                                 "predicting position")
            # window of columns [s - 1, T): its first L positions predict the reasoning tokens
            logits = model.tail_logits(input_ids=batch.input_ids[r: r + 1].to(dev),
                                       attention_mask=batch.attention_mask[r: r + 1].to(dev),
                                       position_ids=batch.position_ids[r: r + 1].to(dev), keep=T - s + 1)[0, :L]
            res.scores[r, :L] = entropy_from_logits(logits, f"entropy_scores: the model's logits of row {r}").cpu()
    res.stats.update(forward_passes=len(rows), seconds=time.perf_counter() - t0)
    _log.info("entropy_scores: %d rows, %d forwards, %.3f s", len(rows), len(rows), res.stats["seconds"])
    return res


def random_scores(batch: ProbeBatch, *, rows: Sequence[int] | None = None,
                  generator: torch.Generator | None = None) -> Attribution:
    """Random-credit baseline (method.md section 8): I_t ~ U(0, 1) i.i.d."""
    rows = _rows(batch, rows)
    res = _empty(batch, rows)
    rand = torch.rand(res.scores.shape, generator=generator)
    res.scores = torch.where(res.mask, rand, torch.zeros_like(rand))
    res.stats.update(forward_passes=0, seconds=0.0)
    return res
