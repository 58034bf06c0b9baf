"""``oar compare``: a grid of methods x seeds on one config and budget, side by side, with intervals.

Every run is an ``oar train`` run (the same TRL path, in a child process: a crash or a kill loses at most
the run in progress), with ``oar.method`` and ``run.seed`` / ``oar.seed`` set from the grid, evaluated on
the same held-out problems before and after training (the before-training evaluation is computed once and
shared: greedy decoding of the same initial model is deterministic).

Layout of ``--out`` (default ``runs/compare``):

- ``grid.json``: config, overrides, methods, seeds (a resumed sweep must use the same config and overrides);
- ``runs/<method>-s<seed>/``: the run folder (metrics.jsonl, summary.json, log.txt); a method may carry config keys
  of its own (``oar_g:credit_rows=positive``: :func:`parse_method`; its folder ``oar_g+credit_rows=positive-s0``);
- ``results/<method>-s<seed>.json``: written atomically when the run finished; a sweep started again
  skips these and redoes only runs without one (a half-done run's folder is cleared first);
- ``compare.md``, ``compare.csv``, ``compare.png``: the report (:func:`oar.app.compare_report.build_report`),
  rebuilt after every finished run, from finished runs only.

Statistics (docs/compare.md): held-out accuracy after training with a two-level bootstrap 95% interval over
seeds and problems; the difference to the baseline method tested on the per-seed paired differences (Student-t
interval and sign-flip permutation p-value; the seed x problem bootstrap of the same differences is kept as a
secondary column); training reward over the second half of the steps, paired by seed; reward curves with a
band of one standard deviation over seeds; median time per step split into generation / attribution / update
over unpaused steps, median wall time per run and the sweep's total; ESS ratio and top-10% mass.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from typing import Sequence

from oar.app._extras import require

require("train", "oar.app.compare")  # runs `oar train`, plots with matplotlib, shows progress with rich

from oar.app.compare_report import build_report, run_name  # noqa: E402
from oar.app.runtime import write_json_atomic  # noqa: E402

__all__ = ["DEFAULT_METHODS", "run_compare", "check_grid", "parse_method"]

#: Methods compared by default: plain GRPO, OAR-G, OAR-P, and the random-importance control (OAR's
#: reshaping with U(0,1) scores: shows whether the reshaping alone, not the attribution, is what helps).
DEFAULT_METHODS = ("grpo", "oar_g", "oar_p", "random")
_log = logging.getLogger("oar")
_KEEP_KEYS = ("reward", "time/generation", "time/attribution", "time/update", "step_time", "oar/ess_ratio",
              "oar/top10_mass", "completions/mean_length")


def parse_method(spec: str) -> tuple[str, list[str]]:
    """A grid entry: a method name, or a method with ``oar`` config keys of its own (``oar_g:credit_rows=positive``,
    ``oar_g:q=0.5,beta=2``; docs/config.md) -> ``(method, ["oar.key=value", ...])``. Values are YAML scalars, as
    in ``--set``; items are split at commas, so a value cannot hold one (set such keys with ``--set`` for the
    whole sweep).

    Raises:
        ValueError: a method not in ``oar.METHODS``, an item without ``=``, a key given twice, the per-run keys
            ``method`` / ``seed``, or a key or value the config schema refuses (its message, naming the key).
    """
    return _parse_method(spec)[:2]


def _parse_method(spec: str) -> tuple[str, list[str], str]:
    """:func:`parse_method`, and the setting in a canonical form (method and parsed key values, sorted: two
    spellings of one setting, ``q=0.5,beta=2`` and ``beta=2,q=0.50``, are equal)."""
    import oar
    from oar.schema import config_from_mapping, parse_method_spec

    name, keys, items = parse_method_spec(str(spec), list(oar.METHODS))
    for k in keys:
        if k in ("method", "seed"):
            raise ValueError(f"method {spec!r}: oar.{k} is set per run by oar compare")
    overrides = [f"oar.{k}={v}" for k, v in items]
    config_from_mapping({"method": name, **keys})  # the schema's own checks, naming the key
    return name, overrides, json.dumps([name, sorted(keys.items())])


#: Overrides ``oar compare`` sets per run; a sweep-wide override of one of them is refused.
PER_RUN_KEYS = ("oar.method", "run.seed", "oar.seed", "eval.before_cache", "run.output_dir")


def check_grid(methods: Sequence[str], seeds: Sequence[int], overrides: Sequence[str] = ()) -> None:
    """Validates a grid before anything runs.

    Raises:
        ValueError: a method not in ``oar.METHODS`` or a bad setting (:func:`parse_method`), repeated methods or
            seeds, a negative or non-int seed, or an override of a key set per run (:data:`PER_RUN_KEYS`).
    """
    for o in overrides:
        if o.split("=", 1)[0] in PER_RUN_KEYS:
            raise ValueError(f"override {o!r} is set per run by oar compare; remove it")

    if not methods:
        raise ValueError("methods must name at least one method")
    seen: dict = {}
    for m in methods:
        canon = _parse_method(m)[2]
        for other, (c, name) in seen.items():
            if c == canon or name == run_name(m, 0):
                raise ValueError(f"methods must not repeat, got {other!r} and {m!r} (the same setting or run name)")
        seen[m] = (canon, run_name(m, 0))
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"seeds must be a non-empty list of non-negative ints, got {list(seeds)}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must not repeat, got {list(seeds)}")


def _grid_file(out_dir: str, config: str | None, overrides: list[str], methods, seeds) -> None:
    """Writes ``grid.json``, or checks that a resumed sweep has the same resolved configuration (the config
    file's values after the overrides; comments and formatting may change). An ``oar`` key the stored grid lacks
    (added by a later oar) counts as its built-in default, so a sweep stays resumable across such additions.

    Raises:
        ValueError: the stored grid resolves to another configuration (the message lists the differing keys).
    """
    import oar
    from oar.app.config import load_config, resolve_config

    path = os.path.join(out_dir, "grid.json")
    cfg = load_config(config, overrides)
    resolved = json.loads(json.dumps({"run": cfg.run, "model": cfg.model, "task": cfg.task, "grpo": cfg.grpo,
                                      "eval": cfg.eval, "oar": cfg.oar_dict()}))
    grid = {"config": os.path.abspath(resolve_config(config)), "overrides": list(overrides), "resolved": resolved,
            "methods": list(methods), "seeds": list(seeds)}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if "oar" in old.get("resolved", {}):
            old["resolved"]["oar"] = {**json.loads(oar.OARConfig().to_json()), **old["resolved"]["oar"]}
        if old.get("resolved") != resolved:
            diff = sorted(f"{sec}.{k}" for sec in resolved for k in set(resolved[sec]) | set(old.get("resolved", {}).get(sec, {}))
                          if resolved[sec].get(k) != old.get("resolved", {}).get(sec, {}).get(k))
            raise ValueError(f"{out_dir!r} holds a sweep of another configuration (differs in {diff[:6]}); resume it with "
                             "the same config and overrides, or pass another --out")
        grid["methods"] = list(dict.fromkeys(old["methods"] + list(methods)))
        grid["seeds"] = list(dict.fromkeys(old["seeds"] + list(seeds)))
    write_json_atomic(path, grid)


def _count_steps(metrics_path: str) -> int:
    try:
        with open(metrics_path) as f:
            return sum(1 for line in f if '"reward"' in line)
    except OSError:
        return 0


def _run_one(cmd: list[str], run_dir: str, max_steps: int, on_step) -> int:
    """Runs one ``oar train`` child, logging to ``run_dir/log.txt``; calls ``on_step(k)`` as steps finish."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            while proc.poll() is None:
                time.sleep(2.0)
                on_step(_count_steps(os.path.join(run_dir, "metrics.jsonl")))
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    on_step(_count_steps(os.path.join(run_dir, "metrics.jsonl")))
    return proc.returncode


def _result_from_run(run_dir: str, method: str, seed: int) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train = [{k: r[k] for k in ("step",) + _KEEP_KEYS if k in r} for r in rows if "reward" in r]
    held = summary.get("heldout/accuracy") or {}
    if held.get("correct_after") is None:
        raise ValueError(f"run {run_dir!r} has no held-out evaluation before and after (eval.problems=0?)")
    return {"method": method, "seed": seed, "steps": summary["steps"], "train": train,
            "heldout": {k: held[k] for k in ("before", "after", "correct_before", "correct_after", "problem_ids")},
            "wall_seconds": summary["wall_seconds"], "peak_rss_mb": summary["peak_rss_mb"]}


def run_compare(config: str | None, overrides: Sequence[str], methods: Sequence[str] = DEFAULT_METHODS,
                seeds: Sequence[int] = (0, 1, 2, 3, 4), out_dir: str = "runs/compare", *, max_runs: int | None = None,
                save_models: bool = False, progress: bool = True,
                python: str = sys.executable) -> dict:
    """Runs (or resumes) the grid and writes the report; returns ``{"done", "failed", "pending", "report"}``.

    Runs go seed-major (every method at seed 0, then at seed 1, ...), so a sweep stopped early still
    compares the methods on the same seeds.

    Args:
        config, overrides: as for ``oar train`` (``oar.method`` / ``run.seed`` / ``oar.seed`` are set per run).
        methods: names of ``oar.METHODS``; the first is the baseline of the paired differences unless
            ``grpo`` is among them.
        seeds: run seeds (training problems, sampling, OAR-G noise and random scores all follow it).
        out_dir: sweep folder (layout in the module docstring).
        max_runs: stop after this many runs have been started in this call (None: all pending).
        save_models: keep each run's trained policy (``model/``, ~0.5 GB for SmolLM2-135M).
        progress: show a rich progress display over the grid.
        python: interpreter of the child runs.

    Raises:
        ValueError: unknown or repeated methods or seeds, a bad config, ``out_dir`` holding a sweep of
            another configuration, or another ``oar compare`` running on ``out_dir`` (a lock file).
    """
    from oar.app.config import load_config
    from oar.app.train import eval_settings

    overrides = list(overrides)
    check_grid(methods, seeds, overrides)
    cfg = load_config(config, overrides)
    ev = eval_settings(cfg)
    if ev["problems"] < 1:
        raise ValueError("oar compare needs a held-out evaluation: eval.problems must be >= 1")
    os.makedirs(os.path.join(out_dir, "results"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "runs"), exist_ok=True)
    lock = open(os.path.join(out_dir, ".lock"), "w")
    try:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ValueError(f"another oar compare is running on {out_dir!r} (its lock file .lock is held)") from None
    except ImportError:  # pragma: no cover - not POSIX
        pass
    try:
        return _run_grid(config, overrides, methods, seeds, out_dir, cfg, max_runs, save_models, progress, python)
    finally:
        lock.close()


def _run_grid(config, overrides, methods, seeds, out_dir, cfg, max_runs, save_models, progress, python) -> dict:
    from oar.app.config import resolve_config

    max_steps = int(cfg.grpo.get("max_steps", 0))
    _grid_file(out_dir, config, overrides, methods, seeds)
    grid = [(m, s) for s in seeds for m in methods]
    todo = [(m, s) for m, s in grid if not os.path.exists(os.path.join(out_dir, "results", run_name(m, s) + ".json"))]
    if max_runs is not None:
        todo = todo[:max_runs]
    failed: list[str] = []
    cfg_arg = os.path.abspath(resolve_config(config))
    before_cache = os.path.abspath(os.path.join(out_dir, "heldout_before.json"))

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not progress) as bar:
        finished = sum(os.path.exists(os.path.join(out_dir, "results", run_name(m, s) + ".json")) for m, s in grid)
        t_grid = bar.add_task("sweep (runs)", total=len(grid), completed=finished)
        for method, seed in todo:
            name = run_name(method, seed)
            run_dir = os.path.join(out_dir, "runs", name)
            if os.path.exists(run_dir):  # a run that did not finish: never reported, redone from scratch
                shutil.rmtree(run_dir)
            cmd = [python, "-m", "oar.app.cli", "train", "--config", cfg_arg, "--output-dir", run_dir]
            base, own = parse_method(method)
            for o in overrides + own + [f"oar.method={base}", f"run.seed={seed}", f"oar.seed={seed}",
                                  f"eval.before_cache={before_cache}", "run.plot=false",
                                  f"run.save_model={'true' if save_models else 'false'}"]:
                cmd += ["--set", o]
            t_run = bar.add_task(f"  {name} (steps)", total=max_steps or None)
            rc = _run_one(cmd, run_dir, max_steps, lambda k, t=t_run: bar.update(t, completed=k))
            bar.remove_task(t_run)
            try:
                if rc != 0:
                    raise RuntimeError(f"exit {rc}")
                result = _result_from_run(run_dir, method, seed)
            except (RuntimeError, OSError, ValueError, KeyError) as e:
                failed.append(name)
                console.print(f"[red]run {name} failed ({e}); its log: {os.path.join(run_dir, 'log.txt')}[/red]")
                continue
            write_json_atomic(os.path.join(out_dir, "results", name + ".json"), result)
            bar.update(t_grid, advance=1)
            h = result["heldout"]
            console.print(f"run {name}: heldout/accuracy {h['before']:.3f} -> {h['after']:.3f} "
                          f"({result['wall_seconds'] / 60:.1f} min)")
            build_report(out_dir)
    report = build_report(out_dir)
    pending = [run_name(m, s) for m, s in grid
               if not os.path.exists(os.path.join(out_dir, "results", run_name(m, s) + ".json"))]
    return {"done": len(grid) - len(pending), "failed": failed, "pending": pending, "report": report}
