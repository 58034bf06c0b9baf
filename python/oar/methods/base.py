"""What a credit-assignment method is to the pipeline: a :class:`MethodSpec` row (what it needs, how its credit
enters the advantages) and, for the methods that score tokens, a scorer built once per :class:`oar.pipeline.Pipeline`
(so that its state, e.g. screened OAR-P's time budget, lives with the method). docs/architecture.md, "Adding a method".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["MethodSpec", "Step", "METHOD_TABLE"]

#: what each input a method may need is, for the message of :meth:`MethodSpec.require`
_INPUTS = {"model": "the policy", "prompt_ids": "the prompts the policy is run on", "tokenizer": "the policy's tokenizer",
           "answers": "the reference answer of each row", "group_ids": "the group of each row"}


@dataclass
class Step:
    """One pipeline call, as a method sees it.

    Attributes:
        b: the validated batch (:class:`oar.batch.Batch`, CPU).
        adv: (B,) float32 CPU sequence advantages.
        active: the rows scored (caller's indexing): rows with A != 0, or every row for ``scores_all_rows`` methods.
        config: the pipeline's ``oar.OARConfig``.
        generator: the pipeline's CPU generator (random baseline, OAR-G noise); advances from call to call.
        memory_budget_mb: activation budget (MiB) of one engine chunk (the config's, capped by the adapter).
        ignore_ids: token ids KTAE scores 0.
        outside_seconds: wall time between the end of the previous call and the start of this one (the trainer's
            GRPO step: generation, update, its own work), None on the first call.
        model_pass: ``model_pass()`` is a context manager yielding the policy as a ProbeModel (behind the forward
            gate across ranks, then ``gate`` is set); raises ValueError naming the method when ``model`` is None.
        model: the policy as the caller passed it (None when not given).
        stats: engine counters the method adds to (``forward_passes``, ``screen_fraction``, ...).
        gate: the :class:`oar.distributed.ForwardGate` of ``model_pass`` when ranks are kept in step, else None.
        spans: the masking units of the scored rows (config ``mask_unit`` or the batch's ``span_starts``;
            docs/method.md section 11) as {row: [(j0, j1), ...]} reasoning-index ranges, None for token units. A
            scorer that masks spans itself (``masks_spans = True``, OAR-P) reads them; the pipeline applies the
            unit rule (:func:`oar.attribution.spans.span_sums`) to every other scorer's token scores.
    """

    b: object
    adv: torch.Tensor
    active: list
    config: object
    generator: torch.Generator
    memory_budget_mb: int
    ignore_ids: tuple
    outside_seconds: float | None
    model_pass: Callable
    model: object = None
    stats: dict = field(default_factory=dict)
    gate: object = None
    spans: dict | None = None


@dataclass(frozen=True)
class MethodSpec:
    """One credit-assignment method: a row of :data:`oar.methods.METHOD_TABLE`.

    Attributes:
        name: the method's name in ``OARConfig.method`` (:data:`oar.schema.METHODS`).
        credit: ``"uniform"`` (every eligible token gets A), ``"reshape"`` (A x sum-preserving weights from
            importance scores, method.md sections 5-6) or ``"add"`` (A + a per-token bonus, method.md section 8).
        needs_model: runs the policy (unless the batch carries its scores / entropies already).
        needs_tokenizer: reads the reasoning span (decodes completions) or builds probe contexts.
        needs_answers: builds the outcome probe from the reference answers.
        needs_groups: reads the groups (KTAE's per-prompt token tables).
        scores_all_rows: scores every row, also rows with A = 0 (KTAE's tables count every rollout).
        scorer: ``scorer(config) -> object`` built once per pipeline. For ``"reshape"``: ``.score(step, pm, pbatch,
            positions) -> oar.attribution.Attribution`` on probe contexts, and optionally ``.precomputed(step) ->
            (B, C) float32 scores on completion tokens or None`` (the trainer's own entropies: no forward). For
            ``"add"``: ``.bonus(step) -> (token advantages (B, C) float32, scores (B, C), scored mask (B, C) bool)``.
    """

    name: str
    credit: str
    needs_model: bool = False
    needs_tokenizer: bool = False
    needs_answers: bool = False
    needs_groups: bool = False
    scores_all_rows: bool = False
    scorer: Callable | None = None

    def needs(self, name: str) -> bool:
        """Whether the method needs input ``name`` (``"model"``, ``"prompt_ids"`` (with the model),
        ``"tokenizer"``, ``"answers"``, ``"group_ids"``)."""
        return {"model": self.needs_model, "prompt_ids": self.needs_model, "tokenizer": self.needs_tokenizer,
                "answers": self.needs_answers, "group_ids": self.needs_groups}[name]

    def require(self, name: str, value, what: str | None = None):
        """``value`` when it is not None or the method does not need input ``name``; else ValueError naming the
        method, the input (and ``what`` it is needed for, when given) and the methods that need it."""
        if value is None and self.needs(name):
            users = ", ".join(s.name for s in METHOD_TABLE.values() if s.needs(name))
            why = _INPUTS[name] + (f"; {what}" if what else "")
            raise ValueError(f"method {self.name!r} needs {name} ({why}) (methods that need it: {users})")
        return value


#: name -> :class:`MethodSpec`: the pipeline's dispatch; its rows are listed in ``oar/methods/__init__.py``.
METHOD_TABLE: dict[str, MethodSpec] = {}
