"""Test scaffolding: accelerate's FSDP plugin on CPU processes (gloo), for the multi-process TRL tests.

accelerate selects ``DistributedType.FSDP`` only on accelerator devices (``AcceleratorState`` keeps
``MULTI_CPU`` for CPU processes and drops the plugin), although torch's FSDP1 and FSDP2 both run on CPU with
gloo. :func:`enable` makes a CPU process group behave as a GPU one does under ``accelerate launch --use_fsdp``:
after ``AcceleratorState`` is built as ``MULTI_CPU`` with an FSDP plugin (the one ``transformers.Trainer`` builds
from ``TrainingArguments(fsdp=..., fsdp_config=...)``), the state's distributed type becomes
``FSDP`` and the plugin is kept, with the mixed-precision policy accelerate gives it on accelerator devices (bf16:
``param_dtype`` / ``reduce_dtype`` bfloat16, FSDP1 also ``buffer_dtype``, FSDP2 ``output_dtype``), so
``Accelerator.prepare`` wraps the model exactly as it would on GPUs. Nothing else of accelerate, TRL or oar is
changed. Used only by test worker scripts; never imported by oar.
"""

import torch


def enable() -> None:
    """Patches ``accelerate.state.AcceleratorState.__init__`` (idempotent). FSDP1's ``sync_module_states`` needs
    an accelerator device: set it false in ``fsdp_config`` (the tests build the same weights on every rank)."""
    from accelerate import state
    from accelerate.utils import DistributedType

    if getattr(state.AcceleratorState.__init__, "_oar_cpu_fsdp", False):
        return
    orig = state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        orig(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":  # FSDP's own mixed-precision policy, as accelerate sets it on GPUs
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            state.PartialState._shared_state["distributed_type"] = self.distributed_type  # as accelerate does

    init._oar_cpu_fsdp = True
    state.AcceleratorState.__init__ = init

    # accelerate passes device_id=accelerator.device ("cpu") to FSDP1; torch's FSDP1 normalizes it to "cpu:0" and
    # then refuses it against its compute device "cpu" (a comparison that only indexed devices pass).
    from torch.distributed.fsdp import _init_utils

    get_compute_device = _init_utils._get_compute_device

    def compute_device(module, ignored_params, device_from_device_id, *args, **kwargs):
        if device_from_device_id is not None and device_from_device_id.type == "cpu":
            device_from_device_id = None
        return get_compute_device(module, ignored_params, device_from_device_id, *args, **kwargs)

    _init_utils._get_compute_device = compute_device
