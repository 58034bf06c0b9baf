"""MATH500 (the 500-problem MATH test split of PRM800K) from a local JSON-lines file.

Format: one object per line with ``question`` and ``answer``; the answer is a solution containing
``\\boxed{...}`` followed by ``The answer is: <final answer>``. The canonical answer is the text after
the last ``The answer is:`` (stripped); when a line lacks it, the content of the solution's last
``\\boxed{...}``. Answers are LaTeX (``\\frac{14}{3}``, ``\\left( 3, \\frac{\\pi}{2} \\right)``),
compared with math-verify (``oar.app.tasks.verify``).

The file is found from an explicit path, else ``data_dir/math500/test.jsonl``, else
``$OAR_DATA_DIR/math500/test.jsonl``. Only a ``test`` split exists.
"""

from __future__ import annotations

import zlib

from oar.app.tasks.base import Problem, Task, check_split, read_jsonl, register_task, resolve_data_path, take
from oar.app.tasks.verify import last_boxed

__all__ = ["Math500Task", "load_math500", "parse_math_answer"]

_MARKER = "The answer is:"


def parse_math_answer(answer_field: str) -> tuple[str, str]:
    """Split a MATH500 ``answer`` field into ``(solution, final_answer)``.

    Raises:
        ValueError: neither ``The answer is:`` nor a complete non-empty ``\\boxed{}`` is present.
    """
    pos = answer_field.rfind(_MARKER)
    if pos != -1:
        final = answer_field[pos + len(_MARKER) :].strip()
        if final:
            return answer_field[:pos].rstrip(), final
    boxed = last_boxed(answer_field)
    if boxed is None:
        raise ValueError(f"MATH answer has neither {_MARKER!r} nor \\boxed{{}}: {answer_field[-80:]!r}")
    return answer_field.rstrip() if pos == -1 else answer_field[:pos].rstrip(), boxed


def load_math500(path: str, *, n: int | None = None, seed: int = 0) -> list[Problem]:
    """Read MATH500 problems from ``path``; ``n`` drawn with ``seed`` (file order kept), all when None.

    Raises:
        FileNotFoundError: missing file. ValueError: malformed line (named by line number), bad ``n``.
    """
    problems = []
    for row in read_jsonl(path, ("question", "answer")):
        try:
            solution, final = parse_math_answer(row["answer"])
        except ValueError as e:
            raise ValueError(f"{path}:{row['_line']}: {e}") from None
        problems.append(
            Problem(
                id=f"math500-{row['_line']}",
                question=row["question"],
                answer=final,
                solution=solution,
                source="math500",
                metadata={"line": row["_line"]},
            )
        )
    return take(problems, n, seed)


@register_task("math500")
class Math500Task(Task):
    """MATH500 as a task (``test`` split only, unless ``holdout`` partitions it).

    Args:
        data_dir: folder holding ``math500/test.jsonl`` (default ``$OAR_DATA_DIR``).
        path: explicit file, overriding ``data_dir``.
        holdout: 0 (default): one ``test`` split of all 500 problems. k >= 2: the file is partitioned into a
            ``test`` split (problems whose CRC32 of the question is 0 mod k, about 500 / k) and a disjoint
            ``train`` split (the rest), fixed for every run and seed, so that ``oar train`` / ``oar compare``
            can train on MATH-style problems and evaluate on held-out ones.
        **kwargs: :class:`oar.app.tasks.base.Task` options. The last-number fallback is off by default
            here (``allow_last_number=False``): MATH answers are expressions, and the last number of
            a derivation is rarely the answer.
    """

    name = "math500"
    splits = ("test",)

    def __init__(self, data_dir: str | None = None, *, path: str | None = None, holdout: int = 0, **kwargs) -> None:
        kwargs.setdefault("allow_last_number", False)
        if isinstance(holdout, bool) or not isinstance(holdout, int) or holdout == 1 or holdout < 0:
            raise ValueError(f"holdout must be 0 (no train split) or an int >= 2, got {holdout!r}")
        super().__init__(**kwargs)
        self.data_dir = data_dir
        self._path = path
        self.holdout = holdout
        if holdout:
            self.splits = ("train", "test")

    def path(self, split: str = "test") -> str:
        """The file ``split`` is read from (ValueError / FileNotFoundError as in ``resolve_data_path``)."""
        check_split(split, self.splits)
        return resolve_data_path(self._path, self.data_dir, "math500/test.jsonl")

    def problems(self, split: str = "test", n: int | None = None, seed: int = 0) -> list[Problem]:
        """Problems of ``split`` (``"test"``; also ``"train"`` when ``holdout``), ``n`` of them (seeded) or all."""
        if not self.holdout:
            return load_math500(self.path(split), n=n, seed=seed)
        want_test = split == "test"
        every = [p for p in load_math500(self.path(split))
                 if (zlib.crc32(p.question.encode("utf-8")) % self.holdout == 0) == want_test]
        return take(every, n, seed)
