"""Cost of OAR attribution relative to a plain GRPO step, providers side by side in one run (issue 3, §3).

One "step" = sampling the rollouts (``model.generate``), rewards + group advantages, [attribution,]
and the policy update (forward + backward of the token-level policy-gradient loss + AdamW step). In
each repeat the rollouts are generated once, then every provider's attribution runs on the same
rollouts, so the providers are compared on identical work; step time of provider X = generation +
update + attribution_X, and its ratio is divided by the GRPO step (generation + update) of the same
repeat. Medians over repeats after one warm-up repeat.

Providers:
  grpo                  no attribution
  oar_g                 OAR-G (1 noise draw, answer_mean; skips rows with A = 0, as the hook does)
  oar_p                 ours: prefix-KV OAR-P engine (skips rows with A = 0, as the hook does)
  oar_p_all_rows        ours on every row (what the naive providers do)
  oar_p_naive_batched   oar.reference.oar_p_naive(mode="batched"): full masked contexts, full logits
  oar_p_naive_serial    oar.reference.oar_p_naive(mode="serial"): one masked context per forward
  oar_p_window{W}       windowed OAR-P (issue 13's screen): each masked token re-runs only the next W reasoning
                        tokens and the probe tail (--windows; never strided)
  oar_p_window{W}_each_prompt  the same with the prompt-once clean pass off (every row runs its prompt; the
                        A/B of docs/design.md "Prompt-once clean pass")
  oar_p_screen{f}       screened OAR-P (issue 13) with the window screen (--screen-window, the config default 8;
                        its time counts), then exact masking of the screen's top f plus a random --screen-sample of
                        the rest (never strided)
  oar_p_gscreen{f}      the same with the oar_g run above as the screen

Fidelity (--fidelity, on by default): in the first timed repeat, at response lengths <= --fidelity-max-len, exact
OAR-P is run on every token of the active rows (untimed) and each of oar_g, oar_p_window{W}, oar_p_screen{f} and
oar_p_gscreen{f} is compared with it,
row by row: Spearman rank correlation, top-10% overlap, mean |w - w_exact| of the reshaped weights.

Suites:
  default   SmolLM2-135M-Instruct on the built-in arithmetic task, 4 prompts x G = 4, up to 96 new tokens
  fixed     a fixed-shape random Llama (hidden 128, 4 layers, 4 heads, vocab 4096), prompt 64 tokens,
            one group of G = 4 rollouts of exactly L response tokens (L in --lengths), rewards 1, 0, 1, 0

OAR-P is exact, so its cost grows like L x context per rollout. Where --stride k > 1 (by default for the
naive providers everywhere and for all OAR-P providers at L >= 512), providers score every k-th
reasoning token and their time is multiplied by k: the table marks those rows "x k (extrapolated)".

Usage:  python benchmarks/python/bench_step.py [--suite default fixed] [--lengths 128 512 2048]
            [--repeats 3] [--device cpu|cuda] [--dtype float32|bfloat16] [--out docs/benchmarks/step]
            [--screen-fractions 0.01 0.02 0.05 0.1] [--screen-sample 0.02] [--screen-window 8] [--windows 2 8]
            [--no-naive] [--no-fidelity]
        (writes .md, .csv, .json next to --out). On a GPU every timed section ends with a device sync.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import time

import torch

import oar
from oar import ops, reference
from oar.attribution import HFProbeModel, ProbeContextBuilder, oar_g_scores, oar_p_scores, oar_p_window_scores
from oar.attribution.screened import oar_p_screened_scores
from oar.app.eval_attribution import reshaped_weights_l1, top_overlap
from oar.app.stats import spearman


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


_DEVICE = torch.device("cpu")


def _sync() -> None:
    if _DEVICE.type == "cuda":
        torch.cuda.synchronize(_DEVICE)


def _timed(fn):
    """(fn(), wall seconds); on a GPU the queued work is finished before each clock read."""
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def _update(model, opt, prompt_ids, comp_ids, comp_mask, tok_adv, pad_id):
    """Token-level policy-gradient update (the PPO-clip loss at ratio 1): -(A_t * logp_t) token mean."""
    B = comp_ids.shape[0]
    P = max(len(p) for p in prompt_ids)
    ids = torch.full((B, P + comp_ids.shape[1]), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, P - len(p):P] = torch.as_tensor(p)
        attn[i, P - len(p):P] = 1
    ids[:, P:] = comp_ids.cpu()
    attn[:, P:] = comp_mask.long().cpu()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    ids, attn, pos = ids.to(_DEVICE), attn.to(_DEVICE), pos.to(_DEVICE)
    comp_ids, comp_mask, tok_adv = comp_ids.to(_DEVICE), comp_mask.to(_DEVICE), tok_adv.to(_DEVICE)
    model.train()
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=comp_ids.shape[1] + 1).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, comp_ids[..., None])[..., 0]
    m = comp_mask.float()
    loss = -(tok_adv * logp * m).sum() / m.sum().clamp_min(1)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    model.eval()


class Rollouts:
    """One generation batch: prompts, completions, rewards, sequence advantages, answers."""

    def __init__(self, prompt_ids, comp_ids, comp_mask, rewards, answers, group_size):
        self.prompt_ids, self.comp_ids, self.comp_mask = prompt_ids, comp_ids, comp_mask
        self.rewards, self.answers = rewards, answers
        self.adv = ops.group_advantages(rewards, group_size=group_size, preset="trl")


def _generate(model, tok, prompts: list[list[int]], G: int, max_new: int, min_new: int, temperature: float):
    ids = [p for p in prompts for _ in range(G)]
    P = max(len(p) for p in ids)
    x = torch.full((len(ids), P), tok.pad_token_id, dtype=torch.long)
    a = torch.zeros_like(x)
    for i, p in enumerate(ids):
        x[i, P - len(p):] = torch.as_tensor(p)
        a[i, P - len(p):] = 1
    kw = dict(max_new_tokens=max_new, min_new_tokens=min_new, pad_token_id=tok.pad_token_id, top_k=0,
              do_sample=True, temperature=temperature)
    with torch.no_grad():
        out = model.generate(input_ids=x.to(_DEVICE), attention_mask=a.to(_DEVICE), **kw)
    comp = out[:, P:].cpu()
    mask = torch.ones_like(comp, dtype=torch.bool)
    eos = tok.eos_token_id
    if min_new < max_new:
        for i in range(comp.shape[0]):
            hit = (comp[i] == eos).nonzero()
            if hit.numel():
                mask[i, int(hit[0]) + 1:] = False
    return ids, comp, mask


def _providers(args, L_reasoning: int):
    stride_naive = args.naive_stride
    stride_ours = 1 if L_reasoning < 512 else max(1, L_reasoning // 128)
    return stride_naive, stride_ours


def _positions(batch, rows, stride: int):
    return {r: list(range(0, int(batch.reasoning_len[r]), stride)) for r in rows}


def run_repeat(model, tok, opt, roll: Rollouts, args, strides, conclude, gen_s) -> dict:
    """Times every provider on one generation batch. Returns gen/update seconds and {provider: seconds}.

    Every provider pays the probe-context construction (reasoning-span search, conclude + answer ids),
    timed once and added to each. OAR-G and ours skip rows whose advantage is 0, like the hook does."""
    stride_naive, stride_ours = strides
    builder = ProbeContextBuilder(tok, conclude)
    responses = [roll.comp_ids[i][roll.comp_mask[i]] for i in range(roll.comp_ids.shape[0])]
    lens = args.reasoning_lens(responses) if args.reasoning_lens else None
    batch, build_s = _timed(lambda: builder.build(roll.prompt_ids, responses, roll.answers, lens))
    pm = HFProbeModel(model)
    active = [i for i in range(batch.batch_size) if float(roll.adv[i]) != 0.0 and int(batch.reasoning_len[i]) > 0]
    every = [i for i in range(batch.batch_size) if int(batch.reasoning_len[i]) > 0]
    times = {"grpo": 0.0}
    gen = torch.Generator().manual_seed(0)
    screen, t = _timed(lambda: oar_g_scores(pm, batch, rows=active, generator=gen, memory_budget_mb=args.budget_mb))
    times["oar_g"] = t + build_s
    windowed, t_win = {}, {}
    for w in dict.fromkeys(list(args.windows) + ([args.screen_window] if args.screen_fractions else [])):
        windowed[w], t_win[w] = _timed(lambda: oar_p_window_scores(pm, batch, window=w, rows=active,
                                                                   memory_budget_mb=args.budget_mb,
                                                                   keep_clean_pass=True))
        if w in args.windows:
            times[f"oar_p_window{w}"] = t_win[w] + build_s
    # The same windowed engine with every row's prompt run in the clean pass (the prompt-once clean pass off):
    # the A/B of docs/design.md "Prompt-once clean pass", on the same rollouts.
    pm_plain = HFProbeModel(model)
    pm_plain.prompt_once_clean_pass = False
    for w in args.windows:
        _, t_plain = _timed(lambda: oar_p_window_scores(pm_plain, batch, window=w, rows=active,
                                                        memory_budget_mb=args.budget_mb))
        times[f"oar_p_window{w}_each_prompt"] = t_plain + build_s
    screened = {}
    for kind, scr, t_scr in (("screen", windowed.get(args.screen_window), t_win.get(args.screen_window)),
                             ("gscreen", screen, t)):
        for f in args.screen_fractions:
            g = torch.Generator().manual_seed(1)
            screened[f"oar_p_{kind}{f:g}"], ts = _timed(
                lambda: oar_p_screened_scores(pm, batch, scr, fraction=f, sample_fraction=args.screen_sample,
                                              rows=active, generator=g, memory_budget_mb=args.budget_mb))
            times[f"oar_p_{kind}{f:g}"] = t_scr + ts + build_s
    fidelity = {}
    if args.fidelity_now and active:
        exact = oar_p_scores(pm, batch, rows=active, memory_budget_mb=args.budget_mb)  # untimed reference
        cfg = oar.OARConfig()
        for name, att in ([("oar_g", screen)] + [(f"oar_p_window{w}", windowed[w]) for w in args.windows]
                          + list(screened.items())):
            per = {"spearman": [], "top10_overlap": [], "weights_l1": []}
            for i in active:
                L = int(batch.reasoning_len[i])
                a, e = att.scores[i, :L].tolist(), exact.scores[i, :L].tolist()
                rho = spearman(a, e)
                if rho is not None:
                    per["spearman"].append(rho)
                per["top10_overlap"].append(top_overlap(a, e, 10))
                per["weights_l1"].append(reshaped_weights_l1(a, e, cfg))
            fidelity[name] = {k: statistics.mean(v) if v else float("nan") for k, v in per.items()}
            if "screen" in name:
                fidelity[name]["masked_frac"] = att.stats["masked"] / max(att.stats["scored_tokens"], 1)
    for name, rows in (("oar_p", active), ("oar_p_all_rows", every)):
        pos = _positions(batch, rows, stride_ours) if stride_ours > 1 else None
        _, t = _timed(lambda: oar_p_scores(pm, batch, rows=rows, positions=pos, memory_budget_mb=args.budget_mb))
        times[name] = t * stride_ours + build_s
    if args.naive:
        pos_n = _positions(batch, every, stride_naive)
        _, t = _timed(lambda: reference.oar_p_naive(model, batch, mode="batched", rows=every, positions=pos_n,
                                                     variants_per_forward=args.naive_batch))
        times["oar_p_naive_batched"] = t * stride_naive + build_s
        _, t = _timed(lambda: reference.oar_p_naive(model, batch, mode="serial", rows=every, positions=pos_n))
        times["oar_p_naive_serial"] = t * stride_naive + build_s
    tok_adv = roll.adv[:, None] * roll.comp_mask.float()
    _, upd_s = _timed(lambda: _update(model, opt, roll.prompt_ids, roll.comp_ids, roll.comp_mask, tok_adv,
                                      tok.pad_token_id))
    return {"gen": gen_s, "update": upd_s, "attr": times, "skipped_rows": 1 - len(active) / max(len(every), 1),
            "reasoning_tokens": float(batch.reasoning_len.float().mean()), "fidelity": fidelity}


def suite_default(args) -> list[dict]:
    from oar.app.models import load_model
    from oar.app.tasks import get_task

    model, tok = load_model("smollm2-135m-instruct")
    model.to(device=_DEVICE, dtype=args.torch_dtype).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    task = get_task("arithmetic")
    problems = task.problems("train", n=4 * (args.repeats + 1), seed=0)
    cfg = oar.OARConfig()
    rows = []
    args.reasoning_lens = None
    for rep in range(args.repeats + 1):
        probs = problems[4 * rep: 4 * rep + 4]
        prompts = [tok.apply_chat_template(task.prompt(p), add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"] for p in probs]
        (ids, comp, mask), gen_s = _timed(lambda: _generate(model, tok, prompts, 4, 96, 1, 0.9))
        texts = [tok.decode(comp[i][mask[i]], skip_special_tokens=True) for i in range(comp.shape[0])]
        rewards = torch.tensor([task.reward(t, probs[i // 4]) for i, t in enumerate(texts)])
        roll = Rollouts(ids, comp, mask, rewards, [probs[i // 4].answer for i in range(len(ids))], 4)
        args.fidelity_now = args.fidelity and rep == 1
        r = run_repeat(model, tok, opt, roll, args, (args.naive_stride, 1), cfg.conclude, gen_s)
        r["strides"] = (args.naive_stride, 1)
        r.update(suite="default", length=96, repeat=rep)
        print(f"[default] repeat {rep}: gen {gen_s:.1f}s update {r['update']:.1f}s "
              + " ".join(f"{k} {v:.1f}s" for k, v in r["attr"].items()), flush=True)
        rows.append(r)
    return rows


def suite_fixed(args) -> list[dict]:
    from oar.testing import tiny_random_llama

    rows = []
    for L in args.lengths:
        model, tok = tiny_random_llama(vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4, seed=0,
                                       tokenizer="minimal", max_position_embeddings=L + 256)
        model.to(device=_DEVICE, dtype=args.torch_dtype)
        model.generation_config.eos_token_id = None  # fixed length: never stop early
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        g = torch.Generator().manual_seed(L)
        prompt = torch.randint(4, 101, (64,), generator=g).tolist()
        args.reasoning_lens = lambda responses: [len(r) for r in responses]  # the whole response is reasoning
        for rep in range(args.repeats + 1):
            (ids, comp, mask), gen_s = _timed(lambda: _generate(model, tok, [prompt], 4, L, L, 1.0))
            roll = Rollouts(ids, comp, mask, torch.tensor([1.0, 0.0, 1.0, 0.0]), ["42"] * 4, 4)
            strides = _providers(args, L)
            args.fidelity_now = args.fidelity and rep == 1 and L <= args.fidelity_max_len
            r = run_repeat(model, tok, opt, roll, args, strides, oar.OARConfig().conclude, gen_s)
            r.update(suite="fixed", length=L, repeat=rep, strides=strides)
            print(f"[fixed L={L}] repeat {rep}: gen {gen_s:.1f}s update {r['update']:.2f}s "
                  + " ".join(f"{k} {v:.2f}s" for k, v in r["attr"].items()), flush=True)
            rows.append(r)
    return rows


def summarize(rows: list[dict], args) -> list[dict]:
    out = []
    keys = sorted({(r["suite"], r["length"]) for r in rows}, key=lambda x: (x[0] != "default", x[1]))
    for suite, L in keys:
        reps = [r for r in rows if r["suite"] == suite and r["length"] == L and r["repeat"] > 0] or \
               [r for r in rows if r["suite"] == suite and r["length"] == L]
        base = [r["gen"] + r["update"] for r in reps]
        strides = reps[0].get("strides", (args.naive_stride, 1))
        for prov in reps[0]["attr"]:
            step = [r["gen"] + r["update"] + r["attr"][prov] for r in reps]
            ratio = statistics.median(s / b for s, b in zip(step, base))
            k = strides[0] if "naive" in prov else (strides[1] if prov in ("oar_p", "oar_p_all_rows") else 1)
            fid = next((r["fidelity"][prov] for r in reps if prov in r.get("fidelity", {})), {})
            out.append({"suite": suite, "response_len": L, "provider": prov,
                        "attribution_s": statistics.median(r["attr"][prov] for r in reps),
                        "grpo_step_s": statistics.median(base), "ratio_to_grpo": ratio,
                        "extrapolated_stride": k,
                        "skipped_rows_frac": statistics.median(r["skipped_rows"] for r in reps),
                        "mean_reasoning_tokens": statistics.median(r["reasoning_tokens"] for r in reps),
                        "masked_frac": fid.get("masked_frac", ""), "spearman_vs_exact": fid.get("spearman", ""),
                        "top10_overlap_vs_exact": fid.get("top10_overlap", ""),
                        "weights_l1_vs_exact": fid.get("weights_l1", "")})
    # speed-up of ours over naive batched, per (suite, L)
    for o in out:
        nb = next((x for x in out if x["suite"] == o["suite"] and x["response_len"] == o["response_len"]
                   and x["provider"] == "oar_p_naive_batched"), None)
        o["naive_batched_over_this"] = (nb["attribution_s"] / o["attribution_s"] if nb and o["attribution_s"] > 0
                                        else None)
    return out


def write(summary: list[dict], rows: list[dict], out: str, dtype: str = "float32") -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    meta = {"torch": torch.__version__, "oar": oar.__version__, "commit": _commit(), "device": str(_DEVICE),
            "device_name": torch.cuda.get_device_name(_DEVICE) if _DEVICE.type == "cuda" else
            (platform.processor() or platform.machine()), "threads": torch.get_num_threads(),
            "dtype": dtype}
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "summary": summary, "raw": rows}, f, indent=1, default=str)
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    where = (f"cuda ({meta['device_name']})" if _DEVICE.type == "cuda" else f"cpu ({meta['threads']} threads)")
    lines = [f"Device {where}, {meta['dtype']}, torch {meta['torch']}, oar {meta['oar']}, commit {meta['commit']}.",
             "", "| suite | response len | provider | attribution s | GRPO step s | step / GRPO step | naive batched / this "
                 "| masked | Spearman vs exact | top-10% overlap | weights L1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def num(v, fmt=".3f"):
        return "-" if v == "" or v is None else format(v, fmt)

    for s in summary:
        note = f" (x{s['extrapolated_stride']} extrapolated)" if s["extrapolated_stride"] > 1 else ""
        nb = f"{s['naive_batched_over_this']:.2f}" if s["naive_batched_over_this"] else "-"
        lines.append(f"| {s['suite']} | {s['response_len']} | {s['provider']}{note} | {s['attribution_s']:.2f} | "
                     f"{s['grpo_step_s']:.2f} | {s['ratio_to_grpo']:.2f}x | {nb} | {num(s['masked_frac'], '.2f')} | "
                     f"{num(s['spearman_vs_exact'])} | {num(s['top10_overlap_vs_exact'])} | "
                     f"{num(s['weights_l1_vs_exact'])} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", nargs="+", default=["default", "fixed"], choices=["default", "fixed"])
    p.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 2048])
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up repeat")
    p.add_argument("--naive-stride", type=int, default=4,
                   help="naive providers score every k-th reasoning token; time x k")
    p.add_argument("--naive-batch", type=int, default=16, help="variants per forward of the naive batched provider")
    p.add_argument("--no-naive", dest="naive", action="store_false",
                   help="skip the naive OAR-P providers (the slowest: their table is in docs/benchmarks.md)")
    p.add_argument("--budget-mb", type=int, default=2048, help="OAR-P memory budget of our engine")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (model, generation, update, attribution)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model weights and activations")
    p.add_argument("--screen-fractions", nargs="*", type=float, default=[0.01, 0.02, 0.05, 0.1],
                   help="screened OAR-P providers: top fractions of the screen masked exactly")
    p.add_argument("--screen-sample", type=float, default=0.02, help="screened OAR-P random sample fraction")
    p.add_argument("--screen-window", type=int, default=8, help="window of the window screen of oar_p_screen{f}")
    p.add_argument("--windows", nargs="*", type=int, default=[2, 8], help="windowed OAR-P providers (none: skip)")
    p.add_argument("--no-fidelity", dest="fidelity", action="store_false",
                   help="skip the comparison of oar_g and screened OAR-P with exact OAR-P")
    p.add_argument("--fidelity-max-len", type=int, default=512,
                   help="compare with exact OAR-P at response lengths up to this (exact is ~L^2/2 token-forwards)")
    p.add_argument("--out", default="docs/benchmarks/step")
    args = p.parse_args(argv)
    args.fidelity_now = False
    global _DEVICE
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch has no CUDA device available")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    _DEVICE = device
    args.torch_dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    rows = []
    if "default" in args.suite:
        rows += suite_default(args)
    if "fixed" in args.suite:
        rows += suite_fixed(args)
    write(summarize(rows, args), rows, args.out, args.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
