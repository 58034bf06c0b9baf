"""The repository's folders, for tests that run scripts, read docs or import benchmark code: computed once here
instead of counting ``dirname(__file__)`` levels in every test (which changes with the folder a test sits in)."""

from pathlib import Path

#: tests/python/support
SUPPORT = Path(__file__).resolve().parent
#: tests/python (the layer folders core/, attribution/, pipeline/, integrations/, app/, project/ are below it)
TESTS = SUPPORT.parent
#: tests/python/workers: the scripts the tests run in subprocesses, accelerate / torchrun ranks and Ray workers
WORKERS = TESTS / "workers"
#: the repository root
ROOT = TESTS.parent.parent
#: python/ (the package's source folder)
SRC = ROOT / "python"
#: docs/
DOCS = ROOT / "docs"
#: benchmarks/python: the benchmark drivers (what measures)
BENCH_PY = ROOT / "benchmarks" / "python"
#: benchmarks/analysis: the scripts that read stored results and tabulate or plot them
BENCH_ANALYSIS = ROOT / "benchmarks" / "analysis"
#: benchmarks/gpu: the GPU check scripts
BENCH_GPU = ROOT / "benchmarks" / "gpu"
