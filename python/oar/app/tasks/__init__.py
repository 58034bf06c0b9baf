"""Math tasks for GRPO with verifiable rewards: problems, prompts, answer extraction and checking.

``get_task(name, **kwargs)`` builds a registered task:

* ``"arithmetic"``: generated word problems (``oar.app.tasks.arithmetic``), no data files.
* ``"gsm8k"``: GSM8K JSONL files (``oar.app.tasks.gsm8k``), optionally only the easiest questions.
* ``"math500"``: the MATH500 JSONL file (``oar.app.tasks.math500``).
* ``"calculator"``: multi-step arithmetic with a calculator tool, multi-turn sessions (``oar.app.tasks.calculator``).

Each task has ``problems(split, n=None, seed=0)``, ``prompt(problem)`` (chat messages) and
``reward(completion, problem)`` (1.0 / 0.0). Answer extraction and verification live in
``oar.app.tasks.verify``. This package imports only the standard library at import time (math-verify
and sympy load on the first verification); the torch-based sampler is ``oar.app.tasks.evaluate``.
"""

from __future__ import annotations

from oar.app.tasks import arithmetic, calculator, gsm8k, math500  # noqa: F401  (register the built-in tasks)
from oar.app.tasks.base import (
    DEFAULT_INSTRUCTION,
    DEFAULT_SYSTEM_PROMPT,
    Problem,
    Task,
    available_tasks,
    get_task,
    register_task,
)
from oar.app.tasks.verify import answer_start, extract_answer, verify_answer

__all__ = [
    "DEFAULT_INSTRUCTION",
    "DEFAULT_SYSTEM_PROMPT",
    "Problem",
    "Task",
    "answer_start",
    "available_tasks",
    "extract_answer",
    "get_task",
    "register_task",
    "verify_answer",
]
