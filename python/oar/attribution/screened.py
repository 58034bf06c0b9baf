"""Screened OAR-P (docs/design.md, "Screened OAR-P"): exact masking on the tokens a cheap screen ranks first, plus a random sample of the
rest; the tokens not masked get the screen's scores mapped onto the exact scale (docs/attribution_eval.md).

For one rollout of L reasoning tokens with screen scores s (e.g. OAR-G):

1. **Selection** (:func:`screen_selection`): the top ``ceil(fraction x L)`` tokens by s (ties: earlier first),
   plus ``ceil(sample_fraction x L)`` tokens drawn uniformly without replacement from the others.
2. **Exact scores** of the selected tokens: :func:`oar.attribution.oar_p_scores` with ``positions`` = the
   selection (the same engine and chunk planner as exact OAR-P, so they are exact OAR-P scores).
3. **Calibration** (:func:`calibrate`): the random sample is an unbiased sample of the unselected tokens, so the
   scale ``a = sum(s x e) / sum(s x s)`` over it (least squares through 0 of exact e on screen s; both >= 0) maps
   the screen onto the exact scale where the unselected tokens live; without a usable sample (empty, or all
   screen scores 0 there) ``a`` is fitted on every selected token. Unselected tokens get ``a x s`` (>= 0, finite).

With ``fraction = 1`` every token is masked and the result is exact OAR-P.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from oar.attribution.context import ProbeBatch
from oar.attribution.base import Attribution
from oar.attribution.oar_p import oar_p_scores
from oar.attribution.spans import check_spans


def _fraction(name: str, value) -> float:
    from oar import _args

    v = _args.float_arg(name, value)  # a real number (the project's one check of that)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be a real number in [0, 1], got {value!r}")
    return v


def screen_selection(screen: torch.Tensor, fraction: float, sample_fraction: float,
                     generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """The reasoning tokens of one rollout to mask exactly.

    Args:
        screen: (L,) real screen scores of the rollout's reasoning tokens (finite).
        fraction: share of tokens taken from the top of the screen, in [0, 1]: ceil(fraction x L) tokens.
        sample_fraction: share drawn uniformly from the other tokens, in [0, 1]: ceil(sample_fraction x L) tokens
            (at most all of them).
        generator: CPU generator of the sample.

    Returns:
        ``(top, sample)``: sorted token indices, disjoint.

    Raises:
        ValueError: fractions outside [0, 1]; ``screen`` not 1-D or not finite.
    """
    fraction = _fraction("fraction", fraction)
    sample_fraction = _fraction("sample_fraction", sample_fraction)
    if not isinstance(screen, torch.Tensor) or screen.dim() != 1:
        raise ValueError(f"screen must be a 1-D tensor (L,), got "
                         f"{tuple(screen.shape) if isinstance(screen, torch.Tensor) else type(screen).__name__}")
    s = screen.detach().double().cpu()
    if not bool(torch.isfinite(s).all()):
        raise ValueError("screen must be finite")
    L = int(s.numel())
    n_top = min(L, math.ceil(fraction * L))
    order = sorted(range(L), key=lambda i: (-float(s[i]), i))
    top = sorted(order[:n_top])
    rest = order[n_top:]
    n_sample = min(len(rest), math.ceil(sample_fraction * L))
    pick = torch.randperm(len(rest), generator=generator)[:n_sample].tolist() if n_sample else []
    return top, sorted(rest[j] for j in pick)


def calibrate(screen: torch.Tensor, exact: torch.Tensor, sample: Sequence[int], selected: Sequence[int]) -> float:
    """Scale ``a >= 0`` of the map ``a x screen`` onto the exact scale (least squares through 0), fitted on
    ``sample`` (the random sample of unselected tokens), else on every ``selected`` token when the sample is empty
    or its screen scores are all 0; 0 when neither has a positive screen score.

    Args:
        screen, exact: (L,) real, >= 0 on the indices used.
        sample, selected: token indices.
    """
    s = screen.detach().double().cpu()
    e = exact.detach().double().cpu()
    for idx in (list(sample), list(selected)):
        if idx:
            si, ei = s[idx], e[idx]
            den = float((si * si).sum())
            if den > 0:
                return max(0.0, float((si * ei).sum()) / den)
    return 0.0


def budget_fraction(costs: Sequence[Sequence[float]], max_fraction: float, sample_fraction: float,
                    budget: float) -> float:
    """The largest top fraction f in [0, max_fraction] whose exact-pass cost fits in ``budget`` (time budget of
    screened OAR-P; the pipeline's ``screen_budget``).

    The cost of f is bounded above, whatever the screen picks: per row, the ``ceil(f x n)`` most expensive of its
    n candidates, plus ``sample_fraction`` x the row's total (the random sample's expected cost).

    Args:
        costs: per row, the cost of masking each candidate (e.g. tokens from it to the end of the probe context).
        max_fraction, sample_fraction: in [0, 1].
        budget: the cost allowed (same unit as ``costs``).

    Returns:
        ``max_fraction`` when it fits, else the largest fitting f found by bisection (to 2^-20), 0 when none fits
        (the sample alone is always kept: it calibrates the screen).
    """
    max_fraction = _fraction("max_fraction", max_fraction)
    sample_fraction = _fraction("sample_fraction", sample_fraction)
    rows = [sorted((float(c) for c in row), reverse=True) for row in costs]
    sample = sample_fraction * sum(sum(r) for r in rows)

    def cost(f: float) -> float:
        return sum(sum(r[:math.ceil(f * len(r))]) for r in rows) + sample

    if cost(max_fraction) <= budget:
        return max_fraction
    lo, hi = 0.0, max_fraction
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid)
    return lo


def oar_p_screened_scores(model, batch: ProbeBatch, screen: Attribution, *, fraction: float, sample_fraction: float,
                          rows: Sequence[int] | None = None, generator: torch.Generator | None = None,
                          positions: dict | None = None, spans: dict | None = None, **oar_p_kwargs) -> Attribution:
    """Screened OAR-P scores of ``batch`` (module docstring).

    Args:
        model, batch, rows: as :func:`oar.attribution.oar_p_scores`.
        screen: the screen's :class:`~oar.attribution.base.Attribution` of the same batch and rows (e.g.
            :func:`oar.attribution.oar_p_window_scores` or :func:`oar.attribution.oar_g_scores`), scores >= 0; its
            ``clean_pass``, when it has one, replaces the exact pass's clean forward.
        fraction, sample_fraction: see :func:`screen_selection`.
        generator: CPU generator of the random sample.
        positions: {row: reasoning indices} the only candidates of a row (as :func:`oar.attribution.oar_p_scores`:
            tool outputs excluded); the fractions are of a row's candidates, other tokens score 0. None = all.
        spans: {row: [(j0, j1), ...]} masking units (docs/method.md section 11; exclusive with ``positions``): the
            candidates are the spans, a span's screen score is the mean of its tokens' screen scores (the screen in
            unit form: every token of a span carrying the span's score, as the window engine run with the same
            spans or :func:`oar.attribution.spans.span_sums` give it), and every token of an unmasked span gets
            ``a x`` that score.
        oar_p_kwargs: passed to :func:`oar.attribution.oar_p_scores` (probe, memory_budget_mb, engine, ...).

    Returns:
        Attribution (B, L_max) float32 >= 0: exact OAR-P scores on the selected units, ``a_i x screen``
        elsewhere; stats of the exact pass plus ``masked`` (units masked exactly), ``masked_units`` ({row: [(j0, j1)
        of each unit masked exactly]}), ``scored_tokens`` (units scored: reasoning tokens with token units),
        ``calibration`` ({row: a_i}).

    Raises:
        ValueError: as :func:`screen_selection` and :func:`oar.attribution.oar_p_scores`; a screen whose shape is not
            the batch's (B, L_max), or with scores < 0 / not finite on its mask; both positions and spans.
    """
    B = int(batch.input_ids.shape[0])
    L_max = int(batch.reasoning_len.max()) if B else 0
    sc = screen.scores
    if tuple(sc.shape) != (B, L_max):
        raise ValueError(f"screen.scores must be (B, L_max) = {(B, L_max)} like the batch, got {tuple(sc.shape)}")
    if not bool((torch.isfinite(sc) & (sc >= 0))[screen.mask].all()):
        raise ValueError("screen.scores must be finite and >= 0 on screen.mask")
    if _fraction("fraction", fraction) + _fraction("sample_fraction", sample_fraction) <= 0:
        raise ValueError("fraction + sample_fraction must be > 0: a screen that masks nothing has no exact scale")
    if positions is not None and spans is not None:
        raise ValueError("pass positions (single tokens) or spans (token ranges), not both")
    rows = list(range(B)) if rows is None else [int(r) for r in rows]
    lengths = {r: int(batch.reasoning_len[r]) for r in rows}
    if spans is not None:
        spans = check_spans(spans, lengths)
    candidates: dict[int, list[tuple[int, int]]] = {}  # per row: its units (j0, j1)
    for r in rows:
        L = lengths[r]
        if spans is not None:
            cand = spans.get(r, [])
        else:
            js = list(range(L)) if positions is None else sorted({int(j) for j in positions.get(r, ())})
            if any(not 0 <= j < L for j in js):
                raise ValueError(f"positions[{r}] must be reasoning indices in [0, {L}), got {js[:8]}")
            cand = [(j, j + 1) for j in js]
        if cand:
            candidates[r] = cand

    def unit_scores(scores: torch.Tensor, units) -> torch.Tensor:
        return torch.stack([scores[j0:j1].double().mean() for j0, j1 in units])

    selection: dict[int, tuple[list[int], list[int]]] = {}  # per row: indices into candidates[r]
    for r, cand in candidates.items():
        selection[r] = screen_selection(unit_scores(sc[r], cand), fraction, sample_fraction, generator)
    chosen_of = {r: sorted(top + sample) for r, (top, sample) in selection.items() if top or sample}
    if screen.clean_pass is not None and "clean_pass" not in oar_p_kwargs:
        oar_p_kwargs = dict(oar_p_kwargs, clean_pass=screen.clean_pass)  # the screen's clean forward, reused
    exact = oar_p_scores(model, batch, rows=rows, spans={r: [candidates[r][i] for i in idx]
                                                         for r, idx in chosen_of.items()}, **oar_p_kwargs)
    out = exact.scores.clone()
    calibration = {}
    for r, (top, sample) in selection.items():
        cand = candidates[r]
        chosen = chosen_of.get(r, [])
        s_u = unit_scores(sc[r], cand)
        e_u = unit_scores(exact.scores[r], cand)
        a = calibrate(s_u, e_u, sample, chosen)
        calibration[r] = a
        taken = set(chosen)
        for i, (j0, j1) in enumerate(cand):
            if i not in taken:
                out[r, j0:j1] = float(a * s_u[i])
    stats = dict(exact.stats, masked=sum(len(p) for p in chosen_of.values()),
                 masked_units={r: [candidates[r][i] for i in idx] for r, idx in chosen_of.items()},
                 scored_tokens=sum(len(c) for c in candidates.values()), calibration=calibration)
    return Attribution(out, exact.mask, stats)
