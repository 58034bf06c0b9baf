"""Attribution settings on long real responses: cost and fidelity against exact token-level OAR-P (issue 23).

For each length bucket (512 / 1024 / 2048 response tokens) and each trace of ``long_traces.py`` (SmolLM2-135M-Instruct's
own responses to MATH500 / GSM8K questions), side by side in one run:

* **exact token-level OAR-P** (``oar_p_scores``, prefix engine, answer_mean probe): the reference. It is computed in
  blocks of ``--exact-block`` reasoning positions (``positions=``; each block runs its own clean pass, at most a few
  percent more tokens), and every finished block is written to the trace's cache file at once, so a killed run
  resumes inside a trace. Its cost is the sum of its blocks (one run, never repeated). ``--exact-stride k`` scores
  only every k-th reasoning position (for models too slow for all of them on CPU): Spearman and top-10% overlap are
  then measured on those positions, and the exact row's seconds / tokens are those of the subset.
* **settings**, one row each of :data:`SETTINGS` (adding a setting is adding a row): OAR-G (1 draw), windowed OAR-P
  (W = 8, 32), screened OAR-P (window-8 screen, its time counted, + exact masking of its top 10% / 20% and a random
  5%), windowed OAR-P with the linearized tail (config ``screen_tail: linear``) (``window4_linear``, ``window8_linear``: its tokens are
  token-columns, forward + 2 x tail columns per backward pass), and, when ``oar.attribution.spans`` exists and
  ``oar_p_scores`` takes ``spans=``, span-level OAR-P (word, line, sentence units) exact and windowed.
* **the GRPO step of one rollout** on CPU, measured as ``bench_step.py`` defines a step (generation + policy update):
  ``model.generate`` of a group of ``--group`` rollouts of exactly the trace's length from its prompt (batched,
  sampling), divided by the group size, plus one forward + backward of the token-level policy-gradient loss over
  the trace (prompt + response, micro-batch 1, as trainers do at these lengths), plus one AdamW step divided by the
  group size. It runs on a copy of the model, so the attribution model is never updated.

Per setting and trace: seconds (median of ``--repeats`` runs), model forwards and tokens run (the engines' stats;
screened = screen + exact pass; OAR-G reports no token count), Spearman rank correlation and top-10% overlap with
exact OAR-P, seconds / GRPO step and seconds / exact OAR-P's. The oracle-causal recall@10%
(``oar eval-attribution``) needs a correct trace and one greedy answer decode of the full context per reasoning
token (about twice exact OAR-P's work, without prefix sharing); ``--oracle`` runs it on correct traces up to
``--oracle-max-len`` reasoning tokens, off by default.

Everything measured goes to one JSON file per trace under ``OUT/cache/`` (scores included); the tables are written
from those files at the end of every run, so a rerun skips what is done (``--max-minutes`` stops between units of
work). Outputs: ``OUT/long.csv``, ``OUT/long.md`` (one table per length) and ``OUT/fidelity_cost_L{b}.png``.

Usage:  python benchmarks/python/bench_long.py [--traces benchmarks/data/long_traces.jsonl] [--lengths 512 1024]
            [--per-length 4] [--max-minutes 90] [--repeats 1] [--out docs/benchmarks/long] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import csv
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from bench_step import _commit  # the commit the numbers were measured at (same as the step table)

PROBE = "answer_mean"
EXACT = "oar_p_exact"


# ----------------------------------------------------------------------------------------------------------------
# settings: one row each


@dataclass
class Ctx:
    """What a setting's run needs: the probe model and batch of one trace, its tokenizer and seed."""

    pm: object
    batch: object
    tok: object
    response_ids: list
    seed: int
    budget_mb: int

    @property
    def L(self) -> int:
        return int(self.batch.reasoning_len[0])

    def spans(self, unit: str) -> dict:
        """{0: [(j0, j1), ...]}: the reasoning tokens cut into ``unit`` spans (oar.attribution.spans)."""
        from oar.attribution import spans as sp

        ids = self.response_ids[: self.L]
        return {0: sp.spans_of(sp.span_starts(sp.token_texts(self.tok, ids), unit))}


@dataclass
class Setting:
    """One row of the table: ``run(ctx)`` returns ``(Attribution, {"forward_passes", "tokens", ...})``;
    ``available()`` says whether this build of oar has what it needs (rows without are skipped and listed)."""

    name: str
    run: Callable
    available: Callable[[], bool] = lambda: True
    note: str = ""


def _cost(*atts) -> dict:
    """Summed engine stats of one or more Attributions (tokens None when an engine reports none)."""
    fw = sum(int(a.stats.get("forward_passes", 0)) for a in atts)
    toks = [a.stats.get("tokens") for a in atts]
    out = {"forward_passes": fw, "tokens": None if any(t is None for t in toks) else int(sum(toks))}
    bw = sum(int(a.stats.get("backward_passes", 0)) for a in atts)
    if bw:
        out["backward_passes"] = bw
    if any("masked" in a.stats for a in atts):
        out["masked"] = int(sum(a.stats.get("masked", 0) for a in atts))
    return out


def _oar_g(ctx: Ctx):
    from oar.attribution import oar_g_scores

    a = oar_g_scores(ctx.pm, ctx.batch, probe=PROBE, noise_draws=1, generator=torch.Generator().manual_seed(ctx.seed))
    return a, _cost(a)


def _window(w: int, unit: str | None = None, tail: str = "conclude"):
    def run(ctx: Ctx):
        from oar.attribution import oar_p_window_scores

        kw = {"spans": ctx.spans(unit)} if unit else {}
        if tail != "conclude":
            kw["rerun_tail"] = tail
        a = oar_p_window_scores(ctx.pm, ctx.batch, window=w, probe=PROBE, memory_budget_mb=ctx.budget_mb, **kw)
        return a, _cost(a)
    return run


def _linear(w: int, top_r: int = 32):
    def run(ctx: Ctx):
        from oar.attribution.linear_tail import oar_p_linear_tail_scores

        a = oar_p_linear_tail_scores(ctx.pm, ctx.batch, window=w, probe=PROBE, top_r=top_r,
                                     memory_budget_mb=ctx.budget_mb)
        cost = _cost(a)
        # token-columns: forward tokens + 2 x tail columns per backward pass (linear_tail.py's cost_tokens)
        cost.update(tokens=int(a.stats["cost_tokens"]), forward_tokens=int(a.stats["tokens"]))
        return a, cost
    return run


def _has_linear_tail() -> bool:
    try:
        import oar.attribution.linear_tail  # noqa: F401
    except ImportError:
        return False
    return True


def _screened(fraction: float, window: int = 8, sample: float = 0.05):
    def run(ctx: Ctx):
        from oar.attribution import oar_p_window_scores
        from oar.attribution.screened import oar_p_screened_scores

        scr = oar_p_window_scores(ctx.pm, ctx.batch, window=window, probe=PROBE, memory_budget_mb=ctx.budget_mb,
                                  keep_clean_pass=True)
        a = oar_p_screened_scores(ctx.pm, ctx.batch, scr, fraction=fraction, sample_fraction=sample,
                                  generator=torch.Generator().manual_seed(ctx.seed), probe=PROBE,
                                  memory_budget_mb=ctx.budget_mb)
        return a, _cost(scr, a)
    return run


def _span_exact(unit: str):
    def run(ctx: Ctx):
        from oar.attribution import oar_p_scores

        a = oar_p_scores(ctx.pm, ctx.batch, probe=PROBE, memory_budget_mb=ctx.budget_mb, spans=ctx.spans(unit))
        return a, _cost(a)
    return run


def _has_probe_tail() -> bool:
    """oar_p_window_scores takes ``rerun_tail`` (the probe-window tail)."""
    import inspect

    from oar.attribution import oar_p_window_scores

    return "rerun_tail" in inspect.signature(oar_p_window_scores).parameters


def _has_spans() -> bool:
    """oar.attribution.spans exists and both OAR-P engines take ``spans=``."""
    import inspect

    import oar.attribution as A

    try:
        import oar.attribution.spans  # noqa: F401
    except ImportError:
        return False
    return (hasattr(A, "spans") and "spans" in inspect.signature(A.oar_p_scores).parameters
            and "spans" in inspect.signature(A.oar_p_window_scores).parameters)


SETTINGS: list[Setting] = [
    Setting("oar_g", _oar_g, note="gradient x input, 1 noise draw"),
    Setting("window1", _window(1), note="windowed OAR-P, W = 1"),
    Setting("window2", _window(2), note="windowed OAR-P, W = 2"),
    Setting("window4", _window(4), note="windowed OAR-P, W = 4"),
    Setting("window8", _window(8), note="windowed OAR-P, W = 8"),
    Setting("window32", _window(32), note="windowed OAR-P, W = 32"),
    Setting("window1_probe", _window(1, tail="probe"), _has_probe_tail, "windowed OAR-P, W = 1, probe-window tail"),
    Setting("window4_probe", _window(4, tail="probe"), _has_probe_tail, "windowed OAR-P, W = 4, probe-window tail"),
    Setting("window8_probe", _window(8, tail="probe"), _has_probe_tail, "windowed OAR-P, W = 8, probe-window tail"),
    Setting("window4_linear", _linear(4), _has_linear_tail,
            "windowed OAR-P, W = 4, linearized tail (tokens = forward + 2 x tail per backward pass)"),
    Setting("window8_linear", _linear(8), _has_linear_tail,
            "windowed OAR-P, W = 8, linearized tail (tokens = forward + 2 x tail per backward pass)"),
    Setting("screen0.1", _screened(0.1), note="window-8 screen + exact top 10% + random 5%"),
    Setting("screen0.2", _screened(0.2), note="window-8 screen + exact top 20% + random 5%"),
    Setting("span_word", _span_exact("word"), _has_spans, "exact OAR-P, word units"),
    Setting("span_line", _span_exact("line"), _has_spans, "exact OAR-P, line units"),
    Setting("span_sentence", _span_exact("sentence"), _has_spans, "exact OAR-P, sentence units"),
    Setting("window8_word", _window(8, "word"), _has_spans, "windowed OAR-P W = 8, word units"),
    Setting("window8_line", _window(8, "line"), _has_spans, "windowed OAR-P W = 8, line units"),
]


# ----------------------------------------------------------------------------------------------------------------
# cache files


def trace_key(trace: dict) -> str:
    """A short hash of what determines a trace's numbers (ids and answer): a cache file of another trace with
    the same id is never reused."""
    h = hashlib.sha1(json.dumps([trace["prompt_ids"], trace["response_ids"], trace["answer"]]).encode())
    return h.hexdigest()[:12]


def load_cache(path: str, trace: dict) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            c = json.load(f)
        if c.get("key") == trace_key(trace) and c.get("probe") == PROBE:
            return c
        print(f"{path}: made for other token ids / probe; starting this trace afresh", file=sys.stderr)
    return {"id": trace["id"], "key": trace_key(trace), "probe": PROBE, "bucket": trace["bucket"],
            "exact_blocks": {}, "settings": {}, "grpo": {}}


def save_cache(path: str, cache: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cache, f, separators=(",", ":"))
    os.replace(tmp, path)


def _round(xs) -> list[float]:
    return [float(f"{float(x):.6g}") for x in xs]


def exact_positions(start: int, end: int, stride: int) -> list[int]:
    """The reasoning positions of block [start, end) that get an exact score: every ``stride``-th position of the
    trace (j % stride == 0; all of them at stride 1)."""
    return [j for j in range(start, end) if j % stride == 0]


def exact_scores(cache: dict) -> list[float | None] | None:
    """The exact reference of a trace when every block is done, else None. With ``exact_stride`` k > 1 only every
    k-th position has a score; the others are None (fidelity is then measured on the scored positions)."""
    L = cache.get("reasoning_len")
    blocks = cache.get("exact_blocks", {})
    if L is None or not blocks:
        return None
    k = int(cache.get("exact_stride", 1))
    out = [None] * L
    for b in blocks.values():
        for j, s in zip(exact_positions(b["start"], b["end"], k), b["scores"]):
            out[j] = s
    return None if any(out[j] is None for j in range(0, L, k)) else out


def paired(scores: list[float], exact: list[float | None]) -> tuple[list[float], list[float]]:
    """(setting scores, exact scores) at the positions that have an exact score."""
    keep = [j for j, e in enumerate(exact) if e is not None]
    return [scores[j] for j in keep], [exact[j] for j in keep]


# ----------------------------------------------------------------------------------------------------------------
# the GRPO step of one rollout (bench_step.py's definition, per rollout)


def grpo_step(model, tok, prompt_ids: list, response_ids: list, group: int, seed: int) -> dict:
    """Seconds of one GRPO step per rollout at this trace's shape, on ``model`` (a copy: it is updated)."""
    L = len(response_ids)
    x = torch.tensor([prompt_ids] * group)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=True, temperature=0.8, top_k=0,
                       max_new_tokens=L, min_new_tokens=L, pad_token_id=tok.pad_token_id)
    gen = time.perf_counter() - t0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    comp = torch.tensor([list(response_ids)])
    model.train()
    t0 = time.perf_counter()
    logits = model(input_ids=ids, logits_to_keep=L + 1).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, comp[..., None])[..., 0]
    loss = -logp.mean()  # advantage 1 on every token: the token-level policy-gradient loss at ratio 1
    opt.zero_grad(set_to_none=True)
    loss.backward()
    fwd_bwd = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt.step()
    adamw = time.perf_counter() - t0
    model.eval()
    opt.zero_grad(set_to_none=True)
    del opt
    return {"generate_group_s": gen, "group": group, "fwd_bwd_s": fwd_bwd, "adamw_s": adamw,
            "step_per_rollout_s": gen / group + fwd_bwd + adamw / group}


# ----------------------------------------------------------------------------------------------------------------
# the run


class Budget:
    def __init__(self, minutes: float):
        self.t0, self.minutes = time.perf_counter(), minutes

    def over(self) -> bool:
        return (time.perf_counter() - self.t0) / 60.0 > self.minutes


def build_batch(tok, trace: dict):
    import oar
    from oar.attribution import ProbeContextBuilder

    cfg = oar.OARConfig()
    builder = ProbeContextBuilder(tok, cfg.conclude, cfg.answer_suffix)
    return builder.build([trace["prompt_ids"]], [trace["response_ids"]], [trace["answer"]])


def trace_seed(trace: dict, seed: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(trace["id"].encode())) % (2**31 - 1)


def run_settings(cache, ctx, settings, repeats, budget, path, bar) -> None:
    for s in settings:
        rec = cache["settings"].get(s.name)
        while rec is None or len(rec["seconds"]) < repeats:
            if budget.over():
                return
            with ctx.pm.eval_mode():
                t0 = time.perf_counter()
                att, cost = s.run(ctx)
                dt = time.perf_counter() - t0
            if rec is None:
                rec = {"seconds": [], "scores": _round(att.scores[0, : ctx.L].tolist()), **cost}
            rec["seconds"].append(dt)
            cache["settings"][s.name] = rec
            save_cache(path, cache)
            bar.write(f"  {cache['id']} {s.name}: {dt:.1f}s, {cost}")


def run_exact(cache, ctx, block: int, budget, path, bar, stride: int = 1) -> None:
    from oar.attribution import oar_p_scores

    L = ctx.L
    have = int(cache.get("exact_stride", 1))
    if cache["exact_blocks"] and have != stride:
        raise SystemExit(f"{path}: its exact blocks were computed at --exact-stride {have}, this run asks {stride}; "
                         "rerun with the same stride (or delete the file's exact_blocks)")
    cache["exact_stride"] = stride
    for start in range(0, L, block):
        key = str(start)
        if key in cache["exact_blocks"]:
            continue
        if budget.over():
            return
        end = min(L, start + block)
        pos = exact_positions(start, end, stride)
        with ctx.pm.eval_mode():
            t0 = time.perf_counter()
            a = oar_p_scores(ctx.pm, ctx.batch, probe=PROBE, memory_budget_mb=ctx.budget_mb, positions={0: pos})
            dt = time.perf_counter() - t0
        cache["exact_blocks"][key] = {"start": start, "end": end, "seconds": dt,
                                      "scores": _round(a.scores[0, pos].tolist()),
                                      "forward_passes": int(a.stats["forward_passes"]), "tokens": int(a.stats["tokens"])}
        save_cache(path, cache)
        done = sum(b["end"] - b["start"] for b in cache["exact_blocks"].values())
        bar.write(f"  {cache['id']} exact block [{start}, {end}): {dt:.1f}s ({done}/{L} positions done)")


def run_oracle(cache, model, tok, trace, batch, max_len: int, path) -> None:
    """Oracle-causal flags (oar eval-attribution's oracle) of a correct trace, cached."""
    import oar
    from oar.app.eval_attribution import oracle_causal
    from oar.app.tasks import get_task
    from oar.attribution import ProbeContextBuilder

    if "oracle" in cache or not trace.get("correct") or cache["reasoning_len"] > max_len:
        return
    task = get_task(trace["dataset"], data_dir=os.environ.get("OAR_DATA_DIR", "../shared/data"))
    prob = next(p for p in task.problems("test") if str(p.id) == trace["problem_id"])
    cfg = oar.OARConfig()
    b = ProbeContextBuilder(tok, cfg.conclude, cfg.answer_suffix)
    L = cache["reasoning_len"]
    t0 = time.perf_counter()
    ok, causal = oracle_causal(model, tok, task, prob, trace["prompt_ids"], trace["response_ids"][:L], b.conclude_ids,
                               b.pad_id)
    cache["oracle"] = {"clean_correct": ok, "causal": causal, "seconds": time.perf_counter() - t0}
    save_cache(path, cache)


def select_traces(traces: list[dict], lengths, per_length: int) -> list[dict]:
    out = []
    for b in lengths:
        out += [t for t in traces if t["bucket"] == b][:per_length]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", default="benchmarks/data/long_traces.jsonl")
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048])
    p.add_argument("--per-length", type=int, default=4, help="traces per length bucket (file order)")
    p.add_argument("--ids", nargs="*", default=None,
                   help="trace ids to run (instead of --lengths/--per-length; the tables still cover every cache)")
    p.add_argument("--settings", nargs="*", default=None, help="names of SETTINGS rows (default: all available)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each setting (median)")
    p.add_argument("--no-exact", dest="exact", action="store_false", help="skip the exact references")
    p.add_argument("--exact-lengths", nargs="*", type=int, default=None,
                   help="compute exact references only at these lengths (default: every --lengths)")
    p.add_argument("--exact-block", type=int, default=128, help="reasoning positions per exact block (resume unit)")
    p.add_argument("--exact-stride", type=int, default=1,
                   help="exact OAR-P on every k-th reasoning position only (fidelity on those positions; a cache's "
                        "stride is fixed once its first block is written)")
    p.add_argument("--no-grpo", dest="grpo", action="store_false", help="skip the GRPO-step measurement")
    p.add_argument("--group", type=int, default=4, help="rollouts per generation group of the GRPO step")
    p.add_argument("--oracle", action="store_true", help="oracle-causal flags of correct traces (expensive)")
    p.add_argument("--oracle-max-len", type=int, default=600)
    p.add_argument("--budget-mb", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-minutes", type=float, default=90.0, help="no new unit of work starts after this")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a load_model name, or 'tiny-random-llama' (plumbing tests only: no fidelity numbers)")
    p.add_argument("--model-label", default="", help="the model's name in the table header (default: --model)")
    p.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments of the model loader (tests)")
    p.add_argument("--out", default="docs/benchmarks/long")
    p.add_argument("--note", default="", help="a sentence for the table header (e.g. whether the machine was shared)")
    p.add_argument("--tables-only", action="store_true", help="only rewrite the tables from the cache files")
    args = p.parse_args(argv)
    if args.exact_block < 1 or args.repeats < 1 or args.group < 1 or args.exact_stride < 1:
        raise SystemExit("--exact-block, --exact-stride, --repeats and --group must be >= 1")
    torch.set_num_threads(args.threads)
    from oar.app.models import load_by_name

    traces = load_traces(args.traces)
    chosen = select_traces(traces, args.lengths, args.per_length)
    if args.ids is not None:
        by_id = {t["id"]: t for t in traces}
        if set(args.ids) - set(by_id):
            raise SystemExit(f"--ids: unknown {sorted(set(args.ids) - set(by_id))}")
        chosen = [by_id[i] for i in args.ids]
    known = {s.name for s in SETTINGS}
    if args.settings is not None and set(args.settings) - known:
        raise SystemExit(f"--settings: unknown {sorted(set(args.settings) - known)}; rows: {sorted(known)}")
    settings = [s for s in SETTINGS if (args.settings is None or s.name in args.settings)]
    unavailable = [s.name for s in settings if not s.available()]
    settings = [s for s in settings if s.name not in unavailable]
    if unavailable:
        print(f"settings skipped (this oar lacks what they need): {unavailable}", flush=True)
    cache_dir = os.path.join(args.out, "cache")
    if not args.tables_only and chosen:
        from tqdm import tqdm

        budget = Budget(args.max_minutes)
        kwargs = json.loads(args.model_kwargs)
        model, tok = load_by_name(args.model, fresh=False, **kwargs) if args.model != "tiny-random-llama" \
            else load_by_name(args.model, seed=args.seed, **kwargs)
        from oar.attribution import HFProbeModel

        pm = HFProbeModel(model)
        exact_at = set(args.lengths if args.exact_lengths is None else args.exact_lengths)
        bar = tqdm(chosen, desc="traces", unit="trace", dynamic_ncols=True)
        for trace in bar:
            if budget.over():
                bar.write(f"--max-minutes {args.max_minutes} reached: stopping (rerun to resume; exact references "
                          "resume block by block)")
                break
            path = os.path.join(cache_dir, f"{trace['id']}.json")
            cache = load_cache(path, trace)
            batch = build_batch(tok, trace)
            cache["reasoning_len"] = int(batch.reasoning_len[0])
            cache["context_len"] = int(batch.context_len[0])
            cache["response_len"] = len(trace["response_ids"])
            ctx = Ctx(pm, batch, tok, trace["response_ids"], trace_seed(trace, args.seed), args.budget_mb)
            bar.set_postfix_str(f"{trace['id']} L={ctx.L}")
            if args.grpo and not cache["grpo"] and not budget.over():
                policy = copy.deepcopy(model)
                cache["grpo"] = grpo_step(policy, tok, trace["prompt_ids"], trace["response_ids"], args.group,
                                          ctx.seed)
                del policy
                save_cache(path, cache)
                bar.write(f"  {trace['id']} GRPO step per rollout: {cache['grpo']['step_per_rollout_s']:.1f}s")
            run_settings(cache, ctx, settings, args.repeats, budget, path, bar)
            if args.oracle and not budget.over():
                run_oracle(cache, model, tok, trace, batch, args.oracle_max_len, path)
            # then this trace's exact reference, resumed block by block (so each finished trace has its fidelity)
            if args.exact and trace["bucket"] in exact_at:
                run_exact(cache, ctx, args.exact_block, budget, path, bar, args.exact_stride)
    # the tables cover every trace of the file that has a cache file, whatever this run's --lengths chose
    rows = summarize(traces, cache_dir, [s.name for s in SETTINGS])
    write_tables(rows, args, unavailable)
    return 0


def load_traces(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise SystemExit(f"--traces {path!r} not found (make it with benchmarks/python/long_traces.py)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------------------------------------------
# tables


def per_trace_rows(cache: dict, names: list[str]) -> list[dict]:
    """One row per setting of one trace (and one for exact OAR-P), fidelity filled when the reference is done."""
    from oar.app.eval_attribution import recall_at, top_overlap
    from oar.app.stats import spearman

    exact = exact_scores(cache)
    grpo = cache.get("grpo", {}).get("step_per_rollout_s")
    causal = cache.get("oracle", {}).get("causal") if cache.get("oracle", {}).get("clean_correct") else None
    rows = []
    blocks = cache.get("exact_blocks", {}).values()
    if blocks:
        sec = sum(b["seconds"] for b in blocks)
        done = sum(b["end"] - b["start"] for b in blocks)
        rows.append({"setting": EXACT, "seconds": sec if exact else None, "done_frac": done / cache["reasoning_len"],
                     "exact_stride": int(cache.get("exact_stride", 1)),
                     "forward_passes": sum(b["forward_passes"] for b in blocks) if exact else None,
                     "tokens": sum(b["tokens"] for b in blocks) if exact else None,
                     "spearman": 1.0 if exact else None, "top10": 1.0 if exact else None,
                     "recall10": recall_at(exact, causal, 10) if exact and causal and any(causal)
                     and None not in exact else None})
    for name in names:
        rec = cache.get("settings", {}).get(name)
        if rec is None:
            continue
        s = rec["scores"]
        s_ex, ex = paired(s, exact) if exact else (None, None)
        rows.append({"setting": name, "seconds": statistics.median(rec["seconds"]), "done_frac": 1.0,
                     "forward_passes": rec.get("forward_passes"), "tokens": rec.get("tokens"),
                     "masked": rec.get("masked"),
                     "spearman": spearman(s_ex, ex) if exact else None,
                     "top10": top_overlap(s_ex, ex, 10) if exact else None,
                     "recall10": recall_at(s, causal, 10) if causal and any(causal) else None})
    for r in rows:
        r.update(trace=cache["id"], bucket=cache["bucket"], reasoning_len=cache.get("reasoning_len"),
                 context_len=cache.get("context_len"), grpo_step_s=grpo,
                 x_grpo=(r["seconds"] / grpo if grpo and r["seconds"] is not None else None),
                 exact_s=(rows[0]["seconds"] if rows and rows[0]["setting"] == EXACT else None))
        r["x_exact"] = r["seconds"] / r["exact_s"] if r["exact_s"] and r["seconds"] is not None else None
    return rows


def summarize(chosen: list[dict], cache_dir: str, names: list[str]) -> list[dict]:
    rows = []
    for t in chosen:
        path = os.path.join(cache_dir, f"{t['id']}.json")
        if os.path.exists(path):
            with open(path) as f:
                c = json.load(f)
            if c.get("key") == trace_key(t):
                rows += per_trace_rows(c, names)
    return rows


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def bucket_table(rows: list[dict], bucket: int) -> list[dict]:
    """Per setting over the bucket's traces: means of per-trace numbers (fidelity over traces with a reference)."""
    rs = [r for r in rows if r["bucket"] == bucket]
    out = []
    for name in dict.fromkeys(r["setting"] for r in rs):
        g = [r for r in rs if r["setting"] == name]
        fid = [r for r in g if r["spearman"] is not None]
        timed = [r for r in g if r["seconds"] is not None]
        out.append({"length": bucket, "setting": name, "traces": len(timed), "with_reference": len(fid),
                    "reasoning_len": _mean([r["reasoning_len"] for r in timed]),
                    "seconds": _mean([r["seconds"] for r in timed]),
                    "forward_passes": _mean([r["forward_passes"] for r in timed]),
                    "tokens": _mean([r["tokens"] for r in timed]),
                    "masked_frac": _mean([r["masked"] / r["reasoning_len"] for r in timed if r.get("masked")]),
                    "x_grpo": _mean([r["x_grpo"] for r in timed]),
                    "x_exact": _mean([r["x_exact"] for r in timed]),
                    "spearman": _mean([r["spearman"] for r in fid]), "spearman_min": min(
                        (r["spearman"] for r in fid), default=None),
                    "top10": _mean([r["top10"] for r in fid]),
                    "recall10": _mean([r["recall10"] for r in g]),
                    "exact_done_frac": _mean([r["done_frac"] for r in g]) if name == EXACT else None,
                    "exact_stride": max((r.get("exact_stride", 1) for r in g), default=1) if name == EXACT else None})
    return out


def write_tables(rows: list[dict], args, unavailable: list[str]) -> None:
    os.makedirs(args.out, exist_ok=True)
    buckets = sorted({r["bucket"] for r in rows})
    table = [r for b in buckets for r in bucket_table(rows, b)]
    if table:
        with open(os.path.join(args.out, "long.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
        with open(os.path.join(args.out, "long_traces.csv"), "w", newline="") as f:
            keys = ["trace", "bucket", "reasoning_len", "context_len", "setting", "seconds", "forward_passes",
                    "tokens", "masked", "grpo_step_s", "x_grpo", "x_exact", "spearman", "top10", "recall10",
                    "done_frac"]
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)

    def f(v, fmt=".2f"):
        return "-" if v is None else format(v, fmt)

    notes = {s.name: s.note for s in SETTINGS}
    notes[EXACT] = "exact token-level OAR-P (prefix engine), the reference"
    lines = [f"Model {args.model_label or args.model}, probe {PROBE}, cpu ({torch.get_num_threads()} thread(s)), "
             f"torch {torch.__version__}, "
             f"commit {_commit()}, {platform.machine()}." + (f" {args.note}" if args.note else ""), ""]
    if unavailable:
        lines += [f"Settings not run (this oar lacks them): {', '.join(unavailable)}.", ""]
    for b in buckets:
        tb = [r for r in table if r["length"] == b]
        grpo = _mean(list({r["trace"]: r["grpo_step_s"] for r in rows if r["bucket"] == b}.values()))  # per trace
        n = len({r["trace"] for r in rows if r["bucket"] == b})
        lines += [f"### L = {b}: {n} traces, GRPO step per rollout {f(grpo, '.1f')} s", "",
                  "| setting | traces (with reference) | reasoning tokens | seconds | x GRPO step | x exact | forwards | "
                  "tokens run | masked | Spearman (min) | top-10% overlap | recall@10% |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in tb:
            name = r["setting"]
            if name == EXACT and r["exact_stride"] and r["exact_stride"] > 1:
                name += f" (every {r['exact_stride']}-th position)"
            if name.startswith(EXACT) and r["exact_done_frac"] is not None and r["exact_done_frac"] < 1:
                name += f" ({100 * r['exact_done_frac']:.0f}% of positions done)"
            sp = "-" if r["spearman"] is None else f"{r['spearman']:.3f} ({r['spearman_min']:.3f})"
            lines.append(f"| {name} | {r['traces']} ({r['with_reference']}) | {f(r['reasoning_len'], '.0f')} | "
                         f"{f(r['seconds'], '.1f')} | {f(r['x_grpo'])} | {f(r['x_exact'])} | "
                         f"{f(r['forward_passes'], '.0f')} | {f(r['tokens'], '.0f')} | {f(r['masked_frac'])} | {sp} | "
                         f"{f(r['top10'], '.3f')} | {f(r['recall10'], '.3f')} |")
        lines.append("")
        _plot(tb, b, os.path.join(args.out, f"fidelity_cost_L{b}.png"))
    shown = dict.fromkeys(r["setting"] for r in table)
    lines += ["Settings: " + "; ".join(f"`{k}`: {notes[k]}" for k in shown if notes.get(k)) + ".", ""]
    with open(os.path.join(args.out, "long.md"), "w") as fh:
        fh.write("\n".join(lines))
    print("\n".join(lines))


def _plot(tb: list[dict], bucket: int, path: str) -> None:
    pts = [r for r in tb if r["spearman"] is not None and r["x_grpo"] is not None]
    if not pts:
        if os.path.exists(path):
            os.remove(path)  # a plot of older numbers would disagree with the table
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for i, r in enumerate(pts):
        ax.scatter([r["x_grpo"]], [r["spearman"]], color=f"C{i % 10}", s=28, zorder=3)
        ax.annotate(r["setting"], (r["x_grpo"], r["spearman"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("attribution seconds / GRPO step (per rollout, CPU, 1 thread)")
    ax.set_ylabel("Spearman vs exact OAR-P (mean over traces)")
    n = max(r["with_reference"] for r in pts)
    ax.set_title(f"L = {bucket}: fidelity vs cost ({n} trace(s) with an exact reference)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
