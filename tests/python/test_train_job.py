"""The main job's plumbing (oar train): config loading, metrics JSONL, plot, summary; on a tiny model."""

import json
import os

import pytest

import oar
from oar.config import config_dir, load_config, parse_overrides


@pytest.mark.parametrize("name", ["default", "gsm8k", "gpu_qwen_math"])
def test_shipped_configs_parse(name):
    cfg = load_config(name)
    assert cfg.oar.method in ("oar_g", "oar_p")
    assert cfg.grpo["num_generations"] >= 2
    assert os.path.exists(os.path.join(config_dir(), name + ".yaml"))


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


def test_train_job_writes_metrics_plot_summary(tmp_path):
    from oar.train import run_training

    out = tmp_path / "run"
    summary = run_training(None, [
        "model.name=tiny-random-llama", "model.tokenizer=minimal", "model.hidden_size=32", "model.num_layers=1",
        "model.num_heads=2", "task.train_size=16", "grpo.max_steps=2", "grpo.per_device_train_batch_size=8",
        "grpo.max_completion_length=8", "grpo.disable_tqdm=true",
    ], str(out))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward_mean", "zero_std_group_frac", "ess_ratio", "top10_mass", "time_generation_s",
                "time_attribution_s", "time_update_s"):
        assert all(key in r for r in rows), key
    assert all(r["time_update_s"] >= 0 for r in rows)
    assert (out / "reward_curve.png").stat().st_size > 1000
    saved = json.load(open(out / "summary.json"))
    assert saved["steps"] == 2 and saved == json.loads(json.dumps(summary))
    assert json.load(open(out / "config.json"))["oar"]["method"] == "oar_g"


def test_cli_reports_missing_data_without_traceback(monkeypatch, capsys):
    from oar.cli import main

    monkeypatch.delenv("OAR_DATA_DIR", raising=False)
    for argv in (["attribute", "--data", "/nonexistent/test.jsonl"], ["train", "--config", "gsm8k"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and "docs/data.md" in err and "Traceback" not in err
