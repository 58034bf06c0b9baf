"""The interface through which the attribution engines reach a model (docs/architecture.md, layer 2;
docs/models.md shows a model implementing it).

:class:`ProbeModel` is what every engine needs from a causal LM: the input embeddings of ids, the logits of the
last ``keep`` positions given ids or embeddings (with an attention mask and explicit position ids, because probe
batches are left-padded), the memory cost the chunk planners budget with, and an evaluation mode. Two optional
capabilities let the OAR-P prefix engine and OAR-G's prompt-once path skip work:

- :class:`PrefixCacheModel`: a clean key/value cache and suffix passes on top of it (declared by
  ``supports_prefix_cache``);
- :class:`SharedPrefixModel`: suffix passes that read each row's cached prefix in place (declared by
  ``supports_shared_prefix_attention``).

:func:`probe_capabilities` checks a model once per engine call (one ``TypeError`` naming every missing member)
and returns what it supports as a :class:`ProbeCapabilities`; the engines read nothing else.
:class:`HFProbeModel` implements all three for Hugging Face ``*ForCausalLM`` models (also when wrapped by
DDP/FSDP/DeepSpeed/PEFT: pass the module whose ``forward`` accepts ``logits_to_keep``). C++ trainers implement
``oar::ProbeModel`` (``include/oar/torch/engine.h``), the same interface without the optional capabilities.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import operator
import warnings
from dataclasses import dataclass, field
from typing import ContextManager, Protocol, runtime_checkable

import torch


@runtime_checkable
class ProbeModel(Protocol):
    """What the OAR-P / OAR-G / entropy engines call. All tensors on :attr:`device`.

    Attributes:
        vocab_size: V, the last dimension of the logits (int >= 1); token ids of a probe batch must lie in
            [0, V).
        hidden_size: H, the last dimension of :meth:`embed` (int >= 1).
        device: the ``torch.device`` the engines put inputs on.
    """

    vocab_size: int
    hidden_size: int
    device: torch.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) int64 -> (B, T, H) input embeddings (model dtype). Called without grad."""

    def tail_logits(self, *, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                    attention_mask: torch.Tensor, position_ids: torch.Tensor, keep: int) -> torch.Tensor:
        """Logits (B, keep, V) (any float dtype) of the last ``keep`` positions; exactly one of ``input_ids``
        (B, T) int64 / ``inputs_embeds`` (B, T, H); ``attention_mask`` (B, T) int64, 0 on left padding;
        ``position_ids`` (B, T) int64. Must be differentiable w.r.t. ``inputs_embeds`` (OAR-G) and must not
        write parameter ``.grad``."""

    def activation_bytes_per_token(self, width: int, backward: bool = False) -> int:
        """Peak activation bytes (int >= 0) one context token costs in a forward over contexts of ``width``
        tokens, at the precision the model computes in when the engine plans (forward + backward w.r.t. the
        input embeddings when ``backward``): the chunk planners keep ``tokens x this + variants x 8 x keep x
        vocab_size`` under the memory budget (``oar.attribution.planner``). An estimate is enough; too small
        risks running out of memory, too large runs more, smaller chunks."""

    def eval_mode(self) -> ContextManager:
        """A context manager under which the model runs deterministically (dropout off), restoring the previous
        mode on exit. ``contextlib.nullcontext()`` for a model without dropout."""


@runtime_checkable
class PrefixCacheModel(ProbeModel, Protocol):
    """Optional capability: a croppable key/value cache (OAR-P's prefix engine, OAR-G's prompt-once path).

    Declared by ``supports_prefix_cache``; a model that declares it must have every member below (else
    :func:`probe_capabilities` raises). The flag may depend on the model (e.g. False for sliding-window or
    recurrent layers); when it is False the engines never call the members below.

    Attributes:
        supports_prefix_cache: the members below work for this model.
        supports_prefix_grad: :meth:`tail_logits_cached` may be differentiated w.r.t. ``inputs_embeds`` (OAR-G
            then runs the prompt once without grad and differentiates the suffix only).
    """

    supports_prefix_cache: bool
    supports_prefix_grad: bool

    def kv_bytes_per_token(self) -> int:
        """Bytes of cached keys + values per token (all layers), in the dtype the cache is written in."""

    def tail_logits_and_cache(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              position_ids: torch.Tensor, keep: int) -> tuple[torch.Tensor, list]:
        """:meth:`tail_logits` on ids, plus the key/value cache: a list of per-layer ``(keys, values)`` of shape
        (B, kv_heads, T, head_dim). A model that also sets ``supports_prefix_extend = True`` takes
        ``prefix_kv=`` (per-layer keys/values of P columns, as for :meth:`tail_logits_cached`; ``attention_mask``
        then (B, P + T)) and returns the cache of prefix + input, (B, kv_heads, P + T, head_dim): the engines'
        prompt-once clean pass (docs/design.md, "Prompt-once clean pass")."""

    def tail_logits_cached(self, prefix_kv: list, *, input_ids: torch.Tensor | None = None,
                           inputs_embeds: torch.Tensor | None = None, attention_mask: torch.Tensor,
                           position_ids: torch.Tensor, keep: int) -> torch.Tensor:
        """Logits (B, keep, V) of the last ``keep`` positions of an input (B, S) run on top of ``prefix_kv``
        (per-layer keys/values of the first P columns); ``attention_mask`` (B, P + S), ``position_ids`` (B, S)."""


@runtime_checkable
class SharedPrefixModel(PrefixCacheModel, Protocol):
    """Optional capability on top of :class:`PrefixCacheModel`: suffix passes that read each row's clean prefix
    in place (no per-variant copy, no dense mask). Declared by ``supports_shared_prefix_attention``."""

    supports_shared_prefix_attention: bool

    def tail_logits_shared_prefix(self, prefix_kv: list, groups, prefix_len: int, *, input_ids: torch.Tensor,
                                  position_ids: torch.Tensor, keep: int, prefix_bias: torch.Tensor | None = None,
                                  self_bias: torch.Tensor | None = None,
                                  window: "WindowMasks | None" = None) -> torch.Tensor:
        """See :meth:`HFProbeModel.tail_logits_shared_prefix` (the masks: windowed OAR-P)."""


class NoisedEmbeddings:
    """What :meth:`EmbeddingNoiseModel.noised_embeddings` records of the one forward run under it.

    Attributes:
        clean: (B, T, H) the embedding module's output, detached (None until the forward ran).
        noised: (B, T, H) ``perturb(clean)``, a leaf that requires grad when grad is enabled: the tensor the rest
            of the forward ran on, to differentiate the logits with respect to.
    """

    __slots__ = ("clean", "noised")

    def __init__(self):
        self.clean = None
        self.noised = None


@runtime_checkable
class EmbeddingNoiseModel(ProbeModel, Protocol):
    """Optional capability: the input embeddings of a forward on ids are taken inside that forward, perturbed and
    made differentiable there (OAR-G without a separate :meth:`ProbeModel.embed` call).

    Under FSDP, DeepSpeed ZeRO-3 and other wrappers that gather parameters in the root module's forward, calling
    the embedding module on its own sees sharded weights (FSDP1: "'weight' must be 2-D"; FSDP2: DTensor
    parameters; ZeRO-3: a gather of its own). With this capability every model call of OAR-G is a root forward on
    ids. Declared by ``supports_embedding_noise``.
    """

    supports_embedding_noise: bool

    def noised_embeddings(self, perturb) -> ContextManager[NoisedEmbeddings]:
        """A context under which exactly one forward (:meth:`ProbeModel.tail_logits` or
        :meth:`PrefixCacheModel.tail_logits_cached` on ``input_ids``) runs with its input embeddings E (B, T, H)
        replaced by ``perturb(E.detach())``, made a leaf that requires grad (when grad is enabled); yields the
        :class:`NoisedEmbeddings` record of that forward."""


@runtime_checkable
class CheckpointModel(ProbeModel, Protocol):
    """Optional capability: activation checkpointing of the model's layers for one forward + backward w.r.t. the
    input embeddings (OAR-G on a row too long for the budget). Declared by ``supports_activation_checkpointing``."""

    supports_activation_checkpointing: bool

    def activation_checkpointing(self) -> ContextManager:
        """A context under which forwards with grad keep only each layer's input and recompute the layer in the
        backward (same gradients within float rounding); no parameter ``.grad`` is written; the model's
        ``training`` flag is unchanged (dropout stays off)."""

    def checkpointed_activation_bytes_per_token(self, width: int) -> int:
        """:meth:`ProbeModel.activation_bytes_per_token` with ``backward=True`` under
        :meth:`activation_checkpointing`."""


def _own_members(proto) -> tuple[str, ...]:
    """Members a protocol class declares itself (annotations, then methods, in definition order)."""
    names = list(proto.__dict__.get("__annotations__", {}))
    names += [n for n, v in proto.__dict__.items() if callable(v) and not n.startswith("_")]
    return tuple(names)


#: Members every model must have, and those of each optional capability (in definition order).
PROBE_MODEL_MEMBERS = _own_members(ProbeModel)
PREFIX_CACHE_MEMBERS = _own_members(PrefixCacheModel)
SHARED_PREFIX_MEMBERS = _own_members(SharedPrefixModel)
EMBEDDING_NOISE_MEMBERS = _own_members(EmbeddingNoiseModel)
CHECKPOINT_MEMBERS = _own_members(CheckpointModel)
#: Optional flags of :class:`PrefixCacheModel` (absent = False; no members of their own): ``supports_prefix_extend``.
PREFIX_CACHE_FLAGS = ("supports_prefix_extend",)
#: Optional members that describe how the model runs attention (read by the engines' checks and the planner; no
#: model call): the attention implementation, whether it takes 4-D masks, the cached keys' element size.
ATTENTION_MEMBERS = ("attn_implementation", "supports_dense_mask", "cache_key_element_size", "window_mask_bytes")

#: Attention implementations of Hugging Face models that take a 4-D float attention mask as given (windowed
#: OAR-P's cached path). transformers' flash-attention paths read 2-D padding masks only (a 4-D one fails or
#: attends wrongly); flex_attention takes it in principle but crashed the process on CPU (torch 2.14,
#: transformers 5.24: "corrupted double-linked list"); a registered custom function may do anything with it.
DENSE_MASK_ATTENTION = ("eager", "sdpa")
#: Attention implementations that never materialise the (heads, L, width) scores: fused kernels with a block
#: workspace (the activation cost has no heads x width term for them). "eager" and unknown names do.
FUSED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "oar_shared_prefix")


@dataclass(frozen=True)
class ProbeCapabilities:
    """What a checked :class:`ProbeModel` supports beyond the required members (see :func:`probe_capabilities`).

    Attributes:
        prefix_cache: :class:`PrefixCacheModel` members usable (OAR-P ``engine="prefix"``).
        prefix_grad: OAR-G may differentiate :meth:`PrefixCacheModel.tail_logits_cached`.
        prefix_extend: :meth:`PrefixCacheModel.tail_logits_and_cache` takes ``prefix_kv`` (flag
            ``supports_prefix_extend``): the prompt-once clean pass of the OAR-P engines.
        shared_prefix: :meth:`SharedPrefixModel.tail_logits_shared_prefix` usable.
        embedding_noise: :meth:`EmbeddingNoiseModel.noised_embeddings` usable (OAR-G never calls ``embed``).
        activation_checkpointing: :meth:`CheckpointModel.activation_checkpointing` usable (OAR-G recomputes the
            layers' activations in the backward when a row would not fit the budget otherwise).
        attn_implementation: the attention implementation the model declares (``attn_implementation``; for a
            Hugging Face model its ``config._attn_implementation``: ``"eager"``, ``"sdpa"``,
            ``"flash_attention_2"``, ...), None when it declares none.
        dense_mask: the model's ``tail_logits_cached`` takes a 4-D float attention mask (N, 1, S, P + S)
            (``supports_dense_mask``; True when the model declares nothing). False for flash-attention and
            flex-attention Hugging Face models (:data:`DENSE_MASK_ATTENTION`).
    """

    prefix_cache: bool = False
    prefix_grad: bool = False
    prefix_extend: bool = False
    shared_prefix: bool = False
    embedding_noise: bool = False
    activation_checkpointing: bool = False
    attn_implementation: str | None = None
    dense_mask: bool = True


def _type_name(model) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


def _declared(model, flag: str, members: tuple[str, ...], protocol: str) -> bool:
    """Whether ``model`` declares the capability ``flag``; TypeError naming what is missing when it declares it
    without every member of the capability."""
    # The one place a capability is detected: its flag (absent = not declared).
    on = getattr(model, flag, False)
    if not isinstance(on, bool):
        raise TypeError(f"model.{flag} must be a bool, got {type(on).__name__} {on!r} ({_type_name(model)})")
    if on:
        missing = [n for n in members if not hasattr(model, n)]
        if missing:
            raise TypeError(f"model declares {flag} = True but lacks {', '.join(missing)} of oar.attribution."
                            f"{protocol} ({_type_name(model)}); implement them or leave {flag} False")
    return on


def probe_capabilities(model) -> ProbeCapabilities:
    """Checks that ``model`` implements :class:`ProbeModel` and returns the optional capabilities it declares.

    Computed once per engine call (and by :func:`as_probe_model`). A capability is declared by its flag
    (``supports_prefix_cache``, ``supports_shared_prefix_attention``, ``supports_embedding_noise``,
    ``supports_activation_checkpointing``); a model that declares one must have all of its members. The attention
    implementation is read once here too (``attn_implementation``, ``supports_dense_mask``: the engines that hand
    the model a 4-D mask check it with :func:`require_dense_mask` before any forward).

    Raises:
        TypeError: ``model`` lacks members of :class:`ProbeModel` (all of them named in one message), a declared
            capability lacks members, a flag is not a bool, or ``attn_implementation`` is not a str.
        ValueError: ``vocab_size`` or ``hidden_size`` is not an int >= 1.
    """
    missing = [n for n in PROBE_MODEL_MEMBERS if not hasattr(model, n)]
    if missing:
        raise TypeError(f"model must implement oar.attribution.ProbeModel ({', '.join(PROBE_MODEL_MEMBERS)}); "
                        f"{_type_name(model)} lacks {', '.join(missing)} (docs/models.md)")
    for name in ("vocab_size", "hidden_size"):
        v = getattr(model, name)
        try:
            ok = not isinstance(v, bool) and operator.index(v) >= 1
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"model.{name} must be an int >= 1, got {type(v).__name__} {v!r}")
    prefix = _declared(model, "supports_prefix_cache", PREFIX_CACHE_MEMBERS, "PrefixCacheModel")
    grad = prefix and _declared(model, "supports_prefix_grad", (), "PrefixCacheModel")
    extend = prefix and _declared(model, "supports_prefix_extend", (), "PrefixCacheModel")
    shared = prefix and _declared(model, "supports_shared_prefix_attention", SHARED_PREFIX_MEMBERS,
                                  "SharedPrefixModel")
    noise = _declared(model, "supports_embedding_noise", EMBEDDING_NOISE_MEMBERS, "EmbeddingNoiseModel")
    ckpt = _declared(model, "supports_activation_checkpointing", CHECKPOINT_MEMBERS, "CheckpointModel")
    impl = getattr(model, "attn_implementation", None)
    if impl is not None and not isinstance(impl, str):
        raise TypeError(f"model.attn_implementation must be a str or None, got {type(impl).__name__} {impl!r} "
                        f"({_type_name(model)})")
    dense = getattr(model, "supports_dense_mask", True)
    if not isinstance(dense, bool):
        raise TypeError(f"model.supports_dense_mask must be a bool, got {type(dense).__name__} {dense!r} "
                        f"({_type_name(model)})")
    return ProbeCapabilities(prefix_cache=prefix, prefix_grad=grad, prefix_extend=extend, shared_prefix=shared,
                             embedding_noise=noise, activation_checkpointing=ckpt, attn_implementation=impl,
                             dense_mask=dense)


def require_dense_mask(caps: ProbeCapabilities, caller: str) -> None:
    """Refuses, before any forward, an engine path that would hand the model a 4-D float attention mask
    (windowed OAR-P without shared-prefix attention) when the model cannot take one (``caps.dense_mask`` False,
    e.g. ``attn_implementation="flash_attention_2"``). Paths with 2-D padding masks (batched and prefix OAR-P,
    OAR-G) need no such check.

    Raises:
        ValueError: naming ``caller``, the implementation found and those that take a 4-D mask.
    """
    if caps.shared_prefix or caps.dense_mask:  # the shared-prefix path runs oar's own attention with its masks
        return
    raise ValueError(f"{caller} hands the model a 4-D float attention mask (N, 1, S, P + S), which attention "
                     f"implementation {caps.attn_implementation!r} cannot take (transformers' flash-attention "
                     f"paths read 2-D padding masks only); run it with one of {DENSE_MASK_ATTENTION} (e.g. "
                     f"model.config._attn_implementation = 'sdpa', or load the model with attn_implementation="
                     f"'sdpa'), or use oar_p_scores / oar_g_scores, whose masks are 2-D")


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
        sdpa's bool mask). Measured on CPU with float32 Llama at width 2091 (tests/python/test_memory_budget.py):
        at most 15 % above the measured peaks, never below."""
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


@dataclass(frozen=True)
class WindowMasks:
    """The masks of windowed OAR-P over a shared prefix, in closed form (O(N x S) numbers instead of the dense
    (N, S, prefix) and (N, S, S) masks; issue 23): variant v re-runs the suffix columns ``cols[v]`` (its masked unit
    and the window after it, and the probe tail) on its row's clean prefix.

    A query of variant v at suffix slot i (original column ``cols[v, i]``) sees prefix column c iff
    ``first[v] <= c < cols[v, i]``, c is not in ``[hole_begin[v], hole_end[v])`` and ``c < tail[v]`` (re-run columns
    are seen through the suffix, never through the prefix), and sees suffix slot j iff
    ``0 <= cols[v, j] <= cols[v, i]`` or j = i.

    Attributes:
        cols: (N, S) int64, strictly increasing along S past a left padding of -1 (a padding slot sees only itself).
        first: (N,) int64, the first non-padding column of the variant's row.
        hole_begin, hole_end: (N,) int64, the re-run columns of the masked unit and its window.
        tail: (N,) int64, columns >= ``tail`` are re-run (the probe tail).
    Raises ValueError on other shapes or dtypes, or ``cols`` not increasing past its padding.
    """

    cols: torch.Tensor
    first: torch.Tensor
    hole_begin: torch.Tensor
    hole_end: torch.Tensor
    tail: torch.Tensor

    def __post_init__(self):
        if self.cols.dim() != 2 or self.cols.dtype != torch.long:
            raise ValueError(f"WindowMasks: cols must be a 2-D int64 tensor (N, S), got {tuple(self.cols.shape)} "
                             f"{self.cols.dtype}")
        n = self.cols.shape[0]
        for name in ("first", "hole_begin", "hole_end", "tail"):
            t = getattr(self, name)
            if tuple(t.shape) != (n,) or t.dtype != torch.long:
                raise ValueError(f"WindowMasks: {name} must be an int64 tensor of shape ({n},), got "
                                 f"{tuple(t.shape)} {t.dtype}")
        c = self.cols
        increasing = (c[:, 1:] > c[:, :-1]) | (c[:, :-1] < 0)
        if not bool(increasing.all()) or bool(((c[:, 1:] < 0) & (c[:, :-1] >= 0)).any()):
            raise ValueError("WindowMasks: cols must increase strictly along each row past a left padding of -1")

    def to(self, device) -> "WindowMasks":
        """The same masks on ``device``."""
        return WindowMasks(*(t.to(device) for t in (self.cols, self.first, self.hole_begin, self.hole_end,
                                                     self.tail)))

    def see_prefix(self, prefix_len: int) -> torch.Tensor:
        """(N, S, prefix_len) bool: the prefix columns each query sees (the dense form, for kernels that take one)."""
        c = torch.arange(prefix_len, device=self.cols.device).view(1, 1, -1)
        per_var = lambda t: t.view(-1, 1, 1)  # noqa: E731
        return ((c >= per_var(self.first)) & (c < self.cols.unsqueeze(-1))
                & ((c < per_var(self.hole_begin)) | (c >= per_var(self.hole_end))) & (c < per_var(self.tail)))

    def see_self(self) -> torch.Tensor:
        """(N, S, S) bool: the suffix slots each query sees (the dense form)."""
        ci, cj = self.cols.unsqueeze(-1), self.cols.unsqueeze(1)
        eye = torch.eye(self.cols.shape[1], dtype=torch.bool, device=self.cols.device)
        return ((cj >= 0) & (cj <= ci)) | eye


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
    above the engines' expected compilations (at most two per mask form, tests/python/test_shared_prefix_flex.py)."""
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


def gather_probe_logits(window: torch.Tensor, probe_start: torch.Tensor, k_max: int) -> torch.Tensor:
    """Selects (N, K_max, V) probe logits from tail windows (N, keep, V): row n takes positions
    ``probe_start[n] + k`` (clamped to the window; positions past a row's answer length are ignored by the
    probe ops through ``lengths``)."""
    keep = window.shape[1]
    idx = (probe_start.to(window.device).view(-1, 1) + torch.arange(k_max, device=window.device).view(1, -1))
    idx = idx.clamp_max(keep - 1)
    return window.gather(1, idx.unsqueeze(-1).expand(-1, -1, window.shape[-1]))
