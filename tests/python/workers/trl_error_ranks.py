"""Worker of tests/python/integrations/test_trl.py's error tests (not a test module): ``python trl_error_ranks.py
SCENARIO OUT``.

Two gloo ranks (torch.multiprocessing, CPU) each run one ``_generate_and_score_completions`` of the OARGRPOTrainer
class built over a stand-in for ``trl.GRPOTrainer`` (:class:`StubGRPO`: TRL's hook points returning a fixed batch,
so no generation runs; the oar code under test is the real adapter, pipeline and forward gate). Rank 1's batch is
broken as SCENARIO says, rank 0's is fine:

- ``answer``: oar_p, rank 1's rows lack the reference answer (refused before the scoring, where rank 0 already
  waits in the forward gate);
- ``vocab``: oar_p, a completion token of rank 1 outside the vocabulary (refused inside the gate's scope);
- ``tool_mask``: grpo (no model pass, no gate), rank 1's ``tool_mask`` has the wrong shape.

Each rank writes what it ended with (``ok`` or ``ExceptionType: message``) to ``OUT/rank<k>.txt``. A gloo timeout
of 30 s turns a rank left waiting in a collective into an error instead of a hang.

``python trl_error_ranks.py rewards OUT``: the real ``trl.GRPOTrainer`` (OARGRPOTrainer, one ``train()`` step on a tiny
random Llama; accelerate initializes the gloo process group from the environment, ``ddp_timeout=30``), where a
reward function fails on rank 1 only, one scenario after the other in the same two processes (:data:`REWARD_SCENARIOS`):

- ``reward_raises``: oar_p, a sync reward function raises on rank 1 (rank 0 goes on to TRL's gather of the rewards);
- ``reward_count``: grpo, an async reward function returns one reward too few on rank 1.

Each rank writes ``OUT/<scenario>/rank<k>.txt`` (what ``train()`` ended with) and ``rank<k>.json`` (the wall-clock
time it ended, the type and message of the exception's ``__cause__``); rank 1's reward function writes the time it
failed to ``OUT/<scenario>/failed_at.txt``.
"""

import collections
import datetime
import json
import os
import socket
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import oar
from oar.testing import tiny_random_llama
from oar.integrations.trl import _make_trainer_class

G = 2  # num_generations: one group per rank


class StubGRPO:
    """``trl.GRPOTrainer``'s hook points (same signatures) over a fixed output dict and fixed rewards."""

    def __init__(self, model=None, processing_class=None, args=None, out=None, rank=0, **kwargs):
        self.model, self.processing_class, self.args = model, processing_class, args
        self.num_generations = G
        self.accelerator = types.SimpleNamespace(process_index=rank, unwrap_model=lambda m: m)
        self._metrics = {"train": collections.defaultdict(list)}
        self.reward_weights = torch.ones(1)
        self._out = out

    def _generate_and_score_completions(self, inputs):
        return dict(self._out)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return torch.zeros(len(inputs), 1)


def _batch(tok, rank: int, scenario: str):
    texts = ["so 2 and 3 make 5 \\boxed{5}", "hmm 9 \\boxed{9}"] if rank == 0 else ["5 \\boxed{5}", "7 \\boxed{7}"]
    C = 16
    ids = torch.full((G, C), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((G, C), dtype=torch.long)
    for i, t in enumerate(texts):
        e = tok.encode(t, add_special_tokens=False)[: C - 1] + [tok.eos_token_id]
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    p = torch.tensor([tok.encode("Q?", add_special_tokens=False)] * G)
    out = {"prompt_ids": p, "prompt_mask": torch.ones_like(p), "completion_ids": ids, "completion_mask": mask,
           "advantages": torch.tensor([0.7, -0.7])}
    answers = ["5", "9"]
    if rank == 1 and scenario == "answer":
        answers = [None, None]
    if rank == 1 and scenario == "vocab":
        out["completion_ids"][0, 0] = 10**6
    if rank == 1 and scenario == "tool_mask":
        out["tool_mask"] = torch.ones((G, C + 1), dtype=torch.long)
    return out, [{"prompt": "Q?", "answer": a} for a in answers]


def _worker(rank: int, port: int, scenario: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    model.train()  # the adapter scores training batches only
    out, inputs = _batch(tok, rank, scenario)
    method = "grpo" if scenario == "tool_mask" else "oar_p"
    cls = _make_trainer_class(StubGRPO)
    trainer = cls(model=model, processing_class=tok, args=types.SimpleNamespace(loss_type="dapo"), out=out,
                  rank=rank, oar_config=oar.OARConfig.from_json(f'{{"method": "{method}", "seed": 1}}'))
    try:
        trainer._generate_and_score_completions(inputs)
        result = "ok"
    except Exception as e:  # noqa: BLE001 - what each rank ended with is the test's subject
        result = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(result)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a rank whose collective timed out may not tear down cleanly
        pass


#: scenario: (oar method, reward function name) of the ``rewards`` run.
REWARD_SCENARIOS = {"reward_raises": ("oar_p", "reward_raising"), "reward_count": ("grpo", "reward_wrong_count")}
#: What the failing reward function raises on rank 1.
REWARD_ERROR = "reward server unreachable from this rank"
_OUT = {"dir": None}


def _failed_now() -> None:
    with open(os.path.join(_OUT["dir"], "failed_at.txt"), "w") as f:
        f.write(repr(time.time()))


def _rewards(completions) -> list:
    return [float(len(c[-1]["content"] if isinstance(c, list) else c) % 3) for c in completions]


def reward_raising(prompts, completions, **kwargs):
    if dist.get_rank() == 1:
        _failed_now()
        raise ValueError(REWARD_ERROR)
    return _rewards(completions)


async def reward_wrong_count(prompts, completions, **kwargs):
    out = _rewards(completions)
    if dist.get_rank() == 1:
        _failed_now()
        return out[:-1]
    return out


def _reward_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", TOKENIZERS_PARALLELISM="false")
    import datasets
    import trl

    from oar.integrations.trl import OARGRPOTrainer

    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a}+{b}?"}], "answer": str(a + b)}
                                     for a, b in [(1, 2), (3, 4)]])
    for scenario, (method, func) in REWARD_SCENARIOS.items():
        _OUT["dir"] = os.path.join(out_dir, scenario)
        os.makedirs(_OUT["dir"], exist_ok=True)
        model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
        args = trl.GRPOConfig(output_dir=os.path.join(out_dir, "run"), per_device_train_batch_size=2,
                              num_generations=2, max_completion_length=8, max_steps=1, report_to="none",
                              save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, bf16=False,
                              gradient_checkpointing=False, ddp_timeout=30)
        trainer = OARGRPOTrainer(model=model, reward_funcs=[globals()[func]], args=args, train_dataset=ds,
                                 processing_class=tok, oar_config=oar.OARConfig.from_json(f'{{"method": "{method}"}}'))
        cause = None
        try:
            trainer.train()
            result = "ok"
        except Exception as e:  # noqa: BLE001 - what each rank ended with is the test's subject
            result = f"{type(e).__name__}: {e}"
            cause = None if e.__cause__ is None else [type(e.__cause__).__name__, str(e.__cause__)]
        ended = time.time()
        with open(os.path.join(_OUT["dir"], f"rank{rank}.txt"), "w") as f:
            f.write(result)
        with open(os.path.join(_OUT["dir"], f"rank{rank}.json"), "w") as f:
            json.dump({"ended_at": ended, "cause": cause}, f)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a rank whose collective timed out may not tear down cleanly
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if sys.argv[1] == "rewards":
        mp.spawn(_reward_worker, args=(_free_port(), sys.argv[2]), nprocs=2, join=True)
    else:
        mp.spawn(_worker, args=(_free_port(), sys.argv[1], sys.argv[2]), nprocs=2, join=True)
