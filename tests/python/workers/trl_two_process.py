"""Worker script of tests/python/integrations/test_trl_multiprocess.py (not a test module: run by ``accelerate launch
--multi_gpu --num_processes 2`` with ``use_cpu=True``, i.e. two CPU processes on the gloo backend).

One optimizer step of OARGRPOTrainer per method on a tiny random Llama, with ONE group of 8 completions split
4 / 4 across the two processes, so that group statistics are only right when computed over the gathered
batch. Each rank saves what it saw to ``<out_dir>/rank<k>.pt``.
"""

import functools
import os
import sys

import torch
import trl
from datasets import Dataset

import oar
from oar.integrations.trl import OARGRPOTrainer
from oar.testing import tiny_random_llama


def reward_digits(prompts, completions, answer, **kw):
    out = []
    for c, a in zip(completions, answer):
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(float(sum(ch in text for ch in a)) / len(a) + 0.1 * (len(text) % 3))
    return out


def run(method: str, out_dir: str) -> dict:
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}?"}], "answer": str(a + b)}
                            for a, b in [(1, 2), (3, 4)]])
    args = trl.GRPOConfig(output_dir=out_dir, per_device_train_batch_size=4, num_generations=8,
                          max_completion_length=12, max_steps=1, learning_rate=1e-3, report_to="none",
                          save_strategy="no", logging_steps=1, use_cpu=True, seed=0, temperature=1.0,
                          disable_tqdm=True, bf16=False)  # TRL's bf16 default would autocast the CPU
    # The tiny random model rarely stops early, so every rank would plan the same number of OAR-P chunks; a
    # per-rank chunk cap stands in for the unequal plans that unequal lengths and memory budgets produce.
    cap = 3 if int(os.environ.get("RANK", "0")) == 0 else 7
    cfg = oar.OARConfig.from_json(f'{{"method": "{method}", "max_variants_per_chunk": {cap}}}')
    trainer = OARGRPOTrainer(model=model, reward_funcs=[reward_digits], args=args, train_dataset=ds,
                             processing_class=tok, oar_config=cfg)
    rec: dict = {}

    # Count every policy forward run during attribution (the hook's compute), not the training ones.
    inner = trainer.accelerator.unwrap_model(trainer.model)
    orig_forward = inner.forward
    counter = {"on": False, "n": 0}

    @functools.wraps(orig_forward)
    def counting(*a, **k):
        if counter["on"]:
            counter["n"] += 1
        return orig_forward(*a, **k)

    inner.forward = counting
    orig_compute = trainer.oar_pipeline.compute

    def compute(*a, **k):
        counter["on"] = True
        try:
            return orig_compute(*a, **k)
        finally:
            counter["on"] = False

    trainer.oar_pipeline.compute = compute
    base = trl.GRPOTrainer._generate_and_score_completions

    def spy(self, inputs):
        out = base(self, inputs)
        rec["seq_adv"] = out["advantages"].detach().clone()
        rec["completion_ids"] = out["completion_ids"].detach().clone()
        rec["completion_mask"] = out["completion_mask"].detach().clone()
        return out

    trl.GRPOTrainer._generate_and_score_completions = spy
    orig_gen = trainer._generate_and_score_completions

    def gen(inputs):
        out = orig_gen(inputs)
        rec["tok_adv"] = out["advantages"].detach().clone()
        rec["rewards_all"] = trainer._oar_rewards.detach().clone()
        m = trainer._metrics["train"]  # this rank's values (logging clears them after the step)
        rec["forward_passes"] = m["oar/forward_passes"][-1]
        rec["padding_forwards"] = m["oar/padding_forwards"][-1]
        return out

    trainer._generate_and_score_completions = gen
    try:
        trainer.train()
    finally:
        trl.GRPOTrainer._generate_and_score_completions = base
    rec.update(attribution_forwards=counter["n"], process_index=trainer.accelerator.process_index, num_processes=trainer.accelerator.num_processes,
               eos=tok.eos_token_id, pad=tok.pad_token_id)
    return rec


def main(out_dir: str) -> None:
    res = {m: run(m, out_dir) for m in ("oar_p", "ktae")}
    rank = res["oar_p"]["process_index"]
    torch.save(res, f"{out_dir}/rank{rank}.pt")
    if torch.distributed.is_initialized():  # not left to the interpreter's exit (see trl_fsdp_process.py)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
