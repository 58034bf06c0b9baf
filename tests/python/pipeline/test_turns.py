"""Multi-turn sessions (docs/method.md section 13): turns from the eligible mask, each turn scored as its own probe
row, the session's advantage split between turns with its mass and sign kept, and a session of one turn scored
exactly as without turns.

A session here is one row: the model's turns (eligible) with tool results between them (not eligible), as the
trainer adapters pass TRL's ``tool_mask``, verl's ``response_mask`` and OpenRLHF's ``action_mask``.
"""

import dataclasses

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings

import oar
from oar.attribution import ProbeContextBuilder
from oar.attribution.turns import reward_turn_weights, turn_runs, turn_segments, turn_weights
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


# ---- turn credit from per-turn rewards (verl's tool_rewards) ----------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-3, 3), st.integers(0, 40)), min_size=1, max_size=6), st.booleans(),
       st.sampled_from([1.0, -1.0]), st.sampled_from([0.0, 0.1, 0.5]))
def test_reward_turn_weights_keep_the_mass_and_follow_the_outcome_sign(turns, last_neutral, sign, floor):
    r = [x for x, _ in turns]
    c = torch.tensor([n for _, n in turns], dtype=torch.float64)
    given_r = r[:-1] if last_neutral else r
    w = reward_turn_weights(given_r, c, sign, floor)
    assert float((c * w).sum()) == pytest.approx(float(c.sum()), rel=1e-12, abs=1e-12)
    full = torch.tensor(given_r + [0.0] * (len(r) - len(given_r)), dtype=torch.float64)  # the neutral last turn
    if not given_r or float(full.abs().max()) <= 1e-12 or float(c.sum()) == 0:
        assert torch.equal(w, torch.ones_like(w))
        return
    assert bool((w >= floor - 1e-12).all())
    # a better reward never gets less of a positive session's mass, nor more of a negative one's
    order = torch.argsort(full * sign)
    assert bool((w[order].diff() >= -1e-12).all()) or torch.equal(w, torch.ones_like(w))


def test_reward_turn_weights_refuse_a_reward_count_of_no_turn_layout():
    with pytest.raises(ValueError, match=r"one value per turn \(K = 3\) or per turn before an observation "
                                         r"\(K - 1 = 2\), got 1"):
        reward_turn_weights([1.0], torch.tensor([3, 4, 5]), 1.0, 0.1)
    with pytest.raises(ValueError, match="rewards must be finite"):
        reward_turn_weights([1.0, float("nan")], torch.tensor([3, 4, 5]), 1.0, 0.1)


@pytest.mark.parametrize("A", [1.0, -1.0])
def test_reward_credit_moves_the_session_mass_toward_the_turn_its_reward_agrees_with(tiny, A):
    """Three turns, verl's layout of tool rewards (one per call: the failed call -0.05, the call whose result holds
    the answer 1.0; the answering turn neutral, 0): each turn's share of the mass, from the formula written out
    here."""
    model, tok = tiny
    p, c, e, spans = _session(tok, *THREE_TURNS)
    batch = _batch([(p, c, e)], [A], ["41"])
    batch.turn_rewards = [[-0.05, 1.0]]
    cfg = oar.OARConfig(method="random", conclude=CONCLUDE, turn_credit="rewards", seed=2)
    out = Pipeline(cfg, tok).compute(batch, model)
    n = [b - a for a, b in spans]
    u = [0.95, 2.0, 1.0] if A > 0 else [1.05, 0.0, 1.0]  # 1 + sign(A) r_k / max |r|, r = (-0.05, 1, 0)
    u_bar = sum(x * k for x, k in zip(u, n)) / sum(n)
    floor = cfg.reshape.floor
    for (a, b), uk, nk in zip(spans, u, n):
        wk = floor + (1 - floor) * uk / u_bar
        assert float(out.advantages[0, a:b].double().sum()) == pytest.approx(A * wk * nk, rel=2e-5)  # turn mass
    assert float(out.advantages.double().sum()) == pytest.approx(A * sum(n), rel=2e-5)
    # scores computed elsewhere (a trainer's workers, which never see the rewards) give the same advantages
    res = Pipeline(cfg, tok).scores(dataclasses.replace(batch, turn_rewards=None), model)
    assert torch.equal(res.turn_weights, torch.ones_like(res.turn_weights))
    given = dataclasses.replace(batch, scores=res.scores, reasoning_mask=res.reasoning_mask)
    assert torch.allclose(Pipeline(cfg, tok).compute(given).advantages, out.advantages, rtol=1e-6, atol=1e-7)


def test_reward_credit_without_or_with_misfit_rewards_is_refused(tiny):
    model, tok = tiny
    p, c, e, _ = _session(tok, *THREE_TURNS)
    batch = _batch([(p, c, e)], [1.0], ["41"])
    cfg = oar.OARConfig(method="random", conclude=CONCLUDE, turn_credit="rewards")
    with pytest.raises(ValueError, match=r"turn_credit 'rewards' needs the batch's per-turn rewards "
                                         r"\(RolloutBatch.turn_rewards; verl: non_tensor_batch\['tool_rewards'\]; "
                                         r"TRL: a rollout_func field 'turn_rewards'\)"):
        Pipeline(cfg, tok).compute(batch, model)
    batch.turn_rewards = [[0.0, 1.0, 0.5, 2.0]]
    with pytest.raises(ValueError, match=r"turn_rewards\[0\]: rewards must hold one value per turn \(K = 3\).*got 4 "
                                         r"\(row 0 has 3 turns"):
        Pipeline(cfg, tok).compute(batch, model)
    for bad, msg in (([[1.0], [2.0]], r"turn_rewards must have B = 1 entries .*got 2"),
                     ([[1.0, float("inf")]], r"turn_rewards\[0\]\[1\] must be finite, got inf"),
                     ([["x"]], r"turn_rewards\[0\]\[0\] must be a real number, got 'x'"),
                     ([3.0], r"turn_rewards\[0\] must be a sequence of per-turn rewards, got float")):
        batch.turn_rewards = bad
        with pytest.raises(ValueError, match=msg):
            Pipeline(cfg, tok).compute(batch, model)
    batch.turn_rewards = [None]  # a session whose tools returned no reward: every turn keeps its mass
    out = Pipeline(cfg, tok).compute(batch, model)
    assert float(out.advantages.double().sum()) == pytest.approx(float(e.sum()), rel=1e-5)


# ---- turn_probe 'action': each turn probed on its own action ----------------------------------------------------


def test_action_probe_rows_hold_the_turns_own_tokens(tiny):
    _, tok = tiny
    builder = ProbeContextBuilder(tok, CONCLUDE)
    p, r = _enc(tok, "Q: 2+3?\n"), _enc(tok, "add them <calc>2+3</calc>")
    L = len(_enc(tok, "add them"))
    pb = builder.build_actions([p, p], [r, r[:L]], [L, L])
    row = p + r
    assert pb.input_ids[0, -len(row):].tolist() == row and int(pb.context_len[0]) == len(row)
    assert pb.answer_ids[0, :int(pb.answer_len[0])].tolist() == r[L:]  # the stored action tokens, not re-encoded
    assert int(pb.reasoning_len[0]) == L and int(pb.reasoning_start[0]) == pb.input_ids.shape[1] - len(row) + len(p)
    assert int(pb.reasoning_len[1]) == 0  # no action (a turn cut before its call): nothing scored
    with pytest.raises(ValueError, match=r"reasoning_lens\[1\] must be in \[0, 2\], got 5"):
        builder.build_actions([p, p], [r, r[:2]], [L, 5])


def test_action_probe_scores_each_turn_against_its_own_action_without_answers(tiny):
    """turn_probe 'action' with no reference answer: each turn's scores are exact OAR-P of a probe row built here
    from the definition (prompt + everything before the turn + its reasoning, then the turn's own action tokens:
    the call, or the last turn's own answer), within the error model."""
    model, tok = tiny
    p, c, e, spans = _session(tok, *THREE_TURNS)
    one = _session(tok, ["it is 12*3+5 so \\boxed{41}"], [])
    batch = _batch([(p, c, e), one[:3]], [1.0, -1.0], ["41", "41"])
    batch.answers = None
    cfg = oar.OARConfig(method="oar_p", conclude=CONCLUDE, turn_probe="action")
    res = Pipeline(cfg, tok).scores(batch, model)
    cut = [len(_enc(tok, "I try ")), len(_enc(tok, "Then ")), len(_enc(tok, "so "))]
    starts = [0] + [a for a, _ in spans[1:]]
    ends = [b for _, b in spans[:-1]] + [len(c)]
    pids = [p + c[:s] for s in starts] + [one[0]]
    rids = [c[s:t] for s, t in zip(starts, ends)] + [one[1]]
    lens = cut + [len(_enc(tok, "it is 12*3+5 so "))]
    assert [tok.decode(r[:L]).strip() for r, L in zip(rids, lens)] == ["I try", "Then", "so", "it is 12*3+5 so"]
    ref = ProbeContextBuilder(tok, CONCLUDE).build_actions(pids, rids, lens)
    assert [tok.decode(ref.answer_ids[k, :int(ref.answer_len[k])].tolist()).strip() for k in range(4)] == [
        "<calc>12/0</calc>", "<calc>12*3+5</calc>", "\\boxed{41}", "\\boxed{41}"]
    exact = oar_p_error_bound(model, ref, "answer_mean")
    got = torch.zeros_like(exact.value, dtype=torch.float32)
    for k, s in enumerate(starts):
        got[k, :lens[k]] = res.scores[0, s:s + lens[k]]
    got[3, :lens[3]] = res.scores[1, :lens[3]]
    assert_within_error_model(got, exact, what="action-probed OAR-P")
    assert res.stats["variants"] == sum(lens)
    assert not bool(res.reasoning_mask[0, :len(c)][~e].any())  # observations unscored
    with pytest.raises(ValueError, match="action_markers must be non-empty strings"):
        Pipeline(cfg, tok, action_markers=["<calc>", ""])


def test_token_advantages_passes_turn_rewards_on(tiny):
    model, tok = tiny
    p, c, e, spans = _session(tok, *THREE_TURNS)
    rows = [(p, c, e), _session(tok, ["so \\boxed{40}"], [])[:3]]
    batch = _batch(rows, [0.0, 0.0], ["41", "41"])
    cfg = oar.OARConfig(method="random", conclude=CONCLUDE, turn_credit="rewards")
    out = oar.token_advantages(torch.tensor([1.0, 0.0]), group_size=2, completion_ids=batch.completion_ids,
                               completion_mask=batch.completion_mask, eligible_mask=batch.eligible_mask,
                               model=model, tokenizer=tok, prompt_ids=batch.prompt_ids, answers=batch.answers,
                               config=cfg, turn_rewards=[[-0.05, 1.0], None])
    A = float(out.sequence_advantages[0])
    ref = Pipeline(cfg, tok).compute(dataclasses.replace(batch, sequence_advantages=out.sequence_advantages,
                                                         turn_rewards=[[-0.05, 1.0], None]), model)
    assert A > 0 and torch.equal(out.advantages, ref.advantages)
    a, b = spans[1]
    assert float(out.advantages[0, a:b].sum()) > A * (b - a)  # the rewarded call got more than its uniform mass
