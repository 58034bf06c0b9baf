"""Timing of oar's CUDA kernels against plain PyTorch on the same GPU (issue 4).

For each case: the oar op and a PyTorch reference run on the same device with the same inputs; each is
timed with CUDA events around single calls (``--warmup`` untimed calls first, then the median of
``--repeats`` timed calls). The device-to-device copy bandwidth is measured the same way (``dst.copy_(src)``
of a ``--copy-mib`` buffer, counting bytes read + written).

Columns of the table (also written to ``$OUT/bench_cuda.csv`` and ``$OUT/bench_cuda.md``; ``$OUT`` defaults
to ``./gpu_results``, ``--out`` overrides both):

- ``ms``: median time of one oar call;
- ``GB/s``: bytes the op must move (every input element it reads once + every output written once; the
  compulsory traffic, not what the kernel actually moves: a second pass over an input that misses the L2 does
  not count) / time. The probe divergence reads positions s < lengths[n] only, so its bytes come from the
  case's actual lengths;
- ``%copy``: that bandwidth as a fraction of the measured copy bandwidth (issue 4's goal: >= 70% for the
  probe divergence and the reshaping kernel at large sizes, the rows marked ``large``);
- ``dev ms`` / ``%copy(dev)``: the same from the device time alone (GPU kernels and copies summed by the PyTorch
  profiler), without host-side gaps such as the step-level ops' 64-byte error-record read-back and wait;
- ``ref``/``ref ms``: the PyTorch reference and its median time; ``speed-up`` = ref ms / ms;
- ``max|d|``: largest absolute difference between the oar and reference outputs (a sanity check; the parity
  tests, the "cuda" cases of each op's test file, are the real ones).

References: ``oar.reference`` where it runs on the device (``probe_divergence``, float64; ``grad_x_input``,
float64; ``reshape_advantages_vectorized``, float32). ``oar.reference.group_advantages`` and
``build_masked_batch`` are host loops, so for them the reference is the vectorized PyTorch a user would write
on the GPU (``_torch_group_advantages``, ``_torch_masked_batch`` below).

Besides the issue's sizes, three groups of rows are diagnostics for the kernels that a reading of the code
flagged as slow at users' shapes (docs/gpu.md says what each should show and what to change if it does):
``probe_divergence`` at ``L=S`` (every row reads all S answer positions: S = 2 and 8 next to the S = 1 row of
the same N and V), ``normalize_importance`` next to ``reshape_advantages`` of the same size (the same first
passes without the quantile and the weights) plus a small ``B=64,T=1024`` batch, and ``group_advantages`` with
ragged groups whose sizes are skewed (many groups of 8 and one large group; the team size is chosen from
the average).

``--dry-run`` runs every case with tiny sizes on the CPU (wall-clock timer), so that the harness and the table
are exercised without a GPU (tests/python/core/test_cuda.py runs it).

Usage: python benchmarks/gpu/bench_cuda.py [--dry-run] [--repeats 30] [--warmup 5] [--out DIR] [--only SUBSTR]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import oar
from oar import ops
from oar import reference as ref


@dataclass
class Case:
    """One benchmark row. ``make`` builds the inputs on a device; ``oar_fn`` / ``ref_fn`` take them."""

    op: str
    size: str
    dtype: str
    make: Callable[[torch.device], tuple]
    oar_fn: Callable[..., object]
    ref_fn: Callable[..., object] | None
    ref_name: str
    nbytes: int | Callable[..., int]  # or a function of the inputs (bytes that depend on their values)
    large: bool = False
    extra: dict = field(default_factory=dict)


# ---- timing --------------------------------------------------------------------------------------------------


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of one call of ``fn`` (CUDA events on a GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def device_time_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Device time of one call of ``fn``: the summed durations of the GPU kernels and copies it queues (from the
    PyTorch profiler), so host-side gaps (a step-level op's error-record read-back) do not count. On the CPU:
    the self time of the ``oar::`` operators. NaN if the profiler is unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with profile(activities=acts) as prof:
            for _ in range(repeats):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        total_us = 0.0
        for e in prof.key_averages():
            if device.type == "cuda":
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    total_us += e.self_device_time_total
            elif e.key.startswith("oar::"):
                total_us += e.self_cpu_time_total
        return total_us / repeats / 1e3 if total_us > 0 else float("nan")
    except Exception as exc:  # noqa: BLE001  (a timing column must not stop the run)
        print(f"# device_time_ms: profiler unavailable ({exc})", file=sys.stderr)
        return float("nan")


def copy_bandwidth(device: torch.device, mib: int, warmup: int, repeats: int) -> tuple[float, float]:
    """Device-to-device copy of a ``mib`` MiB buffer: (median ms, GB/s counting bytes read + written)."""
    n = mib * (1 << 20) // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), device, warmup, repeats)
    return ms, 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


# ---- references that run on the device -----------------------------------------------------------------------


def _torch_group_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages of equal groups of ``group`` rows in vectorized PyTorch (TRL-style), float32."""
    r = rewards.view(-1, group)
    mean = r.mean(1, keepdim=True)
    std = r.std(1, keepdim=True)
    a = (r - mean) / (std + eps)
    a = torch.where((r == r[:, :1]).all(1, keepdim=True), torch.zeros_like(a), a)
    return a.reshape(-1)


def _torch_masked_batch(ids: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, pad: int) -> torch.Tensor:
    """The OAR-P masked batch in vectorized PyTorch: a row gather, then one scatter of PAD per variant."""
    out = ids.index_select(0, rows)
    return out.scatter_(1, pos[:, None], pad)


def _torch_group_advantages_ragged(rewards: torch.Tensor, offsets: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages of ragged CSR groups in vectorized PyTorch (segment sums by ``index_add_``), float32."""
    n, g = rewards.numel(), offsets.numel() - 1
    sizes = offsets.diff()
    gid = torch.repeat_interleave(torch.arange(g, device=rewards.device), sizes, output_size=n)
    cnt = sizes.to(torch.float32)
    mean = torch.zeros(g, device=rewards.device).index_add_(0, gid, rewards) / cnt
    d = rewards - mean[gid]
    std = (torch.zeros(g, device=rewards.device).index_add_(0, gid, d * d) / (cnt - 1)).sqrt()
    lo = torch.full((g,), float("inf"), device=rewards.device).scatter_reduce_(0, gid, rewards, "amin")
    hi = torch.full((g,), float("-inf"), device=rewards.device).scatter_reduce_(0, gid, rewards, "amax")
    a = d / (std[gid] + eps)
    return torch.where((lo == hi)[gid], torch.zeros_like(a), a)


def _torch_normalize(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked per-row log1p min-max normalization in vectorized PyTorch (float64 inside), float32."""
    lx = torch.log1p(scores.double())
    lo = torch.where(mask, lx, float("inf")).amin(1, keepdim=True)
    hi = torch.where(mask, lx, float("-inf")).amax(1, keepdim=True)
    den = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    return torch.where(mask, (lx - lo) / den, torch.zeros_like(lx)).float()


def _probe_backward_ref(clean, pert, lengths):
    p = pert.detach().double().requires_grad_(True)
    (g,) = torch.autograd.grad(ref.probe_divergence(clean, p, lengths=lengths).sum(), p)
    return g


# ---- cases ---------------------------------------------------------------------------------------------------


def _size_of(dt: torch.dtype) -> int:
    return torch.empty(0, dtype=dt).element_size()


def build_cases(dry: bool) -> list[Case]:
    """The issue's sizes (``dry``: tiny ones), plus ``large`` rows for the bandwidth goal."""
    cases: list[Case] = []

    def gen(seed):
        return torch.Generator().manual_seed(seed)

    # probe divergence (answer_mean; S = 1 is the "last"-position shape of OAR-G's probe)
    probe_sizes = [(64, 1, 151936, False), (512, 1, 151936, True), (64, 4, 49152, False)]
    if dry:
        probe_sizes = [(4, 1, 1000, False), (8, 2, 515, True)]
    for N, S, V, large in probe_sizes:
        for dt in (torch.bfloat16, torch.float32):
            def make(dev, N=N, S=S, V=V, dt=dt):
                g = gen(N + V)
                clean = (2 * torch.randn(N, S, V, generator=g)).to(dt)
                pert = (clean.float() + 0.5 * torch.randn(N, S, V, generator=g)).to(dt)
                lengths = torch.randint(1, S + 1, (N,), generator=g)
                return clean.to(dev), pert.to(dev), lengths.to(dev)

            es = _size_of(dt)
            # answer_mean reads clean + perturbed at positions s < L of each row, plus the lengths; writes (N,).
            cases.append(Case("probe_divergence", f"N={N},S={S},V={V}", str(dt).split(".")[-1], make,
                              lambda c, p, ln: ops.probe_divergence(c, p, lengths=ln),
                              lambda c, p, ln: ref.probe_divergence(c, p, lengths=ln),
                              "reference.probe_divergence (fp64)",
                              lambda c, p, ln, V=V, es=es: 2 * int(ln.sum()) * V * es + 12 * ln.numel(), large))
        # backward (bf16 only): reads clean + perturbed, writes the gradient.
        dt = torch.bfloat16

        def make_b(dev, N=N, S=S, V=V, dt=dt):
            g = gen(N + V + 1)
            clean = (2 * torch.randn(N, S, V, generator=g)).to(dt)
            pert = (clean.float() + 0.5 * torch.randn(N, S, V, generator=g)).to(dt)
            lengths = torch.randint(1, S + 1, (N,), generator=g)
            return torch.rand(N, generator=g).to(dev), clean.to(dev), pert.to(dev), lengths.to(dev)

        # reads clean + perturbed at positions s < L, writes the whole (N, S, V) gradient (zeros past L).
        cases.append(Case("probe_divergence_backward", f"N={N},S={S},V={V}", "bfloat16", make_b,
                          lambda go, c, p, ln: torch.ops.oar.probe_divergence_backward(go, c, p, None, ln,
                                                                                      "answer_mean"),
                          lambda go, c, p, ln: _probe_backward_ref(c, p, ln) * go.double()[:, None, None],
                          "autograd of reference.probe_divergence (fp64)",
                          lambda go, c, p, ln, N=N, S=S, V=V: (2 * int(ln.sum()) + N * S) * V * 2 + 16 * N, large))

    # Diagnostic (docs/gpu.md): answer_mean with every row reading all S positions (L = S), bf16, next to the
    # S = 1 row of the same N and V above; the position loop of the kernel runs L - 1 times per vector.
    for N, S, V in ([(64, 2, 151936), (64, 8, 151936)] if not dry else [(4, 2, 1000), (4, 8, 1000)]):
        def make_l(dev, N=N, S=S, V=V):
            g = gen(N + S + V)
            clean = (2 * torch.randn(N, S, V, generator=g)).to(torch.bfloat16)
            pert = (clean.float() + 0.5 * torch.randn(N, S, V, generator=g)).to(torch.bfloat16)
            return clean.to(dev), pert.to(dev), torch.full((N,), S, dtype=torch.int64).to(dev)

        cases.append(Case("probe_divergence", f"N={N},S={S},V={V},L=S", "bfloat16", make_l,
                          lambda c, p, ln: ops.probe_divergence(c, p, lengths=ln),
                          lambda c, p, ln: ref.probe_divergence(c, p, lengths=ln),
                          "reference.probe_divergence (fp64)", 2 * N * S * V * 2 + 12 * N))

    # normalize + reshape (raw scores -> token advantages), float32 scores
    reshape_sizes = [(64, 1024, False), (256, 4096, False), (2048, 8192, True)] if not dry else \
        [(4, 32, False), (8, 64, False), (16, 300, True)]
    for B, T, large in reshape_sizes:
        def make_r(dev, B=B, T=T):
            g = gen(B + T)
            adv = torch.randn(B, generator=g)
            scores = torch.rand(B, T, generator=g) * 2
            resp = torch.rand(B, T, generator=g) < 0.95
            reason = resp & (torch.rand(B, T, generator=g) < 0.8)
            return adv.to(dev), scores.to(dev), reason.to(dev), resp.to(dev)

        cases.append(Case("reshape_advantages", f"B={B},T={T}", "float32", make_r,
                          lambda a, s, rm, pm: ops.reshape_advantages(a, s, rm, pm)[0],
                          lambda a, s, rm, pm: ref.reshape_advantages_vectorized(a, s, rm, pm)[0],
                          "reference.reshape_advantages_vectorized", B * T * (4 + 1 + 1 + 4 + 4) + 4 * B, large))
        # Diagnostic (docs/gpu.md): the same row kernel's passes 1-2 alone (read scores + one mask, write the
        # normalized scores): reshape minus this is the quantile's radix passes and the weights.
        cases.append(Case("normalize_importance", f"B={B},T={T}", "float32", make_r,
                          lambda a, s, rm, pm: ops.normalize_importance(s, rm),
                          lambda a, s, rm, pm: _torch_normalize(s, rm), "torch vectorized (bench)",
                          B * T * (4 + 1 + 4)))

    # group advantages (GRPO, groups of 8)
    n, group = (4096, 8) if not dry else (64, 8)

    def make_g(dev, n=n):
        r = torch.randint(0, 3, (n,), generator=gen(n)).float() / 2
        return (r.to(dev),)

    cases.append(Case("group_advantages", f"n={n},G={n // group}", "float32", make_g,
                      lambda r: ops.group_advantages(r, group_size=group, preset="trl"),
                      lambda r: _torch_group_advantages(r, group), "torch vectorized (bench)", n * 8))

    # Diagnostic (docs/gpu.md): ragged groups of skewed sizes, many groups of 8 and one large group. The average
    # group (~24 rewards) selects one warp per group, so one warp walks the large group three times.
    small, big = (4096, 65536) if not dry else (8, 64)

    def make_s(dev, small=small, big=big):
        sizes = [8] * small + [big]
        off = torch.tensor([0] + sizes).cumsum(0)
        r = torch.randint(0, 3, (int(off[-1]),), generator=gen(big)).float() / 2
        return r.to(dev), off.to(dev)

    ns = 8 * small + big
    cases.append(Case("group_advantages", f"n={ns},G={small + 1},ragged 8x{small}+{big}", "float32", make_s,
                      lambda r, off: ops.group_advantages(r, off, preset="trl"),
                      lambda r, off: _torch_group_advantages_ragged(r, off), "torch vectorized ragged (bench)",
                      ns * 8 + (small + 2) * 8))

    # grad x input
    rows, H = (16384, 2048) if not dry else (64, 64)

    def make_x(dev, rows=rows, H=H):
        g = gen(rows + H)
        return (torch.randn(rows // 16, 16, H, generator=g).to(torch.bfloat16).to(dev),
                torch.randn(rows // 16, 16, H, generator=g).to(torch.bfloat16).to(dev))

    cases.append(Case("grad_x_input", f"rows={rows},H={H}", "bfloat16", make_x, ops.grad_x_input,
                      ref.grad_x_input, "reference.grad_x_input (fp64)", 2 * rows * H * 2 + 4 * rows))

    # OAR-P masked batch
    M, T = (4096, 1024) if not dry else (16, 32)
    Bc = 64 if not dry else 4

    def make_m(dev, M=M, T=T, Bc=Bc):
        g = gen(M + T)
        return (torch.randint(0, 50000, (Bc, T), generator=g).to(dev), torch.randint(0, Bc, (M,), generator=g).to(dev),
                torch.randint(0, T, (M,), generator=g).to(dev))

    cases.append(Case("build_masked_batch", f"M={M},T={T}", "int64", make_m,
                      lambda i, r, p: ops.build_masked_batch(i, r, p, 0),
                      lambda i, r, p: _torch_masked_batch(i, r, p, 0), "torch gather+scatter (bench)",
                      2 * M * T * 8 + 16 * M))
    return cases


# ---- run + report --------------------------------------------------------------------------------------------


def _max_diff(a, b) -> float:
    if a is None or b is None:
        return float("nan")
    return float((a.detach().double() - b.detach().double().to(a.device)).abs().max().item()) if a.numel() else 0.0


def run(args) -> list[dict]:
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    if not dry:
        if not torch.cuda.is_available():
            raise SystemExit("bench_cuda: no CUDA device (use --dry-run to exercise the harness on the CPU)")
        if not oar.has_cuda_kernels():
            raise SystemExit("bench_cuda: this oar build has no CUDA kernels (rebuild with nvcc)")
    warmup, repeats = (1, 3) if dry else (args.warmup, args.repeats)
    copy_ms, copy_gbs = copy_bandwidth(device, 4 if dry else args.copy_mib, warmup, repeats)
    print(f"# copy {4 if dry else args.copy_mib} MiB: {copy_ms:.4f} ms, {copy_gbs:.1f} GB/s", flush=True)
    rows = [dict(op="copy", size=f"{4 if dry else args.copy_mib} MiB", dtype="float32", ms=copy_ms, gbs=copy_gbs,
                 frac=1.0, dev_ms=copy_ms, dev_frac=1.0, ref="", ref_ms=float("nan"), speedup=float("nan"),
                 maxdiff=0.0, large=False)]
    for case in build_cases(dry):
        if args.only and args.only not in case.op:
            continue
        inputs = case.make(device)
        ms = time_fn(lambda: case.oar_fn(*inputs), device, warmup, repeats)
        ref_ms, diff = float("nan"), float("nan")
        if case.ref_fn is not None:
            ref_repeats = max(3, repeats // 3)
            ref_ms = time_fn(lambda: case.ref_fn(*inputs), device, min(warmup, 2), ref_repeats)
            diff = _max_diff(case.oar_fn(*inputs), case.ref_fn(*inputs))
        dev_ms = device_time_ms(lambda: case.oar_fn(*inputs), device, max(3, min(repeats, 10)))
        nbytes = case.nbytes(*inputs) if callable(case.nbytes) else case.nbytes
        gbs = nbytes / (ms * 1e-3) / 1e9
        dev_frac = nbytes / (dev_ms * 1e-3) / 1e9 / copy_gbs
        # One line per case as it finishes: a run stopped by a time limit keeps the rows done so far.
        print(f"# {case.op} {case.size} {case.dtype}: {ms:.4f} ms, {gbs:.1f} GB/s ({100 * gbs / copy_gbs:.0f}% of "
              f"copy), device {dev_ms:.4f} ms; ref {ref_ms:.4f} ms", flush=True)
        rows.append(dict(op=case.op, size=case.size, dtype=case.dtype, ms=ms, gbs=gbs, frac=gbs / copy_gbs,
                         dev_ms=dev_ms, dev_frac=dev_frac, ref=case.ref_name, ref_ms=ref_ms, speedup=ref_ms / ms,
                         maxdiff=diff, large=case.large))
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _num(x: float, fmt: str) -> str:
    return "" if x != x else fmt.format(x)


def format_table(rows: list[dict]) -> str:
    """Fixed-width text table of the rows (the same columns as the CSV)."""
    head = ["op", "size", "dtype", "ms", "GB/s", "%copy", "dev ms", "%copy(dev)", "ref", "ref ms", "speed-up",
            "max|d|"]
    body = []
    for r in rows:
        body.append([r["op"] + (" (large)" if r["large"] else ""), r["size"], r["dtype"], f"{r['ms']:.4f}",
                     f"{r['gbs']:.1f}", f"{100 * r['frac']:.0f}%", _num(r["dev_ms"], "{:.4f}"),
                     _num(100 * r["dev_frac"], "{:.0f}%"), r["ref"],
                     "" if r["ref_ms"] != r["ref_ms"] else f"{r['ref_ms']:.4f}",
                     "" if r["speedup"] != r["speedup"] else f"{r['speedup']:.1f}x",
                     "" if r["maxdiff"] != r["maxdiff"] else f"{r['maxdiff']:.2e}"])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def format_markdown(rows: list[dict], env: dict) -> str:
    out = [f"GPU: {env['device']}; torch {env['torch']}; oar {env['oar']}; median of {env['repeats']} calls "
           f"after {env['warmup']} warm-up calls, {env['timer']}.", "",
           "| op | size | dtype | ms | GB/s | % of copy | device ms | % of copy (device) | reference | ref ms | "
           "speed-up |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        ref_ms = "" if r["ref_ms"] != r["ref_ms"] else f"{r['ref_ms']:.4f}"
        sp = "" if r["speedup"] != r["speedup"] else f"{r['speedup']:.1f}x"
        out.append(f"| {r['op']}{' (large)' if r['large'] else ''} | {r['size']} | {r['dtype']} | {r['ms']:.4f} | "
                   f"{r['gbs']:.0f} | {100 * r['frac']:.0f}% | {_num(r['dev_ms'], '{:.4f}')} | "
                   f"{_num(100 * r['dev_frac'], '{:.0f}%')} | {r['ref']} | {ref_ms} | {sp} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (tests the harness; no GPU)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--copy-mib", type=int, default=1024, help="buffer size of the copy-bandwidth measurement")
    p.add_argument("--only", default="", help="run only the cases whose op name contains this")
    p.add_argument("--out", default=None, help="output folder (default: $OUT, else ./gpu_results)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    out_dir = args.out or os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu_results")
    os.makedirs(out_dir, exist_ok=True)
    rows = run(args)
    env = dict(device="cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(),
               torch=torch.__version__, oar=oar.__version__, repeats=3 if args.dry_run else args.repeats,
               warmup=1 if args.dry_run else args.warmup, build=oar.build_info(),
               timer="wall clock" if args.dry_run else "CUDA events")
    print(f"# {env['device']}, torch {env['torch']}, median of {env['repeats']} calls after {env['warmup']} warm-up")
    print(format_table(rows))
    with open(os.path.join(out_dir, "bench_cuda.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, "bench_cuda.md"), "w") as f:
        f.write(format_markdown(rows, env))
    with open(os.path.join(out_dir, "bench_cuda_env.json"), "w") as f:
        json.dump(env, f, indent=1, default=str)
    print(f"# wrote {out_dir}/bench_cuda.csv, bench_cuda.md, bench_cuda_env.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
