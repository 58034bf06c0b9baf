"""The device parameter of the per-op test files: every op test that runs on CUDA too takes ``device`` from
:data:`DEVICES` ("cpu", and "cuda" skipped with its reason where no GPU is present or oar was built without CUDA
kernels; ``pytest -rs`` prints it). CUDA cases carry the ``cuda`` marker: ``pytest -m cuda`` runs every CUDA test
of the suite (benchmarks/gpu/run_gpu_checks.sh).

Import the fixtures into a test module to use them: ``no_pending_device_errors`` (autouse there: every test
starts and ends with no unraised device error, so a lazily checked error cannot leak into the next test) and
``eager_checks`` (every CUDA op checks its data before returning, with the CPU's exact messages).
"""

from __future__ import annotations

import pytest
import torch

import oar
from oar import cuda_checks

if not torch.cuda.is_available():
    CUDA_SKIP_REASON = "no CUDA device on this machine (torch.cuda.is_available() is False)"
elif not oar.has_cuda_kernels():
    CUDA_SKIP_REASON = "oar was built without CUDA kernels (no nvcc at build time, or a CPU-only torch)"
else:
    CUDA_SKIP_REASON = None

#: Marks of a CUDA-only test (or parameter).
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=CUDA_SKIP_REASON or "")]

#: ``@pytest.mark.parametrize("device", DEVICES)``: the CPU and the first CUDA device.
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS, id="cuda")]

#: For tests that compare a device against the CPU (parity): the non-CPU devices only.
OTHER_DEVICES = [pytest.param("cuda", marks=CUDA_MARKS, id="cuda")]


def cuda_test(fn):
    """Marks a test that needs a CUDA device (stream, device guard, lazy checks)."""
    for mark in CUDA_MARKS:
        fn = mark(fn)
    return fn


def gen(seed: int) -> torch.Generator:
    """A CPU generator: inputs are drawn on the host, then moved, so every device sees the same values."""
    return torch.Generator().manual_seed(seed)


def on(t, device):
    """Host tensor -> ``device`` (None stays None)."""
    return None if t is None else t.to(device)


@pytest.fixture(autouse=True)
def no_pending_device_errors():
    """Every test starts and ends with no unraised device error (a lazy error would leak into the next test)."""
    if CUDA_SKIP_REASON is None:
        cuda_checks.check_cuda_errors()
    yield
    if CUDA_SKIP_REASON is None:
        torch.cuda.synchronize()
        cuda_checks.check_cuda_errors()


@pytest.fixture
def eager_checks():
    """Every CUDA op checks its data before returning (the CPU's exact messages)."""
    prev = cuda_checks.set_cuda_checks("eager")
    yield
    cuda_checks.set_cuda_checks(prev)


def to_device(kwargs: dict, device) -> dict:
    """The keyword arguments of a bad-input table row on ``device``: tensors moved, meta tensors and the rest kept."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
            for k, v in kwargs.items()}


def bad_input_tests(table: list, cpu_table: list):
    """The two bad-input tests of an op's file, from its tables of ``(fn, kwargs, exception, message regex)`` rows:
    ``table`` runs on every device of :data:`DEVICES` (CUDA with eager checks), ``cpu_table`` on the CPU only.
    Use as ``test_bad_input, test_bad_input_cpu = bad_input_tests(BAD_INPUT, BAD_INPUT_CPU)``."""

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("fn, kwargs, exc, match", table)
    def test_bad_input(device, fn, kwargs, exc, match, eager_checks):
        with pytest.raises(exc, match=match):
            fn(**to_device(kwargs, device))

    @pytest.mark.parametrize("fn, kwargs, exc, match", cpu_table)
    def test_bad_input_cpu(fn, kwargs, exc, match):
        with pytest.raises(exc, match=match):
            fn(**kwargs)

    return test_bad_input, test_bad_input_cpu
