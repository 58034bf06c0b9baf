"""The FlexAttention kernel of shared-prefix attention (``HFProbeModel.shared_prefix_kernel = "flex"``, issue 23):
the kernel the engines run on GPUs, here through PyTorch's unfused CPU implementation of the same block mask. The
prefix and windowed OAR-P engines on it against the float64 step-by-step references (rule 1), with token and span
units, grouped-query attention and left padding."""

import pytest
import torch

from oar.attribution import HFProbeModel, ProbeContextBuilder, oar_p_scores, oar_p_window_scores, probe_capabilities
from oar.attribution.spans import span_starts, spans_of, token_texts
from oar.testing import tiny_random_llama

from _completions import CONCLUDE, probe_rollouts
from _error_model import oar_p_error_bound, oar_p_window_error_bound
from _tolerance import assert_within_error_model

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
    pids, rids, answers = probe_rollouts(tok)
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


def _visible(ctx, n, s):
    """The (N*S, g*p + N*S) visibility of the shared-prefix attention, written out pair by pair from its
    definition (the independent reference of the block lists and the mask function)."""
    p, g = ctx.p, len(ctx.groups)
    n_pre = g * p
    out = torch.zeros(n * s, n_pre + n * s, dtype=torch.bool)
    for k, (_, begin, end, pad) in enumerate(ctx.groups):
        for v in range(begin, end):
            for i in range(s):
                wm = ctx.window
                for c in range(p):
                    if wm is not None:
                        ci = int(wm.cols[v, i])
                        see = (c >= pad and int(wm.first[v]) <= c < ci and c < int(wm.tail[v])
                               and not int(wm.hole_begin[v]) <= c < int(wm.hole_end[v]))
                    else:
                        see = bool(ctx.prefix_bias[v, i, c] == 0) if ctx.prefix_bias is not None else c >= pad
                    out[v * s + i, k * p + c] = see
                for j in range(s):
                    if wm is not None:
                        see = 0 <= int(wm.cols[v, j]) <= int(wm.cols[v, i]) or j == i
                    else:
                        see = bool(ctx.self_bias[v, 0, i, j] == 0) if ctx.self_bias is not None else j <= i
                    out[v * s + i, n_pre + v * s + j] = see
    return out


def _layout(seed, n, s, p, groups, biases):
    from oar.attribution.model import WindowMasks
    from oar.attribution.shared_prefix import _SharedPrefix

    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(n - 1, generator=gen)[:groups - 1].add(1).tolist()) if groups > 1 else []
    bounds = [0, *cuts, n]
    rows = [(slot, bounds[k], bounds[k + 1], int(torch.randint(0, p + 1, (), generator=gen)))
            for k, slot in enumerate(torch.randperm(groups, generator=gen).tolist())]
    ctx = _SharedPrefix(kv=[], groups=rows, p=p)
    if biases == "biases":
        ninf = torch.tensor(float("-inf"))
        ctx.prefix_bias = torch.where(torch.rand(n, s, p, generator=gen) < 0.3, ninf, 0.0)
        ctx.self_bias = torch.where(torch.rand(n, 1, s, s, generator=gen) < 0.3, ninf, 0.0)
    elif biases == "window":  # windowed OAR-P's closed form: each variant re-runs some columns, left-padded
        cols = torch.full((n, s), -1, dtype=torch.long)
        for v in range(n):  # re-run columns drawn from [lo, p): a hole may lie below all of them, or among them
            lo = int(torch.randint(0, max(p, 1), (), generator=gen))
            m = min(int(torch.randint(1, s + 1, (), generator=gen)), p - lo) if p else 0
            if m:
                cols[v, s - m:] = lo + torch.randperm(p - lo, generator=gen)[:m].sort().values
        hb = torch.randint(0, p + 1, (n,), generator=gen)
        ctx.window = WindowMasks(cols, torch.randint(0, max(p // 3, 1), (n,), generator=gen), hb,
                                 torch.clamp(hb + torch.randint(1, 7, (n,), generator=gen), max=p),
                                 torch.randint(p // 2, p + 1, (n,), generator=gen))
    return ctx


def _block_lists(counts, indices, QB, KB):
    out = torch.zeros(QB, KB, dtype=torch.bool)
    for r in range(QB):
        cols = indices[0, 0, r, :int(counts[0, 0, r])].long()
        assert bool((cols < KB).all()) and len(set(cols.tolist())) == len(cols)
        out[r, cols] = True
    return out


@pytest.mark.parametrize("full_blocks", [True, False], ids=["full", "partial_only"])
@pytest.mark.parametrize("biases", ["pads", "biases", "window"])
@pytest.mark.parametrize("n,s,p,groups", [(1, 1, 0, 1), (1, 3, 5, 1), (7, 3, 5, 3), (12, 5, 9, 4), (5, 13, 2, 5),
                                          (3, 21, 17, 2), (4, 9, 40, 2)])
def test_block_mask_lists_every_visible_block_and_no_other(n, s, p, groups, biases, full_blocks, monkeypatch):
    """The flex kernel's block mask, built from the layout (never by evaluating the mask on every pair: that took
    44-65 GiB at L = 4096 on the H200), against the pair-by-pair visibility: its mask function equals it on every
    pair (indices past the sequences included: they must not fail); every block holding a visible pair is listed
    (as partial or full); a listed block holds a pair of a variant with its own row or suffix; every pair of a full
    block (where the kernel skips the mask function) is visible. Block size 4 here, so that these small layouts
    span many blocks."""
    from oar.attribution import shared_prefix

    monkeypatch.setattr(shared_prefix, "_FLEX_FULL_BLOCKS", full_blocks)
    ctx = _layout(n * 100 + s, n, s, p, groups, biases)
    want = _visible(ctx, n, s)
    B = 4
    bm = shared_prefix._shared_prefix_block_mask(ctx, n, s, torch.device("cpu"), block=B)
    order = torch.arange(want.shape[0])
    if biases == "window":  # the kernel's queries: every window query (variant-major), then every tail query
        order = ctx.q_order
        is_tail = (ctx.window.cols >= ctx.window.tail[:, None]).reshape(-1)
        assert sorted(order.tolist()) == list(range(n * s)) and not bool((is_tail[order][1:] < is_tail[order][:-1]).any())
        assert torch.equal(order[ctx.q_inverse], torch.arange(n * s))
        want = want[order]
    Q, KV = want.shape
    assert tuple(bm.seq_lengths) == (Q, KV)
    q = torch.arange(Q + B)[:, None]
    kv = torch.arange(KV + B)[None, :]
    got = bm.mask_mod(torch.zeros(()), torch.zeros(()), q, kv)
    assert torch.equal(got[:Q, :KV], want)
    QB, KB = -(-Q // B), -(-KV // B)
    partial = _block_lists(bm.kv_num_blocks, bm.kv_indices, QB, KB)
    full = _block_lists(bm.full_kv_num_blocks, bm.full_kv_indices, QB, KB)
    assert not bool((partial & full).any()), "a block is listed as both partial and full"
    listed = partial | full
    padded = torch.zeros(QB * B, KB * B, dtype=torch.bool)
    padded[:Q, :KV] = want
    blocks = padded.reshape(QB, B, KB, B)
    holds = blocks.any(3).any(1)
    assert not bool((holds & ~listed).any()), "a block with a visible pair is not listed"
    every = blocks.all(3).all(1)
    assert not bool((full & ~every).any()), "a full block has a pair that is not visible"
    if full_blocks and biases == "pads" and s >= 2 * B:
        assert bool(full.any()), "no full block in a layout that has some: the check above would be vacuous"
    if not full_blocks:
        assert not bool(full.any())
    # listed = a variant of the query block meets its own row's prefix or its own suffix in the key block
    # (window: a key block inside one row's prefix only where a query of the block may see one of its columns:
    # below the query's own column and the tail)
    structural = torch.zeros(QB * B, KB * B, dtype=torch.bool)
    bounded = torch.zeros(QB * B, KB * B, dtype=torch.bool)
    n_pre = len(ctx.groups) * p
    pos = torch.argsort(order)  # kernel position of each variant-major query
    for k, (_, begin, end, _) in enumerate(ctx.groups):
        for v in range(begin, end):
            for i in range(s):
                q = int(pos[v * s + i])
                structural[q, k * p:(k + 1) * p] = True
                structural[q, n_pre + v * s:n_pre + (v + 1) * s] = True
                c = int(ctx.window.cols[v, i]) if biases == "window" else p
                hi = -1 if c < 0 else min(c, int(ctx.window.tail[v])) if biases == "window" else p
                bounded[q, k * p:k * p + max(hi, 0)] = True
                bounded[q, n_pre + v * s:n_pre + (v + 1) * s] = True
    blocks_s = structural.reshape(QB, B, KB, B).any(3).any(1)
    blocks_b = bounded.reshape(QB, B, KB, B).any(3).any(1)
    if biases != "window":
        assert torch.equal(listed, blocks_s)
    else:
        assert not bool((listed & ~blocks_s).any()), "a listed block holds no pair of the block's own rows"
        kb0 = torch.arange(KB) * B
        one_row = (kb0 + B <= n_pre) & (kb0 // max(p, 1) == (kb0 + B - 1) // max(p, 1))
        assert torch.equal(listed[:, one_row], blocks_b[:, one_row]), "the window bound is not applied exactly"


def test_window_block_mask_over_many_layouts(monkeypatch):
    """The window form's full-block rules over 40 random layouts (holes below, among and above the re-run
    columns): every check of the test above on each, and full blocks of both kinds (prefix and suffix) found, so
    that those checks are not vacuous."""
    from oar.attribution import shared_prefix

    found = [0, 0]
    for seed in range(40):
        n, s, p, groups = 2 + seed % 4, 5 + seed % 11, 12 + 3 * (seed % 9), 1 + seed % 2
        test_block_mask_lists_every_visible_block_and_no_other(n, s, p, groups, "window", True, monkeypatch)
        ctx = _layout(n * 100 + s, n, s, p, groups, "window")
        bm = shared_prefix._shared_prefix_block_mask(ctx, n, s, torch.device("cpu"), block=4)
        Q, KV = n * s, groups * p + n * s
        full = _block_lists(bm.full_kv_num_blocks, bm.full_kv_indices, -(-Q // 4), -(-KV // 4))
        found[0] += int(full[:, :groups * p // 4].sum())
        found[1] += int(full[:, -(-groups * p // 4):].sum())
    assert found[0] > 0 and found[1] > 0, f"full prefix / suffix blocks found: {found}"


def test_new_chunk_shapes_reuse_the_compiled_kernel(gqa, monkeypatch):
    """Compiled FlexAttention (as on CUDA, here traced by Dynamo with a counting backend that runs the graph
    eagerly): after the engines ran once at two memory budgets, other budgets (new chunk shapes, N = 1 chunks
    included) compile nothing more, and the compiled path gives the unfused kernel's scores. On the H200 each new
    chunk shape recompiled until Dynamo's limit (8), then PyTorch fell back to the unfused kernel, which ran out of
    memory (docs/gpu.md)."""
    from oar.attribution import shared_prefix
    from torch.nn.attention.flex_attention import flex_attention

    compiles = []

    def backend(gm, example_inputs):
        compiles.append(len(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=True, backend=backend)
    model, batch, spans = gqa

    def run_all(budget, rows):
        pm = _flex(model)
        sp = spans if rows is None else {r: spans[r] for r in rows}
        return [oar_p_window_scores(pm, batch, window=3, memory_budget_mb=budget, rows=rows).scores,
                oar_p_window_scores(pm, batch, window=0, memory_budget_mb=budget, rows=rows, spans=sp).scores,
                oar_p_scores(pm, batch, engine="prefix", memory_budget_mb=budget, rows=rows).scores]

    later = [(2, None), (3, [1, 2]), (1, [2])]
    eager = [run_all(*a) for a in later]
    monkeypatch.setattr(shared_prefix, "_flex_kernel", lambda device_type: compiled)
    try:
        for a in [(1, None), (1024, [0]), (1, [0, 1]), (5, [2]), (1024, None)]:
            run_all(*a)
        warm = len(compiles)
        # two mask forms (the window engine's closed-form masks; padding only), each compiled at most twice
        # (Dynamo's first compilation is static, the next dynamic), plus at most one generalization each of a
        # size that happened to equal another (duck sizing)
        assert 1 <= warm <= 6, f"{warm} compilations in the warm-up (at most 3 per mask form; Dynamo stops at 8)"
        again = [run_all(*a) for a in later]
        assert len(compiles) == warm, f"{len(compiles) - warm} recompilations for new chunk shapes"
    finally:
        torch._dynamo.reset()
    for x, y in zip(again, eager):
        for a, b in zip(x, y):
            torch.testing.assert_close(a, b)


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


def test_window_masks_equal_the_masks_of_the_rerun_sets():
    """``WindowMasks`` (closed form) against the masks written from each variant's set of re-run columns (what the
    windowed engine re-runs: its unit and window [t, t + n + W), and the tail [tail, T)): a query sees the clean
    columns before it that are past its row's padding and not re-run, and the re-run columns up to itself."""
    from oar.attribution import WindowMasks

    gen = torch.Generator().manual_seed(5)
    T, W = 30, 3
    runs, rows = [], []
    for _ in range(9):
        first = int(torch.randint(0, 8, (), generator=gen))
        t = int(torch.randint(first, T - 6, (), generator=gen))
        n = int(torch.randint(1, 4, (), generator=gen))
        tail = int(torch.randint(t + 1, T - 1, (), generator=gen))
        runs.append(sorted(set(range(t, min(t + n + W, T))) | set(range(tail, T))))
        rows.append((first, t, min(t + n + W, T), tail))
    S = max(len(r) for r in runs)
    cols = torch.full((len(runs), S), -1, dtype=torch.long)
    for v, r in enumerate(runs):
        cols[v, S - len(r):] = torch.tensor(r)
    first, hb, he, tail = (torch.tensor(x, dtype=torch.long) for x in zip(*rows))
    wm = WindowMasks(cols, first, hb, he, tail)
    rerun = torch.zeros(len(runs), T, dtype=torch.bool)
    for v, r in enumerate(runs):
        rerun[v, r] = True
    k = torch.arange(T).view(1, 1, T)
    want_p = (k < cols.unsqueeze(-1)) & (k >= first.view(-1, 1, 1)) & ~rerun.unsqueeze(1)
    valid = cols >= 0
    want_s = ((cols.unsqueeze(1) <= cols.unsqueeze(-1)) & valid.unsqueeze(1)) | torch.eye(S, dtype=torch.bool)
    assert torch.equal(wm.see_prefix(T), want_p)
    assert torch.equal(wm.see_self(), want_s)


def test_window_masks_check_their_input():
    from oar.attribution import WindowMasks

    z = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"cols must increase strictly along each row past a left padding of -1"):
        WindowMasks(torch.tensor([[3, 2]]), z, z, z, z)
    with pytest.raises(ValueError, match=r"cols must increase strictly"):
        WindowMasks(torch.tensor([[1, -1]]), z, z, z, z)
    with pytest.raises(ValueError, match=r"cols must be a 2-D int64 tensor \(N, S\), got \(2,\) torch.int64"):
        WindowMasks(torch.tensor([1, 2]), z, z, z, z)
    with pytest.raises(ValueError, match=r"tail must be an int64 tensor of shape \(1,\), got \(1,\) torch.int32"):
        WindowMasks(torch.tensor([[1, 2]]), z, z, z, z.int())
