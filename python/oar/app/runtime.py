"""Process helpers of the application (``oar train``, ``compare``, ``diagnose``): JSON files written atomically,
the peak resident memory, freed memory returned to the OS between phases, console lines beside progress bars.
Standard library only, so every ``oar.app`` module can use them without importing the training stack.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["write_json_atomic", "peak_rss_mb", "release_memory"]


def write_json_atomic(path: str, obj: Any) -> None:
    """Writes ``obj`` as JSON to ``path`` through a temporary file and ``os.replace`` (never half-written)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (VmHWM of /proc/self/status; 0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def release_memory() -> None:
    """Frees unreachable tensors (``gc.collect``) and returns the C heap's free pages to the OS (glibc
    ``malloc_trim``; skipped elsewhere).

    Generation, attribution and the update each allocate and free hundreds of MB; glibc keeps freed blocks
    in its heap, so without this the resident size grows to the sum of the phases' peaks instead of their
    maximum (docs/compare.md, memory of the main job).
    """
    global _LIBC
    import gc

    gc.collect()  # autograd graphs caught in reference cycles hold their tensors until the cyclic collector runs
    if _LIBC is None:
        import ctypes

        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


def _console(msg: str) -> None:
    """One line on the console that does not break a tqdm progress bar."""
    try:
        from tqdm.auto import tqdm

        tqdm.write(msg, file=sys.stdout)
    except ImportError:  # pragma: no cover
        print(msg, flush=True)
