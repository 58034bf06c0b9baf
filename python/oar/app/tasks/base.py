"""Problems, the task interface and the task registry.

A task turns a data source into :class:`Problem` objects, formats a problem as chat messages for an
instruct model and scores a completion with a verifiable 0/1 reward (the outcome reward of GRPO,
method.md section 1). Tasks register by name; :func:`get_task` builds one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from oar.app.tasks.verify import extract_answer, verify_answer

__all__ = [
    "Problem",
    "Task",
    "DEFAULT_SYSTEM_PROMPT",
    "DEFAULT_INSTRUCTION",
    "register_task",
    "get_task",
    "available_tasks",
    "check_split",
    "take",
    "read_jsonl",
    "resolve_data_path",
    "chat_prompt_ids",
]

#: System message of every built-in task.
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful math assistant. Reason briefly, then give the final answer as \\boxed{answer}."
)
#: Appended to each question in the user message.
DEFAULT_INSTRUCTION = "Put the final answer in \\boxed{}."


@dataclasses.dataclass(frozen=True)
class Problem:
    """One math problem with a verifiable answer.

    Attributes:
        id: unique within its task and split, stable across runs (e.g. ``"gsm8k-test-17"``).
        question: the problem statement shown to the model.
        answer: canonical final answer string: what :meth:`Task.reward` compares against and what
            the OAR probe appends after ``\\boxed{`` (method.md section 2), e.g. ``"18"``,
            ``"\\frac{\\pi}{2}"``.
        solution: worked solution when the source has one, else None.
        source: task name the problem came from (``"arithmetic"``, ``"gsm8k"``, ``"math500"``).
        metadata: source-specific extras (difficulty level, number of solution steps, line number).
    """

    id: str
    question: str
    answer: str
    solution: str | None = None
    source: str = ""
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of chat ``messages`` (:meth:`Task.prompt`) as the policy sees them: the tokenizer's chat template
    with the generation prompt, tokenized without adding special tokens again."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_split(split: str, allowed: tuple[str, ...]) -> str:
    """Return ``split`` if it is one of ``allowed``; otherwise raise ValueError naming both."""
    if split not in allowed:
        raise ValueError(f"split must be one of {list(allowed)}, got {split!r}")
    return split


def take(problems: list[Problem], n: int | None, seed: int) -> list[Problem]:
    """``n`` problems drawn without replacement with ``random.Random(seed)``, or all when n is None.

    The chosen problems keep their relative order. Raises ValueError for a negative ``n``.
    """
    if n is None:
        return list(problems)
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int or None, got {n!r}")
    if n >= len(problems):
        return list(problems)
    idx = sorted(random.Random(seed).sample(range(len(problems)), n))
    return [problems[i] for i in idx]


def resolve_data_path(path: str | None, data_dir: str | None, relative: str) -> str:
    """The file to read: ``path`` if given, else ``data_dir/relative``, else ``$OAR_DATA_DIR/relative``.

    Raises:
        ValueError: none of the three is set.
        FileNotFoundError: the resolved file does not exist.
    """
    if path is None:
        base = data_dir if data_dir is not None else os.environ.get("OAR_DATA_DIR")
        if not base:
            raise ValueError(
                f"no data file given: pass path=..., data_dir=... or set OAR_DATA_DIR (looked for <dir>/{relative})"
            )
        path = os.path.join(base, relative)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    return path


def read_jsonl(path: str, required: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file (blank lines skipped), each checked for the ``required`` string fields.

    Raises:
        ValueError: a line is not a JSON object or lacks a required string field (the message names
            the file, the line number and the field).
    """
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            for key in required:
                if not isinstance(row.get(key), str):
                    raise ValueError(f"{path}:{lineno}: field {key!r} must be a string, got {row.get(key)!r:.60}")
            row["_line"] = lineno
            rows.append(row)
    return rows


class Task:
    """Base class of math tasks: prompts in chat format, 0/1 reward from answer verification.

    Subclasses set ``name`` and implement :meth:`problems`.

    Args:
        system_prompt: system message (None: no system message; the chat template may add its own).
        instruction: text appended to the question in the user message.
        allow_last_number: let the reward fall back to the last number of a completion that states
            no marked answer (``extract_answer``); False makes ``\\boxed``/``####``/"The answer is"
            mandatory.
        timeout_s: math-verify timeout per operation (``verify_answer``).
        few_shot: worked examples ``(question, answer_text)`` put before the question as earlier
            user/assistant turns; they teach a small model the answer format (``\\boxed{}``).
    """

    name: str = "task"
    splits: tuple[str, ...] = ("train", "test")

    def __init__(
        self,
        *,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        instruction: str = DEFAULT_INSTRUCTION,
        allow_last_number: bool = True,
        timeout_s: int | None = 5,
        few_shot: Sequence[tuple[str, str]] = (),
    ) -> None:
        for i, ex in enumerate(few_shot):
            if not (isinstance(ex, tuple | list) and len(ex) == 2 and all(isinstance(x, str) for x in ex)):
                raise ValueError(f"few_shot[{i}] must be a (question, answer_text) pair of strings, got {ex!r}")
        self.few_shot = [tuple(ex) for ex in few_shot]
        self.system_prompt = system_prompt
        self.instruction = instruction
        self.allow_last_number = allow_last_number
        self.timeout_s = timeout_s

    def problems(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Problem]:
        """Problems of ``split``; ``n`` of them (seeded choice) or all when ``n`` is None."""
        raise NotImplementedError

    def prompt(self, problem: Problem) -> list[dict[str, str]]:
        """Chat messages for ``problem``: optional system message, the few-shot turns, then the user turn
        (question + instruction).

        Feed them to ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``.
        """
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        for question, answer_text in self.few_shot:
            messages.append({"role": "user", "content": self._user_text(question)})
            messages.append({"role": "assistant", "content": answer_text})
        messages.append({"role": "user", "content": self._user_text(problem.question)})
        return messages

    def _user_text(self, question: str) -> str:
        question = question.strip()
        return f"{question}\n{self.instruction}" if self.instruction else question

    def cluster(self, problem: Problem) -> str:
        """The unit of independence ``problem`` belongs to for held-out intervals: problems of one cluster are
        resampled together (``oar.app.stats.bootstrap_mean(clusters=...)``). Default: the problem's own ``id``
        (independent problems); a task whose problems repeat one underlying item in many wordings returns that
        item (the arithmetic task: its fact, docs/compare.md)."""
        return problem.id

    def extract(self, completion: str) -> str | None:
        """Final answer of a completion under this task's extraction settings (never raises)."""
        return extract_answer(completion, allow_last_number=self.allow_last_number)

    def reward(self, completion: str, problem: Problem) -> float:
        """1.0 when the completion's final answer equals ``problem.answer``, else 0.0 (never raises
        on any completion text)."""
        pred = self.extract(completion)
        return 1.0 if verify_answer(pred, problem.answer, timeout_s=self.timeout_s) else 0.0

    def rewards(self, completions: list[str], problems: list[Problem]) -> list[float]:
        """:meth:`reward` of each (completion, problem) pair; raises ValueError on a length mismatch."""
        if len(completions) != len(problems):
            raise ValueError(
                f"completions and problems must have the same length, got {len(completions)} and {len(problems)}"
            )
        return [self.reward(c, p) for c, p in zip(completions, problems)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


_REGISTRY: dict[str, Callable[..., Task]] = {}


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator registering a task factory under ``name`` (ValueError if taken)."""

    def deco(cls: type[Task]) -> type[Task]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"task name {name!r} is already registered to {_REGISTRY[name].__name__}")
        _REGISTRY[name] = cls
        return cls

    return deco


def get_task(name: str, **kwargs: Any) -> Task:
    """Build the task registered as ``name`` with keyword arguments for its constructor.

    Raises:
        ValueError: unknown ``name`` (the message lists the registered ones).
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; available: {available_tasks()}") from None
    return factory(**kwargs)


def available_tasks() -> list[str]:
    """Registered task names, sorted."""
    return sorted(_REGISTRY)
