"""Invariants of the linearized tail of windowed OAR-P (oar.attribution.linear_tail; config ``screen_tail: linear``)."""

import pytest
import torch

from oar.testing import tiny_random_llama
from oar.attribution import HFProbeModel, ProbeContextBuilder, oar_p_scores, oar_p_window_scores
from oar.attribution.linear_tail import _tail_response, linear_tail_support, oar_p_linear_tail_scores

from _devices import DEVICES

CONCLUDE = "\nTherefore, the final answer is \\boxed{"


def _sharp(seed=1, kv_heads=2):
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=kv_heads,
                                   tokenizer="minimal", seed=seed)
    with torch.no_grad():  # sharpened as test_attribution's `tiny` fixture: divergences O(1e-3 .. 1)
        for prm in model.parameters():
            if prm.dim() > 1:
                prm.mul_(6.0)
    model.eval()
    return model, tok


@pytest.fixture(scope="module")
def tiny():
    model, tok = _sharp()
    b = ProbeContextBuilder(tok, CONCLUDE)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    batch = b.build([enc("Q: 2+13?"), enc("Q: what is 7-4? be brief"), enc("Q: 1?")],
                    [enc("2 plus 13 is 15 so the answer"), enc("seven minus four gives 3"), []],
                    ["15", "3", "1"])
    return HFProbeModel(model), batch


@pytest.mark.parametrize("probe", ["answer_mean", "last", "answer_joint"])
def test_full_window_is_exact_oar_p(tiny, probe):
    pm, batch = tiny
    L = int(batch.reasoning_len.max())
    ex = oar_p_scores(pm, batch, probe=probe)
    lt = oar_p_linear_tail_scores(pm, batch, window=L - 1, probe=probe)
    assert lt.stats["linearized"] == 0 and lt.stats["backward_passes"] == 0
    assert torch.equal(lt.mask, ex.mask)
    torch.testing.assert_close(lt.scores, ex.scores, rtol=1e-4, atol=2e-6)


def test_variants_reaching_the_tail_are_exact(tiny):
    pm, batch = tiny
    W = 3
    ex = oar_p_scores(pm, batch, probe="answer_mean")
    lt = oar_p_linear_tail_scores(pm, batch, window=W, probe="answer_mean")
    for r in range(batch.batch_size):
        L = int(batch.reasoning_len[r])
        if L == 0:
            continue
        j = torch.arange(max(0, L - 1 - W), L)  # t + 1 + W >= L: the window reaches the end of the reasoning
        torch.testing.assert_close(lt.scores[r, j], ex.scores[r, j], rtol=1e-4, atol=2e-6)


def test_shapes_dtype_stats(tiny):
    pm, batch = tiny
    lt = oar_p_linear_tail_scores(pm, batch, window=1, probe="answer_mean", top_r=4, rows=[0, 2])
    L = int(batch.reasoning_len.max())
    assert lt.scores.shape == (batch.batch_size, L) and lt.scores.dtype == torch.float32
    assert bool(torch.isfinite(lt.scores).all()) and bool((lt.scores >= 0).all())
    assert not lt.mask[1].any() and not lt.mask[2].any()  # row 1 not asked, row 2 has no reasoning
    assert int(lt.mask[0].sum()) == int(batch.reasoning_len[0])
    assert lt.stats["variants"] == int(batch.reasoning_len[0])
    assert lt.stats["backward_passes"] == 5  # top_r + the rest cell, once per linearized row
    assert lt.stats["cost_tokens"] == lt.stats["tokens"] + lt.stats["backward_tokens"]
    assert lt.scores[0, : int(batch.reasoning_len[0])].max() > 0


def test_close_to_the_rerun_tail(tiny):
    # the sharpened model is far from linear; the linear tail still tracks the re-run (conclude) tail closely
    pm, batch = tiny
    for probe in ("answer_mean", "answer_joint"):
        w = oar_p_window_scores(pm, batch, window=2, probe=probe)
        lt = oar_p_linear_tail_scores(pm, batch, window=2, probe=probe, top_r=1000, exact_reach=False)
        m = w.mask
        c = torch.corrcoef(torch.stack([w.scores[m], lt.scores[m]]))[0, 1]
        assert c > 0.98, (probe, float(c))


def test_small_perturbations_approach_the_rerun_tail():
    """PAD's embedding eps away from the (single) reasoning token's: the tail's response is linear to O(eps), so
    the relative error of the linear tail against the re-run tail shrinks with eps."""
    model, tok = _sharp()
    pm = HFProbeModel(model)
    b = ProbeContextBuilder(tok, CONCLUDE)
    x = tok.encode("a", add_special_tokens=False)
    batch = b.build([tok.encode("Q: 2+13?", add_special_tokens=False)], [x * 10], ["b"])
    E = model.get_input_embeddings().weight
    ex = E[x[0]].detach().clone()
    u = torch.randn(E.shape[1], generator=torch.Generator().manual_seed(0))
    errs = []
    for eps in (0.1, 0.01):
        with torch.no_grad():
            E[b.pad_id] = ex + eps * u * ex.norm() / u.norm()
        w = oar_p_window_scores(pm, batch, window=3, probe="answer_joint").scores[0]
        lt = oar_p_linear_tail_scores(pm, batch, window=3, probe="answer_joint", exact_reach=False).scores[0]
        assert w.abs().max() > 1e-4
        errs.append(float((lt - w).abs().max() / w.abs().max()))
    assert errs[1] < 0.01 and errs[1] < errs[0], errs


@pytest.mark.parametrize("kw, name", [({"window": -1}, "window"), ({"window": 1.5}, "window"),
                                      ({"window": 1, "top_r": 0}, "top_r"),
                                      ({"window": 1, "exact_reach": "yes"}, "exact_reach"),
                                      ({"window": 1, "probe": "mean"}, "probe"),
                                      ({"window": 1, "rows": [7]}, "rows")])
def test_bad_arguments(tiny, kw, name):
    pm, batch = tiny
    with pytest.raises(ValueError, match=name):
        oar_p_linear_tail_scores(pm, batch, **kw)


def test_model_must_be_hf_probe_model(tiny):
    pm, batch = tiny
    with pytest.raises(ValueError, match="model"):
        oar_p_linear_tail_scores(pm.model, batch, window=1)


def test_positions_score_those_tokens_only(tiny):
    """``positions``: the variants of the listed tokens only, each scored as in the full run (a variant's score
    depends on its row's clean pass, Jacobian and readout cells alone, which are the same); the row's other tokens
    score 0 (as the window engine's)."""
    pm, batch = tiny
    full = oar_p_linear_tail_scores(pm, batch, window=1)
    pos = {0: [0, 2, 5], 1: [1]}
    part = oar_p_linear_tail_scores(pm, batch, window=1, rows=[0, 1], positions=pos)
    assert part.stats["variants"] == 4
    for r, js in pos.items():
        # other chunks, other float32 summation orders: ~eps32 x |log p| ~ 1e-6 on a KL (as in the chunking test)
        torch.testing.assert_close(part.scores[r, js], full.scores[r, js], rtol=1e-4, atol=2e-6)
        assert float(full.scores[r, js].max()) > 2e-5  # ten times atol: the comparison has content
        others = [j for j in range(int(batch.reasoning_len[r])) if j not in js]
        assert (part.scores[r, others] == 0).all()
    assert not part.mask[2].any()
    with pytest.raises(ValueError, match=r"positions\[0\] must be reasoning indices"):
        oar_p_linear_tail_scores(pm, batch, window=1, positions={0: [99]})


def test_spans_with_a_full_window_are_exact_span_oar_p(tiny):
    """``spans``: one variant per span masking all its tokens; with ``window >= L - 1`` nothing is linearized and the
    scores are exact span OAR-P's (the exact engine on the same spans; same tolerance as the token case)."""
    pm, batch = tiny
    spans = {0: [(0, 2), (2, 5), (5, int(batch.reasoning_len[0]))], 1: [(0, 1), (1, 4)]}
    L = int(batch.reasoning_len.max())
    ex = oar_p_scores(pm, batch, rows=[0, 1], spans=spans)
    lt = oar_p_linear_tail_scores(pm, batch, window=L - 1, rows=[0, 1], spans=spans)
    assert lt.stats["variants"] == 5 and lt.stats["linearized"] == 0
    assert torch.equal(lt.mask, ex.mask)
    torch.testing.assert_close(lt.scores, ex.scores, rtol=1e-4, atol=2e-6)
    short = oar_p_linear_tail_scores(pm, batch, window=0, rows=[0, 1], spans=spans)
    for r, units in spans.items():  # every token of a span carries the span's score
        for j0, j1 in units:
            assert bool((short.scores[r, j0:j1] == short.scores[r, j0]).all())


def test_tail_response_is_float32_outside_autocast(tiny):
    """The linear arithmetic (a difference of near-equal attention sums) runs in float32 with autocast off: bf16
    inputs give a float32 result, the same with and without a bf16 autocast around it, and within bf16's input
    rounding of the float64 computation on the same (rounded) inputs."""
    pm, batch = tiny
    from oar.attribution.linear_tail import _net
    net = _net(pm)
    g = torch.Generator().manual_seed(0)
    kvH, d, n, nt, N, S, R = net.kv_heads, net.head_dim, 12, 4, 3, 5, 6
    H, gq, nl = net.heads, net.heads // net.kv_heads, len(net.layers)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    K0, V0, Q0 = bf(kvH, n, d), bf(kvH, n, d), bf(H, nt, d)
    # a consistent clean state: the tail's log-sum-exps and outputs of causal attention over the clean keys
    s_ = torch.einsum("kgid,knd->kgin", Q0.double().view(kvH, gq, nt, d), K0.double()) * net.scale
    s_ = s_.masked_fill(torch.arange(n)[None, :] > torch.arange(n - nt, n)[:, None], float("-inf"))
    lse0 = torch.logsumexp(s_, -1)
    A0 = torch.einsum("kgin,knd->kgid", torch.exp(s_ - lse0[..., None]), V0.double())
    Ks, Vs, Qt = [K0] * nl, [V0] * nl, [Q0] * nl
    At, Lt = [A0.reshape(H, nt, d).to(torch.bfloat16)] * nl, [lse0.reshape(H, nt).to(torch.bfloat16)] * nl
    J = torch.randn(R, nl, nt, H * d, generator=g)
    cq = torch.stack([torch.randperm(n - nt, generator=g)[:S] for _ in range(N)])  # distinct window columns
    wmask = torch.rand(N, S, generator=g) > 0.3
    k, v = bf(N, kvH, S, d), bf(N, kvH, S, d)
    plain = _tail_response(net, 0, cq, wmask, k, v, Ks, Vs, Qt, At, Lt, J)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = _tail_response(net, 0, cq, wmask, k, v, Ks, Vs, Qt, At, Lt, J)
    assert plain.dtype == auto.dtype == torch.float32 and plain.shape == (N, R)
    assert torch.equal(plain, auto)
    f64 = lambda xs: [x.double() for x in xs]  # noqa: E731
    want = _tail_response(net, 0, cq, wmask, k.double(), v.double(), f64(Ks), f64(Vs), f64(Qt), f64(At), f64(Lt),
                          J.double())
    # float32: exp of O(10) arguments (relative 1e-6), sums of S * d terms, a contraction of nt * H * d terms of
    # O(1): the result's error is ~1e-6 x sqrt(terms) x the terms' size
    torch.testing.assert_close(plain.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert float(want.abs().max()) > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_runs_on_the_model_device(tiny, device):
    """The engine runs where the model lives (every tensor it builds on the model's device); scores on the CPU
    (float32 Attribution) equal the CPU run's within float32 kernels' differences."""
    import copy

    pm, batch = tiny
    want = oar_p_linear_tail_scores(pm, batch, window=1)
    moved = HFProbeModel(copy.deepcopy(pm.model).to(device))
    got = oar_p_linear_tail_scores(moved, batch, window=1)
    assert got.scores.device.type == "cpu" and torch.equal(got.mask, want.mask)
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-3, atol=1e-6)


def test_sharded_parameters_are_refused(tiny):
    """Parameters the modules cannot use one by one (DeepSpeed ZeRO-3's, an FSDP2 module) are refused with the
    wrapper's name, before any forward; a plain model is accepted."""
    import copy

    from torch.distributed.fsdp import FSDPModule

    pm, batch = tiny
    assert linear_tail_support(pm) is None
    zero3 = copy.deepcopy(pm.model)
    next(zero3.parameters()).ds_id = 0  # what deepspeed.zero.Init sets on every partitioned parameter
    assert "DeepSpeed ZeRO-3" in linear_tail_support(HFProbeModel(zero3))
    with pytest.raises(ValueError, match="needs unsharded parameters; the model is sharded by DeepSpeed ZeRO-3"):
        oar_p_linear_tail_scores(HFProbeModel(zero3), batch, window=1)
    fsdp2 = copy.deepcopy(pm.model)
    layer = fsdp2.model.layers[0]
    layer.__class__ = type("FSDP" + type(layer).__name__, (FSDPModule, type(layer)), {})  # as fully_shard does
    assert "FSDP2" in linear_tail_support(HFProbeModel(fsdp2))


def test_chunking_does_not_change_the_scores(tiny, monkeypatch):
    """Chunks of two variants (each reading the prefix up to its own last start) give the one-chunk scores."""
    import oar.attribution.linear_tail as lt

    pm, batch = tiny
    want = oar_p_linear_tail_scores(pm, batch, window=2)
    monkeypatch.setattr(lt, "_CHUNK_VARIANTS", 2)
    got = oar_p_linear_tail_scores(pm, batch, window=2)
    assert got.stats["forward_passes"] > want.stats["forward_passes"] + 4
    # other shapes, other float32 summation orders: a KL of near-equal distributions carries ~eps32 x |log p| ~ 1e-6
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-4, atol=2e-6)
