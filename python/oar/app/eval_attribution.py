"""``oar eval-attribution``: attribution quality against oracle causal tokens (method.md section 9).

For correct sampled traces of a task:

1. **Oracle** (method.md section 9, [decided]): for every reasoning token t, replace it by PAD, keep the
   rest of the reasoning, append the conclude string, decode the answer greedily (until ``}`` or EOS) and
   verify it against the reference; t is *causal* when the answer stops being correct. A trace is kept
   only when its unmasked probe context itself decodes to the correct answer (otherwise "flipping
   correctness" is undefined for it).
2. **Scores** of every method: OAR-P and OAR-G (1 and K noise draws) for each probe (last, answer_mean,
   answer_joint), entropy, random.
3. **Recall@K%**: the share of a trace's oracle-causal tokens found among its top ceil(K% x L) tokens by
   score (ties broken by position), averaged over traces with at least one causal token; 95% bootstrap
   intervals over traces. ``random`` is reported by its exact expectation per trace, ceil(K% x L) / L (about K%),
   not by one draw; the other methods' random draws (OAR-G's noise) are seeded per trace (:func:`trace_seed`).

4. **Fidelity to exact OAR-P** (docs/design.md, "Screened OAR-P"): screened OAR-P (``--screen-fractions``) and 1-draw OAR-G against exact
   OAR-P (answer_mean) on the same traces: Spearman, top-10% overlap, reshaped-weight L1, recall@10% difference,
   the share masked exactly and the cost of the model passes relative to exact OAR-P.

Outputs (``--out PREFIX``): PREFIX.csv and PREFIX.md (the tables), PREFIX.png (recall vs K), PREFIX.json
(per-trace oracle, scores, costs and recalls, so the numbers can be re-analysed).
"""

from __future__ import annotations

import csv
import json
import math
import numbers
import os
import time
from dataclasses import dataclass, field

import torch

from oar.app._extras import require
from oar.app.stats import bootstrap_mean, spearman
from oar.schema import PROBES

require("train", "oar.app.eval_attribution")  # loads models (transformers, gguf), checks answers, plots

TOP_K_PERCENT = (10, 20, 30)


@dataclass
class Trace:
    """One correct sampled completion and everything measured on it."""

    task: str
    problem_id: str
    answer: str
    prompt_ids: list
    response_ids: list
    text: str
    reasoning_len: int = 0
    causal: list = field(default_factory=list)        # bool per reasoning token
    scores: dict = field(default_factory=dict)        # method name -> list of floats (per reasoning token)
    costs: dict = field(default_factory=dict)         # method name -> {"seconds", "tokens"} of its model passes


def recall_at(scores: list[float], causal: list[bool], percent: float) -> float | None:
    """Share of causal tokens among the top ceil(percent% x L) tokens by score (ties: earlier position first).
    None when the trace has no causal token. Raises ValueError on mismatched lengths, percent that is not a real
    number in (0, 100], or NaN scores (they have no rank)."""
    if len(scores) != len(causal):
        raise ValueError(f"scores ({len(scores)}) and causal ({len(causal)}) must have one entry per token")
    if isinstance(percent, bool) or not isinstance(percent, numbers.Real) or not 0 < percent <= 100:
        raise ValueError(f"percent must be in (0, 100] (a real number), got {percent!r}")
    nan = [i for i, x in enumerate(scores) if math.isnan(x)]
    if nan:
        raise ValueError(f"scores must not contain NaN (no rank), got NaN at positions {nan[:8]}")
    n_causal = sum(bool(c) for c in causal)
    if n_causal == 0 or not scores:
        return None
    k = max(1, math.ceil(percent / 100.0 * len(scores)))
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]
    return sum(bool(causal[i]) for i in order) / n_causal


def expected_random_recall(length: int, causal: list[bool], percent: float) -> float | None:
    """Exact expected :func:`recall_at` of a uniformly random ranking of a trace's ``length`` tokens: the top
    k = ceil(percent% x L) tokens hold each causal token with probability k / L, so the expected recall is k / L.
    None when the trace has no causal token (as :func:`recall_at`). This replaces one random draw per trace: a
    draw seeded alike for every trace ranked every trace alike)."""
    if len(causal) != length:
        raise ValueError(f"causal ({len(causal)}) must have one entry per token (length {length})")
    if isinstance(percent, bool) or not isinstance(percent, numbers.Real) or not 0 < percent <= 100:
        raise ValueError(f"percent must be in (0, 100] (a real number), got {percent!r}")
    if length == 0 or not any(causal):
        return None
    return max(1, math.ceil(percent / 100.0 * length)) / length


def trace_seed(seed: int, task: str, problem_id: str, index: int) -> int:
    """The seed of one trace's random draws (OAR-G noise, the random scores): a function of the run's ``seed``
    and the trace's identity, so that no two traces share their draws."""
    import zlib

    return (int(seed) * 1_000_003 + zlib.crc32(f"{task}|{problem_id}|{index}".encode())) % (2**63 - 1)


def top_overlap(a: list[float], b: list[float], percent: float = 10) -> float:
    """Share of b's top ceil(percent% x L) tokens (ties: earlier first, as :func:`recall_at`) that are also a's."""
    if len(a) != len(b) or not a:
        raise ValueError(f"a ({len(a)}) and b ({len(b)}) must be non-empty with one entry per token")
    k = max(1, math.ceil(percent / 100.0 * len(a)))

    def top(v):
        return set(sorted(range(len(v)), key=lambda i: (-v[i], i))[:k])

    return len(top(a) & top(b)) / k


def reshaped_weights_l1(a: list[float], b: list[float], cfg) -> float:
    """Mean |w_a - w_b| per token of the reshaped weights (method.md sections 5-6, the config's q, beta, floor,
    tiers) of two score lists of one trace, for a positive sequence advantage (the weights have mean 1)."""
    from oar import ops

    r = cfg.reshape
    L = len(a)
    mask = torch.ones((1, L), dtype=torch.bool)
    w = [ops.reshape_advantages(torch.ones(1), torch.tensor([v], dtype=torch.float32), mask, mask, q=r.q,
                                beta=r.beta, floor=r.floor, tiers=r.tiers)[1][0].double() for v in (a, b)]
    return float((w[0] - w[1]).abs().mean())


def bootstrap_ci(values: list[float]) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of the mean over traces (:func:`oar.app.stats.bootstrap_mean`), or
    ``(nan, nan)`` for no values (summarize() reports recall NaN with 0 traces). Raises ValueError for non-finite
    values."""
    if not values:
        return (float("nan"), float("nan"))
    iv = bootstrap_mean(values, seed=0)
    return iv.lo, iv.hi


def _greedy_answers(model, tok, contexts: torch.Tensor, max_new: int) -> list[str]:
    """Greedy continuation of equal-length contexts (B, T), decoded up to the first '}' or EOS."""
    with torch.no_grad():
        out = model.generate(input_ids=contexts, attention_mask=torch.ones_like(contexts), do_sample=False,
                             max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, contexts.shape[1]:], skip_special_tokens=True)
    return [t.split("}")[0].strip() for t in texts]


def oracle_causal(model, tok, task, problem, prompt_ids, reasoning_ids, conclude_ids, pad_id: int,
                  max_new: int = 16, batch_size: int = 32) -> tuple[bool, list[bool]]:
    """(clean_correct, causal flags per reasoning token) by PAD substitution + greedy answer decoding."""
    base = torch.tensor(list(prompt_ids) + list(reasoning_ids) + list(conclude_ids), dtype=torch.long)
    clean = _greedy_answers(model, tok, base[None], max_new)[0]
    clean_ok = task.reward("\\boxed{" + clean + "}", problem) == 1.0
    if not clean_ok:
        return False, []
    P, L = len(prompt_ids), len(reasoning_ids)
    causal = []
    for start in range(0, L, batch_size):
        js = list(range(start, min(L, start + batch_size)))
        ctx = base.repeat(len(js), 1)
        ctx[torch.arange(len(js)), torch.tensor(js) + P] = pad_id
        for ans in _greedy_answers(model, tok, ctx, max_new):
            causal.append(task.reward("\\boxed{" + ans + "}", problem) != 1.0)
    return True, causal


def sample_correct_traces(model, tok, task, task_name: str, problems, G: int, max_new_tokens: int,
                          temperature: float, want: int, seed: int) -> list[Trace]:
    """Samples G completions per problem (batched), keeps correct ones until ``want`` traces."""
    from oar.app.attribute import sample_group

    traces: list[Trace] = []
    for pi, prob in enumerate(problems):
        s = sample_group(model, tok, task.prompt(prob), G, max_new_tokens, temperature, seed + pi)
        for i, text in enumerate(s.texts):
            if task.reward(text, prob) == 1.0:
                traces.append(Trace(task_name, str(prob.id), prob.answer, s.prompt_ids.tolist(),
                                    s.completion_ids[i][s.completion_mask[i]].tolist(), text))
                break  # one trace per problem: traces stay independent for the bootstrap
        if len(traces) >= want:
            break
    return traces


def screened_name(fraction: float, screen: str = "window") -> str:
    """Method name of screened OAR-P (answer_mean probe) at a top ``fraction`` with the ``screen`` ("window" or
    "oar_g"), e.g. ``oar_p_screen0.1/answer_mean`` (window screen) and ``oar_p_gscreen0.1/answer_mean`` (OAR-G)."""
    return f"oar_p_{'g' if screen == 'oar_g' else ''}screen{fraction:g}/answer_mean"


def window_name(window: int) -> str:
    """Method name of windowed OAR-P (answer_mean probe) with ``window``, e.g. ``oar_p_window8/answer_mean``."""
    return f"oar_p_window{window}/answer_mean"


def score_trace(model, tok, trace: Trace, cfg, draws: int, seed: int,
                screen_fractions: tuple = (), screen_sample: float = 0.05, windows: tuple = (),
                screen_window: int = 8) -> dict[str, list[float]]:
    """Every method's scores of one trace's reasoning tokens; ``seed``: this trace's own seed (:func:`trace_seed`)
    of OAR-G's noise and the random scores. Windowed OAR-P (answer_mean) runs at each of ``windows``. Screened
    OAR-P (answer_mean probe) at each of ``screen_fractions`` runs twice: with the windowed screen of
    ``screen_window`` and with the 1-draw OAR-G answer_mean screen, each with a sample seeded by ``seed``. The model
    passes' seconds and token counts go to ``trace.costs`` (screened: screen + exact pass)."""
    from oar.attribution import (
        HFProbeModel,
        ProbeContextBuilder,
        entropy_scores,
        oar_g_scores,
        oar_p_scores,
        oar_p_window_scores,
        random_scores,
    )
    from oar.attribution.screened import oar_p_screened_scores

    builder = ProbeContextBuilder(tok, cfg.conclude, cfg.answer_suffix)
    batch = builder.build([trace.prompt_ids], [trace.response_ids], [trace.answer], [trace.reasoning_len])
    pm = HFProbeModel(model)
    L = trace.reasoning_len
    out, screens = {}, {}

    def cost(att) -> dict:
        return {"seconds": float(att.stats.get("seconds", 0.0)), "tokens": int(att.stats.get("tokens", 0))}

    with pm.eval_mode():
        for probe in PROBES:
            res = oar_p_scores(pm, batch, probe=probe)
            out[f"oar_p/{probe}"] = res.scores[0, :L].tolist()
            trace.costs[f"oar_p/{probe}"] = cost(res)
            for k in (1, draws):
                g = torch.Generator().manual_seed(seed)
                res = oar_g_scores(pm, batch, probe=probe, noise_draws=k, generator=g, sigma=cfg.sigma)
                out[f"oar_g{k}/{probe}"] = res.scores[0, :L].tolist()
                trace.costs[f"oar_g{k}/{probe}"] = cost(res)
                screens[(k, probe)] = res
        by_window = {}
        for w in dict.fromkeys(tuple(windows) + ((screen_window,) if screen_fractions else ())):
            res = oar_p_window_scores(pm, batch, window=w, probe="answer_mean", keep_clean_pass=True)
            by_window[w] = res
            if w in windows:
                out[window_name(w)] = res.scores[0, :L].tolist()
                trace.costs[window_name(w)] = cost(res)
        for kind, screen in (("window", by_window.get(screen_window)), ("oar_g", screens[(1, "answer_mean")])):
            for f in screen_fractions:
                res = oar_p_screened_scores(pm, batch, screen, fraction=f, sample_fraction=screen_sample,
                                            generator=torch.Generator().manual_seed(seed), probe="answer_mean")
                name = screened_name(f, kind)
                out[name] = res.scores[0, :L].tolist()
                c, sc = cost(res), cost(screen)
                trace.costs[name] = {"seconds": c["seconds"] + sc["seconds"], "tokens": c["tokens"] + sc["tokens"],
                                     "masked": int(res.stats["masked"])}
        out["entropy"] = entropy_scores(pm, batch).scores[0, :L].tolist()
        out["random"] = random_scores(batch, generator=torch.Generator().manual_seed(seed)).scores[0, :L].tolist()
    return out


def summarize_fidelity(traces: list[Trace], cfg, exact: str = "oar_p/answer_mean") -> list[dict]:
    """Per task, how close each answer_mean method's scores are to exact OAR-P's on the same traces:
    mean Spearman rank correlation, top-10% overlap and reshaped-weight L1 (:func:`reshaped_weights_l1`) with 95%
    bootstrap intervals over traces; recall@10% minus exact OAR-P's (paired per trace); the share of tokens masked
    exactly; the cost as seconds and tokens of the model passes relative to exact OAR-P's (ratio of sums)."""
    rows = []
    for task in sorted({t.task for t in traces}):
        ts = [t for t in traces if t.task == task and exact in t.scores]
        if not ts:
            continue
        names = [m for m in ts[0].scores if m.startswith("oar_g") and m.endswith("/answer_mean")]
        names += [m for m in ts[0].scores if m.startswith("oar_p_window")]
        names += [m for m in ts[0].scores if m.startswith(("oar_p_screen", "oar_p_gscreen"))]
        for m in names:
            rho = [v for v in (spearman(t.scores[m], t.scores[exact]) for t in ts) if v is not None]
            over = [top_overlap(t.scores[m], t.scores[exact], 10) for t in ts]
            l1 = [reshaped_weights_l1(t.scores[m], t.scores[exact], cfg) for t in ts]
            drec = [recall_at(t.scores[m], t.causal, 10) - recall_at(t.scores[exact], t.causal, 10) for t in ts
                    if any(t.causal)]
            masked = (sum(t.costs.get(m, {}).get("masked", 0) for t in ts) / sum(t.reasoning_len for t in ts)
                      if m.startswith(("oar_p_screen", "oar_p_gscreen")) else 0.0)
            sec = sum(t.costs.get(m, {}).get("seconds", float("nan")) for t in ts)
            tok = sum(t.costs.get(m, {}).get("tokens", 0) for t in ts)
            rows.append({
                "task": task, "method": m, "traces": len(ts),
                "spearman": sum(rho) / len(rho) if rho else float("nan"), "spearman_ci": bootstrap_ci(rho),
                "top10_overlap": sum(over) / len(over), "top10_overlap_ci": bootstrap_ci(over),
                "weights_l1": sum(l1) / len(l1), "weights_l1_ci": bootstrap_ci(l1),
                "recall10_minus_exact": sum(drec) / len(drec) if drec else float("nan"),
                "recall10_minus_exact_ci": bootstrap_ci(drec), "masked_frac": masked,
                "seconds_vs_exact": sec / max(sum(t.costs[exact]["seconds"] for t in ts), 1e-12),
                # OAR-G's passes report no token count: None (shown "-")
                "tokens_vs_exact": tok / max(sum(t.costs[exact]["tokens"] for t in ts), 1) if tok else None})
    return rows


def fidelity_table(rows: list[dict]) -> list[str]:
    """Markdown lines of :func:`summarize_fidelity`'s rows."""
    lines = []
    for task in dict.fromkeys(r["task"] for r in rows):
        lines += [f"### {task}: against exact OAR-P (answer_mean), same traces", "",
                  "| method | masked | Spearman | top-10% overlap | weights L1 | recall@10% - exact | "
                  "seconds / exact | tokens / exact |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["task"] != task:
                continue

            def ci(key):
                lo, hi = r[key + "_ci"]
                return f"{r[key]:.3f} [{lo:.2f}, {hi:.2f}]"

            lines.append(f"| {r['method']} | {r['masked_frac']:.2f} | {ci('spearman')} | {ci('top10_overlap')} | "
                         f"{ci('weights_l1')} | {r['recall10_minus_exact']:+.3f} [{r['recall10_minus_exact_ci'][0]:+.2f},"
                         f" {r['recall10_minus_exact_ci'][1]:+.2f}] | {r['seconds_vs_exact']:.2f} | "
                         f"{'-' if r['tokens_vs_exact'] is None else format(r['tokens_vs_exact'], '.2f')} |")
        lines.append("")
    return lines


def summarize(traces: list[Trace]) -> list[dict]:
    rows = []
    for task in sorted({t.task for t in traces}):
        ts = [t for t in traces if t.task == task]
        methods = list(ts[0].scores) if ts else []
        for m in methods:
            for K in TOP_K_PERCENT:
                if m == "random":  # its exact expectation per trace, not one draw (expected_random_recall)
                    vals = [r for r in (expected_random_recall(len(t.causal), t.causal, K) for t in ts)
                            if r is not None]
                else:
                    vals = [r for r in (recall_at(t.scores[m], t.causal, K) for t in ts) if r is not None]
                lo, hi = bootstrap_ci(vals)
                rows.append({"task": task, "method": m, "top_percent": K, "recall": sum(vals) / len(vals) if vals else float("nan"),
                             "ci_low": lo, "ci_high": hi, "traces": len(vals)})
    return rows


def write_outputs(rows: list[dict], traces: list[Trace], prefix: str, meta: dict, fidelity: list[dict] = ()) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump({"meta": meta, "summary": rows, "fidelity": list(fidelity), "traces": [t.__dict__ for t in traces]},
                  f, indent=1)
    with open(prefix + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["task"])
        w.writeheader()
        w.writerows(rows)
    lines = []
    for task in sorted({r["task"] for r in rows}):
        ts = [t for t in traces if t.task == task]
        n_causal = sum(sum(t.causal) for t in ts)
        n_tok = sum(t.reasoning_len for t in ts)
        lines += [f"### {task}: {len(ts)} traces, {n_tok} reasoning tokens, {n_causal} oracle-causal "
                  f"({100 * n_causal / max(n_tok, 1):.1f}%)", "",
                  "| method | " + " | ".join(f"recall@{k}%" for k in TOP_K_PERCENT) + " |",
                  "|---|" + "---|" * len(TOP_K_PERCENT)]
        for m in dict.fromkeys(r["method"] for r in rows if r["task"] == task):
            cells = []
            for K in TOP_K_PERCENT:
                r = next(x for x in rows if x["task"] == task and x["method"] == m and x["top_percent"] == K)
                cells.append(f"{r['recall']:.3f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += fidelity_table(list(fidelity))
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    _plot(rows, prefix + ".png")


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows})
    if not tasks:  # no trace kept: the table says so; there is nothing to plot
        print(f"no trace kept: {path} not written")
        return
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), dpi=110, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        # Colour = method family (OAR-P, OAR-G with 1 / K draws, entropy, random), line style = probe.
        colours = {}
        styles = {"last": ":", "answer_mean": "-", "answer_joint": "--"}
        for m in dict.fromkeys(r["method"] for r in rows if r["task"] == task):
            rs = [r for r in rows if r["task"] == task and r["method"] == m]
            family, _, probe = m.partition("/")
            colour = colours.setdefault(family, f"C{len(colours)}")
            ax.plot([r["top_percent"] for r in rs], [r["recall"] for r in rs], styles.get(probe, "-."),
                    color=colour, marker="o", ms=3, label=m, lw=1.2 if probe else 2.0)
        ax.set_title(f"{task}: recall of oracle-causal tokens", fontsize=9)
        ax.set_xlabel("top K% tokens by score")
        ax.set_ylabel("recall")
        ax.set_xticks(list(TOP_K_PERCENT))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args) -> list[dict]:
    """Implements ``oar eval-attribution`` (see ``oar eval-attribution --help``)."""
    import oar
    from oar.attribution import ProbeContextBuilder, reasoning_length
    from oar.app.models import load_by_name
    from oar.app.tasks import get_task

    t0 = time.perf_counter()
    model, tok = load_by_name(args.model)
    model.eval()
    cfg = oar.OARConfig()
    builder = ProbeContextBuilder(tok, cfg.conclude, cfg.answer_suffix)  # the pipeline's pad and stop ids
    conclude_ids, pad_id = builder.conclude_ids, builder.pad_id
    traces: list[Trace] = []
    for task_name in args.tasks:
        kwargs = {}
        if task_name == "gsm8k":
            kwargs = {"easiest": True, **({"test_path": args.data} if args.data else {})}
        task = get_task(task_name, **kwargs)
        problems = task.problems("test", n=args.problems, seed=args.seed)
        found = sample_correct_traces(model, tok, task, task_name, problems, args.num_generations,
                                      args.max_new_tokens, args.temperature, args.traces, args.seed)
        print(f"[{task_name}] {len(found)} correct traces from {len(problems)} problems "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
        probs = {str(p.id): p for p in problems}
        for tr in found:
            tr.reasoning_len = reasoning_length(tr.response_ids, tok, stop_ids=builder.stop_ids)
            if tr.reasoning_len == 0:
                continue
            ok, causal = oracle_causal(model, tok, task, probs[tr.problem_id], tr.prompt_ids,
                                       tr.response_ids[: tr.reasoning_len], conclude_ids, pad_id)
            if not ok:
                continue
            tr.causal = causal
            n_kept = sum(t.task == task_name for t in traces)
            tr.scores = score_trace(model, tok, tr, cfg, args.draws,
                                    trace_seed(args.seed, task_name, tr.problem_id, n_kept),
                                    tuple(getattr(args, "screen_fractions", ()) or ()),
                                    getattr(args, "screen_sample", 0.05), tuple(getattr(args, "windows", ()) or ()),
                                    getattr(args, "screen_window", 8))
            traces.append(tr)
        print(f"[{task_name}] {sum(t.task == task_name for t in traces)} traces kept after the clean-answer check "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
    rows = summarize(traces)
    meta = {"model": args.model, "tasks": args.tasks, "draws": args.draws, "seed": args.seed,
            "screen_fractions": list(getattr(args, "screen_fractions", ()) or ()),
            "screen_sample": getattr(args, "screen_sample", 0.05),
            "windows": list(getattr(args, "windows", ()) or ()), "screen_window": getattr(args, "screen_window", 8),
            "threads": torch.get_num_threads(),
            "seconds": time.perf_counter() - t0, "torch": torch.__version__, "oar": oar.__version__}
    write_outputs(rows, traces, args.out, meta, summarize_fidelity(traces, cfg))
    return rows
