"""``oar compare``'s report (docs/compare.md): the finished runs of a sweep folder, their statistics (held-out
accuracy with a two-level bootstrap over seeds and problems, paired differences to the baseline with t intervals and
sign-flip tests, training reward, step times over unpaused steps) and the files ``compare.md``, ``compare.csv``,
``compare.png``. The sweep itself, which runs ``oar train`` per method and seed, is :mod:`oar.app.compare`.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
from typing import Any, Sequence

import numpy as np

from oar.app.stats import bootstrap_grid_mean, paired_t, sign_flip_pvalue
from oar.app.runtime import write_json_atomic

__all__ = ["run_name", "load_results", "build_report", "unpaused_steps", "PAUSE_FACTOR", "problem_clusters"]

_log = logging.getLogger("oar")


def run_name(method: str, seed: int) -> str:
    """Folder / result name of one run of the grid: the method (setting) with every run of characters other than
    letters, digits, ``_``, ``=``, ``-`` and single dots replaced by ``+`` (never a path separator or ``..``)."""
    safe = re.sub(r"[^A-Za-z0-9_=.\-]+", "+", str(method).strip()).replace("..", "+")
    return f"{safe}-s{seed}"


def load_results(out_dir: str) -> list[dict]:
    """The finished runs of a sweep folder (``results/*.json``), sorted by method then seed."""
    folder = os.path.join(out_dir, "results")
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                out.append(json.load(f))
    return sorted(out, key=lambda r: (r["method"], r["seed"]))


def _moving_average(x: np.ndarray, k: int = 5) -> np.ndarray:
    out = np.empty_like(x, dtype=np.float64)
    for i in range(len(x)):
        out[i] = x[max(0, i - k + 1): i + 1].mean()
    return out


#: A step counts as paused (SIGSTOP, or slowed by other jobs on the cores) when its step time is more than this
#: many times the median step time of all steps of all runs of the same method; timing medians leave it out.
PAUSE_FACTOR = 2.0
_TIME_KEYS = ("time/generation", "time/attribution", "time/update")


def _step_seconds(t: dict) -> float | None:
    """Wall time of one logged step: TRL's ``step_time``, else the sum of the ``time/*`` parts (older or partial
    logs), else None (no timing logged)."""
    if t.get("step_time") is not None:
        return float(t["step_time"])
    parts = [t[k] for k in _TIME_KEYS if t.get(k) is not None]
    return float(sum(parts)) if parts else None


def unpaused_steps(runs: Sequence[dict]) -> tuple[list[dict], int]:
    """The logged steps of ``runs`` (results of one method) that were not paused, and how many were left out.

    A step is paused when its step time (:func:`_step_seconds`) exceeds :data:`PAUSE_FACTOR` x the median step
    time over all steps of ``runs``: a run stopped with SIGSTOP or sharing its cores shows steps several times
    the median, while the median itself moves little as long as fewer than half the steps are affected. Steps
    without any timing are kept (there is nothing to judge them by).
    """
    rows = [t for r in runs for t in r["train"]]
    secs = [_step_seconds(t) for t in rows]
    timed = [x for x in secs if x is not None]
    if not timed:
        return rows, 0
    limit = PAUSE_FACTOR * float(np.median(timed))
    keep = [t for t, x in zip(rows, secs) if x is None or x <= limit]
    return keep, len(rows) - len(keep)


def _median(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.median(xs)) if xs else None


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(xs)) if xs else None


def _second_half_reward(train: list[dict]) -> float | None:
    """Mean training reward over the second half of the logged steps (the last ceil(n / 2) of n), or None."""
    rewards = [t["reward"] for t in train]
    return float(np.mean(rewards[len(rewards) // 2:])) if rewards else None


def _paired(per_seed: list[float], seeds: list[int], resamples: int, seed: int) -> dict:
    """Paired t interval and sign-flip p-value of per-seed differences; ``interval`` None under 2 seeds."""
    out: dict[str, Any] = {"seeds": seeds, "per_seed": per_seed, "interval": None, "sign_flip_p": None}
    if len(per_seed) >= 2:
        out["interval"] = paired_t(per_seed).as_dict()
        out["sign_flip_p"] = sign_flip_pvalue(per_seed, resamples=resamples, seed=seed)
    return out


def problem_clusters(out_dir: str, ids: list) -> list | None:
    """The task's cluster (``Task.cluster``: the arithmetic task's fact) of each held-out problem ``ids``, from the
    sweep's config and overrides (``grid.json``); None when every problem is its own cluster, or when the task cannot
    be rebuilt here (then the intervals resample problems, as the report says)."""
    try:
        with open(os.path.join(out_dir, "grid.json")) as f:
            grid = json.load(f)
        from oar.app.config import load_config
        from oar.app.train import build_task, eval_settings, heldout_problems

        config = grid["config"]
        if not os.path.exists(config):  # a sweep copied from another machine: the shipped config of that name
            config = os.path.splitext(os.path.basename(config))[0]
        cfg = load_config(config, list(grid.get("overrides", [])))
        task, train_problems = build_task(cfg)
        by_id = {p.id: task.cluster(p) for p in heldout_problems(task, eval_settings(cfg), train_problems)}
        labels = [by_id[i] for i in ids]
    except (OSError, ValueError, KeyError, TypeError) as e:
        _log.warning("oar compare: held-out clusters not rebuilt (%s); intervals resample problems", e)
        return None
    return labels if len(set(labels)) < len(labels) else None


def build_report(out_dir: str, *, baseline: str | None = None, resamples: int = 4000) -> dict:
    """Writes ``compare.md``, ``compare.csv``, ``compare.json`` and ``compare.png`` from the finished runs of
    ``out_dir`` and returns the report as a dict (``baseline``, ``sweep``, ``methods``: one row per method).

    ``baseline`` (None): ``grpo`` if the sweep's methods (``grid.json``) include it, else the first of them.

    Per method (rationale in docs/compare.md): held-out accuracy after training and its gain over before with
    two-level bootstrap intervals (seeds x problems); against the baseline, the primary test on the per-seed
    differences (per seed: mean over problems of method - baseline at the same seed) -- ``paired_vs_<baseline>``:
    Student-t 95% interval (``interval``, None with fewer than 2 common seeds) and two-sided sign-flip p-value
    (``sign_flip_p``) -- and, secondary, ``diff_vs_<baseline>``: the two-level bootstrap of the seed x problem
    differences; training reward over the second half of the steps, and its per-seed paired difference to the
    baseline (``reward_second_half_vs_<baseline>``); medians over unpaused steps (:func:`unpaused_steps`) of
    ``time/generation``, ``time/attribution``, ``time/update`` and ``step_time`` (``steps_paused``: how many were
    left out); the median wall time of a run (``wall_minutes_median``, from each result's ``wall_seconds``); means
    over all steps of all runs of ``oar/ess_ratio``, ``oar/top10_mass`` and ``completions/mean_length``.
    ``sweep``: number of runs and their total wall time (``wall_hours``).

    Raises:
        ValueError: the finished runs were evaluated on different held-out problems (runs of different sweeps
            mixed in one folder).
    """
    results = load_results(out_dir)
    if not results:
        return {}
    ids = results[0]["heldout"]["problem_ids"]
    for r in results:
        if r["heldout"]["problem_ids"] != ids:
            raise ValueError(f"run {run_name(r['method'], r['seed'])} was evaluated on other held-out problems than "
                             "the rest of this sweep folder")
    clusters = problem_clusters(out_dir, ids)
    methods = list(dict.fromkeys(r["method"] for r in results))
    if baseline is None:
        try:
            with open(os.path.join(out_dir, "grid.json")) as f:
                grid_methods = json.load(f)["methods"]
        except (OSError, ValueError, KeyError):
            grid_methods = methods
        baseline = "grpo" if "grpo" in grid_methods else grid_methods[0]
    if baseline not in methods:
        baseline = methods[0]
    # Before-training results per run (the same for every run of a pretrained model; seed-dependent only for a
    # randomly initialised one).
    before_by = {(r["method"], r["seed"]): np.asarray(r["heldout"]["correct_before"], dtype=np.float64) for r in results}
    before = np.mean([b.mean() for b in before_by.values()])
    by_m = {m: {r["seed"]: r for r in results if r["method"] == m} for m in methods}
    table: dict[str, dict[str, Any]] = {}
    for i, m in enumerate(methods):
        rs = by_m[m]
        seeds = sorted(rs)
        after = np.asarray([rs[s]["heldout"]["correct_after"] for s in seeds], dtype=np.float64)
        bef = np.stack([before_by[(m, s)] for s in seeds])
        row: dict[str, Any] = {"method": m, "seeds": seeds, "n_problems": len(ids), "heldout_before": float(bef.mean()),
                               "n_clusters": len(set(clusters)) if clusters else len(ids)}
        row["heldout_after"] = bootstrap_grid_mean(after, resamples=resamples, seed=i, clusters=clusters).as_dict()
        row["gain_vs_before"] = bootstrap_grid_mean(after - bef, resamples=resamples, seed=i,
                                                    clusters=clusters).as_dict()
        row["heldout_after_per_seed"] = [float(a.mean()) for a in after]
        half = {s: _second_half_reward(rs[s]["train"]) for s in seeds}
        row["reward_second_half"] = _mean(half.values())
        common = [s for s in seeds if s in by_m[baseline]]
        if m != baseline and common:
            base = by_m[baseline]
            d = np.asarray([np.asarray(rs[s]["heldout"]["correct_after"]) -
                            np.asarray(base[s]["heldout"]["correct_after"]) for s in common], dtype=np.float64)
            row[f"paired_vs_{baseline}"] = _paired([float(x) for x in d.mean(axis=1)], common, 20000, 200 + i)
            row[f"diff_vs_{baseline}"] = bootstrap_grid_mean(d, resamples=resamples, seed=100 + i,
                                                             clusters=clusters).as_dict()
            row[f"diff_vs_{baseline}"]["seeds"] = common
            both = [s for s in common if half[s] is not None and _second_half_reward(base[s]["train"]) is not None]
            row[f"reward_second_half_vs_{baseline}"] = _paired(
                [half[s] - _second_half_reward(base[s]["train"]) for s in both], both, 20000, 300 + i)
        trains = [rs[s]["train"] for s in seeds if rs[s]["train"]]
        row["reward_first5"] = _mean([np.mean([t["reward"] for t in tr[:5]]) for tr in trains])
        row["reward_last5"] = _mean([np.mean([t["reward"] for t in tr[-5:]]) for tr in trains])
        kept, paused = unpaused_steps([rs[s] for s in seeds])
        for key in _TIME_KEYS + ("step_time",):
            row[key] = _median([t.get(key) for t in kept])
        row["steps_paused"] = paused
        row["steps_logged"] = sum(len(rs[s]["train"]) for s in seeds)
        for key in ("oar/ess_ratio", "oar/top10_mass", "completions/mean_length"):
            row[key] = _mean([t.get(key) for s in seeds for t in rs[s]["train"]])
        walls = [rs[s]["wall_seconds"] / 60 for s in seeds]
        row["wall_minutes_median"] = float(np.median(walls))
        row["wall_minutes_range"] = [float(min(walls)), float(max(walls))]
        table[m] = row
    sweep = {"runs": len(results), "wall_hours": float(sum(r["wall_seconds"] for r in results) / 3600)}
    report = {"baseline": baseline, "sweep": sweep, "methods": table}
    write_json_atomic(os.path.join(out_dir, "compare.json"), report)
    _write_csv(os.path.join(out_dir, "compare.csv"), table, baseline)
    _write_md(os.path.join(out_dir, "compare.md"), report, out_dir)
    _plot(os.path.join(out_dir, "compare.png"), by_m, table, float(before))
    return report


def _iv(d: dict | None, pct: bool = True) -> str:
    if not d:
        return "-"
    f, spec = (100.0, "+.1f") if pct else (1.0, "+.3f")
    return f"{d['mean'] * f:{spec}} [{d['lo'] * f:{spec}}, {d['hi'] * f:{spec}}]"


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def _pt(p: dict | None, pct: bool = True) -> str:
    """A paired test's interval as ``mean [lo, hi]`` (points), or why there is none."""
    if not p:
        return "-"
    if p["interval"] is None:
        return f"fewer than 2 common seeds ({len(p['seeds'])})"
    return _iv(p["interval"], pct)


def _write_csv(path: str, table: dict, baseline: str) -> None:
    b = baseline
    cols = ["method", "n_seeds", "n_problems", "heldout_before", "heldout_after", "heldout_after_lo",
            "heldout_after_hi", f"paired_t_vs_{b}", f"paired_t_vs_{b}_lo", f"paired_t_vs_{b}_hi",
            f"sign_flip_p_vs_{b}", f"bootstrap_diff_vs_{b}", f"bootstrap_diff_vs_{b}_lo", f"bootstrap_diff_vs_{b}_hi",
            "reward_first5", "reward_last5", "reward_second_half", f"reward_second_half_vs_{b}",
            f"reward_second_half_vs_{b}_lo", f"reward_second_half_vs_{b}_hi", "median_time/generation",
            "median_time/attribution", "median_time/update", "median_step_time", "steps_paused", "steps_logged",
            "wall_minutes_median", "oar/ess_ratio", "oar/top10_mass"]
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for m, r in table.items():
            pt = r.get(f"paired_vs_{b}") or {}
            iv = pt.get("interval") or {}
            d = r.get(f"diff_vs_{b}") or {}
            rh = (r.get(f"reward_second_half_vs_{b}") or {}).get("interval") or {}
            w.writerow([m, len(r["seeds"]), r["n_problems"], r["heldout_before"], r["heldout_after"]["mean"],
                        r["heldout_after"]["lo"], r["heldout_after"]["hi"], iv.get("mean"), iv.get("lo"), iv.get("hi"),
                        pt.get("sign_flip_p"), d.get("mean"), d.get("lo"), d.get("hi"), r["reward_first5"],
                        r["reward_last5"], r["reward_second_half"], rh.get("mean"), rh.get("lo"), rh.get("hi"),
                        r["time/generation"], r["time/attribution"], r["time/update"], r["step_time"],
                        r["steps_paused"], r["steps_logged"], r["wall_minutes_median"], r["oar/ess_ratio"],
                        r["oar/top10_mass"]])
    os.replace(tmp, path)


def _write_md(path: str, report: dict, out_dir: str) -> None:
    base = report["baseline"]
    table = report["methods"]
    sw = report["sweep"]
    first = next(iter(table.values()))
    n_cl = first.get("n_clusters", first["n_problems"])
    units = "problems" if n_cl == first["n_problems"] else f"the problems' {n_cl} facts, each resampled whole"
    lines = [f"# oar compare: {', '.join(table)}", "",
             f"Held-out accuracy (greedy, {first['n_problems']} problems never trained on), "
             "in points. `before`, `after`, `after - before`: mean over seeds and problems with a two-level bootstrap "
             f"95% interval (seeds x {units}). `vs {base}` (the test): per seed, the mean over problems of method - "
             f"{base} at the same seed; their mean with a Student-t 95% interval (seeds - 1 degrees of freedom) and "
             "the two-sided sign-flip permutation p-value (exact over all sign patterns up to 16 seeds, else Monte "
             f"Carlo). `vs {base}, bootstrap`: the same differences per seed and "
             "problem, two-level bootstrap (secondary: it counts the seed x problem noise twice). `train reward, 2nd "
             f"half`: mean training reward over the second half of the steps, and its per-seed paired difference to "
             f"{base} (t interval). Times: medians over steps, leaving out paused steps (step time > "
             f"{PAUSE_FACTOR:g}x the method's median step time; the count is shown); wall: median minutes per run. "
             "ESS ratio and top-10% mass: means over all steps of all runs of a method.", "",
             f"| method | seeds | before | after | after - before | vs {base} [t 95%] | sign-flip p | "
             f"vs {base}, bootstrap | train reward, 2nd half (vs {base}) | gen / attr / update s per step (paused) | "
             "wall min per run | ESS ratio | top-10% mass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in table.items():
        a = r["heldout_after"]
        pt = r.get(f"paired_vs_{base}")
        p = "-" if not pt or pt["sign_flip_p"] is None else f"{pt['sign_flip_p']:.3f}"
        rew = _fmt(r["reward_second_half"], ".3f")
        if m != base:
            rew += f" ({_pt(r.get(f'reward_second_half_vs_{base}'), pct=False)})"
        times = " / ".join(_fmt(r[k], ".1f") for k in _TIME_KEYS) + f" ({r['steps_paused']}/{r['steps_logged']})"
        lines.append(f"| {m} | {len(r['seeds'])} | {r['heldout_before'] * 100:.1f} | {a['mean'] * 100:.1f} "
                     f"[{a['lo'] * 100:.1f}, {a['hi'] * 100:.1f}] | {_iv(r['gain_vs_before'])} | "
                     f"{_pt(pt) if m != base else '(baseline)'} | {p if m != base else '-'} | "
                     f"{_iv(r.get(f'diff_vs_{base}')) if m != base else '-'} | {rew} | {times} | "
                     f"{r['wall_minutes_median']:.1f} | {_fmt(r['oar/ess_ratio'], '.3f')} | "
                     f"{_fmt(r['oar/top10_mass'], '.3f')} |")
    lines += ["", f"Sweep: {sw['runs']} runs, {sw['wall_hours']:.1f} h of wall time in all; runs took "
              + "; ".join(f"{m} {r['wall_minutes_range'][0]:.1f}-{r['wall_minutes_range'][1]:.1f} min"
                          for m, r in table.items()) + ".",
              "", "Per seed (held-out accuracy after training): " + "; ".join(
        f"{m}: " + ", ".join(f"s{s} {v:.3f}" for s, v in zip(r["seeds"], r["heldout_after_per_seed"]))
        for m, r in table.items()), "", f"Plot: `{os.path.join(out_dir, 'compare.png')}`", ""]
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines))
    os.replace(path + ".tmp", path)


def _plot(path: str, by_m: dict, table: dict, before: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), dpi=120, gridspec_kw={"width_ratios": [3, 2]})
    for m, rs in by_m.items():
        n = min(len(r["train"]) for r in rs.values())
        if n == 0:
            continue
        curves = np.asarray([_moving_average(np.asarray([t["reward"] for t in r["train"][:n]])) for r in rs.values()])
        steps = np.arange(1, n + 1)
        mu, sd = curves.mean(0), curves.std(0)
        (line,) = ax.plot(steps, mu, lw=2, label=f"{m} ({len(rs)} seeds)")
        ax.fill_between(steps, mu - sd, mu + sd, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training reward (5-step average)")
    ax.set_title("reward: mean over seeds, band = 1 std", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    names = list(table)
    means = [table[m]["heldout_after"]["mean"] for m in names]
    err = np.asarray([[table[m]["heldout_after"]["mean"] - table[m]["heldout_after"]["lo"] for m in names],
                      [table[m]["heldout_after"]["hi"] - table[m]["heldout_after"]["mean"] for m in names]])
    bx.bar(names, means, yerr=err, capsize=4, color="#4c72b0", alpha=0.8, label="after training (95% CI)")
    bx.axhline(before, color="black", ls="--", lw=1, label=f"before training ({before:.3f})")
    for i, m in enumerate(names):
        vals = table[m]["heldout_after_per_seed"]
        bx.scatter([i] * len(vals), vals, color="black", s=10, zorder=3)
    bx.set_ylabel("held-out accuracy (greedy)")
    bx.set_ylim(0, 1)
    bx.set_title("held-out accuracy, dots = seeds", fontsize=9)
    bx.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path + ".tmp.png")
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
