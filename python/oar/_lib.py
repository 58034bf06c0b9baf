"""Locating and loading oar's compiled parts: the LibTorch op library and the pybind11 module.

Installed layout (wheel): ``oar/lib/liboar_torch.so``, ``oar/_C*.so`` and ``oar/torch_build.json``.
Development layout: set ``OAR_BUILD_DIR`` to a CMake build tree (``cmake -B build -DOAR_BUILD_PYTHON=ON``) and
put ``python/`` on ``PYTHONPATH``; all three are then read from that tree.

Before anything compiled is loaded, :func:`check_torch` compares the torch this build compiled against
(``torch_build.json``, written by CMake) with the installed one. LibTorch has no C++ ABI stability across
minor releases: a library built against torch 2.14 loaded under 2.13 or 2.15 fails with an undefined symbol,
or worse, misbehaves. The rule (:func:`torch_mismatch`):

* torch ``major.minor`` must be equal; the patch release and the local suffix (``+cu130``, ``+cpu``) may
  differ (patch releases keep the C++ ABI; extension wheels such as flash-attention's are built per
  ``major.minor`` for this reason);
* the C++11 string ABI flag (``torch._C._GLIBCXX_USE_CXX11_ABI``) must be equal;
* a build with CUDA ops (linked against ``libtorch_cuda``) needs a CUDA build of torch with the same CUDA
  major version; a CPU-only build loads under CPU and CUDA builds of torch alike.

``OAR_SKIP_TORCH_CHECK=1`` turns the ImportError into a warning (for experiments with nightlies; expect
undefined-symbol errors when the ABI really differs).
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import json
import os
import re
import sys
import warnings
from types import ModuleType

import torch

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))

#: Written by CMake (cmake/torch_build.json.in) next to ``_C``: what this build compiled against.
BUILD_FILE = "torch_build.json"

_REBUILD_HINT = (
    "Rebuild oar against the installed torch: `pip install --no-build-isolation --no-deps --no-cache-dir "
    "--force-reinstall <oar source folder>` (./setup.sh in a checkout), or install the torch it was built against"
)


def _search_dirs() -> list[str]:
    dirs = []
    build = os.environ.get("OAR_BUILD_DIR")
    if build:
        dirs.append(os.path.abspath(build))
    dirs += [os.path.join(_PKG_DIR, "lib"), _PKG_DIR]
    return dirs


def _find(pattern: str) -> str | None:
    for d in _search_dirs():
        hits = sorted(glob.glob(os.path.join(d, pattern)))
        if hits:
            return hits[0]
    return None


def _extension_dir() -> str:
    """The folder :func:`load_extension` loads ``_C`` from: ``OAR_BUILD_DIR`` when it holds one, else the package."""
    build = os.environ.get("OAR_BUILD_DIR")
    if build:
        build = os.path.abspath(build)
        if any(os.path.exists(os.path.join(build, "_C" + suf)) for suf in importlib.machinery.EXTENSION_SUFFIXES):
            return build
    return _PKG_DIR


def build_config() -> dict:
    """What this build compiled against, from ``torch_build.json`` beside the ``_C`` that will be loaded (read as
    text: nothing compiled is loaded).

    Returns a dict: ``oar_version`` (str), ``torch_version`` (``torch.__version__`` at build time, e.g.
    ``"2.14.1+cu130"``; ``""`` for a build without the torch ops), ``torch_cuda_version`` (``"13.0"``, ``""``
    for a CPU torch), ``cxx11_abi`` (0, 1 or None), ``cuda_ops`` (bool: CUDA implementations compiled in).
    Raises ImportError naming the folder when the file is missing or unreadable.
    """
    path = os.path.join(_extension_dir(), BUILD_FILE)
    if not os.path.exists(path):
        raise ImportError(
            f"oar: {BUILD_FILE} not found in {os.path.dirname(path)}: the build is incomplete or predates this "
            "file. Build and install the package (./setup.sh) or set OAR_BUILD_DIR to a CMake build tree "
            "configured with -DOAR_BUILD_PYTHON=ON."
        )
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ImportError(f"oar: cannot read {path}: {e}") from None
    cfg["path"] = path
    return cfg


def _major_minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def torch_mismatch(built: dict, runtime_version: str, runtime_cuda: str | None, runtime_abi: int | None) -> str | None:
    """Why a build cannot load under a torch, or None when it can (the rule in this module's docstring).

    Args:
        built: :func:`build_config`'s dict (``torch_version``, ``torch_cuda_version``, ``cxx11_abi``, ``cuda_ops``).
        runtime_version: the installed ``torch.__version__`` (e.g. ``"2.14.1+cu130"``).
        runtime_cuda: ``torch.version.cuda`` (``"13.0"``), None for a CPU build of torch.
        runtime_abi: ``int(torch._C._GLIBCXX_USE_CXX11_ABI)``, None when unknown (not compared).

    Returns:
        One sentence naming the built-against and the installed versions, or None.
    """
    built_version = str(built.get("torch_version") or "")
    if not built_version:
        return None  # built without the torch ops: nothing links libtorch
    b, r = _major_minor(built_version), _major_minor(str(runtime_version))
    if b is None or b != r:
        return (f"oar was built against torch {built_version} but torch {runtime_version} is installed; oar's "
                f"compiled ops need torch {b[0]}.{b[1]}.x (LibTorch's C++ ABI changes between minor releases)"
                if b is not None else
                f"oar was built against an unrecognized torch version {built_version!r}; torch {runtime_version} "
                "is installed")
    built_abi = built.get("cxx11_abi")
    if built_abi is not None and runtime_abi is not None and int(built_abi) != int(runtime_abi):
        return (f"oar was built against torch {built_version} with _GLIBCXX_USE_CXX11_ABI={int(built_abi)} but the "
                f"installed torch {runtime_version} uses _GLIBCXX_USE_CXX11_ABI={int(runtime_abi)}")
    if built.get("cuda_ops"):
        built_cuda = str(built.get("torch_cuda_version") or "")
        if not runtime_cuda:
            return (f"oar was built with CUDA ops against torch {built_version} (CUDA {built_cuda}) but the installed "
                    f"torch {runtime_version} has no CUDA (its liboar_torch.so links libtorch_cuda)")
        if built_cuda.split(".")[0] != str(runtime_cuda).split(".")[0]:
            return (f"oar was built with CUDA ops against torch {built_version} (CUDA {built_cuda}) but the installed "
                    f"torch {runtime_version} uses CUDA {runtime_cuda} (another CUDA major version)")
    return None


_CHECKED: dict | None = None


def check_torch() -> dict:
    """Raises ImportError when the installed torch cannot load this build (see :func:`torch_mismatch`).

    Runs before any compiled part of oar is loaded (called by :func:`load_extension` and
    :func:`load_ops_library`); the message names both torch versions and how to rebuild. With
    ``OAR_SKIP_TORCH_CHECK=1`` a mismatch is a RuntimeWarning instead. Returns :func:`build_config`'s dict.
    """
    global _CHECKED
    if _CHECKED is not None:
        return _CHECKED
    built = build_config()
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    why = torch_mismatch(built, torch.__version__, torch.version.cuda, None if abi is None else int(abi))
    if why is not None:
        msg = f"{why}. {_REBUILD_HINT} ({built['path']})."
        if os.environ.get("OAR_SKIP_TORCH_CHECK") != "1":
            raise ImportError(msg)
        warnings.warn(msg + " Loading anyway (OAR_SKIP_TORCH_CHECK=1).", RuntimeWarning, stacklevel=2)
    _CHECKED = built
    return built


def load_ops_library() -> str:
    """Loads liboar_torch.so into the torch dispatcher (registers ``torch.ops.oar.*``).

    Returns the path loaded. Raises ImportError naming the folders searched when it is missing, and
    ImportError naming both versions when the installed torch is not the one it was built against
    (:func:`check_torch`).
    """
    check_torch()
    path = _find("liboar_torch.so")
    if path is None:
        raise ImportError(
            "oar: liboar_torch.so not found in " + ", ".join(_search_dirs())
            + ". Build and install the package (./setup.sh) or set OAR_BUILD_DIR to a CMake build tree."
        )
    global _LOADED
    if _LOADED != path:
        torch.ops.load_library(path)
        _LOADED = path
    return path


_LOADED: str | None = None


def loaded_ops_library() -> str | None:
    """Path of the op library loaded by :func:`load_ops_library` (None before)."""
    return _LOADED


def load_extension() -> ModuleType:
    """Imports the pybind11 module ``oar._C`` (from the package, or from OAR_BUILD_DIR).

    Raises ImportError naming both versions when the installed torch is not the one this build compiled
    against (:func:`check_torch`, run first).
    """
    if "oar._C" in sys.modules:
        return sys.modules["oar._C"]
    check_torch()
    build = _extension_dir()
    if build != _PKG_DIR:
        for suf in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(build, "_C" + suf)
            if os.path.exists(path):
                spec = importlib.util.spec_from_file_location("oar._C", path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules["oar._C"] = mod
                spec.loader.exec_module(mod)
                return mod
    from oar import _C  # noqa: PLC0415  (installed layout)

    return _C
