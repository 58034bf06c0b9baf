"""Held-out accuracy per cluster (the arithmetic task's fact) before and after training, for every run of one or
more ``oar compare`` sweeps (issue 25: which facts a run's gain or loss comes from).

A fact's problems are mostly answered alike, so a run's held-out accuracy moves in steps of whole facts; this table
shows which ones. Reads each sweep's ``grid.json`` (the task, to rebuild the facts:
``oar.app.compare_report.problem_clusters``) and its finished runs' ``results/*.json`` (what ``oar compare`` keeps of a run
once it finished, and what a copied sweep without its ``runs/`` folder still has); runs nothing.

Usage: python benchmarks/analysis/per_fact.py SWEEP [SWEEP ...] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict


def _runs(sweep: str) -> list[tuple[str, dict]]:
    from oar.app.compare_report import load_results, run_name

    out = []
    for r in load_results(sweep):
        held = r.get("heldout")
        if held and held.get("correct_before") and held.get("correct_after"):
            out.append((f"{os.path.basename(sweep.rstrip(os.sep))}/{run_name(r['method'], r['seed'])}", held))
    return out


def per_fact_table(sweeps: list[str]) -> str:
    """Markdown: one row per cluster (problems, accuracy before, after per run), one column per finished run; then
    the accuracy over all problems, and the mean of the clusters' accuracies (each fact weighted equally).

    Raises:
        SystemExit: a sweep with no finished run, runs of different held-out problems, or a task whose clusters
            cannot be rebuilt.
    """
    from oar.app.compare_report import problem_clusters

    columns, ids, labels = [], None, None
    for sweep in sweeps:
        runs = _runs(sweep)
        if not runs:
            sys.exit(f"per_fact: {sweep!r} has no finished run (results/*.json with held-out results)")
        for name, held in runs:
            if ids is None:
                ids = held["problem_ids"]
                labels = problem_clusters(sweep, ids)
                if labels is None:
                    sys.exit(f"per_fact: the clusters of {sweep!r}'s held-out problems cannot be rebuilt")
                columns.append(("before", held["correct_before"]))
            elif held["problem_ids"] != ids:
                sys.exit(f"per_fact: {name} was evaluated on other held-out problems than the first run")
            columns.append((name, held["correct_after"]))
    rows: dict[str, list[int]] = defaultdict(list)
    for k, label in enumerate(labels):
        rows[label].append(k)
    lines = ["| fact | problems | " + " | ".join(c for c, _ in columns) + " |",
             "|---|---:|" + "---:|" * len(columns)]
    for label in sorted(rows):
        idx = rows[label]
        cells = [f"{sum(v[i] for i in idx) / len(idx):.2f}" for _, v in columns]
        lines.append(f"| `{label}` | {len(idx)} | " + " | ".join(cells) + " |")
    total = [f"{sum(v) / len(v):.3f}" for _, v in columns]
    lines.append(f"| all | {len(ids)} | " + " | ".join(total) + " |")
    # Each fact weighted equally: a fact drawn 25 times no longer counts 8x one drawn 3 times.
    equal = [f"{sum(sum(v[i] for i in idx) / len(idx) for idx in rows.values()) / len(rows):.3f}" for _, v in columns]
    lines.append(f"| facts, equally weighted | {len(rows)} | " + " | ".join(equal) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", nargs="+", help="oar compare sweep folders (same held-out problems)")
    ap.add_argument("--out", help="also write the table to this Markdown file")
    args = ap.parse_args(argv)
    table = per_fact_table(args.sweeps)
    print(table, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
