"""Documented wrappers of the ``torch.ops.oar.*`` operators, with fake kernels for torch.compile.

Every op is implemented in C++ (``src/torch``, torch-free core in ``src/core``) and registered with the
PyTorch dispatcher; these wrappers add docstrings, preset handling and autograd where it is defined.
Plain-PyTorch references of every op live in :mod:`oar.reference`.
Errors: bad shapes/dtypes/values raise ``ValueError`` whose message names the argument, the expected and
the actual value; device mismatches raise ``ValueError`` too.
"""

from __future__ import annotations

import torch

from oar import _lib

_lib.load_ops_library()

__all__ = [
    "group_advantages",
    "normalize_importance",
    "reshape_advantages",
    "probe_divergence",
    "grad_x_input",
    "build_masked_batch",
    "ADVANTAGE_PRESETS",
]

# ==== section: advantages (group advantages, normalization, reshaping) ================================
# These ops have no autograd: advantages and weights are constants of the policy-gradient loss. The C++
# side registers a fallthrough on the Autograd key, so outputs never require grad (src/torch/cpu_advantages.cpp).

import warnings as _warnings
from collections.abc import Sequence as _Sequence


# Plain-Python argument checks, so that a wrong type gets a ValueError naming the argument instead of a
# dispatcher RuntimeError ("Expected a value of type 'str' ...") or a silent coercion (bool("no") is True).
def _str_arg(name: str, value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {type(value).__name__} {value!r}")
    return value


def _float_arg(name: str, value) -> float:
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}") from None


def _bool_arg(name: str, value) -> bool:
    ok = isinstance(value, bool)
    if not ok and not isinstance(value, (str, bytes, float, torch.Tensor)):
        try:
            ok = value in (True, False)  # numpy bools, 0/1
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise ValueError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def _int_arg(name: str, value) -> int:
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value.__index__())
    if not -(2**63) <= v < 2**63:
        raise ValueError(f"{name} must fit in int64, got {v}")
    return v


def _same_device(ref_name: str, ref: torch.Tensor, **others) -> None:
    # Fake (meta) kernels: the real kernels refuse mixed devices, and a fake kernel that allocated on the
    # first argument's device would hand back uninitialized real memory for e.g. (meta, cpu) inputs.
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")

#: Trainer presets for :func:`group_advantages`, mirroring ``oar::core::preset_options``
#: (include/oar/core/group_advantages.h). Each maps to the keyword arguments ``std``, ``eps`` and
#: ``singleton``; the estimator is chosen separately.
#:
#: - ``"trl"``: TRL ``GRPOTrainer._generate_and_score_completions``: unbiased std, eps 1e-4
#:   (``scale_rewards="group"`` is ``estimator="grpo"``, ``"batch"`` is ``"batch"``, ``"none"`` is
#:   ``"dr_grpo"``).
#: - ``"verl"``: verl ``core_algos.compute_grpo_outcome_advantage``: unbiased std, eps 1e-6, a group of one
#:   response gets mean 0 and std 1, so A = r / (1 + eps) (``norm_adv_by_std_in_grpo=False`` is
#:   ``estimator="dr_grpo"``, where A = r).
#: - ``"openrlhf"``: OpenRLHF ``experience_maker`` ``group_norm``: unbiased std, eps 1e-9 (also ``rloo`` and
#:   ``dr_grpo``). OpenRLHF itself returns NaN (std of one value) or divides by zero (rloo) for a group of
#:   one; this preset gives such a group A = 0 instead.
#: - ``"default"``: unbiased std, eps 1e-6, a group of one gets A = 0.
#:
#: One deliberate difference from all three trainers: they compute ``r - mean`` in float32, so a group of
#: equal but non-representable rewards (e.g. 0.1) can get rounding residue divided by (0 + eps); oar detects
#: all-equal groups by comparing values and returns exactly 0. With 0/1 rewards the results coincide.
def _presets_from_core() -> dict[str, dict]:
    # One source of truth: the C++ table (oar::core::preset_options), read through the pybind11 module.
    core = _lib.load_extension()
    out = {}
    for name in core.ADVANTAGE_PRESET_NAMES:
        o = core.preset_options(name, "grpo")
        out[name] = {"std": o.std, "eps": o.eps, "singleton": o.singleton}
    return out


ADVANTAGE_PRESETS: dict[str, dict] = _presets_from_core()

ESTIMATORS = ("grpo", "dr_grpo", "batch", "rloo")
TIERS = ("both", "boost", "suppress")


def _offsets_from_ids(group_ids, n: int) -> list[int]:
    """CSR offsets of the runs of equal consecutive ids; raises when an id appears in two separate runs."""
    if isinstance(group_ids, (str, bytes)):
        raise ValueError(f"group_ids must be a sequence with one id per reward, got {type(group_ids).__name__}")
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D (N,), got shape {tuple(group_ids.shape)}")
        if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex:
            raise ValueError(f"group_ids must hold integer ids, got dtype {group_ids.dtype}")
        ids = group_ids.detach().cpu().tolist()
    else:
        ids = list(group_ids)
    if len(ids) != n:
        raise ValueError(f"group_ids must have one id per reward, N = {n}, got {len(ids)}")
    starts = [i for i in range(n) if i == 0 or ids[i] != ids[i - 1]]
    seen: dict = {}
    for s in starts:
        try:
            hash(ids[s])
        except TypeError:
            raise ValueError(f"group_ids must hold hashable ids (ints, strings), got {ids[s]!r} at row {s}") from None
        if ids[s] in seen:
            raise ValueError(
                f"group_ids must keep each group's rows contiguous (the rows of one prompt adjacent, as trainers "
                f"lay them out): id {ids[s]!r} starts runs at rows {seen[ids[s]]} and {s}"
            )
        seen[ids[s]] = s
    return starts + [n]


def _resolve_offsets(rewards: torch.Tensor, offsets, group_ids, group_size) -> torch.Tensor:
    given = [name for name, v in (("offsets", offsets), ("group_ids", group_ids), ("group_size", group_size))
             if v is not None]
    if len(given) != 1:
        raise ValueError(f"pass exactly one of offsets, group_ids, group_size; got {given or 'none'}")
    n = rewards.shape[0]
    if offsets is not None:
        if isinstance(offsets, torch.Tensor):
            off = offsets
        else:
            try:
                # An empty list would default to float32; it is an empty (invalid) offsets array, not a dtype error.
                off = torch.as_tensor(offsets, dtype=torch.int64 if len(offsets) == 0 else None)
            except (TypeError, ValueError, RuntimeError, OverflowError) as e:
                raise ValueError(f"offsets must be a sequence of int64 CSR row starts (G + 1,), got {offsets!r} "
                                 f"({e})") from None
        if off.dtype.is_floating_point or off.dtype.is_complex or off.dtype == torch.bool:
            raise ValueError(f"offsets must be an int64 tensor (G + 1,), got dtype {off.dtype}")
        if off.device.type == "meta" and rewards.device.type != "meta":
            raise ValueError(f"offsets must hold data (rewards are on {rewards.device}), got a meta tensor")
        return off.to(device=rewards.device, dtype=torch.int64)
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        if n % group_size != 0:
            raise ValueError(f"group_size must divide the number of rewards N = {n}, got group_size = {group_size}")
        return torch.arange(0, n + 1, group_size, dtype=torch.int64, device=rewards.device)
    return torch.tensor(_offsets_from_ids(group_ids, n), dtype=torch.int64, device=rewards.device)


def group_advantages(
    rewards: torch.Tensor,
    offsets: torch.Tensor | _Sequence[int] | None = None,
    *,
    group_ids=None,
    group_size: int | None = None,
    estimator: str = "grpo",
    preset: str | None = None,
    std: str | None = None,
    eps: float | None = None,
    singleton: str | None = None,
    skip_nan: bool = False,
) -> torch.Tensor:
    """GRPO-family sequence advantages over ragged groups of responses (method.md section 1).

    For the responses y_1..y_G of one prompt with rewards r_i:

    - ``"grpo"``:    A_i = (r_i - mean_g r) / (std_g r + eps)
    - ``"dr_grpo"``: A_i = r_i - mean_g r                      (Liu et al., arXiv 2503.20783)
    - ``"batch"``:   A_i = (r_i - mean_g r) / (std_batch r + eps)   (TRL ``scale_rewards="batch"``; a
      batch std of 0 or undefined is replaced by 1)
    - ``"rloo"``:    A_i = r_i - mean_{j != i} r_j               (leave-one-out)

    A group whose rewards are all equal gets exactly 0 (checked by comparing values, not by rounding). A
    group of one response gets 0, except with ``singleton="verl"`` (mean 0, std 1: A = r / (1 + eps) for
    grpo, r / (std_batch + eps) for batch, r for dr_grpo and rloo). When every group has a single response
    a ``UserWarning`` says that the baseline is meaningless (the C++ op also warns once on stderr, since
    torch 2.14 does not route C++ warnings of custom ops to Python).

    Groups are given by exactly one of:

    - ``offsets``: CSR row starts (G + 1,) int64, offsets[0] = 0, non-decreasing, offsets[-1] = N; empty
      groups are allowed;
    - ``group_ids``: one id per reward (tensor of integers, or any sequence of hashables such as verl's
      ``uid`` strings); the rows of one group must be contiguous;
    - ``group_size``: G equal groups of ``group_size`` consecutive rows (N divisible by it).

    Args:
        rewards: (N,) real tensor (float16/bfloat16/float32/float64, integer or bool). Statistics run in
            double; non-float64 input is read as float32 first.
        estimator: one of :data:`ESTIMATORS`.
        preset: ``None`` (= ``"default"``), ``"trl"``, ``"verl"``, ``"openrlhf"``: fills ``std``, ``eps`` and
            ``singleton`` from :data:`ADVANTAGE_PRESETS`; explicit ``std``/``eps``/``singleton`` override it.
        std: ``"unbiased"`` (n - 1, every preset) or ``"biased"`` (n).
        eps: denominator guard, finite and >= 0.
        singleton: ``"zero"`` or ``"verl"`` (see above).
        skip_nan: ``False``: a NaN reward raises. ``True``: NaN rows are left out of every statistic and get
            A = 0 (TRL's treatment of unscorable completions). Infinite rewards always raise.

    Returns:
        (N,) float32 advantages on ``rewards.device``. Not differentiable (a constant of the loss).

    Raises:
        ValueError: naming the argument: wrong shape/dtype/device, malformed offsets (not starting at 0,
            decreasing, not ending at N), more or fewer than one of offsets/group_ids/group_size, unknown
            estimator/preset/std/singleton (or not a str), eps < 0 or not a number, skip_nan not a bool, NaN
            (without ``skip_nan``) or infinite rewards, float64 rewards whose group statistics overflow double
            or whose advantages overflow float32.
    """
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor (N,), got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    name = "default" if preset is None else preset
    if not isinstance(name, str) or name not in ADVANTAGE_PRESETS:
        raise ValueError(f"preset must be one of {sorted(ADVANTAGE_PRESETS)} or None, got {preset!r}")
    cfg = dict(ADVANTAGE_PRESETS[name])
    for key, value in (("std", std), ("eps", eps), ("singleton", singleton)):
        if value is not None:
            cfg[key] = value
    off = _resolve_offsets(rewards, offsets, group_ids, group_size)
    out = torch.ops.oar.group_advantages(
        rewards, off, _str_arg("estimator", estimator), _str_arg("std", cfg["std"]), _float_arg("eps", cfg["eps"]),
        _str_arg("singleton", cfg["singleton"]), _bool_arg("skip_nan", skip_nan)
    )
    # The single-response warning reads the data: skip it for meta (shape-only) tensors.
    if cfg["singleton"] != "verl" and off.numel() > 1 and rewards.numel() > 0 and rewards.device.type != "meta":
        valid = ~torch.isnan(rewards) if rewards.is_floating_point() else torch.ones_like(rewards, dtype=torch.bool)
        csum = torch.cat([valid.new_zeros(1, dtype=torch.int64), torch.cumsum(valid, 0)])
        counts = csum[off[1:]] - csum[off[:-1]]
        if bool((counts <= 1).all()) and bool((counts == 1).any()):
            _warnings.warn(
                "oar.group_advantages: every group has a single response, so each reward is its own baseline and "
                "every advantage is 0. Sample several responses per prompt, check offsets/group_ids, or use "
                "singleton='verl'.",
                UserWarning,
                stacklevel=2,
            )
    return out


def normalize_importance(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-rollout min-max normalization of log-importance over the reasoning span (method.md section 5).

    s_t = log1p(I_t); s_hat_t = (s_t - min_R s) / (max_R s - min_R s) on positions where ``mask`` is true
    (R, the reasoning span of the row), with denominator 1 when max == min (so all-equal scores give 0).

    Args:
        scores: (B, T) raw importance I, float16/bfloat16/float32/float64. On masked positions it must be
            finite and >= 0 (values off the mask are ignored).
        mask: (B, T) bool (or 0/1 integer) reasoning mask, on the same device.

    Returns:
        (B, T) float32 in [0, 1]; 0 off the mask; rows with an empty mask are all 0. Not differentiable.

    Raises:
        ValueError: wrong shape/dtype/device (naming ``scores`` or ``mask``), NaN/Inf/negative score on the
            mask (naming ``scores[b, t]`` and its value).
    """
    return torch.ops.oar.normalize_importance(scores, mask)


def reshape_advantages(
    advantages: torch.Tensor,
    scores: torch.Tensor,
    reasoning_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    q: float = 0.25,
    beta: float = 1.0,
    floor: float = 0.1,
    tiers: str = "both",
    scores_are_normalized: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bi-level (dual-tier) sum-preserving reshaping of sequence advantages into token advantages.

    Source: method.md sections 5-6. Per row, over the reasoning span R (L = |R| tokens) with normalized
    scores s_hat (:func:`normalize_importance`, unless ``scores_are_normalized``):

    - tau = quantile_q(s_hat over R), linear interpolation (numpy's default);
    - s_hat < tau:  w = max(s_hat / (tau + 1e-8), floor)              (suppress tier);
    - s_hat >= tau: w = 1 + beta * (s_hat - tau) / (1 - tau + 1e-8)  (boost tier);
    - ``tiers="boost"`` sets w = 1 below tau, ``tiers="suppress"`` sets w = 1 at or above tau;
    - mass preservation: w <- w * L / sum_R w, so the span keeps its total weight L;
    - w = 1 on response tokens outside R, w = 0 where ``response_mask`` is false (padding);
    - token_advantages = w * advantages[:, None] (same weights whatever the sign of A).

    Hence sum_t token_advantages[b] = response_mask[b].sum() * advantages[b] (up to float rounding), w >= 0,
    all-equal scores give w = 1 on the response (plain GRPO), and rows with A = 0 stay 0.

    Args:
        advantages: (B,) sequence advantages, float16/bfloat16/float32/float64 (read as float32), finite.
        scores: (B, T) raw importance (finite, >= 0 on ``reasoning_mask``), or normalized scores in [0, 1]
            when ``scores_are_normalized=True``. float16/bfloat16/float32/float64.
        reasoning_mask: (B, T) bool (or 0/1 integer): the span R; must be a subset of ``response_mask``.
        response_mask: (B, T) bool (or 0/1 integer): tokens that carry the loss.
        q: quantile level of tau, in (0, 1). beta: boost strength, >= 0. floor: suppression floor w_min, in
            [0, 1). tiers: one of :data:`TIERS`.
        scores_are_normalized: skip :func:`normalize_importance`.

    Returns:
        ``(token_advantages, weights)``, both (B, T) float32 on ``scores.device``. Not differentiable.

    Raises:
        ValueError: naming the argument: wrong shapes/dtypes/devices, q outside (0, 1), beta < 0, floor
            outside [0, 1), unknown tiers, NaN/Inf/negative scores on the span (or outside [0, 1] when
            normalized), non-finite advantages (or float64 ones beyond float32 range), reasoning_mask not a
            subset of response_mask, a beta so large that the boost weights overflow float32, token advantages
            (weight x advantage) that overflow float32.
    """
    return torch.ops.oar.reshape_advantages(
        advantages, scores, reasoning_mask, response_mask, _float_arg("q", q), _float_arg("beta", beta),
        _float_arg("floor", floor), _str_arg("tiers", tiers), _bool_arg("scores_are_normalized", scores_are_normalized),
    )


# Fake (meta) kernels: shapes and dtypes only, for torch.compile / torch.export and opcheck.
@torch.library.register_fake("oar::group_advantages")
def _group_advantages_fake(rewards, offsets, estimator="grpo", std="unbiased", eps=1e-6, singleton="zero",
                           skip_nan=False):
    torch._check(rewards.dim() == 1, lambda: f"rewards must be 1-D (N,), got {rewards.dim()}-D")
    torch._check(offsets.dim() == 1, lambda: f"offsets must be 1-D (G + 1,), got {offsets.dim()}-D")
    _same_device("rewards", rewards, offsets=offsets)
    return rewards.new_empty(rewards.shape, dtype=torch.float32)


@torch.library.register_fake("oar::normalize_importance")
def _normalize_importance_fake(scores, mask):
    torch._check(scores.dim() == 2, lambda: f"scores must be 2-D (B, T), got {scores.dim()}-D")
    _same_device("scores", scores, mask=mask)
    return scores.new_empty(scores.shape, dtype=torch.float32)


@torch.library.register_fake("oar::reshape_advantages")
def _reshape_advantages_fake(advantages, scores, reasoning_mask, response_mask, q=0.25, beta=1.0, floor=0.1,
                             tiers="both", scores_are_normalized=False):
    torch._check(scores.dim() == 2, lambda: f"scores must be 2-D (B, T), got {scores.dim()}-D")
    _same_device("scores", scores, advantages=advantages, reasoning_mask=reasoning_mask, response_mask=response_mask)
    return (scores.new_empty(scores.shape, dtype=torch.float32), scores.new_empty(scores.shape, dtype=torch.float32))

# ==== end section: advantages ===========================================================================

# ==== section: probe (probe divergence + autograd, grad x input, masked batch) =========================

PROBES = ("last", "answer_mean", "answer_joint")


def probe_divergence(
    clean_logits: torch.Tensor,
    perturbed_logits: torch.Tensor,
    *,
    probe: str = "answer_mean",
    answer_ids: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Divergence of the outcome probe between clean and perturbed logits (method.md section 2).

    One fused pass over the vocabulary per row (online log-sum-exp, no (N, S, V) log-probability
    tensor is materialized), accumulation in float32/float64 whatever the input dtype.

    Probes, for row n with probe positions s < L = lengths[n]:

    - ``"last"``: KL(softmax(clean[n, 0]) || softmax(perturbed[n, 0])) (position 0 is the one that
      predicts the first answer token; ``lengths`` only validated).
    - ``"answer_mean"`` (AS-MEAN, the paper's best probe): KL of the softmax of the *mean logits*
      over s < L (mean of logits, not of probabilities).
    - ``"answer_joint"``: phi_clean - phi_perturbed with phi = mean_{s<L} log_softmax(Z[n, s])[answer_ids[n, s]]
      (the drop of the mean per-token answer log-likelihood). Not clamped here: OAR-P clamps at 0
      (``.clamp_min(0)``), OAR-G differentiates the raw drop (method.md sections 3-4).

    KL is forward KL(p_clean || p_perturbed), clamped at 0 against rounding; -inf logits (zero
    probability) are allowed.

    Args:
        clean_logits: (N, S, V) float32/float16/bfloat16. Any strides on N and S, e.g.
            ``clean.expand(N, S, V)`` of a single (1, S, V) clean row; the vocabulary dimension is
            made contiguous if it is not.
        perturbed_logits: (N, S, V), same dtype and device as ``clean_logits``.
        probe: ``"last"``, ``"answer_mean"`` or ``"answer_joint"``.
        answer_ids: (N, S) int64 reference-answer token ids, required for ``"answer_joint"``
            (ids at s < lengths[n] must lie in [0, V); later entries are padding, never read);
            ignored by the other probes.
        lengths: optional (N,) int64, number of probe positions used per row, each in [1, S]
            (default: all S).

    Returns:
        (N,) float32.

    Autograd: differentiable w.r.t. ``perturbed_logits`` (OAR-G, method.md section 4), through
    ``torch.ops.oar.probe_divergence_backward``. ``clean_logits`` is treated as a constant (p_clean is
    computed without grad in OAR-G): it never receives a gradient, even if it requires one. The
    gradient is of the unclamped value. Double backward is not supported (differentiating the gradient
    raises NotImplementedError).

    Raises:
        ValueError: bad shapes, mismatched dtypes/devices, unknown ``probe``, ``answer_ids`` missing
            for ``"answer_joint"``, ids or lengths out of range, or a row whose result would be NaN
            (NaN/+inf logits, or a probed position without any finite logit). Messages name the
            argument, the expected and the actual value.
    """
    return torch.ops.oar.probe_divergence(clean_logits, perturbed_logits, answer_ids, lengths, _str_arg("probe", probe))


def grad_x_input(grad: torch.Tensor, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (torch naming)
    """OAR-G token scores I = |sum_h grad[b, l, h] * input[b, l, h]| (method.md section 4).

    Args:
        grad: (B, L, H) dJ/dE, the gradient of the probe divergence w.r.t. the input embeddings.
        input: (B, L, H) the input embeddings E, same dtype and device as ``grad``
            (float32, float64, float16 or bfloat16; non-contiguous inputs are copied).

    Returns:
        (B, L) float32, >= 0, the products accumulated in float32 (float64 for float64 input).
        Restricting to reasoning positions is the caller's job (e.g. the reasoning mask passed to
        :func:`reshape_advantages`).

    Not differentiable (scores are detached by construction).

    Raises:
        ValueError: ``input`` not 3-D, ``grad`` of another shape or dtype, unsupported dtype,
            device mismatch, a non-finite result (NaN/Inf in ``grad`` or ``input``, or a product sum beyond
            float32 range; CPU kernel).
    """
    return torch.ops.oar.grad_x_input(grad, input)


def build_masked_batch(
    input_ids: torch.Tensor, row_index: torch.Tensor, positions: torch.Tensor, pad_id: int
) -> torch.Tensor:
    """The OAR-P batch of single-token PAD substitutions (method.md section 3).

    ``out[m] = input_ids[row_index[m]]`` with ``out[m, positions[m]] = pad_id``: a substitution, so the
    sequence keeps its length and the position stays attended (pair it with the row's unchanged
    attention mask).

    Args:
        input_ids: (B, T) int64 probe contexts.
        row_index: (M,) int64, which context each variant copies, in [0, B).
        positions: (M,) int64, the position replaced in each variant, in [0, T).
        pad_id: the replacement token id (the tokenizer's PAD id).

    Returns:
        (M, T) int64.

    Raises:
        ValueError: wrong dims/dtypes, ``positions`` not shaped like ``row_index``, a row or position
            out of range (the message names the offending entry), device mismatch, ``pad_id`` not an int
            or outside int64.
    """
    return torch.ops.oar.build_masked_batch(input_ids, row_index, positions, _int_arg("pad_id", pad_id))


def _probe_setup_context(ctx, inputs, output):
    clean_logits, perturbed_logits, answer_ids, lengths, probe = inputs
    ctx.save_for_backward(clean_logits, perturbed_logits, answer_ids, lengths)
    ctx.probe = probe


def _probe_backward(ctx, grad_out):
    clean_logits, perturbed_logits, answer_ids, lengths = ctx.saved_tensors
    grad_perturbed = None
    if ctx.needs_input_grad[1]:
        grad_perturbed = torch.ops.oar.probe_divergence_backward(
            grad_out, clean_logits, perturbed_logits, answer_ids, lengths, ctx.probe
        )
    # clean_logits: no gradient by design (treated as a detached constant, see probe_divergence).
    return None, grad_perturbed, None, None, None


torch.library.register_autograd(
    "oar::probe_divergence", _probe_backward, setup_context=_probe_setup_context
)


def _probe_double_backward(ctx, grad):
    raise NotImplementedError(
        "oar.probe_divergence: double backward (differentiating the gradient, e.g. after "
        "torch.autograd.grad(..., create_graph=True)) is not supported"
    )


# Without an autograd kernel, create_graph=True would run the backward op through PyTorch's "autograd not
# implemented" fallback (a warning, then a gradient silently disconnected from the graph).
torch.library.register_autograd(
    "oar::probe_divergence_backward", _probe_double_backward, setup_context=lambda ctx, inputs, output: None
)


def _fake_check_logits(clean_logits: torch.Tensor, perturbed_logits: torch.Tensor, **others) -> None:
    # Shape and device errors surface at trace time under torch.compile, as in eager mode.
    _same_device("perturbed_logits", perturbed_logits, clean_logits=clean_logits, **others)
    if perturbed_logits.dim() != 3:
        raise ValueError(
            f"perturbed_logits must be 3-D (N, S, V), got shape {tuple(perturbed_logits.shape)}"
        )
    if clean_logits.shape != perturbed_logits.shape:
        raise ValueError(
            f"clean_logits must be (N, S, V) like perturbed_logits = {tuple(perturbed_logits.shape)}, "
            f"got {tuple(clean_logits.shape)}"
        )


@torch.library.register_fake("oar::probe_divergence")
def _probe_divergence_fake(clean_logits, perturbed_logits, answer_ids=None, lengths=None, probe="answer_mean"):
    _fake_check_logits(clean_logits, perturbed_logits, answer_ids=answer_ids, lengths=lengths)
    return perturbed_logits.new_empty((perturbed_logits.shape[0],), dtype=torch.float32)


@torch.library.register_fake("oar::probe_divergence_backward")
def _probe_divergence_backward_fake(grad_out, clean_logits, perturbed_logits, answer_ids, lengths, probe):
    _fake_check_logits(clean_logits, perturbed_logits, grad_out=grad_out, answer_ids=answer_ids, lengths=lengths)
    return perturbed_logits.new_empty(perturbed_logits.shape)


@torch.library.register_fake("oar::grad_x_input")
def _grad_x_input_fake(grad, input):  # noqa: A002
    if input.dim() != 3:
        raise ValueError(f"input must be 3-D (B, L, H), got shape {tuple(input.shape)}")
    _same_device("input", input, grad=grad)
    return input.new_empty(input.shape[:2], dtype=torch.float32)


@torch.library.register_fake("oar::build_masked_batch")
def _build_masked_batch_fake(input_ids, row_index, positions, pad_id):
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D (B, T), got shape {tuple(input_ids.shape)}")
    _same_device("input_ids", input_ids, row_index=row_index, positions=positions)
    return input_ids.new_empty((row_index.shape[0], input_ids.shape[1]))


# ==== end section: probe ================================================================================

# ==== section: CUDA validation (data checks of the CUDA kernels; src/torch/cuda_checks.h) ===============
# The CUDA kernels validate data (NaN rewards, out-of-range ids, ...) on the device and record errors in a
# per-device record instead of synchronizing. Step-level ops (group_advantages, normalize_importance,
# reshape_advantages) always read it back; the hot-path ops (probe_divergence + backward, grad_x_input,
# build_masked_batch) only in "eager" mode; in "lazy" mode (the default) their errors surface at the next
# check on that device (docs/design.md, "CUDA kernels").

import ctypes as _ctypes

_CUDA_CHECK_MODES = ("lazy", "eager")


_CUDA_LIB: dict = {}


def _cuda_checks_lib():
    """The loaded op library as a ctypes handle with the C entry points, or None (built without CUDA)."""
    path = _lib.loaded_ops_library()
    if path is None:
        return None
    if path not in _CUDA_LIB:
        _CUDA_LIB[path] = _load_cuda_checks(path)
    return _CUDA_LIB[path]


def _load_cuda_checks(path: str):
    try:
        lib = _ctypes.CDLL(path)
        lib.oar_cuda_set_checks.argtypes = [_ctypes.c_int]
        lib.oar_cuda_get_checks.argtypes = [_ctypes.c_char_p, _ctypes.c_int]
        lib.oar_cuda_take_error.argtypes = [_ctypes.c_int, _ctypes.c_char_p, _ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return lib


def set_cuda_checks(mode: str) -> str:
    """Sets when the hot-path CUDA ops read their device error record back (process-wide).

    Args:
        mode: ``"lazy"`` (default; no host synchronization: a bad row gets NaN, or an all-PAD variant, and
            the error is raised by the next step-level op or :func:`check_cuda_errors` on that device) or
            ``"eager"`` (every call waits for its kernels and raises the CPU's exact ``ValueError``). The
            environment variable ``OAR_CUDA_CHECKS`` sets the initial mode.

    Returns:
        The previous mode. In a build without CUDA kernels the call only validates ``mode`` and returns
        ``"lazy"``.

    Raises:
        ValueError: ``mode`` is not ``"lazy"`` or ``"eager"``.
    """
    if not isinstance(mode, str) or mode not in _CUDA_CHECK_MODES:
        raise ValueError(f"mode must be one of {_CUDA_CHECK_MODES}, got {mode!r}")
    lib = _cuda_checks_lib()
    if lib is None:
        return "lazy"
    prev = lib.oar_cuda_set_checks(_CUDA_CHECK_MODES.index(mode))
    return _CUDA_CHECK_MODES[prev] if prev in (0, 1) else "lazy"


def cuda_checks() -> str:
    """The current CUDA check mode, ``"lazy"`` or ``"eager"`` (see :func:`set_cuda_checks`).

    Raises:
        ValueError: ``OAR_CUDA_CHECKS`` holds another value (and no mode was set explicitly).
    """
    lib = _cuda_checks_lib()
    if lib is None:
        return "lazy"
    buf = _ctypes.create_string_buffer(1024)
    m = lib.oar_cuda_get_checks(buf, len(buf))
    if m < 0:
        raise ValueError(buf.value.decode(errors="replace"))
    return _CUDA_CHECK_MODES[m]


def check_cuda_errors(device=None) -> None:
    """Raises the data error that an oar CUDA op recorded on ``device`` and nobody raised yet.

    Waits for the work queued on the device's current stream (one 64-byte copy). Call it where a lazily
    checked op's result is consumed, e.g. once per attribution batch.

    Args:
        device: a CUDA device (``torch.device``, ``"cuda:1"`` or an index); default: the current device.
            A no-op when CUDA was never initialized in this process or the build has no CUDA kernels.

    Raises:
        ValueError: the recorded error (op, what was wrong, first index and value); or ``device`` is not a
            CUDA device.
    """
    if device is None:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        index = torch.cuda.current_device()
    else:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device!r}")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    if not torch.cuda.is_initialized():
        return
    lib = _cuda_checks_lib()
    if lib is None:
        return
    buf = _ctypes.create_string_buffer(4096)
    status = lib.oar_cuda_take_error(int(index), buf, len(buf))
    if status != 0:
        raise ValueError(buf.value.decode(errors="replace"))


__all__ += ["set_cuda_checks", "cuda_checks", "check_cuda_errors"]

# ==== end section: CUDA validation ======================================================================
