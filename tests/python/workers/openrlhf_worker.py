"""Worker of tests/python/integrations/test_openrlhf.py (not a test module): imports the REAL openrlhf 0.11.2
``RemoteExperienceMaker`` in a separate process, with stand-ins only for the GPU/serving packages its module
imports at top level and never uses in ``compute_advantages_and_returns`` (flash_attn, deepspeed, vllm,
aiohttp: not installable on a CPU machine). A stand-in is kept out of the pytest process, where it would make
transformers believe flash-attn is installed.

Runs the real ``compute_advantages_and_returns`` on hand-made ``Experience`` batches (2 prompts x 4 samples,
split into two experiences of different response widths, rows in shuffled prompt order), unpatched and patched
with every OAR method, and saves what it saw to argv[1].
"""

import copy
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
import types
from types import SimpleNamespace as NS

# The shared test helpers (_tiny, _completions), also when run as a script or imported in a Ray worker.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))

STUBS = {"flash_attn", "deepspeed", "vllm", "aiohttp"}
if sys.argv[1:2] == ["zero3"]:  # the ZeRO-3 run uses the real deepspeed (CPU accelerator)
    STUBS.discard("deepspeed")
#: Left missing (ImportError): openrlhf/models/utils.py log_probs_from_logits falls back to its torch path then.
#: How long a rank waits for the others to join (s). Ray starts the actors one after the other, and on a loaded
#: 2-core machine the second one took over 120 s to reach init_process_group; the test's own subprocess timeout
#: (600 s) still bounds a real hang.
JOIN_TIMEOUT_S = 420

NOT_STUBBED = ("flash_attn.ops",)


class _Anything(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Anything(f"{self.__name__}.{name}")
        sub.__path__ = []
        setattr(self, name, sub)
        return sub

    def __call__(self, *a, **k):
        return self


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBS and not name.startswith(NOT_STUBBED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Anything(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubFinder())

import torch  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402

import oar  # noqa: E402
from oar.integrations import openrlhf as oar_orl  # noqa: E402
from oar.testing import tiny_random_llama  # noqa: E402

from _tiny import OPENRLHF_TINY  # noqa: E402

N = 4



def make_experiences(tok):
    g = torch.Generator().manual_seed(0)
    vocab = len(tok)
    order = torch.randperm(2 * N, generator=g).tolist()  # experience rows hold these prompt-order positions
    rewards = {p: float(v) for p, v in zip(range(2 * N), [1, 0, 0, 1, 0.5, 0, 1, 0])}
    out = []
    for e, width in enumerate((10, 8)):
        pos = order[e * N:(e + 1) * N]
        P = 5
        seqs = torch.full((N, P + width), tok.pad_token_id)
        attn = torch.zeros((N, P + width), dtype=torch.long)
        amask = torch.zeros((N, width), dtype=torch.bool)
        for b, p in enumerate(pos):
            plen = 3 + p // N
            seqs[b, P - plen:P] = torch.randint(3, vocab, (plen,), generator=g)
            L = int(torch.randint(4, width + 1, (1,), generator=g))
            seqs[b, P:P + L] = torch.randint(3, vocab, (L,), generator=g)
            attn[b, P - plen:P + L] = 1
            amask[b, :L] = True
        out.append(Experience(sequences=seqs, attention_mask=attn, action_mask=amask,
                              action_log_probs=torch.zeros((N, width)), kl=torch.zeros((N, width)),
                              rewards=torch.tensor([rewards[p] for p in pos]), index=pos,
                              labels=[str(3 + p // N) for p in pos], prompts=[""] * N, info={}))
    return out


def maker(tok, estimator="group_norm", use_loss=True, kl=0.0):
    args = NS(rollout=NS(n_samples_per_prompt=N, max_new_tokens=16, micro_batch_size=3),
              train=NS(dynamic_batch_enable=False),
              algo=NS(advantage=NS(estimator=estimator, gamma=1.0, lambd=1.0, no_std_norm=False),
                      kl=NS(use_loss=use_loss, estimator="k1")),
              reward=NS(clip_range=(-10.0, 10.0)), data=NS(max_len=64))
    return RemoteExperienceMaker(None, None, None, object(), NS(value=kl), NS(args=args), tok)


REAL_REWARDS = [1, 0, 0, 1, 0.5, 0, 1, 0]


def real_layout(tok):
    """Experiences as OpenRLHF 0.11 builds them: fake vLLM outputs (prompt tokens + response tokens; rows 1 and 5
    are multi-turn: response, environment observation, response) turned into single-rollout experiences by the
    real ``SamplesGenerator._process_response_into_experience`` (one right-padded sequence, ``action_mask``
    over the whole sequence shifted by one) and batched by the real ``split_rollout_samples`` (micro-batches of 3:
    widths differ). Returns the experiences and, per rollout, the token lists they were made from."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    g = torch.Generator().manual_seed(1)
    vocab = len(tok)
    samples, truth = [], []
    for i in range(2 * N):
        q = torch.randint(3, vocab, (3 + i % 3,), generator=g).tolist()
        a1 = torch.randint(3, vocab, (4 + i % 4,), generator=g).tolist()
        obs, a2 = [], []
        if i % N == 1:
            obs = torch.randint(3, vocab, (3,), generator=g).tolist()
            a2 = torch.randint(3, vocab, (2,), generator=g).tolist()
        tokens = q + a1 + obs + a2
        ranges = [(len(q), len(q) + len(a1))] + ([(len(tokens) - len(a2), len(tokens))] if a2 else [])
        response = dict(observation_tokens=tokens, action_ranges=ranges, reward=float(REAL_REWARDS[i]), scores=None,
                        rollout_log_probs=None, prompt="", label=str(3 + i // N), extra_logs={})
        samples.append(SamplesGenerator._process_response_into_experience(None, response, max_len=64))
        truth.append(dict(prompt=q, completion=a1 + obs + a2, eligible=[1] * len(a1) + [0] * len(obs) + [1] * len(a2),
                          label=str(3 + i // N)))
    experiences = maker(tok).split_rollout_samples(samples)
    for e in experiences:  # what make_experience adds (no KL: --algo.kl.use_loss)
        e.kl = torch.zeros(e.action_mask.shape)
        e.action_log_probs = torch.zeros(e.action_mask.shape)
    return experiences, truth


def doc_namespace():
    """Names the docs/trainers/openrlhf.md snippet uses (tests/python/integrations/test_trainer_docs.py)."""
    model, tok = tiny_random_llama(**OPENRLHF_TINY)
    return {"model": model, "tokenizer": tok, "experience_maker": maker(tok), "experiences": make_experiences(tok)}


def main(out_path):
    model, tok = tiny_random_llama(**OPENRLHF_TINY)
    base = make_experiences(tok)
    res = {"signature": list(inspect.signature(RemoteExperienceMaker.compute_advantages_and_returns).parameters),
           "inputs": [dict(sequences=e.sequences, action_mask=e.action_mask, rewards=e.rewards, index=e.index)
                      for e in base], "eos": tok.eos_token_id, "pad": tok.pad_token_id, "errors": {}}
    for est in ("group_norm", "dr_grpo"):
        res[f"original/{est}"] = [e.advantages for e in
                                  maker(tok, est).compute_advantages_and_returns(copy.deepcopy(base))]
    runs = [("grpo", "group_norm", {}), ("dr_grpo", "dr_grpo", {}), ("oar_p", "group_norm", {}),
            ("oar_g", "group_norm", {"tiers": "boost", "probe": "last"}), ("random", "group_norm", {}),
            ("entropy", "group_norm", {}), ("entropy_shaping", "group_norm", {}), ("ktae", "group_norm", {})]
    for method, est, extra in runs:
        oar_orl.install(oar.OARConfig.from_json(json.dumps(dict(extra, method=method))), model=model)
        res[method] = [e.advantages for e in maker(tok, est).compute_advantages_and_returns(copy.deepcopy(base))]
    bad = [("kl_in_reward", dict(use_loss=False, kl=0.05), "oar_p"), ("gae", dict(estimator="gae"), "grpo"),
           ("dr_grpo_needs_estimator", {}, "dr_grpo")]
    for key, kw, method in bad:
        oar_orl.install(oar.OARConfig.from_json(json.dumps({"method": method})), model=model)
        try:
            maker(tok, **kw).compute_advantages_and_returns(copy.deepcopy(base))
            res["errors"][key] = None
        except ValueError as e:
            res["errors"][key] = str(e)
    real, truth = real_layout(tok)
    res["real"] = {"truth": truth, "action_mask": [e.action_mask for e in real],
                   "sequences": [e.sequences for e in real], "index": [e.index for e in real]}
    for method in ("oar_p", "oar_g"):
        oar_orl.install(oar.OARConfig.from_json(json.dumps({"method": method, "seed": 2})), model=model)
        res["real"][method] = [e.advantages for e in maker(tok).compute_advantages_and_returns(copy.deepcopy(real))]
    res["remote"] = remote_scores(tok, model, real)
    res["remote_zero"] = remote_scores(tok, model, real, equal_groups=(1,),
                                       train=dict(colocate_all=False, colocate_actor_ref=False))
    for flag in ("colocate_all", "colocate_actor_ref"):
        res[f"remote_{flag}"] = remote_scores(tok, model, real, equal_groups=(1,),
                                              train={"colocate_all": False, "colocate_actor_ref": False, flag: True})
    res["remote_nothing"] = remote_scores(tok, model, real, equal_groups=(0, 1), train=dict(colocate_all=True))
    res["parity"] = parity(tok, model, {"padded": base, "real": real_layout(tok)[0]})
    # in-process use (no launcher): ring attention is refused by the patched method before any policy forward
    oar_orl.install(oar.OARConfig.from_json('{"method": "oar_p"}'), model=model)
    m = maker(tok)
    m.strategy.args.ds = NS(ring_attn_size=2, tensor_parallel_size=1)
    forwards = [0]
    hook = model.register_forward_pre_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    try:
        m.compute_advantages_and_returns(copy.deepcopy(base))
        res["errors"]["ring_in_process"] = None
    except ValueError as e:
        res["errors"]["ring_in_process"] = str(e)
    hook.remove()
    res["ring_in_process_forwards"] = forwards[0]
    oar_orl.install(oar.OARConfig.from_json('{"method": "oar_g"}'), model=None)
    try:
        maker(tok).compute_advantages_and_returns(copy.deepcopy(base))
    except ValueError as e:
        res["errors"]["no_model"] = str(e)
    oar_orl.uninstall()
    res["restored"] = not hasattr(RemoteExperienceMaker.compute_advantages_and_returns, "__oar_original__")
    import os

    os.environ["OAR_CONFIG"] = '{"method": "grpo"}'
    oar_orl.worker_setup_hook()  # what the Ray worker_process_setup_hook runs
    res["hook_installed"] = hasattr(RemoteExperienceMaker.compute_advantages_and_returns, "__oar_original__")
    res["hook_grpo"] = [e.advantages for e in maker(tok).compute_advantages_and_returns(copy.deepcopy(base))]
    torch.save(res, out_path)


def remote_scores(tok, model, real, *, train=None, equal_groups=()):
    """The experience maker's side of the actor-group path, in one process: no model installed, an actor group of
    two policy actors (``args.actor``: 1 node x 2) whose ``async_run_method_batch`` runs OpenRLHF's own
    ``BaseModelActor.execute_batch`` on in-process actors (``ray.get`` of the results is the identity here).
    ``train``: the ``--train.*`` arguments (colocation flags); ``equal_groups``: prompt groups whose rewards are
    made equal (all 1: OpenRLHF's advantages are 0 on their rows). Records every ``async_run_method_batch`` call
    (method, request batches) and every ``async_run_method`` call (method name) in call order."""
    import ray
    from openrlhf.trainer.ray.launcher import BaseModelActor

    class Actor(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

    actors = []
    for k in range(2):
        a = object.__new__(BaseModelActor)
        a.actor, a.strategy = Actor(model), NS(is_rank_0=lambda: True)
        actors.append(a)
    seen, events = [], []

    class Group:
        def async_run_method_batch(self, method_name, **kwargs):
            seen.append((method_name, [r["batch"] for r in kwargs["request"]]))
            events.append(("batch", method_name))
            return [BaseModelActor.execute_batch(a, method_name, {"request": [r]}, 0, 1)
                    for a, r in zip(actors, kwargs["request"])]

        def async_run_method(self, method_name, *args, **kwargs):
            events.append(("all", method_name))  # BaseModelActor.empty_cache needs CUDA: recorded, not run
            return [None for _ in actors]

    m = maker(tok)
    m.strategy.args.ds = NS(ring_attn_size=1, tensor_parallel_size=1)
    m.strategy.args.actor = NS(num_nodes=1, num_gpus_per_node=2)
    if train is not None:
        m.strategy.args.train = NS(dynamic_batch_enable=False, **train)
    m.actor_model_group = Group()
    exps = copy.deepcopy(real)
    for e in exps:
        e.rewards = torch.tensor([1.0 if i // N in equal_groups else float(r) for i, r in zip(e.index, e.rewards)])
    oar_orl.install(oar.OARConfig.from_json('{"method": "oar_p", "seed": 2}'))  # no model: the actors score
    get, ray.get = ray.get, (lambda refs: refs)
    try:
        adv = [e.advantages for e in m.compute_advantages_and_returns(exps)]
    finally:
        ray.get = get
    return {"advantages": adv, "calls": seen, "events": events}


class UniformActorGroup:
    """A policy actor group whose policy gives every token the same importance: ``oar_scores`` answers each chunk
    with score 1 on every eligible token of the rows it scores (sequence advantage != 0) and a reasoning mask over
    them (uniform credit). Records the rows it received."""

    def __init__(self):
        self.received = []

    def async_run_method_batch(self, method_name, request):
        out = []
        for r in request:
            b = r["batch"]
            self.received.append(b)
            elig = (b.eligible_mask if b.eligible_mask is not None else b.completion_mask).bool()
            scored = elig & (b.sequence_advantages != 0)[:, None]
            out.append([{"scores": scored.float(), "reasoning_mask": scored}])
        return out

    def async_run_method(self, method_name, *args, **kwargs):
        return []


#: OpenRLHF 0.11.2's policy-loss options (openrlhf/models/loss.py PolicyLoss and aggregate_loss, as
#: openrlhf/trainer/ray/ppo_actor.py builds and calls it): name -> (PolicyLoss kwargs, loss_batch_info).
LOSS_VARIANTS = {
    "token-mean": ({}, {}),
    "seq-mean-token-mean": ({"token_level_loss": False}, {}),
    "dual-clip": ({"dual_clip": 3.0}, {}),
    "clip-higher": ({"clip_eps_low": 0.2, "clip_eps_high": 0.28}, {}),
    "gspo": ({"policy_loss_type": "gspo"}, {}),
    "is-token-mask": ({"is_correction_level": "token"}, {}),
    "is-seq-mask": ({"is_correction_level": "seq"}, {}),
    "is-token-clip": ({"is_correction_level": "token", "is_correction_mode": "clip"}, {}),
    "is-token-tv": ({"is_correction_level": "token", "is_correction_gating": "tv",
                     "is_correction_threshold": [0.0, 0.005]}, {}),
    "global-token-mean": ({}, {"dp_size": 2, "batch_num_tokens": "tokens"}),
    "global-seq-mean": ({"token_level_loss": False}, {"dp_size": 2, "global_batch_size": "rows"}),
}


def parity(tok, model, layouts):
    """OpenRLHF's GRPO with oar off (unpatched ``compute_advantages_and_returns``) and on (method oar_p, the actor
    group giving uniform credit), for each supported advantage estimator: every experience field after the
    advantage step, and OpenRLHF's own policy loss (``PolicyLoss`` of each :data:`LOSS_VARIANTS`) and its gradients
    w.r.t. the tiny policy's parameters, its log-probs computed by OpenRLHF's own ``Actor.forward``."""
    from openrlhf.models.actor import Actor

    actor = Actor(model)
    actor.packing_samples = False  # Actor(model) leaves it unset (openrlhf/models/actor.py, the else branch)
    out = {}
    for layout, base in layouts.items():
        out[layout] = _parity_layout(tok, model, actor, base)
    return out


def _parity_layout(tok, model, actor, base):
    from openrlhf.models.loss import PolicyLoss

    g = torch.Generator().manual_seed(11)
    old_lp, roll_lp = [], []
    with torch.no_grad():
        for e in base:  # the rollout's log-probs: the policy's, moved so that the ratios clip
            lp = actor(e.sequences, e.action_mask, attention_mask=e.attention_mask)
            old_lp.append(lp + 0.3 * torch.randn(lp.shape, generator=g))
            roll_lp.append(old_lp[-1] + 1.0 * torch.randn(lp.shape, generator=g))  # some leave IS bands
    out = {}
    for est in ("group_norm", "dr_grpo", "rloo"):
        oar_orl.uninstall()
        off = maker(tok, est).compute_advantages_and_returns(copy.deepcopy(base))
        oar_orl.install(oar.OARConfig.from_json('{"method": "oar_p"}'))  # no model: the actor group scores
        m = maker(tok, est)
        m.strategy.args.ds = NS(ring_attn_size=1, tensor_parallel_size=1)
        m.strategy.args.actor = NS(num_nodes=1, num_gpus_per_node=2)
        m.actor_model_group = group = UniformActorGroup()
        import ray

        get, ray.get = ray.get, (lambda refs: refs)
        try:
            on = m.compute_advantages_and_returns(copy.deepcopy(base))
        finally:
            ray.get = get
        fields = {}
        for k in vars(off[0]):
            a, b = [getattr(e, k) for e in off], [getattr(e, k) for e in on]
            fields[k] = (a, b)
        losses = {}
        for name, (kw, info) in LOSS_VARIANTS.items():
            loss_fn = PolicyLoss(**kw)
            per = {}
            for mode, exps in (("off", off), ("on", on)):
                model.zero_grad(set_to_none=True)
                total, clip = [], []
                batch_info = {k: (sum(float(e.action_mask.sum()) for e in exps) if v == "tokens" else
                                  sum(len(e.index) for e in exps) if v == "rows" else v) for k, v in info.items()}
                for e, old, roll in zip(exps, old_lp, roll_lp):
                    lp = actor(e.sequences, e.action_mask, attention_mask=e.attention_mask)
                    loss, clip_ratio, *_ = loss_fn(lp, old, e.advantages, action_mask=e.action_mask,
                                                   rollout_log_probs=roll, **batch_info)
                    loss.backward()
                    total.append(loss.detach())
                    clip.append(float(clip_ratio))
                grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
                per[mode] = {"loss": torch.stack(total), "grad": grads.clone(), "clip_ratio": clip}
            losses[name] = per
        out[est] = {"fields": fields, "losses": losses, "received": group.received}
    model.zero_grad(set_to_none=True)
    oar_orl.uninstall()
    return out


def actor_request(tok, lo, hi, method):
    """The request the experience maker sends to the actor holding rows [lo, hi) of the real-layout rollouts
    (group 1's rewards made equal: its rows have advantage 0, so one actor has nothing to score)."""
    from _completions import token_rollouts

    _, truth = real_layout(tok)
    r = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0], dtype=torch.float32).reshape(-1, N)
    seq = ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)).reshape(-1)
    batch = token_rollouts(tok, truth, seq, N)
    # OAR-P: a 1 MB budget, so the scoring actor runs many forwards. OAR-G: one chunk (with a chunk per row, the
    # plain path's batched clean logits round differently from each chunk's noisy pass, and on this tiny model
    # that rounding is ~40% of the scores: the float64 comparison would say nothing).
    cfg = oar.OARConfig.from_json(json.dumps({"method": method, "seed": 4, "sigma": 0.05, "max_variants_per_chunk": 3,
                                              "memory_budget_mb": 1 if method == "oar_p" else 4096}))
    return dict(config=cfg.to_json(), tokenizer=tok, batch=oar_orl._sub_batch(batch, lo, hi))


def actor_rank(rank, world, port, out_dir):
    """One policy actor of a 2-actor group on gloo: OpenRLHF's own ``BaseModelActor.execute_batch`` calls the
    attached ``oar_scores`` with this actor's chunk, under ``torch.no_grad`` as in ``make_experience``."""
    import datetime
    import os

    import torch.distributed as dist
    from openrlhf.trainer.ray.launcher import BaseModelActor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    oar_orl.install(oar.OARConfig.from_json('{"method": "grpo"}'))  # attaches the actor method
    model, tok = tiny_random_llama(**OPENRLHF_TINY)

    class Actor(torch.nn.Module):  # openrlhf.models.Actor's shape: the policy in .model
        def __init__(self, m):
            super().__init__()
            self.model = m

    me = object.__new__(BaseModelActor)  # an actor as Ray builds it, without its DeepSpeed model set-up
    me.actor = Actor(model)
    me.strategy = NS(is_rank_0=lambda: rank == 0)
    me.actor.train()
    counter = {"n": 0}
    model.register_forward_pre_hook(lambda *a: counter.__setitem__("n", counter["n"] + 1))
    out = {}
    for method in ("oar_p", "oar_g"):
        counter["n"] = 0
        req = actor_request(tok, 4 * rank, 4 * rank + 4, method)
        with torch.no_grad():
            (res,) = BaseModelActor.execute_batch(me, oar_orl.ACTOR_METHOD, {"request": [req]}, 0, 1)
        out[method] = dict(res, forwards=counter["n"], batch=req["batch"], config=req["config"],
                           training=me.actor.training, grads=[p.grad is None for p in model.parameters()])
    torch.save(out, os.path.join(out_dir, f"actor{rank}.pt"))
    dist.destroy_process_group()


def ray_setup_hook() -> None:
    """Ray ``worker_process_setup_hook`` of the Ray-actor run: this module's import installed the stand-ins; then
    oar's own hook (what ``python -m oar.integrations.openrlhf`` sets) attaches ``oar_scores`` to the actors."""
    oar_orl.worker_setup_hook()


def _policy_actor_cls():
    """A policy actor as OpenRLHF's ``PolicyModelActor`` is laid out (``self.actor.model``, ``self.strategy``), on
    a tiny float32 Llama over gloo instead of a DeepSpeed engine (no deepspeed on a CPU machine)."""
    from openrlhf.trainer.ray.launcher import BaseModelActor

    class TinyPolicyActor(BaseModelActor):
        def init_model_from_pretrained(self):
            import datetime

            import torch.distributed as dist

            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))  # env set by OpenRLHF
            model, _ = tiny_random_llama(**OPENRLHF_TINY)

            class Actor(torch.nn.Module):
                def __init__(self, m):
                    super().__init__()
                    self.model = m

            self.actor = Actor(model)
            self.actor.train()
            self.strategy = NS(is_rank_0=lambda: dist.get_rank() == 0, args=None)
            self._forwards = [0]
            model.register_forward_pre_hook(lambda *a: self._forwards.__setitem__(0, self._forwards[0] + 1))
            return True

        def probe_state(self):
            return {"forwards": self._forwards[0], "training": self.actor.training,
                    "no_grads": all(p.grad is None for p in self.actor.parameters()),
                    "has_method": hasattr(self, oar_orl.ACTOR_METHOD)}

    TinyPolicyActor.__module__ = __name__
    TinyPolicyActor.__qualname__ = "TinyPolicyActor"
    return TinyPolicyActor


def ray_actors(out_dir):
    """The policy actor group as OpenRLHF builds it (``RayActorGroup``: 2 Ray CPU actors, gloo), oar attached by
    the Ray worker setup hook, and the experience maker's own call (``_actor_group_scores``:
    ``actor_model_group.async_run_method_batch(method_name="oar_scores", ...)``) on the real-layout rollouts."""
    import os

    import ray
    from openrlhf.trainer.ray.launcher import RayActorGroup

    here = os.path.dirname(os.path.abspath(__file__))  # workers/: the setup hook's module
    support = os.path.join(os.path.dirname(here), "support")  # the helpers it imports
    path = os.pathsep.join([here, support] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env={"worker_process_setup_hook": "openrlhf_worker.ray_setup_hook",
                          "env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1",
                                       "OAR_BUILD_DIR": os.environ.get("OAR_BUILD_DIR", "")}})
    try:
        group = RayActorGroup(num_nodes=2, num_gpus_per_node=1, ray_actor_type=ray.remote(_policy_actor_cls()),
                              num_gpus_per_actor=0)
        assert all(ray.get(group.async_init_model_from_pretrained()))
        _, tok = tiny_random_llama(**OPENRLHF_TINY)
        sent, run = [], group.async_run_method_batch

        def recording(method_name, **kwargs):  # the chunks the experience maker sends, as sent
            sent.append([r["batch"] for r in kwargs["request"]])
            return run(method_name=method_name, **kwargs)

        group.async_run_method_batch = recording
        out = {}
        for method in ("oar_p", "oar_g"):
            req = actor_request(tok, 0, 2 * N, method)  # the whole batch: the maker splits it per actor
            args = NS(ds=NS(ring_attn_size=1, tensor_parallel_size=1), actor=NS(num_nodes=2, num_gpus_per_node=1))
            maker_stub = NS(strategy=NS(args=args), actor_model_group=group)
            cfg = oar.OARConfig.from_json(req["config"])
            scores, mask = oar_orl._actor_group_scores(maker_stub, req["batch"], cfg, tok)
            out[method] = dict(scores=scores, reasoning_mask=mask, batch=req["batch"], config=req["config"],
                               chunks=sent[-1], actors=ray.get(group.async_run_method("probe_state")))
        torch.save(out, os.path.join(out_dir, "ray.pt"))
    finally:
        ray.shutdown()


def zero3_rank(rank, world, port, out_dir):
    """One policy actor of a 2-actor group whose policy is a DeepSpeed ZeRO-3 engine, as OpenRLHF builds it
    (openrlhf/utils/deepspeed/deepspeed.py: ``deepspeed.initialize`` of ``Actor.model`` with
    ``get_train_ds_config(stage=3)``, the engine put back in ``Actor.model``), float32, on gloo with DeepSpeed's
    CPU accelerator. OpenRLHF's own ``BaseModelActor.execute_batch`` calls the attached ``oar_scores`` under
    ``torch.no_grad``; rank 0 has 4 rows to score and rank 1 none (ZeRO-3 gathers each layer's parameters from
    every rank in every forward: the forward gate keeps rank 1 in step)."""
    import datetime
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import deepspeed
    from openrlhf.models.actor import Actor
    from openrlhf.trainer.ray.launcher import BaseModelActor
    from openrlhf.utils.deepspeed.deepspeed_utils import get_train_ds_config

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    oar_orl.install(oar.OARConfig.from_json('{"method": "grpo"}'))  # attaches the actor method
    model, tok = tiny_random_llama(**OPENRLHF_TINY)
    numel = sum(p.numel() for p in model.parameters())
    actor = Actor(model)
    ds_config = get_train_ds_config(offload=False, adam_offload=False, stage=3, param_dtype="fp32",
                                     zpg=1)  # --ds.zpg default 1 (0.19.8: zpg > 1 without optimizer fails)
    ds_config.update(train_micro_batch_size_per_gpu=1, train_batch_size=world)
    engine, *_ = deepspeed.initialize(model=actor.model, config=ds_config,
                                      model_parameters=[p for p in actor.model.parameters() if p.requires_grad])
    actor.model = engine
    me = object.__new__(BaseModelActor)
    me.actor = actor
    me.strategy = NS(is_rank_0=lambda: rank == 0, args=None)
    me.actor.train()
    local = sum(p.numel() for p in engine.module.parameters())  # ZeRO-3: this rank's partition only
    counter = {"n": 0}
    engine.module.register_forward_pre_hook(lambda *a: counter.__setitem__("n", counter["n"] + 1))
    out = {"numel": numel, "local_numel": local,
           "partitioned": all(hasattr(p, "ds_id") for p in engine.module.parameters())}
    for method in ("oar_p", "oar_g"):
        counter["n"] = 0
        req = actor_request(tok, 4 * rank, 4 * rank + 4, method)
        with torch.no_grad():
            (res,) = BaseModelActor.execute_batch(me, oar_orl.ACTOR_METHOD, {"request": [req]}, 0, 1)
        out[method] = dict(res, forwards=counter["n"], batch=req["batch"], config=req["config"],
                           training=me.actor.training)
    torch.save(out, os.path.join(out_dir, f"zero3_{rank}.pt"))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


#: train_ppo_ray arguments of the launcher runs (:func:`launch_runs`): valid for oar_p, then one refused change each.
LAUNCH_OK = ["--algo.advantage.estimator", "group_norm", "--algo.kl.use_loss", "--rollout.n_samples_per_prompt", "4",
             "--vllm.num_engines", "1", "--actor.num_gpus_per_node", "2", "--data.label_key", "answer"]
LAUNCH_RUNS = {
    "ok": ("oar_p", []),
    "ring_attention": ("oar_p", ["--ds.ring_attn_size", "2"]),
    "ring_attention_model_free": ("ktae", ["--ds.ring_attn_size", "2"]),
    "images": ("oar_g", ["--data.max_images_per_prompt", "1"]),
    "kl_in_reward": ("ktae", ["--algo.kl.init_coef", "0.01", "--no-algo.kl.use_loss"]),
    "estimator": ("oar_p", ["--algo.advantage.estimator", "reinforce"]),
    "no_labels": ("oar_p", ["--no-data.label_key"]),
}


def launch_runs(out_path):
    """``python -m oar.integrations.openrlhf`` (:func:`oar.integrations.openrlhf.launch`) on real train_ppo_ray
    arguments (OpenRLHF's own parser and fix-ups), up to the start of ``train(args)``: Ray counts as initialized and
    ``openrlhf.utils.get_strategy`` (what train(args) calls before it creates any vLLM engine or model actor) is
    replaced by a stand-in that raises ``REACHED``. Saves, per :data:`LAUNCH_RUNS` case, the exception's type and
    message."""
    import ray

    import openrlhf.utils

    class Reached(Exception):
        pass

    def reached(args, *a, **k):
        raise Reached(f"REACHED get_strategy with ring_attn_size {args.ds.ring_attn_size}")

    ray.is_initialized = lambda: True
    out = {}
    for name, (method, extra) in LAUNCH_RUNS.items():
        openrlhf.utils.get_strategy = reached
        argv = list(LAUNCH_OK)
        for flag in [x[len("--no-"):] for x in extra if x.startswith("--no-")]:  # "--no-X": drop --X (and value)
            i = argv.index("--" + flag)
            del argv[i: i + (2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1)]
        extra = [x for x in extra if not x.startswith("--no-")]
        try:
            oar_orl.launch(argv + extra, config=oar.OARConfig(method=method))
            out[name] = (None, "")
        except BaseException as e:  # noqa: BLE001 (argparse exits with SystemExit)
            out[name] = (type(e).__name__, str(e))
    torch.save(out, out_path)


if __name__ == "__main__":
    if sys.argv[1] == "launch":  # openrlhf_worker.py launch OUT
        launch_runs(sys.argv[2])
    elif sys.argv[1] == "ray":  # openrlhf_worker.py ray OUT_DIR
        ray_actors(sys.argv[2])
    elif sys.argv[1] == "zero3":  # openrlhf_worker.py zero3 OUT_DIR (needs deepspeed)
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            free = sk.getsockname()[1]
        mp.spawn(zero3_rank, args=(2, free, sys.argv[2]), nprocs=2, join=True)
    elif sys.argv[1] == "actor":  # openrlhf_worker.py actor OUT_DIR
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            free = sk.getsockname()[1]
        mp.spawn(actor_rank, args=(2, free, sys.argv[2]), nprocs=2, join=True)
    else:
        main(sys.argv[1])
