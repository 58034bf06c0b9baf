"""Shared-prefix attention (docs/design.md, "OAR-P: prefix key/value cache" and "Shared-prefix attention on
FlexAttention"): N suffix passes (masked variants) that read their row's clean key/value cache in place instead of a
copy per variant. ``_shared_prefix_attention`` is the attention function registered with transformers' attention
interface under ``"oar_shared_prefix"``: PyTorch's CPU flash kernel with additive masks, or the compiled
FlexAttention kernel with block masks built from windowed OAR-P's closed-form masks
(:class:`oar.attribution.model.WindowMasks`). The context of one call (:class:`_SharedPrefix`) is set by
:meth:`oar.attribution.hf_model.HFProbeModel.tail_logits_shared_prefix`.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from dataclasses import dataclass, field

import torch

from oar.attribution.model import WindowMasks


# ---- the shared-prefix attention function (registered with transformers' attention interface) ----------------

_SHARED_PREFIX_IMPL = "oar_shared_prefix"
_SHARED_PREFIX_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})


@dataclass
class _SharedPrefix:
    kv: list  # per layer (keys, values): (R, kv_heads, >= p, head_dim)
    groups: list  # (slot, begin, end, pad)
    p: int
    bias: dict = field(default_factory=dict)  # pad -> additive (1, 1, 1, p) mask, built once per call
    prefix_bias: torch.Tensor | None = None  # (N, S, p) additive mask of each suffix query over its prefix
    self_bias: torch.Tensor | None = None  # (N, 1, S, S) additive mask of the suffix over itself (None: causal)
    window: WindowMasks | None = None  # windowed OAR-P's masks in closed form (the flex kernel only)
    kernel: str = "flash_cpu"  # "flash_cpu" | "flex"
    block_mask: object = None  # the flex kernel's block mask, built by the first layer, shared by the others
    q_order: torch.Tensor | None = None  # the kernel's query order (window form: window queries, then tail queries)
    q_inverse: torch.Tensor | None = None


_SHARED_PREFIX: contextvars.ContextVar = contextvars.ContextVar("oar_shared_prefix", default=None)


def _flash_cpu(q, k, v, causal: bool, bias, scale):
    """PyTorch's CPU flash attention with its log-sum-exp: (B, H, Lq, D) output, (B, H, Lq) float32 lse."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                      scale=scale)


def _shared_prefix_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             **kwargs):
    """Attention of N suffixes over their row's clean prefix (from the context set by
    :meth:`HFProbeModel.tail_logits_shared_prefix`) and over themselves (causal). query (N, H, S, D); key,
    value (N, kv_heads, S, D): the suffixes' own keys/values. Returns ((N, S, H, D), None)."""
    ctx = _SHARED_PREFIX.get()
    if ctx is None:
        raise RuntimeError("oar shared-prefix attention called outside HFProbeModel.tail_logits_shared_prefix")
    if dropout:
        raise RuntimeError("oar shared-prefix attention runs in eval mode only (dropout must be 0)")
    if kwargs.get("sliding_window") is not None:
        raise RuntimeError("oar shared-prefix attention does not support sliding-window layers")
    # Under autocast (e.g. a trainer's bf16 mixed precision) the rotary embedding leaves queries and keys in
    # float32 and values in bf16; SDPA's autocast rule runs attention in the autocast dtype, the kernels need one
    # dtype: use the same one.
    dev = query.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else query.dtype
    query, key, value = query.to(dt), key.to(dt), value.to(dt)
    if ctx.kernel == "flex":
        return _shared_prefix_flex(ctx, module, query, key, value, scaling), None
    N, H, S, D = query.shape
    rep = H // key.shape[1]
    if rep > 1:  # grouped-query attention: query head h reads kv head h // rep
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    if ctx.self_bias is None:
        out_s, lse_s = _flash_cpu(query, key, value, True, None, scaling)
    else:
        out_s, lse_s = _flash_cpu(query, key, value, False, ctx.self_bias.to(dt), scaling)
    p = ctx.p
    if p == 0:
        return out_s.transpose(1, 2).contiguous(), None
    keys, values = ctx.kv[module.layer_idx]
    out_p = torch.empty_like(out_s)
    lse_p = torch.empty_like(lse_s)
    for slot, begin, end, pad in ctx.groups:
        n = end - begin
        q = query[begin:end].transpose(0, 1).reshape(1, H, n * S, D)
        k, v = keys[slot:slot + 1, :, :p].to(dt), values[slot:slot + 1, :, :p].to(dt)
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        bias = None
        if ctx.prefix_bias is not None:
            bias = ctx.prefix_bias[begin:end].to(dt).reshape(1, 1, n * S, p)
        elif pad > 0:
            bias = ctx.bias.get(pad)
            if bias is None:
                bias = torch.zeros(1, 1, 1, p, dtype=dt, device=query.device)
                bias[..., :pad] = float("-inf")
                ctx.bias[pad] = bias
        o, lse = _flash_cpu(q, k, v, False, bias, scaling)
        out_p[begin:end] = o.reshape(H, n, S, D).transpose(0, 1)
        lse_p[begin:end] = lse.reshape(H, n, S).transpose(0, 1)
    # softmax over prefix + suffix keys = the two partial softmaxes weighted by their shares of the mass
    top = torch.maximum(lse_p, lse_s)
    w_p = (lse_p - top).exp_().unsqueeze(-1)
    w_s = (lse_s - top).exp_().unsqueeze(-1)
    out = (out_p.float() * w_p + out_s.float() * w_s) / (w_p + w_s)
    return out.to(dt).transpose(1, 2).contiguous(), None


# The compiled FlexAttention kernel on CUDA (torch 2.11) raises "NYI: embedding dimension of the query, key, and
# value must be at least 16" below this head width (seen on the H200, docs/gpu.md); real models use 64-256.
_FLEX_CUDA_MIN_HEAD_DIM = 16


@functools.cache
def _flex_attention_available() -> bool:
    """FlexAttention importable (torch >= 2.5)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _flex_kernel(device_type: str):
    """FlexAttention as the shared-prefix kernel runs it: compiled (dynamic shapes: chunks differ in size) on CUDA,
    PyTorch's unfused implementation elsewhere (CPU: the reference the tests compare; it materializes the scores of
    one layer and chunk)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=True)
    return flex_attention


def _at_least_2(t: torch.Tensor) -> torch.Tensor:
    """``t`` zero-padded at the end of every dimension to a size of at least 2: the compiled kernel's guards
    specialize sizes 0 and 1, so a closure tensor of size 1 in one call and 2 in the next recompiles (the H200 run of
    the step benchmark hit the recompile limit and fell back to the unfused kernel, docs/gpu.md)."""
    pad = []
    for d in reversed(t.shape):
        pad += [0, max(2 - d, 0)]
    return torch.nn.functional.pad(t, pad) if any(pad) else t


# Full-block lists (blocks whose every pair is visible skip the mask function in the kernel). A switch for the A/B
# of benchmarks/python/bench_scale.py (--no-full-blocks); the block lists are exact either way.
_FLEX_FULL_BLOCKS = True


def _shared_prefix_blocks(group_of: torch.Tensor, pads: torch.Tensor, g: int, p: int, n: int, s: int, block: int,
                          prefix_full: bool = True, suffix_full: bool = True, window: WindowMasks | None = None,
                          q_order: torch.Tensor | None = None):
    """Which (query block, key block) pairs of the shared-prefix attention hold visible pairs, from the layout alone
    (O(QB x KB x N), never O(queries x keys)). Returns (listed, full), dense (QB, KB) bool tensors, full a subset of
    listed. Listed: a query block meets the prefix blocks of its variants' rows and its variants' suffix blocks
    (conservative: padding, causality and biases are left to ``mask_mod``). Full (every pair visible, so the kernel
    skips ``mask_mod``): the query block lies in one row's variants and the key block in that row's prefix past its
    padding (``prefix_full``: no per-query prefix mask), or both lie in one variant's suffix with every key slot <=
    every query slot (``suffix_full``: causal self mask); both blocks whole (no sequence end inside). With
    ``window`` (:class:`WindowMasks`) the same, under its rules: the key block lies in every query's visible prefix
    range and clear of every hole, or in the non-padding slots of one variant at or before every query slot.
    group_of: (>= N,) long, the row of each variant; pads: (>= g,) long; queries are N x S (variant-major, or in
    ``q_order``: kernel query k is query ``q_order[k]`` of the variant-major layout), keys the g x p prefix columns
    then the N x S suffix tokens. With ``window`` a prefix block is listed only when a query of the block may see
    one of its columns (c < min(column of the query, tail), the query's own re-run column bounding what it sees)."""
    dev = group_of.device
    n_pre = g * p
    q_len, kv_len = n * s, n_pre + n * s
    qb = torch.arange((q_len + block - 1) // block, device=dev)
    kb = torch.arange((kv_len + block - 1) // block, device=dev)
    v = torch.arange(n, device=dev)
    order = torch.arange(q_len, device=dev) if q_order is None else q_order[:q_len].to(dev)
    spare = len(qb) * block - q_len  # the kernel's padded query slots: no variant
    var_blk = torch.cat([order // max(s, 1), order.new_full((spare,), n)]).view(len(qb), block)
    slot_blk = torch.cat([order % max(s, 1), order.new_full((spare,), s)]).view(len(qb), block)
    # query block x variant: a query of the variant lies in the block
    q_var = torch.zeros(len(qb), n + 1, dtype=torch.bool, device=dev).scatter_(1, var_blk, True)[:, :n]
    # key block x variant (suffix part): the variant's suffix columns overlap the block
    k_var = (n_pre + v * s < (kb[:, None] + 1) * block) & (n_pre + (v + 1) * s > kb[:, None] * block)
    hits = q_var.float() @ k_var.float().T
    q0, k0 = qb * block, kb * block
    q_whole = q0 + block <= q_len
    k_whole = k0 + block <= kv_len
    v_lo = var_blk.amin(-1)  # the block's variants (v_lo == v_hi: a single one) and its smallest query slot
    v_hi = torch.where(var_blk < n, var_blk, -1).amax(-1)
    i_min = slot_blk.amin(-1)
    full = torch.zeros(len(qb), len(kb), dtype=torch.bool, device=dev)
    if n_pre > 0:
        r = torch.arange(g, device=dev)
        k_row = (r * p < (kb[:, None] + 1) * block) & ((r + 1) * p > kb[:, None] * block)  # (KB, g)
        member = torch.nn.functional.one_hot(group_of[:n], g).float()  # (N, g)
        rows_in_q = (q_var.float() @ member) > 0  # (QB, g)
        pre_hits = (rows_in_q.float() @ k_row.float().T) > 0
        if window is not None:  # drop the row's blocks at or past every bound of the block's queries of that row
            cols_q = window.cols[:n].reshape(-1)[order]
            u = torch.where(cols_q < 0, cols_q.new_full((), -1),
                            torch.minimum(cols_q, window.tail[:n][order // max(s, 1)]))
            where = (torch.arange(q_len, device=dev) // block) * g + group_of[order // max(s, 1)]
            bound = torch.full((len(qb) * g,), -1, dtype=torch.long, device=dev).scatter_reduce_(
                0, where, u, "amax").view(len(qb), g)
            row_k0, row_k1 = k0 // max(p, 1), (k0 + block - 1) // max(p, 1)
            one_row = (k0 + block <= n_pre) & (row_k0 == row_k1)
            c0_k = k0 - row_k0 * p
            past = bound[:, row_k0.clamp(max=g - 1)] <= c0_k[None, :]
            pre_hits &= ~(one_row[None, :] & past)
        hits = hits + pre_hits.float()
        if prefix_full:
            q_row = torch.where(rows_in_q.sum(-1) == 1, rows_in_q.float().argmax(-1), -1)
            row_k, row_last = k0 // p, (k0 + block - 1) // p
            c0 = k0 - row_k * p  # the key block's columns [c0, c0 + block) in its row's prefix
            in_prefix = (k0 + block <= n_pre) & (row_k == row_last)
            past_pad = c0 >= pads[row_k.clamp(max=g - 1)]
            k_full_row = torch.where(in_prefix & past_pad, row_k, -2)
            pre_full = q_whole[:, None] & (q_row[:, None] == k_full_row[None, :])
            if window is not None:
                big = torch.iinfo(torch.long).max
                c1 = c0 + block
                first_max = torch.where(q_var, window.first[None, :n], -big).amax(-1)
                tail_min = torch.where(q_var, window.tail[None, :n], big).amin(-1)
                flat = window.cols[:n].reshape(-1)[order]
                flat = torch.cat([flat, flat.new_full((len(qb) * block - flat.numel(),), big)])
                col_min = flat.view(len(qb), block).amin(-1)  # a padding slot (-1) sees no prefix
                hole = (window.hole_begin[:n, None] < c1[None, :]) & (window.hole_end[:n, None] > c0[None, :])
                clear = (q_var.float() @ hole.float()) == 0
                pre_full &= ((c0[None, :] >= first_max[:, None]) & (c1[None, :] <= col_min[:, None])
                             & (c1[None, :] <= tail_min[:, None]) & clear)
            full |= pre_full
    if suffix_full:
        w_lo, w_hi = (k0 - n_pre).clamp(min=0) // s, (k0 + block - 1 - n_pre).clamp(min=0) // s
        k_single = (k0 >= n_pre) & k_whole & (w_lo == w_hi)
        j_min = k0 - n_pre - w_lo * s
        j_max = j_min + block - 1
        q_single = q_whole & (v_lo == v_hi)
        if window is not None:  # key slots past the variant's padding (then the query slots, at or after, too)
            n_pad = (window.cols[:n] < 0).sum(-1)
            k_single &= j_min >= n_pad[w_lo.clamp(max=max(n - 1, 0))]
        full |= (q_single[:, None] & k_single[None, :] & (v_lo[:, None] == w_lo[None, :])
                 & (j_max[None, :] <= i_min[:, None]))
    listed = hits > 0
    return listed, full & listed


def _recompile_guard():
    """Dynamo settings around the compiled kernel's call: past its recompile limit Dynamo would run the unfused
    kernel, which materializes every score (out of memory at users' lengths, docs/gpu.md); raise instead, at a limit
    above the engines' expected compilations (at most two per mask form,
    tests/python/attribution/test_shared_prefix_flex.py)."""
    import torch._dynamo.config as dynamo_config

    opts = {k: v for k, v in (("recompile_limit", 32), ("fail_on_recompile_limit_hit", True))
            if hasattr(dynamo_config, k)}
    return dynamo_config.patch(**opts)


def _shared_prefix_block_mask(ctx: _SharedPrefix, n: int, s: int, device, block: int = 128):
    """The flex kernel's block mask over queries (N x S suffix tokens, variant-major) and keys (the used rows'
    prefixes, p columns each, in group order, then the N x S suffix tokens): a query of variant v at suffix slot i
    sees column c < p of its row's prefix when c >= the row's padding (or ``prefix_bias[v, i, c]`` allows it) and
    slot j <= i of its own suffix (or ``self_bias[v, 0, i, j]`` allows it); with ``ctx.window``, as
    :class:`WindowMasks` says (past the row's padding too).

    The block lists (partial and full) come from the layout (:func:`_shared_prefix_blocks`), not from evaluating
    ``mask_mod`` on every (query, key) pair as ``create_block_mask`` does uncompiled (44-65 GiB at L = 4096 on the H200). Every tensor the
    ``mask_mod`` reads, integers included, is a closure tensor of size >= 2 or a 0-d tensor, so a new chunk shape
    reuses the compiled kernel instead of recompiling (docs/gpu.md)."""
    from torch.nn.attention.flex_attention import BlockMask

    p = ctx.p
    g = len(ctx.groups)
    n_pre = g * p
    group_of = torch.zeros(max(n, 2), dtype=torch.long)
    pads = torch.zeros(max(g, 2), dtype=torch.long)
    for k, (_, begin, end, pad) in enumerate(ctx.groups):
        group_of[begin:end] = k
        pads[k] = pad
    group_of, pads = group_of.to(device), pads.to(device)
    see_p = None if ctx.prefix_bias is None else _at_least_2(ctx.prefix_bias == 0)
    see_s = None if ctx.self_bias is None else _at_least_2(ctx.self_bias[:, 0] == 0)
    win = None if ctx.window is None else ctx.window.to(device)
    if win is not None:
        # fresh tensors: a slice's storage offset is guarded too
        cols_c, first_c, hb_c, he_c, tail_c = (_at_least_2(t).clone() for t in (win.cols, win.first, win.hole_begin,
                                                                                 win.hole_end, win.tail))
        # Kernel query order: every variant's window queries first, then every variant's tail queries (variant-major
        # in each part). A query block then holds one kind: window queries see their row's prefix only below their
        # masked unit, tail queries all of it but the holes, so most key blocks are either skipped or full; mixed
        # blocks made ~half of the prefix blocks partial (the mask evaluated on every pair, issue 41).
        is_tail = (win.cols >= win.tail[:, None]).reshape(-1)
        ctx.q_order = torch.argsort(is_tail.to(torch.int8), stable=True)
        ctx.q_inverse = torch.argsort(ctx.q_order)
        order_c = _at_least_2(ctx.q_order).clone()

    def scalar(x: int) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    s_t, p_t, n_pre_t = scalar(s), scalar(max(p, 1)), scalar(n_pre)
    last_v, last_pre = scalar(max(n - 1, 0)), scalar(max(n_pre - 1, 0))

    def mask_mod(b, h, q_idx, kv_idx):
        # indices past the sequences (a kernel's padded tail) are clamped into range; their scores are dropped
        v, i = torch.minimum(q_idx // s_t, last_v), q_idx % s_t
        pre_idx = torch.minimum(kv_idx, last_pre)
        row, c = pre_idx // p_t, pre_idx % p_t
        pre = (kv_idx < n_pre_t) & (row == group_of[v])
        pre = pre & (see_p[v, i, c] if see_p is not None else c >= pads[row])
        suf_idx = torch.clamp(kv_idx - n_pre_t, min=0)
        w, j = suf_idx // s_t, suf_idx % s_t
        suf = (kv_idx >= n_pre_t) & (w == v)
        suf = suf & (see_s[v, i, j] if see_s is not None else j <= i)
        return pre | suf

    last_q = scalar(max(n * s - 1, 0))

    def window_mask_mod(b, h, q_idx, kv_idx):
        qo = order_c[torch.minimum(q_idx, last_q)]  # the kernel's query order (ctx.q_order)
        v, i = qo // s_t, qo % s_t
        pre_idx = torch.minimum(kv_idx, last_pre)
        row, c = pre_idx // p_t, pre_idx % p_t
        ci = cols_c[v, i]
        pre = (kv_idx < n_pre_t) & (row == group_of[v]) & (c >= pads[row]) & (c >= first_c[v]) & (c < ci)
        pre = pre & ((c < hb_c[v]) | (c >= he_c[v])) & (c < tail_c[v])
        suf_idx = torch.clamp(kv_idx - n_pre_t, min=0)
        w, j = suf_idx // s_t, suf_idx % s_t
        cj = cols_c[v, j]
        suf = (kv_idx >= n_pre_t) & (w == v) & (((cj >= 0) & (cj <= ci)) | (j == i))
        return pre | suf

    listed, full = _shared_prefix_blocks(group_of, pads, g, p, n, s, block,
                                         prefix_full=_FLEX_FULL_BLOCKS and see_p is None,
                                         suffix_full=_FLEX_FULL_BLOCKS and see_s is None, window=win,
                                         q_order=None if win is None else ctx.q_order)

    def lists(dense):  # padded rows and columns are never visible
        dense = _at_least_2(dense)
        order = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return dense.sum(-1).to(torch.int32)[None, None], order[None, None]

    partial_counts, partial_order = lists(listed & ~full)
    full_counts, full_order = lists(full)
    # forward only (the engines score under no_grad): the transposed lists a backward pass reads are not built
    return BlockMask.from_kv_blocks(partial_counts, partial_order, full_counts, full_order, BLOCK_SIZE=block,
                                    mask_mod=mask_mod if win is None else window_mask_mod,
                                    seq_lengths=(n * s, n_pre + n * s), compute_q_blocks=False)


def _shared_prefix_flex(ctx: _SharedPrefix, module, query, key, value, scaling):
    """The shared-prefix attention of one layer in one FlexAttention call: query (N, H, S, D), key / value
    (N, kv_heads, S, D) of the suffixes; the used rows' clean prefixes (p columns) gathered once into the key
    sequence. Returns (N, S, H, D)."""
    N, H, S, D = query.shape
    hk = key.shape[1]
    p = ctx.p
    if ctx.block_mask is None:
        ctx.block_mask = _shared_prefix_block_mask(ctx, N, S, query.device)
    keys, values = ctx.kv[module.layer_idx]
    k_s = key.transpose(0, 1).reshape(1, hk, N * S, D)
    v_s = value.transpose(0, 1).reshape(1, hk, N * S, D)
    if p > 0:
        idx = torch.tensor([slot for slot, _, _, _ in ctx.groups], dtype=torch.long, device=keys.device)
        k_p = keys[:, :, :p].index_select(0, idx).to(query.dtype).transpose(0, 1).reshape(1, hk, -1, D)
        v_p = values[:, :, :p].index_select(0, idx).to(query.dtype).transpose(0, 1).reshape(1, hk, -1, D)
        k_s, v_s = torch.cat([k_p, k_s], 2), torch.cat([v_p, v_s], 2)
    q = query.transpose(0, 1).reshape(1, H, N * S, D)
    if ctx.q_order is not None:  # the block mask's query order (window queries, then tail queries)
        q = q[:, :, ctx.q_order]
    # a view (N = 1) would make the compiled kernel guard on the size of the tensor it views: a recompile per N = 1
    q, k_s, v_s = (t.clone() if t._base is not None else t for t in (q, k_s, v_s))
    with warnings.catch_warnings():  # the unfused CPU path is chosen on purpose (PyTorch warns about it)
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        # On CUDA the general kernel always: Inductor picks its decoding kernel for fewer than 128 queries (a
        # small last chunk), which found no valid configuration on the H200 (NoValidChoicesError, docs/gpu.md).
        opts = {"FORCE_USE_FLEX_ATTENTION": True} if query.device.type == "cuda" else None
        with _recompile_guard():
            out = _flex_kernel(query.device.type)(q, k_s, v_s, block_mask=ctx.block_mask, scale=scaling,
                                                  enable_gqa=H != hk, kernel_options=opts)
    if ctx.q_order is not None:
        out = out[:, :, ctx.q_inverse]
    return out.reshape(H, N, S, D).permute(1, 2, 0, 3).contiguous()


def _no_mask(*args, **kwargs):
    """Mask function of the shared-prefix attention: it builds its own (padding of the prefix only)."""
    return None


@functools.cache
def _register_shared_prefix_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(_SHARED_PREFIX_IMPL, _shared_prefix_attention)
    AttentionMaskInterface.register(_SHARED_PREFIX_IMPL, _no_mask)


