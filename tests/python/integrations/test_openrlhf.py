"""oar's OpenRLHF patch against the REAL openrlhf 0.11.2 ``RemoteExperienceMaker.compute_advantages_and_returns``
(run in a subprocess, tests/python/workers/openrlhf_worker.py, because its module imports GPU-only packages that
get stand-ins there), plus the launcher's Ray runtime-env injection.

Skipped when openrlhf is not installed.
"""

import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("ray")
if importlib.util.find_spec("openrlhf") is None:
    pytest.skip("openrlhf not installed (pip install --no-deps openrlhf==0.11.2)", allow_module_level=True)

from oar import baselines, ops  # noqa: E402
from _completions import token_rollouts  # noqa: E402
from _error_model import pipeline_scores_estimate  # noqa: E402
from _paths import WORKERS  # noqa: E402
from _tiny import OPENRLHF_TINY  # noqa: E402
from _tolerance import assert_close_to_rounded, assert_within, assert_within_error_model, gamma, mass_bound, ulp  # noqa: E402

WORKER = str(WORKERS / "openrlhf_worker.py")
sys.path.insert(0, str(WORKERS))  # LOSS_VARIANTS is imported from the worker
N = 4


@pytest.fixture(autouse=True)
def _one_thread():
    """The workers run at OMP_NUM_THREADS=1; the references computed here do too, so that the bit-exact comparisons
    compare the same arithmetic (a float32 matmul's reduction order depends on the thread count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    out = tmp_path_factory.mktemp("orl") / "res.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, WORKER, str(out)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _prompt_order(res, per_exp):
    """Concatenate per-experience (N, A_e) tensors into prompt order (2N, A_max)."""
    A = max(t.shape[1] for t in per_exp)
    rows = torch.cat([torch.nn.functional.pad(t, (0, A - t.shape[1])) for t in per_exp])
    pos = torch.tensor([p for x in res["inputs"] for p in x["index"]])
    return rows[torch.argsort(pos)]


def _inputs(res):
    mask = _prompt_order(res, [x["action_mask"] for x in res["inputs"]]).bool()
    ids = _prompt_order(res, [x["sequences"][:, -x["action_mask"].shape[1]:] for x in res["inputs"]])
    rewards = torch.cat([x["rewards"] for x in res["inputs"]])[torch.argsort(
        torch.tensor([p for x in res["inputs"] for p in x["index"]]))]
    return ids, mask, rewards


def test_patches_the_supported_signature(res):
    assert res["signature"] == ["self", "experiences"]


def test_grpo_is_openrlhf_unchanged(res):
    # method grpo / dr_grpo keeps OpenRLHF's own advantages: the per-response value times the mask, exactly
    for method, est in (("grpo", "group_norm"), ("dr_grpo", "dr_grpo")):
        for ours, theirs in zip(res[method], res[f"original/{est}"]):
            torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    for ours, theirs in zip(res["hook_grpo"], res["original/group_norm"]):
        torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    assert res["restored"] and res["hook_installed"]


def test_openrlhf_sequence_advantages_are_group_norm(res):
    ids, mask, rewards = _inputs(res)
    seq = _prompt_order(res, res["original/group_norm"])[:, 0]  # OpenRLHF's float32 group_norm: the yardstick
    r = rewards.double().view(-1, N)  # its formula in float64: (r - mean) / (std + 1e-9), unbiased std
    ref64 = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-9)).flatten()
    # rule 1: the op accumulates in float64 and rounds once: OpenRLHF's formula in float64, rounded
    assert_close_to_rounded(ops.group_advantages(rewards, group_size=N, preset="openrlhf"), ref64,
                            what="oar openrlhf preset vs OpenRLHF")
    assert seq.shape == ref64.shape


@pytest.mark.parametrize("method", ["oar_p", "oar_g", "random", "entropy"])
def test_reshaping_methods_keep_mass(res, method):
    ids, mask, rewards = _inputs(res)
    seq = _prompt_order(res, res["original/group_norm"])[:, 0]
    tok = _prompt_order(res, res[method])
    L = mask.sum(1)  # + the adapter's read of A as the float32 mean of the response's equal values
    assert_within(tok.sum(1), seq * L, mass_bound(seq, L) + gamma(int(L.max()) + 1) * seq.abs().double() * L, "mass")
    assert (tok[~mask] == 0).all()
    assert not torch.allclose(tok, seq[:, None] * mask, atol=1e-4)


def test_additive_baselines(res):
    ids, mask, rewards = _inputs(res)
    seq = _prompt_order(res, res["original/group_norm"])[:, 0]
    bonus = baselines.ktae_token_scores(ids, mask, rewards, group_size=N, ignore_ids=sorted({res["eos"], res["pad"]}))
    # the adapter reads A as the float32 mean of the response's (equal) values: within gamma_L |A| of seq
    L = mask.sum(1, keepdim=True)
    want = (seq[:, None] + bonus) * mask
    bound = (gamma(int(L.max()) + 1) * seq.abs()[:, None] + ulp(want)) * mask
    assert_within(_prompt_order(res, res["ktae"]), want, bound, "ktae advantages")
    es = _prompt_order(res, res["entropy_shaping"])
    b = (es - seq[:, None]) * mask
    slack = ulp(es).float() + gamma(int(L.max()) + 1) * seq.abs()[:, None]  # A + bonus rounded once; A read as a mean
    assert (b >= -slack).all() and (b <= seq.abs()[:, None] / 2 + slack).all() and b.abs().sum() > 0


def test_refusals_are_clear(res):
    e = res["errors"]
    assert "--algo.kl.use_loss" in e["kl_in_reward"]
    assert "estimator must be one of" in e["gae"] and "'gae'" in e["gae"]
    assert "dr_grpo" in e["dr_grpo_needs_estimator"]
    assert "model=" in e["no_model"]


def test_launcher_injects_the_worker_setup_hook():
    from oar.integrations.openrlhf import _patched_ray_init

    seen = {}
    fake = types.SimpleNamespace(init=lambda *a, **k: seen.update(k))
    fake.init = _patched_ray_init(fake, '{"method": "ktae"}')
    fake.init(runtime_env={"env_vars": {"A": "1"}})
    env = seen["runtime_env"]
    assert env["worker_process_setup_hook"] == "oar.integrations.openrlhf.worker_setup_hook"
    assert env["env_vars"] == {"A": "1", "OAR_CONFIG": '{"method": "ktae"}'}
    fake2 = types.SimpleNamespace(init=lambda *a, **k: None)
    fake2.init = _patched_ray_init(fake2, "{}")
    with pytest.raises(RuntimeError, match="worker_process_setup_hook"):
        fake2.init(runtime_env={"worker_process_setup_hook": "other.hook"})


@pytest.mark.parametrize("method", ["oar_p", "oar_g"])
def test_real_experience_layout_keeps_the_question(res, method):
    """Experiences made by OpenRLHF 0.11's own code (right-padded full sequences, action mask over the whole
    sequence, multi-turn observations between responses): the patch attributes each response with its question
    as the probe context and the observations as unscored context, exactly as the pipeline does on the token lists
    the rollouts were made from; the advantages land on the action-mask columns of their tokens."""
    from oar.testing import tiny_random_llama
    from oar.pipeline import Pipeline

    import oar

    real = res["real"]
    truth = real["truth"]
    B = len(truth)
    model, tok = tiny_random_llama(**OPENRLHF_TINY)
    r = torch.tensor([1, 0, 0, 1, 0.5, 0, 1, 0], dtype=torch.float32).reshape(-1, N)
    seq = ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)).reshape(-1)  # OpenRLHF's group_norm
    batch = token_rollouts(tok, truth, seq, N)
    elig = batch.eligible_mask
    want = Pipeline(oar.OARConfig.from_json(f'{{"method": "{method}", "seed": 2}}'), tok).compute(batch, model)
    assert want.scores.abs().max() > 0 and (want.advantages[~elig] == 0).all()
    got_rows = {}
    for e_adv, amask, index in zip(real[method], real["action_mask"], real["index"]):
        assert e_adv.shape == amask.shape  # OpenRLHF's (B, T - 1) layout
        for b, i in enumerate(index):
            got_rows[i] = (e_adv[b], amask[b].bool())
    assert sorted(got_rows) == list(range(B))
    for i, t in enumerate(truth):
        adv, amask = got_rows[i]
        col = len(t["prompt"]) - 1  # action-mask column of the first response token (token j <-> column j - 1)
        L = len(t["completion"])
        assert amask[col: col + L].tolist() == [bool(x) for x in t["eligible"]], i  # the layout is as described
        torch.testing.assert_close(adv[col: col + L], want.advantages[i, :L], rtol=0, atol=0)
        assert (adv[:col] == 0).all() and (adv[col + L:] == 0).all()


@pytest.fixture(scope="module")
def actors(tmp_path_factory):
    out = tmp_path_factory.mktemp("orl_actor")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, WORKER, "actor", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return [torch.load(out / f"actor{k}.pt", weights_only=False) for k in range(2)]


@pytest.mark.parametrize("method", ["oar_p", "oar_g"])
def test_actor_method_scores_on_the_policy_actors(actors, method):
    """The ``oar_scores`` actor method, called by OpenRLHF's own ``BaseModelActor.execute_batch`` on two actors
    (gloo) under ``torch.no_grad`` (as in make_experience), one actor with four rows to score and one with none:
    both run the same number of policy forwards, OAR-G gets its gradients, no parameter ``.grad`` is written, the
    actor is back in training mode, and the scores are the single-process pipeline's (rule 1 of _tolerance.py
    against the float64 policy: the gate only adds dummy calls)."""
    import oar
    from oar.testing import tiny_random_llama
    from oar.pipeline import Pipeline

    r = [actors[0][method], actors[1][method]]
    assert r[0]["forwards"] == r[1]["forwards"] > 0
    assert int((r[0]["batch"].sequence_advantages != 0).sum()) == 4
    assert int((r[1]["batch"].sequence_advantages != 0).sum()) == 0
    model, tok = tiny_random_llama(**OPENRLHF_TINY)
    for k in range(2):
        assert r[k]["training"] and all(r[k]["grads"])
        cfg = oar.OARConfig.from_json(r[k]["config"])
        alone = Pipeline(cfg, tok).scores(r[k]["batch"], model)
        assert torch.equal(r[k]["reasoning_mask"], alone.reasoning_mask)
        if k == 1:
            assert not r[k]["reasoning_mask"].any() and (r[k]["scores"] == 0).all()
        exact = pipeline_scores_estimate(cfg, tok, r[k]["batch"], model)  # rule 1: float32 error estimate
        assert_within_error_model(r[k]["scores"], exact, what=f"{method} actor {k}")
        assert_within_error_model(alone.scores, exact, what=f"{method} alone {k}")


def test_experience_maker_folds_actor_group_scores(res):
    """Without a model in its process, the experience maker sends one contiguous chunk of the prompt-ordered
    rows to each data-parallel policy actor (method ``oar_scores``), and its advantages are the pipeline's on the
    whole batch with the scores the actors returned, at the experiences' action-mask columns."""
    import oar
    from oar.testing import tiny_random_llama
    from oar.batch import RolloutBatch
    from oar.pipeline import Pipeline

    remote, real = res["remote"], res["real"]
    truth = real["truth"]
    B = len(truth)
    (name, chunks), = remote["calls"]  # one dispatch per step
    assert name == "oar_scores" and [c.batch_size for c in chunks] == [B // 2, B // 2]
    model, tok = tiny_random_llama(**OPENRLHF_TINY)
    pipe = Pipeline(oar.OARConfig.from_json('{"method": "oar_p", "seed": 2}'), tok)
    parts = [pipe.scores(c, model) for c in chunks]
    whole = RolloutBatch(**{k: (None if getattr(chunks[0], k) is None else
                                (torch.cat([getattr(c, k) for c in chunks]) if isinstance(getattr(chunks[0], k),
                                                                                           torch.Tensor)
                                 else list(getattr(chunks[0], k)) + list(getattr(chunks[1], k))))
                            for k in RolloutBatch.__dataclass_fields__})
    for i, t in enumerate(truth):  # chunk rows are the rollouts in prompt order
        assert whole.prompt_ids[i].tolist() == t["prompt"]
    whole.scores = torch.cat([p.scores for p in parts])
    whole.reasoning_mask = torch.cat([p.reasoning_mask for p in parts])
    assert whole.scores.abs().max() > 0
    want = Pipeline(oar.OARConfig.from_json('{"method": "oar_p", "seed": 2}'), tok).compute(whole).advantages
    got = {}
    for e_adv, index in zip(remote["advantages"], real["index"]):
        for b, i in enumerate(index):
            got[i] = e_adv[b]
    for i, t in enumerate(truth):
        col, L = len(t["prompt"]) - 1, len(t["completion"])
        torch.testing.assert_close(got[i][col: col + L], want[i, :L], rtol=0, atol=0)


def test_actor_budget_cap_from_openrlhf_token_budget():
    """The actor caps OAR's chunk budget by OpenRLHF's own forward budget: --rollout.max_tokens_per_gpu tokens under
    --train.dynamic_batch_enable, else --rollout.micro_batch_size sequences of the chunk's longest context; None
    without those arguments."""
    from types import SimpleNamespace as NS

    from oar.attribution import as_probe_model
    from oar.integrations import openrlhf as oar_orl
    from oar.testing import tiny_random_llama
    from oar.batch import RolloutBatch

    model, _ = tiny_random_llama(**OPENRLHF_TINY)
    pm = as_probe_model(model)
    batch = RolloutBatch(torch.zeros((2, 7), dtype=torch.long), torch.ones((2, 7), dtype=torch.bool),
                         prompt_ids=[[5, 6, 7], [5, 6, 7, 8, 9]])
    per = lambda w: pm.activation_bytes_per_token(w) + 4 * pm.vocab_size  # noqa: E731
    dyn = NS(rollout=NS(max_tokens_per_gpu=2**22, micro_batch_size=4), train=NS(dynamic_batch_enable=True))
    assert oar_orl._token_budget_cap(dyn, model, batch) == 2**22 * per(12) // 2**20
    fixed = NS(rollout=NS(max_tokens_per_gpu=2**22, micro_batch_size=4), train=NS(dynamic_batch_enable=False))
    assert oar_orl._token_budget_cap(fixed, model, batch) == max(1, 4 * 12 * per(12) // 2**20)
    assert oar_orl._token_budget_cap(None, model, batch) is None
    assert oar_orl._token_budget_cap(NS(rollout=NS(micro_batch_size=None), train=NS()), model, batch) is None


@pytest.fixture(scope="module")
def ray_actors(tmp_path_factory):
    out = tmp_path_factory.mktemp("orl_ray")
    from _subproc import child_env

    env = child_env()  # the child and its Ray workers import the same oar as this process
    p = subprocess.run([sys.executable, WORKER, "ray", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return torch.load(out / "ray.pt", weights_only=False)


@pytest.mark.parametrize("method", ["oar_p", "oar_g"])
def test_actor_group_on_ray_actors(ray_actors, method):
    """OpenRLHF's own ``RayActorGroup`` of two Ray CPU actors (gloo), ``oar_scores`` attached by oar's Ray worker
    setup hook, reached by the experience maker's call (``async_run_method_batch``): only the 4 rows with an
    advantage are sent, 2 to each actor; both actors ran the same number of policy forwards, wrote no parameter
    grad, stay in training mode, and each chunk's scores are the single-process pipeline's at the chunk's batch rows
    (rule 1 of _tolerance.py against the float64 policy)."""
    import oar
    from oar.integrations._worker_scoring import split_rows
    from oar.pipeline import Pipeline
    from oar.testing import tiny_random_llama

    r = ray_actors[method]
    actors = r["actors"]
    assert all(a["has_method"] and a["training"] and a["no_grads"] for a in actors)
    assert actors[0]["forwards"] == actors[1]["forwards"] > 0
    model, tok = tiny_random_llama(**OPENRLHF_TINY)
    cfg = oar.OARConfig.from_json(r["config"])
    B = r["batch"].batch_size
    split = split_rows(r["batch"].sequence_advantages, 2, only_scored=True)
    assert split.rows == list(range(B // 2)) and [c.batch_size for c in r["chunks"]] == [B // 4, B // 4]
    for k, chunk in enumerate(r["chunks"]):
        rows = split.rows[split.bounds[k]: split.bounds[k + 1]]
        assert torch.equal(chunk.completion_ids, r["batch"].completion_ids[rows])
        alone = Pipeline(cfg, tok).scores(chunk, model)
        exact = pipeline_scores_estimate(cfg, tok, chunk, model)  # rule 1: float32 error estimate
        assert torch.equal(r["reasoning_mask"][rows], alone.reasoning_mask)
        assert_within_error_model(r["scores"][rows], exact, what=f"{method} rows {rows}")
        assert_within_error_model(alone.scores, exact, what=f"{method} alone, rows {rows}")
    assert r["reasoning_mask"][: B // 2].any() and not r["reasoning_mask"][B // 2:].any()
    assert (r["scores"][B // 2:] == 0).all()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("orl_launch") / "launch.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, WORKER, "launch", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return torch.load(out, weights_only=False)


def test_launcher_refuses_at_start(launched):
    """``python -m oar.integrations.openrlhf`` on real train_ppo_ray arguments (OpenRLHF's parser and fix-ups):
    what oar cannot serve is refused when ``train(args)`` builds its strategy, before any vLLM engine or actor
    exists (the stand-in ``get_strategy`` that raises REACHED is never called), naming the argument, its value
    and what to set; valid arguments, and ring attention with a method that runs no model, go through."""
    assert launched["ok"][0] == "Reached" and "ring_attn_size 1" in launched["ok"][1]
    assert launched["ring_attention_model_free"][0] == "Reached"
    want = {"ring_attention": ["--ds.ring_attn_size 2", "--ds.ring_attn_size 1", "ring attention"],
            "images": ["--data.max_images_per_prompt is 1", "--data.max_images_per_prompt 0"],
            "kl_in_reward": ["--algo.kl.use_loss", "--algo.kl.init_coef 0.01"],
            "estimator": ["--algo.advantage.estimator", "'reinforce'", "'group_norm'"],
            "no_labels": ["--data.label_key", "None"]}
    for case, parts in want.items():
        kind, msg = launched[case]
        assert kind == "ValueError", (case, kind, msg)
        for part in parts:
            assert part in msg, (case, part, msg)


def test_ring_attention_refused_in_process_before_any_forward(res):
    """In-process use (no launcher): the patched method refuses ring attention before the policy runs."""
    assert "--ds.ring_attn_size 2" in res["errors"]["ring_in_process"]
    assert res["ring_in_process_forwards"] == 0


def _by_prompt(truth):
    return {tuple(t["prompt"]): i for i, t in enumerate(truth)}


def test_only_rows_with_an_advantage_reach_the_actors(res):
    """With group 1's rewards equal (OpenRLHF's advantages 0 on its rows), only group 0's rows are sent to the
    policy actors, in equal chunks (2 + 2), each once; the folded advantages are the pipeline's on the whole batch
    with those scores, and 0 on group 1's rows."""
    import oar
    from oar.testing import tiny_random_llama
    from oar.pipeline import Pipeline

    remote, real = res["remote_zero"], res["real"]
    truth = real["truth"]
    row_of = _by_prompt(truth)
    (name, chunks), = remote["calls"]
    assert name == "oar_scores" and [c.batch_size for c in chunks] == [2, 2]
    sent = [row_of[tuple(int(x) for x in p)] for c in chunks for p in c.prompt_ids]
    assert sorted(sent) == list(range(N))  # group 0's rows, each once; none of group 1
    assert all(bool((c.sequence_advantages != 0).all()) for c in chunks)
    model, tok = tiny_random_llama(**OPENRLHF_TINY)
    pipe = Pipeline(oar.OARConfig.from_json('{"method": "oar_p", "seed": 2}'), tok)
    got = {}
    for e_adv, index in zip(remote["advantages"], real["index"]):
        for b, i in enumerate(index):
            got[i] = e_adv[b]
    parts = [pipe.scores(c, model) for c in chunks]
    r = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1], dtype=torch.float32).reshape(-1, N)
    seq = ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)).reshape(-1)  # OpenRLHF's group_norm
    batch = token_rollouts(tok, truth, seq, N)  # the whole batch in prompt order
    batch.scores = torch.zeros(batch.completion_ids.shape)
    batch.reasoning_mask = torch.zeros(batch.completion_ids.shape, dtype=torch.bool)
    for c, part in zip(chunks, parts):
        for b, p in enumerate(c.prompt_ids):
            i = row_of[tuple(int(x) for x in p)]
            torch.testing.assert_close(c.completion_ids[b], batch.completion_ids[i], rtol=0, atol=0)
            batch.scores[i], batch.reasoning_mask[i] = part.scores[b], part.reasoning_mask[b]
    assert batch.scores.abs().max() > 0
    want = Pipeline(oar.OARConfig.from_json('{"method": "oar_p", "seed": 2}'), tok).compute(batch).advantages
    for i, t in enumerate(truth):
        col, L = len(t["prompt"]) - 1, len(t["completion"])
        torch.testing.assert_close(got[i][col: col + L], want[i, :L], rtol=0, atol=0)
        assert (got[i][col: col + L] != 0).any() if i < N else (got[i] == 0).all()


def test_no_actor_call_when_no_row_has_an_advantage(res):
    r = res["remote_nothing"]
    assert r["calls"] == [] and r["events"] == []
    assert all((a == 0).all() for a in r["advantages"])


@pytest.mark.parametrize("case, cleared", [("remote_zero", False), ("remote", False), ("remote_colocate_all", True),
                                           ("remote_colocate_actor_ref", True)])
def test_empty_cache_after_scoring_when_colocated(res, case, cleared):
    """Under --train.colocate_all (or --train.colocate_actor_ref), the condition under which OpenRLHF empties the
    policy actors' CUDA cache after their own forwards (experience_maker.py, _dispatch_forward), the actors'
    ``empty_cache`` runs once, after ``oar_scores``; otherwise never."""
    events = res[case]["events"]
    want = [("batch", "oar_scores")] + ([("all", "empty_cache")] if cleared else [])
    assert events == want


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("layout", ["padded", "real"])
@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo"])
def test_uniform_credit_is_openrlhf_grpo(res, estimator, layout):
    """Parity: oar_p with uniform credit (the actor group gives every token the same score) leaves OpenRLHF's
    experiences as OpenRLHF's own advantage step makes them: every field but the advantages bit for bit
    (returns, masks, log-probs, info), the advantages bit for bit on the action mask. Off the mask oar writes 0
    where OpenRLHF's cumulative returns carry the value back over the prompt columns (its 0.11 layout, "real");
    ``PolicyLoss`` masks both out. So OpenRLHF's own ``PolicyLoss`` on the tiny policy's log-probs
    (``Actor.forward``) and its gradients are unchanged, bit for bit, for every loss option of openrlhf 0.11.2
    (token / sequence mean, dual clip, clip higher, GSPO, the train/rollout correction levels, modes and gatings,
    the dp-global normalizations), on hand-made left-padded experiences ("padded") and on experiences made by
    OpenRLHF's own SamplesGenerator, multi-turn rows included ("real")."""
    from openrlhf_worker import LOSS_VARIANTS

    r = res["parity"][layout][estimator]
    assert [b.batch_size for b in r["received"]] == [N, N]  # every row has an advantage here: all were scored
    for field, (off, on) in r["fields"].items():
        if field != "advantages":
            assert _equal(off, on), field
    masks = r["fields"]["action_mask"][0]
    for a_off, a_on, m in zip(*r["fields"]["advantages"], masks):
        m = m.bool()
        assert a_off.dtype == a_on.dtype == torch.float32 and a_off.shape == a_on.shape
        assert torch.equal(a_off[m], a_on[m]) and (a_on[~m] == 0).all()
        assert a_off[m].abs().max() > 0
    assert set(r["losses"]) == set(LOSS_VARIANTS)
    for name, per in r["losses"].items():
        assert torch.equal(per["on"]["loss"], per["off"]["loss"]), name
        assert torch.equal(per["on"]["grad"], per["off"]["grad"]), name
        assert per["off"]["grad"].abs().max() > 0 and per["on"]["clip_ratio"] == per["off"]["clip_ratio"], name
    losses = {name: float(per["off"]["loss"].sum()) for name, per in r["losses"].items()}
    assert len({round(v, 7) for v in losses.values()}) >= 6  # the options do differ on these log-probs


def test_openrlhf_advantages_off_the_mask_are_carried_returns(res):
    """What the parity test allows for, seen: on OpenRLHF 0.11's own layout its advantages are non-zero on prompt
    columns (outside the action mask), where oar's are 0."""
    off, on = res["parity"]["real"]["group_norm"]["fields"]["advantages"]
    masks = res["parity"]["real"]["group_norm"]["fields"]["action_mask"][0]
    assert any(bool(a[~m.bool()].any()) for a, m in zip(off, masks))
    assert not any(bool(a[~m.bool()].any()) for a, m in zip(on, masks))


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed (pip install deepspeed hjson py-cpuinfo einops; runs with "
                    "DS_ACCELERATOR=cpu)")
    out = tmp_path_factory.mktemp("orl_zero3")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    p = subprocess.run([sys.executable, WORKER, "zero3", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return [torch.load(out / f"zero3_{k}.pt", weights_only=False) for k in range(2)]


@pytest.mark.parametrize("method", ["oar_p", "oar_g"])
def test_actor_method_on_deepspeed_zero3(zero3, method):
    """``oar_scores`` on two policy actors whose policy is a real DeepSpeed ZeRO-3 engine built as OpenRLHF builds
    it (CPU accelerator, gloo; each rank holds only its parameter partition), called by OpenRLHF's own
    ``BaseModelActor.execute_batch`` under ``no_grad``, rank 0 with 4 rows to score and rank 1 with none: both ran
    the same number of forwards (every ZeRO-3 forward gathers from both ranks), the actors stay in training mode,
    and the scores are the single-process pipeline's on the unwrapped tiny model (rule 1 of _tolerance.py)."""
    import oar
    from oar.testing import tiny_random_llama
    from oar.pipeline import Pipeline

    assert all(z["partitioned"] and z["local_numel"] < z["numel"] for z in zero3)
    r = [zero3[0][method], zero3[1][method]]
    assert r[0]["forwards"] == r[1]["forwards"] > 0
    assert int((r[0]["batch"].sequence_advantages != 0).sum()) == 4
    assert int((r[1]["batch"].sequence_advantages != 0).sum()) == 0
    model, tok = tiny_random_llama(**OPENRLHF_TINY)
    for k in range(2):
        assert r[k]["training"]
        cfg = oar.OARConfig.from_json(r[k]["config"])
        alone = Pipeline(cfg, tok).scores(r[k]["batch"], model)
        assert torch.equal(r[k]["reasoning_mask"], alone.reasoning_mask)
        if k == 1:
            assert not r[k]["reasoning_mask"].any() and (r[k]["scores"] == 0).all()
        else:
            assert r[k]["scores"].abs().max() > 0
        exact = pipeline_scores_estimate(cfg, tok, r[k]["batch"], model)  # rule 1: float32 error estimate
        assert_within_error_model(r[k]["scores"], exact, what=f"{method} ZeRO-3 rank {k}")
