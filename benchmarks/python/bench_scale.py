"""OAR at the scale users train (issue 23): a cost model in forwards per row, and timings of the attribution settings
on a model of a real shape.

``cost``: model forwards per row (token-columns run / probe-context width T) of each setting against a GRPO step's,
for a response of L reasoning tokens after a P-token prompt, with a probe tail of ``tail`` tokens (conclude +
answer), and units of ``unit_len`` tokens (lines / sentences). The counts are exactly what the engines run
(``tests/python/test_bench_scale.py`` checks them against the engines' own ``tokens`` stats), so they carry over
to any model: the FLOPs of a forward scale with its shape, the count does not. Attention over T keys per re-run
token is not in the count (it adds ~T / (12 hidden) of a token's projections: 8% at 7B and 8k).

    grpo        5 forwards (old log-probs 1, reference 1, update forward + backward 3)
    oar_g       3 (a clean forward, a forward and a backward w.r.t. the input embeddings)
    (clean = 1 forward, or 1 - (1 - 1/G) P / T with G rollouts per prompt: the prompt-once clean pass)
    exact       1 clean + sum over tokens t of (T - t) / T      (the prefix engine: each variant re-runs [t, T))
    window W    1 clean + sum over tokens t of min(1 + W + tail, T - t) / T
    span        1 clean + sum over units u of (T - start_u) / T
    span_window 1 clean + sum over units u of min(len_u + W + tail, T - start_u) / T
    screened f  the window screen + f x L exact variants of mean suffix (T - t)

``time``: one row of L reasoning tokens on a random-weight model of a named shape (timings only: random weights
mean nothing for fidelity), each setting timed on ``--device`` (CUDA: synchronised), with peak memory on CUDA.

Usage:
    python benchmarks/python/bench_scale.py cost [--lengths 2048 4096 8192] [--unit-len 25] [--group 8]
        [--out docs/benchmarks/scale] [--name cost_model]
    python benchmarks/python/bench_scale.py time --shape qwen2.5-1.5b --length 4096 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time

import torch

#: Model shapes (hidden, layers, heads, kv heads, intermediate, vocab) of the families users train.
SHAPES = {
    "qwen2.5-1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                         vocab_size=151936),
    "qwen2.5-7b": dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944,
                       vocab_size=152064),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=128),
}

GRPO_FORWARDS = 5.0
OAR_G_FORWARDS = 3.0


def unit_starts(L: int, unit_len: int) -> list[int]:
    """Starts of consecutive units of ``unit_len`` tokens covering L tokens (the last one may be shorter)."""
    return list(range(0, L, max(1, int(unit_len))))


def forwards_per_row(setting: str, L: int, prompt: int, tail: int, *, window: int = 8, unit_len: int = 25,
                     fraction: float = 0.1, group: int = 1) -> float:
    """Model forwards per row of ``setting`` (module docstring): token-columns run / T, T = prompt + L + tail.
    ``group``: rollouts sharing the prompt in one clean chunk (the prompt-once clean pass runs the prompt once per
    group: clean = 1 - (1 - 1/group) prompt / T; docs/design.md "Prompt-once clean pass")."""
    T = prompt + L + tail
    clean = 1 - (1 - 1 / max(1, int(group))) * prompt / T
    if setting == "grpo":
        return GRPO_FORWARDS
    if setting == "oar_g":
        return OAR_G_FORWARDS
    if setting == "exact":
        return clean + sum(T - (prompt + t) for t in range(L)) / T
    if setting == "window":  # a window reaching the tail re-runs [t, T) once
        return clean + sum(min(1 + window + tail, T - (prompt + t)) for t in range(L)) / T
    starts = unit_starts(L, unit_len)
    if setting == "span":
        return clean + sum(T - (prompt + s) for s in starts) / T
    if setting == "span_window":
        return clean + sum(min(min(s + unit_len, L) - s + window + tail, T - (prompt + s)) for s in starts) / T
    if setting == "screened":
        mean_suffix = sum(T - (prompt + t) for t in range(L)) / L
        return forwards_per_row("window", L, prompt, tail, window=window, group=group) + fraction * L * mean_suffix / T
    raise ValueError(f"setting must be one of grpo, oar_g, exact, window, span, span_window, screened, got {setting!r}")


def cost_table(lengths, prompt: int, tail: int, window: int, unit_lens, fraction: float, group: int = 1) -> list[dict]:
    rows = []
    for L in lengths:
        settings = [("grpo", {}), ("oar_g", {}), ("exact", {}), (f"window W={window}", {"window": window}),
                    (f"screened W={window} f={fraction}", {"window": window, "fraction": fraction})]
        for u in unit_lens:
            settings += [(f"span {u}", {"unit_len": u}), (f"span_window {u} W={window}", {"unit_len": u,
                                                                                        "window": window})]
        for name, kw in settings:
            kind = name.split()[0]
            f = forwards_per_row(kind, L, prompt, tail, group=group, **kw)
            rows.append({"L": L, "setting": name, "forwards_per_row": round(f, 2),
                         "x_grpo": round(f / GRPO_FORWARDS, 2), "attribution_x_grpo_step": round(1 + f / GRPO_FORWARDS, 2)
                         if kind != "grpo" else 1.0})
    return rows


def _write(rows: list[dict], out: str, name: str, title: str) -> None:
    os.makedirs(out, exist_ok=True)
    keys = list(rows[0])
    with open(os.path.join(out, f"{name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(f"# {title}\n\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n")
        for r in rows:
            f.write("| " + " | ".join(str(r[k]) for k in keys) + " |\n")


# ---- timings ---------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_settings(shape: str, L: int, device: str, dtype: str, window: int, unit_len: int, prompt: int = 200,
                  repeats: int = 1, budget_mb: int = 16384, settings=None) -> list[dict]:
    """Seconds and peak memory (CUDA) of each attribution setting on one row of L random reasoning tokens of a
    random-weight ``shape`` model, next to a GRPO-update proxy (a forward + backward of the policy over the row)."""
    from oar.app.models import minimal_tokenizer, tiny_random_llama
    from oar.attribution import (HFProbeModel, ProbeContextBuilder, oar_g_scores, oar_p_scores,
                                 oar_p_window_scores)

    dev = torch.device(device)
    dt = getattr(torch, dtype)
    cfg = dict(SHAPES[shape])
    model, _ = tiny_random_llama(vocab_size=cfg.pop("vocab_size"), hidden_size=cfg.pop("hidden_size"),
                                 num_layers=cfg.pop("num_layers"), tokenizer="minimal", seed=0,
                                 max_position_embeddings=prompt + L + 256, dtype=dt, device=dev, **cfg)
    model.eval()
    tok = minimal_tokenizer()
    g = torch.Generator().manual_seed(0)
    # printable characters (ids 6..99 of the minimal tokenizer) with a newline every unit_len tokens
    resp = torch.randint(6, 100, (L,), generator=g)
    resp[unit_len - 1::unit_len] = tok.convert_tokens_to_ids("\n")
    batch = ProbeContextBuilder(tok, "\nTherefore, the final answer is \\boxed{").build(
        [torch.randint(6, 100, (prompt,), generator=g)], [resp], ["42"], [L])
    pm = HFProbeModel(model)
    starts = unit_starts(L, unit_len)
    spans = {0: [(s, min(s + unit_len, L)) for s in starts]}
    runs = {
        "oar_g": lambda: oar_g_scores(pm, batch, memory_budget_mb=budget_mb, generator=torch.Generator().manual_seed(1)),
        f"window W={window}": lambda: oar_p_window_scores(pm, batch, window=window, memory_budget_mb=budget_mb),
        f"span {unit_len}": lambda: oar_p_scores(pm, batch, spans=spans, memory_budget_mb=budget_mb),
        f"span_window {unit_len} W={window}": lambda: oar_p_window_scores(pm, batch, window=window, spans=spans,
                                                                         memory_budget_mb=budget_mb),
    }
    if settings:
        runs = {k: v for k, v in runs.items() if k.split()[0] in settings}

    def grpo_proxy():
        ids = batch.input_ids.to(dev)
        with torch.enable_grad():
            out = model(input_ids=ids, attention_mask=batch.attention_mask.to(dev), use_cache=False).logits
            out.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    rows = []
    for name, fn in [("grpo_update_proxy", grpo_proxy)] + list(runs.items()):
        secs, stats, peak = [], {}, None
        for _ in range(repeats + 1):  # the first call warms up (compiles the flex kernel on CUDA)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            _sync(dev)
            t0 = time.perf_counter()
            res = fn()
            _sync(dev)
            secs.append(time.perf_counter() - t0)
            stats = getattr(res, "stats", {}) or {}
            if dev.type == "cuda":
                peak = torch.cuda.max_memory_allocated(dev) / 2**30
        timed = sorted(secs[1:])[len(secs[1:]) // 2]
        rows.append({"shape": shape, "L": L, "setting": name, "seconds": round(timed, 3), "first_call_s":
                     round(secs[0], 3), "forwards": stats.get("forward_passes"), "tokens": stats.get("tokens"),
                     "variants": stats.get("variants"), "peak_gib": None if peak is None else round(peak, 2)})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["seconds"]
    for r in rows:
        r["x_grpo_update"] = round(r["seconds"] / base, 2) if base else None
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cost", help="forwards per row of each setting (no model is run)")
    c.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    c.add_argument("--prompt", type=int, default=200)
    c.add_argument("--tail", type=int, default=40)
    c.add_argument("--window", type=int, default=8)
    c.add_argument("--unit-len", type=int, nargs="+", default=[12, 25, 50])
    c.add_argument("--fraction", type=float, default=0.1)
    c.add_argument("--group", type=int, default=1, help="rollouts per prompt in a clean chunk (prompt-once clean pass)")
    c.add_argument("--name", default="cost_model", help="file name of the table under --out")
    c.add_argument("--out", default="docs/benchmarks/scale")
    t = sub.add_parser("time", help="time the settings on a random-weight model of a real shape")
    t.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    t.add_argument("--length", type=int, default=4096)
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--dtype", default="bfloat16")
    t.add_argument("--window", type=int, default=8)
    t.add_argument("--unit-len", type=int, default=25)
    t.add_argument("--prompt", type=int, default=200)
    t.add_argument("--repeats", type=int, default=1)
    t.add_argument("--budget-mb", type=int, default=16384)
    t.add_argument("--settings", nargs="*", help="subset: oar_g window span span_window")
    t.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.cmd == "cost":
        rows = cost_table(a.lengths, a.prompt, a.tail, a.window, a.unit_len, a.fraction, a.group)
        _write(rows, a.out, a.name, f"Forwards per row (prompt {a.prompt}, tail {a.tail}, {a.group} rollouts per "
               f"prompt; GRPO = {GRPO_FORWARDS:g})")
        for r in rows:
            print(r)
    else:
        rows = time_settings(a.shape, a.length, a.device, a.dtype, a.window, a.unit_len, a.prompt, a.repeats,
                             a.budget_mb, a.settings)
        if a.out:
            _write(rows, a.out, f"time_{a.shape}_L{a.length}_{a.device}", f"{a.shape}, L = {a.length}, {a.device}, "
                   f"{a.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
