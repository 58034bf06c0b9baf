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
