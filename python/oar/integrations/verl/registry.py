"""Registration of OAR with verl (:func:`register`, called by the opt-in ``verl.plugins`` entry point
:mod:`oar.integrations.verl.plugin` or from code): the advantage estimators and their wrappers
(:mod:`oar.integrations.verl.estimators`), the worker class, the legacy trainer's ``init_workers`` wrapper and the
v1 trainers (:mod:`oar.integrations.verl.workers`).

:mod:`~oar.integrations.verl.workers` imports verl's worker classes at module level, so it is imported inside
:func:`register`, once verl is known to be importable: ``import oar.integrations.verl`` never imports verl (verl
is an optional dependency, and ``import verl`` loads the plugin, which imports this package).
"""

from __future__ import annotations

import logging
import warnings

from oar.integrations.verl import estimators

#: The v1 trainers the last :func:`register` registered (``names``: ``oar_sync``, ...; empty, with the reason in
#: ``error``, when verl's v1 trainer or the worker class cannot be imported, e.g. without the TransferQueue package).
V1_TRAINERS: dict = {"names": [], "error": None}
#: The registration failures already reported in this process (each is said once).
_SAID: set = set()


def register() -> list[str]:
    """Registers the OAR advantage estimators and v1 trainers with verl and installs the wrappers (idempotent).

    Returns:
        The registered advantage estimator names (:data:`oar.integrations.verl.ADV_ESTIMATORS`); the v1 trainers
        are in :data:`V1_TRAINERS`. A failure to register the v1 trainers is recorded there and reported once per
        process and reason, as a logged error and a RuntimeWarning naming the cause.

    Raises:
        ImportError: verl is not installed. RuntimeError: the verl version lacks the hook points.
    """
    names = estimators.register_estimators()
    try:  # the worker class and verl's v1 trainers (they need the transfer queue package)
        from verl.trainer.ppo import ray_trainer

        from oar.integrations.verl import workers

        trainer_cls = getattr(ray_trainer, "RayPPOTrainer", None)
        if trainer_cls is not None and hasattr(trainer_cls, "init_workers"):
            trainer_cls.init_workers = workers.wrap_init_workers(trainer_cls.init_workers)
        V1_TRAINERS.update(names=workers.register_trainers(), error=None)
        workers.wrap_v1_trainer_init()
    except Exception as e:  # noqa: BLE001 - the estimators above work without them (e.g. verl without its extras)
        error = f"{type(e).__name__}: {e}"
        V1_TRAINERS.update(names=[], error=error)
        if error not in _SAID:  # once per process and reason, loudly: verl would only say "Unknown trainer" later
            _SAID.add(error)
            message = (f"oar: the OAR v1 trainers (trainer.v1.trainer_mode=oar_sync, oar_colocate_async, "
                       f"oar_separate_async) could not be registered with verl, so verl will refuse those modes as "
                       f"unknown trainers; the advantage estimators (algorithm.adv_estimator=oar_*) are registered and "
                       f"work with the legacy trainer (trainer.use_v1=False). Cause: {error}")
            logging.getLogger(__name__).error(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
    estimators.wrap_v1_compute_advantage()
    return names
