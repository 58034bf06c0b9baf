"""The Hugging Face adapter of the probe-model interface (docs/architecture.md, layer 2): :class:`HFProbeModel`
wraps a transformers ``*ForCausalLM`` (transformers >= 5) as a :class:`~oar.attribution.model.ProbeModel` with both
optional capabilities (prefix cache, shared-prefix attention), and :func:`as_probe_model` is what every engine calls
on the model it is given. The protocols it implements are in ``oar.attribution.model``, the attention function it
registers for shared-prefix passes in ``oar.attribution.shared_prefix``, the float32 probe head in
``oar.attribution.probe_head``.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from oar.attribution.model import (
    DENSE_MASK_ATTENTION,
    FUSED_ATTENTION,
    NoisedEmbeddings,
    ProbeModel,
    WindowMasks,
    _type_name,
    probe_capabilities,
)
from oar.attribution.probe_head import _linear_float32
from oar.attribution.shared_prefix import (
    _FLEX_CUDA_MIN_HEAD_DIM,
    _SHARED_PREFIX,
    _SHARED_PREFIX_IMPL,
    _SHARED_PREFIX_MODEL_TYPES,
    _flex_attention_available,
    _register_shared_prefix_attention,
    _SharedPrefix,
)


class HFProbeModel:
    """:class:`ProbeModel` for a Hugging Face causal LM (transformers >= 5), with both optional capabilities.

    Uses ``model(..., logits_to_keep=keep, use_cache=False)`` so the LM head runs only on the probe window.
    ``eval_mode()`` switches off dropout for the duration of an attribution pass and restores the mode.
    For OAR-P's prefix engine it offers the clean key/value cache (:meth:`tail_logits_and_cache`), suffix
    passes on a copied prefix (:meth:`tail_logits_cached`) and, for Llama/Qwen2/Qwen3 models, suffix
    passes that read each row's prefix in place through a registered attention function
    (:meth:`tail_logits_shared_prefix`; switch off with ``shared_prefix_attention = False``). Sizes come from
    the model's (text) config, else from its embedding matrices.

    Memory estimates (:meth:`activation_bytes_per_token`, :meth:`kv_bytes_per_token`) describe the model as it runs
    when an engine plans: the element size is the autocast dtype's when autocast is on for the model's device type
    (``torch.is_autocast_enabled(device_type)``), else the parameters' (read at each call, so a model cast after
    wrapping is seen); the attention term follows ``config._attn_implementation`` (:attr:`attn_implementation`).
    Under FSDP2 mixed precision (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``) the parameters the wrapper
    holds may be float32 while every forward computes in bf16, without autocast: pass ``bytes_per_element=2``.

    Args:
        model: a ``PreTrainedModel`` with a causal-LM head (or a wrapper exposing the same forward).
        bytes_per_element: element size in bytes (int >= 1) of the activations and cache in memory estimates,
            overriding the autocast / parameter dtype; None (default) reads it from the model at planning time.

    Raises:
        TypeError: ``model`` has no ``get_input_embeddings`` (not a Hugging Face model) or no parameters.
        ValueError: ``bytes_per_element`` not None nor an int >= 1.
    """

    def __init__(self, model, bytes_per_element: int | None = None):
        if not callable(getattr(model, "get_input_embeddings", None)):
            raise TypeError(f"HFProbeModel needs a Hugging Face causal LM (with get_input_embeddings), got "
                            f"{_type_name(model)}; other models implement oar.attribution.ProbeModel "
                            f"(docs/models.md)")
        self.model = model
        cfg = getattr(model, "config", None)
        # Multimodal configs keep the language model's sizes in their text config.
        text_cfg = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
        self._text_config = text_cfg
        self.vocab_size = int(getattr(text_cfg, "vocab_size", 0) or model.get_output_embeddings().weight.shape[0])
        self.hidden_size = int(getattr(text_cfg, "hidden_size", 0) or model.get_input_embeddings().weight.shape[1])
        self.intermediate_size = int(getattr(text_cfg, "intermediate_size", 4 * self.hidden_size) or 4 * self.hidden_size)
        self.num_heads = int(getattr(text_cfg, "num_attention_heads", 1) or 1)
        self.num_layers = int(getattr(text_cfg, "num_hidden_layers", 1) or 1)
        param = next(model.parameters(), None)
        if param is None:
            raise TypeError(f"HFProbeModel needs a model with parameters, got {_type_name(model)} without any")
        self.device = param.device
        self.dtype = param.dtype
        if bytes_per_element is not None and (isinstance(bytes_per_element, bool) or not isinstance(
                bytes_per_element, int) or bytes_per_element < 1):
            raise ValueError(f"bytes_per_element must be None (read from the model) or an int >= 1, got "
                             f"{bytes_per_element!r}")
        #: The user's element size of activations and cache (None: autocast dtype, else parameter dtype).
        self.bytes_per_element = bytes_per_element

    def _param_element_size(self) -> int:
        param = next(self.model.parameters(), None)
        return param.element_size() if param is not None else torch.finfo(self.dtype).bits // 8

    def element_size(self) -> int:
        """Bytes of one activation element as the model computes now: ``bytes_per_element`` when given, else the
        autocast dtype's when autocast is on for the model's device type, else the parameters'."""
        if self.bytes_per_element is not None:
            return self.bytes_per_element
        dev = self.device.type
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev).itemsize
        return self._param_element_size()

    def cache_key_element_size(self) -> int:
        """Bytes of one cached key element (also the dtype windowed OAR-P builds its masks in). Under autocast the
        rotary embedding multiplies the keys by position tables of the parameters' dtype, so keys are cached at
        the wider of the two (float32 keys, bf16 values with float32 parameters under bf16 autocast: checked on
        Llama, transformers 5.24)."""
        if self.bytes_per_element is not None:
            return self.bytes_per_element
        if torch.is_autocast_enabled(self.device.type):
            return max(self.element_size(), self._param_element_size())
        return self._param_element_size()

    @property
    def attn_implementation(self) -> str | None:
        """The model's attention implementation (``config._attn_implementation`` of its text config, else of its
        config), None when it has none."""
        for cfg in (self._text_config, getattr(self.model, "config", None)):
            impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
            if isinstance(impl, str):
                return impl
        return None

    @property
    def supports_dense_mask(self) -> bool:
        """:meth:`tail_logits_cached` takes a 4-D float mask: the attention implementation is one of
        :data:`DENSE_MASK_ATTENTION` (or the model declares none)."""
        impl = self.attn_implementation
        return impl is None or impl in DENSE_MASK_ATTENTION

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    # ---- embeddings taken inside the root forward (OAR-G under FSDP / ZeRO-3: no call of the embedding alone) ----

    #: Every forward of this model runs the embedding module inside the root module's forward.
    supports_embedding_noise: bool = True

    @contextlib.contextmanager
    def noised_embeddings(self, perturb):
        """See :meth:`EmbeddingNoiseModel.noised_embeddings`. A forward hook on ``get_input_embeddings()``
        replaces its output; the hook is removed on exit. Raises RuntimeError when the context ends without
        exactly one forward having run under it."""
        rec = NoisedEmbeddings()
        calls = [0]

        def hook(module, args, output):
            calls[0] += 1
            if calls[0] > 1:
                raise RuntimeError("noised_embeddings: more than one forward under one context")
            rec.clean = output.detach()
            noised = perturb(rec.clean).detach()
            if torch.is_grad_enabled():
                noised.requires_grad_(True)
            rec.noised = noised
            return noised

        handle = self.model.get_input_embeddings().register_forward_hook(hook)
        try:
            yield rec
        finally:
            handle.remove()
        if calls[0] != 1:
            raise RuntimeError(f"noised_embeddings: expected one forward under the context, got {calls[0]}")

    #: Compute the probe logits (the LM head on the kept positions) in float32 whatever the compute dtype: under
    #: bf16 the logits' rounding (2^-8 of |z| ~ 0.05 at |z| ~ 10) is of the size of the small probe divergences OAR
    #: ranks tokens by (docs/design.md, "bf16: the probe logits in float32"). False: the model's own head.
    probe_logits_float32: bool = True

    @contextlib.contextmanager
    def _probe_head(self):
        """Within it, the model's output embedding (a ``torch.nn.Linear`` LM head) returns float32 logits from a
        float32 product (:func:`_linear_float32`); a no-op when the head is not a plain Linear. The product takes the head's weight and bias detached: probe calls are differentiated
        w.r.t. their input only, so no head-weight gradient is built even when the head is trainable (issue 41).
        With :attr:`probe_logits_float32` off the head keeps its own dtype but still runs as one 2-D product:
        transformers hands it a strided slice (``hidden[:, -keep:]``), which ``matmul`` turns into a ``bmm`` reading
        the whole (V, H) weight once per row when the weight does not require grad (a frozen model; issue 41,
        docs/design.md)."""
        head = self.model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear) or "forward" in head.__dict__:
            yield
            return
        if self.probe_logits_float32:
            head.forward = lambda x: _linear_float32(x, head.weight, head.bias)
        else:
            head.forward = lambda x: torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), head.weight,
                                                                head.bias).reshape(*x.shape[:-1], -1)
        try:
            yield
        finally:
            del head.forward

    def tail_logits(self, *, input_ids=None, inputs_embeds=None, attention_mask, position_ids, keep: int):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("tail_logits: pass exactly one of input_ids and inputs_embeds")
        with self._probe_head():
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
        text = self._text_config
        types = getattr(text, "layer_types", None)
        if types is not None and any(t != "full_attention" for t in types):
            return False
        return not getattr(text, "use_sliding_window", False)

    def kv_bytes_per_token(self) -> int:
        """Bytes of cached keys + values per token (all layers): layers x kv_heads x head_dim x (key + value
        element sizes, :meth:`cache_key_element_size` and :meth:`element_size`)."""
        return self.num_layers * self._kv_dim() * (self.cache_key_element_size() + self.element_size())

    def _kv_dim(self) -> int:
        """kv_heads x head_dim: the width of one layer's keys (or values) of one token."""
        text = self._text_config
        kv_heads = int(getattr(text, "num_key_value_heads", None) or self.num_heads)
        return kv_heads * self._head_dim()

    #: Set to False to make the engines' clean pass run every row's prompt (A/B benchmarks of the prompt-once
    #: clean pass, docs/design.md "Prompt-once clean pass").
    prompt_once_clean_pass: bool = True

    @property
    def supports_prefix_extend(self) -> bool:
        """:meth:`tail_logits_and_cache` takes ``prefix_kv`` (the engines' prompt-once clean pass): when
        :attr:`supports_prefix_cache` and :attr:`prompt_once_clean_pass`, for eager / sdpa attention only: its layout
        has a masked hole inside each row, which transformers' flash / flex paths were not tested with."""
        return bool(self.prompt_once_clean_pass) and self.supports_prefix_cache and self.supports_dense_mask

    def tail_logits_and_cache(self, *, input_ids, attention_mask, position_ids, keep: int, prefix_kv=None):
        """Like :meth:`tail_logits` on ids (B, S), also returning the key/value cache as a list of per-layer
        ``(keys, values)`` tensors of shape (B, kv_heads, S, head_dim). With ``prefix_kv`` (per-layer keys/values
        (B, kv_heads, P, head_dim)) the input runs on top of it, ``attention_mask`` covers (B, P + S) and the
        returned cache holds P + S columns."""
        from transformers import DynamicCache

        extra = {}
        if prefix_kv is not None and prefix_kv[0][0].shape[-2] > 0:
            extra[self._cache_kwarg] = DynamicCache(ddp_cache_data=[(k, v) for k, v in prefix_kv])
        with self._probe_head():
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             logits_to_keep=keep, use_cache=True, **extra)
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
        with self._probe_head():
            out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                             position_ids=position_ids, logits_to_keep=keep, use_cache=cache is not None,
                             **{self._cache_kwarg: cache})
        return out.logits[:, -keep:]

    # ---- shared-prefix attention (OAR-P suffix passes without copying the prefix or a dense mask) ---------

    #: Set to False to make the prefix engine use :meth:`tail_logits_cached` for every chunk.
    shared_prefix_attention: bool = True
    #: The kernel of :meth:`tail_logits_shared_prefix`: ``"auto"`` (PyTorch's CPU flash kernel on CPU,
    #: FlexAttention on CUDA, none on other devices), ``"flash_cpu"`` or ``"flex"`` (FlexAttention with one block mask over every row's
    #: prefix and every suffix: compiled on CUDA, PyTorch's unfused reference implementation on CPU, which tests it).
    shared_prefix_kernel: str = "auto"

    @property
    def supports_shared_prefix_attention(self) -> bool:
        """True when :meth:`tail_logits_shared_prefix` can run this model: a croppable cache
        (:attr:`supports_prefix_cache`), an architecture whose attention modules call the attention
        interface with plain causal semantics (Llama, Qwen2, Qwen3), a CPU model (the attention with
        log-sum-exp is PyTorch's CPU flash kernel) or a model on any device with FlexAttention (the kernel
        :attr:`shared_prefix_kernel`), and the switch :attr:`shared_prefix_attention` on."""
        if not self.shared_prefix_attention or not self.supports_prefix_cache:
            return False
        if getattr(self._text_config, "model_type", None) not in _SHARED_PREFIX_MODEL_TYPES:
            return False
        if self.shared_prefix_kernel == "auto" and self.device.type not in ("cpu", "cuda"):
            return False  # FlexAttention elsewhere (MPS, XPU) has not been checked: the cached path runs
        kernel = self._shared_prefix_kernel()
        if kernel == "flash_cpu":
            return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        if self.device.type == "cuda" and self._head_dim() < _FLEX_CUDA_MIN_HEAD_DIM:
            return False  # the compiled (Triton) FlexAttention kernel refuses it: the cached path runs
        return _flex_attention_available()

    def window_mask_bytes(self, slots: int, prefix_len: int) -> int:
        """Bytes per windowed OAR-P variant of the masks :meth:`tail_logits_shared_prefix` builds from a
        :class:`WindowMasks` of ``slots`` re-run columns over ``prefix_len`` clean columns (read by
        ``oar.attribution.planner.plan_window``). Kernel ``"flex"``: the closed form as it is (``slots`` int64 columns,
        four int64 bounds) plus its share of the block lists (int32 counts and orders, bool lists, the int64 sort:
        about 24 bytes per (query block, key block) pair of its own query blocks against its row's prefix and its own
        suffix; the pairs against other variants' keys grow with the chunk, about 24 x (N S / 128)^2 bytes: a few
        MB at thousands of variants, not counted). Kernel ``"flash_cpu"``: the two additive biases it expands to, in
        the cache's dtype, and the bool masks they come from, (bytes + 1) x slots x (prefix_len + slots)."""
        slots, prefix_len = int(slots), int(prefix_len)
        if slots < 1 or prefix_len < 0:
            raise ValueError(f"window_mask_bytes: slots must be >= 1 and prefix_len >= 0, got {slots} and {prefix_len}")
        if self._shared_prefix_kernel() == "flex":
            q_blocks = (slots + 127) // 128 + 1
            k_blocks = (prefix_len + 127) // 128 + (slots + 127) // 128 + 2
            return 8 * (slots + 4) + 24 * q_blocks * k_blocks
        return (int(self.cache_key_element_size()) + 1) * slots * (prefix_len + slots)

    def _head_dim(self) -> int:
        """Width of one attention head (``head_dim`` of the config, else hidden_size / heads)."""
        text = self._text_config
        return int(getattr(text, "head_dim", None) or self.hidden_size // max(self.num_heads, 1))

    def _shared_prefix_kernel(self) -> str:
        """The kernel :meth:`tail_logits_shared_prefix` runs (:attr:`shared_prefix_kernel` resolved)."""
        kernel = self.shared_prefix_kernel
        if kernel not in ("auto", "flash_cpu", "flex"):
            raise ValueError(f"shared_prefix_kernel must be 'auto', 'flash_cpu' or 'flex', got {kernel!r}")
        if kernel == "auto":
            return "flash_cpu" if self.device.type == "cpu" else "flex"
        if kernel == "flash_cpu" and self.device.type != "cpu":
            raise ValueError(f"shared_prefix_kernel 'flash_cpu' runs on CPU only; this model is on {self.device}: "
                             "use 'flex' or 'auto'")
        return kernel

    def tail_logits_shared_prefix(self, prefix_kv, groups, prefix_len: int, *, input_ids, position_ids, keep: int,
                                  prefix_bias: torch.Tensor | None = None, self_bias: torch.Tensor | None = None,
                                  window: WindowMasks | None = None):
        """Logits (N, keep, V) of the last ``keep`` positions of N suffixes (``input_ids`` (N, S), columns
        [prefix_len, prefix_len + S) of their contexts; ``position_ids`` (N, S)), each attending over the
        first ``prefix_len`` clean keys/values of its row plus its own suffix, causally.

        ``prefix_kv``: per layer (keys, values) of shape (R, kv_heads, >= prefix_len, head_dim), the clean
        cache of R rows, read in place (never copied per suffix). ``groups``: (slot, begin, end, pad) tuples:
        suffixes [begin, end) belong to cache row ``slot`` whose first ``pad`` columns are left padding
        (pad <= prefix_len); the groups must cover 0..N in order. Attention is computed in two exact parts
        merged by their log-sum-exp: the suffix queries of a row against its prefix (one call per row, its
        suffixes' queries stacked, no mask but the padding) and each suffix against itself (causal, so the
        kernel skips the upper triangle), or (kernel ``"flex"``, :attr:`shared_prefix_kernel`) in one
        FlexAttention call per layer whose block mask lets each suffix query see its row's prefix and its own
        suffix only (the used rows' prefixes are gathered once per layer and chunk, never per suffix). Equal to
        :meth:`tail_logits_cached` within float rounding (tested).
        Optional masks replace the padding mask and the causal one (windowed OAR-P): ``prefix_bias`` (N, S,
        prefix_len) and ``self_bias`` (N, 1, S, S), additive floats (0 = attend, dtype-min = not); every query must
        attend at least one key of the suffix part (e.g. itself). Or ``window`` (:class:`WindowMasks`, N
        variants, S slots): windowed OAR-P's masks in closed form, which the flex kernel reads as they are
        (O(N x S) instead of O(N x S x prefix_len)) and the CPU kernel expands to the two biases.
        Raises ValueError on groups that do not tile the batch or a pad beyond the prefix, masks of other shapes,
        or ``window`` together with a bias."""
        n = int(input_ids.shape[0])
        at = 0
        for slot, begin, end, pad in groups:
            if begin != at or end <= begin or not 0 <= pad <= prefix_len:
                raise ValueError(f"tail_logits_shared_prefix: groups must tile [0, {n}) in order with "
                                 f"0 <= pad <= prefix_len = {prefix_len}, got {(slot, begin, end, pad)} at {at}")
            at = end
        if at != n:
            raise ValueError(f"tail_logits_shared_prefix: groups cover [0, {at}), expected [0, {n})")
        S = int(input_ids.shape[1])
        for name, m, want in (("prefix_bias", prefix_bias, (n, S, int(prefix_len))), ("self_bias", self_bias, (n, 1, S, S))):
            if m is not None and tuple(m.shape) != want:
                raise ValueError(f"tail_logits_shared_prefix: {name} must have shape {want}, got {tuple(m.shape)}")
        kernel = self._shared_prefix_kernel()
        if window is not None:
            if prefix_bias is not None or self_bias is not None:
                raise ValueError("tail_logits_shared_prefix: pass window or the biases, not both")
            if tuple(window.cols.shape) != (n, S):
                raise ValueError(f"tail_logits_shared_prefix: window.cols must have shape {(n, S)}, got "
                                 f"{tuple(window.cols.shape)}")
            if kernel != "flex":  # the CPU kernel takes additive masks
                dt = prefix_kv[0][0].dtype
                low = torch.finfo(dt).min
                dev = input_ids.device
                prefix_bias = torch.zeros((n, S, int(prefix_len)), dtype=dt, device=dev).masked_fill_(
                    ~window.see_prefix(int(prefix_len)).to(dev), low)
                self_bias = torch.zeros((n, S, S), dtype=dt, device=dev).masked_fill_(~window.see_self().to(dev), low)
                self_bias = self_bias.unsqueeze(1)
                window = None
        _register_shared_prefix_attention()
        ctx = _SharedPrefix(prefix_kv, [(int(sl), int(b), int(e), int(pd)) for sl, b, e, pd in groups],
                            int(prefix_len), prefix_bias=prefix_bias, self_bias=self_bias, window=window,
                            kernel=kernel)
        cfg = self.model.config
        old = cfg._attn_implementation
        token = _SHARED_PREFIX.set(ctx)
        cfg._attn_implementation = _SHARED_PREFIX_IMPL
        try:
            with self._probe_head():
                out = self.model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=keep,
                                 use_cache=False)
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

        inner = getattr(self.model, "module", self.model)  # FSDP1 / DeepSpeed wrappers forward **kwargs
        params = inspect.signature(inner.forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    def _costs(self, width: int) -> dict:
        """The per-token terms (bytes) of the activation estimates over contexts of ``width`` keys, at
        :meth:`element_size` bytes per element (bpe), for :attr:`attn_implementation`:

        - ``shared``: tensors every layer reads, alive through the forward: the (B, 1, L, width) mask
          (eager: additive, bpe; sdpa: bool, 1 byte, built when rows are padded, plus the kernel's float copy,
          bpe; flash / flex: none, 2-D) and the rotary tables (2 x head_dim, parameter dtype);
        - ``layer``: one layer's forward peak on top: bpe x (3 H + 3 I) (residual stream, normed input, the
          MLP's three I-wide intermediates), the keys and values repeated to every head under grouped-query
          attention (eager, and sdpa with a mask: 2 x H x bpe), plus eager's scores, heads x width x (4 + bpe)
          (float32 softmax and its compute-dtype copy), or a fused kernel's float32 log-sum-exp (4 x heads);
        - ``saved``: what one layer keeps for the backward: bpe x (8 H + 4 I + 2 kv_dim) plus eager's softmaxed
          scores (heads x width x 4, + bpe below float32), or the log-sum-exp and sdpa's float mask (width x
          bpe);
        - ``attn_bwd``: eager's backward through the softmax (gradients of the probabilities and of the
          scores, 2 x heads x width x 4); 0 for fused kernels;
        - ``grads``: the gradient buffers flowing through a layer, bpe x 2 (H + I);
        - ``inputs``: one layer's input, bpe x H (what a checkpointed layer keeps).
        """
        bpe = self.element_size()
        H, I, kv, heads = self.hidden_size, self.intermediate_size, self._kv_dim(), self.num_heads
        head_dim = H // max(heads, 1)
        impl = self.attn_implementation
        rotary = 2 * head_dim * (self.bytes_per_element or self._param_element_size())
        repeat = 2 * heads * head_dim * bpe if kv < heads * head_dim else 0  # transformers' repeat_kv
        if impl in FUSED_ATTENTION:
            sdpa = impl == "sdpa"
            mask = width * (1 + bpe) if sdpa else 0
            scores = 4 * heads + (repeat if sdpa else 0)
            scores_saved, attn_bwd = 4 * heads + (width * bpe if sdpa else 0), 0
        else:  # eager, and names we do not know (conservatively)
            mask = width * bpe
            scores = heads * width * (4 + bpe) + repeat
            scores_saved = heads * width * (4 if bpe == 4 else 4 + bpe)
            attn_bwd = 2 * heads * width * 4
        return dict(shared=mask + rotary, layer=bpe * (3 * H + 3 * I) + scores,
                    saved=bpe * (8 * H + 4 * I + 2 * kv) + scores_saved, attn_bwd=attn_bwd,
                    grads=bpe * 2 * (H + I), inputs=bpe * H)

    def activation_bytes_per_token(self, width: int, backward: bool = False) -> int:
        """Peak activation bytes one context token costs in a forward over contexts of ``width`` keys (terms:
        :meth:`_costs`): ``shared + layer`` (layers run one after the other); with ``backward`` (w.r.t. the
        input embeddings, every layer's tensors kept): ``shared + layers x saved + layer + grads``. The element
        size is :meth:`element_size` (autocast / parameters / ``bytes_per_element``); the attention term follows
        :attr:`attn_implementation` (eager and unknown names: heads x width terms; sdpa / flash / flex: none but
        sdpa's bool mask). Measured on CPU with float32 Llama at width 2091
        (tests/python/attribution/test_memory_budget.py): at most 15 % above the measured peaks, never below."""
        c = self._costs(int(width))
        if not backward:
            return int(c["shared"] + c["layer"])
        return int(c["shared"] + self.num_layers * c["saved"] + c["layer"] + c["grads"])

    # ---- activation checkpointing (OAR-G on rows too long for the budget) -------------------------------------

    @property
    def supports_activation_checkpointing(self) -> bool:
        """:meth:`activation_checkpointing` works: the model's decoder layers are transformers'
        ``GradientCheckpointingLayer`` modules (every decoder of transformers 5)."""
        return bool(self._decoder_layers())

    def _decoder_layers(self) -> list:
        try:
            from transformers.modeling_layers import GradientCheckpointingLayer
        except ImportError:  # pragma: no cover - older transformers
            return []
        return [m for m in self.model.modules() if isinstance(m, GradientCheckpointingLayer)]

    @contextlib.contextmanager
    def activation_checkpointing(self):
        """See :meth:`CheckpointModel.activation_checkpointing`. Each decoder layer's ``forward`` is replaced, for
        the duration of the context, by a non-reentrant ``torch.utils.checkpoint`` of itself (module hooks, such
        as FSDP2's gathers, stay outside the checkpoint, as in transformers' own gradient checkpointing, which
        only runs in training mode). A layer that appends to a key/value cache (OAR-G's prompt-once passes) gets
        its cache layer put back to what it held before the layer ran when the backward replays it, so the
        replay attends over the same keys."""
        from torch.utils.checkpoint import checkpoint

        layers = self._decoder_layers()
        for k, layer in enumerate(layers):
            idx = getattr(getattr(layer, "self_attn", None), "layer_idx", k)
            layer.forward = functools.partial(_checkpointed_layer, layer.forward, idx, checkpoint)
        try:
            yield
        finally:
            for layer in layers:
                layer.__dict__.pop("forward", None)

    def checkpointed_activation_bytes_per_token(self, width: int) -> int:
        """:meth:`activation_bytes_per_token` (``backward=True``) under :meth:`activation_checkpointing`: every
        layer's input (layers x bpe x H) and the shared tensors, plus the larger of one layer's forward peak and
        one replayed layer's saved tensors with its backward transients (``saved + attn_bwd + grads``, terms of
        :meth:`_costs`)."""
        c = self._costs(int(width))
        return int(c["shared"] + self.num_layers * c["inputs"]
                   + max(c["layer"], c["saved"] + c["attn_bwd"] + c["grads"]))

    @contextlib.contextmanager
    def eval_mode(self):
        """Switches the wrapped model to ``eval()`` (dropout off) and back to training mode on exit if it was
        training."""
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            if was_training:
                self.model.train()


def _checkpointed_layer(forward, layer_idx: int, checkpoint, *args, **kwargs):
    """One decoder layer call under a non-reentrant checkpoint. The replay in the backward would append the layer's
    keys/values to the cache a second time: it first puts the cache layer back to its state before this call."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layer = cache.layers[layer_idx] if cache is not None and hasattr(cache, "layers") else None
    before = (layer.keys, layer.values, layer.is_initialized) if layer is not None and layer.is_initialized else None

    def run(*a, **kw):
        if layer is not None:
            if before is None:
                layer.keys = layer.values = None
                layer.is_initialized = False
            else:
                layer.keys, layer.values, layer.is_initialized = before
        return forward(*a, **kw)

    return checkpoint(run, *args, use_reentrant=False, **kwargs)


def as_probe_model(model) -> ProbeModel:
    """The :class:`ProbeModel` the engines run: a ``torch.nn.Module`` without ``tail_logits`` (a Hugging Face
    causal LM) wrapped in :class:`HFProbeModel`; anything else returned as it is, once checked by
    :func:`probe_capabilities`.

    Raises:
        TypeError: a model that is neither: one message naming every :class:`ProbeModel` member it lacks (or a
            module without ``get_input_embeddings``), before any engine runs.
    """
    if isinstance(model, torch.nn.Module) and not hasattr(model, "tail_logits"):
        return HFProbeModel(model)
    probe_capabilities(model)
    return model


