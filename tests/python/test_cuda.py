"""CUDA implementations of every oar op against the CPU ones (issue 4).

What is covered, per op: CPU-vs-CUDA parity on several shapes (ragged / odd sizes, empty rows, all-equal
groups and rows, the shared-memory and global-memory paths, split and unsplit probe plans, misaligned views
that take the scalar fallbacks), every supported dtype, ``torch.library.opcheck`` on CUDA tensors, the
autograd backward of the probe divergence, a ``torch.compile`` parity test (``fullgraph=True``), the current
stream / device guard, and bad input on CUDA raising the CPU's ``ValueError`` naming the argument (eager
checks), or at the next check (lazy checks, the default; src/torch/cuda_checks.h).

Skipped, with the reason printed (``pytest -rs``), where no GPU is present or oar was built without CUDA
kernels; on a GPU machine they must pass (benchmarks/gpu/run_gpu_checks.sh runs them).

``OAR_CUDA_TEST_DEVICE=cpu`` runs the same parity code with "cpu" as the device under test (CPU vs CPU):
it checks the harness itself (shapes, tolerances, regexes of the CPU messages that the CUDA ops re-raise)
on machines without a GPU. The lazy-check and stream tests need CUDA and stay skipped then.

The last test runs the GPU benchmark module in its CPU dry-run mode (no GPU needed).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import oar
from oar import ops
from oar import reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEV = os.environ.get("OAR_CUDA_TEST_DEVICE", "cuda")
ON_CUDA = DEV.startswith("cuda")

if ON_CUDA and not torch.cuda.is_available():
    _skip_reason = "no CUDA device on this machine (torch.cuda.is_available() is False)"
elif ON_CUDA and not oar.has_cuda_kernels():
    _skip_reason = "oar was built without CUDA kernels (no nvcc at build time, or a CPU-only torch)"
else:
    _skip_reason = None
device_test = pytest.mark.skipif(_skip_reason is not None, reason=_skip_reason or "")
cuda_only = pytest.mark.skipif(not ON_CUDA or _skip_reason is not None,
                               reason=_skip_reason or "needs a CUDA device (OAR_CUDA_TEST_DEVICE=cpu)")

PROBES = ["last", "answer_mean", "answer_joint"]
LOGIT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REAL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _no_pending_device_errors():
    """Every test starts and ends with no unraised device error (a lazy error would leak into the next test)."""
    if ON_CUDA and _skip_reason is None:
        ops.check_cuda_errors()
    yield
    if ON_CUDA and _skip_reason is None:
        torch.cuda.synchronize()
        ops.check_cuda_errors()


@pytest.fixture
def eager_checks():
    """Every CUDA op checks its data before returning (the CPU's exact messages)."""
    prev = ops.set_cuda_checks("eager")
    yield
    ops.set_cuda_checks(prev)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def on(t):
    """Host tensor -> device under test (None stays None)."""
    return None if t is None else t.to(DEV)


def test_build_info_reports_cuda_state():
    info = oar.build_info()
    assert info["cuda_ops_registered"] == oar.has_cuda_kernels()
    if info["cuda_ops_registered"]:
        assert info["cuda_kernels"] and info["torch_cuda_built_against"]


def test_skip_reason_is_explicit():
    # This file's skips must say why (no GPU vs no kernels); pytest -rs prints them.
    if _skip_reason is not None:
        assert "CUDA" in _skip_reason


# ==== normalize_importance / reshape_advantages ===============================================================

def reshape_case(B, T, dtype, seed, ties=False, empty_rows=(), equal_rows=()):
    g = gen(seed)
    scores = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    if ties:
        scores = (scores * 4).round() / 4  # few distinct values: radix-select multiplicities
    resp = torch.rand(B, T, generator=g) < 0.9
    resp[:, 0] = True
    reason = resp & (torch.rand(B, T, generator=g) < 0.75)
    for b in empty_rows:
        reason[b] = False
    for b in equal_rows:
        scores[b] = 0.5
    adv = torch.randn(B, generator=g)
    return adv, scores.to(dtype), reason, resp


SHAPES = [(1, 1), (3, 7), (5, 1000), (4, 4097), (2, 70_000)]  # the last: row kept in global memory


@device_test
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("B, T", SHAPES)
def test_normalize_importance_parity(dtype, B, T):
    _, scores, reason, _ = reshape_case(B, T, dtype, seed=B * T, empty_rows=(0,) if B > 2 else (),
                                        equal_rows=(1,) if B > 2 else ())
    cpu = ops.normalize_importance(scores, reason)
    dev = ops.normalize_importance(on(scores), on(reason))
    assert dev.dtype == torch.float32 and dev.shape == (B, T)
    torch.testing.assert_close(dev.cpu(), cpu, rtol=1e-6, atol=1e-7)
    assert torch.equal(dev.cpu()[~reason], torch.zeros(int((~reason).sum())))


@device_test
@pytest.mark.parametrize("tiers", ["both", "boost", "suppress"])
@pytest.mark.parametrize("normalized", [False, True])
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("B, T", SHAPES)
def test_reshape_advantages_parity(tiers, normalized, dtype, B, T):
    adv, scores, reason, resp = reshape_case(B, T, dtype, seed=7 + B + T, ties=(T == 1000),
                                             empty_rows=(0,) if B > 2 else (), equal_rows=(1,) if B > 2 else ())
    if normalized:
        scores = ops.normalize_importance(scores, reason).to(dtype)
    kw = dict(q=0.3, beta=1.5, floor=0.05, tiers=tiers, scores_are_normalized=normalized)
    tok_c, w_c = ops.reshape_advantages(adv, scores, reason, resp, **kw)
    tok_d, w_d = ops.reshape_advantages(on(adv), on(scores), on(reason), on(resp), **kw)
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


@device_test
@pytest.mark.parametrize("q", [0.01, 0.25, 0.5, 0.99])
@pytest.mark.parametrize("T", [2, 3, 17, 256, 3000])
def test_reshape_quantile_edge_levels_match_reference(q, T):
    # tau interpolates between order statistics k and k + 1 (numpy "linear"); ties included.
    adv, scores, reason, resp = reshape_case(6, T, torch.float32, seed=T, ties=True)
    tok_d, w_d = ops.reshape_advantages(on(adv), on(scores), on(reason), on(resp), q=q)
    tok_r, w_r = ref.reshape_advantages(adv, scores, reason, resp, q=q)
    torch.testing.assert_close(w_d.cpu(), w_r, rtol=1e-5, atol=1e-5)
    tok_c, w_c = ops.reshape_advantages(adv, scores, reason, resp, q=q)
    torch.testing.assert_close(w_d.cpu(), w_c, rtol=2e-6, atol=2e-6)


@device_test
def test_reshape_zero_length_and_empty_batch():
    a = torch.tensor([1.0, -2.0])
    s = torch.zeros(2, 0)
    m = torch.zeros(2, 0, dtype=torch.bool)
    tok, w = ops.reshape_advantages(on(a), on(s), on(m), on(m))
    assert tok.shape == w.shape == (2, 0)
    tok, w = ops.reshape_advantages(on(torch.zeros(0)), on(torch.zeros(0, 5)), on(torch.zeros(0, 5, dtype=torch.bool)),
                                    on(torch.zeros(0, 5, dtype=torch.bool)))
    assert tok.shape == (0, 5)
    assert ops.normalize_importance(on(torch.zeros(0, 3)), on(torch.zeros(0, 3, dtype=torch.bool))).shape == (0, 3)


# ==== probe divergence ========================================================================================

def probe_case(N, S, V, dtype, seed=0, noise=0.5, scale=2.0):
    g = gen(seed)
    clean = (scale * torch.randn(N, S, V, generator=g)).to(dtype)
    pert = (clean.float() + noise * torch.randn(N, S, V, generator=g)).to(dtype)
    ids = torch.randint(0, V, (N, S), generator=g)
    lengths = torch.randint(1, S + 1, (N,), generator=g)
    return clean, pert, ids, lengths


def probe_tol(dtype):
    # Same input values on both devices; only the reduction order and the fast exp differ (fp32 accumulation).
    return dict(rtol=2e-4, atol=2e-5)


# (N, S, V): odd V (scalar tails), a split plan (few rows, big V), an unsplit plan (many rows: one block per row
# finalizes), the two production vocabularies at small N.
PROBE_SHAPES = [(3, 1, 7), (5, 4, 1000), (600, 2, 513), (2, 3, 49152), (2, 1, 151936)]


@device_test
@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("N, S, V", PROBE_SHAPES)
@pytest.mark.parametrize("with_lengths", [False, True])
def test_probe_divergence_parity(probe, dtype, N, S, V, with_lengths):
    clean, pert, ids, lengths = probe_case(N, S, V, dtype, seed=N + S + V)
    lengths = lengths if with_lengths else None
    cpu = ops.probe_divergence(clean, pert, probe=probe, answer_ids=ids, lengths=lengths)
    dev = ops.probe_divergence(on(clean), on(pert), probe=probe, answer_ids=on(ids), lengths=on(lengths))
    assert dev.dtype == torch.float32 and dev.shape == (N,)
    torch.testing.assert_close(dev.cpu(), cpu, **probe_tol(dtype))
    want = ref.probe_divergence(clean, pert, probe=probe, answer_ids=ids, lengths=lengths)
    torch.testing.assert_close(dev.cpu().double(), want, rtol=1e-3, atol=1e-4)


@device_test
@pytest.mark.parametrize("probe", PROBES)
def test_probe_divergence_broadcast_clean_and_misaligned_views(probe):
    N, S, V = 7, 3, 2051
    clean1, pert, ids, lengths = probe_case(1, S, V + 1, torch.bfloat16, seed=11)
    _, pert, _, _ = probe_case(N, S, V + 1, torch.bfloat16, seed=12)
    ids = torch.randint(0, V, (N, S), generator=gen(13))
    lengths = torch.randint(1, S + 1, (N,), generator=gen(14))
    # A vocabulary slice starting at 1: rows are not 16-byte aligned -> the scalar path; clean broadcast over N.
    c_host = clean1[..., 1:].expand(N, S, V)
    p_host = pert[..., 1:]
    cpu = ops.probe_divergence(c_host, p_host, probe=probe, answer_ids=ids, lengths=lengths)
    c_dev = on(clean1)[..., 1:].expand(N, S, V)
    p_dev = on(pert)[..., 1:]
    dev = ops.probe_divergence(c_dev, p_dev, probe=probe, answer_ids=on(ids), lengths=on(lengths))
    torch.testing.assert_close(dev.cpu(), cpu, rtol=2e-4, atol=2e-5)
    # Broadcast of a clean row that is a tensor of its own (stride 0 over N).
    dev2 = ops.probe_divergence(on(clean1[..., :V]).expand(N, S, V), on(pert[..., :V]).contiguous(), probe=probe,
                                answer_ids=on(ids), lengths=on(lengths))
    cpu2 = ops.probe_divergence(clean1[..., :V].expand(N, S, V), pert[..., :V].contiguous(), probe=probe,
                                answer_ids=ids, lengths=lengths)
    torch.testing.assert_close(dev2.cpu(), cpu2, rtol=2e-4, atol=2e-5)


@device_test
def test_probe_divergence_neg_inf_logits_and_identical_rows():
    clean, pert, ids, lengths = probe_case(4, 2, 300, torch.float32, seed=17)
    clean[0, :, :50] = float("-inf")
    pert[0, :, :50] = float("-inf")
    pert[1] = clean[1]  # identical rows: KL exactly 0 after the clamp
    for probe in PROBES:
        cpu = ops.probe_divergence(clean, pert, probe=probe, answer_ids=ids.clamp_min(50), lengths=lengths)
        dev = ops.probe_divergence(on(clean), on(pert), probe=probe, answer_ids=on(ids.clamp_min(50)),
                                   lengths=on(lengths))
        torch.testing.assert_close(dev.cpu(), cpu, rtol=2e-4, atol=2e-5)
        assert torch.isfinite(dev).all()
        if probe != "answer_joint":
            assert float(dev[1]) == 0.0 or abs(float(dev[1])) < 1e-6


@device_test
@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("N, S, V", [(3, 1, 7), (5, 4, 1000), (600, 2, 129), (2, 2, 49152), (1, 1, 151936)])
def test_probe_divergence_backward_parity(probe, dtype, N, S, V):
    clean, pert, ids, lengths = probe_case(N, S, V, dtype, seed=3 * N + V)
    grads = []
    for d in ("cpu", DEV):
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


@device_test
def test_probe_divergence_backward_matches_float64_reference():
    clean, pert, ids, lengths = probe_case(4, 3, 5000, torch.float32, seed=41)
    for probe in PROBES:
        p = on(pert).requires_grad_(True)
        (g,) = torch.autograd.grad(ops.probe_divergence(on(clean), p, probe=probe, answer_ids=on(ids),
                                                        lengths=on(lengths)).sum(), p)
        p64 = pert.double().requires_grad_(True)
        (g64,) = torch.autograd.grad(ref.probe_divergence(clean, p64, probe=probe, answer_ids=ids,
                                                          lengths=lengths).sum(), p64)
        torch.testing.assert_close(g.cpu().double(), g64, rtol=1e-3, atol=1e-4 * g64.abs().max().item())


# ==== grad x input / masked batch =============================================================================

@device_test
@pytest.mark.parametrize("dtype", REAL_DTYPES, ids=str)
@pytest.mark.parametrize("H", [1, 7, 64, 576, 1000, 2048])
def test_grad_x_input_parity(dtype, H):
    g = gen(H)
    grad = torch.randn(3, 41, H, generator=g).to(dtype)
    inp = torch.randn(3, 41, H, generator=g).to(dtype)
    cpu = ops.grad_x_input(grad, inp)
    dev = ops.grad_x_input(on(grad), on(inp))
    assert dev.dtype == torch.float32 and dev.shape == (3, 41)
    bound = 1e-5 * (grad.double().abs() * inp.double().abs()).sum(-1) + 1e-6
    assert ((dev.cpu().double() - cpu.double()).abs() <= bound).all()
    torch.testing.assert_close(dev.cpu().double(), ref.grad_x_input(grad, inp), rtol=1e-4, atol=1e-4)


@device_test
def test_grad_x_input_non_contiguous_and_misaligned():
    x = torch.randn(2, 8, 16).transpose(0, 1)
    y = torch.randn(2, 8, 16).transpose(0, 1)
    torch.testing.assert_close(ops.grad_x_input(on(x), on(y)).cpu(), ops.grad_x_input(x, y), rtol=1e-5, atol=1e-5)
    # A contiguous view with a storage offset of one element: not 16-byte aligned -> the scalar path.
    flat_g = on(torch.randn(1 + 4 * 5 * 64, generator=gen(1)).to(torch.bfloat16))
    flat_x = on(torch.randn(1 + 4 * 5 * 64, generator=gen(2)).to(torch.bfloat16))
    g, xx = flat_g[1:].view(4, 5, 64), flat_x[1:].view(4, 5, 64)
    assert g.is_contiguous() and g.data_ptr() % 16 != 0
    torch.testing.assert_close(ops.grad_x_input(g, xx).cpu(), ops.grad_x_input(g.cpu(), xx.cpu()), rtol=1e-5,
                               atol=1e-5)


@device_test
@pytest.mark.parametrize("B, T, M", [(1, 1, 1), (3, 7, 10), (4, 2048, 9), (2, 5001, 33), (64, 1024, 4096)])
def test_build_masked_batch_parity(B, T, M):
    g = gen(B * T + M)
    ids = torch.randint(0, 50_000, (B, T), generator=g)
    rows = torch.randint(0, B, (M,), generator=g)
    pos = torch.randint(0, T, (M,), generator=g)
    cpu = ops.build_masked_batch(ids, rows, pos, 7)
    dev = ops.build_masked_batch(on(ids), on(rows), on(pos), 7)
    assert dev.dtype == torch.int64 and dev.shape == (M, T)
    assert torch.equal(dev.cpu(), cpu)
    assert torch.equal(cpu, ref.build_masked_batch(ids, rows, pos, 7))


@device_test
def test_build_masked_batch_misaligned_input_and_empty():
    flat = on(torch.arange(1 + 6 * 8))
    ids = flat[1:].view(6, 8)  # even T but an 8-byte storage offset: the 8-byte copy path
    rows = on(torch.tensor([5, 0, 3]))
    pos = on(torch.tensor([7, 0, 4]))
    assert torch.equal(ops.build_masked_batch(ids, rows, pos, -1).cpu(),
                       ops.build_masked_batch(ids.cpu(), rows.cpu(), pos.cpu(), -1))
    empty = ops.build_masked_batch(ids, on(torch.zeros(0, dtype=torch.long)), on(torch.zeros(0, dtype=torch.long)), 0)
    assert empty.shape == (0, 8)


# ==== opcheck =================================================================================================

def _opcheck_cases():
    g = gen(0)
    r = torch.randn(10, generator=g)
    off = torch.tensor([0, 3, 3, 10])
    s = torch.rand(3, 9, generator=g)
    m = torch.rand(3, 9, generator=g) < 0.7
    resp = torch.ones(3, 9, dtype=torch.bool)
    clean, pert, ids, lengths = probe_case(3, 2, 40, torch.float32, seed=5)
    go = torch.rand(3, generator=g)
    grad, x = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g)
    tok = torch.randint(0, 100, (4, 6), generator=g)
    return {
        "normalize_importance": (torch.ops.oar.normalize_importance.default, (s, m), {}),
        "reshape_advantages": (torch.ops.oar.reshape_advantages.default, (torch.randn(3, generator=g), s, m, resp), {}),
        "probe_divergence_mean": (torch.ops.oar.probe_divergence.default, (clean, pert, None, lengths, "answer_mean"), {}),
        "probe_divergence_joint": (torch.ops.oar.probe_divergence.default, (clean, pert, ids, lengths, "answer_joint"), {}),
        "probe_divergence_grad": (torch.ops.oar.probe_divergence.default,
                                  (clean, pert.clone().requires_grad_(True), ids, lengths, "last"), {}),
        "probe_divergence_backward": (torch.ops.oar.probe_divergence_backward.default,
                                      (go, clean, pert, ids, lengths, "answer_joint"), {}),
        "grad_x_input": (torch.ops.oar.grad_x_input.default, (grad, x), {}),
        "build_masked_batch": (torch.ops.oar.build_masked_batch.default,
                               (tok, torch.tensor([0, 3, 3]), torch.tensor([5, 0, 2]), 9), {}),
    }


@device_test
@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck_on_device(case):
    op, args, kwargs = _opcheck_cases()[case]

    def move(a):
        if isinstance(a, torch.Tensor):
            t = a.detach().to(DEV)
            return t.requires_grad_(a.requires_grad)
        return a

    torch.library.opcheck(op, tuple(move(a) for a in args), kwargs)


# ==== torch.compile ===========================================================================================

@device_test
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_parity_fullgraph(backend):
    """One OAR step, compiled as one graph: probe divergence (with backward) -> grad x input -> reshaping."""
    torch._dynamo.reset()
    clean, pert, ids, lengths = probe_case(4, 3, 257, torch.float32, seed=31)
    adv, scores, reason, resp = reshape_case(4, 40, torch.float32, seed=32)
    rewards = torch.randn(8, generator=gen(33))
    offsets = torch.tensor([0, 4, 8])
    emb = torch.randn(4, 40, 16, generator=gen(34))
    clean, ids, lengths, scores, reason, resp, rewards, offsets, emb = map(
        on, (clean, ids, lengths, scores, reason, resp, rewards, offsets, emb))

    def step(p):
        div = torch.ops.oar.probe_divergence(clean, p, ids, lengths, "answer_joint")
        g = torch.ops.oar.probe_divergence_backward(torch.ones_like(div), clean, p, ids, lengths, "answer_joint")
        imp = torch.ops.oar.grad_x_input(emb * g.float().mean(), emb) + scores
        a = torch.ops.oar.group_advantages(rewards, offsets, "grpo", "unbiased", 1e-6, "zero", False)[:4]
        tok, w = torch.ops.oar.reshape_advantages(a, imp, reason, resp, 0.25, 1.0, 0.1, "both", False)
        masked = torch.ops.oar.build_masked_batch(ids, torch.arange(4, device=p.device), lengths - 1, 0)
        return div, tok, w, masked

    p = on(pert)
    eager = step(p)
    compiled = torch.compile(step, backend=backend, fullgraph=True)(p)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)

    # Autograd through the compiled probe divergence.
    def loss(p):
        return ops.probe_divergence(clean, p, probe="answer_mean", lengths=lengths).sum()

    p1 = on(pert).requires_grad_(True)
    p2 = on(pert).requires_grad_(True)
    loss(p1).backward()
    torch.compile(loss, backend=backend, fullgraph=True)(p2).backward()
    torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-5, atol=1e-8)


# ==== stream and device guard =================================================================================

@cuda_only
def test_ops_run_on_the_current_stream():
    s = torch.cuda.Stream()
    clean, pert, ids, lengths = probe_case(8, 2, 4096, torch.bfloat16, seed=51)
    want = ops.probe_divergence(on(clean), on(pert), lengths=on(lengths))
    c, p, ln = on(clean), on(pert), on(lengths)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        # Queue heavy work first: results read on s must still see the op's writes on s.
        for _ in range(3):
            got = ops.probe_divergence(c, p, lengths=ln)
        tok, w = ops.reshape_advantages(*map(on, reshape_case(4, 5000, torch.float32, seed=3)[:4]))
    s.synchronize()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isfinite(tok).all()


@cuda_only
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for the device-guard test")
def test_ops_on_a_non_current_device():
    clean, pert, ids, lengths = probe_case(3, 2, 1000, torch.float32, seed=61)
    with torch.cuda.device(0):
        got = ops.probe_divergence(clean.to("cuda:1"), pert.to("cuda:1"), probe="answer_joint",
                                   answer_ids=ids.to("cuda:1"), lengths=lengths.to("cuda:1"))
        a = ops.group_advantages(torch.randn(8, device="cuda:1"), group_size=4)
    assert got.device == torch.device("cuda:1") and a.device == torch.device("cuda:1")
    torch.testing.assert_close(got.cpu(), ops.probe_divergence(clean, pert, probe="answer_joint", answer_ids=ids,
                                                                lengths=lengths), rtol=2e-4, atol=2e-5)


# ==== bad input ===============================================================================================

def _bad_input_cases():
    r = torch.randn(6)
    off = torch.tensor([0, 3, 6])
    s = torch.rand(2, 5)
    m = torch.ones(2, 5, dtype=torch.bool)
    clean, pert, ids, lengths = probe_case(2, 3, 50, torch.float32, seed=71)
    tok = torch.randint(0, 9, (2, 4))
    nan_r = r.clone()
    nan_r[4] = float("nan")
    neg_s = s.clone()
    neg_s[1, 2] = -1.0
    sub = m.clone()
    sub[0, 1] = False
    nan_g = torch.randn(1, 2, 8)
    nan_g[0, 1, 3] = float("nan")
    bad_ids = ids.clone()
    bad_ids[1, 0] = 50  # == V
    return {
        # argument checks (host side, before any launch)
        "scores_dim": (lambda: ops.normalize_importance(on(r), on(m)), r"scores must be 2-D \(B, T\)"),
        "q_range": (lambda: ops.reshape_advantages(on(torch.ones(2)), on(s), on(m), on(m), q=1.5), r"q must be in \(0, 1\)"),
        "probe_name": (lambda: ops.probe_divergence(on(clean), on(pert), probe="first"), r"probe must be one of"),
        "logits_shape": (lambda: ops.probe_divergence(on(clean[:1]), on(pert)), r"clean_logits must be \(N, S, V\)"),
        "grad_dtype": (lambda: ops.grad_x_input(on(torch.randn(1, 2, 4).double()), on(torch.randn(1, 2, 4))),
                       r"grad must have the dtype of input"),
        "row_index_dtype": (lambda: ops.build_masked_batch(on(tok), on(torch.tensor([0.0])), on(torch.tensor([0])), 0),
                            r"row_index must have dtype"),
        # data checks (found on the device, re-raised with the CPU's message)
        "negative_score": (lambda: ops.normalize_importance(on(neg_s), on(m)), r"scores must be finite and >= 0.*\[1, 2\]"),
        "not_subset": (lambda: ops.reshape_advantages(on(torch.ones(2)), on(s), on(m), on(sub)),
                       r"reasoning_mask must be a subset of response_mask"),
        "nan_advantage": (lambda: ops.reshape_advantages(on(torch.tensor([1.0, float("nan")])), on(s), on(m), on(m)),
                          r"advantages must be finite, got advantages\[1\]"),
        "bad_length": (lambda: ops.probe_divergence(on(clean), on(pert), lengths=on(torch.tensor([1, 4]))),
                       r"lengths\[1\] must be in \[1, S=3\], got 4"),
        "bad_answer_id": (lambda: ops.probe_divergence(on(clean), on(pert), probe="answer_joint", answer_ids=on(bad_ids),
                                                       lengths=on(torch.tensor([3, 3]))),
                          r"answer_ids\[1, 0\]"),
        "nan_logits": (lambda: ops.probe_divergence(on(clean), on(pert.index_fill(0, torch.tensor([1]), float("nan")))),
                       r"row 1 gives a NaN"),
        "nan_grad": (lambda: ops.grad_x_input(on(nan_g), on(torch.ones(1, 2, 8))), r"grad_x_input: the result at \[0, 1\]"),
        "row_index_range": (lambda: ops.build_masked_batch(on(tok), on(torch.tensor([0, 2])), on(torch.tensor([0, 1])), 0),
                            r"row_index\[1\] must be in \[0, B=2\)"),
        "positions_range": (lambda: ops.build_masked_batch(on(tok), on(torch.tensor([0, 1])), on(torch.tensor([4, 1])), 0),
                            r"positions\[0\] must be in \[0, T=4\)"),
    }


@device_test
@pytest.mark.parametrize("case", list(_bad_input_cases()))
def test_bad_input_raises_value_error_naming_the_argument(case, eager_checks):
    call, match = _bad_input_cases()[case]
    with pytest.raises(ValueError, match=match):
        call()


@cuda_only
def test_lazy_checks_raise_at_the_next_check():
    assert ops.set_cuda_checks("lazy") in ("lazy", "eager")
    try:
        clean, pert, _, _ = probe_case(2, 3, 50, torch.float32, seed=81)
        out = ops.probe_divergence(on(clean), on(pert), lengths=on(torch.tensor([1, 9])))  # no wait, no raise
        assert torch.isnan(out[1]).item() and torch.isfinite(out[0]).item()
        with pytest.raises(ValueError, match=r"probe_divergence \(CUDA\): lengths\[n\] must be in \[1, S\]"):
            ops.check_cuda_errors()
        ops.check_cuda_errors()  # raised once only
        # A lazy error is also raised by the next step-level op on the device.
        ops.build_masked_batch(on(torch.zeros(2, 4, dtype=torch.long)), on(torch.tensor([5])), on(torch.tensor([0])), 0)
        with pytest.raises(ValueError, match=r"an earlier oar CUDA call .* build_masked_batch"):
            ops.group_advantages(on(torch.randn(4)), group_size=2)
        ops.check_cuda_errors()
        assert ops.cuda_checks() == "lazy"
    finally:
        ops.set_cuda_checks("lazy")


def test_cuda_checks_mode_argument_is_validated():
    with pytest.raises(ValueError, match=r"mode must be one of \('lazy', 'eager'\), got 'sometimes'"):
        ops.set_cuda_checks("sometimes")
    with pytest.raises(ValueError, match=r"device must be a CUDA device"):
        ops.check_cuda_errors("cpu")


# ==== GPU benchmark module (CPU dry run) ======================================================================

def test_gpu_benchmark_dry_run_prints_the_table(tmp_path):
    """benchmarks/gpu/bench_cuda.py --dry-run: tiny sizes on the CPU through the same timing and table code."""
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1")
    # The child imports the same oar as this process (installed package in CI, python/ + OAR_BUILD_DIR in a dev tree).
    oar_parent = os.path.dirname(os.path.dirname(os.path.abspath(oar.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([oar_parent, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "bench_cuda.py"), "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for op in ("copy", "probe_divergence", "reshape_advantages", "group_advantages", "grad_x_input",
               "build_masked_batch"):
        assert op in out, out
    assert "GB/s" in out and "speed-up" in out
    csv = (tmp_path / "bench_cuda.csv").read_text().splitlines()
    assert csv[0].startswith("op,") and len(csv) >= 8
