"""oar's verl plugin against the REAL verl package (0.9.1; requirements/trainers.txt): entry-point loading, the
estimator registry and the call path ``verl.trainer.ppo.ray_trainer.compute_advantage`` -> registry -> OAR
estimator, on a tiny random Llama for the attribution methods.

Skipped when verl is not installed (it is an optional dependency).
"""

import json
import os
import subprocess
import sys
import tomllib

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl", reason="verl not installed (pip install -r requirements/trainers.txt)")
ray_trainer = pytest.importorskip("verl.trainer.ppo.ray_trainer")

import oar  # noqa: E402
from oar import baselines, ops  # noqa: E402
from oar.integrations import verl as oar_verl  # noqa: E402
from oar.integrations.verl import estimators as verl_estimators  # noqa: E402
from oar.testing import tiny_random_llama  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402

from _completions import completion_batch  # noqa: E402
from _paths import ROOT  # noqa: E402
from _tolerance import assert_close_to_rounded, assert_within, mass_bound  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def registered():
    names = oar_verl.register()
    yield names
    oar_verl.configure(None, None)


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)


def _batch(tok, n_groups=3, G=4, R=10, seed=0, shuffle=True):
    """A verl-shaped DataProto: left-padded prompts, right-padded responses, uid groups in shuffled row order."""
    g = torch.Generator().manual_seed(seed)
    B = n_groups * G
    P = 6
    vocab = len(tok)
    prompts = torch.full((B, P), tok.pad_token_id)
    pmask = torch.zeros((B, P), dtype=torch.long)
    responses = torch.full((B, R), tok.pad_token_id)
    rmask = torch.zeros((B, R), dtype=torch.long)
    for i in range(B):
        p = 3 + (i // G) % 3
        prompts[i, P - p:] = torch.randint(3, vocab, (p,), generator=g)
        pmask[i, P - p:] = 1
        L = int(torch.randint(4, R + 1, (1,), generator=g))
        responses[i, :L] = torch.randint(3, vocab, (L,), generator=g)
        rmask[i, :L] = 1
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    if G == 4:
        rewards[:G] = torch.tensor([1.0, 0.0, 0.0, 1.0])  # at least one group with both outcomes
    tlr = torch.zeros((B, R))
    last = rmask.sum(1) - 1
    tlr[torch.arange(B), last] = rewards
    uid = np.array([f"u{i // G}" for i in range(B)], dtype=object)
    answers = np.array([{"ground_truth": str(i // G + 3)} for i in range(B)], dtype=object)
    order = torch.randperm(B, generator=g) if shuffle else torch.arange(B)
    tensors = {"prompts": prompts, "responses": responses, "response_mask": rmask,
               "attention_mask": torch.cat([pmask, rmask], 1), "token_level_rewards": tlr,
               "input_ids": torch.cat([prompts, responses], 1)}
    tensors = {k: v[order] for k, v in tensors.items()}
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid[order.numpy()],
                                                             "reward_model": answers[order.numpy()]})


def _run(data, name, **cfg):
    # as RayPPOTrainer.fit calls it: norm_adv_by_std_in_grpo both as an argument and in the algorithm config
    norm = cfg.get("norm_adv_by_std_in_grpo", True)
    return ray_trainer.compute_advantage(data, adv_estimator=name, norm_adv_by_std_in_grpo=norm,
                                         config=AlgoConfig(**cfg)).batch["advantages"]


def test_pyproject_declares_the_plugin_entry_point():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"]["verl.plugins"]
    assert eps == {"oar": "oar.integrations.verl.plugin"}


@pytest.mark.parametrize("opt_in", [True, False])
def test_plugin_loads_through_the_verl_plugins_entry_point(tmp_path, opt_in):
    """`import verl` loads oar's plugin through importlib.metadata entry points (a dist-info folder stands in for
    the installed oar distribution; its entry point is pyproject's). Opt-in: with $OAR_VERL_PLUGIN=1 it registers
    the OAR estimators, wraps compute_advantage and registers the OAR v1 trainers; without it, verl is untouched."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        proj = tomllib.load(f)["project"]
    dist = tmp_path / f"oar-{proj['version']}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: oar\nVersion: {proj['version']}\n")
    lines = ["[verl.plugins]"] + [f"{k} = {v}" for k, v in proj["entry-points"]["verl.plugins"].items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    code = ("import json, sys; import verl; from verl.trainer.ppo import core_algos, ray_trainer; "
            "from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY; "
            "print(json.dumps({'names': sorted(k for k in core_algos.ADV_ESTIMATOR_REGISTRY if k.startswith('oar')), "
            "'wrapped': bool(getattr(ray_trainer.compute_advantage, '__oar_wrapped__', False)), "
            "'init_workers': bool(getattr(ray_trainer.RayPPOTrainer.init_workers, '__oar_wrapped__', False)), "
            "'trainers': sorted(k for k in TRAINER_REGISTRY if k.startswith('oar')), "
            "'plugin': 'oar.integrations.verl.plugin' in sys.modules}))")
    # The child imports the same oar as this process (installed package in CI, python/ + OAR_BUILD_DIR in a dev tree).
    oar_parent = os.path.dirname(os.path.dirname(os.path.abspath(oar.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), oar_parent, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("OAR_VERL_PLUGIN", None)
    if opt_in:
        env["OAR_VERL_PLUGIN"] = "1"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["plugin"]
    if opt_in:
        assert out["wrapped"] and out["init_workers"]
        assert out["names"] == sorted(oar_verl.ADV_ESTIMATORS)
        assert out["trainers"] == ["oar_colocate_async", "oar_separate_async", "oar_sync"]
    else:
        assert out == {"names": [], "wrapped": False, "init_workers": False, "trainers": [], "plugin": True}


def test_registry_holds_every_method(registered):
    assert set(registered) == set(oar_verl.ADV_ESTIMATORS)
    methods = {m for m in oar_verl.ADV_ESTIMATORS.values() if m}
    assert methods == set(oar.METHODS)
    for name in registered:
        assert core_algos.get_adv_estimator_fn(name).__name__ == f"compute_{name}_advantage"


@pytest.mark.parametrize("norm", [True, False])
def test_uniform_credit_equals_verl_grpo(tiny, norm):
    """oar_grpo (and oar_dr_grpo when norm is off) reproduce verl's own GRPO estimator exactly, rows shuffled and
    with a singleton group (verl's mean 0 / std 1 quirk)."""
    _, tok = tiny
    data = _batch(tok)
    data = DataProto.concat([data, _batch(tok, n_groups=1, G=1, seed=5)])
    data.non_tensor_batch["uid"][-1] = "single"
    ref = _run(data, "grpo", norm_adv_by_std_in_grpo=norm)  # verl's own estimator, in float32
    ours = _run(data, "oar_grpo", norm_adv_by_std_in_grpo=norm)
    b = data.batch
    ref64, _ = core_algos.compute_grpo_outcome_advantage(b["token_level_rewards"].double(), b["response_mask"],
                                                         data.non_tensor_batch["uid"], norm_adv_by_std_in_grpo=norm)
    # rule 1: the op accumulates in float64 and rounds once: verl's formula in float64, rounded
    assert_close_to_rounded(ours, ref64, what="oar_grpo vs verl")
    assert ref.shape == ours.shape  # verl's own float32 run
    if not norm:
        assert_close_to_rounded(_run(data, "oar_dr_grpo"), ref64, what="oar_dr_grpo vs verl")


@pytest.mark.parametrize("name, tiers, probe", [("oar_p", "both", "answer_mean"), ("oar_g", "boost", "last"),
                                                ("oar_p", "suppress", "answer_joint"), ("oar_random", "both", "answer_mean")])
def test_attribution_methods_keep_mass(tiny, name, tiers, probe):
    """Through compute_advantage with a driver-side HFScorer: per-token advantages keep each row's mass, are 0
    off the response mask, and differ from uniform credit."""
    model, tok = tiny
    oar_verl.configure(oar.OARConfig.from_json(json.dumps({"tiers": tiers, "probe": probe})),
                       oar_verl.HFScorer(tok, model))
    try:
        data = _batch(tok)
        seq = _run(data, "oar_grpo")
        adv = _run(data, name)
    finally:
        oar_verl.configure(None, None)
    mask = data.batch["response_mask"].bool()
    A = seq[torch.arange(len(data)), 0]
    assert_within(adv.sum(1), A * mask.sum(1), mass_bound(A, mask.sum(1)), "mass")
    assert (adv[~mask] == 0).all()
    assert not torch.allclose(adv, seq, atol=1e-4)


def test_attached_scores_are_used(tiny):
    _, tok = tiny
    data = _batch(tok)
    mask = data.batch["response_mask"].bool()
    scores = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    oar_verl.attach_scores(data, scores, mask)
    adv = _run(data, "oar_p")
    seq = _run(data, "oar_grpo")[:, 0]
    exp, _ = ops.reshape_advantages(seq, scores, mask, mask)
    torch.testing.assert_close(adv, exp, rtol=0, atol=0)  # one reshape: the op's own result
    with pytest.raises(ValueError, match=r"scores must be a \(B, R\) = \(\d+, \d+\) tensor, got"):
        oar_verl.attach_scores(data, scores[:, :3], mask)


def test_ktae_uses_the_gathered_groups(tiny):
    _, tok = tiny
    oar_verl.configure(None, None, ignore_ids=[tok.eos_token_id, tok.pad_token_id])
    try:
        data = _batch(tok)
        adv = _run(data, "oar_ktae")
    finally:
        oar_verl.configure(None, None)
    b = data.batch
    seq = _run(data, "oar_grpo")[:, 0]
    uid = list(data.non_tensor_batch["uid"])
    perm = sorted(range(len(uid)), key=lambda i: (int(uid[i][1:]), i))
    inv = torch.empty(len(perm), dtype=torch.long)
    inv[torch.tensor(perm)] = torch.arange(len(perm))
    mask = b["response_mask"].bool()
    rewards = b["token_level_rewards"].sum(1)
    bonus = baselines.ktae_token_scores(b["responses"][perm], mask[perm], rewards[perm], group_size=4,
                                        ignore_ids=sorted({tok.eos_token_id, tok.pad_token_id}))[inv]
    torch.testing.assert_close(adv, (seq[:, None] + bonus) * mask, rtol=0, atol=0)  # A + bonus: one rounding either way
    assert bonus.abs().sum() > 0


def test_entropy_methods_read_the_entropies_kept_by_the_old_log_prob_wrapper(tiny):
    _, tok = tiny
    data = _batch(tok)
    mask = data.batch["response_mask"].bool()
    ent = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) * 3

    def fake_old_log_prob(self, batch):  # what RayPPOTrainer._compute_old_log_prob returns in verl 0.9.1
        return DataProto.from_dict(tensors={"old_log_probs": torch.zeros(mask.shape), "entropys": ent}), 0.0

    wrapped = verl_estimators._wrap_compute_old_log_prob(fake_old_log_prob)
    wrapped(None, data)
    torch.testing.assert_close(data.batch["oar_entropy"], ent)
    assert getattr(ray_trainer.RayPPOTrainer._compute_old_log_prob, "__oar_wrapped__", False)
    adv = _run(data, "oar_entropy_shaping")
    seq = _run(data, "oar_grpo")[:, 0]
    exp = baselines.entropy_shaping_advantages(seq, ent, mask)
    torch.testing.assert_close(adv, exp, rtol=0, atol=0)  # the same function on the same inputs
    oar_verl.configure(None, oar_verl.HFScorer(tok))  # entropy as importance: no model needed, entropies reused
    try:
        adv = _run(data, "oar_entropy")
    finally:
        oar_verl.configure(None, None)
    assert_within(adv.sum(1), seq * mask.sum(1), mass_bound(seq, mask.sum(1)), "mass")


def test_generic_estimator_takes_the_method_from_the_config(tiny, monkeypatch):
    _, tok = tiny
    data = _batch(tok)
    monkeypatch.setenv("OAR_CONFIG", '{"method": "dr_grpo"}')
    torch.testing.assert_close(_run(data, "oar"), _run(data, "grpo", norm_adv_by_std_in_grpo=False))
    monkeypatch.setenv("OAR_CONFIG", '{"method": "oar_q"}')
    with pytest.raises(ValueError, match="oar.method must be one of"):
        _run(data, "oar")


def test_missing_scores_are_a_clear_error(tiny):
    _, tok = tiny
    with pytest.raises(ValueError, match="needs per-token scores: run verl with the OAR trainer .*attach them"):
        _run(_batch(tok), "oar_g")


def test_tool_outputs_stay_in_the_context_but_are_never_scored(tiny, monkeypatch):
    """Multi-turn rollouts: tool outputs are response tokens (attention mask 1) that carry no loss (response_mask
    0). They stay in the probe context, but are neither perturbed nor scored, and get advantage 0."""
    model, tok = tiny
    data = _batch(tok, shuffle=False)
    b = data.batch
    rmask = b["response_mask"].clone()
    tool = torch.zeros_like(rmask, dtype=torch.bool)
    tool[:, 1:3] = True  # columns 1-2 of every response are tool output
    b["response_mask"] = rmask * ~tool
    from oar.pipeline import Pipeline

    contexts = []
    orig = Pipeline._turn_batch  # tool outputs between model tokens: each turn is a probe row (method.md section 13)

    def spy(self, *a, **k):
        out = orig(self, *a, **k)
        contexts.append(out)
        return out

    monkeypatch.setattr(Pipeline, "_turn_batch", spy)
    oar_verl.configure(None, oar_verl.HFScorer(tok, model))
    try:
        adv = _run(data, "oar_g")
        scores, reasoning = oar_verl.HFScorer(tok, model)(data, oar.OARConfig(method="random"), torch.ones(len(data)))
    finally:
        oar_verl.configure(None, None)
    eligible = b["response_mask"].bool()
    assert (adv[~eligible] == 0).all()
    assert not reasoning[~eligible].any() and (scores[~eligible] == 0).all()
    assert torch.equal(reasoning, eligible)  # no marker: every eligible response token is reasoning
    # the probe context of each session's last turn holds the whole response before its probe, tool outputs
    # included (the policy saw them); turn 1 is column 0 alone
    pb, cols, src = contexts[0]
    for i in range(len(data)):
        resp = b["responses"][i][b["attention_mask"][i, -10:].bool()].tolist()
        first, last = src.index(i), len(src) - 1 - src[::-1].index(i)
        assert last - first == 1 and cols[first].tolist() == [0]
        s0, L, k0 = int(pb.reasoning_start[last]), int(pb.reasoning_len[last]), int(cols[last][0])
        assert k0 == 3 and pb.input_ids[last, s0 - k0: s0 + L].tolist() == resp
    seq = _run(data, "oar_grpo")[:, 0]
    assert_within(adv.sum(1), seq * eligible.sum(1), mass_bound(seq, eligible.sum(1)), "mass")


# ---- bad input ---------------------------------------------------------------------------------------------------

@pytest.fixture()
def configure_reset():
    yield
    oar_verl.configure(None, None)


# (keyword arguments of configure, exception, message regex). A dict/str config used to be stored and fail at the
# first training step with AttributeError.
CONFIGURE_BAD_INPUT = [
    pytest.param(dict(config={"method": "grpo"}), ValueError, r"config must be an oar\.OARConfig or None, got dict",
                 id="config_dict"),
    pytest.param(dict(config='{"method": "grpo"}'), ValueError, r"config must be an oar\.OARConfig or None, got str",
                 id="config_str"),
    pytest.param(dict(scorer=3), ValueError, r"scorer must be callable .* got int", id="scorer_int"),
    pytest.param(dict(ignore_ids=None), ValueError, r"ignore_ids must be a sequence of int token ids, got NoneType",
                 id="ignore_ids_none"),
    pytest.param(dict(ignore_ids=["a"]), ValueError, r"ignore_ids\[i\] must be an int, got str 'a'",
                 id="ignore_ids_str"),
]


@pytest.mark.parametrize("kwargs, exc, match", CONFIGURE_BAD_INPUT)
def test_configure_bad_input(configure_reset, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        oar_verl.configure(**kwargs)


def _verl_data(B=4, R=3):
    return DataProto.from_dict(tensors={"responses": torch.zeros(B, R, dtype=torch.long)})


# (scores, reasoning_mask, exception, message regex) for attach_scores on _verl_data(). These used to be attached
# as-is (NaN/negative failing only at compute_advantage, complex silently cast).
ATTACH_SCORES_BAD_INPUT = [
    pytest.param(torch.full((4, 3), float("nan")), torch.ones(4, 3, dtype=torch.bool), ValueError,
                 r"scores must be finite and >= 0 on reasoning_mask, got scores\[0, 0\] = nan", id="nan"),
    pytest.param(-torch.ones(4, 3), torch.ones(4, 3, dtype=torch.bool), ValueError,
                 r"scores must be finite and >= 0 on reasoning_mask", id="negative"),
    pytest.param(torch.ones(4, 3, dtype=torch.complex64), torch.ones(4, 3, dtype=torch.bool), ValueError,
                 r"scores must be real, got dtype torch.complex64", id="complex"),
    pytest.param(torch.ones(4, 3), torch.full((4, 3), 0.5), ValueError, r"reasoning_mask must be a bool or 0/1 mask",
                 id="mask_fractional"),
    pytest.param(torch.ones(4, 3, device="meta"), torch.ones(4, 3, dtype=torch.bool), ValueError,
                 r"scores must hold data", id="meta"),
]


@pytest.mark.parametrize("scores, mask, exc, match", ATTACH_SCORES_BAD_INPUT)
def test_attach_scores_bad_input(configure_reset, scores, mask, exc, match):
    data = _verl_data()
    with pytest.raises(exc, match=match):
        oar_verl.attach_scores(data, scores, mask)
    assert "oar_scores" not in data.batch.keys()


def test_attach_scores_without_responses_is_a_key_error(configure_reset):
    with pytest.raises(KeyError, match=r"data must be a verl DataProto with batch\['responses'\]"):
        oar_verl.attach_scores(DataProto.from_dict(tensors={"x": torch.zeros(4, 3)}), torch.ones(4, 3),
                               torch.ones(4, 3, dtype=torch.bool))


# (call of the registered "oar_grpo" estimator on token_level_rewards (4, 3) and response_mask (4, 3), exception,
# message regex). A wrong-length index used to raise RuntimeError: shape mismatch from an index_put.
ESTIMATOR_BAD_INPUT = [
    pytest.param(lambda est, t, m: est(t, m, index=np.array(["a", "a", "b"], dtype=object)), ValueError,
                 r"index must hold one group id per row: \(bs,\) = \(4,\), got 3 ids", id="index_short"),
    pytest.param(lambda est, t, m: est(t, m, index=np.array(["a", "a", "b", "b", "c"], dtype=object)), ValueError,
                 r"index must hold one group id per row: \(bs,\) = \(4,\), got 5 ids", id="index_long"),
    pytest.param(lambda est, t, m: est(t[:, 0], m, index=np.array(["a", "a", "b", "b"], dtype=object)), ValueError,
                 r"token_level_rewards must be a \(bs, R\) tensor, got \(4,\)", id="rewards_1d"),
    pytest.param(lambda est, t, m: est(t, m, index=np.array(["a", "a", "b", "b"], dtype=object), epsilon="x"),
                 ValueError, r"epsilon must be a real number, got str 'x'", id="epsilon_str"),
]


@pytest.mark.parametrize("call, exc, match", ESTIMATOR_BAD_INPUT)
def test_estimator_bad_input(configure_reset, call, exc, match):
    oar_verl.register()
    est = core_algos.get_adv_estimator_fn("oar_grpo")
    tlr = torch.zeros(4, 3)
    tlr[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    with pytest.raises(exc, match=match):
        call(est, tlr, torch.ones(4, 3))


def test_hfscorer_missing_ground_truth_is_refused(configure_reset, tiny):
    # A row without reward_model.ground_truth used to be KeyError('ground_truth'), and None was probed as "None".
    # The answers are checked before the model runs.
    model, tok = tiny
    P, ids, mask = completion_batch(tok, ["so 2 and 3 \\boxed{5}", "hmm 9", "5 \\boxed{5}", "4 4 \\boxed{8}"], 20,
                                    eos=False)
    prompts = torch.tensor(P)
    data = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": ids, "response_mask": mask,
                 "attention_mask": torch.cat([torch.ones_like(prompts), mask], 1)},
        non_tensors={"reward_model": np.array([{"ground_truth": "5"}, {"ground_truth": None}, {}, {"ground_truth": "8"}],
                                              dtype=object)})
    scorer = oar_verl.HFScorer(tok, model)
    with pytest.raises(KeyError, match=r"needs the reference answers in non_tensor_batch\['reward_model'\]\[i\]"
                                       r"\['ground_truth'\]; rows \[1, 2\] have none"):
        scorer(data, oar.OARConfig.from_json(json.dumps({"method": "oar_p"})), torch.tensor([1.0, -1.0, 1.0, -1.0]))


# ---- parity with verl's own GRPO (issue 24): with uniform credit, OAR changes nothing in verl's loss --------------

#: verl 0.9.1's loss aggregation modes (core_algos.agg_loss).
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def _multi_turn(data):
    """Tool outputs inside the responses (response_mask 0 at columns 1-2 of rows long enough), as verl's agent loop
    writes them; the attention mask keeps them (the policy saw them)."""
    b = data.batch
    rmask = b["response_mask"].clone()
    long_rows = rmask.sum(1) >= 5
    rmask[long_rows, 1:3] = 0
    b["response_mask"] = rmask
    return data


def _response_log_probs(model, data, layout):
    """log p(response token) (B, R) under ``model`` (with grad; 0 after each response), in verl's two layouts:
    ``padded`` (one row per sequence) or ``remove_padding``: the model output of the packed sequences (total_nnz,
    position t = log p(token t + 1), as verl's remove-padding engines return it) sliced back to (B, R) by verl's own
    ``no_padding_2_padding`` (verl/workers/utils/padding.py)."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import no_padding_2_padding

    b = data.batch
    P = b["prompts"].shape[1]
    B, R = b["responses"].shape
    attn = b["attention_mask"].bool()
    per_seq = []
    for i in range(B):
        ids = torch.cat([b["prompts"][i], b["responses"][i]])[attn[i]]
        logits = model(input_ids=ids[None]).logits[0].float()
        per_seq.append(torch.log_softmax(logits, -1).gather(-1, torch.roll(ids, -1)[:, None])[:, 0])
    if layout == "remove_padding":
        td = TensorDict({"prompts": b["prompts"], "responses": b["responses"], "attention_mask": b["attention_mask"]},
                        batch_size=[B])
        return no_padding_2_padding(torch.cat(per_seq), td)
    out = []
    for i in range(B):
        p_len, r_len = int(attn[i, :P].sum()), int(attn[i, P:].sum())
        lp = per_seq[i][p_len - 1: p_len - 1 + r_len]
        out.append(torch.nn.functional.pad(lp, (0, R - r_len)))
    return torch.stack(out)


def _verl_policy_loss(log_prob, old_log_prob, advantages, response_mask, mode):
    """verl's own vanilla PPO policy loss (core_algos.get_policy_loss_fn('vanilla') -> agg_loss), as its actor
    computes it (verl/workers/utils/losses.py, ppo_loss), with verl's default actor config."""
    from verl.workers.config import FSDPActorConfig

    cfg = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1,
                          loss_agg_mode=mode)
    loss, _ = core_algos.get_policy_loss_fn("vanilla")(old_log_prob=old_log_prob, log_prob=log_prob,
                                                       advantages=advantages, response_mask=response_mask.bool(),
                                                       loss_agg_mode=mode, config=cfg)
    return loss


def _sessions_keys(data):
    """Transfer-queue keys of verl's agent loop ("{uid}_{session}_{output index}") for the rows of ``data``: in every
    uid group of 4, sessions of 1, 1 and 2 outputs (the 2-output session's final output comes first)."""
    keys, count = [], {}
    layout = ((0, 0), (1, 0), (2, 1), (2, 0))  # (session, output index) of a group's k-th row
    for uid in data.non_tensor_batch["uid"]:
        k = count.get(uid, 0)
        count[uid] = k + 1
        keys.append(f"{uid}_{layout[k][0]}_{layout[k][1]}")
    return keys


def _advantage_pairs(data):
    """(oar's, verl's float32, verl's float64) token advantages of ``data`` through verl's two call paths: the legacy
    ``ray_trainer.compute_advantage``, and the v1 trainer's ``compute_advantage_for_multi_trajectories`` with
    multi-output agent sessions (the session keys set as the OAR v1 trainer sets them)."""
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    from oar.integrations.verl import context

    b = data.batch
    out = {"legacy": (_run(data, "oar_grpo"), _run(data, "grpo"),
                      core_algos.compute_grpo_outcome_advantage(b["token_level_rewards"].double(), b["response_mask"],
                                                                data.non_tensor_batch["uid"])[0])}
    keys = _sessions_keys(data)

    def v1(est, dtype=torch.float32):
        d = DataProto.from_dict(tensors={k: v.clone() for k, v in b.items()},
                                non_tensors={k: v.copy() for k, v in data.non_tensor_batch.items()})
        d.batch["token_level_rewards"] = d.batch["token_level_rewards"].to(dtype)
        with context.advantage_call(sessions=keys):
            return compute_advantage_for_multi_trajectories(
                d, batch_keys=keys, adv_estimator=est if est != "grpo" else core_algos.AdvantageEstimator.GRPO,
                norm_adv_by_std_in_grpo=True, config=AlgoConfig()).batch["advantages"]

    out["v1_sessions"] = (v1("oar_grpo"), v1("grpo"), v1("grpo", torch.float64))
    return out


def test_uniform_credit_leaves_the_rest_of_the_batch_unchanged(tiny):
    """OAR on (oar_grpo) vs off (grpo) through verl's compute_advantage: every other field of the batch is the
    same, tensors and non-tensors."""
    _, tok = tiny
    data_on, data_off = _multi_turn(_batch(tok)), _multi_turn(_batch(tok))
    on = ray_trainer.compute_advantage(data_on, adv_estimator="oar_grpo", config=AlgoConfig())
    off = ray_trainer.compute_advantage(data_off, adv_estimator="grpo", config=AlgoConfig())
    assert set(on.batch.keys()) == set(off.batch.keys())
    for k in on.batch.keys():
        if k not in ("advantages", "returns"):
            assert torch.equal(on.batch[k], off.batch[k]), k
    assert set(on.non_tensor_batch) == set(off.non_tensor_batch)
    for k in on.non_tensor_batch:
        assert list(on.non_tensor_batch[k]) == list(off.non_tensor_batch[k]), k


@pytest.mark.parametrize("layout", ["padded", "remove_padding"])
def test_uniform_credit_gives_verls_policy_loss_and_gradients(tiny, layout):
    """Parity in one place: with uniform credit (oar_grpo), the per-token advantages, verl's own vanilla policy loss
    and its gradients w.r.t. every policy parameter equal verl's own GRPO, for each loss_agg_mode of verl 0.9.1,
    with tool outputs masked inside the responses, in both the padded and verl's remove-padding layout of the
    log-probs, through both of verl's advantage paths (legacy, and the v1 trainer's multi-output agent sessions).

    Tolerance: oar's advantages are verl's formula in float64 rounded once to float32 (asserted against verl's
    float64 run); verl's float32 run differs from that by float32 rounding, so the loss and gradients (linear in the
    advantages) agree to float32 rounding of the sums they are (rtol 1e-5, atol 1e-7 x their scale)."""
    from _tolerance import assert_close_to_rounded

    model, tok = tiny
    data = _multi_turn(_batch(tok))
    mask = data.batch["response_mask"]
    assert ((mask[:, :-1] == 0) & (mask[:, 1:] == 1)).any()  # holes inside responses (tool outputs)
    params = [p for p in model.parameters() if p.requires_grad]
    log_prob = _response_log_probs(model, data, layout)
    noise = torch.randn(log_prob.shape, generator=torch.Generator().manual_seed(7)) * 0.3
    old_log_prob = (log_prob.detach() + noise) * mask  # ratios away from 1: some tokens clipped
    pairs = _advantage_pairs(data)
    assert not torch.allclose(pairs["legacy"][1], pairs["v1_sessions"][1], atol=1e-3)  # the sessions matter here
    for path, (ours, ref, ref64) in pairs.items():
        assert (ref != 0).any(), path
        assert_close_to_rounded(ours, ref64, what=f"oar_grpo vs verl ({path})")
        torch.testing.assert_close(ours, ref, rtol=2e-6, atol=2e-7)
        for mode in LOSS_AGG_MODES:
            l_ours = _verl_policy_loss(log_prob, old_log_prob, ours, mask, mode)
            l_ref = _verl_policy_loss(log_prob, old_log_prob, ref, mask, mode)
            g_ours = torch.autograd.grad(l_ours, params, retain_graph=True)
            g_ref = torch.autograd.grad(l_ref, params, retain_graph=True)
            scale = max(float(g.abs().max()) for g in g_ref)
            assert scale > 0, (path, mode)
            torch.testing.assert_close(l_ours, l_ref, rtol=1e-5, atol=1e-7 * max(1.0, abs(float(l_ref.detach()))))
            for g1, g2 in zip(g_ours, g_ref):
                torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7 * scale)
    # the two layouts are the same log-probs (verl's remove-padding slice lands on the response tokens)
    if layout == "remove_padding":
        torch.testing.assert_close(log_prob * mask, _response_log_probs(model, data, "padded") * mask)


def test_rewards_turn_credit_reads_the_agent_loops_tool_rewards(tiny, monkeypatch):
    """turn_credit 'rewards' through verl's compute_advantage: the per-call rewards verl's ToolAgentLoop leaves in
    non_tensor_batch['tool_rewards'] (one per call, the answering turn without one) split each two-turn session's
    mass as docs/method.md section 13 says; one-turn rows and rows with no reward keep GRPO's per-token mass."""
    model, tok = tiny
    data = _multi_turn(_batch(tok, shuffle=False))
    B = len(data)
    elig = data.batch["response_mask"].bool()
    two = [i for i in range(B) if bool(elig[i, 0]) and not bool(elig[i, 1]) and bool(elig[i, 3:].any())]
    assert two and len(two) < B
    tool_rewards = np.empty(B, dtype=object)
    tool_rewards[:] = [[0.5 if i % 2 else -0.2] if i in two[:-1] else [] for i in range(B)]
    data.non_tensor_batch["tool_rewards"] = tool_rewards
    monkeypatch.setenv("OAR_CONFIG", '{"method": "random", "turn_credit": "rewards"}')
    oar_verl.configure(None, oar_verl.HFScorer(tok, model))
    try:
        adv = _run(data, "oar")
    finally:
        oar_verl.configure(None, None)
    seq = _run(data, "oar_grpo")[:, 0]
    floor = oar.OARConfig().reshape.floor
    checked = 0
    for i in range(B):
        A, n = float(seq[i]), int(elig[i].sum())
        assert float(adv[i].double().sum()) == pytest.approx(A * n, rel=1e-5, abs=1e-6)
        if i in two[:-1] and A != 0:  # turn 1 is column 0 alone, turn 2 the rest
            r = 0.5 if i % 2 else -0.2
            u = [1 + (1 if A > 0 else -1) * r / abs(r), 1.0]
            cnt = [1, n - 1]
            u_bar = (u[0] * cnt[0] + u[1] * cnt[1]) / n
            w0 = floor + (1 - floor) * u[0] / u_bar
            assert float(adv[i, 0]) == pytest.approx(A * w0, rel=1e-5)  # a one-token turn keeps its weighted mass
            checked += 1
    assert checked
    data.non_tensor_batch.pop("tool_rewards")
    oar_verl.configure(None, oar_verl.HFScorer(tok, model))
    try:
        with pytest.raises(ValueError, match=r"turn_credit 'rewards' needs the batch's per-turn rewards"):
            _run(data, "oar")
    finally:
        oar_verl.configure(None, None)
