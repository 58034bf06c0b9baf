"""oar eval-attribution: recall metric, bootstrap, oracle and the whole command on a tiny model."""

import json
import types

import pytest
import torch

from oar.eval_attribution import bootstrap_ci, oracle_causal, recall_at


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


def test_bootstrap_ci_brackets_mean():
    vals = [0.1, 0.5, 0.3, 0.9, 0.4, 0.6]
    lo, hi = bootstrap_ci(vals, reps=500)
    assert lo <= sum(vals) / len(vals) <= hi
    assert bootstrap_ci([0.5] * 5) == (0.5, 0.5)


class _Task:
    """Answer is correct when it equals '7'."""

    def reward(self, text, problem):
        return 1.0 if text.strip() == "\\boxed{7}" else 0.0


def test_oracle_marks_tokens_whose_masking_flips_the_answer(monkeypatch):
    import oar.eval_attribution as ev

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
