"""Worker script of tests/python/integrations/test_trl_fsdp.py (not a test module): ``trl_fsdp_process.py VERSION
OUT_DIR PRECISION``, run by ``accelerate launch --multi_gpu --num_processes 2`` with ``use_cpu=True`` (two CPU
processes on gloo) and ``TrainingArguments(fsdp=...)``, with accelerate's FSDP plugin enabled on CPU by :mod:`_cpu_fsdp`
(the model is wrapped, and its mixed precision set, exactly as on GPUs).

One optimizer step of OARGRPOTrainer per method (``oar_g``, ``oar_p``) on a tiny random Llama under FSDP version
VERSION, with TRL's defaults: ``gradient_checkpointing`` and ``bf16`` not set in ``GRPOConfig`` (trl 1.13: both
True), except ``bf16=False`` when PRECISION is "float32" (a CPU without native bfloat16). Two prompts, four
completions each, one prompt's group per rank; the reward of the prompt whose answer is 7 is constant, so one rank
holds no row with a non-zero advantage and the other up to four: the ranks have different attribution work. Each
rank saves, per method, to ``<out_dir>/rank<k>.pt``: the batch it attributed (before any parameter update:
attribution runs between generation and the step's update), the scores and advantages it computed, the number of
policy forwards it ran during attribution, the element size the chunk planner read, the dtypes the first layer's
query projection computed in during attribution and during training, the number of activation-checkpointed layer
calls in training and in attribution, the trainer's ``bf16`` / ``gradient_checkpointing`` / accelerate mixed
precision, and whether TRL's step finished.
"""

import dataclasses
import os
import sys

import torch
import transformers.modeling_utils as mu
import trl
from datasets import Dataset

import oar
from oar.attribution import as_probe_model
from oar.integrations.trl import OARGRPOTrainer
from oar.testing import tiny_random_llama

# The shared test helper _cpu_fsdp, also when run as a script by accelerate launch.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
import _cpu_fsdp  # noqa: E402

PROMPTS = [(1, 2), (3, 4)]
#: "bf16": TRL's default (GRPOConfig bf16=True), on a CPU that runs bfloat16 natively; "float32": bf16=False.
PRECISIONS = ("bf16", "float32")
# sharpened (initializer_range 0.12): divergences (~1e-2) far above float32 rounding (rule 1 of _tolerance.py)
MODEL = dict(hidden_size=32, num_layers=2, num_heads=2, tokenizer="minimal", seed=0, initializer_range=0.12)


def reward(prompts, completions, answer, **kw):
    out = []
    for c, a in zip(completions, answer):
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(1.0 if a == "7" else float(sum(ch in text for ch in a)) / len(a) + 0.1 * (len(text) % 5))
    return out


def config(method: str) -> "oar.OARConfig":
    # sigma 0.05: OAR-G scores well above float32 rounding on this tiny model. A 1 MB budget: one OAR-G row / a
    # few OAR-P variants per forward, so the active rank runs many forwards.
    return oar.OARConfig.from_json(f'{{"method": "{method}", "seed": 3, "memory_budget_mb": 1, "sigma": 0.05, '
                                   f'"max_variants_per_chunk": 4}}')


def run(method: str, version: int | None, out_dir: str, precision: str, deepspeed: dict | None = None) -> dict:
    """One step of ``method`` under FSDP ``version`` (1 or 2), or under the DeepSpeed config ``deepspeed``
    (``version`` None; trl_zero3_process.py), with TRL's defaults: gradient checkpointing on, and ``bf16`` left to
    GRPOConfig (on) when ``precision`` is "bf16", set False (float32) when it is "float32"."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    model, tok = tiny_random_llama(**MODEL)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}?"}], "answer": str(a + b)}
                            for a, b in PROMPTS])
    args = trl.GRPOConfig(output_dir=out_dir, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=12, max_steps=1, learning_rate=1e-3, report_to="none",
                          save_strategy="no", logging_steps=1, use_cpu=True, seed=0, temperature=1.0,
                          disable_tqdm=True, **({} if precision == "bf16" else dict(bf16=False)),
                          **(dict(deepspeed=deepspeed) if deepspeed is not None else dict(
                              fsdp="full_shard auto_wrap",
                              fsdp_config={"version": version, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                           "sync_module_states": "false"})))
    trainer = OARGRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=ds,
                             processing_class=tok, oar_config=config(method))
    rec: dict = {"forwards": 0, "checkpointed": 0, "checkpointed_in_attribution": 0, "dtypes": set(),
                 "train_dtypes": set()}
    counting = {"on": False}

    def count(module, args, kwargs):
        if counting["on"]:
            rec["forwards"] += 1

    def compute_dtype(module, args, output):  # a projection's output: bf16 under autocast or bf16 parameters
        rec["dtypes" if counting["on"] else "train_dtypes"].add(str(output.dtype))

    model.register_forward_pre_hook(count, with_kwargs=True)  # the HF module inside every wrapper
    # (not the LM head: the probe computes its logits in float32 whatever the compute dtype)
    model.model.layers[0].self_attn.q_proj.register_forward_hook(compute_dtype)
    # transformers' activation checkpointing calls torch's checkpoint through this module-level name when it is
    # turned on (Trainer.train, from GRPOConfig's gradient_checkpointing): count the checkpointed layer calls.
    checkpoint = mu.checkpoint

    def counted_checkpoint(*a, **k):
        rec["checkpointed_in_attribution" if counting["on"] else "checkpointed"] += 1
        return checkpoint(*a, **k)

    mu.checkpoint = counted_checkpoint
    orig_compute = trainer.oar_pipeline.compute

    def compute(batch, policy=None):
        rec["policy"] = type(policy).__name__
        # the element size the chunk planner reads (autocast dtype, else the parameters'): the single-process
        # reference plans its chunks, and so draws OAR-G's noise, the same way
        rec["element_size"] = as_probe_model(policy).element_size()
        counting["on"] = True
        try:
            res = orig_compute(batch, policy)
        finally:
            counting["on"] = False
        rec["batch"] = {k: v for k, v in dataclasses.asdict(batch).items()}
        rec.update(scores=res.scores.detach().clone(), advantages=res.advantages.detach().clone())
        return res

    trainer.oar_pipeline.compute = compute
    try:
        trainer.train()
    finally:
        mu.checkpoint = checkpoint
    rec.update(bf16=bool(trainer.args.bf16), gradient_checkpointing=bool(trainer.args.gradient_checkpointing),
               mixed_precision=str(trainer.accelerator.mixed_precision))
    params = list(model.parameters())
    rec.update(ds_partitioned=sum(hasattr(p, "ds_id") and p.data.numel() == 0 for p in params), n_params=len(params))
    rec.update(process_index=trainer.accelerator.process_index,
               distributed_type=str(trainer.accelerator.distributed_type),
               wrapped=type(trainer.model_wrapped).__name__, finished=trainer.state.global_step == 1)
    return rec


def main(version: int, out_dir: str, precision: str) -> None:
    _cpu_fsdp.enable()
    res = {m: run(m, version, out_dir, precision) for m in ("oar_g", "oar_p")}
    torch.save(res, f"{out_dir}/rank{res['oar_g']['process_index']}.pt")
    # End the process group before the interpreter exits: torn down at exit with gloo's threads still running, a
    # rank once aborted ("terminate called without an active exception") after finishing its work.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
    # The results are saved: leave without the interpreter's teardown, whose static destructors still aborted a rank
    # of a loaded 2-core machine once after destroy_process_group ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
