"""Shared test helper: right-padded completion batches for the hook / functional-API tests."""

import torch


def completion_batch(tok, texts, C: int, prompt: str = "Q: 2+3?", eos: bool = True):
    """(prompt ids per row, completion ids (B, C) padded with pad_token_id, completion mask (B, C) int64) for
    `texts`, each encoded without special tokens, terminated by EOS when `eos`, cut to C tokens."""
    ids = torch.full((len(texts), C), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(texts), C), dtype=torch.long)
    for i, t in enumerate(texts):
        e = (tok.encode(t, add_special_tokens=False) + ([tok.eos_token_id] if eos else []))[:C]
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    return [tok.encode(prompt, add_special_tokens=False)] * len(texts), ids, mask


def token_rollouts(tok, rollouts, sequence_advantages, group_size: int):
    """A ``RolloutBatch`` of rollouts given as token lists: ``rollouts`` holds dicts with ``prompt``,
    ``completion`` (token ids, observations of multi-turn rollouts included), ``eligible`` (0/1 per completion
    token) and ``label`` (the reference answer); completions right-padded with ``pad_token_id`` to the longest;
    groups of ``group_size`` consecutive rows."""
    from oar.batch import RolloutBatch

    B = len(rollouts)
    C = max(len(t["completion"]) for t in rollouts)
    ids = torch.full((B, C), tok.pad_token_id)
    cmask = torch.zeros((B, C), dtype=torch.bool)
    elig = torch.zeros((B, C), dtype=torch.bool)
    for i, t in enumerate(rollouts):
        L = len(t["completion"])
        ids[i, :L] = torch.tensor(t["completion"])
        cmask[i, :L] = True
        elig[i, :L] = torch.tensor(t["eligible"], dtype=torch.bool)
    return RolloutBatch(ids, cmask, prompt_ids=[t["prompt"] for t in rollouts], eligible_mask=elig,
                        group_ids=[i // group_size for i in range(B)], answers=[t["label"] for t in rollouts],
                        sequence_advantages=sequence_advantages)
