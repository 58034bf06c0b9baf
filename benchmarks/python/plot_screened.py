"""Fidelity against cost of screened OAR-P as the screened fraction varies (issue 13), from the outputs of
``bench_step.py`` (fixed shapes and the default task: step / GRPO step against Spearman with exact OAR-P) and of
``oar eval-attribution`` (traces: cost of the model passes relative to exact OAR-P against Spearman and recall@10%).

Usage: python benchmarks/python/plot_screened.py --step docs/benchmarks/step_screened.json
           --traces docs/attribution_eval/arithmetic.json [...] --out docs/benchmarks/screened_fidelity_cost.png
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", required=True, help="bench_step.py JSON (with the fidelity columns)")
    p.add_argument("--traces", nargs="*", default=[], help="oar eval-attribution JSON files (with 'fidelity')")
    p.add_argument("--out", default="docs/benchmarks/screened_fidelity_cost.png")
    a = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(a.step) as f:
        summary = json.load(f)["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    ax = axes[0]
    for k, key in enumerate(sorted({(s["suite"], s["response_len"]) for s in summary})):
        rows = [s for s in summary if (s["suite"], s["response_len"]) == key and s["spearman_vs_exact"] != ""]
        screened = sorted((s for s in rows if s["provider"].startswith("oar_p_screen")), key=lambda s: s["ratio_to_grpo"])
        if not screened:
            continue
        label = f"{key[0]} L={key[1]}" if key[0] == "fixed" else "default task"
        ax.plot([s["ratio_to_grpo"] for s in screened], [s["spearman_vs_exact"] for s in screened], "o-",
                color=f"C{k}", label=f"screened OAR-P, {label}")
        for s in screened:
            ax.annotate(f"{s['masked_frac']:.2f}", (s["ratio_to_grpo"], s["spearman_vs_exact"]), fontsize=6,
                        textcoords="offset points", xytext=(3, 3))
        g = next((s for s in rows if s["provider"] == "oar_g"), None)
        if g:
            ax.plot([g["ratio_to_grpo"]], [g["spearman_vs_exact"]], "s", color=f"C{k}", mfc="none",
                    label=f"OAR-G (the screen), {label}")
        ex = next((s for s in summary if (s["suite"], s["response_len"]) == key and s["provider"] == "oar_p"), None)
        if ex:
            ax.plot([ex["ratio_to_grpo"]], [1.0], "*", color=f"C{k}", ms=9, label=f"exact OAR-P, {label}")
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.axvline(1.5, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("step / GRPO step (log; labels: share of tokens masked)")
    ax.set_ylabel("Spearman with exact OAR-P")
    ax.set_title("bench_step.py: cost and rank fidelity", fontsize=9)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)

    ax = axes[1]
    for k, path in enumerate(a.traces):
        with open(path) as f:
            fid = json.load(f).get("fidelity", [])
        for task in dict.fromkeys(r["task"] for r in fid):
            rs = sorted((r for r in fid if r["task"] == task and r["method"].startswith("oar_p_screen")),
                        key=lambda r: r["tokens_vs_exact"])
            ax.plot([r["tokens_vs_exact"] for r in rs], [r["spearman"] for r in rs], "o-", color=f"C{k}",
                    label=f"{task}: Spearman")
            ax.plot([r["tokens_vs_exact"] for r in rs], [r["recall10_minus_exact"] for r in rs], "^--",
                    color=f"C{k}", label=f"{task}: recall@10% - exact's")
            g = next((r for r in fid if r["task"] == task and r["method"] == "oar_g1/answer_mean"), None)
            if g:
                ax.plot([g["tokens_vs_exact"]], [g["spearman"]], "s", color=f"C{k}", mfc="none",
                        label=f"{task}: OAR-G (the screen)")
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.axhline(-0.02, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("token-forwards relative to exact OAR-P")
    ax.set_ylabel("Spearman / recall difference")
    ax.set_title("oar eval-attribution traces", fontsize=9)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
