"""verl integration (docs/trainers.md, verl; docs/trainers/verl.md): OAR advantage estimators in verl's registry,
with the scores computed on verl's actor workers.

Tested against verl 0.9.1. :func:`register` (called by the opt-in ``verl.plugins`` entry point,
:mod:`oar.integrations.verl.plugin`, when ``$OAR_VERL_PLUGIN=1``) registers one advantage estimator per OAR method
(:data:`ADV_ESTIMATORS`; select one with ``algorithm.adv_estimator=oar_g``), the OAR v1 trainers
(``trainer.v1.trainer_mode=oar_sync`` etc.) and the wrappers of verl's trainer that make the batch and the actor
worker group visible to the estimator. Importing this package does not import verl.

Modules, each importing only those above it in this list:

* :mod:`.launch`: the command-line spellings (``+oar.<key>=<value>``, the Hydra-quoted ``OAR_VERL_PLUGIN``) and
  their checks (imports nothing of verl);
* :mod:`.context`: the state one ``compute_advantage`` call shares (the batch, the rollouts, the worker scorer);
* :mod:`.rollouts`: verl's padded rollout layout (:func:`rollout_rows`, :func:`attach_scores`);
* :mod:`.estimators`: driver side, the registered advantage estimators (:func:`configure`, :class:`HFScorer`);
* :mod:`.dispatch`: the driver's side of the workers' ``oar_scores`` (:class:`WorkerGroupScorer`);
* :mod:`.workers`: worker side (imports verl): the worker method, the worker class, the OAR v1 trainers;
* :mod:`.registry`: :func:`register`; :mod:`.plugin`: the ``verl.plugins`` entry point.
"""

from oar.integrations.verl.dispatch import WorkerGroupScorer
from oar.integrations.verl.estimators import (ADV_ESTIMATORS, SUPPORTED_VERL, HFScorer, configure,
                                              estimator_config)
from oar.integrations.verl.registry import V1_TRAINERS, register
from oar.integrations.verl.rollouts import attach_scores, rollout_rows

__all__ = ["ADV_ESTIMATORS", "SUPPORTED_VERL", "HFScorer", "V1_TRAINERS", "WorkerGroupScorer", "attach_scores",
           "configure", "estimator_config", "register", "rollout_rows"]
