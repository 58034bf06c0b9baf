"""The package draws as layers (docs/architecture.md): every import of a module of python/oar goes to its own
layer or one below, the import graph has no circle, and no library module imports the package facade ``oar``
(only the application, ``oar.app``, may)."""

import ast
import pathlib

import pytest

from _paths import SRC

#: lowest first; a module belongs to the layer of its longest matching prefix (docs/architecture.md, "Layers")
LAYERS = [
    ("foundation", ["oar._C", "oar._lib", "oar._logging", "oar._args", "oar.app._extras", "oar.schema", "oar.cuda_checks",
                    "oar.groups", "oar.reference", "oar.answers", "oar._smollm2"]),
    ("testing", ["oar.testing"]),
    ("ops", ["oar.ops", "oar.metrics"]),
    ("attribution", ["oar.attribution", "oar.distributed", "oar.baselines", "oar.batch"]),
    ("methods", ["oar.methods"]),
    ("pipeline", ["oar.pipeline"]),
    ("entries", ["oar.api", "oar.pipeline_cache"]),
    ("integrations", ["oar.integrations"]),
    ("application", ["oar.app"]),
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in sorted((SRC / "oar").rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _layer(mod: str) -> int:
    best, rank = -1, None
    for k, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            if (mod == pre or mod.startswith(pre + ".")) and len(pre) > best:
                best, rank = len(pre), k
    if rank is None:
        raise AssertionError(f"{mod} is in no layer of LAYERS: add it (and to docs/architecture.md)")
    return rank


def _imports(mod: str) -> set[str]:
    """The oar modules ``mod`` imports (function-level imports included); ``oar`` = the package facade."""
    tree = ast.parse(MODULES[mod].read_text())
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name == "oar" or a.name.startswith("oar.")}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and (
                n.module == "oar" or n.module.startswith("oar.")):
            for a in n.names:
                sub = f"{n.module}.{a.name}"
                out.add(sub if sub in MODULES or sub == "oar._C" else n.module)  # _C: the pybind11 module
        elif isinstance(n, ast.ImportFrom) and n.level:
            raise AssertionError(f"{mod}: relative import (use absolute oar.* imports)")
    return out - {mod}


GRAPH = {m: _imports(m) for m in MODULES if m != "oar"}


@pytest.mark.parametrize("mod", sorted(GRAPH))
def test_imports_go_down(mod):
    up = sorted(d for d in GRAPH[mod] if d != "oar" and _layer(d) > _layer(mod))
    assert not up, f"{mod} ({LAYERS[_layer(mod)][0]}) imports a higher layer: {up}"
    if _layer(mod) < len(LAYERS) - 1:
        assert "oar" not in GRAPH[mod], f"{mod} imports the package facade oar (import the defining module instead)"


def test_no_circle():
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(GRAPH.get(m, ())):
            if d == "oar":
                continue
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


def test_layers_cover_the_package():
    assert {m for m in GRAPH if m.startswith("oar.app")}, "the application subpackage oar.app exists"
    for m in GRAPH:
        _layer(m)


#: Largest module of python/oar in lines (issue 43: a module that outgrows it holds more than one job; split it by
#: job, as attribution/model.py, app/compare.py, app/diagnose.py and integrations/verl/workers.py were).
MAX_MODULE_LINES = 600


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_module_size(mod):
    n = len(MODULES[mod].read_text().splitlines())
    assert n <= MAX_MODULE_LINES, (f"{MODULES[mod].relative_to(SRC)} has {n} lines (> {MAX_MODULE_LINES}): split it "
                                   "by job (docs/design.md, 'Python layout')")
