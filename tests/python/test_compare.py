"""oar.app.stats (bootstrap intervals) and oar compare (grid runs, resume, report) on tiny runs and synthetic results."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from oar.app.compare import build_report, run_compare, run_name
from oar.app.stats import bootstrap_grid_mean, bootstrap_mean
from oar.app.train import write_json_atomic


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


def test_report_paired_difference_and_steps_to_reach(tmp_path):
    before = [0, 0, 1, 1, 0, 1, 0, 0]
    rng = np.random.default_rng(0)
    afters = {(m, s): rng.integers(0, 2, size=8).tolist() for m in ("grpo", "oar_g") for s in (0, 1, 2)}
    os.makedirs(tmp_path / "results")
    for (m, s), a in afters.items():
        rewards = [0.1 * k for k in range(10)] if m == "grpo" else [0.2] * 10
        write_json_atomic(str(tmp_path / "results" / f"{run_name(m, s)}.json"), _fake_result(m, s, before, a, rewards))
    rep = build_report(str(tmp_path), reward_level=0.35)
    g, o = rep["methods"]["grpo"], rep["methods"]["oar_g"]
    assert g["heldout_before"] == pytest.approx(3 / 8)
    assert g["heldout_after"]["mean"] == pytest.approx(np.mean([afters[("grpo", s)] for s in range(3)]))
    d = np.mean([np.subtract(afters[("oar_g", s)], afters[("grpo", s)]) for s in range(3)])
    assert o["diff_vs_grpo"]["mean"] == pytest.approx(d) and o["diff_vs_grpo"]["seeds"] == [0, 1, 2]
    assert o["diff_vs_grpo"]["lo"] <= d <= o["diff_vs_grpo"]["hi"]
    assert "diff_vs_grpo" not in g
    # Step k has reward 0.1 (k - 1); the 5-step moving average is 0.3 at step 6 (mean of 0.1..0.5) and 0.4 at step 7.
    assert g["steps_to_reward_level"] == {"level": 0.35, "mean_of_reached": 7.0, "reached": 3, "runs": 3}
    assert o["steps_to_reward_level"]["reached"] == 0
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
    # A second sweep on the same folder while one runs is refused (it would delete the other's live run folder).
    import fcntl

    with open(os.path.join(out, ".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="another oar compare is running"):
            run_compare(None, TINY, ["grpo", "random"], [0, 1], out, progress=False)


def test_compare_cli_report_only_and_usage_errors(tmp_path):
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "oar.app.cli", "compare"]
    p = subprocess.run(cmd + ["--methods", "grpo", "nope"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "methods must be among" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run(cmd + ["--report-only", "--out", str(tmp_path / "none")], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "no results/ folder" in p.stderr
    (tmp_path / "afile").write_text("x")
    p = subprocess.run(cmd + ["--out", str(tmp_path / "afile")], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "--out must be a folder, got the file" in p.stderr
    p = subprocess.run(cmd + ["--set", "eval.problems=100000"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "eval.problems=100000" in p.stderr and "Traceback" not in p.stderr
