"""GSM8K grade-school math word problems from local JSON-lines files.

Format (openai/grade-school-math): one object per line with ``question`` and ``answer``; the answer
is a worked solution whose steps carry calculator annotations ``<<48/2=24>>`` and whose last line is
``#### <final answer>``. The canonical answer is that final answer with thousands commas removed
(``"#### 1,080"`` -> ``"1080"``).

Difficulty: a problem's number of solution steps is the larger of its number of ``<<...>>``
annotations and its number of non-empty solution lines (some steps lack an annotation, and a line
can hold several). ``easiest=True`` orders the
problems by (steps, solution length, question length, line) and keeps the first ``n``, a cheap way to
give a small model a GSM8K subset it can partly solve. ``max_steps`` drops longer problems.

Files are found from an explicit path, else ``data_dir/gsm8k/<split>.jsonl``, else
``$OAR_DATA_DIR/gsm8k/<split>.jsonl``; nothing is downloaded.
"""

from __future__ import annotations

import re

from oar.answers import split_gsm8k_answer
from oar.app.tasks.base import Problem, Task, check_split, read_jsonl, register_task, resolve_data_path, take

__all__ = ["GSM8KTask", "load_gsm8k", "parse_gsm8k_answer", "solution_steps"]

_CALC_RE = re.compile(r"<<[^<>]*>>")


def parse_gsm8k_answer(answer_field: str) -> tuple[str, str]:
    """Split a GSM8K ``answer`` field into ``(solution, final_answer)``: :func:`oar.answers.split_gsm8k_answer`
    (the library's copy, which the trainer adapters' ``answer_extractor=oar.answers.gsm8k_final_answer`` uses).

    ``final_answer`` is the text after the last ``####``, stripped, thousands commas removed.

    Raises:
        ValueError: no ``####`` marker or nothing after it.
    """
    return split_gsm8k_answer(answer_field)


def solution_steps(solution: str) -> int:
    """Number of steps of a GSM8K solution (without its ``####`` line): max(``<<...>>`` annotations,
    non-empty lines)."""
    lines = sum(1 for line in solution.splitlines() if line.strip())
    return max(len(_CALC_RE.findall(solution)), lines)


def load_gsm8k(
    path: str,
    *,
    split: str = "",
    n: int | None = None,
    seed: int = 0,
    easiest: bool = False,
    max_steps: int | None = None,
) -> list[Problem]:
    """Read GSM8K problems from the JSON-lines file ``path``.

    Args:
        path: the ``.jsonl`` file.
        split: tag used in problem ids (``gsm8k-<split>-<line>``).
        n: number of problems (None: all that pass ``max_steps``).
        seed: picks the ``n`` problems at random (file order kept) when ``easiest`` is False.
        easiest: keep the ``n`` easiest problems (module docstring), returned easiest first.
        max_steps: drop problems with more solution steps.

    Raises:
        FileNotFoundError: missing file. ValueError: malformed line (named by line number), bad
        ``n``/``max_steps``.
    """
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 0):
        raise ValueError(f"max_steps must be a non-negative int or None, got {max_steps!r}")
    problems = []
    for row in read_jsonl(path, ("question", "answer")):
        try:
            solution, final = parse_gsm8k_answer(row["answer"])
        except ValueError as e:
            raise ValueError(f"{path}:{row['_line']}: {e}") from None
        steps = solution_steps(solution)
        if max_steps is not None and steps > max_steps:
            continue
        tag = f"{split}-" if split else ""
        problems.append(
            Problem(
                id=f"gsm8k-{tag}{row['_line']}",
                question=row["question"],
                answer=final,
                solution=row["answer"],
                source="gsm8k",
                metadata={"steps": steps, "line": row["_line"]},
            )
        )
    if easiest:
        if n is not None and (not isinstance(n, int) or n < 0):
            raise ValueError(f"n must be a non-negative int or None, got {n!r}")
        problems.sort(key=lambda p: (p.metadata["steps"], len(p.solution or ""), len(p.question), p.metadata["line"]))
        return problems if n is None else problems[:n]
    return take(problems, n, seed)


@register_task("gsm8k")
class GSM8KTask(Task):
    """GSM8K as a task (``train`` / ``test`` splits).

    Args:
        data_dir: folder holding ``gsm8k/<split>.jsonl`` (default ``$OAR_DATA_DIR``).
        train_path, test_path: explicit files, overriding ``data_dir``.
        easiest, max_steps: as in :func:`load_gsm8k`, applied to every ``problems`` call.
        **kwargs: :class:`oar.app.tasks.base.Task` options.
    """

    name = "gsm8k"

    def __init__(
        self,
        data_dir: str | None = None,
        *,
        train_path: str | None = None,
        test_path: str | None = None,
        easiest: bool = False,
        max_steps: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.data_dir = data_dir
        self.paths = {"train": train_path, "test": test_path}
        self.easiest = easiest
        self.max_steps = max_steps

    def path(self, split: str) -> str:
        """The file ``split`` is read from (ValueError / FileNotFoundError as in ``resolve_data_path``)."""
        check_split(split, self.splits)
        return resolve_data_path(self.paths[split], self.data_dir, f"gsm8k/{split}.jsonl")

    def problems(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Problem]:
        """Problems of ``split`` (see :func:`load_gsm8k`)."""
        return load_gsm8k(
            self.path(split), split=split, n=n, seed=seed, easiest=self.easiest, max_steps=self.max_steps
        )
