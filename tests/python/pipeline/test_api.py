"""oar.token_advantages: every method selectable by name, ablations and probes, against the building blocks
(group advantages, baselines, reshaping) computed separately."""

import json

import pytest
import torch

import oar
from oar import baselines, ops, reference
from oar.testing import tiny_random_llama
from oar.attribution import policy_entropies
from _completions import completion_batch
from _tolerance import assert_close_to_rounded, assert_within, mass_bound


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, tokenizer="minimal", seed=3)


def _batch(tok, C=30):
    texts = ["so 2 and 3 make 5 \\boxed{5}", "hmm 9 \\boxed{9}", "I think 5", "2+3=5 #### 5",
             "4 4 4 \\boxed{8}", "5 \\boxed{5}"]
    prompts, ids, mask = completion_batch(tok, texts, C)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    return prompts, ids, mask, rewards


def _cfg(**kw):
    return oar.OARConfig.from_json(json.dumps(kw))


def _call(tiny, **kw):
    model, tok = tiny
    prompts, ids, mask, rewards = _batch(tok)
    cfg = _cfg(**kw)
    return oar.token_advantages(rewards, group_size=3, model=model, tokenizer=tok, prompt_ids=prompts,
                                completion_ids=ids, completion_mask=mask, answers=["5"] * 6, config=cfg), (ids, mask, rewards)


def test_every_schema_method_is_selectable():
    assert set(oar.METHODS) == {"grpo", "dr_grpo", "random", "entropy", "entropy_shaping", "ktae", "oar_p", "oar_g"}
    for m in oar.METHODS:
        assert _cfg(method=m).method == m


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "random", "entropy", "oar_p", "oar_g"])
def test_reshaping_methods_keep_mass(tiny, method):
    out, (ids, mask, rewards) = _call(tiny, method=method)
    est = "dr_grpo" if method == "dr_grpo" else "grpo"
    seq = reference.group_advantages(rewards.double(), group_size=3, estimator=est)
    assert_close_to_rounded(out.sequence_advantages, seq, what="sequence advantages")  # float64 rounded once
    seq = out.sequence_advantages
    m = mask.bool()
    assert_within(out.advantages.sum(1), seq * m.sum(1), mass_bound(seq, m.sum(1)), "mass")
    assert (out.advantages[~m] == 0).all()
    if method in ("grpo", "dr_grpo"):
        torch.testing.assert_close(out.advantages, seq[:, None] * m, rtol=0, atol=0)
    else:
        assert out.reasoning_mask.any()
        # the reshaping is ops.reshape_advantages of the scores it reports (same q, beta, floor): the same op
        exp, _ = ops.reshape_advantages(seq, out.scores, out.reasoning_mask, m)
        torch.testing.assert_close(out.advantages, exp, rtol=0, atol=0)


def test_dr_grpo_is_not_std_scaled(tiny):
    out, (_, _, rewards) = _call(tiny, method="dr_grpo")
    r = rewards.double()
    exp = r - r.view(2, 3).mean(1).repeat_interleave(3)
    assert_close_to_rounded(out.sequence_advantages, exp, what="dr_grpo advantages")


@pytest.mark.parametrize("tiers", ["boost", "suppress"])
@pytest.mark.parametrize("probe", ["last", "answer_joint"])
def test_ablations_and_probe_choice(tiny, tiers, probe):
    out, (ids, mask, rewards) = _call(tiny, method="oar_p", tiers=tiers, probe=probe, q=0.5)
    m = mask.bool()
    exp, w = ops.reshape_advantages(out.sequence_advantages, out.scores, out.reasoning_mask, m, q=0.5, tiers=tiers)
    torch.testing.assert_close(out.advantages, exp, rtol=0, atol=0)  # the same op on the same inputs
    torch.testing.assert_close(out.weights, w, rtol=0, atol=0)
    both, _ = ops.reshape_advantages(out.sequence_advantages, out.scores, out.reasoning_mask, m, q=0.5)
    assert not torch.allclose(both, exp)  # the ablation changes something on this batch


def test_entropy_shaping_equals_baseline(tiny):
    model, tok = tiny
    out, (ids, mask, rewards) = _call(tiny, method="entropy_shaping", entropy_alpha=0.3, entropy_kappa=3.0)
    prompts = _batch(tok)[0]
    seq = ops.group_advantages(rewards, group_size=3)
    # the pipeline runs the policy on the rows with A != 0 only: the same forwards, the same entropies
    H = policy_entropies(model, prompts, ids, mask.bool() & (seq != 0)[:, None])
    exp = baselines.entropy_shaping_advantages(seq, H, mask, alpha=0.3, kappa=3.0)
    torch.testing.assert_close(out.advantages, exp, rtol=0, atol=0)
    assert out.metrics["oar/forward_passes"] >= 1


def test_ktae_equals_baseline_and_scores_eos_zero(tiny):
    model, tok = tiny
    out, (ids, mask, rewards) = _call(tiny, method="ktae", ktae_tf=False)
    seq = ops.group_advantages(rewards, group_size=3)
    bonus = baselines.ktae_token_scores(ids, mask, rewards, group_size=3, tf=False,
                                        ignore_ids=[tok.eos_token_id, tok.pad_token_id])
    # A + bonus of two float32 values is exact in float64 and rounded once either way: equal
    torch.testing.assert_close(out.advantages, (seq[:, None] + bonus) * mask.bool(), rtol=0, atol=0)
    assert (out.scores[ids == tok.eos_token_id] == 0).all()
    # no tokenizer: ktae runs without one (EOS then gets a score like any token)
    out2 = oar.token_advantages(rewards, group_size=3, completion_ids=ids, completion_mask=mask,
                                config=_cfg(method="ktae", ktae_tf=False))
    bonus2 = baselines.ktae_token_scores(ids, mask, rewards, group_size=3, tf=False)
    torch.testing.assert_close(out2.advantages, (seq[:, None] + bonus2) * mask.bool(), rtol=0, atol=0)


def test_ragged_groups_and_eligible_mask(tiny):
    model, tok = tiny
    prompts, ids, mask, rewards = _batch(tok)
    elig = mask.clone()
    elig[0, 2:4] = 0  # e.g. tool output inside the completion
    out = oar.token_advantages(rewards, offsets=[0, 2, 6], model=model, tokenizer=tok, prompt_ids=prompts,
                               completion_ids=ids, completion_mask=mask, answers=["5"] * 6,
                               config=_cfg(method="oar_g"), eligible_mask=elig, preset="verl")
    seq = reference.group_advantages(rewards.double(), [0, 2, 6], preset="verl")
    assert_close_to_rounded(out.sequence_advantages, seq, what="sequence advantages")
    seq = out.sequence_advantages
    assert_within(out.advantages.sum(1), seq * elig.sum(1), mass_bound(seq, elig.sum(1)), "mass")
    assert (out.advantages[0, 2:4] == 0).all()


@pytest.mark.parametrize("method, missing", [("oar_p", "model"), ("oar_g", "answers"), ("random", "tokenizer"),
                                             ("entropy_shaping", "model")])
def test_missing_inputs_are_named(tiny, method, missing):
    model, tok = tiny
    prompts, ids, mask, rewards = _batch(tok)
    kw = dict(model=model, tokenizer=tok, prompt_ids=prompts, answers=["5"] * 6)
    kw[missing] = None
    with pytest.raises(ValueError, match=f"needs {missing}"):
        oar.token_advantages(rewards, group_size=3, completion_ids=ids, completion_mask=mask, config=_cfg(method=method),
                             **kw)


def test_bad_rewards_shape(tiny):
    _, tok = tiny
    _, ids, mask, _ = _batch(tok)
    with pytest.raises(ValueError, match="rewards must be a \\(B,\\) = \\(6,\\)"):
        oar.token_advantages(torch.ones(5), group_size=1, completion_ids=ids, completion_mask=mask,
                             config=_cfg(method="grpo"))


def test_pipeline_ktae_needs_groups(tiny):
    model, tok = tiny
    prompts, ids, mask, rewards = _batch(tok)
    pipe = oar.Pipeline(_cfg(method="ktae"), tok)
    with pytest.raises(ValueError, match="needs group_ids"):
        pipe.compute(oar.RolloutBatch(ids, mask, prompt_ids=prompts, sequence_advantages=torch.ones(6)), model)
    # with groups and without rewards, correctness is A > 0
    adv = ops.group_advantages(rewards, group_size=3)
    out = pipe.compute(oar.RolloutBatch(ids, mask, prompt_ids=prompts, sequence_advantages=adv,
                                        group_ids=[i // 3 for i in range(6)]), model)
    bonus = baselines.ktae_token_scores(ids, mask, adv, group_size=3, ignore_ids=[tok.eos_token_id, tok.pad_token_id])
    torch.testing.assert_close(out.advantages, (adv[:, None] + bonus) * mask.bool(), rtol=0, atol=0)


def test_random_baseline_advances_between_calls(tiny):
    a, _ = _call(tiny, method="random", seed=11)
    b, _ = _call(tiny, method="random", seed=11)
    assert not torch.equal(a.scores, b.scores)  # one cached pipeline per (tokenizer, config): the generator advances


# ---- bad input ---------------------------------------------------------------------------------------------------

def _batch4(tok, C=20):
    # Only the tokenizer enters these cases (no model is passed): the "minimal" tokenizer of ``tiny``.
    return completion_batch(tok, ["so 2 and 3 \\boxed{5}", "hmm 9", "5 \\boxed{5}", "4 4 \\boxed{8}"], C, eos=False)


# (rewards and config given to token_advantages with _batch4's completions and group_size=2, exception, message regex)
BAD_INPUT = [
    # A dict or JSON string used to fail with AttributeError: 'dict' object has no attribute 'method'.
    pytest.param(dict(rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), config={"method": "grpo"}), ValueError,
                 r"config must be an oar\.OARConfig or None, got (dict|str)", id="config_dict"),
    pytest.param(dict(rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), config='{"method": "grpo"}'), ValueError,
                 r"config must be an oar\.OARConfig or None, got (dict|str)", id="config_json_str"),
    # Used to raise NotImplementedError: Cannot copy out of meta tensor; no data!
    pytest.param(dict(rewards=torch.ones(4, device="meta"), config=_cfg(method="grpo")), ValueError,
                 r"rewards must hold data, got a tensor on the meta device", id="meta_rewards"),
]


@pytest.mark.parametrize("kwargs, exc, match", BAD_INPUT)
def test_bad_input(tiny, kwargs, exc, match):
    _, tok = tiny
    _, ids, mask = _batch4(tok)
    with pytest.raises(exc, match=match):
        oar.token_advantages(completion_ids=ids, completion_mask=mask, group_size=2, **kwargs)


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_token_advantages_ktae_skip_nan_and_bool_rewards(tiny, with_tokenizer):
    # skip_nan gives NaN rows A = 0 for every method; ktae used to raise "rewards must be finite" for them, and
    # refused bool rewards that every other method accepts.
    _, tok = tiny
    _, ids, mask = _batch4(tok)
    kw = dict(completion_ids=ids, completion_mask=mask, group_size=2, tokenizer=tok if with_tokenizer else None)
    out = oar.token_advantages(torch.tensor([float("nan"), 0.0, 1.0, 0.0]), config=_cfg(method="ktae", skip_nan=True),
                               **kw)
    assert torch.isfinite(out.advantages).all() and out.sequence_advantages[0] == 0
    b = oar.token_advantages(torch.tensor([True, False, True, False]), config=_cfg(method="ktae"), **kw)
    f = oar.token_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), config=_cfg(method="ktae"), **kw)
    torch.testing.assert_close(b.advantages, f.advantages)


@pytest.mark.parametrize("method, keys", [("oar_g", {}), ("oar_p", {"screen_fraction": 0.5, "screen": "oar_g"})])
def test_oar_g_runs_under_no_grad_and_refuses_inference_mode(tiny, method, keys):
    """Trainers make experiences under torch.no_grad() (OpenRLHF) or inference_mode: OAR-G (and the OAR-G screen)
    enables grad for its own input-gradient pass, with the same numbers and no parameter .grad written; under
    inference_mode, where no autograd is possible, the error says what to do."""
    model, tok = tiny
    prompts, ids, mask, rewards = _batch(tok)
    cfg = _cfg(method=method, **keys)
    batch = oar.RolloutBatch(ids, mask, prompt_ids=prompts, answers=["5"] * 6, rewards=rewards,
                             group_ids=[i // 3 for i in range(6)])
    want = oar.Pipeline(cfg, tok).compute(batch, model)  # a fresh pipeline: the same seed, the same noise
    with torch.no_grad():
        got = oar.Pipeline(cfg, tok).compute(batch, model)
    assert torch.equal(got.advantages, want.advantages) and got.reasoning_mask.any()
    assert all(p.grad is None for p in model.parameters())
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"outside inference_mode \(torch\.no_grad\(\) "
                                                                   r"is fine"):
        oar.Pipeline(cfg, tok).compute(batch, model)
