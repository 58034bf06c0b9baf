"""The FlexAttention kernel of shared-prefix attention (``HFProbeModel.shared_prefix_kernel = "flex"``, issue 23):
the kernel the engines run on GPUs, here through PyTorch's unfused CPU implementation of the same block mask. The
prefix and windowed OAR-P engines on it against the float64 step-by-step references (rule 1), with token and span
units, grouped-query attention and left padding."""

import pytest
import torch

from oar.attribution import HFProbeModel, ProbeContextBuilder, oar_p_scores, oar_p_window_scores, probe_capabilities
from oar.attribution.spans import span_starts, spans_of, token_texts
from oar.app.models import tiny_random_llama

from _error_model import oar_p_error_bound, oar_p_window_error_bound
from _tolerance import assert_within_error_model
from test_attribution import CONCLUDE, _rollouts

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _gqa(hidden_size):
    """A sharpened tiny Llama with grouped-query attention (4 query heads on 2 key/value heads)."""
    model, tok = tiny_random_llama(hidden_size=hidden_size, num_layers=2, num_heads=4, num_kv_heads=2,
                                   tokenizer="minimal", seed=3)
    with torch.no_grad():
        for prm in model.parameters():
            if prm.dim() > 1:
                prm.mul_(6.0)
    model.eval()
    pids, rids, answers = _rollouts(tok)
    batch = ProbeContextBuilder(tok, CONCLUDE).build(pids, rids, answers)
    spans = {}
    for r in range(batch.batch_size):
        s, L = int(batch.reasoning_start[r]), int(batch.reasoning_len[r])
        spans[r] = spans_of(span_starts(token_texts(tok, batch.input_ids[r, s:s + L]), "word"))
    return model, batch, spans


@pytest.fixture(scope="module")
def gqa():
    """Head width 8."""
    return _gqa(32)


@pytest.fixture(scope="module")
def gqa16():
    """Head width 16: the smallest the compiled FlexAttention kernel runs on CUDA."""
    return _gqa(64)


_REF = {}


def _ref(gqa, units, window):
    key = (units, window)
    if key not in _REF:
        model, batch, spans = gqa
        sp = spans if units == "word" else None
        _REF[key] = (oar_p_error_bound(model, batch, "answer_mean", spans=sp) if window is None
                     else oar_p_window_error_bound(model, batch, window, "answer_mean", spans=sp))
    return _REF[key]


def _flex(model):
    pm = HFProbeModel(model)
    pm.shared_prefix_kernel = "flex"
    assert probe_capabilities(pm).shared_prefix
    return pm


@pytest.mark.parametrize("units", ["token", "word"])
@pytest.mark.parametrize("budget_mb", [1024, 1])
def test_prefix_engine_on_flex_equals_float64_masking(gqa, units, budget_mb):
    """Exact OAR-P through the flex kernel (rows left-padded, several prefix lengths at 1 MiB)."""
    model, batch, spans = gqa
    res = oar_p_scores(_flex(model), batch, engine="prefix", memory_budget_mb=budget_mb,
                       spans=spans if units == "word" else None)
    assert res.stats["shared_prefix_chunks"] >= 1
    want = _ref(gqa, units, None)
    assert float(want.value.max()) > 1e-3, "test model too flat: the comparison would be vacuous"
    assert_within_error_model(res.scores[:, :want.value.shape[1]], want, what=f"flex prefix, {units}")


@pytest.mark.parametrize("units", ["token", "word"])
@pytest.mark.parametrize("window", [0, 3])
def test_window_engine_on_flex_equals_the_stepwise_reference(gqa, units, window):
    """Windowed OAR-P through the flex kernel: the per-query prefix and self masks become the block mask."""
    model, batch, spans = gqa
    res = oar_p_window_scores(_flex(model), batch, window=window, memory_budget_mb=1,
                              spans=spans if units == "word" else None)
    want = _ref(gqa, units, window)
    assert float(want.value.max()) > 1e-3
    assert_within_error_model(res.scores, want, what=f"flex window {window}, {units}")


def test_flex_and_cpu_flash_kernels_agree(gqa):
    """The two shared-prefix kernels on the same chunks: equal within float32 rounding of the two summation orders
    (each within rule 1 of the float64 reference above; here a direct check that they serve the same attention)."""
    model, batch, _ = gqa
    flash = HFProbeModel(model)
    a = oar_p_scores(flash, batch, engine="prefix")
    b = oar_p_scores(_flex(model), batch, engine="prefix")
    want = _ref(gqa, "token", None)
    assert_within_error_model(a.scores[:, :want.value.shape[1]], want, what="cpu flash")
    assert_within_error_model(b.scores[:, :want.value.shape[1]], want, what="flex")


def test_cuda_flex_needs_head_width_16(gqa, gqa16, monkeypatch):
    """The compiled FlexAttention kernel refuses head widths below 16 on CUDA: such a model is reported as not
    supporting the shared-prefix path (its engines take the cached path) instead of failing inside the kernel."""
    narrow, wide = HFProbeModel(gqa[0]), HFProbeModel(gqa16[0])
    assert narrow._head_dim() == 8 and wide._head_dim() == 16
    assert narrow.supports_shared_prefix_attention and wide.supports_shared_prefix_attention  # CPU: no limit
    for pm in (narrow, wide):
        monkeypatch.setattr(pm, "device", torch.device("cuda"))  # the gate reads the device only
    assert not narrow.supports_shared_prefix_attention and wide.supports_shared_prefix_attention


def test_kernel_names_are_checked(gqa):
    model, batch, _ = gqa
    pm = HFProbeModel(model)
    pm.shared_prefix_kernel = "triton"
    with pytest.raises(ValueError, match=r"shared_prefix_kernel must be 'auto', 'flash_cpu' or 'flex', got 'triton'"):
        oar_p_scores(pm, batch, engine="prefix")


# ---- CUDA: the compiled kernel the engines run on GPUs (benchmarks/gpu/run_scale.sh runs these) -------------------

from _devices import OTHER_DEVICES, no_pending_device_errors  # noqa: E402,F401 - autouse fixture


def _rounded_to(model, dtype):
    """A float32 copy of ``model`` whose weights are exactly representable in ``dtype`` (so that the float64
    reference and a ``dtype`` run start from the same weights)."""
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        for prm in m.parameters():
            prm.copy_(prm.to(dtype).float())
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", OTHER_DEVICES)
@pytest.mark.parametrize("engine", ["prefix", "window"])
def test_cuda_flex_kernel_equals_the_float64_reference(gqa16, device, dtype, engine):
    """On CUDA, ``shared_prefix_kernel="auto"`` is the compiled FlexAttention kernel: the prefix engine (word spans)
    and the windowed engine (window 3) in float32 and bfloat16 against the float64 CPU reference of the same
    (rounded) weights. float32: rule 1 (the first-order error model). bfloat16: that bound scaled by
    u_bf16 / u_fp32 is vacuous for this model (about 50 against scores of 0.02, seen on the H200), so the check is
    flash-attention's: the flex kernel's largest error is at most 3x that of the same engine on the same device and
    dtype without the shared-prefix kernel (the cached path: a copied cache, a dense mask, the model's own
    attention), and that reference error is small against the scores (a wrong mask or row moves a score by its own
    size). On CPU the two bf16 errors are 4.5e-4 and 7.8e-4 for max |score| 0.018-0.027."""
    model, batch, spans = gqa16
    m = _rounded_to(model, dtype)

    def run(shared):
        pm = HFProbeModel(m.to(device=device, dtype=dtype))
        pm.shared_prefix_attention = shared
        if shared:
            assert pm._shared_prefix_kernel() == "flex" and probe_capabilities(pm).shared_prefix
        if engine == "prefix":
            return oar_p_scores(pm, batch, engine="prefix", spans=spans, memory_budget_mb=1)
        return oar_p_window_scores(pm, batch, window=3, memory_budget_mb=1)

    res = run(True)
    if engine == "prefix":
        want = oar_p_error_bound(m.float().cpu(), batch, "answer_mean", spans=spans)
    else:
        want = oar_p_window_error_bound(m.float().cpu(), batch, 3, "answer_mean")
    W = want.value.shape[1]
    if dtype == torch.float32:
        assert_within_error_model(res.scores[:, :W], want, what=f"cuda flex {engine} fp32")
        return
    err = float((res.scores[:, :W].double() - want.value).abs().max())
    err_ref = float((run(False).scores[:, :W].double() - want.value).abs().max())
    top = float(want.value.abs().max())
    assert err_ref <= 0.25 * top, f"the bf16 reference error {err_ref:.3g} is not small against max |score| {top:.3g}"
    assert err <= 3 * err_ref, f"cuda flex {engine} bf16: error {err:.3g} > 3 x the cached path's {err_ref:.3g}"
