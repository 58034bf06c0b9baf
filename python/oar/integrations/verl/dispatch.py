"""verl integration, the driver's side of the actor workers' ``oar_scores`` method (docs/trainers/verl.md): the
request (the rows to score, one contiguous chunk per data-parallel rank), the call through verl's dispatch, and
the replies folded back in batch row order (:class:`WorkerGroupScorer`). The workers' side is
:mod:`oar.integrations.verl.workers`; the rows are split by :func:`oar.integrations._worker_scoring.split_rows`.

Imports verl's ``tensordict`` helpers only when a request is built (verl is an optional dependency).
"""

from __future__ import annotations

import torch

from oar.integrations._worker_scoring import split_rows
from oar.pipeline import scored_rows
from oar.integrations.verl.rollouts import rollout_rows
from oar.batch import RolloutBatch

#: Keys of the request ``TensorDict`` (one row per rollout) and of the reply.
REQUEST_KEYS = ("oar_prompt_ids", "oar_prompt_lengths", "oar_responses", "oar_completion_mask", "oar_eligible_mask",
                "oar_sequence_advantages")


def _dp_size(worker_group) -> int:
    """Data-parallel size of the worker group's ``actor`` mesh, as verl's own dispatch computes it."""
    info = worker_group._dispatch_info
    if "actor" not in info:
        info["actor"] = worker_group._query_dispatch_info("actor")
    return max(info["actor"]) + 1


def _request(rows: dict, config, sequence_advantages: torch.Tensor, dp_size: int):
    """:func:`scores_request` with its :class:`~oar.integrations._worker_scoring.RankSplit`."""
    from tensordict import NonTensorStack, TensorDict
    from verl.utils import tensordict_utils as tu

    adv = sequence_advantages.detach().float().cpu().reshape(-1)
    if not scored_rows(adv, config.credit_rows):
        raise ValueError(f"scores_request needs at least one row to score: a non-zero sequence advantage, of the sign "
                         f"credit_rows={config.credit_rows!r} credits (group_scores sends nothing otherwise)")
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    split = split_rows(adv, dp_size, only_scored=True, credit_rows=config.credit_rows)
    pick, n = split.rows, len(split.rows)
    lengths = torch.tensor([int(rows["prompt_ids"][i].numel()) for i in pick], dtype=torch.int64)
    P = max(1, int(lengths.max()))
    prompts = torch.zeros((n, P), dtype=torch.int64)
    for k, i in enumerate(pick):
        prompts[k, : lengths[k]] = rows["prompt_ids"][i].to(torch.int64)
    idx = torch.tensor(pick, dtype=torch.int64)
    td = TensorDict({"oar_prompt_ids": prompts, "oar_prompt_lengths": lengths,
                     "oar_responses": rows["responses"][idx].to(torch.int64),
                     "oar_completion_mask": rows["completion_mask"][idx].bool(),
                     "oar_eligible_mask": rows["eligible_mask"][idx].bool(),
                     "oar_sequence_advantages": split.sequence_advantages(adv)},
                    batch_size=[n])
    if rows["answers"] is not None:
        td["oar_answers"] = NonTensorStack(*[rows["answers"][i] for i in pick])
    tu.assign_non_tensor(td, oar_config=config.to_json())
    return td, split


def scores_request(rows: dict, config, sequence_advantages: torch.Tensor, dp_size: int) -> tuple:
    """The ``oar_scores`` request: the rows the pipeline scores (:func:`oar.pipeline.scored_rows`: a non-zero sequence
    advantage, of the sign ``config.credit_rows`` credits), padded to a multiple of ``dp_size``.

    Args:
        rows: :func:`oar.integrations.verl.rollout_rows` of the batch (B rows, responses (B, R)).
        config: ``oar.OARConfig`` (sent as JSON: the workers score with the driver's method and settings).
        sequence_advantages: (B,) real.
        dp_size: data-parallel size of the actor mesh (>= 1).

    Raises:
        ValueError: no row to score (a non-zero advantage of the credited sign); ``dp_size`` not an int >= 1.

    Returns:
        ``(request, active)``: a ``TensorDict`` of n = ceil(len(active) / dp_size) * dp_size rows (the padding rows
        repeat the first active row with advantage 0, so they are not scored) with :data:`REQUEST_KEYS`, the
        answers (``oar_answers``, str) when the method needs them and the config (``oar_config``); ``active``, the
        batch rows of the first len(active) request rows. Contiguous chunks go to the ranks (verl's dispatch).
    """
    td, split = _request(rows, config, sequence_advantages, dp_size)
    return td, split.rows[: split.sent]


def request_batch(data) -> RolloutBatch:
    """The :class:`RolloutBatch` of one rank's chunk (a ``TensorDict`` slice) of a :func:`scores_request`."""
    lengths = data["oar_prompt_lengths"].tolist()
    prompts = [row[:n] for row, n in zip(data["oar_prompt_ids"], lengths)]
    answers = data["oar_answers"].tolist() if "oar_answers" in data.keys() else None
    return RolloutBatch(data["oar_responses"].cpu(), data["oar_completion_mask"].bool().cpu(), prompt_ids=prompts,
                        eligible_mask=data["oar_eligible_mask"].bool().cpu(), answers=answers,
                        sequence_advantages=data["oar_sequence_advantages"].float().cpu())


def group_scores(worker_group, rows: dict, config, sequence_advantages: torch.Tensor,
                 info: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of ``rows`` computed by ``worker_group.oar_scores`` (see :class:`WorkerGroupScorer`). ``info``
    (optional dict) receives ``memory_budget_mb``: the budget the workers ran with (the config's, capped by the
    trainer's own, :func:`oar.integrations.verl.workers.trainer_memory_budget_mb`), None when nothing was sent, and
    ``turn_weights``: (B, R) float32 CPU turn weights of the rows sent (docs/method.md section 13), else None.

    Returns:
        ``(scores (B, R) float32, reasoning_mask (B, R) bool)`` on the CPU; rows with advantage 0 are 0 / False.

    Raises:
        AttributeError: the worker group has no ``oar_scores`` (workers without ``OARWorkerMixin``).
        RuntimeError: a reply of another shape than the request's.
    """
    B, R = rows["responses"].shape
    if not hasattr(worker_group, "oar_scores"):
        raise AttributeError("the actor worker group has no oar_scores method: run the actor role on "
                             "oar.integrations.verl.workers.OARActorRolloutRefWorker (the OAR trainers do) or mix "
                             "OARWorkerMixin into your worker class")
    if not scored_rows(sequence_advantages, config.credit_rows):  # no row the pipeline scores: nothing is sent
        return torch.zeros((B, R), dtype=torch.float32), torch.zeros((B, R), dtype=torch.bool)
    td, split = _request(rows, config, sequence_advantages, _dp_size(worker_group))
    out = worker_group.oar_scores(td)
    if info is not None:
        from verl.utils import tensordict_utils as tu

        budget = tu.get(out, "oar_memory_budget_mb", default=None)
        info["memory_budget_mb"] = max(budget) if isinstance(budget, (list, tuple)) else budget
    got, mask = out["oar_scores"], out["oar_reasoning_mask"]
    if tuple(got.shape) != (td.batch_size[0], R) or tuple(mask.shape) != tuple(got.shape):
        raise RuntimeError(f"oar_scores replied {tuple(got.shape)} scores for a ({td.batch_size[0]}, {R}) request")
    if info is not None:
        tw = out["oar_turn_weights"] if "oar_turn_weights" in out.keys() else None
        info["turn_weights"] = None if tw is None else split.place(tw, B, torch.float32)
    return split.place(got, B, torch.float32), split.place(mask, B, torch.bool)


class WorkerGroupScorer:
    """Importance scores of a verl batch computed on verl's actor worker group (the policy that generated the
    rollouts, as verl's FSDP / FSDP2 engine holds it).

    Args:
        worker_group: verl ``RayWorkerGroup`` of :class:`oar.integrations.verl.workers.OARActorRolloutRefWorker`
            (or any ``ActorRolloutRefWorker`` subclass with :class:`~oar.integrations.verl.workers.OARWorkerMixin`).
        answer_key: where the reference answer is, as :class:`oar.integrations.verl.HFScorer`.

    Calling it with ``(data, config, seq_adv)`` sends only the rows the pipeline scores (``seq_adv != 0``, of the
    sign ``config.credit_rows`` credits) to the workers
    (:func:`scores_request`: contiguous chunks, one per data-parallel rank, padded with unscored rows to a multiple
    of the data-parallel size), calls the workers' ``oar_scores`` through verl's dispatch, and returns
    ``(scores (B, R) float32, reasoning_mask (B, R) bool)`` on the CPU in ``data``'s row order (0 / False on the
    rows not sent). ``last_info["memory_budget_mb"]``: the activation budget the workers used (the config's,
    capped by verl's own old-log-prob token budget); ``last_info["turn_weights"]``: (B, R) turn weights of the rows
    sent (docs/method.md section 13), which the estimator passes on with the scores.

    Raises:
        AttributeError: the worker group has no ``oar_scores`` method (verl's plain worker class).
    """

    def __init__(self, worker_group, answer_key: tuple[str, str] = ("reward_model", "ground_truth")):
        self.worker_group = worker_group
        self.answer_key = answer_key
        self.calls = 0
        self.last_info: dict = {}

    def __call__(self, data, config, seq_adv: torch.Tensor):
        rows = rollout_rows(data, config, self.answer_key)
        self.calls += 1
        self.last_info = {"memory_budget_mb": None, "turn_weights": None}
        return group_scores(self.worker_group, rows, config, seq_adv, info=self.last_info)
