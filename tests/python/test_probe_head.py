"""The probe logits in float32 (``HFProbeModel.probe_logits_float32``, issue 23): under bf16 the LM head's output
rounding is of the size of the probe divergences, so the engines take the head's product in float32."""

import pytest
import torch

from oar.attribution import HFProbeModel
from oar.attribution import model as model_mod
from oar.app.models import tiny_random_llama

from _tolerance import gamma


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, tokenizer="minimal", seed=2)
    model.eval()
    return model, tok


def _inputs(tok):
    ids = torch.tensor([tok.encode("2 plus 13 is 15, so", add_special_tokens=False)])
    T = ids.shape[1]
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(T)[None], keep=4)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_linear_float32_is_the_float32_product(weight_dtype, monkeypatch):
    """Chunked upcast (3 chunks here) = the float32 product of the same operands, within float32 dot-product
    rounding (gamma_H x |x| |w|); float32 output; differentiable in x."""
    monkeypatch.setattr(model_mod, "_HEAD_CHUNK_ROWS", 7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 16, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(20, 16, generator=g).to(weight_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model_mod._linear_float32(x, w, None)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 20)
    want = x.detach().double() @ w.double().t()
    bound = gamma(16) * (x.detach().double().abs() @ w.double().abs().t())
    assert bool(((out.detach().double() - want).abs() <= bound).all())
    out.sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def test_probe_logits_are_float32_under_bf16_autocast(tiny):
    """Under bf16 autocast the trunk runs in bf16 and the probe logits come out float32: the float32 product of the
    bf16 final hidden state with the head's weight (the model's own head would round them to bf16)."""
    model, tok = tiny
    pm = HFProbeModel(model)
    kw = _inputs(tok)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = pm.tail_logits(**kw)
        hidden = model.model(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"],
                             position_ids=kw["position_ids"]).last_hidden_state[:, -kw["keep"]:]
        pm.probe_logits_float32 = False
        plain = pm.tail_logits(**kw)
    assert got.dtype == torch.float32 and plain.dtype == torch.bfloat16
    w = model.get_output_embeddings().weight.detach()
    want = hidden.double() @ w.double().t()
    bound = gamma(w.shape[1]) * (hidden.double().abs() @ w.double().abs().t())
    assert bool(((got.double() - want).abs() <= bound).all())
    # the bf16 head's own rounding is far larger: what the float32 product removes
    assert float((plain.double() - want).abs().max()) > 10 * float(bound.max())
    assert "forward" not in model.get_output_embeddings().__dict__  # the head is restored


def test_float32_model_is_unchanged(tiny):
    """A float32 model outside autocast: the same logits with and without the float32 head (plain F.linear)."""
    model, tok = tiny
    pm = HFProbeModel(model)
    kw = _inputs(tok)
    with torch.no_grad():
        a = pm.tail_logits(**kw)
        pm.probe_logits_float32 = False
        b = pm.tail_logits(**kw)
    assert torch.equal(a, b)
