"""Attribution engines against independent one-at-a-time implementations (method.md sections 2-4).

Uses a tiny random Llama with the character-level tokenizer (oar.app.models), so token <-> character and
every expected value is computed here with plain PyTorch on unpadded single sequences.
"""

import contextlib
import copy
import math
import os

import numpy as np
import pytest
import torch

import oar
from oar import ops
from oar.attribution import (
    HFProbeModel,
    ProbeContextBuilder,
    as_probe_model,
    entropy_scores,
    oar_g_scores,
    oar_p_scores,
    random_scores,
    reasoning_length,
)
from oar.testing import tiny_random_llama

from _completions import CONCLUDE, probe_rollouts
from _error_model import (entropy_error_bound, float64_copy, oar_g_reference, oar_p_error_bound,
                          random_rounding)
from _tolerance import assert_close_to_reference, assert_within, assert_within_error_model, float64_model, ulp


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, tokenizer="minimal", seed=1)
    # Default init gives near-uniform next-token distributions (KL ~ 1e-6), which would make value checks
    # vacuous; sharpen them so that divergences are O(1e-2 .. 1).
    with torch.no_grad():
        for prm in model.parameters():
            if prm.dim() > 1:
                prm.mul_(6.0)
    model.eval()
    return model, tok


def test_reasoning_length_marks_text_before_last_marker(tiny):
    _, tok = tiny
    ids = tok.encode("ab \\boxed{1} cd \\boxed{22}", add_special_tokens=False)
    assert reasoning_length(ids, tok) == len("ab \\boxed{1} cd ")
    ids = tok.encode("x #### 4", add_special_tokens=False)
    assert reasoning_length(ids, tok) == len("x ")
    ids = tok.encode("no marker here", add_special_tokens=False) + [tok.eos_token_id, tok.eos_token_id]
    assert reasoning_length(ids, tok, stop_ids=[tok.eos_token_id]) == len("no marker here")
    assert reasoning_length([], tok) == 0


def test_probe_batch_layout(tiny):
    _, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    b = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    T = b.input_ids.shape[1]
    for i in range(3):
        row = b.input_ids[i][b.attention_mask[i].bool()].tolist()
        L = int(b.reasoning_len[i])
        expected = pids[i] + rids[i][:L] + tok.encode(CONCLUDE + answers[i] + "}", add_special_tokens=False)
        assert row == expected
        # reasoning columns hold the response's first L tokens
        cols = b.reasoning_columns(i)
        assert b.input_ids[i, cols].tolist() == rids[i][:L]
        # probe positions predict the answer tokens: the token after each probe position is an answer token
        K = int(b.answer_len[i])
        first_pred_col = T - b.keep + int(b.probe_start[i])
        assert b.input_ids[i, first_pred_col + 1: first_pred_col + 1 + K].tolist() == b.answer_ids[i, :K].tolist()
    assert int(b.reasoning_len[2]) == len("it is 15")  # no marker: whole response without EOS


def _naive_probe(model, ids, P_answer_cols, answer_ids, probe, dtype=torch.float64):
    """Probe statistic of ONE unpadded context, plain PyTorch, computed in ``dtype`` from the model's logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].to(dtype)
    z = logits[P_answer_cols]  # (K, V)
    if probe == "last":
        return torch.log_softmax(z[0], -1)
    if probe == "answer_mean":
        return torch.log_softmax(z.mean(0), -1)
    lp = torch.log_softmax(z, -1)
    return lp[torch.arange(len(answer_ids)), torch.tensor(answer_ids)].mean()


def _naive_oar_p(model, tok, pids, rids, answers, probe, dtype=torch.float64):
    out = []
    for p, r, a in zip(pids, rids, answers):
        L = reasoning_length(r, tok, stop_ids=[tok.eos_token_id])
        a_ids = tok.encode(a, add_special_tokens=False)
        ctx = p + r[:L] + tok.encode(CONCLUDE, add_special_tokens=False) + a_ids + tok.encode("}", add_special_tokens=False)
        first = len(ctx) - 1 - len(a_ids) - 1  # position predicting answer token 0
        cols = list(range(first, first + len(a_ids)))
        clean = _naive_probe(model, ctx, cols, a_ids, probe, dtype)
        scores = []
        for t in range(L):
            masked = list(ctx)
            masked[len(p) + t] = tok.pad_token_id
            pert = _naive_probe(model, masked, cols, a_ids, probe, dtype)
            if probe == "answer_joint":
                scores.append(max(0.0, float(clean - pert)))
            else:
                scores.append(float((clean.exp() * (clean - pert)).sum()))
        out.append(scores)
    return out


def _dense(rows, width):
    """Per-row score lists as a zero-padded (B, width) float64 tensor."""
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
    return out


_EXACT = {}


def _exact(tiny, probe):
    """OAR-P scores of the float64 copy of the ``tiny`` model on ``probe_rollouts`` with their float32 error bounds
    (``_error_model.Bounded``, (B, L_max)): the reference of rule 1's budgets, cached per probe."""
    if probe not in _EXACT:
        model, tok = tiny
        pids, rids, answers = probe_rollouts(tok)
        _EXACT[probe] = oar_p_error_bound(model, ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers), probe)
    return _EXACT[probe]


def _truth(tiny, probe):
    """The float64 scores of :func:`_exact`, (B, L_max)."""
    return _exact(tiny, probe).value


@pytest.mark.parametrize("probe", ["last", "answer_mean", "answer_joint"])
@pytest.mark.parametrize("max_variants", [0, 5])
@pytest.mark.parametrize("engine", ["prefix", "batched"])
def test_oar_p_equals_one_at_a_time(tiny, probe, max_variants, engine):
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    res = oar_p_scores(HFProbeModel(model), batch, probe=probe, max_variants_per_chunk=max_variants, engine=engine)
    assert res.stats["engine"] == engine
    expected = _naive_oar_p(model, tok, pids, rids, answers, probe, torch.float32)
    assert max(max(e) for e in expected) > 1e-3, "test model too flat: the comparison would be vacuous"
    for i, exp in enumerate(expected):
        assert res.mask[i].sum() == len(exp)
    # Rule 1 (_tolerance.py): the engine, and the float32 one-at-a-time computation (model and divergence in
    # float32), within the float32 error model of the float64 model's scores.
    exact = _exact(tiny, probe)
    W = exact.value.shape[1]
    assert_within_error_model(res.scores[:, :W], exact, what=f"{engine} {probe}")
    assert_within_error_model(_dense(expected, W), exact, what=f"naive float32 {probe}")
    assert (res.scores >= 0).all()
    assert res.stats["variants"] == sum(len(e) for e in expected)
    if max_variants:
        assert res.stats["chunks"] >= res.stats["variants"] // max_variants


@pytest.mark.parametrize("budget_mb, waste", [(1, 0.25), (64, 1.0), (64, 0.01)])
def test_prefix_engine_equals_batched_engine(tiny, budget_mb, waste):
    """Exactness of the prefix-cached engine against the batched one (fp32 rounding only), across chunk
    plans: tiny budget (one variant per chunk), no waste bound (few big chunks), tight waste bound."""
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    pm = HFProbeModel(model)
    ref = oar_p_scores(pm, batch, engine="batched")
    got = oar_p_scores(pm, batch, engine="prefix", memory_budget_mb=budget_mb, max_prefix_waste=waste)
    # Rule 1: both engines within the float32 error model of the float64 model's scores.
    exact = _exact(tiny, "answer_mean")
    W = exact.value.shape[1]
    assert_within_error_model(got.scores[:, :W], exact, what="prefix")
    assert_within_error_model(ref.scores[:, :W], exact, what="batched")
    assert torch.equal(got.mask, ref.mask)
    # the prefix engine runs fewer context tokens than re-running every full masked context
    assert got.stats["tokens"] < ref.stats["tokens"]


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("probe", ["answer_mean", "answer_joint"])
def test_shared_prefix_attention_is_exact(kv_heads, probe):
    """The prefix engine's shared-prefix attention (each row's prefix read in place, prefix and causal
    suffix parts merged by log-sum-exp) against the cached path (HF attention over a copied prefix with a
    dense mask) and against float64 truth, with left-padded rows and grouped-query attention; plans where
    some chunks must fall back to the cached path (padding reaching past the chunk's prefix) are included."""
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=kv_heads,
                                   tokenizer="minimal", seed=3)
    with torch.no_grad():
        for prm in model.parameters():
            if prm.dim() > 1:
                prm.mul_(6.0)
    model.eval()
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    assert int((batch.attention_mask == 0).sum()) > 0, "rows must be left-padded for this test"
    exact = oar_p_error_bound(model, batch, probe)
    assert exact.value.abs().max() > 1e-3
    shared_total = 0
    for budget, waste in [(1, 0.25), (64, 1.0), (64, 0.01), (64, 0.3)]:
        pm = HFProbeModel(model)
        assert pm.supports_shared_prefix_attention
        new = oar_p_scores(pm, batch, probe=probe, engine="prefix", memory_budget_mb=budget, max_prefix_waste=waste)
        pm.shared_prefix_attention = False
        assert not pm.supports_shared_prefix_attention
        old = oar_p_scores(pm, batch, probe=probe, engine="prefix", memory_budget_mb=budget, max_prefix_waste=waste)
        assert old.stats["shared_prefix_chunks"] == 0
        shared_total += new.stats["shared_prefix_chunks"]
        # Rule 1: the shared-prefix attention and the cached path within the float32 error model.
        w = exact.value.shape[1]
        assert_within_error_model(new.scores[:, :w], exact, what=f"shared, budget {budget}, waste {waste}")
        assert_within_error_model(old.scores[:, :w], exact, what=f"cached, budget {budget}, waste {waste}")
    assert shared_total > 0


def test_tail_logits_shared_prefix_checks_groups(tiny):
    model, _ = tiny
    pm = HFProbeModel(model)
    ids = torch.full((3, 4), 5, dtype=torch.long)
    pos = torch.arange(6, 10).expand(3, 4)
    kv = [(torch.zeros(2, 4, 6, 8), torch.zeros(2, 4, 6, 8))] * 2
    with pytest.raises(ValueError, match="groups must tile"):
        pm.tail_logits_shared_prefix(kv, [(0, 0, 1, 0), (1, 2, 3, 0)], 6, input_ids=ids, position_ids=pos, keep=1)
    with pytest.raises(ValueError, match="groups cover"):
        pm.tail_logits_shared_prefix(kv, [(0, 0, 2, 0)], 6, input_ids=ids, position_ids=pos, keep=1)
    with pytest.raises(ValueError, match="pad <= prefix_len"):
        pm.tail_logits_shared_prefix(kv, [(0, 0, 3, 7)], 6, input_ids=ids, position_ids=pos, keep=1)


def test_prefix_engine_refused_without_cache_support(tiny):
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)

    class NoCache:
        def __init__(self, inner):
            self.inner = inner
            self.vocab_size, self.hidden_size, self.device = inner.vocab_size, inner.hidden_size, inner.device

        def embed(self, ids):
            return self.inner.embed(ids)

        def tail_logits(self, **kw):
            return self.inner.tail_logits(**kw)

        def activation_bytes_per_token(self, width, backward=False):
            return self.inner.activation_bytes_per_token(width, backward)

        def eval_mode(self):
            return self.inner.eval_mode()

    with pytest.raises(ValueError, match="engine='prefix' needs"):
        oar_p_scores(NoCache(HFProbeModel(model)), batch, engine="prefix")
    res = oar_p_scores(NoCache(HFProbeModel(model)), batch)  # auto -> batched
    assert res.stats["engine"] == "batched"
    with pytest.raises(ValueError, match="engine must be one of"):
        oar_p_scores(HFProbeModel(model), batch, engine="fast")


def test_oar_p_respects_rows(tiny):
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    full = oar_p_scores(HFProbeModel(model), batch)
    part = oar_p_scores(HFProbeModel(model), batch, rows=[1])
    assert not part.mask[0].any() and not part.mask[2].any()
    exact = _exact(tiny, "answer_mean")  # rule 1: a batch of one row within the error model, as the full batch
    W = exact.value.shape[1]
    assert_within_error_model(part.scores[1, :W], exact[1], what="row 1 alone")
    assert_within_error_model(full.scores[1, :W], exact[1], what="row 1 in the batch")
    with pytest.raises(ValueError, match="rows must index the batch"):
        oar_p_scores(HFProbeModel(model), batch, rows=[3])
    with pytest.raises(ValueError, match="probe must be one of"):
        oar_p_scores(HFProbeModel(model), batch, probe="mean")


def _naive_oar_g(model, tok, p, r, a, probe, sigma, seed_noise, dtype=torch.float32):
    """OAR-G for ONE unpadded context with plain autograd and a plain-torch KL computed in ``dtype``."""
    L = reasoning_length(r, tok, stop_ids=[tok.eos_token_id])
    a_ids = tok.encode(a, add_special_tokens=False)
    ctx = p + r[:L] + tok.encode(CONCLUDE, add_special_tokens=False) + a_ids + tok.encode("}", add_special_tokens=False)
    first = len(ctx) - 1 - len(a_ids) - 1
    cols = list(range(first, first + len(a_ids)))
    ids = torch.tensor([ctx])
    E = model.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        zc = model(inputs_embeds=E).logits[0, cols].to(dtype)
    mask = torch.zeros_like(E)
    mask[0, len(p): len(p) + L] = 1
    Ek = (E + seed_noise.to(E.dtype) * sigma * mask).requires_grad_(True)
    zp = model(inputs_embeds=Ek).logits[0, cols].to(dtype)
    if probe == "answer_mean":
        lc, lp = torch.log_softmax(zc.mean(0), -1), torch.log_softmax(zp.mean(0), -1)
        J = (lc.exp() * (lc - lp)).sum()
    else:
        lc, lp = torch.log_softmax(zc, -1), torch.log_softmax(zp, -1)
        idx = torch.arange(len(a_ids)), torch.tensor(a_ids)
        J = lc[idx].mean() - lp[idx].mean()
    (g,) = torch.autograd.grad(J, Ek)
    return (g * E).sum(-1).abs()[0, len(p): len(p) + L]


@pytest.mark.parametrize("probe", ["answer_mean", "answer_joint"])
def test_oar_g_matches_plain_autograd_and_writes_no_grad(tiny, probe):
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids[:1], rids[:1], answers[:1])
    for prm in model.parameters():
        prm.grad = None
    sigma = 1e-2
    gen = torch.Generator().manual_seed(123)
    res = oar_g_scores(HFProbeModel(model), batch, probe=probe, sigma=sigma, generator=gen)
    assert all(prm.grad is None for prm in model.parameters()), "OAR-G wrote parameter .grad"
    # Re-draw the same noise the engine drew (same generator: row_noise on the reasoning columns, width T).
    T = batch.input_ids.shape[1]
    noise = _engine_noises(batch, 123, 1, model.config.hidden_size)[0]
    off = T - int(batch.context_len[0])
    expected = _naive_oar_g(model, tok, pids[0], rids[0], answers[0], probe, sigma, noise[:, off:])
    L = int(batch.reasoning_len[0])
    assert expected.max() > 1e-4, "test model too flat: the comparison would be vacuous"
    # Rule 1: the engine and plain float32 autograd within the random-rounding estimate of the float32 error of
    # the float64 model's OAR-G (a gradient: _error_model.random_rounding)
    m64 = float64_copy(model, exact_norms=True)
    exact = random_rounding(lambda: oar_g_reference(m64, batch, [noise], probe, sigma))
    assert_within_error_model(res.scores[0, :L], exact[0], what=probe)
    assert_within_error_model(expected, exact[0], what=f"plain autograd {probe}")


def test_oar_g_deterministic_under_seed(tiny):
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    pm = HFProbeModel(model)
    a = oar_g_scores(pm, batch, generator=torch.Generator().manual_seed(0))
    b = oar_g_scores(pm, batch, generator=torch.Generator().manual_seed(0))
    c = oar_g_scores(pm, batch, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.scores, b.scores)
    assert not torch.equal(a.scores, c.scores)
    k = oar_g_scores(pm, batch, noise_draws=3, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(k.scores).all() and (k.scores >= 0).all()
    assert k.stats["backward_passes"] == 3 * a.stats["backward_passes"]
    with pytest.raises(ValueError, match="sigma must be > 0"):
        oar_g_scores(pm, batch, sigma=0.0)
    with pytest.raises(ValueError, match="noise_draws must be >= 1"):
        oar_g_scores(pm, batch, noise_draws=0)


def test_entropy_and_random_baselines(tiny):
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    ent = entropy_scores(HFProbeModel(model), batch)
    # independent: the entropy of the distribution that predicted reasoning token 0 of row 0, on the float64 model
    # with its float32 error model (rule 1)
    P = len(pids[0])
    exact = entropy_error_bound(model, torch.tensor([pids[0] + rids[0]]), P - 1, P)
    assert_within_error_model(ent.scores[0, :1], exact, what="entropy")
    rnd = random_scores(batch, generator=torch.Generator().manual_seed(0))
    assert torch.equal(rnd.scores[~rnd.mask], torch.zeros_like(rnd.scores[~rnd.mask]))
    assert ((rnd.scores[rnd.mask] >= 0) & (rnd.scores[rnd.mask] < 1)).all()


def test_uniform_plans_cut_at_budget_over_item_cost(tiny):
    """The windowed and entropy plans (one cost per item) cut every floor(budget / cost) items, the first item of a
    chunk taken even when it alone is over the budget."""
    from oar.attribution import planner

    sizes = lambda plan: [c.end - c.begin for c in plan]  # noqa: E731
    assert sizes(planner.plan_entropy(100, 10, 7, 3 * 12 * 100 * 10)) == [3, 3, 1]
    assert sizes(planner.plan_entropy(100, 10, 2, 1)) == [1, 1]
    model, tok = tiny
    pm = HFProbeModel(model)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(*probe_rollouts(tok))
    assert sizes(planner.plan_window(pm, batch, 5, 4, 1 << 40, shared=False)) == [5]
    assert sizes(planner.plan_window(pm, batch, 9, 4, 1, shared=True)) == [1] * 9


def test_window_plan_counts_the_masks_the_kernel_builds(tiny):
    """Windowed OAR-P's per-variant cost counts dense masks only where they are built: FlexAttention reads the
    closed-form WindowMasks (O(slots)), the CPU kernel expands them to two biases plus bool masks, the cached path
    builds a 4-D mask. A budget of exactly k variants' cost (recomputed here from the terms) packs k per chunk."""
    from oar.attribution import planner

    model, tok = tiny
    batch = ProbeContextBuilder(tok, CONCLUDE).build(*probe_rollouts(tok))
    T, S = int(batch.input_ids.shape[1]), 6
    flex, cpu = HFProbeModel(model), HFProbeModel(model)
    flex.shared_prefix_kernel = "flex"
    bpe = cpu.cache_key_element_size()
    assert cpu.window_mask_bytes(S, T) == (bpe + 1) * S * (T + S)
    # closed form: 6 + 4 int64, and 2 query blocks x (prefix blocks + 3) key-block pairs of 24 bytes
    assert flex.window_mask_bytes(S, T) == 8 * (S + 4) + 24 * 2 * ((T + 127) // 128 + 3)
    assert flex.window_mask_bytes(40, 4096) < cpu.window_mask_bytes(40, 4096) / 100
    base = (S * int(cpu.kv_bytes_per_token()) + S * int(cpu.activation_bytes_per_token(T + S))
            + planner.probe_bytes(cpu, batch))
    sizes = lambda plan: [c.end - c.begin for c in plan]  # noqa: E731
    for pm in (flex, cpu):
        per_var = base + pm.window_mask_bytes(S, T)
        assert sizes(planner.plan_window(pm, batch, 7, S, 3 * per_var, shared=True)) == [3, 3, 1]
        assert sizes(planner.plan_window(pm, batch, 7, S, 3 * per_var - 1, shared=True)) == [2, 2, 2, 1]
    dense = base + (3 * T + S) * int(cpu.kv_bytes_per_token()) + (bpe + 3) * S * (T + S)
    assert sizes(planner.plan_window(cpu, batch, 4, S, 2 * dense, shared=False)) == [2, 2]
    # the multi-rank gate passes the declaration on (else the planner would count dense masks on every rank)
    from oar.distributed import ForwardGate

    assert ForwardGate(flex, pad_id=0).window_mask_bytes(S, T) == flex.window_mask_bytes(S, T)
    with pytest.raises(ValueError, match="slots must be >= 1 and prefix_len >= 0, got -5 and 10"):
        cpu.window_mask_bytes(-5, 10)


def test_entropy_scores_chunked_one_row_per_forward(tiny, monkeypatch):
    """The entropy engine's chunks change only the batching: one row per forward (a budget of 1 byte at the planner)
    gives every row's entropies within the float32 error model of the float64 model's, like one chunk does."""
    from oar.attribution import entropy, planner

    model, tok = tiny
    batch = ProbeContextBuilder(tok, CONCLUDE).build(*probe_rollouts(tok))
    whole = entropy_scores(HFProbeModel(model), batch)
    plan = planner.plan_entropy
    monkeypatch.setattr(entropy.planner, "plan_entropy", lambda v, keep, n, budget: plan(v, keep, n, 1))
    each = entropy_scores(HFProbeModel(model), batch)
    n = int((batch.reasoning_len > 0).sum())
    assert (whole.stats["chunks"], each.stats["chunks"]) == (1, n) and each.stats["forward_passes"] == n
    assert torch.equal(whole.mask, each.mask)
    T = batch.input_ids.shape[1]
    for r in range(batch.batch_size):
        s, L, a = int(batch.reasoning_start[r]), int(batch.reasoning_len[r]), T - int(batch.context_len[r])
        exact = entropy_error_bound(model, batch.input_ids[r: r + 1, a: s + L], s - a - 1, s - a - 1 + L)
        for res in (whole, each):
            assert_within_error_model(res.scores[r, :L], exact, what=f"entropy row {r}")


@pytest.mark.parametrize("mode", ["serial", "batched"])
def test_reference_naive_oar_p_matches_engine(tiny, mode):
    """oar.reference.oar_p_naive (full logits, unpadded) is the benchmarks' naive provider: it must agree."""
    from oar import reference

    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    res = oar_p_scores(HFProbeModel(model), batch, probe="answer_mean")
    naive = reference.oar_p_naive(model, batch, probe="answer_mean", mode=mode, variants_per_forward=4)
    exact = _exact(tiny, "answer_mean")
    got = torch.zeros_like(exact.value)
    for r, scores in naive.items():
        got[r, : len(scores)] = torch.tensor([scores[j] for j in sorted(scores)], dtype=torch.float64)
    # Rule 1: the naive provider and the engine within the float32 error model.
    assert_within_error_model(got, exact, what=f"naive {mode}")
    assert_within_error_model(res.scores[:, : exact.value.shape[1]], exact, what="engine")


@pytest.mark.parametrize("engine", ["prefix", "batched"])
def test_oar_p_positions_subset(tiny, engine):
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    pm = HFProbeModel(model)
    full = oar_p_scores(pm, batch, engine=engine)
    pos = {0: [0, 3, 5], 2: [1]}
    part = oar_p_scores(pm, batch, engine=engine, positions=pos)
    assert part.stats["variants"] == 4
    sel = torch.zeros(part.scores.shape, dtype=torch.bool)
    for r in range(3):
        for j in range(int(batch.reasoning_len[r])):
            if j in pos.get(r, []):
                sel[r, j] = True
            else:
                assert part.scores[r, j] == 0
    exact = _exact(tiny, "answer_mean")  # rule 1: the subset's scores within the error model, as the full run's
    W = exact.value.shape[1]
    assert_within_error_model(part.scores[sel], exact[sel[:, :W]], what=f"{engine} subset")
    assert_within_error_model(full.scores[sel], exact[sel[:, :W]], what=f"{engine} full")
    with pytest.raises(ValueError, match=r"positions\[0\] must be reasoning indices"):
        oar_p_scores(pm, batch, positions={0: [999]})


class _NoPrefixGrad:
    """A ProbeModel view of HFProbeModel without the prefix path (forces OAR-G's plain path)."""

    supports_prefix_grad = False

    def __init__(self, pm):
        self._pm = pm

    def __getattr__(self, name):
        return getattr(self._pm, name)


def _engine_noises(batch, seed: int, draws: int, H: int) -> list:
    """The noise oar_g_scores draws with ``Generator().manual_seed(seed)``, laid out as oar_g_reference takes it:
    one (B, T, H) tensor per draw, row r's :func:`row_noise` on its reasoning columns, zero elsewhere."""
    from oar.attribution.oar_g import noise_base, row_noise

    base = noise_base(torch.Generator().manual_seed(seed))
    out = [torch.zeros((batch.batch_size, batch.input_ids.shape[1], H)) for _ in range(draws)]
    for r in range(batch.batch_size):
        s, L = int(batch.reasoning_start[r]), int(batch.reasoning_len[r])
        rn = row_noise(base, r, draws, L, H)
        for d in range(draws):
            out[d][r, s:s + L] = rn[d]
    return out


def test_oar_g_noise_is_a_function_of_the_row(tiny):
    """A row's OAR-G scores do not depend on which other rows are scored, the chunking (memory budget) or their
    order: row_noise is keyed by (generator draw, row) (issue 42: common random numbers across settings)."""
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    pm = HFProbeModel(model)
    B = batch.batch_size
    assert B >= 3

    def run(**kw):
        return oar_g_scores(pm, batch, probe="answer_mean", sigma=1e-2, noise_draws=2,
                            generator=torch.Generator().manual_seed(11), **kw)

    full = run()
    alone = run(rows=[B - 1])
    tiny_budget = run(memory_budget_mb=1)
    assert tiny_budget.stats["chunks"] > full.stats["chunks"]
    assert full.scores.abs().max() > 1e-4, "test model too flat: the comparison would be vacuous"
    # rule 1: every run within the random-rounding estimate of the float32 error around the float64 model's OAR-G
    # with the noise row_noise gives each row (a different noise would miss by the scores' own size)
    e64 = float64_copy(model, exact_norms=True)
    exact = random_rounding(lambda: oar_g_reference(e64, batch, _engine_noises(batch, 11, 2, model.config.hidden_size),
                                                    "answer_mean", 1e-2))
    Lm = exact.value.shape[1]
    assert_within_error_model(full.scores[:, :Lm], exact, what="all rows, one chunk")
    assert_within_error_model(tiny_budget.scores[:, :Lm], exact, what="all rows, one row per chunk")
    assert_within_error_model(alone.scores[B - 1, :Lm], exact[B - 1], what="the last row alone")
    L = int(batch.reasoning_len[B - 1])
    # a different generator state gives different noise, hence different scores
    other = oar_g_scores(pm, batch, probe="answer_mean", sigma=1e-2, noise_draws=2,
                         generator=torch.Generator().manual_seed(12))
    assert not torch.allclose(other.scores[B - 1, :L], full.scores[B - 1, :L], rtol=1e-2, atol=0)


@pytest.mark.parametrize("probe", ["last", "answer_mean", "answer_joint"])
@pytest.mark.parametrize("draws", [1, 2])
def test_oar_g_prefix_path_equals_plain_path(tiny, probe, draws):
    """The prompt prefix run once without grad (shared key/value cache) gives the plain path's scores."""
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    pm = HFProbeModel(model)
    assert pm.supports_prefix_grad
    fast = oar_g_scores(pm, batch, probe=probe, sigma=1e-2, noise_draws=draws,
                        generator=torch.Generator().manual_seed(7))
    plain = oar_g_scores(_NoPrefixGrad(pm), batch, probe=probe, sigma=1e-2, noise_draws=draws,
                         generator=torch.Generator().manual_seed(7))
    assert fast.stats["forward_passes"] == 2 + draws  # prefix + clean suffix + one suffix pass per draw
    assert plain.stats["forward_passes"] == 1 + draws  # one clean pass over all rows + one pass per draw
    assert plain.scores.abs().max() > 1e-4
    # The two paths on the float64 model (logits rounded once to float32) agree far below the float32 model's own
    # error: the prefix path computes the same scores.
    m64 = HFProbeModel(float64_model(model))
    truth = oar_g_scores(_NoPrefixGrad(m64), batch, probe=probe, sigma=1e-2, noise_draws=draws,
                         generator=torch.Generator().manual_seed(7))
    fast64 = oar_g_scores(m64, batch, probe=probe, sigma=1e-2, noise_draws=draws,
                          generator=torch.Generator().manual_seed(7))
    assert fast64.stats["forward_passes"] == fast.stats["forward_passes"]  # the prefix path ran on it too
    # On the float32 model both paths carry the float32 error of OAR-G (the rounding of the clean vs noisy logits
    # sets the tiny divergence's gradient): rule 1, both within the random-rounding estimate of that error around
    # the float64 model's scores (the plain-PyTorch reference with the engine's noise draws: one chunk).
    assert fast.stats["chunks"] == plain.stats["chunks"] == 1
    assert int(batch.context_len.max()) == batch.input_ids.shape[1]
    noises = _engine_noises(batch, 7, draws, model.config.hidden_size)
    e64 = float64_copy(model, exact_norms=True)
    exact = random_rounding(lambda: oar_g_reference(e64, batch, noises, probe, 1e-2))
    Lm = exact.value.shape[1]
    for name, got in (("prefix path", fast.scores), ("plain path", plain.scores)):
        assert_within_error_model(got[:, :Lm], exact, what=f"{name}, {probe}, {draws} draws")
    # The float64 runs of both paths differ only where a logit rounds to the other neighbouring float32 value
    # (float64_model rounds the logits once for the float32 probe op): within the float32 budget.
    assert_within(fast64.scores[:, :Lm], truth.scores[:, :Lm], exact.bound, what=f"float64 paths, {probe}")
    assert torch.equal(fast.mask, plain.mask)


def test_oar_g_nested_prompts_share_one_prefix_forward(tiny, monkeypatch):
    """Turn rows of a multi-turn session have nested prompts (turn 2's prompt is the session up to it): the prefix
    cache runs only the maximal prompts and gives every row its first columns; the scores equal the plain path's
    (float64 model, as above)."""
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    nested = [pids[0], pids[0] + rids[0][:-1] + tok.encode(" [r] ok", add_special_tokens=False), pids[1], pids[0]]
    resp = [rids[0], rids[2], rids[1], rids[2]]
    batch = ProbeContextBuilder(tok, CONCLUDE).build(nested, resp, [answers[0], answers[2], answers[1], answers[2]])
    m64 = HFProbeModel(float64_model(model))
    calls = []
    real = type(m64).tail_logits_and_cache

    def counting(self, *a, **kw):
        calls.append(int(kw["input_ids"].shape[0]))
        return real(self, *a, **kw)

    monkeypatch.setattr(type(m64), "tail_logits_and_cache", counting)
    fast = oar_g_scores(m64, batch, probe="answer_mean", sigma=1e-2, noise_draws=1,
                        generator=torch.Generator().manual_seed(3))
    assert fast.stats["chunks"] == 1 and calls == [2]  # rows 0, 1, 3 from row 1's prompt; row 2 its own
    truth = oar_g_scores(_NoPrefixGrad(m64), batch, probe="answer_mean", sigma=1e-2, noise_draws=1,
                         generator=torch.Generator().manual_seed(3))
    assert truth.scores.abs().max() > 1e-4
    # float64 throughout: the two paths differ by float64 rounding and the one float32 rounding of the logits
    # the float64 runs of both paths differ only where a logit rounds to the other neighbouring float32 value: within
    # the float32 budget of OAR-G's scores (random-rounding estimate around the float64 reference, as above)
    noises = _engine_noises(batch, 3, 1, model.config.hidden_size)
    e64 = float64_copy(model, exact_norms=True)
    exact = random_rounding(lambda: oar_g_reference(e64, batch, noises, "answer_mean", 1e-2))
    Lm = exact.value.shape[1]
    assert_within(fast.scores[:, :Lm], truth.scores[:, :Lm], exact.bound, what="nested prompts vs plain path")


class _EmbedCall:
    """A ProbeModel view of HFProbeModel that does not take the embeddings inside the forward (OAR-G then calls
    ``embed`` and runs the forward on ``inputs_embeds``, as for models without the capability)."""

    supports_embedding_noise = False

    def __init__(self, pm):
        self._pm = pm

    def __getattr__(self, name):
        return getattr(self._pm, name)


@pytest.mark.parametrize("prefix", [True, False])
def test_oar_g_embeddings_taken_in_the_forward_equal_an_embed_call(tiny, prefix):
    """OAR-G through noised_embeddings (every call a forward on ids, as FSDP / ZeRO-3 need) runs the same
    arithmetic on the same numbers as through embed + inputs_embeds: the scores are identical, on both paths."""
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    pm = HFProbeModel(model) if prefix else _NoPrefixGrad(HFProbeModel(model))
    calls = {"embed": 0}
    emb = model.get_input_embeddings()
    handle = emb.register_forward_hook(lambda *a: calls.__setitem__("embed", calls["embed"] + 1))
    try:
        hooked = oar_g_scores(pm, batch, sigma=1e-2, noise_draws=2, generator=torch.Generator().manual_seed(3))
        n_hooked = calls["embed"]
        looked_up = oar_g_scores(_EmbedCall(pm), batch, sigma=1e-2, noise_draws=2,
                                 generator=torch.Generator().manual_seed(3))
    finally:
        handle.remove()
    assert hooked.scores.abs().max() > 1e-4
    assert torch.equal(hooked.scores, looked_up.scores)
    # every embedding-module call of the hooked run came from a forward of the model
    assert n_hooked == hooked.stats["forward_passes"]
    assert hooked.stats["forward_passes"] == looked_up.stats["forward_passes"]


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512" and torch.cpu._is_amx_tile_supported(),
                    reason="torch 2.14's CPU attention packs bfloat16 for AMX from its AVX2 kernels and fails "
                           "(ATEN_CPU_CAPABILITY below an AMX CPU's level)")
def test_shared_prefix_attention_under_bf16_autocast(tiny):
    """Under CPU autocast (a trainer's bf16 mixed precision) the rotary embedding leaves queries/keys in
    float32 and values in bf16: the shared-prefix attention must run in the autocast dtype like SDPA does,
    and agree with the cached path to bf16 precision."""
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    pm = HFProbeModel(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new = oar_p_scores(pm, batch, engine="prefix", max_prefix_waste=0.01)
        pm.shared_prefix_attention = False
        old = oar_p_scores(pm, batch, engine="prefix", max_prefix_waste=0.01)
    assert new.stats["shared_prefix_chunks"] > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = oar_p_scores(HFProbeModel(model), batch, engine="batched").scores
    # Rule 1 in bfloat16: both prefix paths are as close to the float64 model's scores as the batched engine under
    # the same autocast is.
    truth = _truth(tiny, "answer_mean")
    w = truth.shape[1]
    for got in (new.scores, old.scores):
        assert_close_to_reference(got[:, :w], truth, plain[:, :w], atol=float(ulp(truth.abs().max(), torch.bfloat16)))


# ---- bad input, on one-layer models --------------------------------------------------------------------------------
# Every engine argument either raises a ValueError that names it, the expected and the actual value, or gives a
# finite, well-formed result.

@pytest.fixture(scope="module")
def tiny_1layer():
    return tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal")


@pytest.fixture(scope="module")
def tiny_1layer_seed3():
    return tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=3)


@pytest.fixture(scope="module")
def probe_batch(tiny_1layer):
    model, tok = tiny_1layer
    b = ProbeContextBuilder(tok, "\nTherefore, the final answer is \\boxed{")
    P = tok.encode("Q: 2+3?", add_special_tokens=False)
    batch = b.build([P, P], [tok.encode("so 2 and 3 ", add_special_tokens=False), tok.encode("hmm", add_special_tokens=False)],
                    ["5", "15"])
    return as_probe_model(model), batch, b


@pytest.fixture(scope="module")
def probe_batch_seed3(tiny_1layer_seed3):
    model, tok = tiny_1layer_seed3
    b = ProbeContextBuilder(tok, CONCLUDE, "}")
    P = tok.encode("Q: 2+3?", add_special_tokens=False)
    batch = b.build([P, P], [tok.encode("so 2 and 3 ", add_special_tokens=False),
                             tok.encode("hmm 9 x", add_special_tokens=False)], ["5", "9"], [6, 5])
    return as_probe_model(model), batch


_EVERY_ENGINE_BAD = [
    (dict(rows=[0.5]), r"rows\[i\] must be an int, got float 0\.5", "rows_float"),
    (dict(rows=[True]), r"rows\[i\] must be an int, got bool True", "rows_bool"),
    (dict(rows="0"), r"rows must be a sequence of row indices", "rows_str"),
    (dict(memory_budget_mb=0), r"memory_budget_mb must be an int >= 1, got 0", "budget_0"),
    (dict(memory_budget_mb=0.5), r"memory_budget_mb must be an int >= 1, got 0\.5", "budget_float"),
    (dict(memory_budget_mb=None), r"memory_budget_mb must be an int >= 1, got None", "budget_none"),
    (dict(clean_logits=torch.zeros(1, 1, 1)),
     r"clean_logits must be \(B, K_max, V\) with \(B, K_max\) = \(2, 2\), got \(1, 1, 1\)", "clean_logits_shape"),
]

# (engine, keyword arguments, exception, message regex), on probe_batch
ENGINE_BAD_INPUT = [
    pytest.param(engine, kwargs, ValueError, match, id=f"{engine.__name__}-{name}")
    for engine in (oar_p_scores, oar_g_scores) for kwargs, match, name in _EVERY_ENGINE_BAD
] + [
    pytest.param(oar_p_scores, dict(max_variants_per_chunk=1.5), ValueError,
                 r"max_variants_per_chunk must be an int, got float 1\.5", id="oar_p_scores-max_variants_float"),
    pytest.param(oar_p_scores, dict(max_variants_per_chunk=-1), ValueError, r"max_variants_per_chunk must be >= 0",
                 id="oar_p_scores-max_variants_negative"),
    pytest.param(oar_g_scores, dict(sigma=float("inf")), ValueError, r"sigma must be > 0 and finite, got inf",
                 id="oar_g_scores-sigma_inf"),
    pytest.param(oar_g_scores, dict(noise_draws=1.5), ValueError, r"noise_draws must be an int, got float 1\.5",
                 id="oar_g_scores-noise_draws_float"),
]


@pytest.mark.parametrize("engine, kwargs, exc, match", ENGINE_BAD_INPUT)
def test_engine_bad_input(probe_batch, engine, kwargs, exc, match):
    pm, batch, _ = probe_batch
    with pytest.raises(exc, match=match):
        engine(pm, batch, **kwargs)


# max_prefix_waste used to be ignored by the batched engine (and "auto" when it picks it), TypeError for None.
_WASTE_BAD = [
    (0.0, r"max_prefix_waste must be in \(0, 1\], got 0\.0", "0"),
    (1.5, r"max_prefix_waste must be in \(0, 1\], got 1\.5", "1.5"),
    (float("nan"), r"max_prefix_waste must be in \(0, 1\], got nan", "nan"),
    ("0.2", r"max_prefix_waste must be a real number, got str '0.2'", "str"),
    (None, r"max_prefix_waste must be a real number, got NoneType None", "none"),
]
# positions: rows not requested (or -1, "0") used to be ignored silently (scores 0), out-of-range keys IndexError,
# floats truncated, strings iterated as digits.
_POSITIONS_BAD = [
    ({5: [0]}, None, r"positions has row 5, which is not among the rows scored \(\[0, 1\]\)", "row_5"),
    ({-1: [0]}, None, r"positions has row -1, which is not among the rows scored", "row_-1"),
    ({1: [0]}, [0], r"positions has row 1, which is not among the rows scored \(\[0\]\)", "row_not_requested"),
    ([[0]], None, r"positions must be a mapping \{row: reasoning indices\} or None, got list", "list"),
    ({0: 1}, None, r"positions\[0\] must be a sequence of reasoning indices, got int 1", "int_value"),
    ({0: "01"}, None, r"positions\[0\] must be a sequence of reasoning indices, got str '01'", "str_value"),
    ({0: [1.5]}, None, r"positions\[0\]\[i\] must be an int, got float 1\.5", "float_index"),
    ({0: [True]}, None, r"positions\[0\]\[i\] must be an int, got bool True", "bool_index"),
    ({"0": [1]}, None, r"positions key must be an int, got str '0'", "str_key"),
]

# (keyword arguments of oar_p_scores, exception, message regex), on probe_batch_seed3
OAR_P_BAD_INPUT = [
    pytest.param(dict(engine=engine, max_prefix_waste=waste), ValueError, match, id=f"{engine}-max_prefix_waste_{name}")
    for engine in ("auto", "prefix", "batched") for waste, match, name in _WASTE_BAD
] + [
    pytest.param(dict(engine=engine, positions=positions, rows=rows), ValueError, match,
                 id=f"{engine}-positions_{name}")
    for engine in ("prefix", "batched") for positions, rows, match, name in _POSITIONS_BAD
]


@pytest.mark.parametrize("kwargs, exc, match", OAR_P_BAD_INPUT)
def test_oar_p_bad_input(probe_batch_seed3, kwargs, exc, match):
    pm, batch = probe_batch_seed3
    with pytest.raises(exc, match=match):
        oar_p_scores(pm, batch, **kwargs)


def test_oar_p_positions_accept_tensors_and_arrays(probe_batch_seed3):
    pm, batch = probe_batch_seed3
    ref = oar_p_scores(pm, batch, positions={0: [0, 2]}).scores
    for js in (torch.tensor([0, 2]), np.array([0, 2]), (2, 0)):
        torch.testing.assert_close(oar_p_scores(pm, batch, positions={0: js}).scores, ref)
    assert os.environ.get("OAR_CONFIG") is None


def test_engine_budget_extremes_plan_correctly(tiny_1layer, probe_batch):
    import copy

    pm, batch, _ = probe_batch
    # A sharpened copy of the tiny model, whose divergences (~1e-2) stand far above float32 rounding (the default
    # init gives ~1e-6, at the rounding level), and the float64 truth of its scores.
    sharp = copy.deepcopy(tiny_1layer[0])
    with torch.no_grad():
        for prm in sharp.parameters():
            if prm.dim() > 1:
                prm.mul_(6.0)
    spm = as_probe_model(sharp)
    exact = oar_p_error_bound(sharp, batch, "answer_mean")
    w = exact.value.shape[1]
    assert_within_error_model(oar_p_scores(spm, batch).scores[:, :w], exact, what="default plan")
    for kw in (dict(memory_budget_mb=1), dict(memory_budget_mb=2**50), dict(max_variants_per_chunk=1)):
        got = oar_p_scores(spm, batch, **kw).scores[:, :w]
        assert_within_error_model(got, exact, what=str(kw))  # rule 1: every plan within the error model
    assert torch.isfinite(oar_g_scores(pm, batch, memory_budget_mb=2**50).scores).all()


def test_pad_id_must_be_a_valid_token(tiny_1layer, probe_batch):
    model, tok = tiny_1layer
    pm, _, _ = probe_batch
    with pytest.raises(ValueError, match=r"pad_id must be a token id \(an int >= 0\), got -1"):
        ProbeContextBuilder(tok, "x", pad_id=-1)
    big = ProbeContextBuilder(tok, "x", pad_id=10**6).build([[5, 6]], [[7, 8]], ["5"])
    with pytest.raises(ValueError, match=r"pad_id must be a token id in \[0, vocab_size=\d+\), got 1000000"):
        oar_p_scores(pm, big)


def test_build_reasoning_lens_must_be_integers(probe_batch):
    _, _, b = probe_batch
    with pytest.raises(ValueError, match=r"reasoning_lens\[0\] must be an int, got float 1\.5"):
        b.build([[5]], [[6, 7]], ["5"], reasoning_lens=[1.5])


class _ZeroProbModel:
    """A ProbeModel whose logits put -inf on token 0 whenever a real (attended) position holds PAD: every OAR-P
    variant then gives zero probability where the clean distribution has mass (KL = +inf)."""

    vocab_size = 8
    hidden_size = 4
    device = torch.device("cpu")

    def __init__(self, pad_id):
        self.pad_id = pad_id

    def embed(self, input_ids):
        return torch.zeros(*input_ids.shape, self.hidden_size)

    def activation_bytes_per_token(self, width, backward=False):
        return 4 * self.hidden_size

    def eval_mode(self):
        return contextlib.nullcontext()

    def tail_logits(self, *, input_ids=None, inputs_embeds=None, attention_mask, position_ids, keep):
        out = torch.zeros(input_ids.shape[0], keep, self.vocab_size)
        masked = ((input_ids == self.pad_id) & (attention_mask == 1)).any(1)
        out[masked, :, 0] = float("-inf")
        return out


def test_oar_p_infinite_divergence_is_an_error():
    b = ProbeContextBuilder(type("Tok", (), {"pad_token_id": 7, "eos_token_id": 7,
                                             "encode": lambda self, s, add_special_tokens=False: [1] * len(s),
                                             "decode": lambda self, ids, skip_special_tokens=False: "x" * len(ids)})(),
                            "c", answer_suffix="")
    batch = b.build([[2, 3]], [[4, 5, 6]], ["a"], reasoning_lens=[3])
    with pytest.raises(ValueError, match=r"oar_p_scores: masking reasoning token 0 of row 0 gives a non-finite "
                                         r"divergence \(inf\)"):
        oar_p_scores(_ZeroProbModel(7), batch)
    assert math.isinf(float(ops.probe_divergence(torch.zeros(1, 1, 3), torch.tensor([[[-math.inf, 0.0, 0.0]]]),
                                                 probe="last")))  # the op itself documents +inf


@pytest.mark.parametrize("engine", ["prefix", "batched"])
def test_oar_p_with_an_empty_conclude_scores_tokens_inside_the_probe_window(tiny, engine):
    """With ``conclude = ""`` the last reasoning token predicts the first answer token, so masking it changes a probe
    position itself; the prefix engine once started such a chunk past ``T - keep`` and read the wrong positions
    (0.29 off on this batch). Both engines against the one-at-a-time reference (rule 1 against float64)."""
    model, tok = tiny
    pids, rids, answers = probe_rollouts(tok)
    batch = ProbeContextBuilder(tok, "", "").build(pids, rids, answers)
    assert int((batch.reasoning_start + batch.reasoning_len).max()) > batch.input_ids.shape[1] - batch.keep
    res = oar_p_scores(HFProbeModel(model), batch, engine=engine)
    # truth: full masked contexts, float64, with the float32 error model (rule 1)
    assert_within_error_model(res.scores, oar_p_error_bound(model, batch, "answer_mean"),
                              what=f"{engine}, empty conclude")


def test_probe_view_cuts_only_the_columns_no_probe_reads(tiny):
    """``ProbeBatch.probe_view`` (what the OAR-P engines run) drops the last answer token and the suffix: the view
    is S + 1 columns narrower, its probe logits are the full contexts' (a causal model: the same float64 numbers up
    to summation order), it is its own view, and a batch whose reasoning reaches the last column is left whole."""
    model, tok = tiny
    pids, rids, _ = probe_rollouts(tok)
    builder = ProbeContextBuilder(tok, CONCLUDE)
    batch = builder.build(pids, rids, ["15", "3", "1234567"])  # answers of different lengths
    view = batch.probe_view()
    S, K = len(builder.suffix_ids), batch.answer_ids.shape[1]
    T = batch.input_ids.shape[1]
    assert S >= 1 and view.input_ids.shape[1] == T - S - 1 and view.keep == K == batch.keep - S - 1
    assert torch.equal(view.probe_start, batch.probe_start) and torch.equal(view.context_len, batch.context_len - S - 1)
    assert torch.equal(view.input_ids, batch.input_ids[:, :T - S - 1]) and view.probe_view() is view
    m = copy.deepcopy(model).double()
    with torch.no_grad():
        full = m(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
        cut = m(input_ids=view.input_ids, attention_mask=view.attention_mask, position_ids=view.position_ids).logits
    for r in range(3):
        k = int(batch.answer_len[r])
        a = full[r, T - batch.keep + int(batch.probe_start[r]):][:k]
        b = cut[r, T - S - 1 - view.keep + int(view.probe_start[r]):][:k]
        assert b.shape == a.shape == (k, m.config.vocab_size)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    # the predicted tokens are the answer's: the positions are the probe's
    assert torch.equal(view.input_ids[0, T - S - 1 - view.keep + int(view.probe_start[0]) + 1:][:1],
                       batch.answer_ids[0, :1])
    whole = builder.build(pids[:1], rids[:1], ["15"])
    whole.reasoning_start[0] = 0  # reasoning that runs to the end (a batch not from the builder): nothing is cut
    whole.reasoning_len[0] = whole.input_ids.shape[1]
    assert whole.probe_view() is whole


def test_window_run_columns_closed_form():
    """The window engine's re-run columns in closed form (``window._run_columns``) equal the set union they stand
    for, sorted and right-aligned with -1 padding, over random variants: windows before, touching and inside the
    tail, units of several tokens, windows cut at T."""
    from oar.attribution.window import _run_columns, _run_lengths

    g = torch.Generator().manual_seed(0)
    T = 40
    t = torch.randint(0, T - 1, (500,), generator=g)
    n = torch.randint(1, 4, (500,), generator=g)
    win_end = torch.minimum(t + n + torch.randint(0, 12, (500,), generator=g), torch.tensor(T))
    tail = torch.randint(0, T + 1, (500,), generator=g)
    run_len = _run_lengths(t, win_end, tail, T)
    S = int(run_len.max()) + 2
    cols = _run_columns(t, win_end, tail, run_len, S)
    for v in range(500):
        want = sorted(set(range(int(t[v]), int(win_end[v]))) | set(range(int(tail[v]), T)))
        assert int(run_len[v]) == len(want)
        assert cols[v].tolist() == [-1] * (S - len(want)) + want
