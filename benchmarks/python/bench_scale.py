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
    window_probe W  1 clean + sum over t of (min(1 + W, T - keep - t) + keep) / T  (rerun_tail="probe": the probe
                window of ``keep`` tokens instead of the whole tail)
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
    "smollm2-135m": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                         vocab_size=49152),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=128),
}

GRPO_FORWARDS = 5.0
OAR_G_FORWARDS = 3.0


def unit_starts(L: int, unit_len: int) -> list[int]:
    """Starts of consecutive units of ``unit_len`` tokens covering L tokens (the last one may be shorter)."""
    return list(range(0, L, max(1, int(unit_len))))


def forwards_per_row(setting: str, L: int, prompt: int, tail: int, *, window: int = 8, unit_len: int = 25,
                     fraction: float = 0.1, group: int = 1, keep: int = 8) -> float:
    """Model forwards per row of ``setting`` (module docstring): token-columns run / T, T = prompt + L + tail.
    ``group``: rollouts sharing the prompt in one clean chunk (the prompt-once clean pass runs the prompt once per
    group: clean = 1 - (1 - 1/group) prompt / T; docs/design.md "Prompt-once clean pass"). ``keep``: the probe
    window (answer + suffix + 1 tokens), the only tail the ``*_probe`` settings re-run (``rerun_tail="probe"``)."""
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
    if setting == "window_probe":  # [t, t + 1 + W) and the probe window [T - keep, T)
        return clean + sum(min(1 + window, T - keep - (prompt + t)) + keep for t in range(L)) / T
    starts = unit_starts(L, unit_len)
    if setting == "span":
        return clean + sum(T - (prompt + s) for s in starts) / T
    if setting == "span_window":
        return clean + sum(min(min(s + unit_len, L) - s + window + tail, T - (prompt + s)) for s in starts) / T
    if setting == "span_window_probe":
        return clean + sum(min(min(s + unit_len, L) - s + window, T - keep - (prompt + s)) + keep for s in starts) / T
    if setting == "screened":
        mean_suffix = sum(T - (prompt + t) for t in range(L)) / L
        return forwards_per_row("window", L, prompt, tail, window=window, group=group) + fraction * L * mean_suffix / T
    raise ValueError(f"setting must be one of grpo, oar_g, exact, window, window_probe, span, span_window, "
                     f"span_window_probe, screened, got {setting!r}")


def cost_table(lengths, prompt: int, tail: int, window: int, unit_lens, fraction: float, group: int = 1,
               keep: int = 8) -> list[dict]:
    rows = []
    for L in lengths:
        settings = [("grpo", {}), ("oar_g", {}), ("exact", {}), (f"window W={window}", {"window": window}),
                    (f"window_probe W={window}", {"window": window}), ("window_probe W=4", {"window": 4}),
                    (f"screened W={window} f={fraction}", {"window": window, "fraction": fraction})]
        for u in unit_lens:
            settings += [(f"span {u}", {"unit_len": u}), (f"span_window {u} W={window}", {"unit_len": u,
                                                                                        "window": window}),
                         (f"span_window_probe {u} W={window}", {"unit_len": u, "window": window})]
        for name, kw in settings:
            kind = name.split()[0]
            f = forwards_per_row(kind, L, prompt, tail, group=group, keep=keep, **kw)
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
                  repeats: int = 1, budget_mb: int = 16384, settings=None, group: int = 1,
                  profile_dir: str | None = None) -> list[dict]:
    """Seconds and peak memory (CUDA) of each attribution setting on one row of L random reasoning tokens of a
    random-weight ``shape`` model, next to a GRPO-update proxy (a forward + backward of the policy over the rows).
    ``group`` > 1: one group of that many rollouts of the prompt, reasoning lengths L down to about L / 2, and each
    OAR-P setting also timed with the prompt-once clean pass off (``[each prompt]``), side by side.
    ``profile_dir``: afterwards one profiled call of each setting (:func:`_profile`)."""
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
    group = max(1, int(group))
    lens = [L - (i * L) // (2 * group) for i in range(group)]
    resps = []
    for n in lens:
        resp = torch.randint(6, 100, (n,), generator=g)
        resp[unit_len - 1::unit_len] = tok.convert_tokens_to_ids("\n")
        resps.append(resp)
    batch = ProbeContextBuilder(tok, "\nTherefore, the final answer is \\boxed{").build(
        [torch.randint(6, 100, (prompt,), generator=g)] * group, resps, ["42"] * group, lens)
    pm = HFProbeModel(model)
    spans = {r: [(s, min(s + unit_len, n)) for s in unit_starts(n, unit_len)] for r, n in enumerate(lens)}

    def oar_p_runs(m, tag=""):
        return {
            f"window W={window}{tag}": lambda: oar_p_window_scores(m, batch, window=window, memory_budget_mb=budget_mb),
            f"window_probe W={window}{tag}": lambda: oar_p_window_scores(m, batch, window=window, rerun_tail="probe",
                                                                        memory_budget_mb=budget_mb),
            f"span {unit_len}{tag}": lambda: oar_p_scores(m, batch, spans=spans, memory_budget_mb=budget_mb),
            f"span_window {unit_len} W={window}{tag}": lambda: oar_p_window_scores(
                m, batch, window=window, spans=spans, memory_budget_mb=budget_mb),
            f"span_window_probe {unit_len} W={window}{tag}": lambda: oar_p_window_scores(
                m, batch, window=window, spans=spans, rerun_tail="probe", memory_budget_mb=budget_mb),
        }

    runs = {"oar_g": lambda: oar_g_scores(pm, batch, memory_budget_mb=budget_mb,
                                          generator=torch.Generator().manual_seed(1))}
    runs.update(oar_p_runs(pm))
    if group > 1:  # the A/B of the prompt-once clean pass: same rows, every prompt run
        plain = HFProbeModel(model)
        plain.prompt_once_clean_pass = False
        runs.update(oar_p_runs(plain, " [each prompt]"))
    if settings:
        runs = {k: v for k, v in runs.items() if k.split()[0] in settings}

    def grpo_proxy():
        ids = batch.input_ids.to(dev)
        with torch.enable_grad():
            out = model(input_ids=ids, attention_mask=batch.attention_mask.to(dev), use_cache=False).logits
            out.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    rows = []
    order = [("grpo_update_proxy", grpo_proxy)] + list(runs.items())
    secs = {name: [] for name, _ in order}
    stats, peak = {}, {}
    # Round-robin: repeat k of every setting runs before repeat k + 1 of any, so a slower phase of the machine hits
    # every setting alike (the ratios are side by side); the first round warms up (compiles flex on CUDA).
    for _ in range(repeats + 1):
        for name, fn in order:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            _sync(dev)
            t0 = time.perf_counter()
            res = fn()
            _sync(dev)
            secs[name].append(time.perf_counter() - t0)
            stats[name] = getattr(res, "stats", {}) or {}
            if dev.type == "cuda":
                peak[name] = torch.cuda.max_memory_allocated(dev) / 2**30
    for name, _ in order:
        timed = sorted(secs[name][1:])[len(secs[name][1:]) // 2]
        st, pk = stats[name], peak.get(name)
        rows.append({"shape": shape, "L": L, "group": group, "setting": name, "seconds": round(timed, 3), "first_call_s":
                     round(secs[name][0], 3), "forwards": st.get("forward_passes"), "tokens": st.get("tokens"),
                     "variants": st.get("variants"), "peak_gib": None if pk is None else round(pk, 2)})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["seconds"]
    for r in rows:
        r["x_grpo_update"] = round(r["seconds"] / base, 2) if base else None
    if profile_dir:
        _profile(order, dev, profile_dir, f"{shape}_L{L}")
    return rows


def _profile(order, dev, out_dir: str, tag: str) -> None:
    """One more (warm) call of each setting under torch.profiler: the 25 operators and kernels with the most self
    device time (CUDA) or self CPU time, one text file per setting, ``profile_<tag>_<setting>.txt`` (where the
    engines' time goes, for the kernel work of docs/gpu.md)."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    for name, fn in order:
        _sync(dev)
        with profile(activities=acts) as prof:
            fn()
            _sync(dev)
        safe = "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")
        path = os.path.join(out_dir, f"profile_{tag}_{safe}.txt")
        with open(path, "w") as f:
            f.write(f"# {name}: {tag}, {dev}, sorted by {key}\n")
            f.write(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))
        print(f"[profile] {path}", flush=True)


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
    c.add_argument("--keep", type=int, default=8, help="probe window (answer + suffix + 1 tokens)")
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
    t.add_argument("--settings", nargs="*", help="subset: oar_g window window_probe span span_window "
                   "span_window_probe")
    t.add_argument("--group", type=int, default=1, help="rollouts of the prompt (> 1: prompt-once A/B rows)")
    t.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    t.add_argument("--out", default=None)
    t.add_argument("--no-full-blocks", action="store_true", help="FlexAttention without full-block lists (every "
                   "block partial: the mask function on every pair), the A/B of docs/gpu.md")
    t.add_argument("--profile", action="store_true", help="then one profiled call of each setting: the top "
                   "operators/kernels by self device (CPU) time, profile_*.txt under --out")
    a = ap.parse_args(argv)
    if a.cmd == "cost":
        rows = cost_table(a.lengths, a.prompt, a.tail, a.window, a.unit_len, a.fraction, a.group, a.keep)
        _write(rows, a.out, a.name, f"Forwards per row (prompt {a.prompt}, tail {a.tail}, probe window {a.keep}, "
               f"{a.group} rollouts per prompt; GRPO = {GRPO_FORWARDS:g})")
        for r in rows:
            print(r)
    else:
        if a.threads:
            torch.set_num_threads(a.threads)
        if a.no_full_blocks:
            import oar.attribution.model as model_mod

            model_mod._FLEX_FULL_BLOCKS = False
        rows = time_settings(a.shape, a.length, a.device, a.dtype, a.window, a.unit_len, a.prompt, a.repeats,
                             a.budget_mb, a.settings, a.group,
                             profile_dir=(a.out or ".") if a.profile else None)
        if a.out:
            g = f"_G{a.group}" if a.group > 1 else ""
            nf = "_no_full_blocks" if a.no_full_blocks else ""
            _write(rows, a.out, f"time_{a.shape}_L{a.length}{g}_{a.device}{nf}", f"{a.shape}, L = {a.length}, "
                   f"{a.group} rollout(s), prompt {a.prompt}, {a.device}, {a.dtype}, {torch.get_num_threads()} "
                   f"thread(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
