"""OARGRPOTrainer with the real trl package (1.13.0) on a tiny random Llama: one optimizer step.

Checks that the hook replaces TRL's (B,) sequence advantages by (B, C) per-token advantages whose masked
sums equal A * |completion|, that TRL's own advantages equal oar's "trl" preset on the same rewards,
that training runs and logs oar metrics, and that incompatible settings are refused.
"""

import json
import re

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import oar  # noqa: E402
from oar import baselines, ops  # noqa: E402
from oar.testing import tiny_random_llama  # noqa: E402
from _tolerance import assert_close_to_rounded, assert_within, mass_bound  # noqa: E402


def _dataset():
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}?"}], "answer": str(a + b)}
            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]
    return datasets.Dataset.from_list(rows)


def reward_has_digit(prompts, completions, answer, **kw):
    # Deterministic but varied: reward = share of answer characters present in the completion.
    out = []
    for c, a in zip(completions, answer):
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(float(sum(ch in text for ch in a)) / len(a) + 0.1 * (len(text) % 3))
    return out


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=12,
                max_steps=1, learning_rate=1e-3, report_to="none", save_strategy="no", logging_steps=1, use_cpu=True,
                gradient_checkpointing=False, seed=0, temperature=1.0, disable_tqdm=True, bf16=False)  # fp32 on any CPU
    base.update(kw)
    return trl.GRPOConfig(**base)


@pytest.fixture()
def recording_trainer_cls():
    from oar.integrations.trl import OARGRPOTrainer

    class Recording(OARGRPOTrainer):
        seen: list = []

        def _generate_and_score_completions(self, inputs):
            # capture TRL's sequence advantages before OAR replaces them
            base = trl.GRPOTrainer._generate_and_score_completions

            def spy(inner_self, inp):
                out = base(inner_self, inp)
                Recording.seen.append({"seq_adv": out["advantages"].clone()})
                return out

            orig = trl.GRPOTrainer._generate_and_score_completions
            trl.GRPOTrainer._generate_and_score_completions = spy
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                trl.GRPOTrainer._generate_and_score_completions = orig
            Recording.seen[-1].update(tok_adv=out["advantages"].clone(), mask=out["completion_mask"].clone(),
                                      completion_ids=out["completion_ids"].clone())
            return out

    Recording.seen = []
    return Recording


@pytest.mark.parametrize("method", ["oar_p", "oar_g"])
def test_one_step_per_token_advantages(tmp_path, recording_trainer_cls, method):
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    cfg = oar.OARConfig.from_json(json.dumps({"method": method}))
    trainer = recording_trainer_cls(model=model, reward_funcs=[reward_has_digit], args=_args(tmp_path),
                                    train_dataset=_dataset(), processing_class=tok, oar_config=cfg)
    trainer.train()
    rec = recording_trainer_cls.seen[0]
    seq, tokadv, mask = rec["seq_adv"], rec["tok_adv"], rec["mask"].bool()
    assert tokadv.dim() == 2 and tokadv.shape == mask.shape
    assert_within(tokadv.sum(1), seq * mask.sum(1), mass_bound(seq, mask.sum(1)), "mass")
    assert (tokadv[~mask] == 0).all()
    logged = {k for h in trainer.state.log_history for k in h}
    assert {"oar/ess_ratio", "oar/top10_mass", "time/attribution", "time/generation"} <= logged
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "no parameter was updated"


def test_trl_advantages_equal_oar_trl_preset(tmp_path, recording_trainer_cls):
    """TRL's own group normalization vs oar.ops.group_advantages(preset="trl") on the logged rewards."""
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    cfg = oar.OARConfig.from_json(json.dumps({"method": "grpo"}))
    trainer = recording_trainer_cls(model=model, reward_funcs=[reward_has_digit], args=_args(tmp_path),
                                    train_dataset=_dataset(), processing_class=tok, oar_config=cfg)
    trainer.train()
    rewards = torch.tensor(trainer._logs["rewards"]["reward_has_digit"], dtype=torch.float32)
    seq = recording_trainer_cls.seen[0]["seq_adv"]
    ours = ops.group_advantages(rewards, group_size=4, preset="trl")
    r = rewards.double().view(-1, 4)  # TRL's formula in float64: (r - mean) / (std + 1e-4), unbiased std
    ref64 = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()
    # the op accumulates in float64 and rounds once: TRL's formula in float64, rounded (rule 1)
    assert_close_to_rounded(ours, ref64, what="oar trl preset vs TRL")
    assert seq.shape == ours.shape  # TRL's own float32 run, on the same rewards
    # method "grpo": every token carries the sequence advantage
    rec = recording_trainer_cls.seen[0]
    torch.testing.assert_close(rec["tok_adv"], seq[:, None] * rec["mask"].float(), rtol=0, atol=0)


@pytest.mark.parametrize("bad, match", [({"use_liger_kernel": True}, "use_liger_kernel"),
                                         ({"loss_type": "luspo"}, "luspo")])
def test_refuses_incompatible_settings(tmp_path, bad, match):
    from oar.integrations.trl import OARGRPOTrainer

    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    try:
        args = _args(tmp_path, **bad)
    except Exception as e:  # pragma: no cover - depends on optional liger install
        pytest.skip(f"GRPOConfig refuses {bad} by itself: {e}")
    with pytest.raises(ValueError, match=match):
        OARGRPOTrainer(model=model, reward_funcs=[reward_has_digit], args=args, train_dataset=_dataset(),
                       processing_class=tok)


# (OARGRPOTrainer's own keyword arguments, exception, message regex). These used to fail after TRL had built the
# trainer (AttributeError), or at the first step (missing column).
OAR_ARGS_BAD_INPUT = [
    pytest.param(dict(oar_config={"method": "grpo"}), ValueError,
                 r"oar_config must be an oar\.OARConfig or None, got dict", id="oar_config_dict"),
    pytest.param(dict(answer_column=None), ValueError, r"answer_column must be a non-empty str .* got None",
                 id="answer_column_none"),
    pytest.param(dict(oar_config="oar_g"), ValueError, r"oar_config must be an oar\.OARConfig or None, got str",
                 id="oar_config_str"),
    pytest.param(dict(answer_column="solution"), KeyError,
                 r"needs the reference answer in dataset column 'solution'; "
                 r"train_dataset has columns \['prompt', 'answer'\]", id="answer_column_missing"),
    pytest.param(dict(answer_extractor="gsm8k"), ValueError,
                 r"answer_extractor must be a callable str -> str \(e\.g\. oar\.answers\.gsm8k_final_answer\) or None, "
                 r"got str 'gsm8k'", id="answer_extractor_str"),
    pytest.param(dict(answer_extractor=lambda s: ""), ValueError,
                 r"answer_extractor <lambda> must return the final answer as a non-empty str; on dataset column "
                 r"'answer', row 0 \('3'\) it returned ''", id="answer_extractor_empty"),
]


@pytest.mark.parametrize("kwargs, exc, match", OAR_ARGS_BAD_INPUT)
def test_trainer_checks_oar_arguments_before_building(tiny_trl, tmp_path, kwargs, exc, match):
    # The checks run before TRL's __init__, so the shared model is never touched.
    from oar.integrations.trl import OARGRPOTrainer

    model, tok = tiny_trl
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "1+2?"}], "answer": "3"}] * 4)
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, max_steps=1, report_to="none", save_strategy="no", use_cpu=True)
    with pytest.raises(exc, match=match):
        OARGRPOTrainer(model=model, reward_funcs=[lambda completions, **k: [0.0] * len(completions)], args=args,
                       train_dataset=ds, processing_class=tok, **kwargs)


# ---- loss types, every method, warnings, the mixin (issue 5) ------------------------------------------------

def _loss_of(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h][0]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_loss_types_consume_per_token_advantages(tmp_path, recording_trainer_cls, loss_type):
    """Uniform per-token advantages (B, C) give exactly TRL's loss with (B,) advantages in every supported loss
    aggregation, and OAR-P's reshaped ones keep each row's mass and train."""
    from trl import GRPOTrainer

    losses = {}
    for name in ("plain", "grpo", "oar_p"):
        model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
        args = _args(tmp_path / name, loss_type=loss_type)
        if name == "plain":
            trainer = GRPOTrainer(model=model, reward_funcs=[reward_has_digit], args=args, train_dataset=_dataset(),
                                  processing_class=tok)
        else:
            recording_trainer_cls.seen = []
            trainer = recording_trainer_cls(model=model, reward_funcs=[reward_has_digit], args=args,
                                            train_dataset=_dataset(), processing_class=tok,
                                            oar_config=oar.OARConfig.from_json(json.dumps({"method": name})))
        trainer.train()
        losses[name] = _loss_of(trainer)
        if name == "oar_p":
            rec = recording_trainer_cls.seen[0]
            m = rec["mask"].bool()
            assert rec["tok_adv"].dim() == 2
            assert_within(rec["tok_adv"].sum(1), rec["seq_adv"] * m.sum(1), mass_bound(rec["seq_adv"], m.sum(1)), "mass")
    # the same completions, the same products per token (padding multiplies 0 either way): the same loss
    assert losses["grpo"] == losses["plain"]
    assert all(map(lambda v: v == v and abs(v) < 1e6, losses.values()))


@pytest.mark.parametrize("method", ["dr_grpo", "random", "entropy", "entropy_shaping", "ktae"])
def test_every_baseline_runs_in_trl(tmp_path, recording_trainer_cls, method):
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    cfg = oar.OARConfig.from_json(json.dumps({"method": method}))
    if method == "dr_grpo":
        with pytest.warns(UserWarning, match="scale_rewards='none'"):
            trainer = recording_trainer_cls(model=model, reward_funcs=[reward_has_digit], args=_args(tmp_path),
                                            train_dataset=_dataset(), processing_class=tok, oar_config=cfg)
    else:
        trainer = recording_trainer_cls(model=model, reward_funcs=[reward_has_digit], args=_args(tmp_path),
                                        train_dataset=_dataset(), processing_class=tok, oar_config=cfg)
    trainer.train()
    rec = recording_trainer_cls.seen[0]
    seq, tokadv, mask = rec["seq_adv"], rec["tok_adv"], rec["mask"].bool()
    assert (tokadv[~mask] == 0).all()
    rewards = torch.tensor(trainer._logs["rewards"]["reward_has_digit"], dtype=torch.float32)
    if method == "dr_grpo":  # A = r - mean (no std scaling) broadcast to every token
        torch.testing.assert_close(seq, rewards - rewards.view(-1, 4).mean(1).repeat_interleave(4), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tokadv, seq[:, None] * mask)
    elif method in ("random", "entropy"):
        assert_within(tokadv.sum(1), seq * mask.sum(1), mass_bound(seq, mask.sum(1)), "mass")
    elif method == "entropy_shaping":  # 0 <= A_t - A <= |A| / kappa
        bonus = (tokadv - seq[:, None]) * mask
        assert (bonus >= -1e-6).all() and (bonus <= seq.abs()[:, None] / 2 + 1e-6).all()
        assert bonus.abs().sum() > 0
    else:  # ktae: A + key-token score, correctness from TRL's (weighted) rewards > 0
        from oar import baselines

        ids = rec["completion_ids"]
        bonus = baselines.ktae_token_scores(ids, mask, rewards, group_size=4,
                                            ignore_ids=sorted({tok.eos_token_id, tok.pad_token_id}))
        torch.testing.assert_close(tokadv, (seq[:, None] + bonus) * mask, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting, match", [({"importance_sampling_level": "sequence"}, "importance_sampling_level"),
                                             ({"top_entropy_quantile": 0.5}, "top_entropy_quantile")])
def test_warns_on_pointless_settings(tmp_path, setting, match):
    """A reshaping method warns at start (uniform credit is TRL's GRPO and does not: test_uniform_credit_is_trl_grpo;
    with loss_type='cispo' the sequence-level ratio still multiplies each token's log-probability: no warning)."""
    import warnings

    from oar.integrations.trl import OARGRPOTrainer

    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    with pytest.warns(UserWarning, match=match):
        OARGRPOTrainer(model=model, reward_funcs=[reward_has_digit], args=_args(tmp_path, **setting),
                       train_dataset=_dataset(), processing_class=tok,
                       oar_config=oar.OARConfig.from_json('{"method": "oar_p"}'))
    if "importance_sampling_level" in setting:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            OARGRPOTrainer(model=model, reward_funcs=[reward_has_digit],
                           args=_args(tmp_path, loss_type="cispo", **setting), train_dataset=_dataset(),
                           processing_class=tok, oar_config=oar.OARConfig.from_json('{"method": "oar_p"}'))


def test_mixin_in_a_user_subclass(tmp_path):
    from trl import GRPOTrainer

    from oar.integrations.trl import OARTrainerMixin

    class MyTrainer(OARTrainerMixin, GRPOTrainer):
        def __init__(self, *args, oar_config=None, **kwargs):
            super().__init__(*args, **kwargs)
            self._oar_setup(oar_config)

    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    trainer = MyTrainer(model=model, reward_funcs=[reward_has_digit], args=_args(tmp_path), train_dataset=_dataset(),
                        processing_class=tok, oar_config=oar.OARConfig.from_json('{"method": "oar_g"}'))
    trainer.train()
    logged = {k for h in trainer.state.log_history for k in h}
    assert {"oar/ess_ratio", "oar/forward_passes", "time/attribution"} <= logged


# ---- what the adapter assumes of TRL's batch, checked (a stand-in GRPOTrainer: no generation needed) ----------

class _Accelerator:
    process_index = 0

    def unwrap_model(self, m):
        return m

    def gather(self, t):
        return t

    def pad_across_processes(self, t, dim=1, pad_index=0):
        return t


class _StandInGRPO:
    """What OARTrainerMixin reads of trl.GRPOTrainer (1.13.0): its two hook points and a few attributes.
    ``_generate_and_score_completions`` scores through ``_calculate_rewards`` and returns ``out``, as TRL does."""

    def __init__(self, model, tok, out, rewards_per_func, num_generations):
        from collections import defaultdict

        import types

        self.model, self.processing_class = model, tok
        self.args = types.SimpleNamespace(loss_type="dapo")
        self.accelerator, self.num_generations, self.scale_rewards = _Accelerator(), num_generations, "group"
        self.reward_weights = torch.ones(rewards_per_func.shape[1])
        self._metrics = {"train": defaultdict(list)}
        self._out, self._rpf = out, rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._calculate_rewards(inputs, None, None, None)
        return dict(self._out)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return self._rpf


def _standin_out(tok, prompts, texts, C=24):
    from _completions import completion_batch

    _, ids, mask = completion_batch(tok, texts, C)
    P = max(len(p) for p in prompts)
    pids = torch.full((len(prompts), P), tok.pad_token_id, dtype=torch.long)
    pmask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        pids[i, P - len(p):], pmask[i, P - len(p):] = torch.tensor(p), 1
    return {"prompt_ids": pids, "prompt_mask": pmask, "completion_ids": ids, "completion_mask": mask,
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5][: len(texts)])}


def _standin(tok, model, out, rpf, method="oar_g", answer_extractor=None, **cfg):
    from oar.integrations.trl import _make_trainer_class

    cls = _make_trainer_class(_StandInGRPO)
    model.train()
    return cls(model, tok, out, rpf, 2, oar_config=oar.OARConfig.from_json(json.dumps(dict(method=method, **cfg))),
               answer_extractor=answer_extractor)


TEXTS4 = ["so 2 and 3 \\boxed{5}", "hmm 9 \\boxed{9}", "4 4 \\boxed{8}", "5 \\boxed{5}"]


@pytest.fixture(scope="module")
def tiny_trl():
    return tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)


def test_standin_runs_the_pipeline(tiny_trl):
    model, tok = tiny_trl
    p1, p2 = tok.encode("Q: 2+3?", add_special_tokens=False), tok.encode("Q: 4+4?", add_special_tokens=False)
    out = _standin_out(tok, [p1, p1, p2, p2], TEXTS4)
    t = _standin(tok, model, out, torch.ones(4, 1))
    res = t._generate_and_score_completions([{"answer": "5"}] * 4)
    m = out["completion_mask"].bool()
    assert res["advantages"].shape == out["completion_ids"].shape
    torch.testing.assert_close(res["advantages"].sum(1), out["advantages"] * m.sum(1), rtol=1e-5, atol=1e-6)


def test_block_of_num_generations_rows_must_be_one_prompt(tiny_trl):
    model, tok = tiny_trl
    p1, p2 = tok.encode("Q: 2+3?", add_special_tokens=False), tok.encode("Q: 4+4?", add_special_tokens=False)
    t = _standin(tok, model, _standin_out(tok, [p1, p2, p2, p2], TEXTS4), torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"rows \[0, 1\] \(group 0, num_generations = 2\) must share one prompt"):
        t._generate_and_score_completions([{"answer": "5"}] * 4)


def test_tool_mask_of_the_wrong_shape_is_named(tiny_trl):
    model, tok = tiny_trl
    p1 = tok.encode("Q: 2+3?", add_special_tokens=False)
    out = _standin_out(tok, [p1] * 4, TEXTS4)
    out["tool_mask"] = torch.ones(4, 5, dtype=torch.long)
    t = _standin(tok, model, out, torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"tool_mask must be \(B, C\) = \(4, 24\) like completion_mask, got \(4, 5\)"):
        t._generate_and_score_completions([{"answer": "5"}] * 4)


def test_none_answer_is_missing(tiny_trl):
    # A row whose answer is None used to be probed with the reference answer "None".
    model, tok = tiny_trl
    p1 = tok.encode("Q: 2+3?", add_special_tokens=False)
    t = _standin(tok, model, _standin_out(tok, [p1] * 4, TEXTS4), torch.ones(4, 1))
    with pytest.raises(KeyError, match=r"reference answer in dataset column 'answer'; rows \[1\] lack it or hold None"):
        t._generate_and_score_completions([{"answer": "3"}, {"answer": None}, {"answer": "3"}, {"answer": "3"}])


def test_answers_are_extracted_and_checked_at_the_step(tiny_trl):
    """The step reads each row's answer through answer_extractor; without one, a worked solution in a row the step
    samples is refused naming that row of the process's batch (the first rows were checked at construction)."""
    from oar.answers import gsm8k_final_answer

    model, tok = tiny_trl
    p1 = tok.encode("Q: 2+3?", add_special_tokens=False)
    out = _standin_out(tok, [p1] * 4, TEXTS4)
    solution = "2 and 3 make <<2+3=5>>5.\n#### 5"
    t = _standin(tok, model, out, torch.ones(4, 1), answer_extractor=gsm8k_final_answer)
    assert t._oar_batch([{"answer": solution}] * 4, out).answers == ["5"] * 4
    t = _standin(tok, model, out, torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"dataset column 'answer', row 1 of process 0's batch holds a worked "
                                         r"solution, not a final answer: it contains the final-answer marker '####'"
                                         r".*pass answer_extractor=oar\.answers\.gsm8k_final_answer"):
        t._generate_and_score_completions([{"answer": "5"}, {"answer": solution}, {"answer": "5"}, {"answer": "5"}])


def test_all_nan_rewards_are_ktae_failures(tiny_trl):
    """A rollout whose every reward function returned None is unscorable: wrong for KTAE, never reward 0 (which
    is 'correct' under a negative threshold) as TRL's nansum would make it."""
    from oar.integrations.trl import combined_rewards

    model, tok = tiny_trl
    p1 = tok.encode("Q: 2+3?", add_special_tokens=False)
    out = _standin_out(tok, [p1] * 4, TEXTS4)
    nan = float("nan")
    rpf = torch.tensor([[1.0, nan], [nan, nan], [0.0, -1.0], [nan, 1.0]])
    torch.testing.assert_close(combined_rewards(rpf, torch.ones(2)), torch.tensor([1.0, nan, -1.0, 1.0]),
                               equal_nan=True)
    t = _standin(tok, model, out, rpf, method="ktae", ktae_threshold=-0.5)
    res = t._generate_and_score_completions([{"answer": "5"}] * 4)
    m = out["completion_mask"].bool()
    kw = dict(group_size=2, threshold=-0.5, ignore_ids=[tok.pad_token_id])
    wrong = baselines.ktae_token_scores(out["completion_ids"], m, torch.tensor([1.0, -1e30, -1.0, 1.0]), **kw)
    as_zero = baselines.ktae_token_scores(out["completion_ids"], m, torch.tensor([1.0, 0.0, -1.0, 1.0]), **kw)
    torch.testing.assert_close(res["advantages"], (out["advantages"][:, None] + wrong) * m, rtol=0, atol=1e-7)
    assert not torch.allclose(wrong, as_zero)  # the two readings differ on this batch: the test can fail


def test_trl_versions_are_accepted_by_their_hook_points():
    from oar.integrations.trl import _make_trainer_class, check_trl_features

    check_trl_features(trl.GRPOTrainer)

    class NoRewards:
        def _generate_and_score_completions(self, inputs):
            return {}

    with pytest.raises(RuntimeError, match=r"has no _calculate_rewards, the hook point oar overrides"):
        _make_trainer_class(NoRewards)

    class Changed(_StandInGRPO):
        def _generate_and_score_completions(self, batch, mode):
            return {}

    with pytest.raises(RuntimeError, match=r"_generate_and_score_completions\('self', 'batch', 'mode'\) is not "
                                           r"_generate_and_score_completions\('self', 'inputs'\)"):
        _make_trainer_class(Changed)


# ---- an error on one rank is the same error on every rank (issue 24, item 1) ----------------------------------

@pytest.mark.parametrize("scenario, original", [
    ("answer", "KeyError: \"OAR needs the reference answer in dataset column 'answer'"),  # before the gate
    ("vocab", "ValueError: "),  # inside the gate's scope (token id outside the vocabulary)
    ("tool_mask", "ValueError: tool_mask must be (B, C)"),  # grpo: no model pass, no gate
])
def test_error_on_one_rank_is_raised_on_every_rank(tmp_path, scenario, original):
    """2 gloo ranks (trl_error_ranks.py), rank 1's batch broken: both ranks raise the same RankError naming rank 1
    and its original error, without waiting for a collective timeout (the worker's gloo timeout is 30 s, the
    subprocess's 300 s: a rank left waiting ends with a gloo error, never a hang)."""
    _run_error_ranks(scenario, tmp_path)
    got = [(tmp_path / f"rank{k}.txt").read_text() for k in range(2)]
    assert got[0] == got[1], got
    assert got[0].startswith("RankError: oar: 1 rank(s) failed during attribution"), got[0]
    assert "rank 1: " + original in got[0], got[0]
    assert "rank 0:" not in got[0], got[0]


def _run_error_ranks(scenario: str, out) -> None:
    """``python trl_error_ranks.py SCENARIO OUT`` with the oar this process imported (``_subproc.child_env``)."""
    import os
    import subprocess
    import sys

    from _paths import WORKERS
    from _subproc import child_env

    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(WORKERS), env["PYTHONPATH"]])
    p = subprocess.run([sys.executable, str(WORKERS / "trl_error_ranks.py"), scenario, str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-4000:]


# ---- a reward function failing on one rank (issue 40, item A) --------------------------------------------------

@pytest.fixture(scope="module")
def reward_ranks(tmp_path_factory):
    """One run of ``trl_error_ranks.py rewards``: the real GRPOTrainer on 2 gloo ranks, each scenario in turn."""
    out = tmp_path_factory.mktemp("reward_ranks")
    _run_error_ranks("rewards", out)
    return out


@pytest.mark.parametrize("scenario, original", [
    ("reward_raises", "ValueError: reward server unreachable from this rank"),
    ("reward_count", "ValueError: the reward function 'reward_wrong_count' returned 1 rewards, but 2 were expected"),
])
def test_reward_error_on_one_rank_is_raised_on_every_rank(reward_ranks, scenario, original):
    """A reward function that raises (sync, oar_p) or returns one reward too few (async, grpo) on rank 1 only: both
    ranks leave TRL's step with the same RankError naming rank 1 and its error, chained to it on rank 1, within
    seconds of the failure, by the ranks' own clocks (before the wrapping, rank 0 waited in TRL's gather of the
    rewards until the process group's timeout, TRL's ddp_timeout: 30 minutes by default, 30 s in the worker)."""
    d = reward_ranks / scenario
    got = [(d / f"rank{k}.txt").read_text() for k in range(2)]
    assert got[0] == got[1], got
    assert got[0].startswith("RankError: oar: 1 rank(s) failed during the reward functions, so every rank stops "
                             "here"), got[0]
    assert "rank 1: " + original in got[0] and "rank 0:" not in got[0], got[0]
    rec = [json.loads((d / f"rank{k}.json").read_text()) for k in range(2)]
    assert rec[0]["cause"] is None and rec[1]["cause"][0] == "ValueError", rec
    assert "rank 1: " + ": ".join(rec[1]["cause"]) in got[1]  # chained to the original on the failing rank
    failed_at = float((d / "failed_at.txt").read_text())
    took = max(r["ended_at"] for r in rec) - failed_at
    assert 0 <= took < 10, f"the ranks ended {took:.1f} s after the reward function failed"


def _short_step_args(tmp_path):
    return _args(tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=6)


class RewardServerError(Exception):
    pass


@pytest.mark.parametrize("failure", ["raises", "raises_async", "count"])
def test_reward_error_with_one_process_is_raised_unchanged(tmp_path, failure):
    """With one process the reward functions' wrappers are the functions: a reward function's exception is raised
    by train() as itself (the same object, sync or async), and a wrong number of rewards gets TRL's own error."""
    from oar.integrations.trl import OARGRPOTrainer

    raised = []

    def flaky_reward(prompts, completions, **kw):
        raised.append(RewardServerError("reward server unreachable"))
        raise raised[-1]

    async def flaky_async_reward(prompts, completions, **kw):
        raised.append(RewardServerError("judge timed out"))
        raise raised[-1]

    def short_reward(prompts, completions, **kw):
        return [0.0] * (len(completions) - 1)

    func = {"raises": flaky_reward, "raises_async": flaky_async_reward, "count": short_reward}[failure]
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    trainer = OARGRPOTrainer(model=model, reward_funcs=[func], args=_short_step_args(tmp_path),
                             train_dataset=_dataset(), processing_class=tok,
                             oar_config=oar.OARConfig.from_json('{"method": "grpo"}'))
    if failure == "count":
        with pytest.raises(ValueError, match=r"^The reward function 'short_reward' returned 3 rewards, but 4 were "
                                             r"expected \(one per prompt-completion pair\)"):
            trainer.train()
        return
    with pytest.raises(RewardServerError) as e:
        trainer.train()
    assert e.value is raised[-1]


def test_reward_functions_are_wrapped_keeping_what_trl_reads(tmp_path):
    """Every callable reward function is wrapped (sync, async, a functools.partial, a callable instance): TRL's name
    for it and whether it is a coroutine function are unchanged; the user's list is left as it was, and a second
    trainer built from it wraps the original functions."""
    import functools
    import inspect

    from trl.trainer.utils import get_callable_name

    from oar.integrations.trl import OARGRPOTrainer

    async def judge(prompts, completions, **kw):
        return [0.5] * len(completions)

    class Scorer:
        def __call__(self, prompts, completions, **kw):
            return [1.0] * len(completions)

    def weighted(prompts, completions, weight, **kw):
        return [weight] * len(completions)

    funcs = [reward_has_digit, judge, functools.partial(weighted, weight=2.0), Scorer()]
    before = list(funcs)
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    for _ in range(2):
        trainer = OARGRPOTrainer(model=model, reward_funcs=funcs, args=_short_step_args(tmp_path),
                                 train_dataset=_dataset(), processing_class=tok)
        assert all(a is b for a, b in zip(funcs, before)) and len(funcs) == len(before)
        assert trainer.reward_func_names == ["reward_has_digit", "judge", "weighted", "Scorer"]
        for g, f in zip(trainer.reward_funcs, funcs):
            assert g is not f and g.__wrapped__ is f
            assert get_callable_name(g) == get_callable_name(f)
            assert inspect.iscoroutinefunction(g) == inspect.iscoroutinefunction(f)


def test_guard_records_a_failure_and_returns_placeholders_with_several_processes(monkeypatch):
    """With several processes (stood in for), a correct output is returned as the same object (TRL reads the same
    values: the rewards are bit-identical), a failure is recorded and replaced by one None (NaN) per row, so the rank
    reaches TRL's gather; with one process the function's error and output pass through."""
    import asyncio

    from oar.integrations import trl as oar_trl

    errors = []
    ok = [1.0, None, 0.25]

    def good(prompts, completions, **kw):
        return ok

    def boom(prompts, completions, **kw):
        raise RewardServerError("down")

    async def short(prompts, completions, **kw):
        return ok[:2]

    def words(prompts, completions, **kw):
        return ["high", "low", "low"]

    def lazy(prompts, completions, **kw):
        return iter(ok)

    call = dict(prompts=["p"] * 3, completions=["c"] * 3, completion_ids=[[1]] * 3)
    g = {f.__name__: oar_trl.guard_reward_func(f, errors) for f in (good, boom, short, words, lazy)}
    with pytest.raises(RewardServerError):  # one process: the function itself
        g["boom"](**call)
    assert asyncio.run(g["short"](**call)) == ok[:2] and not errors
    monkeypatch.setattr(oar_trl, "distributed_world", lambda: True)
    assert g["good"](**call) is ok and g["lazy"](**call) == ok and not errors
    assert g["boom"](**call) == [None] * 3 and isinstance(errors[-1], RewardServerError)
    assert asyncio.run(g["short"](**call)) == [None] * 3
    assert str(errors[-1]) == ("the reward function 'short' returned 2 rewards, but 3 were expected (one per "
                               "prompt-completion pair of this process's batch)")
    assert g["words"](**call) == [None] * 3 and isinstance(errors[-1], (TypeError, ValueError))
    assert len(errors) == 3
    with pytest.raises(ValueError, match=r"got Linear \(reward models are called by TRL as models"):
        oar_trl.guard_reward_func(torch.nn.Linear(1, 1), errors)


def test_reward_models_are_not_wrapped(tiny_trl):
    from oar.integrations.trl import _make_trainer_class

    reward_model = torch.nn.Linear(1, 1)

    class WithRewards(_StandInGRPO):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.reward_funcs = [reward_model, reward_has_digit]

    model, tok = tiny_trl
    p1 = tok.encode("Q: 2+3?", add_special_tokens=False)
    t = _make_trainer_class(WithRewards)(model, tok, _standin_out(tok, [p1] * 4, TEXTS4), torch.ones(4, 2), 2)
    assert t.reward_funcs[0] is reward_model and t.reward_funcs[1].__wrapped__ is reward_has_digit


# ---- the reference answer the probe reads (issue 40, item B) -------------------------------------------------

def _gsm8k_rows(n: int) -> list[dict]:
    import os
    from pathlib import Path

    from _paths import ROOT

    path = Path(os.environ.get("OAR_DATA_DIR") or ROOT.parent / "shared" / "data")
    path = path / "gsm8k" / "test.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not found (set OAR_DATA_DIR)")
    with open(path) as f:
        return [json.loads(next(f)) for _ in range(n)]


def test_trainer_refuses_gsm8k_solutions_at_construction(tiny_trl, tmp_path):
    """GSM8K rows as TRL's examples load them (``answer``: the worked solution ending in ``#### 42``): OAR-G refuses
    them before TRL builds anything, naming the column, row 0, the start of its value and the extractor; with
    ``answer_extractor=oar.answers.gsm8k_final_answer`` the trainer builds; method grpo reads no answer."""
    from oar.answers import gsm8k_final_answer
    from oar.integrations.trl import OARGRPOTrainer

    model, tok = tiny_trl
    rows = _gsm8k_rows(8)
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
                                     for r in rows])
    kw = dict(model=model, reward_funcs=[reward_has_digit], args=_short_step_args(tmp_path), train_dataset=ds,
              processing_class=tok)
    start = re.escape(repr(rows[0]["answer"][:20])[:-1])  # the start of the value, as the message quotes it
    with pytest.raises(ValueError, match=rf"^dataset column 'answer', row 0 holds a worked solution, not a final "
                                         rf"answer: it contains the final-answer marker '####' \({start}"
                                         rf".*: pass answer_extractor=oar\.answers\.gsm8k_final_answer"):
        OARGRPOTrainer(**kw)
    trainer = OARGRPOTrainer(**kw, answer_extractor=gsm8k_final_answer)
    assert trainer.oar_answer_extractor is gsm8k_final_answer
    OARGRPOTrainer(**kw, oar_config=oar.OARConfig.from_json('{"method": "grpo"}'))


def test_trainer_warns_about_a_long_single_line_answer(tiny_trl, tmp_path, monkeypatch):
    from oar import answers
    from oar.integrations.trl import OARGRPOTrainer

    monkeypatch.setattr(answers, "_warned_long", set())
    model, tok = tiny_trl
    long = "the answer is the number of apples that Mary has left after giving half of them to each of her friends"
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "1+2?"}], "answer": long}] * 4)
    n = len(tok.encode(long, add_special_tokens=False))
    assert n > answers.MAX_ANSWER_TOKENS
    with pytest.warns(UserWarning, match=rf"dataset column 'answer', row 0: the reference answer is {n} tokens long"):
        OARGRPOTrainer(model=model, reward_funcs=[reward_has_digit], args=_short_step_args(tmp_path),
                       train_dataset=ds, processing_class=tok)


# ---- parity with TRL's own GRPO loss under uniform credit (issue 24, item 3) ----------------------------------

#: every loss_type of trl 1.13's GRPOConfig (grpo_config.py, ``loss_type``) but luspo, which oar refuses at init
PARITY_LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo"]


def _parity_out(tok, with_tool_mask: bool):
    """What TRL's ``_generate_and_score_completions`` returns for 2 groups of 2 (grpo_trainer.py:2923-2960), with
    old log-probs that make the importance ratios and their clipping non-trivial."""
    out = _standin_out(tok, [tok.encode("Q?", add_special_tokens=False)] * 4, TEXTS4, C=16)
    g = torch.Generator().manual_seed(0)
    out["old_per_token_logps"] = -4.6 + 0.4 * torch.randn(out["completion_ids"].shape, generator=g)
    out["num_items_in_batch"] = out["completion_mask"].sum()
    if with_tool_mask:  # a tool output inside row 0 and at the start of row 2 (0 = not the model's tokens)
        tm = torch.ones_like(out["completion_mask"])
        tm[0, 2:5] = 0
        tm[2, :2] = 0
        out["tool_mask"] = tm
    return out


def _loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("setting", [{}, {"tool_mask": True}, {"top_entropy_quantile": 0.2},
                                     {"importance_sampling_level": "sequence"}, {"scale_rewards": "batch"}])
@pytest.mark.parametrize("loss_type", PARITY_LOSS_TYPES)
def test_uniform_credit_is_trl_grpo(tmp_path, monkeypatch, loss_type, setting):
    """oar on (method grpo: uniform credit) and off give the same per-token advantages on TRL's loss mask, and TRL's
    own compute_loss gives the same loss and gradients, bit for bit (the same float operations on every token the
    loss keeps; the (B, C) advantages are 0 where (B,) ones are masked out), for every loss_type of trl 1.13, with
    tool-output masks, the 80/20 entropy selection, sequence-level importance sampling and batch reward scaling;
    and the trainer emits no warning about these settings."""
    import copy
    import warnings

    from trl import GRPOTrainer

    from oar.integrations.trl import OARGRPOTrainer

    setting = dict(setting)
    with_tool_mask = setting.pop("tool_mask", False)
    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    args = _args(tmp_path, loss_type=loss_type, per_device_train_batch_size=4, num_generations=2, **setting)
    plain = GRPOTrainer(model=model, reward_funcs=[reward_has_digit], args=args, train_dataset=_dataset(),
                        processing_class=tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "served unchanged": no warning at start either
        on = OARGRPOTrainer(model=copy.deepcopy(model), reward_funcs=[reward_has_digit], args=args,
                            train_dataset=_dataset(), processing_class=tok,
                            oar_config=oar.OARConfig.from_json('{"method": "grpo"}'))
    out = _parity_out(tok, with_tool_mask)
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", lambda self, inputs: dict(out))
    on.model.train()
    inputs_on = on._generate_and_score_completions([{"answer": "5"}] * 4)
    adv = inputs_on["advantages"]
    mask = (out["completion_mask"] * out.get("tool_mask", 1)).bool()
    assert adv.shape == mask.shape
    assert torch.equal(adv, torch.where(mask, out["advantages"][:, None], torch.zeros(())))
    loss_off, grads_off = _loss_and_grads(plain, dict(out))
    loss_on, grads_on = _loss_and_grads(on, inputs_on)
    assert loss_off != 0 and grads_off
    assert grads_on.keys() == grads_off.keys()
    if loss_type == "sapo" and setting.get("importance_sampling_level") == "sequence":
        # Not bit for bit here (measured: 5e-7 relative on the loss): float rounding only, bounded by the first-order
        # error of the loss's sums of n = |mask| terms (gamma(n) = n u of the summed magnitudes).
        tol = mask.sum().item() * torch.finfo(torch.float32).eps
        torch.testing.assert_close(loss_on, loss_off, rtol=tol, atol=0)
        for n in grads_off:
            torch.testing.assert_close(grads_on[n], grads_off[n], rtol=tol, atol=tol * grads_off[n].abs().max().item())
        return
    assert torch.equal(loss_on, loss_off), (loss_type, setting, float(loss_on), float(loss_off))
    for n in grads_off:
        assert torch.equal(grads_on[n], grads_off[n]), (loss_type, setting, n)


def test_luspo_is_refused_at_start(tmp_path):
    from oar.integrations.trl import OARGRPOTrainer

    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    with pytest.raises(ValueError, match="loss_type='luspo'"):
        OARGRPOTrainer(model=model, reward_funcs=[reward_has_digit],
                       args=_args(tmp_path, loss_type="luspo", importance_sampling_level="sequence"),
                       train_dataset=_dataset(), processing_class=tok,
                       oar_config=oar.OARConfig.from_json('{"method": "grpo"}'))
