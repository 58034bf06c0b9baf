"""Reference answers as OAR-P / OAR-G's probe reads them (docs/method.md section 2): the check every trainer adapter
runs on them, and the extractor for GSM8K's ``#### x`` format.

The probe context of a rollout ends with ``conclude + answer + suffix``: by default
``"\\nTherefore, the final answer is \\\\boxed{" + answer + "}"`` (``OARConfig.conclude``; the suffix closes the box).
The answer is the dataset's value, verbatim. Datasets in the GSM8K / MATH style keep the whole worked solution in
their ``answer`` column (GSM8K: steps with ``<<calc>>`` annotations, then ``#### 42``; MATH: a solution with
``\\boxed{...}``): probed verbatim, the probe would measure how the reasoning changes the model's prediction of a whole
solution inside ``\\boxed{...}``, and every variant's forward would carry it (a GSM8K solution is 29 to 454 tokens,
its final answer 1 to 9; every GSM8K and MATH500 row holds a marker, and every GSM8K row several lines).
:func:`check_reference_answer` tells such a value from a final answer:

* refused (``ValueError``) where it certainly is not one: it contains a final-answer marker (:data:`ANSWER_MARKERS`:
  ``####``, ``\\boxed``, ``\\fbox``; a final answer goes inside the box, it holds none), it spans several lines, or it
  is empty;
* warned about (``UserWarning``, once per column and process) where it probably is not: longer than
  :data:`MAX_ANSWER_TOKENS` tokens.

Nothing here imports torch, a trainer or ``oar.app``: the TRL, verl and OpenRLHF adapters call the same functions.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

__all__ = ["ANSWER_MARKERS", "MAX_ANSWER_TOKENS", "CHARS_PER_TOKEN", "answer_text", "check_reference_answer",
           "prepare_reference_answers", "gsm8k_final_answer", "split_gsm8k_answer"]

#: Final-answer markers: a value holding one is a solution that ends in its final answer, not the answer itself.
ANSWER_MARKERS = ("####", "\\boxed", "\\fbox")

#: Longest reference answer (tokens of the policy's tokenizer) probed without a warning. The probe scores the answer
#: tokens after the conclude string, so the answer should be what goes inside ``\boxed{...}``: the final answers of
#: GSM8K are 1 to 9 tokens (SmolLM2's tokenizer, both splits), those of MATH500 up to 32 (a 3-vector in a
#: ``pmatrix``; 23 at the 99th percentile), while GSM8K's worked solutions start at 29 tokens (median 113 in train,
#: 117 in test) and MATH500's at 25 (median 181). 48 is 1.5 times the longest final answer of either benchmark: a
#: longer single-line value is most likely an explanation or a solution, but not certainly (a long expression can be a
#: final answer), so it is warned about, not refused.
MAX_ANSWER_TOKENS = 48

#: Without a tokenizer, an answer's length is counted in characters against ``CHARS_PER_TOKEN * max_tokens`` (BPE
#: vocabularies average about 4 characters per token of English text; MATH500's longest final answer is 53 characters).
CHARS_PER_TOKEN = 4

#: Characters of an offending value quoted in messages.
_QUOTE = 80

#: Columns already warned about as too long (the warning is given once per column and process).
_warned_long: set = set()

_DEFAULT_FIX = ("extract the final answer first (GSM8K's '#### x' format: oar.answers.gsm8k_final_answer), or read "
                "the reference answer from a column that holds only the final answer")


def _start(value: str) -> str:
    return repr(value[:_QUOTE] + ("..." if len(value) > _QUOTE else ""))


def answer_text(value: Any, *, column: str = "answer", row: Any = None, fix: str | None = None) -> str:
    """A dataset's answer value as the text the probe reads: a str as it is, a number (int, float, numpy scalar) as
    ``str(value)``; containers are refused, because their ``repr`` would be probed (verl's Search-R1 layout keeps
    ``{"target": [...]}`` in ``ground_truth``; parquet turns lists into numpy arrays).

    Args:
        value: one row's answer value. column, row, fix: named in messages (as :func:`check_reference_answer`).

    Returns:
        The text (not yet checked: :func:`check_reference_answer`).

    Raises:
        ValueError: ``value`` is None, bytes, a mapping, or a sequence / array / set (naming its type and start).
    """
    where = f"dataset column {column!r}, row {row}" if row is not None else f"dataset column {column!r}"
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bytes, bytearray)) or hasattr(value, "keys") or (
            hasattr(value, "__len__") and not hasattr(value, "item")) or (
            hasattr(value, "shape") and getattr(value, "shape", ()) != ()):
        raise ValueError(f"{where}: the reference answer must be a str or a number, got {type(value).__name__} "
                         f"{_start(repr(value))}, whose repr the probe would read: "
                         f"{_DEFAULT_FIX if fix is None else fix}")
    if hasattr(value, "item"):  # a numpy / torch scalar
        value = value.item()
    return str(value)


def check_reference_answer(answer: str, *, column: str = "answer", row: Any = None, tokenizer=None,
                           max_tokens: int = MAX_ANSWER_TOKENS, fix: str | None = None) -> str:
    """Checks that ``answer`` is a final answer the probe can read after the conclude string (module docstring);
    returns it unchanged.

    Args:
        answer: the reference answer of one row, as it will be probed.
        column: the dataset column it came from (named in messages).
        row: the row's index in the caller's indexing (named in messages; any printable label).
        tokenizer: the policy's tokenizer (``encode(text, add_special_tokens=False)``), for the length check; None:
            characters against ``CHARS_PER_TOKEN * max_tokens``.
        max_tokens: the length above which a warning is given (default :data:`MAX_ANSWER_TOKENS`).
        fix: what the caller's user should change (default: extract the final answer, or use another column).

    Returns:
        ``answer``.

    Raises:
        ValueError: ``answer`` is not a str, is empty, contains a final-answer marker (:data:`ANSWER_MARKERS`) or
            spans several lines; the message names the column, the row, the start of the value and ``fix``.

    Warns:
        UserWarning: longer than ``max_tokens`` tokens (once per ``column`` in this process).
    """
    where = f"dataset column {column!r}, row {row}" if row is not None else f"dataset column {column!r}"
    fix = _DEFAULT_FIX if fix is None else fix
    if not isinstance(answer, str):
        raise ValueError(f"{where}: the reference answer must be a str, got {type(answer).__name__} {answer!r}")
    if not answer.strip():
        raise ValueError(f"{where}: the reference answer is empty ({answer!r}); the probe needs at least one answer "
                         f"token: {fix}")
    marker = next((m for m in ANSWER_MARKERS if m in answer), None)
    if marker is not None:
        raise ValueError(f"{where} holds a worked solution, not a final answer: it contains the final-answer marker "
                         f"{marker!r} ({_start(answer)}), and OAR-P / OAR-G would probe it verbatim after the conclude "
                         f"string (... \\boxed{{<answer>}}): {fix}")
    lines = answer.strip().splitlines()
    if len(lines) > 1:
        raise ValueError(f"{where} holds {len(lines)} lines, not a final answer ({_start(answer)}), and OAR-P / OAR-G "
                         f"would probe it verbatim after the conclude string (... \\boxed{{<answer>}}): {fix}")
    if column not in _warned_long:
        if tokenizer is not None:
            n, limit, unit = len(tokenizer.encode(answer, add_special_tokens=False)), max_tokens, "tokens"
        else:
            n, limit, unit = len(answer), CHARS_PER_TOKEN * max_tokens, "characters"
        if n > limit:
            _warned_long.add(column)
            warnings.warn(f"{where}: the reference answer is {n} {unit} long ({_start(answer)}), more than the "
                          f"{limit} of the longest final answers (oar.answers.MAX_ANSWER_TOKENS); OAR-P / OAR-G probe "
                          f"it verbatim after the conclude string. If it is not the final answer: {fix} (warned once "
                          f"per column)", UserWarning, stacklevel=2)
    return answer


def prepare_reference_answers(values: Sequence[Any], *, column: str = "answer", rows: Sequence[Any] | None = None,
                              extractor: Callable[[str], str] | None = None, tokenizer=None,
                              max_tokens: int = MAX_ANSWER_TOKENS, fix: str | None = None) -> list[str]:
    """The reference answers the probe reads, from a column's ``values``: each value as text (:func:`answer_text`),
    through ``extractor`` when given, then checked by :func:`check_reference_answer`.

    Args:
        values: one value per row (not None: a missing answer is the caller's error to name).
        column: the dataset column (named in messages).
        rows: the rows' indices in the caller's indexing, same length as ``values`` (default 0, 1, ...).
        extractor: a callable str -> str giving the final answer of a value (e.g. :func:`gsm8k_final_answer`), or
            None (the values are the answers).
        tokenizer, max_tokens, fix: as in :func:`check_reference_answer`.

    Returns:
        list[str], one answer per row.

    Raises:
        ValueError: ``values`` is a str; a value that is None or a container (:func:`answer_text`); ``extractor`` is
            neither None nor callable; ``rows`` of another length than ``values``; the
            extractor raised on a row, or returned something else than a non-empty str (naming the row and the
            start of its value); a checked answer is refused (:func:`check_reference_answer`).
    """
    if isinstance(values, (str, bytes)):
        raise ValueError(f"values must be a sequence with one answer per row, got {type(values).__name__} "
                         f"{_start(repr(values))}")
    if extractor is not None and not callable(extractor):
        raise ValueError(f"answer_extractor must be a callable str -> str or None, got {type(extractor).__name__} "
                         f"{extractor!r}")
    rows = list(range(len(values))) if rows is None else list(rows)
    if len(rows) != len(values):
        raise ValueError(f"rows must have one index per value: {len(values)} values, got {len(rows)} rows")
    out = []
    for value, row in zip(values, rows):
        text = answer_text(value, column=column, row=row, fix=fix)
        if extractor is not None:
            name = getattr(extractor, "__name__", type(extractor).__name__)
            try:
                got = extractor(text)
            except Exception as e:
                raise ValueError(f"answer_extractor {name} failed on dataset column {column!r}, row {row} "
                                 f"({_start(text)}): {type(e).__name__}: {e}") from e
            if not isinstance(got, str) or not got.strip():
                raise ValueError(f"answer_extractor {name} must return the final answer as a non-empty str; on "
                                 f"dataset column {column!r}, row {row} ({_start(text)}) it returned {got!r}")
            text = got
        out.append(check_reference_answer(text, column=column, row=row, tokenizer=tokenizer, max_tokens=max_tokens,
                                          fix=fix))
    return out


def split_gsm8k_answer(text: str) -> tuple[str, str]:
    """Splits a GSM8K ``answer`` field (openai/grade-school-math: the worked solution, then ``#### <final answer>``)
    into ``(solution, final_answer)``: the final answer is the text after the last ``####``, stripped, thousands
    commas removed (``"#### 1,080"`` -> ``"1080"``); the solution is the text before it, right-stripped.

    Raises:
        ValueError: ``text`` is not a str, has no ``####`` marker, or nothing after it.
    """
    if not isinstance(text, str):
        raise ValueError(f"GSM8K answer must be a str, got {type(text).__name__} {text!r}")
    pos = text.rfind("####")
    if pos == -1:
        raise ValueError(f"GSM8K answer has no '####' marker: {text[-80:]!r}")
    final = text[pos + 4:].strip().replace(",", "")
    if not final:
        raise ValueError(f"GSM8K answer has nothing after '####': {text[-80:]!r}")
    return text[:pos].rstrip(), final


def gsm8k_final_answer(text: str) -> str:
    """The final answer of a GSM8K ``answer`` field (``"...\\n#### 1,080"`` -> ``"1080"``): an extractor for the
    trainer adapters' ``answer_extractor`` (:func:`split_gsm8k_answer`).

    Raises:
        ValueError: as :func:`split_gsm8k_answer`.
    """
    return split_gsm8k_answer(text)[1]
