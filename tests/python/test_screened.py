"""Screened OAR-P (oar.attribution.screened, issue 13): selection, calibration and the exactness of the masked
tokens, on the sharpened tiny model of test_attribution.py."""

import math

import pytest
import torch

from oar import ops
from oar.attribution import HFProbeModel, ProbeContextBuilder, oar_g_scores, oar_p_scores
from oar.attribution.screened import calibrate, oar_p_screened_scores, screen_selection

from _tolerance import assert_close_to_reference
from test_attribution import CONCLUDE, _rollouts, _truth, tiny  # noqa: F401 - the module fixture


def _setup(tiny):  # noqa: F811
    model, tok = tiny
    pids, rids, answers = _rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    pm = HFProbeModel(model)
    screen = oar_g_scores(pm, batch, generator=torch.Generator().manual_seed(0))
    return pm, batch, screen


def test_screen_off_equals_exact_oar_p(tiny):  # noqa: F811
    """fraction = 1 masks every token: the scores are exact OAR-P's (same engine; rule 1 against float64)."""
    pm, batch, screen = _setup(tiny)
    full = oar_p_scores(pm, batch)
    res = oar_p_screened_scores(pm, batch, screen, fraction=1.0, sample_fraction=0.0)
    assert res.stats["masked"] == res.stats["tokens"] == int(batch.reasoning_len.sum())
    assert torch.equal(res.mask, full.mask)
    truth = _truth(tiny, "answer_mean")
    W = truth.shape[1]
    assert_close_to_reference(res.scores[:, :W], truth, full.scores[:, :W], what="screen off")


@pytest.mark.parametrize("fraction, sample", [(0.2, 0.1), (0.5, 0.0), (0.0, 0.3), (0.3, 0.3)])
def test_masked_tokens_are_exact_and_the_rest_calibrated(tiny, fraction, sample):  # noqa: F811
    """The masked tokens' scores are exact OAR-P scores (rule 1 against float64, as the full run's); the others are
    a_i x screen with a_i the least-squares scale on the row's random sample (else its masked tokens); every score
    is finite and >= 0; the counts are ceil(fraction L) + ceil(sample L)."""
    pm, batch, screen = _setup(tiny)
    full = oar_p_scores(pm, batch)
    truth = _truth(tiny, "answer_mean")
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
        assert_close_to_reference(res.scores[r, chosen], truth[r, chosen], full.scores[r, chosen], what=f"row {r}")
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
