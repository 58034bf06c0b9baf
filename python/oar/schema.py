"""The configuration schema's one Python home: ``OARConfig``, its option structs and every name a config key can
take. ``OARConfig`` is defined, parsed and validated by the C++ core (``include/oar/core/config.h``,
``src/core/config.cpp``: every key, its default and its checks, one schema for C++ and Python) and exposed by the
pybind11 module ``oar._C``. Library modules import these from here, never from the package facade ``oar``
(docs/architecture.md).

- ``OARConfig``: ``OARConfig(method=..., ...)`` or ``OARConfig.from_json(text)`` (unknown keys and bad values
  raise ValueError naming the key); ``to_json()`` round-trips. JSON keys are flat (``ktae_alpha``), Python
  attributes nested (``cfg.ktae.alpha``): the table is in docs/config.md.
- ``ReshapeOptions``, ``GroupAdvantageOptions``: the nested option structs (``cfg.reshape``, ``cfg.advantages``).
- :data:`CONFIG_CHOICES` (every string key's values, read from the C++ schema) and its entries :data:`METHODS`,
  :data:`PROBES`, :data:`ESTIMATORS`, :data:`SCREENS`, :data:`SCREEN_TAILS`, :data:`MASK_UNITS`, :data:`TIERS`,
  :data:`CREDIT_ROWS`: the values of ``method``, ``probe``, ``estimator``, ``screen``, ``screen_tail``,
  ``mask_unit``, ``tiers`` and ``credit_rows`` (tests/python/core/test_config.py checks that the C++ parser accepts
  exactly these).
- :func:`with_method`: a config with another method (the one rule between keys: ``dr_grpo``'s estimator).
- :func:`config_arg`: the one check of a ``config`` argument; :func:`config_from_mapping` and :func:`yaml_load`:
  the one way a YAML / JSON ``oar`` section becomes an ``OARConfig`` (run configs and ``$OAR_CONFIG`` alike).
"""

from __future__ import annotations

from typing import Sequence

import json
import math
import re

import yaml

from oar._lib import load_extension

_C = load_extension()

OARConfig = _C.OARConfig
ReshapeOptions = _C.ReshapeOptions
GroupAdvantageOptions = _C.GroupAdvantageOptions

#: Every string key's accepted values, in the schema's order (``oar::core::config_choices()``: what the C++ parser
#: accepts and nothing else; the tuples below are its entries, so a value is named in one place, the C++ schema).
CONFIG_CHOICES: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in _C.CONFIG_CHOICES.items()}

#: ``method``: every credit-assignment method (the schema's order).
METHODS: tuple[str, ...] = CONFIG_CHOICES["method"]
#: ``probe``: the outcome probes (method.md section 3).
PROBES: tuple[str, ...] = CONFIG_CHOICES["probe"]
#: ``estimator``: the group statistics of the sequence advantages (method.md section 1, :func:`oar.ops.group_advantages`).
ESTIMATORS: tuple[str, ...] = CONFIG_CHOICES["estimator"]
#: ``screen``: the screen of screened OAR-P (``window``: windowed OAR-P; ``oar_g``: OAR-G).
SCREENS: tuple[str, ...] = CONFIG_CHOICES["screen"]

#: ``screen_tail``: the probe-side tokens the window screen re-runs (:func:`oar.attribution.oar_p_window_scores`,
#: ``rerun_tail``: ``conclude``, ``probe``), or ``linear``: none, the tail's response linearized
#: (:func:`oar.attribution.oar_p_linear_tail_scores`).
SCREEN_TAILS: tuple[str, ...] = CONFIG_CHOICES["screen_tail"]

#: ``mask_unit``: what OAR-P masks per variant and the token-level scorers sum over (docs/method.md section 11).
MASK_UNITS: tuple[str, ...] = CONFIG_CHOICES["mask_unit"]

#: ``tiers``: which tiers of the bi-level reshaping are applied (method.md section 6).
TIERS: tuple[str, ...] = CONFIG_CHOICES["tiers"]

#: ``credit_rows``: which rollouts get token-level credit (docs/method.md section 12, our extension).
CREDIT_ROWS: tuple[str, ...] = CONFIG_CHOICES["credit_rows"]

#: ``turn_probe`` / ``turn_credit``: how multi-turn sessions are probed and how their advantage is split between
#: turns (docs/method.md section 13, our extension).
TURN_PROBES: tuple[str, ...] = CONFIG_CHOICES["turn_probe"]
TURN_CREDITS: tuple[str, ...] = CONFIG_CHOICES["turn_credit"]

__all__ = ["OARConfig", "ReshapeOptions", "GroupAdvantageOptions", "CONFIG_CHOICES", "METHODS", "PROBES", "ESTIMATORS", "SCREENS",
           "SCREEN_TAILS", "MASK_UNITS", "TIERS", "CREDIT_ROWS", "TURN_PROBES", "TURN_CREDITS", "with_method", "config_arg", "config_from_mapping", "yaml_load"]


def with_method(config, method: str):
    """A copy of ``config`` (``OARConfig``) whose method is ``method``, every other key kept. The schema's one rule
    between keys applies: ``dr_grpo`` implies the ``dr_grpo`` estimator, so switching to it sets the estimator and
    switching away from it restores ``grpo``. Raises ValueError naming :data:`METHODS` for an unknown method."""

    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    obj = json.loads(config.to_json())
    if obj.get("method") == "dr_grpo" and method != "dr_grpo" and obj.get("estimator") == "dr_grpo":
        obj["estimator"] = "grpo"
    obj["method"] = method
    if method == "dr_grpo":
        obj["estimator"] = "dr_grpo"
    return OARConfig(**obj)


def config_arg(config, name: str = "config"):
    """``config`` itself when it is an ``OARConfig``, the defaults for None; ValueError naming ``name`` otherwise."""
    if config is None:
        return OARConfig()
    if not isinstance(config, OARConfig):
        raise ValueError(f"{name} must be an oar.OARConfig or None, got {type(config).__name__} "
                         "(build one with oar.OARConfig(method=..., ...))")
    return config


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, plus YAML 1.2 floats without a dot: PyYAML (YAML 1.1) reads ``1e-3`` as the
    string "1e-3", so ``sigma: 1e-3`` would be refused as "not a number"."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def yaml_load(text: str, what: str):
    """``text`` parsed as YAML (PyYAML's safe loader; ``1e-3`` is a float, as in YAML 1.2). Raises ValueError
    ``"{what} is not valid YAML: ..."``."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ValueError(f"{what} is not valid YAML: {str(e).replace(chr(10), ' ')}") from None


def parse_method_spec(spec: str, known: Sequence[str], what: str = "method") -> tuple[str, dict, list]:
    """``"name"`` or ``"name:key=value,key=value"`` (``oar compare`` / ``oar diagnose`` settings) -> ``(name, {key:
    parsed value}, [(key, value text), ...])``. Values are YAML scalars (:func:`yaml_load`), as in ``--set``; items
    are split at commas, so a value cannot hold one. Checks the syntax only; what a key means is the caller's.

    Raises:
        ValueError: ``spec`` not a non-empty string, ``name`` not in ``known``, an item without ``key=``, a key given
            twice, ``:`` with no item, or a value that is not YAML; each names ``what`` and the spec.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{what} spec must be a non-empty string like 'oar_g' or 'oar_g:beta=2', got {spec!r}")
    name, colon, rest = spec.strip().partition(":")
    name = name.strip()
    if name not in known:
        raise ValueError(f"{what} spec {spec!r}: unknown method {name!r}; known: {list(known)} (optionally with "
                         ":key=value,...)")
    values: dict = {}
    items: list = []
    for item in filter(None, (x.strip() for x in rest.split(","))):
        k, eq, v = (x.strip() for x in item.partition("="))
        if not eq or not k:
            raise ValueError(f"{what} spec {spec!r}: expected key=value items after ':', got {item!r}")
        if k in values:
            raise ValueError(f"{what} spec {spec!r}: key {k!r} given twice")
        values[k] = yaml_load(v, f"the value of {k!r} in {what} spec {spec!r}")
        items.append((k, v))
    if colon and not items:
        raise ValueError(f"{what} spec {spec!r}: expected key=value items after ':'")
    return name, values, items


def config_from_mapping(section: dict):
    """``OARConfig`` of an ``oar`` section read from YAML or JSON (flat keys, docs/config.md). JSON has no
    NaN/Infinity and no dates or bytes: such values get a ValueError naming the key here instead of a JSON syntax
    error in the C++ parser, which raises ValueError naming any other bad key or value."""
    if not isinstance(section, dict):
        raise ValueError(f"the oar section must be a mapping of keys, got {type(section).__name__}")
    for key, value in section.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"oar.{key} must be finite, got {value}")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise ValueError(f"oar.{key} must be a number, string, bool or list, got {type(value).__name__} "
                             f"{value!r}") from None
    return OARConfig.from_json(json.dumps(section))
