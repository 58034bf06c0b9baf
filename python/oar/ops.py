"""Documented wrappers of the ``torch.ops.oar.*`` operators, with fake kernels for torch.compile.

Every op is implemented in C++ (``src/torch``, torch-free core in ``src/core``) and registered with the
PyTorch dispatcher; these wrappers add docstrings, argument coercion, preset handling and autograd where it
is defined, and nothing else: the groups and trainer presets of :func:`group_advantages` live in
:mod:`oar.groups`, the CUDA check switch in :mod:`oar.cuda_checks` (re-exported here: :func:`set_cuda_checks`,
:func:`cuda_checks`, :func:`check_cuda_errors`). Plain-PyTorch references of every op live in
:mod:`oar.reference`. Every wrapper traces into one graph under ``torch.compile(fullgraph=True)``.
Errors: bad shapes/dtypes/values raise ``ValueError`` whose message names the argument, the expected and
the actual value; device mismatches raise ``ValueError`` too.
"""

from __future__ import annotations

import warnings as _warnings
from collections.abc import Sequence as _Sequence

import torch

from oar import _args, _lib
from oar.cuda_checks import check_cuda_errors, cuda_checks, set_cuda_checks
from oar.groups import ADVANTAGE_PRESETS, resolve_groups
from oar.schema import ESTIMATORS, PROBES, TIERS  # noqa: F401  (the names the docstrings refer to)

_lib.load_ops_library()

__all__ = [
    "group_advantages",
    "normalize_importance",
    "reshape_advantages",
    "probe_divergence",
    "grad_x_input",
    "build_masked_batch",
    "ADVANTAGE_PRESETS",
    # Re-exported from oar.cuda_checks (documented here first; the switch is process state, not an op).
    "set_cuda_checks",
    "cuda_checks",
    "check_cuda_errors",
]

def _same_device(ref_name: str, ref: torch.Tensor, **others) -> None:
    # Fake (meta) kernels: the real kernels refuse mixed devices, and a fake kernel that allocated on the
    # first argument's device would hand back uninitialized real memory for e.g. (meta, cpu) inputs.
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")


# ==== section: advantages (group advantages, normalization, reshaping) ================================
# These ops have no autograd: advantages and weights are constants of the policy-gradient loss. The C++
# side registers a fallthrough on the Autograd key, so outputs never require grad (src/torch/cpu_advantages.cpp).



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
    torch 2.14 does not route C++ warnings of custom ops to Python). The warning reads the rewards (a host
    sync), so it is not emitted inside ``torch.compile`` (``torch.compiler.is_compiling()``); the stderr
    warning of the op still is.

    On CUDA the op always reads its input checks back (a 64-byte copy and a wait on the current stream), so it
    cannot be captured in a CUDA graph (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``): it
    raises RuntimeError under capture; call it outside the captured region (docs/design.md, "CUDA ops and CUDA
    graphs").

    Groups are given by exactly one of:

    - ``offsets``: CSR row starts (G + 1,) int64, offsets[0] = 0, non-decreasing, offsets[-1] = N; empty
      groups are allowed;
    - ``group_ids``: one id per reward (tensor of integers on any device, or any sequence of hashables such
      as verl's ``uid`` strings), in any row order (interleaved groups, or rows reordered by verl's
      ``balance_batch``): rows are grouped by id with a stable permutation, and the advantages come back in
      the caller's row order. Error messages name the caller's rows (``rewards[k]``); groups are numbered in
      the order of their first row. Not traceable by ``torch.compile`` (the groups depend on the ids' values):
      compiled code passes ``offsets`` or ``group_size``;
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
    groups = resolve_groups(rewards, offsets, group_ids, group_size)
    off = groups.offsets
    args = (_args.str_arg("estimator", estimator), _args.str_arg("std", cfg["std"]), _args.float_arg("eps", cfg["eps"]),
            _args.str_arg("singleton", cfg["singleton"]), _args.bool_arg("skip_nan", skip_nan))
    if groups.order is None:
        out = torch.ops.oar.group_advantages(rewards, off, *args)
    else:
        rewards = groups.gather(rewards)
        try:
            out = groups.scatter(torch.ops.oar.group_advantages(rewards, off, *args))
        except ValueError as e:
            raise groups.caller_rows(e) from None
    # The single-response warning reads the data: skip it for meta (shape-only) tensors, and under torch.compile
    # (a host sync would break the graph).
    if (cfg["singleton"] != "verl" and off.numel() > 1 and rewards.numel() > 0 and rewards.device.type != "meta"
            and not torch.compiler.is_compiling()):
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

    On CUDA the op always reads its input checks back (a 64-byte copy and a wait on the current stream), so it
    cannot be captured in a CUDA graph (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``): it
    raises RuntimeError under capture; call it outside the captured region (docs/design.md, "CUDA ops and CUDA
    graphs").

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

    On CUDA the op always reads its input checks back (a 64-byte copy and a wait on the current stream), so it
    cannot be captured in a CUDA graph (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``): it
    raises RuntimeError under capture; call it outside the captured region (docs/design.md, "CUDA ops and CUDA
    graphs").

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
        advantages, scores, reasoning_mask, response_mask, _args.float_arg("q", q), _args.float_arg("beta", beta),
        _args.float_arg("floor", floor), _args.str_arg("tiers", tiers),
        _args.bool_arg("scores_are_normalized", scores_are_normalized),
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
    probability) are allowed. A finite clean logit has positive probability however far below the clean
    maximum it lies (-1e4 or ``finfo.min`` included), so a perturbed -inf facing it gives +inf, on every
    device.

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
    return torch.ops.oar.probe_divergence(clean_logits, perturbed_logits, answer_ids, lengths,
                                          _args.str_arg("probe", probe))


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
    return torch.ops.oar.build_masked_batch(input_ids, row_index, positions, _args.int_arg("pad_id", pad_id))


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
