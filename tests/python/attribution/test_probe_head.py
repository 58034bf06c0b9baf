"""The probe logits in float32 (``HFProbeModel.probe_logits_float32``, issue 23): under bf16 the LM head's output
rounding is of the size of the probe divergences, so the engines take the head's product in float32."""

import copy

import pytest
import torch

from oar.attribution import HFProbeModel
from oar.attribution import probe_head
from oar.testing import tiny_random_llama

from _devices import OTHER_DEVICES, no_pending_device_errors  # noqa: F401 - autouse fixture
from _tolerance import gamma


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_random_llama(hidden_size=32, num_layers=2, num_heads=4, tokenizer="minimal", seed=2)
    model.eval()
    return model, tok


def _inputs(tok):
    ids = torch.tensor([tok.encode("2 plus 13 is 15, so", add_special_tokens=False)])
    T = ids.shape[1]
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(T)[None], keep=4)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_linear_float32_is_the_float32_product(weight_dtype, monkeypatch):
    """Chunked upcast (3 chunks here) = the float32 product of the same operands, within float32 dot-product
    rounding (gamma_H x |x| |w|); float32 output; differentiable in x."""
    monkeypatch.setattr(probe_head, "_HEAD_CHUNK_ROWS", 7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 16, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(20, 16, generator=g).to(weight_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = probe_head._linear_float32(x, w, None)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 20)
    want = x.detach().double() @ w.double().t()
    bound = gamma(16) * (x.detach().double().abs() @ w.double().abs().t())
    assert bool(((out.detach().double() - want).abs() <= bound).all())
    out.sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def test_probe_logits_are_float32_under_bf16_autocast(tiny):
    """Under bf16 autocast the trunk runs in bf16 and the probe logits come out float32: the float32 product of the
    bf16 final hidden state with the head's weight (the model's own head would round them to bf16)."""
    model, tok = tiny
    pm = HFProbeModel(model)
    kw = _inputs(tok)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = pm.tail_logits(**kw)
        hidden = model.model(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"],
                             position_ids=kw["position_ids"]).last_hidden_state[:, -kw["keep"]:]
        pm.probe_logits_float32 = False
        plain = pm.tail_logits(**kw)
    assert got.dtype == torch.float32 and plain.dtype == torch.bfloat16
    w = model.get_output_embeddings().weight.detach()
    want = hidden.double() @ w.double().t()
    bound = gamma(w.shape[1]) * (hidden.double().abs() @ w.double().abs().t())
    assert bool(((got.double() - want).abs() <= bound).all())
    # the bf16 head's own rounding is far larger: what the float32 product removes
    assert float((plain.double() - want).abs().max()) > 10 * float(bound.max())
    assert "forward" not in model.get_output_embeddings().__dict__  # the head is restored


def test_float32_model_is_unchanged(tiny):
    """A float32 model outside autocast: the same logits with and without the float32 head (plain F.linear)."""
    model, tok = tiny
    pm = HFProbeModel(model)
    kw = _inputs(tok)
    with torch.no_grad():
        a = pm.tail_logits(**kw)
        pm.probe_logits_float32 = False
        b = pm.tail_logits(**kw)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_out_product_has_a_backward(dtype):
    """The CUDA head product (``mm`` with float32 output, which has no derivative in PyTorch) goes through
    ``_MmFloat32Out``; its backward is checked here on CPU (same formulas, upcast product) against float64
    autograd: the incoming gradient is rounded once to ``dtype`` (unit roundoff u) and then accumulated in float32,
    so |d - ref| <= (u + gamma_K) |g| |w| elementwise (K = V for d x, n for d weight), plus the final rounding of the
    result to ``dtype`` (u |ref|)."""
    from _tolerance import UNIT_ROUNDOFF

    g0 = torch.Generator().manual_seed(5)
    x = torch.randn(6, 16, generator=g0).to(dtype).requires_grad_()
    w = torch.randn(40, 16, generator=g0).to(dtype).requires_grad_()
    out = probe_head._MmFloat32Out.apply(x, w)
    assert out.dtype == torch.float32
    want = x.detach().double() @ w.detach().double().t()
    xd, wd = x.detach().double(), w.detach().double()
    assert bool(((out.detach().double() - want).abs() <= gamma(16) * (xd.abs() @ wd.abs().t())).all())
    grad = torch.randn(6, 40, generator=g0)
    out.backward(grad)
    u = UNIT_ROUNDOFF[dtype]
    gd, xd, wd = grad.double(), x.detach().double(), w.detach().double()
    ref_x, ref_w = gd @ wd, gd.t() @ xd
    bound_x = (u + gamma(40)) * (gd.abs() @ wd.abs()) + u * ref_x.abs()
    bound_w = (u + gamma(6)) * (gd.abs().t() @ xd.abs()) + u * ref_w.abs()
    assert x.grad.dtype == dtype and w.grad.dtype == dtype
    assert bool(((x.grad.double() - ref_x).abs() <= bound_x).all())
    assert bool(((w.grad.double() - ref_w).abs() <= bound_w).all())
    # the bound is tight enough to see a gradient that skips the rounding model entirely (e.g. a zero gradient)
    assert float(bound_x.max()) < 0.1 * float(ref_x.abs().max())


@pytest.mark.parametrize("device", OTHER_DEVICES)
def test_cuda_bf16_head_is_differentiable(device):
    """On CUDA with a bf16 head, _linear_float32 is one float32-output mm and OAR-G's input gradient flows through
    it (it raised 'derivative for aten::mm is not implemented' before _MmFloat32Out, on the H200). Bound as in the
    CPU test above: (u + gamma_V) |g| |w| + u |ref|."""
    from _tolerance import UNIT_ROUNDOFF

    g0 = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 64, generator=g0).to(torch.bfloat16).to(device).requires_grad_()
    w = torch.randn(100, 64, generator=g0).to(torch.bfloat16).to(device)
    out = probe_head._linear_float32(x, w, None)
    assert out.dtype == torch.float32
    grad = torch.randn(2, 3, 100, generator=g0)
    out.backward(grad.to(device))
    gd, wd = grad.double(), w.cpu().double()
    ref = gd @ wd
    u = UNIT_ROUNDOFF[torch.bfloat16]
    bound = (u + gamma(100)) * (gd.abs() @ wd.abs()) + u * ref.abs()
    assert bool(((x.grad.cpu().double() - ref).abs() <= bound).all())


def _reaches(fn, target: torch.Tensor) -> bool:
    """True when the autograd graph from node ``fn`` accumulates into ``target`` (a leaf), i.e. a backward through
    it could build ``target``'s gradient."""
    seen, stack = set(), [fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "variable", None) is target:
            return True
        stack.extend(nxt for nxt, _ in node.next_functions)
    return False


def test_trainable_head_gets_no_weight_gradient():
    """Issue 41: the float32 head product takes the weight detached. With a trainable bf16 head (weight and bias
    requiring grad) ``out.backward`` used to build d weight, (V, H); now only d x is built and equals the float64
    product within (u + gamma_V) |g| |w| + u |ref| (the float32 upcast product, rounded once to bf16), as in
    test_cuda_bf16_head_is_differentiable; the bias term adds to the logits unchanged."""
    from _tolerance import UNIT_ROUNDOFF

    g0 = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 16, generator=g0).to(torch.bfloat16).requires_grad_()
    w = torch.randn(40, 16, generator=g0).to(torch.bfloat16).requires_grad_()
    b = torch.randn(40, generator=g0).to(torch.bfloat16).requires_grad_()
    out = probe_head._linear_float32(x, w, b)
    assert out.dtype == torch.float32 and not _reaches(out.grad_fn, w) and not _reaches(out.grad_fn, b)
    want = x.detach().double() @ w.detach().double().t() + b.detach().double()
    bound = gamma(17) * (x.detach().double().abs() @ w.detach().double().abs().t() + b.detach().double().abs())
    assert bool(((out.detach().double() - want).abs() <= bound).all())
    grad = torch.randn(2, 3, 40, generator=g0)
    out.backward(grad)
    assert w.grad is None and b.grad is None
    gd, wd = grad.double(), w.detach().double()
    ref = gd @ wd
    u = UNIT_ROUNDOFF[torch.bfloat16]
    bound = (u + gamma(40)) * (gd.abs() @ wd.abs()) + u * ref.abs()
    assert x.grad.dtype == torch.bfloat16 and bool(((x.grad.double() - ref).abs() <= bound).all())
    assert float(bound.max()) < 0.1 * float(ref.abs().max())  # not vacuous


def test_probe_backward_builds_no_head_weight_gradient(tiny):
    """Issue 41, OAR-G's call: ``tail_logits`` on ``inputs_embeds`` of a trainable bf16 model (every parameter
    requiring grad) and ``torch.autograd.grad`` w.r.t. the embeddings. The head weight is not in the graph (before
    the fix it was, through the float32 upcast of its chunks, and on CUDA through ``_MmFloat32Out``, whose
    backward then computed d weight), no op of the backward produces a new tensor of the head weight's V x H
    elements (its float32 copy, saved by the upcast product for d x, is only read through a transposed view), every parameter's ``.grad`` stays None, and the embeddings' gradient is bit for bit the one of the
    same model frozen (the path whose head weight never required grad, unchanged by the fix)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model, tok = tiny
    m = type(model)(model.config).to(torch.bfloat16)
    m.load_state_dict(model.state_dict())
    m.eval()
    pm = HFProbeModel(m)
    head = m.get_output_embeddings()
    V, H = head.weight.shape
    assert head.weight.requires_grad and all(p.requires_grad for p in m.parameters())
    kw = _inputs(tok)
    ids = kw.pop("input_ids")
    E = m.get_input_embeddings()(ids).detach()
    target = torch.randn(kw["keep"], V, generator=torch.Generator().manual_seed(3))

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numels = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not func.is_view:  # new tensors (a view allocates nothing)
                    self.numels.append(t.numel())
            return out

    def input_grad():
        Ek = E.clone().requires_grad_()
        logits = pm.tail_logits(inputs_embeds=Ek, **kw)
        assert logits.dtype == torch.float32
        reaches = _reaches(logits.grad_fn, head.weight)
        J = (logits[0] * target).sum()
        with Shapes() as rec:
            (g,) = torch.autograd.grad(J, Ek)
        return g, reaches, rec.numels

    g, reaches, numels = input_grad()
    assert not reaches
    assert numels and V * H not in numels
    assert all(p.grad is None for p in m.parameters())
    m.requires_grad_(False)
    try:
        frozen, _, _ = input_grad()
    finally:
        m.requires_grad_(True)
    assert torch.equal(g, frozen) and bool(g.abs().max() > 0)


def test_oar_g_plan_counts_the_probe_heads_backward(tiny):
    """Issue 41: OAR-G's plan (``plan_masked(..., backward=True)``) counts per row the probe logits and their
    float32 gradients, 16 x keep x V bytes, and once per chunk the float32 copy of a bf16 head's weight on CPU,
    V x H x 4 bytes (``_linear_float32``'s upcast chunks, saved for d x). A budget of exactly k rows' cost plus
    that copy (the terms recomputed here) packs k rows per chunk, one byte less k - 1; a float32 model has no
    copy; the forward (OAR-P batched) count is unchanged."""
    from oar.attribution import ProbeContextBuilder, planner

    model, tok = tiny
    m = type(model)(model.config).to(torch.bfloat16)
    m.load_state_dict(model.state_dict())
    pm, pm32 = HFProbeModel(m), HFProbeModel(model)
    prompts = [torch.tensor(tok.encode("2 plus 13 is", add_special_tokens=False))] * 3
    resps = [torch.tensor(tok.encode("15, so 15", add_special_tokens=False))] * 3
    batch = ProbeContextBuilder(tok, "\nTherefore, the final answer is \\boxed{").build(prompts, resps, ["15"] * 3,
                                                                                       [len(r) for r in resps])
    V, H, keep = pm.vocab_size, pm.hidden_size, batch.keep
    assert (V, H) == tuple(m.get_output_embeddings().weight.shape)
    assert planner.probe_bytes(pm, batch) == 8 * keep * V
    assert planner.probe_bytes(pm, batch, backward=True) == 16 * keep * V
    assert planner.probe_bytes(pm, batch, backward=True, per_chunk=True) == 4 * V * H
    assert planner.probe_bytes(pm, batch, per_chunk=True) == 0
    assert planner.probe_bytes(pm32, batch, backward=True, per_chunk=True) == 0
    T = int(batch.input_ids.shape[1])
    widths = [T] * 3
    row = T * planner.masked_bytes_per_token(pm, T, backward=True) + 16 * keep * V
    sizes = lambda plan: [c.end - c.begin for c in plan]  # noqa: E731
    assert sizes(planner.plan_masked(pm, batch, widths, [1] * 3, 2 * row + 4 * V * H, backward=True)) == [2, 1]
    assert sizes(planner.plan_masked(pm, batch, widths, [1] * 3, 2 * row + 4 * V * H - 1, backward=True)) == [1, 1, 1]
    row32 = T * planner.masked_bytes_per_token(pm32, T, backward=True) + 16 * keep * V
    assert sizes(planner.plan_masked(pm32, batch, widths, [1] * 3, 2 * row32, backward=True)) == [2, 1]
    fwd = T * planner.masked_bytes_per_token(pm, T) + 8 * keep * V
    assert sizes(planner.plan_masked(pm, batch, widths, [1] * 3, 2 * fwd)) == [2, 1]


@pytest.mark.parametrize("float32_head", [True, False])
def test_probe_head_runs_one_2d_product_on_a_strided_slice(tiny, float32_head):
    """transformers hands the head ``hidden[:, -keep:]`` (strided); ``matmul`` does not fold such a 3-D input when
    the weight does not require grad (the probe head's detached weight, a frozen model) and runs a ``bmm`` that reads
    the whole (V, H) weight once per row (issue 41). Under ``_probe_head`` the head runs one 2-D ``mm`` (with the
    model's own dtype too), with the values of the plain product. The head is frozen here: the case that folds
    nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    model, _ = tiny
    model = copy.deepcopy(model).requires_grad_(False)
    pm = HFProbeModel(model)
    pm.probe_logits_float32 = float32_head
    head = model.get_output_embeddings()
    with torch.no_grad(), Ops() as plain:  # without it: the bmm this test guards against
        head(torch.randn(5, 9, head.in_features)[:, -3:])
    assert any(n.startswith("bmm") for n in plain.names)
    hidden = torch.randn(5, 9, head.in_features, generator=torch.Generator().manual_seed(0))[:, -3:]
    assert not hidden.is_contiguous()
    with torch.no_grad(), pm._probe_head(), Ops() as ops:
        got = head(hidden)
    assert not any(n.startswith("bmm") for n in ops.names) and any(n.startswith(("mm", "addmm")) for n in ops.names)
    want = hidden.double() @ head.weight.double().t()
    assert got.shape == (5, 3, head.out_features)
    bound = gamma(head.in_features) * (hidden.double().abs() @ head.weight.double().abs().t())
    assert bool(((got.double() - want).abs() <= bound).all())
    assert "forward" not in head.__dict__
