"""OAR scores on verl's actor workers (oar.integrations.verl.workers) against the REAL verl 0.9.1.

The worker-group checks run verl's own ``ActorRolloutRefWorker`` (FSDP2 engine, 2 gloo ranks on Ray CPU workers,
test scaffold ``_verl_cpu.py``) in a subprocess (``verl_worker.py``); the rest runs in this process. Skipped when
verl or its v1 trainer's transfer queue package is not installed.
"""

import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("verl", reason="verl not installed (pip install -r requirements/trainers.txt)")
pytest.importorskip("transfer_queue", reason="TransferQueue not installed (requirements/trainers-nodeps.txt)")

import oar  # noqa: E402
from oar.integrations import verl as oar_verl  # noqa: E402

oar_verl.register()
from oar.integrations.verl import context, dispatch  # noqa: E402
from oar.integrations.verl import workers as verl_workers  # noqa: E402
from oar.integrations.verl import checks as verl_checks  # noqa: E402
from oar.testing import tiny_random_llama  # noqa: E402
from oar.batch import RolloutBatch
from oar.pipeline import Pipeline

from _error_model import pipeline_scores_estimate  # noqa: E402
from _paths import WORKERS  # noqa: E402
from _tolerance import assert_within_error_model  # noqa: E402

sys.path.insert(0, str(WORKERS))  # verl_worker's rollouts and data_proto are imported too


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl")
    from _subproc import child_env

    env = child_env()  # the child and its Ray workers import the same oar as this process
    p = subprocess.run([sys.executable, str(WORKERS / "verl_worker.py"), str(out)], capture_output=True,
                       text=True, timeout=1200, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return torch.load(out / "verl.pt", weights_only=False)


@pytest.fixture(scope="module")
def tiny():
    import _verl_cpu

    return tiny_random_llama(**_verl_cpu.TINY)


def _rows(run, tok):
    import verl_worker

    return oar_verl.rollout_rows(verl_worker.data_proto(run["rows"]), oar.OARConfig(method="oar_g"))


def test_scaffold_runs_verls_own_log_probs(run, tiny):
    """verl's compute_log_prob on the 2 FSDP2 ranks equals a float32 HF forward of the same model (the scaffold runs
    verl's engine faithfully: the scores below are the policy's)."""
    model, _ = tiny
    rows = run["rows"]
    lp = run["log_probs"]
    for i, r in enumerate(rows):
        ids = torch.cat([r["prompt"], r["response"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0].double(), -1)
        q = len(r["response"])
        want = logp[len(r["prompt"]) - 1: len(ids) - 1].gather(1, r["response"][:, None])[:, 0]
        # float32 forward of depth 1 over <= 14 tokens: rounding ~1e-6 of |logp| ~ 5
        torch.testing.assert_close(lp[i, :q].double(), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("method", ["oar_g", "oar_p"])
def test_worker_scores_equal_the_single_process_pipeline(run, tiny, method):
    """``oar_scores`` through verl's dispatch: the rows with a non-zero advantage go out in one contiguous chunk per
    rank (rank 0: two rows, rank 1: one row and a padding row), each rank's scores equal the single-process
    pipeline on its chunk (rule 1 of _tolerance.py against the float64 policy), both ranks ran the same number of
    policy forwards, no parameter .grad was written, and inactive rows come back 0 / False."""
    import json

    import _verl_cpu

    model, tok = tiny
    r = run["scores"][method]
    cfg = oar.OARConfig.from_json(r["config"])
    # the workers cap the config's activation budget by verl's own old-log-prob budget: micro-batches of
    # log_prob_micro_batch_size_per_gpu sequences of the request's width (_verl_cpu.actor_config)
    req, _ = dispatch.scores_request(_rows(run, tok), cfg, r["seq"], 2)
    width = req["oar_prompt_ids"].shape[1] + req["oar_responses"].shape[1]  # what the workers were sent
    from oar.attribution import as_probe_model

    pm = as_probe_model(model)
    micro = int(_verl_cpu.actor_config("unused").rollout.log_prob_micro_batch_size_per_gpu)
    derived = max(1, micro * width * (pm.activation_bytes_per_token(width) + 4 * pm.vocab_size) // 2**20)
    assert r["memory_budget_mb"] == min(cfg.memory_budget_mb, derived)
    cfg = oar.OARConfig.from_json(json.dumps(dict(json.loads(r["config"]), memory_budget_mb=r["memory_budget_mb"])))
    rows = _rows(run, tok)
    req, active = dispatch.scores_request(rows, cfg, r["seq"], 2)
    assert req.batch_size[0] == 4 and len(active) == 3
    ranks = r["ranks"]
    assert ranks[0]["forwards"] == ranks[1]["forwards"] > 0
    assert all(x["no_grads"] for x in ranks) and all(x["fsdp2"].startswith("FSDP") for x in ranks)
    got = torch.zeros((4,) + tuple(rows["responses"].shape[1:]))
    got[:3] = r["scores"][active]
    for k in range(2):
        chunk = req[2 * k: 2 * k + 2]
        batch = dispatch.request_batch(chunk)
        alone = Pipeline(cfg, tok).scores(batch, model)
        exact = pipeline_scores_estimate(cfg, tok, batch, model)  # rule 1: float64 scores, float32 error estimate
        n = 2 if k == 0 else 1
        assert torch.equal(r["reasoning_mask"][active[2 * k: 2 * k + n]], alone.reasoning_mask[:n])
        assert alone.reasoning_mask[:n].any()
        assert_within_error_model(got[2 * k: 2 * k + n], exact[:n], what=f"{method} rank {k}")
        assert_within_error_model(alone.scores[:n], exact[:n], what=f"{method} alone {k}")
    inactive = [i for i in range(len(r["seq"])) if i not in active]
    assert not r["reasoning_mask"][inactive].any() and (r["scores"][inactive] == 0).all()


def _expected(rows, seq, scores, mask, cfg):
    batch = RolloutBatch(rows["responses"], rows["completion_mask"], eligible_mask=rows["eligible_mask"],
                         sequence_advantages=seq.float(), scores=scores, reasoning_mask=mask)
    return Pipeline(cfg).compute(batch).advantages


def test_legacy_trainer_folds_worker_scores(run, tiny):
    """Legacy trainer: ray_trainer.compute_advantage with an OAR estimator sends the rows with a non-zero verl GRPO
    advantage to the workers and folds the returned scores into the token advantages: exactly the pipeline's
    reshaping of those scores; each row keeps its mass (tool-output tokens get 0)."""
    _, tok = tiny
    leg = run["legacy"]
    rows = _rows(run, tok)
    cfg = oar.OARConfig.from_json(run["scores"]["oar_g"]["config"])
    assert int((leg["seq"] != 0).sum()) == 4 and leg["reasoning_mask"].any()
    want = _expected(rows, leg["seq"], leg["scores"], leg["reasoning_mask"], cfg)
    torch.testing.assert_close(leg["advantages"], want, rtol=0, atol=0)
    mass = leg["advantages"].double().sum(1)
    torch.testing.assert_close(mass, leg["seq"].double() * rows["eligible_mask"].sum(1).double(), rtol=1e-5,
                               atol=1e-5)
    assert (leg["advantages"][~rows["eligible_mask"]] == 0).all()


def test_v1_trainer_folds_worker_scores(run, tiny):
    """verl's v1 ``_compute_advantage`` of the registered ``oar_sync`` trainer (transfer queue stood in for):
    the rollouts read from the queue's nested per-row fields, the scores computed on the workers, and the
    advantages written back are the pipeline's reshaping of those scores."""
    _, tok = tiny
    v1 = run["v1"]
    rows = _rows(run, tok)
    cfg = oar.OARConfig.from_json(v1["config"])
    assert cfg.method == "oar_g" and int((v1["seq"] != 0).sum()) == 4
    want = _expected(rows, v1["seq"], v1["scores"], v1["reasoning_mask"], cfg)
    R = want.shape[1]
    torch.testing.assert_close(v1["advantages"][:, :R], want, rtol=0, atol=0)
    assert run["v1_ranks"][0]["forwards"] == run["v1_ranks"][1]["forwards"] > 0


def test_pi_old_scores_at_a_later_mini_batch(run):
    """Which weights score (issue 40): verl's separate-async trainer with parameter_sync_step 2 computes the second
    mini-batch's old log-probs with the weights of the cycle's start (its DetachActorWorker's CPU slot 0,
    trainer_separate_async.py:187-211), so GRPO's ratio is taken against those; OAR's scores at that mini-batch are
    exactly those of the original weights (OAR-P is deterministic), not of the updated ones, and the updated weights
    are back on the workers after (the scores of the sync trainer before and after are equal)."""
    po = run["pi_old"]
    first, second = po["first"]["scores"], po["second"]["scores"]
    before, after = po["changed_before"]["scores"], po["changed_after"]["scores"]
    assert int((po["first"]["seq"] != 0).sum()) > 0 and first.abs().sum() > 0
    torch.testing.assert_close(po["second"]["seq"], po["first"]["seq"], rtol=0, atol=0)
    torch.testing.assert_close(second, first, rtol=0, atol=0)  # pi_old scored
    torch.testing.assert_close(after, before, rtol=0, atol=0)  # the updated weights were put back
    assert (before - first).abs().max() > 1e-3 * first.abs().max()  # the update changed the scores
    torch.testing.assert_close(po["second"]["advantages"], po["first"]["advantages"], rtol=0, atol=0)


# ---- in-process: registration, worker swap, request layout, refusals ------------------------------------------


def test_trainers_registered_per_mode():
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, get_trainer_cls

    names = verl_workers.register_trainers()
    assert names == [f"oar_{m}" for m in TRAINER_REGISTRY if not m.startswith("oar_")]
    assert set(names) == {"oar_sync", "oar_colocate_async", "oar_separate_async"}
    for name in names:
        cls = get_trainer_cls(name)
        assert issubclass(cls, verl_workers.OARTrainerMixin) and issubclass(cls, get_trainer_cls(name[4:]))
        assert getattr(verl_workers, cls.__name__) is cls  # importable by name
    assert verl_workers.register_trainers() == names  # idempotent


def test_use_oar_workers_mixes_into_the_actor_class_only():
    import ray
    from verl.trainer.ppo.utils import Role
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    mapping = {Role.ActorRollout: ray.remote(ActorRolloutRefWorker), Role.Critic: ray.remote(TrainingWorker)}
    assert verl_workers.use_oar_workers(mapping)
    assert mapping[Role.ActorRollout].__ray_actor_class__ is verl_workers.OARActorRolloutRefWorker
    assert mapping[Role.Critic].__ray_actor_class__ is TrainingWorker

    class Mine(ActorRolloutRefWorker):
        pass

    mine = {Role.ActorRolloutRef: ray.remote(Mine)}
    assert verl_workers.use_oar_workers(mine)  # a subclass gets the mixin too (once per class)
    got = mine[Role.ActorRolloutRef].__ray_actor_class__
    assert issubclass(got, Mine) and issubclass(got, verl_workers.OARWorkerMixin)
    assert verl_workers.oar_worker_class(Mine) is got

    class MineWithOAR(verl_workers.OARWorkerMixin, Mine):
        pass

    kept = {Role.Actor: ray.remote(MineWithOAR)}
    assert verl_workers.use_oar_workers(kept) and kept[Role.Actor].__ray_actor_class__ is MineWithOAR

    class NotAWorker:
        pass

    other = {Role.ActorRollout: ray.remote(NotAWorker)}
    assert not verl_workers.use_oar_workers(other) and other[Role.ActorRollout].__ray_actor_class__ is NotAWorker
    assert "oar_scores" in dir(verl_workers.OARActorRolloutRefWorker)


def test_legacy_init_workers_wrapper_records_the_actor_group():
    """RayPPOTrainer.init_workers (wrapped by register()): with an OAR estimator the actor role runs on the OAR
    worker class and the estimator gets the trainer's actor worker group; other estimators are untouched."""
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.utils import Role
    from verl.workers.engine_workers import ActorRolloutRefWorker

    assert getattr(ray_trainer.RayPPOTrainer.init_workers, "__oar_wrapped__", False)
    seen = {}

    def orig(self):
        seen["cls"] = self.role_worker_mapping[Role.ActorRollout].__ray_actor_class__
        self.actor_rollout_wg = "the group"

    wrapped = verl_workers.wrap_init_workers(orig)
    for est, cls in (("grpo", ActorRolloutRefWorker), ("oar_p", verl_workers.OARActorRolloutRefWorker)):
        me = types.SimpleNamespace(config=OmegaConf.create({"algorithm": {"adv_estimator": est}}),
                                   role_worker_mapping={Role.ActorRollout: ray.remote(ActorRolloutRefWorker)})
        context.set_trainer_scorer(None)
        wrapped(me)
        assert seen["cls"] is cls
        got = context.trainer_scorer()
        assert (got is None) if est == "grpo" else (got.worker_group == "the group")
    context.set_trainer_scorer(None)


def test_request_layout_and_padding(tiny):
    """scores_request keeps only the active rows, pads them to a multiple of the data-parallel size with unscored
    copies, and the worker side reads back the same prompts / responses / masks / answers."""
    _, tok = tiny
    import verl_worker

    rows = oar_verl.rollout_rows(verl_worker.data_proto(verl_worker.rollouts(tok)), oar.OARConfig(method="oar_p"))
    seq = torch.tensor([0.0, 1.0, 0.0, -1.0, 0.5, 0.0, 0.0, 2.0])
    for dp in (1, 2, 3, 4):
        req, active = dispatch.scores_request(rows, oar.OARConfig(method="oar_p"), seq, dp)
        assert active == [1, 3, 4, 7] and req.batch_size[0] % dp == 0 and req.batch_size[0] >= 4
        b = dispatch.request_batch(req)
        assert (b.sequence_advantages[4:] == 0).all()
        for k, i in enumerate(active):
            assert torch.equal(b.prompt_ids[k], rows["prompt_ids"][i])
            assert torch.equal(b.completion_ids[k], rows["responses"][i])
            assert torch.equal(b.eligible_mask[k], rows["eligible_mask"][i])
            assert b.answers[k] == rows["answers"][i] and float(b.sequence_advantages[k]) == float(seq[i])
    # credit_rows: only the rows of the credited sign are sent (the others keep uniform credit on the driver)
    for credit_rows, want in (("positive", [1, 4, 7]), ("negative", [3])):
        req, active = dispatch.scores_request(rows, oar.OARConfig(method="oar_p", credit_rows=credit_rows), seq, 2)
        b = dispatch.request_batch(req)
        assert active == want and req.batch_size[0] == -(-len(want) // 2) * 2
        assert b.sequence_advantages[: len(want)].tolist() == seq[want].tolist()
        assert (b.sequence_advantages[len(want):] == 0).all()


class _FakeEngine:
    def __init__(self, sp=1):
        self.ulysses_sequence_parallel_size = sp


def _fake_worker(strategy="fsdp2", sp=1, actor=True, fused=False):
    from omegaconf import OmegaConf

    w = types.SimpleNamespace(config=OmegaConf.create({"actor": {"strategy": strategy}}), role="actor")
    w.actor = types.SimpleNamespace(engine=_FakeEngine(sp)) if actor else None
    if actor:
        w.actor.engine.engine_config = types.SimpleNamespace(use_fused_kernels=fused)
    return w


@pytest.mark.parametrize("worker, exc, match", [
    (_fake_worker("megatron"), NotImplementedError, "actor.strategy='megatron'.*Megatron is not supported"),
    (_fake_worker(sp=2), NotImplementedError, "Ulysses sequence parallelism.*ulysses_sequence_parallel_size=2"),
    (_fake_worker(fused=True), NotImplementedError, r"actor_rollout_ref\.model\.use_fused_kernels must be False, "
                                                    "got True"),
    (_fake_worker(actor=False), RuntimeError, "runs on the actor"),
])
def test_worker_refuses_unsupported_engines(worker, exc, match):
    with pytest.raises(exc, match=match):
        verl_workers.worker_scores(worker, None)


def test_trainer_memory_budget():
    """The budget from verl's token budget: dynamic batch size -> infer_max_token_len_per_gpu tokens, else
    infer_micro_batch_size_per_gpu sequences of the request's width; times the forward's bytes per token + its
    float32 logits; None without a token budget."""
    pm = types.SimpleNamespace(activation_bytes_per_token=lambda width, backward=False: 1000 + width, vocab_size=1024)
    per = lambda w: 1000 + w + 4 * 1024  # noqa: E731
    eng = lambda **kw: types.SimpleNamespace(engine_config=types.SimpleNamespace(**kw))  # noqa: E731
    assert verl_workers.trainer_memory_budget_mb(eng(use_dynamic_bsz=True, infer_max_token_len_per_gpu=2**20),
                                                 pm, 100) == 2**20 * per(100) // 2**20
    assert verl_workers.trainer_memory_budget_mb(eng(use_dynamic_bsz=False, infer_micro_batch_size_per_gpu=64,
                                                     infer_max_token_len_per_gpu=2**20), pm, 4096) == \
        64 * 4096 * per(4096) // 2**20
    assert verl_workers.trainer_memory_budget_mb(eng(use_dynamic_bsz=False, infer_micro_batch_size_per_gpu=1), pm,
                                                 10) == 1  # at least 1 MiB
    assert verl_workers.trainer_memory_budget_mb(eng(use_dynamic_bsz=False, infer_micro_batch_size_per_gpu=None),
                                                 pm, 10) is None
    assert verl_workers.trainer_memory_budget_mb(types.SimpleNamespace(), pm, 10) is None


def test_v1_rollouts_from_nested_fields():
    """The v1 trainer's transfer-queue fields (nested per-row prompts / responses / response_mask / entropy) become
    verl's padded layout: prompts left-padded, responses right-padded, the attention mask over both, entropies as
    oar_entropy (B, R), the answers as non-tensor data."""
    from tensordict import NonTensorStack, TensorDict

    nest = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    p = [torch.tensor([5, 6]), torch.tensor([7, 8, 9])]
    r = [torch.tensor([11, 12, 13]), torch.tensor([14])]
    m = [torch.tensor([1, 0, 1]), torch.tensor([1])]
    e = [torch.tensor([0.5, 0.25, 2.0]), torch.tensor([1.5])]
    td = TensorDict({"prompts": nest(p), "responses": nest(r), "response_mask": nest(m), "entropy": nest(e)},
                    batch_size=[2])
    td["reward_model"] = NonTensorStack({"ground_truth": "3"}, {"ground_truth": "4"})
    d = verl_workers._v1_rollouts(td, ("reward_model", "ground_truth"))
    b = d.batch
    assert b["prompts"].tolist() == [[0, 5, 6], [7, 8, 9]]
    assert b["responses"].tolist() == [[11, 12, 13], [14, 0, 0]]
    assert b["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert b["response_mask"].tolist() == [[1, 0, 1], [1, 0, 0]]
    assert b["oar_entropy"].tolist() == [[0.5, 0.25, 2.0], [1.5, 0.0, 0.0]]
    assert [x["ground_truth"] for x in d.non_tensor_batch["reward_model"]] == ["3", "4"]
    rows = oar_verl.rollout_rows(d, oar.OARConfig(method="oar_g"))
    assert [x.tolist() for x in rows["prompt_ids"]] == [[5, 6], [7, 8, 9]] and rows["answers"] == ["3", "4"]
    assert rows["completion_mask"].tolist() == [[True] * 3, [True, False, False]]


def test_request_bad_input(tiny):
    _, tok = tiny
    import verl_worker

    rows = oar_verl.rollout_rows(verl_worker.data_proto(verl_worker.rollouts(tok)), oar.OARConfig(method="oar_g"))
    with pytest.raises(ValueError, match="at least one row to score: a non-zero sequence advantage, of the sign "
                                         "credit_rows='all' credits"):
        dispatch.scores_request(rows, oar.OARConfig(method="oar_g"), torch.zeros(8), 2)
    with pytest.raises(ValueError, match="at least one row to score.*credit_rows='positive'"):
        dispatch.scores_request(rows, oar.OARConfig(method="oar_g", credit_rows="positive"), -torch.ones(8), 2)
    with pytest.raises(ValueError, match="dp_size must be an int >= 1, got 0"):
        dispatch.scores_request(rows, oar.OARConfig(method="oar_g"), torch.ones(8), 0)


def test_group_without_the_method_is_a_clear_error(tiny):
    _, tok = tiny
    import verl_worker

    rows = oar_verl.rollout_rows(verl_worker.data_proto(verl_worker.rollouts(tok)), oar.OARConfig(method="oar_g"))
    with pytest.raises(AttributeError, match="no oar_scores method: run the actor role on"):
        dispatch.group_scores(object(), rows, oar.OARConfig(method="oar_g"), torch.ones(8))


# ---- trainer start (issue 24): the actor class each verl trainer picks, refusals before any generation, and
# ---- verl's multi-output agent sessions ----------------------------------------------------------------------------


def _trainer_config(adv_estimator="oar_g", *, strategy="fsdp", sp=1, fsdp_sp=1, fused=False, hybrid=True):
    """The keys verl 0.9.1's ``PPOTrainer._init_resource_pool_mgr`` (trainer_base.py) reads, and those the OAR start
    checks read, with verl's defaults (``_generated_ppo_trainer.yaml``) unless given."""
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "algorithm": {"adv_estimator": adv_estimator, "use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0,
                      "norm_adv_by_std_in_grpo": True},
        "actor_rollout_ref": {"hybrid_engine": hybrid,
                              "model": {"lora_rank": 0, "use_fused_kernels": fused},
                              "actor": {"strategy": strategy, "use_kl_loss": False,
                                        "ulysses_sequence_parallel_size": sp,
                                        "fsdp_config": {"ulysses_sequence_parallel_size": fsdp_sp}},
                              "rollout": {"n": 2}},
        "critic": {"enable": False},
        "trainer": {"n_gpus_per_node": 1, "nnodes": 1},
        "reward": {"reward_model": {"enable_resource_pool": False, "nnodes": 0, "n_gpus_per_node": 0}},
    })


def _trainer(mode, config):
    """An OAR v1 trainer of verl's ``mode`` with only its config set (verl's __init__ starts Ray and data loaders)."""
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    trainer = object.__new__(get_trainer_cls(f"oar_{mode}"))
    trainer.config = config
    if mode == "separate_async":
        trainer._enable_hybrid_replicas = bool(config.actor_rollout_ref.hybrid_engine)  # as its __init__ sets it
    return trainer


@pytest.mark.parametrize("hybrid", [True, False])
def test_separate_async_trainer_runs_the_actor_on_detach_worker_with_oar_scores(hybrid):
    """verl's separate_async trainer swaps the actor class for its DetachActorWorker in its own
    _init_resource_pool_mgr (verl/trainer/ppo/v1/trainer_separate_async.py). The OAR trainer of that mode must end
    with that class plus oar_scores (it used to keep DetachActorWorker and fail at the first advantage call), under
    the role verl picks (ActorRollout with hybrid replicas, Actor without), importable by name from oar."""
    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.trainer.ppo.utils import Role

    trainer = _trainer("separate_async", _trainer_config(hybrid=hybrid))
    trainer._init_resource_pool_mgr()
    role = Role.ActorRollout if hybrid else Role.Actor
    cls = trainer.role_worker_mapping[role].__ray_actor_class__
    assert issubclass(cls, DetachActorWorker) and hasattr(cls, "oar_scores")
    assert issubclass(cls, verl_workers.OARWorkerMixin)
    assert cls.__module__ == verl_workers.__name__ and getattr(verl_workers, cls.__name__) is cls
    assert verl_workers.oar_worker_class(DetachActorWorker) is cls  # one subclass per base class
    # the sync trainer keeps verl's ActorRolloutRefWorker plus oar_scores
    sync = _trainer("sync", _trainer_config(hybrid=hybrid))
    sync._init_resource_pool_mgr()
    assert sync.role_worker_mapping[Role.ActorRollout].__ray_actor_class__ is verl_workers.OARActorRolloutRefWorker


def test_mixed_worker_class_unpickles_by_reference_in_a_fresh_process():
    """Ray ships actor classes with its cloudpickle: the OAR DetachActorWorker pickles by reference and a fresh
    process (which never ran the trainer) resolves it by name to the same kind of class."""
    import ray.cloudpickle as cp
    from verl.experimental.separation.engine_workers import DetachActorWorker

    from _subproc import child_env

    cls = verl_workers.oar_worker_class(DetachActorWorker)
    blob = cp.dumps(cls)
    assert b"OARDetachActorWorker" in blob and len(blob) < 500  # by reference: a module and a name, no class body
    code = ("import sys, ray.cloudpickle as cp; cls = cp.loads(sys.stdin.buffer.read()); "
            "from verl.experimental.separation.engine_workers import DetachActorWorker; "
            "from oar.integrations.verl import workers as w; "
            "print(cls.__qualname__, cls is w.OARDetachActorWorker, issubclass(cls, DetachActorWorker), "
            "hasattr(cls, 'oar_scores'))")
    p = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=300, env=child_env())
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    assert p.stdout.decode().split() == ["OARDetachActorWorker", "True", "True", "True"]

    # a user's own subclass (not importable by name in another process) travels by value
    from verl.workers.engine_workers import ActorRolloutRefWorker

    class UserWorker(ActorRolloutRefWorker):
        pass

    user = verl_workers.oar_worker_class(UserWorker)
    assert not hasattr(verl_workers, user.__name__)
    code = ("import sys, ray.cloudpickle as cp; cls = cp.loads(sys.stdin.buffer.read()); "
            "from verl.workers.engine_workers import ActorRolloutRefWorker; "
            "print(cls.__name__, cls.__mro__[2].__name__, issubclass(cls, ActorRolloutRefWorker), "
            "hasattr(cls, 'oar_scores'))")
    p = subprocess.run([sys.executable, "-c", code], input=cp.dumps(user), capture_output=True, timeout=300,
                       env=child_env())
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    assert p.stdout.decode().split() == ["OARUserWorker", "UserWorker", "True", "True"]


def test_an_actor_class_without_oar_scores_is_refused_at_start():
    """An actor class that cannot get oar_scores (no ActorRolloutRefWorker subclass) is refused when the trainer
    starts (v1: _init_resource_pool_mgr; legacy: init_workers before verl's own), not at the first advantage call;
    an estimator that does not score on the workers (oar_grpo) starts."""
    import ray
    from verl.trainer.ppo.utils import Role

    class NotAWorker:
        pass

    for est, refused in (("oar_g", True), ("oar_random", True), ("oar_grpo", False), ("grpo", False)):
        mapping = {Role.ActorRollout: ray.remote(NotAWorker)}
        if refused:
            with pytest.raises(TypeError, match=rf"algorithm.adv_estimator='{est}' scores on the actor workers: the "
                                                r"actor role runs on .*NotAWorker, which has no oar_scores"):
                verl_workers.require_oar_workers(_trainer_config(est), mapping)
        else:
            assert not verl_workers.require_oar_workers(_trainer_config(est), mapping)
    with pytest.raises(TypeError, match="scores on the actor workers, but the trainer has no actor role"):
        verl_workers.require_oar_workers(_trainer_config("oar_g"), {Role.Critic: ray.remote(NotAWorker)})
    called = []
    wrapped = verl_workers.wrap_init_workers(lambda self: called.append(1))
    me = types.SimpleNamespace(config=_trainer_config("oar_p"), role_worker_mapping={Role.ActorRollout:
                                                                                    ray.remote(NotAWorker)})
    with pytest.raises(TypeError, match="no oar_scores"):
        wrapped(me)
    assert not called  # refused before verl starts any worker


START_REFUSALS = [
    pytest.param(dict(strategy="megatron"), r"actor_rollout_ref\.actor\.strategy must be one of \('fsdp', 'fsdp2'\), "
                 r"got actor\.strategy='megatron'", id="megatron"),
    pytest.param(dict(sp=2), r"ulysses_sequence_parallel_size=2.*set actor_rollout_ref\.actor\."
                 r"ulysses_sequence_parallel_size", id="ulysses_actor"),
    pytest.param(dict(fsdp_sp=4), r"ulysses_sequence_parallel_size=4", id="ulysses_fsdp_config"),
    pytest.param(dict(fused=True), r"actor_rollout_ref\.model\.use_fused_kernels must be False, got True",
                 id="fused_kernels"),
]


@pytest.mark.parametrize("mode", ["sync", "separate_async"])
@pytest.mark.parametrize("overrides, match", START_REFUSALS)
def test_unsupported_configs_are_refused_when_the_trainer_starts(mode, overrides, match):
    """Megatron, Ulysses SP > 1 and verl's fused-kernel forward used to be refused by the workers at the first
    advantage call, after a whole generation; the OAR trainers refuse them in _init_resource_pool_mgr (before any
    resource pool or worker) and the legacy init_workers wrapper before verl's own."""
    trainer = _trainer(mode, _trainer_config("oar_g", **overrides))
    with pytest.raises(NotImplementedError, match=match):
        trainer._init_resource_pool_mgr()
    assert not hasattr(trainer, "role_worker_mapping")  # refused before verl's own set-up
    called = []
    me = types.SimpleNamespace(config=_trainer_config("oar_p", **overrides), role_worker_mapping={})
    with pytest.raises(NotImplementedError, match=match):
        verl_workers.wrap_init_workers(lambda self: called.append(1))(me)
    assert not called


@pytest.mark.parametrize("overrides", [p.values[0] for p in START_REFUSALS])
def test_estimators_without_worker_scores_start_on_any_engine(overrides):
    """Uniform credit, KTAE and entropy shaping never call the workers' oar_scores: nothing to refuse. The fused
    forward is refused only for methods that run the policy (random does not)."""
    for est in ("oar_grpo", "oar_dr_grpo", "oar_ktae", "oar_entropy_shaping", "grpo"):
        verl_checks.check_trainer_config(_trainer_config(est, **overrides))
    if overrides == dict(fused=True):
        verl_checks.check_trainer_config(_trainer_config("oar_random", **overrides))
        with pytest.raises(NotImplementedError, match="use_fused_kernels"):
            verl_checks.check_trainer_config(_trainer_config("oar_entropy", **overrides))


def _sessions_batch(seed=0):
    """Rows of verl's agent loop with multi-output sessions, as its transfer queue holds them: keys
    "{uid}_{session}_{output index}" in shuffled order, 2 prompts (uids) x 3 sessions each with 1-3 outputs, rewards
    differing between a session's outputs (only the final output's reward counts in verl's GRPO), tool outputs
    (response_mask 0) inside some responses, one session whose final output is not its last row."""
    g = torch.Generator().manual_seed(seed)
    outputs = {("u0", 0): 3, ("u0", 1): 1, ("u0", 2): 2, ("u1", 0): 2, ("u1", 1): 3, ("u1", 2): 1}
    rows = []
    for (uid, sess), n in outputs.items():
        for k in range(n):
            L = int(torch.randint(4, 9, (1,), generator=g))
            mask = torch.ones(L, dtype=torch.long)
            if L > 5:
                mask[2:4] = 0  # a tool output inside the response
            rows.append(dict(key=f"{uid}_{sess}_{k}", uid=uid, prompt=torch.randint(3, 60, (3 + k,), generator=g),
                             response=torch.randint(3, 60, (L,), generator=g), mask=mask,
                             reward=float(torch.randint(0, 3, (1,), generator=g)) - 1.0))
    order = torch.randperm(len(rows), generator=g).tolist()
    return [rows[i] for i in order]


def _v1_advantages(rows, mode, adv_estimator, dtype=torch.float32):
    """verl 0.9.1's v1 ``_compute_advantage`` of trainer ``mode`` (``sync``: verl's own; ``oar_sync``: OAR's) on a
    transfer queue stood in for by verl_worker.FakeTQ; returns the advantages written back, padded (B, R)."""
    import transfer_queue
    from tensordict import NonTensorStack, TensorDict
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    import verl_worker

    fake = verl_worker.FakeTQ()
    keys = [r["key"] for r in rows]
    nest = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    rm = [torch.nn.functional.one_hot(torch.tensor(len(r["response"]) - 1), len(r["response"])).to(dtype)
          * r["reward"] for r in rows]
    td = TensorDict({"prompts": nest([r["prompt"] for r in rows]), "responses": nest([r["response"] for r in rows]),
                     "response_mask": nest([r["mask"] for r in rows]), "rm_scores": nest(rm)},
                    batch_size=[len(rows)])
    td["uid"] = NonTensorStack(*[r["uid"] for r in rows])
    meta = fake.put(keys, "train", td)
    saved = (transfer_queue.kv_batch_get, transfer_queue.kv_batch_put)
    transfer_queue.kv_batch_get, transfer_queue.kv_batch_put = fake.get, fake.put
    try:
        trainer = object.__new__(get_trainer_cls(mode))
        trainer.config = _trainer_config(adv_estimator)
        trainer.actor_rollout_wg = None  # uniform credit: the workers are never called
        trainer._compute_advantage(meta, metrics={})
    finally:
        transfer_queue.kv_batch_get, transfer_queue.kv_batch_put = saved
    return fake.get(keys, "train", ["advantages"])["advantages"].to_padded_tensor(0.0)


def test_session_rows_follow_verls_key_format():
    final, session = oar_verl.estimators.session_rows(["a_0_0", "a_0_2", "b_x_1", "a_0_1", "a_1_0", "u_v_w_3_0"])
    assert final == [1, 2, 4, 5] and session == [0, 0, 1, 0, 2, 3]
    with pytest.raises(ValueError, match=r"key 1 must be '\{uid\}_\{session_id\}_\{output index\}'.*got 'a_b'"):
        oar_verl.estimators.session_rows(["a_0_0", "a_b"])


@pytest.mark.parametrize("seed", [0, 1])
def test_multi_output_sessions_group_as_verls_grpo(seed):
    """EQUALITY with verl's own GRPO of the v1 trainer (compute_advantage_for_multi_trajectories: group statistics
    over each session's final output, broadcast to the session's outputs): oar_grpo through the OAR v1 trainer
    gives the same token advantages on multi-output sessions with tool outputs (it used to group every output by
    uid, which biases the group mean and std)."""
    from _tolerance import assert_close_to_rounded

    rows = _sessions_batch(seed)
    ref64 = _v1_advantages(rows, "sync", "grpo", dtype=torch.float64)  # verl's own estimator, in float64
    ref = _v1_advantages(rows, "sync", "grpo")  # verl's own, float32 as it runs
    ours = _v1_advantages(rows, "oar_sync", "oar_grpo")
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert_close_to_rounded(ours, ref64, what="oar_grpo vs verl's v1 GRPO on multi-output sessions")
    torch.testing.assert_close(ours, ref, rtol=2e-6, atol=2e-7)
    # the sessions matter: grouping every output by uid gives other advantages here
    per_row = _v1_advantages([dict(r, key=f"{r['uid']}_{i}_0") for i, r in enumerate(rows)], "sync", "grpo")
    assert not torch.allclose(per_row, ref, atol=1e-3)


def test_verls_fused_kernel_forward_gives_the_probes_no_logits():
    """Why use_fused_kernels is refused at start: verl's own patch (models/transformers/monkey_patch.py,
    patch_forward_with_backends, torch backend, which runs on CPU) makes the policy's forward return log-probs and
    entropies of the rolled labels and no logits, and raise without return_dict: OAR's probe forward
    (HFProbeModel.tail_logits) cannot run on it. The patch replaces the class's forward, so it is applied to a
    throwaway subclass of the tiny model's class."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    import _verl_cpu

    from oar.attribution import as_probe_model

    model = tiny_random_llama(**_verl_cpu.TINY)[0]  # a fresh model: its class gets patched
    model.__class__ = type("FusedPatched", (type(model),), {})
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, return_dict=True)
    assert getattr(out, "logits", None) is None and tuple(out.log_probs.shape) == (2, 7)
    with pytest.raises(NotImplementedError, match="has to return_dict"):
        as_probe_model(model).tail_logits(input_ids=ids, attention_mask=torch.ones_like(ids),
                                          position_ids=torch.arange(7).expand(2, 7), keep=2)
    verl_checks.check_trainer_config(_trainer_config("oar_g", fused=False))  # the refusal is the key, nothing else
    with pytest.raises(NotImplementedError, match="use_fused_kernels"):
        verl_checks.check_trainer_config(_trainer_config("oar_g", fused=True))
