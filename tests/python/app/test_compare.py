"""oar.app.stats (bootstrap intervals) and oar compare (grid runs, resume, report) on tiny runs and synthetic results."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from oar.app.compare import run_compare
from oar.app.compare_report import build_report, run_name
from oar.app.stats import bootstrap_grid_mean, bootstrap_mean
from oar.app.runtime import write_json_atomic

from _paths import BENCH_ANALYSIS, DOCS


# ------------------------------------------------------------------------------------------------ stats

def test_bootstrap_mean_matches_the_normal_interval_of_a_proportion():
    # 0/1 outcomes, n = 400, p = 0.3: the bootstrap distribution of the mean is close to N(p, p(1-p)/n), so its
    # 95% bounds are p -+ 1.96 sd (sd = 0.0229). Error budget: percentile quantiles from 20000 resamples move by
    # about sd * 0.06 (Monte Carlo), plus the discreteness of a mean of 0/1 values (1/n = 0.0025).
    x = np.array([1] * 120 + [0] * 280)
    iv = bootstrap_mean(x, resamples=20000, seed=3)
    sd = math.sqrt(0.3 * 0.7 / 400)
    assert iv.mean == pytest.approx(0.3)
    assert iv.lo == pytest.approx(0.3 - 1.96 * sd, abs=0.2 * sd + 1 / 400)
    assert iv.hi == pytest.approx(0.3 + 1.96 * sd, abs=0.2 * sd + 1 / 400)
    assert iv.n == 400 and iv.level == 0.95


def test_bootstrap_invariants():
    const = bootstrap_grid_mean(np.full((3, 10), 0.25))
    assert (const.lo, const.mean, const.hi) == (0.25, 0.25, 0.25)
    # One seed: the grid bootstrap is the bootstrap over problems (same draws for the same generator seed).
    x = np.random.default_rng(0).integers(0, 2, size=50).astype(float)
    assert bootstrap_grid_mean(x[None], seed=5) == bootstrap_mean(x, seed=5)
    # Seeds that disagree widen the interval compared with the problems alone: seed offsets -0.2 / +0.2.
    grid = np.stack([x - 0.2, x + 0.2])
    pooled = bootstrap_mean(np.concatenate([x - 0.2, x + 0.2]), seed=1)
    two_level = bootstrap_grid_mean(grid, seed=1)
    assert two_level.mean == pytest.approx(pooled.mean)
    assert (two_level.hi - two_level.lo) > 1.5 * (pooled.hi - pooled.lo)
    # Deterministic for a seed.
    assert bootstrap_grid_mean(grid, seed=2) == bootstrap_grid_mean(grid, seed=2)


def test_cluster_bootstrap_matches_the_interval_of_cluster_means():
    # K = 40 clusters of 5 problems; every problem of a cluster has its cluster's value (a fact answered the same in
    # every wording). The cluster bootstrap of the pooled mean is then the bootstrap of the K cluster means: its
    # sd is the plug-in sd of the means / sqrt(K), and its 95% bounds are mean -+ 1.96 sd (normal approximation of
    # a mean of 40 bounded values: error a few % of sd; Monte Carlo of 20000 resamples about 0.06 sd).
    rng = np.random.default_rng(4)
    means = rng.integers(-1, 2, size=40).astype(float)
    x, labels = np.repeat(means, 5), np.repeat(np.arange(40), 5)
    iv = bootstrap_mean(x, clusters=labels, resamples=20000, seed=1)
    sd = means.std() / math.sqrt(40)
    assert iv.mean == pytest.approx(means.mean()) and iv.n == 200
    assert iv.lo == pytest.approx(means.mean() - 1.96 * sd, abs=0.25 * sd)
    assert iv.hi == pytest.approx(means.mean() + 1.96 * sd, abs=0.25 * sd)
    # Resampling the 200 problems as if independent is about sqrt(5) times too narrow here.
    naive = bootstrap_mean(x, resamples=20000, seed=1)
    assert (iv.hi - iv.lo) / (naive.hi - naive.lo) == pytest.approx(math.sqrt(5), rel=0.15)
    # Unequal cluster sizes: the statistic of every resample is a mean over problems, so a constant stays put.
    const = bootstrap_mean(np.full(7, 0.5), clusters=["a", "a", "b", "c", "c", "c", "d"])
    assert (const.lo, const.mean, const.hi) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match=r"clusters must have one label per value \(3\), got 2"):
        bootstrap_mean([1.0, 0.0, 1.0], clusters=["a", "b"])
    for bad, match in [({"a", "b", "c"}, "clusters must be a sequence of 3 labels .* got set"),
                       (3, "got int"), ([[1], [2], [3]], "hashable labels .* got list"),
                       (["a", "a", "a"], "at least 2 distinct labels .* got 1")]:
        with pytest.raises(ValueError, match=match):
            bootstrap_mean([1.0, 0.0, 1.0], clusters=bad)
    # numpy labels group by value
    assert bootstrap_mean([1.0, 0.0, 1.0, 0.0], clusters=np.array([1, 1, 2, 2])) == \
        bootstrap_mean([1.0, 0.0, 1.0, 0.0], clusters=[1, 1, 2, 2])


@pytest.mark.parametrize("bad, match", [([], "non-empty"), ([[[1.0]]], "1-D .* or 2-D"), ([0.0, float("nan")], r"finite, got nan at index \(0, 1\)")])
def test_bootstrap_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        bootstrap_grid_mean(bad)
    with pytest.raises(ValueError, match="level must be in"):
        bootstrap_mean([1.0, 0.0], level=1.0)


# ------------------------------------------------------------------------------------------------ report

def _fake_result(method, seed, before, after, rewards):
    return {"method": method, "seed": seed, "steps": len(rewards),
            "train": [{"step": i + 1, "reward": r, "time/generation": 1.0, "time/attribution": 0.5,
                       "time/update": 2.0, "oar/ess_ratio": 0.9, "oar/top10_mass": 0.2} for i, r in enumerate(rewards)],
            "heldout": {"before": float(np.mean(before)), "after": float(np.mean(after)), "correct_before": before,
                        "correct_after": after, "problem_ids": [f"p{i}" for i in range(len(before))]},
            "wall_seconds": 60.0, "peak_rss_mb": 100.0}


def test_report_bootstrap_difference_and_mixed_sweeps(tmp_path):
    before = [0, 0, 1, 1, 0, 1, 0, 0]
    rng = np.random.default_rng(0)
    afters = {(m, s): rng.integers(0, 2, size=8).tolist() for m in ("grpo", "oar_g") for s in (0, 1, 2)}
    os.makedirs(tmp_path / "results")
    for (m, s), a in afters.items():
        rewards = [0.1 * k for k in range(10)] if m == "grpo" else [0.2] * 10
        write_json_atomic(str(tmp_path / "results" / f"{run_name(m, s)}.json"), _fake_result(m, s, before, a, rewards))
    rep = build_report(str(tmp_path))
    g, o = rep["methods"]["grpo"], rep["methods"]["oar_g"]
    assert g["heldout_before"] == pytest.approx(3 / 8)
    assert g["heldout_after"]["mean"] == pytest.approx(np.mean([afters[("grpo", s)] for s in range(3)]))
    d = np.mean([np.subtract(afters[("oar_g", s)], afters[("grpo", s)]) for s in range(3)])
    assert o["diff_vs_grpo"]["mean"] == pytest.approx(d) and o["diff_vs_grpo"]["seeds"] == [0, 1, 2]
    assert o["diff_vs_grpo"]["lo"] <= d <= o["diff_vs_grpo"]["hi"]
    assert "diff_vs_grpo" not in g and "paired_vs_grpo" not in g
    assert o["time/attribution"] == pytest.approx(0.5) and o["oar/ess_ratio"] == pytest.approx(0.9)
    for f in ("compare.md", "compare.csv", "compare.png", "compare.json"):
        assert (tmp_path / f).stat().st_size > 100
    md = (tmp_path / "compare.md").read_text()
    assert "| oar_g | 3 |" in md and "(baseline)" in md
    # Runs evaluated on other problems cannot be mixed into one report.
    bad = _fake_result("random", 0, [1] * 8, [1] * 8, [0.5] * 10)
    bad["heldout"]["problem_ids"] = [f"q{i}" for i in range(8)]
    write_json_atomic(str(tmp_path / "results" / "random-s0.json"), bad)
    with pytest.raises(ValueError, match="other held-out problems"):
        build_report(str(tmp_path))


def test_report_resamples_the_tasks_clusters(tmp_path):
    """A sweep of the main job's default (200 held-out problems of the arithmetic task, split by fact): the report
    rebuilds each problem's fact from grid.json and its intervals resample facts. With outcomes constant within a
    fact (a model that gets a fact right or wrong in every wording), resampling problems as independent is too
    narrow by about sqrt(problems per fact)."""
    from oar.app.config import load_config, resolve_config
    from oar.app.train import build_task, eval_settings, heldout_problems

    cfg = load_config("default", [])
    task, train = build_task(cfg)
    held = heldout_problems(task, eval_settings(cfg), train)
    facts = [task.cluster(p) for p in held]
    G = len(set(facts))
    assert G < len(held) / 5
    rng = np.random.default_rng(2)
    right = {f: int(rng.integers(0, 2)) for f in set(facts)}
    before = [0] * len(held)
    os.makedirs(tmp_path / "results")
    for s in (0, 1):
        r = _fake_result("oar_g", s, before, [right[f] for f in facts], [0.1] * 4)
        r["heldout"]["problem_ids"] = [p.id for p in held]
        write_json_atomic(str(tmp_path / "results" / f"oar_g-s{s}.json"), r)
    write_json_atomic(str(tmp_path / "grid.json"), {"config": resolve_config("default"), "overrides": [],
                                                    "methods": ["oar_g"], "seeds": [0, 1]})
    rep = build_report(str(tmp_path))
    row = rep["methods"]["oar_g"]
    assert row["n_clusters"] == G
    after = np.asarray([[right[f] for f in facts]] * 2, dtype=float)
    assert row["gain_vs_before"] == bootstrap_grid_mean(after, seed=0, clusters=facts).as_dict()
    naive = bootstrap_grid_mean(after, seed=0).as_dict()
    assert (row["gain_vs_before"]["hi"] - row["gain_vs_before"]["lo"]) > 2 * (naive["hi"] - naive["lo"])
    assert f"the problems' {G} facts, each resampled whole" in (tmp_path / "compare.md").read_text()
    # A sweep folder copied from another machine: its config path is gone, the shipped config of that name is used.
    write_json_atomic(str(tmp_path / "grid.json"), {"config": "/elsewhere/configs/default.yaml", "overrides": [],
                                                    "methods": ["oar_g"], "seeds": [0, 1]})
    assert build_report(str(tmp_path))["methods"]["oar_g"]["n_clusters"] == G
    # Without grid.json the problems are resampled, and the report says so.
    os.remove(tmp_path / "grid.json")
    rep = build_report(str(tmp_path))
    assert rep["methods"]["oar_g"]["n_clusters"] == len(held)
    assert "(seeds x problems)" in (tmp_path / "compare.md").read_text()


#: Student-t 0.975 quantile with 3 degrees of freedom (printed t tables: 3.182446).
T975_DF3 = 3.1824463


def test_report_paired_t_and_sign_flip_on_per_seed_differences(tmp_path):
    # 4 seeds x 4 problems. oar_g - grpo per seed, mean over problems: +0.25, +0.5, 0, +0.25 (by construction).
    before = [0, 0, 0, 0]
    grpo = {0: [1, 0, 0, 0], 1: [0, 0, 0, 0], 2: [1, 1, 0, 0], 3: [0, 1, 0, 0]}
    oar_g = {0: [1, 1, 0, 0], 1: [1, 1, 0, 0], 2: [1, 1, 0, 0], 3: [0, 1, 1, 0]}
    os.makedirs(tmp_path / "results")
    for s in range(4):
        # training reward: grpo 0.1 then 0.2 over the second half; oar_g 0.1 then 0.2 + 0.1 s (second half = last 4
        # of 8 steps), so the per-seed second-half differences are 0, 0.1, 0.2, 0.3.
        write_json_atomic(str(tmp_path / "results" / f"grpo-s{s}.json"),
                          _fake_result("grpo", s, before, grpo[s], [0.1] * 4 + [0.2] * 4))
        write_json_atomic(str(tmp_path / "results" / f"oar_g-s{s}.json"),
                          _fake_result("oar_g", s, before, oar_g[s], [0.1] * 4 + [0.2 + 0.1 * s] * 4))
    # random has seed 0 only: one common seed, no interval.
    write_json_atomic(str(tmp_path / "results" / "random-s0.json"),
                      _fake_result("random", 0, before, [1, 1, 1, 0], [0.3] * 8))
    rep = build_report(str(tmp_path))
    o = rep["methods"]["oar_g"]
    pt = o["paired_vs_grpo"]
    assert pt["seeds"] == [0, 1, 2, 3] and pt["per_seed"] == pytest.approx([0.25, 0.5, 0.0, 0.25])
    # By hand: mean 0.25; sd (n - 1) = sqrt((0 + 0.25^2 + 0.25^2 + 0) / 3); half width t(0.975, 3) sd / 2.
    half = T975_DF3 * math.sqrt(0.125 / 3) / 2
    assert pt["interval"]["mean"] == pytest.approx(0.25)
    assert pt["interval"]["lo"] == pytest.approx(0.25 - half, abs=1e-6)
    assert pt["interval"]["hi"] == pytest.approx(0.25 + half, abs=1e-6)
    # Sign flips: the zero difference flips freely; of the 8 sign patterns of (0.25, 0.5, 0.25) only all + and
    # all - reach |mean| >= 0.25, so p = 2 / 8.
    assert pt["sign_flip_p"] == pytest.approx(0.25)
    # Second-half training reward, paired: differences 0, 0.1, 0.2, 0.3: mean 0.15, sd sqrt(0.05 / 3).
    rh = o["reward_second_half_vs_grpo"]["interval"]
    h2 = T975_DF3 * math.sqrt(0.05 / 3) / 2
    assert rh["mean"] == pytest.approx(0.15) and rh["lo"] == pytest.approx(0.15 - h2, abs=1e-6)
    assert rep["methods"]["grpo"]["reward_second_half"] == pytest.approx(0.2)
    # The bootstrap stays, as a secondary column, on the same differences.
    assert o["diff_vs_grpo"]["mean"] == pytest.approx(0.25)
    r = rep["methods"]["random"]["paired_vs_grpo"]
    assert r["interval"] is None and r["sign_flip_p"] is None and r["per_seed"] == pytest.approx([0.5])
    md = (tmp_path / "compare.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| oar_g |"))
    assert f"+25.0 [{(0.25 - half) * 100:+.1f}, {(0.25 + half) * 100:+.1f}] | 0.250 |" in row
    assert "fewer than 2 common seeds (1)" in next(line for line in md.splitlines() if line.startswith("| random |"))
    with open(tmp_path / "compare.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert float(rows["oar_g"]["paired_t_vs_grpo_lo"]) == pytest.approx(0.25 - half, abs=1e-6)
    assert float(rows["oar_g"]["sign_flip_p_vs_grpo"]) == pytest.approx(0.25)
    assert float(rows["oar_g"]["bootstrap_diff_vs_grpo"]) == pytest.approx(0.25)
    assert rows["random"]["paired_t_vs_grpo"] == ""


def test_report_timing_medians_leave_out_a_paused_step(tmp_path):
    os.makedirs(tmp_path / "results")
    walls = {0: 600.0, 1: 1500.0, 2: 900.0}
    for s in range(3):
        r = _fake_result("grpo", s, [0, 1], [1, 1], [0.5] * 10)
        for k, t in enumerate(r["train"]):
            # generation 10 + k + s, attribution 0, update 20 + k; one step of seed 1 paused: 20x the others.
            t.update({"time/generation": 10.0 + k + s, "time/attribution": 0.0, "time/update": 20.0 + k})
            t["step_time"] = t["time/generation"] + t["time/update"]
            if s == 1 and k == 4:
                t["time/update"] = 20 * t["step_time"]
                t["step_time"] = t["time/generation"] + t["time/update"]
        r["wall_seconds"] = walls[s]
        write_json_atomic(str(tmp_path / "results" / f"grpo-s{s}.json"), r)
    g = build_report(str(tmp_path))["methods"]["grpo"]
    kept = [(k, s) for s in range(3) for k in range(10) if (s, k) != (1, 4)]
    assert g["steps_paused"] == 1 and g["steps_logged"] == 30
    assert g["time/generation"] == pytest.approx(np.median([10.0 + k + s for k, s in kept]))
    assert g["time/update"] == pytest.approx(np.median([20.0 + k for k, s in kept]))
    assert g["step_time"] == pytest.approx(np.median([30.0 + 2 * k + s for k, s in kept]))
    assert g["wall_minutes_median"] == pytest.approx(15.0) and g["wall_minutes_range"] == [10.0, 25.0]
    rep = json.load(open(tmp_path / "compare.json"))
    assert rep["sweep"] == {"runs": 3, "wall_hours": pytest.approx(3000.0 / 3600)}
    assert "(1/30)" in (tmp_path / "compare.md").read_text()
    # Without step_time (older logs) the step time is the sum of the time/* parts: the same step is left out.
    for s in range(3):
        path = tmp_path / "results" / f"grpo-s{s}.json"
        r = json.load(open(path))
        for t in r["train"]:
            del t["step_time"]
        write_json_atomic(str(path), r)
    g2 = build_report(str(tmp_path))["methods"]["grpo"]
    assert g2["steps_paused"] == 1 and g2["time/update"] == pytest.approx(g["time/update"])


def test_the_dropped_reach_metric_is_gone_from_every_output(tmp_path, monkeypatch):
    os.makedirs(tmp_path / "results")
    for m in ("grpo", "oar_g"):
        for s in (0, 1):
            write_json_atomic(str(tmp_path / "results" / f"{m}-s{s}.json"),
                              _fake_result(m, s, [0, 1], [1, 0], [0.1 * k for k in range(6)]))
    import matplotlib.axes

    lines = []
    orig = matplotlib.axes.Axes.axhline
    monkeypatch.setattr(matplotlib.axes.Axes, "axhline",
                        lambda self, y=0, *a, **k: lines.append(y) or orig(self, y, *a, **k))
    rep = build_report(str(tmp_path))
    assert lines == [pytest.approx(0.5)]  # the plot's only horizontal line: held-out accuracy before training
    for f in ("compare.md", "compare.csv", "compare.json"):
        text = (tmp_path / f).read_text().lower()
        assert "reward_level" not in text and "steps to reward" not in text and "steps_to" not in text, f
    assert "reward_level" not in rep
    with pytest.raises(TypeError):
        build_report(str(tmp_path), reward_level=0.3)
    p = subprocess.run([sys.executable, "-m", "oar.app.cli", "compare", "--report-only", "--out", str(tmp_path),
                        "--reward-level", "0.3"], capture_output=True, text=True)
    assert p.returncode == 2 and "unrecognized arguments: --reward-level" in p.stderr


def test_committed_sweep_results_still_load(tmp_path):
    # The result files of the committed CPU sweep (written before this report changed) rebuild a report, and its
    # paired test is computed from their per-seed accuracies.
    import shutil

    src = DOCS / "compare" / "compare_cpu"
    shutil.copytree(os.path.join(src, "results"), tmp_path / "results")
    shutil.copy(os.path.join(src, "grid.json"), tmp_path / "grid.json")
    res = {}
    for name in os.listdir(tmp_path / "results"):
        r = json.load(open(tmp_path / "results" / name))
        res[(r["method"], r["seed"])] = r
    rep = build_report(str(tmp_path), resamples=200)
    assert rep["baseline"] == "grpo" and rep["sweep"]["runs"] == len(res)
    assert rep["sweep"]["wall_hours"] == pytest.approx(sum(r["wall_seconds"] for r in res.values()) / 3600)
    for m in ("oar_g", "oar_p", "random"):
        per_seed = [np.mean(res[(m, s)]["heldout"]["correct_after"])
                    - np.mean(res[("grpo", s)]["heldout"]["correct_after"]) for s in range(5)]
        pt = rep["methods"][m]["paired_vs_grpo"]
        assert pt["per_seed"] == pytest.approx(per_seed)
        assert pt["interval"]["mean"] == pytest.approx(np.mean(per_seed))
        half = 2.7764451 * np.std(per_seed, ddof=1) / math.sqrt(5)  # t(0.975, 4) = 2.776445
        assert pt["interval"]["hi"] - pt["interval"]["mean"] == pytest.approx(half, abs=1e-6)
        assert 0 < pt["sign_flip_p"] <= 1


# ------------------------------------------------------------------------------------------------ grid runs

TINY = ["model.name=tiny-random-llama", "model.tokenizer=minimal", "model.hidden_size=32", "model.num_layers=1",
        "model.num_heads=2", "task.train_size=16", "grpo.max_steps=1", "grpo.per_device_train_batch_size=8",
        "grpo.max_completion_length=6", "grpo.disable_tqdm=true", "eval.problems=4", "eval.batch_size=4"]


def test_compare_runs_resumes_and_never_reports_a_partial_run(tmp_path):
    out = str(tmp_path / "sweep")
    res = run_compare(None, TINY, ["grpo", "random"], [0, 1], out, max_runs=3, progress=False)
    assert res["done"] == 3 and res["pending"] == ["random-s1"] and not res["failed"]
    assert sorted(os.listdir(os.path.join(out, "results"))) == ["grpo-s0.json", "grpo-s1.json", "random-s0.json"]
    assert os.path.exists(os.path.join(out, "heldout_before.json"))  # computed once, shared by every run
    rep = json.load(open(os.path.join(out, "compare.json")))
    assert rep["methods"]["grpo"]["seeds"] == [0, 1] and rep["methods"]["random"]["seeds"] == [0]
    # A run that was stopped half-way leaves a folder but no result: it is redone, the finished ones are kept.
    os.makedirs(os.path.join(out, "runs", "random-s1", "checkpoint-1"), exist_ok=True)
    open(os.path.join(out, "runs", "random-s1", "metrics.jsonl"), "w").write('{"step": 1, "reward": 9.0}\n')
    open(os.path.join(out, "runs", "random-s1", "stale-sentinel"), "w").write("from the stopped run")
    kept = os.path.getmtime(os.path.join(out, "results", "grpo-s0.json"))
    res = run_compare(None, TINY, ["grpo", "random"], [0, 1], out, progress=False)
    assert res["done"] == 4 and res["pending"] == []
    assert os.path.getmtime(os.path.join(out, "results", "grpo-s0.json")) == kept
    assert not os.path.exists(os.path.join(out, "runs", "random-s1", "stale-sentinel"))
    assert not os.path.exists(os.path.join(out, "runs", "random-s1", "checkpoint-1"))
    r = json.load(open(os.path.join(out, "results", "random-s1.json")))
    assert r["seed"] == 1 and r["method"] == "random" and all(t["reward"] <= 1.0 for t in r["train"])
    # Another config in the same folder is refused.
    with pytest.raises(ValueError, match=r"another configuration \(differs in \['oar.q'\]\)"):
        run_compare(None, TINY + ["oar.q=0.5"], ["grpo"], [0], out, progress=False)
    with pytest.raises(ValueError, match="set per run"):
        run_compare(None, TINY + ["oar.method=oar_p"], ["grpo"], [0], str(tmp_path / "other"), progress=False)
    # A grid written before an oar key existed (credit_rows, here) resumes while that key keeps its default,
    # and is refused once an override sets it to something else.
    grid_path = os.path.join(out, "grid.json")
    grid = json.load(open(grid_path))
    del grid["resolved"]["oar"]["credit_rows"]
    json.dump(grid, open(grid_path, "w"))
    assert run_compare(None, TINY, ["grpo", "random"], [0, 1], out, progress=False)["done"] == 4
    assert json.load(open(grid_path))["resolved"]["oar"]["credit_rows"] == "all"
    json.dump(grid, open(grid_path, "w"))  # again without the key
    with pytest.raises(ValueError, match=r"differs in \['oar.credit_rows'\]"):
        run_compare(None, TINY + ["oar.credit_rows=positive"], ["grpo"], [0], out, progress=False)
    # A second sweep on the same folder while one runs is refused (it would delete the other's live run folder).
    import fcntl

    with open(os.path.join(out, ".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="another oar compare is running"):
            run_compare(None, TINY, ["grpo", "random"], [0, 1], out, progress=False)


def test_method_settings_run_with_their_own_config_keys(tmp_path):
    """``--methods random random:credit_rows=positive``: two arms of one method, the second with its own oar key
    (in its run's config.json, not in the other's), each reported under its own name; bad settings are refused
    before anything runs, naming the key."""
    from oar.app.compare import parse_method

    assert parse_method("oar_g") == ("oar_g", [])
    assert parse_method("oar_g: q=0.5, credit_rows=positive") == ("oar_g", ["oar.q=0.5", "oar.credit_rows=positive"])
    for bad, match in [("oar_g:credit_rows=pos", r'oar.credit_rows must be "all", "positive" or "negative"'),
                       ("oar_g:q", "expected key=value items"), ("oar_g:", "expected key=value items"), ("oar_g:seed=3", "set per run"),
                       ("oar_q:q=0.5", "unknown method .oar_q."), ("oar_g:qq=1", 'unknown key "qq"')]:
        with pytest.raises(ValueError, match=match):
            parse_method(bad)
    with pytest.raises(ValueError, match="key 'q' given twice"):
        parse_method("oar_g:q=0.5,q=0.7")
    # one setting spelled twice, or two whose run folders would collide, is one arm
    for twice in (["oar_g:q=0.5", "oar_g:q=0.5"], ["oar_g:q=0.5,beta=2", "oar_g:beta=2,q=0.50"], ["oar_g", " oar_g"],
                  ["oar_g:conclude=a b", "oar_g:conclude=a/b"]):
        with pytest.raises(ValueError, match="must not repeat"):
            run_compare(None, TINY, twice, [0], str(tmp_path / "rep"), progress=False)
    # a value never makes a run folder a path outside the sweep
    for spec in ("oar_g:answer_suffix=../../../tmp/x", "oar_g:conclude=(a/b)"):
        name = run_name(spec, 0)
        assert "/" not in name and ".." not in name and name.endswith("-s0")
    out = str(tmp_path / "sweep")
    res = run_compare(None, TINY, ["random", "random:credit_rows=positive"], [0], out, progress=False)
    assert res["done"] == 2 and not res["failed"]
    cfg = {name: json.load(open(os.path.join(out, "runs", name, "config.json")))["oar"]
           for name in ("random-s0", "random+credit_rows=positive-s0")}
    assert cfg["random-s0"]["credit_rows"] == "all" and cfg["random+credit_rows=positive-s0"]["credit_rows"] == "positive"
    assert {k for k in cfg["random-s0"] if cfg["random-s0"][k] != cfg["random+credit_rows=positive-s0"][k]} == \
        {"credit_rows"}
    rep = json.load(open(os.path.join(out, "compare.json")))
    assert set(rep["methods"]) == {"random", "random:credit_rows=positive"} and rep["baseline"] == "random"


def test_compare_cli_report_only_and_usage_errors(tmp_path):
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "oar.app.cli", "compare"]
    p = subprocess.run(cmd + ["--methods", "grpo", "nope"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "unknown method 'nope'" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run(cmd + ["--report-only", "--out", str(tmp_path / "none")], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "no results/ folder" in p.stderr
    (tmp_path / "afile").write_text("x")
    p = subprocess.run(cmd + ["--out", str(tmp_path / "afile")], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "--out must be a folder, got the file" in p.stderr
    p = subprocess.run(cmd + ["--set", "eval.problems=100000"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "eval.problems=100000" in p.stderr and "Traceback" not in p.stderr


def test_per_fact_table_counts_each_fact_of_each_run(tmp_path):
    """benchmarks/analysis/per_fact.py: each fact's accuracy before and after, per run, is the mean of its problems'
    0/1 outcomes (computed here from the facts the task gives each held-out problem), the "all" row is the
    run's accuracy and the last row the mean of its facts' accuracies; a run on other problems or a sweep without
    runs is refused."""
    import sys

    sys.path.insert(0, str(BENCH_ANALYSIS))
    import per_fact
    from oar.app.config import load_config, resolve_config
    from oar.app.train import build_task, eval_settings, heldout_problems

    cfg = load_config("default", [])
    task, train = build_task(cfg)
    held = heldout_problems(task, eval_settings(cfg), train)
    facts = [task.cluster(p) for p in held]
    rng = np.random.default_rng(5)
    before = [int(v) for v in rng.integers(0, 2, len(held))]
    after = {s: [int(v) for v in rng.integers(0, 2, len(held))] for s in (0, 1)}
    sweep = tmp_path / "sweep"
    os.makedirs(sweep / "results")
    for s in (0, 1):
        write_json_atomic(str(sweep / "results" / f"oar_g-s{s}.json"),
                          {"method": "oar_g", "seed": s, "heldout": {"problem_ids": [p.id for p in held],
                                                                     "correct_before": before, "correct_after": after[s]}})
    write_json_atomic(str(sweep / "grid.json"), {"config": resolve_config("default"), "overrides": [],
                                                 "methods": ["oar_g"], "seeds": [0, 1]})
    lines = per_fact.per_fact_table([str(sweep)]).splitlines()
    assert lines[0] == "| fact | problems | before | sweep/oar_g-s0 | sweep/oar_g-s1 |"
    body = {ln.split("|")[1].strip().strip("`"): [c.strip() for c in ln.split("|")[2:-1]] for ln in lines[2:]}
    assert set(body) == set(facts) | {"all", "facts, equally weighted"}
    for f in set(facts):
        idx = [i for i, g in enumerate(facts) if g == f]
        want = [str(len(idx))] + [f"{sum(v[i] for i in idx) / len(idx):.2f}" for v in (before, after[0], after[1])]
        assert body[f] == want
    assert body["all"] == [str(len(held))] + [f"{sum(v) / len(v):.3f}" for v in (before, after[0], after[1])]
    per_fact_means = [np.mean([np.mean([v[i] for i, g in enumerate(facts) if g == f]) for f in set(facts)])
                      for v in (before, after[0], after[1])]
    assert body["facts, equally weighted"] == [str(len(set(facts)))] + [f"{m:.3f}" for m in per_fact_means]
    other = dict(json.load(open(sweep / "results" / "oar_g-s1.json")))
    other["heldout"]["problem_ids"] = other["heldout"]["problem_ids"][::-1]
    write_json_atomic(str(sweep / "results" / "oar_g-s1.json"), other)
    with pytest.raises(SystemExit, match="other held-out problems"):
        per_fact.per_fact_table([str(sweep)])
    with pytest.raises(SystemExit, match="has no finished run"):
        per_fact.per_fact_table([str(tmp_path / "empty")])
