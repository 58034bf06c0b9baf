"""Intervals for held-out accuracies: percentile bootstrap over problems, and over seeds x problems.

Used by ``oar train`` (the gain of one run, paired over the same held-out problems) and ``oar compare``
(a method's gain over ``grpo``, paired over seeds and problems). Plain numpy; every function takes a
``seed`` so that a report is a pure function of its inputs. Rationale: docs/compare.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Interval", "bootstrap_mean", "bootstrap_grid_mean"]


@dataclass(frozen=True)
class Interval:
    """A point estimate with a percentile-bootstrap interval.

    Attributes:
        mean: the statistic on the data as given.
        lo, hi: the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the bootstrap distribution.
        level: coverage (0.95 by default).
        n: number of observations (problems, or seeds x problems) it was computed from.
    """

    mean: float
    lo: float
    hi: float
    level: float = 0.95
    n: int = 0

    def as_dict(self) -> dict:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "level": self.level, "n": self.n}

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}]"


def _check_level(level: float, resamples: int) -> None:
    if not (0.0 < level < 1.0):
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be a positive int, got {resamples!r}")


def _finite_2d(values, name: str) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 1-D (problems) or 2-D (seeds, problems) array, got shape "
                         f"{tuple(np.shape(values))}")
    if not np.isfinite(x).all():
        i = tuple(int(v) for v in np.argwhere(~np.isfinite(x))[0])
        raise ValueError(f"{name} must be finite, got {x[i]} at index {i}")
    return x


def bootstrap_mean(values, *, level: float = 0.95, resamples: int = 4000, seed: int = 0) -> Interval:
    """Mean of ``values`` (N,) float with a percentile-bootstrap interval (problems resampled).

    For a paired gain pass the per-problem differences (after - before, each in {-1, 0, 1}).

    Raises:
        ValueError: empty or non-finite ``values``, ``level`` outside (0, 1), ``resamples`` < 1.
    """
    _check_level(level, resamples)
    x = _finite_2d(values, "values")
    if x.shape[0] != 1:
        raise ValueError(f"values must be 1-D, got shape {x.shape}")
    return bootstrap_grid_mean(x, level=level, resamples=resamples, seed=seed)


def bootstrap_grid_mean(values, *, level: float = 0.95, resamples: int = 4000, seed: int = 0) -> Interval:
    """Mean of a (S, N) seeds x problems grid with a two-level percentile bootstrap.

    Each resample draws S seeds with replacement and N problems with replacement (the same problem draw
    for every seed: the problems are shared, so seed and problem effects are both kept) and takes the
    grid mean. With S = 1 it is the ordinary bootstrap over problems. Pass per-problem paired differences
    (method - grpo, same seed) for a paired comparison.

    Raises:
        ValueError: empty or non-finite ``values``, more than 2 dimensions, ``level`` outside (0, 1),
            ``resamples`` < 1.
    """
    _check_level(level, resamples)
    x = _finite_2d(values, "values")
    S, N = x.shape
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    # Chunks keep the (chunk, S, N) gather small for large grids.
    chunk = max(1, min(resamples, 2_000_000 // max(S * N, 1)))
    for start in range(0, resamples, chunk):
        k = min(chunk, resamples - start)
        si = rng.integers(0, S, size=(k, S))
        pi = rng.integers(0, N, size=(k, N))
        stats[start:start + k] = x[si[:, :, None], pi[:, None, :]].mean(axis=(1, 2))
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(x.mean()), float(lo), float(hi), level, S * N)
