"""oar.ops.grad_x_input (method.md section 4) and oar.ops.build_masked_batch (section 3) against the
plain-PyTorch references, with opcheck, edge shapes, properties and error messages."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oar  # noqa: F401  (loads the op library)
from oar import ops
from oar import reference as ref

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def naive_same_dtype(grad, inp):
    return (grad * inp).sum(-1).abs()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 5, 576), (1, 1, 1), (3, 47, 131), (2, 3, 1500)])
def test_grad_x_input_matches_reference(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    grad = torch.randn(*shape, generator=g).to(dtype)
    inp = torch.randn(*shape, generator=g).to(dtype)
    got = ops.grad_x_input(grad, inp)
    assert got.dtype == torch.float32 and got.shape == shape[:2]
    want = ref.grad_x_input(grad, inp)
    # float32 accumulation of exact products: error ~ eps32 * sum |g x| (per row), whatever the dtype;
    # for 16-bit inputs also within a small multiple of the naive same-dtype error.
    mag = (grad.double() * inp.double()).abs().sum(-1)
    err = (got.double() - want).abs()
    assert (err <= 4e-7 * mag + 1e-7 * want.abs() + 1e-30).all(), err.max()
    if dtype in (torch.float16, torch.bfloat16):
        naive_err = (naive_same_dtype(grad, inp).double() - want).abs().max()
        assert err.max() <= 4 * naive_err + 1e-6


def test_grad_x_input_hand_values_and_non_contiguous():
    # Row (0, 0): 1*2 + (-3)*1 + 0.5*4 = 1; row (0, 1): -(1 + 4 + 9) -> 14.
    grad = torch.tensor([[[1.0, -3.0, 0.5], [-1.0, -2.0, -3.0]]])
    inp = torch.tensor([[[2.0, 1.0, 4.0], [1.0, 2.0, 3.0]]])
    torch.testing.assert_close(ops.grad_x_input(grad, inp), torch.tensor([[1.0, 14.0]]))
    # (L, B, H) storage viewed as (B, L, H), and an H stride of 2.
    big = torch.randn(7, 4, 2 * 33)
    g = big[..., ::2].transpose(0, 1)
    x = torch.randn(7, 4, 33).transpose(0, 1)
    dense = ops.grad_x_input(g.contiguous(), x.contiguous())
    torch.testing.assert_close(ops.grad_x_input(g, x), dense, rtol=0, atol=0)
    torch.testing.assert_close(ops.grad_x_input(g, x).double(), ref.grad_x_input(g, x), rtol=1e-5, atol=1e-6)


def test_grad_x_input_empty():
    assert ops.grad_x_input(torch.randn(0, 3, 8), torch.randn(0, 3, 8)).shape == (0, 3)
    out = ops.grad_x_input(torch.randn(2, 3, 0), torch.randn(2, 3, 0))
    assert torch.equal(out, torch.zeros(2, 3))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), H=st.integers(1, 200), scale=st.floats(-50, 50))
def test_grad_x_input_properties(seed, H, scale):
    """Non-negative, symmetric in (grad, input), and homogeneous: |sum (c g) x| = |c| |sum g x|."""
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(2, 3, H, generator=g)
    inp = torch.randn(2, 3, H, generator=g)
    base = ops.grad_x_input(grad, inp)
    assert (base >= 0).all()
    torch.testing.assert_close(ops.grad_x_input(inp, grad), base)
    # fp32 rounding of a sum with cancellation scales with sum |g x|, not with |sum g x|.
    bound = 1e-6 * abs(scale) * (grad.abs() * inp.abs()).sum(-1) + 1e-12
    assert ((ops.grad_x_input(grad * scale, inp) - base * abs(scale)).abs() <= bound).all()


def test_grad_x_input_opcheck():
    for dtype in (torch.float32, torch.bfloat16):
        args = (torch.randn(2, 3, 16).to(dtype), torch.randn(2, 3, 16).to(dtype))
        torch.library.opcheck(torch.ops.oar.grad_x_input.default, args)


def test_grad_x_input_errors():
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"input must be 3-D \(B, L, H\), got shape \(6, 4\)"):
        ops.grad_x_input(x.reshape(6, 4), x.reshape(6, 4))
    with pytest.raises(ValueError, match=r"grad must be \(B, L, H\) like input = \(2, 3, 4\), got \(2, 3, 5\)"):
        ops.grad_x_input(torch.randn(2, 3, 5), x)
    with pytest.raises(ValueError, match=r"grad must have the dtype of input \(Float\), got Half"):
        ops.grad_x_input(x.half(), x)
    with pytest.raises(ValueError, match=r"input must have dtype in"):
        ops.grad_x_input(x.long(), x.long())


# ---- build_masked_batch -------------------------------------------------------------------------------


def test_build_masked_batch_matches_reference():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (4, 47), generator=g)
    rows = torch.randint(0, 4, (131,), generator=g)
    pos = torch.randint(0, 47, (131,), generator=g)
    got = ops.build_masked_batch(ids, rows, pos, pad_id=151643)
    torch.testing.assert_close(got, ref.build_masked_batch(ids, rows, pos, 151643), rtol=0, atol=0)
    # Exactly one entry differs from the source row (when the source token was not already PAD).
    diff = (got != ids[rows]).sum(1)
    assert (diff <= 1).all() and (got[torch.arange(131), pos] == 151643).all()


def test_build_masked_batch_edges():
    ids = torch.arange(12).reshape(3, 4)
    empty = ops.build_masked_batch(ids, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), 0)
    assert empty.shape == (0, 4) and empty.dtype == torch.int64
    # Non-contiguous ids (a transposed view) are copied, not misread.
    t = torch.arange(12).reshape(4, 3).t()
    got = ops.build_masked_batch(t, torch.tensor([2, 0]), torch.tensor([0, 3]), -1)
    torch.testing.assert_close(got, ref.build_masked_batch(t, torch.tensor([2, 0]), torch.tensor([0, 3]), -1))


def test_build_masked_batch_opcheck():
    ids = torch.randint(0, 50, (3, 9))
    rows, pos = torch.tensor([0, 2, 2]), torch.tensor([8, 0, 4])
    torch.library.opcheck(torch.ops.oar.build_masked_batch.default, (ids, rows, pos, 7))


def test_build_masked_batch_errors():
    ids = torch.zeros(2, 5, dtype=torch.long)
    r, p = torch.tensor([0, 1]), torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"row_index\[1\] must be in \[0, B=2\), got 2"):
        ops.build_masked_batch(ids, torch.tensor([0, 2]), p, 0)
    with pytest.raises(ValueError, match=r"positions\[0\] must be in \[0, T=5\), got 5"):
        ops.build_masked_batch(ids, r, torch.tensor([5, 0]), 0)
    with pytest.raises(ValueError, match=r"positions\[1\] must be in \[0, T=5\), got -1"):
        ops.build_masked_batch(ids, r, torch.tensor([0, -1]), 0)
    with pytest.raises(ValueError, match=r"positions must be \(M,\) like row_index = \(2,\), got \(3,\)"):
        ops.build_masked_batch(ids, r, torch.tensor([0, 1, 2]), 0)
    with pytest.raises(ValueError, match=r"input_ids must have dtype in \{Long\}, got Int"):
        ops.build_masked_batch(ids.int(), r, p, 0)
    with pytest.raises(ValueError, match=r"input_ids must be 2-D \(B, T\)"):
        ops.build_masked_batch(ids[0], r, p, 0)
    with pytest.raises(ValueError, match=r"row_index must have dtype in \{Long\}, got Int"):
        ops.build_masked_batch(ids, r.int(), p, 0)
