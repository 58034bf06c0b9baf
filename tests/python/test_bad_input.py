"""Adversarial inputs: every public entry point either raises a ValueError that names the argument, the
expected and the actual value, or returns a finite, well-formed result. Never NaN/Inf silently, never a
crash, never uninitialized memory handed back as a result. One test (or parametrized case) per finding.

The op-level cases (oar.ops.*) live in each op's test file, in its bad-input table (test_group_advantages.py,
test_normalize_importance.py, test_reshape_advantages.py, test_probe_divergence.py, test_grad_x_input.py,
test_build_masked_batch.py). Here: configuration, the hook and the attribution engines."""

import contextlib
import json
import math
import re

import pytest
import torch

import oar
from oar import ops
from oar.attribution import ProbeContextBuilder, as_probe_model, oar_g_scores, oar_p_scores
from oar.config import load_config, parse_overrides
from oar.hook import TokenAdvantageHook
from oar.models import tiny_random_llama

from _completions import completion_batch


# ---- configuration -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, match", [
    ('{"q": 1e400}', r"oar config is not valid JSON: .*number overflow parsing '1e400'"),
    ('{"seed": 9223372036854775808}', r"oar\.seed must fit in a signed 64-bit integer, got 9223372036854775808"),
    ('{"memory_budget_mb": 18446744073709551615}', r"oar\.memory_budget_mb must fit in a signed 64-bit integer"),
    ('{"method": 1}', r"^oar\.method must be a string, got number 1$"),
    ('{"std": null}', r"^oar\.std must be a string, got null$"),
    ('{"q": null}', r"^oar\.q must be a number, got null$"),
])
def test_oar_config_from_json_errors(text, match):
    with pytest.raises(ValueError, match=match):
        oar.OARConfig.from_json(text)


def _yaml(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text, match", [
    ("oar: {q: .inf}", r"oar\.q must be finite, got inf"),
    ("oar: {q: .nan}", r"oar\.q must be finite, got nan"),
    ("oar: {when: 2020-01-01}", r"oar\.when must be a number, string, bool or list, got date"),
    ("oar: {q: 0.3", r"is not valid YAML"),
    ("run: {seed: abc}", r"run\.seed must be an integer, got str 'abc'"),
    ("model: {dtype: zeros}", r"model\.dtype must name a floating torch dtype .*got 'zeros'"),
])
def test_load_config_errors(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_config(_yaml(tmp_path, text))


def test_load_config_directory_is_not_a_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist \(or is not a file\)"):
        load_config(str(tmp_path))


def test_yaml_scientific_notation_is_a_number(tmp_path):
    # PyYAML (YAML 1.1) reads 1e-3 as a string, which the schema then refused as "not a number".
    cfg = load_config(_yaml(tmp_path, "oar: {sigma: 1e-3, q: 2.5E-1}"))
    assert cfg.oar.sigma == pytest.approx(1e-3) and cfg.oar.reshape.q == pytest.approx(0.25)
    assert load_config(None, ["oar.sigma=2e-3"]).oar.sigma == pytest.approx(2e-3)


@pytest.mark.parametrize("items, match", [
    (["oar..q=1"], r"has an empty key part"),
    (["oar.q=[1"], r"the value of override 'oar\.q=\[1' is not valid YAML"),
    (["oar.q=1", "oar.q.x=2"], r"sets a key inside 'q'"),
])
def test_parse_overrides_errors(items, match):
    with pytest.raises(ValueError, match=match):
        parse_overrides(items)


@pytest.mark.parametrize("item, match", [
    ("oar.q=2", r"oar\.q must be in \(0, 1\), got 2"),
    ("grpo.max_steps=abc", r"grpo\.max_steps must be an integer"),
    ("eval.problems=-1", r"eval\.problems must be an integer >= 0, got -1"),
    ("eval.before_cache=3", r"eval\.before_cache must be a file path or null, got 3"),
])
def test_cli_train_bad_set_is_a_usage_error(tmp_path, capsys, item, match):
    from oar.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--set", item, "--output-dir", str(tmp_path / "run")])
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()  # nothing written for a rejected config


# ---- hook and engines ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal")


def _hook_batch(tok, C=12):
    return completion_batch(tok, ["so 2 and 3 \\boxed{5}", "hmm 9"], C, eos=False)


def _hook(tok, method="oar_p"):
    return TokenAdvantageHook(oar.OARConfig.from_json(json.dumps({"method": method})), tok)


@pytest.mark.parametrize("method", ["oar_p", "oar_g"])
def test_hook_bad_arguments(tiny, method):
    model, tok = tiny
    P, ids, mask = _hook_batch(tok)
    h = _hook(tok, method)
    ans = ["5", "5"]
    cases = [
        (dict(advantages=[1.0, -1.0]), r"advantages must be a \(B,\) tensor of sequence advantages, got list"),
        (dict(completion_ids=None), r"completion_ids must be a \(B, C\) tensor, got NoneType"),
        (dict(completion_ids=ids.float()), r"completion_ids must be an integer tensor of token ids, got dtype torch\.float32"),
        (dict(completion_ids=ids + 100000), r"completion_ids must be token ids in \[0, \d+\), got \d+ at \[0, 0\]"),
        (dict(completion_ids=ids - 100000), r"completion_ids must be token ids in \[0, \d+\), got -\d+"),
        (dict(prompt_ids=[[10**6], [1]]), r"prompt_ids\[0\] must be token ids in \[0, \d+\), got 1000000 at position 0"),
        (dict(prompt_ids=[torch.tensor([P[0]])] * 2), r"prompt_ids\[0\] must be a 1-D integer tensor of token ids"),
        (dict(prompt_ids=[[1.5], [1]]), r"prompt_ids\[0\] must hold integer token ids, got 1\.5"),
        (dict(advantages=torch.tensor([3e38, -1.0])), r"advantages\[0\] = 3e\+38 times its weight .* overflows float32"),
        (dict(advantages=torch.tensor([1e300, -1.0], dtype=torch.float64)), r"advantages must fit in float32"),
        (dict(advantages=torch.ones(2, device="meta")), r"advantages must hold data, got a tensor on the meta device"),
    ]
    for over, match in cases:
        args = dict(prompt_ids=P, completion_ids=ids, completion_mask=mask, advantages=torch.tensor([1.0, -1.0]),
                    answers=ans)
        args.update(over)
        with pytest.raises(ValueError, match=match):
            h.compute(model, **args)


@pytest.mark.parametrize("method", ["oar_p", "oar_g", "entropy", "random"])
def test_hook_degenerate_batches_are_well_formed(tiny, method):
    model, tok = tiny
    P, ids, mask = _hook_batch(tok)
    h = _hook(tok, method)
    A2 = torch.tensor([1.0, -1.0])
    for p, i, m, a, ans in [
        ([], ids[:0], mask[:0], A2[:0], []),                       # B = 0
        (P, ids[:, :0], mask[:, :0], A2, ["5", "5"]),              # completions of length 0
        (P, ids, torch.zeros_like(mask), A2, ["5", "5"]),          # all-padding rows
    ]:
        out = h.compute(model, p, i, m, a, ans)
        assert out.advantages.shape == i.shape and torch.isfinite(out.advantages).all()
        assert (out.advantages[~m.bool()] == 0).all()
    with pytest.raises(ValueError, match=r"answers: reference answer '' encodes to no tokens"):
        h.compute(model, P, ids, mask, A2, ["", "5"])


@pytest.fixture(scope="module")
def probe_batch(tiny):
    model, tok = tiny
    b = ProbeContextBuilder(tok, "\nTherefore, the final answer is \\boxed{")
    P = tok.encode("Q: 2+3?", add_special_tokens=False)
    batch = b.build([P, P], [tok.encode("so 2 and 3 ", add_special_tokens=False), tok.encode("hmm", add_special_tokens=False)],
                    ["5", "15"])
    return as_probe_model(model), batch, b


@pytest.mark.parametrize("engine", [oar_p_scores, oar_g_scores])
@pytest.mark.parametrize("kwargs, match", [
    (dict(rows=[0.5]), r"rows\[i\] must be an int, got float 0\.5"),
    (dict(rows=[True]), r"rows\[i\] must be an int, got bool True"),
    (dict(rows="0"), r"rows must be a sequence of row indices"),
    (dict(memory_budget_mb=0), r"memory_budget_mb must be an int >= 1, got 0"),
    (dict(memory_budget_mb=0.5), r"memory_budget_mb must be an int >= 1, got 0\.5"),
    (dict(memory_budget_mb=None), r"memory_budget_mb must be an int >= 1, got None"),
    (dict(clean_logits=torch.zeros(1, 1, 1)), r"clean_logits must be \(B, K_max, V\) with \(B, K_max\) = \(2, 2\), got \(1, 1, 1\)"),
])
def test_engine_bad_arguments(probe_batch, engine, kwargs, match):
    pm, batch, _ = probe_batch
    with pytest.raises(ValueError, match=match):
        engine(pm, batch, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_variants_per_chunk=1.5), r"max_variants_per_chunk must be an int, got float 1\.5"),
    (dict(max_variants_per_chunk=-1), r"max_variants_per_chunk must be >= 0"),
])
def test_oar_p_bad_chunking(probe_batch, kwargs, match):
    pm, batch, _ = probe_batch
    with pytest.raises(ValueError, match=match):
        oar_p_scores(pm, batch, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sigma=float("inf")), r"sigma must be > 0 and finite, got inf"),
    (dict(noise_draws=1.5), r"noise_draws must be an int, got float 1\.5"),
])
def test_oar_g_bad_noise(probe_batch, kwargs, match):
    pm, batch, _ = probe_batch
    with pytest.raises(ValueError, match=match):
        oar_g_scores(pm, batch, **kwargs)


def test_engine_budget_extremes_plan_correctly(tiny, probe_batch):
    import copy

    from oar import reference

    from _tolerance import assert_close_to_reference

    pm, batch, _ = probe_batch
    # A sharpened copy of the tiny model, whose divergences (~1e-2) stand far above float32 rounding (the default
    # init gives ~1e-6, at the rounding level), and the float64 truth of its scores.
    sharp = copy.deepcopy(tiny[0])
    with torch.no_grad():
        for prm in sharp.parameters():
            if prm.dim() > 1:
                prm.mul_(6.0)
    spm = as_probe_model(sharp)
    truth = torch.zeros(batch.batch_size, int(batch.reasoning_len.max()), dtype=torch.float64)
    for r, scores in reference.oar_p_naive(copy.deepcopy(sharp).double(), batch, mode="batched").items():
        for j, v in scores.items():
            truth[r, j] = v
    w = truth.shape[1]
    ref = oar_p_scores(spm, batch).scores[:, :w]
    for kw in (dict(memory_budget_mb=1), dict(memory_budget_mb=2**50), dict(max_variants_per_chunk=1)):
        got = oar_p_scores(spm, batch, **kw).scores[:, :w]
        assert_close_to_reference(got, truth, ref, what=str(kw))  # rule 1: every plan as accurate as the default
    assert torch.isfinite(oar_g_scores(pm, batch, memory_budget_mb=2**50).scores).all()


def test_pad_id_must_be_a_valid_token(tiny, probe_batch):
    model, tok = tiny
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
