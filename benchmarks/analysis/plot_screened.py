"""Fidelity against cost of screened OAR-P as the screened fraction varies, with the window screen and the OAR-G
screen, and of windowed OAR-P alone (issue 13), from the outputs of ``bench_step.py`` (fixed shapes and the default
task: step / GRPO step against Spearman with exact OAR-P) and of ``oar eval-attribution`` (traces: seconds of the
model passes relative to exact OAR-P against Spearman).

Usage: python benchmarks/analysis/plot_screened.py --step docs/benchmarks/step_screened.json
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
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    ax = axes[0]
    for k, key in enumerate(sorted({(s["suite"], s["response_len"]) for s in summary})):
        rows = [s for s in summary if (s["suite"], s["response_len"]) == key and s["spearman_vs_exact"] != ""]
        if not rows:
            continue
        label = f"L={key[1]}" if key[0] == "fixed" else "default task"
        for prefix, style, what in (("oar_p_screen", "o-", "window screen"), ("oar_p_gscreen", "x--", "OAR-G screen")):
            curve = sorted((s for s in rows if s["provider"].startswith(prefix)), key=lambda s: s["ratio_to_grpo"])
            if curve:
                ax.plot([s["ratio_to_grpo"] for s in curve], [s["spearman_vs_exact"] for s in curve], style,
                        color=f"C{k}", label=f"screened, {what}, {label}")
        for s in rows:
            if s["provider"].startswith("oar_p_window"):
                ax.plot([s["ratio_to_grpo"]], [s["spearman_vs_exact"]], "d", color=f"C{k}", mfc="none")
                ax.annotate(f"W={s['provider'][len('oar_p_window'):]}", (s["ratio_to_grpo"], s["spearman_vs_exact"]),
                            fontsize=6, textcoords="offset points", xytext=(3, -8))
        g = next((s for s in rows if s["provider"] == "oar_g"), None)
        if g:
            ax.plot([g["ratio_to_grpo"]], [g["spearman_vs_exact"]], "s", color=f"C{k}", mfc="none",
                    label=f"OAR-G, {label}")
        ex = next((s for s in summary if (s["suite"], s["response_len"]) == key and s["provider"] == "oar_p"), None)
        if ex:
            ax.plot([ex["ratio_to_grpo"]], [1.0], "*", color=f"C{k}", ms=9, label=f"exact OAR-P, {label}")
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.axvline(1.5, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("step / GRPO step (log); diamonds: windowed OAR-P alone")
    ax.set_ylabel("Spearman with exact OAR-P")
    ax.set_title("bench_step.py: cost and rank fidelity", fontsize=9)
    ax.legend(fontsize=5.5)
    ax.grid(alpha=0.3)

    ax = axes[1]
    for k, path in enumerate(a.traces):
        with open(path) as f:
            fid = json.load(f).get("fidelity", [])
        for task in dict.fromkeys(r["task"] for r in fid):
            for prefix, style, what in (("oar_p_screen", "o-", "window screen"), ("oar_p_gscreen", "x--", "OAR-G screen")):
                rs = sorted((r for r in fid if r["task"] == task and r["method"].startswith(prefix)),
                            key=lambda r: r["seconds_vs_exact"])
                if rs:
                    ax.plot([r["seconds_vs_exact"] for r in rs], [r["spearman"] for r in rs], style, color=f"C{k}",
                            label=f"{task}: screened, {what}")
            for r in fid:
                if r["task"] == task and r["method"].startswith(("oar_p_window", "oar_g1/")):
                    ax.plot([r["seconds_vs_exact"]], [r["spearman"]], "d" if "window" in r["method"] else "s",
                            color=f"C{k}", mfc="none")
                    ax.annotate(r["method"].split("/")[0].replace("oar_p_window", "W="), (r["seconds_vs_exact"],
                                r["spearman"]), fontsize=6, textcoords="offset points", xytext=(3, -8))
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("model-pass seconds / exact OAR-P (diamonds: windowed; squares: OAR-G)")
    ax.set_ylabel("Spearman with exact OAR-P")
    ax.set_title("oar eval-attribution traces", fontsize=9)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
