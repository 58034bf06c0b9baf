"""Shared test helper: right-padded completion batches for the hook / functional-API tests, the rollouts of the
attribution tests and the tool-call batch of the eligible-mask tests."""

import torch

#: The conclude string of the attribution tests' probe contexts.
CONCLUDE = "\nTherefore, the final answer is \\boxed{"
#: A response with a tool output (``[tool: ...]``) that is context, never scored.
TOOL_TEXT = "so 2 and 3 [tool: 5] make 5 \\boxed{5}"


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


def probe_rollouts(tok):
    """(prompt ids, response ids ending in EOS, answers) of three rollouts of two prompts (rows 0 and 2 share one)."""
    prompts = ["Q: 2+13?", "Q: what is 7-4? be brief"]
    responses = ["2 plus 13 is 15. \\boxed{15}", "seven minus four gives 3 #### 3", "it is 15"]
    answers = ["15", "3", "15"]
    pids = [tok.encode(prompts[0], add_special_tokens=False), tok.encode(prompts[1], add_special_tokens=False),
            tok.encode(prompts[0], add_special_tokens=False)]
    rids = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for r in responses]
    return pids, rids, answers


def tool_batch(tok, C=48):
    """(prompts, ids, mask, eligible) of four responses, three with a tool output, whose ``[tool: ...]`` columns
    are outside the eligible mask (character-level tokenizer: column = character)."""
    texts = [TOOL_TEXT, "hmm 9 [tool: 9] then \\boxed{9}", "4 4 [tool: 8] \\boxed{8}", "5 \\boxed{5}"]
    prompts, ids, mask = completion_batch(tok, texts, C)
    eligible = mask.bool().clone()
    for i, t in enumerate(texts):
        a = t.find("[tool:")
        if a >= 0:
            eligible[i, a: t.index("]") + 1] = False  # character-level tokenizer: column = character
    return prompts, ids, mask, eligible
