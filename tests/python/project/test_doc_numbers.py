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

from _paths import ROOT

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
            elif name == "SNR [95% CI]":  # version 2: the SNR's jackknife interval
                _interval(cell, r["snr_ci"])
            elif name == "cross-batch cos":
                _close(cell, r["cross_batch_cos"])
            elif name == "cost / step":
                _close(cell, r["cost_ratio"])
            elif name == "break-even Δcos":
                _close(cell, r["break_even_dcos"])
            elif name == "Δreward (1 step)":
                _interval(cell, r["dreward"])
            elif name == "ESS ratio":
                _close(cell, r["ess_ratio"])
            else:
                raise AssertionError(f"docs/diagnose.md table of {run}: column {name!r} has no check")
            checked += 1
    assert checked >= 3 * len(rows)


@pytest.mark.parametrize("run", sorted({t[0] for t in TABLES}))
def test_version_2_runs_recompute_from_their_published_files(run):
    from oar.app.diagnose_report import summarize_stored

    folder = ROOT / "docs" / "diagnose" / run
    stored = json.loads((folder / "diagnose.json").read_text())
    if "sketch_gram" not in stored:
        pytest.skip(f"docs/diagnose/{run} was written by version 1 (no fold or sketch Gram matrices stored)")
    _same(json.loads(json.dumps(summarize_stored(str(folder)))), stored, run)


def _same(got, want, where: str) -> None:
    """Equal structures; floats within 1e-9 relative (the Student-t quantiles are numerical integrals: a change of
    their quadrature moves the last digits of every interval)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: length"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15), where
    else:
        assert got == want, where


# ---- docs/compare.md ---------------------------------------------------------------------------------------------

COMPARE = ROOT / "docs" / "compare.md"


def _table(doc: Path, header_start: str):
    """(header cells, [row cells]) of the one table of ``doc`` whose header line starts with ``header_start``."""
    lines = doc.read_text().splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith(header_start)]
    assert len(starts) == 1, (header_start, starts)
    i = starts[0]
    header = [c.strip() for c in lines[i].strip("|").split("|")]
    rows = []
    for ln in lines[i + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip().strip("*") for c in ln.strip("|").split("|")])
    return header, rows


def test_compare_cpu_table_is_the_stored_sweep():
    """The 20-run table of docs/compare.md: per-seed accuracies, means and intervals (points = x 100), from
    docs/compare/compare_cpu/compare.json."""
    stored = json.loads((ROOT / "docs" / "compare" / "compare_cpu" / "compare.json").read_text())["methods"]
    header, rows = _table(COMPARE, "| method | seed 0 |")
    assert [r[0] for r in rows] == list(stored)
    pts = lambda st: {k: 100 * st[k] for k in ("mean", "lo", "hi")}  # noqa: E731
    for cells in rows:
        m = stored[cells[0]]
        for k, cell in enumerate(cells[1:6]):
            _close(cell, m["heldout_after_per_seed"][k])
        _interval(cells[6], pts(m["heldout_after"]))
        if cells[7] == "(baseline)":
            continue
        _interval(cells[7], pts(m["paired_vs_grpo"]["interval"]))
        _close(cells[8], m["paired_vs_grpo"]["sign_flip_p"])
        _interval(cells[9], pts(m["diff_vs_grpo"]))


def test_main_job_seed_table_is_the_stored_runs():
    """The main job's fifteen OAR-G runs (docs/compare.md): held-out accuracy after, the gain over before (its mean;
    the interval resamples facts, docs/compare/default_per_fact.md), the median step and peak memory, from each
    run's results/oar_g-s<seed>.json."""
    import statistics

    header, rows = _table(COMPARE, "| seed | precision | after |")
    folder = {"bf16-autocast": "default_bf16", "float32": "default_fp32"}
    assert len(rows) == 15
    for seed, precision, after, gain, step, peak in rows:
        run = json.loads((ROOT / "docs" / "compare" / folder[precision] / "results" / f"oar_g-s{seed}.json").read_text())
        held = run["heldout"]
        _close(after, held["after"])
        _close(gain.split(" [")[0], held["after"] - held["before"])
        _close(step, statistics.median(s["step_time"] for s in run["train"]))
        _close(peak, run["peak_rss_mb"] / 1024)


def test_main_job_mean_gains_are_the_stored_runs():
    """The prose under the seed table: mean gains over the fifteen runs and per precision, t intervals over runs."""
    from oar.app.stats import paired_t

    def gains(folder, n):
        out = []
        for s in range(n):
            h = json.loads((ROOT / "docs" / "compare" / folder / "results" / f"oar_g-s{s}.json").read_text())["heldout"]
            out.append(h["after"] - h["before"])
        return out

    bf, fp = gains("default_bf16", 5), gains("default_fp32", 10)
    text = " ".join(COMPARE.read_text().split())  # the prose with its line breaks undone
    iv = rf"({NUM}) \[({NUM}), ({NUM})\]"
    claims = {rf"the mean gain is ({NUM}) \(t interval over runs \[({NUM}), ({NUM})\]\)": bf + fp,
              rf"bf16 {iv} \(5 seeds\)": bf, rf"float32 {iv} \(10 seeds;": fp,
              rf"seeds 0-4 alone had {iv}": fp[:5], rf"seeds 5-9 {iv}\)": fp[5:]}
    for pattern, xs in claims.items():
        m = re.search(pattern, text)
        assert m, pattern
        want = paired_t(xs).as_dict()
        for got, key in zip(m.groups(), ("mean", "lo", "hi")):
            _close(got, want[key])


def test_readme_main_job_numbers_are_the_stored_runs():
    """README's paragraph on the fifteen runs: each gain, their range, mean and t intervals, and the quoted line of
    seed 0 with bf16 autocast."""
    from oar.app.stats import paired_t

    runs = {fol: [json.loads((ROOT / "docs" / "compare" / fol / "results" / f"oar_g-s{s}.json").read_text())["heldout"]
                  for s in range(n)] for fol, n in (("default_bf16", 5), ("default_fp32", 10))}
    bf = [h["after"] - h["before"] for h in runs["default_bf16"]]
    fp = [h["after"] - h["before"] for h in runs["default_fp32"]]
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(rf"the gain was ({NUM}) to ({NUM}) \(bf16: ([^;]+); float32: ([^;]+); mean ({NUM}), t interval over "
                  rf"the runs \[({NUM}), ({NUM})\]; bf16 \[({NUM}), ({NUM})\], float32 \[({NUM}), ({NUM})\]\)", text)
    assert m, "README's sentence on the fifteen runs"
    lo, hi, bf_txt, fp_txt, mean, tlo, thi, blo, bhi, flo, fhi = m.groups()
    _close(lo, min(bf + fp)), _close(hi, max(bf + fp))
    for txt, xs in ((bf_txt, bf), (fp_txt, fp)):
        cells = txt.split(", ")
        assert len(cells) == len(xs)
        for c, x in zip(cells, xs):
            _close(c, x)
    t_all, t_bf, t_fp = (paired_t(x).as_dict() for x in (bf + fp, bf, fp))
    for got, want in ((mean, t_all["mean"]), (tlo, t_all["lo"]), (thi, t_all["hi"]), (blo, t_bf["lo"]),
                      (bhi, t_bf["hi"]), (flo, t_fp["lo"]), (fhi, t_fp["hi"])):
        _close(got, want)
    h0 = runs["default_bf16"][0]
    assert f"before {h0['before']:.3f} -> after {h0['after']:.3f}; gain {h0['after'] - h0['before']:+.3f}" in text
