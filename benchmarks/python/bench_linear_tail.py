"""The linearized tail of windowed OAR-P (issue 41 item 3; config `screen_tail: linear`) against the exact reference.

On the long real traces that have an exact token-level OAR-P reference in ``docs/benchmarks/long/cache/`` (written by
``bench_long.py``), for W = 4 and 8: Spearman against exact OAR-P, tokens run, forwards per row (tokens / T, T = the
row's context length after ``probe_view``) and seconds of

* ``probe``: ``oar_p_window_scores(rerun_tail="probe")`` (re-runs the probe window),
* ``conclude``: ``oar_p_window_scores(rerun_tail="conclude")`` (re-runs conclude + probe window, the default),
* ``linear``: ``oar.attribution.linear_tail.oar_p_linear_tail_scores`` (no tail re-run; its backward passes are
  counted as 2 token-columns of the tail each: ``cost_tokens``).

The probe / conclude rows are taken from bench_long's cache files (scores, tokens and seconds of its own run, same
engine, same machine class) unless ``--rerun`` names them; rows re-run here say so. Results go to
``--results`` (JSON, resumable) and ``OUT/linear_tail.md``.

Usage: PYTHONPATH=python OMP_NUM_THREADS=1 python benchmarks/python/bench_linear_tail.py [--ids ...] [--windows 4 8]
           [--rerun probe conclude] [--top-r 32] [--out docs/benchmarks/long]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_long  # noqa: E402  (loading, caches and the exact reference of the long benchmark)

NOTES = "<!-- notes: kept across reruns -->"
HEADER = """# Windowed OAR-P with a linearized tail (issue 41 item 3; config `screen_tail: linear`)

`oar.attribution.linear_tail.oar_p_linear_tail_scores`: the masked token and its W followers are re-run exactly on
the clean prefix (as `oar_p_window_scores`); the tail (conclude string + probe window) is not re-run. Per layer, the
tail's attention output is re-normalized exactly at its clean queries over the window's new keys/values; a Jacobian
taken once per row through the clean tail (R = top_r + 1 backward passes: log-probabilities of the top-r vocabulary
cells of the clean answer_mean distribution and of the rest) maps those changes to the probe, and the score is the
KL over the cells. Variants whose window reaches the tail re-run it exactly. Cost is counted in token-columns:
tokens run forward + 2 x n_tail per backward pass (`cost_tokens`); "forwards / row" = cost / T; "x probe tail" =
cost / the probe-window tail's tokens. Exact reference: bench_long's token-level OAR-P (docs/benchmarks/long/cache).

"""

IDS = ["gsm8k-331-s0", "gsm8k-1030-s0", "gsm8k-690-s0", "math500-454-s0"]


def run_setting(pm, batch, kind: str, w: int, top_r: int, exact_reach: bool):
    from oar.attribution import oar_p_window_scores
    from oar.attribution.linear_tail import oar_p_linear_tail_scores

    t0 = time.perf_counter()
    with pm.eval_mode():
        if kind == "linear":
            a = oar_p_linear_tail_scores(pm, batch, window=w, probe=bench_long.PROBE, top_r=top_r,
                                         exact_reach=exact_reach)
        else:
            a = oar_p_window_scores(pm, batch, window=w, probe=bench_long.PROBE, memory_budget_mb=2048,
                                    rerun_tail=kind)
    dt = time.perf_counter() - t0
    L = int(batch.reasoning_len[0])
    rec = {"scores": bench_long._round(a.scores[0, :L].tolist()), "seconds": dt, "tokens": int(a.stats["tokens"]),
           "cost_tokens": int(a.stats.get("cost_tokens", a.stats["tokens"])), "source": "this run"}
    for k in ("backward_passes", "backward_tokens", "linearized"):
        if k in a.stats:
            rec[k] = int(a.stats[k])
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", default="benchmarks/data/long_traces.jsonl")
    p.add_argument("--ids", nargs="+", default=IDS)
    p.add_argument("--windows", nargs="+", type=int, default=[4, 8])
    p.add_argument("--rerun", nargs="*", default=[], choices=["probe", "conclude"],
                   help="window tails to run here instead of taking bench_long's cached run")
    p.add_argument("--top-r", type=int, default=32)
    p.add_argument("--no-exact-reach", dest="exact_reach", action="store_false")
    p.add_argument("--tag", default="linear", help="name of the linear rows (e.g. linear_r8)")
    p.add_argument("--out", default="docs/benchmarks/long", help="where cache/ (bench_long's) is and the table goes")
    p.add_argument("--cache-dir", default="docs/benchmarks/long/cache", help="bench_long's cache files")
    p.add_argument("--results", default="/tmp/oar_linear_tail.json", help="this benchmark's own results (resumable)")
    p.add_argument("--tables-only", action="store_true")
    p.add_argument("--max-minutes", type=float, default=60.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    res_path = args.results
    res = json.load(open(res_path)) if os.path.exists(res_path) else {}
    traces = {t["id"]: t for t in bench_long.load_traces(args.traces)}
    if not args.tables_only:
        from oar.app.models import load_by_name
        from oar.attribution import HFProbeModel

        model, tok = load_by_name("smollm2-135m-instruct", fresh=False)
        pm = HFProbeModel(model)
        t_start = time.perf_counter()
        for tid in args.ids:
            tr = traces[tid]
            cache = bench_long.load_cache(os.path.join(args.cache_dir, f"{tid}.json"), tr)
            batch = bench_long.build_batch(tok, tr)
            T = int(batch.probe_view().input_ids.shape[1])
            rt = res.setdefault(tid, {"T": T, "L": int(batch.reasoning_len[0]), "settings": {}})
            for w in args.windows:
                for kind in ("probe", "conclude"):
                    name = f"window{w}_{kind}"
                    if name in rt["settings"] and (kind not in args.rerun or rt["settings"][name]["source"] ==
                                                   "this run"):
                        continue
                    cached = cache["settings"].get(f"window{w}" + ("_probe" if kind == "probe" else ""))
                    if kind not in args.rerun and cached is not None:
                        rt["settings"][name] = {"scores": cached["scores"], "seconds": min(cached["seconds"]),
                                                "tokens": cached["tokens"], "cost_tokens": cached["tokens"],
                                                "source": "bench_long cache"}
                    elif (time.perf_counter() - t_start) / 60 < args.max_minutes:
                        rt["settings"][name] = run_setting(pm, batch, kind, w, args.top_r, args.exact_reach)
                        print(tid, name, rt["settings"][name]["seconds"], flush=True)
                name = f"window{w}_{args.tag}"
                if name not in rt["settings"] and (time.perf_counter() - t_start) / 60 < args.max_minutes:
                    rec = run_setting(pm, batch, "linear", w, args.top_r, args.exact_reach)
                    rec.update(top_r=args.top_r, exact_reach=args.exact_reach)
                    rt["settings"][name] = rec
                    print(tid, name, rec["seconds"], rec["cost_tokens"], flush=True)
                with open(res_path, "w") as f:
                    json.dump(res, f)
    write_table(res, args, traces)
    return 0


def write_table(res: dict, args, traces) -> None:
    from oar.app.stats import spearman

    lines = [f"Model smollm2-135m-instruct, probe {bench_long.PROBE}, CPU, 1 thread, torch {torch.__version__}, "
             f"{platform.machine()}; a machine shared with other jobs (seconds are noisy; tokens are exact).", "",
             "Command: `PYTHONPATH=python OAR_BUILD_DIR=build OMP_NUM_THREADS=1 .venv/bin/python "
             "benchmarks/python/bench_linear_tail.py " + " ".join(sys.argv[1:]) + "`", "",
             "| trace | L | T | setting | Spearman vs exact | tokens run | + backward (2 x tail each) | forwards / row "
             "(cost / T) | x probe tail | seconds | source |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    summary: dict = {}
    for tid, rt in res.items():
        cache = json.load(open(os.path.join(args.cache_dir, f"{tid}.json")))
        exact = bench_long.exact_scores(cache)
        for name in sorted(rt["settings"], key=lambda s: (int(s.split("_")[0][6:]), s)):
            rec = rt["settings"][name]
            sp = spearman(rec["scores"], exact) if exact else None
            w = name.split("_")[0]
            base = rt["settings"].get(f"{w}_probe")
            ratio = rec["cost_tokens"] / base["cost_tokens"] if base else None
            summary.setdefault(name, []).append((sp, rec["cost_tokens"] / rt["T"], ratio))
            lines.append(f"| {tid} | {rt['L']} | {rt['T']} | {name} | {sp:.3f} | {rec['tokens']} | "
                         f"{rec.get('backward_tokens', 0)} | {rec['cost_tokens'] / rt['T']:.2f} | "
                         f"{ratio:.2f} | {rec['seconds']:.1f} | {rec['source']} |")
    lines += ["", "| setting | traces | mean Spearman | min Spearman | mean forwards / row | mean x probe tail |",
              "|---|---|---|---|---|---|"]
    for name, xs in sorted(summary.items(), key=lambda kv: (int(kv[0].split("_")[0][6:]), kv[0])):
        sps = [x[0] for x in xs if x[0] is not None]
        lines.append(f"| {name} | {len(xs)} | {sum(sps) / len(sps):.3f} | {min(sps):.3f} | "
                     f"{sum(x[1] for x in xs) / len(xs):.2f} | {sum(x[2] for x in xs) / len(xs):.2f} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "linear_tail.md")
    notes = ""
    if os.path.exists(path):  # hand-written findings below the marker survive a rerun
        old = open(path).read()
        if NOTES in old:
            notes = old[old.index(NOTES):]
    with open(path, "w") as f:
        f.write(HEADER + "\n".join(lines) + "\n\n" + (notes or NOTES + "\n"))
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
