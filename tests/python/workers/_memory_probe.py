"""Worker of test_memory_budget.py: runs ONE attribution engine call in a fresh process and prints its peak memory.

``python _memory_probe.py SETTING`` builds the test model and a long batch (L = 2048 reasoning tokens), warms the
model up on a short input, reads the resident set size (RSS, /proc/self/statm) and the process high-water mark
(``VmHWM``), runs the engine call of SETTING and prints one JSON line: ``rss0`` (bytes resident before the
call), ``max0`` (high-water mark before), ``max1`` (after), ``peak`` = max1 - rss0 (the most the call added on top
of what was resident: an upper bound of its peak when max0 - rss0 is small, which the test checks), the budget,
the bytes the planner declares outside chunks (:func:`oar.attribution.planner.resident_bytes`) and the stats.

Run it with ``MALLOC_ARENA_MAX=1`` and ``MALLOC_MMAP_THRESHOLD_=65536`` (test_memory_budget.py does): every
allocation of 64 KiB or more is then its own mmap, returned to the system when freed, so the RSS follows the live
tensors; smaller ones come from one arena whose free space is reused (docs/design.md, "Memory planner: what the
budget covers").
"""

from __future__ import annotations

import json
import os
import sys

import torch

#: The test model: Llama, random weights (fine for memory, never for fidelity), sized so that the budget binds.
MODEL = dict(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688,
             max_position_embeddings=4096, tokenizer="minimal", seed=0)
#: Reasoning lengths of the two rows (the first at the issue's L = 2048; the second shorter, so rows are padded).
LENGTHS = (2048, 1900)
#: Budget of every engine call, MiB.
BUDGET_MB = 128


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss() -> int:
    """The high-water mark of this process's own address space (/proc/self/status ``VmHWM``, KiB). Not
    ``ru_maxrss``: Linux carries that over fork and exec, so a child of a large parent (pytest after a long
    session) starts with the parent's resident size as its high-water mark."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def build(attn: str = "sdpa"):
    from oar.testing import tiny_random_llama
    from oar.attribution import HFProbeModel
    from oar.attribution.context import ProbeContextBuilder

    model, tok = tiny_random_llama(**MODEL)
    model.config._attn_implementation = attn
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (n,), generator=g).tolist() for n in (24, 40)]
    responses = [torch.randint(4, 100, (L,), generator=g).tolist() for L in LENGTHS]
    batch = ProbeContextBuilder(tok, conclude="\nAnswer: \\boxed{").build(prompts, responses, ["42", "7"],
                                                                          reasoning_lens=list(LENGTHS))
    return HFProbeModel(model), batch


def positions(batch, n: int) -> dict:
    """``n`` evenly spaced reasoning indices per row (the context stays full length: the memory of a variant does
    not depend on how many are scored, only the time does)."""
    out = {}
    for r in range(batch.batch_size):
        L = int(batch.reasoning_len[r])
        out[r] = sorted({(i * L) // n for i in range(n)})
    return out


def run(setting: str) -> dict:
    from oar.attribution import oar_g_scores, oar_p_scores, oar_p_window_scores, planner
    from oar.attribution.screened import oar_p_screened_scores

    torch.set_num_threads(int(os.environ.get("OAR_MEMTEST_THREADS", "2")))
    pm, batch = build(os.environ.get("OAR_MEMTEST_ATTN", "sdpa"))
    with torch.no_grad():  # warm-up: kernels loaded, thread pools started, on a short input
        pm.tail_logits(input_ids=batch.input_ids[:, -16:], attention_mask=batch.attention_mask[:, -16:],
                       position_ids=batch.position_ids[:, -16:], keep=batch.keep)
    rows = list(range(batch.batch_size))
    T = int(batch.input_ids.shape[1])
    kw = dict(memory_budget_mb=BUDGET_MB)
    if setting == "oar_g":
        call = lambda: oar_g_scores(pm, batch, positions=positions(batch, 64), generator=torch.Generator().manual_seed(0), **kw)  # noqa: E731
        resident = planner.resident_bytes(pm, batch, "oar_g", len(rows))
    elif setting in ("oar_p_batched", "oar_p_prefix"):
        engine = setting.rsplit("_", 1)[1]
        call = lambda: oar_p_scores(pm, batch, engine=engine, positions=positions(batch, 4), **kw)  # noqa: E731
        resident = planner.resident_bytes(pm, batch, engine, len(rows))
    elif setting in ("oar_p_window", "oar_p_window_dense"):
        if setting.endswith("dense"):
            pm.shared_prefix_attention = False  # the path GPUs run: cache copied per variant, one 4-D mask
        call = lambda: oar_p_window_scores(pm, batch, window=8, positions=positions(batch, 32), **kw)  # noqa: E731
        resident = planner.resident_bytes(pm, batch, "window", len(rows))
    elif setting == "oar_p_screened":
        def call():
            screen = oar_p_window_scores(pm, batch, window=8, positions=positions(batch, 32), keep_clean_pass=True,
                                         **kw)
            return oar_p_screened_scores(pm, batch, screen, fraction=1 / 16, sample_fraction=1 / 32,
                                         generator=torch.Generator().manual_seed(0), positions=positions(batch, 32),
                                         engine="prefix", **kw)
        resident = planner.resident_bytes(pm, batch, "window", len(rows))
    else:
        raise SystemExit(f"unknown setting {setting!r}")
    rss0, max0 = _rss(), _maxrss()
    res = call()
    max1 = _maxrss()
    if not bool(torch.isfinite(res.scores).all()):
        raise SystemExit("non-finite scores")
    stats = {k: v for k, v in res.stats.items() if isinstance(v, (int, float, str))}
    return dict(setting=setting, T=T, rss0=rss0, max0=max0, max1=max1, peak=max1 - rss0, budget=BUDGET_MB << 20,
                resident=int(resident), stats=stats)


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
