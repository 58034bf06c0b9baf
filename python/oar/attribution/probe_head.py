"""The probe head in float32 (docs/design.md, "bf16: the probe logits in float32"): the model's LM head applied to the
probe window as float32 logits whatever the model's dtype, differentiable in its input only (OAR-G's gradient w.r.t.
the embeddings), without a float32 copy of a bf16 head on CUDA. Installed by
:class:`oar.attribution.hf_model.HFProbeModel` around its probe passes; its memory is counted by
:func:`oar.attribution.planner.plan_masked`.
"""

from __future__ import annotations

import torch


#: Rows of the LM head weight upcast at a time when a float32 product needs a float32 copy (CPU, float16 on CUDA).
_HEAD_CHUNK_ROWS = 16384


def _mm_float32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (both bf16 or both fp16) as float32: one ``mm`` with float32 output on CUDA; elsewhere (where
    ``mm.dtype`` has no kernel: CPU) the float32 product of the upcast operands, the same value up to float32
    accumulation order."""
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class _MmFloat32Out(torch.autograd.Function):
    """``x2 @ weight.T`` as float32 logits from bf16 / fp16 operands (x2 (n, H), weight (V, H), same dtype), with
    a backward: PyTorch's ``mm(..., out_dtype=float32)`` has none ("derivative for aten::mm is not implemented",
    OAR-G on the H200, docs/gpu.md). The incoming float32 gradient is rounded to the operands' dtype, as the
    model's own bf16 / fp16 backward would hold it, and the products accumulate in float32:
    d x2 = g @ weight, d weight = g.T @ x2, each rounded once to its operand's dtype. ``ctx.needs_input_grad`` is
    fixed when the forward runs (whether ``weight`` requires grad), not by what ``torch.autograd.grad`` asks for,
    so a caller that never wants d weight passes ``weight.detach()`` (:func:`_linear_float32` does: the probe
    head), else every backward computes and drops a (V, H) product (issue 41)."""

    @staticmethod
    def forward(ctx, x2, weight):
        ctx.save_for_backward(x2, weight)
        return _mm_float32_out(x2, weight.t())

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        g = grad.to(weight.dtype)
        gx = _mm_float32_out(g, weight).to(x2.dtype) if ctx.needs_input_grad[0] else None
        gw = _mm_float32_out(g.t(), x2).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw


def _linear_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` as float32 logits, outside autocast, differentiable in ``x`` only: the plain product
    when both are float32; on CUDA with bf16 / fp16 weights one ``mm`` with float32 output (tensor cores, float32
    accumulation, no weight copy); otherwise the weight upcast :data:`_HEAD_CHUNK_ROWS` rows at a time.

    ``weight`` and ``bias`` are detached (issue 41): the probe head is only ever differentiated w.r.t. its input
    (OAR-G's ``torch.autograd.grad`` w.r.t. the embeddings; parameters' ``.grad`` are never written), and with a
    trainable head :class:`_MmFloat32Out` would otherwise compute and drop d weight, (V, H) in float32 plus its
    rounded copy, in every backward (about 1.4 GB at vocabulary 151936 x hidden 1536). The gradient w.r.t. ``x``
    is the same. What the head keeps for the backward (counted by :func:`oar.attribution.planner.plan_masked`):
    ``x`` and the weight itself on the CUDA path; on the upcast path the float32 weight copy, V x H x 4 bytes
    (the chunks are saved by their products for d x), only for a ``weight`` that is not float32."""
    dev = x.device.type
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    with torch.autocast(dev, enabled=False):
        # one 2-D product: transformers hands the head a strided slice (hidden[:, -keep:]), which matmul folds only
        # when the weight requires grad; with the detached weight it expands the weight per batch row into a bmm of
        # keep-row products, each reading the whole (V, H) weight (issue 41: 59 % of windowed OAR-P's CPU time at 4
        # layers of SmolLM2-135M's shape)
        x2 = x.reshape(-1, x.shape[-1])
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return torch.nn.functional.linear(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
        if dev == "cuda" and weight.dtype in (torch.bfloat16, torch.float16):
            out = _MmFloat32Out.apply(x2.to(weight.dtype), weight)
        else:
            xf = x2.float()
            out = torch.cat([xf @ weight[v:v + _HEAD_CHUNK_ROWS].float().t()
                             for v in range(0, weight.shape[0], _HEAD_CHUNK_ROWS)], dim=-1)
        if bias is not None:
            out = out + bias.float()
        return out.reshape(*x.shape[:-1], weight.shape[0])


