"""verl as users launch it (issue 40): the printed commands run as printed, verl's own mode semantics for each OAR
trainer mode, and what is refused when the trainer is built (docs/trainers/verl.md, "The lines you change").

The commands are the ``oar-verl-command`` blocks of README.md and docs/trainers/*.md, split as a POSIX shell splits
them and run as verl 0.9.1's ``main_ppo`` runs them up to the point where a GPU is needed (worker script
``verl_launch.py``: Hydra, ``validate_config``, Ray's runtime env, the TaskRunner's trainer constructor in a Ray
actor). The mode semantics compare the real trainers' fields, OAR's against verl's own, built from one config.
"""

import glob
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from oar.integrations import verl as oar_verl  # noqa: E402
from oar.integrations.verl import launch  # noqa: E402

from _paths import ROOT, WORKERS  # noqa: E402

sys.path.insert(0, str(WORKERS))  # verl_launch's compose is imported too

#: Stand-ins for the ``...`` of a printed command: a user's own settings, as verl's examples give them (model and
#: data paths that are never opened before ``trainer.init()``, batch sizes, one node of 8 GPUs, vLLM rollouts).
USER_SETTINGS = ["actor_rollout_ref.model.path=/models/Qwen2.5-1.5B-Instruct",
                 "data.train_files=/data/gsm8k/train.parquet", "data.val_files=/data/gsm8k/test.parquet",
                 "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=8",
                 "actor_rollout_ref.rollout.name=vllm", "trainer.n_gpus_per_node=8", "trainer.nnodes=1"]
#: What verl's separate-async trainer also asserts of a user's settings (trainer_separate_async.py:55-70): a
#: standalone rollout pool and a checkpoint engine other than "naive".
SEPARATE_ASYNC_SETTINGS = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=8",
                           "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]


@pytest.fixture(scope="module", autouse=True)
def registered():
    names = oar_verl.register()
    yield names
    oar_verl.configure(None, None)


def printed_commands():
    """(file, block text) of every ``oar-verl-command`` block of README.md and docs/trainers/*.md."""
    out = []
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "trainers", "*.md"))):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for m in re.finditer(r"```bash oar-verl-command\n(.*?)```", text, re.S):
            out.append((os.path.relpath(path, ROOT), m.group(1)))
    return out


def argv_of(block: str) -> list[str]:
    """The block's words as a POSIX shell gives them to the program (continuation lines joined)."""
    return shlex.split(block.replace("\\\n", " "), comments=True, posix=True)


def overrides_of(block: str) -> list[str]:
    """The Hydra overrides of a printed ``python -m verl.trainer.main_ppo`` command, its ``...`` replaced by
    :data:`USER_SETTINGS` (and :data:`SEPARATE_ASYNC_SETTINGS` for that mode)."""
    argv = argv_of(block)
    assert argv[:3] == ["python", "-m", "verl.trainer.main_ppo"], argv
    assert argv[-1] == "...", f"a printed command ends with '...' (the rest of the user's command): {argv}"
    overrides = argv[3:-1]
    extra = list(USER_SETTINGS)
    if "trainer.v1.trainer_mode=oar_separate_async" in overrides:
        extra += SEPARATE_ASYNC_SETTINGS
    return overrides + extra


def compose(overrides):
    import verl_launch

    return verl_launch.compose(overrides)


def _mode_fields(trainer) -> dict:
    """What verl's mode decides, read off a built v1 trainer (verl 0.9.1 trainer_base.py:129-157 and the replay
    buffer), and the parameter_sync_step verl's rollout-skip tool reads from the config (rollout_skip.py:189)."""
    from omegaconf import OmegaConf

    rb = trainer.replay_buffer
    cfg = trainer.config
    return {"trainer_mode": trainer.trainer_mode, "parameter_sync_step": trainer.parameter_sync_step,
            "replay_buffer": type(rb).__name__, "replay_buffer.trainer_mode": rb.trainer_mode,
            "replay_buffer.trainer_config": OmegaConf.to_container(rb.trainer_config)
            if OmegaConf.is_config(rb.trainer_config) else rb.trainer_config,
            "replay_buffer.max_off_policy_threshold": rb.max_off_policy_threshold,
            "replay_buffer.max_off_policy_strategy": rb.max_off_policy_strategy,
            "config.trainer.v1.trainer_mode": str(cfg.trainer.v1.trainer_mode),
            "rollout_skip.parameter_sync_step": int(OmegaConf.select(
                cfg, f"trainer.v1.{cfg.trainer.v1.trainer_mode}.parameter_sync_step", default=1)),
            "use_critic": trainer.use_critic, "use_reference_policy": trainer.use_reference_policy}


def _build(overrides):
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = compose(overrides)
    OmegaConf.resolve(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # verl's "Disabled critic as algorithm.adv_estimator != gae"
        return get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)


def test_the_docs_print_the_commands():
    found = printed_commands()
    files = sorted({f for f, _ in found})
    assert files == ["README.md", os.path.join("docs", "trainers", "verl.md")], files
    assert len(found) >= 3
    for _, block in found:
        assert launch.check_overrides(argv_of(block)[3:-1]) == []  # nothing the plugin would warn about


def test_every_printed_verl_command_runs_as_printed():
    """Each printed command, as the shell splits it, through verl's main_ppo up to trainer.init(): Hydra composes
    and validates it, Ray starts with its runtime env, and in a Ray actor with that env (verl's TaskRunner) the plugin
    is loaded and the OAR trainer of the command's mode is built with the command's OAR config. The fields verl's
    mode decides equal those of verl's own trainer of that mode built from the same config (in this process)."""
    from _subproc import child_env

    commands = printed_commands()
    payload = json.dumps([{"overrides": overrides_of(block)} for _, block in commands])
    env = child_env()
    env.pop("OAR_VERL_PLUGIN", None)  # only the runtime env of the command may turn the plugin on
    env.pop("OAR_CONFIG", None)
    p = subprocess.run([sys.executable, str(WORKERS / "verl_launch.py")], input=payload, capture_output=True,
                       text=True, timeout=1200, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    results = [json.loads(line[len("RESULT "):]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(commands), p.stdout[-3000:] + p.stderr[-3000:]
    for (where, block), res in zip(commands, results):
        overrides = overrides_of(block)
        assert "error" not in res, (where, res)
        assert res["step"] == "task_runner" and res["OAR_VERL_PLUGIN"] == "1"
        assert set(oar_verl.ADV_ESTIMATORS) <= set(res["registered"])
        mode = dict(o.split("=", 1) for o in overrides if "=" in o)["trainer.v1.trainer_mode"]
        assert mode.startswith("oar_") and res["bases"][0] == "OARTrainerMixin"
        base = mode[len("oar_"):]
        # verl's own trainer of the mode, same config but a verl estimator: the fields it decides are the same
        verl_own = _build([o for o in overrides if not o.startswith(("algorithm.adv_estimator=", "+oar.",
                                                                    "trainer.v1.trainer_mode="))]
                          + ["algorithm.adv_estimator=grpo", f"trainer.v1.trainer_mode={base}"])
        want = _mode_fields(verl_own)
        assert res["trainer_mode"] == res["config_trainer_mode"] == want["trainer_mode"] == base
        assert res["parameter_sync_step"] == want["parameter_sync_step"]
        assert res["replay_buffer"] == want["replay_buffer"]
        # the command's OAR config reached the estimator (method from the estimator's name)
        estimator = dict(o.split("=", 1) for o in overrides)["algorithm.adv_estimator"]
        assert res["oar_config"]["method"] == oar_verl.ADV_ESTIMATORS[estimator]
        for o in overrides:
            if o.startswith("+oar."):
                key, value = o[len("+oar."):].split("=", 1)
                got = res["oar_config"][key]
                assert (str(got) == value) or (isinstance(got, float) and got == float(value)), (key, got, value)


@pytest.mark.parametrize("mode, extra", [("sync", []), ("colocate_async", []),
                                         ("separate_async", ["trainer.v1.separate_async.parameter_sync_step=4"]),
                                         ("separate_async", ["trainer.v1.separate_async.parameter_sync_step=2",
                                                             "data.train_batch_size=32"])])
def test_oar_modes_behave_as_verls_modes(mode, extra):
    """verl decides a trainer's behaviour from the literal trainer_mode (trainer_base.py:129-130 parameter sync,
    153-157 replay buffer, 731 data-loader refill, 902/912/1004/1499 checkpointed transfer queue; rollout_skip.py:189):
    oar_<mode> used to get parameter_sync_step 1 (oar_separate_async) and the async replay buffer (oar_sync). Every
    field verl's mode decides now equals that of verl's own trainer of the mode, built from the same config; the
    whole config equals verl's but for the estimator and the oar keys."""
    from omegaconf import OmegaConf

    settings = USER_SETTINGS + (SEPARATE_ASYNC_SETTINGS if mode == "separate_async" else []) + extra
    ours = _build(settings + ["algorithm.adv_estimator=oar_g", f"trainer.v1.trainer_mode=oar_{mode}",
                              "+oar.probe=answer_mean"])
    theirs = _build(settings + ["algorithm.adv_estimator=grpo", f"trainer.v1.trainer_mode={mode}"])
    assert isinstance(ours, oar_verl.workers.OARTrainerMixin) and isinstance(ours, type(theirs))
    assert _mode_fields(ours) == _mode_fields(theirs)
    if mode == "separate_async":
        assert ours.parameter_sync_step == int(extra[0].rsplit("=", 1)[1]) > 1
    a, b = OmegaConf.to_container(ours.config), OmegaConf.to_container(theirs.config)
    assert a.pop("oar") == {"probe": "answer_mean"}
    a["algorithm"]["adv_estimator"] = b["algorithm"]["adv_estimator"]
    assert a == b


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_forgotten_oar_mode_is_refused_when_the_trainer_is_built(mode):
    """An OAR estimator with verl's own trainer mode used to fail at the first advantage step, after a whole
    generation; it is refused by the constructor, naming the line to add. verl's own estimators build as before."""
    settings = USER_SETTINGS + (SEPARATE_ASYNC_SETTINGS + ["trainer.v1.separate_async.parameter_sync_step=4"]
                                if mode == "separate_async" else [])
    for est in ("oar_g", "oar_grpo"):
        with pytest.raises(ValueError, match=rf"algorithm.adv_estimator='{est}' needs oar's v1 trainer.*"
                                             rf"trainer.v1.trainer_mode='{mode}'.*Add trainer.v1.trainer_mode=oar_{mode}"):
            _build(settings + [f"algorithm.adv_estimator={est}", f"trainer.v1.trainer_mode={mode}"])
    assert type(_build(settings + ["algorithm.adv_estimator=grpo", f"trainer.v1.trainer_mode={mode}"])).__name__ \
        .startswith("PPOTrainer")


BUILD_REFUSALS = [
    pytest.param(["+oar.probe=answer_meen"], {}, r"verl config key 'oar' .*oar.probe must be one of .*answer_meen",
                 id="bad_value"),
    pytest.param(["+oar.prob=last"], {}, r"verl config key 'oar' .*prob", id="unknown_key"),
    pytest.param(["+oar=oar_g"], {}, r"verl's config key 'oar' must hold the OAR config's keys \(one override per "
                 r"key: \+oar.probe=answer_mean \+oar.tiers=both\), got str 'oar_g'", id="not_a_mapping"),
    pytest.param(["+oar.probe=last"], {"OAR_CONFIG": '{"probe": "last"}'}, r"the OAR config is given twice",
                 id="twice"),
    pytest.param([], {"OAR_CONFIG": "{probe: last}"}, r"\$OAR_CONFIG must be a JSON object, e\.g\. "
                 r"OAR_CONFIG='\{\"probe\": \"answer_mean\"\}'.*\+oar\.probe=answer_mean; got invalid JSON",
                 id="env_not_json"),
    pytest.param(["+trainer.v1.oar_sync.parameter_sync_step=2"], {},
                 r"trainer.v1.oar_sync is not read by verl.*reads trainer.v1.sync; move these keys there: "
                 r"\['parameter_sync_step'\]", id="oar_mode_section"),
    pytest.param([], {"OAR_CONFIG": "[1]"}, r"\$OAR_CONFIG must be a JSON object.*got '\[1\]', which is JSON list, not "
                 r"an object", id="env_json_list"),
    pytest.param([], {"OAR_CONFIG": '{"probe": "lastt"}'}, r"^\$OAR_CONFIG: oar.probe must be one of", id="env_schema"),
]


@pytest.mark.parametrize("overrides, env, match", BUILD_REFUSALS)
def test_oar_config_is_refused_when_the_trainer_is_built(monkeypatch, overrides, env, match):
    """The OAR config in verl's config (+oar.*) or $OAR_CONFIG is checked by the OAR trainer's constructor (it used
    to be read at the first advantage step), with the working spelling in the message."""
    monkeypatch.delenv("OAR_CONFIG", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        _build(USER_SETTINGS + ["algorithm.adv_estimator=oar_g", "trainer.v1.trainer_mode=oar_sync"] + overrides)
    oar_verl.configure(None, None)


#: The command line docs/trainers/verl.md printed before issue 40, which failed before starting.
OLD_COMMAND = ["algorithm.adv_estimator=oar_g", "trainer.v1.trainer_mode=oar_sync",
               "+ray_kwargs.ray_init.runtime_env.env_vars.OAR_VERL_PLUGIN=1",
               "+ray_kwargs.ray_init.runtime_env.env_vars.OAR_CONFIG="
               '{"probe": "answer_mean", "tiers": "both"}']


def test_spellings_that_cannot_work_are_named_with_the_working_one():
    """The old command failed in Hydra (JSON in an override) and, without that line, in Ray (OAR_VERL_PLUGIN=1 is an
    int for Hydra); both errors are theirs, so the plugin names the working spelling first."""
    from hydra.errors import HydraException
    from ray.runtime_env import RuntimeEnv

    with pytest.raises(HydraException, match="no viable alternative at input"):
        compose(OLD_COMMAND)
    config = compose(OLD_COMMAND[:3])
    env_vars = dict(config.ray_kwargs.ray_init.runtime_env.env_vars)
    assert env_vars == {"OAR_VERL_PLUGIN": 1}
    with pytest.raises(TypeError, match=r"env_vars'\] must be of type Dict\[str, str\], but the value 1 is of type"):
        RuntimeEnv(env_vars=env_vars)
    problems = launch.check_overrides(OLD_COMMAND)
    assert len(problems) == 2
    assert "OAR_VERL_PLUGIN the int 1" in problems[0] and launch.PLUGIN_LINE in problems[0]
    assert "Hydra cannot parse" in problems[1] and launch.CONFIG_LINE in problems[1]
    bool_problem = launch.check_overrides(["+ray_kwargs.ray_init.runtime_env.env_vars.OAR_VERL_PLUGIN=true"])
    assert len(bool_problem) == 1 and "the bool True" in bool_problem[0]
    twice = launch.check_overrides(["+oar.probe=last",
                                    "+ray_kwargs.ray_init.runtime_env.env_vars.OAR_CONFIG='{\"probe\": \"last\"}'"])
    assert len(twice) == 1 and "given twice" in twice[0]
    assert launch.check_overrides(["algorithm.adv_estimator=grpo", "trainer.nnodes=1"]) == []
    with pytest.raises(TypeError, match="overrides must be a sequence of str"):
        launch.check_overrides("+oar.probe=last")
    # the plugin prints them when verl is imported by such a command line (verl's driver process)
    from _subproc import child_env

    code = ("import sys; sys.argv = ['main_ppo.py'] + sys.argv[1:]; import warnings; "
            "warnings.simplefilter('always'); import oar.integrations.verl.plugin")
    env = child_env()
    env.pop("OAR_VERL_PLUGIN", None)
    p = subprocess.run([sys.executable, "-c", code] + OLD_COMMAND[2:], capture_output=True, text=True, timeout=300,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("RuntimeWarning: oar:") == 2 and launch.PLUGIN_LINE in p.stderr, p.stderr[-3000:]


def test_a_failed_trainer_registration_is_said_once(monkeypatch, caplog):
    """A failure to register the OAR v1 trainers used to be recorded silently in V1_TRAINERS (verl then said
    "Unknown trainer 'oar_sync'"); it is said once per process and cause, as an error log and a RuntimeWarning."""
    from oar.integrations.verl import registry, workers

    def broken():
        raise ImportError("No module named 'transfer_queue'")

    monkeypatch.setattr(workers, "register_trainers", broken)
    monkeypatch.setattr(registry, "_SAID", set())
    try:
        with caplog.at_level(logging.ERROR), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            oar_verl.register()
            oar_verl.register()
        said = [w for w in caught if issubclass(w.category, RuntimeWarning) and "could not be registered" in
                str(w.message)]
        assert len(said) == 1 and "ImportError: No module named 'transfer_queue'" in str(said[0].message)
        assert "trainer.use_v1=False" in str(said[0].message)
        assert sum("could not be registered" in r.getMessage() for r in caplog.records) == 1
        assert oar_verl.V1_TRAINERS == {"names": [], "error": "ImportError: No module named 'transfer_queue'"}
    finally:
        monkeypatch.undo()
        oar_verl.register()
    assert oar_verl.V1_TRAINERS["error"] is None and "oar_sync" in oar_verl.V1_TRAINERS["names"]


def _solutions(n=4, level=3):
    """(worked solution, final answer) pairs of the built-in arithmetic task (GSM8K's '#### x' format)."""
    import random

    from oar.app.tasks.arithmetic import generate_problem

    rng = random.Random(0)
    return [(sol, str(ans)) for _, ans, sol, _ in (generate_problem(rng, level) for _ in range(n))]


class _Dataset:
    """verl's RLHFDataset as the OAR trainer reads it: rows in ``dataframe``."""

    def __init__(self, rows):
        self.dataframe = rows

    def __len__(self):
        return len(self.dataframe)


def test_worked_solutions_in_verls_ground_truth_are_refused_at_start():
    """The probe reads reward_model.ground_truth verbatim: a worked solution there (GSM8K's raw 'answer') is refused
    when the OAR trainer loads the data, before any worker or generation, naming the row and the fix; final answers
    pass; a missing one is a KeyError; methods that read no answers check nothing."""
    from omegaconf import OmegaConf

    check = oar_verl.checks.check_dataset_answers
    pairs = _solutions()
    cfg = OmegaConf.create({"algorithm": {"adv_estimator": "oar_g"}})
    good = _Dataset([{"reward_model": {"style": "rule", "ground_truth": a}} for _, a in pairs])
    assert check(cfg, good) == len(pairs)
    bad = _Dataset([{"reward_model": {"ground_truth": a}} for _, a in pairs[:2]]
                   + [{"reward_model": {"ground_truth": s}} for s, _ in pairs[2:]])
    with pytest.raises(ValueError, match=r"dataset column 'reward_model.ground_truth', row 2 holds a worked solution"
                                         r".*'####'.*reward_model.ground_truth.*examples/data_preprocess/gsm8k.py"):
        check(cfg, bad)
    with pytest.raises(KeyError, match=r"train row 1 has none"):
        check(cfg, _Dataset([good.dataframe[0], {"reward_model": {"style": "rule"}}]))
    assert check(OmegaConf.create({"algorithm": {"adv_estimator": "oar_grpo"}}), bad) == 0
    assert check(OmegaConf.create({"algorithm": {"adv_estimator": "grpo"}}), bad) == 0


def test_worked_solutions_in_a_batch_are_refused_naming_the_row():
    """Every batch's answers are checked when the driver reads them (rows beyond the ones checked at start)."""
    import numpy as np
    import torch
    from verl import DataProto

    pairs = _solutions(3)
    B, P, R = 3, 2, 4
    data = DataProto.from_dict(
        tensors=dict(prompts=torch.ones((B, P), dtype=torch.long), responses=torch.ones((B, R), dtype=torch.long),
                     attention_mask=torch.ones((B, P + R), dtype=torch.long),
                     response_mask=torch.ones((B, R), dtype=torch.long)),
        non_tensors=dict(reward_model=np.array([{"ground_truth": pairs[0][1]}, {"ground_truth": pairs[1][1]},
                                                {"ground_truth": pairs[2][0]}], dtype=object)))
    import oar

    with pytest.raises(ValueError, match=r"'reward_model.ground_truth', row 2 holds a worked solution"):
        oar_verl.rollout_rows(data, oar.OARConfig(method="oar_p"))
    data.non_tensor_batch["reward_model"][2] = {"ground_truth": pairs[2][1]}
    assert oar_verl.rollout_rows(data, oar.OARConfig(method="oar_p"))["answers"] == [a for _, a in pairs]


def test_the_oar_trainer_checks_the_answers_when_verl_loads_the_data(tmp_path):
    """Through the real trainer: verl's own _init_tokenizer / _init_dataloader (trainer.init() runs them before any
    worker) read a parquet file of verl's RL layout whose ground truths are worked solutions; the OAR trainer refuses
    there. With final answers, the data loads."""
    import pandas as pd

    import _verl_cpu

    model = _verl_cpu.save_tiny_model(str(tmp_path / "tiny"))
    pairs = _solutions(6)

    def parquet(name, key):
        rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"question {i}"}],
                 "reward_model": {"style": "rule", "ground_truth": p[key]}} for i, p in enumerate(pairs)]
        path = tmp_path / f"{name}.parquet"
        pd.DataFrame(rows).to_parquet(path)
        return str(path)

    def trainer(train):
        settings = [s for s in USER_SETTINGS if not s.startswith(("actor_rollout_ref.model.path", "data."))]
        t = _build(settings + [f"actor_rollout_ref.model.path={model}", f"data.train_files={train}",
                               f"data.val_files={parquet('val', 1)}", "data.train_batch_size=2",
                               "algorithm.adv_estimator=oar_p", "trainer.v1.trainer_mode=oar_sync"])
        t._init_tokenizer()
        return t

    t = trainer(parquet("solutions", 0))
    with pytest.raises(ValueError, match=r"'reward_model.ground_truth', row 0 holds a worked solution"):
        t._init_dataloader()
    t = trainer(parquet("answers", 1))
    t._init_dataloader()
    assert len(t.train_dataset) == len(pairs)


# ---- bad input (review of issue 40's launch path) -----------------------------------------------------------------


def test_check_overrides_looks_only_at_oar_overrides():
    """No false alarm for words that merely contain OAR_ (a run name, a pytest -k); the fix named for each kind of
    key; an OAR_VERL_PLUGIN value that leaves the plugin off; null / empty configs are not 'given twice'."""
    env = "+ray_kwargs.ray_init.runtime_env.env_vars."
    for quiet in (["--run-name", "OAR_test"], ["-k", "test_OAR_"], ["data.train_files=/d/OAR_a.parquet"],
                  ["~oar"], ["+oar=null", env + 'OAR_CONFIG="x.json"'], [env + 'OAR_CONFIG=""', "+oar.probe=last"],
                  [env + 'OAR_VERL_PLUGIN="on"']):
        assert launch.check_overrides(quiet) == [], quiet
    (p,) = launch.check_overrides([env + "OAR_DEBUG=1"])
    assert "the int 1" in p and f"'{env}OAR_DEBUG=\"<value>\"'" in p
    (p,) = launch.check_overrides([env + 'OAR_VERL_PLUGIN="2"'])
    assert "leaves the plugin off" in p and "got '2'" in p and launch.PLUGIN_LINE in p
    (p,) = launch.check_overrides(["+oar.probe = last"])
    assert "Hydra cannot parse" in p and "without spaces around '='" in p


def test_more_refusals_when_the_trainer_is_built(monkeypatch):
    """+oar.method that disagrees with the estimator's name (it used to be overridden silently), a mistyped oar
    estimator, a second trainer built from a config the first one set back to verl's mode name, a read-only config."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import get_trainer_cls

    monkeypatch.delenv("OAR_CONFIG", raising=False)
    base = USER_SETTINGS + ["trainer.v1.trainer_mode=oar_sync"]
    with pytest.raises(ValueError, match=r"\+oar.method=oar_p disagrees with algorithm.adv_estimator='oar_g'.*"
                                         r"algorithm.adv_estimator=oar_p"):
        _build(base + ["algorithm.adv_estimator=oar_g", "+oar.method=oar_p"])
    assert _build(base + ["algorithm.adv_estimator=oar", "+oar.method=oar_p"]).config.oar.method == "oar_p"
    assert _build(base + ["algorithm.adv_estimator=oar_g", "+oar.method=oar_g"])  # the same method: fine
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator must be one of oar's estimators .*got 'OAR_G'"):
        _build(base + ["algorithm.adv_estimator=OAR_G"])
    config = compose(base + ["algorithm.adv_estimator=oar_g"])
    OmegaConf.resolve(config)
    OmegaConf.set_readonly(config, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        get_trainer_cls("oar_sync")(config=config)
        assert config.trainer.v1.trainer_mode == "sync"
        with pytest.raises(ValueError, match=r"this config was already used to build the OAR trainer of "
                                             r"trainer.v1.trainer_mode=oar_sync"):
            get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)
    oar_verl.configure(None, None)


def test_answers_that_are_containers_are_refused():
    """verl's Search-R1 layout keeps {"target": [...]} in ground_truth, parquet turns lists into arrays: their repr
    would be probed; refused naming the row and the type. Numbers (numpy scalars too) are their text; a pandas
    dataframe (a custom dataset class) is read by position."""
    import numpy as np
    import pandas as pd
    from omegaconf import OmegaConf

    check = oar_verl.checks.check_dataset_answers
    cfg = OmegaConf.create({"algorithm": {"adv_estimator": "oar_p"}})
    for value, kind in (({"target": ["Paris"]}, "dict"), (np.array(["1", "2"]), "ndarray"), (["1"], "list")):
        with pytest.raises(ValueError, match=rf"row 1: the reference answer must be a str or a number, got {kind}"):
            check(cfg, _Dataset([{"reward_model": {"ground_truth": "3"}}, {"reward_model": {"ground_truth": value}}]))
    assert check(cfg, _Dataset([{"reward_model": {"ground_truth": np.int64(7)}}])) == 1
    frame = pd.DataFrame({"reward_model": [{"ground_truth": "4"}, {"ground_truth": "5 apples\nso 5"}]})
    with pytest.raises(ValueError, match=r"row 1 holds 2 lines"):
        check(cfg, _Dataset(frame))


def test_legacy_init_workers_checks_the_dataset_answers():
    """The legacy trainer (trainer.use_v1=False) has its train dataset before init_workers: a worked solution there is
    refused before verl starts any worker."""
    import types

    from omegaconf import OmegaConf

    called = []
    wrapped = oar_verl.workers.wrap_init_workers(lambda self: called.append(1))
    sol, _ = _solutions(1)[0]
    me = types.SimpleNamespace(config=OmegaConf.create({"algorithm": {"adv_estimator": "oar_g"}}),
                               role_worker_mapping={},
                               train_dataset=_Dataset([{"reward_model": {"ground_truth": sol}}]))
    with pytest.raises(ValueError, match=r"row 0 holds a worked solution"):
        wrapped(me)
    assert not called


class _FakeGroup:
    """A worker group that records the weight-slot calls and fails where told."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name,) + args)
            if (name,) + args == self.fail:
                raise RuntimeError(f"{name} failed")
        return call


def test_pi_old_swap_only_when_rows_are_scored_and_always_put_back():
    """No save / restore when no row is sent to the workers (every advantage 0: common early in training); the
    current weights are restored and their copy cleared even when scoring or the restore itself fails."""
    import torch

    import oar

    cfg = oar.OARConfig(method="oar_g")
    scored = []
    inner = lambda data, config, seq: scored.append(1) or "scores"  # noqa: E731
    wg = _FakeGroup()
    scorer = oar_verl.workers._PiOldScorer(inner, wg, 0)
    assert scorer(None, cfg, torch.zeros(4)) == "scores" and wg.calls == []
    assert scorer(None, cfg, torch.tensor([1.0, 0.0, -1.0, 0.0])) == "scores"
    cur = oar_verl.workers.CURRENT_SLOT
    assert wg.calls == [("save_model_to_cpu", cur), ("restore_model_from_cpu", 0), ("restore_model_from_cpu", cur),
                        ("clear_cpu_model", cur)]

    def broken(data, config, seq):
        raise KeyError("scoring failed")

    wg = _FakeGroup()
    with pytest.raises(KeyError, match="scoring failed"):
        oar_verl.workers._PiOldScorer(broken, wg, 0)(None, cfg, torch.ones(2))
    assert wg.calls[-2:] == [("restore_model_from_cpu", cur), ("clear_cpu_model", cur)]
    wg = _FakeGroup(fail=("restore_model_from_cpu", cur))
    with pytest.raises(RuntimeError, match="restore_model_from_cpu failed"):
        oar_verl.workers._PiOldScorer(inner, wg, 0)(None, cfg, torch.ones(2))
    assert wg.calls[-1] == ("clear_cpu_model", cur)
    import copy

    assert copy.copy(oar_verl.workers._PiOldScorer(inner, wg, 0)).slot == 0


def test_oar_keys_with_a_verl_estimator_are_refused():
    """A verl GRPO script keeps algorithm.adv_estimator=grpo in its '...': after the printed oar_g, Hydra keeps the
    last value, and the run was plain GRPO with the +oar.* keys ignored, silently. Refused now, in every trainer."""
    import types

    from omegaconf import OmegaConf

    match = r"the config has OAR keys \(\+oar\.\*: \['probe'\]\) but algorithm.adv_estimator='grpo' is not an OAR"
    for mode in ("oar_sync", "sync"):
        with pytest.raises(ValueError, match=match):
            _build(USER_SETTINGS + ["algorithm.adv_estimator=oar_g", f"trainer.v1.trainer_mode={mode}",
                                    "+oar.probe=answer_mean", "algorithm.adv_estimator=grpo"])
    called = []
    me = types.SimpleNamespace(config=OmegaConf.create({"algorithm": {"adv_estimator": "grpo"},
                                                        "oar": {"probe": "last"}}), role_worker_mapping={})
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator='grpo' is not an OAR estimator"):
        oar_verl.workers.wrap_init_workers(lambda self: called.append(1))(me)
    assert not called
    me.config = OmegaConf.create({"algorithm": {"adv_estimator": "grpo"}})
    oar_verl.workers.wrap_init_workers(lambda self: called.append(1))(me)
    assert called == [1]  # verl's own estimator without oar keys: untouched


def test_a_command_selecting_oar_without_the_plugin_line_is_named(monkeypatch):
    """Without the plugin in verl's Ray processes, verl only says "Unknown trainer 'oar_sync'"; the driver-side
    check names the missing line (unless this process has $OAR_VERL_PLUGIN, which a local Ray cluster inherits)."""
    monkeypatch.delenv("OAR_VERL_PLUGIN", raising=False)
    (p,) = launch.check_overrides(["algorithm.adv_estimator=oar_g", "trainer.v1.trainer_mode=oar_sync"])
    assert "selects oar, but nothing turns the oar plugin on" in p and launch.PLUGIN_LINE in p
    assert launch.check_overrides(["algorithm.adv_estimator=grpo", "trainer.v1.trainer_mode=sync"]) == []
    monkeypatch.setenv("OAR_VERL_PLUGIN", "1")
    assert launch.check_overrides(["algorithm.adv_estimator=oar_g", "trainer.v1.trainer_mode=oar_sync"]) == []
