"""Adversarial inputs for the newer surfaces (oar.token_advantages, the trainer adapters, the
eval-attribution CLI, the OAR-P engine's engine / max_prefix_waste / positions arguments). Same standard as
test_bad_input.py: a clear error naming the argument, or a finite, well-formed result. One test per finding.
The oar.baselines cases are in test_baselines.py (its bad-input table)."""

import json
import os
import types

import numpy as np
import pytest
import torch

import oar
from oar.attribution import ProbeContextBuilder, as_probe_model, oar_p_scores
from oar.models import tiny_random_llama

from _completions import completion_batch

CONCLUDE = "\nTherefore, the final answer is \\boxed{"


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_llama(hidden_size=32, num_layers=1, num_heads=2, tokenizer="minimal", seed=3)


def _cfg(**kw):
    return oar.OARConfig.from_json(json.dumps(kw))


def _batch(tok, C=20):
    return completion_batch(tok, ["so 2 and 3 \\boxed{5}", "hmm 9", "5 \\boxed{5}", "4 4 \\boxed{8}"], C, eos=False)


# ---- oar.token_advantages --------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [{"method": "grpo"}, '{"method": "grpo"}'])
def test_token_advantages_config_must_be_an_oarconfig(tiny, config):
    # A dict or JSON string used to fail with AttributeError: 'dict' object has no attribute 'method'.
    _, tok = tiny
    _, ids, mask = _batch(tok)
    with pytest.raises(ValueError, match=r"config must be an oar\.OARConfig or None, got (dict|str)"):
        oar.token_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), completion_ids=ids, completion_mask=mask,
                             group_size=2, config=config)


def test_token_advantages_meta_rewards_are_named(tiny):
    # Used to raise NotImplementedError: Cannot copy out of meta tensor; no data!
    _, tok = tiny
    _, ids, mask = _batch(tok)
    with pytest.raises(ValueError, match=r"rewards must hold data, got a tensor on the meta device"):
        oar.token_advantages(torch.ones(4, device="meta"), completion_ids=ids, completion_mask=mask, group_size=2,
                             config=_cfg(method="grpo"))


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_token_advantages_ktae_skip_nan_and_bool_rewards(tiny, with_tokenizer):
    # skip_nan gives NaN rows A = 0 for every method; ktae used to raise "rewards must be finite" for them, and
    # refused bool rewards that every other method accepts.
    _, tok = tiny
    _, ids, mask = _batch(tok)
    kw = dict(completion_ids=ids, completion_mask=mask, group_size=2, tokenizer=tok if with_tokenizer else None)
    out = oar.token_advantages(torch.tensor([float("nan"), 0.0, 1.0, 0.0]), config=_cfg(method="ktae", skip_nan=True),
                               **kw)
    assert torch.isfinite(out.advantages).all() and out.sequence_advantages[0] == 0
    b = oar.token_advantages(torch.tensor([True, False, True, False]), config=_cfg(method="ktae"), **kw)
    f = oar.token_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), config=_cfg(method="ktae"), **kw)
    torch.testing.assert_close(b.advantages, f.advantages)


# ---- trainer adapters ------------------------------------------------------------------------------------------

def _env_config(monkeypatch, value):
    from oar.integrations._common import config_from_env

    monkeypatch.setenv("OAR_CONFIG", value)
    return config_from_env()


@pytest.mark.parametrize("name, text, match", [
    ("bad.yaml", "oar: {method: [\n", r"\$OAR_CONFIG file '.*bad\.yaml' is not readable YAML"),
    ("bad.json", "{method: 1", r"\$OAR_CONFIG file '.*bad\.json' is not readable JSON"),
    ("bin.json", b"\xff\xfe garbage", r"\$OAR_CONFIG file '.*bin\.json' is not readable JSON"),
])
def test_oar_config_env_unreadable_files_are_named(tmp_path, monkeypatch, name, text, match):
    # Used to raise yaml.ParserError / a bare JSONDecodeError / UnicodeDecodeError without naming $OAR_CONFIG.
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=match):
        _env_config(monkeypatch, str(p))


def test_oar_config_env_json_run_config_is_unwrapped(tmp_path, monkeypatch):
    # runs/*/config.json holds the schema under "oar", like configs/*.yaml (which was already unwrapped).
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"run": {}, "oar": {"method": "oar_p"}}))
    assert _env_config(monkeypatch, str(p)).method == "oar_p"


@pytest.fixture()
def oar_verl():
    pytest.importorskip("verl")
    from oar.integrations import verl as ov

    yield ov
    ov.configure(None, None)


@pytest.mark.parametrize("kwargs, match", [
    (dict(config={"method": "grpo"}), r"config must be an oar\.OARConfig or None, got dict"),
    (dict(config='{"method": "grpo"}'), r"config must be an oar\.OARConfig or None, got str"),
    (dict(scorer=3), r"scorer must be callable .* got int"),
    (dict(ignore_ids=None), r"ignore_ids must be a sequence of int token ids, got NoneType"),
    (dict(ignore_ids=["a"]), r"ignore_ids\[i\] must be an int, got str 'a'"),
])
def test_verl_configure_checks_its_arguments(oar_verl, kwargs, match):
    # A dict/str config used to be stored and fail at the first training step with AttributeError.
    with pytest.raises(ValueError, match=match):
        oar_verl.configure(**kwargs)


def _verl_data(B=4, R=3):
    from verl import DataProto

    return DataProto.from_dict(tensors={"responses": torch.zeros(B, R, dtype=torch.long)})


@pytest.mark.parametrize("scores, mask, match", [
    (torch.full((4, 3), float("nan")), torch.ones(4, 3, dtype=torch.bool),
     r"scores must be finite and >= 0 on reasoning_mask, got scores\[0, 0\] = nan"),
    (-torch.ones(4, 3), torch.ones(4, 3, dtype=torch.bool), r"scores must be finite and >= 0 on reasoning_mask"),
    (torch.ones(4, 3, dtype=torch.complex64), torch.ones(4, 3, dtype=torch.bool),
     r"scores must be real .*, got dtype torch.complex64"),
    (torch.ones(4, 3), torch.full((4, 3), 0.5), r"reasoning_mask must be bool or 0/1"),
    (torch.ones(4, 3, device="meta"), torch.ones(4, 3, dtype=torch.bool), r"scores must hold data"),
])
def test_verl_attach_scores_checks_values(oar_verl, scores, mask, match):
    # These used to be attached as-is (NaN/negative failing only at compute_advantage, complex silently cast).
    data = _verl_data()
    with pytest.raises(ValueError, match=match):
        oar_verl.attach_scores(data, scores, mask)
    assert "oar_scores" not in data.batch.keys()


def test_verl_attach_scores_without_responses_is_a_key_error(oar_verl):
    from verl import DataProto

    with pytest.raises(KeyError, match=r"data must be a verl DataProto with batch\['responses'\]"):
        oar_verl.attach_scores(DataProto.from_dict(tensors={"x": torch.zeros(4, 3)}), torch.ones(4, 3),
                               torch.ones(4, 3, dtype=torch.bool))


@pytest.mark.parametrize("call, match", [
    (lambda est, t, m: est(t, m, index=np.array(["a", "a", "b"], dtype=object)),
     r"index must hold one group id per row: \(bs,\) = \(4,\), got 3 ids"),
    (lambda est, t, m: est(t, m, index=np.array(["a", "a", "b", "b", "c"], dtype=object)),
     r"index must hold one group id per row: \(bs,\) = \(4,\), got 5 ids"),
    (lambda est, t, m: est(t[:, 0], m, index=np.array(["a", "a", "b", "b"], dtype=object)),
     r"token_level_rewards must be a \(bs, R\) tensor, got \(4,\)"),
    (lambda est, t, m: est(t, m, index=np.array(["a", "a", "b", "b"], dtype=object), epsilon="x"),
     r"epsilon must be a real number, got str 'x'"),
])
def test_verl_estimator_checks_index_and_rewards(oar_verl, call, match):
    # A wrong-length index used to raise RuntimeError: shape mismatch from an index_put.
    oar_verl.register()
    est = oar_verl._REGISTERED["oar_grpo"]
    tlr = torch.zeros(4, 3)
    tlr[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match=match):
        call(est, tlr, torch.ones(4, 3))


def test_verl_hfscorer_missing_ground_truth_is_refused(oar_verl, tiny):
    # A row without reward_model.ground_truth used to be KeyError('ground_truth'), and None was probed as "None".
    from verl import DataProto

    model, tok = tiny
    P, ids, mask = _batch(tok)
    prompts = torch.tensor(P)
    data = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": ids, "response_mask": mask,
                 "attention_mask": torch.cat([torch.ones_like(prompts), mask], 1)},
        non_tensors={"reward_model": np.array([{"ground_truth": "5"}, {"ground_truth": None}, {}, {"ground_truth": "8"}],
                                              dtype=object)})
    scorer = oar_verl.HFScorer(tok, model)
    with pytest.raises(KeyError, match=r"needs the reference answers in non_tensor_batch\['reward_model'\]\[i\]"
                                       r"\['ground_truth'\]; rows \[1, 2\] have none"):
        scorer(data, _cfg(method="oar_p"), torch.tensor([1.0, -1.0, 1.0, -1.0]))


def test_openrlhf_install_checks_config_before_importing_openrlhf():
    from oar.integrations import openrlhf

    with pytest.raises(ValueError, match=r"config must be an oar\.OARConfig or None, got str"):
        openrlhf.install('{"method": "grpo"}')
    with pytest.raises(ValueError, match=r"config must be an oar\.OARConfig or None, got dict"):
        openrlhf.launch([], config={"method": "grpo"})


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(oar_config={"method": "grpo"}), ValueError, r"oar_config must be an oar\.OARConfig or None, got dict"),
    (dict(answer_column=None), ValueError, r"answer_column must be a non-empty str .* got None"),
    (dict(oar_config="oar_g"), ValueError, r"oar_config must be an oar\.OARConfig or None, got str"),
    (dict(answer_column="solution"), KeyError, r"needs the reference answer in dataset column 'solution'; "
                                                r"train_dataset has columns \['prompt', 'answer'\]"),
])
def test_trl_trainer_checks_oar_arguments_before_building(tiny, tmp_path, kwargs, exc, match):
    # These used to fail after TRL had built the trainer (AttributeError), or at the first step (missing column).
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from oar.integrations.trl import OARGRPOTrainer

    model, tok = tiny
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "1+2?"}], "answer": "3"}] * 4)
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, max_steps=1, report_to="none", save_strategy="no", use_cpu=True)
    with pytest.raises(exc, match=match):
        OARGRPOTrainer(model=model, reward_funcs=[lambda completions, **k: [0.0] * len(completions)], args=args,
                       train_dataset=ds, processing_class=tok, **kwargs)


# ---- oar eval-attribution --------------------------------------------------------------------------------------

@pytest.fixture()
def no_model(monkeypatch):
    """Fails the test if the command gets as far as loading a model or running the evaluation."""
    import oar.eval_attribution as ea

    def boom(*a, **k):
        raise AssertionError("eval-attribution ran past its argument checks")

    monkeypatch.setattr(ea, "run", boom)
    monkeypatch.setattr("oar.models.load_by_name", boom)


@pytest.mark.parametrize("argv, match", [
    (["--tasks", "math500"], r"data file not found: .*math500"),
    (["--max-new-tokens", "0"], r"--max-new-tokens must be >= 1, got 0"),
    (["--temperature", "-1"], r"--temperature must be finite and > 0, got -1\.0"),
    (["--temperature", "nan"], r"--temperature must be finite and > 0, got nan"),
    (["--out", "/proc/oar-nonexistent/recall"], r"--out: cannot create the output directory '/proc/oar-nonexistent'"),
    (["--out", "DIR/"], r"--out must be a file prefix .* got '.*/'"),
])
def test_cli_eval_attribution_fails_fast(tmp_path, monkeypatch, capsys, no_model, argv, match):
    # Each of these used to load the model (and for --out, run to the end before failing to write the results).
    from oar.cli import main

    monkeypatch.setenv("OAR_DATA_DIR", str(tmp_path / "no-data"))
    argv = [a.replace("DIR", str(tmp_path)) for a in argv]
    if "--tasks" not in argv:
        argv = ["--tasks", "arithmetic"] + argv
    with pytest.raises(SystemExit) as e:
        main(["eval-attribution"] + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("oar eval-attribution: error:")
    assert __import__("re").search(match, err)


def test_recall_at_nan_scores_are_refused():
    from oar.eval_attribution import recall_at

    # NaN keys made the ranking (and so the recall) depend on their position.
    with pytest.raises(ValueError, match=r"scores must not contain NaN .* positions \[1\]"):
        recall_at([1.0, float("nan"), 0.5], [True, False, False], 10)
    with pytest.raises(ValueError, match=r"percent must be in \(0, 100\] \(a real number\), got '10'"):
        recall_at([1.0], [True], "10")


@pytest.mark.parametrize("kwargs, match", [
    (dict(values=[0.5], reps=0), r"reps must be an int >= 1, got 0"),
    (dict(values=[0.5], level=1.5), r"level must be a real number in \(0, 1\), got 1\.5"),
    (dict(values=[0.5, float("nan")]), r"values must be finite, got nan at index 1"),
])
def test_bootstrap_ci_bad_arguments(kwargs, match):
    from oar.eval_attribution import bootstrap_ci

    # reps=0 used to be IndexError; level=1.5 a silently wrong interval.
    with pytest.raises(ValueError, match=match):
        bootstrap_ci(**kwargs)


def test_write_outputs_with_no_trace_kept(tmp_path):
    from oar.eval_attribution import write_outputs

    # Plotting zero tasks used to raise after the table was written.
    write_outputs([], [], str(tmp_path / "r"), {})
    assert (tmp_path / "r.json").exists() and (tmp_path / "r.md").exists()


# ---- oar_p_scores: engine, max_prefix_waste, positions ---------------------------------------------------------

@pytest.fixture(scope="module")
def probe(tiny):
    model, tok = tiny
    b = ProbeContextBuilder(tok, CONCLUDE, "}")
    P = tok.encode("Q: 2+3?", add_special_tokens=False)
    batch = b.build([P, P], [tok.encode("so 2 and 3 ", add_special_tokens=False),
                             tok.encode("hmm 9 x", add_special_tokens=False)], ["5", "9"], [6, 5])
    return as_probe_model(model), batch


@pytest.mark.parametrize("engine", ["auto", "prefix", "batched"])
@pytest.mark.parametrize("waste, match", [
    (0.0, r"max_prefix_waste must be in \(0, 1\], got 0\.0"),
    (1.5, r"max_prefix_waste must be in \(0, 1\], got 1\.5"),
    (float("nan"), r"max_prefix_waste must be in \(0, 1\], got nan"),
    ("0.2", r"max_prefix_waste must be a real number, got str '0.2'"),
    (None, r"max_prefix_waste must be a real number, got NoneType None"),
])
def test_oar_p_max_prefix_waste_checked_for_every_engine(probe, engine, waste, match):
    # Used to be ignored by the batched engine (and "auto" when it picks it), TypeError for None.
    pm, batch = probe
    with pytest.raises(ValueError, match=match):
        oar_p_scores(pm, batch, engine=engine, max_prefix_waste=waste)


@pytest.mark.parametrize("engine", ["prefix", "batched"])
@pytest.mark.parametrize("positions, rows, match", [
    ({5: [0]}, None, r"positions has row 5, which is not among the rows scored \(\[0, 1\]\)"),
    ({-1: [0]}, None, r"positions has row -1, which is not among the rows scored"),
    ({1: [0]}, [0], r"positions has row 1, which is not among the rows scored \(\[0\]\)"),
    ([[0]], None, r"positions must be a mapping \{row: reasoning indices\} or None, got list"),
    ({0: 1}, None, r"positions\[0\] must be a sequence of reasoning indices, got int 1"),
    ({0: "01"}, None, r"positions\[0\] must be a sequence of reasoning indices, got str '01'"),
    ({0: [1.5]}, None, r"positions\[0\]\[i\] must be an int, got float 1\.5"),
    ({0: [True]}, None, r"positions\[0\]\[i\] must be an int, got bool True"),
    ({"0": [1]}, None, r"positions key must be an int, got str '0'"),
])
def test_oar_p_positions_checked(probe, engine, positions, rows, match):
    # Rows not requested (or -1, "0") used to be ignored silently (scores 0), out-of-range keys IndexError,
    # floats truncated, strings iterated as digits.
    pm, batch = probe
    with pytest.raises(ValueError, match=match):
        oar_p_scores(pm, batch, engine=engine, positions=positions, rows=rows)


def test_oar_p_positions_accept_tensors_and_arrays(probe):
    pm, batch = probe
    ref = oar_p_scores(pm, batch, positions={0: [0, 2]}).scores
    for js in (torch.tensor([0, 2]), np.array([0, 2]), (2, 0)):
        torch.testing.assert_close(oar_p_scores(pm, batch, positions={0: js}).scores, ref)
    assert os.environ.get("OAR_CONFIG") is None
