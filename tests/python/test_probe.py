"""oar.ops.probe_divergence (+ its autograd) against the float64 reference (method.md section 2).

Tolerances: the kernel reads the inputs in their own dtype and accumulates in float32/float64, so its
error vs the float64 reference must stay within a small multiple of what a naive PyTorch computation in
the *input dtype* makes (plus a tiny floor for float32), and in fact at float32 level for every dtype.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oar  # noqa: F401  (loads the op library)
from oar import ops
from oar import reference as ref

PROBES = ["last", "answer_mean", "answer_joint"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_inputs(N, S, V, dtype, seed=0, noise=0.5, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    clean = (scale * torch.randn(N, S, V, generator=g)).to(dtype)
    pert = (clean.float() + noise * torch.randn(N, S, V, generator=g)).to(dtype)
    ids = torch.randint(0, V, (N, S), generator=g)
    lengths = torch.randint(1, S + 1, (N,), generator=g)
    return clean, pert, ids, lengths


def naive_same_dtype(clean, pert, probe, ids, lengths):
    """What a user writes by hand, computed entirely in the input dtype (the error yardstick)."""
    N, S, V = pert.shape
    mask = torch.arange(S)[None, :] < lengths[:, None]
    cnt = lengths.to(pert.dtype)
    if probe == "last":
        zc, zp = clean[:, 0], pert[:, 0]
    elif probe == "answer_mean":
        m3 = mask[..., None].to(pert.dtype)
        zc = (clean * m3).sum(1) / cnt[:, None]
        zp = (pert * m3).sum(1) / cnt[:, None]
    else:
        safe = torch.where(mask, ids, torch.zeros_like(ids))[..., None]

        def phi(z):
            ll = torch.log_softmax(z, -1).gather(-1, safe)[..., 0]
            return (ll * mask.to(z.dtype)).sum(1) / cnt

        return phi(clean) - phi(pert)
    lc, lp = torch.log_softmax(zc, -1), torch.log_softmax(zp, -1)
    return (lc.exp() * (lc - lp)).sum(-1)


def assert_close_to_reference(got, clean, pert, probe, ids, lengths, k=4.0):
    want = ref.probe_divergence(clean, pert, probe=probe, answer_ids=ids, lengths=lengths)
    naive = naive_same_dtype(clean, pert, probe, ids, lengths).double()
    naive_err = (naive - want).abs().max().item()
    err = (got.double() - want).abs().max().item()
    floor = 2e-6 * (1.0 + want.abs().max().item())
    assert err <= k * naive_err + floor, f"{probe}: error {err:.3g} vs naive {clean.dtype} error {naive_err:.3g}"
    # Stronger: the op reads 16-bit inputs exactly and accumulates in float32/float64, so its error is at
    # float32 level whatever the input dtype (the naive 16-bit error is 1e-3..1e-2 here).
    assert err <= 1e-5 * (1.0 + want.abs().max().item()), f"{probe}: error {err:.3g} above float32 level"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("V", [7, 131, 49152])
@pytest.mark.parametrize("S", [1, 3])
def test_matches_reference(dtype, probe, V, S):
    N = 4
    clean, pert, ids, lengths = make_inputs(N, S, V, dtype, seed=V + S)
    got = ops.probe_divergence(clean, pert, probe=probe, answer_ids=ids, lengths=lengths)
    assert got.dtype == torch.float32 and got.shape == (N,)
    assert_close_to_reference(got, clean, pert, probe, ids, lengths)
    # Without lengths every row uses all S positions.
    got_all = ops.probe_divergence(clean, pert, probe=probe, answer_ids=ids)
    full = torch.full((N,), S, dtype=torch.int64)
    assert_close_to_reference(got_all, clean, pert, probe, ids, full)


def test_qwen_sized_vocabulary_bf16():
    clean, pert, ids, lengths = make_inputs(2, 2, 151936, torch.bfloat16, seed=3)
    got = ops.probe_divergence(clean, pert, probe="answer_mean", lengths=lengths)
    assert_close_to_reference(got, clean, pert, "answer_mean", ids, lengths)


@pytest.mark.parametrize("probe", PROBES)
def test_broadcast_clean_via_expand(probe):
    N, S, V = 5, 3, 257
    clean1, pert, ids, lengths = make_inputs(1, S, V, torch.float32, seed=5)
    pert = pert + torch.randn(N, S, V)  # (N, S, V): each row a different perturbation
    ids = torch.randint(0, V, (N, S))
    lengths = torch.randint(1, S + 1, (N,))
    clean = clean1.expand(N, S, V)
    assert clean.stride(0) == 0
    got = ops.probe_divergence(clean, pert, probe=probe, answer_ids=ids, lengths=lengths)
    dense = ops.probe_divergence(clean.contiguous(), pert, probe=probe, answer_ids=ids, lengths=lengths)
    # A broadcast clean row takes the cached-softmax path: same math, another rounding order.
    torch.testing.assert_close(got, dense, rtol=1e-6, atol=1e-7)
    assert_close_to_reference(got, clean, pert, probe, ids, lengths)


@pytest.mark.parametrize("probe", PROBES)
def test_non_contiguous_inputs(probe):
    N, S, V = 3, 3, 131
    g = torch.Generator().manual_seed(9)
    # Strides permuted on (N, S), and a vocabulary dimension with stride 2 (copied by the op).
    clean = torch.randn(S, N, V, generator=g).transpose(0, 1)
    pert = torch.randn(N, S, 2 * V, generator=g)[..., ::2]
    assert not clean.is_contiguous() and pert.stride(2) == 2
    ids = torch.randint(0, V, (S, N), generator=g).t()
    lengths = torch.tensor([3, 1, 2])[::1]
    got = ops.probe_divergence(clean, pert, probe=probe, answer_ids=ids, lengths=lengths)
    dense = ops.probe_divergence(clean.contiguous(), pert.contiguous(), probe=probe,
                                 answer_ids=ids.contiguous(), lengths=lengths)
    torch.testing.assert_close(got, dense, rtol=0, atol=0)
    assert_close_to_reference(got, clean, pert, probe, ids, lengths)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("probe", PROBES)
def test_identical_inputs_give_zero(dtype, probe):
    clean, _, ids, lengths = make_inputs(3, 3, 1000, dtype, seed=11)
    got = ops.probe_divergence(clean, clean.clone(), probe=probe, answer_ids=ids, lengths=lengths)
    assert torch.equal(got, torch.zeros(3))
    # Also through the broadcast (cached clean softmax) path.
    one = clean[:1].expand(3, -1, -1)
    got = ops.probe_divergence(one, one.contiguous(), probe=probe, answer_ids=ids, lengths=lengths)
    assert torch.equal(got, torch.zeros(3))


def test_empty_batch():
    z = torch.randn(0, 2, 5)
    assert ops.probe_divergence(z, z).shape == (0,)


def test_neg_inf_logits_are_zero_probability():
    V = 300
    clean, pert, _, _ = make_inputs(2, 1, V, torch.float32, seed=13)
    clean[:, :, :50] = float("-inf")
    pert[:, :, :50] = float("-inf")
    got = ops.probe_divergence(clean, pert, probe="last")
    want = ref.probe_divergence(clean, pert, probe="last")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    V=st.integers(1, 300),
    S=st.integers(1, 4),
    probe=st.sampled_from(PROBES),
    shift_c=st.floats(-30, 30),
    shift_p=st.floats(-30, 30),
    broadcast=st.booleans(),
)
def test_property_nonnegative_and_shift_invariant(seed, V, S, probe, shift_c, shift_p, broadcast):
    """KL >= 0, and every probe is invariant to adding a constant to a position's logits (softmax).

    broadcast: the clean logits are one row expanded over N (the cached-clean path)."""
    N = 3
    clean, pert, ids, lengths = make_inputs(N, S, V, torch.float32, seed=seed)
    if broadcast:
        clean = clean[:1].expand(N, S, V)
    base = ops.probe_divergence(clean, pert, probe=probe, answer_ids=ids, lengths=lengths)
    shifted = ops.probe_divergence(clean + shift_c, pert + shift_p, probe=probe, answer_ids=ids, lengths=lengths)
    if probe != "answer_joint":
        assert (base >= 0).all()
    # Shifting moves logits by up to 30, so float32 rounding of the inputs is ~30 * 2^-24 per entry.
    torch.testing.assert_close(shifted, base, rtol=1e-4, atol=2e-5)


# ---- autograd ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradient_matches_autograd_of_reference(probe, dtype):
    N, S, V = 3, 3, 131
    clean, pert, ids, lengths = make_inputs(N, S, V, dtype, seed=17)
    w = torch.tensor([1.0, -2.0, 0.5])

    p = pert.clone().requires_grad_(True)
    (ops.probe_divergence(clean, p, probe=probe, answer_ids=ids, lengths=lengths) * w).sum().backward()

    p64 = pert.double().requires_grad_(True)
    (ref.probe_divergence(clean, p64, probe=probe, answer_ids=ids, lengths=lengths) * w.double()).sum().backward()

    assert p.grad.dtype == dtype and p.grad.shape == pert.shape
    # float32: arithmetic error only; 16-bit: the gradient is stored in the input dtype.
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(p.grad.double(), p64.grad, rtol=rtol, atol=rtol * p64.grad.abs().max().item())


def test_clean_logits_get_no_gradient():
    clean, pert, _, _ = make_inputs(2, 2, 17, torch.float32, seed=19)
    c = clean.clone().requires_grad_(True)
    p = pert.clone().requires_grad_(True)
    ops.probe_divergence(c, p).sum().backward()
    assert c.grad is None
    assert p.grad is not None and p.grad.abs().sum() > 0


def test_gradient_with_expanded_clean():
    N, S, V = 4, 2, 50
    clean1, _, _, _ = make_inputs(1, S, V, torch.float32, seed=21)
    pert = torch.randn(N, S, V, requires_grad=True)
    out = ops.probe_divergence(clean1.expand(N, S, V), pert)
    (g,) = torch.autograd.grad(out.sum(), pert)
    p64 = pert.detach().double().requires_grad_(True)
    (g64,) = torch.autograd.grad(ref.probe_divergence(clean1.expand(N, S, V), p64).sum(), p64)
    torch.testing.assert_close(g.double(), g64, rtol=1e-5, atol=1e-7)


def test_torch_compile_parity():
    clean, pert, ids, lengths = make_inputs(3, 2, 64, torch.float32, seed=23)

    def f(c, p):
        return ops.probe_divergence(c, p, probe="answer_mean", lengths=lengths).sum()

    p_eager = pert.clone().requires_grad_(True)
    p_comp = pert.clone().requires_grad_(True)
    eager = f(clean, p_eager)
    eager.backward()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(clean, p_comp)
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(p_comp.grad, p_eager.grad)


# ---- opcheck ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("probe", PROBES)
def test_opcheck_probe_divergence(probe):
    clean, pert, ids, lengths = make_inputs(3, 2, 40, torch.float32, seed=29)
    pert.requires_grad_(True)
    torch.library.opcheck(torch.ops.oar.probe_divergence.default, (clean, pert, ids, lengths, probe))
    torch.library.opcheck(torch.ops.oar.probe_divergence.default, (clean, pert.detach(), None, None, "last"))


def test_opcheck_probe_divergence_backward():
    clean, pert, ids, lengths = make_inputs(3, 2, 40, torch.bfloat16, seed=31)
    go = torch.randn(3)
    torch.library.opcheck(
        torch.ops.oar.probe_divergence_backward.default, (go, clean, pert, ids, lengths, "answer_joint")
    )
    torch.library.opcheck(
        torch.ops.oar.probe_divergence_backward.default, (go, clean, pert, None, None, "answer_mean")
    )


# ---- errors -----------------------------------------------------------------------------------------


def test_errors_name_the_argument():
    clean, pert, ids, lengths = make_inputs(2, 3, 11, torch.float32, seed=37)
    with pytest.raises(ValueError, match=r"perturbed_logits must be 3-D \(N, S, V\)"):
        ops.probe_divergence(clean[0], pert[0])
    msg = r"clean_logits must be \(N, S, V\) like perturbed_logits = \(2, 3, 11\), got \(2, 3, 10\)"
    with pytest.raises(ValueError, match=msg):
        ops.probe_divergence(clean[..., :10], pert)
    with pytest.raises(ValueError, match=r"clean_logits must have the dtype of perturbed_logits \(Float\), got Half"):
        ops.probe_divergence(clean.half(), pert)
    with pytest.raises(ValueError, match=r"perturbed_logits must have dtype in"):
        ops.probe_divergence(clean.long(), pert.long())
    with pytest.raises(ValueError, match=r"probe must be one of"):
        ops.probe_divergence(clean, pert, probe="mean")
    with pytest.raises(ValueError, match=r"answer_ids .* required for probe='answer_joint'"):
        ops.probe_divergence(clean, pert, probe="answer_joint")
    with pytest.raises(ValueError, match=r"answer_ids must be \(N, S\) = \(2, 3\), got \(2, 2\)"):
        ops.probe_divergence(clean, pert, probe="answer_joint", answer_ids=ids[:, :2])
    with pytest.raises(ValueError, match=r"answer_ids must have dtype in \{Long\}, got Int"):
        ops.probe_divergence(clean, pert, probe="answer_joint", answer_ids=ids.int())
    bad = ids.clone()
    bad[1, 2] = 11
    with pytest.raises(ValueError, match=r"answer_ids\[1, 2\] must be in \[0, V=11\), got 11"):
        ops.probe_divergence(clean, pert, probe="answer_joint", answer_ids=bad)
    bad[1, 2] = -1
    with pytest.raises(ValueError, match=r"answer_ids\[1, 2\] must be in \[0, V=11\), got -1"):
        ops.probe_divergence(clean, pert, probe="answer_joint", answer_ids=bad)
    # ... but padding beyond a row's length is never read.
    ops.probe_divergence(clean, pert, probe="answer_joint", answer_ids=bad, lengths=torch.tensor([3, 2]))
    with pytest.raises(ValueError, match=r"lengths\[1\] must be in \[1, S=3\], got 4"):
        ops.probe_divergence(clean, pert, lengths=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"lengths\[0\] must be in \[1, S=3\], got 0"):
        ops.probe_divergence(clean, pert, lengths=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"lengths must be \(N,\) = \(2,\), got \(3,\)"):
        ops.probe_divergence(clean, pert, lengths=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"lengths must have dtype in \{Long\}"):
        ops.probe_divergence(clean, pert, lengths=torch.tensor([1.0, 1.0]))
    nan = pert.clone()
    nan[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"row 1 gives a NaN"):
        ops.probe_divergence(clean, nan, probe="last")


def test_backward_op_errors():
    clean, pert, _, _ = make_inputs(2, 3, 11, torch.float32, seed=41)
    with pytest.raises(ValueError, match=r"grad_out must be \(N,\) = \(2,\), got \(3,\)"):
        torch.ops.oar.probe_divergence_backward(torch.ones(3), clean, pert, None, None, "answer_mean")
    with pytest.raises(ValueError, match=r"probe must be one of"):
        torch.ops.oar.probe_divergence_backward(torch.ones(2), clean, pert, None, None, "joint")
