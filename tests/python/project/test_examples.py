"""examples/cpp builds against the oar C++ package with find_package(oar) and reshapes advantages like the
Python ops (issue 5).

The package is the installed one (``oar.cmake_prefix_path``, as tests/python/project/test_consumer.py uses) when it
exists; in the development layout (``OAR_BUILD_DIR``) the build tree is installed into a temporary prefix with
``cmake --install`` first, so the example always links an installed package, never the build tree.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import oar
from oar import ops

from _paths import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "cpp")


def _cmake():
    exe = shutil.which("cmake", path=os.path.dirname(sys.executable)) or shutil.which("cmake")
    if exe is None:
        pytest.skip("cmake not found")
    return exe


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    cmake = _cmake()
    tmp = tmp_path_factory.mktemp("example")
    if os.path.isdir(oar.cmake_prefix_path):
        prefix = oar.cmake_prefix_path
    elif os.environ.get("OAR_BUILD_DIR"):
        dest = tmp / "prefix"
        p = subprocess.run([cmake, "--install", os.environ["OAR_BUILD_DIR"], "--prefix", str(dest)],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
        prefix = str(dest)
    else:
        pytest.skip("oar is neither installed nor built (OAR_BUILD_DIR unset)")
    build = tmp / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja", path=os.path.dirname(sys.executable)) or shutil.which("ninja") else []
    cfg = subprocess.run([cmake, "-S", EXAMPLE, "-B", str(build), *gen, f"-DCMAKE_PREFIX_PATH={prefix}",
                          "-DCMAKE_BUILD_TYPE=Release"], capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    b = subprocess.run([cmake, "--build", str(build), "-j2"], capture_output=True, text=True)
    assert b.returncode == 0, b.stdout + b.stderr
    return build / "reshape_example"


def _run(exe, config="{}"):
    p = subprocess.run([str(exe), config], capture_output=True, text=True, timeout=60)
    return p


@pytest.mark.parametrize("config", ["{}", '{"tiers": "boost", "q": 0.5}', '{"tiers": "suppress", "beta": 2.0}',
                                    '{"method": "dr_grpo", "floor": 0.3}'])
def test_example_matches_python_ops(example, config):
    p = _run(example, config)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    cfg = oar.OARConfig.from_json(config)
    assert out["method"] == cfg.method and out["tiers"] == cfg.reshape.tiers
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    seq = oar.sequence_advantages(rewards, cfg, group_size=4)
    torch.testing.assert_close(torch.tensor(out["sequence_advantages"]), seq, rtol=1e-6, atol=1e-7)
    scores = torch.tensor([[0.1, 3.0, 0.2, 0.0, 1.5, 0.0], [2.0, 0.1, 0.1, 0.4, 0.3, 0.0],
                           [0.5, 0.5, 0.9, 0.2, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    lens = torch.tensor([6, 6, 5, 6])
    t = torch.arange(6)
    response = t[None, :] < lens[:, None]
    reasoning = t[None, :] < (lens - 1)[:, None]
    r = cfg.reshape
    tok, w = ops.reshape_advantages(seq, scores, reasoning, response, q=r.q, beta=r.beta, floor=r.floor, tiers=r.tiers)
    torch.testing.assert_close(torch.tensor(out["token_advantages"]).view(4, 6), tok, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(out["weights"]).view(4, 6), w, rtol=1e-5, atol=1e-6)
    # the contract: each row keeps its mass
    torch.testing.assert_close(tok.sum(1), seq * lens, rtol=1e-5, atol=1e-5)


def test_example_rejects_a_bad_config(example):
    p = _run(example, '{"q": 1.5}')
    assert p.returncode == 2 and "oar.q" in p.stderr
