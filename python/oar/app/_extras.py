"""Optional dependencies ("extras") and the error a module raises when its extra is not installed.

``pip install oar`` brings only what ``import oar`` needs (torch, numpy, pyyaml): the ops, the pipeline, the
functional API and the trainer integrations, which use the trainer the user already has. The command line, the
tasks, the model loaders and the plots need ``pip install "oar[train]"``. A module that needs an extra calls
:func:`require` where it starts, so a missing package is reported as "oar.app.train needs oar[train] ..." rather
than as a bare ModuleNotFoundError deep inside transformers or trl. pyproject.toml lists the same packages
(tests/python/project/test_packaging.py keeps the two in step).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

#: extra -> {import name: distribution name} (pyproject.toml's [project.optional-dependencies]).
EXTRAS: dict[str, dict[str, str]] = {
    "train": {
        "transformers": "transformers",
        "trl": "trl",
        "accelerate": "accelerate",
        "datasets": "datasets",
        "gguf": "gguf",
        "math_verify": "math-verify",
        "rich": "rich",
        "tqdm": "tqdm",
        "matplotlib": "matplotlib",
    },
}


def missing(extra: str, modules: Iterable[str] | None = None) -> list[str]:
    """Distribution names of ``extra`` whose import name is not installed (``importlib.util.find_spec``; nothing
    is imported).

    Args:
        extra: a key of :data:`EXTRAS` (``"train"``).
        modules: import names to check (default: every package of the extra); each must belong to the extra.

    Raises:
        ValueError: an unknown extra, or a module that is not part of it.
    """
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {sorted(EXTRAS)}, got {extra!r}")
    table = EXTRAS[extra]
    names = list(table) if modules is None else list(modules)
    for name in names:
        if name not in table:
            raise ValueError(f"modules must be import names of oar[{extra}] ({', '.join(table)}), got {name!r}")
    out = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken or half-installed package counts as missing
            found = False
        if not found:
            out.append(table[name])
    return out


def require(extra: str, what: str, modules: Iterable[str] | None = None) -> None:
    """Raises ModuleNotFoundError (an ImportError) naming ``what``, the missing packages and the extra to install.

    Args:
        extra: a key of :data:`EXTRAS`.
        what: the feature asking (``"oar.app.train"``, ``"oar train"``), first words of the message.
        modules: the import names ``what`` needs (default: the whole extra).

    Example message: ``oar.app.models needs transformers, gguf, which are not installed: pip install "oar[train]"``.
    """
    gone = missing(extra, modules)
    if gone:
        raise ModuleNotFoundError(
            f"{what} needs {', '.join(gone)}, which {'is' if len(gone) == 1 else 'are'} not installed: "
            f'pip install "oar[{extra}]"',
            name=next(k for k, v in EXTRAS[extra].items() if v == gone[0]),
        )
