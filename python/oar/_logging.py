"""One log level for oar's C++ logger and Python's ``"oar"`` logger (docs/design.md, "Logging").

The C++ planners (``plan_masked_chunks``, ``plan_prefix_chunks``) and the C++ engine log through spdlog
(``oar/core/log.h``); the Python engines decide which path runs for Hugging Face models and log that through
``logging.getLogger("oar")``. :func:`set_log_level` sets both. The environment variable ``OAR_LOG_LEVEL`` is
read once, by the C++ logger when ``import oar`` first asks for its level (:func:`_apply_environment`), and the
Python logger follows it. Both write to stderr as ``[oar D] message`` (level letter).

Levels: ``trace`` (C++ only; Python treats it as debug), ``debug`` (plans and path decisions, per call),
``info`` (one summary line per engine call), ``warn`` (the default), ``error``, ``off``.
"""

from __future__ import annotations

import logging
import os

from oar._lib import load_extension

_C = load_extension()

#: The accepted level names, most verbose first (the C++ table).
LOG_LEVELS: tuple[str, ...] = tuple(_C.LOG_LEVELS)

_PY_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
              "error": logging.ERROR, "off": logging.CRITICAL + 1}

_logger = logging.getLogger("oar")
_handler: logging.Handler | None = None


def set_log_level(level: str) -> None:
    """Sets the level of oar's C++ logger and of Python's ``"oar"`` logger.

    Args:
        level: ``"trace"`` | ``"debug"`` | ``"info"`` | ``"warn"`` | ``"error"`` | ``"off"``.

    When neither the ``"oar"`` logger nor the root logger has a handler (the application configured no
    logging), a stderr handler formatting like the C++ logger is attached to ``"oar"``, so that the Python
    messages appear next to the C++ ones; an application's own handlers are used otherwise.

    Raises:
        ValueError: another level name (the message lists the accepted ones).
    """
    if not isinstance(level, str) or level not in _PY_LEVELS:
        raise ValueError(f"level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    _C.set_log_level(level)
    _set_python_level(level)


def log_level() -> str:
    """The level of oar's C++ logger (``OAR_LOG_LEVEL`` or the last :func:`set_log_level`; default ``"warn"``)."""
    return str(_C.log_level())


def _set_python_level(level: str) -> None:
    global _handler
    _logger.setLevel(_PY_LEVELS[level])
    if _handler is None and not _logger.handlers and not logging.getLogger().handlers:
        _handler = logging.StreamHandler()  # stderr, like spdlog's sink
        _handler.setFormatter(logging.Formatter("[oar %(levelname).1s] %(message)s"))
        _logger.addHandler(_handler)


def _apply_environment() -> None:
    """Called once by ``import oar``: the C++ logger reads ``OAR_LOG_LEVEL`` (warning on stderr about an unknown
    value, then ``warn``) and, when the variable is set, Python's ``"oar"`` logger takes the same level."""
    level = log_level()  # the C++ logger's first use: it reads the environment now
    if "OAR_LOG_LEVEL" in os.environ:
        _set_python_level(level)
