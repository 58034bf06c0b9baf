"""Floating-point work of one GRPO step and of exact OAR-P on the fixed-shape suite of bench_step.py (issue 3, §3).

The step benchmark measures time; this script counts the arithmetic each provider must do, which bounds
what any implementation can reach on a compute-bound device. Exact OAR-P must run, for every reasoning
token t, the model over columns [t, T) of the masked context (everything after t depends on t), so its work
is fixed by the model shape and the lengths; a faster engine only removes overhead above that count.

Counts (multiply-add = 2 FLOPs; Llama layers: q/k/v/o projections, gated MLP, attention):
  token_flops      projections + MLP of one token through all layers
  attention        4 * heads * head_dim per (query, key) pair and layer
  lm_head          2 * hidden * vocab per position whose logits are computed
Attribution providers, per group of G rollouts (L response tokens, T probe-context width):
  naive_batched    per variant: a full causal forward over T columns with logits at every position
  ours_ideal       per row a clean forward over T (logits on the probe window), per variant the suffix
                   [t, T) attending causally over t + its own prefix (the least any exact engine runs)
  ours_built       the prefix engine as built: chunk prefixes as planned by the engine (default
                   max_prefix_waste), suffix attention causal (the shared-prefix attention of CPU Llama/Qwen
                   models) or, with --dense, over every column through an explicit mask (the cached path)
Reported: naive_batched / ours (the best speed-up an exact prefix engine can show over the naive one, ideal
and as built), and for the step goal (OAR-P step <= 2.5x a GRPO step, i.e. attribution <= 1.5 GRPO steps)
the attribution throughput that goal needs, ours_ideal / (1.5 x the measured GRPO step), next to the
throughput the machine reaches on the naive provider's large batched forwards (naive_batched / its measured
time). Generation is latency-bound (one token per model call), so the GRPO step is not a FLOP count; the
measured step time is the yardstick.

Usage:  python benchmarks/python/flop_bounds.py [--lengths 128 512 2048] [--out docs/benchmarks/flop_bounds]
        (writes .md and .csv; reads docs/benchmarks/step.csv, when present, for the measured columns)
"""

from __future__ import annotations

import argparse
import csv
import os
from dataclasses import dataclass

import torch

import oar
from oar import _lib


@dataclass(frozen=True)
class Shape:
    """Llama-style decoder shape: hidden size H, intermediate size I, layers, heads, kv heads, head dim, vocab V."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> "Shape":
        """Shape of a transformers ``LlamaConfig``-like config."""
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(int(config.hidden_size), int(config.intermediate_size), int(config.num_hidden_layers), heads,
                   int(getattr(config, "num_key_value_heads", None) or heads), head_dim, int(config.vocab_size))

    def token_flops(self) -> int:
        """FLOPs of the projections and the gated MLP for one token through all layers (no attention)."""
        q_o = 2 * 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * 2 * self.hidden * self.intermediate
        return self.layers * (q_o + k_v + mlp)

    def pair_flops(self) -> int:
        """FLOPs of one (query, key) pair over all layers: scores + weighted values."""
        return self.layers * 4 * self.heads * self.head_dim

    def lm_head_flops(self) -> int:
        """FLOPs of the logits of one position."""
        return 2 * self.hidden * self.vocab


def causal_pairs(start: int, end: int) -> int:
    """(query, key) pairs of causal attention for query columns [start, end) over keys [0, column]."""
    return sum(c + 1 for c in range(start, end))


def forward_flops(s: Shape, start: int, end: int, keys_per_query: int | None, logits: int) -> int:
    """One forward of query columns [start, end): causal keys when ``keys_per_query`` is None, else that many
    keys per query (a dense mask over the whole context); ``logits`` positions through the LM head."""
    n = end - start
    pairs = causal_pairs(start, end) if keys_per_query is None else n * keys_per_query
    return n * s.token_flops() + pairs * s.pair_flops() + logits * s.lm_head_flops()


def naive_batched_flops(s: Shape, T: int, columns: list[int]) -> int:
    """Every masked variant: a full causal forward over T columns with logits at every position."""
    return len(columns) * forward_flops(s, 0, T, None, T)


def ours_ideal_flops(s: Shape, T: int, columns: list[int], rows: int, keep: int) -> int:
    """Clean forward per row + per variant the causal suffix [t, T), logits on the probe window only."""
    return rows * forward_flops(s, 0, T, None, keep) + sum(forward_flops(s, c, T, None, keep) for c in columns)


def ours_built_flops(s: Shape, T: int, columns: list[int], rows: int, keep: int, max_prefix_waste: float,
                     dense: bool = False) -> int:
    """The prefix engine as built: chunks from the C++ planner (``plan_prefix_chunks``, unlimited memory);
    every variant of a chunk with prefix p runs [p, T), attending causally (shared-prefix attention) or,
    when ``dense``, over all T columns (the cached path's explicit mask)."""
    plan = _lib.load_extension().plan_prefix_chunks(sorted(columns), T, 1, 1, 1, 2**62, 0, float(max_prefix_waste))
    total = rows * forward_flops(s, 0, T, None, keep)
    for ch in plan:
        total += (ch.end - ch.begin) * forward_flops(s, ch.prefix_len, T, T if dense else None, keep)
    return total


def fixed_suite(L: int, G: int = 4, prompt_len: int = 64):
    """The fixed-shape suite of bench_step.py at response length L: (shape, P, T, keep, masked columns)."""
    from oar.attribution import ProbeContextBuilder
    from oar.testing import tiny_random_llama

    model, tok = tiny_random_llama(vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4, seed=0,
                                   tokenizer="minimal", max_position_embeddings=L + 256)
    g = torch.Generator().manual_seed(L)
    prompt = torch.randint(4, 101, (prompt_len,), generator=g).tolist()
    responses = [torch.randint(4, 101, (L,), generator=g) for _ in range(G)]
    batch = ProbeContextBuilder(tok, oar.OARConfig().conclude).build([prompt] * G, responses, ["42"] * G, [L] * G)
    T = int(batch.input_ids.shape[1])
    columns = [int(batch.reasoning_start[r]) + j for r in range(G) for j in range(int(batch.reasoning_len[r]))]
    return Shape.of(model.config), prompt_len, T, int(batch.keep), columns


def measured(path: str) -> dict:
    """{(L, provider): row} from bench_step.py's CSV (fixed suite), or {} when absent."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {(int(r["response_len"]), r["provider"]): r for r in csv.DictReader(f) if r["suite"] == "fixed"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 2048])
    p.add_argument("--step-csv", default="docs/benchmarks/step.csv", help="measured step benchmark (optional)")
    p.add_argument("--max-prefix-waste", type=float, default=0.1, help="the engine's planner setting (its default)")
    p.add_argument("--dense", action="store_true", help="as built = the cached path (dense mask) instead of the "
                   "shared-prefix attention")
    p.add_argument("--out", default="docs/benchmarks/flop_bounds")
    args = p.parse_args(argv)
    meas = measured(args.step_csv)
    rows = []
    for L in args.lengths:
        s, _, T, keep, cols = fixed_suite(L)
        G = 4
        naive = naive_batched_flops(s, T, cols)
        ideal = ours_ideal_flops(s, T, cols, G, keep)
        built = ours_built_flops(s, T, cols, G, keep, args.max_prefix_waste, args.dense)
        m_all = meas.get((L, "oar_p_all_rows"), {})
        m_naive = meas.get((L, "oar_p_naive_batched"), {})
        grpo_s = float(m_naive["grpo_step_s"]) if m_naive else None
        rows.append({
            "response_len": L, "context_width_T": T,
            "naive_batched_gflop": naive / 1e9, "ours_ideal_gflop": ideal / 1e9, "ours_built_gflop": built / 1e9,
            "bound_naive_over_ideal": naive / ideal, "bound_naive_over_built": naive / built,
            "measured_naive_over_ours": float(m_all["naive_batched_over_this"]) if m_all else None,
            "measured_grpo_step_s": grpo_s,
            "needed_gflops_for_2_5x": ideal / 1e9 / (1.5 * grpo_s) if grpo_s else None,
            "achieved_gflops_naive": naive / 1e9 / float(m_naive["attribution_s"]) if m_naive else None,
        })
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = ["| L | T | naive batched GFLOP | ours ideal GFLOP | ours as built GFLOP | naive / ours bound: ideal | "
             "as built | measured | GRPO step s | GFLOP/s needed for <= 2.5x | GFLOP/s reached (naive batched) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['response_len']} | {r['context_width_T']} | {r['naive_batched_gflop']:.0f} | "
            f"{r['ours_ideal_gflop']:.0f} | {r['ours_built_gflop']:.0f} | {r['bound_naive_over_ideal']:.2f}x | "
            f"{r['bound_naive_over_built']:.2f}x | {fmt(r['measured_naive_over_ours'], '.2f')}x | "
            f"{fmt(r['measured_grpo_step_s'], '.2f')} | {fmt(r['needed_gflops_for_2_5x'], '.0f')} | "
            f"{fmt(r['achieved_gflops_naive'], '.0f')} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
