"""The one cache of :class:`oar.pipeline.Pipeline` objects, for :func:`oar.token_advantages` and every trainer
adapter.

A pipeline holds a random generator (the ``random`` baseline, OAR-G's noise). Building a new one per training
step would replay the same draws every step; a cached one advances from call to call, as in a trainer. The cache
is keyed by the config (its JSON), the tokenizer and any extra :class:`Pipeline` keyword arguments (e.g.
``ignore_ids``), inside a *scope*:

* default: the tokenizer object (weakly referenced: its pipelines go with it), or the process when there is none;
* ``scope=obj``: ``obj``'s own pipelines (weakly referenced; e.g. a scorer object that caches per instance);
* ``scope="name"``: a named, process-wide scope, emptied with :func:`clear` (an adapter's reinstall);
* ``by_name=True``: the tokenizer is identified by ``(name_or_path, len(tokenizer), class name)`` instead of by
  object, for tokenizers unpickled with every request (OpenRLHF's policy actors).
"""

from __future__ import annotations

import weakref
from typing import Any

from oar.pipeline import Pipeline
from oar.schema import config_arg

#: Scope of the pipelines without a tokenizer (default scope) and of the named scopes: {scope: {key: Pipeline}}.
_NAMED: dict[Any, dict] = {}
#: Object scopes (tokenizers, scorer objects), weakly referenced: {scope: {key: Pipeline}}.
_OBJECTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PROCESS = "<process>"


def tokenizer_identity(tokenizer) -> tuple | None:
    """What identifies a tokenizer across unpickled copies: ``(name_or_path, len(tokenizer), class name)``, None
    for no tokenizer."""
    if tokenizer is None:
        return None
    return (getattr(tokenizer, "name_or_path", None), len(tokenizer), type(tokenizer).__name__)


def pipeline_for(config=None, tokenizer=None, *, scope=None, by_name: bool = False, **pipeline_kwargs) -> Pipeline:
    """The cached :class:`Pipeline` of (``config``, ``tokenizer``, ``pipeline_kwargs``) in ``scope`` (a new one,
    uncached, when the default scope's tokenizer cannot be weakly referenced).

    Args:
        config: ``oar.OARConfig`` (None: the defaults).
        tokenizer: the policy's tokenizer or None.
        scope: None (the tokenizer object, or the process without a tokenizer / with ``by_name``), a str (a named
            process-wide scope) or any weakly referenceable object (its own pipelines, dropped with it).
        by_name: identify the tokenizer by :func:`tokenizer_identity` instead of by object.
        pipeline_kwargs: extra :class:`Pipeline` keyword arguments (hashable values, e.g. ``ignore_ids`` as a
            tuple), part of the key.

    Raises:
        ValueError: ``config`` not an ``oar.OARConfig`` / None, an unhashable keyword value, or an object
            ``scope`` that cannot be weakly referenced; otherwise as :class:`Pipeline`.
    """
    cfg = config_arg(config)
    extra = tuple(sorted(pipeline_kwargs.items()))
    try:
        hash(extra)
    except TypeError:
        bad = next(k for k, v in extra if getattr(v, "__hash__", None) is None)
        raise ValueError(f"pipeline_for keyword {bad!r} must be hashable (it is part of the cache key), got "
                         f"{type(pipeline_kwargs[bad]).__name__}") from None
    if by_name:
        tok_key: Any = ("name", tokenizer_identity(tokenizer))
    elif tokenizer is None or scope is None:
        tok_key = None  # the default scope is the tokenizer itself
    else:  # the cached pipeline holds the tokenizer, so its id is not reused while the entry lives
        tok_key = ("object", id(tokenizer))
    if scope is None:
        scope = _PROCESS if tokenizer is None or by_name else tokenizer
    if isinstance(scope, str):
        per = _NAMED.setdefault(scope, {})
    else:
        try:
            per = _OBJECTS.setdefault(scope, {})
        except TypeError:
            if scope is tokenizer:
                return Pipeline(cfg, tokenizer, **pipeline_kwargs)
            raise ValueError(f"scope must be None, a str or a weakly referenceable object, got "
                             f"{type(scope).__name__}") from None
    key = (cfg.to_json(), tok_key, extra)
    if key not in per:
        per[key] = Pipeline(cfg, tokenizer, **pipeline_kwargs)
    return per[key]


def clear(scope=None) -> None:
    """Drops cached pipelines: those of ``scope`` (a str or object as in :func:`pipeline_for`), or every one when
    ``scope`` is None (tests, reinstalls). The next :func:`pipeline_for` builds fresh ones (random draws restart)."""
    if scope is None:
        _NAMED.clear()
        _OBJECTS.clear()
    elif isinstance(scope, str):
        _NAMED.pop(scope, None)
    else:
        try:
            _OBJECTS.pop(scope, None)
        except TypeError:
            pass
