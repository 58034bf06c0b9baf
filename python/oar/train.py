"""The main job: GRPO training with OAR per-token advantages through TRL (``oar train``).

Reads a run config (oar.config), loads the model (oar.models) and task (oar.tasks), trains with
:class:`oar.integrations.trl.OARGRPOTrainer`, and writes to ``run.output_dir``:

- ``metrics.jsonl``: one JSON object per optimizer step: step, reward mean/std, share of zero-variance
  groups, ESS ratio, top-10% advantage mass, time split (generation / attribution / update, seconds),
  loss, KL, completion length, plus every ``oar/*`` metric;
- ``reward_curve.png``: reward mean per step (matplotlib);
- ``config.json``: the resolved configuration (oar section as parsed by the C++ schema);
- ``summary.json``: written last, only when the run completed (a run that failed leaves none, so a
  partial metrics file is never mistaken for a finished run).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch

from oar.config import RunConfig, load_config


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


class MetricsWriter:
    """TrainerCallback writing one JSONL line per logged step and updating a rich progress line."""

    KEYS = {
        "reward": "reward_mean", "reward_std": "reward_std", "frac_reward_zero_std": "zero_std_group_frac",
        "oar/ess_ratio": "ess_ratio", "oar/top10_mass": "top10_mass", "time/generation": "time_generation_s",
        "time/attribution": "time_attribution_s", "step_time": "step_time_s", "loss": "loss", "kl": "kl",
        "completions/mean_length": "completion_length",
    }

    def __init__(self, path: str, max_steps: int):
        from transformers import TrainerCallback

        self.path = path
        self.max_steps = max_steps
        self.rows: list[dict] = []
        self.fh = open(path, "w")
        writer = self

        class _CB(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                writer.write(state.global_step, logs or {})

        self.callback = _CB()

    def write(self, step: int, logs: dict) -> None:
        if "reward" not in logs:  # the final train summary log has no reward
            return
        row: dict[str, Any] = {"step": step}
        for k, v in logs.items():
            if isinstance(v, (int, float)):
                row[self.KEYS.get(k, k)] = v
        st = row.get("step_time_s")
        if st is not None:
            gen = row.get("time_generation_s", 0.0)
            att = row.get("time_attribution_s", 0.0)
            row["time_update_s"] = max(st - gen - att, 0.0)
        self.rows.append(row)
        self.fh.write(json.dumps(row) + "\n")
        self.fh.flush()

    def close(self):
        self.fh.close()


def plot_reward_curve(rows: list[dict], path: str, title: str) -> None:
    """Reward mean per step with a 5-step moving average (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    rew = [r.get("reward_mean", float("nan")) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, rew, marker="o", ms=3, lw=1, label="reward mean")
    if len(rew) >= 5:
        ma = [sum(rew[max(0, i - 4): i + 1]) / len(rew[max(0, i - 4): i + 1]) for i in range(len(rew))]
        ax.plot(steps, ma, lw=2, label="5-step average")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward (accuracy)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def build_trainer(cfg: RunConfig, output_dir: str, callbacks=()):
    """Model, tokenizer, dataset, reward function and OARGRPOTrainer for a run config."""
    from datasets import Dataset
    from trl import GRPOConfig

    from oar.integrations.trl import OARGRPOTrainer
    from oar.models import load_by_name
    from oar.tasks import get_task

    seed = int(cfg.run.get("seed", 0))
    torch.manual_seed(seed)
    tcfg = dict(cfg.task)
    task = get_task(tcfg.pop("name", "arithmetic"), **(tcfg.pop("kwargs", None) or {}))
    problems = task.problems("train", n=tcfg.pop("train_size", None), seed=seed)
    if not problems:
        raise ValueError(f"task {task!r} produced no training problems")
    mcfg = dict(cfg.model)
    dtype = getattr(torch, str(mcfg.pop("dtype", "float32")))
    model, tokenizer = load_by_name(mcfg.pop("name", "smollm2-135m-instruct"), dtype=dtype, seed=seed, **mcfg)
    ds = Dataset.from_list(_rows_for_dataset(task, problems))
    grpo = dict(cfg.grpo)
    grpo.setdefault("report_to", "none")
    grpo.setdefault("save_strategy", "no")
    grpo.setdefault("logging_steps", 1)
    grpo.setdefault("use_cpu", not torch.cuda.is_available())
    grpo.setdefault("seed", seed)
    grpo.setdefault("disable_tqdm", False)
    args = GRPOConfig(output_dir=output_dir, **grpo)
    trainer = OARGRPOTrainer(model=model, reward_funcs=[make_reward_func(task, {p.id: p for p in problems})],
                             args=args, train_dataset=ds, processing_class=tokenizer, oar_config=cfg.oar,
                             callbacks=list(callbacks))
    return trainer, task


def run_training(config: str | None = None, overrides: list[str] | None = None, output_dir: str | None = None) -> dict:
    """Runs the main job and returns the summary dict (also written to ``summary.json``)."""
    cfg = load_config(config, overrides)
    out = output_dir or cfg.run.get("output_dir", "runs/default")
    os.makedirs(out, exist_ok=True)
    for stale in ("summary.json",):
        if os.path.exists(os.path.join(out, stale)):
            os.remove(os.path.join(out, stale))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"source": cfg.source, "run": cfg.run, "model": cfg.model, "task": cfg.task, "grpo": cfg.grpo,
                   "oar": cfg.oar_dict()}, f, indent=2)
    max_steps = int(cfg.grpo.get("max_steps", 0))
    writer = MetricsWriter(os.path.join(out, "metrics.jsonl"), max_steps)
    t0 = time.perf_counter()
    try:
        trainer, task = build_trainer(cfg, out, callbacks=[writer.callback])
        load_s = time.perf_counter() - t0
        trainer.train()
    finally:
        writer.close()
    rows = writer.rows
    if cfg.run.get("plot", True) and rows:
        plot_reward_curve(rows, os.path.join(out, "reward_curve.png"),
                          f"GRPO + OAR ({cfg.oar.method}, {cfg.oar.probe}) on {cfg.task.get('name', 'arithmetic')}")

    def mean(key, sl=slice(None)):
        vals = [r[key] for r in rows[sl] if key in r and not math.isnan(r[key])]
        return sum(vals) / len(vals) if vals else None

    summary = {
        "steps": len(rows),
        "reward_first5": mean("reward_mean", slice(0, 5)),
        "reward_last5": mean("reward_mean", slice(-5, None)),
        "reward_per_step": [r.get("reward_mean") for r in rows],
        "mean_time_generation_s": mean("time_generation_s"),
        "mean_time_attribution_s": mean("time_attribution_s"),
        "mean_time_update_s": mean("time_update_s"),
        "mean_ess_ratio": mean("ess_ratio"),
        "mean_top10_mass": mean("top10_mass"),
        "load_seconds": load_s,
        "wall_seconds": time.perf_counter() - t0,
        "output_dir": out,
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
