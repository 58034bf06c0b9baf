"""Do attribution scores under bf16 autocast rank like float32 scores? (issue 23, item 5)

On real responses of SmolLM2-135M-Instruct (``long_traces.py``'s JSONL), per trace and setting: the scores of a float32
run and of a run under CPU bf16 autocast, their Spearman correlation (over units for span settings, whose tokens
share their unit's score) and the median relative error of the top-10% scores; with the probe logits in float32
(``HFProbeModel.probe_logits_float32``, the default) and, with ``--model-head``, the model's own bf16 head too.

Usage:  python benchmarks/python/bf16_ranks.py --traces benchmarks/data/long_traces.jsonl [--rows 0 1] [--model-head]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from oar.app.stats import spearman


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="benchmarks/data/long_traces.jsonl")
    ap.add_argument("--rows", type=int, nargs="+", default=[0])
    ap.add_argument("--model-head", action="store_true", help="also run with the model's own (bf16) LM head")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from oar.app.models import load_model
    from oar.attribution import HFProbeModel, ProbeContextBuilder, oar_g_scores, oar_p_scores, oar_p_window_scores
    from oar.attribution.spans import span_starts, spans_of, token_texts

    model, tok = load_model()
    traces = [json.loads(line) for line in open(a.traces)]
    for row in a.rows:
        tr = traces[row]
        b = ProbeContextBuilder(tok, "\nTherefore, the final answer is \\boxed{").build(
            [tr["prompt_ids"]], [tr["response_ids"]], [tr["answer"]])
        L, s = int(b.reasoning_len[0]), int(b.reasoning_start[0])
        spans = {0: spans_of(span_starts(token_texts(tok, b.input_ids[0, s:s + L]), "line"))}
        firsts = torch.tensor([j0 for j0, _ in spans[0]])
        pm = HFProbeModel(model)
        runs = {"window W=8": (lambda: oar_p_window_scores(pm, b, window=8), None),
                "span line, window W=8": (lambda: oar_p_window_scores(pm, b, window=8, spans=spans), firsts),
                "span line, exact": (lambda: oar_p_scores(pm, b, spans=spans), firsts),
                "oar_g (1 draw)": (lambda: oar_g_scores(pm, b, generator=torch.Generator().manual_seed(0)), None)}
        print(f"trace {tr.get('id', row)}: L = {L}, {len(spans[0])} lines")
        for name, (fn, pick) in runs.items():
            heads = [True, False] if a.model_head else [True]
            pm.probe_logits_float32 = True
            t0 = time.perf_counter()
            ref = fn().scores[0, :L]
            t32 = time.perf_counter() - t0
            for f32 in heads:
                pm.probe_logits_float32 = f32
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    t0 = time.perf_counter()
                    got = fn().scores[0, :L]
                    t16 = time.perf_counter() - t0
                x, y = (ref, got) if pick is None else (ref[pick], got[pick])
                top = x >= x.quantile(0.9)
                rel = float(((x - y).abs()[top] / x[top].clamp_min(1e-30)).median())
                rho = spearman(x.tolist(), y.tolist())
                print(f"  {name:24s} head {'float32' if f32 else 'model  '}: spearman {rho:.4f}, "
                      f"top-10% median rel. error {rel:.3g}, seconds fp32 {t32:.1f} bf16 {t16:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
