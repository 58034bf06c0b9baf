"""oar.ops.grad_x_input (method.md section 4) against the plain-PyTorch reference, with opcheck, edge shapes,
properties and error messages, on every device (``device``: "cpu", and "cuda" where a GPU and the CUDA kernels are
present; the CUDA cases compare against the CPU op too), bad input as one table, torch.compile of the wrapper."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oar  # noqa: F401  (loads the op library)
from oar import ops
from oar import reference as ref

from _devices import DEVICES, eager_checks, gen, no_pending_device_errors, on, bad_input_tests, to_device  # noqa: F401
from _tolerance import assert_within, sum_bound, ulp

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
    # float32 accumulation of the H products (rule 2 of _tolerance.py: gamma_{H+1} sum |g x| per row, in any
    # summation order, whatever the input dtype), then the abs and the float32 output (half an ulp).
    mag = (grad.double() * inp.double()).abs().sum(-1)
    assert_within(got, want, sum_bound(mag, shape[-1] + 1) + ulp(want), f"{dtype} {shape}")
    if dtype in (torch.float16, torch.bfloat16):  # rule 1: far better than the same sum in the 16-bit dtype
        err = (got.double() - want).abs()
        naive_err = (naive_same_dtype(grad, inp).double() - want).abs().max()
        assert err.max() <= 4 * naive_err + ulp(want.abs().max()), (err.max(), naive_err)


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
    want = ref.grad_x_input(g, x)  # H = 33 products: the float32 sum bound, as above
    assert_within(ops.grad_x_input(g, x), want, sum_bound((g.double() * x.double()).abs().sum(-1), 34) + ulp(want))


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


# ---- bad input: one table ----------------------------------------------------------------------------------------
# Each row: (the callable, its keyword arguments, the exception, a regex of the message). Tensors are moved to the
# device under test; meta tensors stay on meta.

GX = ops.grad_x_input
_NAN_G = torch.randn(1, 2, 8, generator=gen(71))
_NAN_G[0, 1, 3] = float("nan")

#: Argument and data checks, on every device (CUDA: eager checks, the CPU's messages).
BAD_INPUT = [
    pytest.param(GX, dict(grad=torch.randn(1, 2, 4).double(), input=torch.randn(1, 2, 4)), ValueError,
                 r"grad must have the dtype of input", id="grad_dtype"),
    pytest.param(GX, dict(grad=_NAN_G, input=torch.ones(1, 2, 8)), ValueError, r"grad_x_input: the result at \[0, 1\]",
                 id="nan_grad"),
]

#: Non-finite results of the CPU kernel (NaN/Inf inputs, float32 overflow of the product sum), arguments the dispatcher
#: sees as None, and the fake (meta) kernel.
BAD_INPUT_CPU = [
    pytest.param(GX, dict(grad=torch.tensor([[[float("nan"), 1.0]]]), input=torch.ones(1, 1, 2)), ValueError,
                 r"grad_x_input: the result at \[0, 0\] is not finite .*grad and input", id="nan"),
    pytest.param(GX, dict(grad=torch.tensor([[[float("inf"), 1.0]]]), input=torch.ones(1, 1, 2)), ValueError,
                 r"grad_x_input: the result at \[0, 0\] is not finite .*grad and input", id="inf"),
    pytest.param(GX, dict(grad=torch.full((1, 1, 4), 1e30), input=torch.full((1, 1, 4), 1e30)), ValueError,
                 r"grad_x_input: the result at \[0, 0\] is not finite .*grad and input", id="float32_overflow"),
    pytest.param(GX, dict(grad=torch.full((1, 1, 4), 1e30, dtype=torch.float64),
                          input=torch.full((1, 1, 4), 1e30, dtype=torch.float64)), ValueError,
                 r"grad_x_input: the result at \[0, 0\] is not finite .*grad and input",
                 id="float64_to_float32_overflow"),
    # An undefined tensor used to be reported as shape (0,), dtype UNKNOWN_SCALAR or "tensor does not have a device".
    pytest.param(GX, dict(grad=None, input=torch.zeros(1, 1, 2)), ValueError, r"grad must be a tensor, got None",
                 id="grad_none"),
    # The fake kernel used to allocate on the first argument's device and return uninitialized memory.
    pytest.param(GX, dict(grad=torch.zeros(1, 1, 3, device="meta"), input=torch.zeros(1, 1, 3)), ValueError,
                 r"grad must be on the same device as input \(cpu\), got meta", id="fake_mixed_devices"),
]


test_bad_input, test_bad_input_cpu = bad_input_tests(BAD_INPUT, BAD_INPUT_CPU)


# ---- every device (CUDA: parity with the CPU op; moved from test_cuda.py) ------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H", [1, 7, 64, 576, 1000, 2048])
def test_grad_x_input_parity(device, dtype, H):
    g = gen(H)
    grad = torch.randn(3, 41, H, generator=g).to(dtype)
    inp = torch.randn(3, 41, H, generator=g).to(dtype)
    cpu = ops.grad_x_input(grad, inp)
    dev = ops.grad_x_input(on(grad, device), on(inp, device))
    assert dev.dtype == torch.float32 and dev.shape == (3, 41)
    bound = 1e-5 * (grad.double().abs() * inp.double().abs()).sum(-1) + 1e-6
    assert ((dev.cpu().double() - cpu.double()).abs() <= bound).all()
    torch.testing.assert_close(dev.cpu().double(), ref.grad_x_input(grad, inp), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_grad_x_input_non_contiguous_and_misaligned(device):
    x = torch.randn(2, 8, 16).transpose(0, 1)
    y = torch.randn(2, 8, 16).transpose(0, 1)
    torch.testing.assert_close(ops.grad_x_input(on(x, device), on(y, device)).cpu(), ops.grad_x_input(x, y), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(ops.grad_x_input(on(x, device), on(y, device)).cpu().double(), ref.grad_x_input(x, y),
                               rtol=1e-5, atol=1e-5)
    # A contiguous view with a storage offset of one element: not 16-byte aligned -> the scalar path.
    flat_g = on(torch.randn(1 + 4 * 5 * 64, generator=gen(1)).to(torch.bfloat16), device)
    flat_x = on(torch.randn(1 + 4 * 5 * 64, generator=gen(2)).to(torch.bfloat16), device)
    g, xx = flat_g[1:].view(4, 5, 64), flat_x[1:].view(4, 5, 64)
    assert g.is_contiguous() and g.data_ptr() % 16 != 0
    torch.testing.assert_close(ops.grad_x_input(g, xx).cpu(), ops.grad_x_input(g.cpu(), xx.cpu()), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(ops.grad_x_input(g, xx).cpu().double(), ref.grad_x_input(g.cpu(), xx.cpu()), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_on_device(device):
    g = gen(0)
    grad, x = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g)
    torch.library.opcheck(torch.ops.oar.grad_x_input.default, (grad.to(device), x.to(device)))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_wrapper_fullgraph(backend):
    """oar.ops.grad_x_input traces into one graph and gives the eager values exactly."""
    torch._dynamo.reset()
    g = gen(3)
    grad, x = torch.randn(2, 5, 33, generator=g), torch.randn(2, 5, 33, generator=g)

    def f(a, b):
        return ops.grad_x_input(a, b) + ops.grad_x_input(b.to(torch.bfloat16), a.to(torch.bfloat16))

    assert torch.equal(torch.compile(f, backend=backend, fullgraph=True)(grad, x), f(grad, x))
