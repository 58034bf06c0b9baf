"""oar.answers: the check of the reference answers OAR-P / OAR-G probe, and GSM8K's extractor.

Fast (no model). The real GSM8K / MATH500 rows are read from $OAR_DATA_DIR or ../shared/data when present, else those
tests are skipped: their ``answer`` columns hold worked solutions, which the check refuses naming the fix; the
extractor gives each GSM8K row's final answer; the benchmarks' final answers pass without a warning.
"""

import json
import os
import re
import warnings
from pathlib import Path

import pytest

from oar import answers
from oar.answers import (ANSWER_MARKERS, CHARS_PER_TOKEN, MAX_ANSWER_TOKENS, check_reference_answer,
                         gsm8k_final_answer, prepare_reference_answers, split_gsm8k_answer)

from _paths import ROOT

SHARED_DATA = Path(os.environ.get("OAR_DATA_DIR") or ROOT.parent / "shared" / "data")
GSM8K_TEST = SHARED_DATA / "gsm8k" / "test.jsonl"
MATH500_TEST = SHARED_DATA / "math500" / "test.jsonl"
needs_gsm8k = pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"{GSM8K_TEST} not found (set OAR_DATA_DIR)")
needs_math500 = pytest.mark.skipif(not MATH500_TEST.exists(), reason=f"{MATH500_TEST} not found (set OAR_DATA_DIR)")


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    # the long-answer warning is given once per column and process: every test starts with none given
    monkeypatch.setattr(answers, "_warned_long", set())


class _CharTokenizer:
    """One token per character (the length check's only use of a tokenizer is ``encode``)."""

    def encode(self, text, add_special_tokens=False):
        return list(text)


@needs_gsm8k
def test_gsm8k_solutions_are_refused_naming_the_extractor():
    rows = _rows(GSM8K_TEST)
    for i, r in enumerate(rows):
        with pytest.raises(ValueError) as e:
            check_reference_answer(r["answer"], column="answer", row=i)
        msg = str(e.value)
        assert msg.startswith(f"dataset column 'answer', row {i} holds a worked solution, not a final answer: it "
                              "contains the final-answer marker '####' ("), msg
        assert repr(r["answer"][:80] + "...") in msg or repr(r["answer"]) in msg  # the start of the value
        assert "oar.answers.gsm8k_final_answer" in msg, msg


@needs_gsm8k
def test_gsm8k_extractor_gives_each_rows_final_answer():
    """Every GSM8K test row: the extractor's result is the text of the row's last line after ``#### `` (thousands
    commas removed: the dataset writes 1,080 and 1080 alike), and it passes the check without a warning."""
    rows = _rows(GSM8K_TEST)
    want = []
    for r in rows:
        last = r["answer"].strip().splitlines()[-1]
        assert last.startswith("#### "), last
        want.append(last[len("#### "):].strip().replace(",", ""))
    got = [gsm8k_final_answer(r["answer"]) for r in rows]
    assert got == want
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", a) for a in got)  # GSM8K's answers are numbers
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prepare_reference_answers([r["answer"] for r in rows], extractor=gsm8k_final_answer,
                                         tokenizer=_CharTokenizer()) == want
    assert split_gsm8k_answer(rows[0]["answer"]) == (rows[0]["answer"][:rows[0]["answer"].rfind("####")].rstrip(),
                                                     want[0])


@needs_math500
def test_math500_solutions_are_refused_and_final_answers_pass():
    """MATH500's ``answer`` column (solutions with ``\\boxed{}``) is refused on every row; its final answers (oar.app's
    MATH500 parser), LaTeX up to 53 characters, pass without a warning, also counted in characters; the last box's
    content (``oar.app.tasks.verify.last_boxed``, the extractor docs/trainers/trl.md names for MATH) is that final
    answer on every row."""
    from oar.app.tasks.math500 import parse_math_answer
    from oar.app.tasks.verify import last_boxed

    rows = _rows(MATH500_TEST)
    for i, r in enumerate(rows):
        with pytest.raises(ValueError, match=rf"^dataset column 'answer', row {i} holds .*not a final answer"):
            check_reference_answer(r["answer"], row=i)
    finals = [parse_math_answer(r["answer"])[1] for r in rows]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prepare_reference_answers(finals) == finals  # characters against CHARS_PER_TOKEN x MAX_ANSWER_TOKENS
        assert prepare_reference_answers(finals, tokenizer=_CharTokenizer(), max_tokens=60) == finals
        assert prepare_reference_answers([r["answer"] for r in rows], extractor=last_boxed) == finals


@pytest.mark.parametrize("value, match", [
    ("Step one.\nStep two gives 7", r"row 3 holds 2 lines, not a final answer \('Step one.\\nStep two gives 7'\)"),
    ("so the answer is \\boxed{7}", r"row 3 holds a worked solution.*marker '\\\\boxed'"),
    ("\\fbox{7}", r"marker '\\\\fbox'"),
    ("   ", r"row 3: the reference answer is empty \('   '\)"),
    (7, r"row 3: the reference answer must be a str, got int 7"),
])
def test_not_an_answer_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        check_reference_answer(value, column="answer", row=3, fix="use the right column")


def test_a_final_answer_passes_unchanged():
    for a in ["7", "-3.5", "\\frac{1}{2}", "\\left( 3, \\frac{\\pi}{2} \\right)", " 42 \n", "x^2 + 1"]:
        assert check_reference_answer(a) is a
    assert ANSWER_MARKERS == ("####", "\\boxed", "\\fbox")


def test_a_long_single_line_answer_is_warned_about_once_per_column():
    long = "the total is " + " ".join(["many"] * 20)  # one line, 112 characters
    tok = _CharTokenizer()
    with pytest.warns(UserWarning, match=rf"dataset column 'answer', row 5: the reference answer is {len(long)} "
                                         rf"tokens long \('the total is many.*more than the {MAX_ANSWER_TOKENS} "):
        assert check_reference_answer(long, row=5, tokenizer=tok) is long
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_reference_answer(long + " again", row=6, tokenizer=tok)  # once per column
        check_reference_answer(long, column="solution", row=0)  # 112 characters <= 4 x 48: no warning
    with pytest.warns(UserWarning, match=rf"column 'solution', row 1: .* is {CHARS_PER_TOKEN * 60} characters long"):
        check_reference_answer("x" * (CHARS_PER_TOKEN * 60), column="solution", row=1)


def test_extractor_results_and_failures_name_the_row():
    assert prepare_reference_answers([12, "#### 3"], rows=[10, 11], extractor=lambda s: s.replace("#### ", "")) == \
        ["12", "3"]

    def first_word(s):
        return s.split(" ")[0]

    with pytest.raises(ValueError, match=r"answer_extractor first_word must return the final answer as a non-empty "
                                         r"str; on dataset column 'answer', row 11 \(' b'\) it returned ''"):
        prepare_reference_answers(["a", " b"], rows=[10, 11], extractor=first_word)
    with pytest.raises(ValueError, match=r"answer_extractor gsm8k_final_answer failed on dataset column 'sol', row 0 "
                                         r"\('42'\): ValueError: GSM8K answer has no '####' marker") as e:
        prepare_reference_answers(["42"], column="sol", extractor=gsm8k_final_answer)
    assert isinstance(e.value.__cause__, ValueError)
    with pytest.raises(ValueError, match=r"answer_extractor must be a callable str -> str or None, got str 'x'"):
        prepare_reference_answers(["42"], extractor="x")
    with pytest.raises(ValueError, match=r"rows must have one index per value: 2 values, got 1 rows"):
        prepare_reference_answers(["1", "2"], rows=[0])
