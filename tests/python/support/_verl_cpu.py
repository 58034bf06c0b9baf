"""Test scaffolding: verl 0.9.1's real ``ActorRolloutRefWorker`` (role ``"actor"``, FSDP2 engine) on Ray CPU workers.

Used only by tests and test scripts (``verl_worker.py``); never imported by oar. It runs verl's own
``verl.workers.engine_workers.ActorRolloutRefWorker`` -> ``TrainingWorker`` -> ``FSDPEngineWithLMHead`` (FSDP2,
``torch.distributed.fsdp.fully_shard``) in N Ray CPU actors over gloo, on a tiny random Llama saved to disk.

* :func:`save_tiny_model` saves oar's tiny random ``LlamaForCausalLM`` (fixed seed, float32) and its minimal
  tokenizer (nothing is downloaded).
* :func:`actor_config` loads verl's own trainer config (``_generated_ppo_trainer.yaml``, the flattened
  ``ppo_trainer.yaml``) and returns its ``actor_rollout_ref`` node, the one verl's trainer passes to
  ``ActorRolloutRefWorker``, set up for CPU and float32.
* :func:`enable_cpu` applies the in-worker workarounds below (idempotent). It runs inside each worker process only
  (the :func:`cpu_worker_cls` wrapper calls it first thing in ``__init__``), never in the driver.
* :func:`worker_group` builds an N-rank ``RayWorkerGroup`` of a given ``ActorRolloutRefWorker`` subclass on Ray CPU
  resources (``RayResourcePool(use_gpu=False, max_colocate_count=1)``, ``device_name="cpu"``).

Workarounds, each with the error it avoids (all inside the worker processes; nothing of verl is edited):

1. A ``cpu`` platform, through verl's own extension point (``PlatformRegistry.register(platform="cpu")`` +
   ``set_platform``). verl 0.9.1 has none: auto-detection falls back to ``nvidia`` ("No supported accelerator
   detected ... Falling back to 'nvidia'"), ``get_device_name()`` is ``"cuda"`` and ``init_model`` fails in the
   engine's ``init_device_mesh("cuda", ...)`` with ``RuntimeError: Found no NVIDIA driver on your system``. Details
   of the platform:

   * ``current_device()`` (verl's ``get_device_id()``) returns ``"cpu"``, not an index: verl passes it to
     ``.to()`` (``fsdp2_load_full_state_dict``: ``model.to(device=get_device_id())``), where ``0`` means
     ``cuda:0`` (same ``Found no NVIDIA driver`` error).
   * the device module is ``torch.cpu`` plus no-ops returning 0 for what it lacks (``empty_cache``,
     ``max_memory_allocated``, ...), and ``mem_get_info`` -> ``(free, total)`` host bytes (verl's
     ``log_gpu_memory_usage`` unpacks it: ``TypeError: cannot unpack non-iterable int object``) and
     ``get_device_name`` -> ``"CPU"`` (verl's flops counter does ``key in device_name``: ``TypeError: argument of
     type 'int' is not iterable``).
2. ``FSDPEngineWithLMHead`` registered in ``EngineRegistry`` for ``device="cpu"``: verl registers it for
   ``["cuda", "npu"]`` only: ``ValueError: No engine registered for device='cpu', vendor='cpu',
   model_type='language_model', backend='fsdp2'``.
3. The default process group is created with ``backend="gloo"`` (env://: the RANK / WORLD_SIZE / MASTER_ADDR /
   MASTER_PORT that verl's worker group sets) before verl's ``initialize_global_process_group_ray``, which then
   finds it initialized and does nothing. verl would build ``f"cpu:gloo,{device}:{backend}"`` =
   ``"cpu:gloo,cpu:gloo"``: ``ValueError: Duplicate device type cpu in backend string: gloo``.
4. Only when ``hydra`` is not importable: a stand-in ``hydra.utils`` module whose ``instantiate`` covers verl's one
   use on this path, ``verl.utils.config.omega_conf_to_dataclass`` -> ``instantiate(cfg, _convert_="partial")``.
   verl is installed ``--no-deps`` and requirements/trainers.txt lists no hydra-core (hydra-core 1.3.x pins
   ``antlr4-python3-runtime==4.9.*`` and ``omegaconf<2.4``; with math-verify's antlr4 4.13 it fails at import:
   ``Could not deserialize ATN with version 3 (expected 4)``). Without hydra ``init_model`` fails with
   ``ModuleNotFoundError: No module named 'hydra'``. Checked against hydra-core 1.3.8: identical dataclasses for
   ``model``, ``actor``, ``actor.profiler`` and ``rollout.checkpoint_engine``. The real hydra is used whenever it
   imports.
5. Only when trl has no ``AutoModelForCausalLMWithValueHead`` (trl >= 1.x; not CPU-specific): verl's
   ``apply_monkey_patch`` imports it whenever trl is installed, to patch a value-head ``state_dict``:
   ``ImportError: cannot import name 'AutoModelForCausalLMWithValueHead' from 'trl'``. ``is_trl_available`` is
   made false in ``verl.models.transformers.monkey_patch`` only (the patch concerns value models, not the actor).

Config choices (:func:`actor_config`, not patches): ``actor.strategy=fsdp2``; float32 end to end:
``actor.fsdp_config.model_dtype=fp32`` (the weights; verl's default already) and
``actor.fsdp_config.mixed_precision={param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}`` (the compute:
unset, verl's FSDP engine uses ``MixedPrecisionPolicy(param_dtype=bf16)``, so the forward runs in bf16 over fp32
weights and the log-probs are off by ~3e-2); ``model.override_config.attn_implementation=eager`` (verl's default
``flash_attention_2``: ``ImportError: FlashAttention2 has been toggled on, but ... doesn't seem to be installed``);
``use_torch_compile=False`` (verl otherwise ``torch.compile``s its entropy function: slow to build on CPU, not
tried); ``rollout.name="hf"``, a
placeholder for the mandatory ``???`` (no rollout is built for role ``"actor"``, so nothing looks it up and no
vllm/sglang is imported); use_remove_padding, use_dynamic_bsz, gradient checkpointing and offload off.

In the driver, ``RayWorkerGroup(device_name="cpu")`` only logs "Requested device cpu does not match current platform
device cuda" (the driver keeps verl's auto-detected platform; ``use_gpu=False`` asks Ray for CPU bundles only).
Not covered: ``ulysses_sequence_parallel_size > 1`` (``transformer_impl.device_name`` is read at import time, before
the cpu platform exists), not tried; FSDP1 (``strategy=fsdp``), which fails in ``init_model``: verl builds
``FSDP(..., sync_module_states=True)`` and torch's FSDP1 refuses CPU parameters (``ValueError: The module has CPU
parameters or buffers when `sync_module_states=True` ...``; tests/python/integrations/test_verl_defaults.py pins it).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

_ENABLED = False

# ----------------------------------------------------------------------------------------------------------------
# tiny model
# ----------------------------------------------------------------------------------------------------------------

#: The tiny model of the verl worker tests: ``oar.testing.tiny_random_llama(**TINY)`` (float32, minimal tokenizer),
#: sharpened (``initializer_range=0.12``): divergences (~1e-2) far above float32 rounding, so that rule 1's error
#: budgets (_tolerance.py) are not vacuous.
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0, initializer_range=0.12)


def save_tiny_model(path: str) -> str:
    """Saves ``oar.testing.tiny_random_llama(**TINY)`` (model and tokenizer, ``save_pretrained``) to ``path``, where
    verl's ``HFModelConfig`` loads it from; returns ``path``. The same call in the test process is the reference."""
    from oar.testing import tiny_random_llama

    model, tok = tiny_random_llama(**TINY)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------------------------


def actor_config(model_path: str, **overrides: Any):
    """``actor_rollout_ref`` of verl's trainer config (what ``main_ppo`` passes to ``ActorRolloutRefWorker``),
    resolved, for the FSDP2 actor on CPU in float32.

    Loaded from ``verl/trainer/config/_generated_ppo_trainer.yaml``, verl's own flattened composition of
    ``ppo_trainer.yaml`` (so that no hydra is needed to compose ``ppo_trainer.yaml``'s defaults list).
    ``overrides``: dotted keys relative to ``actor_rollout_ref`` (e.g. ``**{"actor.ppo_mini_batch_size": 4}``),
    applied after the settings below with ``OmegaConf.update``.
    """
    import verl
    from omegaconf import OmegaConf

    path = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "_generated_ppo_trainer.yaml")
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    settings = {
        "model.path": model_path,
        "model.use_remove_padding": False,
        "model.enable_gradient_checkpointing": False,
        "model.override_config": {"attn_implementation": "eager"},  # verl's default is flash_attention_2
        "actor.strategy": "fsdp2",
        "actor.use_torch_compile": False,
        "actor.ppo_mini_batch_size": 4,
        "actor.ppo_micro_batch_size_per_gpu": 2,
        "actor.use_dynamic_bsz": False,
        "actor.fsdp_config.model_dtype": "fp32",
        "actor.fsdp_config.mixed_precision": fp32,
        "actor.fsdp_config.use_torch_compile": False,
        "actor.fsdp_config.param_offload": False,
        "actor.fsdp_config.optimizer_offload": False,
        "actor.fsdp_config.offload_policy": False,
        "ref.fsdp_config.model_dtype": "fp32",
        "ref.fsdp_config.mixed_precision": fp32,
        "ref.fsdp_config.use_torch_compile": False,
        "ref.log_prob_micro_batch_size_per_gpu": 2,
        "rollout.name": "hf",
        "rollout.log_prob_micro_batch_size_per_gpu": 2,
        "rollout.log_prob_use_dynamic_bsz": False,
        "rollout.tensor_model_parallel_size": 1,
        "rollout.n": 1,
    }
    settings.update(overrides)
    full = OmegaConf.load(path)
    for key, value in settings.items():
        OmegaConf.update(full, f"actor_rollout_ref.{key}", value, merge=False, force_add=True)
    OmegaConf.resolve(full)  # interpolations point at the root (actor_rollout_ref.*, global_profiler.*)
    return full.actor_rollout_ref


# ----------------------------------------------------------------------------------------------------------------
# in-worker workarounds
# ----------------------------------------------------------------------------------------------------------------


class _CpuDeviceModule(ModuleType):
    """Stands in for ``torch.cuda``: ``torch.cpu`` where it has the attribute, else a no-op returning 0."""

    def __init__(self):
        super().__init__("_verl_cpu_device")

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def mem_get_info(device=None):  # (free, total) bytes: verl's log_gpu_memory_usage unpacks it
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    @staticmethod
    def get_device_name(device=None):  # verl's flops counter looks it up in its peak-FLOPS table (none: inf)
        return "CPU"

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None):
        torch.set_rng_state(state)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        return lambda *args, **kwargs: 0


def _platform_cls():
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        _device_module = _CpuDeviceModule()

        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: self._device_module)

        def is_available(self):
            return True

        def is_platform_available(self, use_smi_check=False):
            return False  # never auto-detected: only set explicitly by enable_cpu()

        def current_device(self):
            return "cpu"  # verl passes this to .to(); an int would mean cuda:<index>

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "VERL_CPU_VISIBLE_DEVICES"  # not CUDA_VISIBLE_DEVICES: nothing to hide on CPU

        @contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    return PlatformCPU


def _hydra_instantiate(config, *args, _convert_="partial", **kwargs):
    """Stand-in for ``hydra.utils.instantiate`` as verl calls it (``instantiate(cfg, _convert_="partial")`` in
    ``verl.utils.config.omega_conf_to_dataclass``): depth-first, every mapping with ``_target_`` becomes
    ``target(**children)``, other mappings dicts and sequences lists (hydra's ``_convert_="partial"``)."""
    import importlib

    from omegaconf import DictConfig, ListConfig, OmegaConf

    if args or kwargs or _convert_ != "partial":
        raise NotImplementedError("the hydra stand-in only covers instantiate(config, _convert_='partial')")

    def locate(path):
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def build(node):
        if isinstance(node, DictConfig | dict):
            if isinstance(node, DictConfig):
                node = OmegaConf.to_container(node, resolve=True)
            children = {k: build(v) for k, v in node.items() if k != "_target_"}
            return locate(node["_target_"])(**children) if node.get("_target_") else children
        if isinstance(node, ListConfig | list | tuple):
            return [build(v) for v in node]
        return node

    return build(config)


def _install_hydra_stand_in() -> None:
    try:
        import hydra.utils  # noqa: F401

        return  # the real one
    except ImportError:
        pass
    hydra = ModuleType("hydra")
    hydra.__path__ = []
    hydra._verl_cpu_stand_in = True
    utils = ModuleType("hydra.utils")
    utils.instantiate = _hydra_instantiate
    hydra.utils = utils
    sys.modules["hydra"], sys.modules["hydra.utils"] = hydra, utils


def enable_cpu() -> None:
    """Applies the in-worker workarounds listed in the module docstring (idempotent). Call it inside a worker
    process before verl's ``Worker.__init__`` / ``init_model`` (the :func:`cpu_worker_cls` wrapper does)."""
    global _ENABLED
    if _ENABLED:
        return
    from verl.plugin.platform import PlatformRegistry, get_platform, platform_manager, set_platform

    # 1. cpu platform
    if PlatformRegistry.get("cpu") is None:
        PlatformRegistry.register(platform="cpu")(_platform_cls())
    if platform_manager._current_platform is None or get_platform().device_name != "cpu":
        platform_manager._current_platform = None  # set_platform would warn about replacing the auto-detected one
        set_platform(PlatformRegistry.get("cpu")())

    # 2. the FSDP engine for device "cpu"
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if "cpu" not in EngineRegistry._engines.get("language_model", {}).get("fsdp2", {}):
        EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
            FSDPEngineWithLMHead
        )

    # 3. gloo process group, before verl would build "cpu:gloo,cpu:gloo"
    if not torch.distributed.is_initialized() and "WORLD_SIZE" in os.environ:
        torch.distributed.init_process_group(
            backend="gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
        )

    # 4. hydra.utils.instantiate, when hydra-core is not importable
    _install_hydra_stand_in()

    # 5. trl without AutoModelForCausalLMWithValueHead (trl >= 1.x; not CPU-specific)
    try:
        from trl import AutoModelForCausalLMWithValueHead  # noqa: F401
    except ImportError:
        try:
            from trl.experimental.ppo import AutoModelForCausalLMWithValueHead  # noqa: F401
        except ImportError:
            from verl.models.transformers import monkey_patch

            monkey_patch.is_trl_available = lambda: False
    _ENABLED = True


# ----------------------------------------------------------------------------------------------------------------
# worker group
# ----------------------------------------------------------------------------------------------------------------


def cpu_worker_cls(worker_cls: type) -> type:
    """A subclass of ``worker_cls`` (an ``ActorRolloutRefWorker`` subclass) whose ``__init__`` calls
    :func:`enable_cpu` first, so verl's ``Worker.__init__`` and ``init_model`` already see the cpu platform."""
    if getattr(worker_cls, "_verl_cpu_wrapped", False):
        return worker_cls

    def __init__(self, *args, **kwargs):
        enable_cpu()
        worker_cls.__init__(self, *args, **kwargs)

    return type(worker_cls.__name__, (worker_cls,), {"__init__": __init__, "_verl_cpu_wrapped": True})


def worker_group(worker_cls: type, config, n: int = 2, role: str = "actor", **init_kwargs):
    """An ``n``-rank ``RayWorkerGroup`` of ``worker_cls`` (``ActorRolloutRefWorker`` or a subclass) on Ray CPU
    resources, each worker constructed as verl's trainer does (``worker_cls(config=config, role=role)``) after
    :func:`enable_cpu`. Ray must already be running with at least ``n`` CPUs (one CPU bundle per worker);
    ``init_model()`` is left to the caller.

    The workers' ``PYTHONPATH`` gets the folders of this module and of ``worker_cls``'s module, so both import there
    (Ray only forwards the driver script's folder and the current directory, which misses them under pytest)."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    paths = [os.path.dirname(os.path.abspath(__file__))]
    module_file = getattr(sys.modules.get(worker_cls.__module__), "__file__", None)
    if module_file:
        paths.append(os.path.dirname(os.path.abspath(module_file)))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    pool = RayResourcePool(process_on_nodes=[n], use_gpu=False, max_colocate_count=1)
    cls_with_init = RayClassWithInitArgs(
        cls=ray.remote(cpu_worker_cls(worker_cls)), config=config, role=role, **init_kwargs
    )
    return RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=cls_with_init,
        device_name="cpu",
        worker_env={"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))},
    )
