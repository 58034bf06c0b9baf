"""oar.pipeline: the one method pipeline, and the inputs trainers really send (rows in any group order, tool
outputs outside the eligible mask, -inf logits, NaN rewards, errors in the caller's indexing)."""

import ast
import math
import pathlib

import pytest
import torch

import oar
from oar import baselines, ops
from oar.attribution import HFProbeModel
from oar.attribution import oar_p
from oar.attribution.entropy import entropy_from_logits
from oar.testing import tiny_random_llama
from oar.batch import RolloutBatch
from oar.methods import METHOD_TABLE, method_spec
from oar.pipeline import Pipeline
from oar.schema import with_method
from _completions import completion_batch, tool_batch
from _error_model import entropy, entropy_error_bound, error_bound
from _tolerance import assert_within, assert_within_error_model, mass_bound

TEXTS = ["so 2 and 3 make 5 \\boxed{5}", "hmm 9 \\boxed{9}", "I think 5", "2+3=5 #### 5", "4 4 4 \\boxed{8}",
         "5 \\boxed{5}"]
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
PY = pathlib.Path(oar.__file__).parent


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, tokenizer="minimal", seed=4)


def _cfg(**kw):
    return oar.OARConfig.from_json(__import__("json").dumps(kw))


# ---- the method table -----------------------------------------------------------------------------------------

def test_method_table_is_the_schema_and_the_spec():
    """One row per schema method, with the credit rule of method.md (sections 5-6 reshape, section 8 add)."""
    assert set(METHOD_TABLE) == set(oar.METHODS)
    credit = {"grpo": "uniform", "dr_grpo": "uniform", "random": "reshape", "entropy": "reshape",
              "oar_p": "reshape", "oar_g": "reshape", "entropy_shaping": "add", "ktae": "add"}
    assert {m: s.credit.name for m, s in METHOD_TABLE.items()} == credit
    import pickle

    for s in METHOD_TABLE.values():  # Ray and multiprocessing pickle specs: the rule comes back as the same object
        assert pickle.loads(pickle.dumps(s.credit)) is s.credit
    assert [m for m, s in METHOD_TABLE.items() if s.needs_answers] == ["oar_p", "oar_g"]
    with pytest.raises(ValueError, match=r"method must be one of \['grpo', .*\], got 'oar_q'"):
        method_spec("oar_q")
    with pytest.raises(ValueError, match=r"method 'oar_p' needs answers \(the reference answer of each row\) "
                                         r"\(methods that need it: oar_p, oar_g\)"):
        method_spec("oar_p").require("answers", None)
    assert method_spec("grpo").require("answers", None) is None


def test_with_method_keeps_every_other_key_and_the_dr_grpo_rule():
    base = _cfg(method="oar_g", q=0.3, probe="last")
    dr = with_method(base, "dr_grpo")
    assert dr.method == "dr_grpo" and dr.advantages.estimator == "dr_grpo" and dr.reshape.q == pytest.approx(0.3)
    back = with_method(dr, "oar_p")
    assert back.advantages.estimator == "grpo" and back.probe == "last"


# ---- groups in any row order ------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "ktae"])
def test_groups_in_any_row_order(tiny, method):
    """verl's balance_batch reorders rows and interleaved layouts exist: the result is the contiguous layout's,
    in the caller's row order (exactly: per group the same sums in the same order)."""
    model, tok = tiny
    prompts, ids, mask = completion_batch(tok, TEXTS, 30)
    cfg = _cfg(method=method)
    kw = dict(model=model, tokenizer=tok, prompt_ids=prompts, answers=["5"] * 6, config=cfg)
    ref = oar.token_advantages(REWARDS, completion_ids=ids, completion_mask=mask, group_ids=[0, 0, 0, 1, 1, 1], **kw)
    for perm in ([0, 3, 1, 4, 2, 5], [5, 2, 0, 4, 1, 3]):
        p = torch.tensor(perm)
        out = oar.token_advantages(REWARDS[p], completion_ids=ids[p], completion_mask=mask[p],
                                   group_ids=["a" if i < 3 else "b" for i in perm],
                                   **dict(kw, prompt_ids=[prompts[i] for i in perm]))
        torch.testing.assert_close(out.advantages, ref.advantages[p], rtol=0, atol=0)
        torch.testing.assert_close(out.sequence_advantages, ref.sequence_advantages[p], rtol=0, atol=0)
        assert out.metrics["oar/skipped_groups_frac"] == ref.metrics["oar/skipped_groups_frac"]
    assert ref.advantages.abs().sum() > 0


def test_nan_reward_names_its_group():
    r = torch.tensor([1.0, 0.0, float("nan"), 1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"rewards\[2\] is NaN \(group 'q1', rows \[0, 2, 4\]\); set skip_nan=True"):
        oar.sequence_advantages(r, group_ids=["q1", "q2", "q1", "q2", "q1", "q2"])
    out = oar.sequence_advantages(r, _cfg(skip_nan=True), group_ids=["q1", "q2", "q1", "q2", "q1", "q2"])
    assert out[2] == 0 and torch.isfinite(out).all()


# ---- tokens outside the eligible mask (tool outputs) are never masked, perturbed or scored ----------------------

class _PlainProbe:
    """A ProbeModel without a prefix cache (the engines' plain paths) that records OAR-G's noisy embeddings."""

    def __init__(self, model):
        self.inner = HFProbeModel(model)
        self.vocab_size, self.hidden_size, self.device = self.inner.vocab_size, self.inner.hidden_size, self.inner.device
        self.noisy = []  # (window ids, clean embeddings, noisy embeddings) per differentiated call
        self._last = None

    def embed(self, input_ids):
        e = self.inner.embed(input_ids)
        self._last = (input_ids.detach().clone(), e.detach().clone())
        return e

    def tail_logits(self, *, input_ids=None, inputs_embeds=None, attention_mask, position_ids, keep):
        if inputs_embeds is not None and inputs_embeds.requires_grad:
            self.noisy.append((*self._last, inputs_embeds.detach().clone()))
        return self.inner.tail_logits(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                      position_ids=position_ids, keep=keep)

    def activation_bytes_per_token(self, width, backward=False):
        return self.inner.activation_bytes_per_token(width, backward)

    def eval_mode(self):
        return self.inner.eval_mode()


def _eligible_reasoning(pipe, ids, mask, eligible):
    """{row: [reasoning indices whose token is eligible]} (completion column j = reasoning index j here)."""
    lens = pipe.reasoning_lengths(ids, mask)
    return {i: [j for j in range(lens[i]) if bool(eligible[i, j])] for i in range(ids.shape[0])}


def test_windowed_oar_p_through_compute_reports_nothing_masked(tiny):
    """Windowed OAR-P (``screen_fraction = screen_sample = 0``: the screen's scores alone) through ``compute``: its
    metrics say no token was masked exactly (they once read counts only the exact pass reports: KeyError)."""
    model, tok = tiny
    prompts, ids, mask, eligible = tool_batch(tok)
    cfg = _cfg(method="oar_p", screen_fraction=0.0, screen_sample=0.0, screen_window=2)
    adv = torch.tensor([1.0, -0.5, 0.7, 0.0])
    res = Pipeline(cfg, tok).compute(RolloutBatch(ids, mask, prompt_ids=prompts, eligible_mask=eligible,
                                                  answers=["5"] * 4, sequence_advantages=adv), model)
    assert res.metrics["oar/screen_fraction"] == 0.0 and res.metrics["oar/masked_frac"] == 0.0
    assert bool(res.reasoning_mask.any()) and float(res.scores.max()) > 0
    assert_within(res.advantages.sum(1), adv * eligible.sum(1), mass_bound(adv, eligible.sum(1)), "mass")


def test_oar_p_masks_only_eligible_tokens(tiny, monkeypatch):
    model, tok = tiny
    prompts, ids, mask, eligible = tool_batch(tok)
    # one probe per row (engine row r = caller row r); turn by turn: tests/python/pipeline/test_turns.py
    pipe = Pipeline(_cfg(method="oar_p", turn_probe="session"), tok)
    seen = []
    orig = oar_p.unit_variants

    def spy(batch, rows, positions=None):
        out = orig(batch, rows, positions)
        seen.append((out[0].tolist(), out[2].tolist()))
        return out

    monkeypatch.setattr(oar_p, "unit_variants", spy)
    adv = torch.tensor([1.0, -0.5, 0.7, 0.0])
    res = pipe.compute(RolloutBatch(ids, mask, prompt_ids=prompts, eligible_mask=eligible, answers=["5"] * 4,
                                    sequence_advantages=adv), model)
    want = _eligible_reasoning(pipe, ids, mask, eligible)
    got: dict = {}
    for rows, js in seen:
        for r, j in zip(rows, js):
            got.setdefault(r, []).append(j)
    assert {r: sorted(v) for r, v in got.items()} == {r: want[r] for r in (0, 1, 2)}  # row 3: A = 0, not scored
    assert (res.scores[~eligible] == 0).all() and not res.reasoning_mask[~eligible].any()
    assert (res.advantages[~eligible] == 0).all()
    assert_within(res.advantages.sum(1), adv * eligible.sum(1), mass_bound(adv, eligible.sum(1)), "mass")


def test_oar_g_perturbs_only_eligible_tokens(tiny):
    model, tok = tiny
    prompts, ids, mask, eligible = tool_batch(tok)
    pipe = Pipeline(_cfg(method="oar_g", sigma=0.05, turn_probe="session"), tok)  # one probe per row
    pm = _PlainProbe(model)
    adv = torch.tensor([1.0, -0.5, 0.7, 0.0])
    res = pipe.compute(RolloutBatch(ids, mask, prompt_ids=prompts, eligible_mask=eligible, answers=["5"] * 4,
                                    sequence_advantages=adv), pm)
    want = _eligible_reasoning(pipe, ids, mask, eligible)
    assert len(pm.noisy) == 1  # one chunk: rows 0, 1, 2 in order
    win_ids, clean, noisy = pm.noisy[0]
    perturbed = (noisy - clean[:, -noisy.shape[1]:]).abs().amax(-1) > 0
    for k, r in enumerate((0, 1, 2)):
        # the noised window tokens, in order, are exactly the row's eligible reasoning tokens
        got = win_ids[k, -noisy.shape[1]:][perturbed[k]].tolist()
        assert got == ids[r, want[r]].tolist()
    assert (res.scores[~eligible] == 0).all() and (res.scores[eligible & res.reasoning_mask] > 0).any()


@pytest.mark.parametrize("method", ["random", "entropy"])
def test_other_scorers_score_only_eligible_tokens(tiny, method):
    model, tok = tiny
    prompts, ids, mask, eligible = tool_batch(tok)
    res = Pipeline(_cfg(method=method), tok).compute(
        RolloutBatch(ids, mask, prompt_ids=prompts, eligible_mask=eligible, sequence_advantages=torch.ones(4)), model)
    assert (res.scores[~eligible] == 0).all() and not res.reasoning_mask[~eligible].any()
    assert res.reasoning_mask.any()


def test_eligible_mask_must_lie_in_the_completion():
    ids = torch.zeros((2, 4), dtype=torch.long)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    bad = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"eligible_mask must be a subset of completion_mask, got True at \[0, 2\]"):
        Pipeline(_cfg(method="grpo")).compute(RolloutBatch(ids, mask, eligible_mask=bad,
                                                           sequence_advantages=torch.ones(2)))


# ---- scores only: no second reshape -----------------------------------------------------------------------------

def test_scores_entry_and_precomputed_scores_reshape_once(tiny):
    model, tok = tiny
    prompts, ids, mask = completion_batch(tok, TEXTS[:4], 30)
    adv = torch.tensor([0.8, -1.2, 0.0, 0.4])
    batch = RolloutBatch(ids, mask, prompt_ids=prompts, answers=["5"] * 4, sequence_advantages=adv)
    pipe = Pipeline(_cfg(method="oar_p"), tok)
    sc = pipe.scores(batch, model)
    full = pipe.compute(batch, model)
    torch.testing.assert_close(sc.scores, full.scores, rtol=0, atol=0)
    assert torch.equal(sc.reasoning_mask, full.reasoning_mask)
    # a trainer that scored elsewhere passes the scores in: one reshape, the op's own result
    pre = Pipeline(_cfg(method="oar_p")).compute(RolloutBatch(ids, mask, sequence_advantages=adv, scores=sc.scores,
                                                              reasoning_mask=sc.reasoning_mask))
    want, _ = ops.reshape_advantages(adv, sc.scores, sc.reasoning_mask, mask.bool())
    torch.testing.assert_close(pre.advantages, want, rtol=0, atol=0)


@pytest.mark.parametrize("rows", ["positive", "negative"])
def test_credit_rows_keeps_uniform_credit_outside_the_sign(tiny, rows):
    """``credit_rows`` (method.md section 12): rows of the chosen sign get exactly the method's credit of
    ``credit_rows: all`` on the batch where only they are scored (the other rows at A = 0: the same chunks, so the
    same float rounding; the random tiny model's divergences are ~1e-6, so a row's scores move with the batch's
    padding at float32 rounding), the other rows GRPO's uniform A x mask and no scores (not scored: counted as
    skipped), rows with A = 0 stay 0; the scores-only entry agrees. This is the diagnostic's sign rule
    (python/oar/app/diagnose_core.py)."""
    model, tok = tiny
    prompts, ids, mask = completion_batch(tok, TEXTS[:4], 30)
    adv = torch.tensor([0.8, -1.2, 0.0, 0.4])
    on = adv > 0 if rows == "positive" else adv < 0
    batch = RolloutBatch(ids, mask, prompt_ids=prompts, answers=["5"] * 4, sequence_advantages=adv)
    only = RolloutBatch(ids, mask, prompt_ids=prompts, answers=["5"] * 4, sequence_advantages=adv * on)
    full = Pipeline(_cfg(method="oar_p"), tok).compute(only, model)
    pipe = Pipeline(_cfg(method="oar_p", credit_rows=rows), tok)
    part = pipe.compute(batch, model)
    uniform = adv[:, None] * mask.float()
    want = torch.where(on[:, None], full.advantages, uniform)
    torch.testing.assert_close(part.advantages, want, rtol=0, atol=0)
    assert not part.reasoning_mask[~on].any() and (part.scores[~on] == 0).all()
    assert part.reasoning_mask[on].any() and not torch.equal(full.advantages[on], uniform[on])
    assert part.metrics["oar/skipped_rows_frac"] == pytest.approx(1 - on.float().mean().item())
    sc = pipe.scores(batch, model)
    assert torch.equal(sc.reasoning_mask, part.reasoning_mask) and torch.equal(sc.scores, part.scores)
    # trainer-supplied scores of every row: the off-sign rows still get uniform credit
    every = Pipeline(_cfg(method="oar_p"), tok).compute(batch, model)
    assert every.reasoning_mask[~on & (adv != 0)].any()
    pre = Pipeline(_cfg(method="oar_p", credit_rows=rows)).compute(
        RolloutBatch(ids, mask, sequence_advantages=adv, scores=every.scores, reasoning_mask=every.reasoning_mask))
    torch.testing.assert_close(pre.advantages, torch.where(on[:, None], every.advantages, uniform), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r'oar.credit_rows must be "all", "positive" or "negative", got "pos"'):
        _cfg(method="oar_p", credit_rows="pos")
    cfg = _cfg(method="oar_p")
    cfg.credit_rows = "bogus"  # an attribute set after parsing is checked by the pipeline
    with pytest.raises(ValueError, match=r"credit_rows must be one of \['all', 'positive', 'negative'\], got 'bogus'"):
        Pipeline(cfg, tok).compute(batch, model)


def test_scored_rows_is_the_sign_rule():
    """``scored_rows`` / ``credited_rows`` (what the pipeline scores and what the trainer adapters send): a row is
    scored iff A != 0 and its sign is the credited one; ``all`` credits every row, A = 0 is never scored."""
    from oar.pipeline import credited_rows, scored_rows

    adv = torch.tensor([0.5, -0.25, 0.0, -0.0, 2.0, -3.0], dtype=torch.float64)
    assert credited_rows(adv, "all").tolist() == [True] * 6
    assert credited_rows(adv, "positive").tolist() == [True, False, False, False, True, False]
    assert credited_rows(adv, "negative").tolist() == [False, True, False, False, False, True]
    assert scored_rows(adv, "all") == [0, 1, 4, 5]
    assert scored_rows(adv, "positive") == [0, 4] and scored_rows(adv, "negative") == [1, 5]
    assert scored_rows(torch.zeros(3), "all") == []
    with pytest.raises(ValueError, match=r"credit_rows must be one of \['all', 'positive', 'negative'\], got 'pos'"):
        scored_rows(adv, "pos")


# ---- entropy with -inf logits ------------------------------------------------------------------------------------

def test_entropy_from_logits_allows_minus_inf():
    x = torch.tensor([[0.0, float("-inf"), math.log(2.0)], [1.0, 1.0, 1.0]])
    want = torch.tensor([-(1 / 3 * math.log(1 / 3) + 2 / 3 * math.log(2 / 3)), math.log(3.0)], dtype=torch.float64)
    out = entropy_from_logits(x)
    assert torch.isfinite(out).all()
    exact = error_bound(entropy, x)  # rule 1: the float32 error model of the entropy of these logits
    assert float((exact.value - want).abs().max()) <= 2.0**-24  # x holds log 2 rounded to float32 (moves H by < u)
    assert_within_error_model(out, exact, what="entropy")
    with pytest.raises(ValueError, match=r"logits must not hold NaN or \+inf, got nan at \[0, 1\]"):
        entropy_from_logits(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(ValueError, match=r"logits at \[0\] are all -inf"):
        entropy_from_logits(torch.full((1, 3), float("-inf")))


class _BannedVocab(_PlainProbe):
    """The tiny model with some vocabulary entries at -inf (a constrained vocabulary)."""

    BANNED = [0, 1, 7, 40]

    def _ban(self, logits):
        logits = logits.clone()
        logits[..., self.BANNED] = float("-inf")
        return logits

    def tail_logits(self, **kw):
        return self._ban(super().tail_logits(**kw))


@pytest.mark.parametrize("method", ["entropy", "entropy_shaping"])
def test_entropy_methods_are_finite_with_minus_inf_logits(tiny, method):
    model, tok = tiny
    prompts, ids, mask = completion_batch(tok, TEXTS[:4], 30)
    pm = _BannedVocab(model)
    adv = torch.tensor([0.8, -1.2, 0.5, 0.4])
    res = Pipeline(_cfg(method=method), tok).compute(
        RolloutBatch(ids, mask, prompt_ids=prompts, sequence_advantages=adv), pm)
    assert torch.isfinite(res.advantages).all() and torch.isfinite(res.scores).all()
    # the entropies are those of the banned-vocabulary distributions (torch.distributions as the reference)
    i = 0
    P = len(prompts[i])
    seq = torch.tensor(prompts[i] + ids[i][mask[i].bool()].tolist())[None]
    with torch.no_grad():
        logits = pm.tail_logits(input_ids=seq, attention_mask=torch.ones_like(seq),
                                position_ids=torch.arange(seq.shape[1])[None],
                                keep=seq.shape[1])[0, P - 1: seq.shape[1] - 1]
    cols = res.reasoning_mask[i] if method == "entropy" else mask[i].bool()
    n = int(mask[i].sum())
    ref32 = torch.distributions.Categorical(logits=logits.float()).entropy()[cols[:n]]
    # rule 1: the pipeline's batched (padded) forward and torch.distributions' entropy of the unpadded one, both
    # within the float32 error model of the float64 model's entropies
    exact = entropy_error_bound(model, seq, P - 1, seq.shape[1] - 1, banned=_BannedVocab.BANNED)[cols[:n]]
    assert_within_error_model(res.scores[i][cols], exact, what=f"{method} entropies")
    assert_within_error_model(ref32, exact, what=f"{method} entropies, torch.distributions")


# ---- errors in the caller's indexing -----------------------------------------------------------------------------

class _ZeroOnMasked(_PlainProbe):
    """Gives token 30 probability 0 in masked variants (a PAD inside the context) of contexts holding '7'."""

    def tail_logits(self, *, input_ids=None, **kw):
        out = super().tail_logits(input_ids=input_ids, **kw)
        if input_ids is not None:
            seven = self.seven
            hit = ((input_ids == self.pad) & kw["attention_mask"].bool()).any(1) & (input_ids == seven).any(1)
            out = out.clone()
            out[hit, :, 30] = float("-inf")
        return out


def test_engine_errors_name_the_callers_row(tiny):
    model, tok = tiny
    texts = ["so 2 and 3 \\boxed{5}", "hmm 9 \\boxed{9}", "77 7 \\boxed{7}", "5 \\boxed{5}"]
    prompts, ids, mask = completion_batch(tok, texts, 30)
    pm = _ZeroOnMasked(model)
    pm.seven, pm.pad = tok.encode("7", add_special_tokens=False)[0], tok.pad_token_id
    adv = torch.tensor([0.0, 1.0, -1.0, 0.5])  # row 0 is skipped: row 2 is the second scored row
    with pytest.raises(ValueError, match=r"masking reasoning token \d+ of row 2 gives a non-finite divergence"):
        Pipeline(_cfg(method="oar_p"), tok).compute(
            RolloutBatch(ids, mask, prompt_ids=prompts, answers=["5"] * 4, sequence_advantages=adv), pm)


def test_memory_budget_cap():
    """Pipeline.memory_budget_mb: the config's budget, capped by an adapter's memory_budget_cap_mb (never below 1)."""
    import oar
    from oar.pipeline import Pipeline

    pipe = Pipeline(oar.OARConfig.from_json('{"method": "oar_g", "memory_budget_mb": 300}'))
    assert pipe.memory_budget_mb == 300
    for cap, want in ((120, 120), (300, 300), (5000, 300), (0, 1)):
        pipe.memory_budget_cap_mb = cap
        assert pipe.memory_budget_mb == want
