"""The built-in multi-turn task: multi-step arithmetic over 3-digit numbers with a calculator tool (issue 44,
docs/method.md section 13).

A problem is an expression on numbers of 1-3 digits: one operation at level 1 (``347*29``), two or three at level 2
(``347*29 + 118``, ``(512 - 87)*6``, ``214*13 - 35*17``); the answer is its integer value. The model may call the calculator with
``<calc>expression</calc>`` (at most :data:`MAX_CALLS` calls); the environment answers inside the same assistant
message with ``<result>value</result>`` (``oar.app.tasks.tools``), and the session ends with ``\\boxed{answer}``. The
few-shot turns show the protocol, since a small instruct model has no tool template. The reward is 1 when the
boxed answer equals the value; the last-number fallback is off, so a copied tool result is no answer.

Determinism and held-out data: problem ``i`` of (split, seed) is a pure function of those values
(``random.Random`` seeded with a string); a problem belongs to ``test`` exactly when the CRC-32 of its expression is
divisible by 5, so train and test never share an expression.
"""

from __future__ import annotations

import random
import zlib

from oar.app.tasks.base import Problem, Task, check_split, register_task

__all__ = ["CalculatorTask", "MAX_CALLS", "FEW_SHOT", "SYSTEM_PROMPT", "LEVELS", "DEFAULT_LEVEL",
           "generate_expression"]

#: Calls the environment answers per session (a further call is left unanswered).
MAX_CALLS = 4

SYSTEM_PROMPT = ("You are a helpful math assistant with a calculator. To compute, write <calc>expression</calc> and "
                 "the result appears as <result>value</result>. Give the final answer as \\boxed{answer}.")

#: Worked sessions (question, assistant text with the tool's replies in place): one call on the whole expression.
#: Measured with SmolLM2-135M-Instruct (level 2, 16 test problems x 4 sessions, temperature 0.9, 128 tokens): 55%
#: accuracy, 13 of 16 groups with mixed rewards, 59 of 64 sessions call the tool; worked sessions that split the
#: expression into two calls gave 6% (4 of 16 groups mixed): the model copies the pattern but not the arithmetic.
FEW_SHOT = (
    ("What is 123*45 + 67?", "<calc>123*45 + 67</calc><result>5602</result> The answer is \\boxed{5602}."),
    ("What is (604 - 58)*7?", "<calc>(604 - 58)*7</calc><result>3822</result> The answer is \\boxed{3822}."),
)

#: level -> the expression forms: 1 one operation (one call and the answer: two turns), 2 two or three operations
LEVELS = {1: ("{a}*{b}", "{a}*{d}", "{a} + {c}", "{a} - {b}"),
          2: ("{a}*{b} + {c}", "{a}*{b} - {c}", "({a} + {c})*{d}", "({a} - {c})*{d}", "{a}*{d} + {b}*{e}",
              "{a}*{d} - {b}*{e}")}
DEFAULT_LEVEL = 2


def generate_expression(rng: random.Random, level: int = DEFAULT_LEVEL) -> str:
    """One expression of ``level`` (:data:`LEVELS`) with a, c in 100..999, b in 11..99, d, e in 3..19."""
    form = rng.choice(LEVELS[level])
    return form.format(a=rng.randint(100, 999), b=rng.randint(11, 99), c=rng.randint(100, 999),
                       d=rng.randint(3, 19), e=rng.randint(3, 19))


def _split_of(expression: str) -> str:
    return "test" if zlib.crc32(expression.encode()) % 5 == 0 else "train"


@register_task("calculator")
class CalculatorTask(Task):
    """Multi-step arithmetic with a calculator tool (module docstring).

    Args:
        level: 1 (one operation) or 2 (two or three operations, the default): :data:`LEVELS`.
        max_calls: calls the environment answers per session (>= 0).
        **kwargs: :class:`Task`'s (``system_prompt``, ``instruction``, ``few_shot``, ...); the defaults are this
            task's system prompt, the worked sessions :data:`FEW_SHOT` and no last-number fallback.

    Attributes:
        tool: True: sessions are sampled with the calculator (``oar.app.tasks.tools.run_sessions``).
    """

    name = "calculator"
    tool = True

    def __init__(self, *, level: int = DEFAULT_LEVEL, max_calls: int = MAX_CALLS, **kwargs):
        if level not in LEVELS:
            raise ValueError(f"level must be one of {sorted(LEVELS)}, got {level!r}")
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 0:
            raise ValueError(f"max_calls must be an int >= 0, got {max_calls!r}")
        kwargs.setdefault("system_prompt", SYSTEM_PROMPT)
        kwargs.setdefault("few_shot", FEW_SHOT)
        kwargs.setdefault("allow_last_number", False)
        super().__init__(**kwargs)
        self.max_calls = max_calls
        self.level = level

    def problems(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Problem]:
        """``n`` problems of ``split`` (default 256), each a pure function of (split, seed, index)."""
        check_split(split, self.splits)
        count = 256 if n is None else n
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"n must be a non-negative int or None, got {n!r}")
        rng = random.Random(f"calculator-{self.level}-{split}-{seed}")
        out, seen = [], set()
        while len(out) < count:
            expr = generate_expression(rng, self.level)
            if expr in seen or _split_of(expr) != split:
                continue
            seen.add(expr)
            from oar.app.tasks.tools import evaluate_expression

            value = evaluate_expression(expr)
            out.append(Problem(id=f"calculator{self.level}-{split}-{seed}-{len(out)}", question=f"What is {expr}?",
                               answer=str(value), source=self.name, metadata={"expression": expr, "level": self.level}))
        return out
