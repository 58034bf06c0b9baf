"""The numbers docs/diagnose.md quotes are its stored runs' (issue 42: "every number recomputed from the stored
files"): each results table after a link to a run folder ``docs/diagnose/<run>/`` is checked cell by cell against
that folder's ``diagnose.json`` (to the decimals the table shows), and a folder written by version 2 of the
diagnostic is also recomputed from its published files alone (``summarize_stored``: ``batches.jsonl`` and
``diagnose.json``, no reference gradient and no sketches) and must give the stored summary."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "diagnose.md"
NUM = r"[+-]?\d+(?:\.\d+)?"


def _tables():
    """[(run folder, header cells, [row cells])]: the first table after each ``[diagnose/<run>/](...)`` link."""
    lines = DOC.read_text().splitlines()
    out, pending = [], None
    i = 0
    while i < len(lines):
        m = re.search(r"\[diagnose/([\w.-]+)/\]\(diagnose/\1/\)", lines[i])
        if m:
            pending = m.group(1)
        if pending and lines[i].startswith("| setting"):
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            rows = []
            i += 2  # the |---| line
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            out.append((pending, header, rows))
            pending = None
            continue
        i += 1
    return out


TABLES = _tables()


def _close(doc_text: str, value: float) -> None:
    """``doc_text`` (a number as printed) is ``value`` rounded to the printed decimals."""
    decimals = len(doc_text.split(".")[1]) if "." in doc_text else 0
    assert abs(float(doc_text) - value) <= 0.5 * 10 ** -decimals + 1e-12, (doc_text, value)


def _interval(cell: str, stat: dict) -> None:
    m = re.fullmatch(rf"\**({NUM}) \[({NUM}), ({NUM})\]\**", cell)
    assert m, cell
    for text, key in zip(m.groups(), ("mean", "lo", "hi")):
        _close(text, stat[key])


def test_every_run_folder_of_the_doc_has_a_table():
    runs = [t[0] for t in TABLES]
    assert len(runs) >= 3 and len(set(runs)) == len(runs), runs
    for run in runs:
        assert (ROOT / "docs" / "diagnose" / run / "diagnose.json").exists(), run


@pytest.mark.parametrize("run, header, rows", TABLES, ids=[t[0] for t in TABLES])
def test_doc_table_is_the_stored_summary(run, header, rows):
    stored = json.loads((ROOT / "docs" / "diagnose" / run / "diagnose.json").read_text())
    by = {r["method"]: r for r in stored["rows"]}
    assert [r[0] for r in rows] == [r["method"] for r in stored["rows"]]
    checked = 0
    for cells in rows:
        r = by[cells[0]]
        for name, cell in zip(header[1:], cells[1:]):
            if cell in ("(baseline)", "-"):
                continue
            if name.startswith("cos(u, g_ref)"):
                _interval(cell, r["cos_ci"])
            elif name.startswith("Δcos"):
                _interval(cell, r["dcos"])
            elif name.startswith("est. cos"):
                _close(cell, r["cos_true_est"])
            elif name == "sign-flip p":
                _close(cell, r["dcos_p_signflip"])
            elif name == "SNR":
                _close(re.match(NUM, cell).group(0), r["snr"])
            elif name == "ESS ratio":
                _close(cell, r["ess_ratio"])
            else:
                raise AssertionError(f"docs/diagnose.md table of {run}: column {name!r} has no check")
            checked += 1
    assert checked >= 3 * len(rows)


@pytest.mark.parametrize("run", sorted({t[0] for t in TABLES}))
def test_version_2_runs_recompute_from_their_published_files(run):
    from oar.app.diagnose import summarize_stored

    folder = ROOT / "docs" / "diagnose" / run
    stored = json.loads((folder / "diagnose.json").read_text())
    if "sketch_gram" not in stored:
        pytest.skip(f"docs/diagnose/{run} was written by version 1 (no fold or sketch Gram matrices stored)")
    assert json.dumps(summarize_stored(str(folder)), sort_keys=True) == json.dumps(stored, sort_keys=True)
