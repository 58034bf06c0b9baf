"""Intervals for held-out accuracies (percentile bootstrap over problems, and over seeds x problems) and paired
tests over independent units (a t interval and a sign-flip permutation test; seeds of ``oar compare``, batches of
``oar diagnose``).

Used by ``oar train`` (the gain of one run, paired over the same held-out problems) and ``oar compare``
(a method's gain over ``grpo``, paired over seeds and problems). Plain numpy; every function takes a
``seed`` so that a report is a pure function of its inputs. Rationale: docs/compare.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Interval", "bootstrap_mean", "bootstrap_grid_mean", "t_quantile", "paired_t", "sign_flip_pvalue",
           "jackknife_se", "t_with_reference", "margin_pvalue", "break_even_dcos", "average_ranks", "spearman_rows",
           "spearman"]


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


def _vector(values, name: str) -> np.ndarray:
    """``values`` as a finite 1-D float64 array of >= 2 entries; ValueError naming ``name`` otherwise."""
    d = _finite_2d(values, name)
    if d.shape[0] != 1 or d.shape[1] < 2:
        raise ValueError(f"{name} must be 1-D with >= 2 values, got shape {np.shape(values)}")
    return d[0]


def bootstrap_mean(values, *, level: float = 0.95, resamples: int = 4000, seed: int = 0,
                   clusters=None) -> Interval:
    """Mean of ``values`` (N,) float with a percentile-bootstrap interval (problems resampled).

    For a paired gain pass the per-problem differences (after - before, each in {-1, 0, 1}). ``clusters``
    (N labels, any hashable) resamples whole clusters instead (a cluster bootstrap of the pooled mean: problems that
    repeat one fact in many wordings are not independent, docs/compare.md); each resample draws as many clusters as
    there are, with replacement, and takes the mean over their problems.

    Raises:
        ValueError: empty or non-finite ``values``, bad ``clusters`` (:func:`bootstrap_grid_mean`), ``level``
            outside (0, 1), ``resamples`` < 1.
    """
    _check_level(level, resamples)
    x = _finite_2d(values, "values")
    if x.shape[0] != 1:
        raise ValueError(f"values must be 1-D, got shape {x.shape}")
    return bootstrap_grid_mean(x, level=level, resamples=resamples, seed=seed, clusters=clusters)


def bootstrap_grid_mean(values, *, level: float = 0.95, resamples: int = 4000, seed: int = 0,
                        clusters=None) -> Interval:
    """Mean of a (S, N) seeds x problems grid with a two-level percentile bootstrap.

    Each resample draws S seeds with replacement and N problems with replacement (the same problem draw
    for every seed: the problems are shared, so seed and problem effects are both kept) and takes the
    grid mean. With S = 1 it is the ordinary bootstrap over problems. Pass per-problem paired differences
    (method - grpo, same seed) for a paired comparison. ``clusters`` (N labels) draws whole clusters of problems
    instead (as many as there are, with replacement) and takes the mean over their problems.

    Raises:
        ValueError: empty or non-finite ``values``, more than 2 dimensions, ``clusters`` that is not a sequence of
            N hashable labels or holds fewer than 2 distinct ones, ``level`` outside (0, 1), ``resamples`` < 1.
    """
    _check_level(level, resamples)
    x = _finite_2d(values, "values")
    S, N = x.shape
    if clusters is None:  # every problem its own cluster
        sums, counts = x, np.ones(N)
    else:
        if isinstance(clusters, (set, frozenset, dict, str, bytes)) or not hasattr(clusters, "__len__"):
            raise ValueError(f"clusters must be a sequence of {N} labels (list, tuple or 1-D array), got "
                             f"{type(clusters).__name__}")
        labels = [c.item() if isinstance(c, np.generic) else c for c in clusters]
        if len(labels) != N:
            raise ValueError(f"clusters must have one label per value ({N}), got {len(labels)}")
        index: dict = {}
        try:
            inv = np.array([index.setdefault(c, len(index)) for c in labels], dtype=np.int64)
        except TypeError:
            bad = next(c for c in labels if not isinstance(c, (str, int, float, tuple, type(None))))
            raise ValueError(f"clusters must hold hashable labels (str, int, tuple), got {type(bad).__name__} "
                             f"{bad!r:.60}") from None
        if len(index) < 2:
            raise ValueError(f"clusters must hold at least 2 distinct labels (one cluster gives no interval), got "
                             f"{len(index)}")
        sums = np.stack([np.bincount(inv, weights=row, minlength=len(index)) for row in x])
        counts = np.bincount(inv, minlength=len(index)).astype(np.float64)
    G = sums.shape[1]
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    # Chunks keep the (chunk, S, G) gather small for large grids.
    chunk = max(1, min(resamples, 2_000_000 // max(S * G, 1)))
    for start in range(0, resamples, chunk):
        k = min(chunk, resamples - start)
        si = rng.integers(0, S, size=(k, S))
        gi = rng.integers(0, G, size=(k, G))
        stats[start:start + k] = sums[si[:, :, None], gi[:, None, :]].sum(axis=(1, 2)) / (S * counts[gi].sum(axis=1))
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(x.mean()), float(lo), float(hi), level, S * N)


def _log_gamma_ratio_half(a: float) -> float:
    """log Gamma(a + 1/2) - log Gamma(a), without the cancellation of two lgamma values at large a (its asymptotic
    series, error < 1e-16 for a > 1e4)."""
    if a <= 1e4:
        return math.lgamma(a + 0.5) - math.lgamma(a)
    return 0.5 * math.log(a) - 1.0 / (8.0 * a) + 1.0 / (192.0 * a ** 3)


def _betainc(a: float, b: float, x: float, log_beta: float | None = None, x1m: float | None = None) -> float:
    """Regularized incomplete beta I_x(a, b) (a, b > 0, x in [0, 1]): its continued fraction (Abramowitz & Stegun
    26.5.8), evaluated by the modified Lentz method, on the side of the symmetry I_x(a, b) = 1 - I_(1-x)(b, a)
    where it converges fast. ``log_beta``: log B(a, b) when the caller has it more accurately than lgamma gives it;
    ``x1m``: 1 - x when the caller has it without cancellation."""
    x1m = 1.0 - x if x1m is None else x1m
    if x <= 0.0:
        return 0.0
    if x1m <= 0.0:
        return 1.0
    if log_beta is None:
        log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    log_x = math.log1p(-x1m) if x > 0.5 else math.log(x)  # whichever of x, 1 - x is small is exact
    log_x1m = math.log1p(-x) if x1m > 0.5 else math.log(x1m)
    front = math.exp(a * log_x + b * log_x1m - log_beta)

    def frac(a, b, x):
        tiny = 1e-300
        c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
        d = 1.0 / (d if abs(d) > tiny else tiny)
        h = d
        for m in range(1, 10_000):
            for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                        -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
                d = 1.0 + num * d
                d = 1.0 / (d if abs(d) > tiny else tiny)
                c = 1.0 + num / c
                c = c if abs(c) > tiny else tiny
                h *= c * d
            if abs(c * d - 1.0) < 1e-16:
                break
        return h

    if x < (a + 1.0) / (a + b + 2.0):
        return front * frac(a, b, x) / a
    return 1.0 - front * frac(b, a, x1m) / b


def _t_cdf(x: float, df: float) -> float:
    """Student-t CDF, df >= 1 (inf: the normal), any x: 1 - I_(df / (df + x^2))(df / 2, 1 / 2) / 2 for x > 0
    (:func:`_betainc`; against mpmath: error < 1e-12 for df <= 1e5, < 1e-9 up to 1e12, the normal above). NaN in,
    NaN out."""
    if math.isnan(x) or math.isnan(df):
        return math.nan
    if x == 0:
        return 0.5
    if df > 1e12:
        return 0.5 * math.erfc(-x / math.sqrt(2.0))
    if math.isinf(x):
        return 1.0 if x > 0 else 0.0
    a = df / 2.0
    log_beta = math.lgamma(0.5) - _log_gamma_ratio_half(a)  # log B(a, 1/2) = lgamma(1/2) + lgamma(a) - lgamma(a+1/2)
    if abs(x) < 1e150:
        z, z1m = df / (df + x * x), x * x / (df + x * x)
    else:
        z, z1m = 0.0, 1.0
    tail = 0.5 * _betainc(a, 0.5, z, log_beta, z1m)
    return 1.0 - tail if x > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Quantile of Student's t with ``df`` degrees of freedom (inf: the normal): bisection on :func:`_t_cdf` to
    |error| < 1e-9 relative.

    Raises:
        ValueError: ``p`` outside (0, 1) or ``df`` < 1 (or NaN).
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    if not df >= 1:
        raise ValueError(f"df must be >= 1, got {df!r}")
    if p == 0.5:
        return 0.0
    target = max(p, 1.0 - p)  # the upper quantile, mirrored for p < 1/2
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < target and hi < 1e300:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if _t_cdf(mid, df) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    q = (lo + hi) / 2
    return q if p > 0.5 else -q


def paired_t(diffs, *, level: float = 0.95) -> Interval:
    """Mean of paired differences (N,) with a Student-t interval (N - 1 degrees of freedom).

    Pass one difference per independent unit (seed, batch): method - baseline on the same unit.

    Raises:
        ValueError: fewer than 2 or non-finite differences, ``level`` outside (0, 1).
    """
    _check_level(level, 1)
    d = _vector(diffs, "diffs")
    n = d.size
    m, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(n))
    h = t_quantile((1 + level) / 2, n - 1) * se
    return Interval(m, m - h, m + h, level, n)


def jackknife_se(leave_one_out) -> float:
    """Jackknife standard error from the F leave-one-out values of a statistic: sqrt((F - 1) / F x sum (theta_(-c) -
    mean)^2) (Efron & Tibshirani, An Introduction to the Bootstrap, ch. 11).

    Raises:
        ValueError: fewer than 2 or non-finite values.
    """
    v = _vector(leave_one_out, "leave_one_out")
    F = v.size
    return float(math.sqrt((F - 1) / F * float(((v - v.mean()) ** 2).sum())))


def t_with_reference(per_unit, reference_leave_one_out, *, level: float = 0.95) -> Interval:
    """Mean over N independent units (batches) of a statistic that also depends on a noisy reference estimated from
    F independent folds, with an interval carrying both noises.

    ``per_unit`` (N,): the statistic of each unit against the whole reference; ``reference_leave_one_out`` (F,): the
    mean over units against the reference without fold c. The two sources are independent, so their variances add
    (first order): SE^2 = var(per_unit) / N + jackknife SE^2 over folds (:func:`jackknife_se`); the t quantile takes
    Welch-Satterthwaite's degrees of freedom, SE^4 / (SE_units^4 / (N - 1) + SE_ref^4 / (F - 1)).

    Raises:
        ValueError: fewer than 2 units or folds, non-finite values, ``level`` outside (0, 1).
    """
    _check_level(level, 1)
    m, se, df, n = _with_reference_se(per_unit, reference_leave_one_out)
    if se == 0:
        return Interval(m, m, m, level, n)
    h = t_quantile((1 + level) / 2, df) * se
    return Interval(m, m - h, m + h, level, n)


def _with_reference_se(per_unit, reference_leave_one_out) -> tuple:
    """(mean, SE, Welch-Satterthwaite df, N) of :func:`t_with_reference`, computed on the values divided by their
    largest magnitude (so that squares of small SEs do not underflow: the result does not depend on the scale).

    Raises:
        ValueError: fewer than 2 units or folds, non-finite values, or a mean / SE that overflows.
    """
    d = _vector(per_unit, "per_unit")
    r = _vector(reference_leave_one_out, "reference_leave_one_out")
    with np.errstate(over="ignore"):
        m = float(d.mean())  # the plain mean (the statistic itself), not a rescaled one
    scale = float(max(np.abs(d).max(), np.abs(r).max()))
    scale = scale if scale > 0 else 1.0
    d, r = d / scale, r / scale
    n, F = d.size, r.size
    se_u2 = float(d.var(ddof=1)) / n
    se_r = jackknife_se(r)
    se2 = se_u2 + se_r ** 2
    den = (se_u2 ** 2) / (n - 1) + (se_r ** 4) / (F - 1)
    df = max(1.0, se2 ** 2 / den) if den > 0 else float(n - 1)
    se = math.sqrt(se2) * scale
    if not (math.isfinite(m) and math.isfinite(se)):
        raise ValueError(f"per_unit / reference_leave_one_out: the mean ({m}) or its standard error ({se}) overflows")
    return m, se, df, n


def margin_pvalue(per_unit, reference_leave_one_out, margin: float) -> float | None:
    """One-sided p-value of H0: mean <= ``margin`` against H1: mean > ``margin``, with the standard error and degrees
    of freedom of :func:`t_with_reference` (both noises): 1 - F_t((mean - margin) / SE; df). The margin test of
    issue 42 item 7 (is a setting's Delta-cos above the break-even that pays for its cost?). None when the SE is 0
    (no spread over units or folds: the test is undefined).

    Raises:
        ValueError: as :func:`t_with_reference`; a ``margin`` that is not a finite real number.
    """
    from oar._args import float_arg

    margin = float_arg("margin", margin)
    if not math.isfinite(margin):
        raise ValueError(f"margin must be a finite number, got {margin!r}")
    m, se, df, _ = _with_reference_se(per_unit, reference_leave_one_out)
    if se == 0:
        return None
    t = (m - float(margin)) / se
    if not math.isfinite(t):
        raise ValueError(f"margin_pvalue: (mean - margin) / SE = ({m} - {margin}) / {se} is not finite")
    return float(1.0 - _t_cdf(t, df))


def break_even_dcos(cos_base: float, snr_base: float, cost_ratio: float) -> float:
    """The cosine gain a credit setting must show over the baseline to pay for its extra compute, if that compute
    bought the baseline more rollouts instead (issue 42).

    Model: a batch's update is u = mu + noise with signal-to-noise ratio SNR = |mu|^2 / E|noise|^2 (the diagnostic's
    SNR); averaging k independent batches keeps mu and divides the noise's energy by k, so to first order cos(u_k,
    g) = cos(u_1, g) x sqrt((SNR + 1) / (SNR + 1 / k)). A setting costing ``cost_ratio`` = c times a baseline step
    more would, spent on rollouts, give the baseline k = 1 + c batches: break-even Delta-cos = cos_base x
    (sqrt((SNR + 1) / (SNR + 1 / (1 + c))) - 1), about cos_base x c / 2 when SNR and c are small.

    Raises:
        ValueError: a non-finite input, ``snr_base`` < 0 or ``cost_ratio`` < 0.
    """
    vals = (cos_base, snr_base, cost_ratio)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals):
        raise ValueError(f"cos_base, snr_base and cost_ratio must be finite numbers, got {vals}")
    if snr_base < 0 or cost_ratio < 0:
        raise ValueError(f"snr_base and cost_ratio must be >= 0, got {snr_base}, {cost_ratio}")
    k = 1.0 + cost_ratio
    return float(cos_base * (math.sqrt((snr_base + 1.0) / (snr_base + 1.0 / k)) - 1.0))


def sign_flip_pvalue(diffs, *, resamples: int = 20000, seed: int = 0) -> float:
    """Two-sided p-value of the sign-flip permutation test of mean(diffs) = 0 (paired differences symmetric about 0
    under the null). Exact (all 2^N sign patterns) for N <= 16, else ``resamples`` random patterns (the observed one
    counted, so p >= 1 / (resamples + 1)).

    Raises:
        ValueError: empty or non-finite differences, ``resamples`` < 1.
    """
    _check_level(0.5, resamples)
    d = _finite_2d(diffs, "diffs")
    if d.shape[0] != 1:
        raise ValueError(f"diffs must be 1-D, got shape {np.shape(diffs)}")
    d = d[0]
    n = d.size
    obs = abs(d.mean())
    tol = 1e-12 * max(1.0, float(np.abs(d).max()))
    if n <= 16:
        signs = ((np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1) * 2 - 1
        return float((np.abs(signs @ d / n) >= obs - tol).mean())
    rng = np.random.default_rng(seed)
    signs = rng.integers(0, 2, size=(resamples, n)) * 2 - 1
    hits = int((np.abs(signs @ d / n) >= obs - tol).sum())
    return (hits + 1) / (resamples + 1)


def average_ranks(x) -> np.ndarray:
    """Ranks along the last axis of ``x`` (..., m), 0-based, float64, ties sharing the mean of their ranks
    (``scipy.stats.rankdata(method="average") - 1``, vectorized over the leading axes)."""
    x = np.asarray(x, dtype=np.float64)
    m = x.shape[-1]
    order = np.argsort(x, axis=-1, kind="stable")
    s = np.take_along_axis(x, order, axis=-1)
    pos = np.broadcast_to(np.arange(m), s.shape)
    first = np.ones(s.shape, dtype=bool)  # a tie run starts here
    first[..., 1:] = s[..., 1:] != s[..., :-1]
    last = np.ones(s.shape, dtype=bool)  # a tie run ends here
    last[..., :-1] = first[..., 1:]
    start = np.maximum.accumulate(np.where(first, pos, 0), axis=-1)
    end = np.flip(np.minimum.accumulate(np.flip(np.where(last, pos, m - 1), -1), axis=-1), -1)
    ranks = np.empty_like(s)
    np.put_along_axis(ranks, order, (start + end) / 2.0, axis=-1)
    return ranks


def spearman_rows(a, b) -> np.ndarray:
    """Spearman rank correlation of each pair of rows of ``a`` and ``b`` (..., m): the Pearson correlation of
    their average ranks (:func:`average_ranks`), float64 (...,); NaN where a row is constant (no ranking)."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra -= ra.mean(-1, keepdims=True)
    rb -= rb.mean(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (ra * rb).sum(-1) / np.sqrt((ra * ra).sum(-1) * (rb * rb).sum(-1))


def spearman(a, b) -> float | None:
    """Spearman rank correlation of two score lists of one trace (:func:`spearman_rows` of one row). None when
    either list is constant (no ranking) or has fewer than 2 entries.

    Raises:
        ValueError: lists of different lengths, or a NaN score (no rank).
    """
    if len(a) != len(b):
        raise ValueError(f"a ({len(a)}) and b ({len(b)}) must have one entry per token")
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if np.isnan(x).any() or np.isnan(y).any():
        raise ValueError("scores must not contain NaN (no rank)")
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(spearman_rows(x, y))
