"""oar's log level (python/oar/_logging.py, oar/core/log.h): the C++ planners' chunk decisions at debug level on
stderr, the Python engines' path decisions on the "oar" logger, one switch for both (oar.set_log_level) and the
environment (OAR_LOG_LEVEL, read once at import); nothing printed at the default level."""

import logging
import os
import subprocess
import sys

import pytest
import torch

import oar
from oar import _C
from oar.attribution import oar_g_scores, oar_p_scores
from oar.attribution.context import ProbeContextBuilder

from test_probe_model import CONCLUDE, Toy, _rollouts, tiny  # noqa: F401  (the module fixture)

# One masked plan (2 + 3 variants of rollouts of widths 5 and 6: 5 x 6 x 100 + 5 x 10 B fit in 1 MiB, one chunk)
# and one prefix plan (columns 1, 2, 4 of width 6, waste 0.5: column 2 is within 0.5 x (6 - 1) of prefix 1, column 4
# is not, so two chunks with prefixes 1 and 4).
PLANS = ("oar._C.plan_masked_chunks([5, 6], [2, 3], 100, 10, 1 << 20, 0);"
         "oar._C.plan_prefix_chunks([1, 2, 4], 6, 100, 50, 10, 1 << 20, 0, 0.5)")
MASKED_LINE = ("[oar D] plan_masked_chunks: 5 variants of 2 rollouts -> 1 chunks, at most 5 variants per chunk, padded "
               "widths 6..6 tokens; budget 1048576 B, 100 B/token, 10 B/variant, variant cap 0 (0 = none)")
PREFIX_LINE = ("[oar D] plan_prefix_chunks: 3 variants, width 6 -> 2 chunks, at most 2 variants per chunk, prefix "
               "lengths 1..4 tokens; budget 1048576 B, 100 B/token, 50 B/cached token, 10 B/variant, variant cap 0 "
               "(0 = none), max_prefix_waste 0.500000")


def _run(code: str, level: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OAR_LOG_LEVEL"}
    if level is not None:
        env["OAR_LOG_LEVEL"] = level
    return subprocess.run([sys.executable, "-c", "import oar\n" + code], capture_output=True, text=True, env=env,
                          timeout=120)


def test_environment_sets_the_level_at_import():
    quiet = _run(PLANS + "; print(oar.log_level())", None)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.split() == ["warn"] and "[oar" not in quiet.stderr  # the default prints nothing
    loud = _run(PLANS + "; import logging; print(oar.log_level(), logging.getLogger('oar').level)", "debug")
    assert loud.returncode == 0, loud.stderr
    assert loud.stdout.split() == ["debug", str(logging.DEBUG)]  # both loggers
    lines = loud.stderr.splitlines()
    assert MASKED_LINE in lines and PREFIX_LINE in lines
    bad = _run("print(oar.log_level())", "chatty")
    assert bad.returncode == 0 and bad.stdout.split() == ["warn"]
    assert ('[oar W] OAR_LOG_LEVEL must be one of trace, debug, info, warn, error, off, got "chatty"; logging at warn'
            in bad.stderr.splitlines())


def test_set_log_level_switches_the_cpp_logger():
    out = _run("oar.set_log_level('debug');" + PLANS + ";import sys; sys.stderr.write('--\\n');"
               "oar.set_log_level('info');" + PLANS, None)
    assert out.returncode == 0, out.stderr
    before, after = out.stderr.split("--\n")
    assert MASKED_LINE in before.splitlines() and PREFIX_LINE in before.splitlines()
    assert "[oar" not in after  # debug lines are below info


@pytest.fixture
def restore_level():
    yield
    oar.set_log_level("warn")
    logging.getLogger("oar").setLevel(logging.NOTSET)


def test_set_log_level_sets_both_and_checks_the_name(restore_level):
    oar.set_log_level("debug")
    assert oar.log_level() == "debug" and logging.getLogger("oar").level == logging.DEBUG
    oar.set_log_level("off")
    assert oar.log_level() == "off" and not logging.getLogger("oar").isEnabledFor(logging.CRITICAL)
    assert _C.LOG_LEVELS == ("trace", "debug", "info", "warn", "error", "off")
    with pytest.raises(ValueError, match=r"level must be one of trace, debug, info, warn, error, off, got 'verbose'"):
        oar.set_log_level("verbose")
    with pytest.raises(ValueError, match=r"level must be one of .*, got 3"):
        oar.set_log_level(3)
    assert oar.log_level() == "off"  # unchanged by the refused calls


def test_engines_log_the_path_they_ran(tiny, caplog, restore_level):
    _, tok = tiny
    batch = ProbeContextBuilder(tok, CONCLUDE).build(*_rollouts(tok))
    oar.set_log_level("debug")
    with caplog.at_level(logging.DEBUG, logger="oar"):
        res = oar_p_scores(Toy(len(tok)), batch)
        oar_g_scores(Toy(len(tok)), batch, generator=torch.Generator().manual_seed(0))
    msgs = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "oar"]
    assert ("DEBUG", "oar_p_scores: engine batched (no prefix cache), 2 rows to score, budget 1024 MiB, max 0 "
                     "variants/chunk, shared-prefix attention off") in msgs
    info = [m for lvl, m in msgs if lvl == "INFO" and m.startswith("oar_p_scores: batched engine, 2 rows, ")]
    assert len(info) == 1 and f"{res.stats['variants']} variants in {res.stats['chunks']} chunks" in info[0]
    assert any(lvl == "DEBUG" and m.startswith("oar_g_scores: plain path (no differentiable prefix cache), 2 rows in ")
               for lvl, m in msgs)
    caplog.clear()
    oar.set_log_level("warn")
    with caplog.at_level(logging.NOTSET, logger="oar"):
        oar_p_scores(Toy(len(tok)), batch)
    assert not [r for r in caplog.records if r.name == "oar"]
