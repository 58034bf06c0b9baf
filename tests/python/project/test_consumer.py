"""find_package(oar) works for a downstream CMake project against the INSTALLED package (issue 2, section 1).

Configures, builds and runs tests/consumer with CMAKE_PREFIX_PATH = oar.cmake_prefix_path, then checks
the numbers it prints against oar.reference (independent plain-PyTorch math). Skipped in the development
layout (OAR_BUILD_DIR), where nothing is installed.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import oar
from oar import reference

from _paths import ROOT

CONSUMER = os.path.join(ROOT, "tests", "consumer")

pytestmark = pytest.mark.skipif(
    not os.path.isdir(oar.cmake_prefix_path),
    reason=f"oar is not installed (no {oar.cmake_prefix_path}); development layout",
)


def _cmake():
    exe = shutil.which("cmake", path=os.path.dirname(sys.executable)) or shutil.which("cmake")
    if exe is None:
        pytest.skip("cmake not found")
    return exe


def _configure_and_build(build, python_exe):
    cmake = _cmake()
    gen = ["-G", "Ninja"] if shutil.which("ninja", path=os.path.dirname(sys.executable)) or shutil.which("ninja") else []
    cfg = subprocess.run([cmake, "-S", CONSUMER, "-B", str(build), *gen, f"-DCMAKE_PREFIX_PATH={oar.cmake_prefix_path}",
                          f"-DOAR_PYTHON_EXECUTABLE={python_exe}", "-DCMAKE_BUILD_TYPE=Release"],
                         capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    b = subprocess.run([cmake, "--build", str(build), "-j2"], capture_output=True, text=True)
    assert b.returncode == 0, b.stdout + b.stderr
    return cfg.stdout


@pytest.fixture(scope="module")
def consumer_build(tmp_path_factory):
    build = tmp_path_factory.mktemp("consumer")
    _configure_and_build(build, sys.executable)
    return build


def test_core_only_consumer_needs_no_torch(tmp_path):
    """With no usable Python/torch, find_package(oar) still provides oar::core (and says why not oar::torch)."""
    log = _configure_and_build(tmp_path, "/bin/false")
    assert "oar::torch is not available" in log
    assert (tmp_path / "consumer_core").exists() and not (tmp_path / "consumer_torch").exists()
    got = _run(str(tmp_path / "consumer_core"))
    assert len(got["advantages"]) == 4


def _run(path):
    out = subprocess.run([path], capture_output=True, text=True, check=True).stdout
    merged = {}
    for line in out.splitlines():
        merged.update(json.loads(line))
    return merged


def test_core_consumer_matches_reference(consumer_build):
    got = _run(str(consumer_build / "consumer_core"))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    # TRL convention written out: (r - mean) / (unbiased std + 1e-4)
    exp_adv = (rewards - rewards.mean()) / (rewards.std(unbiased=True) + 1e-4)
    torch.testing.assert_close(torch.tensor(got["advantages"], dtype=torch.float64), exp_adv, rtol=1e-6, atol=1e-6)
    scores = torch.tensor([[0.0, 2.0, 0.5, 8.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0]])
    rmask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    mask = torch.ones(2, 5, dtype=torch.bool)
    exp_tok, _ = reference.reshape_advantages(exp_adv[:2].float(), scores, rmask, mask)
    torch.testing.assert_close(torch.tensor(got["token_advantages"]).view(2, 5), exp_tok.float(), rtol=1e-5, atol=1e-6)
    # Mass preservation survives the install boundary too.
    tok = torch.tensor(got["token_advantages"]).view(2, 5)
    torch.testing.assert_close(tok.sum(1), 5 * exp_adv[:2].float(), rtol=1e-5, atol=1e-6)


def test_torch_consumer_matches_reference(consumer_build):
    exe = consumer_build / "consumer_torch"
    if not exe.exists():
        pytest.skip("oar was installed without the LibTorch op library")
    got = _run(str(exe))
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5], dtype=torch.float64)
    g1 = (r[:4] - r[:4].mean()) / (r[:4].std() + 1e-6)  # verl: unbiased std, eps 1e-6
    exp = torch.cat([g1, torch.zeros(2, dtype=torch.float64)])  # all-equal group -> 0
    torch.testing.assert_close(torch.tensor(got["advantages"], dtype=torch.float64), exp, rtol=1e-6, atol=1e-6)
    assert got["q_error"] is True
    tok = torch.tensor(got["token_advantages"])
    torch.testing.assert_close(tok.sum(), 4 * exp[0].float(), rtol=1e-5, atol=1e-6)
