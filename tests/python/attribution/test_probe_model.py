"""The ProbeModel protocol (python/oar/attribution/model.py, docs/models.md): one clear error for a model that lacks
members, capabilities declared by their flags and checked once, the cost declaration reaching the planners, and
the page's example model scored against an independent one-at-a-time reference."""

import contextlib
import os
import re

import pytest
import torch

from oar.attribution import (
    EmbeddingNoiseModel,
    HFProbeModel,
    PrefixCacheModel,
    ProbeCapabilities,
    ProbeContextBuilder,
    ProbeModel,
    SharedPrefixModel,
    as_probe_model,
    entropy_scores,
    oar_g_scores,
    oar_p_scores,
    probe_capabilities,
)
from oar.testing import tiny_random_llama

from _error_model import error_bound
from _paths import ROOT
from _tolerance import assert_within_error_model

CONCLUDE = "\nThe answer is \\boxed{"
MISSING_ALL = "vocab_size, hidden_size, device, embed, tail_logits, activation_bytes_per_token, eval_mode"


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    model.eval()
    return model, tok


def _rollouts(tok):
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    return ([enc("Q: 2+3?"), enc("Q: 4+4? think")], [enc("2 and 3 make 5 \\boxed{5}"), enc("four and four \\boxed{8}")],
            ["5", "8"])


class Toy:
    """A complete ProbeModel without any capability: a causal running-mean LM in plain PyTorch."""

    def __init__(self, vocab_size, hidden_size=8, bytes_per_token=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.E = torch.randn(vocab_size, hidden_size, generator=g)
        self.W = torch.randn(hidden_size, vocab_size, generator=g) * 3
        self.vocab_size, self.hidden_size, self.device = vocab_size, hidden_size, torch.device("cpu")
        self.bytes_per_token = bytes_per_token
        self.declared = []  # (width, backward) of every cost query

    def embed(self, input_ids):
        return self.E[input_ids]

    def tail_logits(self, *, input_ids=None, inputs_embeds=None, attention_mask, position_ids, keep):
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        m = attention_mask.unsqueeze(-1).to(x.dtype)
        h = torch.tanh((x * m).cumsum(1) / m.cumsum(1).clamp_min(1))
        return (h @ self.W.to(h.dtype))[:, -keep:]

    def activation_bytes_per_token(self, width, backward=False):
        self.declared.append((width, backward))
        return self.bytes_per_token

    def eval_mode(self):
        return contextlib.nullcontext()


# ---- required members: one error, before anything runs ---------------------------------------------------------

class _Half:
    vocab_size = 10
    hidden_size = 4

    def embed(self, input_ids):
        raise AssertionError("never called")

    def tail_logits(self, **kw):
        raise AssertionError("never called")


def test_missing_members_are_listed_once_at_as_probe_model():
    with pytest.raises(TypeError, match=re.escape(f"model must implement oar.attribution.ProbeModel ({MISSING_ALL}); "
                                                  "test_probe_model._Half lacks device, activation_bytes_per_token, "
                                                  "eval_mode")):
        as_probe_model(_Half())
    with pytest.raises(TypeError, match=re.escape(f"builtins.object lacks {MISSING_ALL}")):
        as_probe_model(object())
    assert not isinstance(_Half(), ProbeModel)


@pytest.mark.parametrize("engine", [oar_p_scores, oar_g_scores, entropy_scores])
def test_engines_refuse_an_incomplete_model_before_any_call(tiny, engine):
    _, tok = tiny
    batch = ProbeContextBuilder(tok, CONCLUDE).build(*_rollouts(tok))
    with pytest.raises(TypeError, match=r"_Half lacks device, activation_bytes_per_token, eval_mode"):
        engine(_Half(), batch)


@pytest.mark.parametrize("name, value, match", [
    ("vocab_size", 0, r"model\.vocab_size must be an int >= 1, got int 0"),
    ("vocab_size", 5.0, r"model\.vocab_size must be an int >= 1, got float 5\.0"),
    ("hidden_size", True, r"model\.hidden_size must be an int >= 1, got bool True"),
])
def test_sizes_must_be_positive_ints(name, value, match):
    m = Toy(10)
    setattr(m, name, value)
    with pytest.raises(ValueError, match=match):
        as_probe_model(m)


def test_a_plain_module_is_not_taken_for_a_hugging_face_model():
    with pytest.raises(TypeError, match=r"HFProbeModel needs a Hugging Face causal LM \(with get_input_embeddings\), "
                                        r"got torch\.nn\.modules\.linear\.Linear"):
        as_probe_model(torch.nn.Linear(2, 2))


# ---- capabilities: declared by their flag, complete or refused -------------------------------------------------

def test_capabilities_of_a_plain_model_and_of_hf_models(tiny):
    model, _ = tiny
    assert probe_capabilities(Toy(10)) == ProbeCapabilities(False, False, False)
    pm = HFProbeModel(model)
    assert isinstance(pm, ProbeModel) and isinstance(pm, PrefixCacheModel) and isinstance(pm, SharedPrefixModel)
    assert isinstance(pm, EmbeddingNoiseModel)
    impl = model.config._attn_implementation  # transformers' default for a model built from a config: sdpa
    assert impl == "sdpa"
    assert probe_capabilities(pm) == ProbeCapabilities(prefix_cache=True, prefix_grad=True, prefix_extend=True,
                                                       shared_prefix=True, embedding_noise=True, activation_checkpointing=True,
                                                       attn_implementation="sdpa", dense_mask=True)
    pm.shared_prefix_attention = False
    assert probe_capabilities(pm) == ProbeCapabilities(prefix_cache=True, prefix_grad=True, prefix_extend=True,
                                                       shared_prefix=False, embedding_noise=True, activation_checkpointing=True,
                                                       attn_implementation="sdpa", dense_mask=True)
    assert as_probe_model(model).model is model and as_probe_model(pm) is pm


def test_a_declared_capability_must_be_complete():
    m = Toy(10)
    m.supports_prefix_cache = True
    with pytest.raises(TypeError, match=r"model declares supports_prefix_cache = True but lacks supports_prefix_grad, "
                                        r"kv_bytes_per_token, tail_logits_and_cache, tail_logits_cached of "
                                        r"oar\.attribution\.PrefixCacheModel"):
        probe_capabilities(m)
    m.supports_prefix_cache = "yes"
    with pytest.raises(TypeError, match=r"model\.supports_prefix_cache must be a bool, got str 'yes'"):
        probe_capabilities(m)
    m.supports_prefix_cache = False  # declared off: the members are not needed
    assert probe_capabilities(m) == ProbeCapabilities()
    m.supports_embedding_noise = True
    with pytest.raises(TypeError, match=r"model declares supports_embedding_noise = True but lacks noised_embeddings "
                                        r"of oar\.attribution\.EmbeddingNoiseModel"):
        probe_capabilities(m)


def test_noised_embeddings_replace_the_embedding_output_of_one_forward(tiny):
    """HFProbeModel.noised_embeddings: the forward runs on perturb(E) made a leaf (the gradient reaches it), the
    record holds the clean E of that forward, the hook is gone afterwards, and a context without exactly one
    forward is an error."""
    model, _ = tiny
    pm = HFProbeModel(model)
    ids = torch.tensor([[3, 5, 7, 9]])
    attn, pos = torch.ones_like(ids), torch.arange(4).unsqueeze(0)
    E = model.get_input_embeddings()(ids).detach()
    with pm.noised_embeddings(lambda e: e * 2) as rec:
        out = pm.tail_logits(input_ids=ids, attention_mask=attn, position_ids=pos, keep=2)
    assert torch.equal(rec.clean, E) and torch.equal(rec.noised, 2 * E) and rec.noised.requires_grad
    ref = pm.tail_logits(inputs_embeds=(2 * E).requires_grad_(True), attention_mask=attn, position_ids=pos, keep=2)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # the same forward on the same numbers
    (g,) = torch.autograd.grad(out.sum(), rec.noised)
    assert g.shape == E.shape and g.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())
    assert not model.get_input_embeddings()._forward_hooks  # removed on exit
    with pytest.raises(RuntimeError, match="expected one forward under the context, got 0"):
        with pm.noised_embeddings(lambda e: e):
            pass
    with pytest.raises(RuntimeError, match="more than one forward under one context"):
        with pm.noised_embeddings(lambda e: e):
            for _ in range(2):
                pm.tail_logits(input_ids=ids, attention_mask=attn, position_ids=pos, keep=1)
    assert not model.get_input_embeddings()._forward_hooks


def test_prefix_engine_needs_the_capability(tiny):
    _, tok = tiny
    batch = ProbeContextBuilder(tok, CONCLUDE).build(*_rollouts(tok))
    with pytest.raises(ValueError, match=r"engine='prefix' needs a ProbeModel with the prefix-cache capability .* "
                                         r"Toy does not declare it"):
        oar_p_scores(Toy(len(tok)), batch, engine="prefix")


# ---- the cost declaration is what the planners get -------------------------------------------------------------

def test_planners_use_the_declared_activation_cost(tiny):
    _, tok = tiny
    batch = ProbeContextBuilder(tok, CONCLUDE).build(*_rollouts(tok))
    T = batch.probe_view().input_ids.shape[1]  # the engines' width: without the columns no probe reads
    n = int(batch.reasoning_len.sum())
    # 1 MiB budget: 64 B/token fits every variant in one chunk; 2**20 B/token makes each variant a chunk of its own
    small, huge = Toy(len(tok), bytes_per_token=64), Toy(len(tok), bytes_per_token=2**20)
    one = oar_p_scores(small, batch, memory_budget_mb=1)
    each = oar_p_scores(huge, batch, memory_budget_mb=1)
    assert (one.stats["chunks"], each.stats["chunks"]) == (1, n)
    # asked once by the clean pass (plan_clean, full width T) and once by the variants (the widest context)
    assert small.declared == [(T, False), (T, False)]
    torch.testing.assert_close(one.scores, each.scores, rtol=0, atol=0)  # the same model: only the chunking differs
    g = Toy(len(tok), bytes_per_token=2**20)
    assert oar_g_scores(g, batch, memory_budget_mb=1, generator=torch.Generator().manual_seed(0)).stats["chunks"] == 2
    T_g = batch.input_ids.shape[1]  # OAR-G runs the whole context
    assert g.declared == [(T_g, False), (T_g, True)]  # its clean pass (chunked), then forward + backward


# ---- the page's example (docs/models.md) -----------------------------------------------------------------------

def _page_snippets():
    with open(os.path.join(ROOT, "docs", "models.md")) as f:
        blocks = re.findall(r"^```python oar-doctest\n(.*?)^```", f.read(), re.S | re.M)
    assert len(blocks) == 2, "docs/models.md: the model and the scoring snippet"
    return blocks


def _naive_answer_mean(tail, ctx, P, L, K, S, pad):
    """OAR-P of one unpadded context by definition: replace each reasoning token by ``pad`` in its own forward, KL
    of the mean answer-position logits, in the dtype of ``tail``'s logits: a list of L 0-d tensors."""
    def probe(ids):
        t = torch.tensor([ids])
        z = tail(t)[0]  # (len, V)
        first = len(ids) - S - K - 1
        return torch.log_softmax(z[first: first + K].mean(0), -1)

    clean = probe(ctx)
    out = []
    for j in range(L):
        masked = list(ctx)
        masked[P + j] = pad
        lp = probe(masked)
        out.append((clean.exp() * (clean - lp)).sum())
    return out


def _mean_pool_logits(net, dtype):
    """The page's MeanPoolLM on one unpadded (1, T) context, recomputed in ``dtype`` from its weights."""
    def f(t):
        e = net.emb.weight.to(dtype)[t]
        h = torch.tanh(e.cumsum(1) / torch.arange(1, t.shape[1] + 1, dtype=dtype).view(1, -1, 1))
        return h @ net.head.weight.to(dtype).T + net.head.bias.to(dtype)
    return f


def test_models_page_example_runs_and_is_exact(tiny):
    _, tok = tiny
    prompt_ids, response_ids, answers = _rollouts(tok)
    ns = {"tokenizer": tok, "prompt_ids": prompt_ids, "response_ids": response_ids, "answers": answers}
    for code in _page_snippets():
        exec(compile(code, "docs/models.md", "exec"), ns)
    res, batch, net = ns["res"], ns["batch"], ns["pm"].net
    assert ns["caps"] == ProbeCapabilities() and res.stats["engine"] == "batched"
    S = len(tok.encode("}", add_special_tokens=False))
    with torch.no_grad():
        for i in range(batch.batch_size):
            row = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
            P, L, K = len(prompt_ids[i]), int(batch.reasoning_len[i]), int(batch.answer_len[i])
            assert L > 0 and row[P: P + L] == response_ids[i][:L]
            def naive(row=row, P=P, L=L, K=K):
                terms = _naive_answer_mean(_mean_pool_logits(net, torch.float64), row, P, L, K, S, batch.pad_id)
                return torch.stack(terms), terms

            exact = error_bound(naive)  # float64 scores with their float32 error model
            assert exact.value.abs().max() > 1e-4, "toy model too flat: the comparison would be vacuous"
            # Rule 1 (_tolerance.py): the engine within the float32 error model of the float64 scores
            assert_within_error_model(res.scores[i, :L], exact, what=f"row {i}")
