"""The credit-assignment methods, one module each, and :data:`METHOD_TABLE`, the pipeline's dispatch.

Adding a method is one module (a :class:`MethodSpec` and, if it scores tokens, its scorer) plus one row below, and
its name in the C++ schema (``oar::core::method_names()``).
"""

from __future__ import annotations

from oar.methods import entropy, entropy_shaping, grpo, ktae, oar_g, oar_p, random
from oar.methods.base import ADD, METHOD_TABLE, RESHAPE, UNIFORM, BonusScorer, Credit, MethodSpec, Step, TokenScorer
from oar.schema import METHODS

__all__ = ["METHOD_TABLE", "MethodSpec", "Step", "Credit", "UNIFORM", "RESHAPE", "ADD", "TokenScorer", "BonusScorer",
           "method_spec"]

# the rows of METHOD_TABLE (name -> MethodSpec), in the schema's order
METHOD_TABLE.update({s.name: s for s in (
    grpo.GRPO,
    grpo.DR_GRPO,
    random.SPEC,
    entropy.SPEC,
    entropy_shaping.SPEC,
    ktae.SPEC,
    oar_p.SPEC,
    oar_g.SPEC,
)})
if set(METHOD_TABLE) != set(METHODS):  # pragma: no cover - a schema change without a table row
    raise ImportError(f"oar.methods: METHOD_TABLE {sorted(METHOD_TABLE)} differs from the C++ schema {sorted(METHODS)}")


def method_spec(method: str) -> MethodSpec:
    """The :class:`MethodSpec` of ``method``. Raises ValueError naming :data:`oar.schema.METHODS`."""
    spec = METHOD_TABLE.get(method) if isinstance(method, str) else None
    if spec is None:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    return spec
