"""Screened OAR-P (oar.attribution.screened, issue 13): selection, calibration and the exactness of the masked
tokens, and the windowed OAR-P screen, on the sharpened tiny model of test_attribution.py."""

import logging
import math

import pytest
import torch

import oar
from oar import ops
from oar.attribution import (HFProbeModel, ProbeContextBuilder, oar_g_scores, oar_p_scores, oar_p_window_scores,
                            screened)
from oar.attribution.screened import budget_fraction, calibrate, oar_p_screened_scores, screen_selection
from oar.batch import RolloutBatch
from oar.pipeline import Pipeline
from oar.methods import oar_p as oar_p_method

from _completions import CONCLUDE, probe_rollouts
from _error_model import oar_p_window_error_bound
from _tolerance import assert_within_error_model
from test_attribution import _exact, tiny  # noqa: F401 - the module fixture


def _setup(tiny):  # noqa: F811
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    pm = HFProbeModel(model)
    screen = oar_g_scores(pm, batch, generator=torch.Generator().manual_seed(0))
    return pm, batch, screen


def test_screen_off_equals_exact_oar_p(tiny):  # noqa: F811
    """fraction = 1 masks every token: the scores are exact OAR-P's (same engine; rule 1 against float64)."""
    pm, batch, screen = _setup(tiny)
    full = oar_p_scores(pm, batch)
    res = oar_p_screened_scores(pm, batch, screen, fraction=1.0, sample_fraction=0.0)
    assert res.stats["masked"] == res.stats["scored_tokens"] == int(batch.reasoning_len.sum())
    assert torch.equal(res.mask, full.mask)
    exact = _exact(tiny, "answer_mean")
    W = exact.value.shape[1]
    assert_within_error_model(res.scores[:, :W], exact, what="screen off")


@pytest.mark.parametrize("fraction, sample", [(0.2, 0.1), (0.5, 0.0), (0.0, 0.3), (0.3, 0.3)])
def test_masked_tokens_are_exact_and_the_rest_calibrated(tiny, fraction, sample):  # noqa: F811
    """The masked tokens' scores are exact OAR-P scores (rule 1 against float64, as the full run's); the others are
    a_i x screen with a_i the least-squares scale on the row's random sample (else its masked tokens); every score
    is finite and >= 0; the counts are ceil(fraction L) + ceil(sample L)."""
    pm, batch, screen = _setup(tiny)
    exact = _exact(tiny, "answer_mean")
    res = oar_p_screened_scores(pm, batch, screen, fraction=fraction, sample_fraction=sample,
                                generator=torch.Generator().manual_seed(1))
    assert bool(torch.isfinite(res.scores).all()) and bool((res.scores >= 0).all())
    gen = torch.Generator().manual_seed(1)
    masked_total = 0
    for r in range(batch.input_ids.shape[0]):
        L = int(batch.reasoning_len[r])
        top, samp = screen_selection(screen.scores[r, :L], fraction, sample, gen)  # the same draws, in row order
        assert len(top) == min(L, math.ceil(fraction * L)) and not set(top) & set(samp)
        assert len(samp) == min(L - len(top), math.ceil(sample * L))
        chosen = sorted(set(top) | set(samp))
        masked_total += len(chosen)
        assert_within_error_model(res.scores[r, chosen], exact[r, chosen], what=f"row {r}")
        a = res.stats["calibration"][r]
        assert a == pytest.approx(calibrate(screen.scores[r, :L], res.scores[r, :L], samp, chosen), rel=1e-12)
        rest = [j for j in range(L) if j not in chosen]
        if rest:
            torch.testing.assert_close(res.scores[r, rest], (a * screen.scores[r, rest].double()).float(),
                                       rtol=0, atol=0)
        assert (res.scores[r, L:] == 0).all()
    assert res.stats["masked"] == masked_total


def test_top_fraction_follows_the_screen():
    s = torch.tensor([0.1, 0.9, 0.5, 0.9, 0.0, 0.3])
    top, samp = screen_selection(s, 0.5, 0.0)
    assert top == [1, 2, 3] and samp == []  # ties: earlier first (1 before 3)
    top, samp = screen_selection(s, 0.3, 1.0, torch.Generator().manual_seed(0))  # ceil(1.8) = 2
    assert top == [1, 3] and samp == [0, 2, 4, 5]  # the sample takes at most all of the rest
    with pytest.raises(ValueError, match="fraction must be a real number in \\[0, 1\\], got 1.5"):
        screen_selection(s, 1.5, 0.0)
    with pytest.raises(ValueError, match="screen must be finite"):
        screen_selection(torch.tensor([1.0, float("nan")]), 0.5, 0.0)


def test_calibration_hand_values():
    s = torch.tensor([1.0, 2.0, 0.0, 4.0])
    e = torch.tensor([2.0, 4.0, 7.0, 8.0])
    assert calibrate(s, e, [0, 1], [0, 1, 2]) == pytest.approx(2.0)  # exact proportionality on the sample
    assert calibrate(s, e, [2], [0, 3]) == pytest.approx((2 + 32) / 17)  # zero screen on the sample: all selected
    assert calibrate(torch.zeros(4), e, [0], [1]) == 0.0


def test_reshaping_invariants_hold_on_screened_scores(tiny):  # noqa: F811
    """Screened scores go through the same reshaping: every row keeps its mass, every token keeps its row's sign."""
    pm, batch, screen = _setup(tiny)
    res = oar_p_screened_scores(pm, batch, screen, fraction=0.25, sample_fraction=0.1,
                                generator=torch.Generator().manual_seed(2))
    B, Lm = res.scores.shape
    adv = torch.tensor([1.0, -0.5, 2.0])
    eligible = res.mask.clone()
    tok, weights = ops.reshape_advantages(adv, res.scores, res.mask, eligible, q=0.25, beta=1.0, floor=0.1,
                                          tiers="both")
    torch.testing.assert_close(tok.double().sum(1), adv.double() * eligible.sum(1).double(), rtol=1e-5, atol=1e-5)
    assert bool((weights[eligible] > 0).all())
    assert bool((torch.sign(tok[eligible]) == torch.sign(adv[:, None].expand_as(tok)[eligible])).all())


def test_bad_input(tiny):  # noqa: F811
    pm, batch, screen = _setup(tiny)
    with pytest.raises(ValueError, match="fraction \\+ sample_fraction must be > 0"):
        oar_p_screened_scores(pm, batch, screen, fraction=0.0, sample_fraction=0.0)
    bad = type(screen)(screen.scores[:, :-1], screen.mask[:, :-1], {})
    with pytest.raises(ValueError, match="screen.scores must be \\(B, L_max\\)"):
        oar_p_screened_scores(pm, batch, bad, fraction=0.5, sample_fraction=0.0)


def test_budget_fraction_hand_values():
    """Two rows of suffix costs; the cost of f is each row's ceil(f n) most expensive candidates + the sample's
    expected share of the total."""
    costs = [[10, 9, 8, 7], [5, 4]]  # total 43
    assert budget_fraction(costs, 0.5, 0.0, 1e9) == 0.5  # the cap fits
    # f = 0.5: rows take 10 + 9 and 5 -> 24; f = 0.25: 10 and 5 -> 15 (ceil(0.5) = 1 in row 2)
    f = budget_fraction(costs, 1.0, 0.0, 24.0)
    assert 0.5 <= f < 0.5 + 2 ** -19  # the largest f whose top sets cost <= 24 is exactly 0.5
    f = budget_fraction(costs, 1.0, 0.1, 24.0 + 4.3)  # the sample's 4.3 on top
    assert 0.5 <= f < 0.5 + 2 ** -19
    assert budget_fraction(costs, 1.0, 0.1, 4.0) == 0.0  # nothing fits beyond the sample: the sample alone
    with pytest.raises(ValueError, match="max_fraction must be a real number in \\[0, 1\\]"):
        budget_fraction(costs, 2.0, 0.0, 1.0)


def _pipeline_batch(tok):
    from _completions import tool_batch

    prompts, ids, mask, eligible = tool_batch(tok)
    adv = torch.tensor([1.0, -0.5, 0.7, 0.0])
    return RolloutBatch(ids, mask, prompt_ids=prompts, eligible_mask=eligible, answers=["5"] * 4,
                        sequence_advantages=adv), eligible


def test_pipeline_screened_oar_p_is_the_screen_then_the_screened_pass(tiny, monkeypatch):  # noqa: F811
    """Config ``screen_fraction`` < 1 with ``screen="oar_g"`` runs OAR-G (the config's sigma, the pipeline's generator) on the eligible
    reasoning tokens, then :func:`oar_p_screened_scores` on them; recomputed here from the same probe batch with a
    generator seeded like the pipeline's, the screen and the scores are the same numbers, and the token advantages
    are the reshaping of those scores (mass kept per row, tool outputs at 0)."""
    model, tok = tiny
    batch, eligible = _pipeline_batch(tok)
    cfg = oar.OARConfig(method="oar_p", screen="oar_g", screen_fraction=0.3, screen_sample=0.1, sigma=0.05, seed=5,
                        turn_probe="session")  # engine row r = caller row r (turn by turn: test_turns.py)
    calls = []
    real = screened.oar_p_screened_scores

    def spy(model_, pbatch, screen, **kw):
        out = real(model_, pbatch, screen, **kw)
        calls.append((pbatch, screen, dict(kw), out))
        return out

    monkeypatch.setattr(oar_p_method, "oar_p_screened_scores", spy)  # where the OAR-P method calls it
    pipe = Pipeline(cfg, tok)
    res = pipe.compute(batch, model)
    (pbatch, screen, kw, out), = calls
    assert kw["fraction"] == 0.3 and kw["sample_fraction"] == 0.1 and kw["rows"] == [0, 1, 2]  # row 3: A = 0
    gen = torch.Generator().manual_seed(5)
    pm = HFProbeModel(model)
    want_screen = oar_g_scores(pm, pbatch, rows=[0, 1, 2], sigma=0.05, generator=gen, positions=kw["positions"])
    assert torch.equal(screen.scores, want_screen.scores)
    want = real(pm, pbatch, want_screen, fraction=0.3, sample_fraction=0.1, rows=[0, 1, 2], generator=gen,
                positions=kw["positions"], memory_budget_mb=kw["memory_budget_mb"])
    assert torch.equal(out.scores, want.scores)
    # tool outputs are never candidates: masked + calibrated tokens are exactly the eligible reasoning tokens
    for r, js in kw["positions"].items():
        others = [j for j in range(int(pbatch.reasoning_len[r])) if j not in set(js)]
        assert (out.scores[r, others] == 0).all()
    assert out.stats["scored_tokens"] == sum(len(js) for js in kw["positions"].values())
    tok_adv, _ = ops.reshape_advantages(batch.sequence_advantages, res.scores, res.reasoning_mask, eligible)
    torch.testing.assert_close(res.advantages, tok_adv, rtol=0, atol=0)
    assert (res.advantages[~eligible] == 0).all()
    torch.testing.assert_close(res.advantages.double().sum(1),
                               batch.sequence_advantages.double() * eligible.sum(1).double(), rtol=1e-5, atol=1e-5)
    assert res.metrics["oar/screen_fraction"] == 0.3
    assert res.metrics["oar/masked_frac"] == out.stats["masked"] / out.stats["scored_tokens"]


def test_pipeline_time_budget_cuts_the_fraction(tiny):  # noqa: F811
    """``screen_budget``: the first call has no measurement and takes ``screen_fraction``; once the GRPO step and
    the exact pass's rate are known, a budget that leaves nothing for the exact pass masks the random sample alone,
    and a generous one keeps ``screen_fraction``."""
    model, tok = tiny
    batch, _ = _pipeline_batch(tok)
    pipe = Pipeline(oar.OARConfig(method="oar_p", screen_fraction=0.5, screen_sample=0.1, screen_budget=1.5), tok)
    first = pipe.compute(batch, model)
    assert first.metrics["oar/screen_fraction"] == 0.5
    assert pipe.scorer.exact_s_per_token is not None and pipe.scorer.exact_s_per_token > 0
    pipe._last_end = None  # the next call's GRPO step: set by hand instead of measured
    pipe.outside_seconds = 0.0
    starved = pipe.compute(batch, model)
    assert starved.metrics["oar/screen_fraction"] == 0.0
    pipe._last_end, pipe.outside_seconds, pipe.scorer.exact_s_per_token = None, 1e9, 1e-9
    assert pipe.compute(batch, model).metrics["oar/screen_fraction"] == 0.5


_WINDOW = {}


def _window_exact(tiny, window, probe):  # noqa: F811
    """Windowed OAR-P by the step-by-step reference (oar.reference.oar_p_window_naive's steps) on the float64 model,
    with the float32 error bounds (``_error_model.Bounded``, (B, L_max)), cached."""
    if (window, probe) not in _WINDOW:
        model, tok = tiny
        pids, rids, answers = probe_rollouts(tok)
        batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
        _WINDOW[window, probe] = oar_p_window_error_bound(model, batch, window, probe)
    return _WINDOW[window, probe]


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("probe", ["answer_mean", "answer_joint"])
@pytest.mark.parametrize("window, budget_mb", [(0, 1024), (3, 1), (5, 1024)])
def test_window_scores_equal_the_stepwise_reference(tiny, window, probe, budget_mb, shared):  # noqa: F811
    """The windowed engine (each row's clean cache read in place by the shared-prefix attention with per-query
    masks, or copied per variant under one 4-D mask; left-padded rows; chunks of few variants at budget 1 MiB)
    against the reference that crops a cache and re-runs the window and the tail with 2-D masks, one token at a
    time (rule 1 against float64). The window is an approximation: at window 0 it differs from exact OAR-P by far
    more than rounding (so the comparison is not exact OAR-P's)."""
    pm, batch, _ = _setup(tiny)
    pm.shared_prefix_attention = shared
    assert oar.attribution.probe_capabilities(pm).shared_prefix == shared
    res = oar_p_window_scores(pm, batch, window=window, probe=probe, memory_budget_mb=budget_mb)
    assert res.stats["engine"] == "window" and res.stats["variants"] == int(batch.reasoning_len.sum())
    want = _window_exact(tiny, window, probe)
    assert float(want.value.max()) > 1e-3, "test model too flat: the comparison would be vacuous"
    assert_within_error_model(res.scores, want, what=f"window {window}")
    assert bool((res.scores >= 0).all())
    if window == 0:  # the window's approximation error is outside exact OAR-P's rounding budget
        exact = _exact(tiny, probe)
        with pytest.raises(AssertionError, match="outside the budget"):
            assert_within_error_model(res.scores[:, : exact.value.shape[1]], exact, what="window 0 vs exact")


@pytest.mark.parametrize("shared", [True, False])
def test_window_probe_tail_equals_the_stepwise_reference(tiny, shared):  # noqa: F811
    """``rerun_tail="probe"``: each variant re-runs its window and the probe window only (the conclude tokens keep
    their clean keys/values), against the step-by-step reference with that tail (rule 1 against float64); fewer
    tokens run than with the conclude tail, and the scores differ from it by more than rounding."""
    pm, batch, _ = _setup(tiny)
    pm.shared_prefix_attention = shared
    res = oar_p_window_scores(pm, batch, window=2, rerun_tail="probe")
    model, _ = tiny
    want = oar_p_window_error_bound(model, batch, 2, "answer_mean", rerun_tail="probe")
    assert_within_error_model(res.scores, want, what="window 2, probe tail")
    full = oar_p_window_scores(pm, batch, window=2)
    T, keep = batch.input_ids.shape[1], int(batch.keep)
    # variant of column t re-runs [t, t + 3) and its tail, [T - keep, T) or [min(end of reasoning, T - keep), T)
    # (a window reaching the tail runs those columns once); both runs share the same clean pass
    def reruns(tail_of):
        return sum(len(set(range(t, min(t + 3, T))) | set(range(tail_of(e), T))) for e, s in (
            (int(batch.reasoning_start[r] + batch.reasoning_len[r]), int(batch.reasoning_start[r]))
            for r in range(batch.batch_size)) for t in range(s, e))
    saved = reruns(lambda e: min(e, T - keep)) - reruns(lambda e: T - keep)
    assert saved > 0 and full.stats["tokens"] - res.stats["tokens"] == saved
    with pytest.raises(AssertionError, match="outside the budget"):
        assert_within_error_model(full.scores, want, what="conclude tail vs probe tail")
    with pytest.raises(ValueError, match=r"rerun_tail must be one of \('conclude', 'probe'\), got 'all'"):
        oar_p_window_scores(pm, batch, window=2, rerun_tail="all")
    assert oar.schema.SCREEN_TAILS == oar.attribution.window.RERUN_TAILS + ("linear",)


def test_window_covering_the_rest_is_exact_oar_p(tiny):  # noqa: F811
    """A window as long as the longest reasoning re-runs every later token: exact OAR-P (rule 1 against float64,
    the exact engine's float32 scores as rounding reference); with positions, only those tokens are scored."""
    pm, batch, _ = _setup(tiny)
    full = oar_p_scores(pm, batch)
    exact = _exact(tiny, "answer_mean")
    W = exact.value.shape[1]
    res = oar_p_window_scores(pm, batch, window=int(batch.reasoning_len.max()))
    assert torch.equal(res.mask, full.mask)
    assert_within_error_model(res.scores[:, :W], exact, what="window = L")
    some = {0: [0, 3, 5], 2: [1]}
    part = oar_p_window_scores(pm, batch, window=100, rows=[0, 2], positions=some)
    for r, js in some.items():
        assert_within_error_model(part.scores[r, js], exact[r, js], what=f"row {r}")
        others = [j for j in range(int(batch.reasoning_len[r])) if j not in js]
        assert (part.scores[r, others] == 0).all()
    assert not part.mask[1].any() and part.stats["variants"] == 4


def test_window_bad_input(tiny):  # noqa: F811
    pm, batch, _ = _setup(tiny)
    with pytest.raises(ValueError, match="window must be an int >= 0, got -1"):
        oar_p_window_scores(pm, batch, window=-1)
    with pytest.raises(ValueError, match="window must be an int, got float 1.5"):
        oar_p_window_scores(pm, batch, window=1.5)

    class NoCache(HFProbeModel):
        @property
        def supports_prefix_cache(self):
            return False

    with pytest.raises(ValueError, match="needs a ProbeModel with the prefix-cache capability.*NoCache"):
        oar_p_window_scores(NoCache(pm.model), batch, window=2)
    ids = torch.zeros((2, 3), dtype=torch.long)
    with pytest.raises(ValueError, match="prefix_bias must have shape \\(2, 3, 5\\), got \\(2, 3, 4\\)"):
        pm.tail_logits_shared_prefix(None, [(0, 0, 2, 0)], 5, input_ids=ids, position_ids=ids, keep=1,
                                     prefix_bias=torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="self_bias must have shape \\(2, 1, 3, 3\\)"):
        pm.tail_logits_shared_prefix(None, [(0, 0, 2, 0)], 5, input_ids=ids, position_ids=ids, keep=1,
                                     self_bias=torch.zeros(2, 3, 3))
    from oar.attribution import WindowMasks

    z = torch.zeros(2, dtype=torch.long)
    wm = WindowMasks(torch.zeros((2, 4), dtype=torch.long).add_(torch.arange(4)), z, z, z, z)
    with pytest.raises(ValueError, match="window.cols must have shape \\(2, 3\\), got \\(2, 4\\)"):
        pm.tail_logits_shared_prefix(None, [(0, 0, 2, 0)], 5, input_ids=ids, position_ids=ids, keep=1, window=wm)
    with pytest.raises(ValueError, match="pass window or the biases, not both"):
        pm.tail_logits_shared_prefix(None, [(0, 0, 2, 0)], 5, input_ids=ids, position_ids=ids, keep=1, window=wm,
                                     self_bias=torch.zeros(2, 1, 3, 3))


def test_pipeline_window_screen(tiny, monkeypatch, caplog):  # noqa: F811
    """The default screen is windowed OAR-P with the config's ``screen_window`` on the eligible reasoning tokens of
    the active rows; its scores are what the screened pass selects and calibrates from. A model without the
    prefix-cache capability is screened by OAR-G instead (a warning)."""
    model, tok = tiny
    batch, _ = _pipeline_batch(tok)
    cfg = oar.OARConfig(method="oar_p", screen_fraction=0.3, screen_sample=0.1, screen_window=2, seed=5,
                        turn_probe="session")  # engine row r = caller row r (turn by turn: test_turns.py)
    assert cfg.screen == "window"
    calls = []
    real = screened.oar_p_screened_scores

    def spy(model_, pbatch, screen, **kw):
        calls.append((pbatch, screen, dict(kw)))
        return real(model_, pbatch, screen, **kw)

    monkeypatch.setattr(oar_p_method, "oar_p_screened_scores", spy)  # where the OAR-P method calls it
    Pipeline(cfg, tok).compute(batch, model)
    (pbatch, screen, kw), = calls
    want = oar_p_window_scores(HFProbeModel(model), pbatch, window=2, rows=[0, 1, 2], positions=kw["positions"])
    assert screen.stats["engine"] == "window"
    torch.testing.assert_close(screen.scores, want.scores, rtol=0, atol=0)

    class NoCache(HFProbeModel):
        @property
        def supports_prefix_cache(self):
            return False

    calls.clear()
    with caplog.at_level(logging.WARNING, logger="oar"):
        Pipeline(cfg, tok).compute(batch, NoCache(model))
    assert "screening with OAR-G" in caplog.text
    (pbatch, screen, kw), = calls
    want = oar_g_scores(NoCache(model), pbatch, rows=[0, 1, 2], sigma=cfg.sigma,
                        generator=torch.Generator().manual_seed(5), positions=kw["positions"])
    assert torch.equal(screen.scores, want.scores)


def test_pipeline_linear_tail_screen(tiny, monkeypatch):  # noqa: F811
    """``screen_tail: linear``: the screen is :func:`oar_p_linear_tail_scores` with ``screen_window`` on the eligible
    tokens of the active rows (no clean pass handed over: the exact pass runs its own); a model it cannot run
    (here ZeRO-3-partitioned parameters) is refused with the reason and the settings that work, not screened
    otherwise."""
    import copy

    from oar.attribution import oar_p_linear_tail_scores

    model, tok = tiny
    batch, _ = _pipeline_batch(tok)
    cfg = oar.OARConfig(method="oar_p", screen_fraction=0.3, screen_sample=0.1, screen_window=2, screen_tail="linear",
                        turn_probe="session",
                        seed=5)
    calls = []
    real = screened.oar_p_screened_scores
    monkeypatch.setattr(oar_p_method, "oar_p_screened_scores",
                        lambda m, pb, screen, **kw: calls.append((pb, screen, kw)) or real(m, pb, screen, **kw))
    res = Pipeline(cfg, tok).compute(batch, model)
    (pbatch, screen, kw), = calls
    assert screen.stats["engine"] == "linear_tail" and screen.clean_pass is None
    want = oar_p_linear_tail_scores(HFProbeModel(model), pbatch, window=2, rows=[0, 1, 2], positions=kw["positions"])
    assert torch.equal(screen.scores, want.scores)
    assert res.metrics["oar/screen_fraction"] == 0.3
    zero3 = copy.deepcopy(model)
    next(zero3.parameters()).ds_id = 0
    with pytest.raises(ValueError, match=r"oar.screen_tail 'linear' cannot run on this model: .*sharded by "
                                         r"DeepSpeed ZeRO-3; set oar.screen_tail to 'probe' or 'conclude'"):
        Pipeline(cfg, tok).compute(batch, zero3)


def test_window_screen_hands_its_clean_pass_to_the_exact_pass(tiny):  # noqa: F811
    """With the window screen's clean pass (``keep_clean_pass``), the exact pass runs no clean forward of its own and
    its scores are the same exact OAR-P numbers (rule 1: the float32 error model of the float64 scores); a
    clean pass that misses a scored row is refused."""
    pm, batch, _ = _setup(tiny)
    pm.prompt_once_clean_pass = False  # every clean row runs its whole context: one chunk of 3 T tokens
    screen = oar_p_window_scores(pm, batch, window=2, keep_clean_pass=True)
    assert screen.clean_pass is not None and screen.clean_pass.rows == (0, 1, 2)
    plain = oar_p_window_scores(pm, batch, window=2)
    assert plain.clean_pass is None
    gen = lambda: torch.Generator().manual_seed(4)  # noqa: E731
    shared = oar_p_screened_scores(pm, batch, screen, fraction=0.3, sample_fraction=0.1, generator=gen())
    own = oar_p_screened_scores(pm, batch, plain, fraction=0.3, sample_fraction=0.1, generator=gen())
    assert shared.stats["masked"] == own.stats["masked"]
    assert shared.stats["forward_passes"] == own.stats["forward_passes"] - 1  # one clean chunk fewer
    assert shared.stats["tokens"] == own.stats["tokens"] - 3 * batch.probe_view().input_ids.shape[1]  # engines' width
    exact = _exact(tiny, "answer_mean")
    g = gen()
    for r in range(3):  # the same draws, in row order
        L = int(batch.reasoning_len[r])
        top, samp = screen_selection(screen.scores[r, :L], 0.3, 0.1, g)
        chosen = sorted(set(top) | set(samp))
        assert_within_error_model(shared.scores[r, chosen], exact[r, chosen], what=f"row {r}")
    with pytest.raises(ValueError, match="clean_pass covers rows \\[0\\], not every row scored \\(\\[0, 1\\]\\)"):
        oar_p_scores(pm, batch, rows=[0, 1], clean_pass=oar_p_window_scores(pm, batch, window=0, rows=[0],
                                                                              keep_clean_pass=True).clean_pass)


def test_pipeline_window_screen_under_flash_attention_falls_back_to_oar_g(tiny, monkeypatch, caplog):  # noqa: F811
    """A model whose attention is flash-attention (no 4-D masks) and without shared-prefix attention cannot run the
    window screen: the pipeline screens with OAR-G (warned, naming the implementation) instead of failing. The model
    is never run with flash attention here: the implementation is only declared (flash-attn is not installed)."""
    model, tok = tiny
    batch, _ = _pipeline_batch(tok)
    cfg = oar.OARConfig(method="oar_p", screen_fraction=0.3, screen_sample=0.1, screen_window=2, seed=5,
                        turn_probe="session")  # engine row r = caller row r (turn by turn: test_turns.py)

    class Flash(HFProbeModel):
        shared_prefix_attention = False

        @property
        def attn_implementation(self):
            return "flash_attention_2"

        @property
        def supports_dense_mask(self):
            return False

    calls = []
    real = screened.oar_p_screened_scores
    monkeypatch.setattr(oar_p_method, "oar_p_screened_scores",
                        lambda m, pb, screen, **kw: calls.append((pb, screen, kw)) or real(m, pb, screen, **kw))
    with caplog.at_level(logging.WARNING, logger="oar"):
        Pipeline(cfg, tok).compute(batch, Flash(model))
    assert "runs attention 'flash_attention_2': screening with OAR-G" in caplog.text
    (pbatch, screen, kw), = calls
    assert "engine" not in screen.stats or screen.stats["engine"] != "window"
    want = oar_g_scores(Flash(model), pbatch, rows=[0, 1, 2], sigma=cfg.sigma,
                        generator=torch.Generator().manual_seed(5), positions=kw["positions"])
    assert torch.equal(screen.scores, want.scores)


def test_forward_gate_passes_the_attention_implementation_on(tiny):  # noqa: F811
    """Under a ForwardGate (ZeRO-3 / FSDP ranks kept in step) the engines still see the model's attention
    implementation: the windowed engine's 4-D-mask refusal fires before any model call, so no collective runs."""
    from oar.distributed import ForwardGate

    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    pbatch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    pm = HFProbeModel(model)
    pm.shared_prefix_attention = False
    old = model.config._attn_implementation
    model.config._attn_implementation = "flash_attention_2"
    try:
        gate = ForwardGate(pm)
        caps = oar.attribution.probe_capabilities(gate)
        assert caps.attn_implementation == "flash_attention_2" and not caps.dense_mask
        with pytest.raises(ValueError, match="attention implementation 'flash_attention_2' cannot take"):
            oar_p_window_scores(gate, pbatch, window=2)
        assert gate.real_calls == {1: 0, 2: 0} and gate.dummy_calls == {1: 0, 2: 0}
    finally:
        model.config._attn_implementation = old
