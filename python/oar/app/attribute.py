"""``oar attribute``: OAR-P vs OAR-G importance for G sampled completions of one question.

Samples G completions with the policy, scores them (0/1 reward), computes GRPO advantages, then OAR-P
and OAR-G importance of every reasoning token, the reshaped per-token advantages of each, prints the
top tokens per method, and writes an HTML heatmap (one block per completion, a row per method, token
background = normalized importance) plus a JSON file with every number shown.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass

import torch

from oar.app._extras import require

require("train", "oar.app.attribute")  # loads models (transformers, gguf), checks answers (math-verify)


@dataclass
class Sampled:
    prompt_ids: torch.Tensor       # (P,)
    completion_ids: torch.Tensor   # (B, C) right-padded
    completion_mask: torch.Tensor  # (B, C) bool
    texts: list


def sample_group(model, tokenizer, messages, G: int, max_new_tokens: int, temperature: float, seed: int) -> Sampled:
    """G sampled completions of one chat prompt, as ids (EOS kept, padding masked)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    prompt = enc["input_ids"][0]
    torch.manual_seed(seed)
    with torch.no_grad():
        gen = model.generate(input_ids=prompt.repeat(G, 1), attention_mask=torch.ones(G, prompt.numel(), dtype=torch.long),
                             do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id)
    comp = gen[:, prompt.numel():]
    eos = tokenizer.eos_token_id
    mask = torch.ones_like(comp, dtype=torch.bool)
    for i in range(G):
        hits = (comp[i] == eos).nonzero()
        if hits.numel():
            mask[i, int(hits[0]) + 1:] = False
    texts = [tokenizer.decode(comp[i][mask[i]], skip_special_tokens=True) for i in range(G)]
    return Sampled(prompt, comp, mask, texts)


def _color(v: float, rgb=(220, 60, 40)) -> str:
    a = max(0.0, min(1.0, v))
    return f"rgba({rgb[0]},{rgb[1]},{rgb[2]},{a:.3f})"


def write_heatmap(path: str, question: str, answer: str, tokens: list[list[str]], rewards: list[float],
                  advantages: list[float], methods: dict[str, list[list[float]]], token_adv: dict[str, list[list[float]]]) -> None:
    """HTML page: per completion, one row per method; token background = importance min-max scaled within
    the row; hover shows raw score and reshaped advantage."""
    colors = {"OAR-P": (220, 60, 40), "OAR-G": (40, 90, 220)}
    parts = ["<!doctype html><meta charset='utf-8'><title>oar attribute</title>",
             "<style>body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;line-height:1.9}"
             ".tok{white-space:pre-wrap;border-radius:3px;padding:1px 0;font-family:ui-monospace,monospace;font-size:13px}"
             ".row{margin:.3em 0 .8em 0}.lbl{font-weight:600;display:inline-block;width:5em}"
             "h3{margin-bottom:.2em}.meta{color:#555;font-size:13px}</style>",
             f"<h2>Question</h2><p>{html.escape(question)}</p><p><b>Reference answer:</b> {html.escape(answer)}</p>",
             "<p class=meta>Background = importance of the reasoning token (normalized per row: log1p then min-max, "
             "as in the reshaping). Hover a token for its raw score and reshaped advantage. Tokens after the "
             "reasoning span (the final answer) are uncolored.</p>"]
    for i, toks in enumerate(tokens):
        parts.append(f"<h3>Completion {i + 1}: reward {rewards[i]:.0f}, GRPO advantage {advantages[i]:+.3f}</h3>")
        for name, scores in methods.items():
            sc = scores[i]
            logs = [float(torch.log1p(torch.tensor(x))) for x in sc]
            lo, hi = (min(logs), max(logs)) if logs else (0.0, 1.0)
            den = (hi - lo) if hi > lo else 1.0
            row = [f"<div class=row><span class=lbl>{name}</span>"]
            for j, t in enumerate(toks):
                if j < len(sc):
                    v = (logs[j] - lo) / den
                    title = f"I={sc[j]:.3g}  A_t={token_adv[name][i][j]:+.3f}"
                    row.append(f"<span class=tok style='background:{_color(v, colors.get(name, (120, 120, 120)))}' "
                               f"title='{html.escape(title)}'>{html.escape(t)}</span>")
                else:
                    row.append(f"<span class=tok>{html.escape(t)}</span>")
            row.append("</div>")
            parts.append("".join(row))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(parts))
    os.replace(tmp, path)


def run_attribute(a) -> dict:
    """Implements ``oar attribute`` (arguments: see ``oar attribute --help``). Returns the JSON record."""
    import oar
    from oar import ops
    from oar.attribution import HFProbeModel, ProbeContextBuilder, oar_g_scores, oar_p_scores
    from oar.app.models import load_by_name
    from oar.app.tasks import get_task

    if a.num_generations < 1:
        raise ValueError(f"--num-generations must be >= 1, got {a.num_generations}")
    kwargs = {}
    if a.task in ("gsm8k", "math500") and a.data:
        kwargs = {"test_path": a.data} if a.task == "gsm8k" else {"path": a.data}
    if a.task == "gsm8k" and getattr(a, "easiest", False):
        kwargs["easiest"] = True
    task = get_task(a.task, **kwargs)
    problems = task.problems("test")
    if not 0 <= a.index < len(problems):
        raise ValueError(f"--index must be in [0, {len(problems)}), got {a.index}")
    prob = problems[a.index]
    model, tok = load_by_name(a.model, **(getattr(a, "model_kwargs", None) or {}))
    s = sample_group(model, tok, task.prompt(prob), a.num_generations, a.max_new_tokens, a.temperature, a.seed)
    rewards = torch.tensor([task.reward(t, prob) for t in s.texts], dtype=torch.float32)
    adv = ops.group_advantages(rewards, torch.tensor([0, len(rewards)]), estimator="grpo", preset="trl")
    cfg = oar.OARConfig()
    builder = ProbeContextBuilder(tok, cfg.conclude, cfg.answer_suffix)
    responses = [s.completion_ids[i][s.completion_mask[i]] for i in range(len(s.texts))]
    batch = builder.build([s.prompt_ids] * len(responses), responses, [prob.answer] * len(responses))
    pm = HFProbeModel(model)
    with pm.eval_mode():
        att = {"OAR-P": oar_p_scores(pm, batch, probe=a.probe),
               "OAR-G": oar_g_scores(pm, batch, probe=a.probe, generator=torch.Generator().manual_seed(a.seed))}
    B, C = s.completion_ids.shape
    tokens, methods, token_adv, record = [], {}, {}, {"question": prob.question, "answer": prob.answer,
                                                       "rewards": rewards.tolist(), "advantages": adv.tolist(),
                                                       "completions": s.texts, "methods": {}}
    for i in range(B):
        ids = responses[i].tolist()
        tokens.append([tok.decode([t]) for t in ids])
    for name, res in att.items():
        scores = torch.zeros(B, C)
        rmask = torch.zeros(B, C, dtype=torch.bool)
        for i in range(B):
            L = int(batch.reasoning_len[i])
            scores[i, :L] = res.scores[i, :L]
            rmask[i, :L] = True
        ta, w = ops.reshape_advantages(adv, scores, rmask, s.completion_mask)
        methods[name] = [res.scores[i, : int(batch.reasoning_len[i])].tolist() for i in range(B)]
        token_adv[name] = [ta[i, : int(s.completion_mask[i].sum())].tolist() for i in range(B)]
        flat = [(float(res.scores[i, j]), i, j) for i in range(B) for j in range(int(batch.reasoning_len[i]))]
        flat.sort(reverse=True)
        top = [{"token": tokens[i][j], "completion": i + 1, "position": j, "score": sc} for sc, i, j in flat[: a.top]]
        record["methods"][name] = {"top_tokens": top, "stats": {k: v for k, v in res.stats.items()},
                                   "token_advantages": token_adv[name], "scores": methods[name]}
    write_heatmap(a.out, prob.question, prob.answer, tokens, rewards.tolist(), adv.tolist(), methods, token_adv)
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump(record, f, indent=1)
    print(f"Question: {prob.question}\nReference answer: {prob.answer}")
    if float(rewards.max()) == float(rewards.min()):
        print(f"Note: all {B} completions got reward {float(rewards[0]):.0f}, so every GRPO advantage is 0 and so is every "
              "token advantage; the importance scores below are still computed and shown.")
    for i in range(B):
        print(f"\n--- completion {i + 1}: reward {rewards[i]:.0f}, advantage {adv[i]:+.3f}")
        print(s.texts[i])
        for name in att:
            pairs = " ".join(f"{tokens[i][j]!r}:{token_adv[name][i][j]:+.2f}" for j in range(min(len(tokens[i]), 40)))
            print(f"  {name} per-token advantages (first 40): {pairs}")
    for name in att:
        print(f"\nTop {a.top} tokens by {name} importance:")
        for r in record["methods"][name]["top_tokens"]:
            print(f"  {r['token']!r:>14}  completion {r['completion']} pos {r['position']:>3}  I={r['score']:.4g}")
    print(f"\nHeatmap: {a.out}")
    return record
