"""One method pipeline: a :class:`RolloutBatch` in, per-token advantages out (method.md sections 1-8).

Every method of :data:`METHODS` is one row of :data:`METHOD_TABLE` (what it needs, whether it reshapes the
sequence advantage or adds a bonus to it, how it scores tokens), and :class:`Pipeline` runs any of them the
same way. Everything that knows a trainer is a thin adapter to and from a :class:`RolloutBatch`:
:func:`oar.token_advantages`, :class:`oar.hook.TokenAdvantageHook` and ``oar.integrations.{trl,verl,openrlhf}``.

- :meth:`Pipeline.compute`: token advantages (B, C), with weights, scores and diagnostics.
- :meth:`Pipeline.scores`: the importance scores and reasoning mask only, for trainers that reshape elsewhere.
- :func:`compute`, :func:`scores`: the same through one cached :class:`Pipeline` per (tokenizer, config), so
  that the random draws (random baseline, OAR-G noise) advance from call to call as in a trainer.

Rows are always named in the caller's indexing (row ``i`` of the batch passed in), also when rows with a zero
sequence advantage are skipped or groups are regrouped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch

from oar import _args, ops
from oar._lib import load_extension
from oar.groups import resolve_groups
from oar.schema import OARConfig

_log = logging.getLogger("oar")

_C = load_extension()

#: Every selectable credit-assignment method (the C++ schema's names, ``oar::core::method_names()``).
METHODS: tuple[str, ...] = tuple(_C.METHOD_NAMES)

__all__ = [
    "METHODS", "METHOD_TABLE", "MethodSpec", "sequence_advantages", "method_spec", "with_method", "RolloutBatch", "TokenAdvantages",
    "TokenScores", "Pipeline", "pipeline_for", "group_ids_from",
]


# ==== the method table ====================================================================================


@dataclass(frozen=True)
class MethodSpec:
    """What one credit-assignment method needs and how it assigns credit.

    Attributes:
        name: the method's name in ``OARConfig.method``.
        credit: ``"uniform"`` (every eligible token gets A), ``"reshape"`` (A x sum-preserving weights from
            importance scores, method.md sections 5-6) or ``"add"`` (A + a per-token bonus, method.md section 8).
        needs_model: runs the policy (unless the batch carries its scores / entropies already).
        needs_tokenizer: reads the reasoning span (decodes completions) or builds probe contexts.
        needs_answers: builds the outcome probe from the reference answers.
        needs_groups: reads the groups (KTAE's per-prompt token tables).
        scorer: the engine behind the scores, for documentation (``oar.attribution`` function name).
    """

    name: str
    credit: str
    needs_model: bool = False
    needs_tokenizer: bool = False
    needs_answers: bool = False
    needs_groups: bool = False
    scorer: str = ""

    def needs(self, name: str) -> bool:
        """Whether the method needs input ``name`` (``"model"``, ``"prompt_ids"`` (with the model),
        ``"tokenizer"``, ``"answers"``, ``"groups"``)."""
        return {"model": self.needs_model, "prompt_ids": self.needs_model, "tokenizer": self.needs_tokenizer,
                "answers": self.needs_answers, "groups": self.needs_groups}[name]

    def check_inputs(self, **inputs) -> None:
        """Raises ValueError naming the first input of ``inputs`` (name=value) that the method needs and that is
        None, and the methods that need it."""
        for name, value in inputs.items():
            if value is None and self.needs(name):
                users = ", ".join(s.name for s in METHOD_TABLE.values() if s.needs(name))
                raise ValueError(f"method {self.name!r} needs {name} (methods that need it: {users})")


METHOD_TABLE: dict[str, MethodSpec] = {s.name: s for s in (
    MethodSpec("grpo", "uniform"),
    MethodSpec("dr_grpo", "uniform"),  # the estimator (no std scaling) is set by the config schema
    MethodSpec("random", "reshape", needs_tokenizer=True, scorer="random_scores"),
    MethodSpec("entropy", "reshape", needs_model=True, needs_tokenizer=True, scorer="entropy_scores"),
    MethodSpec("entropy_shaping", "add", needs_model=True, scorer="policy_entropies"),
    MethodSpec("ktae", "add", needs_groups=True, scorer="ktae_token_scores"),
    MethodSpec("oar_p", "reshape", needs_model=True, needs_tokenizer=True, needs_answers=True, scorer="oar_p_scores"),
    MethodSpec("oar_g", "reshape", needs_model=True, needs_tokenizer=True, needs_answers=True, scorer="oar_g_scores"),
)}
if set(METHOD_TABLE) != set(METHODS):  # pragma: no cover - a schema change without a table row
    raise ImportError(f"oar.pipeline: METHOD_TABLE {sorted(METHOD_TABLE)} differs from the C++ schema {sorted(METHODS)}")


def method_spec(method: str) -> MethodSpec:
    """The :class:`MethodSpec` of ``method``. Raises ValueError naming the known methods."""
    spec = METHOD_TABLE.get(method) if isinstance(method, str) else None
    if spec is None:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    return spec


def with_method(config, method: str):
    """A copy of ``config`` (``oar.OARConfig``) whose method is ``method``, every other key kept. The schema's
    one rule between keys applies: ``dr_grpo`` implies the ``dr_grpo`` estimator, so switching to it sets the
    estimator and switching away from it restores ``grpo``."""

    method_spec(method)
    obj = json.loads(config.to_json())
    if obj.get("method") == "dr_grpo" and method != "dr_grpo" and obj.get("estimator") == "dr_grpo":
        obj["estimator"] = "grpo"
    obj["method"] = method
    if method == "dr_grpo":
        obj["estimator"] = "dr_grpo"
    return OARConfig(**obj)


# ==== inputs and outputs ==================================================================================


@dataclass
class RolloutBatch:
    """One generation batch of B rollouts, in the caller's row order (what every trainer adapter builds).

    Attributes:
        completion_ids: (B, C) integer, right-padded completion (response) token ids.
        completion_mask: (B, C) bool or 0/1, True on completion tokens.
        prompt_ids: B unpadded prompts (lists or 1-D integer tensors); needed when the policy is run.
        eligible_mask: (B, C) bool or 0/1, the tokens that carry the loss, a subset of ``completion_mask``
            (default: ``completion_mask``; e.g. ``completion_mask * tool_mask``). Nothing outside it is masked,
            perturbed or scored, and its token advantages are 0.
        rewards: (B,) real rewards; NaN marks an unscorable rollout (see ``skip_nan``; a failure for KTAE).
        group_ids: B group ids (one per row, hashable: ints, strings such as verl's ``uid``), rows of a group in
            any order. Needed to compute sequence advantages from rewards and by KTAE.
        answers: B reference answers (str); needed by ``oar_p`` / ``oar_g``.
        sequence_advantages: (B,) real, finite: the trainer's own sequence advantages (else computed from
            ``rewards`` and ``group_ids`` with the config's estimator).
        entropy: optional (B, C) policy entropies (nats) at completion tokens, already computed by the trainer
            (methods ``entropy`` and ``entropy_shaping`` then run no forward).
        scores, reasoning_mask: optional (B, C) importance scores (>= 0 on the mask) and bool reasoning mask
            computed elsewhere (e.g. on the trainer's workers); the reshaping methods then run no scorer.
    """

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    prompt_ids: Sequence | None = None
    eligible_mask: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    group_ids: Sequence | torch.Tensor | None = None
    answers: Sequence[str] | None = None
    sequence_advantages: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    reasoning_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.completion_ids.shape[0])


@dataclass
class TokenAdvantages:
    """Per-token advantages of one batch (output of :meth:`Pipeline.compute`).

    Attributes:
        advantages: (B, C) float32 per-token advantages, 0 off the eligible mask.
        weights: (B, C) float32 reshaping weights (1 outside the reasoning span, 0 off the eligible mask); for the
            additive methods A_t / A on rows with A != 0 (a diagnostic view).
        scores: (B, C) float32 raw importance scores on scored tokens (entropies for entropy shaping, KTAE token
            scores for KTAE), 0 elsewhere.
        reasoning_mask: (B, C) bool, the tokens that were scored.
        metrics: scalars (``oar/ess_ratio``, ``oar/top10_mass``, ``oar/reasoning_frac``, ``oar/skipped_rows_frac``,
            ``oar/skipped_groups_frac`` when the groups are known, ``oar/forward_passes``,
            ``oar/padding_forwards``, ``oar/attribution_seconds``).
        sequence_advantages: (B,) float32 sequence advantages the token advantages were built from.
    """

    advantages: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor
    reasoning_mask: torch.Tensor
    metrics: dict = field(default_factory=dict)
    sequence_advantages: torch.Tensor | None = None


@dataclass
class TokenScores:
    """Importance scores of one batch (output of :meth:`Pipeline.scores`).

    Attributes:
        scores: (B, C) float32, >= 0 and finite on ``reasoning_mask``, 0 elsewhere.
        reasoning_mask: (B, C) bool, the scored reasoning tokens (eligible tokens of rows with A != 0 only).
        stats: engine counters (``forward_passes``, ``padding_forwards``, ...).
    """

    scores: torch.Tensor
    reasoning_mask: torch.Tensor
    stats: dict = field(default_factory=dict)


# ==== groups ==============================================================================================


def group_ids_from(n: int, *, offsets=None, group_ids=None, group_size=None) -> list | None:
    """One group id per row from exactly one of ``offsets`` (CSR (G + 1,)), ``group_ids`` (N ids, any row order)
    or ``group_size`` (equal consecutive groups), validated as :func:`oar.ops.group_advantages` does; None when none
    is given.

    Raises:
        ValueError: naming the argument (as :func:`oar.groups.resolve_groups`), offsets that do not run
            non-decreasing from 0 to N.
    """
    if offsets is None and group_ids is None and group_size is None:
        return None
    g = resolve_groups(torch.zeros(n), offsets, group_ids, group_size)
    if group_ids is not None:
        return group_ids.detach().cpu().tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    off = g.offsets.cpu().tolist()
    if not off or off[0] != 0 or off[-1] != n or any(b < a for a, b in zip(off, off[1:])):
        raise ValueError(f"offsets must be non-decreasing CSR row starts from 0 to N = {n}, got {off}")
    ids = [0] * n
    for k, (a, b) in enumerate(zip(off, off[1:])):
        ids[a:b] = [k] * (b - a)
    return ids


# ==== checks (messages name the RolloutBatch field and the caller's row) ====================================


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _tensor(name: str, t, shape: tuple) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        dims = "(B,)" if len(shape) == 1 else "(B, C)"
        raise ValueError(f"{name} must be a {dims} = {shape} tensor, got {_shape(t)}")
    if t.device.type == "meta":
        raise ValueError(f"{name} must hold data, got a tensor on the meta device")
    return t


def _mask(name: str, t, shape: tuple) -> torch.Tensor:
    t = _tensor(name, t, shape)
    if t.dtype.is_complex or (t.dtype != torch.bool and not bool(((t == 0) | (t == 1)).all())):
        raise ValueError(f"{name} must be a bool or 0/1 mask, got dtype {t.dtype} with other values")
    return t.detach().bool().cpu()


def _real(name: str, t, shape: tuple) -> torch.Tensor:
    t = _tensor(name, t, shape)
    if t.dtype.is_complex:
        raise ValueError(f"{name} must be real, got dtype {t.dtype}")
    return t


def _check_token_ids(cids: torch.Tensor, cmask: torch.Tensor, prompt_ids: Sequence, rows: list[int],
                     vocab: int) -> list[torch.Tensor]:
    """Completion tokens under the mask and the prompts of ``rows`` must be ids in [0, vocab) (vocab 0: only >= 0
    is checked); returns the B prompts as 1-D int64 CPU tensors (unchecked rows as given, converted)."""
    hi = vocab if vocab > 0 else None
    sel = cids[rows][cmask[rows]]
    if sel.numel() and (int(sel.min()) < 0 or (hi is not None and int(sel.max()) >= hi)):
        bad = int(sel.min()) if int(sel.min()) < 0 else int(sel.max())
        r, c = torch.nonzero((cids == bad) & cmask)[0].tolist()
        raise ValueError(f"completion_ids must be token ids in [0, {hi or 'inf'}), got {bad} at [{r}, {c}]")
    out = []
    check = set(rows)
    for i, p in enumerate(prompt_ids):
        if isinstance(p, torch.Tensor):
            p = p.detach().cpu()
            if p.dim() != 1 or p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
                raise ValueError(f"prompt_ids[{i}] must be a 1-D integer tensor of token ids, got shape "
                                 f"{tuple(p.shape)} and dtype {p.dtype}")
            p = p.long()
        else:
            vals = list(p)
            for j, x in enumerate(vals):
                if isinstance(x, (bool, float)) or not hasattr(x, "__index__"):
                    raise ValueError(f"prompt_ids[{i}] must hold integer token ids, got {x!r} at position {j}")
            p = torch.tensor([int(x) for x in vals], dtype=torch.long)
        if i in check and p.numel():
            bad = (p < 0) | (p >= hi) if hi is not None else p < 0
            if bool(bad.any()):
                j = int(torch.nonzero(bad)[0])
                raise ValueError(f"prompt_ids[{i}] must be token ids in [0, {hi or 'inf'}), got {int(p[j])} at "
                                 f"position {j}")
        out.append(p)
    return out


@dataclass
class _Batch:
    """A validated :class:`RolloutBatch` on the CPU (internal)."""

    B: int
    C: int
    cids: torch.Tensor
    cmask: torch.Tensor
    eligible: torch.Tensor
    prompt_ids: Sequence | None
    rewards: torch.Tensor | None
    group_ids: list | None
    answers: list | None
    entropy: torch.Tensor | None
    scores: torch.Tensor | None
    reasoning: torch.Tensor | None
    out_device: torch.device


def _validate(batch: RolloutBatch) -> _Batch:
    if not isinstance(batch, RolloutBatch):
        raise ValueError(f"batch must be an oar.pipeline.RolloutBatch, got {type(batch).__name__}")
    cids = batch.completion_ids
    if not isinstance(cids, torch.Tensor) or cids.dim() != 2:
        raise ValueError(f"completion_ids must be a (B, C) tensor, got {_shape(cids)}")
    if cids.dtype.is_floating_point or cids.dtype.is_complex or cids.dtype == torch.bool:
        raise ValueError(f"completion_ids must be an integer tensor of token ids, got dtype {cids.dtype}")
    if cids.device.type == "meta":
        raise ValueError("completion_ids must hold data, got a tensor on the meta device")
    B, C = (int(x) for x in cids.shape)
    cmask = _mask("completion_mask", batch.completion_mask, (B, C))
    eligible = cmask if batch.eligible_mask is None else _mask("eligible_mask", batch.eligible_mask, (B, C))
    outside = eligible & ~cmask
    if bool(outside.any()):
        r, c = torch.nonzero(outside)[0].tolist()
        raise ValueError(f"eligible_mask must be a subset of completion_mask, got True at [{r}, {c}] where "
                         "completion_mask is False")
    rewards = None
    if batch.rewards is not None:
        rewards = _real("rewards", batch.rewards, (B,)).detach()
    for name, seq in (("prompt_ids", batch.prompt_ids), ("answers", batch.answers)):
        if seq is not None and (isinstance(seq, (str, bytes)) or len(seq) != B):
            raise ValueError(f"{name} must have B = {B} entries (one per row), got "
                             f"{type(seq).__name__ if isinstance(seq, (str, bytes)) else len(seq)}")
    groups = None if batch.group_ids is None else group_ids_from(B, group_ids=batch.group_ids)
    entropy = None
    if batch.entropy is not None:
        entropy = _real("entropy", batch.entropy, (B, C)).detach().float().cpu()
    scores = reasoning = None
    if (batch.scores is None) != (batch.reasoning_mask is None):
        raise ValueError("scores and reasoning_mask must be given together (both (B, C)) or not at all")
    if batch.scores is not None:
        scores = _real("scores", batch.scores, (B, C)).detach().float().cpu()
        reasoning = _mask("reasoning_mask", batch.reasoning_mask, (B, C))
        bad = reasoning & eligible & ~(torch.isfinite(scores) & (scores >= 0))
        if bool(bad.any()):
            r, c = torch.nonzero(bad)[0].tolist()
            raise ValueError(f"scores must be finite and >= 0 on reasoning_mask, got scores[{r}, {c}] = "
                             f"{float(scores[r, c])}")
    dev = (batch.sequence_advantages.device if isinstance(batch.sequence_advantages, torch.Tensor)
           else rewards.device if rewards is not None else cids.device)
    return _Batch(B, C, cids.detach().cpu(), cmask, eligible, batch.prompt_ids, rewards, groups,
                  None if batch.answers is None else list(batch.answers), entropy, scores, reasoning, dev)


def _nan_reward_error(rewards: torch.Tensor, groups: list, skip_hint: bool = True) -> ValueError:
    i = int(torch.nonzero(torch.isnan(rewards))[0])
    g = groups[i]
    members = [k for k, x in enumerate(groups) if x == g]
    hint = ("; set skip_nan=True (OARConfig) to leave unscorable rollouts out of the group statistics with A = 0"
            if skip_hint else "")
    return ValueError(f"rewards[{i}] is NaN (group {g!r}, rows {members[:8]}{'...' if len(members) > 8 else ''})"
                      f"{hint}")


def _sequence_advantages(b: _Batch, batch: RolloutBatch, config, preset: str | None) -> torch.Tensor:
    """(B,) float32 CPU sequence advantages: the batch's own, or computed from rewards and groups."""
    if batch.sequence_advantages is not None:
        raw = _real("sequence_advantages", batch.sequence_advantages, (b.B,)).detach().cpu()
        if not bool(torch.isfinite(raw).all()):
            rows = torch.nonzero(~torch.isfinite(raw)).flatten().tolist()
            raise ValueError(f"sequence_advantages must be finite; got NaN/Inf at rows {rows[:8]}")
        adv = raw.float()
        if not bool(torch.isfinite(adv).all()):  # finite float64 beyond float32 range
            rows = torch.nonzero(~torch.isfinite(adv)).flatten().tolist()
            raise ValueError(f"sequence_advantages must fit in float32 (|A| <= 3.4e38); got larger values at rows "
                             f"{rows[:8]}")
        return adv
    if b.rewards is None or b.group_ids is None:
        raise ValueError("the batch needs sequence_advantages, or rewards and group_ids to compute them")
    return sequence_advantages(b.rewards.cpu(), config, group_ids=b.group_ids, preset=preset)


def sequence_advantages(rewards: torch.Tensor, config=None, *, offsets=None, group_ids=None,
                        group_size: int | None = None, preset: str | None = None) -> torch.Tensor:
    """(N,) float32 group advantages with the estimator and conventions of ``config`` (method.md section 1).

    Args:
        rewards: (N,) real rewards (NaN only with ``config.advantages.skip_nan``).
        config: ``oar.OARConfig``: ``advantages.estimator`` (``dr_grpo`` for method ``dr_grpo``), ``std``, ``eps``,
            ``singleton``, ``skip_nan``.
        offsets / group_ids / group_size: the groups, exactly one (``group_ids`` in any row order).
        preset: ``"trl"``, ``"verl"``, ``"openrlhf"`` or ``"default"``: decides std, eps and singleton as
            :func:`oar.ops.group_advantages` does, instead of the config's.

    Returns:
        (N,) float32 on ``rewards.device``, in the caller's row order.

    Raises:
        ValueError: as :func:`oar.ops.group_advantages`; a NaN reward without ``skip_nan`` names its group.
    """

    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-D (N,) tensor, got {got}")
    a = (config if config is not None else OARConfig()).advantages
    if rewards.is_floating_point() and not a.skip_nan and rewards.device.type != "meta" and bool(rewards.isnan().any()):
        groups = group_ids_from(rewards.shape[0], offsets=offsets, group_ids=group_ids, group_size=group_size)
        raise _nan_reward_error(rewards.detach().cpu(), groups)
    kw = dict(estimator=a.estimator, skip_nan=a.skip_nan)
    kw.update(dict(preset=preset) if preset is not None else dict(std=a.std, eps=a.eps, singleton=a.singleton))
    return ops.group_advantages(rewards, offsets, group_ids=group_ids, group_size=group_size, **kw)


# ==== the pipeline ==========================================================================================


@dataclass
class _Run:
    """One call's state, handed to the scorers (internal)."""

    b: _Batch
    adv: torch.Tensor
    active: list[int]
    model: object
    stats: dict = field(default_factory=dict)
    gate: object = None


class Pipeline:
    """Runs one credit-assignment method on rollout batches (method.md sections 1-8).

    Args:
        config: ``oar.OARConfig`` (default: OAR-G, answer_mean probe, q = 0.25, beta = 1, floor = 0.1).
        tokenizer: the policy's Hugging Face tokenizer: needed by the methods whose :class:`MethodSpec` says
            ``needs_tokenizer`` (reasoning span, probe contexts); KTAE uses its EOS / PAD ids as ``ignore_ids``.
        markers: final-answer markers that end the reasoning span.
        pad_id: PAD id of OAR-P's masked variants (default: the tokenizer's pad, then eos).
        sync_forwards: keep the policy forwards in step across ranks (:class:`oar.distributed.ForwardGate`;
            required under ZeRO-3 / FSDP); None = whenever torch.distributed runs with more than one process.
        ignore_ids: token ids KTAE scores 0 (default: the tokenizer's EOS and PAD ids, none without tokenizer).

    Raises:
        ValueError: ``config`` not an ``oar.OARConfig``; a tokenizer without pad and eos ids.
    """

    def __init__(self, config=None, tokenizer=None, *, markers: Sequence[str] | None = None, pad_id: int | None = None,
                 sync_forwards: bool | None = None, ignore_ids: Sequence[int] | None = None):
        from oar.attribution import DEFAULT_MARKERS, ProbeContextBuilder

        if config is not None and not isinstance(config, OARConfig):
            raise ValueError(f"config must be an oar.OARConfig or None, got {type(config).__name__}")
        self.config = config if config is not None else OARConfig()
        self.method = method_spec(self.config.method)
        self.tokenizer = tokenizer
        self.sync_forwards = sync_forwards
        self.builder = None
        if tokenizer is not None:
            self.builder = ProbeContextBuilder(tokenizer, self.config.conclude, self.config.answer_suffix,
                                               pad_id=pad_id, markers=markers if markers is not None else DEFAULT_MARKERS)
        self._pad_id = self.builder.pad_id if self.builder is not None else int(pad_id or 0)
        if ignore_ids is None:
            ignore_ids = self.builder.stop_ids if self.builder is not None else ()
        self.ignore_ids = tuple(_args.int_arg("ignore_ids[i]", x) for x in ignore_ids)
        self._generator = torch.Generator().manual_seed(int(self.config.seed))
        self.calls = 0
        # screen_budget's measurements (screened OAR-P): the last GRPO step's wall time outside this pipeline, the
        # exact pass's seconds per token, and when the previous call ended
        self._grpo_step_s: float | None = None
        self._exact_s_per_token: float | None = None
        self._warned_screen = False  # the window screen fell back to OAR-G (warned once)
        self._last_end: float | None = None
        #: cap (MiB) on the config's ``memory_budget_mb``, set by a trainer adapter from what the trainer already
        #: budgets per forward (None: the config's budget); see :attr:`memory_budget_mb`.
        self.memory_budget_cap_mb: int | None = None

    @property
    def memory_budget_mb(self) -> int:
        """Activation budget (MiB) of one OAR-P / OAR-G / entropy chunk: the config's ``memory_budget_mb``, capped
        by :attr:`memory_budget_cap_mb` when an adapter set one (docs/trainers/*.md)."""
        budget = int(self.config.memory_budget_mb)
        cap = self.memory_budget_cap_mb
        return budget if cap is None else max(1, min(budget, int(cap)))

    @property
    def pad_id(self) -> int:
        """PAD id of OAR-P's masked variants and of the ForwardGate's dummy forwards."""
        return self._pad_id

    # ---- public entries ------------------------------------------------------------------------------------

    def compute(self, batch: RolloutBatch, model=None, *, preset: str | None = None) -> TokenAdvantages:
        """Token advantages of ``batch`` with this pipeline's method.

        Args:
            batch: the rollouts (:class:`RolloutBatch`).
            model: the policy (Hugging Face causal LM or an :class:`oar.attribution.ProbeModel`) for the methods
                that run it; parameter ``.grad`` is never written.
            preset: trainer convention of the group statistics when the advantages are computed from rewards
                (``"trl"``, ``"verl"``, ``"openrlhf"``; default: the config's ``std``/``eps``/``singleton``).

        Returns:
            :class:`TokenAdvantages` on the device of the batch's sequence advantages (else rewards, else
            completion ids). Reshaping methods keep each row's mass: ``advantages[b].sum() ==
            sequence_advantages[b] * eligible_mask[b].sum()`` up to float rounding.

        Raises:
            ValueError: a malformed batch (naming the field and the caller's row), a NaN reward without
                ``skip_nan`` (naming its group), a missing input of the method (naming it), token ids outside
                the model's vocabulary.
        """
        t0 = self._call_started()
        b = _validate(batch)
        adv = _sequence_advantages(b, batch, self.config, preset)
        credit = self.method.credit
        if credit == "uniform":
            run = _Run(b, adv, [i for i in range(b.B) if float(adv[i]) != 0.0], model)
            tok = adv[:, None] * b.eligible
            weights = b.eligible.float()
            sc, reasoning = torch.zeros((b.B, b.C)), torch.zeros((b.B, b.C), dtype=torch.bool)
        elif credit == "reshape":
            run = _Run(b, adv, [i for i in range(b.B) if float(adv[i]) != 0.0], model)
            sc, reasoning = self._scores(run)
            r = self.config.reshape
            tok, weights = ops.reshape_advantages(adv, sc, reasoning, b.eligible, q=r.q, beta=r.beta, floor=r.floor,
                                                  tiers=r.tiers)
        else:
            run, tok, sc, reasoning = self._additive(b, adv, model)
            safe = torch.where(adv != 0, adv, torch.ones_like(adv)).double()
            ratio = torch.where((adv != 0)[:, None], tok.double() / safe[:, None], torch.ones_like(tok, dtype=torch.float64))
            weights = torch.where(b.eligible, ratio, torch.zeros((), dtype=torch.float64)).float()
        self.calls += 1
        metrics = _metrics(tok, weights, b.eligible, reasoning, run, adv, b.group_ids, t0)
        self._last_end = time.perf_counter()
        dev = b.out_device
        return TokenAdvantages(tok.to(dev), weights.to(dev), sc.to(dev), reasoning.to(dev), metrics, adv.to(dev))

    def scores(self, batch: RolloutBatch, model=None, *, preset: str | None = None) -> TokenScores:
        """Importance scores only (no reshaping), for trainers that fold advantages elsewhere.

        Rows whose sequence advantage is 0 are not scored (their token advantages are 0 whatever the scores).
        For ``grpo`` / ``dr_grpo`` the scores are all 0 and the reasoning mask empty; for the additive methods
        the scores are the bonus's inputs (entropies, KTAE token scores) on the eligible tokens.

        Returns:
            :class:`TokenScores` on the same device as :meth:`compute`'s outputs.

        Raises:
            ValueError: as :meth:`compute`.
        """
        self._call_started()
        b = _validate(batch)
        adv = _sequence_advantages(b, batch, self.config, preset)
        if self.method.credit == "reshape":
            run = _Run(b, adv, [i for i in range(b.B) if float(adv[i]) != 0.0], model)
            sc, reasoning = self._scores(run)
        elif self.method.credit == "add":
            run, _, sc, reasoning = self._additive(b, adv, model)
        else:
            run = _Run(b, adv, [], model)
            sc, reasoning = torch.zeros((b.B, b.C)), torch.zeros((b.B, b.C), dtype=torch.bool)
        self._last_end = time.perf_counter()
        dev = b.out_device
        return TokenScores(sc.to(dev), reasoning.to(dev), dict(run.stats))

    def reasoning_lengths(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                          rows: Sequence[int] | None = None) -> list[int]:
        """L_i of each completion row (right-padded completions, mask True on real tokens): the number of
        leading completion tokens before the final-answer marker (method.md section 2). With ``rows``, only those
        rows are decoded and the others get 0."""
        from oar.attribution import reasoning_length

        b = self._need_builder("reasoning_lengths")
        cmask = completion_mask.detach().bool().cpu()
        cids = completion_ids.detach().cpu()
        want = range(cids.shape[0]) if rows is None else set(rows)
        return [reasoning_length(cids[i][cmask[i]].tolist(), self.tokenizer, b.markers, b.stop_ids) if i in want
                else 0 for i in range(cids.shape[0])]

    # ---- internals -----------------------------------------------------------------------------------------

    def _call_started(self) -> float:
        """Start of a call; the wall time since the previous call ended is the last GRPO step (screen_budget)."""
        t0 = time.perf_counter()
        if self._last_end is not None:
            self._grpo_step_s = t0 - self._last_end
        return t0

    def _need_builder(self, what: str):
        if self.builder is None:
            raise ValueError(f"method {self.method.name!r} needs the policy's tokenizer for {what} (methods that "
                             f"need it: {', '.join(s.name for s in METHOD_TABLE.values() if s.needs_tokenizer)})")
        return self.builder

    def _policy(self, run: _Run):
        """The model as a ProbeModel, behind a ForwardGate when ranks must stay in step; raises without one."""
        from oar.attribution import as_probe_model
        from oar.distributed import ForwardGate, distributed_world

        if run.model is None:
            raise ValueError(f"method {self.method.name!r} needs model (the policy) (methods that need it: "
                             f"{', '.join(s.name for s in METHOD_TABLE.values() if s.needs_model)})")
        pm = as_probe_model(run.model)
        if self.sync_forwards or (self.sync_forwards is None and distributed_world()):
            run.gate = ForwardGate(pm, pad_id=self._pad_id)
            return run.gate
        return pm

    @contextlib.contextmanager
    def _model_pass(self, run: _Run):
        """Yields the policy (or None when the method needs none here); finishes the ForwardGate afterwards, on
        every rank, also with no rows to score (a collective)."""
        pm = self._policy(run)
        ctx = pm.eval_mode()  # a required ProbeModel member (as_probe_model checked the model)
        try:
            with ctx:
                yield pm
        finally:
            if run.gate is not None:
                run.gate.finish()
                run.stats["padding_forwards"] = sum(run.gate.dummy_calls.values())

    def _scores(self, run: _Run) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores (B, C) and reasoning mask (B, C) of a reshaping method: the batch's own, or the scorer's on the
        eligible reasoning tokens of the active rows (rows named in the caller's indexing)."""
        b = run.b
        if b.scores is not None:
            reasoning = b.reasoning & b.eligible
            return torch.where(reasoning, b.scores, torch.zeros(())), reasoning
        name = self.method.name
        if name == "entropy" and b.entropy is not None:  # the trainer's own entropies: no forward
            reasoning = self._reasoning_mask(b, run.active)
            return torch.where(reasoning, b.entropy, torch.zeros(())), reasoning
        builder = self._need_builder("the reasoning span and probe contexts")
        if self.method.needs_answers and b.answers is None:
            raise ValueError(f"method {name!r} needs answers (the reference answer of each row)")
        if self.method.needs_model and b.prompt_ids is None:
            raise ValueError(f"method {name!r} needs prompt_ids (the prompts the policy is run on)")
        sc = torch.zeros((b.B, b.C), dtype=torch.float32)
        reasoning = torch.zeros((b.B, b.C), dtype=torch.bool)
        pm_ctx = self._model_pass(run) if self.method.needs_model else contextlib.nullcontext(None)
        with pm_ctx as pm:
            if not run.active:
                return sc, reasoning
            vocab = int(pm.vocab_size) if pm is not None else 0
            prompts = (_check_token_ids(b.cids, b.cmask, b.prompt_ids, run.active, vocab) if b.prompt_ids is not None
                       else [torch.zeros(0, dtype=torch.long)] * b.B)
            pbatch, cols = self._probe_batch(b, run.active, prompts, builder)
            positions = self._eligible_positions(b, run.active, cols, pbatch)
            att = self._run_scorer(run, pm, pbatch, positions)
        run.stats.update({k: v for k, v in att.stats.items() if k != "padding_forwards"})
        for i in run.active:
            L = int(pbatch.reasoning_len[i])
            sc[i, cols[i][:L]] = att.scores[i, :L]
            reasoning[i, cols[i][:L]] = True
        reasoning &= b.eligible
        return torch.where(reasoning, sc, torch.zeros(())), reasoning

    def _run_scorer(self, run: _Run, pm, pbatch, positions):
        from oar.attribution import entropy_scores, oar_g_scores, oar_p_scores, random_scores

        cfg, name = self.config, self.method.name
        if name == "oar_p":
            kw = dict(probe=cfg.probe, memory_budget_mb=self.memory_budget_mb,
                      max_variants_per_chunk=cfg.max_variants_per_chunk)
            if cfg.screen_fraction < 1:
                return self._screened_oar_p(run, pm, pbatch, positions, kw)
            return oar_p_scores(pm, pbatch, rows=run.active, positions=positions, **kw)
        if name == "oar_g":
            return oar_g_scores(pm, pbatch, probe=cfg.probe, rows=run.active, sigma=cfg.sigma,
                                noise_draws=cfg.noise_draws, generator=self._generator,
                                memory_budget_mb=self.memory_budget_mb, positions=positions)
        if name == "entropy":
            return entropy_scores(pm, pbatch, rows=run.active)
        if name == "random":
            return random_scores(pbatch, rows=run.active, generator=self._generator)
        raise AssertionError(f"no scorer for method {name!r}")  # pragma: no cover - METHOD_TABLE is checked

    def _screened_oar_p(self, run: _Run, pm, pbatch, positions, kw):
        """Screened OAR-P (config ``screen_fraction`` < 1; docs/design.md "Screened OAR-P"): the screen (config
        ``screen``: windowed OAR-P with ``screen_window``, or OAR-G with the config's sigma, noise draws and this
        pipeline's generator), then exact masking of the selection. A model without the prefix-cache capability
        (sliding-window or recurrent layers) cannot run the window screen: OAR-G screens instead (warned once)."""
        from oar.attribution import oar_g_scores, oar_p_window_scores, probe_capabilities
        from oar.attribution.screened import oar_p_screened_scores

        cfg = self.config
        if cfg.screen not in ("window", "oar_g"):
            raise ValueError(f"config screen must be 'window' or 'oar_g', got {cfg.screen!r}")
        kind = cfg.screen
        if kind == "window" and not probe_capabilities(pm).prefix_cache:
            if not self._warned_screen:
                _log.warning("screen 'window' needs a model with the prefix-cache capability; %s has none: "
                             "screening with OAR-G", type(pm).__name__)
                self._warned_screen = True
            kind = "oar_g"
        t0 = time.perf_counter()
        if kind == "window":
            screen = oar_p_window_scores(pm, pbatch, window=int(cfg.screen_window), probe=cfg.probe,
                                         rows=run.active, positions=positions, memory_budget_mb=self.memory_budget_mb,
                                         keep_clean_pass=True)
        else:
            screen = oar_g_scores(pm, pbatch, probe=cfg.probe, rows=run.active, sigma=cfg.sigma,
                                  noise_draws=cfg.noise_draws, generator=self._generator,
                                  memory_budget_mb=self.memory_budget_mb, positions=positions)
        screen_s = time.perf_counter() - t0
        fraction = self._screen_fraction(pbatch, run.active, positions, screen_s, screen.clean_pass is None)
        att = oar_p_screened_scores(pm, pbatch, screen, fraction=fraction, sample_fraction=cfg.screen_sample,
                                    rows=run.active, generator=self._generator, positions=positions, **kw)
        screen.clean_pass = None  # the cache is no longer needed
        if att.stats.get("tokens"):  # seconds per token the exact pass ran: the time budget's cost model
            self._exact_s_per_token = float(att.stats["seconds"]) / float(att.stats["tokens"])
        att.stats.update(forward_passes=int(screen.stats.get("forward_passes", 0)) + int(att.stats["forward_passes"]),
                         screen_fraction=fraction, screen_seconds=screen_s)
        return att

    def _screen_fraction(self, pbatch, active: list[int], positions, screen_s: float,
                         clean_pass: bool = True) -> float:
        """The screened share of this call: ``screen_fraction``, cut (never raised) by ``screen_budget`` once a
        previous call measured both the GRPO step (the wall time between the end of one call and the start of the
        next: generation + update + the trainer's own work) and the exact pass's seconds per token. The exact pass
        of a masked reasoning token j costs the tokens from j to the end of its probe context (the prefix engine
        re-runs that suffix); the largest fraction whose cost, with the random sample's expected cost, fits in
        ``(screen_budget - 1) x GRPO step - screen seconds`` (less the exact pass's clean pass over every context,
        ``clean_pass``: False when the window screen hands over its own)
        is taken (0: the sample alone)."""
        from oar.attribution.screened import budget_fraction

        cfg = self.config
        f_max = float(cfg.screen_fraction)
        step_s, per_tok = self._grpo_step_s, self._exact_s_per_token
        if not cfg.screen_budget or step_s is None or per_tok is None or per_tok <= 0:
            return f_max
        budget_tokens = ((float(cfg.screen_budget) - 1.0) * step_s - screen_s) / per_tok
        if clean_pass:  # the exact pass's own clean pass (none when the window screen hands over its own)
            budget_tokens -= sum(int(pbatch.context_len[r]) for r in active)
        T = int(pbatch.input_ids.shape[1])
        costs = []  # per row: the suffix cost (tokens) of each candidate (left-padded: every context ends at T)
        for r in active:
            cand = range(int(pbatch.reasoning_len[r])) if positions is None else positions.get(r, ())
            costs.append([T - int(pbatch.reasoning_start[r]) - j for j in cand])
        return budget_fraction(costs, f_max, float(cfg.screen_sample), budget_tokens)

    def _probe_batch(self, b: _Batch, active: list[int], prompts: list[torch.Tensor], builder):
        """Probe contexts of all B rows (rows not scored get a stub: empty prompt and response, so that engine
        row r is the caller's row r) and each row's completion columns (reasoning token j = column cols[i][j])."""
        cols = [torch.nonzero(b.cmask[i]).flatten() for i in range(b.B)]
        responses = [b.cids[i][b.cmask[i]] for i in range(b.B)]
        lens = self.reasoning_lengths(b.cids, b.cmask, active)  # decode the scored rows only
        on = set(active)
        answers = b.answers if b.answers is not None else ["0"] * b.B  # random / entropy never read the answer
        ps, rs, ans, ls = [], [], [], []
        for i in range(b.B):
            if i in on:
                ps.append(prompts[i]), rs.append(responses[i]), ans.append(str(answers[i])), ls.append(lens[i])
            else:
                ps.append([]), rs.append([]), ans.append("0"), ls.append(0)
        return builder.build(ps, rs, ans, ls), cols

    @staticmethod
    def _eligible_positions(b: _Batch, active: list[int], cols, pbatch) -> dict | None:
        """{row: eligible reasoning indices} when some reasoning token is not eligible (tool outputs), else None:
        the engines then never mask, perturb or score the others."""
        out, restricted = {}, False
        for i in active:
            L = int(pbatch.reasoning_len[i])
            ok = b.eligible[i, cols[i][:L]]
            restricted |= not bool(ok.all())
            out[i] = torch.nonzero(ok).flatten().tolist()
        return out if restricted else None

    def _reasoning_mask(self, b: _Batch, active: list[int]) -> torch.Tensor:
        lens = self.reasoning_lengths(b.cids, b.cmask, active)
        reasoning = torch.zeros((b.B, b.C), dtype=torch.bool)
        for i in active:
            reasoning[i, torch.nonzero(b.cmask[i]).flatten()[: lens[i]]] = True
        return reasoning & b.eligible

    def _additive(self, b: _Batch, adv: torch.Tensor, model):
        """Entropy shaping and KTAE (method.md section 8): A_t = A + bonus_t, no reshaping. Returns (run, token
        advantages, scores, scored-token mask)."""
        from oar import baselines
        from oar.attribution import policy_entropies

        name = self.method.name
        if name == "entropy_shaping":
            run = _Run(b, adv, [i for i in range(b.B) if float(adv[i]) != 0.0], model)
            if b.entropy is not None:
                H = b.entropy
            else:
                if b.prompt_ids is None or model is None:
                    raise ValueError("method 'entropy_shaping' needs the policy entropies: the batch's entropy (B, C), "
                                     "or model and prompt_ids to compute them")
                rows = b.cmask & torch.tensor([i in set(run.active) for i in range(b.B)], dtype=torch.bool)[:, None]
                with self._model_pass(run) as pm:
                    vocab = int(pm.vocab_size)
                    prompts = _check_token_ids(b.cids, b.cmask, b.prompt_ids, run.active, vocab)
                    H = policy_entropies(pm, prompts, b.cids, rows, memory_budget_mb=self.memory_budget_mb)
                run.stats["forward_passes"] = (run.gate.real_calls[1] if run.gate is not None
                                               else int(bool(run.active)))
            sc = torch.where(b.eligible, H, torch.zeros(()))
            es = self.config.entropy_shaping
            tok = baselines.entropy_shaping_advantages(adv, sc, b.eligible, alpha=es.alpha, kappa=es.kappa)
            return run, tok, sc, b.eligible.clone()
        # ktae: needs whole groups; correctness from rewards (NaN = unscorable = wrong), else from A > 0
        run = _Run(b, adv, list(range(b.B)), model)
        if b.group_ids is None:
            raise ValueError("method 'ktae' needs group_ids (the group of each row): its token tables are built per "
                             "prompt")
        kt = self.config.ktae
        if b.rewards is None:
            r, threshold = adv.double(), 0.0  # [decided] correct = A > 0 (method.md section 8)
        else:
            r = torch.nan_to_num(b.rewards.cpu().double(), nan=float("-inf")).clamp_min(-3e38)
            threshold = kt.threshold
        sc = baselines.ktae_token_scores(b.cids, b.eligible, r, group_ids=b.group_ids, alpha=kt.alpha, beta=kt.beta,
                                         tf=kt.tf, scale=kt.scale, threshold=threshold, ignore_ids=self.ignore_ids)
        tok = ((adv.double()[:, None] + sc.double()) * b.eligible).float()
        return run, tok, sc, b.eligible.clone()


def _metrics(tok, weights, eligible, reasoning, run: _Run, adv, groups, t0) -> dict:
    """The diagnostics of method.md section 9, one definition for every method and adapter."""
    from oar.metrics import ess_ratio, top_mass

    B = tok.shape[0]
    rows = [i for i in run.active if bool(eligible[i].any())]
    idx = torch.tensor(rows, dtype=torch.long)
    w = weights.abs()
    out = {
        "oar/ess_ratio": float(ess_ratio(w[idx], eligible[idx]).mean()) if rows else 1.0,
        "oar/top10_mass": float(top_mass(tok[idx], w[idx], eligible[idx], 0.1).mean()) if rows else 0.1,
        "oar/reasoning_frac": float(reasoning.sum() / eligible.sum().clamp_min(1)),
        "oar/skipped_rows_frac": 1.0 - len(run.active) / max(B, 1),
    }
    if groups is not None and B:
        g = resolve_groups(adv, group_ids=groups)
        a, off = g.gather(adv), g.offsets.tolist()
        spans = [(int(x), int(y)) for x, y in zip(off, off[1:]) if y > x]
        out["oar/skipped_groups_frac"] = sum(bool((a[x:y] == 0).all()) for x, y in spans) / max(len(spans), 1)
    if "screen_fraction" in run.stats:  # screened OAR-P: the share taken from the screen, the share masked
        out["oar/screen_fraction"] = float(run.stats["screen_fraction"])
        out["oar/masked_frac"] = run.stats["masked"] / max(run.stats["scored_tokens"], 1)
    out["oar/forward_passes"] = float(run.stats.get("forward_passes", 0))
    out["oar/padding_forwards"] = float(run.stats.get("padding_forwards", 0))
    out["oar/attribution_seconds"] = time.perf_counter() - t0
    return out


# ==== cached pipelines ======================================================================================

# One pipeline per (tokenizer, config): its random generator (random baseline, OAR-G noise) then advances from
# call to call as in a trainer, instead of replaying the same draws every step.
_PIPELINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_NO_TOKENIZER: dict = {}


def pipeline_for(config=None, tokenizer=None) -> Pipeline:
    """The cached :class:`Pipeline` of (``tokenizer``, ``config``) (a new one when the tokenizer cannot be
    weakly referenced). Raises ValueError as :class:`Pipeline`."""

    if config is not None and not isinstance(config, OARConfig):
        raise ValueError(f"config must be an oar.OARConfig or None, got {type(config).__name__} "
                         "(build one with oar.OARConfig(method=..., ...))")
    cfg = config if config is not None else OARConfig()
    key = cfg.to_json()
    if tokenizer is None:
        per = _NO_TOKENIZER
    else:
        try:
            per = _PIPELINES.setdefault(tokenizer, {})
        except TypeError:
            return Pipeline(cfg, tokenizer)
    if key not in per:
        per[key] = Pipeline(cfg, tokenizer)
    return per[key]

