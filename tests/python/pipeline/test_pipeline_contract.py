"""The trainer contract of docs/trainers.md through oar.Pipeline, end to end on a tiny model: sequence advantages
and a generation batch in, per-token advantages out."""

import json

import pytest
import torch

import oar
from oar.batch import RolloutBatch
from oar.groups import group_ids_from
from oar.pipeline import Pipeline
from oar.metrics import ess_ratio, top_mass
from oar.testing import tiny_random_llama
from _completions import completion_batch
from _tolerance import assert_close_to_rounded, assert_within, mass_bound


class _Contract:
    """A trainer's call of the contract: (model, prompts, completions, mask, sequence advantages, answers) ->
    oar.Pipeline.compute on the RolloutBatch the adapters build."""

    def __init__(self, config, tokenizer):
        self.pipeline = Pipeline(config, tokenizer)

    def compute(self, model, prompt_ids, completion_ids, completion_mask, sequence_advantages, answers,
                eligible_mask=None, rewards=None, group_offsets=None):
        groups = None
        if group_offsets is not None:
            size = group_offsets if isinstance(group_offsets, int) else None
            groups = group_ids_from(int(completion_ids.shape[0]), offsets=None if size else group_offsets,
                                    group_size=size)
        batch = RolloutBatch(completion_ids, completion_mask, prompt_ids=prompt_ids, eligible_mask=eligible_mask,
                             rewards=rewards, group_ids=groups, answers=answers,
                             sequence_advantages=sequence_advantages)
        return self.pipeline.compute(batch, model)


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, tokenizer="minimal", seed=2)
    return model, tok


def _batch(tok, C=40):
    texts = ["so 2 and 3 make 5 \\boxed{5}", "hmm 9 \\boxed{9}", "I think 5", "2+3=5 #### 5"]
    return completion_batch(tok, texts, C)


def _cfg(**kw):
    base = {"method": "oar_p", "probe": "answer_mean"}
    base.update(kw)
    return oar.OARConfig.from_json(json.dumps(base))


@pytest.mark.parametrize("method", ["oar_p", "oar_g", "entropy", "random"])
def test_contract_invariants(tiny, method):
    model, tok = tiny
    prompts, ids, mask = _batch(tok)
    adv = torch.tensor([0.8, -1.2, 0.0, 0.4])
    hook = _Contract(_cfg(method=method), tok)
    out = hook.compute(model, prompts, ids, mask, adv, ["5"] * 4)
    m = mask.bool()
    assert out.advantages.shape == ids.shape and out.advantages.dtype == torch.float32
    assert (out.advantages[~m] == 0).all() and (out.weights[~m] == 0).all()
    assert (out.weights >= 0).all()
    # mass preservation: sum_t A_t = A * |eligible tokens|
    assert_within(out.advantages.sum(1), adv * m.sum(1), mass_bound(adv, m.sum(1)), "mass")
    # sign preserved, zero rows stay zero
    assert (out.advantages[0][m[0]] >= 0).all() and (out.advantages[1][m[1]] <= 0).all()
    assert (out.advantages[2] == 0).all()
    assert out.metrics["oar/skipped_rows_frac"] == pytest.approx(0.25)
    # reasoning span: row 0 "so 2 and 3 make 5 " (18 chars), row 3 "2+3=5 " (6)
    assert out.reasoning_mask[0].sum() == len("so 2 and 3 make 5 ")
    assert out.reasoning_mask[3].sum() == len("2+3=5 ")
    assert not out.reasoning_mask[2].any()  # skipped (A == 0)
    assert 0 < out.metrics["oar/ess_ratio"] <= 1


def test_grpo_method_is_uniform(tiny):
    model, tok = tiny
    prompts, ids, mask = _batch(tok)
    adv = torch.tensor([0.5, -0.5, 1.0, 0.0])
    out = _Contract(_cfg(method="grpo"), tok).compute(model, prompts, ids, mask, adv, ["5"] * 4)
    torch.testing.assert_close(out.advantages, adv[:, None] * mask.float(), rtol=0, atol=0)
    assert out.metrics["oar/ess_ratio"] == pytest.approx(1.0)


def test_eligible_mask_excludes_tool_tokens(tiny):
    model, tok = tiny
    prompts, ids, mask = _batch(tok)
    eligible = mask.clone()
    eligible[0, 3:6] = 0  # e.g. tool output tokens
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0])
    out = _Contract(_cfg(method="random"), tok).compute(model, prompts, ids, mask, adv, ["5"] * 4,
                                                                  eligible_mask=eligible)
    assert (out.advantages[0, 3:6] == 0).all()
    assert_within(out.advantages.sum(1), adv * eligible.sum(1), mass_bound(adv, eligible.sum(1)), "mass")


def test_bad_input_names_argument(tiny):
    model, tok = tiny
    prompts, ids, mask = _batch(tok)
    hook = _Contract(_cfg(method="random"), tok)
    with pytest.raises(ValueError, match="advantages must be"):
        hook.compute(model, prompts, ids, mask, torch.zeros(3), ["5"] * 4)
    with pytest.raises(ValueError, match="completion_mask must be"):
        hook.compute(model, prompts, ids, mask[:, :5], torch.zeros(4), ["5"] * 4)
    with pytest.raises(ValueError, match="advantages must be finite"):
        hook.compute(model, prompts, ids, mask, torch.tensor([1.0, float("nan"), 0, 0]), ["5"] * 4)


def test_metrics_against_hand_values():
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 1.0, 1.0]])
    m = torch.ones_like(w, dtype=torch.bool)
    assert_close_to_rounded(ess_ratio(w, m), torch.tensor([1.0, 16.0 / (4 * 6.0)], dtype=torch.float64))
    a = w * torch.tensor([[1.0], [-1.0]])
    # row 1: the top ceil(0.25*4)=1 weighted token carries 2 of |A| mass 4
    assert_close_to_rounded(top_mass(a, w, m, 0.25), torch.tensor([0.25, 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="frac must be in"):
        top_mass(a, w, m, 0.0)


def test_skipped_groups_metric(tiny):
    """Groups whose advantages are all 0 (all-equal rewards) run no attribution and are reported."""
    model, tok = tiny
    prompts, ids, mask = _batch(tok)
    adv = torch.tensor([0.0, 0.0, 0.7, -0.7])  # group 0 (rows 0-1) all zero, group 1 not
    hook = _Contract(_cfg(method="random"), tok)
    out = hook.compute(model, prompts, ids, mask, adv, ["5"] * 4, group_offsets=2)
    assert out.metrics["oar/skipped_groups_frac"] == pytest.approx(0.5)
    assert out.metrics["oar/skipped_rows_frac"] == pytest.approx(0.5)
    assert not out.reasoning_mask[:2].any() and out.reasoning_mask[2:].any()
    # CSR offsets: groups [0, 1), [1, 3), [3, 4) -> only the first is all zero
    out = hook.compute(model, prompts, ids, mask, adv, ["5"] * 4, group_offsets=torch.tensor([0, 1, 3, 4]))
    assert out.metrics["oar/skipped_groups_frac"] == pytest.approx(1 / 3)
    # unknown groups: the metric is omitted, never guessed; inconsistent groups are refused
    assert "oar/skipped_groups_frac" not in hook.compute(model, prompts, ids, mask, adv, ["5"] * 4).metrics
    with pytest.raises(ValueError, match=r"group_size must divide the number of rewards N = 4, got group_size = 3"):
        hook.compute(model, prompts, ids, mask, adv, ["5"] * 4, group_offsets=3)


# ---- bad input and degenerate batches, on a one-layer model ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_1layer():
    return tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal")


def _hook_batch(tok, C=12):
    return completion_batch(tok, ["so 2 and 3 \\boxed{5}", "hmm 9"], C, eos=False)


def _hook(tok, method="oar_p"):
    return _Contract(oar.OARConfig.from_json(json.dumps({"method": method})), tok)


# (arguments of compute that replace the valid ones: prompt_ids / completion_ids / completion_mask of _hook_batch,
# advantages [1, -1], answers ["5", "5"]; a callable builds them from the valid (prompt_ids, completion_ids),
# exception, message regex)
CONTRACT_BAD_INPUT = [
    pytest.param(dict(sequence_advantages=[1.0, -1.0]), ValueError,
                 r"sequence_advantages must be a \(B,\) torch.Tensor, got list", id="advantages_list"),
    pytest.param(dict(completion_ids=None), ValueError, r"completion_ids must be a \(B, C\) torch.Tensor, got NoneType",
                 id="completion_ids_none"),
    pytest.param(lambda P, ids: dict(completion_ids=ids.float()), ValueError,
                 r"completion_ids must be an integer tensor of token ids, got dtype torch\.float32",
                 id="completion_ids_float"),
    pytest.param(lambda P, ids: dict(completion_ids=ids + 100000), ValueError,
                 r"completion_ids must be token ids in \[0, \d+\), got \d+ at \[0, 0\]", id="completion_ids_too_large"),
    pytest.param(lambda P, ids: dict(completion_ids=ids - 100000), ValueError,
                 r"completion_ids must be token ids in \[0, \d+\), got -\d+", id="completion_ids_negative"),
    pytest.param(dict(prompt_ids=[[10**6], [1]]), ValueError,
                 r"prompt_ids\[0\] must be token ids in \[0, \d+\), got 1000000 at position 0",
                 id="prompt_ids_too_large"),
    pytest.param(lambda P, ids: dict(prompt_ids=[torch.tensor([P[0]])] * 2), ValueError,
                 r"prompt_ids\[0\] must be a 1-D integer tensor of token ids", id="prompt_ids_2d_tensor"),
    pytest.param(dict(prompt_ids=[[1.5], [1]]), ValueError, r"prompt_ids\[0\] must hold integer token ids, got 1\.5",
                 id="prompt_ids_float"),
    pytest.param(dict(sequence_advantages=torch.tensor([3e38, -1.0])), ValueError,
                 r"advantages\[0\] = 3e\+38 times its weight .* overflows float32", id="advantages_weight_overflow"),
    pytest.param(dict(sequence_advantages=torch.tensor([1e300, -1.0], dtype=torch.float64)), ValueError,
                 r"advantages must fit in float32", id="advantages_beyond_float32"),
    pytest.param(dict(sequence_advantages=torch.ones(2, device="meta")), ValueError,
                 r"advantages must hold data, got a tensor on the meta device", id="advantages_meta"),
]


@pytest.mark.parametrize("method", ["oar_p", "oar_g"])
@pytest.mark.parametrize("over, exc, match", CONTRACT_BAD_INPUT)
def test_contract_bad_input(tiny_1layer, method, over, exc, match):
    model, tok = tiny_1layer
    P, ids, mask = _hook_batch(tok)
    h = _hook(tok, method)
    args = dict(prompt_ids=P, completion_ids=ids, completion_mask=mask, sequence_advantages=torch.tensor([1.0, -1.0]),
                answers=["5", "5"])
    args.update(over(P, ids) if callable(over) else over)
    with pytest.raises(exc, match=match):
        h.compute(model, **args)


@pytest.mark.parametrize("method", ["oar_p", "oar_g", "entropy", "random"])
def test_contract_degenerate_batches_are_well_formed(tiny_1layer, method):
    model, tok = tiny_1layer
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
