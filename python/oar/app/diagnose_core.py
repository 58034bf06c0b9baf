"""The pieces of ``oar diagnose`` that need no task and no files: rollouts, credit settings, update directions,
the reference gradient and a count sketch (docs/diagnose.md).

The diagnostic compares credit-assignment methods on the same rollouts (common random numbers): for each batch
of rollouts every method's token advantages give one policy-gradient update direction,

    u_m = (1 / N_tok) * sum_{i, t} A^m_{i,t} * grad log pi(y_{i,t} | x_i, y_{i,<t})      (token-mean, TRL's dapo)

and each u_m is compared with a reference gradient of expected reward estimated from an independent sample
(leave-one-out baseline per prompt: an unbiased estimate of grad E[R]). Everything here works on any causal LM
whose forward takes ``input_ids``, ``attention_mask``, ``position_ids`` and returns ``logits``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

__all__ = ["Rollouts", "CreditSpec", "parse_credit", "sample_rollouts", "method_advantages", "token_logprobs",
           "update_directions", "reference_gradient", "config_for", "CountSketch", "grad_dot", "grad_norm"]


@dataclass
class Rollouts:
    """B sampled rollouts, groups of ``group_size`` consecutive rows sharing a prompt.

    Attributes:
        prompt_ids: B unpadded prompts, 1-D int64 tensors.
        completion_ids: (B, C) int64, right-padded completions (pad 0 after the mask).
        completion_mask: (B, C) bool, True on completion tokens (through the EOS token when one was sampled).
        rewards: (B,) float32 rewards.
        group_size: rollouts per prompt (rows [g * G, (g + 1) * G) share prompt g).
        answers: B reference answers (str) or None.
        temperature: the sampling temperature T (> 0). The policy the rollouts were drawn from is
            softmax(logits / T), so :func:`token_logprobs` (hence every update direction and the reference gradient)
            divides the logits by T, as TRL's ``_get_per_token_logps_and_entropies`` does.
        eligible_mask: (B, C) bool, the policy's own tokens (a tool task's sessions: False on the tool's replies, as
            TRL's ``tool_mask``), or None (every completion token). Only these carry a log-prob and an advantage.
    """

    prompt_ids: list
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    rewards: torch.Tensor
    group_size: int
    answers: list | None = None
    temperature: float = 1.0
    eligible_mask: torch.Tensor | None = None

    @property
    def action_mask(self) -> torch.Tensor:
        """(B, C) bool: the tokens the policy chose (``eligible_mask``, else ``completion_mask``)."""
        return self.completion_mask if self.eligible_mask is None else self.eligible_mask & self.completion_mask

    def __post_init__(self):
        if not float(self.temperature) > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")

    @property
    def batch_size(self) -> int:
        return int(self.completion_ids.shape[0])


@dataclass(frozen=True)
class CreditSpec:
    """One credit setting of the diagnostic, parsed from ``name[:key=value,...]`` (:func:`parse_credit`).

    Attributes:
        label: the spec as given (the report's row name).
        method: an oar method (``oar.schema.METHODS``) or ``entropy_top`` (TRL's ``top_entropy_quantile``: the
            sequence advantage on the tokens whose policy entropy is in the batch's top ``quantile``, 0 elsewhere;
            not mass-preserving, as in TRL).
        overrides: ``oar.OARConfig`` keys set for this setting (e.g. ``q``, ``beta``, ``screen``, ``mask_unit``).
        credit_rows: oar's ``credit_rows`` (docs/method.md section 12): ``all`` (the method on every row),
            ``positive`` (the method's credit on rows with A > 0, uniform GRPO credit on the others) or
            ``negative`` (the reverse). For oar's methods it is passed to the config (the pipeline then scores only
            those rows, as in training); ``entropy_top`` and ``credit`` apply it to their advantages.
        quantile: ``entropy_top`` only: the kept fraction (TRL's ``top_entropy_quantile``; default 0.2).
        credit: a callable ``(rollouts, sequence_advantages (B,), entropies (B, C)) -> (B, C)`` token advantages used
            instead of ``method`` (tests, planted credit).
    """

    label: str
    method: str
    overrides: tuple = ()
    credit_rows: str = "all"
    quantile: float = 0.2
    credit: Callable | None = field(default=None, compare=False)


def parse_credit(spec: str) -> CreditSpec:
    """``"oar_g"``, ``"oar_g:beta=2,q=0.5"``, ``"oar_g:credit_rows=positive"``, ``"entropy_top:quantile=0.2"`` ->
    CreditSpec, with the parser of ``oar compare``'s settings (:func:`oar.schema.parse_method_spec`).

    ``quantile`` is the diagnostic's own key (``entropy_top``); ``credit_rows`` is oar's config key; every other key
    must be an ``oar.OARConfig`` key (checked when the config is built: :func:`method_advantages`).

    Raises:
        ValueError: empty spec, unknown method, a ``key=value`` item without ``=``, a key given twice, a bad
            ``credit_rows`` or ``quantile``, the former key ``sign`` (renamed ``credit_rows``).
    """
    from oar.schema import CREDIT_ROWS, METHODS, parse_method_spec

    name, keys, _ = parse_method_spec(spec, list(METHODS) + ["entropy_top"])
    if "sign" in keys:
        raise ValueError(f"method spec {spec!r}: sign= is now credit_rows= (oar's config key: all, positive or "
                         "negative), e.g. 'oar_g:credit_rows=positive'")
    credit_rows = keys.pop("credit_rows", "all")
    if credit_rows not in CREDIT_ROWS:
        raise ValueError(f"method spec {spec!r}: credit_rows must be one of {list(CREDIT_ROWS)}, got {credit_rows!r}")
    quantile = 0.2
    if "quantile" in keys:
        val = keys.pop("quantile")
        if name != "entropy_top":
            raise ValueError(f"method spec {spec!r}: quantile is a key of entropy_top only")
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not 0.0 < float(val) <= 1.0:
            raise ValueError(f"method spec {spec!r}: quantile must be in (0, 1], got {val!r}")
        quantile = float(val)
    if name == "entropy_top" and keys:
        raise ValueError(f"method spec {spec!r}: entropy_top takes only quantile= and credit_rows=, got "
                         f"{sorted(keys)}")
    return CreditSpec(spec.strip(), name, tuple(sorted(keys.items())), credit_rows, quantile)


def sample_rollouts(model, prompt_ids: Sequence[Sequence[int]], reward_fn: Callable[[int, list, str], float], *,
                    group_size: int, temperature: float, max_new_tokens: int, seed: int, pad_id: int, eos_id: int,
                    tokenizer=None, answers: Sequence[str] | None = None, batch_size: int = 64,
                    max_calls: int | None = None) -> Rollouts:
    """Samples ``group_size`` completions per prompt with ``model.generate`` (top-k off, as GRPO trainers sample),
    or, with ``max_calls``, ``group_size`` calculator sessions (``oar.app.tasks.tools.run_sessions``: the replies
    are not the policy's, :attr:`Rollouts.eligible_mask` is False on them).

    Args:
        model: a Hugging Face causal LM.
        prompt_ids: P prompts as token id lists (unpadded).
        reward_fn: ``(prompt index, completion token ids up to the EOS, decoded text) -> reward``.
        group_size, temperature, max_new_tokens: as in training (temperature > 0).
        seed: the sampling seed (the global RNG is restored after the call).
        pad_id, eos_id: token ids; the completion mask ends after the first EOS.
        tokenizer: decodes the completions for ``reward_fn`` (None: the text is "").
        answers: P reference answers, repeated per rollout into :attr:`Rollouts.answers`.
        batch_size: sequences per ``generate`` call.
        max_calls: a tool task's calls per session (None: plain completions).

    Returns:
        :class:`Rollouts` with B = P * group_size rows (prompt-major).

    Raises:
        ValueError: no prompts, ``group_size`` < 1, ``temperature`` <= 0, ``max_new_tokens`` < 1.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if group_size < 1 or max_new_tokens < 1 or not temperature > 0:
        raise ValueError(f"group_size and max_new_tokens must be >= 1 and temperature > 0, got {group_size}, "
                         f"{max_new_tokens}, {temperature}")
    device = next(model.parameters()).device
    flat = [(i, list(map(int, p))) for i, p in enumerate(prompt_ids) for _ in range(group_size)]
    comps: list[list[int]] = []
    env: list[list[int]] | None = None
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        if max_calls is not None:
            from oar.app.tasks.tools import run_sessions

            sessions = run_sessions(model, tokenizer, [p for _, p in flat], max_calls=max_calls,
                                    max_new_tokens=max_new_tokens, temperature=float(temperature),
                                    batch_size=batch_size)
            comps, env = [s.completion_ids for s in sessions], [s.env_mask for s in sessions]
        for s in range(0, len(flat) if max_calls is None else 0, batch_size):
            chunk = [p for _, p in flat[s:s + batch_size]]
            P = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), P), pad_id, dtype=torch.long)
            attn = torch.zeros((len(chunk), P), dtype=torch.long)
            for r, p in enumerate(chunk):
                ids[r, P - len(p):] = torch.tensor(p)
                attn[r, P - len(p):] = 1
            out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), do_sample=True,
                                 temperature=float(temperature), top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad_id, eos_token_id=eos_id)
            for row in out[:, P:].cpu().tolist():
                comps.append(row[:row.index(eos_id) + 1] if eos_id in row else row)
    C = max(1, max(len(c) for c in comps))
    cids = torch.full((len(comps), C), 0, dtype=torch.long)
    cmask = torch.zeros((len(comps), C), dtype=torch.bool)
    elig = None if env is None else torch.zeros((len(comps), C), dtype=torch.bool)
    rewards = torch.empty(len(comps), dtype=torch.float32)
    for r, ((pi, _), c) in enumerate(zip(flat, comps)):
        cids[r, :len(c)] = torch.tensor(c, dtype=torch.long)
        cmask[r, :len(c)] = True
        if elig is not None:
            elig[r, :len(c)] = torch.tensor(env[r], dtype=torch.bool)
        text = tokenizer.decode(c, skip_special_tokens=True) if tokenizer is not None else ""
        rewards[r] = float(reward_fn(pi, c, text))
    ans = [answers[pi] for pi, _ in flat] if answers is not None else None
    return Rollouts([torch.tensor(p, dtype=torch.long) for _, p in flat], cids, cmask, rewards, group_size, ans,
                    float(temperature), elig)


def _layout(r: Rollouts, rows: Sequence[int], pad_id: int):
    """Left-padded prompt + completion of ``rows``: (input_ids, attention_mask, position_ids, P)."""
    P = max(int(r.prompt_ids[i].numel()) for i in rows)
    C = int(r.completion_ids.shape[1])
    n = len(rows)
    ids = torch.full((n, P + C), pad_id, dtype=torch.long)
    attn = torch.zeros((n, P + C), dtype=torch.long)
    for k, i in enumerate(rows):
        p = r.prompt_ids[i]
        ids[k, P - p.numel():P] = p
        attn[k, P - p.numel():P] = 1
        pad = torch.full_like(r.completion_ids[i], pad_id)
        ids[k, P:] = torch.where(r.completion_mask[i], r.completion_ids[i], pad)
        attn[k, P:] = r.completion_mask[i].long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return ids, attn, pos, P


def token_logprobs(model, r: Rollouts, rows: Sequence[int], pad_id: int, *, with_entropy: bool = False):
    """log pi_T(y_t | x, y_<t) of the completion tokens of ``rows`` (with autograd when grad is enabled), where
    pi_T = softmax(logits / T) is the sampling policy at the rollouts' temperature T (``r.temperature``), as TRL's
    ``_get_per_token_logps_and_entropies`` computes it (logits divided by ``args.temperature``).

    Returns:
        (n, C) float32 log-probs (0 off :attr:`Rollouts.action_mask`), and with ``with_entropy`` also (n, C) float32 full-vocabulary
        entropies of pi_T (detached; 0 off the mask).
    """
    dev = next(model.parameters()).device
    ids, attn, pos, P = _layout(r, rows, pad_id)
    C = int(r.completion_ids.shape[1])
    logits = model(input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev)).logits
    logits = logits[:, P - 1:P - 1 + C].float() / float(r.temperature)
    logp_all = torch.log_softmax(logits, dim=-1)
    tgt = r.completion_ids[list(rows)].to(dev)
    mask = r.action_mask[list(rows)].to(dev)  # a tool's replies are context, not the policy's choices
    lp = logp_all.gather(-1, tgt[..., None]).squeeze(-1) * mask
    if not with_entropy:
        return lp
    from oar.attribution.entropy import entropy_from_logprobs

    with torch.no_grad():
        ent = entropy_from_logprobs(logp_all) * mask
    return lp, ent.detach()


def _pipeline_credits_rows(spec: CreditSpec) -> bool:
    """oar's own method: the pipeline applies ``credit_rows`` (``entropy_top`` and ``credit`` settings do it
    themselves on their advantages)."""
    return spec.credit is None and spec.method != "entropy_top"


def config_for(base_config, spec: CreditSpec, seed: int):
    """The ``oar.OARConfig`` of ``spec``: ``base_config`` with its method, overrides, ``credit_rows`` (oar's methods;
    ``entropy_top`` and ``credit`` settings apply theirs to their own advantages) and ``seed``. Raises ValueError
    naming the spec for a bad override."""
    import json

    from oar.schema import OARConfig, with_method

    cfg = with_method(base_config, "grpo" if spec.method == "entropy_top" else spec.method)
    obj = json.loads(cfg.to_json())
    obj.update(dict(spec.overrides))
    if _pipeline_credits_rows(spec):
        obj["credit_rows"] = spec.credit_rows
    obj["seed"] = int(seed)
    try:
        return OARConfig(**obj)
    except (TypeError, ValueError) as e:
        raise ValueError(f"method spec {spec.label!r}: {e}") from None


def method_advantages(spec: CreditSpec, r: Rollouts, *, model, tokenizer, base_config, seed: int,
                      entropies: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Token advantages of one credit setting on ``r``.

    Args:
        spec: the setting (:func:`parse_credit`).
        r: the rollouts.
        model, tokenizer: the policy (methods that run it) and its tokenizer.
        base_config: ``oar.OARConfig`` the setting's overrides apply to (estimator, probe, q, beta, ...).
        seed: the setting's random seed for this batch (random credit, OAR-G noise).
        entropies: (B, C) policy entropies (``entropy_top``).

    Returns:
        ``(advantages (B, C) float32, sequence_advantages (B,) float32, metrics)``; the sequence advantages are the
        base config's estimator with TRL's conventions (the same for every setting).

    Raises:
        ValueError: a bad override (naming the spec), ``entropy_top`` without ``entropies``.
    """
    from oar.batch import RolloutBatch
    from oar.pipeline import Pipeline

    from oar.pipeline import credited_rows

    cfg = config_for(base_config, spec, seed)
    batch = RolloutBatch(r.completion_ids, r.completion_mask, prompt_ids=r.prompt_ids, rewards=r.rewards,
                         group_ids=[i // r.group_size for i in range(r.batch_size)], answers=r.answers,
                         eligible_mask=r.eligible_mask)
    if spec.credit is not None or spec.method == "entropy_top" or spec.method == "grpo":
        res = Pipeline(config_for(base_config, CreditSpec("grpo", "grpo"), seed), tokenizer).compute(batch, None,
                                                                                                      preset="trl")
    else:
        res = Pipeline(cfg, tokenizer).compute(batch, model, preset="trl")
    seq = res.sequence_advantages.float()
    adv = res.advantages.float()
    if spec.credit is not None:
        adv = spec.credit(r, seq, entropies).float()
    elif spec.method == "entropy_top":
        if entropies is None:
            raise ValueError("entropy_top needs the policy entropies")
        mask = r.action_mask
        vals = entropies[mask].float()
        keep = torch.zeros_like(mask)
        if vals.numel():
            thr = torch.quantile(vals, 1.0 - spec.quantile)
            keep = (entropies >= thr) & mask
        adv = seq[:, None] * keep.float()
    if not _pipeline_credits_rows(spec) and spec.credit_rows != "all":
        uniform = seq[:, None] * r.action_mask.float()
        adv = torch.where(credited_rows(seq, spec.credit_rows)[:, None], adv, uniform)
    return adv, seq, dict(res.metrics)


def update_directions(model, r: Rollouts, advantages: dict, params: list, pad_id: int, *,
                      micro_batch: int | None = None) -> dict:
    """Each setting's update direction u_m = grad of (1 / N_tok) * sum_{i,t} A^m_{i,t} log pi(y_{i,t}) (ascent).

    Args:
        model: the policy (its parameter ``.grad`` is not touched: ``torch.autograd.grad``).
        r: the rollouts.
        advantages: ``{label: (B, C) token advantages}``.
        params: the parameters the directions are taken over (a list of tensors requiring grad).
        pad_id: token id of the padding.
        micro_batch: rows per forward (None: the whole batch in one forward, shared by every setting).

    Returns:
        ``{label: [per-parameter float32 gradients]}``, with N_tok = the batch's policy tokens (action mask).
    """
    B = r.batch_size
    n_tok = max(1.0, float(r.action_mask.sum()))
    labels = list(advantages)
    mb = B if micro_batch is None or micro_batch >= B else int(micro_batch)
    out: dict = {}
    if mb == B:
        lp = token_logprobs(model, r, list(range(B)), pad_id)
        for k, lab in enumerate(labels):
            obj = (advantages[lab].to(lp.device) * lp).sum() / n_tok
            g = torch.autograd.grad(obj, params, retain_graph=k < len(labels) - 1, allow_unused=True)
            out[lab] = [torch.zeros_like(p, dtype=torch.float32) if x is None else x.float() for x, p in zip(g, params)]
        return out
    for lab in labels:
        acc = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        for s in range(0, B, mb):
            rows = list(range(s, min(B, s + mb)))
            lp = token_logprobs(model, r, rows, pad_id)
            obj = (advantages[lab][rows].to(lp.device) * lp).sum() / n_tok
            g = torch.autograd.grad(obj, params, allow_unused=True)
            for a, x in zip(acc, g):
                if x is not None:
                    a += x.float()
        out[lab] = acc
    return out


def reference_gradient(model, r: Rollouts, params: list, pad_id: int, *, micro_batch: int = 16) -> list:
    """Unbiased estimate of grad E[R] from ``r``: (1 / B) * sum_i (R_i - mean of the other rewards of its group) *
    grad log pi(y_i | x_i) (leave-one-out baseline; groups need >= 2 rollouts).

    Returns:
        per-parameter float32 tensors (the parameters' shapes).

    Raises:
        ValueError: ``group_size`` < 2.
    """
    G = r.group_size
    if G < 2:
        raise ValueError(f"the reference gradient needs >= 2 rollouts per prompt (leave-one-out), got {G}")
    rew = r.rewards.double().view(-1, G)
    loo = (rew - (rew.sum(1, keepdim=True) - rew) / (G - 1)).view(-1).float()
    acc = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    B = r.batch_size
    for s in range(0, B, micro_batch):
        rows = [i for i in range(s, min(B, s + micro_batch)) if loo[i] != 0]
        if not rows:
            continue
        lp = token_logprobs(model, r, rows, pad_id)
        obj = (loo[rows].to(lp.device)[:, None] * lp).sum() / B
        g = torch.autograd.grad(obj, params, allow_unused=True)
        for a, x in zip(acc, g):
            if x is not None:
                a += x.float()
    return acc


def reward_slope_gradient(model, r: Rollouts, params: list, pad_id: int, *, micro_batch: int = 16) -> list:
    """The gradient, at the current parameters, of :func:`is_reward_change` on ``r`` (``r`` sampled from the current
    policy): (1 / B) sum_i (R_i - mean reward of its group) grad log pi(y_i | x_i), i.e. (G - 1) / G times
    :func:`reference_gradient`. <delta, this> is the first-order (linear) prediction of the importance-weighted
    reward change after a parameter step delta.

    Returns:
        per-parameter float32 tensors. Raises: ValueError: ``group_size`` < 2.
    """
    g = reference_gradient(model, r, params, pad_id, micro_batch=micro_batch)
    c = (r.group_size - 1) / r.group_size
    return [x * c for x in g]


def sequence_logprobs(model, r: Rollouts, pad_id: int, *, micro_batch: int = 16) -> torch.Tensor:
    """(B,) float64: sum_t log pi_T(y_t | ...) over each row's policy tokens (:func:`token_logprobs`, no autograd)."""
    out = torch.zeros(r.batch_size, dtype=torch.float64)
    with torch.no_grad():
        for s in range(0, r.batch_size, micro_batch):
            rows = list(range(s, min(r.batch_size, s + micro_batch)))
            out[rows] = token_logprobs(model, r, rows, pad_id).double().sum(-1).cpu()
    return out


def is_reward_change(r: Rollouts, logp_new: torch.Tensor, logp_old: torch.Tensor) -> float:
    """Importance-sampling estimate of E_new[R] - E_old[R] from rollouts ``r`` sampled from the old policy:
    per prompt, the self-normalized weights w_i = softmax_group(logp_new - logp_old)_i give sum_i w_i R_i; the mean
    over prompts minus the mean reward. Smooth in the step (no resampling), so a scan over step sizes shows where it
    stops being linear; unreliable once a group's weights concentrate on one rollout.

    Args:
        r: the rollouts (``group_size`` >= 2 consecutive rows per prompt, B >= 1 a multiple of it, finite rewards);
            logp_new, logp_old: (B,) floating sequence log-probs (:func:`sequence_logprobs`) under the stepped and
            the sampling policy (logp_old finite: the rows were sampled from it; logp_new may be -inf, a row the new
            policy cannot produce, weight 0, but not on every row of a group).
    Returns: the estimated change of the mean reward (float).
    Raises: ValueError: any of the above violated (naming the argument and the row).
    """
    B, G = r.batch_size, r.group_size
    if B < 1 or G < 2 or B % G:
        raise ValueError(f"rollouts: is_reward_change needs >= 2 rollouts per prompt and B a positive multiple of "
                         f"group_size, got B = {B}, group_size = {G}")
    R = r.rewards.double()
    if not bool(torch.isfinite(R).all()):
        raise ValueError(f"rollouts: reward of row {int((~torch.isfinite(R)).nonzero()[0])} is not finite")
    for name, x in (("logp_new", logp_new), ("logp_old", logp_old)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating torch.Tensor of shape ({B},), got {type(x).__name__}"
                             f"{'' if not isinstance(x, torch.Tensor) else ' of dtype ' + str(x.dtype)}")
        if tuple(x.shape) != (B,):
            raise ValueError(f"{name} must have shape ({B},) (one log-prob per rollout), got {tuple(x.shape)}")
    new, old = logp_new.double().cpu(), logp_old.double().cpu()
    bad = ~torch.isfinite(old) | torch.isnan(new) | (new == float("inf"))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"log-probs of row {i}: logp_old must be finite and logp_new finite or -inf, got "
                         f"logp_old = {float(old[i])}, logp_new = {float(new[i])}")
    diff = (new - old).view(-1, G)
    if bool(torch.isinf(diff).all(1).any()):
        raise ValueError(f"logp_new is -inf on every row of prompt {int(torch.isinf(diff).all(1).nonzero()[0])}: "
                         "the self-normalized weights are undefined")
    if bool((diff == float("inf")).any()):
        raise ValueError("logp_new - logp_old overflows")
    w = torch.softmax(diff, dim=1)
    R = R.view(-1, G)
    return float((w * R).sum(1).mean() - R.mean())


def grad_dot(a: list, b: list) -> float:
    """Inner product of two gradients given as per-parameter tensors (float64 accumulation)."""
    return float(sum(torch.dot(x.reshape(-1).double(), y.reshape(-1).double()) for x, y in zip(a, b)))


def grad_norm(a: list) -> float:
    """Euclidean norm of a gradient given as per-parameter tensors."""
    return math.sqrt(max(0.0, grad_dot(a, a)))


class CountSketch:
    """A count sketch of gradients: S(u)[k] = sum_{j: h(j) = k} s(j) u_j with random buckets h and signs s drawn once
    per parameter chunk from ``seed`` (regenerated on each call, so nothing of the parameters' size is stored).

    E[<S(u), S(v)>] = <u, v>, with variance about (|u|^2 |v|^2 + <u, v>^2) / dim: inner products between batches'
    updates (the signal term of the signal-to-noise ratio) from ``dim`` floats per update.

    Args:
        numels: the parameters' sizes, in order.
        dim: sketch size (>= 1).
        seed: the hash seed (the same for every update that is compared).
    """

    CHUNK = 1 << 22

    def __init__(self, numels: Sequence[int], dim: int = 65536, seed: int = 0):
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.numels, self.dim, self.seed = [int(n) for n in numels], int(dim), int(seed)

    def __call__(self, grads: list) -> torch.Tensor:
        out = torch.zeros(self.dim, dtype=torch.float64)
        gen = torch.Generator()
        for pi, (g, n) in enumerate(zip(grads, self.numels)):
            flat = g.reshape(-1).double().cpu()
            if flat.numel() != n:
                raise ValueError(f"gradient {pi} has {flat.numel()} elements, expected {n}")
            for ci, s in enumerate(range(0, n, self.CHUNK)):
                e = min(n, s + self.CHUNK)
                gen.manual_seed((self.seed * 1_000_003 + pi * 7919 + ci) % (2 ** 63))
                idx = torch.randint(0, self.dim, (e - s,), generator=gen)
                sign = torch.randint(0, 2, (e - s,), generator=gen).double() * 2 - 1
                out.index_add_(0, idx, flat[s:e] * sign)
        return out.float()
