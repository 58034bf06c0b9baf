"""oar eval-attribution: recall metric, bootstrap, oracle and the whole command on a tiny model."""

import math
import json
import re
import types

import numpy as np
import pytest
import torch

from oar.app.eval_attribution import (Trace, bootstrap_ci, expected_random_recall, oracle_causal, recall_at,
                                  reshaped_weights_l1, summarize, summarize_fidelity, top_overlap,
                                  trace_seed, write_outputs)
from oar.app.stats import average_ranks, spearman, spearman_rows


def test_recall_at_hand_values():
    scores = [0.9, 0.1, 0.8, 0.2, 0.7, 0.0, 0.3, 0.6, 0.5, 0.4]
    causal = [True, False, False, False, True, False, False, False, False, True]
    # top 10% = 1 token (index 0, causal) -> 1 of 3 causal
    assert recall_at(scores, causal, 10) == pytest.approx(1 / 3)
    # top 30% = 3 tokens (0, 2, 4) -> 2 of 3
    assert recall_at(scores, causal, 30) == pytest.approx(2 / 3)
    assert recall_at(scores, [False] * 10, 30) is None
    # ties broken by position: all-equal scores pick the first tokens
    assert recall_at([1.0] * 4, [False, False, False, True], 25) == 0.0
    with pytest.raises(ValueError, match="one entry per token"):
        recall_at([1.0], [True, False], 10)
    with pytest.raises(ValueError, match="percent must be in"):
        recall_at([1.0], [True], 0)


@pytest.mark.parametrize("causal", [[True, False, False, True, False], [False, True, False, False, False, False, True],
                                    [True] * 3])
@pytest.mark.parametrize("percent", [10, 20, 30, 50, 100])
def test_expected_random_recall_is_the_mean_over_every_ranking(causal, percent):
    """The exact expectation against an independent reference: recall_at averaged over every permutation of the
    trace's tokens (all rankings equally likely under random scores)."""
    import itertools
    from fractions import Fraction

    L = len(causal)
    total, n = Fraction(0), 0
    for perm in itertools.permutations(range(L)):
        scores = [float(L - perm.index(i)) for i in range(L)]  # token perm[0] ranks first
        total += Fraction(recall_at(scores, causal, percent)).limit_denominator(10**6)
        n += 1
    assert expected_random_recall(L, causal, percent) == pytest.approx(float(total / n), abs=1e-12)
    assert expected_random_recall(L, [False] * L, percent) is None


def test_summarize_reports_random_by_its_expectation():
    """One draw per trace is gone from the table: random's recall is the mean of ceil(K% L) / L over traces, whatever
    the stored random scores (here: scores that would rank every causal token first)."""
    traces = [Trace(task="t", problem_id=str(i), prompt_ids=[], response_ids=[], answer="", text="", reasoning_len=L,
                    causal=[j == 0 for j in range(L)], scores={"random": [float(-j) for j in range(L)]})
              for i, L in enumerate((7, 12, 30))]
    rows = {(r["method"], r["top_percent"]): r for r in summarize(traces)}
    for K in (10, 20, 30):
        want = sum(max(1, -(-K * L // 100)) / L for L in (7, 12, 30)) / 3
        assert rows[("random", K)]["recall"] == pytest.approx(want, abs=1e-12)


def test_trace_seeds_differ_between_traces():
    """Every trace draws its own noise / random scores: the seeds of a run's traces are distinct, a pure function
    of (seed, task, problem, index)."""
    seeds = {trace_seed(7, task, str(p), k) for task in ("arithmetic", "gsm8k") for p in range(50) for k in range(3)}
    assert len(seeds) == 2 * 50 * 3
    assert trace_seed(7, "gsm8k", "3", 1) == trace_seed(7, "gsm8k", "3", 1) != trace_seed(8, "gsm8k", "3", 1)


def test_bootstrap_ci_brackets_mean():
    vals = [0.1, 0.5, 0.3, 0.9, 0.4, 0.6]
    lo, hi = bootstrap_ci(vals)
    assert lo <= sum(vals) / len(vals) <= hi
    assert bootstrap_ci([0.5] * 5) == (0.5, 0.5)
    assert all(math.isnan(x) for x in bootstrap_ci([]))


class _Task:
    """Answer is correct when it equals '7'."""

    def reward(self, text, problem):
        return 1.0 if text.strip() == "\\boxed{7}" else 0.0


def test_oracle_marks_tokens_whose_masking_flips_the_answer(monkeypatch):
    import oar.app.eval_attribution as ev

    # Fake greedy decoder: the answer is 7 unless token id 99 (the "pivotal" token) was replaced by PAD (0).
    def fake_answers(model, tok, contexts, max_new):
        return ["7" if bool((c == 99).any()) else "8" for c in contexts]

    monkeypatch.setattr(ev, "_greedy_answers", fake_answers)
    ok, causal = oracle_causal(None, None, _Task(), None, [5, 6], [11, 99, 12, 99], [3], pad_id=0)
    assert ok and causal == [False, False, False, False]  # two 99s: masking one keeps the other
    ok, causal = oracle_causal(None, None, _Task(), None, [5, 6], [11, 99, 12], [3], pad_id=0)
    assert ok and causal == [False, True, False]
    ok, causal = oracle_causal(None, None, _Task(), None, [5], [11, 12], [3], pad_id=0)
    assert not ok and causal == []  # the clean trace itself does not decode to the right answer


# ---- bad input -----------------------------------------------------------------------------------------------------
def test_spearman_against_the_definition():
    """Without ties Spearman is 1 - 6 sum d^2 / (n (n^2 - 1)) (d = rank differences); with ties, average ranks."""
    import itertools

    a = [0.3, 0.1, 0.9, 0.5, 0.7]
    for perm in itertools.permutations(range(5)):
        b = [float(p) for p in perm]
        ra = sorted(range(5), key=lambda i: a[i])
        rank_a = [ra.index(i) for i in range(5)]
        d2 = sum((rank_a[i] - perm[i]) ** 2 for i in range(5))
        assert spearman(a, b) == pytest.approx(1 - 6 * d2 / (5 * 24), abs=1e-12)
    # ties: ranks of [1, 1, 2] are [0.5, 0.5, 2]; of [1, 2, 3]: [0, 1, 2]; Pearson of the two = sqrt(3)/2
    assert spearman([1.0, 1.0, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(3 ** 0.5 / 2, abs=1e-12)
    assert spearman([1.0, 1.0], [1.0, 2.0]) is None  # a constant list has no ranking
    with pytest.raises(ValueError, match="one entry per token"):
        spearman([1.0], [1.0, 2.0])


def test_average_ranks_and_rows_against_the_count_definition():
    """The rank of x_i is #{j: x_j < x_i} + (#{j: x_j == x_i} - 1) / 2 (0-based average ranks); checked element by
    element on rows with many ties, and spearman_rows equal to spearman row by row (NaN where a row is constant)."""
    gen = np.random.default_rng(0)
    x = gen.integers(0, 6, size=(50, 17)).astype(np.float64)  # ties in every row
    x[3] = 2.0  # a constant row
    want = np.array([[(r < v).sum() + ((r == v).sum() - 1) / 2 for v in r] for r in x])
    assert np.array_equal(average_ranks(x), want)
    assert np.array_equal(average_ranks(x[5]), want[5])
    y = gen.normal(size=(50, 17))
    rows = spearman_rows(x, y)
    for i in range(50):
        one = spearman(list(x[i]), list(y[i]))
        if one is None:
            assert np.isnan(rows[i])
        else:
            assert rows[i] == pytest.approx(one, abs=1e-12)
    assert np.isnan(rows[3]) and not np.isnan(rows[np.arange(50) != 3]).any()


def test_top_overlap_and_weights_l1_hand_values():
    import oar

    a = [0.9, 0.1, 0.8, 0.2, 0.7, 0.0, 0.3, 0.6, 0.5, 0.4]
    assert top_overlap(a, a, 30) == 1.0
    assert top_overlap(a, [-x for x in a], 30) == 0.0
    assert top_overlap(a, [0.9, 0.8, 0.1, 0.2, 0.7, 0.0, 0.3, 0.6, 0.5, 0.4], 30) == pytest.approx(2 / 3)  # {0,1,4}
    cfg = oar.OARConfig()
    assert reshaped_weights_l1(a, a, cfg) == 0.0
    import numpy as np

    def weights(v, q=0.25, beta=1.0, floor=0.1):  # method.md sections 5-6, written out
        s = np.log1p(np.asarray(v, dtype=np.float64))
        s = (s - s.min()) / (s.max() - s.min())
        tau = np.quantile(s, q)
        w = np.where(s < tau, np.maximum(s / tau, floor), 1 + beta * (s - tau) / (1 - tau))
        return w * len(v) / w.sum()

    b = [0.2, 0.9, 0.1, 0.8, 0.0, 0.7, 0.3, 0.6, 0.5, 0.4]
    want = float(np.abs(weights(a) - weights(b)).mean())
    # float32 op against float64: weights are O(1), 1e-5 is ~100 float32 ulps
    assert reshaped_weights_l1(a, b, cfg) == pytest.approx(want, abs=1e-5)
    assert want > 0.1


def test_summarize_fidelity_of_exact_scores_is_perfect():
    """A screened method that returned the exact scores: Spearman 1, overlap 1, L1 0, recall difference 0; the cost
    ratios are the sums' ratios."""
    import oar

    ts = []
    for i, L in enumerate((12, 20)):
        ex = [float((7 * j) % L) for j in range(L)]
        ts.append(Trace(task="t", problem_id=str(i), prompt_ids=[], response_ids=[], answer="", text="",
                        reasoning_len=L, causal=[j % 5 == 0 for j in range(L)],
                        scores={"oar_p/answer_mean": ex, "oar_g1/answer_mean": [max(ex) - x for x in ex],
                                "oar_p_screen0.1/answer_mean": list(ex)},
                        costs={"oar_p/answer_mean": {"seconds": 2.0, "tokens": 100},
                               "oar_g1/answer_mean": {"seconds": 0.5, "tokens": 30},
                               "oar_p_screen0.1/answer_mean": {"seconds": 1.0, "tokens": 40, "masked": 3}}))
    rows = {r["method"]: r for r in summarize_fidelity(ts, oar.OARConfig())}
    s = rows["oar_p_screen0.1/answer_mean"]
    assert s["spearman"] == pytest.approx(1.0) and s["top10_overlap"] == 1.0 and s["weights_l1"] == 0.0
    assert s["recall10_minus_exact"] == 0.0 and s["masked_frac"] == pytest.approx(6 / 32)
    assert s["seconds_vs_exact"] == pytest.approx(0.5) and s["tokens_vs_exact"] == pytest.approx(0.4)
    assert rows["oar_g1/answer_mean"]["spearman"] == pytest.approx(-1.0)


# (function, keyword arguments, exception, message regex)
BAD_INPUT = [
    # NaN keys made the ranking (and so the recall) depend on their position.
    pytest.param(recall_at, dict(scores=[1.0, float("nan"), 0.5], causal=[True, False, False], percent=10), ValueError,
                 r"scores must not contain NaN .* positions \[1\]", id="recall_at_nan_scores"),
    pytest.param(recall_at, dict(scores=[1.0], causal=[True], percent="10"), ValueError,
                 r"percent must be in \(0, 100\] \(a real number\), got '10'", id="recall_at_percent_str"),
    # reps=0 used to be IndexError; level=1.5 a silently wrong interval.
    pytest.param(bootstrap_ci, dict(values=[0.5, float("nan")]), ValueError,
                 r"values must be finite, got nan at index", id="bootstrap_ci_nan"),
]


@pytest.mark.parametrize("fn, kwargs, exc, match", BAD_INPUT)
def test_bad_input(fn, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fn(**kwargs)


def test_write_outputs_with_no_trace_kept(tmp_path):
    # Plotting zero tasks used to raise after the table was written.
    write_outputs([], [], str(tmp_path / "r"), {})
    assert (tmp_path / "r.json").exists() and (tmp_path / "r.md").exists()


@pytest.fixture()
def no_model(monkeypatch):
    """Fails the test if the command gets as far as loading a model or running the evaluation."""
    import oar.app.eval_attribution as ea

    def boom(*a, **k):
        raise AssertionError("eval-attribution ran past its argument checks")

    monkeypatch.setattr(ea, "run", boom)
    monkeypatch.setattr("oar.app.models.load_by_name", boom)


@pytest.mark.parametrize("argv, match", [
    (["--tasks", "math500"], r"data file not found: .*math500"),
    (["--max-new-tokens", "0"], r"--max-new-tokens must be >= 1, got 0"),
    (["--temperature", "-1"], r"--temperature must be finite and > 0, got -1\.0"),
    (["--temperature", "nan"], r"--temperature must be finite and > 0, got nan"),
    (["--out", "/proc/oar-nonexistent/recall"], r"--out: cannot create the output directory '/proc/oar-nonexistent'"),
    (["--out", "DIR/"], r"--out must be a file prefix .* got '.*/'"),
    (["--screen-fractions", "0.1", "1.5"], r"--screen-fractions must be in \[0, 1\] \(1 = exact OAR-P\), got 1\.5"),
    (["--screen-sample", "nan"], r"--screen-sample must be finite, got nan"),
    (["--screen-sample", "1.5"], r"--screen-sample must be in \[0, 1\], got 1\.5"),
    (["--screen-fractions", "0", "--screen-sample", "0"], r"--screen-fractions 0 needs --screen-sample > 0"),
    (["--screen-window", "-1"], r"--screen-window must be >= 0, got -1"),
    (["--windows", "0", "-2"], r"--windows must be >= 0, got -2"),
])
def test_cli_eval_attribution_fails_fast(tmp_path, monkeypatch, capsys, no_model, argv, match):
    # Each of these used to load the model (and for --out, run to the end before failing to write the results).
    from oar.app.cli import main

    monkeypatch.setenv("OAR_DATA_DIR", str(tmp_path / "no-data"))
    argv = [a.replace("DIR", str(tmp_path)) for a in argv]
    if "--tasks" not in argv:
        argv = ["--tasks", "arithmetic"] + argv
    with pytest.raises(SystemExit) as e:
        main(["eval-attribution"] + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("oar eval-attribution: error:")
    assert re.search(match, err)


def test_score_trace_windows_and_both_screens():
    """score_trace scores windowed OAR-P at each window (the engine's numbers) and screened OAR-P at each fraction
    with both screens: the window screen's and OAR-G's masked tokens carry exact OAR-P scores, so at fraction 1
    both equal exact OAR-P; the costs of a screened method include its screen's."""
    import oar
    from oar.attribution import HFProbeModel, ProbeContextBuilder, oar_p_window_scores
    from oar.app.eval_attribution import score_trace, screened_name, window_name
    from oar.testing import tiny_random_llama
    from _completions import CONCLUDE, probe_rollouts

    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, tokenizer="minimal", seed=1)
    with torch.no_grad():  # sharpened as test_attribution's fixture: divergences O(1e-2 .. 1)
        for prm in model.parameters():
            if prm.dim() > 1:
                prm.mul_(6.0)
    model.eval()
    pids, rids, answers = probe_rollouts(tok)
    cfg = oar.OARConfig(conclude=CONCLUDE)
    L = 17
    tr = Trace(task="t", problem_id="0", prompt_ids=pids[0], response_ids=rids[0], answer=answers[0], text="",
               reasoning_len=L, causal=[False] * L)
    out = score_trace(model, tok, tr, cfg, draws=2, seed=3, screen_fractions=(0.2, 1.0), screen_sample=0.1,
                      windows=(0, 3), screen_window=3)
    batch = ProbeContextBuilder(tok, CONCLUDE).build([pids[0]], [rids[0]], [answers[0]], [L])
    for w in (0, 3):
        want = oar_p_window_scores(HFProbeModel(model), batch, window=w).scores[0, :L]
        torch.testing.assert_close(torch.tensor(out[window_name(w)]), want, rtol=0, atol=0)
    for kind in ("window", "oar_g"):
        torch.testing.assert_close(torch.tensor(out[screened_name(1.0, kind)]), torch.tensor(out["oar_p/answer_mean"]),
                                   rtol=0, atol=0)
        assert tr.costs[screened_name(0.2, kind)]["masked"] == 4 + 2  # ceil(0.2 x 17) + ceil(0.1 x 17)
    assert screened_name(0.2, "oar_g") == "oar_p_gscreen0.2/answer_mean"
    # the screen's tokens plus the exact pass's (its clean pass at least)
    assert tr.costs[screened_name(0.2)]["tokens"] > tr.costs[window_name(3)]["tokens"]
