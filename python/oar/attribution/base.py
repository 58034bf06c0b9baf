"""What the attribution engines share: the result types, the argument checks, the clean pass and the probe
divergence of a chunk (method.md sections 2-4).

Every engine (:mod:`~oar.attribution.oar_p`, :mod:`~oar.attribution.window`, :mod:`~oar.attribution.oar_g`,
:mod:`~oar.attribution.entropy`, :mod:`~oar.attribution.random`) takes a
:class:`~oar.attribution.model.ProbeModel`, a :class:`~oar.attribution.context.ProbeBatch` and the rows to score,
and returns an :class:`Attribution`: scores (B, L_max) float32 aligned with each row's reasoning tokens (column
j = reasoning token j, i.e. completion column j), a mask of valid entries and timing/size stats. Rows not asked
for get all-False masks. Nothing here writes parameter ``.grad``. Each engine checks the model once
(:func:`~oar.attribution.model.probe_capabilities`: a ``TypeError`` naming the missing members of a model that is
no ProbeModel) and takes its optional capabilities from that check. Which path ran is logged on the ``"oar"``
logger (info: one summary per call; debug: the decision and its reason; ``oar.set_log_level``). Chunks are sized
by :mod:`oar.attribution.planner`.

The engine contract (docs/architecture.md, "Adding an engine"): an engine is a function
``engine(model, batch, *, probe, rows, positions, memory_budget_mb, ...) -> Attribution`` built from these, in
this order:

1. :func:`engine_args` (model capabilities, probe, rows, budget, positions checked in one order) and
   :func:`check_ids`; :func:`empty_attribution` is the result it fills (and returns as is when no row is asked);
2. the clean pass: :func:`resolve_clean_logits` (probe logits only) or :func:`clean_pass_with_cache` (logits and the
   key/value cache the masked passes re-use);
3. the perturbations: :func:`masking_units` (units from ``positions`` / ``spans``), :func:`unit_variants` (one
   variant per unit), :func:`span_mask` (which columns a variant masks);
4. per chunk, :func:`chunk_divergence` (probe divergence against the clean logits) and :func:`store_scores`
   (checked, written to the result; spans share their score).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from oar import _args, ops
from oar.schema import PROBES
from oar.attribution import planner
from oar.attribution.context import ProbeBatch
from oar.attribution.model import ProbeCapabilities, ProbeModel, gather_probe_logits, probe_capabilities
from oar.attribution.spans import check_spans

__all__ = ["Attribution", "CleanPass", "clean_probe_logits", "check_probe", "int_value", "engine_args", "check_rows",
           "check_positions", "check_ids", "empty_attribution", "resolve_clean_logits", "chunk_divergence",
           "masking_units", "unit_variants", "span_mask", "store_scores", "clean_pass_with_cache"]



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
    #: The clean pass of :func:`~oar.attribution.window.oar_p_window_scores` (``keep_clean_pass=True``): handed to
    #: the exact pass of screened OAR-P, which then needs no clean forward of its own; None otherwise.
    clean_pass: "CleanPass | None" = None


@dataclass
class CleanPass:
    """One clean forward over ``rows`` of a batch: probe logits (n, K_max, V) and the key/value cache (per layer
    (keys, values), each (n, kv_heads, T, head_dim)); row ``rows[i]`` is index i."""

    rows: tuple[int, ...]
    logits: torch.Tensor
    kv: list


def check_probe(probe: str) -> str:
    """``probe`` when it is one of :data:`oar.schema.PROBES`; ValueError naming them otherwise."""
    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {probe!r}")
    return probe


def int_value(name: str, v) -> int:
    """``v`` as an int, integer 0-d tensors included (:func:`oar._args.int_arg`)."""
    return _args.int_arg(name, v, tensors=True)


def engine_args(model: ProbeModel, batch: ProbeBatch, probe: str, rows, positions, memory_budget_mb):
    """The checks every probe engine starts with, in one order: the model's capabilities (TypeError naming missing
    members), the probe name, the rows, the memory budget, the positions. Returns (capabilities, probe, rows,
    budget bytes, positions)."""
    caps: ProbeCapabilities = probe_capabilities(model)
    probe = check_probe(probe)
    rows = check_rows(batch, rows)
    budget = planner.budget_bytes(memory_budget_mb)
    return caps, probe, rows, budget, check_positions(batch, rows, positions)


def check_rows(batch: ProbeBatch, rows: Sequence[int] | None) -> list[int]:
    """The rows to score, sorted and unique: every row for None, else ``rows`` checked (ints or integer 0-d tensors,
    0 <= row < B). Raises ValueError naming the bad entry."""
    if rows is None:
        return list(range(batch.batch_size))
    if isinstance(rows, (str, bytes)) or (isinstance(rows, torch.Tensor) and rows.dim() != 1):
        raise ValueError(f"rows must be a sequence of row indices, got {rows!r}")
    out = sorted(set(int_value("rows[i]", r) for r in rows))
    for r in out:
        if not 0 <= r < batch.batch_size:
            raise ValueError(f"rows must index the batch (0 <= row < {batch.batch_size}), got {r}")
    return out


def check_positions(batch: ProbeBatch, rows: list[int], positions) -> dict[int, list[int]] | None:
    """``positions`` checked: a mapping {requested row: reasoning indices in [0, L_row)} of ints."""
    if positions is None:
        return None
    if not isinstance(positions, Mapping):
        raise ValueError(f"positions must be a mapping {{row: reasoning indices}} or None, got {type(positions).__name__}")
    out: dict[int, list[int]] = {}
    for key, js in positions.items():
        r = int_value("positions key", key)
        if r not in rows:
            raise ValueError(f"positions has row {r}, which is not among the rows scored ({rows[:8]}"
                             f"{'...' if len(rows) > 8 else ''})")
        if (isinstance(js, (str, bytes, Mapping)) or not hasattr(js, "__iter__")
                or (isinstance(js, torch.Tensor) and js.dim() != 1)):
            raise ValueError(f"positions[{r}] must be a sequence of reasoning indices, got {type(js).__name__} {js!r}")
        L = int(batch.reasoning_len[r])
        idx = [int_value(f"positions[{r}][i]", j) for j in js]
        if any(not 0 <= j < L for j in idx):
            raise ValueError(f"positions[{r}] must be reasoning indices in [0, {L}), got {idx[:8]}")
        out[r] = idx
    return out


def check_ids(model: ProbeModel, batch: ProbeBatch) -> None:
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


def empty_attribution(batch: ProbeBatch, rows: list[int]) -> Attribution:
    """The result an engine fills: scores (B, L_max) float32 zeros, mask True on the first L_r columns of ``rows``."""
    L = int(batch.reasoning_len.max()) if batch.batch_size else 0
    mask = torch.zeros((batch.batch_size, L), dtype=torch.bool)
    for r in rows:
        mask[r, : int(batch.reasoning_len[r])] = True
    return Attribution(torch.zeros((batch.batch_size, L), dtype=torch.float32), mask)


def clean_probe_logits(model: ProbeModel, batch: ProbeBatch, rows: Sequence[int] | None = None,
                       memory_budget_mb: int | None = None, *, return_forwards: bool = False):
    """Probe logits (n, K_max, V) (the model's dtype, on its device) of the unperturbed contexts of ``rows`` (all
    rows by default), without grad: one forward, or with ``memory_budget_mb`` (an int >= 1) forwards over chunks of
    rows planned by :func:`oar.attribution.planner.plan_clean` (no cache kept). With ``return_forwards``:
    ``(logits, number of forwards run)``.

    Raises:
        ValueError: ``memory_budget_mb`` not None nor an int >= 1.
    """
    rows = list(rows) if rows is not None else list(range(batch.batch_size))
    budget = None if memory_budget_mb is None else planner.budget_bytes(memory_budget_mb)
    logits, forwards = _clean_logits(model, batch, rows, budget)
    return (logits, forwards) if return_forwards else logits


def _clean_logits(model: ProbeModel, batch: ProbeBatch, rows: list[int], budget: int | None):
    """Clean probe logits (n, K_max, V) of ``rows`` without grad, in chunks of rows under ``budget`` bytes (None:
    one forward), and the number of forwards."""
    idx = torch.tensor(rows, dtype=torch.long)
    dev = torch.device(model.device)
    if budget is None or not rows:
        spans = [(0, len(rows))]
    else:
        spans = [(ch.begin, ch.end) for ch in planner.plan_clean(model, batch, len(rows), budget, cache=False)]
    parts = []
    with torch.no_grad():
        for begin, end in spans:
            sel = idx[begin:end]
            window = model.tail_logits(input_ids=batch.input_ids[sel].to(dev),
                                       attention_mask=batch.attention_mask[sel].to(dev),
                                       position_ids=batch.position_ids[sel].to(dev), keep=batch.keep)
            parts.append(gather_probe_logits(window, batch.probe_start[sel], batch.answer_ids.shape[1]))
            del window
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), len(spans)


def resolve_clean_logits(model: ProbeModel, batch: ProbeBatch, rows: Sequence[int],
                         clean_logits: torch.Tensor | None, budget: int | None = None):
    """The clean probe logits an engine compares its perturbations with: the caller's ``clean_logits`` (B, K_max, V)
    when given (checked; 0 forwards, indexed by row), else computed for ``rows`` without grad (in chunks under
    ``budget`` bytes when given). Returns (logits, row -> index into logits, forward passes spent).

    Raises:
        ValueError: ``clean_logits`` not a (B, K_max, V) tensor of this batch.
    """
    if clean_logits is None:
        logits, passes = _clean_logits(model, batch, list(rows), budget)
        return logits, {r: i for i, r in enumerate(rows)}, passes
    want = (batch.batch_size, batch.answer_ids.shape[1])
    if not isinstance(clean_logits, torch.Tensor) or clean_logits.dim() != 3 or tuple(clean_logits.shape[:2]) != want:
        got = tuple(clean_logits.shape) if isinstance(clean_logits, torch.Tensor) else type(clean_logits).__name__
        raise ValueError(f"clean_logits must be (B, K_max, V) with (B, K_max) = {want}, got {got}")
    return clean_logits, {r: r for r in rows}, 0


def chunk_divergence(clean: torch.Tensor, pert: torch.Tensor, batch: ProbeBatch, row_index: torch.Tensor,
                     probe: str) -> torch.Tensor:
    """Probe divergence (N,) of a chunk's perturbed probe logits ``pert`` (N, K_max, V) against ``clean`` (N, K_max,
    V; cast to ``pert``'s dtype) of the variants' rows ``row_index`` (N,) (:func:`oar.ops.probe_divergence`: KL for
    the distribution probes, phi_clean - phi_pert for ``answer_joint``, unclamped; :func:`store_scores` clamps)."""
    dev = pert.device
    lengths = batch.answer_len[row_index].to(dev)
    answer_ids = batch.answer_ids[row_index].to(dev) if probe == "answer_joint" else None
    return ops.probe_divergence(clean.to(pert.dtype), pert, probe=probe, answer_ids=answer_ids, lengths=lengths)


def masking_units(batch: ProbeBatch, rows: Sequence[int], positions, spans) -> dict[int, list[tuple[int, int]]] | None:
    """The masking units of the OAR-P engines: {row: [(j0, j1), ...]} from ``spans`` (checked here) or from the
    checked ``positions`` (one token each); None when neither is given (every reasoning token its own unit).
    Raises ValueError for both at once or spans that :func:`oar.attribution.spans.check_spans` refuses."""
    if spans is None:
        return None if positions is None else {r: [(j, j + 1) for j in sorted(set(js))] for r, js in positions.items()}
    if positions is not None:
        raise ValueError("pass positions (single tokens) or spans (token ranges), not both")
    return check_spans(spans, {int(r): int(batch.reasoning_len[r]) for r in rows})


def unit_variants(batch: ProbeBatch, rows: Sequence[int], units=None):
    """Flattened variant list, rollout-major, one variant per unit (:func:`masking_units`; None = every reasoning
    token): rows, first masked column, first reasoning index j, number of masked tokens (int64 tensors)."""
    var_row, var_col, var_j, var_len = [], [], [], []
    for r in rows:
        s = int(batch.reasoning_start[r])
        spans = [(j, j + 1) for j in range(int(batch.reasoning_len[r]))] if units is None else units.get(r, ())
        for j0, j1 in spans:
            var_row.append(r)
            var_col.append(s + j0)
            var_j.append(j0)
            var_len.append(j1 - j0)
    as_t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return as_t(var_row), as_t(var_col), as_t(var_j), as_t(var_len)


def span_mask(cols: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """(N, S) bool: True where column ``cols`` (N, S) or (S,) lies in variant n's masked range [starts[n],
    starts[n] + lens[n])."""
    cols = cols if cols.dim() == 2 else cols.view(1, -1)
    return (cols >= starts.view(-1, 1)) & (cols < (starts + lens).view(-1, 1))


def store_scores(res: Attribution, d: torch.Tensor, probe: str, row_index: torch.Tensor, j_index: torch.Tensor,
                 lens: torch.Tensor | None = None) -> None:
    """Checks a chunk's divergences and writes them into ``res.scores``: variant n's score on its masked tokens
    [j_index[n], j_index[n] + lens[n]) (every token of a span gets the span's score; method.md section 11)."""
    if not bool(torch.isfinite(d).all()):
        # probe_divergence returns +inf when the masked model gives zero probability (a -inf logit) to a token
        # the clean model predicts; such a score cannot be normalized.
        k = int(torch.nonzero(~torch.isfinite(d))[0])
        what = (f"reasoning token {int(j_index[k])}" if lens is None or int(lens[k]) == 1 else
                f"reasoning tokens [{int(j_index[k])}, {int(j_index[k]) + int(lens[k])})")
        raise ValueError(
            f"oar_p_scores: masking {what} of row {int(row_index[k])} gives a non-finite "
            f"divergence ({float(d[k])}): the masked probe distribution puts zero probability (-inf logits) where "
            "the clean one has mass"
        )
    if probe == "answer_joint":
        d = d.clamp_min(0.0)  # method.md section 2: I = max(0, phi_clean - phi_masked)
    d = d.float().cpu()
    if lens is None or bool((lens == 1).all()):
        res.scores[row_index, j_index] = d
        return
    reps = lens.cpu()
    offs = torch.arange(int(reps.sum())) - torch.repeat_interleave(reps.cumsum(0) - reps, reps)
    res.scores[row_index.repeat_interleave(reps), j_index.repeat_interleave(reps) + offs] = d.repeat_interleave(reps)


def _prompt_once_layout(batch: ProbeBatch, rows: Sequence[int]):
    """The prompt-once layout of a clean chunk (docs/design.md, "Prompt-once clean pass"), or None when it saves
    nothing (no prompt shared by two rows) or does not apply (an empty prompt, a probe window reaching into a
    row's prompt).

    Row r (batch columns: padding [0, a_r), prompt [a_r, s_r), response [s_r, T)) is laid out as prompt [0, P_r),
    a hole [P_r, s_r) (padding, masked), response [s_r, T) at its batch columns. The first ``p`` columns (p <= every
    s_r, <= T - keep) are the distinct prompts' cache, computed once each; columns [p, T) run on top of it.

    Returns (p, distinct prompts as tuples, slot of each row's prompt, per-row (a_r, s_r))."""
    T = int(batch.input_ids.shape[1])
    firsts = [T - int(batch.context_len[r]) for r in rows]
    starts = [int(batch.reasoning_start[r]) for r in rows]
    keys = [tuple(batch.input_ids[r, a:s].tolist()) for r, a, s in zip(rows, firsts, starts)]
    distinct = list(dict.fromkeys(keys))
    if len(distinct) == len(rows) or any(len(k) == 0 for k in distinct) or max(starts) > T - int(batch.keep):
        return None
    p = min(min(starts), max(len(k) for k in distinct))
    if p <= 0:
        return None
    slot = {k: i for i, k in enumerate(distinct)}
    return p, distinct, [slot[k] for k in keys], list(zip(firsts, starts))


def _prompt_once_clean(model, batch: ProbeBatch, rows: Sequence[int], layout, dev):
    """One clean chunk through the prompt-once layout (:func:`_prompt_once_layout`): the distinct prompts' first
    ``p`` columns once, then columns [p, T) of every row on top (``tail_logits_and_cache(prefix_kv=...)``). Returns
    (probe window logits (n, keep, V), cache in the batch layout (per layer (n, kv_heads, T, head_dim)), tokens)."""
    p, distinct, slots, spans = layout
    T, keep, pad = int(batch.input_ids.shape[1]), int(batch.keep), int(batch.pad_id)
    n, nd = len(rows), len(distinct)
    ids_u = torch.full((nd, p), pad, dtype=torch.long)
    attn_u = torch.zeros((nd, p), dtype=torch.long)
    for i, k in enumerate(distinct):
        m = min(len(k), p)
        ids_u[i, :m] = torch.tensor(k[:m], dtype=torch.long)
        attn_u[i, :m] = 1
    pos_u = torch.arange(p).expand(nd, p)
    _, kv_u = model.tail_logits_and_cache(input_ids=ids_u.to(dev), attention_mask=attn_u.to(dev),
                                          position_ids=pos_u.to(dev), keep=1)
    slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
    prefix = [(k.index_select(0, slot_t), v.index_select(0, slot_t)) for k, v in kv_u]
    del kv_u
    # Columns [p, T) of each row in the prompt-once layout; `src` maps a batch column to its layout column.
    ids = torch.full((n, T), pad, dtype=torch.long)
    attn = torch.zeros((n, T), dtype=torch.long)
    pos = torch.zeros((n, T), dtype=torch.long)
    src = torch.arange(T).repeat(n, 1)
    for i, (r, (a, s)) in enumerate(zip(rows, spans)):
        ids[i, : s - a] = batch.input_ids[r, a:s]
        ids[i, s:] = batch.input_ids[r, s:]
        attn[i, : s - a] = 1
        attn[i, s:] = 1
        pos[i, : s - a] = batch.position_ids[r, a:s]
        pos[i, s:] = batch.position_ids[r, s:]
        src[i, a:s] = torch.arange(s - a)
    window, kv = model.tail_logits_and_cache(input_ids=ids[:, p:].to(dev), attention_mask=attn.to(dev),
                                             position_ids=pos[:, p:].to(dev), keep=keep, prefix_kv=prefix)
    del prefix
    # Back to the batch layout, one layer at a time (a transient of one layer's cache): prompt [0, P_r) moves to
    # [a_r, s_r); the response already sits at its batch columns; padding columns [0, a_r) keep finite values.
    src = src.to(dev)
    out = []
    for k, v in kv:
        idx = src.view(n, 1, T, 1).expand(-1, k.shape[1], -1, k.shape[3])
        out.append((torch.take_along_dim(k, idx, dim=2), torch.take_along_dim(v, idx, dim=2)))
    del kv
    return window, out, nd * p + n * (T - p)


def clean_pass_with_cache(model, batch: ProbeBatch, rows: Sequence[int], budget: int, prompt_once: bool = False):
    """Clean pass over ``rows`` (chunked under ``budget`` bytes, no grad): probe logits (n, K_max, V), the
    key/value cache (per layer (keys, values), each (n, kv_heads, T, head_dim)), forward passes, tokens run.

    With ``prompt_once`` (the model's ``prefix_extend`` capability) a chunk whose rows share prompts (rollouts of
    one group) runs each distinct prompt once (:func:`_prompt_once_clean`; same numbers within rounding)."""
    T = batch.input_ids.shape[1]
    K = batch.answer_ids.shape[1]
    dev = torch.device(model.device)
    rows = list(rows)
    idx_rows = torch.tensor(rows, dtype=torch.long)
    prompt_once = prompt_once and _prompt_once_layout(batch, rows) is not None
    plan = planner.plan_clean(model, batch, len(rows), budget, prompt_once=prompt_once)
    clean_parts, kv_all, passes, tokens = [], None, 0, 0
    n = len(rows)
    for ch in plan:
        sel = idx_rows[ch.begin:ch.end]
        layout = _prompt_once_layout(batch, rows[ch.begin:ch.end]) if prompt_once else None
        if layout is not None:
            window, kv, run_tokens = _prompt_once_clean(model, batch, rows[ch.begin:ch.end], layout, dev)
            passes += 2
        else:
            window, kv = model.tail_logits_and_cache(input_ids=batch.input_ids[sel].to(dev),
                                                     attention_mask=batch.attention_mask[sel].to(dev),
                                                     position_ids=batch.position_ids[sel].to(dev), keep=batch.keep)
            run_tokens = int(sel.numel()) * T
            passes += 1
        clean_parts.append(gather_probe_logits(window, batch.probe_start[sel], K))
        del window
        if kv_all is None:
            if len(plan) == 1:  # one chunk: its cache is the cache
                kv_all = [(k, v) for k, v in kv]
            else:  # the rows' cache written chunk by chunk into one allocation (no concatenation: no 2x peak)
                kv_all = [(k.new_empty((n,) + tuple(k.shape[1:])), v.new_empty((n,) + tuple(v.shape[1:])))
                          for k, v in kv]
        if len(plan) > 1:
            for (k_all, v_all), (k, v) in zip(kv_all, kv):
                k_all[ch.begin:ch.end].copy_(k)
                v_all[ch.begin:ch.end].copy_(v)
        del kv
        tokens += run_tokens
    clean_all = torch.cat(clean_parts)
    return clean_all, kv_all, passes, tokens
