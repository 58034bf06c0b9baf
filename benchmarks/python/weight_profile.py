"""Which tokens OAR's weights favour on the CPU comparison's task (issue 10: why OAR shows no gain there).

Samples rollouts as a training step of ``configs/compare_cpu.yaml`` does (SmolLM2-135M-Instruct, arithmetic levels
2-3, G = 4, temperature 0.9, up to 48 new tokens), keeps the groups whose rewards differ (the only rows OAR
reshapes), and runs ``oar_g``, ``oar_p`` and ``random`` through the same pipeline on the same rollouts. Reports,
per method, over the reasoning tokens of those rows:

- the mean reshaped weight of each token class (``number``: the token holds a digit; ``operator``: + - * / = x;
  ``word``: letters; ``other``: spaces, punctuation, markup) and each class's share of the top-10% weights;
- the same split by the sign of the sequence advantage (OAR uses the same weights whatever the sign);
- the ESS ratio and top-10% mass of the weights (method.md section 9), and the Spearman rank correlation of the
  scores with OAR-P's (exact) per row.

Usage: python benchmarks/python/weight_profile.py [--prompts 24] [--seed 0] [--out docs/compare/weight_profile]
(writes PREFIX.md and PREFIX.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import torch

import oar
from oar import ops
from oar.app.stats import spearman
from oar.metrics import ess_ratio, top_mass
from oar.batch import RolloutBatch
from oar.pipeline import Pipeline

CLASSES = ("number", "operator", "word", "other")


def token_class(text: str) -> str:
    """The class of one decoded token (module docstring)."""
    if re.search(r"\d", text):
        return "number"
    if re.search(r"[+\-*/=×÷]", text):
        return "operator"
    if re.search(r"[A-Za-z]", text):
        return "word"
    return "other"


def sample(model, tok, task, problems, G: int, max_new: int, temperature: float, seed: int):
    """Rollouts of ``problems`` (G each): prompt ids, right-padded completion ids and mask, rewards, answers."""
    torch.manual_seed(seed)
    prompts, comps, rewards, answers = [], [], [], []
    for p in problems:
        ids = tok.apply_chat_template(task.prompt(p), add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        x = torch.tensor([ids] * G)
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=True, top_k=0,
                                 temperature=temperature, max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
        for row in out[:, len(ids):]:
            row = row.tolist()
            if tok.eos_token_id in row:
                row = row[: row.index(tok.eos_token_id) + 1]
            prompts.append(ids)
            comps.append(row)
            rewards.append(task.reward(tok.decode(row, skip_special_tokens=True), p))
            answers.append(str(p.answer))
    C = max(len(c) for c in comps)
    cids = torch.full((len(comps), C), tok.pad_token_id, dtype=torch.long)
    cmask = torch.zeros((len(comps), C), dtype=torch.bool)
    for i, c in enumerate(comps):
        cids[i, : len(c)] = torch.tensor(c)
        cmask[i, : len(c)] = True
    return prompts, cids, cmask, torch.tensor(rewards, dtype=torch.float32), answers


def profile(res, tok, cids, adv) -> dict:
    """Per-class mean weight and top-10% share over the reshaped rows' reasoning tokens, split by advantage sign."""
    out = {}
    for sign_name, keep in (("all", lambda a: a != 0), ("positive", lambda a: a > 0), ("negative", lambda a: a < 0)):
        w_by, top_by, n_top = {c: [] for c in CLASSES}, {c: 0 for c in CLASSES}, 0
        for i in range(cids.shape[0]):
            m = res.reasoning_mask[i]
            if not keep(float(adv[i])) or not bool(m.any()):
                continue
            cols = torch.nonzero(m).flatten().tolist()
            w = res.weights[i, cols]
            cls = [token_class(tok.decode([int(cids[i, c])])) for c in cols]
            for c, x in zip(cls, w.tolist()):
                w_by[c].append(x)
            k = max(1, -(-len(cols) // 10))
            for j in sorted(range(len(cols)), key=lambda j: (-float(w[j]), j))[:k]:
                top_by[cls[j]] += 1
            n_top += k
        out[sign_name] = {c: {"tokens": len(w_by[c]), "mean_weight": statistics.mean(w_by[c]) if w_by[c] else None,
                              "top10_share": top_by[c] / n_top if n_top else None} for c in CLASSES}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=24, help="training problems sampled (G = 4 rollouts each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/compare/weight_profile")
    a = p.parse_args(argv)
    from oar.app.models import load_model
    from oar.app.tasks import get_task

    t0 = time.perf_counter()
    model, tok = load_model("smollm2-135m-instruct")
    model.float().eval()
    task = get_task("arithmetic", level=[2, 3])
    problems = task.problems("train", n=a.prompts, seed=a.seed)
    prompts, cids, cmask, rewards, answers = sample(model, tok, task, problems, 4, 48, 0.9, a.seed)
    adv = ops.group_advantages(rewards, group_size=4, preset="trl")
    batch = RolloutBatch(cids, cmask, prompt_ids=prompts, rewards=rewards, answers=answers,
                         group_ids=[i // 4 for i in range(len(prompts))], sequence_advantages=adv)
    results, report = {}, {"meta": {"prompts": a.prompts, "seed": a.seed, "rollouts": len(prompts),
                                    "reward_mean": float(rewards.mean()),
                                    "reshaped_rows": int((adv != 0).sum())}, "methods": {}}
    for method in ("oar_p", "oar_g", "random"):
        cfg = oar.OARConfig(method=method, memory_budget_mb=512, seed=a.seed)
        res = Pipeline(cfg, tok).compute(batch, model)
        results[method] = res
        rows = [i for i in range(len(prompts)) if float(adv[i]) != 0 and bool(res.reasoning_mask[i].any())]
        idx = torch.tensor(rows, dtype=torch.long)
        w, m = res.weights[idx].abs(), res.reasoning_mask[idx]
        rho = [spearman(res.scores[i][res.reasoning_mask[i]].tolist(),
                        results["oar_p"].scores[i][results["oar_p"].reasoning_mask[i]].tolist()) for i in rows]
        rho = [r for r in rho if r is not None]
        report["methods"][method] = {
            "classes": profile(res, tok, cids, adv),
            "ess_ratio_reasoning": float(ess_ratio(w, m).mean()) if rows else None,
            "top10_mass_reasoning": float(top_mass(res.advantages[idx], w, m, 0.1).mean()) if rows else None,
            "spearman_vs_oar_p": statistics.mean(rho) if rho else None,
            "rows": len(rows)}
    report["meta"]["seconds"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    meta = report["meta"]
    lines = [f"{meta['rollouts']} rollouts of {a.prompts} training problems (seed {a.seed}), mean reward "
             f"{meta['reward_mean']:.2f}; {meta['reshaped_rows']} rows with a non-zero advantage are reshaped; "
             f"{meta['seconds']:.0f} s.", "",
             "| method | rows | ESS ratio | top-10% mass | Spearman vs OAR-P | "
             + " | ".join(f"{c}: mean w (top-10% share)" for c in CLASSES) + " |",
             "|---|---|---|---|---|" + "---|" * len(CLASSES)]

    def f3(v):
        return "-" if v is None else f"{v:.3f}"

    for method, r in report["methods"].items():
        cells = [f"{f3(r['classes']['all'][c]['mean_weight'])} ({f3(r['classes']['all'][c]['top10_share'])})"
                 for c in CLASSES]
        lines.append(f"| {method} | {r['rows']} | {f3(r['ess_ratio_reasoning'])} | {f3(r['top10_mass_reasoning'])} "
                     f"| {f3(r['spearman_vs_oar_p'])} | " + " | ".join(cells) + " |")
    share = report["methods"]["oar_p"]["classes"]["all"]
    total = sum(share[c]["tokens"] for c in CLASSES)
    lines += ["", "Token classes among the reasoning tokens: " + ", ".join(
        f"{c} {share[c]['tokens'] / max(total, 1):.2f}" for c in CLASSES) + ".", "",
        "By the sign of the sequence advantage (mean weight of numbers / operators / words / other):", ""]
    for method, r in report["methods"].items():
        for sgn in ("positive", "negative"):
            cl = r["classes"][sgn]
            lines.append(f"- {method}, {sgn}: " + " / ".join(f3(cl[c]["mean_weight"]) for c in CLASSES))
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
