"""Windowed OAR-P with a linearized probe tail (config ``screen_tail: linear``; docs/design.md "Windowed OAR-P: the
linear tail").

:func:`oar_p_linear_tail_scores` keeps what :func:`~oar.attribution.window.oar_p_window_scores` runs exactly for each
masked token t (token t as PAD and the W reasoning tokens after it, re-run on the row's clean prefix) but does not
re-run the tail (conclude string + probe window). The tail's response to the window's changed keys/values is
approximated instead:

1. **Exact re-normalization at clean queries**, per layer l: the tail's attention output a_l (n_tail, H, d) is
   recomputed with the tail's *clean* queries over the keys/values in which the window columns' entries are replaced
   by the variant's (the other columns, the tail's own included, keep their clean keys/values). With the clean
   log-sum-exp ``lse`` and clean output ``a`` of each (head, tail query) this is closed-form over the window columns
   only: ``w = exp(q k_c * scale - lse)``, ``a' = (a - sum_win w_old v_old + sum_win w_new v_new) /
   (1 - sum_win w_old + sum_win w_new)``, ``delta a_l = a' - a``.
2. **First-order map to the probe through the clean tail**, once per row: the tail is run with grad on the clean
   prefix (constant keys/values) with a zero leaf added to every layer's attention output (before o_proj), and
   the Jacobian of R *readouts* of the probe w.r.t. those leaves is taken with R vector-Jacobian products in one
   batched backward (shape
   (R, layers, n_tail, H * d)). Per variant, ``delta rho = sum_l <J_l, delta a_l>``.
3. **Readouts and divergence.** KL has zero gradient at the clean point, so the readouts are not the KL but the
   log-probabilities of a partition of the vocabulary: the top ``r`` entries of the clean probe distribution (the
   softmax of the mean answer logits for ``answer_mean``, of the first probe position for ``last``) and one cell for
   the rest (R = r + 1; R = V without a rest cell when r >= V). The approximate perturbed cells are
   ``softmax(log q + delta rho)`` (re-normalized) and the score is KL(q || q') over the cells: the exact KL of the
   coarse-grained distributions when delta rho is exact (a lower bound of the full KL), second order in delta a.
   ``answer_joint`` has one readout, phi (mean answer log-likelihood), and scores max(0, -delta phi).

What it neglects: the cross terms between the tail's own changes and the window's (the tail's queries, keys and
values at layer l are clean when a_l is re-normalized; their change reaches the probe only through the linear map),
and the curvature of the tail above layer l. Variants whose window reaches the tail (the last W tokens of the
reasoning, or every token when ``window >= L - 1``) re-run the tail exactly instead (``exact_reach=True``): with
``window >= L - 1`` nothing is linearized and the scores are exact OAR-P's (tested).

Cost per row, in token-columns (the unit of ``stats["tokens"]``): the clean pass (n = the row's context length,
run by this module's own float forward, which also keeps the tail's queries, outputs and log-sum-exps), (1 + W)
per linearized variant (the window; the top layer's attention and MLP are skipped for them, still counted as a
whole column), (1 + W + n_tail) per variant that reaches the tail, and the Jacobian: one forward of n_tail columns
with grad plus R backward passes, counted as 2 * n_tail each (``stats["backward_passes"]`` = R per row,
``stats["backward_tokens"]``). The per-variant tail arithmetic (O(layers * H * n_tail * (1 + W) * d) and the
contraction with J, O(R * layers * n_tail * H * d)) is not counted as token-columns.

Only Hugging Face Llama / Qwen2 / Qwen3 decoders wrapped in :class:`~oar.attribution.hf_model.HFProbeModel` are
supported (the forward is re-implemented here from their modules: RMSNorm, RoPE, grouped-query attention, gated
MLP, with its own dense attention, so flash-attention models run too), with unsharded parameters: the modules are
called one by one, which FSDP / DeepSpeed ZeRO-3 parameters do not allow (:func:`linear_tail_support` says why not).
The linear arithmetic (re-normalization, Jacobian contraction, cell KL) runs in float32 whatever the model's dtype,
outside autocast.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from oar.attribution import planner
from oar.attribution.base import (
    Attribution,
    check_ids,
    chunk_divergence,
    empty_attribution,
    engine_args,
    int_value,
    masking_units,
    store_scores,
    unit_variants,
)
from oar.attribution.context import ProbeBatch
from oar.attribution.hf_model import HFProbeModel
from oar.attribution.model import gather_probe_logits

_log = logging.getLogger("oar")

#: model_type values of the configs this module can run.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
#: at most this many variants per chunk: a chunk's prefix attention reads the columns before its last start only.
_CHUNK_VARIANTS = 256


@dataclass
class _Net:
    embed: object
    layers: list
    norm: object
    lm_head: object
    rotary: object
    heads: int
    kv_heads: int
    head_dim: int
    scale: float


def _sharding(module) -> str | None:
    """The parameter sharding of ``module`` or a submodule (FSDP1 / FSDP2 wrappers, DTensor or ZeRO-3 parameters),
    None if its parameters are whole tensors."""
    for m in module.modules():
        bases = {b.__name__ for b in type(m).__mro__}
        if "FullyShardedDataParallel" in bases:
            return "FSDP"
        if "FSDPModule" in bases:
            return "FSDP2"
    for prm in module.parameters():
        if hasattr(prm, "ds_id"):
            return "DeepSpeed ZeRO-3"
        if "DTensor" in {b.__name__ for b in type(prm).__mro__}:
            return "DTensor parameters"
    return None


def linear_tail_support(model) -> str | None:
    """Why :func:`oar_p_linear_tail_scores` cannot run ``model`` (a sentence naming what is unsupported), or None
    when it can: it needs an :class:`~oar.attribution.hf_model.HFProbeModel` of a Llama / Qwen2 / Qwen3 decoder
    (:data:`SUPPORTED_MODEL_TYPES`) without sliding-window attention, with unsharded parameters."""
    if not isinstance(model, HFProbeModel):
        return f"model must be an HFProbeModel (Llama / Qwen2 / Qwen3), got {type(model).__name__}"
    hf = model.model
    cfg = getattr(hf, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        return f"model: oar_p_linear_tail_scores supports model_type {SUPPORTED_MODEL_TYPES}, got {mt!r}"
    if getattr(cfg, "use_sliding_window", False):
        return "model: sliding-window attention is not supported by oar_p_linear_tail_scores"
    wrapper = _sharding(hf)
    if wrapper is not None:
        return (f"model: oar_p_linear_tail_scores calls the decoder's modules one by one, which needs unsharded "
                f"parameters; the model is sharded by {wrapper}")
    return None


def _net(model) -> _Net:
    why = linear_tail_support(model)
    if why is not None:
        raise ValueError(why)
    hf = model.model
    cfg = hf.config
    inner = hf.model
    attn = inner.layers[0].self_attn
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    return _Net(inner.embed_tokens, list(inner.layers), inner.norm, hf.lm_head, inner.rotary_emb, heads, kv,
                int(attn.head_dim), float(attn.scaling))


def _rope(q, k, cos, sin):
    # (N, heads, S, d) with cos/sin (N, S, d): the rotation of transformers' apply_rotary_pos_emb
    def rot(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _qkv(net: _Net, attn, x, cos, sin):
    """Queries (N, H, S, d), keys and values (N, kvH, S, d) of normed hidden states x (N, S, D), RoPE applied."""
    N, S, _ = x.shape
    d = net.head_dim
    q = attn.q_proj(x).view(N, S, -1, d)
    k = attn.k_proj(x).view(N, S, -1, d)
    v = attn.v_proj(x).view(N, S, -1, d).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = _rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v


def _grouped(q, net: _Net):
    """(N, H, S, d) -> (N, kvH, g, S, d): head h reads kv head h // g, as transformers' repeat_kv."""
    N, H, S, d = q.shape
    return q.view(N, net.kv_heads, H // net.kv_heads, S, d)


def _attend(net: _Net, q, keys, values, mask):
    """Softmax attention of q (N, H, S, d) over keys/values (N or 1, kvH, Sk, d) with mask (N or 1, S, Sk) bool
    (True = visible). Returns output (N, H, S, d) and log-sum-exp (N, H, S)."""
    qg = _grouped(q, net)
    s = torch.einsum("nkgsd,nktd->nkgst", qg, keys.expand(qg.shape[0], -1, -1, -1)) * net.scale
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("nkgst,nktd->nkgsd", p, values.expand(qg.shape[0], -1, -1, -1))
    N, H, S, d = q.shape
    return out.reshape(N, H, S, d), lse.reshape(N, H, S)


def _attend_prefix(net: _Net, q, kp, vp, mask_p, k, v, mask_s):
    """Softmax attention of the re-run queries q (N, H, S, d) over the row's clean prefix kp / vp (kvH, n, d),
    shared by the N variants and read in place (mask_p (N, S, n)), and over their own keys / values k / v
    (N, kvH, S, d) (mask_s (N, S, S), True on the diagonal): one softmax over both, as over their concatenation,
    without copying the prefix per variant. Returns (N, H, S, d)."""
    N, H, S, d = q.shape
    kvH, g = net.kv_heads, H // net.kv_heads
    q5 = q.view(N, kvH, g, S, d)
    # the large scores (kvH, N, g, S, n) come out of one batched matmul over the kv heads in the layout the second
    # matmul reads: no copy of them, no copy of the prefix per variant; masking and softmax in place
    s_p = torch.matmul(q5.permute(1, 0, 2, 3, 4).reshape(kvH, N * g * S, d), kp.transpose(1, 2))
    s_p = s_p.mul_(net.scale).view(kvH, N, g, S, -1).masked_fill_(~mask_p[None, :, None], float("-inf"))
    s_s = torch.einsum("nkgsd,nktd->kngst", q5, k).mul_(net.scale).masked_fill_(~mask_s[None, :, None], float("-inf"))
    m = torch.maximum(s_p.amax(-1), s_s.amax(-1)).unsqueeze(-1)  # finite: every query sees itself
    p_p, p_s = s_p.sub_(m).exp_(), s_s.sub_(m).exp_()
    den = (p_p.sum(-1) + p_s.sum(-1)).unsqueeze(-1)
    out = torch.matmul(p_p.view(kvH, N * g * S, -1), vp).view(kvH, N, g, S, d)
    out = (out + torch.einsum("kngst,nktd->kngsd", p_s, v)) / den
    return out.permute(1, 0, 2, 3, 4).reshape(N, H, S, d)


def _merge(out):
    """(N, H, S, d) -> (N, S, H * d)."""
    N, H, S, d = out.shape
    return out.transpose(1, 2).reshape(N, S, H * d)


def _clean_row(net: _Net, ids, pos, tail0: int, keep: int, q_block: int = 512):
    """Clean forward of one unpadded row (n,): per-layer keys/values (kvH, n, d), the tail's queries (H, nt, d),
    attention outputs (H, nt, d) and log-sum-exps (H, nt), and the logits of the last ``keep`` columns (1, keep, V)."""
    n = ids.shape[0]
    h = net.embed(ids[None])
    cos, sin = net.rotary(h, pos[None])
    col = torch.arange(n, device=ids.device)
    Ks, Vs, Qt, At, Lt = [], [], [], [], []
    for layer in net.layers:
        attn = layer.self_attn
        q, k, v = _qkv(net, attn, layer.input_layernorm(h), cos, sin)
        outs, lses = [], []
        for b in range(0, n, q_block):
            e = min(n, b + q_block)
            mask = (col[None, :e] <= col[b:e, None])[None]
            o, lse = _attend(net, q[:, :, b:e], k[:, :, :e], v[:, :, :e], mask)
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        Ks.append(k[0])
        Vs.append(v[0])
        Qt.append(q[0, :, tail0:])
        At.append(out[0, :, tail0:])
        Lt.append(lse[0, :, tail0:])
        h = h + attn.o_proj(_merge(out))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = net.lm_head(net.norm(h[:, n - keep:]))
    return Ks, Vs, Qt, At, Lt, logits


def _readouts(probe_logits, probe: str, answer_ids, K_r: int, top):
    """Readouts rho (R,) of one row's probe logits (1, K, V): log-probabilities of the cells ``top`` (r,) and the
    rest (answer_mean / last), or phi (answer_joint)."""
    z = probe_logits[0, :K_r].float()
    if probe == "answer_joint":
        lp = torch.log_softmax(z, -1).gather(-1, answer_ids[:K_r, None])[:, 0]
        return lp.mean().view(1)
    zz = z.mean(0) if probe == "answer_mean" else z[0]
    lp = torch.log_softmax(zz, -1)
    cells = lp[top]
    if top.numel() < lp.numel():
        rest = torch.ones_like(lp, dtype=torch.bool)
        rest[top] = False
        cells = torch.cat([cells, torch.logsumexp(lp[rest], 0).view(1)])
    return cells


def _tail_jacobian(net: _Net, ids_t, pos_t, Ks, Vs, tail0: int, keep: int, probe_start, K: int, probe: str,
                   answer_ids, K_r: int, top):
    """J (R, layers, nt, H * d): d readouts / d (attention output of each tail column before o_proj), through the
    clean tail run on the clean prefix (constant keys/values); and the readouts of that run (R,)."""
    nt = ids_t.shape[0]
    dev = ids_t.device
    col = torch.arange(nt, device=dev)
    mask = torch.cat([torch.ones(nt, tail0, dtype=torch.bool, device=dev), col[None, :] <= col[:, None]], 1)[None]
    with torch.enable_grad():
        h = net.embed(ids_t[None]).detach()
        cos, sin = net.rotary(h, pos_t[None])
        eps = [torch.zeros(1, nt, net.heads * net.head_dim, dtype=h.dtype, device=dev, requires_grad=True)
               for _ in net.layers]
        for i, layer in enumerate(net.layers):
            attn = layer.self_attn
            q, k, v = _qkv(net, attn, layer.input_layernorm(h), cos, sin)
            kk = torch.cat([Ks[i][None, :, :tail0], k], 2)
            vv = torch.cat([Vs[i][None, :, :tail0], v], 2)
            out, _ = _attend(net, q, kk, vv, mask)
            h = h + attn.o_proj(_merge(out) + eps[i])
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = net.lm_head(net.norm(h[:, nt - keep:]))
        rho = _readouts(gather_probe_logits(logits, probe_start, K), probe, answer_ids, K_r, top)
        # the R backward passes as one batched backward (vmap over the one-hot output gradients)
        R = rho.numel()
        g = torch.autograd.grad(rho, eps, grad_outputs=torch.eye(R, dtype=rho.dtype, device=dev),
                                is_grads_batched=True)
        J = torch.stack([x[:, 0] for x in g], 1).float()  # (R, layers, nt, H * d)
    return J, rho.detach().float()


def _cell_kl(rho, drho):
    """KL(q || q') over cells, log q = rho (R,), log q' = normalized rho + drho (N, R)."""
    lq = rho - torch.logsumexp(rho, 0)
    lq2 = rho[None] + drho
    lq2 = lq2 - torch.logsumexp(lq2, 1, keepdim=True)
    return (lq.exp()[None] * (lq[None] - lq2)).sum(1).clamp_min(0.0)


def oar_p_linear_tail_scores(model, batch: ProbeBatch, *, window: int, probe: str = "answer_mean",
                             rows: Sequence[int] | None = None, positions: Mapping[int, Sequence[int]] | None = None,
                             memory_budget_mb: int = planner.DEFAULT_MEMORY_BUDGET_MB,
                             spans: Mapping[int, Sequence[tuple[int, int]]] | None = None,
                             top_r: int = 32, exact_reach: bool = True) -> Attribution:
    """Windowed OAR-P whose tail is linearized (module docstring; config ``screen_tail: linear``): I_t for every
    reasoning token t is the probe divergence when token t is replaced by PAD and t plus the ``window`` reasoning
    tokens after it are re-run exactly on the clean prefix (as :func:`~oar.attribution.window.oar_p_window_scores`),
    while the tail (conclude + probe window) is not re-run: its response is the exact re-normalization of its
    attention at clean queries over the window's new keys/values, mapped to the probe by a Jacobian taken once per
    row through the clean tail, and the divergence is the KL over the top ``top_r`` vocabulary cells + a rest cell.

    Args:
        model: :class:`~oar.attribution.hf_model.HFProbeModel` of a Llama / Qwen2 / Qwen3 decoder with unsharded
            parameters (:func:`linear_tail_support`), on any device, in any float dtype.
        batch: :class:`ProbeBatch`; run on its :meth:`~ProbeBatch.probe_view`.
        window: int >= 0, later reasoning tokens re-run with each masked token.
        probe: ``"answer_mean"`` (default), ``"last"`` or ``"answer_joint"``.
        rows, positions: as :func:`~oar.attribution.oar_p.oar_p_scores` (default all rows, every reasoning token).
        memory_budget_mb: int >= 1, rough bound (MiB) on the attention scores of one chunk of variants.
        spans: optional {row: [(j0, j1), ...]} masking units, as :func:`~oar.attribution.window.oar_p_window_scores`
            (a span's variant masks all its tokens; the window counts tokens after its last one).
        top_r: int >= 1, vocabulary cells of the readout (R = top_r + 1 backward passes per row, top_r + 1 >= V:
            V cells, no rest cell); ignored by ``answer_joint`` (R = 1).
        exact_reach: variants whose window reaches the end of the reasoning re-run the tail exactly (default; with
            ``window >= L - 1`` the scores are exact OAR-P's); False linearizes them too (their window stops at the
            end of the reasoning).

    Returns:
        Attribution: scores (B, L_max) float32 >= 0 aligned with the reasoning tokens, mask, stats
        ``tokens`` (token-columns run forward: clean passes, windows, exact tails, the Jacobian's tail forward),
        ``backward_passes`` (R per row), ``backward_tokens`` (2 * n_tail per backward pass), ``forward_passes``
        (model calls: clean + Jacobian + chunks), ``variants``, ``linearized`` (variants with a linear tail),
        ``cost_tokens`` (tokens + backward_tokens), ``engine`` (``"linear_tail"``), ``seconds``.

    Raises:
        ValueError: ``window`` not an int >= 0, ``top_r`` not an int >= 1, ``exact_reach`` not a bool, a model
            :func:`linear_tail_support` refuses (its sentence), and as :func:`~oar.attribution.oar_p.oar_p_scores`.
    """
    window = int_value("window", window)
    if window < 0:
        raise ValueError(f"window must be an int >= 0, got {window}")
    top_r = int_value("top_r", top_r)
    if top_r < 1:
        raise ValueError(f"top_r must be an int >= 1, got {top_r}")
    if not isinstance(exact_reach, bool):
        raise ValueError(f"exact_reach must be a bool, got {exact_reach!r}")
    net = _net(model)
    _, probe, rows, budget, positions = engine_args(model, batch, probe, rows, positions, memory_budget_mb)
    batch = batch.probe_view()
    units = masking_units(batch, rows, positions, spans)
    check_ids(model, batch)
    t0 = time.perf_counter()
    res = empty_attribution(batch, rows)
    rows = [r for r in rows if int(batch.reasoning_len[r]) > 0 and (units is None or units.get(r))]
    stats = dict(forward_passes=0, variants=0, linearized=0, tokens=0, backward_passes=0, backward_tokens=0)
    T = int(batch.input_ids.shape[1])
    K = int(batch.answer_ids.shape[1])
    keep = int(batch.keep)
    dev = torch.device(model.device)
    with torch.no_grad():
        for r in rows:
            _row(net, batch, r, T, K, keep, window, probe, top_r, exact_reach, budget, res, stats, units, dev)
    stats.update(cost_tokens=stats["tokens"] + stats["backward_tokens"], engine="linear_tail",
                 seconds=time.perf_counter() - t0)
    res.stats.update(stats)
    _log.info("oar_p_linear_tail_scores: window %d, %d rows, %d variants (%d linearized), %.3f s", window, len(rows),
              stats["variants"], stats["linearized"], stats["seconds"])
    return res


def _row(net: _Net, batch: ProbeBatch, r: int, T: int, K: int, keep: int, window: int, probe: str,
         top_r: int, exact_reach: bool, budget: int, res: Attribution, stats: dict, units, dev) -> None:
    a = T - int(batch.context_len[r])
    ids = batch.input_ids[r, a:].to(dev)
    pos = batch.position_ids[r, a:].to(dev)
    n = ids.shape[0]
    s0 = int(batch.reasoning_start[r]) - a
    L = int(batch.reasoning_len[r])
    tail0 = min(s0 + L, n - keep)  # first tail column (unpadded): as the window engine's conclude tail
    nt = n - tail0
    K_r = int(batch.answer_len[r])
    ps = batch.probe_start[r:r + 1]
    Ks, Vs, Qt, At, Lt, logits = _clean_row(net, ids, pos, tail0, keep)
    stats["forward_passes"] += 1
    stats["tokens"] += n
    clean = gather_probe_logits(logits, ps, K)  # (1, K, V)

    row_t, col_t, j_t, len_t = unit_variants(batch, [r], units)
    cols = (col_t - a).tolist()
    lens = len_t.tolist()
    ends = [c + m + window for c, m in zip(cols, lens)]
    reach = [exact_reach and e >= tail0 for e in ends]
    lin = [i for i, x in enumerate(reach) if not x]
    ex = [i for i, x in enumerate(reach) if x]
    stats["variants"] += len(cols)
    stats["linearized"] += len(lin)

    J = rho = None
    if lin:
        V = clean.shape[-1]
        top = torch.empty(0, dtype=torch.long, device=dev)
        if probe != "answer_joint":
            z = clean[0, :K_r].float()
            zz = z.mean(0) if probe == "answer_mean" else z[0]
            top = torch.topk(zz, min(top_r, V)).indices
            if top.numel() >= V - 1:  # a rest cell of one entry: take it as a cell of its own
                top = torch.arange(V, device=dev)
        J, rho = _tail_jacobian(net, ids[tail0:], pos[tail0:], Ks, Vs, tail0, keep, ps, K, probe,
                                batch.answer_ids[r].to(dev), K_r, top)
        stats["forward_passes"] += 1
        stats["tokens"] += nt
        stats["backward_passes"] += int(rho.numel())
        stats["backward_tokens"] += 2 * nt * int(rho.numel())

    H = net.heads
    for group, linear in ((lin, True), (ex, False)):
        if not group:
            continue
        S = max((min(ends[i], tail0) if linear else n) - cols[i] for i in group)
        per_variant = 4 * H * S * (n + S) * 3 + 1
        # variants are in column order: a chunk of at most _CHUNK_VARIANTS reads the prefix up to its last start only
        step = max(1, min(_CHUNK_VARIANTS, int(budget // per_variant)))
        for b in range(0, len(group), step):
            idx = group[b:b + step]
            d = _chunk(net, ids, pos, batch.pad_id, [cols[i] for i in idx], [lens[i] for i in idx],
                       [min(ends[i], tail0) if linear else n for i in idx], linear, tail0, keep, Ks, Vs, Qt, At, Lt,
                       J, rho, stats)
            stats["forward_passes"] += 1
            if not linear:
                pert = gather_probe_logits(d, ps.expand(len(idx)), K)
                d = chunk_divergence(clean.expand(len(idx), -1, -1), pert, batch, row_t[idx], probe)
            store_scores(res, d, probe, row_t[idx], j_t[idx], len_t[idx])


def _tail_response(net: _Net, i: int, cq, wmask, k, v, Ks, Vs, Qt, At, Lt, J):
    """Layer i's first-order change of the readouts (N, R) float32: the tail's attention output re-normalized exactly
    at its clean queries over the window's new keys/values ``k``, ``v`` (N, kvH, S, d) at columns ``cq`` (N, S)
    (``wmask``: the window's columns), contracted with J. In float32 (float64 when J is), autocast off: the change is
    a difference of near-equal sums."""
    with torch.autocast(device_type=cq.device.type, enabled=False):
        f = torch.promote_types(J.dtype, torch.float32)
        g = net.heads // net.kv_heads
        k_old = Ks[i][:, cq].permute(1, 0, 2, 3).to(f)  # (N, kvH, S, d)
        v_old = Vs[i][:, cq].permute(1, 0, 2, 3).to(f)
        qt = Qt[i].view(net.kv_heads, g, -1, net.head_dim).to(f)  # (kvH, g, nt, d)
        lse = Lt[i].view(net.kv_heads, g, -1, 1).to(f)
        a0 = At[i].view(net.kv_heads, g, -1, net.head_dim).to(f)
        m = wmask[:, None, None, None, :].to(f)
        w_old = torch.exp(torch.einsum("kgid,nksd->nkgis", qt, k_old) * net.scale - lse) * m
        w_new = torch.exp(torch.einsum("kgid,nksd->nkgis", qt, k.to(f)) * net.scale - lse) * m
        num = a0[None] - torch.einsum("nkgis,nksd->nkgid", w_old, v_old) + torch.einsum(
            "nkgis,nksd->nkgid", w_new, v.to(f))
        den = 1.0 - w_old.sum(-1) + w_new.sum(-1)
        da = num / den.unsqueeze(-1) - a0[None]  # (N, kvH, g, nt, d)
        N = da.shape[0]
        da = da.permute(0, 3, 1, 2, 4).reshape(N, -1, net.heads * net.head_dim)  # (N, nt, H * d)
        return torch.einsum("nie,rie->nr", da, J[:, i])


def _chunk(net: _Net, ids, pos, pad_id: int, starts, lens, stops, linear: bool, tail0: int, keep: int, Ks, Vs, Qt,
           At, Lt, J, rho, stats):
    """One chunk of variants of a row: variant n re-runs columns [starts[n], stops[n]) with its unit
    [starts[n], starts[n] + lens[n]) as PAD, on the clean prefix. Linear: returns the approximate divergences (N,);
    else the logits of the last ``keep`` columns (N, keep, V) (the chunk's stops are the row's end)."""
    N = len(starts)
    dev = ids.device
    S = max(e - s for s, e in zip(starts, stops))
    colq = torch.full((N, S), -1, dtype=torch.long)
    for i, (s, e) in enumerate(zip(starts, stops)):
        colq[i, S - (e - s):] = torch.arange(s, e)
    colq = colq.to(dev)
    valid = colq >= 0
    st = torch.tensor(starts, device=dev).view(-1, 1)
    x_ids = ids[colq.clamp_min(0)]
    x_ids[(colq >= st) & (colq < st + torch.tensor(lens, device=dev).view(-1, 1)) | ~valid] = pad_id
    x_pos = pos[colq.clamp_min(0)]
    stats["tokens"] += int(valid.sum())
    pre = max(starts)  # no variant sees a clean column at or after its own start
    see_prefix = (torch.arange(pre, device=dev)[None, None, :] < st[:, :, None]) & valid[:, :, None]  # (N, S, pre)
    see_self = (colq[:, None, :] <= colq[:, :, None]) & valid[:, None, :] & valid[:, :, None]
    see_self |= torch.eye(S, dtype=torch.bool, device=dev)[None]  # padding slots see themselves (never read)
    h = net.embed(x_ids)
    cos, sin = net.rotary(h, x_pos)
    if linear:
        wmask = valid & (colq < tail0)  # (N, S)
        drho = torch.zeros(N, rho.numel(), dtype=torch.float32, device=dev)
    nl = len(net.layers)
    for i, layer in enumerate(net.layers):
        attn = layer.self_attn
        q, k, v = _qkv(net, attn, layer.input_layernorm(h), cos, sin)
        if linear:
            drho += _tail_response(net, i, colq.clamp_min(0), wmask, k, v, Ks, Vs, Qt, At, Lt, J)
            if i == nl - 1:
                break  # the top layer's attention and MLP of the window reach no tail readout
        out = _attend_prefix(net, q, Ks[i][:, :pre], Vs[i][:, :pre], see_prefix, k, v, see_self)
        h = h + attn.o_proj(_merge(out))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    if linear:
        if rho.numel() == 1:  # answer_joint: the drop of phi, clamped by store_scores
            return -drho[:, 0]
        return _cell_kl(rho.float(), drho)
    return net.lm_head(net.norm(h[:, S - keep:]))
