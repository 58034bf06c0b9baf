"""Sampling completions from a causal LM and measuring a task's accuracy (pass@1 over samples).

Plain ``model.generate``, batched with left padding: enough for evaluation (:func:`heldout_accuracy`, greedy) and for
measuring whether a task has the reward variance GRPO needs (sampled :func:`generate_completions` scored with
``task.reward``, as the arithmetic levels were tuned). Imports torch, so ``oar.app.tasks`` does not import this module
eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from oar.app.tasks.base import Problem, Task, chat_prompt_ids

__all__ = ["generate_completions", "heldout_accuracy", "HeldoutResult"]


def generate_completions(
    model: Any,
    tokenizer: Any,
    messages: list[list[dict[str, str]]],
    *,
    num_samples: int = 1,
    temperature: float = 0.8,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 96,
    batch_size: int = 64,
    seed: int = 0,
) -> list[list[str]]:
    """Sample ``num_samples`` completions for each chat in ``messages``.

    Args:
        model, tokenizer: a causal LM and its tokenizer (left padding is forced for the call).
        messages: one list of chat messages per prompt (``Task.prompt``).
        num_samples: completions per prompt (the GRPO group size when estimating reward variance).
        temperature: sampling temperature; 0 means greedy decoding.
        top_p, top_k, max_new_tokens: as in ``transformers`` generation; ``top_k=0`` (default)
            disables top-k filtering, as GRPO trainers sample (transformers' own default is 50).
        batch_size: sequences per ``generate`` call (prompts x samples are flattened).
        seed: ``torch.manual_seed`` applied before generation, inside a forked RNG state.

    Returns:
        ``out[i][j]``: the j-th completion of prompt i, decoded without special tokens.

    Raises:
        ValueError: ``num_samples``/``batch_size``/``max_new_tokens`` < 1 or ``temperature`` < 0.
    """
    for arg, v in (("num_samples", num_samples), ("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{arg} must be a positive int, got {v!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    flat = [t for t in texts for _ in range(num_samples)]
    device = next(model.parameters()).device
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    outs: list[str] = []
    gen_kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    if temperature > 0:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    else:
        gen_kwargs.update(do_sample=False)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(seed)
            for start in range(0, len(flat), batch_size):
                enc = tokenizer(
                    flat[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
                ).to(device)
                gen = model.generate(**enc, **gen_kwargs)
                new = gen[:, enc["input_ids"].shape[1] :]
                outs.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = old_side
    return [outs[i * num_samples : (i + 1) * num_samples] for i in range(len(messages))]


@dataclass
class HeldoutResult:
    """Result of :func:`heldout_accuracy`.

    Attributes:
        accuracy: fraction of problems answered correctly (greedy decoding, the task's verifier).
        correct: (N,) list of 0/1 per problem, in the order of ``problems`` (paired comparisons use it).
        problem_ids: the problems' ids, same order.
        seconds: wall time of the evaluation.
    """

    accuracy: float
    correct: list[int]
    problem_ids: list[str]
    seconds: float

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "n": len(self.correct), "correct": self.correct,
                "problem_ids": self.problem_ids, "seconds": self.seconds}


def heldout_accuracy(task: Task, problems: list[Problem], model: Any, tokenizer: Any, *, max_new_tokens: int = 96,
                     batch_size: int = 32) -> HeldoutResult:
    """Greedy accuracy of ``model`` on ``problems`` (held-out: never in the training set), one sample each (a tool
    task's, ``task.tool``, as calculator sessions: ``oar.app.tasks.tools.run_sessions``).

    The model is put in eval mode for the call and returned to its previous mode; the global RNG is
    untouched (greedy decoding draws nothing). Deterministic for a given model, problems and machine.

    Raises:
        ValueError: empty ``problems``, ``max_new_tokens`` or ``batch_size`` < 1.
    """
    import time

    if not problems:
        raise ValueError("problems must not be empty")
    was_training = bool(getattr(model, "training", False))
    t0 = time.perf_counter()
    model.eval()
    try:
        if getattr(task, "tool", False):  # tool sessions (the calculator), greedy
            from oar.app.tasks.tools import run_sessions

            ids = [chat_prompt_ids(tokenizer, task.prompt(p)) for p in problems]
            comps = [[s.text] for s in run_sessions(model, tokenizer, ids, max_calls=task.max_calls,
                                                     max_new_tokens=max_new_tokens, temperature=0.0,
                                                     batch_size=batch_size)]
        else:
            comps = generate_completions(model, tokenizer, [task.prompt(p) for p in problems], num_samples=1,
                                         temperature=0.0, max_new_tokens=max_new_tokens, batch_size=batch_size)
    finally:
        if was_training:
            model.train()
    correct = [int(task.reward(c[0], p) > 0.5) for c, p in zip(comps, problems)]
    return HeldoutResult(sum(correct) / len(correct), correct, [p.id for p in problems], time.perf_counter() - t0)
