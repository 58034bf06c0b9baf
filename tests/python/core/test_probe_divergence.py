"""oar.ops.probe_divergence (+ its autograd) against the float64 reference (method.md section 2), on every device
(``device``: "cpu", and "cuda" where a GPU and the CUDA kernels are present; the CUDA cases compare against the CPU
op too), with opcheck, bad input as one table and torch.compile of the wrapper.

Tolerances (rule 1 of _tolerance.py): the kernel reads the inputs exactly in their own dtype and accumulates in
float32/float64, so its error vs the float64 value of its formula on the same inputs stays within the float32
error model of that formula (_error_model.py: any order of the V-term sums), whatever the input dtype.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oar  # noqa: F401  (loads the op library)
from oar import ops
from oar import reference as ref

from _devices import DEVICES, eager_checks, gen, no_pending_device_errors, on, bad_input_tests, to_device  # noqa: F401
from _op_inputs import make_inputs
from _error_model import error_bound, probe_divergence_error_bound, probe_divergence_grad_formula
from _tolerance import K_ALGORITHM, assert_within, assert_within_error_model, ulp

PROBES = ["last", "answer_mean", "answer_joint"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_close_to_reference(got, clean, pert, probe, ids, lengths):
    """Rule 1: within the float32 error model (_error_model.py) of the op's formula evaluated in float64 on the same
    inputs (16-bit inputs are read exactly, so float32 is the op's working precision for every dtype). The bound
    holds for any order of the V-term sums (the op's chunked, vectorized ones included); the float64 value is checked
    against the independent reference (log_softmax and KL) too."""
    exact = probe_divergence_error_bound(clean, pert, probe, ids, lengths)
    want = ref.probe_divergence(clean, pert, probe=probe, answer_ids=ids, lengths=lengths)
    assert_within(exact.value, want, 1e-12 * (1 + want.abs()), what="formula vs reference")
    assert_within_error_model(got, exact, vacuous_above=None if bool((want.abs() < 1e-6).all()) else 0.25,
                              what=f"{probe} {clean.dtype}")


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
    # A broadcast clean row takes the cached-softmax path: same math, another rounding order; both within rule 1.
    assert_close_to_reference(got, clean, pert, probe, ids, lengths)
    assert_close_to_reference(dense, clean, pert, probe, ids, lengths)


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
    assert torch.isfinite(got).all()
    # Zero-probability entries contribute nothing (to the value and to the error model)
    assert_close_to_reference(got, clean, pert, "last", None, torch.ones(2, dtype=torch.int64))


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

    def budget(c, p):  # rule 1 budget of one run (the float32 error model), and its float64 value
        e = probe_divergence_error_bound(c, p, probe, ids, lengths)
        return K_ALGORITHM * e.bound + ulp(e.value), e.value

    # Each run within rule 1 of the float64 value of its own inputs; those two values differ by what the float32
    # rounding of the shifted logits changes (exactly computed here in float64), nothing else. The shifts make
    # the cancelling terms up to 60 times larger than the KL, which the error model counts.
    (b0, w0), (b1, w1) = budget(clean, pert), budget(clean + shift_c, pert + shift_p)
    assert_within(shifted, base, b0 + b1 + float((w1 - w0).abs().max()), f"{probe} shift")


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
    # Rule 1: the float32 error model of the backward's formula (the op's working precision), plus the rounding of
    # the stored gradient to the input dtype (an ulp of that dtype per element, in assert_within_error_model)
    exact = error_bound(lambda c, q: probe_divergence_grad_formula(c, q, probe, ids, lengths, w), clean, pert)
    assert_within(exact.value, p64.grad, 1e-12 * float(p64.grad.abs().max()), what="formula vs autograd")
    assert_within_error_model(p.grad, exact, what=f"{probe} {dtype}")


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
    exact = error_bound(lambda c, q: probe_divergence_grad_formula(c, q, "answer_mean"), clean1.expand(N, S, V),
                        pert.detach())
    assert_within(exact.value, g64, 1e-12 * float(g64.abs().max()), what="formula vs autograd")
    assert_within_error_model(g, exact, what="expanded clean")  # rule 1, as the forward


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


def test_probe_divergence_double_backward_raises_clearly():
    clean, pert = torch.randn(2, 2, 5), torch.randn(2, 2, 5, requires_grad=True)
    (g,) = torch.autograd.grad(ops.probe_divergence(clean, pert).sum(), pert, create_graph=True)
    with pytest.raises(NotImplementedError, match=r"double backward .* is not supported"):
        torch.autograd.grad(g.sum(), pert)
    # First-order gradients are unaffected.
    (g1,) = torch.autograd.grad(ops.probe_divergence(clean, pert).sum(), pert)
    assert torch.isfinite(g1).all()


# ---- bad input: one table ----------------------------------------------------------------------------------------
# Each row: (the callable, its keyword arguments, the exception, a regex of the message). Tensors are moved to the
# device under test; meta tensors stay on meta.

PD = ops.probe_divergence
_C, _P, _IDS, _ = make_inputs(2, 3, 50, torch.float32, seed=71)
_BAD_IDS = _IDS.clone()
_BAD_IDS[1, 0] = 50  # == V

#: Argument and data checks, on every device (CUDA: eager checks, the CPU's messages).
BAD_INPUT = [
    pytest.param(PD, dict(clean_logits=_C, perturbed_logits=_P, probe="first"), ValueError, r"probe must be one of",
                 id="probe_name"),
    pytest.param(PD, dict(clean_logits=_C[:1], perturbed_logits=_P), ValueError, r"clean_logits must be \(N, S, V\)",
                 id="logits_shape"),
    pytest.param(PD, dict(clean_logits=_C, perturbed_logits=_P, lengths=torch.tensor([1, 4])), ValueError,
                 r"lengths\[1\] must be in \[1, S=3\], got 4", id="bad_length"),
    pytest.param(PD, dict(clean_logits=_C, perturbed_logits=_P, probe="answer_joint", answer_ids=_BAD_IDS,
                          lengths=torch.tensor([3, 3])), ValueError, r"answer_ids\[1, 0\]", id="bad_answer_id"),
    pytest.param(PD, dict(clean_logits=_C, perturbed_logits=_P.index_fill(0, torch.tensor([1]), float("nan"))),
                 ValueError, r"row 1 gives a NaN", id="nan_logits"),
]

#: Checks of the Python wrapper's arguments, of arguments the dispatcher sees as None, and of the fake (meta) kernel.
BAD_INPUT_CPU = [
    pytest.param(PD, dict(clean_logits=torch.zeros(1, 1, 3), perturbed_logits=torch.zeros(1, 1, 3), probe=None),
                 ValueError, r"probe must be a str, got NoneType None", id="probe_none"),
    # An undefined tensor used to be reported as shape (0,), dtype UNKNOWN_SCALAR or "tensor does not have a device".
    pytest.param(PD, dict(clean_logits=None, perturbed_logits=torch.zeros(1, 1, 2)), ValueError,
                 r"clean_logits must be a tensor, got None", id="clean_none"),
    # The fake kernel used to allocate on the first argument's device and return uninitialized memory.
    pytest.param(PD, dict(clean_logits=torch.zeros(1, 1, 3, device="meta"), perturbed_logits=torch.zeros(1, 1, 3)),
                 ValueError, r"clean_logits must be on the same device as perturbed_logits \(cpu\), got meta",
                 id="fake_mixed_devices"),
]


test_bad_input, test_bad_input_cpu = bad_input_tests(BAD_INPUT, BAD_INPUT_CPU)


# ---- every device (CUDA: parity with the CPU op; moved from test_cuda.py) ------------------------------------------


def probe_tol(dtype):
    # Same input values on both devices; only the reduction order and the fast exp differ (fp32 accumulation).
    return dict(rtol=2e-4, atol=2e-5)


# (N, S, V): odd V (scalar tails), a split plan (few rows, big V), an unsplit plan (many rows: one block per row
# finalizes), the two production vocabularies at small N.
PROBE_SHAPES = [(3, 1, 7), (5, 4, 1000), (600, 2, 513), (2, 3, 49152), (2, 1, 151936)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N, S, V", PROBE_SHAPES)
@pytest.mark.parametrize("with_lengths", [False, True])
def test_probe_divergence_parity(device, probe, dtype, N, S, V, with_lengths):
    clean, pert, ids, lengths = make_inputs(N, S, V, dtype, seed=N + S + V)
    lengths = lengths if with_lengths else None
    cpu = ops.probe_divergence(clean, pert, probe=probe, answer_ids=ids, lengths=lengths)
    dev = ops.probe_divergence(on(clean, device), on(pert, device), probe=probe, answer_ids=on(ids, device),
                               lengths=on(lengths, device))
    assert dev.dtype == torch.float32 and dev.shape == (N,)
    torch.testing.assert_close(dev.cpu(), cpu, **probe_tol(dtype))
    want = ref.probe_divergence(clean, pert, probe=probe, answer_ids=ids, lengths=lengths)
    torch.testing.assert_close(dev.cpu().double(), want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("probe", PROBES)
def test_probe_divergence_broadcast_clean_and_misaligned_views(device, probe):
    N, S, V = 7, 3, 2051
    clean1, pert, ids, lengths = make_inputs(1, S, V + 1, torch.bfloat16, seed=11)
    _, pert, _, _ = make_inputs(N, S, V + 1, torch.bfloat16, seed=12)
    ids = torch.randint(0, V, (N, S), generator=gen(13))
    lengths = torch.randint(1, S + 1, (N,), generator=gen(14))
    # A vocabulary slice starting at 1: rows are not 16-byte aligned -> the scalar path; clean broadcast over N.
    c_host = clean1[..., 1:].expand(N, S, V)
    p_host = pert[..., 1:]
    cpu = ops.probe_divergence(c_host, p_host, probe=probe, answer_ids=ids, lengths=lengths)
    c_dev = on(clean1, device)[..., 1:].expand(N, S, V)
    p_dev = on(pert, device)[..., 1:]
    dev = ops.probe_divergence(c_dev, p_dev, probe=probe, answer_ids=on(ids, device), lengths=on(lengths, device))
    torch.testing.assert_close(dev.cpu(), cpu, rtol=2e-4, atol=2e-5)
    want = ref.probe_divergence(c_host, p_host, probe=probe, answer_ids=ids, lengths=lengths)
    torch.testing.assert_close(dev.cpu().double(), want, rtol=1e-3, atol=1e-4)
    # Broadcast of a clean row that is a tensor of its own (stride 0 over N).
    dev2 = ops.probe_divergence(on(clean1[..., :V], device).expand(N, S, V), on(pert[..., :V], device).contiguous(),
                                probe=probe, answer_ids=on(ids, device), lengths=on(lengths, device))
    cpu2 = ops.probe_divergence(clean1[..., :V].expand(N, S, V), pert[..., :V].contiguous(), probe=probe,
                                answer_ids=ids, lengths=lengths)
    torch.testing.assert_close(dev2.cpu(), cpu2, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_probe_divergence_neg_inf_logits_and_identical_rows(device):
    clean, pert, ids, lengths = make_inputs(4, 2, 300, torch.float32, seed=17)
    clean[0, :, :50] = float("-inf")
    pert[0, :, :50] = float("-inf")
    pert[1] = clean[1]  # identical rows: KL exactly 0 after the clamp
    for probe in PROBES:
        cpu = ops.probe_divergence(clean, pert, probe=probe, answer_ids=ids.clamp_min(50), lengths=lengths)
        dev = ops.probe_divergence(on(clean, device), on(pert, device), probe=probe,
                                   answer_ids=on(ids.clamp_min(50), device), lengths=on(lengths, device))
        torch.testing.assert_close(dev.cpu(), cpu, rtol=2e-4, atol=2e-5)
        assert torch.isfinite(dev).all()
        if probe != "answer_joint":
            assert float(dev[1]) == 0.0 or abs(float(dev[1])) < 1e-6


# A finite clean logit far below the clean maximum facing a perturbed -inf: positive clean probability against zero
# perturbed probability, so KL = +inf (and the answer_joint drop +inf at answer id 0), never NaN. On CUDA, __expf
# underflows to exactly 0 below ~-87 (0 * inf = NaN) and the running t sum is rescaled by factors that underflow;
# on the CPU the chunk merges in double underflow below ~-745. Rows of (V, S, far value, where it lies):
# - "tiny": the case (-200 at entry 0, the -inf there);
# - "low_half": the first half is far below, the -inf at entry 0, the maximum comes later, so an infinite sum is
#   rescaled: across the threads of a block (V = 1024: whole threads below the maximum), within a thread (V = 8192,
#   16-bit), across CUDA splits (V = 8192 float32, V = 151,936) and across the CPU's 2048-entry chunks (-1e4);
# - "high_half": the second half is far below, the -inf at its start: a term whose exp underflows;
# - "finfo_min": masked with the dtype's lowest value (the logit difference itself overflows).
# -200 has a nonzero float64 probability, so the reference gives +inf too; -1e4 and finfo.min do not (exp
# underflows in float64: the reference drops the term), and the op's +inf is the exact answer there.
FAR_BELOW = [
    pytest.param(8, 1, -200.0, "first", id="tiny"),
    pytest.param(1024, 2, -200.0, "low_half", id="low_half-200-block"),
    pytest.param(8192, 2, -200.0, "low_half", id="low_half-200"),
    pytest.param(151936, 2, -200.0, "low_half", id="low_half-200-split"),
    pytest.param(8192, 2, -1e4, "low_half", id="low_half-1e4"),
    pytest.param(8192, 2, -1e4, "high_half", id="high_half-1e4"),
    pytest.param(8, 1, "finfo_min", "first", id="finfo_min"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V, S, far, where", FAR_BELOW)
def test_probe_divergence_far_below_clean_vs_neg_inf_perturbed_is_inf(device, probe, dtype, V, S, far, where):
    far = torch.finfo(dtype).min if far == "finfo_min" else far
    clean = torch.zeros(1, S, V, dtype=dtype)
    if where == "first":
        clean[..., 0] = far
    elif where == "low_half":
        clean[..., : V // 2] = far
    else:
        clean[..., V // 2:] = far
    pert = clean.clone()
    at = V // 2 if where == "high_half" else 0
    pert[..., at] = float("-inf")
    ids = torch.full((1, S), at, dtype=torch.int64)
    cpu = ops.probe_divergence(clean, pert, probe=probe, answer_ids=ids)
    dev = ops.probe_divergence(on(clean, device), on(pert, device), probe=probe, answer_ids=on(ids, device))
    assert float(cpu[0]) == float("inf"), f"CPU: {float(cpu[0])}"
    assert float(dev[0]) == float("inf"), f"{device}: {float(dev[0])}"
    want = ref.probe_divergence(clean, pert, probe=probe, answer_ids=ids)
    if far == -200.0 or probe == "answer_joint":
        assert float(want[0]) == float("inf")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N, S, V", [(3, 1, 7), (5, 4, 1000), (600, 2, 129), (2, 2, 49152), (1, 1, 151936)])
def test_probe_divergence_backward_parity(device, probe, dtype, N, S, V):
    clean, pert, ids, lengths = make_inputs(N, S, V, dtype, seed=3 * N + V)
    grads = []
    for d in ("cpu", device):
        p = pert.to(d).requires_grad_(True)
        out = ops.probe_divergence(clean.to(d), p, probe=probe, answer_ids=ids.to(d), lengths=lengths.to(d))
        w = torch.linspace(0.5, 1.5, N, device=d)  # a non-uniform grad_out
        (g,) = torch.autograd.grad((out * w).sum(), p)
        assert g.dtype == dtype and g.shape == (N, S, V)
        grads.append(g.cpu().float())
    g_cpu, g_dev = grads
    scale = g_cpu.abs().max().item()
    rtol = 2e-4 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(g_dev, g_cpu, rtol=rtol, atol=2e-4 * scale + 1e-12)
    # Positions at or beyond each row's probe length get exactly 0.
    Lp = torch.ones(N, dtype=torch.int64) if probe == "last" else lengths
    beyond = torch.arange(S)[None, :] >= Lp[:, None]
    assert torch.equal(g_dev[beyond], torch.zeros_like(g_dev[beyond]))


@pytest.mark.parametrize("device", DEVICES)
def test_probe_divergence_backward_matches_float64_reference(device):
    clean, pert, ids, lengths = make_inputs(4, 3, 5000, torch.float32, seed=41)
    for probe in PROBES:
        p = on(pert, device).requires_grad_(True)
        (g,) = torch.autograd.grad(ops.probe_divergence(on(clean, device), p, probe=probe, answer_ids=on(ids, device),
                                                        lengths=on(lengths, device)).sum(), p)
        p64 = pert.double().requires_grad_(True)
        (g64,) = torch.autograd.grad(ref.probe_divergence(clean, p64, probe=probe, answer_ids=ids,
                                                          lengths=lengths).sum(), p64)
        torch.testing.assert_close(g.cpu().double(), g64, rtol=1e-3, atol=1e-4 * g64.abs().max().item())


def _opcheck_cases():
    clean, pert, ids, lengths = make_inputs(3, 2, 40, torch.float32, seed=5)
    go = torch.rand(3, generator=gen(0))
    return {
        "probe_divergence_mean": (torch.ops.oar.probe_divergence.default, (clean, pert, None, lengths, "answer_mean")),
        "probe_divergence_joint": (torch.ops.oar.probe_divergence.default, (clean, pert, ids, lengths, "answer_joint")),
        "probe_divergence_grad": (torch.ops.oar.probe_divergence.default,
                                  (clean, pert.clone().requires_grad_(True), ids, lengths, "last")),
        "probe_divergence_backward": (torch.ops.oar.probe_divergence_backward.default,
                                      (go, clean, pert, ids, lengths, "answer_joint")),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck_on_device(device, case):
    op, args = _opcheck_cases()[case]

    def move(a):
        if isinstance(a, torch.Tensor):
            return a.detach().to(device).requires_grad_(a.requires_grad)
        return a

    torch.library.opcheck(op, tuple(move(a) for a in args))


# ---- torch.compile of the wrapper ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_wrapper_fullgraph(backend):
    """oar.ops.probe_divergence (every probe, with and without lengths) traces into one graph, forward and
    backward, and gives the eager values and gradients exactly."""
    torch._dynamo.reset()
    clean, pert, ids, lengths = make_inputs(3, 2, 64, torch.float32, seed=23)

    def f(c, p):
        return (ops.probe_divergence(c, p, probe="answer_mean", lengths=lengths)
                + ops.probe_divergence(c, p, probe="answer_joint", answer_ids=ids)
                + 0.5 * ops.probe_divergence(c, p, probe="last"))

    p_eager = pert.clone().requires_grad_(True)
    p_comp = pert.clone().requires_grad_(True)
    eager = f(clean, p_eager)
    eager.sum().backward()
    compiled = torch.compile(f, backend=backend, fullgraph=True)(clean, p_comp)
    compiled.sum().backward()
    assert torch.equal(compiled, eager)
    assert torch.equal(p_comp.grad, p_eager.grad)
