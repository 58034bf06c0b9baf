"""Masking units (oar.attribution.spans, docs/method.md section 11, issue 23): the boundaries of words, lines and
sentences, exact and windowed span OAR-P against float64 step-by-step references, screened OAR-P over spans, and the
pipeline's ``mask_unit`` / ``span_starts``, on the sharpened tiny model of test_attribution.py (character tokens)."""

import pytest
import torch

import oar
from oar.attribution import HFProbeModel, ProbeContextBuilder, oar_g_scores, oar_p_scores, oar_p_window_scores
from oar.attribution.screened import oar_p_screened_scores
from oar.attribution.spans import check_spans, span_starts, span_sums, spans_of, token_texts
from oar.batch import RolloutBatch
from oar.pipeline import Pipeline

from _completions import CONCLUDE, probe_rollouts
from _error_model import oar_p_error_bound, oar_p_window_error_bound
from _tolerance import assert_within_error_model
from test_attribution import tiny  # noqa: F401 - the module fixture


BPE = ["2", " plus", " 1", "3", " is", " 15", ".", "\n", "\n", "Then", " 3", ".", "14", " ok", ".", " Fine", "!"]


@pytest.mark.parametrize("unit, want", [
    ("token", BPE),
    ("word", ["2", " plus", " 13", " is", " 15", ".\n\n", "Then", " 3", ".", "14", " ok", ".", " Fine", "!"]),
    ("line", ["2 plus 13 is 15.\n\n", "Then 3.14 ok. Fine!"]),
    ("sentence", ["2 plus 13 is 15.\n\n", "Then 3.14 ok.", " Fine!"]),
])
def test_boundaries_of_byte_level_tokens(unit, want):
    """Hand-derived units of a byte-level-BPE-like token sequence (leading spaces inside tokens): digits of one number
    are one word, a decimal point does not end a sentence, newlines end their line."""
    got = ["".join(BPE[a:b]) for a, b in spans_of(span_starts(BPE, unit))]
    assert got == want


@pytest.mark.parametrize("unit, want", [
    ("word", ["2 ", "plus ", "13 ", "is ", "15", ".\n", "Then ", "7", "-", "4 ", "= ", "3", "! ", "ok"]),
    ("line", ["2 plus 13 is 15.\n", "Then 7-4 = 3! ok"]),
    ("sentence", ["2 plus 13 is 15.\n", "Then 7-4 = 3! ", "ok"]),
])
def test_boundaries_of_character_tokens(unit, want):
    """Whitespace-only tokens never begin a unit: they stay with the unit before them."""
    toks = list("2 plus 13 is 15.\nThen 7-4 = 3! ok")
    assert ["".join(toks[a:b]) for a, b in spans_of(span_starts(toks, unit))] == want


def test_spans_cut_at_tokens_that_are_not_eligible():
    starts = [True, False, False, True, False, False]
    assert spans_of(starts) == [(0, 3), (3, 6)]
    assert spans_of(starts, eligible=[0, 2, 3, 4, 5]) == [(0, 1), (2, 3), (3, 6)]
    assert spans_of(starts, eligible=[]) == []
    assert spans_of([], None) == []


def test_token_texts_decode_each_id_alone(tiny):  # noqa: F811
    _, tok = tiny
    ids = tok.encode("ab 12\ncd", add_special_tokens=False)
    assert token_texts(tok, torch.tensor(ids)) == [tok.decode([i]) for i in ids]
    assert "".join(token_texts(tok, ids)) == "ab 12\ncd"


def test_span_sums():
    s = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert span_sums(s, [(0, 2), (3, 5)]).tolist() == [3.0, 3.0, 3.0, 9.0, 9.0]
    assert s.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]  # a new tensor


@pytest.mark.parametrize("spans, match", [
    ({0: [(0, 2), (1, 3)]}, r"spans\[0\] must be sorted, disjoint, non-empty ranges within \[0, 5\), got \(1, 3\) "
                            r"at index 1 after one ending at 2"),
    ({0: [(2, 2)]}, r"got \(2, 2\) at index 0"),
    ({0: [(3, 6)]}, r"within \[0, 5\), got \(3, 6\)"),
    ({0: [(0, 1, 2)]}, r"spans\[0\]\[0\] must be a \(j0, j1\) pair, got \(0, 1, 2\)"),
    ({0: [(0.5, 2)]}, r"spans\[0\]\[0\]\[0\]"),
    ({4: [(0, 1)]}, r"spans has row 4, which is not among the rows scored"),
    ({0: "ab"}, r"spans\[0\] must be a sequence of \(j0, j1\) pairs, got str"),
    ([(0, 1)], r"spans must be a mapping"),
])
def test_check_spans_names_the_bad_range(spans, match):
    with pytest.raises(ValueError, match=match):
        check_spans(spans, {0: 5, 1: 3})


def test_unknown_unit():
    with pytest.raises(ValueError, match=r"unit must be one of \('token', 'word', 'line', 'sentence'\), got 'step'"):
        span_starts(["a"], "step")
    with pytest.raises(ValueError, match=r'oar.mask_unit must be "token", "word", "line" or "sentence", got "step"'):
        oar.OARConfig(mask_unit="step")


# ---- the engines -----------------------------------------------------------------------------------------------


def _setup(tiny, unit="word"):  # noqa: F811
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    spans = {}
    for r in range(batch.batch_size):
        L = int(batch.reasoning_len[r])
        s = int(batch.reasoning_start[r])
        spans[r] = spans_of(span_starts(token_texts(tok, batch.input_ids[r, s:s + L]), unit))
    return HFProbeModel(model), batch, spans


_REF = {}


def _span_exact(tiny, unit, window=None):  # noqa: F811
    """Float64 span OAR-P (or windowed span OAR-P) of the tiny rollouts with float32 error bounds, cached."""
    key = (unit, window)
    if key not in _REF:
        model, _ = tiny
        _, batch, spans = _setup(tiny, unit)
        _REF[key] = (oar_p_error_bound(model, batch, "answer_mean", spans=spans) if window is None
                     else oar_p_window_error_bound(model, batch, window, "answer_mean", spans=spans))
    return _REF[key]


@pytest.mark.parametrize("engine, budget_mb", [("prefix", 1024), ("prefix", 1), ("batched", 1024), ("batched", 1)])
@pytest.mark.parametrize("unit", ["word", "line"])
def test_span_oar_p_equals_the_float64_reference(tiny, engine, budget_mb, unit):  # noqa: F811
    """Each span replaced by PAD whole, in one variant: the engines (prefix with shared-prefix attention, batched;
    many chunks at 1 MiB) against one-context-at-a-time float64 masking (rule 1); every token of a span carries the
    span's score; far fewer variants than tokens."""
    pm, batch, spans = _setup(tiny, unit)
    res = oar_p_scores(pm, batch, spans=spans, engine=engine, memory_budget_mb=budget_mb)
    n_spans = sum(len(v) for v in spans.values())
    assert res.stats["variants"] == n_spans < int(batch.reasoning_len.sum())
    exact = _span_exact(tiny, unit)
    assert float(exact.value.max()) > 1e-3, "test model too flat: the comparison would be vacuous"
    W = exact.value.shape[1]
    assert_within_error_model(res.scores[:, :W], exact, what=f"{unit} spans, {engine}")
    for r, units in spans.items():
        for j0, j1 in units:
            assert bool((res.scores[r, j0:j1] == res.scores[r, j0]).all())


def test_single_token_spans_are_token_oar_p(tiny):  # noqa: F811
    """Spans of one token each give exactly the token engine's scores (same variants, same chunks)."""
    pm, batch, _ = _setup(tiny)
    for engine in ("prefix", "batched"):
        tok = oar_p_scores(pm, batch, engine=engine)
        ones = {r: [(j, j + 1) for j in range(int(batch.reasoning_len[r]))] for r in range(batch.batch_size)}
        assert torch.equal(oar_p_scores(pm, batch, engine=engine, spans=ones).scores, tok.scores)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("window", [0, 3])
def test_windowed_span_oar_p_equals_the_stepwise_reference(tiny, window, shared):  # noqa: F811
    """Windowed OAR-P over word spans (the span and the ``window`` tokens after it re-run on the clean cache, in
    place or copied under a 4-D mask) against the float64 cache-and-2-D-mask reference (rule 1)."""
    pm, batch, spans = _setup(tiny, "word")
    pm.shared_prefix_attention = shared
    res = oar_p_window_scores(pm, batch, window=window, spans=spans, memory_budget_mb=1)
    want = _span_exact(tiny, "word", window)
    assert float(want.value.max()) > 1e-3
    assert_within_error_model(res.scores, want, what=f"window {window} over words")


def test_window_covering_the_rest_is_exact_span_oar_p(tiny):  # noqa: F811
    pm, batch, spans = _setup(tiny, "line")
    res = oar_p_window_scores(pm, batch, window=int(batch.reasoning_len.max()), spans=spans)
    exact = _span_exact(tiny, "line")
    assert_within_error_model(res.scores[:, :exact.value.shape[1]], exact, what="window = L over lines")


def test_screened_over_spans(tiny):  # noqa: F811
    """Screened OAR-P over spans: fraction 1 is exact span OAR-P; with a partial fraction, every span that was not
    masked (``stats["masked_units"]``) carries exactly a x the mean of its screen scores on each of its tokens (the
    same float64 expression, rounded once), and the masked ones the exact span score (against the float64
    reference, rule 1; it used to be told apart by closeness to another float32 run, whose rounding differs between
    CPUs: it failed on an Intel AMX machine)."""
    pm, batch, spans = _setup(tiny, "word")
    want = _span_exact(tiny, "word")
    W = want.value.shape[1]
    screen = oar_p_window_scores(pm, batch, window=1, spans=spans, keep_clean_pass=True)
    full = oar_p_screened_scores(pm, batch, screen, fraction=1.0, sample_fraction=0.0, spans=spans)
    assert_within_error_model(full.scores[:, :W], want, what="screened spans, fraction 1")
    assert full.stats["masked"] == sum(len(v) for v in spans.values())
    part = oar_p_screened_scores(pm, batch, screen, fraction=0.3, sample_fraction=0.2, spans=spans,
                                 generator=torch.Generator().manual_seed(0))
    chosen = part.stats["masked_units"]
    n_masked = part.stats["masked"]
    assert sum(len(v) for v in chosen.values()) == n_masked and 0 < n_masked < full.stats["masked"]
    masked = torch.zeros_like(part.scores, dtype=torch.bool)
    for r, units in spans.items():
        a = part.stats["calibration"][r]
        for j0, j1 in units:
            got = part.scores[r, j0:j1]
            assert bool((got == got[0]).all())
            if (j0, j1) in chosen.get(r, []):
                masked[r, j0:j1] = True
            else:
                estimate = torch.tensor(float(a * screen.scores[r, j0:j1].double().mean()), dtype=got.dtype)
                assert bool(got[0] == estimate), (r, j0, j1)
    m = masked[:, :W]
    assert_within_error_model(part.scores[:, :W][m], type(want)(want.value[m], want.bound[m], want.bound_ref[m]),
                              what="screened spans, the masked ones")
    with pytest.raises(ValueError, match="pass positions .* or spans .*, not both"):
        oar_p_screened_scores(pm, batch, screen, fraction=1.0, sample_fraction=0.0, spans=spans, positions={0: [0]})


def test_spans_and_positions_are_exclusive(tiny):  # noqa: F811
    pm, batch, spans = _setup(tiny)
    with pytest.raises(ValueError, match=r"pass positions \(single tokens\) or spans \(token ranges\), not both"):
        oar_p_scores(pm, batch, spans=spans, positions={0: [0]})
    with pytest.raises(ValueError, match=r"spans\[1\] must be sorted"):
        oar_p_window_scores(pm, batch, window=2, spans={1: [(1, 3), (0, 1)]})


# ---- the pipeline ----------------------------------------------------------------------------------------------


def _rollout_batch(tok, **kw):
    pids, rids, answers = probe_rollouts(tok)
    C = max(len(r) for r in rids)
    cids = torch.zeros((len(rids), C), dtype=torch.long)
    cmask = torch.zeros((len(rids), C), dtype=torch.bool)
    for i, r in enumerate(rids):
        cids[i, :len(r)] = torch.tensor(r)
        cmask[i, :len(r)] = True
    return RolloutBatch(cids, cmask, prompt_ids=pids, rewards=torch.tensor([1.0, 0.0, 0.0]),
                        group_ids=[0, 1, 0], answers=answers, **kw), cids, cmask


@pytest.mark.parametrize("method", ["oar_p", "oar_g"])
def test_pipeline_mask_unit(tiny, method):  # noqa: F811
    """``mask_unit: line``: OAR-P masks each line whole (the engine's span scores), OAR-G sums its token scores per
    line; each token of a line carries the line's score, the reshaping keeps each row's advantage mass."""
    model, tok = tiny
    rb, cids, cmask = _rollout_batch(tok)
    cfg = oar.OARConfig(method=method, mask_unit="line", sigma=1e-2)
    out = Pipeline(cfg, tok).compute(rb, model)
    tok_cfg = oar.OARConfig(method=method, sigma=1e-2)
    ref = Pipeline(tok_cfg, tok).scores(rb, model)
    for i in range(3):
        on = out.reasoning_mask[i]
        if not bool(on.any()):
            continue
        cols = torch.nonzero(on).flatten()
        texts = token_texts(tok, cids[i, cols])
        units = spans_of(span_starts(texts, "line"))
        assert len(units) < len(cols)
        for j0, j1 in units:
            s = out.scores[i, cols[j0:j1]]
            assert bool((s == s[0]).all())
            if method == "oar_g":  # the unit rule on the token scores of the same noise draw
                want = ref.scores[i, cols[j0:j1]].double().sum()
                assert float(s[0]) == pytest.approx(float(want), rel=1e-5, abs=1e-9)
        A = float(out.sequence_advantages[i])
        assert float(out.advantages[i][cmask[i]].double().sum()) == pytest.approx(A * int(cmask[i].sum()), rel=1e-5)


def test_pipeline_span_starts_override_the_unit(tiny):  # noqa: F811
    """The caller's ``span_starts`` (here: one span per 4 completion tokens) decide the units, whatever the config's
    unit; the exact engine's scores of those spans come back on each of their tokens."""
    model, tok = tiny
    rb, cids, cmask = _rollout_batch(tok)
    starts = torch.zeros_like(cmask)
    starts[:, ::4] = True
    rb.span_starts = starts
    pipe = Pipeline(oar.OARConfig(method="oar_p", mask_unit="word"), tok)
    sc = pipe.scores(rb, model)
    pids, rids, answers = probe_rollouts(tok)
    lens = pipe.reasoning_lengths(cids, cmask, [0, 1, 2])
    active = [i for i in range(3) if bool(sc.reasoning_mask[i].any())]
    assert len(active) >= 2
    on = lambda i, x, stub: x if i in active else stub  # noqa: E731 - the pipeline's stubs for rows not scored
    pb = pipe.builder.build([on(i, pids[i], []) for i in range(3)], [on(i, torch.tensor(rids[i]), []) for i in range(3)],
                            [on(i, answers[i], "0") for i in range(3)], [on(i, lens[i], 0) for i in range(3)])
    units = {i: spans_of(starts[i, :lens[i]]) for i in active}
    att = oar_p_scores(HFProbeModel(model), pb, rows=active, spans=units)  # the same call the pipeline makes
    for i in active:
        L = lens[i]
        assert int(sc.reasoning_mask[i].sum()) == L
        assert torch.equal(sc.scores[i, :L], att.scores[i, :L])
        assert float(att.scores[i, :L].max()) > 1e-3
        assert all(bool((att.scores[i, a:b] == att.scores[i, a]).all()) for a, b in units[i])
    with pytest.raises(ValueError, match=r"span_starts must be a \(B, C\) = \(3, 32\) tensor, got \(3, 2\)"):
        rb.span_starts = starts[:, :2]
        Pipeline(oar.OARConfig(method="oar_p"), tok).scores(rb, model)


def _windowed_span_pipeline(tiny, **cfg_kw):  # noqa: F811
    """The pipeline's windowed word-span scores (``screen_fraction = screen_sample = 0``, ``screen_window`` 2, plus
    ``cfg_kw``) and what an engine needs to recompute them: (scores, probe batch, active rows, units, lengths, model)."""
    model, tok = tiny
    rb, cids, cmask = _rollout_batch(tok)
    cfg = oar.OARConfig(method="oar_p", mask_unit="word", screen_fraction=0.0, screen_sample=0.0, screen_window=2,
                        **cfg_kw)
    pipe = Pipeline(cfg, tok)
    sc = pipe.scores(rb, model)
    pids, rids, answers = probe_rollouts(tok)
    lens = pipe.reasoning_lengths(cids, cmask, [0, 1, 2])
    active = [i for i in range(3) if bool(sc.reasoning_mask[i].any())]
    on = lambda i, x, stub: x if i in active else stub  # noqa: E731 - the pipeline's stubs for rows not scored
    pb = pipe.builder.build([on(i, pids[i], []) for i in range(3)], [on(i, torch.tensor(rids[i]), []) for i in range(3)],
                            [on(i, answers[i], "0") for i in range(3)], [on(i, lens[i], 0) for i in range(3)])
    units = {i: spans_of(span_starts(token_texts(tok, cids[i, :lens[i]]), "word")) for i in active}
    return sc, pb, active, units, lens, model


def test_pipeline_windowed_span_oar_p_is_the_window_engine(tiny):  # noqa: F811
    """``screen_fraction = screen_sample = 0`` with the window screen: windowed OAR-P alone (nothing masked exactly),
    here over words: the pipeline's scores are the window engine's on the same probe contexts and spans."""
    sc, pb, active, units, lens, model = _windowed_span_pipeline(tiny)
    want = oar_p_window_scores(HFProbeModel(model), pb, window=2, rows=active, spans=units)
    for i in active:
        assert torch.equal(sc.scores[i, :lens[i]], want.scores[i, :lens[i]])
        assert float(want.scores[i, :lens[i]].max()) > 1e-3


def test_pipeline_linear_tail_is_the_linear_tail_engine(tiny):  # noqa: F811
    """``screen_tail: linear`` with ``screen_fraction = screen_sample = 0``: the pipeline's scores are
    :func:`oar_p_linear_tail_scores`'s on the same probe contexts and word spans (the engine the config names)."""
    from oar.attribution import oar_p_linear_tail_scores

    sc, pb, active, units, lens, model = _windowed_span_pipeline(tiny, screen_tail="linear")
    want = oar_p_linear_tail_scores(HFProbeModel(model), pb, window=2, rows=active, spans=units)
    assert want.stats["linearized"] > 0
    for i in active:
        assert torch.equal(sc.scores[i, :lens[i]], want.scores[i, :lens[i]])
        assert float(want.scores[i, :lens[i]].max()) > 1e-3
