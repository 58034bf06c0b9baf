"""Held-out sets of the built-in arithmetic task, split by question text or by arithmetic (issue 25).

For a config (default: the main job's, configs/default.yaml) this measures, with the config's model and greedy
evaluation settings, the before-training accuracy on

- the question split (``task.kwargs.split_by: question``, the historical default): ``eval.problems`` held-out
  problems, and how many of them ask an arithmetic fact (operation + operands, ``arithmetic_fact``) that some
  training problem also asks;
- the arithmetic split (``split_by: arithmetic``): ``--problems`` held-out problems (default 200) whose facts no
  training problem asks.

Accuracy is also given per fact (each fact's problems averaged, then the facts averaged), with the number of
distinct facts: the problems of one fact are far from independent, so the number of facts bounds what the set can
resolve. Writes ``heldout_split.md`` and ``heldout_split.json`` under ``--out``.

Usage: python benchmarks/python/heldout_split.py [--config default] [--problems 200] [--out docs/compare]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch


def _split_report(task, held, train, model, tok, ev) -> dict:
    from oar.app.tasks.arithmetic import arithmetic_fact
    from oar.app.tasks.evaluate import heldout_accuracy

    res = heldout_accuracy(task, held, model, tok, max_new_tokens=ev["max_new_tokens"], batch_size=ev["batch_size"])
    train_facts = {arithmetic_fact(p.metadata) for p in train}
    by_fact: dict[str, list[int]] = defaultdict(list)
    for p, c in zip(held, res.correct):
        by_fact[arithmetic_fact(p.metadata)].append(c)
    return {
        "problems": len(held),
        "facts": len(by_fact),
        "problems_with_a_training_fact": sum(arithmetic_fact(p.metadata) in train_facts for p in held),
        "accuracy": res.accuracy,
        "accuracy_per_fact": sum(sum(v) / len(v) for v in by_fact.values()) / len(by_fact),
        "seconds": res.seconds,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="default")
    ap.add_argument("--problems", type=int, default=200, help="held-out problems of the arithmetic split")
    ap.add_argument("--out", default="docs/compare")
    a = ap.parse_args(argv)

    from oar.app.config import load_config
    from oar.app.models import load_model
    from oar.app.train import build_task, eval_settings, heldout_problems

    cfg = load_config(a.config, [])
    if dict(cfg.task).get("name", "arithmetic") != "arithmetic":
        raise SystemExit(f"config {a.config!r} is not on the arithmetic task")
    ev = eval_settings(cfg)
    dtype = getattr(torch, str(cfg.model.get("dtype", "float32")))
    model, tok = load_model(cfg.model["name"], dtype=dtype, fresh=False)
    rows = {}
    for split_by, n in (("question", ev["problems"]), ("arithmetic", a.problems)):
        c = load_config(a.config, [f"task.kwargs.split_by={split_by}", f"eval.problems={n}"])
        task, train = build_task(c)
        held = heldout_problems(task, eval_settings(c), train)
        t0 = time.perf_counter()
        rows[split_by] = _split_report(task, held, train, model, tok, ev)
        print(f"[heldout_split] split_by={split_by}: {rows[split_by]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    os.makedirs(a.out, exist_ok=True)
    env = {"config": a.config, "model": cfg.model["name"], "dtype": str(dtype), "max_new_tokens": ev["max_new_tokens"],
           "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    with open(os.path.join(a.out, "heldout_split.json"), "w") as f:
        json.dump({"env": env, "splits": rows}, f, indent=1)
    lines = [f"Before-training greedy accuracy of {env['model']} ({env['dtype']}, max_new_tokens "
             f"{env['max_new_tokens']}, torch {env['torch']}, ATen {env['cpu_capability']}) on the held-out sets of "
             f"config `{a.config}`; command: `python benchmarks/python/heldout_split.py --config {a.config} "
             f"--problems {a.problems}`.", "",
             "| split_by | problems | distinct facts | problems whose fact is also trained on | accuracy | "
             "accuracy per fact |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for k, r in rows.items():
        lines.append(f"| {k} | {r['problems']} | {r['facts']} | {r['problems_with_a_training_fact']} | "
                     f"{r['accuracy']:.3f} | {r['accuracy_per_fact']:.3f} |")
    with open(os.path.join(a.out, "heldout_split.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
