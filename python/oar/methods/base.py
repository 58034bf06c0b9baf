"""What a credit-assignment method is to the pipeline: a :class:`MethodSpec` row (what it needs, how its credit
enters the advantages) and, for the methods that score tokens, a scorer built once per :class:`oar.pipeline.Pipeline`
(so that its state, e.g. screened OAR-P's time budget, lives with the method). docs/architecture.md, "Adding a method".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from oar.attribution.turns import reshape_turns

__all__ = ["Credit", "UNIFORM", "RESHAPE", "ADD", "TokenScorer", "BonusScorer", "MethodSpec", "Step", "METHOD_TABLE"]

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
        turns: {row: [(turn columns, weight), ...]} of the rows scored turn by turn (several turns, ``turn_probe:
            answer``; docs/method.md section 13), set by the scoring pass; None when no row has two turns. The
            reshaping credit reshapes each such turn on its own with sequence advantage ``A x weight``.
        scores_only: the call returns scores only (:meth:`oar.pipeline.Pipeline.scores`, e.g. on a trainer's
            workers): turn weights the caller computes itself (``turn_credit: rewards``) are not required.
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
    turns: dict | None = None
    scores_only: bool = False


class TokenScorer:
    """The scorer of a :data:`RESHAPE` method (built once per pipeline: ``Scorer(config)``): importance scores of
    the reasoning tokens, which the pipeline normalizes and reshapes (method.md sections 5-6).

    Attributes:
        masks_spans: True when :meth:`score` masks the step's masking units itself (``step.spans``; OAR-P); else the
            pipeline sums the token scores over each unit (the unit rule, docs/method.md section 11).
    """

    masks_spans: bool = False

    def __init__(self, config):
        self.config = config

    def precomputed(self, step: "Step") -> torch.Tensor | None:
        """(B, C) float32 scores on completion tokens that need no forward (e.g. the trainer's own entropies), or
        None (the default): the pipeline then builds probe contexts and calls :meth:`score`."""
        return None

    def score(self, step: "Step", pm, pbatch, positions):
        """Scores of the active rows: ``pm`` the policy as a ProbeModel (None for a method without
        ``needs_model``), ``pbatch`` their :class:`oar.attribution.ProbeBatch`, ``positions`` {row: eligible
        reasoning indices} or None (all). Returns an :class:`oar.attribution.Attribution`."""
        raise NotImplementedError


class BonusScorer:
    """The scorer of an :data:`ADD` method (built once per pipeline: ``Scorer(config)``): a per-token bonus added to
    the sequence advantage (method.md section 8)."""

    def __init__(self, config):
        self.config = config

    def bonus(self, step: "Step") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token advantages (B, C) float32, scores (B, C) float32, scored mask (B, C) bool) of ``step``'s batch."""
        raise NotImplementedError


class Credit:
    """How a method's credit enters the token advantages (a :class:`MethodSpec`'s ``credit``): one of the three
    instances :data:`UNIFORM`, :data:`RESHAPE`, :data:`ADD`. The pipeline calls these two methods and switches on
    nothing; adapters read :attr:`name` ("uniform", "reshape", "add").

    ``pipe`` is the calling :class:`oar.pipeline.Pipeline` (its config, the method's scorer and its scoring pass),
    ``step`` the call's :class:`Step`.
    """

    name: str = ""

    def scores(self, pipe, step: "Step") -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C) float32 token scores and (B, C) bool scored-token mask (CPU) of ``step``'s batch."""
        raise NotImplementedError

    def token_advantages(self, pipe, step: "Step") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token advantages (B, C), weights (B, C) float32, scores (B, C) float32, scored mask (B, C) bool), CPU."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<credit {self.name}>"

    def __reduce__(self):
        # unpickled (Ray, multiprocessing) as the module's own instance, so identity checks keep holding
        return (_credit, (self.name,))


class _Uniform(Credit):
    """GRPO's credit: every eligible token gets its sequence advantage A; no scores."""

    name = "uniform"

    def scores(self, pipe, step):
        b = step.b
        return torch.zeros((b.B, b.C)), torch.zeros((b.B, b.C), dtype=torch.bool)

    def token_advantages(self, pipe, step):
        b = step.b
        sc, reasoning = self.scores(pipe, step)
        return step.adv[:, None] * b.eligible, b.eligible.float(), sc, reasoning


class _Reshape(Credit):
    """A x sum-preserving weights from importance scores (method.md sections 5-6,
    :func:`oar.ops.reshape_advantages`); rows of several turns turn by turn (docs/method.md section 13,
    :func:`oar.attribution.turns.reshape_turns`)."""

    name = "reshape"

    def scores(self, pipe, step):
        return pipe._scores(step)

    def token_advantages(self, pipe, step):
        sc, reasoning = self.scores(pipe, step)
        r = pipe.config.reshape
        tok, weights = reshape_turns(step.adv, sc, reasoning, step.b.eligible, step.turns, q=r.q, beta=r.beta,
                                     floor=r.floor, tiers=r.tiers)
        return tok, weights, sc, reasoning


class _Add(Credit):
    """A + a per-token bonus (method.md section 8; the scorer's ``bonus``); weights are the ratios to A (1 where
    A = 0)."""

    name = "add"

    def scores(self, pipe, step):
        _, sc, reasoning = pipe.scorer.bonus(step)
        return sc, reasoning

    def token_advantages(self, pipe, step):
        adv, eligible = step.adv, step.b.eligible
        tok, sc, reasoning = pipe.scorer.bonus(step)
        safe = torch.where(adv != 0, adv, torch.ones_like(adv)).double()
        ratio = torch.where((adv != 0)[:, None], tok.double() / safe[:, None],
                            torch.ones_like(tok, dtype=torch.float64))
        weights = torch.where(eligible, ratio, torch.zeros((), dtype=torch.float64)).float()
        return tok, weights, sc, reasoning


#: The three credit rules (a :class:`MethodSpec`'s ``credit``).
UNIFORM, RESHAPE, ADD = _Uniform(), _Reshape(), _Add()


def _credit(name: str) -> Credit:
    """The credit rule named ``name`` (how :class:`Credit` instances unpickle)."""
    return {c.name: c for c in (UNIFORM, RESHAPE, ADD)}[name]


@dataclass(frozen=True)
class MethodSpec:
    """One credit-assignment method: a row of :data:`oar.methods.METHOD_TABLE`.

    Attributes:
        name: the method's name in ``OARConfig.method`` (:data:`oar.schema.METHODS`).
        credit: :data:`UNIFORM` (every eligible token gets A), :data:`RESHAPE` (A x sum-preserving weights from
            importance scores, method.md sections 5-6) or :data:`ADD` (A + a per-token bonus, method.md section 8):
            a :class:`Credit`, whose ``token_advantages`` / ``scores`` the pipeline calls.
        needs_model: runs the policy (unless the batch carries its scores / entropies already).
        needs_tokenizer: reads the reasoning span (decodes completions) or builds probe contexts.
        needs_answers: builds the outcome probe from the reference answers.
        needs_groups: reads the groups (KTAE's per-prompt token tables).
        scores_all_rows: scores every row, also rows with A = 0 (KTAE's tables count every rollout).
        scorer: the scorer class, built once per pipeline (``scorer(config)``): a :class:`TokenScorer` for
            :data:`RESHAPE` (``score`` on probe contexts, ``precomputed`` where no forward is needed), a
            :class:`BonusScorer` for :data:`ADD` (``bonus``); None for :data:`UNIFORM`.
    """

    name: str
    credit: Credit
    needs_model: bool = False
    needs_tokenizer: bool = False
    needs_answers: bool = False
    needs_groups: bool = False
    scores_all_rows: bool = False
    scorer: type | None = None

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
