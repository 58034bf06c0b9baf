"""Attribution of reasoning tokens against the final-answer distribution (method.md sections 2-4, 8)."""

from oar.attribution.context import DEFAULT_ACTION_MARKERS, DEFAULT_MARKERS, ProbeBatch, ProbeContextBuilder, reasoning_length
from oar.attribution.base import Attribution, CleanPass, clean_probe_logits
from oar.attribution.entropy import entropy_scores, policy_entropies
from oar.attribution.oar_g import oar_g_scores
from oar.attribution.oar_p import oar_p_scores
from oar.attribution.random import random_scores
from oar.attribution.window import oar_p_window_scores
from oar.attribution.linear_tail import linear_tail_support, oar_p_linear_tail_scores
from oar.attribution.screened import oar_p_screened_scores
from oar.attribution.model import (
    EmbeddingNoiseModel,
    NoisedEmbeddings,
    PrefixCacheModel,
    ProbeCapabilities,
    ProbeModel,
    SharedPrefixModel,
    WindowMasks,
    probe_capabilities,
)
from oar.attribution.hf_model import HFProbeModel, as_probe_model

__all__ = [
    "DEFAULT_MARKERS", "DEFAULT_ACTION_MARKERS", "ProbeBatch", "ProbeContextBuilder", "reasoning_length", "Attribution", "CleanPass",
    "clean_probe_logits", "entropy_scores", "policy_entropies", "oar_g_scores", "oar_p_scores", "oar_p_window_scores",
    "random_scores", "HFProbeModel", "ProbeModel", "PrefixCacheModel", "SharedPrefixModel", "ProbeCapabilities",
    "as_probe_model", "probe_capabilities", "EmbeddingNoiseModel", "NoisedEmbeddings", "oar_p_screened_scores",
    "WindowMasks", "oar_p_linear_tail_scores", "linear_tail_support",
]
