"""Command line: ``oar train | compare | diagnose | attribute | eval-attribution | info`` (see README)."""

from __future__ import annotations

import argparse
import json
import sys


def _train(a) -> int:
    from oar.app.config import load_config
    from oar.app.train import RunFolderError, build_task, eval_settings, format_summary, heldout_problems, run_training

    # Configuration errors are user errors: report them as such (exit 2, no traceback) before any work.
    try:
        cfg = load_config(a.config, a.set)
        ev = eval_settings(cfg)
        _task_problems(dict(cfg.task), "train")  # missing data fails here, before the model is loaded
        task, train = build_task(cfg)
        heldout_problems(task, ev, train)
    except (ValueError, FileNotFoundError) as e:
        a.parser.error(str(e))
    try:
        summary = run_training(a.config, a.set, a.output_dir, resume=a.resume)
    except RunFolderError as e:
        a.parser.error(str(e))
    print(format_summary(summary))
    return 0


def _task_problems(task_cfg: dict, split: str):
    """Builds a config's task and reads one problem of ``split`` (fails fast on missing data files)."""
    from oar.app.tasks import get_task

    task_cfg.pop("train_size", None)
    task = get_task(task_cfg.pop("name", "arithmetic"), **(task_cfg.pop("kwargs", None) or {}))
    try:
        return task.problems(split, n=1)
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"{e}. Download the data (docs/data.md) and pass its path (--data for `oar attribute`, "
                      "task.kwargs.train_path for `oar train`) or set OAR_DATA_DIR") from None


def _attribute(a) -> int:
    from oar.app.attribute import run_attribute

    try:
        kwargs = {"test_path": a.data} if a.task == "gsm8k" and a.data else ({"path": a.data} if a.data else {})
        _task_problems({"name": a.task, "kwargs": kwargs}, "test")
    except (ValueError, FileNotFoundError) as e:
        a.parser.error(str(e))
    run_attribute(a)
    return 0


def _eval_attribution(a) -> int:
    import math
    import os

    from oar.app.eval_attribution import run

    # Every usage error exits 2 with one line before the model is loaded (and before hours of work whose results
    # could not be written).
    for name, v, lo in (("--traces", a.traces, 1), ("--draws", a.draws, 1), ("--problems", a.problems, 1),
                        ("--num-generations", a.num_generations, 1), ("--max-new-tokens", a.max_new_tokens, 1)):
        if v < lo:
            a.parser.error(f"{name} must be >= {lo}, got {v}")
    if not (math.isfinite(a.temperature) and a.temperature > 0):
        a.parser.error(f"--temperature must be finite and > 0, got {a.temperature}")
    from oar.schema import OARConfig

    # the config keys these flags set: their ranges are the schema's (include/oar/core/config.h), checked by it
    for name, key, vs in (("--screen-sample", "screen_sample", [a.screen_sample]),
                          ("--screen-fractions", "screen_fraction", a.screen_fractions),
                          ("--screen-window", "screen_window", [a.screen_window]),
                          ("--windows", "screen_window", a.windows)):
        for v in vs:
            try:
                OARConfig(**{key: v})
            except ValueError as e:
                a.parser.error(str(e).replace(f"oar.{key}", name, 1))
    if a.screen_sample == 0 and 0 in a.screen_fractions:
        a.parser.error("--screen-fractions 0 needs --screen-sample > 0 (nothing would be masked exactly)")
    if not a.out or a.out.endswith(("/", os.sep)) or os.path.isdir(a.out):
        a.parser.error(f"--out must be a file prefix (PREFIX.csv, .md, .png, .json are written), got {a.out!r}")
    for task in dict.fromkeys(a.tasks):
        kwargs = {"test_path": a.data} if task == "gsm8k" and a.data else {}
        try:
            _task_problems({"name": task, "kwargs": kwargs}, "test")  # GSM8K and MATH500 read local files
        except (ValueError, FileNotFoundError) as e:
            a.parser.error(str(e))
    out_dir = os.path.dirname(os.path.abspath(a.out))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        a.parser.error(f"--out: cannot create the output directory {out_dir!r}: {e.strerror or e}")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        a.parser.error(f"--out: the output directory {out_dir!r} is not writable")
    run(a)
    return 0


def _compare(a) -> int:
    import os

    from oar.app.compare import run_compare
    from oar.app.compare_report import build_report

    if os.path.exists(a.out) and not os.path.isdir(a.out):
        a.parser.error(f"--out must be a folder, got the file {a.out!r}")
    if a.report_only:
        if not os.path.isdir(os.path.join(a.out, "results")):
            a.parser.error(f"--report-only: {a.out!r} holds no results/ folder (run the sweep first)")
        try:
            report = build_report(a.out)
        except ValueError as e:
            print(f"oar compare: {e}", file=sys.stderr)
            return 1
        print(open(os.path.join(a.out, "compare.md")).read() if report else f"no finished runs in {a.out}")
        return 0
    try:
        from oar.app.config import load_config
        from oar.app.train import build_task, eval_settings, heldout_problems

        cfg = load_config(a.config, a.set)
        ev = eval_settings(cfg)
        _task_problems(dict(cfg.task), "train")
        task, train = build_task(cfg)
        heldout_problems(task, ev, train)
        if a.max_runs is not None and a.max_runs < 1:
            raise ValueError(f"--max-runs must be >= 1, got {a.max_runs}")
        from oar.app.compare import check_grid

        check_grid(a.methods, a.seeds, a.set)
    except (ValueError, FileNotFoundError) as e:
        a.parser.error(str(e))
    res = run_compare(a.config, a.set, a.methods, a.seeds, a.out, max_runs=a.max_runs,
                      save_models=a.save_models, progress=not a.no_progress)
    md = os.path.join(a.out, "compare.md")
    if os.path.exists(md):
        print(open(md).read())
    print(f"[oar] {res['done']} runs finished, {len(res['pending'])} pending"
          + (f" (resume with the same command: {', '.join(res['pending'][:6])}...)" if res["pending"] else "")
          + (f"; failed: {', '.join(res['failed'])}" if res["failed"] else ""))
    return 1 if res["failed"] else 0


def _diagnose(a) -> int:
    import os

    from oar.app.config import load_config
    from oar.app.diagnose import diagnose_main

    if os.path.exists(a.out) and not os.path.isdir(a.out):
        a.parser.error(f"--out must be a folder, got the file {a.out!r}")
    flags = {k: getattr(a, k) for k in ("methods", "batches", "prompts", "group", "ref_prompts", "ref_group",
                                        "ref_folds", "micro_batch", "sketch_dim", "reward_batches", "reward_prompts",
                                        "reward_samples", "step_norm", "step_scales")}
    if a.margins is not None:
        flags["margins"] = {}
        for item in a.margins:
            label, sep, value = item.rpartition("=")
            try:
                v = float(value)
            except ValueError:
                sep = ""
            if not sep or not label.strip():
                a.parser.error(f"--margins takes SETTING=VALUE items (e.g. oar_g=0.02), got {item!r}")
            label = label.strip()
            if label in flags["margins"]:
                a.parser.error(f"--margins names {label!r} twice ({flags['margins'][label]:g} and {v:g})")
            flags["margins"][label] = v
    try:
        _task_problems(dict(load_config(a.config, a.set).task), "train")  # missing data fails before the model loads
        summary = diagnose_main(a.config, a.set, a.out, flags, progress=not a.no_progress)
    except (ValueError, FileNotFoundError) as e:
        a.parser.error(str(e))
    print(open(os.path.join(a.out, "diagnose.md")).read())
    return 0 if summary["rows"] else 1


def _info(a) -> int:
    import oar

    print(json.dumps(oar.build_info(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from oar.schema import PROBES, OARConfig

    defaults = OARConfig()  # the schema's defaults (include/oar/core/config.h), not numbers written again here
    p = argparse.ArgumentParser(prog="oar", description="Outcome-grounded Advantage Reshaping for GRPO")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="GRPO + OAR training through TRL (default: configs/default.yaml)")
    t.add_argument("--config", default=None, help="YAML path or shipped name (default, compare_cpu, gsm8k, gpu_qwen_math, gpu_compare_math)")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set oar.method=oar_p --set grpo.max_steps=5")
    t.add_argument("--output-dir", default=None)
    t.add_argument("--resume", action="store_true",
                   help="continue from the last checkpoint-N in the output folder (grpo.save_strategy=steps)")
    t.set_defaults(func=_train, parser=t)

    at = sub.add_parser("attribute", help="sample G completions for one question, print per-token advantages, "
                                          "write an HTML heatmap comparing OAR-P and OAR-G")
    at.add_argument("--data", default=None, help="GSM8K JSONL (default: $OAR_DATA_DIR/gsm8k/test.jsonl)")
    at.add_argument("--index", type=int, default=0, help="question index in the file")
    at.add_argument("--task", default="gsm8k", help="gsm8k | arithmetic | math500")
    at.add_argument("--easiest", action="store_true",
                    help="GSM8K: index into the questions sorted by number of solution steps (easiest first)")
    at.add_argument("--model", default="smollm2-135m-instruct")
    at.add_argument("-G", "--num-generations", type=int, default=4)
    at.add_argument("--max-new-tokens", type=int, default=160)
    at.add_argument("--temperature", type=float, default=0.8)
    at.add_argument("--probe", default=defaults.probe, choices=PROBES)
    at.add_argument("--seed", type=int, default=0)
    at.add_argument("--out", default="runs/attribute/heatmap.html")
    at.add_argument("--top", type=int, default=10, help="print the top-N tokens per method")
    at.set_defaults(func=_attribute, parser=at)

    ev = sub.add_parser("eval-attribution",
                        help="recall of oracle-causal tokens among the top 10/20/30%% by OAR-P, OAR-G, entropy, random")
    ev.add_argument("--tasks", nargs="+", default=["arithmetic", "gsm8k"], choices=["arithmetic", "gsm8k", "math500"])
    ev.add_argument("--data", default=None, help="GSM8K test JSONL (default: $OAR_DATA_DIR/gsm8k/test.jsonl)")
    ev.add_argument("--model", default="smollm2-135m-instruct")
    ev.add_argument("--problems", type=int, default=60, help="problems sampled per task (easiest first for GSM8K)")
    ev.add_argument("--traces", type=int, default=16, help="correct traces to keep per task")
    ev.add_argument("-G", "--num-generations", type=int, default=8, help="samples per problem to find a correct one")
    ev.add_argument("--max-new-tokens", type=int, default=160)
    ev.add_argument("--temperature", type=float, default=0.8)
    ev.add_argument("--draws", type=int, default=8, help="OAR-G noise draws K (reported with K = 1 too)")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--screen-fractions", nargs="*", type=float, default=[0.05, 0.1, 0.2, 0.3],
                    help="screened OAR-P top fractions to score and compare with exact OAR-P (none: skip)")
    ev.add_argument("--screen-sample", type=float, default=defaults.screen_sample,
                    help="screened OAR-P random sample fraction (the config's screen_sample)")
    ev.add_argument("--screen-window", type=int, default=defaults.screen_window,
                    help="window of the windowed screen of screened OAR-P (the config's screen_window)")
    ev.add_argument("--windows", nargs="*", type=int, default=[0, 2, 8],
                    help="windowed OAR-P windows to score and compare with exact OAR-P (none: skip)")
    ev.add_argument("--out", default="runs/eval_attribution/recall", help="output prefix (.csv .md .png .json)")
    ev.set_defaults(func=_eval_attribution, parser=ev)

    c = sub.add_parser("compare", help="methods x seeds side by side on one config, held-out accuracy with "
                                       "bootstrap intervals (resumable)")
    c.add_argument("--config", default=None, help="YAML path or shipped name (default: default)")
    c.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override for every run (oar.method, run.seed, oar.seed are set per run)")
    c.add_argument("--methods", nargs="+", default=["grpo", "oar_g", "oar_p", "random"])
    c.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    c.add_argument("--out", default="runs/compare", help="sweep folder (resumable: finished runs are kept)")
    c.add_argument("--max-runs", type=int, default=None, help="start at most this many pending runs, then report")
    c.add_argument("--save-models", action="store_true", help="keep each run's trained policy")
    c.add_argument("--no-progress", action="store_true", help="no live progress display")
    c.add_argument("--report-only", action="store_true", help="rebuild the report from finished runs, run nothing")
    c.set_defaults(func=_compare, parser=c)

    d = sub.add_parser("diagnose", help="which credit points the update the right way: every method's update on the "
                                        "same rollouts against a held-out reward gradient (resumable)")
    d.add_argument("--config", default=None, help="YAML path or shipped name (default: default): model, task, sampling")
    d.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override, e.g. --set model.name=runs/default/model (a checkpoint)")
    d.add_argument("--out", default="runs/diagnose", help="output folder (resumable: finished batches are kept)")
    d.add_argument("--methods", nargs="+", default=None,
                   help="credit settings, the first is the baseline: grpo oar_g oar_p:screen=window ... "
                        "oar_g:credit_rows=positive entropy_top:quantile=0.2 (default: docs/diagnose.md)")
    d.add_argument("--batches", type=int, default=None, help="training batches (the paired units; default 24)")
    d.add_argument("--prompts", type=int, default=None, help="prompts per batch (default: the config's step)")
    d.add_argument("--group", type=int, default=None, help="rollouts per prompt (default: grpo.num_generations)")
    d.add_argument("--ref-prompts", type=int, default=None, help="held-out prompts of the reference gradient (96)")
    d.add_argument("--ref-group", type=int, default=None, help="rollouts per reference prompt (8)")
    d.add_argument("--ref-folds", type=int, default=None,
                   help="independent folds of the reference; intervals carry its noise by a jackknife over them (4)")
    d.add_argument("--micro-batch", type=int, default=None, help="rows per forward of the updates (0: whole batch)")
    d.add_argument("--sketch-dim", type=int, default=None, help="count-sketch size per update (65536)")
    d.add_argument("--reward-batches", type=int, default=None,
                   help="batches whose held-out reward after one step is sampled (default 0: none)")
    d.add_argument("--reward-prompts", type=int, default=None, help="held-out prompts of the reward check (64)")
    d.add_argument("--reward-samples", type=int, default=None, help="samples per prompt of the reward check (4)")
    d.add_argument("--step-norm", type=float, default=None,
                   help="length of the reward check's step along u/|u| (default: 4 x lr x sqrt(#params))")
    d.add_argument("--margins", nargs="+", action="extend", default=None, metavar="SETTING=VALUE",
                   help="pre-declared break-even margins of Δcos, tested one-sided (e.g. oar_g=0.021); stored in "
                        "state.json, so a resume cannot change them")
    d.add_argument("--step-scales", type=float, nargs="+", action="extend", default=None,
                   help="the reward check's steps as multiples of --step-norm, a scan of the linear regime (default: 1)")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    d.set_defaults(func=_diagnose, parser=d)

    i = sub.add_parser("info", help="print build information (CUDA kernels, torch versions)")
    i.set_defaults(func=_info)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs one ``oar`` command; returns its exit status (2: usage error, or the ``train`` extra is missing)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd != "info":  # every command but `info` trains, samples or plots: pip install "oar[train]"
        from oar.app._extras import require

        try:
            require("train", f"oar {args.cmd}")
        except ModuleNotFoundError as e:
            parser.exit(2, f"oar: error: {e}\n")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
