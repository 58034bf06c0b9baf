"""Every attribution setting's fidelity on every long trace with an exact reference, in one table (issue 41 item 4).

``bench_long.py`` writes one cache file per trace (exact token-level OAR-P block by block, each setting's scores and
token counts). This script reads the caches of one or more trace sets (for example SmolLM2-135M-Instruct's traces in
``docs/benchmarks/long`` and Qwen2.5-Coder-0.5B-Instruct's in ``docs/benchmarks/long_qwen05``) and writes, side by
side:

* per trace (rows) and setting (columns): Spearman rank correlation with exact OAR-P, over the positions that have an
  exact score (all of them, or every k-th when the cache was made with ``--exact-stride k``);
* per model and over all traces: mean and min Spearman, and the mean cost in forwards per row (tokens run / the
  row's probe-context length T, T = ``context_len`` - 2: the last answer token and the suffix are never run);
* paired comparisons of settings on the same trace and positions: the Spearman difference per trace with a 95%
  bootstrap interval over positions (2,000 resamples of the scored positions, both settings scored on the same
  resample), and how many traces lose more than 0.03 (issue 41's bar for keeping a tail out of the defaults).

Usage: python benchmarks/analysis/fidelity_table.py --set "SmolLM2-135M-Instruct:docs/benchmarks/long:\
benchmarks/data/long_traces.jsonl" --set "Qwen2.5-Coder-0.5B-Instruct:docs/benchmarks/long_qwen05:\
benchmarks/data/long_traces_qwen05.jsonl" [--out docs/benchmarks/long/fidelity_all.md]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import numpy as np

# bench_long is the driver that wrote the caches: its readers (traces, cache files, the exact reference's positions)
# are the ones this analysis uses. It lives in benchmarks/python.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import bench_long  # noqa: E402  (cache files, the exact reference and its positions)
from oar.app.stats import spearman_rows  # noqa: E402

COLUMNS = ["oar_g", "window4_probe", "window4_linear", "window4", "window8_probe", "window8_linear", "window8",
           "window32", "screen0.1", "span_line"]
PAIRS = [("window8_linear", "window8"), ("window4_linear", "window4"), ("window8_probe", "window8"),
         ("window8_linear", "window8_probe")]


def paired_diff(x: list[float], y: list[float], exact: list[float], draws: int = 2000,
                seed: int = 0) -> tuple[float, float, float]:
    """Spearman(x, exact) - Spearman(y, exact) and its 95% bootstrap interval over positions (percentiles of
    ``draws`` resamples with replacement, both settings on the same resample)."""
    x, y, e = (np.asarray(v, dtype=np.float64) for v in (x, y, exact))
    d = float(spearman_rows(x[None], e[None])[0] - spearman_rows(y[None], e[None])[0])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(e), size=(draws, len(e)))
    ds = spearman_rows(x[idx], e[idx]) - spearman_rows(y[idx], e[idx])
    lo, hi = np.nanpercentile(ds, [2.5, 97.5])
    return d, float(lo), float(hi)


def load_set(label: str, out_dir: str, traces_path: str) -> list[dict]:
    """One record per trace of the set that has a cache file with a finished exact reference."""
    from oar.app.stats import spearman

    recs = []
    for t in bench_long.load_traces(traces_path):
        path = os.path.join(out_dir, "cache", f"{t['id']}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            c = json.load(f)
        if c.get("key") != bench_long.trace_key(t):
            continue
        exact = bench_long.exact_scores(c)
        if exact is None:
            continue
        T = int(c["context_len"]) - 2
        rec = {"model": label, "trace": t["id"], "L": int(c["reasoning_len"]), "T": T,
               "stride": int(c.get("exact_stride", 1)), "truncated": bool(t.get("truncated")),
               "correct": bool(t.get("correct")), "spearman": {}, "forwards": {}, "paired": {}, "_scores": {}}
        for name, s in c["settings"].items():
            xs, ex = bench_long.paired(s["scores"], exact)
            rec["spearman"][name] = spearman(xs, ex)
            rec["_scores"][name] = xs
            if s.get("tokens") is not None:
                rec["forwards"][name] = s["tokens"] / T
        ex = [e for e in exact if e is not None]
        rec["positions"] = len(ex)
        for a, b in PAIRS:
            if a in rec["_scores"] and b in rec["_scores"]:
                rec["paired"][f"{a} - {b}"] = paired_diff(rec["_scores"][a], rec["_scores"][b], ex)
        del rec["_scores"]
        recs.append(rec)
    return recs


def _f(v, fmt=".3f") -> str:
    return "-" if v is None else format(v, fmt)


def write(recs: list[dict], out: str, command: str) -> None:
    cols = [c for c in COLUMNS if any(c in r["spearman"] for r in recs)]
    lines = ["# Fidelity of every setting on every long trace (issue 41 item 4)", "",
             f"Command: `{command}` (reads bench_long's cache files; nothing is re-run). Spearman vs exact token-level "
             "OAR-P (answer_mean probe) over the positions with an exact score (`stride` k: every k-th reasoning "
             "position). Traces marked `cut` were truncated at a newline near their length bucket; `ok` = the kept "
             "text earns the task's reward.", "",
             "| model | trace | L | exact positions (stride) | text | " + " | ".join(cols) + " |",
             "|---|---|---|---|---|" + "---|" * len(cols)]
    for r in recs:
        text = ("cut" if r["truncated"] else "whole") + (", ok" if r["correct"] else "")
        lines.append(f"| {r['model']} | {r['trace']} | {r['L']} | {r['positions']} ({r['stride']}) | {text} | "
                     + " | ".join(_f(r["spearman"].get(c)) for c in cols) + " |")
    lines += ["", "| traces | statistic | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    groups = [(m, [r for r in recs if r["model"] == m]) for m in dict.fromkeys(r["model"] for r in recs)]
    groups.append(("all", recs))
    rows_csv = []
    for m, g in groups:
        for stat in ("mean Spearman", "min Spearman", "mean forwards / row"):
            vals = []
            for c in cols:
                key = "forwards" if stat.startswith("mean forwards") else "spearman"
                xs = [r[key][c] for r in g if r[key].get(c) is not None]
                v = None if not xs else (min(xs) if stat.startswith("min") else sum(xs) / len(xs))
                vals.append(v)
                rows_csv.append({"traces": m, "statistic": stat, "setting": c, "value": v, "n": len(xs)})
            fmt = ".1f" if stat.startswith("mean forwards") else ".3f"
            lines.append(f"| {m} ({len(g)}) | {stat} | " + " | ".join(_f(v, fmt) for v in vals) + " |")
    lines += ["", "Paired on the same trace and positions: Spearman(A) - Spearman(B), 95% bootstrap interval over "
              "positions; the last column counts traces where A loses more than 0.03.", "",
              "| A - B | " + " | ".join(r["trace"] for r in recs) + " | mean | traces with A < B - 0.03 |",
              "|---|" + "---|" * (len(recs) + 2)]
    for a, b in PAIRS:
        key = f"{a} - {b}"
        ds = [r["paired"].get(key) for r in recs]
        have = [d for d in ds if d is not None]
        if not have:
            continue
        cells = ["-" if d is None else f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]" for d in ds]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {sum(d[0] for d in have) / len(have):+.3f} | "
                     f"{sum(d[0] < -0.03 for d in have)} of {len(have)} |")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(out[:-3] + ".csv" if out.endswith(".md") else out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["traces", "statistic", "setting", "value", "n"])
        w.writeheader()
        w.writerows(rows_csv)
    print("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append", required=True, metavar="LABEL:OUT_DIR:TRACES",
                   help="a model label, bench_long's --out folder (with cache/) and its traces JSONL")
    p.add_argument("--out", default="docs/benchmarks/long/fidelity_all.md")
    args = p.parse_args(argv)
    recs = []
    for s in args.set:
        parts = s.split(":")
        if len(parts) != 3:
            raise SystemExit(f"--set {s!r}: expected LABEL:OUT_DIR:TRACES")
        recs += load_set(*parts)
    if not recs:
        raise SystemExit("no trace of the given sets has a finished exact reference")
    write(recs, args.out, "python benchmarks/analysis/fidelity_table.py " + " ".join(
        f'--set "{s}"' for s in args.set) + (f" --out {args.out}" if args.out != p.get_default("out") else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
