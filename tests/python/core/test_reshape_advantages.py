"""oar.ops.reshape_advantages (method.md sections 5-6) against the float64 reference, the section 6 invariants as
hypothesis properties, errors, opcheck, every device (``device``: "cpu", and "cuda" where a GPU and the CUDA kernels
are present; the CUDA cases compare against the CPU op too), bad input as one table, torch.compile parity.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oar  # noqa: F401  (loads the op library)
from oar import ops
from oar import reference as ref

from _devices import DEVICES, eager_checks, no_pending_device_errors, on, bad_input_tests, to_device  # noqa: F401
from _op_inputs import make_batch, reshape_case
from _error_model import error_bound
from _tolerance import assert_within, assert_within_error_model, gamma, sum_bound, ulp

TIERS = ["both", "boost", "suppress"]
REAL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


# ---- reshape_advantages vs reference ------------------------------------------------------------------------------


def reshape_plain(adv, scores, reason, resp, dtype, q=0.25, beta=1.0, floor=0.1, tiers="both"):
    """Normalize + reshape in plain vectorized PyTorch, computed in ``dtype`` (float64: the truth of the error
    budgets, traced by _error_model.error_bound)."""
    eps = 1e-8
    rm, pm = reason.bool(), resp.bool()
    s = torch.log1p(scores.to(dtype))
    big = torch.finfo(dtype).max
    lo = torch.where(rm, s, torch.full_like(s, big)).amin(1, keepdim=True)
    hi = torch.where(rm, s, torch.full_like(s, -big)).amax(1, keepdim=True)
    x = torch.where(rm, (s - lo) / torch.where(hi > lo, hi - lo, torch.ones_like(hi)), torch.zeros_like(s))
    tau = torch.nanquantile(torch.where(rm, x, torch.full_like(x, float("nan"))), q, dim=1, keepdim=True)
    tau = torch.nan_to_num(tau, nan=0.0)
    sup = torch.ones_like(x) if tiers == "boost" else torch.clamp(x / (tau + eps), min=floor)
    boo = torch.ones_like(x) if tiers == "suppress" else 1.0 + beta * (x - tau) / (1.0 - tau + eps)
    w = torch.where(rm, torch.where(x < tau, sup, boo), torch.zeros_like(x))
    w = w * (rm.sum(1, keepdim=True).to(dtype) / w.sum(1, keepdim=True).clamp_min(1e-30))
    w = torch.where(rm, w, pm.to(dtype))
    return w * adv.to(dtype)[:, None], w


def assert_reshape_close(ta, w, adv, scores, reason, resp, **kw):
    """Rule 1: token advantages and weights within the float32 error model (_error_model.py) of the float64
    computation on the same inputs."""
    both = error_bound(lambda a, s: torch.stack(reshape_plain(a, s, reason, resp, torch.float64, **kw)), adv, scores)
    assert_within_error_model(ta, both[0], what=f"token advantages {kw}")
    assert_within_error_model(w, both[1], what=f"weights {kw}")


@pytest.mark.parametrize("tiers", TIERS)
@pytest.mark.parametrize("q,beta,floor", [(0.25, 1.0, 0.1), (0.5, 0.5, 0.0), (0.9, 2.0, 0.5), (0.05, 0.0, 0.3)])
def test_reshape_matches_reference(tiers, q, beta, floor):
    adv, scores, reason, resp = make_batch(9, 131, seed=int(q * 100) + len(tiers))
    kw = dict(q=q, beta=beta, floor=floor, tiers=tiers)
    ta, w = ops.reshape_advantages(adv, scores, reason, resp, **kw)
    ta_r, w_r = ref.reshape_advantages(adv, scores, reason, resp, **kw)
    assert ta.dtype == w.dtype == torch.float32 and ta.shape == w.shape == scores.shape
    assert_reshape_close(ta, w, adv, scores, reason, resp, **kw)
    # The row-loop reference (float64, outputs rounded to float32) is a second float32-output computation: rule 1.
    assert_reshape_close(ta_r, w_r, adv, scores, reason, resp, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_reshape_dtypes(dtype):
    adv, scores, reason, resp = make_batch(4, 47, seed=3, dtype=dtype)
    ta, w = ops.reshape_advantages(adv.to(dtype), scores, reason, resp)
    assert ta.dtype == w.dtype == torch.float32
    assert_reshape_close(ta, w, adv.to(dtype).double(), scores.double(), reason, resp)  # on the rounded inputs


def test_reshape_normalized_scores_path():
    adv, scores, reason, resp = make_batch(6, 47, seed=5)
    s_hat = ops.normalize_importance(scores, reason)
    a = ops.reshape_advantages(adv, scores, reason, resp)
    b = ops.reshape_advantages(adv, s_hat, reason, resp, scores_are_normalized=True)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)


def test_reshape_hand_example():
    # One row: response = 6 tokens + 2 padding, reasoning = tokens 1..4 with s_hat {0, 0.5, 1, 0.25}, q = 0.5:
    # tau = 0.375; raw w = {0.1, 1.2, 2, 2/3} (floor, boost, boost, suppress); scale 4 / 3.9667.
    s_hat = torch.tensor([[0.7, 0.0, 0.5, 1.0, 0.25, 0.3, 0.9, 0.9]])
    reason = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    resp = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    ta, w = ops.reshape_advantages(torch.tensor([-2.0]), s_hat, reason, resp, q=0.5, scores_are_normalized=True)
    eps, tau = 1e-8, 0.375
    raw = torch.tensor([0.1, 1 + 0.125 / (1 - tau + eps), 1 + 0.625 / (1 - tau + eps), 0.25 / (tau + eps)],
                       dtype=torch.float64)
    span = raw * 4 / raw.sum()
    want = torch.tensor([1.0, *span.tolist(), 1.0, 0.0, 0.0])
    torch.testing.assert_close(w[0], want.float())
    torch.testing.assert_close(ta[0], -2.0 * want.float())


def test_reshape_edge_rows():
    T = 5
    adv = torch.tensor([1.5, -1.0, 2.0, 0.7, 0.0])
    scores = torch.rand(5, T) * 3
    resp = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]).bool()
    reason = torch.tensor([[0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]).bool()
    scores[3] = 2.5  # all-equal scores -> plain GRPO
    ta, w = ops.reshape_advantages(adv, scores, reason, resp)
    torch.testing.assert_close(w[0], resp[0].float())  # no reasoning span: 1 on the response
    assert (w[1] == 0).all() and (ta[1] == 0).all()  # empty response
    torch.testing.assert_close(w[2], torch.ones(T))  # span of one token
    assert torch.equal(w[3], torch.ones(T))  # all-equal scores: exactly 1
    assert torch.equal(ta[4], torch.zeros(T)) and (w[4] >= 0).all()  # A = 0 stays 0
    for B, T2 in [(0, 4), (3, 0)]:
        out = ops.reshape_advantages(torch.zeros(B), torch.zeros(B, T2), torch.zeros(B, T2, dtype=torch.bool),
                                     torch.zeros(B, T2, dtype=torch.bool))
        assert out[0].shape == out[1].shape == (B, T2)


def test_reshape_non_contiguous():
    adv, scores, reason, resp = make_batch(47, 8, seed=8)
    args = (adv[::2], scores[::2], reason[::2], resp[::2])
    assert not args[0].is_contiguous() and not args[1].is_contiguous()
    got = ops.reshape_advantages(*args)
    want = ops.reshape_advantages(*(a.contiguous() for a in args))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_boost_only_and_suppress_only_tiers():
    adv, scores, reason, resp = make_batch(6, 64, seed=21, zeros=0.0)
    s_hat = ops.normalize_importance(scores, reason)
    for b in range(6):
        x = s_hat[b][reason[b]]
        if x.numel() < 2:
            continue
        tau = torch.quantile(x.double(), 0.25).item()
        _, wb = ops.reshape_advantages(adv, scores, reason, resp, tiers="boost")
        _, ws = ops.reshape_advantages(adv, scores, reason, resp, tiers="suppress")
        # The op's tau and torch's interpolate the same float32 order statistics: they may differ by an ulp of
        # tau, so tokens that close to it may sit in either tier. Away from it the shared weights are the same
        # float64 product rounded once (exactly equal), and the tier order is exact (monotone rounding).
        margin = float(ulp(tau))
        low, high = x < tau - margin, x >= tau + margin
        wbx, wsx = wb[b][reason[b]], ws[b][reason[b]]
        # boost-only: every low token shares one weight (1 before rescaling), the boosted ones are >= it
        if low.any():
            assert torch.equal(wbx[low], wbx[low][0].expand(int(low.sum())))
            assert (wbx[x >= tau] >= wbx[low][0]).all()
        # suppress-only: every high token shares one weight, the suppressed ones are <= it
        if high.any():
            assert torch.equal(wsx[high], wsx[high][0].expand(int(high.sum())))
            assert (wsx[x < tau] <= wsx[high][0]).all()


# ---- invariants (method.md section 6) as properties ---------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 6),
    T=st.integers(1, 70),
    seed=st.integers(0, 2**31 - 1),
    q=st.floats(0.01, 0.99),
    beta=st.floats(0.0, 3.0),
    floor=st.floats(0.0, 0.95),
    tiers=st.sampled_from(TIERS),
    equal=st.booleans(),
)
def test_property_invariants(B, T, seed, q, beta, floor, tiers, equal):
    adv, scores, reason, resp = make_batch(B, T, seed=seed)
    adv[0] = 0.0
    if equal:
        scores = torch.full_like(scores, 0.37)
    ta, w = ops.reshape_advantages(adv, scores, reason, resp, q=q, beta=beta, floor=floor, tiers=tiers)
    n_resp = resp.sum(1).double()
    # masked sum of token advantages == |response| * A. The op scales the weights in float64 so that they sum to
    # the span length exactly, then rounds each weight and each w * A once to float32 (2 u |ta_t|); the sums
    # here run in float64.
    abs_ta = (ta.double().abs() * resp).sum(1)
    budget = gamma(2) * abs_ta + sum_bound(abs_ta, T, torch.float64)
    assert_within((ta.double() * resp).sum(1), n_resp * adv.double(), budget, "token advantage mass")
    # the span keeps its mass: one float32 rounding per weight
    abs_w = (w.double() * reason).sum(1)
    budget = gamma(1) * abs_w + sum_bound(abs_w, T, torch.float64)
    assert_within((w.double() * reason).sum(1), reason.sum(1).double(), budget, "span mass")
    assert (w >= 0).all()
    assert (w[~resp] == 0).all() and (ta[~resp] == 0).all()  # padding
    assert (w[resp & ~reason] == 1).all()  # response tokens outside the span
    assert (ta[0] == 0).all()  # A = 0 stays 0
    # sign preserved (strictly wherever the weight is positive, which a floor that survives float32 rounding
    # of the rescaled weight guarantees)
    assert ((ta * adv[:, None]) >= 0).all()
    pos = w > 1e-30  # a denormal weight (floor ~ 1e-45) times A can underflow to 0 in float32
    assert (torch.sign(ta[pos]) == torch.sign(adv[:, None].expand_as(ta)[pos])).all()
    if floor >= 1e-3:
        assert (w[reason] > 0).all()
    if equal:
        assert torch.equal(w, resp.float())  # all-equal scores: plain GRPO exactly
    # Tier ablations: boost-only gives every token below tau the same weight (1 before rescaling) and no
    # more to any token above; suppress-only mirrors it. Tokens within 1e-6 of tau are left out (rounding).
    s_hat = ops.normalize_importance(scores, reason).double()
    for b in range(B):
        x, wx = s_hat[b][reason[b]], w[b][reason[b]].double()
        if x.numel() == 0:
            continue
        tau = torch.quantile(x, q).item()
        margin = float(ulp(tau))  # the op's tau vs torch's: same float32 order statistics, an ulp apart at most
        low, high = x < tau - margin, x > tau + margin
        if tiers == "boost" and low.any():
            assert torch.equal(wx[low], wx[low][0].expand(int(low.sum())))  # one float64 product, rounded once
            assert (wx[x >= tau] >= wx[low][0]).all()  # boost >= 1: exact order after monotone rounding
        if tiers == "suppress" and high.any():
            assert torch.equal(wx[high], wx[high][0].expand(int(high.sum())))
            assert (wx[x < tau] <= wx[high][0]).all()


# ---- errors -----------------------------------------------------------------------------------------------------


def _ok():
    adv, scores, reason, resp = make_batch(2, 5, seed=0)
    return adv, scores, reason, resp


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(q=0.0), r"q must be in \(0, 1\), got 0"),
        (dict(q=1.0), r"q must be in \(0, 1\), got 1"),
        (dict(q=1.5), r"q must be in \(0, 1\), got 1.5"),
        (dict(beta=-0.5), r"beta must be finite and >= 0, got -0.5"),
        (dict(floor=1.0), r"floor must be in \[0, 1\), got 1"),
        (dict(floor=-0.1), r"floor must be in \[0, 1\), got -0.1"),
        (dict(tiers="boost_only"), r'tiers must be one of \{"both", "boost", "suppress"\}, got "boost_only"'),
    ],
)
def test_reshape_option_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        ops.reshape_advantages(*_ok(), **kw)


def test_reshape_argument_errors():
    adv, scores, reason, resp = _ok()
    with pytest.raises(ValueError, match=r"advantages must be \(B,\) with B = scores.size\(0\) = \(2,\), got \(3,\)"):
        ops.reshape_advantages(torch.zeros(3), scores, reason, resp)
    with pytest.raises(ValueError, match=r"scores must be 2-D \(B, T\)"):
        ops.reshape_advantages(adv, scores[0], reason, resp)
    with pytest.raises(ValueError, match=r"reasoning_mask must be \(B, T\) = \(2, 5\), got \(2, 4\)"):
        ops.reshape_advantages(adv, scores, reason[:, :4], resp)
    with pytest.raises(ValueError, match=r"response_mask must be \(B, T\) = \(2, 5\), got \(5, 2\)"):
        ops.reshape_advantages(adv, scores, reason, resp.t())
    with pytest.raises(ValueError, match=r"advantages must have dtype in"):
        ops.reshape_advantages(torch.zeros(2, dtype=torch.int64), scores, reason, resp)
    with pytest.raises(ValueError, match=r"advantages must be finite, got advantages\[1\] = nan"):
        ops.reshape_advantages(torch.tensor([0.0, float("nan")]), scores, reason, resp)


def test_reshape_subset_and_score_errors():
    adv = torch.ones(1)
    resp = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    reason = torch.tensor([[1, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match=r"reasoning_mask must be a subset of response_mask, .*\[0, 3\]"):
        ops.reshape_advantages(adv, torch.ones(1, 4), reason, resp)
    reason = resp.clone()
    for bad in (float("nan"), float("inf"), -1.0):
        s = torch.ones(1, 4)
        s[0, 1] = bad
        with pytest.raises(ValueError, match=r"scores must be finite and >= 0 .*scores\[0, 1\]"):
            ops.reshape_advantages(adv, s, reason, resp)
    with pytest.raises(ValueError, match=r"scores must lie in \[0, 1\] .*scores_are_normalized=True.*scores\[0, 2\]"):
        ops.reshape_advantages(adv, torch.tensor([[0.0, 0.5, 1.5, 9.0]]), reason, resp, scores_are_normalized=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reshape_device_mismatch():
    adv, scores, reason, resp = _ok()
    with pytest.raises((ValueError, RuntimeError, NotImplementedError)):
        torch.ops.oar.reshape_advantages(adv.cuda(), scores, reason, resp)


def test_reshape_huge_beta_raises_instead_of_nan_weights():
    S, M, A = _bad_input_args()
    with pytest.raises(ValueError, match=r"beta = 1e\+308 makes the boost weights .* overflow float32"):
        ops.reshape_advantages(A, S, M, M, beta=1e308)
    tok, w = ops.reshape_advantages(A, S, M, M, beta=1e30)  # large but representable: still finite
    assert torch.isfinite(tok).all() and torch.isfinite(w).all()


def _bad_input_args():
    S = torch.rand(2, 5, generator=torch.Generator().manual_seed(0))
    return S, torch.ones(2, 5, dtype=torch.bool), torch.tensor([1.0, -1.0])


# Each row: (the callable: the wrapper or the raw op, its keyword arguments, the exception, a regex of the message).
# Tensors are moved to the device under test; meta tensors stay on meta.
S, M, A = _bad_input_args()
_SUB = M.clone()
_SUB[0, 1] = False
RA, RAW = ops.reshape_advantages, torch.ops.oar.reshape_advantages


def _args(**over):
    kw = dict(advantages=A, scores=S, reasoning_mask=M, response_mask=M)
    kw.update(over)
    return kw


#: Argument and data checks, on every device (CUDA: eager checks, the CPU's messages).
BAD_INPUT = [
    pytest.param(RA, _args(advantages=torch.ones(2), q=1.5), ValueError, r"q must be in \(0, 1\)", id="q_range"),
    pytest.param(RA, _args(advantages=torch.ones(2), response_mask=_SUB), ValueError,
                 r"reasoning_mask must be a subset of response_mask", id="not_subset"),
    pytest.param(RA, _args(advantages=torch.tensor([1.0, float("nan")])), ValueError,
                 r"advantages must be finite, got advantages\[1\]", id="nan_advantage"),
]

#: Checks of the Python wrapper's arguments, of arguments the dispatcher sees as None, of the fake (meta) kernel, and
#: float32 overflow edge cases of the CPU kernel.
BAD_INPUT_CPU = [
    pytest.param(RA, _args(advantages=torch.tensor([3e38, 1.0])), ValueError,
                 r"advantages\[0\] = 3e\+38 times its weight .* overflows float32", id="token_advantage_overflow"),
    pytest.param(RA, _args(advantages=torch.tensor([1e300, 1.0], dtype=torch.float64)), ValueError,
                 r"advantages must fit in float32 .*got advantages\[0\] = 1e\+300", id="float64_advantages_too_large"),
    pytest.param(RA, _args(q="0.3"), ValueError, r"q must be a real number, got str '0.3'", id="q_str"),
    pytest.param(RA, _args(q=None), ValueError, r"q must be a real number, got NoneType None", id="q_none"),
    pytest.param(RA, _args(beta=True), ValueError, r"beta must be a real number, got bool True", id="beta_bool"),
    pytest.param(RA, _args(floor="x"), ValueError, r"floor must be a real number, got str 'x'", id="floor_str"),
    pytest.param(RA, _args(tiers=None), ValueError, r"tiers must be a str, got NoneType None", id="tiers_none"),
    pytest.param(RA, _args(scores_are_normalized="false"), ValueError,
                 r"scores_are_normalized must be True or False, got str 'false'", id="scores_are_normalized_str"),
    # An undefined tensor used to be reported as shape (0,), dtype UNKNOWN_SCALAR or "tensor does not have a device".
    pytest.param(RAW, _args(advantages=None), ValueError, r"advantages must be a tensor, got None",
                 id="raw_advantages_none"),
    pytest.param(RAW, _args(response_mask=None), ValueError, r"response_mask must be a tensor, got None",
                 id="raw_response_mask_none"),
    # The fake kernel used to allocate on the first argument's device and return uninitialized memory.
    pytest.param(RA, _args(advantages=A.to("meta")), ValueError,
                 r"advantages must be on the same device as scores \(cpu\), got meta", id="fake_mixed_devices"),
]


test_bad_input, test_bad_input_cpu = bad_input_tests(BAD_INPUT, BAD_INPUT_CPU)


# ---- every device (CUDA: parity with the CPU op; moved from test_cuda.py) ------------------------------------------

# The CUDA kernel keeps a row in shared memory (5 bytes a token) up to ~46k tokens on sm_90 (~32k on sm_80), in global
# memory beyond (T = 70,000). T = 9600: the dynamic part is below 48 KiB but static + dynamic is above (the window
# 9,495 <= T <= 9,830 that once failed to launch). T = 16384: the raised opt-in limit (dynamic part above 48 KiB).
SHAPES = [(1, 1), (3, 7), (5, 1000), (4, 4097), (3, 9600), (2, 16_384), (2, 70_000)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiers", ["both", "boost", "suppress"])
@pytest.mark.parametrize("normalized", [False, True])
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("B, T", SHAPES)
def test_reshape_advantages_parity(device, tiers, normalized, dtype, B, T):
    adv, scores, reason, resp = reshape_case(B, T, dtype, seed=7 + B + T, ties=(T == 1000),
                                             empty_rows=(0,) if B > 2 else (), equal_rows=(1,) if B > 2 else ())
    if normalized:
        scores = ops.normalize_importance(scores, reason).to(dtype)
    kw = dict(q=0.3, beta=1.5, floor=0.05, tiers=tiers, scores_are_normalized=normalized)
    tok_c, w_c = ops.reshape_advantages(adv, scores, reason, resp, **kw)
    tok_d, w_d = ops.reshape_advantages(on(adv, device), on(scores, device), on(reason, device), on(resp, device), **kw)
    assert tok_d.dtype == w_d.dtype == torch.float32 and tok_d.shape == w_d.shape == (B, T)
    torch.testing.assert_close(w_d.cpu(), w_c, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(tok_d.cpu(), tok_c, rtol=2e-6, atol=2e-6)
    w = w_d.cpu()
    # Padding is 0, response tokens outside the span 1, a row with an empty span or all-equal scores exactly 1.
    assert torch.equal(w[~resp], torch.zeros(int((~resp).sum())))
    assert torch.equal(w[resp & ~reason], torch.ones(int((resp & ~reason).sum())))
    if B > 2 and not normalized:
        assert torch.equal(w[1][resp[1]], torch.ones(int(resp[1].sum())))
    # Mass preservation: each row's token advantages sum to |response| * A.
    want = resp.sum(1).double() * adv.double()
    torch.testing.assert_close(tok_d.cpu().double().sum(1), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q", [0.01, 0.25, 0.5, 0.99])
@pytest.mark.parametrize("T", [2, 3, 17, 256, 3000])
def test_reshape_quantile_edge_levels_match_reference(device, q, T):
    # tau interpolates between order statistics k and k + 1 (numpy "linear"); ties included.
    adv, scores, reason, resp = reshape_case(6, T, torch.float32, seed=T, ties=True)
    tok_d, w_d = ops.reshape_advantages(on(adv, device), on(scores, device), on(reason, device), on(resp, device), q=q)
    tok_r, w_r = ref.reshape_advantages(adv, scores, reason, resp, q=q)
    torch.testing.assert_close(w_d.cpu(), w_r, rtol=1e-5, atol=1e-5)
    tok_c, w_c = ops.reshape_advantages(adv, scores, reason, resp, q=q)
    torch.testing.assert_close(w_d.cpu(), w_c, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_zero_length_and_empty_batch(device):
    a = torch.tensor([1.0, -2.0])
    s = torch.zeros(2, 0)
    m = torch.zeros(2, 0, dtype=torch.bool)
    tok, w = ops.reshape_advantages(on(a, device), on(s, device), on(m, device), on(m, device))
    assert tok.shape == w.shape == (2, 0)
    tok, w = ops.reshape_advantages(on(torch.zeros(0), device), on(torch.zeros(0, 5), device),
                                    on(torch.zeros(0, 5, dtype=torch.bool), device),
                                    on(torch.zeros(0, 5, dtype=torch.bool), device))
    assert tok.shape == (0, 5)
    assert ops.normalize_importance(on(torch.zeros(0, 3), device),
                                    on(torch.zeros(0, 3, dtype=torch.bool), device)).shape == (0, 3)


# ---- dispatcher integration ----------------------------------------------------------------------------------------


def test_opcheck():
    adv, scores, reason, resp = make_batch(3, 17, seed=2)
    torch.library.opcheck(torch.ops.oar.reshape_advantages.default, (adv, scores, reason, resp))
    torch.library.opcheck(
        torch.ops.oar.reshape_advantages.default,
        (adv.double(), scores.half(), reason, resp),
        {"q": 0.5, "beta": 2.0, "floor": 0.0, "tiers": "suppress"},
    )
    # inputs that require grad: no autograd kernel is needed, outputs are constants
    a, s = adv.clone().requires_grad_(), scores.clone().requires_grad_()
    torch.library.opcheck(torch.ops.oar.reshape_advantages.default, (a, s, reason, resp))
    ta, w = ops.reshape_advantages(a, s, reason, resp)
    assert not ta.requires_grad and not w.requires_grad


def test_torch_compile_parity():
    adv, scores, reason, resp = make_batch(4, 33, seed=6)

    def f(a, s, rm, pm):
        ta, w = ops.reshape_advantages(a, s, rm, pm, q=0.3)
        return ta * 2.0, w

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = compiled(adv, scores, reason, resp)
    want = f(adv, scores, reason, resp)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_vectorized_reference_matches_ops():
    """The benchmarks' "what a user would write" provider computes the same thing as the op."""
    from oar import reference

    g = torch.Generator().manual_seed(5)
    B, T = 7, 131
    adv = torch.randn(B, generator=g)
    scores = torch.rand(B, T, generator=g) * 3
    resp = torch.rand(B, T, generator=g) < 0.9
    reason = resp & (torch.rand(B, T, generator=g) < 0.7)
    reason[2] = False  # empty span
    exp_tok, exp_w = ops.reshape_advantages(adv, scores, reason, resp)
    got_tok, got_w = reference.reshape_advantages_vectorized(adv, scores, reason, resp)
    # Both are float32 computations of the same function: each within rule 1 of the float64 computation.
    assert_reshape_close(exp_tok, exp_w, adv, scores, reason, resp)
    assert_reshape_close(got_tok, got_w, adv, scores, reason, resp)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_on_device(device):
    g = torch.Generator().manual_seed(0)
    s = torch.rand(3, 9, generator=g)
    m = torch.rand(3, 9, generator=g) < 0.7
    resp = torch.ones(3, 9, dtype=torch.bool)
    args = (torch.randn(3, generator=g), s, m, resp)
    torch.library.opcheck(torch.ops.oar.reshape_advantages.default, tuple(a.to(device) for a in args))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_wrapper_fullgraph(backend):
    """oar.ops.reshape_advantages traces into one graph (Python scalars coerced at trace time) and gives the eager
    values exactly, with the default and with explicit options."""
    torch._dynamo.reset()
    adv, scores, reason, resp = make_batch(4, 33, seed=6)

    def f(a, s, rm, pm):
        ta, w = ops.reshape_advantages(a, s, rm, pm, q=0.3, beta=2, floor=0.05, tiers="boost")
        ta2, w2 = ops.reshape_advantages(a, ops.normalize_importance(s, rm), rm, pm, scores_are_normalized=True)
        return ta, w, ta2, w2

    got = torch.compile(f, backend=backend, fullgraph=True)(adv, scores, reason, resp)
    for g, e in zip(got, f(adv, scores, reason, resp)):
        assert torch.equal(g, e)
