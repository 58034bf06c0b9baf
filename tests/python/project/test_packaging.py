"""Packaging (issue 11, section 2): ranges in pyproject.toml, exact pins in requirements/ that satisfy them, the
`train` extra listed once for pip and once for the error messages, and `import oar` with only the runtime
dependencies (the train extra's packages hidden from the import system)."""

import os
import subprocess
import sys
import textwrap
import tomllib

import pytest
from packaging.requirements import Requirement

import oar
from oar.app import _extras

from _paths import ROOT

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(oar.__file__)))

with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _f:
    PYPROJECT = tomllib.load(_f)
PROJECT = PYPROJECT["project"]


def _name(req: Requirement) -> str:
    return req.name.lower().replace("_", "-")


def _pins(filename: str) -> dict[str, str]:
    out = {}
    with open(os.path.join(ROOT, "requirements", filename)) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                req = Requirement(line)
                (spec,) = req.specifier
                assert spec.operator == "==", f"requirements/{filename}: {line!r} is not an exact pin"
                out[_name(req)] = spec.version
    return out


def test_dependencies_are_ranges_not_pins():
    groups = {"build-system.requires": PYPROJECT["build-system"]["requires"], "dependencies": PROJECT["dependencies"]}
    groups.update({f"extra {k}": v for k, v in PROJECT["optional-dependencies"].items()})
    for where, reqs in groups.items():
        for text in reqs:
            ops = {s.operator for s in Requirement(text).specifier}
            assert ops and not ops & {"==", "===", "~="}, f"{where}: {text!r} must be a range"
    runtime = {_name(Requirement(r)) for r in PROJECT["dependencies"]}
    assert runtime == {"torch", "numpy", "pyyaml"}  # what `import oar` needs; the rest lives in extras


@pytest.mark.parametrize("group, pins", [("dependencies", "runtime.txt"), ("train", "train.txt"), ("test", "test.txt")])
def test_every_range_has_one_pin_that_satisfies_it(group, pins):
    reqs = PROJECT["dependencies"] if group == "dependencies" else PROJECT["optional-dependencies"][group]
    pinned = _pins(pins)
    ranges = {_name(Requirement(r)): Requirement(r).specifier for r in reqs}
    assert set(pinned) == set(ranges), f"requirements/{pins} pins {sorted(pinned)}, pyproject lists {sorted(ranges)}"
    for name, spec in ranges.items():
        assert spec.contains(pinned[name], prereleases=True), f"{name}=={pinned[name]} is outside {spec}"


def test_one_torch_for_build_runtime_and_the_install_test():
    torch_pin = _pins("runtime.txt")["torch"]
    assert _pins("build.txt")["torch"] == torch_pin
    assert _pins("verl-env.txt")["torch"] == torch_pin
    build_torch = next(Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("torch"))
    run_torch = next(Requirement(r) for r in PROJECT["dependencies"] if r.startswith("torch"))
    assert build_torch.specifier == run_torch.specifier
    with open(os.path.join(ROOT, "README.md")) as f:
        assert f"`{run_torch}`" in f.read(), "README must state the supported torch range of pyproject.toml"


def test_verl_env_holds_a_transformers_that_verl_accepts():
    # verl 0.9.1's METADATA: transformers!=5.6.0,<5.11,>=5.5.3
    from packaging.specifiers import SpecifierSet

    assert SpecifierSet("!=5.6.0,<5.11,>=5.5.3").contains(_pins("verl-env.txt")["transformers"])


def test_extras_table_matches_pyproject():
    for extra, table in _extras.EXTRAS.items():
        declared = {_name(Requirement(r)) for r in PROJECT["optional-dependencies"][extra]}
        assert set(table.values()) == declared, extra


def test_require_names_the_missing_packages_and_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("gguf", "math_verify") else real(name, *a))
    assert _extras.missing("train", ["transformers", "gguf"]) == ["gguf"]
    with pytest.raises(ModuleNotFoundError) as e:
        _extras.require("train", "oar.app.models", ["transformers", "gguf"])
    assert str(e.value) == 'oar.app.models needs gguf, which is not installed: pip install "oar[train]"'
    assert e.value.name == "gguf"
    with pytest.raises(ModuleNotFoundError) as e:
        _extras.require("train", "oar train")
    assert str(e.value) == 'oar train needs gguf, math-verify, which are not installed: pip install "oar[train]"'
    assert e.value.name == "gguf"
    _extras.require("train", "oar.app.models", ["transformers"])  # present: no error


def test_missing_refuses_unknown_names():
    with pytest.raises(ValueError, match=r"^extra must be one of \['train'\], got 'gpu'$"):
        _extras.missing("gpu")
    with pytest.raises(ValueError, match=r"^modules must be import names of oar\[train\] .*, got 'torch'$"):
        _extras.missing("train", ["torch"])


def test_import_oar_without_the_train_extra():
    hidden = sorted(_extras.EXTRAS["train"])
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        HIDDEN = {hidden!r}

        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in HIDDEN:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, Hide())
        import torch
        import oar, oar.ops, oar.pipeline, oar.integrations.verl, oar.integrations.openrlhf
        assert not [m for m in sys.modules if m.startswith("oar.app")], "import oar loaded the application"
        cfg = oar.OARConfig(method="grpo", q=0.3)
        a = oar.ops.group_advantages(torch.tensor([1.0, 0.0]), group_size=2)
        print(cfg.method, cfg.reshape.q, round(a[0].item(), 4))
        assert not set(HIDDEN) & {{m.split(".")[0] for m in sys.modules}}, "a train-extra module was imported"
        for mod in ("oar.app.train", "oar.app.compare", "oar.app.models", "oar.app.attribute", "oar.app.eval_attribution"):
            try:
                __import__(mod)
            except ModuleNotFoundError as e:
                print(mod, "|", e)
        from oar.app.cli import main
        try:
            main(["train"])
        except SystemExit as e:
            print("exit", e.code)
        """)
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    every = ", ".join(_extras.EXTRAS["train"].values())
    assert p.stdout.splitlines() == [
        "grpo 0.3 0.7071",
        f'oar.app.train | oar.app.train needs {every}, which are not installed: pip install "oar[train]"',
        f'oar.app.compare | oar.app.compare needs {every}, which are not installed: pip install "oar[train]"',
        'oar.app.models | oar.app.models needs transformers, which is not installed: pip install "oar[train]"',
        f'oar.app.attribute | oar.app.attribute needs {every}, which are not installed: pip install "oar[train]"',
        f'oar.app.eval_attribution | oar.app.eval_attribution needs {every}, which are not installed: pip install "oar[train]"',
        "exit 2",
    ]
    assert p.stderr.strip().splitlines()[-1] == f'oar: error: oar train needs {every}, which are not installed: ' \
                                                'pip install "oar[train]"'


def test_install_docs_use_no_build_isolation():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "pip install --no-build-isolation" in readme
    assert 'pip install --no-build-isolation ".[train]"' in readme or "oar[train]" in readme


def test_trainer_extras_are_the_tested_ranges():
    """oar[trl] / oar[verl] / oar[openrlhf] (and the train extra's trl) install the release series the tests ran
    (issue 40: they allowed any newer version), the same ranges as oar.integrations._versions.TESTED, each holding
    the exact version requirements/ pins for the tests."""
    from oar.integrations import _versions

    pins = {**_pins("train.txt")}
    with open(os.path.join(ROOT, "requirements", "trainers-nodeps.txt")) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                req = Requirement(line)
                pins[_name(req)] = next(iter(req.specifier)).version
    for package in _versions.TESTED:
        (declared,) = PROJECT["optional-dependencies"][package]
        assert Requirement(declared) == Requirement(_versions.requirement(package)), (package, declared)
        assert Requirement(declared).specifier.contains(pins[package]), (package, pins[package])
        assert _versions.in_tested_range(package, pins[package])
    train_trl = next(r for r in PROJECT["optional-dependencies"]["train"] if _name(Requirement(r)) == "trl")
    assert Requirement(train_trl) == Requirement(_versions.requirement("trl"))


@pytest.mark.parametrize("package, version, ok", [("trl", "1.13.0", True), ("trl", "1.13.4", True),
                                                  ("trl", "1.14.0", False), ("trl", "1.12.9", False),
                                                  ("verl", "0.9.1", True), ("verl", "0.9.0", False),
                                                  ("verl", "0.10.0.dev0", False), ("openrlhf", "0.11.2", True),
                                                  ("openrlhf", "0.11.10", True), ("openrlhf", "1.0", False),
                                                  ("trl", "1.13.0.dev1+local", False), ("trl", "1.13.0rc1", False),
                                                  ("trl", "1.13.1rc1", True), ("trl", "V1.13.2", True),
                                                  ("TRL", "1.13.2", True)])
def test_an_untested_trainer_version_is_named_once(monkeypatch, package, version, ok):
    import warnings

    from oar.integrations import _versions

    monkeypatch.setattr(_versions, "_SAID", set())
    assert _versions.in_tested_range(package, version) is ok
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _versions.check_tested(package, version) is ok
        _versions.check_tested(package, version)
    said = [str(w.message) for w in caught]
    if ok:
        assert said == []
    else:
        low, high = _versions.TESTED[package]
        assert len(said) == 1 and f"{package} {version} is installed" in said[0]
        assert f'pip install "{package}>={low},<{high}"' in said[0]
    with pytest.raises(ValueError, match="version must start with a release number"):
        _versions.release("latest")
    with pytest.raises(ValueError, match=r"package must be one of \['openrlhf', 'trl', 'verl'\], got 'trlx'"):
        _versions.check_tested("trlx", "1.0")


def test_each_integration_names_an_untested_trainer_version():
    """The check runs where each integration is set up: importing oar.integrations.trl, verl's register(), OpenRLHF's
    install; here with the installed (tested) versions nothing is said, and a stand-in version outside is named."""
    import subprocess
    import sys

    from _subproc import child_env

    code = ("import warnings, importlib.metadata as md; real = md.version; "
            "md.version = lambda p: {'trl': '1.15.0', 'verl': '0.10.2'}.get(p) or real(p); "
            "warnings.simplefilter('always'); "
            "import oar.integrations.trl; from oar.integrations import verl; verl.register()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=child_env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert "trl 1.15.0 is installed" in p.stderr and 'pip install "trl>=1.13.0,<1.14"' in p.stderr
    assert "verl 0.10.2 is installed" in p.stderr and 'pip install "verl>=0.9.1,<0.10"' in p.stderr
