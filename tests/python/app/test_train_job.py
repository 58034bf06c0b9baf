"""The main job's plumbing (oar train): config loading, metrics JSONL, plot, summary; on a tiny model."""

import json
import os

import pytest
import torch

import oar
from oar.app.tasks import register_task
from oar.app.tasks.arithmetic import ArithmeticTask
from oar.app.config import config_dir, load_config, parse_overrides


@pytest.mark.parametrize("name", ["default", "gsm8k", "gpu_qwen_math", "compare_cpu", "gpu_compare_math"])
def test_shipped_configs_parse(name):
    from oar.app.train import eval_settings

    cfg = load_config(name)
    assert cfg.oar.method in ("oar_g", "oar_p")
    assert cfg.grpo["num_generations"] >= 2
    assert os.path.exists(os.path.join(config_dir(), name + ".yaml"))
    ev = eval_settings(cfg)
    assert ev["problems"] >= 1 and ev["max_new_tokens"] >= 1


def test_compare_cpu_config_is_the_harder_arithmetic_mix_with_disjoint_heldout():
    from oar.app.train import build_task, eval_settings, heldout_problems

    cfg = load_config("compare_cpu")
    task, train = build_task(cfg)
    held = heldout_problems(task, eval_settings(cfg), train)
    assert task.levels == (2, 3) and len(held) >= 200
    assert {p.metadata["level"] for p in held} == {2, 3}
    # disjoint in arithmetic, not only in wording: no held-out fact (operation and operands) is a training fact
    from oar.app.tasks.arithmetic import arithmetic_fact

    assert not {arithmetic_fact(p.metadata) for p in held} & {arithmetic_fact(p.metadata) for p in train}


def test_math500_holdout_partition(tmp_path):
    from oar.app.tasks import get_task

    rows = [{"question": f"What is {i} + {i}?", "answer": f"... \\boxed{{{2 * i}}}"} for i in range(200)]
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = get_task("math500", path=str(path), holdout=5)
    train, test = t.problems("train"), t.problems("test")
    assert len(train) + len(test) == 200 and not {p.question for p in train} & {p.question for p in test}
    assert 20 <= len(test) <= 60  # about 1/5 of 200 (CRC32 mod 5)
    draw3, draw4 = ([p.id for p in t.problems("test", n=10, seed=sd)] for sd in (3, 4))
    assert set(draw3) <= {p.id for p in test} and len(set(draw3)) == 10 and draw3 != draw4
    assert len(get_task("math500", path=str(path)).problems("test")) == 200
    with pytest.raises(ValueError, match="split"):
        get_task("math500", path=str(path)).problems("train")
    with pytest.raises(ValueError, match="holdout must be 0"):
        get_task("math500", path=str(path), holdout=1)


def test_default_config_is_oar_g_answer_mean():
    cfg = load_config(None)
    assert (cfg.oar.method, cfg.oar.probe) == ("oar_g", "answer_mean")
    assert cfg.model["name"] == "smollm2-135m-instruct" and cfg.task["name"] == "arithmetic"


def test_overrides_and_errors(tmp_path):
    assert parse_overrides(["oar.q=0.5", "grpo.max_steps=3"]) == {"oar": {"q": 0.5}, "grpo": {"max_steps": 3}}
    assert load_config(None, ["oar.method=oar_p"]).oar.method == "oar_p"
    with pytest.raises(ValueError, match="oar.q"):
        load_config(None, ["oar.q=2"])
    with pytest.raises(ValueError, match="section.key=value"):
        parse_overrides(["oar.q"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {}\n")
    with pytest.raises(ValueError, match="unknown sections"):
        load_config(str(bad))
    with pytest.raises(FileNotFoundError):
        load_config(str(tmp_path / "missing.yaml"))


TINY = ["model.name=tiny-random-llama", "model.tokenizer=minimal", "model.hidden_size=32", "model.num_layers=1",
        "model.num_heads=2", "task.train_size=16", "grpo.max_steps=2", "grpo.per_device_train_batch_size=8",
        "grpo.max_completion_length=8", "grpo.disable_tqdm=true", "eval.problems=6", "eval.batch_size=3"]


@register_task("digit-test")
class _DigitTask(ArithmeticTask):
    """The arithmetic problems with a reward a random tiny model earns about half of the time (a digit anywhere in
    the completion), so that advantages are non-zero and training changes the model."""

    name = "digit-test"

    def reward(self, completion, problem):
        return float(any(c.isdigit() for c in completion))


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_train_job_writes_metrics_plot_summary_and_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from oar.app.models import load_model
    from oar.app.train import run_training

    out = tmp_path / "run"
    summary = run_training(None, TINY + ["eval.every_steps=1"], str(out))
    rows = _rows(out / "metrics.jsonl")
    train = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "heldout/accuracy" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert [r["step"] for r in evals] == [0, 1, 2] and all(r["heldout/n"] == 6 for r in evals)
    # One name per metric: TRL's names in the file, the same names in the summary.
    for key in ("reward", "frac_reward_zero_std", "oar/ess_ratio", "oar/top10_mass", "time/generation",
                "time/attribution", "time/update", "step_time"):
        assert all(key in r for r in train), key
    assert not any("reward_mean" in r for r in rows)
    for r in train:
        assert r["time/update"] == pytest.approx(max(r["step_time"] - r["time/generation"] - r["time/attribution"], 0))
    assert (out / "reward_curve.png").stat().st_size > 1000
    saved = json.load(open(out / "summary.json"))
    assert saved["steps"] == 2 and saved == json.loads(json.dumps(summary))
    assert saved["reward"]["per_step"] == [r["reward"] for r in train]
    held = saved["heldout/accuracy"]
    assert held["before"] == evals[0]["heldout/accuracy"] and held["after"] == evals[-1]["heldout/accuracy"]
    assert [h[0] for h in held["history"]] == [0, 1, 2]
    assert held["before"] == sum(held["correct_before"]) / 6 and held["after"] == sum(held["correct_after"]) / 6
    assert held["gain"]["lo"] <= held["gain"]["mean"] <= held["gain"]["hi"]
    assert held["gain"]["mean"] == pytest.approx(held["after"] - held["before"])
    assert json.load(open(out / "config.json"))["oar"]["method"] == "oar_g"
    assert saved["peak_rss_mb"] > 0
    from oar.app.train import cpu_has_native_bf16

    assert saved["precision"] == ("bf16-autocast" if cpu_has_native_bf16() else "float32")  # CPU run, no grpo.bf16
    # The trained policy is a Hugging Face folder that both loaders read, with the trained weights.
    assert saved["model_dir"] == str(out / "model")
    m1, tok = load_model(saved["model_dir"])
    m2 = AutoModelForCausalLM.from_pretrained(saved["model_dir"])
    assert tok.pad_token is not None
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_heldout_problems_are_disjoint_from_training_and_shared_across_seeds():
    from oar.app.config import load_config
    from oar.app.train import build_task, eval_settings, heldout_problems

    held = []
    for seed in (0, 1):
        cfg = load_config(None, [f"run.seed={seed}", "eval.problems=40"])
        task, train = build_task(cfg)
        h = heldout_problems(task, eval_settings(cfg), train)
        assert len(h) == 40 and not {p.question for p in h} & {p.question for p in train}
        held.append([p.id for p in h])
    assert held[0] == held[1]


def _without_times(rows):
    timed = ("step_time", "heldout/seconds", "oar/attribution_seconds", "train_runtime")
    return [{k: v for k, v in r.items() if not (k.startswith("time/") or k in timed)} for r in rows]


def test_same_config_same_seed_gives_the_same_metrics_line_for_line(tmp_path):
    from oar.app.train import run_training

    args = TINY + ["task.name=digit-test", "grpo.max_steps=3", "grpo.learning_rate=1e-2"]
    for name in ("a", "b"):
        run_training(None, args, str(tmp_path / name))
    a, b = (_without_times(_rows(tmp_path / n / "metrics.jsonl")) for n in ("a", "b"))
    assert len(a) == 5 and a == b
    # The runs trained: advantages were non-zero (mixed groups), so the weights moved.
    assert any(r.get("frac_reward_zero_std", 1.0) < 1.0 for r in a)
    c = run_training(None, args + ["run.seed=1"], str(tmp_path / "c"))
    assert _without_times(_rows(tmp_path / "c" / "metrics.jsonl")) != a and c["steps"] == 3


def test_resume_continues_from_the_last_checkpoint(tmp_path):
    from oar.app.train import run_training

    out = tmp_path / "run"
    ck = TINY + ["task.name=digit-test", "grpo.save_strategy=steps", "grpo.save_steps=1", "run.save_model=false"]
    run_training(None, ck, str(out))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    first = _rows(out / "metrics.jsonl")
    # A fresh run into the same folder would mix two runs: refused, nothing touched.
    with pytest.raises(ValueError, match="--resume"):
        run_training(None, ck, str(out))
    assert _rows(out / "metrics.jsonl") == first
    # Resume from checkpoint-2 with a longer budget: steps 1-2 kept as they were, step 3 trained and appended.
    s = run_training(None, ck + ["grpo.max_steps=3"], str(out), resume=True)
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward" in r] == [1, 2, 3]
    assert rows[:3] == first[:3] and s["steps"] == 3
    assert s["heldout/accuracy"]["history"][0][0] == 0 and s["heldout/accuracy"]["history"][-1][0] == 3
    with pytest.raises(ValueError, match="no checkpoint"):
        run_training(None, TINY, str(tmp_path / "empty"), resume=True)


def test_a_new_run_never_overwrites_an_earlier_one(tmp_path):
    from oar.app.train import run_training

    out = tmp_path / "run"
    args = TINY + ["grpo.max_steps=1", "run.save_model=false"]
    run_training(None, args, str(out))
    first = (out / "metrics.jsonl").read_text()
    run_training(None, args + ["run.seed=1"], str(out))
    assert (tmp_path / "run.1" / "metrics.jsonl").read_text() == first  # moved aside, intact
    assert json.load(open(out / "config.json"))["run"]["seed"] == 1
    # A refused config leaves the folders as they were.
    with pytest.raises(ValueError, match="eval.problems=100000"):
        run_training(None, args + ["eval.problems=100000"], str(out))
    assert not (tmp_path / "run.2").exists() and (out / "summary.json").exists()


def test_resume_refuses_other_settings(tmp_path):
    from oar.app.train import RunFolderError, run_training

    out = tmp_path / "run"
    ck = TINY + ["grpo.max_steps=1", "grpo.save_strategy=steps", "grpo.save_steps=1", "run.save_model=false"]
    run_training(None, ck, str(out))
    with pytest.raises(RunFolderError, match=r"oar.method: 'oar_g' -> 'grpo'"):
        run_training(None, ck + ["oar.method=grpo", "grpo.max_steps=2"], str(out), resume=True)


def test_eval_section_errors_name_the_key():
    from oar.app.config import load_config
    from oar.app.train import eval_settings

    with pytest.raises(ValueError, match="eval.problems must be an integer >= 0"):
        eval_settings(load_config(None, ["eval.problems=-1"]))
    with pytest.raises(ValueError, match=r"eval section has unknown keys \['problem'\]"):
        eval_settings(load_config(None, ["eval.problem=3"]))
    # max_new_tokens left unset: the training completion length.
    cfg = load_config(None, ["eval.max_new_tokens=null", "grpo.max_completion_length=40"])
    assert eval_settings(cfg)["max_new_tokens"] == 40


def test_cli_reports_missing_data_without_traceback(monkeypatch, capsys):
    from oar.app.cli import main

    monkeypatch.delenv("OAR_DATA_DIR", raising=False)
    for argv in (["attribute", "--data", "/nonexistent/test.jsonl"], ["train", "--config", "gsm8k"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and "docs/data.md" in err and "Traceback" not in err


# ---- CPU precision (docs/config.md, "Precision on CPU") -----------------------------------------------------


def test_cpu_bf16_autocast_only_where_the_cpu_runs_bfloat16(monkeypatch):
    """TRL's GRPOConfig turns bf16 on by default (a GPU default); a CPU run of ``oar train`` uses it only where
    torch's CPU kernels run bfloat16 natively, float32 elsewhere; an explicit grpo.bf16 / grpo.fp16 is kept."""
    import oar.app.train as tr

    for native, want in ((True, "bf16-autocast"), (False, "float32")):
        monkeypatch.setattr(tr, "cpu_has_native_bf16", lambda native=native: native)
        grpo = {"max_steps": 1}
        assert tr.resolve_cpu_precision(grpo) == want and grpo == {"max_steps": 1, "bf16": native}
        grpo = {"bf16": False}
        assert tr.resolve_cpu_precision(grpo) == "float32" and grpo == {"bf16": False}
    monkeypatch.setattr(tr, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(RuntimeWarning, match="grpo.bf16: true on a CPU without native bfloat16"):
        assert tr.resolve_cpu_precision({"bf16": True}) == "bf16-autocast"


def test_native_bf16_follows_torchs_active_cpu_kernels():
    """Under ATEN_CPU_CAPABILITY=avx2 torch runs its AVX2 kernels on any CPU, where bfloat16 attention is emulated
    (and, on an AMX CPU, fails in torch 2.14): never "native" then, whatever the developer's CPU."""
    import subprocess
    import sys

    code = "import torch, oar.app.train as t; print(torch.backends.cpu.get_cpu_capability(), t.cpu_has_native_bf16())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["AVX2", "False"]
