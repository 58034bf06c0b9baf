"""CUDA checks that belong to no single op (issue 4), and the CUDA check switch (oar.cuda_checks).

Per-op CUDA tests (parity with the CPU op on ragged / odd / empty shapes and every dtype, opcheck on CUDA tensors,
bad input raising the CPU's ``ValueError``) live in each op's test file (test_group_advantages.py,
test_normalize_importance.py, test_reshape_advantages.py, test_probe_divergence.py, test_grad_x_input.py,
test_build_masked_batch.py) as the ``"cuda"`` value of their ``device`` parameter. Here: build information, the
check modes (``set_cuda_checks`` / ``cuda_checks`` / ``check_cuda_errors``: lazy errors raised at the next check),
the current stream and the device guard, one OAR step compiled as one graph (``fullgraph=True``) on every device,
and the GPU benchmark module in its CPU dry-run mode.

CUDA cases are skipped, with the reason printed (``pytest -rs``), where no GPU is present or oar was built without
CUDA kernels; on a GPU machine they must pass: ``pytest -m cuda`` runs every CUDA test of the suite
(benchmarks/gpu/run_gpu_checks.sh runs them).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import oar
from oar import cuda_checks, ops

from _devices import CUDA_SKIP_REASON, DEVICES, cuda_test, gen, no_pending_device_errors, on  # noqa: F401
from _op_inputs import make_inputs, reshape_case
from _paths import ROOT


def test_build_info_reports_cuda_state():
    info = oar.build_info()
    assert info["cuda_ops_registered"] == oar.has_cuda_kernels()
    if info["cuda_ops_registered"]:
        assert info["cuda_kernels"] and info["torch_cuda_built_against"]


def test_skip_reason_is_explicit():
    # The CUDA skips must say why (no GPU vs no kernels); pytest -rs prints them.
    if CUDA_SKIP_REASON is not None:
        assert "CUDA" in CUDA_SKIP_REASON


# ==== torch.compile ===========================================================================================

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_parity_fullgraph(device, backend):
    """One OAR step, compiled as one graph: probe divergence (with backward) -> grad x input -> reshaping."""
    torch._dynamo.reset()
    clean, pert, ids, lengths = make_inputs(4, 3, 257, torch.float32, seed=31)
    adv, scores, reason, resp = reshape_case(4, 40, torch.float32, seed=32)
    rewards = torch.randn(8, generator=gen(33))
    offsets = torch.tensor([0, 4, 8])
    emb = torch.randn(4, 40, 16, generator=gen(34))
    clean, ids, lengths, scores, reason, resp, rewards, offsets, emb = (
        on(t, device) for t in (clean, ids, lengths, scores, reason, resp, rewards, offsets, emb))

    def step(p):
        div = torch.ops.oar.probe_divergence(clean, p, ids, lengths, "answer_joint")
        g = torch.ops.oar.probe_divergence_backward(torch.ones_like(div), clean, p, ids, lengths, "answer_joint")
        imp = torch.ops.oar.grad_x_input(emb * g.float().mean(), emb) + scores
        a = torch.ops.oar.group_advantages(rewards, offsets, "grpo", "unbiased", 1e-6, "zero", False)[:4]
        tok, w = torch.ops.oar.reshape_advantages(a, imp, reason, resp, 0.25, 1.0, 0.1, "both", False)
        masked = torch.ops.oar.build_masked_batch(ids, torch.arange(4, device=p.device), lengths - 1, 0)
        return div, tok, w, masked

    p = on(pert, device)
    eager = step(p)
    compiled = torch.compile(step, backend=backend, fullgraph=True)(p)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)

    # Autograd through the compiled probe divergence.
    def loss(p):
        return ops.probe_divergence(clean, p, probe="answer_mean", lengths=lengths).sum()

    p1 = on(pert, device).requires_grad_(True)
    p2 = on(pert, device).requires_grad_(True)
    loss(p1).backward()
    torch.compile(loss, backend=backend, fullgraph=True)(p2).backward()
    torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-5, atol=1e-8)


# ==== stream and device guard =================================================================================

@cuda_test
def test_ops_run_on_the_current_stream():
    s = torch.cuda.Stream()
    clean, pert, ids, lengths = make_inputs(8, 2, 4096, torch.bfloat16, seed=51)
    want = ops.probe_divergence(on(clean, "cuda"), on(pert, "cuda"), lengths=on(lengths, "cuda"))
    c, p, ln = on(clean, "cuda"), on(pert, "cuda"), on(lengths, "cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        # Queue heavy work first: results read on s must still see the op's writes on s.
        for _ in range(3):
            got = ops.probe_divergence(c, p, lengths=ln)
        tok, w = ops.reshape_advantages(*(on(t, "cuda") for t in reshape_case(4, 5000, torch.float32, seed=3)))
    s.synchronize()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isfinite(tok).all()


@cuda_test
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for the device-guard test")
def test_ops_on_a_non_current_device():
    clean, pert, ids, lengths = make_inputs(3, 2, 1000, torch.float32, seed=61)
    with torch.cuda.device(0):
        got = ops.probe_divergence(clean.to("cuda:1"), pert.to("cuda:1"), probe="answer_joint",
                                   answer_ids=ids.to("cuda:1"), lengths=lengths.to("cuda:1"))
        a = ops.group_advantages(torch.randn(8, device="cuda:1"), group_size=4)
    assert got.device == torch.device("cuda:1") and a.device == torch.device("cuda:1")
    torch.testing.assert_close(got.cpu(), ops.probe_divergence(clean, pert, probe="answer_joint", answer_ids=ids,
                                                                lengths=lengths), rtol=2e-4, atol=2e-5)


# ==== the CUDA check switch ===================================================================================

@cuda_test
def test_lazy_checks_raise_at_the_next_check():
    assert ops.set_cuda_checks("lazy") in ("lazy", "eager")
    try:
        clean, pert, _, _ = make_inputs(2, 3, 50, torch.float32, seed=81)
        # No wait, no raise:
        out = ops.probe_divergence(on(clean, "cuda"), on(pert, "cuda"), lengths=on(torch.tensor([1, 9]), "cuda"))
        assert torch.isnan(out[1]).item() and torch.isfinite(out[0]).item()
        with pytest.raises(ValueError, match=r"probe_divergence \(CUDA\): lengths\[n\] must be in \[1, S\]"):
            ops.check_cuda_errors()
        ops.check_cuda_errors()  # raised once only
        # A lazy error is also raised by the next step-level op on the device.
        ops.build_masked_batch(on(torch.zeros(2, 4, dtype=torch.long), "cuda"), on(torch.tensor([5]), "cuda"),
                               on(torch.tensor([0]), "cuda"), 0)
        with pytest.raises(ValueError, match=r"an earlier oar CUDA call .* build_masked_batch"):
            ops.group_advantages(on(torch.randn(4), "cuda"), group_size=2)
        ops.check_cuda_errors()
        assert ops.cuda_checks() == "lazy"
    finally:
        ops.set_cuda_checks("lazy")


def test_cuda_checks_mode_argument_is_validated():
    with pytest.raises(ValueError, match=r"mode must be one of \('lazy', 'eager'\), got 'sometimes'"):
        ops.set_cuda_checks("sometimes")
    with pytest.raises(ValueError, match=r"device must be a CUDA device"):
        ops.check_cuda_errors("cpu")


def test_cuda_check_switch_round_trip():
    # The mode lives in the op library (torch.ops.oar._set_cuda_checks / _get_cuda_checks); oar.ops re-exports it.
    assert ops.set_cuda_checks is cuda_checks.set_cuda_checks and ops.check_cuda_errors is cuda_checks.check_cuda_errors
    prev = cuda_checks.set_cuda_checks("eager")
    try:
        if oar.has_cuda_kernels():
            assert cuda_checks.cuda_checks() == "eager"
            assert cuda_checks.set_cuda_checks("lazy") == "eager"
            assert ops.cuda_checks() == "lazy"
        else:  # nothing to switch: the call only validates its argument
            assert prev == "lazy" and cuda_checks.cuda_checks() == "lazy"
    finally:
        cuda_checks.set_cuda_checks(prev)


@pytest.mark.skipif(not oar.has_cuda_kernels(), reason="oar was built without CUDA kernels: no check ops")
def test_cuda_check_environment_variable():
    code = ("import oar\nfrom oar import cuda_checks\n"
            "try:\n    cuda_checks.cuda_checks()\nexcept ValueError as e:\n    print('ValueError:', e)\n"
            "print(cuda_checks.set_cuda_checks('eager'), cuda_checks.cuda_checks())\n")
    env = dict(os.environ, OAR_CUDA_CHECKS="sometimes")
    oar_parent = os.path.dirname(os.path.dirname(os.path.abspath(oar.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([oar_parent, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # An invalid value is an error naming the variable; an explicit setting overrides it (previous mode: the default).
    assert "ValueError: OAR_CUDA_CHECKS must be 'lazy' or 'eager', got 'sometimes'" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "lazy eager"
    env["OAR_CUDA_CHECKS"] = "eager"
    code = "import oar\nfrom oar import cuda_checks\nprint(cuda_checks.cuda_checks())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "eager", out.stdout + out.stderr


@pytest.mark.skipif(not oar.has_cuda_kernels(), reason="oar was built without CUDA kernels: no check ops")
def test_take_cuda_error_op_checks_the_device_index():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"device must be a CUDA device index in \[0, {n}\), got {n}"):
        torch.ops.oar._take_cuda_error(n)
    with pytest.raises(ValueError, match=r"mode must be one of \('lazy', 'eager'\), got 'x'"):
        torch.ops.oar._set_cuda_checks("x")


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
