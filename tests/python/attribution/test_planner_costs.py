"""The planner's cost model describes the model that runs (issue 23): element size from autocast / parameters /
``bytes_per_element``, the attention term from ``config._attn_implementation``; the 4-D-mask check before any
forward; OAR-G's activation checkpointing (same scores, no parameter .grad); what the planner declares outside
chunks. Fast tests on a tiny model; the peak-memory measurement is test_memory_budget.py."""

from __future__ import annotations

import logging

import pytest
import torch

from oar.testing import tiny_random_llama
from oar.attribution import HFProbeModel, oar_g_scores, oar_p_window_scores, planner
from oar.attribution.context import ProbeContextBuilder
from oar.attribution.model import DENSE_MASK_ATTENTION, probe_capabilities

CONCLUDE = "\nAnswer: \\boxed{"


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, tokenizer="minimal",
                                   seed=0, initializer_range=0.12)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (n,), generator=g).tolist() for n in (6, 9)]
    responses = [torch.randint(4, 100, (n,), generator=g).tolist() for n in (24, 17)]
    batch = ProbeContextBuilder(tok, CONCLUDE).build(prompts, responses, ["12", "3"], reasoning_lens=[24, 17])
    return model, batch


def test_element_size_follows_autocast_parameters_and_the_override(tiny):
    model, _ = tiny
    pm = HFProbeModel(model)
    kv_dim = 2 * (32 // 4)  # kv_heads x head_dim
    assert pm.element_size() == 4 and pm.kv_bytes_per_token() == 2 * kv_dim * (4 + 4)
    fwd32 = pm.activation_bytes_per_token(100)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert pm.element_size() == 2
        # keys stay float32 (rotary tables of the float32 parameters), values are bf16
        assert pm.cache_key_element_size() == 4 and pm.kv_bytes_per_token() == 2 * kv_dim * (4 + 2)
        assert pm.activation_bytes_per_token(100) < fwd32
    assert pm.element_size() == 4  # read at planning time, not at construction
    forced = HFProbeModel(model, bytes_per_element=2)  # FSDP2 mixed precision: float32 parameters, bf16 compute
    assert forced.element_size() == 2 and forced.kv_bytes_per_token() == 2 * kv_dim * (2 + 2)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"bytes_per_element must be None \(read from the model\) or an int >= 1"):
            HFProbeModel(model, bytes_per_element=bad)


def test_attention_term_follows_the_implementation(tiny):
    model, _ = tiny
    pm = HFProbeModel(model)
    old = model.config._attn_implementation
    try:
        cost = {}
        for impl in ("eager", "sdpa", "flash_attention_2", "my_custom_kernel"):
            model.config._attn_implementation = impl
            assert pm.attn_implementation == impl
            cost[impl] = [pm.activation_bytes_per_token(w) for w in (1000, 2000)]
        heads, bpe = 4, 4
        # eager: float32 softmax + its copy per head, and the additive mask, per key: 4 x (4 + 4) + 4 = 36 B/key
        assert cost["eager"][1] - cost["eager"][0] == 1000 * (heads * (4 + bpe) + bpe)
        assert cost["my_custom_kernel"] == cost["eager"]  # unknown names: conservatively eager
        assert cost["sdpa"][1] - cost["sdpa"][0] == 1000 * (1 + bpe)  # the bool mask and the kernel's float copy
        assert cost["flash_attention_2"][0] == cost["flash_attention_2"][1]  # 2-D masks: nothing per key
        assert cost["flash_attention_2"][0] < cost["sdpa"][0] < cost["eager"][0]
    finally:
        model.config._attn_implementation = old


def test_windowed_engine_refuses_flash_attention_before_any_forward(tiny):
    model, batch = tiny
    pm = HFProbeModel(model)
    pm.shared_prefix_attention = False  # the cached path with one 4-D mask (what GPUs run)
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    old = model.config._attn_implementation
    try:
        model.config._attn_implementation = "flash_attention_2"  # not installed here: never called
        caps = probe_capabilities(pm)
        assert (caps.attn_implementation, caps.dense_mask) == ("flash_attention_2", False)
        with pytest.raises(ValueError, match=r"oar_p_window_scores hands the model a 4-D float attention mask .* "
                                             r"implementation 'flash_attention_2' cannot take .* one of "
                                             r"\('eager', 'sdpa'\)"):
            oar_p_window_scores(pm, batch, window=2)
        assert calls == []
        for impl in DENSE_MASK_ATTENTION:  # those run
            model.config._attn_implementation = impl
            res = oar_p_window_scores(pm, batch, window=2)
            assert bool(torch.isfinite(res.scores).all()) and calls
    finally:
        handle.remove()
        model.config._attn_implementation = old


@pytest.mark.parametrize("clean_logits", [False, True], ids=["prompt-once", "plain"])
def test_oar_g_checkpointed_equals_plain_and_writes_no_grad(tiny, clean_logits):
    model, batch = tiny
    pm = HFProbeModel(model)
    kw = dict(sigma=1e-2, noise_draws=2)
    if clean_logits:
        from oar.attribution import clean_probe_logits

        kw["clean_logits"] = clean_probe_logits(pm, batch)
    full = oar_g_scores(pm, batch, generator=torch.Generator().manual_seed(3), memory_budget_mb=1, **kw)
    # declare a forward + backward of 1 MB per token: a row no longer fits 1 MiB, its checkpointed cost does
    plain_cost = pm.activation_bytes_per_token
    pm.activation_bytes_per_token = lambda w, backward=False: 10**6 if backward else plain_cost(w)
    small = oar_g_scores(pm, batch, generator=torch.Generator().manual_seed(3), memory_budget_mb=1, **kw)
    assert (full.stats["checkpointing"], small.stats["checkpointing"]) == (False, True)
    assert float(full.scores.abs().max()) > 1e-4  # scores well above float32 rounding: the comparison can fail
    torch.testing.assert_close(small.scores, full.scores, rtol=1e-4, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())
    assert not any("forward" in m.__dict__ for m in model.modules())  # the layers' forwards are restored


def test_resident_bytes_declares_the_clean_cache_of_the_cached_engines(tiny):
    model, batch = tiny
    pm = HFProbeModel(model)
    T, K, V = batch.input_ids.shape[1], batch.answer_ids.shape[1], pm.vocab_size
    base = batch.batch_size * int(batch.reasoning_len.max()) * 5 + 2 * K * V * 4
    assert planner.resident_bytes(pm, batch, "batched", 2) == planner.resident_bytes(pm, batch, "oar_g", 2) == base
    assert planner.resident_bytes(pm, batch, "window", 2) == base + 2 * T * pm.kv_bytes_per_token()
    with pytest.raises(ValueError, match=r"engine must be one of \('batched', 'prefix', 'window', 'oar_g'\), got 'x'"):
        planner.resident_bytes(pm, batch, "x", 2)


def test_a_row_over_the_budget_is_logged(tiny, caplog):
    model, batch = tiny
    pm = HFProbeModel(model)
    T = batch.input_ids.shape[1]
    with caplog.at_level(logging.WARNING, logger="oar"):
        plan = planner.plan_masked(pm, batch, [T, T], [1, 1], 1024, backward=True, checkpoint=True)
    assert [(c.begin, c.end) for c in plan] == [(0, 1), (1, 2)]  # each row alone
    need = T * planner.masked_bytes_per_token(pm, T, backward=True, checkpoint=True) + planner.probe_bytes(pm, batch)
    assert f"one row (forward + backward) of {T} tokens needs {need / 2**20:.1f} MiB, over memory_budget_mb = 0 MiB" \
        in caplog.text
