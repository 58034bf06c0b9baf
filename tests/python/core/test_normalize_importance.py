"""oar.ops.normalize_importance (method.md section 5) against the float64 reference, edge rows, errors, opcheck,
every device (``device``: "cpu", and "cuda" where a GPU and the CUDA kernels are present; the CUDA cases compare
against the CPU op too), bad input as one table, torch.compile of the wrapper.
"""

from __future__ import annotations

import pytest
import torch

import oar  # noqa: F401  (loads the op library)
from oar import ops
from oar import reference as ref

from _devices import DEVICES, eager_checks, no_pending_device_errors, on, bad_input_tests, to_device  # noqa: F401
from _op_inputs import make_batch, reshape_case
from _tolerance import assert_within, gamma

REAL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("B,T", [(1, 1), (3, 47), (5, 131), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_normalize_matches_reference(B, T, dtype):
    _, scores, reason, _ = make_batch(B, T, seed=B * T, dtype=dtype)
    reason[0] = False  # an all-masked-out row
    got = ops.normalize_importance(scores, reason)
    want = ref.normalize_importance(scores.double(), reason)
    assert got.dtype == torch.float32 and got.shape == (B, T)
    # float32 scores: log1p((s - lo) / (1 + lo)) / log1p((hi - lo) / (1 + lo)) in float32, 3 roundings and a 2-ulp
    # log1p above, 2 and a 2-ulp log1p below, one division: 14 u relative (no cancellation); other dtypes run in
    # float64 and round once. (rule 2 of _tolerance.py)
    assert_within(got, want, gamma(16) * want.abs(), f"{dtype}")
    assert (got[~reason] == 0).all() and (got >= 0).all() and (got <= 1).all()


def test_normalize_hand_values_and_mask_forms():
    e = torch.e
    scores = torch.tensor([[0.0, e - 1, e * e - 1, 123.0], [4.0, 4.0, 4.0, 4.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # 0/1 integer mask is accepted
    got = ops.normalize_importance(scores, mask)
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.5, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    # Off-mask values are ignored, even NaN.
    s2 = scores.clone()
    s2[0, 3] = float("nan")
    torch.testing.assert_close(ops.normalize_importance(s2, mask.bool()), got)


def test_normalize_non_contiguous_and_empty():
    _, scores, reason, _ = make_batch(47, 5, seed=1)
    s_t, m_t = scores.t(), reason.t()  # (5, 47) views
    assert not s_t.is_contiguous()
    want = ref.normalize_importance(s_t, m_t)
    assert_within(ops.normalize_importance(s_t, m_t), want, gamma(16) * want.abs(), "strided")  # as above
    assert ops.normalize_importance(torch.empty(0, 7), torch.empty(0, 7, dtype=torch.bool)).shape == (0, 7)
    assert ops.normalize_importance(torch.empty(3, 0), torch.empty(3, 0, dtype=torch.bool)).shape == (3, 0)


def test_normalize_importance_subnormal_float64_range_is_finite():
    # A subnormal max-min range has no finite reciprocal: (0 - 0) * inf used to give NaN.
    s = torch.tensor([[5e-324, 0.0, 2.5e-324]], dtype=torch.float64)
    out = ops.normalize_importance(s, torch.ones(1, 3, dtype=torch.bool))
    assert torch.isfinite(out).all()
    assert out[0, 0] == 1.0 and out[0, 1] == 0.0 and 0.0 <= out[0, 2] <= 1.0
    tok, w = ops.reshape_advantages(torch.tensor([1.0]), s, torch.ones(1, 3, dtype=torch.bool),
                                    torch.ones(1, 3, dtype=torch.bool))
    assert torch.isfinite(w).all() and torch.isfinite(tok).all()


# ---- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.25])
def test_normalize_bad_scores(bad):
    scores = torch.ones(2, 3)
    scores[1, 2] = bad
    with pytest.raises(ValueError, match=r"scores must be finite and >= 0 .* got scores\[1, 2\]"):
        ops.normalize_importance(scores, torch.ones(2, 3, dtype=torch.bool))


def test_normalize_argument_errors():
    with pytest.raises(ValueError, match=r"scores must be 2-D \(B, T\), got shape \(6,\)"):
        ops.normalize_importance(torch.ones(6), torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask must be \(B, T\) = \(2, 3\), got \(3, 2\)"):
        ops.normalize_importance(torch.ones(2, 3), torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"scores must have dtype in \{.*\}, got Long"):
        ops.normalize_importance(torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be a bool"):
        ops.normalize_importance(torch.ones(2, 3), torch.ones(2, 3))


# Each row: (the callable: the wrapper or the raw op, its keyword arguments, the exception, a regex of the message).
# Tensors are moved to the device under test; meta tensors stay on meta.
S = torch.rand(2, 5, generator=torch.Generator().manual_seed(0))
M = torch.ones(2, 5, dtype=torch.bool)
NI, RAW = ops.normalize_importance, torch.ops.oar.normalize_importance
_NEG = S.clone()
_NEG[1, 2] = -1.0

#: Argument and data checks, on every device (CUDA: eager checks, the CPU's messages).
BAD_INPUT = [
    pytest.param(NI, dict(scores=torch.randn(6), mask=M), ValueError, r"scores must be 2-D \(B, T\)", id="scores_dim"),
    pytest.param(NI, dict(scores=_NEG, mask=M), ValueError, r"scores must be finite and >= 0.*\[1, 2\]",
                 id="negative_score"),
]

#: Checks of the arguments the dispatcher sees as None, and of the fake (meta) kernel.
BAD_INPUT_CPU = [
    # An undefined tensor used to be reported as shape (0,), dtype UNKNOWN_SCALAR or "tensor does not have a device".
    pytest.param(NI, dict(scores=S, mask=None), ValueError, r"mask must be a tensor, got None", id="mask_none"),
    pytest.param(RAW, dict(scores=None, mask=M), ValueError, r"scores must be a tensor, got None",
                 id="raw_scores_none"),
    # The fake kernel used to allocate on the first argument's device and return uninitialized memory.
    pytest.param(NI, dict(scores=S.to("meta"), mask=M), ValueError,
                 r"mask must be on the same device as scores \(meta\), got cpu", id="fake_mixed_devices"),
]


test_bad_input, test_bad_input_cpu = bad_input_tests(BAD_INPUT, BAD_INPUT_CPU)


# ---- every device (CUDA: parity with the CPU op; moved from test_cuda.py) ------------------------------------------

# The CUDA kernel keeps a row in shared memory (5 bytes a token) up to ~46k tokens on sm_90 (~32k on sm_80), in global
# memory beyond (T = 70,000). T = 9600: the dynamic part is below 48 KiB but static + dynamic is above (the window
# 9,495 <= T <= 9,830 that once failed to launch). T = 16384: the raised opt-in limit (dynamic part above 48 KiB).
SHAPES = [(1, 1), (3, 7), (5, 1000), (4, 4097), (3, 9600), (2, 16_384), (2, 70_000)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("B, T", SHAPES)
def test_normalize_importance_parity(device, dtype, B, T):
    _, scores, reason, _ = reshape_case(B, T, dtype, seed=B * T, empty_rows=(0,) if B > 2 else (),
                                        equal_rows=(1,) if B > 2 else ())
    cpu = ops.normalize_importance(scores, reason)
    dev = ops.normalize_importance(on(scores, device), on(reason, device))
    assert dev.dtype == torch.float32 and dev.shape == (B, T)
    torch.testing.assert_close(dev.cpu(), cpu, rtol=1e-6, atol=1e-7)
    assert torch.equal(dev.cpu()[~reason], torch.zeros(int((~reason).sum())))
    torch.testing.assert_close(dev.cpu(), ref.normalize_importance(scores, reason), rtol=1e-6, atol=1e-6)


# ---- dispatcher integration -------------------------------------------------------------------------------------


def test_opcheck():
    adv, scores, reason, resp = make_batch(3, 17, seed=2)
    torch.library.opcheck(torch.ops.oar.normalize_importance.default, (scores, reason))
    torch.library.opcheck(torch.ops.oar.normalize_importance.default, (scores.double(), reason.int()))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_on_device(device):
    g = torch.Generator().manual_seed(0)
    s = torch.rand(3, 9, generator=g)
    m = torch.rand(3, 9, generator=g) < 0.7
    torch.library.opcheck(torch.ops.oar.normalize_importance.default, (s.to(device), m.to(device)))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_wrapper_fullgraph(backend):
    """oar.ops.normalize_importance traces into one graph and gives the eager values exactly."""
    torch._dynamo.reset()
    _, scores, reason, _ = make_batch(4, 33, seed=6)

    def f(s, m):
        return ops.normalize_importance(s, m) * 2.0

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    assert torch.equal(compiled(scores, reason), f(scores, reason))
