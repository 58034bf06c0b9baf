"""Error budgets of the tests: one rule, written once (docs/design.md, "Test tolerances").

A floating-point result is never compared under a tolerance tuned on the developer's CPU: AVX-512, AVX2 and
baseline kernels (torch's, oneDNN's, MKL's, ours: ``OAR_CPU_ISA``), other thread counts and other batch shapes
round differently. Each comparison takes its budget from the computation, in one of three ways:

1. **Reference error, from the float32 error model** (:func:`assert_within_error_model`): the float64 value of the
   computation and a bound of the error of a float32 evaluation of the same operations in ANY order, from
   ``_error_model.py`` (a first-order bound traced through the reference, or for computations with a backward
   pass a random-rounding estimate). Require ``|out - value| <= k * bound + bound_ref + ulp`` elementwise, k = 2
   (:data:`K_ALGORITHM`). The budget depends on the computation only, never on the kernels of the CPU.
2. **Operation bound**: a sum of n terms in precision u is off by at most ``gamma_{n-1} * sum|x_i|``
   (:func:`sum_bound`; Higham, Accuracy and Stability of Numerical Algorithms, eq. 4.4), k chained roundings of
   a value x by ``gamma_k * |x|`` (:func:`gamma`), a rounding to the output dtype by half an ulp
   (:func:`ulp`). Compared with :func:`assert_within`; an op that computes in float64 and rounds once with
   :func:`assert_close_to_rounded`.
3. **Exact**: what involves no rounding (selections, copies, sums of small integers or dyadic values, the same
   op on the same data) is compared with ``rtol=0, atol=0``.

:func:`assert_close_to_reference` (flash-attention's rule, ``max|out - ref64| <= k * max|ref_lp - ref64| +
atol``) compares two paths' actual errors, whose ratio depends on the kernels a CPU picks (MKL and oneDNN differ
between AMD and Intel even for one instruction set); it is kept only for bfloat16 autocast, whose roundings the
float32 error model does not describe (docs/design.md, "Test tolerances").
"""

from __future__ import annotations

import torch

#: Unit roundoff (half an ulp of 1) per floating dtype.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff u of ``dtype`` (|fl(x) - x| <= u |x| for one rounding to nearest).

    Raises:
        ValueError: ``dtype`` is not a floating dtype in :data:`UNIT_ROUNDOFF`.
    """
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype must be one of {sorted(map(str, UNIT_ROUNDOFF))}, got {dtype}")
    return UNIT_ROUNDOFF[dtype]


def gamma(k: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_k = k u / (1 - k u): the relative error bound of k chained roundings in ``dtype``."""
    u = unit_roundoff(dtype)
    if k * u >= 1:
        raise ValueError(f"k * u must be < 1 for the bound to hold, got k={k}, u={u}")
    return k * u / (1 - k * u)


def sum_bound(abs_sum, n: int, dtype: torch.dtype = torch.float32):
    """Worst-case error of a sum of ``n`` terms accumulated in ``dtype`` in any order (sequential, SIMD lanes,
    blocked, pairwise): ``gamma_{n-1} * abs_sum`` with ``abs_sum = sum_i |x_i|`` (a float or a tensor of per-sum
    values). A dot product of n products adds one rounding per term: pass ``n + 1``."""
    return gamma(max(n - 1, 0), dtype) * abs_sum


def ulp(x, dtype: torch.dtype = torch.float32):
    """One ulp of values of magnitude ``|x|`` in ``dtype`` (an upper bound: 2 u |x|, at least the smallest
    subnormal); half of it bounds one rounding to ``dtype``."""
    tiny = torch.finfo(dtype).smallest_normal * 2.0 * unit_roundoff(dtype)
    if isinstance(x, torch.Tensor):
        return torch.clamp(2.0 * unit_roundoff(dtype) * x.double().abs(), min=tiny)
    return max(2.0 * unit_roundoff(dtype) * abs(float(x)), tiny)


def assert_within(out: torch.Tensor, want: torch.Tensor, bound, what: str = "") -> None:
    """Asserts ``|out - want| <= bound`` elementwise (in float64). ``bound`` is a float or a tensor that
    broadcasts against ``want``; NaN must match NaN, infinities must be equal. The message names the worst
    element, its values and its budget.

    Raises:
        AssertionError: some element is outside its budget, or the shapes differ.
    """
    out64, want64 = out.detach().double().cpu(), want.detach().double().cpu()
    if out64.shape != want64.shape:
        raise AssertionError(f"{what}: shape {tuple(out64.shape)} != expected {tuple(want64.shape)}")
    b = torch.as_tensor(bound, dtype=torch.float64).cpu().expand_as(want64)
    same = (out64 == want64) | (out64.isnan() & want64.isnan())  # exact matches, infinities and NaN included
    err = torch.where(same, torch.zeros_like(out64), (out64 - want64).abs())
    err = torch.where(err.isnan(), torch.full_like(err, float("inf")), err)
    excess = err - b
    if bool((excess > 0).any()):
        i = int(excess.flatten().argmax())
        idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), want64.shape)) if want64.dim() else ()
        got_i, want_i = out64.flatten()[i].item(), want64.flatten()[i].item()
        raise AssertionError(f"{what}: {int((excess > 0).sum())} of {want64.numel()} elements outside the budget; "
                             f"worst at {idx}: got {got_i!r}, expected {want_i!r}, "
                             f"|diff| {err.flatten()[i].item():.3g} > budget {b.flatten()[i].item():.3g}")


def assert_close_to_reference(out: torch.Tensor, ref64: torch.Tensor, ref_lp: torch.Tensor, *, k: float = 2.0,
                              atol: float | None = None, what: str = "") -> None:
    """Rule 1: ``max|out - ref64| <= k * max|ref_lp - ref64| + atol``.

    Args:
        out: the result under test (any floating dtype).
        ref64: the same computation in float64 (the truth), same shape.
        ref_lp: the same computation in plain PyTorch in ``out``'s dtype, same shape.
        k: how many times the reference's own rounding error ``out`` may lose (2 by default).
        atol: floor for computations the low-precision reference happens to get exact; default: one ulp of
            ``out``'s dtype at the largest ``|ref64|`` (the final rounding of the output alone costs half of it).

    Raises:
        AssertionError: outside the budget (the message gives both errors); shapes differ; non-finite values
            in different places.
    """
    r64 = ref64.detach().double().cpu()
    o, r = out.detach().double().cpu(), ref_lp.detach().double().cpu()
    for name, t in (("out", o), ("ref_lp", r)):
        if t.shape != r64.shape:
            raise AssertionError(f"{what}: {name} has shape {tuple(t.shape)}, ref64 {tuple(r64.shape)}")
    fin = r64.isfinite()
    if not torch.equal(o.isfinite(), fin) or not torch.equal(o[~fin].nan_to_num(), r64[~fin].nan_to_num()):
        raise AssertionError(f"{what}: non-finite values differ from the float64 reference")
    scale = float(r64[fin].abs().max()) if bool(fin.any()) else 0.0
    if atol is None:
        atol = float(ulp(scale, out.dtype)) if out.dtype in UNIT_ROUNDOFF else 0.0
    err_out = float((o[fin] - r64[fin]).abs().max()) if bool(fin.any()) else 0.0
    err_ref = float((r[fin] - r64[fin]).abs().max()) if bool(fin.any()) else 0.0
    budget = k * err_ref + atol
    if not err_out <= budget:
        raise AssertionError(f"{what}: max|out - ref64| = {err_out:.3g} exceeds {k} x max|ref_lp - ref64| "
                             f"({err_ref:.3g}) + atol {atol:.3g} = {budget:.3g} (largest |ref64| {scale:.3g})")


#: Rule 1's constant for the error model: an implementation may commit up to twice the float32 roundings of the
#: traced reference along any path (docs/design.md, "Test tolerances": online softmax rescaling, padding, chunked
#: caches add operations the reference formula does not have).
K_ALGORITHM = 2.0


def assert_within_error_model(out: torch.Tensor, exact, *, k: float = K_ALGORITHM, vacuous_above: float | None = 0.25,
                              what: str = "") -> None:
    """Rule 1: ``|out - value| <= k * bound + bound_ref + ulp(value)`` elementwise, with ``exact`` a
    :class:`_error_model.Bounded` of the same shape (the float64 value of the computation and the first-order
    worst-case float32 error bounds of any evaluation order: ``bound`` that of a float32 run, ``bound_ref`` the
    rounding ``value`` itself carries). Also checks that the budget is not vacuous: ``k * max bound`` must stay
    below 25% of ``max |value|``: the errors these comparisons exist to catch (a wrong token masked, wrong probe
    positions, a row or variant mixed up) move a score by its own size. ``vacuous_above=None`` skips that check,
    for a computation that is itself unstable under float32 rounding somewhere (the comment at the call says why):
    the elementwise budget is then large only where it must be.

    Raises:
        AssertionError: an element is outside its budget (the message names it), shapes differ, or the budget is
            vacuous.
    """
    value, bound, bound_ref = exact.value, exact.bound, exact.bound_ref
    scale = float(value.abs().max()) if value.numel() else 0.0
    if vacuous_above is not None and value.numel() and not float(k * bound.max()) <= vacuous_above * scale:
        raise AssertionError(f"{what}: vacuous error budget: k x max bound = {float(k * bound.max()):.3g} is not "
                             f"below {vacuous_above:.0%} of max |value| = {scale:.3g}")
    dtype = out.dtype if out.dtype in UNIT_ROUNDOFF else torch.float32
    assert_within(out, value, k * bound + bound_ref + ulp(value, dtype), what=what)


def assert_close_to_rounded(out: torch.Tensor, ref64: torch.Tensor, *, k: float = 2.0, what: str = "") -> None:
    """Rule 1 for ops that compute in float64 and round once to ``out``'s dtype: the reference in the test dtype is
    the float64 reference itself rounded to that dtype (the best any ``out``-dtype result can be), so ``out`` is
    within ``k`` times that rounding plus one ulp of the largest value (about 2 ulps of the largest ``|ref64|``)."""
    assert_close_to_reference(out, ref64, ref64.to(out.dtype), k=k, what=what)


def mass_bound(advantages: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rule 2 for the mass identity of a reshaped row, ``sum_t A_t == A * L`` over its L eligible tokens: the
    weights are renormalized to sum L by a sum of L terms (``gamma_L``), each token advantage ``w_t * A`` is
    rounded once, and the check's own sum adds L terms (``gamma_L``): ``(2 gamma_L + gamma_3) |A| L`` per row,
    plus the ulp floor of the smallest normal. ``advantages`` (B,), ``lengths`` (B,) integer; returns (B,)."""
    L = lengths.detach().double().cpu()
    a = advantages.detach().double().cpu().abs()
    n = max(int(L.max()), 1) if L.numel() else 1
    return (2 * gamma(n, dtype) + gamma(3, dtype)) * a * L + ulp(0.0, dtype)


def float64_model(model):
    """A float64 copy of a Hugging Face ``model`` whose logits are rounded once to float32 (the probe ops take
    float32): the engines run on it unchanged, so its results are the float64 reference (``ref64``) of rule 1 for
    the float32 model's."""
    import copy
    import functools

    m64 = copy.deepcopy(model).double()
    forward = m64.forward

    @functools.wraps(forward)  # keeps the signature the engines inspect
    def rounded(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits.float()
        return out

    m64.forward = rounded
    return m64
