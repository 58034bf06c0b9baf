"""The state one ``compute_advantage`` call shares between verl's trainer and the OAR advantage estimators
(lowest module of :mod:`oar.integrations.verl`; imports nothing of verl or of its sibling modules).

verl passes a registered estimator only ``token_level_rewards``, ``response_mask``, ``index`` and ``config``, so
what else it needs is made visible for the duration of the call through context variables (nothing is global
across calls): the whole ``DataProto`` (set by the ``compute_advantage`` wrapper, :mod:`.estimators`), the
rollouts in verl's padded layout, the scorer on the actor worker group and the rows' session keys (set by the
OAR v1 trainers, :mod:`.workers`). The legacy trainer's worker-group scorer is recorded once per trainer
(``init_workers``).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

_BATCH: contextvars.ContextVar = contextvars.ContextVar("oar_verl_data", default=None)
_ROLLOUTS: contextvars.ContextVar = contextvars.ContextVar("oar_verl_rollouts", default=None)
_SCORER: contextvars.ContextVar = contextvars.ContextVar("oar_verl_workers", default=None)
_SESSIONS: contextvars.ContextVar = contextvars.ContextVar("oar_verl_sessions", default=None)
_TRAINER: dict[str, Any] = {"scorer": None}


def call_batch():
    """The ``DataProto`` of the current ``compute_advantage`` call, or None outside one."""
    return _BATCH.get()


def call_rollouts():
    """The rollouts (prompts, responses, masks, answers) of the current call in verl's padded layout, a
    ``DataProto``, when the batch itself lacks them (the v1 trainer's batch holds only the reward fields); or None."""
    return _ROLLOUTS.get()


def call_scorer():
    """The scorer of the current call on the actor worker group (``WorkerGroupScorer``), or None."""
    return _SCORER.get()


def call_sessions():
    """The transfer-queue keys of the current call's rows (``"{uid}_{session_id}_{output index}"``, one per row, in
    row order; set by the OAR v1 trainers: verl's GRPO takes the group statistics from each session's final output,
    ``verl/trainer/ppo/v1/utils.py``, ``compute_advantage_for_multi_trajectories``), or None."""
    return _SESSIONS.get()


@contextlib.contextmanager
def advantage_call(*, batch=None, rollouts=None, scorer=None, sessions=None) -> Iterator[None]:
    """Makes ``batch`` / ``rollouts`` / ``scorer`` / ``sessions`` (those not None) the current call's for the
    ``with`` block (see :func:`call_batch`, :func:`call_rollouts`, :func:`call_scorer`, :func:`call_sessions`),
    restoring the previous values after."""
    tokens = [(var, var.set(value)) for var, value in ((_BATCH, batch), (_ROLLOUTS, rollouts), (_SCORER, scorer),
                                                       (_SESSIONS, sessions))
              if value is not None]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def set_trainer_scorer(scorer) -> None:
    """Records the legacy ``RayPPOTrainer``'s actor worker-group scorer (None: forget it); the
    ``compute_advantage`` wrapper makes it the call's scorer unless one is set already."""
    _TRAINER["scorer"] = scorer


def trainer_scorer():
    """The scorer recorded by :func:`set_trainer_scorer`, or None."""
    return _TRAINER["scorer"]
