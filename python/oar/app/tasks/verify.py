"""Final-answer extraction and verification for math tasks.

Two steps, both total functions (they never raise on model output, however malformed):

1. :func:`extract_answer` pulls the final-answer string out of a completion. Rules, first that
   matches wins (each returns the *last* occurrence in the text, because models restate
   intermediate results before concluding):

   ``boxed``
       the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces balance and whose content is not
       empty. Nested braces are followed, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. A box
       cut off by the token limit (unbalanced) or an empty ``\\boxed{}`` (SmolLM2 often copies the
       instruction literally) is skipped, and the previous box is tried.
   ``hash``
       ``#### x`` (GSM8K's marker): the rest of the line after the last ``####``.
   ``answer_is``
       ``The answer is x`` / ``the final answer is: x`` (case-insensitive): the rest of the line,
       without a trailing full stop and without ``$`` delimiters.
   ``last_number``
       the last number in the text (``-12``, ``1,234``, ``3.5``, ``3/4``); only when
       ``allow_last_number`` is true (the default). It rewards a correct result stated without a
       marker, which matters for small models that rarely format their answer; turn it off for a
       strict format reward.

2. :func:`verify_answer` decides whether an extracted answer equals the reference:

   a. both sides plain numbers (after dropping ``$``, ``\\$``, ``%``, thousands commas, ``\\text{..}``
      units and surrounding words, and reading ``a/b``, ``\\frac{a}{b}``, ``\\dfrac{a}{b}``):
      exact comparison as :class:`fractions.Fraction`, with a relative tolerance of ``1e-6`` when
      either side was written as a decimal (``0.333333`` vs ``1/3``). No sympy, so it is fast and
      cannot hang; this covers the arithmetic and GSM8K tasks.
   b. otherwise ``math_verify`` (``parse`` both sides wrapped in ``\\boxed{}``, then ``verify(gold,
      pred)``): symbolic equality of LaTeX expressions, tuples, intervals, matrices (MATH500).
   c. if math-verify could not parse a side, raised, or timed out: the numeric comparison of (a)
      again, which then requires each side to hold exactly one number (``"18 dollars"``), and
      finally an exact comparison of the normalized strings.

Time bounds. math-verify bounds each parse/compare with ``signal.alarm``, which only works in the
main thread of the main interpreter; elsewhere it raises ``ValueError`` (and ``alarm`` would also
cancel a ``SIGALRM`` timer the caller set). So :func:`verify_answer` passes
``parsing_timeout=timeout_s`` / ``timeout_seconds=timeout_s`` only in the main thread and ``None``
(no signal) in any other thread, e.g. a data-loader or reward worker thread. Because sympy can then
run unbounded (``9^{9^{9^{9}}}`` never finishes), every input is first screened: answers longer than
:data:`MAX_ANSWER_CHARS` characters, with nested exponents (``a^{b^{c}}``), exponent literals above
``9999`` or factorials of more than three digits never reach math-verify and go to the numeric and
string comparisons only. This screen applies in the main thread too, so a pathological sample costs
microseconds instead of a multi-second timeout inside a training step. Callers that verify huge
volumes of untrusted text from threads and want a hard wall-clock bound should run
:func:`verify_answer` in a process pool.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from fractions import Fraction

__all__ = [
    "MAX_ANSWER_CHARS",
    "extract_answer",
    "extract_answer_with_rule",
    "answer_start",
    "last_boxed",
    "parse_number",
    "numbers_equal",
    "normalize_answer",
    "verify_answer",
]

#: Answers longer than this (characters) are not handed to math-verify (see the module docstring).
MAX_ANSWER_CHARS = 256

#: Completions longer than this are searched only in their last MAX_TEXT_CHARS characters: the final
#: answer is at the end, and it keeps every regex pass linear in a bounded input.
MAX_TEXT_CHARS = 20000

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"(?:final\s+)?answer\s+is\s*:?[ \t]*([^\n]*)", re.IGNORECASE)
# A number: optional sign, digits with optional thousands groups, optional decimals, optional
# "/denominator". The look-behind keeps "x2" or "3.4.5"-like fragments from yielding partial numbers.
_NUMBER_RE = re.compile(
    r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?(?![\w])|(?<![\w.\d])-?\.\d+"
)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.,]+)\s*\}\s*\{\s*(-?[\d.,]+)\s*\}")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|textit)\s*\{[^{}]*\}")
_SPACING_RE = re.compile(r"\\[,;:! ]|\\quad|\\qquad|~")
_NESTED_POW_RE = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\(?[^\s{}()]*\^|\*\*[^*]*\*\*")
_BIG_EXP_RE = re.compile(r"(?:\^|\*\*)\s*\{?\s*\(?\s*\d{5,}")
_BIG_FACT_RE = re.compile(r"\d{4,}\s*!")

_log = logging.getLogger(__name__)


def _tail(text: str) -> str:
    return text[-MAX_TEXT_CHARS:] if len(text) > MAX_TEXT_CHARS else text


def _balanced_content(text: str, open_pos: int) -> int | None:
    """Index of the ``}`` matching the ``{`` at ``open_pos``, or None when the text ends first."""
    depth = 0
    for i in range(open_pos, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _boxed_spans(text: str) -> list[tuple[int, int, int]]:
    """All complete boxes as (command start, content start, content end), in text order."""
    spans = []
    for cmd in _BOX_COMMANDS:
        pos = text.find(cmd)
        while pos != -1:
            j = pos + len(cmd)
            while j < len(text) and text[j] in " \t":
                j += 1
            if j < len(text) and text[j] == "{":
                close = _balanced_content(text, j)
                if close is not None:
                    spans.append((pos, j + 1, close))
            elif cmd == "\\boxed" and j < len(text) and j > pos + len(cmd):
                # "\boxed 7": LaTeX takes the next token as the argument.
                m = re.match(r"[^\s$}]+", text[j:])
                if m:
                    spans.append((pos, j, j + m.end()))
            pos = text.find(cmd, pos + len(cmd))
    spans.sort()
    return spans


def last_boxed(text: str) -> str | None:
    """Content of the last complete, non-empty ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``.

    Braces are matched, so nested groups are kept whole. Returns None when there is none.
    """
    if not isinstance(text, str):
        return None
    text = _tail(text)
    for _, start, end in reversed(_boxed_spans(text)):
        content = text[start:end].strip()
        if content:
            return content
    return None


def _clean_phrase(s: str) -> str:
    # An empty box copied from the instruction ("The answer is \\boxed{}.") states nothing.
    s = re.sub(r"\\(?:boxed|fbox)\s*\{\s*\}", "", s).strip()
    # "The answer is $7$." / "The answer is: 7." -> "7"
    s = s.rstrip(" .;!,")
    if s.startswith("$") and s.endswith("$") and len(s) > 1:
        s = s.strip("$").strip()
    if s.startswith("\\(") and s.endswith("\\)"):
        s = s[2:-2].strip()
    return s


def extract_answer_with_rule(text: str, *, allow_last_number: bool = True) -> tuple[str | None, str | None]:
    """Like :func:`extract_answer`, also naming the rule that matched.

    Returns:
        ``(answer, rule)`` with rule one of ``"boxed"``, ``"hash"``, ``"answer_is"``,
        ``"last_number"``; ``(None, None)`` when nothing matched or ``text`` is not a string.
    """
    if not isinstance(text, str) or not text:
        return None, None
    text = _tail(text)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    for rule, regex in (("hash", _HASH_RE), ("answer_is", _ANSWER_IS_RE)):
        matches = [m for m in regex.finditer(text) if _clean_phrase(m.group(1))]
        if matches:
            return _clean_phrase(matches[-1].group(1)), rule
    if allow_last_number:
        nums = _NUMBER_RE.findall(text)
        if nums:
            return nums[-1].strip(), "last_number"
    return None, None


def extract_answer(text: str, *, allow_last_number: bool = True) -> str | None:
    """The final answer stated in a completion, or None.

    Args:
        text: model output (any string; non-strings give None).
        allow_last_number: use the last number in the text when no marker matched.

    Returns:
        The answer as written (stripped), e.g. ``"\\frac{1}{2}"``, ``"1,234"``, ``"-3"``; the rules
        and their order are in the module docstring. Never raises.
    """
    return extract_answer_with_rule(text, allow_last_number=allow_last_number)[0]


def answer_start(text: str) -> int | None:
    """Character offset where the completion's final-answer expression starts, or None.

    That is the start of the last complete ``\\boxed``/``\\fbox`` command, else of the last ``####``
    marker; the reasoning part of the completion is ``text[:answer_start(text)]`` (method.md
    section 2: reasoning tokens run up to, excluding, the final-answer expression). None when the
    completion has neither marker (then the whole completion counts as reasoning).
    """
    if not isinstance(text, str) or not text:
        return None
    offset = max(0, len(text) - MAX_TEXT_CHARS)
    tail = text[offset:]
    spans = [s for s in _boxed_spans(tail) if tail[s[1] : s[2]].strip()]
    if spans:
        return offset + spans[-1][0]
    pos = tail.rfind("####")
    return offset + pos if pos != -1 else None


def normalize_answer(s: str) -> str:
    """Answer string with LaTeX spacing, ``$`` delimiters, ``\\left``/``\\right`` and blanks removed.

    Used for the last-resort string comparison only.
    """
    s = _SPACING_RE.sub("", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "")
    s = s.replace("$", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


def _to_fraction(token: str) -> tuple[Fraction, bool] | None:
    """(value, written_as_decimal) of one number token; None if it is not finite."""
    token = token.replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/", 1)
            d = Fraction(den)
            if d == 0:
                return None
            return Fraction(num) / d, ("." in token)
        return Fraction(token), ("." in token)
    except (ValueError, ZeroDivisionError):
        return None


def parse_number(s: str, *, single_only: bool = False) -> tuple[Fraction, bool] | None:
    """Read an answer string as one rational number.

    Strips ``$``/``\\$``, ``%``, ``\\%``, LaTeX spacing, ``\\text{...}``-style units and thousands
    commas, and reads ``\\frac{a}{b}`` / ``\\dfrac{a}{b}`` / ``a/b``.

    Args:
        s: the answer string.
        single_only: accept surrounding words (``"18 dollars"``, ``"x = 7"``) as long as exactly one
            number occurs; when False the cleaned string must be a number and nothing else.

    Returns:
        ``(value, written_as_decimal)`` or None (not a number, several numbers, division by zero,
        non-string input). Never raises.
    """
    if not isinstance(s, str) or not s or len(s) > MAX_ANSWER_CHARS:
        return None
    t = _TEXT_CMD_RE.sub(" ", s)
    t = _SPACING_RE.sub("", t)
    t = t.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    t = t.replace("\\left", "").replace("\\right", "").replace("{,}", ",")
    t = _FRAC_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", t)
    t = t.strip().rstrip(".").strip()
    if not single_only:
        if re.fullmatch(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/[+-]?\d+(?:\.\d+)?)?|[+-]?\.\d+", t):
            return _to_fraction(t.lstrip("+"))
        return None
    nums = list(_NUMBER_RE.finditer(t))
    if len(nums) != 1:
        return None
    # Only words, "=" or ":" may surround the number ("x = 7", "18 dollars"): "x^7" or "7 + y" are
    # expressions, not the number 7.
    rest = t[: nums[0].start()] + " " + t[nums[0].end() :]
    if not re.fullmatch(r"[A-Za-z\s=:,.']*", rest):
        return None
    return _to_fraction(nums[0].group(0))


def numbers_equal(pred: str, gold: str, *, single_only: bool = False, rel_tol: float = 1e-6) -> bool | None:
    """Numeric equality of two answer strings; None when either is not a number (see :func:`parse_number`).

    Exact rational comparison, except that a side written as a decimal is compared with relative
    tolerance ``rel_tol`` (absolute ``1e-9`` near zero) so that ``0.333333`` matches ``1/3``.
    """
    a = parse_number(pred, single_only=single_only)
    b = parse_number(gold, single_only=single_only)
    if a is None or b is None:
        return None
    (va, dec_a), (vb, dec_b) = a, b
    if va == vb:
        return True
    if dec_a or dec_b:
        return math.isclose(float(va), float(vb), rel_tol=rel_tol, abs_tol=1e-9)
    return False


def _unsafe_for_sympy(s: str) -> bool:
    return (
        len(s) > MAX_ANSWER_CHARS
        or bool(_NESTED_POW_RE.search(s))
        or bool(_BIG_EXP_RE.search(s))
        or bool(_BIG_FACT_RE.search(s))
    )


def _math_verify_equal(pred: str, gold: str, timeout_s: int | None) -> bool | None:
    """math-verify's verdict, or None when it could not parse a side / failed. Raises ModuleNotFoundError naming
    the ``train`` extra when math-verify is not installed (never a silently weaker check)."""
    from oar.app._extras import require

    require("train", "answer checking (oar.app.tasks.verify_answer)", ["math_verify"])
    from math_verify import parse, verify
    in_main = threading.current_thread() is threading.main_thread()
    t = timeout_s if (in_main and timeout_s) else None
    # math-verify logs a warning the first time a timeout is disabled; that is expected here.
    mv_logger = logging.getLogger("math_verify")
    previous = mv_logger.level
    mv_logger.setLevel(logging.ERROR)
    try:
        g = parse("\\boxed{" + gold + "}", parsing_timeout=t)
        p = parse("\\boxed{" + pred + "}", parsing_timeout=t)
        if not g or not p:
            return None
        return bool(verify(g, p, timeout_seconds=t))
    except BaseException as e:  # noqa: BLE001 - garbage output must never escape as an exception
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        _log.debug("math-verify failed on pred=%r gold=%r: %s", pred[:80], gold[:80], e)
        return None
    finally:
        mv_logger.setLevel(previous)


def verify_answer(pred: str | None, gold: str, *, timeout_s: int | None = 5, use_math_verify: bool = True) -> bool:
    """True when the extracted answer ``pred`` equals the reference ``gold``.

    Args:
        pred: extracted answer (:func:`extract_answer`), None or any string.
        gold: reference answer (canonical string, e.g. ``"18"``, ``"\\frac{\\pi}{2}"``).
        timeout_s: per-operation limit (whole seconds) for math-verify in the main thread; ignored in
            other threads, where signals are unavailable (module docstring). None disables it.
        use_math_verify: False restricts the check to the numeric and string comparisons.

    Returns:
        bool. The order of checks is in the module docstring. Never raises on any ``pred``.

    Raises:
        TypeError: ``gold`` is not a string (a caller bug, unlike a bad prediction).
    """
    if not isinstance(gold, str):
        raise TypeError(f"gold must be a str, got {type(gold).__name__}")
    if not isinstance(pred, str):
        return False
    pred, gold = pred.strip(), gold.strip()
    if not pred or not gold:
        return False
    exact = numbers_equal(pred, gold)
    if exact is not None:
        return exact
    if use_math_verify and not _unsafe_for_sympy(pred) and not _unsafe_for_sympy(gold):
        mv = _math_verify_equal(pred, gold, timeout_s)
        if mv:
            return True
    loose = numbers_equal(pred, gold, single_only=True)
    if loose is not None:
        return loose
    return normalize_answer(pred) == normalize_answer(gold)
