"""Plain-PyTorch reference implementations of every oar op (method.md sections 1-6).

Written for clarity, not speed: loops and float64 where it makes the math obvious. Imported by the
tests (independent reference) and the benchmarks (what a user would write by hand). Each function has
the same signature and semantics as its ``oar.ops`` counterpart.
"""

from __future__ import annotations

import torch

# ==== section: advantages ===============================================================================

#: Same table as :data:`oar.ops.ADVANTAGE_PRESETS`, written out again so the reference stays independent.
_PRESETS = {
    "default": ("unbiased", 1e-6, "zero"),
    "trl": ("unbiased", 1e-4, "zero"),
    "verl": ("unbiased", 1e-6, "verl"),
    "openrlhf": ("unbiased", 1e-9, "zero"),
}


def _std(x: torch.Tensor, unbiased: bool) -> float:
    n = x.numel()
    dof = n - 1 if unbiased else n
    if dof <= 0:
        return 0.0
    return float(((x - x.mean()) ** 2).sum() / dof) ** 0.5


def group_advantages(
    rewards: torch.Tensor,
    offsets=None,
    *,
    group_ids=None,
    group_size: int | None = None,
    estimator: str = "grpo",
    preset: str | None = None,
    std: str | None = None,
    eps: float | None = None,
    singleton: str | None = None,
    skip_nan: bool = False,
) -> torch.Tensor:
    """Reference of :func:`oar.ops.group_advantages` (method.md section 1): one Python loop per group, float64.

    Returns (N,) float32. Raises ValueError on NaN (without ``skip_nan``) or infinite rewards.
    """
    r = rewards.detach().to("cpu", torch.float64)
    n = r.numel()
    if offsets is not None:
        off = [int(v) for v in torch.as_tensor(offsets).tolist()]
    elif group_size is not None:
        off = list(range(0, n + 1, group_size))
    else:
        ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
        off = [i for i in range(n) if i == 0 or ids[i] != ids[i - 1]] + [n]
    std_p, eps_p, single_p = _PRESETS["default" if preset is None else preset]
    unbiased = (std or std_p) == "unbiased"
    eps = eps_p if eps is None else eps
    verl = (singleton or single_p) == "verl"
    nan = torch.isnan(r)
    if torch.isinf(r).any():
        raise ValueError("rewards must be finite")
    if nan.any() and not skip_nan:
        raise ValueError("rewards must not contain NaN")

    valid_all = r[~nan]
    batch_std = _std(valid_all, unbiased)
    batch_div = (batch_std if batch_std > 0 else 1.0) + eps
    out = torch.zeros(n, dtype=torch.float64)
    for g in range(len(off) - 1):
        idx = [i for i in range(off[g], off[g + 1]) if not nan[i]]
        if not idx:
            continue
        x = r[idx]
        m = len(idx)
        if m == 1:
            if verl:
                v = x[0]
                a = {"grpo": v / (1 + eps), "batch": v / batch_div}.get(estimator, v)
                out[idx[0]] = a
            continue
        if bool((x == x[0]).all()):
            continue
        mean = x.mean()
        if estimator == "grpo":
            a = (x - mean) / (_std(x, unbiased) + eps)
        elif estimator == "dr_grpo":
            a = x - mean
        elif estimator == "batch":
            a = (x - mean) / batch_div
        elif estimator == "rloo":
            a = x - (x.sum() - x) / (m - 1)
        else:
            raise ValueError(f"estimator must be one of grpo, dr_grpo, batch, rloo, got {estimator!r}")
        out[idx] = a
    return out.to(torch.float32)


def normalize_importance(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`oar.ops.normalize_importance` (method.md section 5): row loop, float64.

    Returns (B, T) float32. Raises ValueError on NaN/Inf/negative scores on the mask.
    """
    s = scores.detach().to("cpu", torch.float64)
    m = mask.detach().to("cpu").bool()
    out = torch.zeros_like(s)
    for b in range(s.shape[0]):
        x = s[b][m[b]]
        if x.numel() == 0:
            continue
        if not bool(torch.isfinite(x).all()) or bool((x < 0).any()):
            raise ValueError("scores must be finite and >= 0 on the mask")
        lx = torch.log1p(x)
        lo, hi = lx.min(), lx.max()
        den = hi - lo if hi > lo else torch.tensor(1.0, dtype=torch.float64)
        out[b][m[b]] = (lx - lo) / den
    return out.to(torch.float32)


def reshape_advantages(
    advantages: torch.Tensor,
    scores: torch.Tensor,
    reasoning_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    q: float = 0.25,
    beta: float = 1.0,
    floor: float = 0.1,
    tiers: str = "both",
    scores_are_normalized: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`oar.ops.reshape_advantages` (method.md section 6): row loop, float64, the
    quantile from ``torch.quantile(..., interpolation="linear")``.

    Returns ``(token_advantages, weights)``, (B, T) float32 each.
    """
    eps = 1e-8
    rm = reasoning_mask.detach().to("cpu").bool()
    pm = response_mask.detach().to("cpu").bool()
    if scores_are_normalized:
        s_hat = scores.detach().to("cpu", torch.float64)
    else:
        s_hat = normalize_importance(scores, rm).to(torch.float64)
    a = advantages.detach().to("cpu", torch.float64)
    w = pm.to(torch.float64)  # 1 on the response, 0 on padding; the span is overwritten below
    for b in range(s_hat.shape[0]):
        x = s_hat[b][rm[b]]
        if x.numel() == 0:
            continue
        tau = float(torch.quantile(x, q, interpolation="linear"))
        low = x < tau
        suppress = torch.clamp(x / (tau + eps), min=floor)
        boost = 1.0 + beta * (x - tau) / (1.0 - tau + eps)
        if tiers == "boost":
            suppress = torch.ones_like(x)
        elif tiers == "suppress":
            boost = torch.ones_like(x)
        wx = torch.where(low, suppress, boost)
        w[b][rm[b]] = wx * (x.numel() / wx.sum())
    return (w * a[:, None]).to(torch.float32), w.to(torch.float32)


def reshape_advantages_vectorized(advantages: torch.Tensor, scores: torch.Tensor, reasoning_mask: torch.Tensor,
                                  response_mask: torch.Tensor, *, q: float = 0.25, beta: float = 1.0,
                                  floor: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize + reshape (tiers "both") the way a user would vectorize it in plain PyTorch, float32, on
    any device: log1p, masked min-max via where, the per-row quantile via ``torch.nanquantile`` on a
    NaN-filled copy, then tiers and mass preservation. Same math as :func:`reshape_advantages` (tested);
    the benchmarks' "what users would write" provider. Returns ``(token_advantages, weights)``."""
    eps = 1e-8
    rm = reasoning_mask.bool()
    pm = response_mask.bool()
    s = torch.log1p(scores.float())
    big = torch.finfo(torch.float32).max
    lo = torch.where(rm, s, torch.full_like(s, big)).amin(1, keepdim=True)
    hi = torch.where(rm, s, torch.full_like(s, -big)).amax(1, keepdim=True)
    den = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    x = torch.where(rm, (s - lo) / den, torch.zeros_like(s))
    tau = torch.nanquantile(torch.where(rm, x, torch.full_like(x, float("nan"))), q, dim=1, keepdim=True,
                            interpolation="linear")
    tau = torch.nan_to_num(tau, nan=0.0)
    w = torch.where(x < tau, torch.clamp(x / (tau + eps), min=floor), 1.0 + beta * (x - tau) / (1.0 - tau + eps))
    w = torch.where(rm, w, torch.zeros_like(w))
    L = rm.sum(1, keepdim=True).float()
    w = w * (L / w.sum(1, keepdim=True).clamp_min(1e-30))
    w = torch.where(rm, w, pm.float())
    return w * advantages.float()[:, None], w


# ==== end section: advantages ===========================================================================

# ==== section: probe ====================================================================================


def _kl_from_logits(zc: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
    """KL(softmax(zc) || softmax(zp)) over the last dim; entries with p_clean = 0 contribute 0."""
    lc = torch.log_softmax(zc, dim=-1)
    lp = torch.log_softmax(zp, dim=-1)
    pc = lc.exp()
    terms = torch.where(pc > 0, pc * (lc - lp), torch.zeros_like(pc))
    return terms.sum(-1)


def probe_divergence(
    clean_logits: torch.Tensor,
    perturbed_logits: torch.Tensor,
    *,
    probe: str = "answer_mean",
    answer_ids: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`oar.ops.probe_divergence` (method.md section 2), in float64.

    log_softmax + KL for ``"last"`` / ``"answer_mean"`` (mean of logits over s < lengths[n]), drop of the
    mean answer log-likelihood for ``"answer_joint"`` (not clamped). Returns (N,) **float64** (the op
    returns float32) and is differentiable w.r.t. both inputs; the tests differentiate it w.r.t.
    ``perturbed_logits`` only. Raises ValueError on an unknown probe or missing ``answer_ids``; does not
    range-check ids or lengths.
    """
    if probe not in ("last", "answer_mean", "answer_joint"):
        raise ValueError(f"probe must be one of last, answer_mean, answer_joint, got {probe!r}")
    c = clean_logits.double()
    p = perturbed_logits.double()
    N, S, V = p.shape
    if lengths is None:
        lengths = torch.full((N,), S, dtype=torch.int64, device=p.device)
    mask = torch.arange(S, device=p.device)[None, :] < lengths[:, None]  # (N, S)
    count = lengths.to(torch.float64)
    if probe == "last":
        return _kl_from_logits(c[:, 0], p[:, 0]).clamp_min(0)
    if probe == "answer_mean":
        m3 = mask[..., None]
        zc = torch.where(m3, c, torch.zeros_like(c)).sum(1) / count[:, None]
        zp = torch.where(m3, p, torch.zeros_like(p)).sum(1) / count[:, None]
        return _kl_from_logits(zc, zp).clamp_min(0)
    if answer_ids is None:
        raise ValueError("answer_ids is required for probe='answer_joint'")
    ids = torch.where(mask, answer_ids, torch.zeros_like(answer_ids))[..., None]

    def phi(z: torch.Tensor) -> torch.Tensor:
        ll = torch.log_softmax(z, dim=-1).gather(-1, ids)[..., 0]  # (N, S)
        return torch.where(mask, ll, torch.zeros_like(ll)).sum(1) / count

    return phi(c) - phi(p)


def grad_x_input(grad: torch.Tensor, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """Reference of :func:`oar.ops.grad_x_input` (method.md section 4): |sum_h g * x|, (B, L) float64."""
    return (grad.double() * input.double()).sum(-1).abs()


def build_masked_batch(
    input_ids: torch.Tensor, row_index: torch.Tensor, positions: torch.Tensor, pad_id: int
) -> torch.Tensor:
    """Reference of :func:`oar.ops.build_masked_batch` (method.md section 3): one PAD substitution per row."""
    out = input_ids[row_index].clone()
    for m in range(out.shape[0]):
        out[m, positions[m]] = pad_id
    return out


# ==== end section: probe ================================================================================

# ==== section: attribution (naive OAR-P, what a user would write; benchmarks and tests) ==================


def _probe_stat(logits: torch.Tensor, cols: torch.Tensor, answer_ids: torch.Tensor, probe: str,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Probe statistic of ONE context's full logits (T, V): log-distribution (V,) or phi (scalar), in ``dtype``."""
    z = logits[cols].to(dtype)
    if probe == "last":
        return torch.log_softmax(z[0], -1)
    if probe == "answer_mean":
        return torch.log_softmax(z.mean(0), -1)
    lp = torch.log_softmax(z, -1)
    return lp[torch.arange(len(cols), device=lp.device), answer_ids].mean()


def _divergence_of(clean: torch.Tensor, pert: torch.Tensor, probe: str) -> float:
    """OAR-P score of one masked variant from two :func:`_probe_stat` results: KL(clean || pert) >= 0, or the
    clamped drop of phi for ``answer_joint``."""
    if probe == "answer_joint":
        return max(0.0, float(clean - pert))
    return float((clean.exp() * (clean - pert)).sum().clamp_min(0))


def _row_context(batch, r: int, dev):
    """Row ``r`` of a probe batch unpadded: context ids (n,), reasoning start and length in it, the positions
    predicting the answer tokens (K,) and the answer ids (K,)."""
    m = batch.attention_mask[r].bool()
    ids = batch.input_ids[r][m].to(dev)
    s = int(batch.reasoning_start[r]) - int((~m).sum())
    K = int(batch.answer_len[r])
    first = ids.numel() - (batch.keep - int(batch.probe_start[r]))  # position predicting answer token 0
    return ids, s, int(batch.reasoning_len[r]), torch.arange(first, first + K, device=dev), batch.answer_ids[r, :K].to(dev)


def oar_p_naive(model, batch, probe: str = "answer_mean", mode: str = "batched", rows=None, positions=None,
                variants_per_forward: int = 32) -> dict:
    """OAR-P the way a user would write it from method.md section 3 with Hugging Face: mask each reasoning
    token with PAD, run ``model(input_ids).logits`` over the WHOLE context (full logits, every position),
    take log_softmax at the probe positions and the KL (or the clamped answer log-likelihood drop).

    ``mode="serial"``: one unpadded context per forward. ``mode="batched"``: ``variants_per_forward``
    masked copies of one rollout per forward. ``positions``: optional {row: list of reasoning indices} to
    score a subset (benchmarks extrapolate from it). Runs on the model's device (the batch may stay on the
    CPU). Returns {row: {reasoning index j: score}}.
    """
    out = {}
    rows = range(batch.batch_size) if rows is None else rows
    dev = next(model.parameters()).device
    with torch.no_grad():
        for r in rows:
            ids, s, L, cols, a_ids = _row_context(batch, r, dev)
            clean = _probe_stat(model(input_ids=ids[None]).logits[0], cols, a_ids, probe)
            js = list(range(L)) if positions is None else list(positions[r])
            scores = {}
            step = 1 if mode == "serial" else max(1, int(variants_per_forward))
            for k in range(0, len(js), step):
                chunk = js[k:k + step]
                masked = ids.repeat(len(chunk), 1)
                masked[torch.arange(len(chunk), device=dev), torch.tensor(chunk, device=dev) + s] = batch.pad_id
                logits = model(input_ids=masked).logits
                for i, j in enumerate(chunk):
                    pert = _probe_stat(logits[i], cols, a_ids, probe)
                    scores[j] = _divergence_of(clean, pert, probe)
            out[r] = scores
    return out


def oar_p_window_naive(model, batch, window: int, probe: str = "answer_mean", rows=None,
                       dtype: torch.dtype = torch.float64) -> dict:
    """Windowed OAR-P (:func:`oar.attribution.oar_p_window_scores`) written step by step with a Hugging Face
    cache and 2-D masks, one unpadded context and one masked token at a time: (1) the clean cache of the columns
    before the probe tail ``[0, tail)``, tail = min(end of reasoning, context length - keep); (2) token t as PAD and
    the ``window`` reasoning tokens after it (columns before ``tail``) on that cache, attending to columns < t
    only; (3) the tail on top, attending to every clean column except the re-run ones, and to the re-run ones.
    ``dtype``: precision of the divergence (float32 for a float32 model's rounding reference). Returns
    {row: {reasoning index j: score}}."""
    import copy
    import inspect

    from transformers import DynamicCache

    ckw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # transformers 5.x
    out = {}
    rows = range(batch.batch_size) if rows is None else rows
    dev = next(model.parameters()).device
    with torch.no_grad():
        for r in rows:
            ids, s, L, cols, a_ids = _row_context(batch, r, dev)
            n = ids.numel()
            clean = _probe_stat(model(input_ids=ids[None]).logits[0], cols, a_ids, probe, dtype)
            tail = min(s + L, n - batch.keep)
            base = DynamicCache(config=model.config)
            model(input_ids=ids[None, :tail], use_cache=True, **{ckw: base})
            scores = {}
            for j in range(L):
                t = s + j
                cache = copy.deepcopy(base)
                win = list(range(t, min(t + 1 + window, tail)))
                masked = ids.clone()
                masked[t] = batch.pad_id
                if win:
                    att = torch.ones(1, tail + len(win), dtype=torch.long, device=dev)
                    att[0, t:tail] = 0
                    model(input_ids=masked[None, win], attention_mask=att, use_cache=True,
                          position_ids=torch.tensor([win], device=dev), **{ckw: cache})
                att = torch.ones(1, tail + len(win) + n - tail, dtype=torch.long, device=dev)
                att[0, win] = 0  # the clean keys of the re-run columns
                logits = model(input_ids=masked[None, tail:], attention_mask=att, use_cache=True,
                               position_ids=torch.arange(tail, n, device=dev)[None], **{ckw: cache}).logits[0]
                full = torch.zeros(n, logits.shape[-1], dtype=logits.dtype, device=dev)
                full[tail:] = logits
                pert = _probe_stat(full, cols, a_ids, probe, dtype)
                scores[j] = _divergence_of(clean, pert, probe)
            out[r] = scores
    return out


# ==== end section: attribution ============================================================================
