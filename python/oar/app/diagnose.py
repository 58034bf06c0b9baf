"""``oar diagnose``: which credit points the policy-gradient update the right way, on the same rollouts
(docs/diagnose.md).

From one policy (the config's model, or a checkpoint folder), the command

1. estimates the gradient of held-out reward, grad E[R], from ``ref_prompts`` held-out prompts x ``ref_group``
   rollouts each (leave-one-out baseline: unbiased), in ``ref_folds`` independent folds (their agreement says how
   noisy the reference is, and a jackknife over them puts its noise into every interval);
2. draws ``batches`` training batches as training would (``prompts`` x ``group`` rollouts, the config's temperature
   and completion length) and, on each, computes every credit setting's token advantages and its update
   direction u_m (:mod:`oar.app.diagnose_core`);
3. reports per setting, paired across batches: the cosine of u_m with the reference gradient, its difference to
   grpo's (paired t interval with the reference's noise, and sign-flip test), and the signal-to-noise ratio of
   u_m across batches (count sketches of the updates); optionally the held-out reward
   after one normalized step along u_m, sampled with the same seeds for every setting (common random numbers).

Output folder: ``state.json`` (the settings; a resume must match them), ``reference.pt`` (the reference gradient),
``batches.jsonl`` (one line per finished batch, appended: a killed run resumes at the next batch),
``sketches/batch_NNNN.pt``, and the report ``diagnose.md``, ``diagnose.csv``, ``diagnose.png``.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from oar.app._extras import require

require("train", "oar.app.diagnose")

from oar.app import diagnose_core as core  # noqa: E402
from oar.app.diagnose_report import _load_batches, summarize, write_report  # noqa: E402
from oar.app.runtime import release_memory, write_json_atomic  # noqa: E402
from oar.app.tasks.base import chat_prompt_ids  # noqa: E402

DEFAULT_METHODS = ["grpo", "oar_g", "oar_p", "random", "entropy", "entropy_top:quantile=0.2",
                   "oar_g:credit_rows=positive", "oar_g:q=0.5", "oar_g:beta=2"]


@dataclass
class DiagnoseSettings:
    """What one diagnostic measures (``state.json``; every field is a command-line flag of ``oar diagnose``).

    Attributes:
        methods: credit settings (:func:`oar.app.diagnose_core.parse_credit` specs); the first is the baseline of
            the paired differences (``grpo`` by default).
        batches: B training batches (the paired units).
        prompts: prompts per batch; group: rollouts per prompt (the GRPO group).
        ref_prompts, ref_group: the reference sample (held-out prompts x rollouts each).
        ref_folds: F >= 2 independent folds the reference is estimated in (prompt i in fold i mod F); every
            interval carries the reference's sampling noise through a jackknife over them (memory: F + 1
            parameter-sized float32 gradients).
        temperature, max_new_tokens: sampling, as in training (default: the config's grpo section).
        micro_batch: rows per forward of the update directions (0: the whole batch in one forward).
        sketch_dim: count-sketch size of each update (the signal-to-noise ratio).
        reward_batches: batches whose held-out reward after one step is measured (0: none).
        reward_prompts, reward_samples: that evaluation's held-out prompts and samples per prompt.
        step_norm: length of that step along u / |u| (parameter units; 0: 4 x lr x sqrt(#params), about four
            Adam steps at the config's learning rate).
        step_scales: the reward check's steps, as multiples of ``step_norm`` (a scan: at each, the sampled reward
            change and the importance-weighted one next to its linear prediction; docs/diagnose.md). The main
            table's column is the step of scale 1 (``-`` when 1 is not listed).
        margins: pre-declared break-even margins ``{setting label: Δcos}`` (issue 42 item 7): the report tests
            H1: Δcos > margin for each (one-sided, both noises; :func:`oar.app.stats.margin_pvalue`). Recorded in
            ``state.json`` before the first batch, so a resume cannot change them.
        seed: the seed of everything (prompt draws, sampling, random credit, OAR-G noise, the sketch).
    """

    methods: list = field(default_factory=lambda: list(DEFAULT_METHODS))
    batches: int = 24
    prompts: int = 4
    group: int = 4
    ref_prompts: int = 96
    ref_group: int = 8
    ref_folds: int = 4
    temperature: float = 0.9
    max_new_tokens: int = 48
    micro_batch: int = 0
    sketch_dim: int = 65536
    reward_batches: int = 0
    reward_prompts: int = 64
    reward_samples: int = 4
    step_norm: float = 0.0
    step_scales: list = field(default_factory=lambda: [1.0])
    margins: dict = field(default_factory=dict)
    seed: int = 0

    def check(self) -> None:
        """Raises ValueError naming the first bad field."""
        for k in ("batches", "prompts", "group", "ref_prompts", "ref_group", "max_new_tokens", "sketch_dim",
                  "reward_prompts", "reward_samples"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be a positive integer, got {v!r}")
        if isinstance(self.ref_folds, bool) or not isinstance(self.ref_folds, int) or not \
                2 <= self.ref_folds <= self.ref_prompts:
            raise ValueError(f"ref_folds must be an integer in [2, ref_prompts = {self.ref_prompts}], got "
                             f"{self.ref_folds!r}")
        if self.ref_group < 2:
            raise ValueError(f"ref_group must be >= 2 (leave-one-out baseline), got {self.ref_group}")
        if self.batches < 2:
            raise ValueError(f"batches must be >= 2 (paired intervals), got {self.batches}")
        for k in ("micro_batch", "reward_batches"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{k} must be an integer >= 0, got {v!r}")
        if self.reward_batches > self.batches:
            raise ValueError(f"reward_batches ({self.reward_batches}) must be <= batches ({self.batches})")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if not (_real(self.step_norm) is not None and 0 <= self.step_norm < _MAX_STEP):
            raise ValueError(f"step_norm must be a number in [0, {_MAX_STEP:g}) (0: the default), got {self.step_norm!r}")
        sc = self.step_scales
        vals = [_real(x) for x in sc] if isinstance(sc, (list, tuple)) else None
        if not vals or any(v is None or not v > 0 for v in vals):
            raise ValueError(f"step_scales must be a non-empty list of finite numbers > 0, got {sc!r}")
        if len(set(vals)) != len(vals):
            raise ValueError(f"step_scales lists a scale more than once: {sc!r}")
        self.step_scales = vals  # a list of floats, as state.json stores it (a resume compares equal)
        if not self.methods:
            raise ValueError("methods must name at least one credit setting")
        labels = [core.parse_credit(m).label for m in self.methods]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"methods lists {dup} more than once")
        if not isinstance(self.margins, dict):
            raise ValueError(f"margins must be a dict {{setting: margin}}, got {self.margins!r}")
        margins = {}
        for k, v in self.margins.items():
            if k not in labels[1:]:
                raise ValueError(f"margins: {k!r} is not a compared setting (one of {labels[1:]}; the first, "
                                 f"{labels[0]!r}, is the baseline; an item is SETTING=VALUE, the margin being the "
                                 "number after the last '=')")
            m = _real(v)
            if m is None or not -2.0 < m < 2.0:
                raise ValueError(f"margins[{k!r}] must be a number in (-2, 2) (a difference of cosines), got {v!r}")
            margins[k] = m
        self.margins = margins


#: Upper bound of a reward-check step's length (parameter units): far beyond any useful step, below float32's range.
_MAX_STEP = 1e30


def _real(x) -> float | None:
    """``x`` as a finite float (:func:`oar._args.float_arg`'s real numbers), else None."""
    from oar._args import float_arg

    try:
        v = float_arg("value", x)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


class TaskSource:
    """Prompts and rewards of a task for the diagnostic: training prompts for the batches, held-out prompts for the
    reference gradient and the reward check (the task's test split: disjoint from training as the task defines it).

    Args:
        task: an ``oar.app.tasks`` task; tokenizer: the policy's; train_problems / heldout_problems: Problem lists.
    """

    def __init__(self, task, tokenizer, train_problems, heldout_problems):
        self.task, self.tok = task, tokenizer
        self.train, self.heldout = list(train_problems), list(heldout_problems)

    def prompt_ids(self, problems) -> list:
        return [chat_prompt_ids(self.tok, self.task.prompt(p)) for p in problems]

    def rollouts(self, model, problems, *, group: int, temperature: float, max_new_tokens: int, seed: int):
        """:func:`oar.app.diagnose_core.sample_rollouts` on ``problems`` with the task's verifier as reward (a tool
        task's calculator sessions, ``task.tool``)."""
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        return core.sample_rollouts(
            model, self.prompt_ids(problems), lambda i, ids, text: float(self.task.reward(text, problems[i])),
            group_size=group, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed, pad_id=int(pad),
            eos_id=int(self.tok.eos_token_id), tokenizer=self.tok, answers=[p.answer for p in problems],
            max_calls=self.task.max_calls if getattr(self.task, "tool", False) else None)


def _params(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _pad_id(tok) -> int:
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)



def _batch_problems(source: TaskSource, s: DiagnoseSettings, b: int) -> list:
    rng = np.random.default_rng([s.seed, 1, b])
    idx = rng.choice(len(source.train), size=min(s.prompts, len(source.train)), replace=False)
    return [source.train[int(i)] for i in idx]


def compute_reference(model, tok, source: TaskSource, s: DiagnoseSettings, out_dir: str, *, progress=None) -> dict:
    """The reference gradient (``reference.pt``, loaded when present): ``ref_folds`` independent folds of the
    ``ref_prompts`` held-out prompts (prompt i in fold i mod F), their weighted mean, and what says how noisy it is.
    Resumable by fold: each finished fold is kept in ``reference_fold<c>.pt`` until ``reference.pt`` is written (a
    run stopped in its reference, tens of minutes on a CPU, redoes only the fold it was in; the same numbers, as each
    fold's rollouts are seeded by the fold and the chunk).

    Returns:
        ``{"grad": [per-parameter float32], "folds": F such lists, "fold_rollouts": (F,), "gram": (F, F) inner
        products of the folds, "norm", "fold_cos", "signal_sq", "attenuation", "mean_reward", "mixed_groups",
        "rollouts"}``; ``signal_sq`` = the mean of <g_c, g_c'> over pairs of different folds (an unbiased estimate of
        |grad E[R]|^2), ``fold_cos`` the mean cosine between different folds, ``attenuation`` = sqrt(signal_sq) /
        |g_ref| (cosines with g_ref times 1 / attenuation estimate cosines with the true gradient; None when
        signal_sq <= 0: the reference is dominated by its noise).
    """
    path = os.path.join(out_dir, "reference.pt")
    if os.path.exists(path):
        return torch.load(path, weights_only=False)
    params = _params(model)
    probs = source.heldout[: s.ref_prompts]
    F = s.ref_folds
    folds, counts, rewards, mixed = [], [], [], 0
    for h in range(F):
        part = probs[h::F]
        fold_path = os.path.join(out_dir, f"reference_fold{h}.pt")
        if os.path.exists(fold_path):  # finished by an earlier, stopped run
            fold = torch.load(fold_path, weights_only=False)
            folds.append(fold["grad"])
            counts.append(fold["rollouts"])
            rewards += fold["rewards"]
            mixed += fold["mixed_groups"]
            if progress is not None:
                progress(len(part))
            continue
        acc = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        n, fold_rewards, fold_mixed = 0, [], 0
        for c in range(0, len(part), 8):
            chunk = part[c:c + 8]
            r = source.rollouts(model, chunk, group=s.ref_group, temperature=s.temperature,
                                max_new_tokens=s.max_new_tokens, seed=s.seed * 7919 + 100_000 + h * 10_000 + c)
            g = core.reference_gradient(model, r, params, _pad_id(tok))
            for a, x in zip(acc, g):
                a += x * r.batch_size
            n += r.batch_size
            fold_rewards += r.rewards.tolist()
            rg = r.rewards.view(-1, s.ref_group)
            fold_mixed += int(((rg.max(1).values - rg.min(1).values) > 0).sum())
            del r, g
            release_memory()  # generation and the backward free GBs each chunk; keep the heap from holding them
            if progress is not None:
                progress(len(chunk))
        folds.append([a / max(1, n) for a in acc])
        counts.append(n)
        rewards += fold_rewards
        mixed += fold_mixed
        torch.save({"grad": folds[-1], "rollouts": n, "rewards": fold_rewards, "mixed_groups": fold_mixed},
                   fold_path + ".tmp")
        os.replace(fold_path + ".tmp", fold_path)
    N = float(sum(counts))
    g = [sum(fc[i] * (n / N) for fc, n in zip(folds, counts)) for i in range(len(params))]
    gram = np.array([[core.grad_dot(folds[a], folds[b]) for b in range(F)] for a in range(F)])
    off = gram[~np.eye(F, dtype=bool)]
    signal = float(off.mean())
    norms = np.sqrt(np.diag(gram))
    cos = [gram[a, b] / max(1e-30, norms[a] * norms[b]) for a in range(F) for b in range(F) if a != b]
    norm = core.grad_norm(g)
    ref = {"grad": g, "folds": folds, "fold_rollouts": counts, "gram": gram.tolist(), "norm": norm,
           "fold_cos": float(np.mean(cos)), "signal_sq": signal,
           "attenuation": (math.sqrt(signal) / norm) if signal > 0 and norm > 0 else None,
           "mean_reward": float(np.mean(rewards)), "mixed_groups": mixed / max(1, len(probs)),
           "rollouts": len(rewards)}
    torch.save(ref, path + ".tmp")
    os.replace(path + ".tmp", path)
    for h in range(F):  # now in reference.pt
        os.remove(os.path.join(out_dir, f"reference_fold{h}.pt"))
    return ref


def _heldout_rollouts(model, source: TaskSource, s: DiagnoseSettings):
    """The reward check's rollouts (the same prompts and sampling seed for every setting, step and the start)."""
    probs = source.heldout[s.ref_prompts: s.ref_prompts + s.reward_prompts]
    if not probs:
        raise ValueError(f"no held-out prompts left for the reward check: the task's test split has "
                         f"{len(source.heldout)} problems, ref_prompts uses {s.ref_prompts}")
    return source.rollouts(model, probs, group=s.reward_samples, temperature=s.temperature,
                           max_new_tokens=s.max_new_tokens, seed=s.seed * 7919 + 900_001)


@dataclass
class RewardCheck:
    """The reward check's starting point: its rollouts ``r0`` at the current policy, their mean reward, sequence
    log-probs and the gradient of the importance-weighted reward (:func:`oar.app.diagnose_core.
    reward_slope_gradient`), whose inner product with a step is the step's linear prediction."""

    r0: object
    reward: float
    logp0: torch.Tensor
    slope: list


def _reward_check(model, tok, source: TaskSource, s: DiagnoseSettings, params: list, out_dir: str) -> RewardCheck:
    r0 = _heldout_rollouts(model, source, s)
    reward = float(r0.rewards.mean())
    bpath = os.path.join(out_dir, "base_reward.json")
    if os.path.exists(bpath):
        with open(bpath) as f:
            stored = json.load(f)["reward"]
        if abs(stored - reward) > 1e-9:  # another machine or library sampled other rollouts
            raise ValueError(f"{out_dir}: the reward check's starting rollouts now have mean reward {reward:.6f}, "
                             f"the stored run's had {stored:.6f} (another machine or library version samples "
                             "differently): resume where it started, or use another output folder")
    write_json_atomic(bpath, {"reward": reward})
    pad = _pad_id(tok)
    slope = core.reward_slope_gradient(model, r0, params, pad) if r0.group_size >= 2 else None
    return RewardCheck(r0, reward, core.sequence_logprobs(model, r0, pad), slope)


def _reward_scan(model, tok, source: TaskSource, s: DiagnoseSettings, params: list, u: list, step_norm: float,
                 check: RewardCheck) -> list:
    """Per step scale: the held-out reward after a step of ``scale * step_norm`` along u / |u|, sampled with the
    start's seed (``reward_change``), its importance-weighted estimate on the start's rollouts (``is_change``) and
    the linear prediction of that estimate (``linear_change``; None with one sample per prompt)."""
    n = core.grad_norm(u)
    slope = core.grad_dot(u, check.slope) / n if check.slope is not None and n > 0 else 0.0
    out = []
    for scale in s.step_scales:
        length = float(scale) * step_norm
        with _step_along(model, params, u, length):
            after = float(_heldout_rollouts(model, source, s).rewards.mean())
            is_change = None
            if check.r0.group_size >= 2:
                is_change = core.is_reward_change(check.r0, core.sequence_logprobs(model, check.r0, _pad_id(tok)),
                                                  check.logp0)
        out.append({"scale": float(scale), "step": length, "reward_after_step": after,
                    "reward_change": after - check.reward, "is_change": is_change,
                    "linear_change": length * slope if check.slope is not None else None})
    return out


def _step_along(model, params, u: list, length: float):
    """Context: parameters moved by ``length`` * u / |u| inside, restored after."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        n = core.grad_norm(u)
        saved = [p.detach().clone() for p in params]
        try:
            with torch.no_grad():
                if n > 0:
                    for p, x in zip(params, u):
                        p.add_((length / n) * x.to(p.dtype))
            yield
        finally:
            with torch.no_grad():
                for p, x in zip(params, saved):
                    p.copy_(x)

    return ctx()


def run_batch(model, tok, source: TaskSource, s: DiagnoseSettings, specs: list, ref: dict, b: int,
              sketch: core.CountSketch, base_config, check: RewardCheck | None, step_norm: float) -> tuple[dict, dict]:
    """One batch: rollouts, every setting's advantages and update, its statistics. Returns ``(record, sketches)``."""
    t0 = time.perf_counter()
    params = _params(model)
    r = source.rollouts(model, _batch_problems(source, s, b), group=s.group, temperature=s.temperature,
                        max_new_tokens=s.max_new_tokens, seed=s.seed * 7919 + b)
    t_gen = time.perf_counter() - t0
    with torch.no_grad():
        _, ent = core.token_logprobs(model, r, list(range(r.batch_size)), _pad_id(tok), with_entropy=True)
    advs, metrics, seq = {}, {}, None
    for spec in specs:
        # one seed per batch for every setting (not per position in --methods): random draws are common random
        # numbers across settings (OAR-G's noise of a row is a function of (seed, row): oar_g.row_noise)
        adv, seq, m = core.method_advantages(spec, r, model=model, tokenizer=tok, base_config=base_config,
                                             seed=s.seed * 1_000_003 + b * 101, entropies=ent.cpu())
        advs[spec.label], metrics[spec.label] = adv, m
    t_adv = time.perf_counter() - t0 - t_gen
    dirs = core.update_directions(model, r, advs, params, _pad_id(tok), micro_batch=s.micro_batch or None)
    t_upd = time.perf_counter() - t0 - t_gen - t_adv
    rec = {"batch": b, "mean_reward": float(r.rewards.mean()), "active_rows": int((seq != 0).sum()),
           "signal": bool((seq != 0).any()),
           "tokens": int(r.completion_mask.sum()), "methods": {}}
    sk = {}
    for spec in specs:
        u = dirs[spec.label]
        dot, norm = core.grad_dot(u, ref["grad"]), core.grad_norm(u)
        entry = {"dot": dot, "norm": norm, "cos": dot / (norm * ref["norm"]) if norm > 0 and ref["norm"] > 0 else 0.0,
                 "fold_dots": [core.grad_dot(u, f) for f in ref["folds"]],
                 "ess_ratio": metrics[spec.label].get("oar/ess_ratio"),
                 "attribution_seconds": metrics[spec.label].get("oar/attribution_seconds")}
        sk[spec.label] = sketch(u)
        if check is not None:
            entry["reward_scan"] = _reward_scan(model, tok, source, s, params, u, step_norm, check)
            for x in entry["reward_scan"]:
                if x["scale"] == 1.0:
                    entry["reward_after_step"], entry["reward_change"] = x["reward_after_step"], x["reward_change"]
        rec["methods"][spec.label] = entry
    rec["seconds"] = {"generation": t_gen, "advantages": t_adv, "updates": t_upd, "total": time.perf_counter() - t0}
    return rec, sk


#: Version of what a batch record means (2: logits divided by the sampling temperature, one seed per batch for every
#: setting, batches without signal marked); an output folder of another version is not resumed.
STATE_VERSION = 2


def run(model, tok, source: TaskSource, s: DiagnoseSettings, out_dir: str, *, base_config=None, lr: float = 2e-5,
        progress: bool = True, provenance: dict | None = None) -> dict:
    """Runs (or resumes) the diagnostic into ``out_dir`` and writes the report.

    Args:
        model, tok: the policy (put in eval mode; its weights are restored after every reward-check step) and its
            tokenizer.
        source: prompts and rewards (:class:`TaskSource`).
        s: the settings (checked; on resume they must equal ``state.json``'s).
        out_dir: the output folder (created).
        base_config: ``oar.OARConfig`` every setting's overrides apply to (default: OAR's defaults).
        lr: the learning rate that sets the default ``step_norm``.
        provenance: what else determines the numbers (``oar diagnose`` passes the task, the model and the whole run
            config); stored in ``state.json`` with the task's name, and a resume with other values is refused.

    Returns:
        The report's summary (also in ``diagnose.json``).

    Raises:
        ValueError: bad settings, or settings, task, model or config that differ from an earlier run in ``out_dir``
            (naming the fields), or an ``out_dir`` written by another version of the diagnostic.
    """
    from oar.schema import OARConfig

    s.check()
    specs = [core.parse_credit(m) for m in s.methods]
    base_config = base_config if base_config is not None else OARConfig()
    for spec in specs:  # every setting's config is valid before anything is sampled
        core.config_for(base_config, spec, s.seed)
    os.makedirs(os.path.join(out_dir, "sketches"), exist_ok=True)
    state_path = os.path.join(out_dir, "state.json")
    prov = {"task": getattr(getattr(source, "task", None), "name", None), "lr": float(lr), **(provenance or {})}
    state = {"version": STATE_VERSION, "settings": asdict(s), "base_config": json.loads(base_config.to_json()),
             "provenance": json.loads(json.dumps(prov, default=str))}
    if os.path.exists(state_path):
        with open(state_path) as f:
            old = json.load(f)
        if old.get("version") != STATE_VERSION:
            raise ValueError(f"{out_dir} holds a diagnostic of another version ({old.get('version', 1)}, this is "
                             f"{STATE_VERSION}: its batches measured other updates); use another output folder")
        # `batches` may change: batch b is the same draw whatever the total, so a pilot extends to a full run
        # (and the report covers batches 0 .. batches - 1). A setting added since a run started is compared at its
        # default (what that run used).
        dflt = asdict(DiagnoseSettings())
        diff = sorted(k for k in set(old["settings"]) | set(state["settings"])
                      if k != "batches" and old["settings"].get(k, dflt.get(k)) != state["settings"].get(k))
        if old.get("base_config") != state["base_config"]:
            diff.append("base_config")
        op, np_ = old.get("provenance", {}), state["provenance"]
        diff += [f"provenance.{k}" for k in sorted(set(op) | set(np_)) if op.get(k) != np_.get(k)]
        if diff:
            raise ValueError(f"{out_dir} holds a diagnostic with other settings ({diff}): pass the same settings, "
                             "task, model and config to resume (only --batches may change), or another output folder")
    write_json_atomic(state_path, state)
    model.eval()
    params = _params(model)
    n_params = sum(p.numel() for p in params)
    step_norm = s.step_norm or 4.0 * lr * math.sqrt(n_params)
    if s.reward_batches and max(s.step_scales) * step_norm >= _MAX_STEP:
        raise ValueError(f"step_scales: {max(s.step_scales):g} x step_norm {step_norm:.3g} is a step beyond "
                         f"{_MAX_STEP:g} (float32 parameters would overflow)")
    from tqdm.auto import tqdm

    bar = tqdm(total=s.ref_prompts, desc="reference gradient (prompts)", disable=not progress, dynamic_ncols=True)
    ref = compute_reference(model, tok, source, s, out_dir, progress=bar.update)
    bar.close()
    done = {b: rec for b, rec in _load_batches(out_dir).items() if b < s.batches}
    sketch = core.CountSketch([p.numel() for p in params], s.sketch_dim, seed=s.seed)
    todo = [b for b in range(s.batches) if b not in done]
    check, base_reward = None, None
    if any(b < s.reward_batches for b in todo):
        check = _reward_check(model, tok, source, s, params, out_dir)
        base_reward = check.reward
    elif s.reward_batches:
        with open(os.path.join(out_dir, "base_reward.json")) as f:
            base_reward = json.load(f)["reward"]
    with tqdm(total=s.batches, initial=len(done), desc="batches", disable=not progress, dynamic_ncols=True) as bar:
        for b in todo:
            if b >= s.reward_batches:
                check = None  # its slope gradient (parameter-sized) is no longer needed
            rec, sk = run_batch(model, tok, source, s, specs, ref, b, sketch, base_config, check, step_norm)
            torch.save(sk, os.path.join(out_dir, "sketches", f"batch_{b:04d}.pt"))
            with open(os.path.join(out_dir, "batches.jsonl"), "a+b") as f:
                # A killed run may have left a cut last line without its newline: end it first, so that this
                # record is a line of its own (else it would merge with the fragment and be lost on resume).
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        f.write(b"\n")
                f.write((json.dumps(rec) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
            done[b] = rec
            del sk
            release_memory()
            bar.update(1)
    summary = summarize(done, ref, [sp.label for sp in specs], out_dir, step_norm=step_norm, base_reward=base_reward,
                        n_params=n_params, margins=s.margins)
    write_report(summary, out_dir)
    return summary



def settings_from(cfg, **flags) -> DiagnoseSettings:
    """:class:`DiagnoseSettings` from a run config (group, temperature, completion length and seed of its ``grpo`` /
    ``run`` sections) and the command line's ``flags`` (None values are left at the defaults)."""
    g = cfg.grpo
    base = {"group": int(g.get("num_generations", 4)), "temperature": float(g.get("temperature", 0.9)),
            "max_new_tokens": int(g.get("max_completion_length", 48)), "seed": int(cfg.run.get("seed", 0))}
    per_step = int(g.get("per_device_train_batch_size", 2)) * int(g.get("gradient_accumulation_steps", 8))
    base["prompts"] = max(1, per_step // max(1, base["group"]))
    base.update({k: v for k, v in flags.items() if v is not None})
    return DiagnoseSettings(**base)


def diagnose_main(config: str | None, overrides: list, out_dir: str, flags: dict, *, progress: bool = True) -> dict:
    """``oar diagnose``: the config's model and task (``oar train``'s config; ``--set model.name=<folder>`` for a
    checkpoint), its ``oar`` section as the base of every setting, then :func:`run`.

    Raises:
        ValueError / FileNotFoundError: a bad config or flag (naming it), too few held-out problems.
    """
    from oar.app.config import load_config
    from oar.app.models import load_by_name
    from oar.app.train import build_task

    cfg = load_config(config, overrides)
    s = settings_from(cfg, **flags)
    s.check()
    task, train = build_task(cfg)
    need = s.ref_prompts + (s.reward_prompts if s.reward_batches else 0)
    try:
        heldout = task.problems("test", n=need, seed=int(cfg.eval.get("seed", 0)))
    except ValueError as e:
        raise ValueError(f"--ref-prompts/--reward-prompts ask {need} held-out problems: {e}") from None
    if len(heldout) < need:
        raise ValueError(f"--ref-prompts/--reward-prompts ask {need} held-out problems; the {task.name} test split "
                         f"has {len(heldout)}")
    seen = {p.question for p in train}
    heldout = [p for p in heldout if p.question not in seen]
    mcfg = dict(cfg.model)
    dtype = getattr(torch, str(mcfg.pop("dtype", "float32")))
    torch.manual_seed(s.seed)
    model, tok = load_by_name(mcfg.pop("name", "smollm2-135m-instruct"), dtype=dtype, seed=s.seed, **mcfg)
    lr = float(cfg.grpo.get("learning_rate", 2e-5))
    prov = {"model": dict(cfg.model), "task_config": dict(cfg.task), "grpo": dict(cfg.grpo), "eval": dict(cfg.eval),
            "seed": cfg.run.get("seed", 0)}
    return run(model, tok, TaskSource(task, tok, train, heldout), s, out_dir, base_config=cfg.oar, lr=lr,
               progress=progress, provenance=prov)
