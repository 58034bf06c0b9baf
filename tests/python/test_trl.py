"""OARGRPOTrainer with the real trl package (1.13.0) on a tiny random Llama: one optimizer step.

Checks that the hook replaces TRL's (B,) sequence advantages by (B, C) per-token advantages whose masked
sums equal A * |completion|, that TRL's own advantages equal oar's "trl" preset on the same rewards,
that training runs and logs oar metrics, and that incompatible settings are refused.
"""

import json

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import oar  # noqa: E402
from oar import ops  # noqa: E402
from oar.models import tiny_random_llama  # noqa: E402


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
                gradient_checkpointing=False, seed=0, temperature=1.0, disable_tqdm=True)
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
    torch.testing.assert_close(tokadv.sum(1), seq * mask.sum(1), rtol=1e-5, atol=1e-5)
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
    torch.testing.assert_close(ours, seq, rtol=1e-5, atol=1e-5)
    # method "grpo": every token carries the sequence advantage
    rec = recording_trainer_cls.seen[0]
    torch.testing.assert_close(rec["tok_adv"], seq[:, None] * rec["mask"].float())


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
            torch.testing.assert_close(rec["tok_adv"].sum(1), rec["seq_adv"] * m.sum(1), rtol=1e-5, atol=1e-5)
    assert losses["grpo"] == pytest.approx(losses["plain"], rel=1e-5, abs=1e-7)
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
        torch.testing.assert_close(tokadv.sum(1), seq * mask.sum(1), rtol=1e-5, atol=1e-5)
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
    from oar.integrations.trl import OARGRPOTrainer

    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    with pytest.warns(UserWarning, match=match):
        OARGRPOTrainer(model=model, reward_funcs=[reward_has_digit], args=_args(tmp_path, **setting),
                       train_dataset=_dataset(), processing_class=tok,
                       oar_config=oar.OARConfig.from_json('{"method": "grpo"}'))


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
