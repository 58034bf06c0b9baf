"""Multi-turn sessions (docs/method.md section 13): turns from the eligible mask, each turn scored as its own probe
row, the session's advantage split between turns with its mass and sign kept, and a session of one turn scored
exactly as without turns.

A session here is one row: the model's turns (eligible) with tool results between them (not eligible), as the
trainer adapters pass TRL's ``tool_mask``, verl's ``response_mask`` and OpenRLHF's ``action_mask``.
"""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings

import oar
from oar.attribution import ProbeContextBuilder
from oar.attribution.turns import turn_runs, turn_segments, turn_weights
from oar.batch import RolloutBatch
from oar.pipeline import Pipeline
from oar.testing import tiny_random_llama

from _error_model import oar_p_error_bound
from _sessions import THREE_TURNS, session_tokens
from _tolerance import assert_within_error_model

CONCLUDE = "\nTherefore, the final answer is \\boxed{"


@pytest.fixture(scope="module")
def tiny():
    # initializer_range 0.12: divergences ~1e-2, far above float32 rounding (rule 1 of _tolerance.py is not vacuous)
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, tokenizer="minimal", seed=1,
                                   initializer_range=0.12)
    return model.eval(), tok


def _enc(tok, s):
    return tok(s, add_special_tokens=False)["input_ids"]


def _session(tok, turns, observations, prompt="Q: 12*3+5?\n"):
    """(prompt ids, completion ids, eligible (n,) bool, [(start, end) of each turn's tokens]) of one session."""
    ids, mask, spans = session_tokens(tok, turns, observations)
    return _enc(tok, prompt), ids, torch.tensor(mask, dtype=torch.bool), spans


def _batch(rows, advantages, answers):
    """A right-padded RolloutBatch of sessions ``rows`` = [(prompt, completion, eligible), ...]."""
    C = max(len(c) for _, c, _ in rows)
    cids = torch.zeros((len(rows), C), dtype=torch.long)
    cmask = torch.zeros((len(rows), C), dtype=torch.bool)
    elig = torch.zeros((len(rows), C), dtype=torch.bool)
    for i, (_, c, e) in enumerate(rows):
        cids[i, :len(c)] = torch.tensor(c)
        cmask[i, :len(c)] = True
        elig[i, :len(c)] = e
    return RolloutBatch(cids, cmask, prompt_ids=[p for p, _, _ in rows], eligible_mask=elig,
                        sequence_advantages=torch.tensor(advantages, dtype=torch.float32), answers=list(answers))


# ---- turns from the mask ----------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=0, max_size=40))
def test_segments_cut_at_observations_and_cover_each_turn(mask):
    e = torch.tensor(mask, dtype=torch.bool)
    n = len(mask)
    runs, segs = turn_runs(e), turn_segments(e)
    # runs: maximal, in order, exactly the True tokens
    assert sum(b - a for a, b in runs) == sum(mask)
    for a, b in runs:
        assert all(mask[a:b]) and (a == 0 or not mask[a - 1]) and (b == n or not mask[b])
    if len(runs) <= 1:
        assert segs == [(0, n)]
        return
    assert len(segs) == len(runs) and segs[0][0] == 0 and segs[-1][1] == n
    for k, ((s, t), (a, b)) in enumerate(zip(segs, runs)):
        assert s <= a < b <= t  # the turn's own tokens
        assert not any(mask[s:a]) and not any(mask[b:t])  # nothing else eligible in its segment
        if k + 1 < len(segs):
            assert t == b and segs[k + 1][0] == runs[k + 1][0]  # the observation after it is in no segment


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.integers(0, 50)), min_size=1, max_size=6),
       st.sampled_from([0.0, 0.1, 0.5]))
@example([(5e-324, 1)], 0.1)  # a denormal gain: once weights 0.1 (mass 0.1 of 1) where denormals flush to zero
def test_turn_weights_keep_the_session_mass(turns, floor):
    g = torch.tensor([x for x, _ in turns], dtype=torch.float64)
    c = torch.tensor([n for _, n in turns], dtype=torch.float64)
    w = turn_weights(g, c, floor)
    assert float((c * w).sum()) == pytest.approx(float(c.sum()), rel=1e-12, abs=1e-12)
    if float((c * g.abs()).sum()) <= 1e-12 * max(float(c.sum()), 1.0):  # nothing moved beyond rounding
        assert torch.equal(w, torch.ones_like(w))
    else:
        assert bool((w >= floor - 1e-15).all())
        order = torch.argsort(g.abs())
        assert bool((w[order].diff() >= -1e-12).all())  # monotone in |gain|


# ---- one turn is today's OAR ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["oar_p", "oar_g", "random"])
def test_sessions_of_one_turn_are_scored_as_without_turns_bit_for_bit(tiny, method):
    model, tok = tiny
    rows = []
    for text, tail in (("I add 12 and 30. \\boxed{42}", 0), ("so 7*6 is 42 \\boxed{42}", 3), ("it is 42", 0)):
        p, c, e, _ = _session(tok, [text], [])
        e = e.clone()
        if tail:
            e[-tail:] = False  # trailing tokens out of the loss: still one turn
        rows.append((p, c, e))
    batch = _batch(rows, [1.0, -0.5, 0.25], ["42"] * 3)
    outs = {}
    for probe in ("answer", "session"):
        for credit in ("uniform", "probe"):
            cfg = oar.OARConfig(method=method, conclude=CONCLUDE, turn_probe=probe, turn_credit=credit)
            outs[probe, credit] = Pipeline(cfg, tok).compute(batch, model)
    ref = outs["session", "uniform"]
    for key, out in outs.items():
        for name in ("advantages", "weights", "scores", "reasoning_mask"):
            assert torch.equal(getattr(out, name), getattr(ref, name)), (key, name)


# ---- within a turn ----------------------------------------------------------------------------------------------


def test_each_turn_is_exact_oar_p_of_its_own_probe_row(tiny):
    """The pipeline's scores on a three-turn session against exact OAR-P (float64, one context per variant) of three
    probe rows built here from the definition: prompt + everything before the turn, the turn, the answer probe."""
    model, tok = tiny
    p, c, e, spans = _session(tok, *THREE_TURNS)
    batch = _batch([(p, c, e)], [1.0], ["41"])
    cfg = oar.OARConfig(method="oar_p", conclude=CONCLUDE)
    res = Pipeline(cfg, tok).scores(batch, model)
    builder = ProbeContextBuilder(tok, CONCLUDE)
    starts = [0] + [a for a, _ in spans[1:]]
    ends = [b for _, b in spans[:-1]] + [len(c)]
    pids = [p + c[:s] for s in starts]
    rids = [c[s:t] for s, t in zip(starts, ends)]
    ref_batch = builder.build(pids, rids, ["41"] * 3)
    exact = oar_p_error_bound(model, ref_batch, "answer_mean")
    got = torch.zeros_like(exact.value, dtype=torch.float32)
    for k, s in enumerate(starts):
        L = int(ref_batch.reasoning_len[k])
        got[k, :L] = res.scores[0, s:s + L]
    assert_within_error_model(got, exact, what="per-turn OAR-P")
    # observations: never scored, never masked (one variant per eligible reasoning token of the turns)
    obs = ~e
    assert not bool(res.reasoning_mask[0, :len(c)][obs].any()) and float(res.scores[0, :len(c)][obs].abs().sum()) == 0
    assert res.stats["variants"] == int(ref_batch.reasoning_len.sum())
    assert int(ref_batch.reasoning_len[-1]) < ends[-1] - starts[-1]  # the last turn's marker cut its reasoning


def test_editing_an_observation_changes_only_the_turns_after_it(tiny):
    model, tok = tiny
    turns, obs = THREE_TURNS
    p, c, e, spans = _session(tok, turns, obs)
    p2, c2, e2, _ = _session(tok, turns, [obs[0], "<result>63</result>"])  # same length, other digits
    assert len(c2) == len(c) and c2 != c
    cfg = oar.OARConfig(method="oar_p", conclude=CONCLUDE)
    a = Pipeline(cfg, tok).scores(_batch([(p, c, e)], [1.0], ["41"]), model).scores[0]
    b = Pipeline(cfg, tok).scores(_batch([(p2, c2, e2)], [1.0], ["41"]), model).scores[0]
    before, after = slice(0, spans[1][1]), slice(spans[2][0], len(c))
    assert torch.allclose(a[before], b[before], rtol=1e-5, atol=1e-7)  # turns 1-2 never see the edited result
    assert float((a[after] - b[after]).abs().max()) > 1e-3 * float(a[after].abs().max())


# ---- between turns ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_turns", [1, 2, 3, 4])
@pytest.mark.parametrize("method,credit,extra", [
    ("random", "uniform", {}), ("oar_g", "uniform", {}), ("oar_g", "probe", {}), ("oar_p", "probe", {}),
    ("oar_p", "uniform", dict(screen_fraction=0.0, screen_sample=0.0, screen_window=4)),  # windowed OAR-P
    ("oar_p", "probe", dict(screen_fraction=0.3, screen_sample=0.1, screen_window=2, mask_unit="word")),  # screened
])
def test_mass_and_sign_are_kept_for_one_to_four_turns(tiny, n_turns, method, credit, extra):
    model, tok = tiny
    texts = ["Let me <calc>3*4</calc>", "ok <calc>12+1</calc>", "and <calc>13-2</calc>", "so \\boxed{11}"]
    turns = texts[:n_turns - 1] + [texts[-1]]
    observations = ["<result>12</result>", "<result>13</result>", "<result>11</result>"][:n_turns - 1]
    rows = [_session(tok, turns, observations)[:3], _session(tok, turns[::-1], observations)[:3]]
    batch = _batch(rows, [1.3, -0.7], ["11", "11"])
    cfg = oar.OARConfig(method=method, conclude=CONCLUDE, turn_credit=credit, seed=3, **extra)
    out = Pipeline(cfg, tok).compute(batch, model)
    assert bool(out.reasoning_mask.any())
    elig = batch.eligible_mask
    for i, A in enumerate([1.3, -0.7]):
        adv = out.advantages[i]
        assert float(adv.double().sum()) == pytest.approx(A * int(elig[i].sum()), rel=2e-5)
        assert bool((torch.sign(adv[elig[i]]) == (1 if A > 0 else -1)).all())
        assert float(adv[~elig[i]].abs().sum()) == 0


def test_probe_credit_goes_to_the_turn_whose_result_reveals_the_answer(tiny, monkeypatch):
    """turn_credit 'probe' with the answer probe replaced by a stand-in whose log-likelihood is 2 once the answer
    appears in the context and 0 before: the failed call (turn 1) and the final turn move nothing, the call whose
    result holds the answer (turn 2) gets the weight; the probes sit before turn 1, after each observation and at
    the end of the last turn's reasoning."""
    import oar.pipeline as pipeline_mod

    model, tok = tiny
    turns = ["I try <calc>12/0</calc>", "Then <calc>12*3+5</calc>", "so it is \\boxed{41}"]
    p, c, e, spans = _session(tok, turns, ["<result>error</result>", "<result>41</result>"])
    seen = []

    def fake(pm, builder, prompts, prefixes, answers, budget):
        seen.extend(len(x) for x in prefixes)
        return torch.tensor([2.0 if "41" in tok.decode(list(x)) else 0.0 for x in prefixes], dtype=torch.float64), 1

    monkeypatch.setattr(pipeline_mod, "answer_log_likelihoods", fake)
    cfg = oar.OARConfig(method="random", conclude=CONCLUDE, turn_credit="probe")
    res = Pipeline(cfg, tok).scores(_batch([(p, c, e)], [1.0], ["41"]), model)
    L_last = len(_enc(tok, "so it is "))
    assert seen == [0, spans[1][0], spans[2][0], spans[2][0] + L_last]
    w = [float(res.turn_weights[0, a]) for a, _ in spans]
    n = [b - a for a, b in spans]
    floor = cfg.reshape.floor
    assert w[0] == pytest.approx(floor) and w[2] == pytest.approx(floor)
    assert w[1] == pytest.approx(floor + (1 - floor) * sum(n) / n[1])  # all |gain| mass on turn 2
    assert sum(wk * nk for wk, nk in zip(w, n)) == pytest.approx(sum(n))


def test_probe_credit_with_scores_from_elsewhere_needs_turn_weights(tiny):
    model, tok = tiny
    p, c, e, _ = _session(tok, *THREE_TURNS)
    batch = _batch([(p, c, e)], [1.0], ["41"])
    cfg = oar.OARConfig(method="oar_g", conclude=CONCLUDE, turn_credit="probe")
    res = Pipeline(cfg, tok).scores(batch, model)
    batch.scores, batch.reasoning_mask = res.scores, res.reasoning_mask
    with pytest.raises(ValueError, match="turn_weights"):
        Pipeline(cfg, tok).compute(batch)
    batch.turn_weights = res.turn_weights  # what the workers send back with the scores
    given = Pipeline(cfg, tok).compute(batch)
    batch.scores = batch.reasoning_mask = batch.turn_weights = None
    direct = Pipeline(cfg, tok).compute(batch, model)
    assert torch.allclose(given.advantages, direct.advantages, rtol=1e-6, atol=1e-7)
    bad = res.turn_weights.clone()
    bad[0, 0] = -1.0
    batch.scores, batch.reasoning_mask, batch.turn_weights = res.scores, res.reasoning_mask, bad
    with pytest.raises(ValueError, match=r"turn_weights must be finite and >= 0 on eligible_mask, got "
                                         r"turn_weights\[0, 0\] = -1.0"):
        Pipeline(cfg, tok).compute(batch)


def test_probe_credit_without_answers_is_refused(tiny):
    model, tok = tiny
    p, c, e, _ = _session(tok, *THREE_TURNS)
    batch = _batch([(p, c, e)], [1.0], ["41"])
    batch.answers = None
    with pytest.raises(ValueError, match="turn_credit 'probe' probes the reference answer across each turn, but the "
                                         "batch has no answers \\(method 'random'\\)"):
        Pipeline(oar.OARConfig(method="random", conclude=CONCLUDE, turn_credit="probe"), tok).compute(batch, model)
    # uniform turn credit needs no answer for a method that reads none
    out = Pipeline(oar.OARConfig(method="random", conclude=CONCLUDE), tok).compute(batch, model)
    assert float(out.advantages.double().sum()) == pytest.approx(float(e.sum()), rel=1e-5)
