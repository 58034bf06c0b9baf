"""The small interface through which attribution engines reach a model (docs/architecture.md, layer 2).

An engine needs three things from a causal LM: the input embeddings of ids, and the logits of the last
``keep`` positions given ids or embeddings (with an attention mask and explicit position ids, because
probe batches are left-padded). :class:`ProbeModel` is that interface; :class:`HFProbeModel` implements it
for Hugging Face ``*ForCausalLM`` models (also when wrapped by DDP/FSDP/DeepSpeed/PEFT: pass the module
whose ``forward`` accepts ``logits_to_keep``). C++ users implement the same three calls for their module.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch


class ProbeModel(Protocol):
    """What the OAR-P / OAR-G engines call. All tensors on the model's device."""

    vocab_size: int
    hidden_size: int

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) int64 -> (B, T, H) input embeddings (model dtype)."""

    def tail_logits(self, *, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                    attention_mask: torch.Tensor, position_ids: torch.Tensor, keep: int) -> torch.Tensor:
        """Logits (B, keep, V) of the last ``keep`` positions; exactly one of input_ids / inputs_embeds."""


class HFProbeModel:
    """:class:`ProbeModel` for a Hugging Face causal LM (transformers >= 5).

    Uses ``model(..., logits_to_keep=keep, use_cache=False)`` so the LM head runs only on the probe window.
    ``eval_mode()`` switches off dropout for the duration of an attribution pass and restores the mode.
    For OAR-P's prefix engine it offers the clean key/value cache (:meth:`tail_logits_and_cache`), suffix
    passes on a copied prefix (:meth:`tail_logits_cached`) and, for CPU Llama/Qwen2/Qwen3 models, suffix
    passes that read each row's prefix in place through a registered attention function
    (:meth:`tail_logits_shared_prefix`; switch off with ``shared_prefix_attention = False``).

    Args:
        model: a ``PreTrainedModel`` with a causal-LM head (or a wrapper exposing the same forward).
        bytes_per_element: override of the activation element size used in memory estimates.
    """

    def __init__(self, model, bytes_per_element: int | None = None):
        self.model = model
        cfg = getattr(model, "config", None)
        text_cfg = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
        self.vocab_size = int(getattr(text_cfg, "vocab_size", 0) or model.get_output_embeddings().weight.shape[0])
        self.hidden_size = int(getattr(text_cfg, "hidden_size", 0) or model.get_input_embeddings().weight.shape[1])
        self.intermediate_size = int(getattr(text_cfg, "intermediate_size", 4 * self.hidden_size) or 4 * self.hidden_size)
        self.num_heads = int(getattr(text_cfg, "num_attention_heads", 1) or 1)
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.bytes_per_element = bytes_per_element or param.element_size()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    def tail_logits(self, *, input_ids=None, inputs_embeds=None, attention_mask, position_ids, keep: int):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("tail_logits: pass exactly one of input_ids and inputs_embeds")
        out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                         position_ids=position_ids, logits_to_keep=keep, use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[:, -keep:]

    # ---- prefix key/value cache (OAR-P: a masked variant shares the clean prefix before its token) ----------

    @property
    def supports_prefix_cache(self) -> bool:
        """True for models whose every layer is full causal attention with a plain dynamic cache (Llama,
        Qwen2, Mistral without sliding window, ...). Sliding-window, hybrid and recurrent layers are not
        croppable per variant, so the engines fall back to batched masking for them."""
        cfg = getattr(self.model, "config", None)
        text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
        types = getattr(text, "layer_types", None)
        if types is not None and any(t != "full_attention" for t in types):
            return False
        return not getattr(text, "use_sliding_window", False)

    def kv_bytes_per_token(self) -> int:
        """Bytes of cached keys + values per token (all layers)."""
        cfg = getattr(self.model, "config", None)
        text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
        layers = int(getattr(text, "num_hidden_layers", 1) or 1)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or self.num_heads)
        head_dim = int(getattr(text, "head_dim", None) or self.hidden_size // max(self.num_heads, 1))
        return 2 * layers * kv_heads * head_dim * self.bytes_per_element

    def tail_logits_and_cache(self, *, input_ids, attention_mask, position_ids, keep: int):
        """Like :meth:`tail_logits` on ids, also returning the key/value cache as a list of per-layer
        ``(keys, values)`` tensors of shape (B, kv_heads, T, head_dim)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         logits_to_keep=keep, use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)  # renamed in transformers 5.x
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        return out.logits[:, -keep:], kv

    def tail_logits_cached(self, prefix_kv, *, input_ids=None, inputs_embeds=None, attention_mask, position_ids,
                           keep: int):
        """Logits (B, keep, V) of the last ``keep`` positions of the input (``input_ids`` (B, S) or
        ``inputs_embeds`` (B, S, H), exactly one) run on top of ``prefix_kv`` (per-layer (keys, values) of the
        first P columns; None or P = 0 for no prefix). ``attention_mask`` covers prefix + input (B, P + S);
        ``position_ids`` the input only (B, S). Differentiable w.r.t. ``inputs_embeds`` (OAR-G's suffix pass);
        the prefix cache is a constant."""
        from transformers import DynamicCache

        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("tail_logits_cached: pass exactly one of input_ids and inputs_embeds")
        cache = None
        if prefix_kv is not None and prefix_kv[0][0].shape[-2] > 0:
            cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in prefix_kv])
        out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                         position_ids=position_ids, logits_to_keep=keep, use_cache=cache is not None,
                         **{self._cache_kwarg: cache})
        return out.logits[:, -keep:]

    # ---- shared-prefix attention (OAR-P suffix passes without copying the prefix or a dense mask) ---------

    #: Set to False to make the prefix engine use :meth:`tail_logits_cached` for every chunk.
    shared_prefix_attention: bool = True

    @property
    def supports_shared_prefix_attention(self) -> bool:
        """True when :meth:`tail_logits_shared_prefix` can run this model: a croppable cache
        (:attr:`supports_prefix_cache`), an architecture whose attention modules call the attention
        interface with plain causal semantics (Llama, Qwen2, Qwen3), a CPU model (the attention with
        log-sum-exp is PyTorch's CPU flash kernel; on GPUs the engine keeps the cached path) and the switch
        :attr:`shared_prefix_attention` on."""
        if not self.shared_prefix_attention or not self.supports_prefix_cache or self.device.type != "cpu":
            return False
        if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
            return False
        cfg = getattr(self.model, "config", None)
        text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
        return getattr(text, "model_type", None) in _SHARED_PREFIX_MODEL_TYPES

    def tail_logits_shared_prefix(self, prefix_kv, groups, prefix_len: int, *, input_ids, position_ids, keep: int):
        """Logits (N, keep, V) of the last ``keep`` positions of N suffixes (``input_ids`` (N, S), columns
        [prefix_len, prefix_len + S) of their contexts; ``position_ids`` (N, S)), each attending over the
        first ``prefix_len`` clean keys/values of its row plus its own suffix, causally.

        ``prefix_kv``: per layer (keys, values) of shape (R, kv_heads, >= prefix_len, head_dim), the clean
        cache of R rows, read in place (never copied per suffix). ``groups``: (slot, begin, end, pad) tuples:
        suffixes [begin, end) belong to cache row ``slot`` whose first ``pad`` columns are left padding
        (pad <= prefix_len); the groups must cover 0..N in order. Attention is computed in two exact parts
        merged by their log-sum-exp: the suffix queries of a row against its prefix (one call per row, its
        suffixes' queries stacked, no mask but the padding) and each suffix against itself (causal, so the
        kernel skips the upper triangle). Equal to :meth:`tail_logits_cached` within float rounding (tested).
        Raises ValueError on groups that do not tile the batch or a pad beyond the prefix."""
        n = int(input_ids.shape[0])
        at = 0
        for slot, begin, end, pad in groups:
            if begin != at or end <= begin or not 0 <= pad <= prefix_len:
                raise ValueError(f"tail_logits_shared_prefix: groups must tile [0, {n}) in order with "
                                 f"0 <= pad <= prefix_len = {prefix_len}, got {(slot, begin, end, pad)} at {at}")
            at = end
        if at != n:
            raise ValueError(f"tail_logits_shared_prefix: groups cover [0, {at}), expected [0, {n})")
        _register_shared_prefix_attention()
        ctx = _SharedPrefix(prefix_kv, [(int(sl), int(b), int(e), int(pd)) for sl, b, e, pd in groups],
                            int(prefix_len))
        cfg = self.model.config
        old = cfg._attn_implementation
        token = _SHARED_PREFIX.set(ctx)
        cfg._attn_implementation = _SHARED_PREFIX_IMPL
        try:
            out = self.model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=keep, use_cache=False)
        finally:
            cfg._attn_implementation = old
            _SHARED_PREFIX.reset(token)
        return out.logits[:, -keep:]

    @property
    def supports_prefix_grad(self) -> bool:
        """OAR-G may run the clean prompt prefix once without grad and differentiate only the suffix
        (same condition as :attr:`supports_prefix_cache`)."""
        return self.supports_prefix_cache

    @property
    def _cache_kwarg(self) -> str:
        # transformers 5.x renames forward(past_key_values=...) to forward(cache=...) (deprecated until 5.40).
        import inspect

        params = inspect.signature(self.model.forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    def full_logits(self, *, input_ids, attention_mask, position_ids):
        """Logits (B, T, V) of every position (used by the entropy baseline)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False)
        return out.logits if hasattr(out, "logits") else out[0]

    def activation_bytes_per_token(self, width: int, backward: bool = False) -> int:
        """Rough peak activation bytes one context token costs in a forward (x3 with backward): residual
        stream and MLP intermediates of one layer plus attention scores over ``width`` keys."""
        per = self.bytes_per_element * (4 * self.hidden_size + 2 * self.intermediate_size) + 4 * self.num_heads * width
        if backward:
            layers = int(getattr(getattr(self.model, "config", None), "num_hidden_layers", 1) or 1)
            per = per * layers + per * 2
        return int(per)

    @contextlib.contextmanager
    def eval_mode(self):
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            if was_training:
                self.model.train()


# ---- the shared-prefix attention function (registered with transformers' attention interface) ----------------

_SHARED_PREFIX_IMPL = "oar_shared_prefix"
_SHARED_PREFIX_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})


@dataclass
class _SharedPrefix:
    kv: list  # per layer (keys, values): (R, kv_heads, >= p, head_dim)
    groups: list  # (slot, begin, end, pad)
    p: int
    bias: dict = field(default_factory=dict)  # pad -> additive (1, 1, 1, p) mask, built once per call


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
    # Under CPU autocast (e.g. a trainer's bf16 mixed precision) the rotary embedding leaves queries and keys
    # in float32 and values in bf16; SDPA's autocast rule runs attention in the autocast dtype, the private
    # kernel needs one dtype: use the same one.
    dt = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    query, key, value = query.to(dt), key.to(dt), value.to(dt)
    N, H, S, D = query.shape
    rep = H // key.shape[1]
    if rep > 1:  # grouped-query attention: query head h reads kv head h // rep
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    out_s, lse_s = _flash_cpu(query, key, value, True, None, scaling)
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
        if pad > 0:
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


def _no_mask(*args, **kwargs):
    """Mask function of the shared-prefix attention: it builds its own (padding of the prefix only)."""
    return None


@functools.cache
def _register_shared_prefix_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(_SHARED_PREFIX_IMPL, _shared_prefix_attention)
    AttentionMaskInterface.register(_SHARED_PREFIX_IMPL, _no_mask)


def as_probe_model(model) -> ProbeModel:
    """Returns ``model`` if it already implements :class:`ProbeModel`, else wraps it in :class:`HFProbeModel`."""
    if hasattr(model, "tail_logits") and hasattr(model, "embed"):
        return model
    return HFProbeModel(model)


def gather_probe_logits(window: torch.Tensor, probe_start: torch.Tensor, k_max: int) -> torch.Tensor:
    """Selects (N, K_max, V) probe logits from tail windows (N, keep, V): row n takes positions
    ``probe_start[n] + k`` (clamped to the window; positions past a row's answer length are ignored by the
    probe ops through ``lengths``)."""
    keep = window.shape[1]
    idx = (probe_start.to(window.device).view(-1, 1) + torch.arange(k_max, device=window.device).view(1, -1))
    idx = idx.clamp_max(keep - 1)
    return window.gather(1, idx.unsqueeze(-1).expand(-1, -1, window.shape[-1]))
