"""``oar diagnose``'s statistics and report (docs/diagnose.md): the per-setting summary over finished batches
(cosines with the reference gradient and their paired differences, intervals with the reference's noise, SNR from
the sketches' Gram matrices, break-even margins), the report files, and the summary recomputed from the files a
published run keeps (:func:`summarize_stored`). The command itself, which produces the batches, is
:mod:`oar.app.diagnose`.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from oar.app.runtime import write_json_atomic

__all__ = ["leave_one_fold_out", "snr_from_sketches", "snr_from_gram", "summarize", "summarize_stored", "write_report"]


def leave_one_fold_out(ref: dict) -> tuple[np.ndarray, np.ndarray]:
    """Weights and norms of the reference without fold c: g_(-c) = sum_{c' != c} w[c, c'] g_c' (F, F) and
    |g_(-c)| (F,), from the folds' Gram matrix (no parameter-sized work)."""
    n = np.asarray(ref["fold_rollouts"], dtype=np.float64)
    G = np.asarray(ref["gram"], dtype=np.float64)
    F = n.size
    w = np.tile(n, (F, 1))
    np.fill_diagonal(w, 0.0)
    w /= w.sum(1, keepdims=True)
    norms = np.sqrt(np.maximum(0.0, np.einsum("ca,ab,cb->c", w, G, w)))
    return w, norms



def _load_batches(out_dir: str) -> dict:
    path = os.path.join(out_dir, "batches.jsonl")
    done = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill: that batch runs again
                    continue
                if os.path.exists(os.path.join(out_dir, "sketches", f"batch_{rec['batch']:04d}.pt")):
                    done[int(rec["batch"])] = rec
    return done


def snr_from_sketches(sketches: np.ndarray, sq_norms: np.ndarray) -> tuple[float, float]:
    """Signal-to-noise ratio of B update directions: |E u|^2 / E|u - E u|^2.

    |E u|^2 is estimated without bias from the cross products of different batches (sketched:
    (|sum S_b|^2 - sum |S_b|^2) / (B (B - 1))), E|u|^2 from the exact squared norms.

    Args:
        sketches: (B, dim) count sketches of the updates; sq_norms: (B,) their exact squared norms.

    Returns:
        ``(snr, mean cosine between different batches' updates)``; the SNR is NaN-free (0 when the signal estimate
        is <= 0).
    """
    S = sketches.astype(np.float64)
    return snr_from_gram(S @ S.T, sq_norms)


def snr_from_gram(gram: np.ndarray, sq_norms: np.ndarray) -> tuple[float, float]:
    """:func:`snr_from_sketches` from the (B, B) Gram matrix of the B sketches (float64), which is all it reads: the
    off-diagonal sum is B (B - 1) times the cross-product estimate of |E u|^2. ``diagnose.json`` keeps it per setting
    (``sketch_gram``), so the SNR and its jackknife are recomputed from the stored files without the sketches."""
    G = np.asarray(gram, dtype=np.float64)
    B = G.shape[0]
    cross = (G.sum() - np.trace(G)) / (B * (B - 1))
    mean_sq = float(np.mean(sq_norms))
    noise = mean_sq - cross
    snr = max(0.0, cross) / noise if noise > 0 else 0.0
    return float(snr), float(cross / mean_sq) if mean_sq > 0 else 0.0


def summarize(done: dict, ref: dict, labels: list, out_dir: str, *, step_norm: float, base_reward,
              n_params: int, grams: dict | None = None, margins: dict | None = None) -> dict:
    """Per-setting statistics over the finished batches (the paired differences against ``labels[0]``).

    Intervals of cos and Δcos carry both noises: the batches' (t over batches) and the reference's (jackknife over
    its folds: each batch's cosine recomputed against the reference without fold c, from the stored <u, g_c>);
    :func:`oar.app.stats.t_with_reference`. The SNR's interval is a jackknife over batches. ``grams``: the sketches'
    Gram matrices ``{"batches": [...], "gram": {label: (B, B)}}`` as the summary stores them (``sketch_gram``);
    None computes them from ``out_dir/sketches``. ``margins``: pre-declared ``{label: Δcos margin}``, each tested
    (``margin``, ``dcos_minus_margin`` interval, one-sided ``margin_p``)."""
    from oar.app.stats import (break_even_dcos, jackknife_se, margin_pvalue, paired_t, sign_flip_pvalue, t_quantile,
                               t_with_reference)

    w_loo, n_loo = leave_one_fold_out(ref)

    def cos_loo(lab: str) -> np.ndarray:
        """(B, F): each batch's cosine with the reference without fold c."""
        out = np.zeros((len(bs), len(n_loo)))
        for i, b in enumerate(bs):
            m = done[b]["methods"][lab]
            if m["norm"] > 0:
                out[i] = (w_loo @ np.asarray(m["fold_dots"])) / (m["norm"] * np.maximum(n_loo, 1e-30))
        return out

    # batches where no group has reward signal (every sequence advantage 0) give every setting u = 0: they say
    # nothing about credit and are counted apart, not averaged in as cos = 0
    bs = sorted(b for b in done if done[b].get("signal", done[b].get("active_rows", 1) > 0))
    silent = len(done) - len(bs)
    if grams is None:
        grams = {"batches": bs, "gram": {}}
        if len(bs) >= 2:
            for lab in labels:
                sk = np.stack([torch.load(os.path.join(out_dir, "sketches", f"batch_{b:04d}.pt"))[lab].numpy()
                               for b in bs]).astype(np.float64)
                grams["gram"][lab] = (sk @ sk.T).tolist()
    elif list(grams["batches"]) != bs:
        raise ValueError(f"grams: the Gram matrices are of batches {list(grams['batches'])[:8]}..., the batches with "
                         f"signal are {bs[:8]}...")
    base = labels[0]
    rows = []
    att = ref.get("attenuation")
    for lab in labels:
        cos = np.array([done[b]["methods"][lab]["cos"] for b in bs])
        row = {"method": lab, "batches": len(bs), "batches_without_signal": silent,
               "cos": float(cos.mean()) if len(bs) else None}
        if len(bs) >= 2:
            loo = cos_loo(lab)
            row["cos_ci"] = t_with_reference(cos, loo.mean(0)).as_dict()
            row["cos_ci_batches_only"] = paired_t(cos).as_dict()
            row["cos_true_est"] = float(cos.mean() / att) if att else None
            G = np.asarray(grams["gram"][lab], dtype=np.float64)
            sq = np.array([done[b]["methods"][lab]["norm"] ** 2 for b in bs])
            row["snr"], row["cross_batch_cos"] = snr_from_gram(G, sq)
            if len(bs) >= 3:
                jk = [snr_from_gram(np.delete(np.delete(G, i, 0), i, 1), np.delete(sq, i))[0] for i in range(len(bs))]
                h = t_quantile(0.975, len(bs) - 1) * jackknife_se(jk)
                row["snr_ci"] = {"mean": row["snr"], "lo": row["snr"] - h, "hi": row["snr"] + h, "level": 0.95,
                                 "n": len(bs)}
            if lab != base:
                d = cos - np.array([done[b]["methods"][base]["cos"] for b in bs])
                d_loo = loo - cos_loo(base)
                row["dcos"] = t_with_reference(d, d_loo.mean(0)).as_dict() if np.any(d != 0) else \
                    {"mean": 0.0, "lo": 0.0, "hi": 0.0}
                row["dcos_p_signflip"] = sign_flip_pvalue(d) if np.any(d != 0) else 1.0
                if margins and lab in margins:
                    mg = float(margins[lab])
                    row["dcos_minus_margin"] = t_with_reference(d - mg, d_loo.mean(0) - mg).as_dict()
                    row["margin_p"] = margin_pvalue(d, d_loo.mean(0), mg)
            rc = [done[b]["methods"][lab].get("reward_change") for b in bs]
            rc = [x for x in rc if x is not None]
            if rc:
                row["reward_change"] = float(np.mean(rc))
                row["reward_batches"] = len(rc)
                if lab != base:
                    rb = [done[b]["methods"][base].get("reward_change") for b in bs]
                    dd = [x - y for x, y in zip(rc, [v for v in rb if v is not None])]
                    row["dreward"] = float(np.mean(dd))
                    if len(dd) >= 2 and any(dd):
                        row["dreward_ci"] = paired_t(dd).as_dict()
            scan = _scan_rows(done, bs, lab, base)
            if scan:
                row["reward_scan"] = scan
        if margins and lab in margins:
            row["margin"] = float(margins[lab])
        ess = [done[b]["methods"][lab].get("ess_ratio") for b in bs]
        ess = [e for e in ess if e is not None]
        row["ess_ratio"] = float(np.mean(ess)) if ess else None
        att_s = [done[b]["methods"][lab].get("attribution_seconds") or 0.0 for b in bs]
        row["attribution_seconds"] = float(np.median(att_s)) if att_s else None
        rows.append(row)
    # Holm's step-down adjustment over the margin tests (family: every setting with a declared margin and a p)
    tested = sorted((r for r in rows if r.get("margin_p") is not None), key=lambda r: r["margin_p"])
    run_max = 0.0
    for i, r in enumerate(tested):
        run_max = max(run_max, min(1.0, (len(tested) - i) * r["margin_p"]))
        r["margin_p_holm"] = run_max
    # break-even: the Δcos that pays for a setting's attribution if that compute bought grpo more rollouts instead
    # (oar.app.stats.break_even_dcos); a step = generation + one update (the batch's update time shared by the
    # settings: one backward each on a shared forward)
    steps = [done[b]["seconds"]["generation"] + done[b]["seconds"]["updates"] / max(1, len(labels)) for b in bs
             if "updates" in done[b]["seconds"]]
    step_s = float(np.median(steps)) if steps else None
    b_row = rows[0]
    for row in rows:
        row["cost_ratio"] = (row["attribution_seconds"] / step_s) if step_s and row["attribution_seconds"] is not None \
            else None
        if row is not b_row and row["cost_ratio"] is not None and b_row.get("snr") is not None and b_row["cos"]:
            row["break_even_dcos"] = break_even_dcos(b_row["cos"], b_row["snr"], row["cost_ratio"])
    secs = [done[b]["seconds"]["total"] for b in sorted(done)]
    return {"baseline": base, "rows": rows,
            "reference": {k: v for k, v in ref.items() if k not in ("grad", "folds")},
            "step_norm": step_norm, "base_reward": base_reward, "n_params": n_params,
            "median_batch_seconds": float(np.median(secs)) if secs else None,
            "mean_batch_reward": float(np.mean([done[b]["mean_reward"] for b in done])) if done else None,
            "step_seconds": step_s,
            "batches_without_signal": silent, **({"margins": dict(margins)} if margins else {}),
            "sketch_gram": grams}


def _scan_rows(done: dict, bs: list, lab: str, base: str) -> list:
    """The step scan of one setting (batches' ``reward_scan`` records), per step scale: the sampled and the
    importance-weighted reward change (means, t intervals over batches), the linear prediction of the latter and
    their ratio (1 in the linear regime), and the sampled change's paired difference to ``base``."""
    from oar.app.stats import paired_t

    def ci(x):
        return paired_t(x).as_dict() if len(x) >= 2 and np.ptp(x) > 0 else None

    by = {}
    for b in bs:
        for x in done[b]["methods"][lab].get("reward_scan") or []:
            by.setdefault(x["scale"], []).append((b, x))
    out = []
    for scale in sorted(by):
        xs = by[scale]
        rc = np.array([x["reward_change"] for _, x in xs])
        row = {"scale": scale, "step": xs[0][1]["step"], "batches": len(xs), "reward_change": float(rc.mean()),
               "reward_change_ci": ci(rc)}
        isc = [x["is_change"] for _, x in xs if x.get("is_change") is not None]
        lin = [x["linear_change"] for _, x in xs if x.get("linear_change") is not None]
        if isc:
            row["is_change"], row["is_change_ci"] = float(np.mean(isc)), ci(np.array(isc))
        if lin:
            row["linear_change"] = float(np.mean(lin))
            # least-squares slope of the IS change on its prediction across batches (1: linear); a ratio of means
            # would be unstable where batches' predictions have both signs
            pairs = [(x["is_change"], x["linear_change"]) for _, x in xs
                     if x.get("is_change") is not None and x.get("linear_change") is not None]
            den = sum(lv * lv for _, lv in pairs)
            row["is_over_linear"] = float(sum(iv * lv for iv, lv in pairs) / den) if den > 0 else None
        if lab != base:
            d = []
            for b, x in xs:
                y = next((y for y in done[b]["methods"][base].get("reward_scan") or [] if y["scale"] == scale), None)
                if y is not None:
                    d.append(x["reward_change"] - y["reward_change"])
            if d:
                row["dreward"], row["dreward_ci"] = float(np.mean(d)), ci(np.array(d))
        out.append(row)
    return out


def summarize_stored(out_dir: str) -> dict:
    """The summary of a finished run recomputed from the files it keeps that are small enough to publish:
    ``batches.jsonl`` and ``diagnose.json`` (the reference's norms, fold counts and Gram matrix; the sketches' Gram
    matrices), without ``reference.pt`` or ``sketches/`` (docs/diagnose/*: every number of a report from its
    folder). Equal to the stored summary for a run of this version (tested).

    Raises:
        ValueError: a folder whose ``diagnose.json`` has no fold Gram matrix or no sketch Gram (written before
            version 2 of the diagnostic), naming the missing field.
    """
    with open(os.path.join(out_dir, "diagnose.json")) as f:
        stored = json.load(f)
    for key, where in (("gram", stored.get("reference", {})), ("fold_rollouts", stored.get("reference", {})),
                       ("sketch_gram", stored)):
        if key not in where:
            raise ValueError(f"{out_dir}/diagnose.json has no {key!r}: written before version 2 of oar diagnose, its "
                             "numbers cannot be recomputed from the stored files")
    done = {}
    with open(os.path.join(out_dir, "batches.jsonl")) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                done[int(rec["batch"])] = rec
    return summarize(done, stored["reference"], [r["method"] for r in stored["rows"]], out_dir,
                     step_norm=stored["step_norm"], base_reward=stored["base_reward"], n_params=stored["n_params"],
                     grams=stored["sketch_gram"], margins=stored.get("margins"))


def _fmt(x, spec="+.4f"):
    return "-" if x is None else format(x, spec)


def write_report(summary: dict, out_dir: str) -> None:
    """``diagnose.md`` (how to read it: docs/diagnose.md), ``diagnose.csv`` (one row per setting), ``diagnose.json``
    and ``diagnose.png`` (cosine difference to the baseline with its interval)."""
    import csv

    write_json_atomic(os.path.join(out_dir, "diagnose.json"), summary)
    ref, base = summary["reference"], summary["baseline"]
    lines = ["# oar diagnose", "",
             f"Reference gradient: {ref['rollouts']} held-out rollouts, mean reward {ref['mean_reward']:.3f}, "
             f"groups with both rewards {ref['mixed_groups']:.2f}; mean cosine between its {len(ref['gram'])} folds "
             f"{ref['fold_cos']:+.3f} (attenuation {_fmt(ref.get('attenuation'), '.3f')}: a cosine with the reference "
             "divided by it estimates the cosine with the true gradient; '-' means the reference is mostly noise).",
             f"Batches: {summary['rows'][0]['batches']} with signal"
             f" (+ {summary.get('batches_without_signal', 0)} where no group had two rewards: every u = 0, not "
             "counted)"
             f", mean reward {_fmt(summary['mean_batch_reward'], '.3f')}, "
             f"median {_fmt(summary['median_batch_seconds'], '.1f')} s per batch; {summary['n_params']} parameters.",
             "Intervals carry the batches' and the reference's noise (jackknife over its folds); the SNR's is a "
             "jackknife over batches.",
             "", f"| setting | cos(u, g_ref) [95% CI] | est. cos(u, g) | Δcos vs {base} [95% CI] | sign-flip p | "
             "SNR [95% CI] | cross-batch cos | ESS ratio | cost / step | break-even Δcos | Δreward (1 step) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in enumerate(summary["rows"]):
        ci = r.get("cos_ci")
        d = r.get("dcos")
        no_d = "(baseline)" if k == 0 else "-"  # a later setting without a Δcos: no batch with signal
        lines.append(
            f"| {r['method']} | {_fmt(r['cos'])}" + (f" [{ci['lo']:+.4f}, {ci['hi']:+.4f}]" if ci else "") +
            f" | {_fmt(r.get('cos_true_est'))} | " +
            (f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]" if d else no_d) +
            f" | {_fmt(r.get('dcos_p_signflip'), '.3f')} | {_fmt(r.get('snr'), '.3f')}"
            + (f" [{r['snr_ci']['lo']:+.3f}, {r['snr_ci']['hi']:+.3f}]" if r.get("snr_ci") else "") +
            f" | {_fmt(r.get('cross_batch_cos'), '+.4f')} | "
            f"{_fmt(r.get('ess_ratio'), '.3f')} | {_fmt(r.get('cost_ratio'), '.3f')} | "
            f"{_fmt(r.get('break_even_dcos'), '+.4f')} | "
            f"{_fmt(r.get('reward_change'), '+.4f')} |")
    n = summary["rows"][0]["batches"] if summary["rows"] else 0
    lines += ["", f"cost / step: the setting's attribution seconds (median per batch) / a {base} step's (generation + "
              f"one update, median {_fmt(summary.get('step_seconds'), '.1f')} s); break-even Δcos: the cosine gain "
              f"that pays for that cost had it bought {base} more rollouts instead (oar.app.stats.break_even_dcos, "
              f"from {base}'s cos and SNR). A setting is worth its cost when its Δcos interval lies above it."]
    lines += ["", "Sign-flip p: " + ("exact, over all 2^N sign patterns of the N paired batch differences."
                                   if n <= 16 else f"Monte Carlo, 20,000 random sign patterns of the {n} paired batch "
                                   "differences (the observed one counted; exact enumeration is used up to 16).")]
    if summary.get("base_reward") is not None:
        scanned = {x["scale"] for r in summary["rows"] for x in r.get("reward_scan") or []}
        lines += ["", f"Reward check: held-out reward {summary['base_reward']:.4f} before; each setting's column is "
                  "the "
                  f"change after one step of length {summary['step_norm']:.3g} along u / |u| (same sampling seeds)"
                  + ("." if not scanned or 1.0 in scanned else
                     "; that step (scale 1) was not among the scanned ones, so the column is empty: see the step "
                     "scan.")]
    tested = [r for r in summary["rows"] if r.get("margin") is not None]
    if tested:
        lines += ["", "Margin test (pre-declared margins, state.json): H1 Δcos > margin, one-sided t with both noises "
                  "(oar.app.stats.margin_pvalue), Holm's adjustment over the settings tested; a setting pays for its "
                  "cost at α = 0.05 when its Holm p is below 0.05, does not pay when the interval's upper end is "
                  "below 0. The run's own break-even (from its measured cost) is next to it.", "",
                  "| setting | margin | Δcos - margin [95% CI] | one-sided p | Holm p | this run's break-even Δcos |",
                  "|---|---|---|---|---|---|"]
        for r in tested:
            d = r.get("dcos_minus_margin")
            if d is None:
                lines.append(f"| {r['method']} | {r['margin']:+.4f} | untestable: {r['batches']} batches with signal "
                             "(2 needed) | - | - | - |")
                continue
            p_, ph = r.get("margin_p"), r.get("margin_p_holm")
            lines.append(f"| {r['method']} | {r['margin']:+.4f} | {d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}] | "
                         f"{'- (no spread)' if p_ is None else format(p_, '.3g')} | "
                         f"{'-' if ph is None else format(ph, '.3g')} | {_fmt(r.get('break_even_dcos'))} |")
    scan = [(r["method"], x) for r in summary["rows"] for x in r.get("reward_scan") or []]
    if scan:
        lines += ["", "Step scan (the reward check at each step length; `IS`: the importance-weighted change on the "
                  "start's rollouts, `linear`: its first-order prediction <step, grad>, both means over the batches; "
                  "`IS / linear`: the least-squares slope of the batches' IS changes on their predictions, 1 in the "
                  "linear regime; intervals are t over batches, without the reference's noise):", "",
                  f"| setting | step | batches | Δreward sampled [95% CI] | vs {base} | Δreward IS [95% CI] | linear | "
                  "IS / linear (slope) |",
                  "|---|---|---|---|---|---|---|---|"]

        def cell(x, key):
            c = x.get(key + "_ci")
            v = x.get(key)
            return "-" if v is None else f"{v:+.4f}" + (f" [{c['lo']:+.4f}, {c['hi']:+.4f}]" if c else "")

        for lab, x in scan:
            lines.append(f"| {lab} | {x['step']:.6g} ({x['scale']:.6g}x) | {x['batches']} | {cell(x, 'reward_change')} | "
                         f"{cell(x, 'dreward') if lab != base else '(baseline)'} | {cell(x, 'is_change')} | "
                         f"{_fmt(x.get('linear_change'))} | {_fmt(x.get('is_over_linear'), '.2f')} |")
    lines += ["", "How to read this and what it cannot tell: docs/diagnose.md."]
    with open(os.path.join(out_dir, "diagnose.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    keys = ["method", "batches", "batches_without_signal", "cos", "cos_true_est", "snr", "cross_batch_cos", "ess_ratio",
            "cost_ratio", "break_even_dcos",
            "dcos_p_signflip", "reward_change"]
    with open(os.path.join(out_dir, "diagnose.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys + ["cos_lo", "cos_hi", "dcos", "dcos_lo", "dcos_hi"])
        for r in summary["rows"]:
            ci, d = r.get("cos_ci") or {}, r.get("dcos") or {}
            w.writerow([r.get(k) for k in keys] + [ci.get("lo"), ci.get("hi"), d.get("mean"), d.get("lo"), d.get("hi")])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    rows = [r for r in summary["rows"] if r.get("dcos")]
    fig, ax = plt.subplots(figsize=(7, 0.45 * max(3, len(rows)) + 1))
    for i, r in enumerate(rows):
        d = r["dcos"]
        ax.errorbar(d["mean"], i, xerr=[[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]], fmt="o", color="C0", capsize=3)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(rows)), [r["method"] for r in rows])
    ax.set_xlabel(f"cos(u, g_ref) - cos(u_{base}, g_ref), paired over batches (95% t interval)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "diagnose.png"), dpi=120)
    plt.close(fig)
