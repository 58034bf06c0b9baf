"""Worker script of tests/python/integrations/test_trl_fsdp.py's ZeRO-3 test (not a test module): run by
``accelerate launch --use_deepspeed --num_processes 2`` with ``DS_ACCELERATOR=cpu`` (DeepSpeed's CPU accelerator,
gloo when oneccl is absent) and ``GRPOConfig(deepspeed={ZeRO stage 3})``.

``trl_zero3_process.py OUT_DIR PRECISION``: the same step as ``trl_fsdp_process.py`` (its model, prompts, rewards,
configs, TRL defaults and records), with the policy partitioned by ZeRO-3 instead of FSDP, and DeepSpeed's ``bf16`` /
``fp16`` left to the trainer ("auto": bf16 under GRPOConfig's default ``bf16=True``): one optimizer step of
OARGRPOTrainer per method (``oar_g``, ``oar_p``); each rank saves what it attributed and computed to
``<out_dir>/rank<k>.pt``.
"""

import os
import sys

import torch

import trl_fsdp_process as base

ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                               "stage3_prefetch_bucket_size": 0, "reduce_bucket_size": 1000},
         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "bf16": {"enabled": "auto"},
         "fp16": {"enabled": "auto"}}


def main(out_dir: str, precision: str) -> None:
    res = {m: base.run(m, None, out_dir, precision, deepspeed=ZERO3) for m in ("oar_g", "oar_p")}
    torch.save(res, f"{out_dir}/rank{res['oar_g']['process_index']}.pt")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
