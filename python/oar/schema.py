"""The configuration schema's one Python home: ``OARConfig`` and the option structs, defined, parsed and validated
by the C++ core (``include/oar/core/config.h``, ``src/core/config.cpp``: every key, its default and its checks,
one schema for C++ and Python) and exposed by the pybind11 module ``oar._C``. Library modules import them from
here, never from the package facade ``oar`` (docs/architecture.md).

- ``OARConfig``: ``OARConfig(method=..., ...)`` or ``OARConfig.from_json(text)`` (unknown keys and bad values
  raise ValueError naming the key); ``to_json()`` round-trips (docs/config.md).
- ``ReshapeOptions``, ``GroupAdvantageOptions``: the nested option structs (``cfg.reshape``, ``cfg.advantages``).
"""

from __future__ import annotations

from oar._lib import load_extension

_C = load_extension()

OARConfig = _C.OARConfig
ReshapeOptions = _C.ReshapeOptions
GroupAdvantageOptions = _C.GroupAdvantageOptions

__all__ = ["OARConfig", "ReshapeOptions", "GroupAdvantageOptions"]
