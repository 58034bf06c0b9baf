"""verl's padded rollout layout (docs/trainers/verl.md): the rollouts of a ``DataProto`` as the OAR pipeline reads
them, and per-token scores attached to one. Imports nothing of verl (it reads the ``DataProto`` it is given).
"""

from __future__ import annotations

import torch

from oar.batch import check_scores
from oar.methods import method_spec


def response_masks(b, R: int, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(completion_mask, eligible_mask)``, both (B, R) bool CPU, of a verl batch ``b`` (``TensorDict`` with
    ``attention_mask`` (B, P + R), or None): every response token (the attention mask's response part, tool
    outputs of multi-turn rollouts included: they are part of the context) and the tokens that carry the loss
    (``response_mask`` (B, R) 0/1, which excludes tool outputs)."""
    eligible = response_mask.detach().bool().cpu()
    attn = b["attention_mask"] if b is not None and "attention_mask" in b.keys() else None
    completion = attn[:, -R:].detach().bool().cpu() | eligible if attn is not None else eligible
    return completion, eligible


def attach_scores(data, scores: torch.Tensor, reasoning_mask: torch.Tensor,
                  turn_weights: torch.Tensor | None = None) -> None:
    """Attaches per-token importance scores to a verl ``DataProto`` (``batch["oar_scores"]``, ``["oar_reasoning_mask"]``,
    and ``["oar_turn_weights"]`` when given).

    Args:
        data: ``verl.DataProto`` with ``batch["responses"]`` (B, R).
        scores: (B, R) real, >= 0 on the reasoning mask (raw importance; normalized by the reshaping).
        reasoning_mask: (B, R) bool, the scored reasoning tokens.
        turn_weights: optional (B, R) real, >= 0: the turn weights of multi-turn rows that came with the scores
            (``oar.TokenScores.turn_weights``, docs/method.md section 13); checked by the estimator's pipeline.

    Raises:
        ValueError: shapes that are not the responses' (B, R), tensors on the meta device, complex or bool
            scores, a reasoning_mask that is not bool or 0/1, scores that are NaN/Inf or < 0 on the reasoning mask.
        KeyError: ``data`` without ``batch["responses"]``.
    """
    batch = getattr(data, "batch", None)
    if batch is None or "responses" not in batch.keys():
        raise KeyError(f"data must be a verl DataProto with batch['responses'] (B, R), got {type(data).__name__}"
                       + ("" if batch is None else f" with batch keys {sorted(batch.keys())}"))
    # (B, R): the shape of batch['responses']
    s, rm = check_scores(scores, reasoning_mask, "(B, R)", tuple(batch["responses"].shape))
    data.batch["oar_scores"] = s.to(scores.device)
    data.batch["oar_reasoning_mask"] = rm.to(scores.device)
    if turn_weights is not None:
        from oar import _args

        tw = _args.real_arg("turn_weights", turn_weights, "(B, R)", tuple(batch["responses"].shape))
        data.batch["oar_turn_weights"] = tw.detach().float().to(scores.device)


#: What a verl user changes when a reference answer is not a final answer (named by the refusals).
ANSWER_FIX = ("put the final answer alone in reward_model.ground_truth, as verl's data preprocessing scripts do (e.g. "
              "examples/data_preprocess/gsm8k.py extracts the number after '####'; a subclass of the OAR trainer "
              "can read another field through its oar_answer_key)")


def rollout_rows(data, config, answer_key: tuple[str, str] = ("reward_model", "ground_truth")) -> dict:
    """The rollouts of a verl ``DataProto`` in verl's padded layout, as the pipeline reads them.

    Args:
        data: ``verl.DataProto`` with ``batch["prompts"]`` (B, P) left-padded, ``["responses"]`` (B, R)
            right-padded, ``["attention_mask"]`` (B, P + R), ``["response_mask"]`` (B, R) and, for methods that need
            reference answers, ``non_tensor_batch[answer_key[0]][i][answer_key[1]]``.
        config: ``oar.OARConfig`` (its method decides whether answers are needed).

    Returns:
        ``{"prompt_ids": B 1-D int64 tensors (unpadded), "responses": (B, R) int64, "completion_mask": (B, R) bool,
        "eligible_mask": (B, R) bool, "answers": B str or None}``, all on the CPU.

    Raises:
        KeyError: a missing batch key, or answers missing for ``oar_p`` / ``oar_g`` (naming the rows).
        ValueError: no ``non_tensor_batch[answer_key[0]]`` for a method that needs answers; an answer that is not a
            final answer (a worked solution: :func:`oar.answers.check_reference_answer`, naming the row).
    """
    b = data.batch
    for key in ("prompts", "responses", "attention_mask", "response_mask"):
        if key not in b.keys():
            raise KeyError(f"data.batch must hold {key!r} (verl's padded rollout layout), got keys {sorted(b.keys())}")
    responses = b["responses"].detach().cpu()
    R = responses.shape[1]
    completion, eligible = response_masks(b, R, b["response_mask"])
    P = b["prompts"].shape[1]
    pmask = b["attention_mask"][:, :P].bool().cpu()
    prompt_ids = [row[m] for row, m in zip(b["prompts"].detach().cpu(), pmask)]
    answers = None
    if method_spec(config.method).needs_answers:
        k0, k1 = answer_key
        if k0 not in data.non_tensor_batch:
            raise ValueError(f"method {config.method!r} needs the reference answers in non_tensor_batch[{k0!r}]"
                             f"[i][{k1!r}] (answer_key=... to change)")
        raw = [x.get(k1) if isinstance(x, dict) else x for x in data.non_tensor_batch[k0]]
        missing = [i for i, x in enumerate(raw) if x is None]
        if missing:
            raise KeyError(f"method {config.method!r} needs the reference answers in non_tensor_batch[{k0!r}]"
                           f"[i][{k1!r}]; rows {missing[:5]} have none (answer_key=... to change)")
        from oar.answers import answer_text, check_reference_answer

        column = f"{k0}.{k1}"
        answers = [check_reference_answer(answer_text(x, column=column, row=i, fix=ANSWER_FIX), column=column,
                                          row=i, fix=ANSWER_FIX) for i, x in enumerate(raw)]
    return dict(prompt_ids=prompt_ids, responses=responses, completion_mask=completion, eligible_mask=eligible,
                answers=answers)
