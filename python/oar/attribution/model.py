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
:class:`~oar.attribution.hf_model.HFProbeModel` implements all three for Hugging Face ``*ForCausalLM`` models (also
when wrapped by DDP/FSDP/DeepSpeed/PEFT: pass the module whose ``forward`` accepts ``logits_to_keep``). C++ trainers implement
``oar::ProbeModel`` (``include/oar/torch/engine.h``), the same interface without the optional capabilities.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
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


def gather_probe_logits(window: torch.Tensor, probe_start: torch.Tensor, k_max: int) -> torch.Tensor:
    """Selects (N, K_max, V) probe logits from tail windows (N, keep, V): row n takes positions
    ``probe_start[n] + k`` (clamped to the window; positions past a row's answer length are ignored by the
    probe ops through ``lengths``)."""
    keep = window.shape[1]
    idx = (probe_start.to(window.device).view(-1, 1) + torch.arange(k_max, device=window.device).view(1, -1))
    idx = idx.clamp_max(keep - 1)
    return window.gather(1, idx.unsqueeze(-1).expand(-1, -1, window.shape[-1]))
