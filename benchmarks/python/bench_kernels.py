"""Kernel micro-benchmarks on CPU, oar vs plain PyTorch side by side in one run (issue 3, §4).

Cases:
  probe divergence  N = 64 rows, S = 4 probe positions, V in {49152, 151936}, fp32 and bf16 input,
                    probes last / answer_mean / answer_joint.
                    oar: torch.ops.oar.probe_divergence (fused log-softmax + KL, fp32 accumulation).
                    torch: what a user writes: log_softmax of the (mean) logits in fp32, then the KL sum
                    (answer_joint: log_softmax of every position, gather the answer ids).
  normalize+reshape B = 256, L = 4096 (75% of tokens reasoning), fp32.
                    oar: torch.ops.oar.reshape_advantages (raw scores -> token advantages).
                    torch: oar.reference.reshape_advantages_vectorized (log1p, masked min-max,
                    nanquantile, tiers, mass preservation; float32, vectorized).
                    loop-ref: oar.reference.reshape_advantages (the row-loop float64 reference).

Time: median of --repeats timed calls after --warmup calls, in this process, providers interleaved.
Peak memory: each (case, provider) runs in a fresh subprocess that builds the inputs, runs the op once
(warm-up), resets the peak RSS (Linux /proc/self/clear_refs), runs the op again and reads the peak RSS
(VmHWM): peak minus the RSS before the call is the extra memory the op needed beyond its inputs,
including its output (MiB; resolution: the OS's page accounting, so Linux only).

Usage: python benchmarks/python/bench_kernels.py [--repeats 10] [--out docs/benchmarks/kernels]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

N, S = 64, 4


def _inputs(case: dict):
    g = torch.Generator().manual_seed(0)
    if case["kind"] == "probe":
        V, dt = case["V"], getattr(torch, case["dtype"])
        clean = (torch.randn(N, S, V, generator=g) * 3).to(dt)
        pert = (clean.float() + 0.3 * torch.randn(N, S, V, generator=g)).to(dt)
        ids = torch.randint(0, V, (N, S), generator=g)
        return clean, pert, ids
    B, L = case["B"], case["L"]
    adv = torch.randn(B, generator=g)
    scores = torch.rand(B, L, generator=g) * 2
    resp = torch.ones(B, L, dtype=torch.bool)
    reason = torch.rand(B, L, generator=g) < 0.75
    return adv, scores, reason, resp


def _torch_probe(clean, pert, ids, probe):
    if probe == "last":
        pc, pp = torch.log_softmax(clean[:, 0].float(), -1), torch.log_softmax(pert[:, 0].float(), -1)
        return (pc.exp() * (pc - pp)).sum(-1)
    if probe == "answer_mean":
        pc = torch.log_softmax(clean.float().mean(1), -1)
        pp = torch.log_softmax(pert.float().mean(1), -1)
        return (pc.exp() * (pc - pp)).sum(-1)
    phi = lambda z: torch.log_softmax(z.float(), -1).gather(-1, ids[..., None])[..., 0].mean(1)  # noqa: E731
    return phi(clean) - phi(pert)


def _fn(case: dict, provider: str):
    """A zero-argument callable running `provider` on fresh inputs of `case`."""
    import oar  # noqa: F401  (registers torch.ops.oar)
    from oar import reference

    x = _inputs(case)
    if case["kind"] == "probe":
        clean, pert, ids = x
        probe = case["probe"]
        if provider == "oar":
            aid = ids if probe == "answer_joint" else None
            return lambda: torch.ops.oar.probe_divergence(clean, pert, aid, None, probe)
        return lambda: _torch_probe(clean, pert, ids, probe)
    adv, scores, reason, resp = x
    if provider == "oar":
        return lambda: torch.ops.oar.reshape_advantages(adv, scores, reason, resp, 0.25, 1.0, 0.1, "both", False)
    if provider == "torch":
        return lambda: reference.reshape_advantages_vectorized(adv, scores, reason, resp)
    return lambda: reference.reshape_advantages(adv, scores, reason, resp)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_child(case_json: str, provider: str) -> None:
    case = json.loads(case_json)
    fn = _fn(case, provider)
    fn()  # first call: one-time allocations (thread pools, caches) are not the op's working memory
    # Linux: writing "5" to clear_refs resets the peak RSS (VmHWM) to the current RSS.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    out = fn()
    peak = _status_kib("VmHWM")
    del out
    print(json.dumps({"extra_mib": (peak - before) / 1024.0}))


def _peak(case: dict, provider: str) -> float:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(case), provider],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_mib"]


def cases() -> list[dict]:
    out = []
    for V in (49152, 151936):
        for dtype in ("float32", "bfloat16"):
            for probe in ("last", "answer_mean", "answer_joint"):
                out.append({"kind": "probe", "V": V, "dtype": dtype, "probe": probe,
                            "name": f"probe_divergence {probe} N={N} S={S} V={V} {dtype}"})
    out.append({"kind": "reshape", "B": 256, "L": 4096, "name": "normalize+reshape B=256 L=4096 fp32"})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="docs/benchmarks/kernels")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _peak_child(*a.child)
        return 0
    rows = []
    for case in cases():
        providers = ["oar", "torch"] + (["loop-ref"] if case["kind"] == "reshape" else [])
        fns = {pr: _fn(case, pr) for pr in providers}
        for pr in providers:
            for _ in range(a.warmup):
                fns[pr]()
        times = {pr: [] for pr in providers}
        reps = a.repeats if case["kind"] == "probe" else max(3, a.repeats // 3)
        for _ in range(reps):
            for pr in providers:  # interleaved: drift hits every provider alike
                if pr == "loop-ref" and len(times[pr]) >= 2:
                    continue
                t0 = time.perf_counter()
                fns[pr]()
                times[pr].append(time.perf_counter() - t0)
        for pr in providers:
            rows.append({"case": case["name"], "provider": pr, "ms": 1e3 * statistics.median(times[pr]),
                         "extra_peak_mib": _peak(case, pr)})
        base = {r["provider"]: r for r in rows if r["case"] == case["name"]}
        print(f"{case['name']}: " + ", ".join(f"{k} {v['ms']:.2f} ms / {v['extra_peak_mib']:.0f} MiB"
                                              for k, v in base.items()), flush=True)
    lines = [f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}.", "",
             "| case | oar ms | torch ms | speed-up | oar extra MiB | torch extra MiB | memory ratio |",
             "|---|---|---|---|---|---|---|"]
    for case in cases():
        r = {x["provider"]: x for x in rows if x["case"] == case["name"]}
        o, t = r["oar"], r["torch"]
        mem = f"{o['extra_peak_mib'] / t['extra_peak_mib']:.2f}" if t["extra_peak_mib"] > 0 else "-"
        extra = f" (loop-ref {r['loop-ref']['ms']:.0f} ms)" if "loop-ref" in r else ""
        lines.append(f"| {case['name']}{extra} | {o['ms']:.2f} | {t['ms']:.2f} | {t['ms'] / o['ms']:.2f}x | "
                     f"{o['extra_peak_mib']:.0f} | {t['extra_peak_mib']:.0f} | {mem} |")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
