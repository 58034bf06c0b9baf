"""Float32 rounding-error budgets of a computation, derived from its float64 run (docs/design.md, "Test
tolerances", rule 1): a first-order worst-case bound for forward computations (:func:`error_bound`), a
random-rounding estimate for computations with a backward pass (:func:`random_rounding`, further below).

:func:`error_bound` runs a computation written in plain PyTorch (a reference, a Hugging Face model forward) in
float64 under a :class:`torch.overrides.TorchFunctionMode` that, for every operation, records its output ``v`` and
the largest rounding error ``rho`` that the same operation evaluated in float32 may commit, in ANY evaluation order:

* one rounding (``+ - * /``, ``sqrt``): ``u |v|``;
* an elementary function (``exp``, ``log``, ``rsqrt``, ``sigmoid``, ``silu`` ...): ``ULPS_ELEMENTARY`` ulps of
  ``|v|`` (libm, SLEEF and MKL's VML are within 1-4 ulps in float32; we allow 4);
* a sum, mean or cumulative sum of ``n`` terms, a dot product or matrix product of inner size ``n``: ``gamma_n * sum|terms|``
  (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5 / 4.4: every summation order, SIMD
  lanes, blocking and pairwise trees included; for long sums Higham and Mary's probabilistic gamma, see
  :func:`_gamma`), plus the division of a mean or the scale of attention scores;
* ``softmax`` / ``log_softmax`` over ``n``: the shifted exponentials (the shift ``x_i - max`` rounds by
  ``u |x_i - max|``, the exponential by ``ULPS_ELEMENTARY``), their sum (``gamma_n``), the division or the log;
* ``scaled_dot_product_attention``: decomposed into scores, softmax and the weighted sum (each as above), so its
  intermediate tensors get their own entries (a flash/online-softmax kernel reassociates the same operations);
* selections, copies, reshapes, masks, ``abs``, ``max``, ``clamp``: exact (0).

An operation the mode has no rule for raises :class:`NotImplementedError` naming it (never a silent 0).

The bound of each output element ``y`` is then ``sum_ops sum_elements |dy/dv| * rho`` with the exact sensitivities
``dy/dv`` from one float64 backward pass per element (``autograd.grad`` w.r.t. the recorded outputs): the standard
first-order forward error bound (linearised, so valid up to O(u^2) terms, which are 2^-24 times smaller). It
bounds the deviation from the exact value of the float32 computation with the same operations in any order; it
is a worst case (every rounding at its maximum with the sign that hurts), typically 25-300 times the error a real
run shows, and still far below the size of a wrong result (:func:`_tolerance.assert_within_error_model` checks
that: ``k x max bound <= 25% of max |value|``).

Operations that the float64 run itself carries out in float32 (Hugging Face's RMSNorm upcasts to float32, and so
does not compute in float64) get the same rule with float32's u; those rounding errors are then in the float64
value too, and are summed apart as ``bound_ref`` (with the casts of float64 values down to float32), which
:func:`_tolerance.assert_within_error_model` adds to the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: Accuracy assumed for float32 elementary functions (exp, log, rsqrt, sigmoid, tanh, silu ...), in ulps.
ULPS_ELEMENTARY = 4

_U32 = 2.0**-24

#: Output elements whose sensitivities one batched backward pass computes.
_CHUNK = 16

_EXACT = {
    # selections, copies, layout, masks, comparisons: no rounding
    "__getitem__", "__setitem__", "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand",
    "expand_as", "contiguous", "clone", "cat", "concat", "concatenate", "stack", "split", "chunk", "narrow",
    "squeeze", "unsqueeze", "flatten", "unflatten", "embedding", "masked_fill", "masked_fill_", "where", "index_select",
    "gather", "select", "repeat", "repeat_interleave", "neg", "__neg__", "abs", "max", "min", "amax", "amin", "relu",
    "clamp", "clamp_min", "clamp_max", "pad", "t", "detach", "unbind", "roll", "flip", "tril", "triu", "zeros_like",
    "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor", "sort",
    "topk", "argsort", "argmax", "argmin", "masked_select", "diagonal", "movedim", "maximum", "minimum", "float",
    "double", "to", "type", "type_as", "copy_", "zero_", "fill_", "index_put_", "index_put", "scatter", "scatter_",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "eq", "ne", "lt", "le", "gt", "ge", "isfinite",
    "isnan", "isinf", "any", "all", "__and__", "__or__", "__invert__", "logical_and", "logical_or", "logical_not",
    "size", "dim", "numel", "item", "tolist", "__len__", "__iter__", "__bool__", "__float__", "__int__", "__index__",
    "__format__", "__repr__", "__hash__", "requires_grad_", "retain_grad", "register_hook", "backward", "data_ptr",
    "is_floating_point", "is_complex", "element_size", "stride", "storage_offset", "is_contiguous", "cpu", "cuda",
    "numpy", "nonzero", "arange", "zeros", "ones", "full", "empty", "tensor", "as_tensor", "__get__", "__set__",
    "_has_compatible_shallow_copy_type", "dtype", "device", "shape", "is_leaf", "grad_fn", "grad", "requires_grad",
    "names", "layout", "is_sparse", "is_cuda", "is_meta", "is_nested", "is_quantized", "ndim", "T", "mT", "H", "mH",
    "__reversed__", "__contains__", "unique", "bincount", "sign", "signbit", "floor",
    "ceil", "round", "trunc", "__deepcopy__", "__reduce_ex__", "_make_subclass", "masked_scatter", "index_fill",
    "index_fill_", "unsafe_split", "split_with_sizes", "tensor_split", "swapaxes", "swapdims", "squeeze_", "unsqueeze_",
    "as_strided", "clone_", "expand_copy", "view_copy", "broadcast_to", "broadcast_tensors", "atleast_1d",
    "atleast_2d", "long", "int", "bool", "new", "__array__", "_is_view", "untyped_storage",
    "is_inference", "get_device", "__setstate__", "__getstate__", "nelement", "is_shared", "is_pinned", "nan_to_num",
    "is_set_to", "_version", "_base", "output_nr", "_cdata", "__torch_function__", "isclose", "allclose", "equal",
}
_ONE_ROUNDING = {"add", "sub", "mul", "div", "true_divide", "subtract", "multiply", "divide", "__add__", "__radd__",
                 "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__", "__truediv__",
                 "__rtruediv__", "__itruediv__", "__div__", "__rdiv__", "sqrt", "square", "add_", "sub_", "mul_",
                 "div_", "rsub", "reciprocal"}
_ELEMENTARY = {"exp", "log", "log1p", "expm1", "rsqrt", "sigmoid", "tanh", "sin", "cos", "log2", "exp2", "erf",
               "softplus", "gelu", "logsigmoid"}
_REDUCTIONS = {"sum", "mean", "nansum", "nanmean"}
_MATMUL = {"matmul", "mm", "bmm", "__matmul__", "__rmatmul__", "linear"}


def _name(func) -> str:
    if isinstance(func, torch._ops.OpOverload):  # torch.ops.ns.op.overload: the op's name, not the overload's
        func = func.overloadpacket
    n = getattr(func, "__name__", None) or str(func)
    return n.split(".")[-1]


#: lambda of the probabilistic bound of long sums (see :func:`_gamma`).
LAMBDA_SUM = 8.0


def _gamma(n: int, u: float) -> float:
    """Relative error bound of a sum of n + 1 terms (n additions) in any order: Higham's worst case gamma_n =
    n u / (1 - n u), or, where smaller (n > ~64), Higham and Mary's probabilistic bound exp(lambda sqrt(n) u +
    n u^2 / (1 - u)) - 1 with lambda = LAMBDA_SUM = 8 ("A new approach to probabilistic rounding error analysis",
    SIAM J. Sci. Comput. 41(5), 2019, Theorem 2.8): it holds for any summation order with probability at least
    1 - 2 n exp(-lambda^2 (1 - u)^2 / 2) (1 - 1.2e-9 for the 49,152-entry vocabulary sums of the tests) under the
    model of independent, mean-zero rounding errors. The worst case grows as n u, a bound no rounding reaches at
    n in the thousands; the probabilistic one as sqrt(n) u."""
    n = max(int(n), 0)
    worst = n * u / (1 - n * u)
    prob = math.expm1(LAMBDA_SUM * math.sqrt(n) * u + n * u * u / (1 - u))
    return min(worst, prob)


def _unit(t: torch.Tensor) -> float:
    """Unit roundoff of the float32 run: float32's u for a float64 or float32 operation."""
    return _U32


class _Recorder(TorchFunctionMode):
    """Records (output, rho) for every rounding operation on floating tensors that carry gradients."""

    def __init__(self):
        super().__init__()
        # (output, rho, in_f32, in_ref): in_f32 - a float32 evaluation commits this rounding; in_ref - the
        # float64 run itself does (an operation it carries out in float32, or a cast of float64 to float32)
        self.records: list[tuple[torch.Tensor, torch.Tensor, bool, bool]] = []

    def _keep(self, out, rho, in_f32=True, in_ref=None):
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return
        if in_ref is None:
            in_ref = out.dtype == torch.float32
        self.records.append((out, rho.detach(), in_f32, in_ref))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name == "scaled_dot_product_attention":
            return self._sdpa(*args, **kwargs)
        out = func(*args, **kwargs)
        if not (isinstance(out, torch.Tensor) and out.is_floating_point() and out.requires_grad):
            return out  # no gradient flows through it: not a function of the traced inputs, nothing to bound
        if name in ("to", "float", "type", "type_as") and out.dtype == torch.float32 and isinstance(args[0], torch.Tensor) \
                and args[0].dtype == torch.float64:
            # a cast down inside the float64 run (Hugging Face's RMSNorm upcasts "to float32"): a rounding of the
            # reference only; a float32 evaluation has nothing to round there
            with torch.no_grad():
                self._keep(out, _U32 * out.detach().abs(), in_f32=False, in_ref=True)
            return out
        if name in _EXACT:
            return out
        u = _unit(out)
        with torch.no_grad():
            if name in _ONE_ROUNDING:
                rho = u * out.abs()
            elif name == "pow":
                e = args[1] if len(args) > 1 else kwargs.get("exponent")
                k = 1 if isinstance(e, (int, float)) and float(e) in (2.0, -1.0) else 2 * ULPS_ELEMENTARY
                rho = k * u * out.abs()
            elif name == "__pow__":
                e = args[1]
                k = 1 if isinstance(e, (int, float)) and float(e) in (2.0, -1.0) else 2 * ULPS_ELEMENTARY
                rho = k * u * out.abs()
            elif name in _ELEMENTARY:
                rho = 2 * ULPS_ELEMENTARY * u * out.abs()
            elif name == "silu":  # x * sigmoid(x): the sigmoid and one product
                rho = (2 * ULPS_ELEMENTARY + 1) * u * out.abs()
            elif name in _REDUCTIONS:
                x = args[0]
                n = max(x.numel() // max(out.numel(), 1), 1)
                absum = func(x.detach().abs(), *args[1:], **kwargs)
                rho = _gamma(n - 1, u) * absum + (u * out.abs() if "mean" in name else 0.0)
            elif name in ("quantile", "nanquantile"):  # x_(k) + f (x_(k+1) - x_(k)): a subtraction, a product, a sum
                rho = 3 * u * out.abs() + 2 * u * out.abs()  # and the rounding of f = (n - 1) q - k
            elif name == "logsumexp":  # m + log sum exp(x - m): the shifts, the exponentials, the sum, the log
                x = args[0].detach()
                dim = args[1] if len(args) > 1 else kwargs["dim"]
                m = x.amax(dim, keepdim=True)
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
                p = torch.exp(x - m - torch.logsumexp(x - m, dim, keepdim=True)).nan_to_num(0.0)
                shift = (x - m).abs().nan_to_num(0.0, posinf=0.0)
                ce = 2 * ULPS_ELEMENTARY * u
                rho = ((p * (u * shift + ce)).sum(dim) + _gamma(x.shape[dim] - 1, u) * (1 + ce)
                       + (ce + u) * out.detach().abs().nan_to_num(0.0, posinf=0.0))
            elif name in ("std", "var"):  # the mean, the n squared deviations and their sum, the division, sqrt
                x = args[0]
                dim = args[1] if len(args) > 1 else kwargs.get("dim")
                corr = kwargs.get("correction", 0 if kwargs.get("unbiased") is False else 1)
                n = x.numel() // max(out.numel(), 1)
                keep = dict(dim=dim, keepdim=True) if dim is not None else {}
                xd = x.detach()
                m = xd.mean(**keep) if keep else xd.mean()
                dev2 = (xd - m) ** 2
                var = (dev2.sum(**keep) if keep else dev2.sum()) / max(n - corr, 1)
                absx = xd.abs().mean(**keep) if keep else xd.abs().mean()
                absdev = (xd - m).abs().sum(**keep) if keep else (xd - m).abs().sum()
                rho_var = _gamma(n + 3, u) * var + 2 * absdev * _gamma(n, u) * absx / max(n - corr, 1)
                if dim is not None and not kwargs.get("keepdim", False):
                    rho_var = rho_var.squeeze(dim) if isinstance(dim, int) else rho_var.reshape(out.shape)
                rho_var = rho_var.reshape(out.shape)
                if name == "var":
                    rho = rho_var
                else:
                    sd = out.detach().abs()
                    rho = torch.where(sd > 0, rho_var / (2 * sd), rho_var.sqrt()) + u * sd
            elif name == "cumsum":  # every prefix is a sum of at most n terms
                x = args[0]
                dim = args[1] if len(args) > 1 else kwargs["dim"]
                rho = _gamma(x.shape[dim] - 1, u) * torch.cumsum(x.detach().abs(), dim)
            elif name in _MATMUL:
                rho = self._matmul_rho(name, args, kwargs, out, u)
            elif name in ("softmax", "log_softmax"):
                x = args[0]
                dim = args[1] if len(args) > 1 else kwargs["dim"]
                rho = self._softmax_rho(x.detach(), dim, out.detach(), u, log=(name == "log_softmax"))
            else:
                raise NotImplementedError(f"_error_model: no rounding rule for {name!r} ({func}); add one")
            rho = torch.broadcast_to(torch.as_tensor(rho, dtype=out.dtype), out.shape)
        self._keep(out, rho)
        return out

    @staticmethod
    def _matmul_rho(name, args, kwargs, out, u):
        a, b = args[0], args[1]
        if name == "linear":
            w = b
            n = a.shape[-1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rho = _gamma(n, u) * F.linear(a.detach().abs(), w.detach().abs())
            if bias is not None:
                rho = rho + u * out.detach().abs()
            return rho
        if name == "__rmatmul__":
            a, b = b, a
        n = a.shape[-1]
        return _gamma(n, u) * torch.matmul(a.detach().abs(), b.detach().abs())

    @staticmethod
    def _softmax_rho(x, dim, out, u, log):
        n = x.shape[dim]
        m = x.amax(dim, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        shift = (x - m).abs()
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        ce = 2 * ULPS_ELEMENTARY * u
        if not log:
            # p_i = exp(x_i - m) / S: the shift, the exponential, the sum of n positive terms, the division
            return out.abs() * (u * shift + ce + _gamma(max(n - 1, 0), u) * (1 + ce) + u)
        # log p_i = (x_i - m) - log S: the shift, log S (its argument's relative error, plus the log's own), the
        # subtraction; S's relative error is the exponentials' (shift and exp, weighted by p) plus the sum's.
        p = out.exp()
        p = torch.where(torch.isfinite(p), p, torch.zeros_like(p))
        logS = torch.logsumexp(torch.where(torch.isfinite(x), x - m, torch.full_like(x, -math.inf)), dim, keepdim=True)
        rel_S = (p * (u * shift + ce)).sum(dim, keepdim=True) + _gamma(max(n - 1, 0), u)
        return u * shift + rel_S + ce * logS.abs() + u * out.abs().nan_to_num(posinf=0.0, neginf=0.0)

    def _sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        """Scaled dot-product attention decomposed into recorded operations (scores, softmax, weighted sum)."""
        if dropout_p:
            raise NotImplementedError("_error_model: scaled_dot_product_attention with dropout")
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k = k.repeat_interleave(rep, dim=-3)
            v = v.repeat_interleave(rep, dim=-3)
        d = q.shape[-1]
        sc = 1.0 / math.sqrt(d) if scale is None else scale
        u = _U32
        s = torch.matmul(q, k.transpose(-2, -1)) * sc
        with torch.no_grad():
            rho_s = _gamma(d, u) * torch.matmul(q.detach().abs(), k.detach().abs().transpose(-2, -1)) * abs(sc) \
                + u * s.detach().abs()
        self._keep(s, rho_s)
        Lq, Lk = q.shape[-2], k.shape[-2]
        if is_causal:  # PyTorch's convention: aligned to the top left
            causal = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril()
            s = s.masked_fill(~causal, -math.inf)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                s = s.masked_fill(~attn_mask, -math.inf)
            else:
                s = s + attn_mask  # 0 or a large negative: exact where 0, and the masked entries vanish below
        p = torch.softmax(s, dim=-1)
        with torch.no_grad():
            rho_p = self._softmax_rho(s.detach(), -1, p.detach(), u, log=False)
        self._keep(p, rho_p.nan_to_num(0.0))
        o = torch.matmul(p, v)
        with torch.no_grad():
            rho_o = _gamma(Lk, u) * torch.matmul(p.detach().abs(), v.detach().abs())
        self._keep(o, rho_o)
        return o


@dataclass(frozen=True)
class Bounded:
    """A float64 result with the first-order float32 error bounds of :func:`error_bound` (all the same shape):
    ``bound`` that of a float32 evaluation in any order, ``bound_ref`` that of ``value`` itself. Indexing
    (``b[r, cols]``, ``b[mask]``) indexes the three tensors alike."""

    value: torch.Tensor
    bound: torch.Tensor
    bound_ref: torch.Tensor

    def __getitem__(self, index) -> "Bounded":
        return Bounded(self.value[index], self.bound[index], self.bound_ref[index])


def error_bound(fn, *inputs: torch.Tensor) -> Bounded:
    """Runs ``fn(*inputs)`` in float64 and bounds the float32 rounding error of each element of its result.

    Args:
        fn: a computation in plain PyTorch returning one float64 tensor ``y`` (any shape), or ``(y, elements)``
            with ``elements`` the ``y.numel()`` 0-d tensors that ``y`` was stacked from, in row-major order (then
            each element is differentiated directly: a backward from ``y[i]`` would also walk, with zero
            gradients, the graphs of all the elements stacked beside it). Its operations must be differentiable
            functions of ``inputs`` and/or of parameters that require gradients (a model's).
        inputs: float tensors; each is cast to float64 and made to require gradients (a leaf), so the bound counts
            every rounding that depends on them (the inputs themselves are exact).

    Returns:
        :class:`Bounded` ``(value, bound, bound_ref)``: float64 tensors of the result's shape. ``bound[i]`` is the first-order
        worst-case error of element ``i`` of a float32 evaluation of the same operations in any order (module
        docstring); ``bound_ref[i]`` that of ``value[i]`` itself (the roundings the float64 run makes: operations
        it carries out in float32 and casts down to float32; 0 for a computation wholly in float64).

    Raises:
        NotImplementedError: ``fn`` uses an operation with no rule.
        TypeError: ``fn`` did not return a floating tensor.
        ValueError: a sensitivity is NaN (the bound would be meaningless), or ``elements`` has the wrong length.
    """
    leaves = [x.detach().double().requires_grad_() for x in inputs]
    rec = _Recorder()
    with torch.enable_grad():
        with rec:
            y = fn(*leaves)
        y, elements = y if isinstance(y, tuple) else (y, None)
        if not (isinstance(y, torch.Tensor) and y.is_floating_point()):
            raise TypeError(f"error_bound: fn must return a floating tensor, got {type(y).__name__}")
        flat = y.reshape(-1)
        n = flat.numel()
        if elements is None:
            elements = [flat[i] for i in range(n)]
        elif len(elements) != n:
            raise ValueError(f"error_bound: fn returned {len(elements)} elements for a result of {n}")
        tensors = [r[0] for r in rec.records]
        bound = torch.zeros(n, dtype=torch.float64)
        bound_ref = torch.zeros(n, dtype=torch.float64)
        for i, e in enumerate(elements):
            if not e.requires_grad or not bool(torch.isfinite(e)):
                continue
            grads = torch.autograd.grad(e, tensors, retain_graph=True, allow_unused=True)
            for g, (_, rho, in_f32, in_ref) in zip(grads, rec.records):
                if g is None:
                    continue
                if bool(g.isnan().any()):
                    raise ValueError(f"error_bound: a NaN sensitivity of element {i} (an operation whose gradient is "
                                     "NaN, e.g. 0 x -inf in a product that a where() discards: mask the operand)")
                # rho is +inf on -inf values (e.g. masked logits) that no element depends on (g == 0 there)
                term = float(torch.where(g != 0, g.abs() * rho, torch.zeros_like(rho)).sum())
                if in_f32:
                    bound[i] += term
                if in_ref:
                    bound_ref[i] += term
    return Bounded(y.detach().double(), bound.view(y.shape), bound_ref.view(y.shape))


def float64_copy(model, exact_norms: bool = False):
    """A float64 copy of ``model`` whose parameters require gradients (the sensitivities of :func:`error_bound`).
    ``exact_norms``: its RMSNorms compute in float64 too (Hugging Face's upcast them to float32), for
    :func:`random_rounding`, which then has no float32 operation of the model to account for."""
    import copy

    m64 = copy.deepcopy(model).double()
    for prm in m64.parameters():
        prm.requires_grad_(True)
    if exact_norms:
        for mod in m64.modules():
            if type(mod).__name__.endswith("RMSNorm"):
                def forward(h, mod=mod):
                    return mod.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon))
                mod.forward = forward
    return m64


def _oar_p_divergence(clean: torch.Tensor, pert: torch.Tensor, probe: str) -> torch.Tensor:
    """OAR-P's score of one masked variant from two :func:`oar.reference._probe_stat` results, differentiable:
    KL(clean || pert) clamped at 0, or the clamped drop of phi for ``answer_joint``."""
    if probe == "answer_joint":
        return (clean - pert).clamp_min(0)
    return (clean.exp() * (clean - pert)).sum().clamp_min(0)


def oar_p_error_bound(model, batch, probe: str = "answer_mean", spans=None):
    """Exact OAR-P scores of a probe ``batch`` on the float64 copy of ``model`` and their float32 error bounds.

    One unpadded context per forward (clean, then each reasoning token masked with PAD), the probe statistic and
    the divergence as in :mod:`oar.reference` (method.md section 3), all under :func:`error_bound`. ``spans``
    ({row: [(j0, j1), ...]}, method.md section 11): each span masked whole instead, its score on each of its tokens
    (others 0).

    Returns:
        :class:`Bounded`, (B, L_max) float64; positions past a row's reasoning length are 0 with bound 0.
    """
    from oar.reference import _probe_stat, _row_context

    m64 = float64_copy(model)
    B, Lm = batch.batch_size, int(batch.reasoning_len.max())

    def run():
        rows, elements = [], []
        for r in range(B):
            ids, s, L, cols, a_ids = _row_context(batch, r, torch.device("cpu"))
            clean = _probe_stat(m64(input_ids=ids[None]).logits[0], cols, a_ids, probe)
            row = [torch.zeros((), dtype=torch.float64)] * Lm
            for j0, j1 in ([(j, j + 1) for j in range(L)] if spans is None else spans.get(r, [])):
                masked = ids.clone()
                masked[s + j0:s + j1] = batch.pad_id
                pert = _probe_stat(m64(input_ids=masked[None]).logits[0], cols, a_ids, probe)
                row[j0:j1] = [_oar_p_divergence(clean, pert, probe)] * (j1 - j0)
            elements += row
            rows.append(torch.stack(row))
        return torch.stack(rows), elements

    return error_bound(run)


def oar_p_window_error_bound(model, batch, window: int, probe: str = "answer_mean", spans=None,
                             rerun_tail: str = "conclude"):
    """Windowed OAR-P scores of a probe ``batch`` on the float64 copy of ``model`` and their float32 error bounds,
    step by step as :func:`oar.reference.oar_p_window_naive` (one unpadded context, one masked token at a time, a
    Hugging Face cache and 2-D masks), under :func:`error_bound`. The clean cache is recomputed for each masked
    token instead of copied (a copy of a tensor inside an autograd graph is not supported): the same operations on
    the same values, so the same scores and bounds. ``spans`` ({row: [(j0, j1), ...]}): each span masked whole,
    re-running its tokens and the ``window`` tokens after it; its score on each of its tokens (others 0).
    ``rerun_tail="probe"``: the tail re-run is the last ``batch.keep`` columns only (the conclude tokens before them
    keep their clean keys/values).

    Returns:
        :class:`Bounded`, (B, L_max) float64; positions past a row's reasoning length are 0 with bound 0.
    """
    import inspect

    from transformers import DynamicCache

    from oar.reference import _probe_stat, _row_context

    m64 = float64_copy(model)
    ckw = "cache" if "cache" in inspect.signature(m64.forward).parameters else "past_key_values"
    B, Lm = batch.batch_size, int(batch.reasoning_len.max())

    def run():
        rows, elements = [], []
        for r in range(B):
            ids, s, L, cols, a_ids = _row_context(batch, r, torch.device("cpu"))
            n = ids.numel()
            clean = _probe_stat(m64(input_ids=ids[None]).logits[0], cols, a_ids, probe)
            tail = n - batch.keep if rerun_tail == "probe" else min(s + L, n - batch.keep)
            row = [torch.zeros((), dtype=torch.float64)] * Lm
            for j0, j1 in ([(j, j + 1) for j in range(L)] if spans is None else spans.get(r, [])):
                t = s + j0
                cache = DynamicCache(config=m64.config)
                m64(input_ids=ids[None, :tail], use_cache=True, **{ckw: cache})
                win = list(range(t, min(s + j1 + window, tail)))
                masked = ids.clone()
                masked[t:s + j1] = batch.pad_id
                if win:
                    att = torch.ones(1, tail + len(win), dtype=torch.long)
                    att[0, t:tail] = 0
                    m64(input_ids=masked[None, win], attention_mask=att, use_cache=True,
                        position_ids=torch.tensor([win]), **{ckw: cache})
                att = torch.ones(1, tail + len(win) + n - tail, dtype=torch.long)
                att[0, win] = 0  # the clean keys of the re-run columns
                logits = m64(input_ids=masked[None, tail:], attention_mask=att, use_cache=True,
                             position_ids=torch.arange(tail, n)[None], **{ckw: cache}).logits[0]
                full = torch.cat([torch.zeros(tail, logits.shape[-1], dtype=logits.dtype), logits])
                row[j0:j1] = [_oar_p_divergence(clean, _probe_stat(full, cols, a_ids, probe), probe)] * (j1 - j0)
            elements += row
            rows.append(torch.stack(row))
        return torch.stack(rows), elements

    return error_bound(run)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension in plain PyTorch, traceable by :func:`error_bound`; -inf
    logits (zero probability) contribute 0. (..., V) -> (...)."""
    lp = torch.log_softmax(logits, -1)
    p = lp.exp()
    live = p > 0
    return -torch.where(live, p * torch.where(live, lp, torch.zeros_like(lp)), torch.zeros_like(p)).sum(-1)


def entropy_error_bound(model, input_ids: torch.Tensor, start: int, stop: int, banned=()) -> Bounded:
    """Entropies of the next-token distributions at positions ``start <= t < stop`` of ONE unpadded context
    ``input_ids`` (1, T) on the float64 copy of a Hugging Face ``model`` (vocabulary entries ``banned`` set to -inf),
    with their float32 error bounds: :class:`Bounded`, (stop - start,) float64."""
    m64 = float64_copy(model)

    def run():
        logits = m64(input_ids=input_ids).logits[0, start:stop]
        if len(banned):
            logits = logits.clone()
            logits[..., list(banned)] = float("-inf")
        return entropy(logits)

    return error_bound(run)


# ---- random rounding: an estimate for computations with a backward pass -------------------------------------------
#
# The first-order bound above needs the sensitivity of the result to every intermediate, which autograd gives for
# the operations a TorchFunctionMode sees: a forward. A result that is itself a gradient (OAR-G) is computed by the
# autograd engine's backward operations, which no Python mode can retain. For those, :func:`random_rounding` runs
# the float64 computation (forward and backward) under a TorchDispatchMode that adds to every floating operation's
# result its worst-case float32 rounding (the rules above, at the aten level) times a random sign. The result's
# deviation over a few such runs estimates sigma = sqrt(sum_v (dy/dv rho_v)^2), the standard deviation of the
# float32 error under the probabilistic model of rounding (independent, mean-zero errors of at most rho_v each:
# Higham and Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019):
# by Hoeffding's inequality the float32 error of any evaluation order exceeds lambda sigma with probability at
# most 2 exp(-lambda^2 / 2). Not a worst-case bound, and said so where it is used.

_ATEN_EXACT = {
    "view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute", "clone", "copy_", "detach", "alias",
    "slice", "select", "index", "index_select", "gather", "cat", "stack", "unsqueeze", "squeeze", "split",
    "split_with_sizes", "unbind", "embedding", "where", "masked_fill", "masked_fill_", "_to_copy", "zeros_like",
    "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_full", "new_empty", "zeros", "ones",
    "full", "empty", "empty_strided", "fill_", "zero_", "arange", "scalar_tensor", "lift_fresh", "lift_fresh_copy",
    "neg", "abs", "sign", "max", "min", "amax", "amin", "maximum", "minimum", "clamp", "clamp_min", "clamp_max",
    "threshold_backward", "relu", "contiguous", "as_strided", "unsqueeze_", "squeeze_", "expand_as", "view_as",
    "_reshape_alias", "flip", "roll", "tril", "triu", "constant_pad_nd", "slice_backward", "select_backward",
    "unfold", "_local_scalar_dense", "repeat", "repeat_interleave", "diagonal", "narrow", "index_put", "index_put_",
    "scatter", "scatter_", "masked_scatter", "set_", "resize_", "to", "isinf",
    "isnan", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "bitwise_and",
    "bitwise_or", "bitwise_not", "any", "all", "nonzero", "sort", "topk", "argmax", "argmin", "_has_compatible_shallow_copy_type", "is_nonzero", "item", "equal", "detach_", "_reshape_copy", "new_empty_strided",
    "expand_copy", "permute_copy", "view_copy", "transpose_copy", "t_copy", "slice_copy",
    "select_copy", "unsqueeze_copy", "squeeze_copy", "alias_copy", "clone_", "bernoulli_", "normal_", "uniform_",
    "random_", "randn", "rand", "randn_like", "rand_like", "ceil", "floor", "round", "trunc", "_unsafe_index",
    "index_add", "_efficientzerotensor", "isfinite", "resolve_conj", "resolve_neg",
}
# oar's step-level ops (sequence and token advantages): downstream of the scores, which are what the estimate is
# for; left unperturbed.
_STEP_OPS = {"group_advantages", "normalize_importance", "reshape_advantages"}
_ATEN_ONE = {"add", "sub", "mul", "div", "rsub", "reciprocal", "sqrt", "square", "add_", "sub_", "mul_", "div_",
             "addcmul", "addcdiv", "lerp", "true_divide"}
_ATEN_ELEMENTARY = {"exp", "log", "log1p", "expm1", "rsqrt", "sigmoid", "tanh", "sin", "cos", "silu", "erf",
                    "softplus", "gelu", "log_sigmoid_forward", "exp_", "log_", "pow", "sigmoid_", "tanh_"}


def _aten_rho(name, args, kwargs, out):
    """Worst-case float32 rounding of one aten operation's result ``out`` (float64), or None if exact."""
    u = _U32
    ce = 2 * ULPS_ELEMENTARY * u
    if name == "_to_copy" and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64 \
            and out.dtype == torch.float32:  # a cast down: one rounding
        return u * out.abs()
    if name in _ATEN_EXACT:
        return None
    if name in _ATEN_ONE:
        k = 2 if name in ("addcmul", "addcdiv", "lerp") else 1
        return k * u * out.abs()
    if name in _ATEN_ELEMENTARY:
        return (ce + (u if name == "silu" else 0.0)) * out.abs()
    if name in ("sum", "mean"):
        x = args[0]
        n = max(x.numel() // max(out.numel(), 1), 1)
        absum = torch.ops.aten.sum(x.abs(), *args[1:], **kwargs) if name == "sum" else \
            torch.ops.aten.mean(x.abs(), *args[1:], **kwargs) * n
        if name == "mean":
            absum = absum / n
            return _gamma(n - 1, u) * absum + u * out.abs()
        return _gamma(n - 1, u) * absum
    if name in ("mm", "bmm", "dot", "mv"):
        x, y = args[0], args[1]
        op = {"mm": torch.mm, "bmm": torch.bmm, "dot": torch.dot, "mv": torch.mv}[name]
        return _gamma(x.shape[-1], u) * op(x.abs(), y.abs())
    if name in ("addmm", "baddbmm"):
        x, y = args[1], args[2]
        op = torch.mm if name == "addmm" else torch.bmm
        return _gamma(x.shape[-1], u) * op(x.abs(), y.abs()) + u * out.abs()
    if name in ("_softmax", "_log_softmax", "_safe_softmax"):
        rho = _Recorder._softmax_rho(args[0].detach(), args[1], out.detach(), u, log=(name == "_log_softmax"))
        return rho.nan_to_num(0.0)
    if name == "_softmax_backward_data":  # g_in = y (g - sum(y g))
        g, y, dim = args[0], args[1], args[2]
        n = y.shape[dim]
        s = (y * g).sum(dim, keepdim=True)
        return y.abs() * (_gamma(n, u) * (y * g).abs().sum(dim, keepdim=True) + u * (g.abs() + s.abs())) \
            + u * out.abs()
    if name == "_log_softmax_backward_data":  # g_in = g - exp(y) sum(g)
        g, y, dim = args[0], args[1], args[2]
        n = y.shape[dim]
        p = y.exp()
        return p * (_gamma(n - 1, u) * g.abs().sum(dim, keepdim=True) + ce * g.sum(dim, keepdim=True).abs()) \
            + u * out.abs()
    if name == "silu_backward":  # g s (1 + x (1 - s))
        g, x = args[0], args[1]
        s = torch.sigmoid(x)
        return (ce + 4 * u) * g.abs() * s * (1 + x.abs() * (1 - s))
    if name == "tanh_backward":  # g (1 - y^2)
        g, y = args[0], args[1]
        return 3 * u * g.abs() * (1 + y * y)
    if name == "sigmoid_backward":  # g y (1 - y)
        g, y = args[0], args[1]
        return 3 * u * g.abs() * y.abs() * (1 + y.abs())
    if name == "embedding_dense_backward":  # sums the gradients of repeated ids
        g = args[0]
        n = max(g.numel() // max(g.shape[-1], 1), 1)
        return _gamma(n, u) * torch.ops.aten.embedding_dense_backward(g.abs(), *args[1:], **kwargs)
    if name == "scatter_add":  # self + the src values scattered to each element: a sum of at most n + 1 terms
        x, dim, index, src = args[0], args[1], args[2], args[3]
        return _gamma(src.shape[dim] + 1, u) * torch.scatter_add(x.abs(), dim, index, src.abs())
    if name == "index_add":  # the same along one dimension
        x, dim, index, src = args[0], args[1], args[2], args[3]
        return _gamma(src.shape[dim] + 1, u) * torch.index_add(x.abs(), dim, index, src.abs())
    if name == "index_put_accumulate":
        return u * out.abs()
    if name in ("probe_divergence", "probe_divergence_backward"):
        return _probe_rho(name, args, out)  # args: every argument of the schema, in order (see the mode)
    if name == "grad_x_input":  # |sum_h g x|: a dot product of H terms
        g, x = args[0].double(), args[1].double()
        return _gamma(g.shape[-1] + 1, u) * (g.abs() * x.abs()).sum(-1)
    raise NotImplementedError(f"_error_model.random_rounding: no rounding rule for aten.{name}; add one")


def _log_softmax_parts(z, u):
    """log_softmax of z (..., V) in float64 with the float32 rounding rules of its log-probabilities and
    probabilities: (lp, p, rho_lp, rho_p)."""
    lp = torch.log_softmax(z, -1)
    p = lp.exp()
    rho_lp = _Recorder._softmax_rho(z, -1, lp, u, log=True).nan_to_num(0.0, posinf=0.0)
    rho_p = _Recorder._softmax_rho(z, -1, p, u, log=False).nan_to_num(0.0, posinf=0.0)
    return lp, p, rho_lp, rho_p


def _probe_rho(name, args, out):
    """Worst-case float32 rounding of oar::probe_divergence (KL of the probe distributions, or the drop of the mean
    answer log-likelihood) and of its backward (w.r.t. the perturbed logits), from their formulas (method.md
    section 2) evaluated on the op's inputs: the log-softmaxes, the probabilities, the products and the sums."""
    u = _U32
    backward = name == "probe_divergence_backward"
    if backward:
        g, args = args[0].double(), args[1:]
    clean, pert, ids, lengths, probe = args[0].double(), args[1].double(), args[2], args[3], args[4]
    N, S, V = pert.shape
    L = lengths if lengths is not None else torch.full((N,), S, dtype=torch.int64)
    live = (torch.arange(S)[None, :] < L[:, None]).to(torch.float64)[..., None]  # (N, S, 1)
    cnt = L.to(torch.float64)
    if probe in ("last", "answer_mean"):
        if probe == "last":
            zc, zp, rz = clean[:, 0], pert[:, 0], 0.0
        else:  # the mean over s < L of the logits: a sum of L terms and a division
            zc = (clean * live).sum(1) / cnt[:, None]
            zp = (pert * live).sum(1) / cnt[:, None]
            rz = (_gamma_t(cnt, u)[:, None] + u) * (pert.abs() * live).sum(1) / cnt[:, None]
        lc, pc, rlc, rpc = _log_softmax_parts(zc, u)
        lq, pq, rlq, rpq = _log_softmax_parts(zp, u)
        rz = torch.as_tensor(rz, dtype=torch.float64)
        if not backward:  # KL = sum_v pc (lc - lq)
            d = (lc - lq).nan_to_num(0.0, posinf=0.0, neginf=0.0).abs()
            rlq = rlq + rz + (pq * rz).sum(-1, keepdim=True)  # the mean's rounding through log_softmax
            return (pc * (rlc + rlq) + rpc * d).sum(-1) + _gamma(V + 2, u) * (pc * d).sum(-1)
        # d KL / d zp = (pq - pc) g (divided by L over the positions s < L for answer_mean)
        r = g.abs()[:, None] * (rpq + rpc)  # (N, V)
        r = r[:, None, :] * (live / cnt[:, None, None] if probe == "answer_mean" else
                             (torch.arange(S)[None, :, None] == 0).to(torch.float64))
        return (r + u * out.double().abs()).to(out.dtype)
    # answer_joint: phi = mean_{s<L} log_softmax(z_s)[a_s]
    lc, pc, rlc, rpc = _log_softmax_parts(clean, u)
    lq, pq, rlq, rpq = _log_softmax_parts(pert, u)
    a = ids.clamp_min(0)[..., None]
    if not backward:
        pick = lambda t: (t.gather(-1, a) * live).sum((1, 2))  # noqa: E731
        sums = pick(lc.abs().nan_to_num(0.0, posinf=0.0)) + pick(lq.abs().nan_to_num(0.0, posinf=0.0))
        return (pick(rlc) + pick(rlq)) / cnt + (_gamma_t(cnt, u) + u) * sums / cnt + u * out.double().abs()
    return (g.abs()[:, None, None] * rpq * live / cnt[:, None, None] + u * out.double().abs()).to(out.dtype)


def _gamma_t(n: torch.Tensor, u: float) -> torch.Tensor:
    """:func:`_gamma` of a tensor of term counts."""
    return n.double().clone().apply_(lambda v: _gamma(int(v), u))  # clone: apply_ works in place


class _RandomRounding(torch.utils._python_dispatch.TorchDispatchMode):
    """Adds rho x a random sign to every float64 result of a floating aten operation (see above)."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.generator = generator
        self.float32_ops = 0  # operations the float64 run itself carries out in float32

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ("index_put", "index_put_") and (kwargs.get("accumulate") or (len(args) > 3 and args[3])):
            name = "index_put_accumulate"
        if name in _STEP_OPS:
            return out
        if name == "_scaled_dot_product_flash_attention_for_cpu":
            return self._flash(args, kwargs, out)
        floating = (torch.float64, torch.float32)
        if not isinstance(out, torch.Tensor) or out.dtype not in floating or out.numel() == 0:
            if isinstance(out, (tuple, list)) and any(isinstance(t, torch.Tensor) and t.dtype in floating
                                                      for t in out) and name not in _ATEN_EXACT:
                raise NotImplementedError(f"_error_model.random_rounding: no rule for aten.{name} (several outputs)")
            return out
        if name in ("probe_divergence", "probe_divergence_backward"):  # all arguments, defaults filled in
            sch = func._schema.arguments
            args = tuple(args[i] if i < len(args) else kwargs.get(a.name, a.default_value) for i, a in enumerate(sch))
        rho = _aten_rho(name, args, kwargs, out)
        if rho is None:
            return out
        self.float32_ops += out.dtype == torch.float32
        noise = self._noise(out, torch.as_tensor(rho))
        if (name == "probe_divergence" and args[4] != "answer_joint") or name == "grad_x_input":
            return (out + noise).clamp_min(0)  # the op clamps a KL at 0; |sum| is >= 0 in any rounding
        if name.endswith("_") or func._schema.is_mutable:
            out.add_(noise)
            return out
        return out + noise


    def _noise(self, t, rho):
        sign = torch.randint(0, 2, t.shape, generator=self.generator, dtype=torch.int8).to(t.dtype) * 2 - 1
        rho = torch.broadcast_to(rho.to(t.dtype), t.shape)
        return torch.where(torch.isfinite(t), sign * rho.nan_to_num(0.0, posinf=0.0), torch.zeros_like(t))

    def _flash(self, args, kwargs, out):
        """PyTorch's CPU flash attention (output, float32 log-sum-exp) as scores, softmax and the weighted sum."""
        q, k, v = (t.double() for t in args[:3])
        causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        bias = kwargs.get("attn_mask", args[5] if len(args) > 5 else None)
        scale = kwargs.get("scale", None)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        u, ce = _U32, 2 * ULPS_ELEMENTARY * _U32
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        s = q @ k.transpose(-2, -1) * scale
        rho_s = _gamma(q.shape[-1] + 1, u) * (q.abs() @ k.abs().transpose(-2, -1)) * abs(scale) + u * s.abs()
        if bias is not None:
            s = s + bias.double()
        if causal:
            Lq, Lk = s.shape[-2], s.shape[-1]
            if Lq != Lk:
                raise NotImplementedError("_error_model: causal flash attention with Lq != Lk")
            s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool).tril(), -math.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        o = p @ v
        rho_p = _Recorder._softmax_rho(s, -1, p, u, log=False).nan_to_num(0.0, posinf=0.0)
        rho_s = torch.where(p > 0, rho_s, torch.zeros_like(rho_s))
        rho_o = (_gamma(k.shape[-2], u) * (p @ v.abs()) + rho_p @ v.abs()
                 + (p * rho_s) @ v.abs() + (p * rho_s).sum(-1, keepdim=True) * o.abs())
        lse = out[1].double()
        rho_lse = (p * rho_s).sum(-1) + _gamma(k.shape[-2], u) + ce + ce * lse.abs().nan_to_num(0.0, posinf=0.0)
        self.float32_ops += 1  # the log-sum-exp is float32
        return (out[0] + self._noise(out[0], rho_o), out[1] + self._noise(out[1], rho_lse), *out[2:])


def random_rounding(fn, draws: int = 8, seed: int = 0) -> Bounded:
    """Runs ``fn()`` (float64, forward and backward allowed) once plainly and ``draws`` times under random
    worst-case roundings (the comment above), and returns :class:`Bounded` with ``bound`` = the estimated standard
    deviation sigma of the float32 error of each element times ``LAMBDA`` (so that ``bound`` plays the worst-case
    bound's part in :func:`_tolerance.assert_within_error_model`). Operations that ``fn`` carries out in float32
    (oar's probe op on logits rounded to float32, Hugging Face's rotary tables) are randomized too, and then
    ``value`` carries one such float32 error itself: ``bound_ref`` = ``bound`` (else 0; :func:`float64_copy` with
    ``exact_norms`` makes a model compute in float64 throughout).

    Raises:
        NotImplementedError: an aten operation with no rule.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # attention as matmuls and a softmax, which the rules cover
        value = fn().detach().double()
        dev, float32_ops = [], 0
        for d in range(draws):
            with _RandomRounding(torch.Generator().manual_seed(seed + d)) as mode:
                y = fn()
            float32_ops += mode.float32_ops
            dev.append((y.detach().double() - value) ** 2)
    bound = LAMBDA * torch.stack(dev).mean(0).sqrt()
    return Bounded(value, bound, bound if float32_ops else torch.zeros_like(value))


#: Estimated standard deviations that :func:`random_rounding`'s bound spans. With 8 draws the estimate of sigma is
#: below half the true value with probability 0.019 (chi-square, 8 degrees of freedom); 5 sigma then still leaves
#: Hoeffding's tail 2 exp(-12.5) = 7e-6. The magnitudes rho are worst cases per operation, so real float32 errors
#: sit far inside (observed: below 1% of the bound on the test suite's computations).
LAMBDA = 10.0


def oar_g_reference(model, batch, noises, probe: str = "answer_mean", sigma: float = 1e-3) -> torch.Tensor:
    """OAR-G scores (method.md section 4) of a probe ``batch`` in plain PyTorch, one unpadded context per forward,
    in the model's dtype: the clean probe logits, the embeddings plus ``sigma`` x noise on the reasoning tokens,
    the gradient of the divergence (unclamped; the drop of phi for ``answer_joint``) w.r.t. them, and
    ``|sum_h grad * clean embedding|``, averaged over the draws.

    Args:
        noises: one (B, W, H) float32 tensor per draw, drawn as :func:`oar.attribution.oar_g_scores` draws them
            when the batch is one chunk (W = the longest context; row r's context fills its last columns).

    Returns:
        (B, L_max) scores in the model's dtype; positions past a row's reasoning length are 0.
    """
    from oar.reference import _row_context

    B, Lm = batch.batch_size, int(batch.reasoning_len.max())
    emb = model.get_input_embeddings()
    out = []
    with torch.enable_grad():
        for r in range(B):
            ids, s, L, cols, a_ids = _row_context(batch, r, torch.device("cpu"))
            n = ids.numel()
            E = emb(ids[None]).detach()
            zc = model(inputs_embeds=E).logits[0, cols].detach()
            acc = torch.zeros(L, dtype=E.dtype)
            for noise in noises:
                mask = torch.zeros(1, n, 1, dtype=E.dtype)
                mask[0, s: s + L] = 1
                Ek = (E + noise[r, noise.shape[1] - n:][None].to(E.dtype) * sigma * mask).requires_grad_(True)
                zp = model(inputs_embeds=Ek).logits[0, cols]
                if probe == "answer_joint":
                    idx = torch.arange(len(cols)), a_ids
                    J = torch.log_softmax(zc, -1)[idx].mean() - torch.log_softmax(zp, -1)[idx].mean()
                else:
                    c, p = (zc[0], zp[0]) if probe == "last" else (zc.mean(0), zp.mean(0))
                    lc, lp = torch.log_softmax(c, -1), torch.log_softmax(p, -1)
                    J = (lc.exp() * (lc - lp)).sum()
                (g,) = torch.autograd.grad(J, Ek)
                acc = acc + (g * E).sum(-1).abs()[0, s: s + L]
            out.append(torch.cat([acc / len(noises), torch.zeros(Lm - L, dtype=E.dtype)]))
    return torch.stack(out)


def pipeline_scores_estimate(cfg, tokenizer, batch, model, bytes_per_element: int | None = None) -> Bounded:
    """``Pipeline(cfg, tokenizer).scores(batch, ...)`` on the float64 copy of a Hugging Face ``model`` (logits rounded
    once to the float32 that oar's probe ops take; chunks planned as for ``model``, so OAR-G draws the same noise),
    with the :func:`random_rounding` estimate of the float32 error of its scores: :class:`Bounded`, (B, T).
    ``bytes_per_element``: the element size the chunks are planned with (default ``model``'s parameters'; a run under
    bf16 autocast or bf16 parameters plans with 2)."""
    from oar.attribution import HFProbeModel
    from oar.pipeline import Pipeline

    from _tolerance import float64_model

    if bytes_per_element is None:
        bytes_per_element = next(model.parameters()).element_size()
    m64 = HFProbeModel(float64_model(model), bytes_per_element=bytes_per_element)
    return random_rounding(lambda: Pipeline(cfg, tokenizer).scores(batch, m64).scores)


def probe_divergence_formula(clean: torch.Tensor, perturbed: torch.Tensor, probe: str, answer_ids=None,
                             lengths=None) -> torch.Tensor:
    """The probe divergence (method.md section 2) written as oar's op computes it (docs/design.md, "probe
    divergence"): KL = sum_v p_v (zc_v - zp_v) + (lse(zp) - lse(zc)) with p = softmax(zc) (accurate for small KLs),
    on the mean of the logits over the first ``lengths`` positions for ``answer_mean``, on position 0 for
    ``last``; ``answer_joint``: phi(clean) - phi(perturbed), phi the mean answer log-likelihood. Plain PyTorch in the
    inputs' dtype, traceable by :func:`error_bound`. (N, S, V) -> (N,)."""
    N, S, V = perturbed.shape
    L = torch.full((N,), S, dtype=torch.int64) if lengths is None else lengths
    live = torch.arange(S)[None, :] < L[:, None]
    cnt = L.to(perturbed.dtype)
    if probe == "answer_joint":
        ids = torch.where(live, answer_ids, torch.zeros_like(answer_ids))[..., None]

        def phi(z):
            ll = (z.gather(-1, ids)[..., 0] - torch.logsumexp(z, -1))
            return torch.where(live, ll, torch.zeros_like(ll)).sum(1) / cnt

        return phi(clean) - phi(perturbed)
    if probe == "last":
        zc, zp = clean[:, 0], perturbed[:, 0]
    else:
        m3 = live[..., None]
        zc = torch.where(m3, clean, torch.zeros_like(clean)).sum(1) / cnt[:, None]
        zp = torch.where(m3, perturbed, torch.zeros_like(perturbed)).sum(1) / cnt[:, None]
    lse_c, lse_p = torch.logsumexp(zc, -1), torch.logsumexp(zp, -1)
    p = torch.exp(zc - lse_c[:, None])
    fin = torch.isfinite(zc) & torch.isfinite(zp)
    d = torch.where(fin, zc - torch.where(fin, zp, torch.zeros_like(zp)), torch.zeros_like(zc))
    return (p * d).sum(-1) + (lse_p - lse_c)


def probe_divergence_error_bound(clean, perturbed, probe, answer_ids=None, lengths=None) -> Bounded:
    """:func:`probe_divergence_formula` in float64 on the inputs as given (16-bit inputs are read exactly) with its
    float32 error bounds (N,). Rows where the float64 value is not finite get bound 0."""
    return error_bound(lambda c, p: probe_divergence_formula(c, p, probe, answer_ids, lengths), clean, perturbed)


def probe_divergence_grad_formula(clean, perturbed, probe, answer_ids=None, lengths=None, weights=None):
    """The gradient of ``sum_n weights[n] * probe_divergence(...)[n]`` w.r.t. the perturbed logits, written out as
    oar's backward op computes it (method.md section 4): ``w_n (softmax(zp) - softmax(zc))`` at position 0
    (``last``), spread as ``/ L_n`` over the positions s < L_n (``answer_mean``), and ``w_n (softmax(z_s) - onehot(a_s))
    / L_n`` per position (``answer_joint``). Plain PyTorch, traceable by :func:`error_bound`. -> (N, S, V)."""
    N, S, V = perturbed.shape
    L = torch.full((N,), S, dtype=torch.int64) if lengths is None else lengths
    w = torch.ones(N, dtype=perturbed.dtype) if weights is None else weights.to(perturbed.dtype)
    live = (torch.arange(S)[None, :] < L[:, None])[..., None]
    cnt = L.to(perturbed.dtype)[:, None, None]
    if probe == "answer_joint":
        onehot = torch.zeros(N, S, V, dtype=perturbed.dtype).scatter(-1, answer_ids.clamp_min(0)[..., None], 1.0)
        g = (torch.softmax(perturbed, -1) - onehot) * w[:, None, None] / cnt
        return torch.where(live, g, torch.zeros_like(g))
    if probe == "last":
        d = (torch.softmax(perturbed[:, 0], -1) - torch.softmax(clean[:, 0], -1)) * w[:, None]
        return torch.cat([d[:, None], torch.zeros(N, S - 1, V, dtype=perturbed.dtype)], 1)
    zc = torch.where(live, clean, torch.zeros_like(clean)).sum(1) / cnt[:, 0]
    zp = torch.where(live, perturbed, torch.zeros_like(perturbed)).sum(1) / cnt[:, 0]
    d = (torch.softmax(zp, -1) - torch.softmax(zc, -1)) * w[:, None]
    g = d[:, None] / cnt
    return torch.where(live, g.expand(N, S, V), torch.zeros(N, S, V, dtype=perturbed.dtype))
