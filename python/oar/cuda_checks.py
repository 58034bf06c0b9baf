"""When the CUDA kernels' data checks are read back (src/torch/cuda_checks.h; docs/design.md, "CUDA input validation").

The CUDA kernels validate data (NaN rewards, out-of-range ids, ...) on the device and record errors in a
per-device record instead of synchronizing. Step-level ops (group_advantages, normalize_importance,
reshape_advantages) always read it back; the hot-path ops (probe_divergence + backward, grad_x_input,
build_masked_batch) only in ``"eager"`` mode; in ``"lazy"`` mode (the default) their errors surface at the next
check on that device.

The state lives in the op library (liboar_torch.so), reached through three ops that take no tensors
(``torch.ops.oar._set_cuda_checks`` / ``_get_cuda_checks`` / ``_take_cuda_error``, registered by CUDA builds).
The same functions are re-exported by :mod:`oar.ops`, where they were documented first.
"""

from __future__ import annotations

import torch

from oar import _lib

__all__ = ["set_cuda_checks", "cuda_checks", "check_cuda_errors"]

_MODES = ("lazy", "eager")


_REGISTERED: list[bool] = []


def _registered() -> bool:
    """Whether this build registered the CUDA kernels (and with them the check ops)."""
    if not _REGISTERED:
        _lib.load_ops_library()
        _REGISTERED.append(bool(_lib.load_extension().build_info()["cuda_ops_registered"]))
    return _REGISTERED[0]


def set_cuda_checks(mode: str) -> str:
    """Sets when the hot-path CUDA ops read their device error record back (process-wide).

    Args:
        mode: ``"lazy"`` (default; no host synchronization: a bad row gets NaN, or an all-PAD variant, and
            the error is raised by the next step-level op or :func:`check_cuda_errors` on that device) or
            ``"eager"`` (every call waits for its kernels and raises the CPU's exact ``ValueError``). The
            environment variable ``OAR_CUDA_CHECKS`` sets the initial mode.

    Returns:
        The previous mode (``"lazy"`` when ``OAR_CUDA_CHECKS`` held an invalid value). In a build without CUDA
        kernels the call only validates ``mode`` and returns ``"lazy"``.

    Raises:
        ValueError: ``mode`` is not ``"lazy"`` or ``"eager"``.
    """
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if not _registered():
        return "lazy"
    return torch.ops.oar._set_cuda_checks(mode)


def cuda_checks() -> str:
    """The current CUDA check mode, ``"lazy"`` or ``"eager"`` (see :func:`set_cuda_checks`); always ``"lazy"`` in
    a build without CUDA kernels.

    Raises:
        ValueError: ``OAR_CUDA_CHECKS`` holds another value (and no mode was set explicitly).
    """
    if not _registered():
        return "lazy"
    return torch.ops.oar._get_cuda_checks()


def check_cuda_errors(device=None) -> None:
    """Raises the data error that an oar CUDA op recorded on ``device`` and nobody raised yet.

    Waits for the work queued on the device's current stream (one 64-byte copy). Call it where a lazily
    checked op's result is consumed, e.g. once per attribution batch.

    Args:
        device: a CUDA device (``torch.device``, ``"cuda:1"`` or an index); default: the current device.
            A no-op when CUDA was never initialized in this process or the build has no CUDA kernels.

    Raises:
        ValueError: the recorded error (op, what was wrong, first index and value); or ``device`` is not a
            CUDA device of this machine.
    """
    if device is None:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        index = torch.cuda.current_device()
    else:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device!r}")
        if not torch.cuda.is_initialized():
            return
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    if not _registered():
        return
    msg = torch.ops.oar._take_cuda_error(int(index))
    if msg:
        raise ValueError(msg)
