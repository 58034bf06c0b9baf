"""Test script (tests/python/integrations/test_verl_launch.py): a verl launch command of the docs, run as verl's own
``main_ppo`` runs it, up to the point where a GPU would be needed.

``python verl_launch.py`` reads a JSON list of commands on stdin (each: ``{"overrides": [...]}``, the Hydra
overrides of ``python -m verl.trainer.main_ppo`` as the shell split them, the doc's ``...`` replaced by stand-ins
for a user's own settings) and, for each, does what verl 0.9.1's ``verl/trainer/main_ppo.py`` does:

1. ``main``: composes verl's Hydra config ``ppo_trainer`` with the overrides, ``auto_set_device`` and
   ``validate_config``;
2. ``run_ppo``: builds Ray's runtime env (``get_ppo_ray_runtime_env`` merged with
   ``ray_kwargs.ray_init.runtime_env``; ``TRANSFER_QUEUE_ENABLE``) and calls ``ray.init`` with it (Ray checks it
   here: env vars must be strings), with at most 1 CPU;
3. ``TaskRunnerV1.run``, in a Ray actor started with that runtime env: ``import verl`` (the ``verl.plugins``
   entry point, opted in by the runtime env's ``OAR_VERL_PLUGIN``), ``get_trainer_cls(trainer.v1.trainer_mode)``,
   ``OmegaConf.resolve`` and the trainer's constructor. ``trainer.init()`` is not run: it builds the resource
   pools, which need the GPUs.

Prints one JSON line per command: the step that failed with its error, or what the TaskRunner saw (the plugin's
env var, the registered OAR names, the trainer class and the fields verl's mode decides, the OAR config the
estimator will run).
"""

import json
import os
import sys
import traceback


def compose(overrides):
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=list(overrides))


def task_runner(config):
    """What ``TaskRunnerV1.run`` does up to ``trainer.init()``, in a Ray actor; returns what it saw."""
    import verl  # noqa: F401 - loads the verl.plugins entry points, as every verl process does
    from omegaconf import OmegaConf, open_dict
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.v1 import get_trainer_cls

    seen = {"OAR_VERL_PLUGIN": os.environ.get("OAR_VERL_PLUGIN"),
            "registered": sorted(k for k in core_algos.ADV_ESTIMATOR_REGISTRY if k.startswith("oar"))}
    try:
        trainer_cls = get_trainer_cls(config.trainer.v1.trainer_mode)
        with open_dict(config):
            config.transfer_queue.enable = True
        OmegaConf.resolve(config)
        trainer = trainer_cls(config=config)
    except Exception as e:  # noqa: BLE001 - reported to the test
        seen["error"] = f"{type(e).__name__}: {e}"
        return seen
    from oar.integrations.verl import estimators

    name = str(config.algorithm.adv_estimator)
    seen.update(trainer_cls=type(trainer).__name__, bases=[c.__name__ for c in type(trainer).__mro__[1:4]],
                trainer_mode=trainer.trainer_mode, config_trainer_mode=str(config.trainer.v1.trainer_mode),
                parameter_sync_step=trainer.parameter_sync_step, replay_buffer=type(trainer.replay_buffer).__name__,
                oar_config=json.loads(estimators.estimator_config(name).to_json())
                if name in estimators.ADV_ESTIMATORS else None)
    return seen


def run(overrides):
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    try:
        config = compose(overrides)
        auto_set_device(config)
        validate_config(config=config, use_reference_policy=need_reference_policy(config),
                        use_critic=need_critic(config))
    except Exception as e:  # noqa: BLE001
        return {"step": "hydra", "error": f"{type(e).__name__}: {e}"}
    default_runtime_env = get_ppo_ray_runtime_env(config)
    ray_init_kwargs = config.ray_kwargs.get("ray_init", {})
    runtime_env_kwargs = ray_init_kwargs.get("runtime_env", {})
    if config.transfer_queue.enable:
        default_runtime_env.setdefault("env_vars", {})["TRANSFER_QUEUE_ENABLE"] = "1"
    runtime_env = OmegaConf.merge(default_runtime_env, runtime_env_kwargs)
    kwargs = OmegaConf.to_container(OmegaConf.create({**ray_init_kwargs, "runtime_env": runtime_env}))
    kwargs["num_cpus"] = 1
    kwargs["include_dashboard"] = False
    try:
        ray.init(**kwargs)
    except Exception as e:  # noqa: BLE001
        return {"step": "ray.init", "error": f"{type(e).__name__}: {e}"}
    try:
        runner = ray.remote(num_cpus=0)(task_runner)
        return {"step": "task_runner", **ray.get(runner.remote(config), timeout=600)}
    except Exception as e:  # noqa: BLE001
        return {"step": "task_runner", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    finally:
        ray.shutdown()


if __name__ == "__main__":
    for command in json.load(sys.stdin):
        print("RESULT " + json.dumps(run(command["overrides"])), flush=True)
