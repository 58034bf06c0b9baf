"""Wall time of the linear tail (config ``screen_tail: linear``) beside the window engine's tails, on one long trace.

Runs, in rounds (every setting once per round, so a slower phase of a shared machine hits all alike), on one trace of
``benchmarks/data/long_traces.jsonl`` with SmolLM2-135M-Instruct at one thread:

* ``linear``: ``oar_p_linear_tail_scores`` of this tree,
* ``linear@REV`` (``--old-rev REV``): the same function as ``python/oar/attribution/linear_tail.py`` was at git
  revision REV (the before of a change; loaded from ``git show``),
* ``probe`` / ``conclude``: ``oar_p_window_scores(rerun_tail=...)``,

and prints each setting's median seconds over the rounds, its token-columns (``cost_tokens``, else ``tokens``) and,
for ``linear@REV``, the largest score difference to ``linear``.

Usage:  PYTHONPATH=python OAR_BUILD_DIR=build python benchmarks/python/time_linear_tail.py [--id gsm8k-1030-s0]
            [--window 8] [--rounds 3] [--old-rev 934c8de] [--tails probe]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_long  # noqa: E402


def _old_linear(rev: str):
    """``oar_p_linear_tail_scores`` of linear_tail.py at git revision ``rev`` (a module of its own)."""
    src = subprocess.run(["git", "show", f"{rev}:python/oar/attribution/linear_tail.py"], check=True,
                         capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "linear_tail_old.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("linear_tail_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["linear_tail_old"] = mod  # dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod.oar_p_linear_tail_scores


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", default="benchmarks/data/long_traces.jsonl")
    p.add_argument("--id", default="gsm8k-1030-s0")
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--old-rev", default=None, help="also time linear_tail.py as it was at this git revision")
    p.add_argument("--tails", nargs="*", default=["probe"], choices=["probe", "conclude"])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from oar.app.models import load_by_name
    from oar.attribution import HFProbeModel, oar_p_linear_tail_scores, oar_p_window_scores

    model, tok = load_by_name("smollm2-135m-instruct", fresh=False)
    pm = HFProbeModel(model)
    trace = {t["id"]: t for t in bench_long.load_traces(args.traces)}[args.id]
    batch = bench_long.build_batch(tok, trace)
    W, probe = args.window, bench_long.PROBE
    runs = {"linear": lambda: oar_p_linear_tail_scores(pm, batch, window=W, probe=probe)}
    if args.old_rev:
        old = _old_linear(args.old_rev)
        runs[f"linear@{args.old_rev}"] = lambda: old(pm, batch, window=W, probe=probe)
    for tail in args.tails:
        runs[tail] = (lambda t: lambda: oar_p_window_scores(pm, batch, window=W, probe=probe, memory_budget_mb=2048,
                                                            rerun_tail=t))(tail)
    secs = {k: [] for k in runs}
    last = {}
    for r in range(args.rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            with pm.eval_mode():
                last[name] = fn()
            secs[name].append(time.perf_counter() - t0)
            print(f"round {r} {name} {secs[name][-1]:.1f} s", flush=True)
    L = int(batch.reasoning_len[0])
    out = {"trace": args.id, "L": L, "T": int(batch.probe_view().input_ids.shape[1]), "window": W, "settings": {}}
    for name, res in last.items():
        st = res.stats
        row = {"median_s": round(statistics.median(secs[name]), 2), "seconds": [round(x, 2) for x in secs[name]],
               "token_columns": int(st.get("cost_tokens", st["tokens"]))}
        if name.startswith("linear@"):
            row["max_abs_diff_to_linear"] = float((res.scores[0, :L] - last["linear"].scores[0, :L]).abs().max())
        out["settings"][name] = row
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
