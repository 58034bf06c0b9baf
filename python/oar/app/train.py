"""The main job: GRPO training with OAR per-token advantages through TRL (``oar train``).

Reads a run config (oar.app.config), loads the model (oar.app.models) and task (oar.app.tasks), evaluates the policy on
held-out problems of the task (greedy, the task's verifier; never seen in training), trains with
:class:`oar.integrations.trl.OARGRPOTrainer`, evaluates again, and writes to ``run.output_dir``:

- ``metrics.jsonl``: one JSON object per optimizer step, under TRL's metric names (``reward``,
  ``reward_std``, ``frac_reward_zero_std``, ``time/generation``, ``time/attribution``, ``oar/*``, ...) plus
  ``time/update``; and one object per held-out evaluation (``{"step": N, "heldout/accuracy": ...}``,
  step 0 = before training). The console shows the same names.
- ``reward_curve.png``: reward per step and the held-out accuracy points (matplotlib);
- ``config.json``: the resolved configuration (oar section as parsed by the C++ schema);
- ``model/``: the trained policy (Hugging Face folder: ``oar.app.models.load_model(path)`` and
  ``transformers.AutoModelForCausalLM.from_pretrained(path)`` load it), when ``run.save_model`` (default);
- ``checkpoint-N/``: TRL checkpoints when ``grpo.save_strategy: steps`` (``oar train --resume`` continues
  from the last one);
- ``summary.json``: written last, atomically, only when the run completed (a run that failed leaves none,
  so a partial metrics file is never mistaken for a finished run).
"""

from __future__ import annotations

import glob
import json
import math
import os
import time
from typing import Any

import torch

from oar.app._extras import require

require("train", "oar.app.train")  # transformers, trl, datasets, ... (pip install "oar[train]")

from oar.app.config import RunConfig, load_config  # noqa: E402
from oar.app.runtime import _console, peak_rss_mb, release_memory, write_json_atomic  # noqa: E402

#: Defaults of the ``eval`` config section (docs/config.md).
EVAL_DEFAULTS = {"problems": 96, "every_steps": 0, "max_new_tokens": None, "batch_size": 32, "seed": 0,
                 "before_cache": None}


def _rows_for_dataset(task, problems) -> list[dict]:
    return [{"prompt": task.prompt(p), "answer": p.answer, "problem_id": p.id} for p in problems]


def make_reward_func(task, problems_by_id: dict):
    """TRL reward function: 1.0 when the completion's final answer verifies against the reference."""

    def correctness(prompts, completions, problem_id, **kwargs) -> list[float]:
        out = []
        for comp, pid in zip(completions, problem_id):
            text = comp[-1]["content"] if isinstance(comp, list) else str(comp)
            out.append(float(task.reward(text, problems_by_id[pid])))
        return out

    correctness.__name__ = "correctness"
    return correctness


def make_rollout_func(task):
    """TRL ``rollout_func`` of a tool task (``task.tool``; TRL 1.13's experimental hook): one calculator session per
    prompt of the process's slice (``oar.app.tasks.tools.run_sessions``), sampled with the trainer's temperature,
    top-p, top-k and ``max_completion_length`` (the model's tokens and the results' together). Returns the ids TRL
    stores and ``env_mask`` (0 on the results), which TRL passes on as ``tool_mask`` and oar's adapter as the
    observations between turns (docs/method.md section 13); ``logprobs`` None (TRL recomputes them)."""
    from trl.models.utils import unwrap_model_for_generation

    from oar.app.tasks.base import chat_prompt_ids
    from oar.app.tasks.tools import run_sessions

    def rollout(prompts, trainer) -> dict:
        tok = trainer.processing_class
        prompt_ids = [chat_prompt_ids(tok, p) for p in prompts]
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            sessions = run_sessions(model, tok, prompt_ids, max_calls=task.max_calls,
                                    max_new_tokens=int(trainer.max_completion_length),
                                    temperature=float(trainer.temperature), top_p=float(trainer.top_p),
                                    top_k=int(trainer.top_k or 0))
        return {"prompt_ids": prompt_ids, "completion_ids": [s.completion_ids for s in sessions],
                "logprobs": None, "env_mask": [s.env_mask for s in sessions]}

    return rollout


class MetricsWriter:
    """Appends one JSON line per logged optimizer step (TRL's names plus ``time/update``) and one per held-out
    evaluation to ``path``; ``rows`` keeps them in memory for the plot and the summary.

    Args:
        path: the ``metrics.jsonl`` file.
        keep_until: resume: rows of an earlier run with ``step <= keep_until`` are kept, later ones dropped
            (None: start a new file).
    """

    def __init__(self, path: str, keep_until: int | None = None):
        from transformers import TrainerCallback

        self.path = path
        self.rows: list[dict] = []
        if keep_until is not None and os.path.exists(path):
            with open(path) as f:
                self.rows = [r for r in (json.loads(line) for line in f if line.strip()) if r["step"] <= keep_until]
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.rows)
        os.replace(path + ".tmp", path)
        self.fh = open(path, "a")
        writer = self

        class _CB(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                if logs is not None:
                    writer.add_update_time(logs)  # before the progress callback prints the same dict
                    writer.write_train(state.global_step, logs)

            def on_step_end(self, args, state, control, **kw):
                release_memory()

            def on_substep_end(self, args, state, control, **kw):
                release_memory()  # between gradient-accumulation micro-batches

        self.callback = _CB()

    @staticmethod
    def add_update_time(logs: dict) -> None:
        """``time/update`` = TRL's ``step_time`` minus generation and attribution (seconds, >= 0)."""
        st = logs.get("step_time")
        if isinstance(st, (int, float)) and "reward" in logs:
            logs["time/update"] = max(st - logs.get("time/generation", 0.0) - logs.get("time/attribution", 0.0), 0.0)

    def _append(self, row: dict) -> None:
        self.rows.append(row)
        self.fh.write(json.dumps(row) + "\n")
        self.fh.flush()

    def write_train(self, step: int, logs: dict) -> None:
        if "reward" not in logs:  # the final train summary log has no reward
            return
        self._append({"step": step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}})

    def write_eval(self, step: int, result) -> None:
        self._append({"step": step, "heldout/accuracy": result.accuracy, "heldout/n": len(result.correct),
                      "heldout/seconds": result.seconds})

    def train_rows(self) -> list[dict]:
        return [r for r in self.rows if "reward" in r]

    def close(self):
        self.fh.close()


def plot_reward_curve(rows: list[dict], path: str, title: str) -> None:
    """Reward per step with a 5-step moving average, and the held-out accuracy points (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "heldout/accuracy" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    if train:
        steps = [r["step"] for r in train]
        rew = [r["reward"] for r in train]
        ax.plot(steps, rew, marker="o", ms=3, lw=1, alpha=0.6, label="reward (training rollouts)")
        if len(rew) >= 5:
            ma = [sum(rew[max(0, i - 4): i + 1]) / len(rew[max(0, i - 4): i + 1]) for i in range(len(rew))]
            ax.plot(steps, ma, lw=2, label="reward, 5-step average")
    if evals:
        ax.plot([r["step"] for r in evals], [r["heldout/accuracy"] for r in evals], marker="s", ms=6, lw=1.5,
                color="black", label=f"heldout/accuracy (greedy, {evals[0].get('heldout/n', '?')} problems)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def eval_settings(cfg: RunConfig) -> dict:
    """The ``eval`` section with its defaults filled in (``max_new_tokens`` defaults to the training
    completion length).

    Raises:
        ValueError: unknown key or a bad value (named).
    """
    raw = dict(cfg.eval or {})
    unknown = sorted(set(raw) - set(EVAL_DEFAULTS))
    if unknown:
        raise ValueError(f"eval section has unknown keys {unknown}; known: {sorted(EVAL_DEFAULTS)}")
    ev = {**EVAL_DEFAULTS, **raw}
    if ev["max_new_tokens"] is None:
        ev["max_new_tokens"] = int(cfg.grpo.get("max_completion_length", 256))
    for key, lo in (("problems", 0), ("every_steps", 0), ("max_new_tokens", 1), ("batch_size", 1), ("seed", 0)):
        v = ev[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"eval.{key} must be an integer >= {lo}, got {v!r}")
    if ev["before_cache"] is not None and not isinstance(ev["before_cache"], str):
        raise ValueError(f"eval.before_cache must be a file path or null, got {ev['before_cache']!r}")
    return ev


def build_task(cfg: RunConfig):
    """The task of a config and its training problems (``task.train_size``, drawn with ``run.seed``)."""
    from oar.app.tasks import get_task

    seed = int(cfg.run.get("seed", 0))
    tcfg = dict(cfg.task)
    task = get_task(tcfg.pop("name", "arithmetic"), **(tcfg.pop("kwargs", None) or {}))
    problems = task.problems("train", n=tcfg.pop("train_size", None), seed=seed)
    if not problems:
        raise ValueError(f"task {task!r} produced no training problems")
    return task, problems


def heldout_problems(task, ev: dict, train_problems) -> list:
    """The held-out problems: ``eval.problems`` of the task's test split, drawn with ``eval.seed`` (not the run
    seed: every run of a comparison is evaluated on the same problems).

    Raises:
        ValueError: ``eval.problems`` exceeds the test split, or a held-out question also occurs among the
            training problems.
    """
    if ev["problems"] == 0:
        return []
    try:
        problems = task.problems("test", n=ev["problems"], seed=ev["seed"])
    except ValueError as e:
        raise ValueError(f"eval.problems={ev['problems']}: {e}") from None
    if len(problems) < ev["problems"]:
        raise ValueError(f"eval.problems={ev['problems']} exceeds the {len(problems)} problems of the {task.name} "
                         "test split; lower eval.problems")
    seen = {p.question for p in train_problems}
    leaked = [p.id for p in problems if p.question in seen]
    if leaked:
        raise ValueError(f"held-out problems {leaked[:3]} also occur in the training problems: the task's test and "
                         "train splits overlap")
    return problems


def cpu_has_native_bf16() -> bool:
    """True when torch's CPU kernels run bfloat16 natively here: ATen's active kernel level is AVX-512 (after
    ``ATEN_CPU_CAPABILITY``) and the CPU has AVX512-BF16 or AMX. Elsewhere (AVX2-only CPUs such as AMD before
    Zen 4, an ``ATEN_CPU_CAPABILITY`` below the CPU's own level, other architectures) bfloat16 math is emulated
    through float32 conversions, or, for torch 2.14's CPU attention under ``ATEN_CPU_CAPABILITY=avx2`` on an AMX
    CPU, fails ("pack_vnni2 is only supported when avx512 is supported")."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(bool(p()) for p in probes if p is not None)


def resolve_cpu_precision(grpo: dict) -> str:
    """Decides bfloat16 autocast for a CPU run (``use_cpu``) and returns ``"bf16-autocast"`` or ``"float32"``.

    ``trl.GRPOConfig`` turns ``bf16`` on whenever ``fp16`` is off (a GPU default), and with ``use_cpu`` accelerate
    then runs every forward under ``torch.autocast("cpu", torch.bfloat16)``. On a CPU without native bfloat16
    that is slower than float32 at best. So, unless the config sets ``grpo.bf16`` or ``grpo.fp16`` itself, a CPU
    run uses bfloat16 autocast only where :func:`cpu_has_native_bf16`, and float32 elsewhere; an explicit
    ``grpo.bf16: true`` is kept, with a warning when the CPU would emulate it. Sets ``grpo["bf16"]`` in place.
    """
    native = cpu_has_native_bf16()
    if "bf16" not in grpo and "fp16" not in grpo:
        grpo["bf16"] = native
    elif grpo.get("bf16") and not native:
        import warnings

        warnings.warn(f"grpo.bf16: true on a CPU without native bfloat16 (torch's CPU kernels: "
                      f"{torch.backends.cpu.get_cpu_capability()}; native needs AVX512 kernels and AVX512-BF16 or AMX): "
                      "bfloat16 autocast is emulated (slower than float32, and torch's CPU attention can fail under "
                      "ATEN_CPU_CAPABILITY); remove the key to train in float32 here", RuntimeWarning, stacklevel=2)
    return "bf16-autocast" if grpo.get("bf16") else ("fp16-autocast" if grpo.get("fp16") else "float32")


def build_trainer(cfg: RunConfig, output_dir: str, callbacks=(), task=None, problems=None):
    """Model, tokenizer, dataset, reward function and OARGRPOTrainer for a run config; returns
    ``(trainer, task)``."""
    from datasets import Dataset
    from trl import GRPOConfig

    from oar.app.models import load_by_name

    seed = int(cfg.run.get("seed", 0))
    torch.manual_seed(seed)
    if task is None:
        task, problems = build_task(cfg)
    mcfg = dict(cfg.model)
    dtype = getattr(torch, str(mcfg.pop("dtype", "float32")))
    # The trainer owns the only copy: no cached second copy of the weights in this process.
    if mcfg.get("name", "smollm2-135m-instruct") != "tiny-random-llama":
        mcfg.setdefault("fresh", False)
    model, tokenizer = load_by_name(mcfg.pop("name", "smollm2-135m-instruct"), dtype=dtype, seed=seed, **mcfg)
    ds = Dataset.from_list(_rows_for_dataset(task, problems))
    grpo = dict(cfg.grpo)
    grpo.setdefault("report_to", "none")
    grpo.setdefault("save_strategy", "no")
    grpo.setdefault("logging_steps", 1)
    grpo.setdefault("use_cpu", not torch.cuda.is_available())
    if grpo["use_cpu"]:
        _console(f"[oar] CPU training in {resolve_cpu_precision(grpo)} (grpo.bf16 overrides; docs/config.md)")
    grpo.setdefault("seed", seed)
    grpo.setdefault("disable_tqdm", False)
    args = GRPOConfig(output_dir=output_dir, **grpo)
    tools = dict(rollout_func=make_rollout_func(task)) if getattr(task, "tool", False) else {}
    trainer = _main_job_trainer_class()(model=model, reward_funcs=[make_reward_func(task, {p.id: p for p in problems})],
                             args=args, train_dataset=ds, processing_class=tokenizer, oar_config=cfg.oar,
                             callbacks=list(callbacks), **tools)
    return trainer, task


def _main_job_trainer_class():
    from oar.integrations.trl import OARGRPOTrainer

    class MainJobTrainer(OARGRPOTrainer):
        """OARGRPOTrainer that hands the generation and attribution buffers back to the OS before the update
        (:func:`release_memory`), so that the update's gradients and activations do not stack on them."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            release_memory()
            return out

    return MainJobTrainer


def _before_cache_key(cfg: RunConfig, ev: dict, problems) -> dict:
    from oar.app.models import TINY_RANDOM_NAME

    # The initial weights depend on run.seed only for the random test model; left-padded batched greedy decoding
    # can depend on the batch size.
    init_seed = int(cfg.run.get("seed", 0)) if cfg.model.get("name") == TINY_RANDOM_NAME else None
    return {"model": cfg.model, "init_seed": init_seed, "task": {k: v for k, v in cfg.task.items() if k != "train_size"},
            "max_new_tokens": ev["max_new_tokens"], "batch_size": ev["batch_size"],
            "problem_ids": [p.id for p in problems]}


def _evaluate_before(cfg, ev, task, problems, model, tokenizer):
    """The before-training evaluation, read from ``eval.before_cache`` when it holds one for the same model,
    task, problems and length (greedy decoding is deterministic), else computed (and stored there)."""
    from oar.app.tasks.evaluate import HeldoutResult, heldout_accuracy

    key = _before_cache_key(cfg, ev, problems)
    path = ev["before_cache"]
    if path and os.path.exists(path):
        with open(path) as f:
            cached = json.load(f)
        if cached.get("key") == json.loads(json.dumps(key)):
            r = cached["result"]
            return HeldoutResult(r["accuracy"], r["correct"], r["problem_ids"], r["seconds"])
    res = heldout_accuracy(task, problems, model, tokenizer, max_new_tokens=ev["max_new_tokens"],
                           batch_size=ev["batch_size"])
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_json_atomic(path, {"key": key, "result": res.as_dict()})
    return res


def _eval_callback(every: int, evaluate):
    from transformers import TrainerCallback

    class _Eval(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if every > 0 and state.global_step % every == 0 and state.global_step < state.max_steps:
                evaluate(model, state.global_step)

    return _Eval()


def _load_evals(path: str, keep_until: int | None) -> dict:
    from oar.app.tasks.evaluate import HeldoutResult

    if keep_until is None or not os.path.exists(path):
        return {}
    with open(path) as f:
        raw = json.load(f)
    return {int(s): HeldoutResult(r["accuracy"], r["correct"], r["problem_ids"], r["seconds"])
            for s, r in raw.items() if int(s) <= keep_until}


def _record_eval(out: str, evals: dict, step: int, res) -> None:
    evals[step] = res
    write_json_atomic(os.path.join(out, "heldout.json"), {str(s): evals[s].as_dict() for s in sorted(evals)})


class RunFolderError(ValueError):
    """The output folder cannot hold this run as asked (a file; checkpoints of another run; ``resume`` without a
    checkpoint or with other settings). ``oar train`` reports it as a usage error."""


#: Settings a resumed run may change: the budget and what is written, not what is trained.
RESUME_MAY_CHANGE = {("grpo", "max_steps"), ("grpo", "save_steps"), ("grpo", "save_strategy"), ("eval", "every_steps"),
                     ("run", "plot"), ("run", "save_model"), ("grpo", "disable_tqdm")}


def _check_resume_config(out: str, resolved: dict) -> None:
    """Refuses to resume a run under other settings than it was started with (its ``config.json``)."""
    try:
        with open(os.path.join(out, "config.json")) as f:
            old = json.load(f)
    except (OSError, ValueError):
        raise RunFolderError(f"--resume: {out!r} has no readable config.json of the run to continue") from None
    diff = []
    for sec, vals in resolved.items():
        before = old.get(sec) or {}
        for k in sorted(set(vals) | set(before)):
            if (sec, k) not in RESUME_MAY_CHANGE and vals.get(k) != before.get(k):
                diff.append(f"{sec}.{k}: {before.get(k)!r} -> {vals.get(k)!r}")
    if diff:
        raise RunFolderError(f"--resume: the run in {out!r} was started with other settings ({'; '.join(diff[:5])}); "
                             "resume it with the same config and overrides (only the budget and outputs may change)")


def checkpoints(output_dir: str) -> list[str]:
    """TRL/transformers checkpoint folders (``checkpoint-N``) in ``output_dir``, oldest first."""
    found = [d for d in glob.glob(os.path.join(output_dir, "checkpoint-*")) if d.rsplit("-", 1)[-1].isdigit()]
    return sorted(found, key=lambda d: int(d.rsplit("-", 1)[-1]))


def run_training(config: str | None = None, overrides: list[str] | None = None, output_dir: str | None = None,
                 resume: bool = False) -> dict:
    """Runs the main job and returns the summary dict (also written to ``summary.json``).

    Args:
        config: YAML path or shipped config name (default ``default``).
        overrides: ``section.key=value`` strings.
        output_dir: overrides ``run.output_dir``.
        resume: continue from the last ``checkpoint-N`` in the output folder (TRL's checkpointing; the
            metrics of steps after that checkpoint are dropped and redone).

    Raises:
        ValueError: bad config; ``resume`` without a checkpoint; a fresh run into a folder holding
            checkpoints of an earlier run (it would mix two runs: pass ``resume`` or another folder).
    """
    cfg = load_config(config, overrides)
    out = output_dir or cfg.run.get("output_dir", "runs/default")
    ev = eval_settings(cfg)
    # Everything that can be refused is checked before the output folder is touched.
    task, train_problems = build_task(cfg)
    held = heldout_problems(task, ev, train_problems)
    resolved = json.loads(json.dumps({"run": cfg.run, "model": cfg.model, "task": cfg.task, "grpo": cfg.grpo,
                                      "eval": ev, "oar": cfg.oar_dict()}))
    if os.path.exists(out) and not os.path.isdir(out):
        raise RunFolderError(f"output folder {out!r} is a file, not a folder")
    ckpts = checkpoints(out) if os.path.isdir(out) else []
    keep_until = None
    if resume:
        if not ckpts:
            raise RunFolderError(f"--resume: no checkpoint-N folder in {out!r} (checkpoints are written when "
                                 "grpo.save_strategy=steps and grpo.save_steps=N)")
        _check_resume_config(out, resolved)
        try:
            with open(os.path.join(ckpts[-1], "trainer_state.json")) as f:
                keep_until = int(json.load(f)["global_step"])
        except (OSError, ValueError, KeyError) as e:
            raise RunFolderError(f"--resume: {ckpts[-1]!r} has no readable trainer_state.json ({e})") from None
    elif ckpts:
        raise RunFolderError(f"output folder {out!r} holds checkpoints of an earlier run "
                             f"({os.path.basename(ckpts[-1])}): pass --resume to continue it, or choose another "
                             "--output-dir")
    elif any(os.path.exists(os.path.join(out, f)) for f in ("metrics.jsonl", "summary.json", "model")):
        # An earlier run's results are never overwritten: they move to OUT.1 (OUT.2, ...).
        n = 1
        while os.path.exists(f"{out.rstrip(os.sep)}.{n}"):
            n += 1
        os.replace(out, f"{out.rstrip(os.sep)}.{n}")
        _console(f"[oar] {out} held an earlier run: moved it to {out.rstrip(os.sep)}.{n}")
    os.makedirs(out, exist_ok=True)
    if os.path.exists(os.path.join(out, "summary.json")):
        os.remove(os.path.join(out, "summary.json"))  # resume: the run is not finished until it is rewritten
    write_json_atomic(os.path.join(out, "config.json"), {"source": cfg.source, **resolved})
    writer = MetricsWriter(os.path.join(out, "metrics.jsonl"), keep_until)
    t0 = time.perf_counter()
    # Per-problem results of every held-out evaluation, by step (heldout.json; a resumed run reloads them).
    evals = _load_evals(os.path.join(out, "heldout.json"), keep_until)
    try:
        def evaluate(model, step):
            from oar.app.tasks.evaluate import heldout_accuracy

            res = heldout_accuracy(task, held, model, tokenizer, max_new_tokens=ev["max_new_tokens"],
                                   batch_size=ev["batch_size"])
            _record_eval(out, evals, step, res)
            writer.write_eval(step, res)
            release_memory()
            _console(f"[oar] step {step}: heldout/accuracy {res.accuracy:.3f} ({sum(res.correct)}/{len(held)}, "
                     f"greedy, {res.seconds:.0f} s)")

        cbs = [writer.callback]
        if held and ev["every_steps"]:
            cbs.append(_eval_callback(ev["every_steps"], evaluate))
        trainer, task = build_trainer(cfg, out, callbacks=cbs, task=task, problems=train_problems)
        tokenizer = trainer.processing_class
        load_s = time.perf_counter() - t0
        if held and keep_until is None:
            res = _evaluate_before(cfg, ev, task, held, trainer.model, tokenizer)
            _record_eval(out, evals, 0, res)
            writer.write_eval(0, res)
            _console(f"[oar] before training: heldout/accuracy {res.accuracy:.3f} ({sum(res.correct)}/{len(held)} "
                     f"held-out problems, greedy)")
        trainer.train(resume_from_checkpoint=ckpts[-1] if resume else None)
        final_step = int(trainer.state.global_step)
        # Training is over (checkpoints, if any, are written): the optimizer's moments (2x the parameters) are
        # dead weight for the final evaluation and the save, whose own buffers would stack on them.
        if getattr(trainer, "optimizer", None) is not None:
            trainer.optimizer.state.clear()
        release_memory()
        if held:
            evaluate(trainer.model, final_step)
        model_dir = None
        if cfg.run.get("save_model", True):
            model_dir = os.path.join(out, "model")
            trainer.save_model(model_dir)
    finally:
        writer.close()
    rows = writer.rows
    if cfg.run.get("plot", True) and rows:
        plot_reward_curve(rows, os.path.join(out, "reward_curve.png"),
                          f"GRPO + OAR ({cfg.oar.method}, {cfg.oar.probe}) on {cfg.task.get('name', 'arithmetic')}")
    summary = summarize(writer, evals, final_step, clusters=[task.cluster(p) for p in held] if held else None)
    precision = "bf16-autocast" if trainer.args.bf16 else ("fp16-autocast" if trainer.args.fp16 else "float32")
    summary.update({"method": cfg.oar.method, "seed": int(cfg.run.get("seed", 0)), "peak_rss_mb": peak_rss_mb(),
                    "precision": precision,
                    "load_seconds": load_s, "wall_seconds": time.perf_counter() - t0, "output_dir": out,
                    "model_dir": model_dir})
    write_json_atomic(os.path.join(out, "summary.json"), summary)
    return summary


def summarize(writer: MetricsWriter, evals: dict, final_step: int, clusters=None) -> dict:
    """The summary of a finished run: per metric name (the names of metrics.jsonl) its aggregates. ``clusters``:
    one label per held-out problem (``Task.cluster``), the unit the gain's interval resamples (None: problems)."""
    from oar.app.stats import bootstrap_mean

    train = writer.train_rows()

    def agg(key, sl=slice(None)):
        vals = [r[key] for r in train[sl] if key in r and not math.isnan(r[key])]
        return sum(vals) / len(vals) if vals else None

    out: dict[str, Any] = {"steps": final_step}
    out["reward"] = {"first5": agg("reward", slice(0, 5)), "last5": agg("reward", slice(-5, None)),
                     "per_step": [r.get("reward") for r in train]}
    for key in ("time/generation", "time/attribution", "time/update", "step_time", "oar/ess_ratio",
                "oar/top10_mass", "completions/mean_length"):
        out[key] = {"mean": agg(key)}
    if evals:
        before, after = evals.get(0), evals.get(final_step)
        held: dict[str, Any] = {"n": len(next(iter(evals.values())).correct),
                                "history": [[s, evals[s].accuracy] for s in sorted(evals)],
                                "before": before.accuracy if before is not None else None,
                                "after": after.accuracy if after is not None else None}
        if before is not None and after is not None:
            # Paired over the same problems: per-problem differences in {-1, 0, 1}, bootstrap over the task's
            # clusters (problems, or the arithmetic task's facts: Task.cluster).
            diffs = [a - b for a, b in zip(after.correct, before.correct)]
            if clusters is not None:
                held["clusters"] = len(set(clusters))
            # one cluster (one problem, or one fact) gives no interval
            one = len(set(clusters)) < 2 if clusters is not None else len(diffs) < 2
            held["gain"] = None if one else bootstrap_mean(diffs, seed=0, clusters=clusters).as_dict()
            held["correct_before"] = before.correct
            held["correct_after"] = after.correct
            held["problem_ids"] = after.problem_ids
        out["heldout/accuracy"] = held
    return out


def format_summary(summary: dict) -> str:
    """A few console lines for a finished run (the full summary is in ``summary.json``)."""
    lines = [f"[oar] finished {summary['steps']} steps in {summary['wall_seconds'] / 60:.1f} min "
             f"(peak memory {summary['peak_rss_mb'] / 1024:.2f} GiB); outputs in {summary['output_dir']}"]
    rw = summary["reward"]
    if rw["first5"] is not None:
        lines.append(f"[oar] reward (training rollouts): first 5 steps {rw['first5']:.3f}, last 5 steps {rw['last5']:.3f}")
    held = summary.get("heldout/accuracy")
    if held and held.get("before") is not None and held.get("after") is not None:
        g = held.get("gain")
        gain = f"; gain {g['mean']:+.3f}, 95% CI [{g['lo']:+.3f}, {g['hi']:+.3f}]" if g else ""
        facts = f" of {held['clusters']} facts" if held.get("clusters") not in (None, held["n"]) else ""
        lines.append(f"[oar] heldout/accuracy (greedy, {held['n']} problems{facts} never trained on): "
                     f"before {held['before']:.3f} -> after {held['after']:.3f}{gain}")
    if summary.get("model_dir"):
        lines.append(f"[oar] trained policy saved to {summary['model_dir']} (oar.app.models.load_model(path))")
    return "\n".join(lines)
