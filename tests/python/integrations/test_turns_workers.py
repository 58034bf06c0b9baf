"""Multi-turn sessions scored where the trainer's policy lives (docs/method.md section 13): the turn weights of
``turn_credit: probe`` travel back from verl's actor workers and OpenRLHF's policy actors with the scores, and the
driver's advantages equal the single-process pipeline's.

The workers' own bodies run here in-process (verl's ``worker_scores``, OpenRLHF's ``actor_scores``) behind stand-ins
of the worker group / actor group (two data-parallel ranks); their Ray and FSDP paths are the tests of
test_verl_workers.py and test_openrlhf.py.
"""

import contextlib
from types import SimpleNamespace

import pytest
import torch

import oar
from oar.batch import RolloutBatch
from oar.pipeline import Pipeline
from oar.testing import tiny_random_llama

from _error_model import pipeline_scores_estimate
from _sessions import session_tokens
from _tolerance import assert_within_error_model

CONCLUDE = "\nTherefore, the final answer is \\boxed{"
SESSIONS = [  # (turns, observations, answer, sequence advantage)
    (["I try <calc>12/0</calc>", "Then <calc>12*3+5</calc>", "so \\boxed{41}"],
     ["<result>error</result>", "<result>41</result>"], "41", 1.0),
    (["It is 7*6 = 42. \\boxed{42}"], [], "42", -1.0),
    (["First <calc>2+2</calc>", "it is \\boxed{4}"], ["<result>4</result>"], "4", 0.5),
    (["Just \\boxed{9}"], [], "9", 0.0),  # advantage 0: never sent
]


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, tokenizer="minimal", seed=1,
                                   initializer_range=0.12)
    return model.eval(), tok


def _rows(tok):
    out = []
    for turns, obs, answer, adv in SESSIONS:
        ids, mask, _ = session_tokens(tok, turns, obs)
        prompt = tok(f"Q{len(out)}: ?\n", add_special_tokens=False)["input_ids"]
        out.append(dict(prompt=torch.tensor(prompt), response=torch.tensor(ids), mask=torch.tensor(mask),
                        answer=answer, adv=adv))
    return out


def _rollout_batch(rows) -> RolloutBatch:
    C = max(len(r["response"]) for r in rows)
    cids = torch.zeros((len(rows), C), dtype=torch.long)
    cmask = torch.zeros((len(rows), C), dtype=torch.bool)
    elig = torch.zeros((len(rows), C), dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r["response"])
        cids[i, :n], cmask[i, :n], elig[i, :n] = r["response"], True, r["mask"].bool()
    return RolloutBatch(cids, cmask, prompt_ids=[r["prompt"] for r in rows], eligible_mask=elig,
                        answers=[r["answer"] for r in rows],
                        sequence_advantages=torch.tensor([r["adv"] for r in rows], dtype=torch.float32))


def _config():
    return oar.OARConfig(method="oar_p", conclude=CONCLUDE, turn_credit="probe")


def _check_driver(batch, scores, reasoning, turn_weights, model, tok):
    """The workers' scores within the float32 error model of the single-process pipeline (rule 1 of _tolerance.py),
    their turn weights the pipeline's, and the driver's advantages reshaped turn by turn with them: each turn's mass
    A_i w_k n_k, each session's A_i n_i."""
    from oar.attribution.turns import turn_runs

    cfg = _config()
    direct = Pipeline(cfg, tok).scores(batch, model)
    multi = [i for i, r in enumerate(SESSIONS) if len(r[0]) > 1 and r[3] != 0]
    assert turn_weights is not None and multi
    for i in multi:  # the probe's log-likelihoods in float32: differences of ~1e-6 nats at most
        torch.testing.assert_close(turn_weights[i], direct.turn_weights[i], rtol=1e-4, atol=1e-5)
        assert float(turn_weights[i][batch.eligible_mask[i]].std()) > 0.01  # not all ones: the probe moved
    assert_within_error_model(scores, pipeline_scores_estimate(cfg, tok, batch, model), what="workers' scores")
    assert torch.equal(reasoning, direct.reasoning_mask)
    given = RolloutBatch(**{**batch.__dict__, "scores": scores, "reasoning_mask": reasoning,
                            "turn_weights": turn_weights})
    adv = Pipeline(cfg, tok).compute(given).advantages.double()
    for i, (_, _, _, A) in enumerate(SESSIONS):
        elig = batch.eligible_mask[i]
        assert float(adv[i].sum()) == pytest.approx(A * int(elig.sum()), rel=1e-5, abs=1e-6)
        if i in multi:
            for a, b in turn_runs(elig):
                w = float(turn_weights[i, a])
                assert float(adv[i, a:b].sum()) == pytest.approx(A * w * (b - a), rel=1e-5)


def test_verl_workers_send_turn_weights_back(tiny):
    pytest.importorskip("verl")
    import numpy as np
    from verl import DataProto

    from oar.integrations import verl as oar_verl
    from oar.integrations.verl import workers

    model, tok = tiny
    rows = _rows(tok)
    B, P, R = len(rows), max(len(r["prompt"]) for r in rows), max(len(r["response"]) for r in rows)
    prompts, responses = torch.zeros((B, P), dtype=torch.long), torch.zeros((B, R), dtype=torch.long)
    attn, rmask = torch.zeros((B, P + R), dtype=torch.long), torch.zeros((B, R), dtype=torch.long)
    for i, r in enumerate(rows):
        p, q = len(r["prompt"]), len(r["response"])
        prompts[i, P - p:], responses[i, :q], attn[i, P - p: P + q], rmask[i, :q] = r["prompt"], r["response"], 1, r["mask"]
    data = DataProto.from_dict(tensors=dict(prompts=prompts, responses=responses, attention_mask=attn,
                                            response_mask=rmask),
                               non_tensors=dict(reward_model=np.array([{"ground_truth": r["answer"]} for r in rows],
                                                                      dtype=object)))
    engine = SimpleNamespace(module=model, ulysses_sequence_parallel_size=1, engine_config=None,
                             eval_mode=contextlib.nullcontext)
    worker = SimpleNamespace(actor=SimpleNamespace(engine=engine, model_config=SimpleNamespace(tokenizer=tok)),
                             config=SimpleNamespace(actor={"strategy": "fsdp"}))

    class Group:  # two data-parallel ranks; verl's dispatch hands each a contiguous chunk
        _dispatch_info = {"actor": [0, 1]}

        def oar_scores(self, td):
            n = td.batch_size[0] // 2
            parts = [workers.worker_scores(worker, td[k * n:(k + 1) * n]) for k in range(2)]
            return torch.cat([p.select("oar_scores", "oar_reasoning_mask", "oar_turn_weights") for p in parts])

    scorer = oar_verl.WorkerGroupScorer(Group())
    seq = torch.tensor([r["adv"] for r in rows], dtype=torch.float32)
    scores, reasoning = scorer(data, _config(), seq)
    _check_driver(_rollout_batch(rows), scores, reasoning, scorer.last_info["turn_weights"], model, tok)
    # attach_scores keeps them for the estimator
    oar_verl.attach_scores(data, scores, reasoning, turn_weights=scorer.last_info["turn_weights"])
    assert torch.equal(data.batch["oar_turn_weights"], scorer.last_info["turn_weights"])
    with pytest.raises(ValueError, match=rf"turn_weights must be a \(B, R\) = \({B}, {R}\) tensor, got \({B}, {R + 1}\)"):
        oar_verl.attach_scores(data, scores, reasoning, turn_weights=torch.ones(B, R + 1))


def test_openrlhf_actors_send_turn_weights_back(tiny, monkeypatch):
    ray = pytest.importorskip("ray")
    from oar.integrations import openrlhf as oar_orl

    model, tok = tiny
    rows = _rows(tok)
    batch = _rollout_batch(rows)
    actor = SimpleNamespace(model=SimpleNamespace(module=model), training=False, eval=lambda: None,
                            train=lambda: None)
    policy_actor = SimpleNamespace(actor=actor, strategy=None)

    class ActorGroup:
        def async_run_method_batch(self, method_name, request):
            assert method_name == oar_orl.ACTOR_METHOD
            return [[oar_orl.actor_scores(policy_actor, req)] for req in request]

    args = SimpleNamespace(ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1),
                           actor=SimpleNamespace(num_nodes=1, num_gpus_per_node=2), train=None)
    maker = SimpleNamespace(strategy=SimpleNamespace(args=args), actor_model_group=ActorGroup())
    monkeypatch.setattr(ray, "get", lambda refs: refs)  # the stand-in group returns its replies, not object refs
    info = {}
    scores, reasoning = oar_orl._actor_group_scores(maker, batch, _config(), tok, info)
    _check_driver(batch, scores, reasoning, info["turn_weights"], model, tok)
