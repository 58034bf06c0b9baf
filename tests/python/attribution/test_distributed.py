"""oar.distributed.ForwardGate: ranks with different amounts of attribution work run the same sequence of model
calls (2 processes, gloo backend, CPU), and the gate changes no result."""

import contextlib
import datetime
import functools
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import oar
from oar.attribution.model import (ATTENTION_MEMBERS, EMBEDDING_NOISE_MEMBERS, PREFIX_CACHE_FLAGS, PREFIX_CACHE_MEMBERS,
                                   PROBE_MODEL_MEMBERS, SHARED_PREFIX_MEMBERS, NoisedEmbeddings)
from oar.distributed import ForwardGate, distributed_world, gate_model

from _error_model import Bounded, random_rounding
from _tolerance import assert_within_error_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # a timeout: a collective a rank never joins fails the test instead of hanging it
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))


class LoggingModel:
    """A ProbeModel with the prefix-cache capability whose calls are logged by kind (0 embedding lookup, 1 forward,
    2 forward + backward) and, like a ZeRO-3 model, each run a collective: an all-reduce of 1000 + kind whose sum
    tells whether every rank ran a call of the same kind at that point (``mismatches`` counts those that did not)."""

    vocab_size = 11
    hidden_size = 3
    device = torch.device("cpu")
    supports_prefix_cache = True
    supports_prefix_grad = True

    def __init__(self, collective=True):
        self.log = []
        self.mismatches = 0
        self.collective = collective
        self.w = torch.nn.Parameter(torch.randn(3, 11))

    def _call(self, kind):
        self.log.append(kind)
        if self.collective:
            t = torch.tensor([1000 + kind], dtype=torch.int64)
            dist.all_reduce(t)
            self.mismatches += int(t.item()) != dist.get_world_size() * (1000 + kind)

    def embed(self, input_ids):
        self._call(0)
        return torch.ones(*input_ids.shape, 3)

    def tail_logits(self, *, input_ids=None, inputs_embeds=None, attention_mask, position_ids, keep):
        grad = inputs_embeds is not None and inputs_embeds.requires_grad and torch.is_grad_enabled()
        self._call(2 if grad else 1)
        x = inputs_embeds if inputs_embeds is not None else torch.ones(*input_ids.shape, 3)
        return (x @ self.w)[:, -keep:]

    def activation_bytes_per_token(self, width, backward=False):
        return 4 * self.hidden_size * (3 if backward else 1)

    def eval_mode(self):
        return contextlib.nullcontext()

    def kv_bytes_per_token(self):
        return 8 * self.hidden_size

    def tail_logits_and_cache(self, *, input_ids, attention_mask, position_ids, keep):
        self._call(1)
        return torch.zeros(input_ids.shape[0], keep, 11), [(torch.zeros(input_ids.shape[0], 1, 1, 1),) * 2]

    def tail_logits_cached(self, prefix_kv, *, input_ids=None, inputs_embeds=None, attention_mask, position_ids, keep):
        return self.tail_logits(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                position_ids=position_ids, keep=keep)


# Each rank's own work: (no-grad forwards via tail_logits, via the prefix-cache calls, embed + forward+backward).
WORK = {0: (3, 2, 2), 1: (1, 0, 0)}


def _gate_worker(rank, world, port, out_dir):
    _init(rank, world, port)
    torch.manual_seed(rank)
    m = LoggingModel()
    gate = gate_model(m, pad_id=0)
    assert isinstance(gate, ForwardGate) and distributed_world()
    n_tail, n_cache, n_fb = WORK[rank]
    ids = torch.zeros(2, 4, dtype=torch.long)
    attn = torch.ones(2, 4, dtype=torch.long)
    pos = torch.arange(4).expand(2, 4)
    with torch.no_grad():
        for _ in range(n_tail):
            gate.tail_logits(input_ids=ids, attention_mask=attn, position_ids=pos, keep=2)
        for k in range(n_cache):
            if k % 2 == 0:
                gate.tail_logits_and_cache(input_ids=ids, attention_mask=attn, position_ids=pos, keep=2)
            else:
                gate.tail_logits_cached(None, input_ids=ids, attention_mask=attn, position_ids=pos, keep=2)
    for _ in range(n_fb):
        with torch.no_grad():
            e = gate.embed(ids)
        e.requires_grad_(True)
        out = gate.tail_logits(inputs_embeds=e, attention_mask=attn, position_ids=pos, keep=2)
        torch.autograd.grad(out.sum(), e)
    gate.finish()
    assert m.w.grad is None  # dummies never write parameter grads
    with open(os.path.join(out_dir, f"gate{rank}.json"), "w") as f:
        json.dump({"log": m.log, "mismatches": m.mismatches, "real": gate.real_calls, "dummy": gate.dummy_calls,
                   "embeds": [gate.real_embeds, gate.dummy_embeds]}, f)
    dist.destroy_process_group()


def test_gate_aligns_ranks_with_different_work(tmp_path):
    mp.spawn(_gate_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "gate0.json").read_text())
    r1 = json.loads((tmp_path / "gate1.json").read_text())
    assert r0["log"] == r1["log"]  # same kinds in the same order on both ranks
    assert r0["log"] == [1, 1, 1, 1, 1, 0, 2, 0, 2]  # rank 0's own work, in its order
    assert r0["mismatches"] == r1["mismatches"] == 0  # every model collective met the same one on the other rank
    assert r0["dummy"] == {"1": 0, "2": 0} and r0["embeds"] == [2, 0]
    assert r1["dummy"] == {"1": 4, "2": 2} and r1["real"] == {"1": 1, "2": 0}
    assert r1["embeds"] == [0, 2]  # the kind-2 dummies reuse the dummy lookups' embedding: no extra lookup


class NoisingModel(LoggingModel):
    """LoggingModel that takes its embeddings inside the forward (EmbeddingNoiseModel): a forward on ids under
    ``noised_embeddings`` runs on ``perturb(embeddings)`` made a leaf, and is logged as kind 2 when grad is on."""

    supports_embedding_noise = True

    def __init__(self, collective=True):
        super().__init__(collective)
        self._pending = None

    @contextlib.contextmanager
    def noised_embeddings(self, perturb):
        rec = NoisedEmbeddings()
        self._pending = (perturb, rec)
        try:
            yield rec
        finally:
            self._pending = None

    def tail_logits(self, *, input_ids=None, inputs_embeds=None, attention_mask, position_ids, keep):
        if self._pending is None:
            return super().tail_logits(input_ids=input_ids, inputs_embeds=inputs_embeds,
                                       attention_mask=attention_mask, position_ids=position_ids, keep=keep)
        (perturb, rec), self._pending = self._pending, None
        self._call(2 if torch.is_grad_enabled() else 1)
        rec.clean = torch.ones(*input_ids.shape, 3)
        rec.noised = perturb(rec.clean).requires_grad_(torch.is_grad_enabled())
        return (rec.noised @ self.w)[:, -keep:]


def _noise_worker(rank, world, port, out_dir):
    _init(rank, world, port)
    m = NoisingModel()
    gate = gate_model(m, pad_id=0)
    ids = torch.zeros(2, 4, dtype=torch.long)
    attn = torch.ones(2, 4, dtype=torch.long)
    pos = torch.arange(4).expand(2, 4)
    grads = []
    with torch.no_grad():  # rank 0: a clean forward and two noised forward + backward; rank 1: nothing
        for _ in range(1 - rank):
            gate.tail_logits(input_ids=ids, attention_mask=attn, position_ids=pos, keep=2)
    for _ in range(2 * (1 - rank)):
        with gate.noised_embeddings(lambda e: 2 * e) as rec:
            out = gate.tail_logits(input_ids=ids, attention_mask=attn, position_ids=pos, keep=2)
        (g,) = torch.autograd.grad(out.sum(), rec.noised)
        grads.append((rec.clean.sum().item(), rec.noised.sum().item(), g.shape == rec.noised.shape))
    gate.finish()
    assert m.w.grad is None
    with open(os.path.join(out_dir, f"noise{rank}.json"), "w") as f:
        json.dump({"log": m.log, "mismatches": m.mismatches, "dummy": gate.dummy_calls, "grads": grads,
                   "embeds": [gate.real_embeds, gate.dummy_embeds]}, f)
    dist.destroy_process_group()


def test_gate_with_embeddings_taken_in_the_forward(tmp_path):
    """A model that takes its embeddings inside the forward is never asked for a lookup of its own: the
    forward under noised_embeddings counts as forward + backward, the other rank's dummies of that kind are
    forwards on ids under the identity perturbation, and the record reaches the caller through the gate."""
    mp.spawn(_noise_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "noise0.json").read_text())
    r1 = json.loads((tmp_path / "noise1.json").read_text())
    assert r0["log"] == r1["log"] == [1, 2, 2]  # no kind 0: no embedding lookup on either rank
    assert r0["mismatches"] == r1["mismatches"] == 0
    assert r0["embeds"] == r1["embeds"] == [0, 0]
    assert r0["dummy"] == {"1": 0, "2": 0} and r1["dummy"] == {"1": 1, "2": 2}
    assert r0["grads"] == [[8 * 3, 16 * 3, True]] * 2  # clean = ones (2, 4, 3), noised = 2 x clean


def test_no_gate_without_distributed():
    assert not distributed_world()
    m = LoggingModel()
    assert gate_model(m) is m


def test_gate_is_the_protocol_and_nothing_else():
    """Every ProbeModel / capability member is the gate's own (a model call cannot reach the model ungated), and
    the gate offers nothing beyond them but finish()."""
    public = {n for n in dir(ForwardGate) if not n.startswith("_")}
    members = (PROBE_MODEL_MEMBERS + PREFIX_CACHE_MEMBERS + SHARED_PREFIX_MEMBERS + EMBEDDING_NOISE_MEMBERS
               + ATTENTION_MEMBERS + PREFIX_CACHE_FLAGS)
    assert public == set(members) | {"finish"}
    gate = ForwardGate(LoggingModel(collective=False))
    assert gate.supports_prefix_cache and not gate.supports_prefix_grad  # OAR-G keeps its plain path under a gate
    assert not gate.supports_shared_prefix_attention  # LoggingModel does not declare it
    assert not gate.supports_embedding_noise and ForwardGate(NoisingModel(collective=False)).supports_embedding_noise
    with pytest.raises(AttributeError):
        gate.model  # noqa: B018  (no pass-through to the wrapped object)
    with pytest.raises(TypeError, match=r"lacks embed, tail_logits, activation_bytes_per_token, eval_mode"):
        ForwardGate(type("Sizes", (), {"vocab_size": 5, "hidden_size": 2, "device": torch.device("cpu")})())


def _pipeline_worker(rank, world, port, out_dir, methods):
    _init(rank, world, port)
    from oar.attribution import HFProbeModel
    from oar.batch import RolloutBatch
    from oar.pipeline import Pipeline
    from oar.testing import tiny_random_llama

    model, tok = tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0)
    with torch.no_grad():  # sharpened (as test_attribution's tiny model): divergences far above float32 rounding
        for prm in model.parameters():
            if prm.dim() > 1:
                prm.mul_(6.0)
    calls = {"n": 0}
    orig = model.forward

    @functools.wraps(orig)  # keeps the signature the engines inspect
    def counting(*a, **k):
        calls["n"] += 1
        out = orig(*a, **k)
        if out.logits.dtype == torch.float64:
            # The float64 reference run: exact logits, rounded once to the float32 the probe ops take.
            out.logits = out.logits.float()
        return out

    model.forward = counting
    # Rank 0 has three long active rows, rank 1 a single short one: different chunk plans.
    texts = (["so 2 and 3 make 5 \\boxed{5}", "hmm 9 and 9 \\boxed{9}", "1 1 1 1 2 \\boxed{4}"] if rank == 0
             else ["5 \\boxed{5}", "7 \\boxed{7}", "x"])
    adv = torch.tensor([0.5, -1.0, 0.7]) if rank == 0 else torch.tensor([1.0, 0.0, 0.0])
    C = 32
    ids = torch.full((3, C), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((3, C), dtype=torch.long)
    for i, t in enumerate(texts):
        e = tok.encode(t, add_special_tokens=False) + [tok.eos_token_id]
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    prompts = [tok.encode("Q?", add_special_tokens=False)] * 3
    res = {}
    for method in methods:
        if method == "oar_g" and rank == 1:
            # OAR-G fits every row in one chunk here; a rank with nothing to score must still match the other's
            # clean forward and forward + backward.
            adv = torch.zeros(3)
        # A 1 MB budget puts one OAR-G row / few OAR-P variants per forward, so the plans differ between ranks.
        # "oar_p_screened": screened OAR-P (the windowed screen, then exact masking of a selection that differs by
        # rank); "oar_p_screened_g": the same with the OAR-G screen.
        screened = {"method": "oar_p", "screen_fraction": 0.3, "screen_sample": 0.2}
        keys = (screened if method == "oar_p_screened" else {**screened, "screen": "oar_g"}
                if method == "oar_p_screened_g" else {"method": method})
        cfg = oar.OARConfig.from_json(json.dumps({**keys, "max_variants_per_chunk": 4, "seed": 5,
                                                  "memory_budget_mb": 1}))
        calls["n"] = 0
        batch = RolloutBatch(ids, mask, prompt_ids=prompts, answers=["5"] * 3, sequence_advantages=adv)
        synced = Pipeline(cfg, tok).compute(batch, model)
        n_synced = calls["n"]
        dist.barrier()
        alone = Pipeline(cfg, tok, sync_forwards=False).compute(batch, model)
        model.double()  # the same computation with a float64 model: the reference of the error budget
        # planned as the float32 model (its activation bytes): the same chunks, so OAR-G draws the same noise
        m64 = HFProbeModel(model, bytes_per_element=4)
        # its scores with the random-rounding estimate of their float32 error (rule 1, _error_model.py)
        exact = random_rounding(lambda: Pipeline(cfg, tok, sync_forwards=False).compute(batch, m64).scores)
        model.float()  # float32 -> float64 -> float32 is exact: the weights are unchanged
        res[method] = {"calls": n_synced, "exact": (exact.value, exact.bound, exact.bound_ref),
                       **{f"{name}_{f}": getattr(out, f) for name, out in
                                             (("synced", synced), ("alone", alone))
                                             for f in ("advantages", "scores")},
                       "padding": synced.metrics["oar/padding_forwards"], "real": synced.metrics["oar/forward_passes"]}
    torch.save(res, os.path.join(out_dir, f"hook{rank}.pt"))
    dist.destroy_process_group()


METHODS = ["oar_p", "oar_g", "entropy", "entropy_shaping", "oar_p_screened", "oar_p_screened_g"]


def test_pipeline_runs_equal_forwards_on_every_rank(tmp_path):
    mp.spawn(_pipeline_worker, args=(2, _free_port(), str(tmp_path), METHODS), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"hook{k}.pt") for k in range(2)]
    for method in METHODS:
        r = [res[0][method], res[1][method]]
        assert r[0]["calls"] == r[1]["calls"] > 0, method
        assert r[0]["padding"] + r[1]["padding"] > 0, method  # the work differed, so a rank padded
        for k in range(2):  # and the gate changed no value
            # The gate only adds dummy model calls, so the synced scores are the same float32 computation as the
            # ungated ones; kernels may still round them differently (MKL/oneDNN pick code paths by shape and
            # alignment). Rule 1 of _tolerance.py: both within the random-rounding estimate of the float32 error
            # around the float64 model's scores.
            got, alone = (r[k][f"{run}_scores"] for run in ("synced", "alone"))
            exact = Bounded(*r[k]["exact"])
            # The OAR-G screen's selection is not stable under float32 rounding on this model (its scores are
            # gradients of a divergence of order sigma^2, with large relative rounding errors): where a draw flips a
            # token in or out of the masked set, the estimate is as large as the score itself.
            vac = None if method == "oar_p_screened_g" else 0.25
            assert_within_error_model(got, exact, vacuous_above=vac, what=f"{method} rank {k} synced scores")
            assert_within_error_model(alone, exact, vacuous_above=vac, what=f"{method} rank {k} ungated scores")
            # Advantages are normalize + reshape of the scores (deterministic ops): exact where the scores are.
            # (Where the scores differ by rounding they are not compared: OAR-P/OAR-G weights of low-impact
            # tokens are scores divided by the q-quantile score, which on this tiny random model sits at the
            # float32 rounding level of the divergence, so they differ by O(1) between float32 and float64.)
            same = (got == alone).all(dim=1)
            torch.testing.assert_close(r[k]["synced_advantages"][same], r[k]["alone_advantages"][same], rtol=0, atol=0)


# ---- the gate over the replica group under HSDP (issue 24, item 2) ---------------------------------------------

HSDP_TEXTS = {0: ["so 2 and 3 make 5 \\boxed{5}", "hmm 9 and 9 \\boxed{9}", "1 1 1 1 2 \\boxed{4}"],
              1: ["5 \\boxed{5}", "x", "y"], 2: ["7 \\boxed{7}", "x", "y"], 3: ["x", "y", "z"]}
# Sequence advantages per method and rank. OAR-P: replica 0 = a rank with three active rows and one with one,
# replica 1 = one active row and none. OAR-G fits every row in one chunk here: only rank 0 has active rows, so rank
# 1 pads it and replica 1 has nothing to run.
HSDP_ADV = {"oar_p": {0: [0.5, -1.0, 0.7], 1: [1.0, 0.0, 0.0], 2: [1.0, 0.0, 0.0], 3: [0.0, 0.0, 0.0]},
            "oar_g": {0: [0.5, -1.0, 0.7], 1: [0.0, 0.0, 0.0], 2: [0.0, 0.0, 0.0], 3: [0.0, 0.0, 0.0]}}
HSDP_MODEL = dict(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=0, initializer_range=0.12)


def _hsdp_config(method):
    # A 1 MB budget: one OAR-G row / four OAR-P variants per forward, so the work differs between the ranks.
    return oar.OARConfig.from_json(json.dumps({"method": method, "max_variants_per_chunk": 4, "seed": 5,
                                               "memory_budget_mb": 1, "sigma": 0.05}))


def _hsdp_batch(tok, rank, method):
    from oar.batch import RolloutBatch

    C = 32
    ids = torch.full((3, C), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((3, C), dtype=torch.long)
    for i, t in enumerate(HSDP_TEXTS[rank]):
        e = tok.encode(t, add_special_tokens=False) + [tok.eos_token_id]
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    return RolloutBatch(ids, mask, prompt_ids=[tok.encode("Q?", add_special_tokens=False)] * 3, answers=["5"] * 3,
                        sequence_advantages=torch.tensor(HSDP_ADV[method][rank]))


def _hsdp_worker(rank, world, port, out_dir):
    _init(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from oar.testing import tiny_random_llama
    from oar.distributed import replica_group
    from oar.pipeline import Pipeline

    # HSDP: 2 replicas (dp_replicate) of 2 shards (dp_shard): ranks {0, 1} gather one replica, {2, 3} the other.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model, tok = tiny_random_llama(**HSDP_MODEL)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls = {"n": 0}
    model.register_forward_pre_hook(lambda m, a, k: calls.__setitem__("n", calls["n"] + 1), with_kwargs=True)
    res = {"group": dist.get_process_group_ranks(replica_group(model))}
    for method in ("oar_p", "oar_g"):
        calls["n"] = 0
        out = Pipeline(_hsdp_config(method), tok).compute(_hsdp_batch(tok, rank, method), model)
        res[method] = {"calls": calls["n"], "scores": out.scores, "advantages": out.advantages,
                       "padding": out.metrics["oar/padding_forwards"]}
        dist.barrier()
    torch.save(res, os.path.join(out_dir, f"hsdp{rank}.pt"))
    dist.destroy_process_group()


def test_gate_synchronises_the_replica_group_only_under_hsdp(tmp_path):
    """4 gloo ranks, FSDP2 ``fully_shard`` on a 2x2 HSDP mesh: the gate's group is the replica's shard group, the
    ranks of one replica run equal numbers of forwards (padding each other), the two replicas run their own numbers
    (the world is not synchronised), and the scores are the single-process ones (rule 1 of _tolerance.py)."""
    from oar.testing import tiny_random_llama

    from _error_model import pipeline_scores_estimate

    mp.spawn(_hsdp_worker, args=(4, _free_port(), str(tmp_path)), nprocs=4, join=True)
    res = [torch.load(tmp_path / f"hsdp{k}.pt", weights_only=False) for k in range(4)]
    assert [r["group"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for method in ("oar_p", "oar_g"):
        calls = [r[method]["calls"] for r in res]
        # Under a world-wide gate all four would be equal.
        assert calls[0] == calls[1] > calls[2] == calls[3], (method, calls)
        assert res[1][method]["padding"] > 0, method  # the replica's ranks did keep each other in step
        assert res[3][method]["padding"] == (calls[3] if method == "oar_p" else 0), method
        model, tok = tiny_random_llama(**HSDP_MODEL)
        for k in range(4):
            batch = _hsdp_batch(tok, k, method)
            if not batch.sequence_advantages.any():  # nothing scored: zeros
                assert (res[k][method]["scores"] == 0).all() and (res[k][method]["advantages"] == 0).all()
                continue
            exact = pipeline_scores_estimate(_hsdp_config(method), tok, batch, model)
            assert_within_error_model(res[k][method]["scores"], exact, what=f"HSDP {method} rank {k}")


def test_error_agreement_without_distributed_is_plain_python():
    """One process: no collective; the original error propagates as it is, results pass through."""
    from oar.distributed import RankError, agree_on_errors, agreed_call

    assert not distributed_world()
    agree_on_errors(None)
    with pytest.raises(KeyError, match="answer"):
        agree_on_errors(KeyError("answer"))
    assert agreed_call(lambda: 7) == 7
    with pytest.raises(ValueError, match="bad"):
        agreed_call(lambda: (_ for _ in ()).throw(ValueError("bad")))
    e = RankError({3: "ValueError: b", 1: "KeyError: 'a'"})
    assert e.failures == {1: "KeyError: 'a'", 3: "ValueError: b"}
    assert str(e).endswith("rank 1: KeyError: 'a'; rank 3: ValueError: b")
