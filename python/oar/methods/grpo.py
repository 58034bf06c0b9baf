"""GRPO and Dr. GRPO (method.md section 1): every eligible token gets its rollout's sequence advantage. They differ
only in the sequence advantages' estimator (``dr_grpo``: no std scaling), which the config schema sets
(:func:`oar.schema.with_method`); the pipeline's uniform credit does the rest."""

from oar.methods.base import UNIFORM, MethodSpec

GRPO = MethodSpec("grpo", UNIFORM)
DR_GRPO = MethodSpec("dr_grpo", UNIFORM)
