"""oar.OARConfig(**kwargs): the keyword constructor takes the flat keys of to_json() and validates them with the
same C++ parser, and the same messages, as OARConfig.from_json (issue 11, section 2.4)."""

import json

import numpy as np
import pytest
import torch

import oar

# Every key of the schema set to a value other than its default (preset: the verl group-advantage defaults).
NON_DEFAULT = {
    "method": "oar_p", "probe": "answer_joint", "q": 0.3, "beta": 0.5, "floor": 0.2, "tiers": "boost",
    "estimator": "rloo", "std": "biased", "eps": 1e-4, "singleton": "verl", "skip_nan": True, "sigma": 0.01,
    "noise_draws": 3, "conclude": "\nSo the answer is \\boxed{", "answer_suffix": "}.", "memory_budget_mb": 512,
    "max_variants_per_chunk": 16, "seed": 7, "entropy_alpha": 0.3, "entropy_kappa": 3.0, "ktae_alpha": 0.5,
    "ktae_beta": 2.0, "ktae_tf": False, "ktae_scale": 2.0, "ktae_threshold": 0.5, "screen_fraction": 0.2,
    "screen_sample": 0.1, "screen_budget": 1.5, "screen": "oar_g", "screen_window": 3, "screen_tail": "probe",
    "mask_unit": "line", "credit_rows": "positive", "turn_probe": "session", "turn_credit": "probe",
}


def _error(fn):
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


def test_keyword_q_is_the_reshape_q_and_equals_from_json():
    a = oar.OARConfig(q=0.3)
    b = oar.OARConfig.from_json('{"q": 0.3}')
    assert a.reshape.q == 0.3
    for field in ("q", "beta", "floor", "tiers"):
        assert getattr(a.reshape, field) == getattr(b.reshape, field)
    for field in ("estimator", "std", "eps", "singleton", "skip_nan"):
        assert getattr(a.advantages, field) == getattr(b.advantages, field)
    for field in ("method", "probe", "sigma", "noise_draws", "conclude", "answer_suffix", "memory_budget_mb",
                  "max_variants_per_chunk", "seed"):
        assert getattr(a, field) == getattr(b, field)
    assert a.to_json() == b.to_json()


def test_every_key_round_trips_as_a_keyword():
    defaults = json.loads(oar.OARConfig().to_json())
    assert set(NON_DEFAULT) == set(defaults), "NON_DEFAULT must name every key of to_json()"
    assert all(NON_DEFAULT[k] != defaults[k] for k in defaults)
    a = oar.OARConfig(**NON_DEFAULT)
    assert json.loads(a.to_json()) == NON_DEFAULT
    assert a.to_json() == oar.OARConfig.from_json(json.dumps(NON_DEFAULT)).to_json()
    assert (a.method, a.probe, a.reshape.tiers, a.advantages.estimator, a.noise_draws, a.seed) == (
        "oar_p", "answer_joint", "boost", "rloo", 3, 7)
    assert (a.ktae.alpha, a.ktae.tf, a.entropy_shaping.kappa) == (0.5, False, 3.0)


def test_no_keywords_is_the_default_config():
    assert oar.OARConfig().to_json() == oar.OARConfig.from_json("{}").to_json()
    assert oar.OARConfig().method == "oar_g" and oar.OARConfig().reshape.q == 0.25


def test_preset_and_dr_grpo_follow_the_json_rules():
    assert oar.OARConfig(preset="verl").to_json() == oar.OARConfig.from_json('{"preset": "verl"}').to_json()
    assert oar.OARConfig(method="dr_grpo").advantages.estimator == "dr_grpo"
    msg = _error(lambda: oar.OARConfig(method="dr_grpo", estimator="grpo"))
    assert msg == 'oar.estimator must be "dr_grpo" (or absent) when oar.method is "dr_grpo", got "grpo"'
    assert msg == _error(lambda: oar.OARConfig.from_json('{"method": "dr_grpo", "estimator": "grpo"}'))


def test_unknown_keyword_names_it_and_lists_the_valid_ones():
    msg = _error(lambda: oar.OARConfig(method="oar_g", qq=0.3))
    keys = sorted(list(json.loads(oar.OARConfig().to_json())) + ["preset"])
    assert msg == 'oar config has unknown key "qq"; known keys: ' + ", ".join(keys)
    assert msg == _error(lambda: oar.OARConfig.from_json('{"qq": 0.3}'))


@pytest.mark.parametrize("kwargs, text, expected", [
    ({"q": 1.5}, '{"q": 1.5}', "oar.q must be in (0, 1), got 1.5"),
    ({"method": "oar_x"}, '{"method": "oar_x"}',
     'oar.method must be one of {"grpo", "dr_grpo", "random", "entropy", "entropy_shaping", "ktae", "oar_p", '
     '"oar_g"}, got "oar_x"'),
    ({"q": "0.3"}, '{"q": "0.3"}', 'oar.q must be a number, got string "0.3"'),
    ({"q": None}, '{"q": null}', "oar.q must be a number, got null"),
    ({"q": [0.3]}, '{"q": [0.3]}', "oar.q must be a number, got array [0.3]"),
    ({"noise_draws": 2.0}, '{"noise_draws": 2.0}', "oar.noise_draws must be an integer, got number 2.0"),
    ({"noise_draws": 0}, '{"noise_draws": 0}', "oar.noise_draws must be >= 1, got 0"),
    ({"skip_nan": 1}, '{"skip_nan": 1}', "oar.skip_nan must be true or false, got 1"),
    ({"q": True}, '{"q": true}', "oar.q must be a number, got boolean true"),
    ({"sigma": -1e-3}, '{"sigma": -0.001}', "oar.sigma must be > 0, got -0.001"),
])
def test_bad_values_raise_the_from_json_message(kwargs, text, expected):
    msg = _error(lambda: oar.OARConfig(**kwargs))
    assert msg == expected
    assert msg == _error(lambda: oar.OARConfig.from_json(text))


def test_values_json_cannot_hold_are_refused_with_the_key():
    assert _error(lambda: oar.OARConfig(q=float("nan"))) == "oar.q must be finite, got nan"
    assert _error(lambda: oar.OARConfig(sigma=float("inf"))) == "oar.sigma must be finite, got inf"
    assert _error(lambda: oar.OARConfig(seed=object)) == "oar.seed must be a number, a string, a bool or None, " \
                                                         "got type <class 'object'>"


def test_positional_arguments_are_a_type_error():
    with pytest.raises(TypeError) as e:
        oar.OARConfig("oar_g")
    assert str(e.value) == ('OARConfig() takes keyword arguments only (the keys of OARConfig().to_json(), e.g. '
                            'OARConfig(method="oar_g", q=0.25)), got 1 positional argument(s)')


def test_numpy_and_tensor_scalars_are_numbers():
    c = oar.OARConfig(seed=np.int64(3), q=np.float64(0.3), noise_draws=torch.tensor(2), beta=torch.tensor(0.5))
    assert (c.seed, c.reshape.q, c.noise_draws, c.reshape.beta) == (3, 0.3, 2, 0.5)
    # An integer beyond int64 is read as from_json reads its decimal text.
    big = 2**70
    assert _error(lambda: oar.OARConfig(seed=big)) == _error(lambda: oar.OARConfig.from_json(f'{{"seed": {big}}}'))


def test_constructor_docstring_lists_every_key_with_its_default():
    doc = oar.OARConfig.__init__.__doc__
    for key, value in json.loads(oar.OARConfig().to_json()).items():
        shown = ("True" if value else "False") if isinstance(value, bool) else json.dumps(value)
        assert f"    {key}={shown}\n" in doc, key
