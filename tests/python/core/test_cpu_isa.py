"""The ISA level of oar's CPU loops (oar/core/cpu_isa.h; docs/design.md, "CPU loops on every ISA level"):
reported by ``oar.build_info()``, switched by ``oar._C.set_cpu_isa`` and the ``OAR_CPU_ISA`` environment
variable, refused when this machine cannot run it, and the ops' results on every level this machine runs.
The whole op test files run under each forced level in CI (.ci/run); here each level gets one check per loop
family, and the compiled code is checked for AVX instructions outside the AVX copies.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch

import oar
from oar import _C, ops
from oar import reference as ref

from _error_model import probe_divergence_error_bound
from _paths import ROOT
from _tolerance import assert_within, assert_within_error_model, gamma, sum_bound, ulp

LEVELS = ["avx512f", "avx2", "baseline"]
SUPPORTED = _C.supported_cpu_isas()


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux x86-64), or None elsewhere."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return None


@pytest.fixture(params=LEVELS)
def level(request):
    """Runs the test with the CPU loops forced to one level (skipped where the machine cannot run it)."""
    if request.param not in SUPPORTED:
        pytest.skip(f"this machine cannot run the {request.param} loops (supported: {SUPPORTED})")
    before = _C.cpu_isa()
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa(before)


def test_build_info_reports_the_level_and_the_supported_ones():
    info = oar.build_info()
    assert info["cpu_isas_supported"] == SUPPORTED and SUPPORTED[-1] == "baseline"
    assert info["cpu_isa"] == _C.cpu_isa() and info["cpu_isa"] in SUPPORTED
    assert [lv for lv in LEVELS if lv in SUPPORTED] == SUPPORTED  # best first
    flags = _cpu_flags()
    if flags is not None:  # the kernel's view of the CPU agrees with the loader's (the OS enables AVX state)
        assert ("avx512f" in SUPPORTED) == ("avx512f" in flags)
        assert ("avx2" in SUPPORTED) == ("avx2" in flags)
    if "OAR_CPU_ISA" not in os.environ:
        assert info["cpu_isa"] == SUPPORTED[0] and _C.cpu_isa_source() in ("auto", "set_cpu_isa")


def test_set_cpu_isa_switches_and_refuses_with_the_supported_levels():
    before = _C.cpu_isa()
    try:
        for lv in LEVELS:
            if lv in SUPPORTED:
                _C.set_cpu_isa(lv)
                assert _C.cpu_isa() == lv == oar.build_info()["cpu_isa"]
            else:
                with pytest.raises(ValueError, match=f"cannot run the {lv} loops; supported here: "):
                    _C.set_cpu_isa(lv)
        with pytest.raises(ValueError, match=r'isa must be one of \{avx512f, avx2, baseline\}, got "sse2"'):
            _C.set_cpu_isa("sse2")
    finally:
        _C.set_cpu_isa(before)


def _import_with(isa: str) -> subprocess.CompletedProcess:
    code = "import oar; i = oar.build_info(); print(i['cpu_isa'], oar._C.cpu_isa_source())"
    env = {**os.environ, "OAR_CPU_ISA": isa}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_oar_cpu_isa_is_read_at_load_and_refused_when_it_cannot_run():
    forced = SUPPORTED[-1]  # baseline: every machine runs it, and it is never the automatic choice on x86-64
    out = _import_with(forced)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == [forced, "OAR_CPU_ISA"]
    out = _import_with("sse2")
    assert out.returncode != 0
    assert 'OAR_CPU_ISA must be one of {auto, avx512f, avx2, baseline}, got "sse2"' in out.stderr
    missing = [lv for lv in LEVELS if lv not in SUPPORTED]
    if missing:  # e.g. avx512f on an AVX2-only CPU
        out = _import_with(missing[0])
        assert out.returncode != 0 and f"cannot run the {missing[0]} loops" in out.stderr


# ---- the ops on each level (the loops of vec_math.h: exp/max/sum, dots, log1p, masked passes, widening) ------


@pytest.mark.parametrize("probe", ["last", "answer_mean", "answer_joint"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_divergence_on_each_level(level, probe, dtype):
    g = torch.Generator().manual_seed(0)
    N, S, V = 5, 3, 4099  # V: two chunks and an odd tail
    clean = (torch.randn(N, S, V, generator=g) * 3).to(dtype)
    pert = (clean.float() + torch.randn(N, S, V, generator=g) * 0.5).to(dtype)
    ids = torch.randint(0, V, (N, S), generator=g)
    lengths = torch.tensor([3, 1, 2, 3, 3])
    got = ops.probe_divergence(clean, pert, probe=probe, answer_ids=ids, lengths=lengths)
    want64 = ref.probe_divergence(clean, pert, probe=probe, answer_ids=ids, lengths=lengths)
    # Rule 1: within the float32 error model of the op's formula on the same (rounded) inputs, which holds for any
    # order of the V-term sums (every level's lanes and chunks); its float64 value is the reference's.
    exact = probe_divergence_error_bound(clean, pert, probe, ids, lengths)
    assert_within(exact.value, want64, 1e-12 * (1 + want64.abs()), what="formula vs reference")
    assert_within_error_model(got, exact, what=f"{level} {probe} {dtype}")


def test_normalize_and_reshape_on_each_level(level):
    g = torch.Generator().manual_seed(1)
    B, T = 4, 131
    resp = torch.arange(T)[None, :] < torch.tensor([131, 90, 47, 3])[:, None]
    reason = resp & (torch.rand(B, T, generator=g) < 0.8)
    scores = torch.rand(B, T, generator=g) ** 3 * 20
    adv = torch.tensor([1.0, -0.5, 2.0, 0.25])
    got = ops.normalize_importance(scores, reason)
    want64 = ref.normalize_importance(scores.double(), reason)
    # The float32 path computes log1p((s - lo) / (1 + lo)) / log1p((hi - lo) / (1 + lo)) (no cancellation):
    # 3 roundings + a 2-ulp log1p in the numerator, 2 + 2 ulp in the denominator, 1 division: 14 u relative.
    assert_within(got, want64, gamma(16) * want64.abs(), f"normalize_importance on {level}")
    tok, w = ops.reshape_advantages(adv, scores, reason, resp)
    # The advantage mass over each response is preserved: a float32 sum of T terms of size |A| w.
    mass = (tok.double() * resp).sum(1)
    abs_mass = (tok.double().abs() * resp).sum(1)
    assert_within(mass, adv.double() * resp.sum(1), sum_bound(abs_mass, T) + ulp(abs_mass), f"mass on {level}")
    assert bool(((tok * adv[:, None]) >= 0).all())  # signs follow A
    assert bool((w[~resp] == 0).all()) and bool((tok[~resp] == 0).all())


def test_grad_x_input_on_each_level(level):
    g = torch.Generator().manual_seed(2)
    grad, x = torch.randn(3, 17, 96, generator=g), torch.randn(3, 17, 96, generator=g)
    got = ops.grad_x_input(grad, x)
    want = ref.grad_x_input(grad, x)
    # |sum_h g_h x_h|: a dot product of 96 terms, gamma_97 of sum |g_h x_h| (plus the abs, exact).
    assert_within(got, want, sum_bound((grad.double() * x.double()).abs().sum(-1), 97), f"grad_x_input on {level}")


# ---- no AVX outside the AVX copies -------------------------------------------------------------------------


def _loaded_oar_libraries() -> list[str]:
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if re.search(r"/(liboar_core|liboar_torch|_C\.)[^/]*\.so", line)}
    return sorted(paths)


def _with_symbols(path: str) -> str | None:
    """``path`` if it keeps its symbol table; else the same library of the repository's CMake build tree (the
    installed wheel's copies are stripped by the install step, so their functions have no names to attribute
    instructions to); None when neither has one."""
    def has_symtab(p):
        return ".symtab" in subprocess.run(["readelf", "-S", "-W", p], capture_output=True, text=True).stdout

    if has_symtab(path):
        return path
    name = os.path.basename(path)
    stem = name.split(".so")[0] + ".so" if name.startswith("lib") else name
    for folder in (os.environ.get("OAR_BUILD_DIR") or "", os.path.join(ROOT, "build")):
        cand = os.path.join(folder, stem)
        if folder and os.path.isfile(cand) and has_symtab(cand):
            return cand
    return None


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64", reason="Linux x86-64 only")
@pytest.mark.skipif(shutil.which("objdump") is None or shutil.which("readelf") is None,
                    reason="objdump / readelf (binutils) not installed")
def test_no_avx_instruction_outside_the_avx_copies():
    """A build for the x86-64 baseline must run on a CPU without AVX: no VEX/EVEX instruction (AVX, AVX2,
    AVX-512: mnemonics v*, registers ymm/zmm) may appear outside the isa_avx2 / isa_avx512f copies of the
    loops, which only run when the CPU has them."""
    loaded = _loaded_oar_libraries()
    assert any("liboar_core" in p for p in loaded), loaded
    libs = [p for p in (_with_symbols(x) for x in loaded) if p is not None]
    if not any("liboar_core" in p for p in libs):
        pytest.skip("liboar_core is stripped and no build tree with symbols was found (OAR_BUILD_DIR or ./build)")
    offenders = []
    for path in libs:
        dis = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", path], capture_output=True, text=True,
                             check=True).stdout
        fn, seen_avx_copy = None, False
        for line in dis.splitlines():
            m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
            if m:
                fn = m.group(1)
                seen_avx_copy |= "isa_avx" in fn
                continue
            parts = line.split("\t")
            if fn is None or len(parts) < 2 or "isa_avx2::" in fn or "isa_avx512f::" in fn:
                continue
            ins = parts[1].split()
            if ins and (ins[0].startswith("v") or "%ymm" in line or "%zmm" in line):
                offenders.append(f"{os.path.basename(path)}: {fn}: {parts[1].strip()}")
        if "liboar_core" in path and platform.machine() == "x86_64":
            assert seen_avx_copy, "liboar_core has no isa_avx* copies: the multi-ISA build is off"
    assert not offenders, "AVX instructions outside the guarded copies:\n" + "\n".join(offenders[:20])
