"""The configuration schema's one Python home: ``OARConfig``, its option structs and every name a config key can
take. ``OARConfig`` is defined, parsed and validated by the C++ core (``include/oar/core/config.h``,
``src/core/config.cpp``: every key, its default and its checks, one schema for C++ and Python) and exposed by the
pybind11 module ``oar._C``. Library modules import these from here, never from the package facade ``oar``
(docs/architecture.md).

- ``OARConfig``: ``OARConfig(method=..., ...)`` or ``OARConfig.from_json(text)`` (unknown keys and bad values
  raise ValueError naming the key); ``to_json()`` round-trips. JSON keys are flat (``ktae_alpha``), Python
  attributes nested (``cfg.ktae.alpha``): the table is in docs/config.md.
- ``ReshapeOptions``, ``GroupAdvantageOptions``: the nested option structs (``cfg.reshape``, ``cfg.advantages``).
- :data:`METHODS`, :data:`PROBES`, :data:`ESTIMATORS` and :data:`SCREENS`: the values of ``method``, ``probe``,
  ``estimator`` and ``screen`` (tests/python/test_config.py checks that the C++ parser accepts exactly these).
- :func:`with_method`: a config with another method (the one rule between keys: ``dr_grpo``'s estimator).
"""

from __future__ import annotations

import json

from oar._lib import load_extension

_C = load_extension()

OARConfig = _C.OARConfig
ReshapeOptions = _C.ReshapeOptions
GroupAdvantageOptions = _C.GroupAdvantageOptions

#: ``method``: every credit-assignment method (``oar::core::method_names()``, the schema's order).
METHODS: tuple[str, ...] = tuple(_C.METHOD_NAMES)
#: ``probe``: the outcome probes (method.md section 3).
PROBES: tuple[str, ...] = ("last", "answer_mean", "answer_joint")
#: ``estimator``: the group statistics of the sequence advantages (method.md section 1, :func:`oar.ops.group_advantages`).
ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "batch", "rloo")
#: ``screen``: the screen of screened OAR-P (``window``: windowed OAR-P; ``oar_g``: OAR-G).
SCREENS: tuple[str, ...] = ("window", "oar_g")

__all__ = ["OARConfig", "ReshapeOptions", "GroupAdvantageOptions", "METHODS", "PROBES", "ESTIMATORS", "SCREENS",
           "with_method"]


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
