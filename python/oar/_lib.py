"""Locating and loading oar's compiled parts: the LibTorch op library and the pybind11 module.

Installed layout (wheel): ``oar/lib/liboar_torch.so`` and ``oar/_C*.so``. Development layout: set
``OAR_BUILD_DIR`` to a CMake build tree (``cmake -B build -DOAR_BUILD_PYTHON=ON``) and put ``python/``
on ``PYTHONPATH``; both parts are then loaded from that tree.
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

import torch

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


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


def load_ops_library() -> str:
    """Loads liboar_torch.so into the torch dispatcher (registers ``torch.ops.oar.*``).

    Returns the path loaded. Raises ImportError naming the folders searched when it is missing.
    """
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
    """Imports the pybind11 module ``oar._C`` (from the package, or from OAR_BUILD_DIR)."""
    if "oar._C" in sys.modules:
        return sys.modules["oar._C"]
    build = os.environ.get("OAR_BUILD_DIR")
    if build:
        suffixes = importlib.machinery.EXTENSION_SUFFIXES
        for suf in suffixes:
            path = os.path.join(os.path.abspath(build), "_C" + suf)
            if os.path.exists(path):
                spec = importlib.util.spec_from_file_location("oar._C", path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules["oar._C"] = mod
                spec.loader.exec_module(mod)
                return mod
    from oar import _C  # noqa: PLC0415  (installed layout)

    return _C
