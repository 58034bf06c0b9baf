"""The prompt-once clean pass of the OAR-P engines (docs/design.md, "Prompt-once clean pass"): rollouts of a group
share their prompt, so the clean pass runs each distinct prompt once and every row's remaining columns on its
cache. The scores stay within the float32 error model of the float64 model's (rule 1, _tolerance.py) on both
engines that keep a clean cache (prefix OAR-P, windowed OAR-P), and the tokens it saves are exactly the repeated
prompt columns.
"""

from __future__ import annotations

import pytest
import torch

from oar.testing import tiny_random_llama
from oar.attribution import HFProbeModel, ProbeContextBuilder, oar_p_scores, oar_p_window_scores, planner
from oar.attribution.model import probe_capabilities

from _error_model import oar_p_error_bound, oar_p_window_error_bound
from _tolerance import assert_within_error_model

CONCLUDE = "\nTherefore, the final answer is \\boxed{"


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, tokenizer="minimal",
                                   seed=3)
    with torch.no_grad():  # sharpen the near-uniform random model (divergences O(1e-2 .. 1), as test_attribution)
        for prm in model.parameters():
            if prm.dim() > 1:
                prm.mul_(6.0)
    model.eval()
    return model, tok


def _groups(tok):
    """Two groups and a lone rollout: group A (short prompt) with three responses of different lengths, the longest
    context of the batch among them (so the shared prefix p is A's prompt and group B's longer prompt runs partly in
    the suffix), group B with two, C alone."""
    prompts = {"A": "Q: 2+13?", "B": "Q: 7-4? be brief", "C": "Q: 9*2?"}
    rollouts = [("A", "2+13 is 15, so 15", "15"), ("A", "15", "15"), ("B", "it is 3", "3"), ("A", "13+2=15", "15"),
                ("B", "3", "3"), ("C", "18", "18")]
    pids = [tok.encode(prompts[g], add_special_tokens=False) for g, _, _ in rollouts]
    rids = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for _, r, _ in rollouts]
    return pids, rids, [a for _, _, a in rollouts]


def _expected_saving(batch) -> tuple[int, int]:
    """(tokens saved, distinct prompts) by the layout's definition, computed here from the batch: every row's prompt
    after the first of its kind is not re-run over its first p columns, p = min(first response column, longest
    prompt)."""
    T = batch.input_ids.shape[1]
    prompts, starts = [], []
    for r in range(batch.batch_size):
        a, s = T - int(batch.context_len[r]), int(batch.reasoning_start[r])
        prompts.append(tuple(batch.input_ids[r, a:s].tolist()))
        starts.append(s)
    p = min(min(starts), max(len(x) for x in prompts))
    distinct = len(set(prompts))
    return (batch.batch_size - distinct) * p, distinct


def _pair(model):
    on, off = HFProbeModel(model), HFProbeModel(model)
    off.prompt_once_clean_pass = False
    assert probe_capabilities(on).prefix_extend and not probe_capabilities(off).prefix_extend
    return on, off


@pytest.fixture(scope="module")
def groups(tiny):
    """(probe batch of :func:`_groups`, its exact OAR-P scores with float32 error bounds)."""
    model, tok = tiny
    batch = ProbeContextBuilder(tok, CONCLUDE).build(*_groups(tok))
    return batch, oar_p_error_bound(model, batch)


def test_layout_shares_a_short_prompt_and_runs_the_rest_of_a_longer_one(tiny, groups):
    """The batch exercises both cases of the layout: rows whose whole prompt is cached and rows whose longer prompt
    runs partly in the suffix."""
    batch, _ = groups
    T = batch.input_ids.shape[1]
    plen = [int(batch.reasoning_start[r]) - (T - int(batch.context_len[r])) for r in range(batch.batch_size)]
    p = min(min(int(s) for s in batch.reasoning_start), max(plen))
    assert min(plen) <= p < max(plen)


def test_prefix_engine_prompt_once_matches_float64(tiny, groups):
    model, _ = tiny
    batch, exact = groups
    on, off = _pair(model)
    got = oar_p_scores(on, batch, engine="prefix")
    ref = oar_p_scores(off, batch, engine="prefix")
    W = exact.value.shape[1]
    assert_within_error_model(got.scores[:, :W], exact, what="prompt-once")
    assert_within_error_model(ref.scores[:, :W], exact, what="plain clean pass")
    assert torch.equal(got.mask, ref.mask)
    saved, _ = _expected_saving(batch)
    assert saved > 0
    assert ref.stats["tokens"] - got.stats["tokens"] == saved
    assert got.stats["forward_passes"] == ref.stats["forward_passes"] + 1  # the distinct prompts' own forward


@pytest.mark.parametrize("window", [1])
def test_window_engine_prompt_once_matches_float64(tiny, window):
    model, tok = tiny
    batch = ProbeContextBuilder(tok, CONCLUDE).build(*_groups(tok))
    on, off = _pair(model)
    got = oar_p_window_scores(on, batch, window=window)
    ref = oar_p_window_scores(off, batch, window=window)
    exact = oar_p_window_error_bound(model, batch, window)
    W = exact.value.shape[1]
    assert_within_error_model(got.scores[:, :W], exact, what=f"prompt-once window {window}")
    assert_within_error_model(ref.scores[:, :W], exact, what=f"plain window {window}")
    assert ref.stats["tokens"] - got.stats["tokens"] == _expected_saving(batch)[0]


def test_prompt_once_across_chunks_and_without_sharing(tiny, groups):
    """A budget that cuts the clean pass into several chunks (prompts shared only within a chunk count), and a
    batch without a shared prompt (the plain pass, no extra forward)."""
    model, tok = tiny
    pids, rids, answers = _groups(tok)
    batch, exact = groups
    on, off = _pair(model)
    on.bytes_per_element = off.bytes_per_element = 8  # twice as wide in memory: three rows per 1 MiB chunk
    assert len(planner.plan_clean(on, batch, batch.batch_size, planner.budget_bytes(1), prompt_once=True)) == 2
    got = oar_p_scores(on, batch, engine="prefix", memory_budget_mb=1)
    # chunk 1 = rows 0-2 (two of group A share), chunk 2 = rows 3-5 (no prompt shared): one extra forward
    plain = oar_p_scores(off, batch, engine="prefix", memory_budget_mb=1)
    assert got.stats["forward_passes"] == plain.stats["forward_passes"] + 1
    assert_within_error_model(got.scores[:, :exact.value.shape[1]], exact, what="prompt-once, 1 MiB chunks")
    lone = ProbeContextBuilder(tok, CONCLUDE).build([pids[0], pids[2], pids[5]], [rids[0], rids[2], rids[5]],
                                                    [answers[0], answers[2], answers[5]])
    a, b = oar_p_scores(on, lone, engine="prefix"), oar_p_scores(off, lone, engine="prefix")
    assert a.stats["tokens"] == b.stats["tokens"] and a.stats["forward_passes"] == b.stats["forward_passes"]
    assert torch.equal(a.scores, b.scores)  # the same plain pass: the same operations on the same data
