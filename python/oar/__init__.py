"""oar: Outcome-grounded Advantage Reshaping (OAR, arXiv 2601.07408) for GRPO-style RL of language models.

Token-level credit assignment: each reasoning token's influence on the model's final-answer distribution
(OAR-P: masking; OAR-G: gradient x input under embedding noise) reshapes the sequence advantage into
per-token advantages that keep the total advantage mass (docs/method.md).

Entry points:
    oar.ops            tensor operators (torch.ops.oar.*), documented wrappers
    oar.reference      plain-PyTorch references of every op
    oar.OARConfig      configuration (one schema with the C++ side)
    oar.token_advantages(...)  rewards -> per-token advantages in one call (custom training loops)
    oar.Pipeline, oar.RolloutBatch  the one method pipeline every trainer adapter uses (oar.pipeline, oar.batch;
                       one module per method in oar.methods)
    oar.baselines      entropy shaping, KTAE, IRPO rewards (oar.irpo_rewards)
    oar.build_info()   what this build contains; oar.has_cuda_kernels()
    oar.set_log_level("debug")  C++ planner + Python engine logging (or OAR_LOG_LEVEL=debug)
"""

from __future__ import annotations

import os
import warnings

from oar import _lib

__version__ = "0.1.0"

_C = _lib.load_extension()
from oar._logging import log_level, set_log_level  # noqa: E402

_logging._apply_environment()  # OAR_LOG_LEVEL, read once
# An OAR_CPU_ISA that this machine cannot run is refused here, at import, rather than by the first op.
_C.cpu_isa()
from oar import ops  # noqa: E402  (loads liboar_torch.so, registers torch.ops.oar.*)

from oar.schema import METHODS, GroupAdvantageOptions, OARConfig, ReshapeOptions  # noqa: E402  (the config schema)

from oar.batch import RolloutBatch, sequence_advantages  # noqa: E402
from oar.pipeline import Pipeline  # noqa: E402  (the one method pipeline)
from oar.api import token_advantages  # noqa: E402  (functional API)
from oar.baselines import irpo_advantages, irpo_rewards  # noqa: E402

#: Folder to put on CMAKE_PREFIX_PATH so that find_package(oar) finds this installation.
cmake_prefix_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "share", "cmake")


def build_info() -> dict:
    """What this build of oar contains.

    Returns a dict: ``version``, ``cuda_kernels`` (CUDA kernels compiled in), ``cuda_ops_registered``
    (CUDA implementations registered with the dispatcher), ``torch_built_against``, ``torch_runtime``,
    ``torch_cuda_built_against``, ``cuda_architectures``, ``ops_library`` (path loaded), ``cpu_isa`` (ISA
    level the CPU loops run at: ``"avx512f"``, ``"avx2"`` or ``"baseline"``; the best one the CPU supports unless
    the environment variable ``OAR_CPU_ISA`` forces one) and ``cpu_isas_supported`` (the levels this machine can
    run, best first).
    """
    info = dict(_C.build_info())
    import torch

    info["torch_runtime"] = torch.__version__
    info["ops_library"] = _lib.loaded_ops_library()
    return info


def has_cuda_kernels() -> bool:
    """True when this build registered CUDA implementations of the ops (torch.ops.oar.* on CUDA tensors)."""
    return bool(_C.build_info()["cuda_ops_registered"])


def _warn_missing_cuda_once() -> None:
    import torch

    if torch.cuda.is_available() and not has_cuda_kernels():
        warnings.warn(
            "oar was built without CUDA kernels but a GPU is present: oar ops on CUDA tensors will raise "
            "NotImplementedError. Rebuild with nvcc available (OAR_WITH_CUDA=ON ./setup.sh).",
            RuntimeWarning,
            stacklevel=2,
        )


_warn_missing_cuda_once()

__all__ = [
    "__version__",
    "ops",
    "OARConfig",
    "ReshapeOptions",
    "GroupAdvantageOptions",
    "METHODS",
    "token_advantages",
    "Pipeline",
    "RolloutBatch",
    "sequence_advantages",
    "irpo_rewards",
    "irpo_advantages",
    "build_info",
    "has_cuda_kernels",
    "cmake_prefix_path",
    "set_log_level",
    "log_level",
]
