"""The prepared device scripts (benchmarks/gpu/run_scale.sh, run_gpu_checks.sh) on this CPU machine (issue 41,
item 6): run_scale.sh's dry-run plan (phases in priority order, caps against the budget, one device call), its
capped pytest wrapper stopped by SIGINT (pytest's interrupted summary and the line it was at survive in the log),
and a whole run with stand-ins for the build, Python and bench_scale.py (a phase stopped at its cap keeps the rows
it wrote, a phase whose cap exceeds the budget left is skipped, one summary line per phase). docs/gpu.md, "Calls in
priority order"."""

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from _paths import ROOT

SCALE = ROOT / "benchmarks" / "gpu" / "run_scale.sh"
CHECKS = ROOT / "benchmarks" / "gpu" / "run_gpu_checks.sh"
ORDER = ["build", "time1.5b", "time7b", "tests", "ab", "profile"]
TOOL_LIMIT_S = 600  # the device tool's limit on one command

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


def _env(tmp_path, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCALE_", "OUT"))}
    env.update(OAR_GPU_BUILD_DIR=str(tmp_path / "no-build-gpu"), SCALE_DEPS_PREFIX=str(tmp_path / "no-deps"),
               SCALE_SCRATCH=str(tmp_path / "scratch"))
    env.update(kw)
    return env


def _plan(out: str) -> list[tuple[str, int, int, str]]:
    """(phase, cap, running sum, fits) of each row of the dry run's plan table."""
    rows = re.findall(r"^\s+\d+ (\S+)\s+(\d+)s\s+(\d+)s\s+~\d+s\s+(yes|if-left)\s", out, re.M)
    return [(p, int(c), int(s), f) for p, c, s, f in rows]


def test_dry_run_lists_the_phases_in_priority_order_within_the_budget(tmp_path):
    r = subprocess.run([str(SCALE), "--dry-run"], env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    plan = _plan(r.stdout)
    assert [p for p, *_ in plan] == ORDER, r.stdout
    budget = int(re.search(r"budget (\d+)s", r.stdout).group(1))
    timeout_s = int(re.search(r"timeout_s (\d+)", r.stdout).group(1))
    assert budget + 15 + 25 <= timeout_s <= TOOL_LIMIT_S  # the 15 s kill grace and the summary fit in the call
    fitting = [(p, c) for p, c, _, f in plan if f == "yes"]
    # build and both timing phases fit even if each used its whole cap; the sum column is the running sum
    assert [p for p, _ in fitting] == ORDER[:3], r.stdout
    assert sum(c for _, c in fitting) <= budget
    assert [s for *_, s, _ in plan] == [sum(c for _, c, *_ in plan[:i + 1]) for i in range(len(plan))]
    assert all(f == "if-left" for *_, f in plan[3:])
    assert "(cold)" in r.stdout and "run_gpu_checks.sh --build-only" in r.stdout
    assert "--settings dense grpo oar_g window_probe window" in r.stdout
    files = re.search(r"files back in \$OUT \((\d+) of at most 8\): (.*)", r.stdout)
    assert int(files.group(1)) <= 8 and len(files.group(2).split()) == int(files.group(1))
    assert not (tmp_path / "scratch").exists()  # nothing ran


def test_dry_run_of_a_follow_up_call_on_a_warm_machine(tmp_path):
    """SCALE_PHASES keeps the priority order, adds the build, and a warm build (build-gpu/ and the unpacked
    packages of an earlier call) has the small cap."""
    env = _env(tmp_path, SCALE_PHASES="profile tests ab", SCALE_BUDGET_S="400", **_fake_warm(tmp_path))
    r = subprocess.run([str(SCALE), "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    plan = _plan(r.stdout)
    assert [p for p, *_ in plan] == ["build", "tests", "ab", "profile"]
    assert plan[0][1] == 60 and "(warm)" in r.stdout
    assert all(f == "yes" for *_, f in plan) and plan[-1][2] <= 400
    bad = subprocess.run([str(SCALE), "--dry-run"], env=_env(tmp_path, SCALE_PHASES="tests nope"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown phase 'nope'" in bad.stderr


def test_pytest_phase_stopped_at_its_cap_keeps_the_summary_and_the_traceback(tmp_path):
    (tmp_path / "test_sleeps.py").write_text(textwrap.dedent("""
        import time

        def test_quick():
            pass

        def test_sleeps():
            time.sleep(120)
    """))
    log = tmp_path / "full.log"
    script = f'source {SCALE}; FULL_LOG={log}; PY={sys.executable}; : > "$FULL_LOG"; ' \
             'pytest_capped tests 5 test_sleeps.py; echo "rc=$?"'
    # a 5 s cap (pytest's start can take 2 s on a loaded machine; plugins not loaded), test_sleeps sleeps 120 s
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=_env(tmp_path, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"),
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().endswith("rc=124"), r.stdout + r.stderr  # timeout's status: stopped at the cap
    text = log.read_text()
    assert "timeout -s INT" in text and "-rfEs" in text and "--durations=15" in text
    assert "test_sleeps.py::test_quick PASSED" in text
    assert re.search(r"!+ KeyboardInterrupt !+", text), text
    assert re.search(r"test_sleeps\.py:8: KeyboardInterrupt", text), text  # the line the test was at
    assert re.search(r"=+ 1 passed in [\d.]+s =+", text), text  # the summary of what ran
    assert "exit status 124" in text


def test_the_pytest_phases_of_both_scripts_run_under_timeout_s_int():
    scale, checks = SCALE.read_text(), CHECKS.read_text()
    assert re.search(r'timeout -s INT -k "\$KILL_AFTER" "\$cap"', scale)
    assert "pytest_capped \"$p\" \"$cap\" -m cuda tests/python/attribution/test_shared_prefix_flex.py" in scale
    assert re.search(r'timeout -s "\$sig" -k "\$kill_after"', checks)
    assert re.search(r"case \"\$name\" in pytest\|bench\|step\) sig=INT", checks)


# ---- a whole run, with stand-ins for the build, the interpreter and bench_scale.py ---------------------------------

FAKE_BENCH = """
import json, os, sys, time
a = sys.argv[1:]
def opt(name, default=None):
    return a[a.index(name) + 1] if name in a else default
shape, out, L = opt("--shape"), opt("--out"), opt("--length")
settings = a[a.index("--settings") + 1:]
settings = settings[:next((i for i, s in enumerate(settings) if s.startswith("--")), len(settings))]
nf = "_no_full_blocks" if "--no-full-blocks" in a else ""
name = os.path.join(out, f"time_{shape}_L{L}_cuda{nf}")
os.makedirs(out, exist_ok=True)
rows = []
for i, s in enumerate(settings):
    if i:
        time.sleep(float(os.environ.get("FAKE_SLEEP_" + shape.replace(".", "_").replace("-", "_"), "0.05")))
    rows.append({"shape": shape, "setting": s, "seconds": 1.0})
    print(json.dumps(rows[-1]), flush=True)
    with open(name + ".csv", "w") as f:  # each row as soon as its setting finishes (bench_scale.py --out)
        f.write("shape,setting,seconds\\n" + "".join(f"{r['shape']},{r['setting']},1.0\\n" for r in rows))
    with open(name + ".md", "w") as f:
        f.write("| shape | setting | seconds |\\n|---|---|---|\\n" + "".join(
            f"| {r['shape']} | {r['setting']} | 1.0 |\\n" for r in rows))
if "--profile" in a:
    for s in settings:
        with open(os.path.join(out, f"profile_{shape}_L{L}_{s}.txt"), "w") as f:
            f.write(f"# {s}: top kernels\\n")
"""


def _fake_warm(tmp_path) -> dict:
    """A build directory and unpacked packages as an earlier call on the same machine leaves them, with a stand-in
    cmake and a stand-in interpreter (bench_scale.py -> FAKE_BENCH; -c: the import check; -m pytest: a summary)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (tmp_path / "fake_bench.py").write_text(FAKE_BENCH)
    (bin_ / "cmake").write_text("#!/bin/bash\necho ninja: no work to do.\n")
    (bin_ / "python").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        case "$1" in
          -c) echo "oar 0 with CUDA kernels; torch (stand-in)" ;;
          -m) echo "tests/python/attribution/test_shared_prefix_flex.py::test_x PASSED"; echo "======== 3 passed in 0.10s ========" ;;
          *bench_scale.py) shift; exec {sys.executable} {tmp_path / 'fake_bench.py'} "$@" ;;
          *) exit 9 ;;
        esac
    """))
    for f in ("cmake", "python"):
        (bin_ / f).chmod(0o755)
    build = tmp_path / "build-gpu"
    build.mkdir(exist_ok=True)
    (build / "CMakeCache.txt").write_text(f"CMAKE_COMMAND:INTERNAL={bin_ / 'cmake'}\n"
                                          f"OAR_PYTHON_EXECUTABLE:UNINITIALIZED={bin_ / 'python'}\n")
    (tmp_path / "deps" / "usr").mkdir(parents=True, exist_ok=True)
    return dict(OAR_GPU_BUILD_DIR=str(build), SCALE_DEPS_PREFIX=str(tmp_path / "deps"))


def test_a_run_stops_skips_and_summarizes_each_phase(tmp_path):
    out = tmp_path / "out"
    # time7b writes its first row at once, then sleeps 2 s before each next one, under a 5 s cap: stopped after 1-3
    # of its 5 rows; ab's cap exceeds what is left, profile's does not
    env = _env(tmp_path, OUT=str(out), SCALE_BUDGET_S="30", FAKE_SLEEP_qwen2_5_7b="2",
               SCALE_CAPS="build=5 time1.5b=8 time7b=5 tests=5 ab=60 profile=5", **_fake_warm(tmp_path))
    r = subprocess.run([str(SCALE)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr  # a phase was stopped
    log = (out / "scale.log").read_text()
    assert log == r.stdout
    started = re.findall(r"phase (\S+): (?:cap|SKIPPED)", log)
    assert started == ORDER, log
    summary = log[log.index("summary (budget 30s"):]
    status = dict(re.findall(r"^  (\S+)\s+(ok|STOPPED at cap|SKIPPED|FAILED rc=\d+)\s", summary, re.M))
    assert status == {"build": "ok", "time1.5b": "ok", "time7b": "STOPPED at cap", "tests": "ok", "ab": "SKIPPED",
                      "profile": "ok"}, summary
    assert "(warm)" in log and "needs 60s" in summary and "3 passed" in summary
    assert 'SCALE_PHASES="ab"' in log  # the call that runs the skipped phase
    # the stopped phase kept the rows of the settings that finished, and Python's traceback of the SIGINT
    rows7 = (out / "time_qwen2.5-7b_L4096_cuda.csv").read_text().splitlines()[1:]
    assert 1 <= len(rows7) < 5 and rows7[0].endswith("dense,1.0"), rows7
    rows15 = (out / "time_qwen2.5-1.5b_L4096_cuda.csv").read_text().splitlines()[1:]
    assert [r.split(",")[1] for r in rows15] == ["dense", "grpo", "oar_g", "window_probe", "window",
                                                     "window_linear"]
    full = (out / "phases.log").read_text()
    assert "KeyboardInterrupt" in full and "Traceback (most recent call last)" in full
    assert "==== [time7b] exit status 124" in full
    assert (out / "profiles.txt").read_text().count("top kernels") == 2  # oar_g window_probe
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8  # what the device tool returns
