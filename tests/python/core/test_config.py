"""Configuration parsing: oar.OARConfig.from_json, load_config (YAML files), parse_overrides, ``oar train --set``,
$OAR_CONFIG as the trainer adapters read it, and the adapters' config type check that runs before any trainer
package is imported (so it runs here, where openrlhf may be absent; test_openrlhf.py skips without it).
The keyword constructor OARConfig(**kwargs) is tested in test_config_kwargs.py. Bad input: a ValueError naming
the key (or argument), the expected and the actual value."""

import json
import re

import pytest

import oar
from oar.app.config import load_config, parse_overrides
from oar.integrations import openrlhf
from oar.integrations._config_env import config_from_env

# (callable, positional arguments, exception, message regex)
BAD_INPUT = [
    pytest.param(oar.OARConfig.from_json, ('{"q": 1e400}',), ValueError,
                 r"oar config is not valid JSON: .*number overflow parsing '1e400'", id="from_json_overflow"),
    pytest.param(oar.OARConfig.from_json, ('{"seed": 9223372036854775808}',), ValueError,
                 r"oar\.seed must fit in a signed 64-bit integer, got 9223372036854775808", id="from_json_seed_int64"),
    pytest.param(oar.OARConfig.from_json, ('{"memory_budget_mb": 18446744073709551615}',), ValueError,
                 r"oar\.memory_budget_mb must fit in a signed 64-bit integer", id="from_json_budget_int64"),
    pytest.param(oar.OARConfig.from_json, ('{"method": 1}',), ValueError,
                 r"^oar\.method must be a string, got number 1$", id="from_json_method_number"),
    pytest.param(oar.OARConfig.from_json, ('{"std": null}',), ValueError, r"^oar\.std must be a string, got null$",
                 id="from_json_std_null"),
    pytest.param(oar.OARConfig.from_json, ('{"q": null}',), ValueError, r"^oar\.q must be a number, got null$",
                 id="from_json_q_null"),
    pytest.param(parse_overrides, (["oar..q=1"],), ValueError, r"has an empty key part", id="overrides_empty_key_part"),
    pytest.param(parse_overrides, (["oar.q=[1"],), ValueError, r"the value of override 'oar\.q=\[1' is not valid YAML",
                 id="overrides_bad_yaml_value"),
    pytest.param(parse_overrides, (["oar.q=1", "oar.q.x=2"],), ValueError, r"sets a key inside 'q'",
                 id="overrides_key_inside_value"),
]


@pytest.mark.parametrize("fn, args, exc, match", BAD_INPUT)
def test_bad_input(fn, args, exc, match):
    with pytest.raises(exc, match=match):
        fn(*args)


def _yaml(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


# (YAML file text, exception, message regex)
LOAD_CONFIG_BAD_INPUT = [
    pytest.param("oar: {q: .inf}", ValueError, r"oar\.q must be finite, got inf", id="q_inf"),
    pytest.param("oar: {q: .nan}", ValueError, r"oar\.q must be finite, got nan", id="q_nan"),
    pytest.param("oar: {when: 2020-01-01}", ValueError, r"oar\.when must be a number, string, bool or list, got date",
                 id="date_value"),
    pytest.param("oar: {q: 0.3", ValueError, r"is not valid YAML", id="bad_yaml"),
    pytest.param("run: {seed: abc}", ValueError, r"run\.seed must be an integer, got str 'abc'", id="run_seed_str"),
    pytest.param("model: {dtype: zeros}", ValueError, r"model\.dtype must name a floating torch dtype .*got 'zeros'",
                 id="model_dtype"),
]


@pytest.mark.parametrize("text, exc, match", LOAD_CONFIG_BAD_INPUT)
def test_load_config_bad_input(tmp_path, text, exc, match):
    with pytest.raises(exc, match=match):
        load_config(_yaml(tmp_path, text))


def test_load_config_directory_is_not_a_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist \(or is not a file\)"):
        load_config(str(tmp_path))


def test_yaml_scientific_notation_is_a_number(tmp_path):
    # PyYAML (YAML 1.1) reads 1e-3 as a string, which the schema then refused as "not a number".
    cfg = load_config(_yaml(tmp_path, "oar: {sigma: 1e-3, q: 2.5E-1}"))
    assert cfg.oar.sigma == pytest.approx(1e-3) and cfg.oar.reshape.q == pytest.approx(0.25)
    assert load_config(None, ["oar.sigma=2e-3"]).oar.sigma == pytest.approx(2e-3)


@pytest.mark.parametrize("item, match", [
    ("oar.q=2", r"oar\.q must be in \(0, 1\), got 2"),
    ("grpo.max_steps=abc", r"grpo\.max_steps must be an integer"),
    ("eval.problems=-1", r"eval\.problems must be an integer >= 0, got -1"),
    ("eval.before_cache=3", r"eval\.before_cache must be a file path or null, got 3"),
])
def test_cli_train_bad_set_is_a_usage_error(tmp_path, capsys, item, match):
    from oar.app.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--set", item, "--output-dir", str(tmp_path / "run")])
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()  # nothing written for a rejected config


# ---- $OAR_CONFIG (oar.integrations._config_env.config_from_env) ------------------------------------------------------

def _env_config(monkeypatch, value):
    monkeypatch.setenv("OAR_CONFIG", value)
    return config_from_env()


# (file name, file bytes, exception, message regex). These used to raise yaml.ParserError / a bare JSONDecodeError /
# UnicodeDecodeError without naming $OAR_CONFIG.
ENV_BAD_INPUT = [
    pytest.param("bad.yaml", b"oar: {method: [\n", ValueError, r"\$OAR_CONFIG file '.*bad\.yaml' is not valid YAML",
                 id="yaml"),
    pytest.param("bad.json", b"{method: 1", ValueError, r"\$OAR_CONFIG file '.*bad\.json' is not valid JSON",
                 id="json"),
    pytest.param("bin.json", b"\xff\xfe garbage", ValueError, r"\$OAR_CONFIG file '.*bin\.json' is not readable JSON",
                 id="binary"),
]


@pytest.mark.parametrize("name, content, exc, match", ENV_BAD_INPUT)
def test_oar_config_env_unreadable_files_are_named(tmp_path, monkeypatch, name, content, exc, match):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(exc, match=match):
        _env_config(monkeypatch, str(p))


def test_oar_config_env_json_run_config_is_unwrapped(tmp_path, monkeypatch):
    # runs/*/config.json holds the schema under "oar", like configs/*.yaml (which was already unwrapped).
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"run": {}, "oar": {"method": "oar_p"}}))
    assert _env_config(monkeypatch, str(p)).method == "oar_p"


# ---- adapters: the config type, checked before the trainer package is imported ----------------------------------

# (callable, positional arguments, keyword arguments, exception, message regex)
ADAPTER_BAD_INPUT = [
    pytest.param(openrlhf.install, ('{"method": "grpo"}',), {}, ValueError,
                 r"config must be an oar\.OARConfig or None, got str", id="openrlhf_install_str"),
    pytest.param(openrlhf.launch, ([],), dict(config={"method": "grpo"}), ValueError,
                 r"config must be an oar\.OARConfig or None, got dict", id="openrlhf_launch_dict"),
]


@pytest.mark.parametrize("fn, args, kwargs, exc, match", ADAPTER_BAD_INPUT)
def test_adapter_config_checked_before_importing_the_trainer(fn, args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def _config_choice_keys():
    from oar import schema

    return sorted(schema.CONFIG_CHOICES)


@pytest.mark.parametrize("key", _config_choice_keys())
def test_config_choices_are_the_parsers(key):
    """Every string key's values in ``oar.schema.CONFIG_CHOICES`` (read from the C++ schema) are exactly what the
    parser accepts: each one parses (and round-trips where the key is stored), and the parser's error for an unknown
    value lists the same set."""
    from oar import schema

    want = schema.CONFIG_CHOICES[key]
    assert len(want) == len(set(want)) >= 2
    for name in want:
        obj = {key: name, "method": "dr_grpo"} if key == "estimator" and name == "dr_grpo" else {key: name}
        stored = json.loads(oar.OARConfig(**obj).to_json())
        if key in stored:
            assert stored[key] == name
    with pytest.raises(ValueError) as err:
        oar.OARConfig(**{key: "not_a_name"})
    listed = set(re.findall(r'"(\w+)"', str(err.value))) - {"not_a_name"}
    assert listed == set(want), (listed, want)


def test_schema_name_tuples_are_config_choices():
    """The named tuples the library checks against are the schema's entries, nothing written twice."""
    from oar import schema

    names = {"method": "METHODS", "probe": "PROBES", "estimator": "ESTIMATORS", "screen": "SCREENS",
             "screen_tail": "SCREEN_TAILS", "mask_unit": "MASK_UNITS", "tiers": "TIERS", "credit_rows": "CREDIT_ROWS",
             "turn_probe": "TURN_PROBES", "turn_credit": "TURN_CREDITS"}
    for key, attr in names.items():
        assert getattr(schema, attr) == schema.CONFIG_CHOICES[key], attr
    assert set(schema.CONFIG_CHOICES) == set(names) | {"preset", "std", "singleton"}
    assert oar._C.ADVANTAGE_PRESET_NAMES == schema.CONFIG_CHOICES["preset"]


def test_oar_config_env_reads_yaml_as_run_configs_do(tmp_path, monkeypatch):
    """$OAR_CONFIG and `oar train` read YAML with the same loader: ``sigma: 1e-3`` is a number in both (PyYAML's
    YAML 1.1 alone reads it as the string "1e-3", which the schema refuses)."""
    path = tmp_path / "run.yaml"
    path.write_text("oar:\n  method: oar_g\n  sigma: 1e-3\n")
    assert _env_config(monkeypatch, str(path)).sigma == pytest.approx(1e-3)
    assert load_config(str(path)).oar.sigma == pytest.approx(1e-3)
