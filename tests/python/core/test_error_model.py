"""The error model of the tests (_error_model.py): its bounds hold for float32 evaluations in different orders,
match the closed forms where there is one, and refuse what they cannot bound (docs/design.md, "Test tolerances")."""

import math

import pytest
import torch

from _error_model import (Bounded, _gamma, entropy, error_bound, probe_divergence_error_bound, random_rounding)
from _tolerance import assert_within_error_model

U = 2.0**-24


def _orders(x32):
    """The float32 sum of x32 in four orders: sequential, reversed, pairwise, 8 SIMD-like lanes."""
    seq = torch.zeros((), dtype=torch.float32)
    for v in x32:
        seq = seq + v
    rev = torch.zeros((), dtype=torch.float32)
    for v in x32.flip(0):
        rev = rev + v
    pair = x32.clone()
    while pair.numel() > 1:
        if pair.numel() % 2:
            pair = torch.cat([pair, torch.zeros(1)])
        pair = pair[0::2] + pair[1::2]
    lanes = torch.zeros(8, dtype=torch.float32)
    for i in range(0, x32.numel(), 8):
        chunk = x32[i: i + 8]
        lanes[: chunk.numel()] += chunk
    return [seq, rev, pair[0], lanes.sum()]


def test_sum_bound_is_the_closed_form_and_holds_in_every_order():
    g = torch.Generator().manual_seed(0)
    n = 50
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 4, (n,), generator=g)
    exact = error_bound(lambda t: t.sum(), x)
    assert exact.value == x.double().sum()
    want = n * U / (1 - n * U) * float(x.double().abs().sum())  # gamma_{n-1} of n terms, n = 50: the worst case
    assert math.isclose(float(exact.bound), (n - 1) * U / (1 - (n - 1) * U) * float(x.double().abs().sum()),
                        rel_tol=1e-12) and float(exact.bound) <= want
    assert float(exact.bound_ref) == 0.0
    for got in _orders(x.float()):
        assert abs(float(got) - float(exact.value)) <= float(exact.bound)


def test_long_sums_use_the_probabilistic_gamma():
    # sqrt(n) growth beyond ~64 terms, the worst case below; both are >= n u / 2 for tiny n
    assert _gamma(10, U) == pytest.approx(10 * U / (1 - 10 * U))
    assert _gamma(49152, U) < 0.05 * 49152 * U
    assert _gamma(49152, U) == pytest.approx(math.expm1(8 * math.sqrt(49152) * U + 49152 * U * U / (1 - U)))


def test_softmax_entropy_bound_holds_for_float32_and_is_small():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(6, 300, generator=g) * 4
    exact = error_bound(entropy, z)
    got = entropy(z.float())
    assert_within_error_model(got, exact, k=1.0, what="float32 entropy")
    assert float(exact.bound.max()) < 1e-4 * float(exact.value.abs().max())


def test_bound_follows_the_sensitivity():
    # y = 1e6 * (a * b): the product's rounding, scaled by the factor that follows it
    a, b = torch.tensor([3.0]), torch.tensor([7.0])
    exact = error_bound(lambda x, y: (x * y) * 1e6, a, b)
    # rho of x*y is u * 21, times dy/d(xy) = 1e6, plus the rounding of the final product u * 2.1e7
    assert float(exact.bound[0]) == pytest.approx(U * 21 * 1e6 + U * 21e6, rel=1e-12)


def test_unknown_operation_and_nan_sensitivity_raise():
    with pytest.raises(NotImplementedError, match="no rounding rule for 'erfinv'"):
        error_bound(lambda t: torch.erfinv(t).sum(), torch.tensor([0.1, 0.2]))
    x = torch.tensor([0.0, float("-inf")])
    with pytest.raises(ValueError, match="NaN sensitivity"):  # 0 x -inf in the discarded branch of where()
        error_bound(lambda t: torch.where(t > -1, t.exp() * t, torch.zeros_like(t)).sum(), x)


def test_probe_divergence_bound_is_exceeded_by_a_wrong_result():
    from oar import ops

    g = torch.Generator().manual_seed(2)
    clean, pert = torch.randn(3, 1, 500, generator=g) * 3, torch.randn(3, 1, 500, generator=g) * 3
    exact = probe_divergence_error_bound(clean, pert, "last")
    assert_within_error_model(ops.probe_divergence(clean, pert, probe="last"), exact, what="op")
    with pytest.raises(AssertionError, match="outside the budget"):  # the KL of the wrong row
        assert_within_error_model(ops.probe_divergence(clean, pert.roll(1, 0), probe="last"), exact, what="wrong")


def test_random_rounding_covers_a_backward_pass():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 64, generator=g, dtype=torch.float64) / 8
    x = torch.randn(16, 64, generator=g, dtype=torch.float64)

    def grad_norm(dtype):
        xx = x.to(dtype).requires_grad_(True)
        y = torch.tanh(xx @ w.to(dtype)).square().sum()
        (gx,) = torch.autograd.grad(y, xx)
        return gx.abs().sum(-1)

    est = random_rounding(lambda: grad_norm(torch.float64))
    assert isinstance(est, Bounded) and float(est.bound_ref.max()) == 0.0
    assert float(est.bound.min()) > 0 and float(est.bound.max()) < 1e-3 * float(est.value.abs().max())
    assert_within_error_model(grad_norm(torch.float32), est, k=1.0, what="float32 backward")
