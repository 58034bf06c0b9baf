"""Tests of oar.app.tasks: answer extraction, verification, the arithmetic generator, GSM8K/MATH500 loaders.

Fast (no model). The real data files are read from $OAR_DATA_DIR or ../shared/data when present, else skipped.
"""

from __future__ import annotations

import json
import os
import re
import threading
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oar.app.tasks import Problem, available_tasks, get_task
from oar.app.tasks.arithmetic import _ITEMS as ARITH_ITEMS
from oar.app.tasks.arithmetic import _NAMES as ARITH_NAMES
from oar.app.tasks.arithmetic import FEW_SHOT_EXAMPLES, LEVELS
from oar.app.tasks.gsm8k import load_gsm8k, parse_gsm8k_answer, solution_steps
from oar.app.tasks.math500 import load_math500, parse_math_answer
from oar.app.tasks.verify import (
    answer_start,
    extract_answer,
    extract_answer_with_rule,
    last_boxed,
    numbers_equal,
    parse_number,
    verify_answer,
)

from _paths import ROOT

SHARED_DATA = Path(os.environ.get("OAR_DATA_DIR") or ROOT.parent / "shared" / "data")
GSM8K_TEST = SHARED_DATA / "gsm8k" / "test.jsonl"
MATH500_TEST = SHARED_DATA / "math500" / "test.jsonl"


# ---------------------------------------------------------------------------------------------------
# extraction


@pytest.mark.parametrize(
    "text, answer, rule",
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", "boxed"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", "boxed"),
        ("first \\boxed{3} then \\boxed{ 4 }", "4", "boxed"),
        ("\\boxed{7} and a cut-off \\boxed{\\frac{1}{", "7", "boxed"),  # unbalanced last box skipped
        ("\\boxed{5} The answer is \\boxed{}.", "5", "boxed"),  # empty box skipped
        ("\\fbox{12}", "12", "boxed"),
        ("\\boxed 9", "9", "boxed"),
        ("3 + 4 = 7\n#### 1,234\n", "1,234", "hash"),
        ("#### 7\nThe answer is \\boxed{}.", "7", "hash"),
        ("#### -5", "-5", "hash"),
        ("The answer is: $12$.", "12", "answer_is"),
        ("so the final answer is 42.\nThanks", "42", "answer_is"),
        ("The answer is \\boxed{}.", None, None),
        ("She has -3 left, then 8, finally -12 apples", "-12", "last_number"),
        ("x is 2.5", "2.5", "last_number"),
        ("3/4 of the cake", "3/4", "last_number"),
        ("1,234,567 grains", "1,234,567", "last_number"),
        ("no digits at all", None, None),
        ("", None, None),
    ],
)
def test_extract_answer_cases(text, answer, rule):
    assert extract_answer_with_rule(text) == (answer, rule)
    assert extract_answer(text) == answer


def test_extract_answer_without_last_number_fallback():
    assert extract_answer("Tom has 3 + 4 = 7 apples.", allow_last_number=False) is None
    assert extract_answer("Tom has 3 + 4 = 7 apples.") == "7"


@pytest.mark.parametrize("bad", [None, 17, b"\\boxed{1}", ["\\boxed{1}"], "}}}{{{\\boxed{{{", "\\boxed" * 1000])
def test_extract_answer_never_raises(bad):
    out = extract_answer(bad)
    assert out is None or isinstance(out, str)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("\\boxed{}#### 0123456789-.,/ The answer is:$\n")), max_size=80))
def test_extract_answer_total_on_random_text(text):
    out = extract_answer(text)
    assert out is None or (isinstance(out, str) and out == out.strip() and out)
    if out is not None:
        assert verify_answer(out, out) in (True, False)


def test_last_boxed_nested_and_absent():
    assert last_boxed("a \\boxed{x^{2}+\\frac{1}{2}} b") == "x^{2}+\\frac{1}{2}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{}") is None


def test_answer_start_points_at_final_answer_marker():
    text = "3 + 4 = 7, so \\boxed{7}"
    pos = answer_start(text)
    assert text[pos:] == "\\boxed{7}"
    text = "We add.\n#### 7"
    assert text[answer_start(text) :] == "#### 7"
    assert answer_start("just 7") is None
    assert answer_start("empty \\boxed{} here") is None


# ---------------------------------------------------------------------------------------------------
# verification


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("0.5", "\\frac{1}{2}", True),
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac{14}{2}", "7", True),
        ("1,000", "1000", True),
        ("1{,}000", "1000", True),
        ("\\$18", "18", True),
        ("$18$", "18", True),
        ("18 dollars", "18", True),
        ("18\\text{ dollars}", "18", True),
        ("x = 7", "7", True),
        ("7.0", "7", True),
        ("-3", "-3", True),
        ("-3", "3", False),
        ("8", "7", False),
        ("0.333333", "1/3", True),  # decimal within relative tolerance 1e-6
        ("0.33", "1/3", False),
        ("x^7", "7", False),  # an expression, not the number 7
        ("7\\pi", "7", False),
        ("1/0", "7", False),
        ("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)", True),  # math-verify: tuples, pi
        ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),  # math-verify: symbolic equality
        ("p-q", "p - q", True),
        ("\\text{Evelyn}", "\\text{Evelyn}", True),
        ("garbage}}{{", "7", False),
        (None, "7", False),
        ("", "7", False),
    ],
)
def test_verify_answer_equivalences(pred, gold, expected):
    assert verify_answer(pred, gold) is expected


def test_verify_answer_rejects_non_string_gold():
    with pytest.raises(TypeError, match="gold must be a str"):
        verify_answer("1", 1)


def test_verify_pathological_input_is_fast_and_false():
    # sympy would not finish 9^(9^(9^9)); the screen keeps it away from math-verify entirely.
    import time

    t0 = time.perf_counter()
    assert verify_answer("9^{9^{9^{9}}}", "7") is False
    assert verify_answer("2^{1000000}", "2") is False
    assert verify_answer("12345!", "1") is False
    assert verify_answer("1" * 10_000, "1") is False
    assert time.perf_counter() - t0 < 2.0


def test_verify_answer_in_worker_thread():
    # math-verify's signal-based timeout raises outside the main thread; verify_answer must disable it.
    results = []

    def work():
        results.append(verify_answer("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)"))
        results.append(verify_answer("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"))
        results.append(verify_answer("5", "\\frac{\\pi}{2}"))

    th = threading.Thread(target=work)
    th.start()
    th.join(timeout=60)
    assert results == [True, True, False]


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**9, 10**9), st.integers(1, 10**6))
def test_numbers_equal_matches_fraction_arithmetic(num, den):
    # Reference: Python's Fraction, written in the forms a model may use.
    value = Fraction(num, den)
    as_frac = f"\\frac{{{num}}}{{{den}}}" if num >= 0 else f"-{abs(num)}/{den}"
    assert numbers_equal(as_frac, f"{num}/{den}") is True
    if value.denominator == 1:
        as_int = f"{int(value):,}"
        assert numbers_equal(as_int, str(int(value))) is True
        assert numbers_equal(str(int(value) + 1), str(int(value))) is False


def test_parse_number_forms():
    assert parse_number("1,234") == (Fraction(1234), False)
    assert parse_number("-0.25") == (Fraction(-1, 4), True)
    assert parse_number("\\frac{3}{4}") == (Fraction(3, 4), False)
    assert parse_number("-\\frac{1}{2}") == (Fraction(-1, 2), False)
    assert parse_number("\\dfrac{1}{-2}") == (Fraction(-1, 2), False)
    assert parse_number("50\\%") == (Fraction(50), False)
    assert parse_number("7 apples") is None
    assert parse_number("7 apples", single_only=True) == (Fraction(7), False)
    assert parse_number("3 and 4", single_only=True) is None
    assert parse_number("1/0") is None


# ---------------------------------------------------------------------------------------------------
# arithmetic task

_ARITH_FORMS = {
    # (regex over the question, function of the captured numbers) -> independent reference answer
    r"has (\d+) \w+ and buys (\d+) more": lambda a, b: a + b,
    r"picked (\d+) \w+ in the morning and (\d+) \w+ in the afternoon": lambda a, b: a + b,
    r"There are (\d+) \w+ in a box\. \w+ puts (\d+) more": lambda a, b: a + b,
    r"has (\d+) \w+ and gives (\d+) of them": lambda a, b: a - b,
    r"There are (\d+) \w+ on the table\. \w+ takes (\d+) of them": lambda a, b: a - b,
    r"had (\d+) \w+ and lost (\d+) of them": lambda a, b: a - b,
    r"has (\d+) bags with (\d+) \w+ in each": lambda a, b: a * b,
    r"has (\d+) boxes with (\d+) \w+ in each": lambda a, b: a * b,  # the few-shot example's form
    r"There are (\d+) boxes and each box holds (\d+)": lambda a, b: a * b,
    r"buys (\d+) packs of \w+\. Each pack has (\d+)": lambda a, b: a * b,
    r"has (\d+) \w+, buys (\d+) more, and then gives (\d+)": lambda a, b, c: a + b - c,
    r"There are (\d+) \w+ in a box\. \w+ adds (\d+) more and then takes out (\d+)": lambda a, b, c: a + b - c,
}


def _reference_answer(question: str) -> int:
    hits = [(f, m) for pat, f in _ARITH_FORMS.items() if (m := re.search(pat, question))]
    assert len(hits) == 1, f"question matches {len(hits)} known forms: {question!r}"
    f, m = hits[0]
    return f(*(int(g) for g in m.groups()))


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_arithmetic_answers_are_correct(level):
    task = get_task("arithmetic", level=level)
    for split in ("train", "test"):
        problems = task.problems(split, n=300, seed=3)
        assert len(problems) == 300
        assert len({p.question for p in problems}) == 300  # distinct
        for p in problems:
            expected = _reference_answer(p.question)
            assert expected >= 0
            assert p.answer == str(expected)
            assert p.metadata["level"] == level
            assert p.solution.endswith(f"#### {expected}")
            assert task.reward(f"so the total is \\boxed{{{expected}}}", p) == 1.0
            assert task.reward(f"\\boxed{{{expected + 1}}}", p) == 0.0


def test_arithmetic_operand_ranges():
    for p in get_task("arithmetic", level=3).problems("train", n=200):
        assert all(10 <= x <= 100 for x in p.metadata["operands"])  # 100: a == b bumped by one
    for p in get_task("arithmetic", level=1).problems("train", n=200):
        assert all(2 <= x <= 9 for x in p.metadata["operands"])


def test_arithmetic_deterministic_and_seeded():
    a = get_task("arithmetic", level=2).problems("train", n=50, seed=7)
    b = get_task("arithmetic", level=2).problems("train", n=50, seed=7)
    c = get_task("arithmetic", level=2).problems("train", n=50, seed=8)
    assert a == b
    assert [p.question for p in a] != [p.question for p in c]
    assert [p.id for p in a] == [f"arithmetic-L2-train-s7-{i}" for i in range(50)]


def test_arithmetic_train_test_disjoint():
    task = get_task("arithmetic", level=1)
    train = {p.question for p in task.problems("train", n=1000)}
    test = {p.question for p in task.problems("test", n=200)}
    assert not train & test


def _fact(p):
    """The arithmetic of a problem recomputed from its solution text (independent of arithmetic_fact): the
    operation and operands, with + and x operands sorted."""
    import re

    lines = [ln for ln in p.solution.splitlines() if not ln.startswith("####")]
    if len(lines) == 2:  # two-step: "a + b = s", "s - c = r"
        a, b = map(int, re.match(r"(\d+) \+ (\d+) =", lines[0]).groups())
        c = int(re.match(r"\d+ - (\d+) =", lines[1]).group(1))
        return ("+-", (a, b, c))
    a, op, b = re.match(r"(\d+) ([+\-x]) (\d+) =", lines[0]).groups()
    a, b = int(a), int(b)
    return (op, tuple(sorted((a, b))) if op in "+x" else (a, b))


@pytest.mark.parametrize("level", [1, 2, 4, 5])
def test_arithmetic_split_by_arithmetic_is_disjoint_in_facts(level):
    """split_by="arithmetic": no held-out problem asks an operation on operands that a training problem asks
    (commuted sums and products included); the question split does share them (what the option fixes)."""
    task = get_task("arithmetic", level=level, split_by="arithmetic")
    train = task.problems("train", n=300)
    test = task.problems("test", n=120)
    train_facts, test_facts = {_fact(p) for p in train}, {_fact(p) for p in test}
    assert not train_facts & test_facts
    assert len(test_facts) >= 5 and len({p.question for p in test}) == 120
    assert all(int(p.answer) == int(p.solution.rsplit("#### ", 1)[1]) for p in test)
    # deterministic, and other ids than the question split's
    again = task.problems("test", n=120)
    assert [p.question for p in again] == [p.question for p in test] and test[0].id.startswith(f"arithmetic-L{level}f-")
    by_question = get_task("arithmetic", level=level)
    shared = ({_fact(p) for p in by_question.problems("train", n=300)}
              & {_fact(p) for p in by_question.problems("test", n=60)})
    assert shared


def test_arithmetic_cluster_is_the_fact():
    """Held-out intervals resample facts: Task.cluster of an arithmetic problem is its fact (recomputed here from
    the solution text), problems without the metadata and other tasks' problems are their own cluster."""
    from oar.app.tasks.base import Problem, Task

    task = get_task("arithmetic", split_by="arithmetic")
    test = task.problems("test", n=200)
    by_cluster: dict = {}
    for p in test:
        by_cluster.setdefault(task.cluster(p), set()).add(_fact(p))
    assert all(len(facts) == 1 for facts in by_cluster.values())
    assert len(by_cluster) == len({_fact(p) for p in test}) < 50
    hand = Problem(id="mine-1", question="2 + 2?", answer="4")
    assert task.cluster(hand) == "mine-1"
    assert Task().cluster(test[0]) == test[0].id


def test_arithmetic_question_split_is_unchanged():
    """Adding split_by left the default split's problems as they were (the README's and runs' held-out sets)."""
    a = get_task("arithmetic").problems("test", n=5)
    b = get_task("arithmetic", split_by="question").problems("test", n=5)
    assert [p.question for p in a] == [p.question for p in b] and a[0].id == "arithmetic-L2-test-s0-0"


def test_arithmetic_mixed_levels():
    problems = get_task("arithmetic", level=[1, 4]).problems("train", n=200)
    assert {p.metadata["level"] for p in problems} == {1, 4}


def test_arithmetic_bad_arguments():
    with pytest.raises(ValueError, match="level must be one of"):
        get_task("arithmetic", level=9)
    with pytest.raises(ValueError, match="split must be one of"):
        get_task("arithmetic").problems("validation")
    with pytest.raises(ValueError, match="n must be a non-negative int"):
        get_task("arithmetic").problems("train", n=-1)
    with pytest.raises(ValueError, match="exceeds the distinct"):
        get_task("arithmetic", level=1).problems("test", n=20_000)
    with pytest.raises(ValueError, match=r"split_by must be one of \('question', 'arithmetic'\), got 'facts'"):
        get_task("arithmetic", split_by="facts")


def test_prompt_format():
    task = get_task("arithmetic", level=2)
    p = task.problems("test", n=1)[0]
    msgs = task.prompt(p)
    # system, then one worked example per operation of level 2 (add, sub), then the question
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[-1]["content"].startswith(p.question)
    assert "\\boxed{}" in msgs[-1]["content"]
    zero_shot = get_task("arithmetic", system_prompt=None, few_shot=())
    assert [m["role"] for m in zero_shot.prompt(p)] == ["user"]
    with pytest.raises(ValueError, match=r"few_shot\[0\] must be a \(question, answer_text\) pair"):
        get_task("arithmetic", few_shot=["just a string"])


@pytest.mark.parametrize("key", sorted(FEW_SHOT_EXAMPLES))
def test_few_shot_examples_are_correct_and_not_generated(key):
    question, answer_text = FEW_SHOT_EXAMPLES[key]
    expected = _reference_answer(question)
    assert extract_answer(answer_text) == str(expected)
    for level in LEVELS:
        generated = {p.question for p in get_task("arithmetic", level=level).problems("train", n=300)}
        assert question not in generated
    assert "Sara" not in ARITH_NAMES and "pens" not in ARITH_ITEMS


def test_registry():
    assert {"arithmetic", "gsm8k", "math500"} <= set(available_tasks())
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        get_task("nope")


def test_rewards_length_mismatch():
    task = get_task("arithmetic")
    with pytest.raises(ValueError, match="same length"):
        task.rewards(["a"], [])


# ---------------------------------------------------------------------------------------------------
# GSM8K / MATH500 loaders on small files written here


def _write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_gsm8k_loader_small_file(tmp_path):
    rows = [
        {"question": "q1", "answer": "a=<<1+1=2>>2\nb=<<2*3=6>>6\nc=<<6+1=7>>7\n#### 7"},
        {"question": "q2", "answer": "a=<<5*5=25>>25\n#### 1,234"},
        {"question": "q3", "answer": "x\ny\n#### -4"},
    ]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    ps = load_gsm8k(path, split="train")
    assert [p.answer for p in ps] == ["7", "1234", "-4"]
    assert [p.metadata["steps"] for p in ps] == [3, 1, 2]
    assert [p.id for p in ps] == ["gsm8k-train-1", "gsm8k-train-2", "gsm8k-train-3"]
    assert [p.question for p in load_gsm8k(path, easiest=True, n=2)] == ["q2", "q3"]
    assert [p.question for p in load_gsm8k(path, max_steps=2)] == ["q2", "q3"]
    assert len(load_gsm8k(path, n=2, seed=1)) == 2
    task = get_task("gsm8k", train_path=path)
    assert task.reward("so #### 1,234", ps[1]) == 1.0
    assert task.reward("\\boxed{1233}", ps[1]) == 0.0


def test_gsm8k_loader_errors(tmp_path):
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: GSM8K answer has no '####'"):
        load_gsm8k(bad)
    missing_field = _write_jsonl(tmp_path / "m.jsonl", [{"question": "q"}])
    with pytest.raises(ValueError, match=r"m.jsonl:1: field 'answer' must be a string"):
        load_gsm8k(missing_field)
    (tmp_path / "notjson.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_gsm8k(str(tmp_path / "notjson.jsonl"))
    with pytest.raises(FileNotFoundError):
        load_gsm8k(str(tmp_path / "absent.jsonl"))


def test_data_path_resolution(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    _write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "q", "answer": "#### 3"}])
    monkeypatch.delenv("OAR_DATA_DIR", raising=False)
    with pytest.raises(ValueError, match="OAR_DATA_DIR"):
        get_task("gsm8k").problems("test")
    assert get_task("gsm8k", data_dir=str(tmp_path)).problems("test")[0].answer == "3"
    monkeypatch.setenv("OAR_DATA_DIR", str(tmp_path))
    assert get_task("gsm8k").problems("test")[0].answer == "3"
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        get_task("gsm8k").problems("train")


def test_parse_answers():
    assert parse_gsm8k_answer("x=<<2+2=4>>4\n#### 4") == ("x=<<2+2=4>>4", "4")
    assert solution_steps("a\nb\n\nc") == 3
    assert solution_steps("<<1+1=2>><<2+2=4>>") == 2
    assert parse_math_answer("so $\\boxed{\\frac{1}{2}}$.The answer is: \\frac{1}{2}")[1] == "\\frac{1}{2}"
    assert parse_math_answer("so $\\boxed{\\frac{1}{2}}$.") == ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}")
    with pytest.raises(ValueError, match="neither"):
        parse_math_answer("no answer here")


def test_math500_loader_small_file(tmp_path):
    path = _write_jsonl(
        tmp_path / "test.jsonl",
        [{"question": "Q", "answer": "We get $\\boxed{\\frac{14}{3}}$.The answer is: \\frac{14}{3}"}],
    )
    (p,) = load_math500(path)
    assert p.answer == "\\frac{14}{3}" and p.source == "math500"
    task = get_task("math500", path=path)
    assert task.reward("Hence \\boxed{\\dfrac{14}{3}}", p) == 1.0
    assert task.reward("Hence 14/3", p) == 0.0  # no marker: MATH500 has no last-number fallback
    with pytest.raises(ValueError, match="split must be one of"):
        task.problems("train")


# ---------------------------------------------------------------------------------------------------
# the real files, when ../shared/data is present


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"GSM8K data absent ({SHARED_DATA}/gsm8k/test.jsonl; set OAR_DATA_DIR)")
def test_gsm8k_real_test_file():
    ps = load_gsm8k(str(GSM8K_TEST), split="test")
    assert len(ps) == 1319
    assert ps[0].answer == "18"  # Janet's ducks: 16 - 3 - 4 = 9 eggs at $2
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", p.answer) for p in ps)
    # Every reference solution verifies against its own answer through the "####" rule.
    task = get_task("gsm8k", test_path=str(GSM8K_TEST))
    assert all(task.reward(p.solution, p) == 1.0 for p in ps)
    easy = load_gsm8k(str(GSM8K_TEST), easiest=True, n=50)
    assert max(p.metadata["steps"] for p in easy) <= min(p.metadata["steps"] for p in ps[50:]) + 1
    assert sorted(p.metadata["steps"] for p in easy) == [p.metadata["steps"] for p in easy]


@pytest.mark.skipif(not MATH500_TEST.exists(), reason=f"MATH500 data absent ({SHARED_DATA}/math500/test.jsonl; set OAR_DATA_DIR)")
def test_math500_real_file_boxed_matches_answer():
    ps = load_math500(str(MATH500_TEST))
    assert len(ps) == 500
    # The solution's last box and the "The answer is:" line agree (checked on a sample: sympy is slow).
    agree = sum(verify_answer(last_boxed(p.solution), p.answer) for p in ps[:40])
    assert agree >= 38


def test_problem_is_frozen():
    p = Problem(id="x", question="q", answer="1")
    with pytest.raises(AttributeError):
        p.answer = "2"  # type: ignore[misc]
