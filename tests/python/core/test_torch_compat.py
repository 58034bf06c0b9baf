"""`import oar` under a torch other than the one the build compiled against: a clear ImportError naming both
versions, raised before any compiled library is loaded (issue 11, section 2.3; rule in python/oar/_lib.py)."""

import importlib.machinery
import json
import os
import subprocess
import sys

import pytest
import torch

import oar
from oar import _lib

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(oar.__file__)))


def _built(version="2.14.1+cu130", cuda="13.0", abi=1, cuda_ops=True):
    return {"torch_version": version, "torch_cuda_version": cuda, "cxx11_abi": abi, "cuda_ops": cuda_ops}


@pytest.mark.parametrize("built, runtime", [
    (_built(), ("2.14.1+cu130", "13.0", 1)),                          # the same torch
    (_built(), ("2.14.0+cu130", "13.0", 1)),                          # another patch release
    (_built(), ("2.14.2", "13.2", 1)),                                # another CUDA minor version
    (_built(cuda_ops=False), ("2.14.1+cpu", None, 1)),                # CPU-only build under a CPU torch
    (_built("2.14.1+cpu", "", cuda_ops=False), ("2.14.1+cu130", "13.0", 1)),  # CPU-only build under CUDA torch
    (_built(abi=None), ("2.14.1+cu130", "13.0", 0)),                  # unknown ABI flag: not compared
    (_built(""), ("2.11.0", None, 1)),                                # built without the torch ops
])
def test_compatible_torch_versions(built, runtime):
    assert _lib.torch_mismatch(built, *runtime) is None


def test_another_minor_release_is_refused_naming_both_versions():
    assert _lib.torch_mismatch(_built(), "2.13.0+cu130", "13.0", 1) == (
        "oar was built against torch 2.14.1+cu130 but torch 2.13.0+cu130 is installed; oar's compiled ops need "
        "torch 2.14.x (LibTorch's C++ ABI changes between minor releases)")
    assert _lib.torch_mismatch(_built(), "2.15.0", "13.0", 1).startswith(
        "oar was built against torch 2.14.1+cu130 but torch 2.15.0 is installed")
    assert _lib.torch_mismatch(_built(), "3.14.1", "13.0", 1) is not None


def test_abi_and_cuda_mismatches_are_refused():
    assert _lib.torch_mismatch(_built(), "2.14.1", "13.0", 0) == (
        "oar was built against torch 2.14.1+cu130 with _GLIBCXX_USE_CXX11_ABI=1 but the installed torch 2.14.1 "
        "uses _GLIBCXX_USE_CXX11_ABI=0")
    assert _lib.torch_mismatch(_built(), "2.14.1+cpu", None, 1) == (
        "oar was built with CUDA ops against torch 2.14.1+cu130 (CUDA 13.0) but the installed torch 2.14.1+cpu "
        "has no CUDA (its liboar_torch.so links libtorch_cuda)")
    assert _lib.torch_mismatch(_built(), "2.14.1+cu128", "12.8", 1) == (
        "oar was built with CUDA ops against torch 2.14.1+cu130 (CUDA 13.0) but the installed torch 2.14.1+cu128 "
        "uses CUDA 12.8 (another CUDA major version)")


def test_this_build_records_the_installed_torch():
    built = _lib.build_config()
    assert built["torch_version"] == torch.__version__
    assert built["torch_cuda_version"] == (torch.version.cuda or "")
    assert built["cxx11_abi"] == int(torch._C._GLIBCXX_USE_CXX11_ABI)
    assert built["cuda_ops"] == oar.build_info()["cuda_ops_registered"]
    assert built["oar_version"] == oar.__version__
    assert oar.build_info()["torch_built_against"] == torch.__version__.split("+")[0]
    assert _lib.check_torch() is not None


def _import_oar_from(build_dir, skip_check=False):
    env = {k: v for k, v in os.environ.items() if k != "OAR_SKIP_TORCH_CHECK"}
    env.update(OAR_BUILD_DIR=str(build_dir), PYTHONPATH=PKG_PARENT)
    if skip_check:
        env["OAR_SKIP_TORCH_CHECK"] = "1"
    return subprocess.run([sys.executable, "-c", "import oar"], capture_output=True, text=True, env=env, timeout=300)


def test_import_under_another_torch_fails_before_loading_anything(tmp_path):
    # A build tree that says it was built against torch 2.13 and whose libraries are not libraries at all: the
    # ImportError must come from the version check, since loading either file would fail differently.
    (tmp_path / _lib.BUILD_FILE).write_text(json.dumps(_built("2.13.0+cu130")))
    ext = next(s for s in importlib.machinery.EXTENSION_SUFFIXES if s.endswith(".so"))
    fake_c = tmp_path / ("_C" + ext)
    for path in (tmp_path / "liboar_torch.so", fake_c):
        path.write_bytes(b"not an ELF file")
    p = _import_oar_from(tmp_path)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        f"ImportError: oar was built against torch 2.13.0+cu130 but torch {torch.__version__} is installed; oar's "
        "compiled ops need torch 2.13.x (LibTorch's C++ ABI changes between minor releases). Rebuild oar against "
        "the installed torch: `pip install --no-build-isolation --no-deps --no-cache-dir --force-reinstall <oar "
        f"source folder>` (./setup.sh in a checkout), or install the torch it was built against "
        f"({tmp_path / _lib.BUILD_FILE}).")
    # OAR_SKIP_TORCH_CHECK=1 warns and goes on to load the (fake) pybind11 module, which then fails to load.
    p = _import_oar_from(tmp_path, skip_check=True)
    assert p.returncode == 1
    assert "Loading anyway (OAR_SKIP_TORCH_CHECK=1)" in p.stderr
    assert p.stderr.strip().splitlines()[-1] == f"ImportError: {fake_c}: file too short"


def test_missing_build_file_is_an_import_error(tmp_path):
    # The file is read beside the _C that would be loaded (here the build tree's), never from another install.
    ext = next(s for s in importlib.machinery.EXTENSION_SUFFIXES if s.endswith(".so"))
    (tmp_path / ("_C" + ext)).write_bytes(b"not an ELF file")
    p = _import_oar_from(tmp_path)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        f"ImportError: oar: {_lib.BUILD_FILE} not found in {tmp_path}: the build is incomplete or predates this "
        "file. Build and install the package (./setup.sh) or set OAR_BUILD_DIR to a CMake build tree configured "
        "with -DOAR_BUILD_PYTHON=ON.")
