"""Invariants of the (experimental) linearized tail of windowed OAR-P (oar.attribution.linear_tail)."""

import pytest
import torch

from oar.app.models import tiny_random_llama
from oar.attribution import HFProbeModel, ProbeContextBuilder, oar_p_scores, oar_p_window_scores
from oar.attribution.linear_tail import oar_p_linear_tail_scores

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
