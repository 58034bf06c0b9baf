"""OAR at the scale users train (issue 23): a cost model in forwards per row, and timings of the attribution settings
on a model of a real shape.

``cost``: model forwards per row (token-columns run / probe-context width T) of each setting against a GRPO step's,
for a response of L reasoning tokens after a P-token prompt, with a probe tail of ``tail`` tokens (conclude +
answer), and units of ``unit_len`` tokens (lines / sentences). The counts are exactly what the engines run
(``tests/python/project/test_bench_scale.py`` checks them against the engines' own ``tokens`` stats), so they carry over
to any model: the FLOPs of a forward scale with its shape, the count does not. Attention over T keys per re-run
token is not in the count (it adds ~T / (12 hidden) of a token's projections: 8% at 7B and 8k).

    grpo        5 forwards (old log-probs 1, reference 1, update forward + backward 3)
    oar_g       3 (a clean forward, a forward and a backward w.r.t. the input embeddings)
    (clean = 1 forward, or 1 - (1 - 1/G) P / T with G rollouts per prompt: the prompt-once clean pass)
    exact       1 clean + sum over tokens t of (T - t) / T      (the prefix engine: each variant re-runs [t, T))
    window W    1 clean + sum over tokens t of min(1 + W + tail, T - t) / T
    window_probe W  1 clean + sum over t of (min(1 + W, T - keep - t) + keep) / T  (rerun_tail="probe": the probe
                window of ``keep`` tokens instead of the whole tail)
    window_linear W  1 clean (the whole row: no prompt-once) + sum over t of (1 + W, or T - t when the window reaches
                the tail) / T + tail x (1 + 2 R) / T (screen_tail "linear": the Jacobian's tail forward and R = 33
                output gradients, each counted as 2 tail columns; ``cost_tokens`` of oar_p_linear_tail_scores)
    span        1 clean + sum over units u of (T - start_u) / T
    span_window 1 clean + sum over units u of min(len_u + W + tail, T - start_u) / T
    screened f  the window screen + f x L exact variants of mean suffix (T - t)

``time``: one row of L reasoning tokens on a random-weight model of a named shape (timings only: random weights
mean nothing for fidelity), each setting timed on ``--device`` (CUDA: synchronised), with peak memory on CUDA.

Usage:
    python benchmarks/python/bench_scale.py cost [--lengths 2048 4096 8192] [--unit-len 25] [--group 8]
        [--out docs/benchmarks/scale] [--name cost_model]
    python benchmarks/python/bench_scale.py time --shape qwen2.5-1.5b --length 4096 --device cuda --dtype bfloat16
    python benchmarks/python/bench_scale.py blocks [--length 4096] [--windows 4 8]   # FlexAttention's block lists
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
#: readouts of the linear tail's Jacobian at its default top_r = 32 (and the rest cell)
LINEAR_READOUTS = 33


def unit_starts(L: int, unit_len: int) -> list[int]:
    """Starts of consecutive units of ``unit_len`` tokens covering L tokens (the last one may be shorter)."""
    return list(range(0, L, max(1, int(unit_len))))


def forwards_per_row(setting: str, L: int, prompt: int, tail: int, *, window: int = 8, unit_len: int = 25,
                     fraction: float = 0.1, group: int = 1, keep: int = 8) -> float:
    """Model forwards per row of ``setting`` (module docstring): token-columns run / T, T = prompt + L + tail.
    ``group``: rollouts sharing the prompt in one clean chunk (the prompt-once clean pass runs the prompt once per
    group: clean = 1 - (1 - 1/group) prompt / T; docs/design.md "Prompt-once clean pass"). ``keep``: the probe
    window (the answer-predicting positions, ``ProbeBatch.probe_view``), the only tail the ``*_probe`` settings
    re-run (``rerun_tail="probe"``)."""
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
    if setting == "window_linear":  # [t, t + 1 + W); a window reaching the tail re-runs [t, T) exactly
        cols = sum(1 + window if t + 1 + window < L else T - (prompt + t) for t in range(L))
        return 1 + (cols + tail * (1 + 2 * LINEAR_READOUTS)) / T
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
    raise ValueError(f"setting must be one of grpo, oar_g, exact, window, window_probe, window_linear, span, "
                     f"span_window, span_window_probe, screened, got {setting!r}")


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
    """``rows`` as ``<out>/<name>.csv`` and a Markdown table ``<name>.md`` (columns: every key in order of first
    appearance; a missing value is empty). Each file is written to a temporary name and renamed: a run stopped
    while writing leaves the previous complete table, never a partial one."""
    os.makedirs(out, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    path = os.path.join(out, f"{name}.csv")
    with open(path + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, restval="")
        w.writeheader()
        w.writerows(rows)
    os.replace(path + ".tmp", path)
    path = os.path.join(out, f"{name}.md")
    with open(path + ".tmp", "w") as f:
        f.write(f"# {title}\n\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n")
        for r in rows:
            f.write("| " + " | ".join("" if r.get(k) is None else str(r.get(k)) for k in keys) + " |\n")
    os.replace(path + ".tmp", path)


# ---- timings ---------------------------------------------------------------------------------------------------

#: Engine settings ``time`` knows (``--settings`` picks a subset; ``dense`` and ``grpo``, the reference rows, always run).
TIME_SETTINGS = ("dense", "grpo", "oar_g", "exact", "window", "window_probe", "window_linear", "span", "span_window",
                 "span_window_probe")
#: Forwards of a GRPO step that the update proxy (one forward + backward = 3) stands for: old log-probs 1,
#: reference 1, update 3 (module docstring).
GRPO_STEP_OVER_PROXY = GRPO_FORWARDS / 3.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def _setting_cost(name: str, L: int, prompt: int, tail: int, window: int, unit_len: int, keep: int,
                  exact_stride: int) -> float | None:
    """The cost model's forwards per row (:func:`forwards_per_row`) of a timed setting ``name`` (None: not an OAR-P
    engine setting, or a prompt-once A/B row)."""
    if "[" in name or name in ("dense_forward", "grpo_update_proxy", "grpo_step"):
        return None
    kind = name.split()[0]
    if kind == "oar_g":
        return OAR_G_FORWARDS
    if kind == "exact":  # every exact_stride-th token: the prefix engine's needed columns
        T = prompt + L + tail
        return 1 + sum(T - (prompt + t) for t in range(0, L, exact_stride)) / T
    return forwards_per_row(kind, L, prompt, tail, window=window, unit_len=unit_len, keep=keep)


def time_settings(shape: str, L: int, device: str, dtype: str, window: int, unit_len: int, prompt: int = 200,
                  repeats: int = 1, budget_mb: int = 16384, settings=None, group: int = 1,
                  profile_dir: str | None = None, out: str | None = None, scored_fraction: float = 1.0,
                  generation: str = "none", gen_tokens_per_s: float | None = None, exact_stride: int = 16,
                  dense_tokens: int = 8192, no_full_blocks: bool = False, layers: int | None = None,
                  gen_sample: int = 128) -> list[dict]:
    """Seconds, peak memory (CUDA), model tokens per second and engine efficiency of each attribution setting on one
    row of L random reasoning tokens of a random-weight ``shape`` model, beside two reference rows run the same way:
    ``dense_forward`` (a no-grad forward of whole contexts of the row's width, batched to about ``dense_tokens``
    tokens, LM head on the probe window as the engines run it) and ``grpo_update_proxy`` (a forward + backward of the
    policy over the row).

    Columns: ``tokens`` (model tokens the setting ran: its ``tokens`` stat; for OAR-G and the proxy, forward-token
    equivalents, 3 per token: forward + backward), ``tok_per_s``, ``E`` = tok_per_s / the
    dense forward's (engine efficiency: 1 = a re-run token costs what a dense forward token costs),
    ``cost_forwards`` (the cost model's forwards per row, :func:`forwards_per_row`), ``x_grpo_update`` (seconds /
    the proxy's) next to ``cost_x_update`` (cost_forwards / 3, the proxy's forwards), and per row against a GRPO
    step (generation + old log-probs + reference + update, i.e. generation + 5/3 x the proxy):
    ``x_grpo_step_scored_row`` (the row scored) and ``x_grpo_step_batch_row`` (x ``scored_fraction``: rows with
    zero advantage are not scored). The step's generation is measured (``generation="measure"``: ``gen_sample``
    greedy decoding steps scaled to L, :func:`_time_generation`), estimated at ``gen_tokens_per_s`` (stated as such
    in the ``grpo_step`` row's ``generation`` field) or left out (``"none"``: the step without generation).

    ``group`` > 1: one group of that many rollouts of the prompt, reasoning lengths L down to about L / 2, and each
    OAR-P setting also timed with the prompt-once clean pass off (``[each prompt]``), side by side. ``exact``: the
    prefix engine on every ``exact_stride``-th reasoning token (its tokens are what it ran, including the columns a
    chunk recomputes in vain). With ``out``, the table is rewritten after every call (a run stopped by a time limit
    leaves what it measured; rows not yet timed past their first call say ``timed: false``). ``profile_dir``:
    afterwards one profiled call of each setting (:func:`_profile`). ``layers``: override the shape's layer count
    (profiling on a shallower model of the same widths; E is per layer, so it moves little). ``no_full_blocks``: only
    names the output file (``--no-full-blocks`` sets the switch). Raises ValueError on an unknown setting."""
    from oar.testing import minimal_tokenizer, tiny_random_llama
    from oar.attribution import (HFProbeModel, ProbeContextBuilder, oar_g_scores, oar_p_linear_tail_scores,
                                 oar_p_scores, oar_p_window_scores)

    unknown = sorted(set(settings or ()) - set(TIME_SETTINGS))
    if unknown:
        raise ValueError(f"settings must be among {TIME_SETTINGS}, got {unknown}")
    if not 0.0 < float(scored_fraction) <= 1.0:
        raise ValueError(f"scored_fraction must be in (0, 1], got {scored_fraction}")
    if generation not in ("none", "measure", "estimate"):
        raise ValueError(f"generation must be 'none', 'measure' or 'estimate', got {generation!r}")
    if generation == "estimate" and not (gen_tokens_per_s and gen_tokens_per_s > 0):
        raise ValueError(f"generation='estimate' needs gen_tokens_per_s > 0, got {gen_tokens_per_s}")
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    cfg = dict(SHAPES[shape])
    if layers:
        cfg["num_layers"] = int(layers)
    if dev.type == "cpu":
        model, _ = tiny_random_llama(vocab_size=cfg.pop("vocab_size"), hidden_size=cfg.pop("hidden_size"),
                                     num_layers=cfg.pop("num_layers"), tokenizer="minimal", seed=0,
                                     max_position_embeddings=prompt + L + 256, dtype=dt, device=dev, **cfg)
    else:  # built on the device in its dtype: a 7B model built in float32 on the host takes a minute
        model = _device_random_llama(cfg, prompt + L + 256, dt, dev)
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
    prompt_ids = torch.randint(6, 100, (prompt,), generator=g)
    batch = ProbeContextBuilder(tok, "\nTherefore, the final answer is \\boxed{").build(
        [prompt_ids] * group, resps, ["42"] * group, lens)
    # what the OAR-P engines run (the columns after the last probe position cut; oar before issue 41 ran the batch)
    view = batch.probe_view() if hasattr(batch, "probe_view") else batch
    T = int(view.input_ids.shape[1])
    tail = T - prompt - L  # conclude + answer tokens (but the last) after the longest row's reasoning
    keep = int(view.keep)
    pm = HFProbeModel(model)
    spans = {r: [(s, min(s + unit_len, n)) for s in unit_starts(n, unit_len)] for r, n in enumerate(lens)}
    exact_pos = {r: list(range(0, n, max(1, int(exact_stride)))) for r, n in enumerate(lens)}

    def oar_p_runs(m, tag=""):
        return {
            f"exact 1/{exact_stride}{tag}": lambda: oar_p_scores(m, batch, engine="prefix", positions=exact_pos,
                                                                memory_budget_mb=budget_mb),
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
    # the linear tail (no prompt-once clean pass, so no A/B row): its tokens are cost_tokens (backward included)
    runs[f"window_linear W={window}"] = lambda: oar_p_linear_tail_scores(pm, batch, window=window,
                                                                        memory_budget_mb=budget_mb)
    if group > 1:  # the A/B of the prompt-once clean pass: same rows, every prompt run
        plain = HFProbeModel(model)
        plain.prompt_once_clean_pass = False
        runs.update(oar_p_runs(plain, " [each prompt]"))
    # in the order asked (a run stopped by its time limit has measured the first ones); exact only when named
    chosen = list(settings) if settings else [s for s in TIME_SETTINGS if s != "exact"]
    runs = {k: v for want in chosen for k, v in runs.items() if k.split()[0] == want}

    dense_rows = max(1, int(dense_tokens) // T)
    dense_ids = view.input_ids[:1].expand(dense_rows, -1).contiguous().to(dev)
    dense_mask = view.attention_mask[:1].expand(dense_rows, -1).contiguous().to(dev)

    def dense_forward():
        with torch.no_grad(), pm._probe_head():
            model(input_ids=dense_ids, attention_mask=dense_mask, logits_to_keep=keep, use_cache=False)
        return dense_rows * T

    def grpo_proxy():
        ids = batch.input_ids.to(dev)
        with torch.enable_grad():
            out = model(input_ids=ids, attention_mask=batch.attention_mask.to(dev), use_cache=False).logits
            out.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        return 3 * int(batch.attention_mask.sum())  # forward-token equivalents: forward + backward = 3

    gen_s, gen_note = 0.0, "none: the step without generation"
    if generation == "measure":
        gen_s = _time_generation(model, prompt_ids, L, dev, gen_sample)
        gen_note = (f"measured: {gen_sample} greedy decoding steps after a context of prompt + L / 2, scaled to L = "
                    f"{L}: {gen_s:.2f} s")
    elif generation == "estimate":
        gen_s = L / float(gen_tokens_per_s)
        gen_note = f"estimate: {L} tokens at {gen_tokens_per_s:g} tokens/s (not measured)"

    order = [("dense_forward", dense_forward), ("grpo_update_proxy", grpo_proxy)] + list(runs.items())
    secs = {name: [] for name, _ in order}
    stats, peak, ran = {}, {}, {}

    def build_table() -> list[dict]:
        rows = []
        for name, _ in order:
            if not secs[name]:
                continue
            timed = secs[name][1:]
            s = _median(timed) if timed else secs[name][0]
            st, pk = stats[name], peak.get(name)
            n_tok = ran.get(name)
            rows.append({"shape": shape, "L": L, "group": group, "setting": name, "seconds": round(s, 4),
                         "timed": bool(timed), "first_call_s": round(secs[name][0], 3),
                         "forwards": st.get("forward_passes"), "tokens": n_tok, "variants": st.get("variants"),
                         "peak_gib": None if pk is None else round(pk, 2),
                         "tok_per_s": round(n_tok / s) if n_tok and s > 0 else None})
        by = {r["setting"]: r for r in rows}
        dense, proxy = by.get("dense_forward"), by.get("grpo_update_proxy")
        step = proxy["seconds"] * GRPO_STEP_OVER_PROXY + gen_s if proxy else None
        for r in rows:
            r["E"] = (round(r["tok_per_s"] / dense["tok_per_s"], 3)
                      if dense and dense["tok_per_s"] and r["tok_per_s"] else None)
            cf = _setting_cost(r["setting"], L, prompt, tail, window, unit_len, keep, exact_stride)
            r["cost_forwards"] = None if cf is None else round(cf, 2)
            r["x_grpo_update"] = round(r["seconds"] / proxy["seconds"], 3) if proxy else None
            r["cost_x_update"] = None if cf is None else round(cf / 3.0, 3)
            attribution = r["setting"] not in ("dense_forward", "grpo_update_proxy")
            r["x_grpo_step_scored_row"] = round(r["seconds"] / step, 3) if step and attribution else None
            r["x_grpo_step_batch_row"] = (round(scored_fraction * r["seconds"] / step, 3)
                                          if step and attribution else None)
        if step:
            rows.append({"shape": shape, "L": L, "group": group, "setting": "grpo_step", "seconds": round(step, 4),
                         "timed": bool(proxy["timed"]), "generation": gen_note, "scored_fraction": scored_fraction})
        return rows

    def flush() -> None:
        if out:
            _write(build_table(), out, _time_name(shape, L, group, device, no_full_blocks),
                   _time_title(shape, L, group, prompt, device, dtype))

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
            if isinstance(res, int):
                stats[name], ran[name] = {}, res
            else:
                stats[name] = getattr(res, "stats", {}) or {}
                ran[name] = (stats[name].get("cost_tokens") or stats[name].get("tokens")
                             or (3 * int(batch.attention_mask.sum()) if name == "oar_g" else None))
            if dev.type == "cuda":
                peak[name] = torch.cuda.max_memory_allocated(dev) / 2**30
            flush()
    table = build_table()
    for r in table:
        print(json.dumps(r), flush=True)
    if profile_dir:
        _profile(order, dev, profile_dir, f"{shape}_L{L}")
    return table


def _device_random_llama(cfg: dict, max_positions: int, dt: torch.dtype, dev: torch.device):
    """A random-weight ``LlamaForCausalLM`` of ``cfg`` (a :data:`SHAPES` entry) built directly on ``dev`` in ``dt``
    with the minimal tokenizer's special ids (timings only: the weights differ from :func:`tiny_random_llama`'s)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oar.testing import minimal_tokenizer

    tok = minimal_tokenizer()
    c = dict(cfg)
    config = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                         intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_layers"],
                         num_attention_heads=c["num_heads"], num_key_value_heads=c["num_kv_heads"],
                         max_position_embeddings=max_positions, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=True)
    old = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dt)
        with torch.device(dev):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model


def _time_generation(model, prompt_ids: torch.Tensor, L: int, dev: torch.device, sample: int = 128) -> float:
    """Seconds to generate ``L`` tokens after ``prompt_ids`` greedily (transformers' ``generate``, KV cache), one row:
    ``sample`` tokens are generated after a context of the prompt + L / 2 tokens (the mean context of the whole
    generation, so the attention over the cache is the mean one) and their time per token is scaled to L (stated as
    such in the table); a trainer batches rows, so per row this is an upper bound."""
    sample = max(1, min(int(sample), int(L)))
    ctx = torch.cat([prompt_ids, prompt_ids.new_full((L // 2,), 7)]).view(1, -1).to(dev)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(ctx[:, :8], max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
    times = []
    for n in (1, sample + 1):  # the prefill alone, then with sample more tokens: their difference is the decoding
        _sync(dev)
        t0 = time.perf_counter()
        model.generate(ctx, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return max(times[1] - times[0], 0.0) / sample * L


def _time_name(shape: str, L: int, group: int, device: str, no_full_blocks: bool) -> str:
    g = f"_G{group}" if group > 1 else ""
    nf = "_no_full_blocks" if no_full_blocks else ""
    return f"time_{shape}_L{L}{g}_{torch.device(device).type}{nf}"


def _time_title(shape: str, L: int, group: int, prompt: int, device: str, dtype: str) -> str:
    return (f"{shape}, L = {L}, {group} rollout(s), prompt {prompt}, {device}, {dtype}, {torch.get_num_threads()} "
            f"thread(s)")


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


def block_table(L: int, prompt: int, keep: int, conclude: int, variants: int, windows, block: int = 128) -> list[dict]:
    """The FlexAttention block lists of one windowed-OAR-P chunk (``variants`` consecutive masked tokens of one row of
    T = prompt + L + conclude + keep columns, starting at the first, middle and last reasoning tokens), in the
    kernel's query order (window queries, then tail queries: ``q_order``) and variant-major (the order before issue
    41): partial and full (query block, key block) pairs and the share of the pairs in listed blocks that are visible
    (the kernel computes every pair of a listed block; a partial one also evaluates the mask on each). Counted from
    the layout on the CPU: the kernel's work, not its time."""
    from oar.attribution.model import WindowMasks
    from oar.attribution.shared_prefix import _shared_prefix_blocks
    from oar.attribution.window import _run_columns, _run_lengths

    T = prompt + L + conclude + keep
    rows = []
    for W in windows:
        for tail_kind, tail_col in (("probe", T - keep), ("conclude", prompt + L)):
            for start in (0, L // 2, L - variants):
                t = torch.arange(prompt + start, prompt + start + variants)
                win_end = torch.clamp(t + 1 + W, max=T)
                tail = torch.full_like(t, tail_col)
                run_len = _run_lengths(t, win_end, tail, T)
                S = int(run_len.max())
                cols = _run_columns(t, win_end, tail, run_len, S)
                wm = WindowMasks(cols, torch.zeros_like(t), t, win_end, tail)
                visible = int(wm.see_prefix(T).sum()) + int(wm.see_self().sum())
                order = torch.argsort((cols >= tail[:, None]).reshape(-1).to(torch.int8), stable=True)
                row = {"W": W, "tail": tail_kind, "first_token": start, "S": S}
                for tag, q_order in (("variant_major", None), ("q_order", order)):
                    listed, full = _shared_prefix_blocks(torch.zeros(variants, dtype=torch.long),
                                                         torch.zeros(2, dtype=torch.long), 1, T, variants, S, block,
                                                         window=wm, q_order=q_order)
                    part, whole = int((listed & ~full).sum()), int(full.sum())
                    row.update({f"{tag}_partial": part, f"{tag}_full": whole,
                                f"{tag}_visible_share": round(visible / ((part + whole) * block * block), 3)})
                rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cost", help="forwards per row of each setting (no model is run)")
    c.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    c.add_argument("--prompt", type=int, default=200)
    c.add_argument("--tail", type=int, default=38, help="conclude + answer tokens the engines run after the "
                   "reasoning (the probe view: the last answer token and the suffix cut)")
    c.add_argument("--window", type=int, default=8)
    c.add_argument("--unit-len", type=int, nargs="+", default=[12, 25, 50])
    c.add_argument("--fraction", type=float, default=0.1)
    c.add_argument("--keep", type=int, default=6, help="probe window: the answer-predicting positions (answer "
                   "tokens; ProbeBatch.probe_view)")
    c.add_argument("--group", type=int, default=1, help="rollouts per prompt in a clean chunk (prompt-once clean pass)")
    c.add_argument("--name", default="cost_model", help="file name of the table under --out")
    c.add_argument("--out", default="docs/benchmarks/scale")
    b = sub.add_parser("blocks", help="FlexAttention block lists of a windowed chunk (the kernel's work)")
    b.add_argument("--length", type=int, default=4096)
    b.add_argument("--prompt", type=int, default=200)
    b.add_argument("--keep", type=int, default=6)
    b.add_argument("--conclude", type=int, default=12)
    b.add_argument("--variants", type=int, default=512)
    b.add_argument("--windows", type=int, nargs="+", default=[4, 8])
    b.add_argument("--out", default="docs/benchmarks/scale")
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
    t.add_argument("--settings", nargs="*", choices=TIME_SETTINGS, help="subset of the settings (dense and grpo, "
                   "the reference rows, always run; exact only when named)")
    t.add_argument("--exact-stride", type=int, default=16, help="exact: the prefix engine on every k-th token")
    t.add_argument("--layers", type=int, default=None, help="override the shape's layer count (profiling)")
    t.add_argument("--dense-tokens", type=int, default=8192, help="tokens per dense-forward call (whole rows)")
    t.add_argument("--scored-fraction", type=float, default=1.0, help="rows scored / batch rows (zero-advantage rows "
                   "are not scored): the per-batch-row column")
    t.add_argument("--generation", choices=["none", "measure", "estimate"], default="none",
                   help="the GRPO step's generation: measured (greedy generate of L tokens), estimated at "
                   "--gen-tokens-per-s, or left out")
    t.add_argument("--gen-tokens-per-s", type=float, default=None)
    t.add_argument("--gen-sample", type=int, default=128, help="decoding steps timed for --generation measure")
    t.add_argument("--group", type=int, default=1, help="rollouts of the prompt (> 1: prompt-once A/B rows)")
    t.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    t.add_argument("--out", default=None, help="folder of the table, rewritten after every call")
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
    elif a.cmd == "blocks":
        rows = block_table(a.length, a.prompt, a.keep, a.conclude, a.variants, a.windows)
        _write(rows, a.out, f"flex_blocks_L{a.length}", f"FlexAttention block lists of one windowed chunk: "
               f"{a.variants} variants of one row, L = {a.length}, prompt {a.prompt}, conclude {a.conclude}, probe "
               f"window {a.keep}, blocks of 128 (counted on CPU: the kernel's work, not its time)")
        for r in rows:
            print(r)
    else:
        if a.threads:
            torch.set_num_threads(a.threads)
        if a.no_full_blocks:
            from oar.attribution import shared_prefix

            shared_prefix._FLEX_FULL_BLOCKS = False
        time_settings(a.shape, a.length, a.device, a.dtype, a.window, a.unit_len, a.prompt, a.repeats, a.budget_mb,
                      a.settings, a.group, profile_dir=(a.out or ".") if a.profile else None, out=a.out,
                      scored_fraction=a.scored_fraction, generation=a.generation,
                      gen_tokens_per_s=a.gen_tokens_per_s, exact_stride=a.exact_stride,
                      dense_tokens=a.dense_tokens, no_full_blocks=a.no_full_blocks, layers=a.layers,
                      gen_sample=a.gen_sample)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
