"""Keeping ranks in step while attribution runs forwards (docs/trainers.md, "ZeRO-3/FSDP").

Under DeepSpeed ZeRO-3 or FSDP every forward (and backward) of the policy issues collectives (parameter
all-gathers), so every rank must run the same sequence of forwards: a rank that runs fewer would leave the
others waiting forever. The number of attribution forwards depends on the local data (rows with a non-zero
advantage, reasoning lengths, the chunk plan), so it differs between ranks.

:class:`ForwardGate` wraps a :class:`~oar.attribution.ProbeModel` and agrees with the other ranks *before*
each model call: every rank contributes the kind of its next call (0 = embedding lookup, 1 = forward without
grad, 2 = forward + backward, 3 = done) to an ``all_reduce(MIN)``. A rank whose next call is the agreed kind
runs it; a rank whose next call is of another kind (or that is done) runs a dummy call of the agreed kind (a
one-token lookup or forward, plus its backward for kind 2) and asks again. Each round, every rank runs exactly
one call of the agreed kind, so all ranks issue the same collectives in the same order, the engines stay
unchanged, and the plan never has to be known in advance. Engines call forwards in kind order where they can
(no-grad clean logits first, then forward + backward for OAR-G), which keeps the dummies few.

The gate implements the whole protocol explicitly: every member of :class:`~oar.attribution.ProbeModel` and of
the optional capabilities (:class:`~oar.attribution.PrefixCacheModel`, :class:`~oar.attribution.SharedPrefixModel`,
:class:`~oar.attribution.EmbeddingNoiseModel`) that runs the model is gated (``embed``; ``tail_logits``;
``tail_logits_and_cache``, ``tail_logits_cached``, ``tail_logits_shared_prefix``; a forward under
``noised_embeddings`` counts as a forward + backward), the others (sizes, cost declarations, ``eval_mode``) are
forwarded as they are, and nothing else is reachable through the gate (an ungated model call would desynchronize
the ranks). With a model that takes its embeddings inside the forward (``HFProbeModel``), OAR-P and OAR-G never
call ``embed``: every call is a root forward, as FSDP1/FSDP2 (root-module parameter gathering) and ZeRO-3 need.

Cost: one scalar all-reduce per model call, plus the dummy calls (each a one-token lookup or forward).
Without ``torch.distributed`` (or with a world of one process) nothing is wrapped: :func:`gate_model`
returns the model unchanged and :func:`distributed_world` returns False.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from oar.attribution.model import NoisedEmbeddings, probe_capabilities

__all__ = ["distributed_world", "ForwardGate", "gate_model"]

KIND_EMBED = 0
KIND_FORWARD = 1
KIND_FORWARD_BACKWARD = 2
KIND_DONE = 3


def distributed_world() -> bool:
    """True when torch.distributed is initialized with more than one process."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _collective_device() -> torch.device:
    import torch.distributed as dist

    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _forward_kind(inputs_embeds) -> int:
    """A call on ``inputs_embeds`` that require grad (with grad enabled) is differentiated before the caller's
    next call: forward + backward. Any other call is a forward."""
    if inputs_embeds is not None and inputs_embeds.requires_grad and torch.is_grad_enabled():
        return KIND_FORWARD_BACKWARD
    return KIND_FORWARD


class ForwardGate:
    """A :class:`~oar.attribution.ProbeModel` proxy that keeps every rank's model calls in step.

    ``embed`` counts as an embedding lookup (under ZeRO-3 it gathers the embedding matrix); the calls on
    ``inputs_embeds`` that require grad as a forward + backward (the caller differentiates them before its next
    call); every other model call as a forward. Call :meth:`finish` once the local work is done (also on a rank
    with nothing to do): it runs dummy calls until every rank is done. The prefix-cache members are offered when
    the wrapped model has that capability, but ``supports_prefix_grad`` is False: under a gate OAR-G keeps its
    plain path, whose calls come in kind order (every no-grad forward first), so ranks pad each other with few
    dummies; the prompt-once path alternates no-grad and differentiated calls in every chunk. Activation
    checkpointing is not offered either: its recomputation in the backward would run collectives (ZeRO-3 / FSDP
    parameter gathers) that a rank running a dummy call does not, so OAR-G rows over the budget run whole (warned by
    the planner). The attention implementation and the mask element size are passed on as they are.

    Args:
        model: the ProbeModel (``oar.attribution.as_probe_model(policy)``).
        pad_id: token id of the dummy one-token calls.
        group: torch.distributed process group (default: the world).

    Attributes:
        real_calls, dummy_calls: model forwards per kind ({1: n, 2: n}).
        real_embeds, dummy_embeds: embedding lookups (``embed`` calls).

    Raises:
        TypeError: ``model`` is not a ProbeModel (names every missing member).
    """

    supports_prefix_grad = False

    def __init__(self, model, pad_id: int = 0, group=None):
        self._caps = probe_capabilities(model)
        self._model = model
        self._pad_id = int(pad_id)
        self._group = group
        self._finished = False
        self._one_embedding = None  # (1, 1, H) embedding of one token: the input of kind-2 dummies
        self._noise = None  # (perturb, record) of an open noised_embeddings context, until its forward runs
        self.real_calls = {KIND_FORWARD: 0, KIND_FORWARD_BACKWARD: 0}
        self.dummy_calls = {KIND_FORWARD: 0, KIND_FORWARD_BACKWARD: 0}
        self.real_embeds = 0
        self.dummy_embeds = 0

    # ---- ProbeModel: forwarded as they are (no model call) ----------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._model.vocab_size

    @property
    def hidden_size(self) -> int:
        return self._model.hidden_size

    @property
    def device(self) -> torch.device:
        return self._model.device

    def activation_bytes_per_token(self, width: int, backward: bool = False) -> int:
        return self._model.activation_bytes_per_token(width, backward)

    @property
    def attn_implementation(self) -> str | None:
        """The wrapped model's attention implementation (read by the engines' checks; no model call)."""
        return self._caps.attn_implementation

    @property
    def supports_dense_mask(self) -> bool:
        return self._caps.dense_mask

    def cache_key_element_size(self) -> int:
        """The wrapped model's cached-key element size (the windowed planner's mask estimate), 4 when it declares
        none."""
        f = getattr(self._model, "cache_key_element_size", None)
        return int(f()) if callable(f) else 4

    def eval_mode(self):
        return self._model.eval_mode()

    # ---- ProbeModel: gated ------------------------------------------------------------------------------
    def embed(self, input_ids):
        self._wait_turn(KIND_EMBED)
        self.real_embeds += 1
        out = self._model.embed(input_ids)
        if self._one_embedding is None and out.numel():
            self._one_embedding = out[:1, :1].detach().clone()
        return out

    def tail_logits(self, *, input_ids=None, inputs_embeds=None, attention_mask, position_ids, keep: int):
        return self._run(self._model.tail_logits, input_ids=input_ids, inputs_embeds=inputs_embeds,
                         attention_mask=attention_mask, position_ids=position_ids, keep=keep)

    # ---- EmbeddingNoiseModel (offered when the wrapped model declares it) ---------------------------------
    @property
    def supports_embedding_noise(self) -> bool:
        return self._caps.embedding_noise

    @contextlib.contextmanager
    def noised_embeddings(self, perturb):
        """The wrapped model's :meth:`~oar.attribution.EmbeddingNoiseModel.noised_embeddings`, entered around the
        one forward of the context only after the ranks agreed on it (a forward + backward when grad is enabled),
        so that the dummy calls run before it see no perturbation."""
        if self._noise is not None:
            raise RuntimeError("ForwardGate.noised_embeddings: contexts do not nest")
        rec = NoisedEmbeddings()
        self._noise = (perturb, rec)
        try:
            yield rec
        finally:
            pending, self._noise = self._noise, None
        if pending is not None:
            raise RuntimeError("noised_embeddings: expected one forward under the context, got 0")

    def _run(self, fn, **kwargs):
        """One gated model call: its kind is agreed first (dummies run meanwhile), then ``fn(**kwargs)`` runs,
        under the wrapped model's embedding perturbation when a noised_embeddings context is open."""
        if self._noise is None:
            self._gate(_forward_kind(kwargs.get("inputs_embeds")))
            return fn(**kwargs)
        (perturb, rec), self._noise = self._noise, None
        self._gate(KIND_FORWARD_BACKWARD if torch.is_grad_enabled() else KIND_FORWARD)
        with self._model.noised_embeddings(perturb) as inner:
            out = fn(**kwargs)
        rec.clean, rec.noised = inner.clean, inner.noised
        return out

    # ---- PrefixCacheModel / SharedPrefixModel (used only when the wrapped model declares them) -------------
    @property
    def supports_prefix_cache(self) -> bool:
        return self._caps.prefix_cache

    @property
    def supports_shared_prefix_attention(self) -> bool:
        return self._caps.shared_prefix

    def kv_bytes_per_token(self) -> int:
        return self._model.kv_bytes_per_token()

    @property
    def supports_prefix_extend(self) -> bool:
        return self._caps.prefix_extend

    def tail_logits_and_cache(self, *, input_ids, attention_mask, position_ids, keep: int, prefix_kv=None):
        self._gate(KIND_FORWARD)
        extra = {} if prefix_kv is None else {"prefix_kv": prefix_kv}  # only models that declare prefix_extend
        return self._model.tail_logits_and_cache(input_ids=input_ids, attention_mask=attention_mask,
                                                 position_ids=position_ids, keep=keep, **extra)

    def tail_logits_cached(self, prefix_kv, *, input_ids=None, inputs_embeds=None, attention_mask, position_ids,
                           keep: int):
        return self._run(functools.partial(self._model.tail_logits_cached, prefix_kv), input_ids=input_ids,
                         inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                         position_ids=position_ids, keep=keep)

    def tail_logits_shared_prefix(self, prefix_kv, groups, prefix_len: int, *, input_ids, position_ids, keep: int,
                                  **masks):
        self._gate(KIND_FORWARD)
        return self._model.tail_logits_shared_prefix(prefix_kv, groups, prefix_len, input_ids=input_ids,
                                                     position_ids=position_ids, keep=keep, **masks)

    # ---- agreement -----------------------------------------------------------------------------------
    def _gate(self, kind: int) -> None:
        self._wait_turn(kind)
        self.real_calls[kind] += 1

    def _agree(self, kind: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([kind], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)
        return int(t.item())

    def _wait_turn(self, kind: int) -> None:
        if self._finished:
            raise RuntimeError("ForwardGate: model call after finish(); create a new gate per attribution pass")
        while True:
            agreed = self._agree(kind)
            if agreed == kind:
                return
            if agreed > kind:  # cannot happen: MIN of values that include ours
                raise RuntimeError(f"ForwardGate: agreed kind {agreed} > own kind {kind}")
            self._dummy(agreed)

    def finish(self) -> None:
        """Runs dummy calls until every rank is done. Collective: every rank must call it once."""
        if self._finished:
            return
        while True:
            agreed = self._agree(KIND_DONE)
            if agreed == KIND_DONE:
                break
            self._dummy(agreed)
        self._finished = True

    def _dummy(self, kind: int) -> None:
        """The collectives of a real call of ``kind`` with no effect on parameters or their ``.grad``: a one-token
        embedding lookup (kind 0), a one-token forward (kind 1), or a one-token forward + backward w.r.t. its input
        embedding (kind 2: taken inside the forward for an EmbeddingNoiseModel, else the one kept from an earlier
        lookup, so no extra lookup runs)."""
        m = self._model
        dev = torch.device(m.device)
        ids = torch.full((1, 1), self._pad_id, dtype=torch.long, device=dev)
        attn = torch.ones((1, 1), dtype=torch.long, device=dev)
        pos = torch.zeros((1, 1), dtype=torch.long, device=dev)
        if kind == KIND_EMBED:
            with torch.no_grad():
                e = m.embed(ids)
            if self._one_embedding is None:
                self._one_embedding = e.detach().clone()
            self.dummy_embeds += 1
            return
        if kind == KIND_FORWARD:
            with torch.no_grad():
                m.tail_logits(input_ids=ids, attention_mask=attn, position_ids=pos, keep=1)
        elif self._caps.embedding_noise:  # the embeddings are taken inside the forward: no lookup of its own
            with torch.enable_grad():
                with m.noised_embeddings(lambda e: e) as rec:
                    out = m.tail_logits(input_ids=ids, attention_mask=attn, position_ids=pos, keep=1)
                torch.autograd.grad(out.float().sum(), rec.noised)
        else:
            e = self._one_embedding
            if e is None:
                # Only when a caller differentiates inputs_embeds it did not get from this gate's embed: this
                # lookup is then one collective more than the real call issues.
                with torch.no_grad():
                    e = m.embed(ids)
            with torch.enable_grad():
                e = e.detach().clone().requires_grad_(True)
                out = m.tail_logits(inputs_embeds=e, attention_mask=attn, position_ids=pos, keep=1)
                torch.autograd.grad(out.float().sum(), e)
        self.dummy_calls[kind] += 1


def gate_model(model, pad_id: int = 0, enabled: bool | None = None):
    """``ForwardGate(model)`` when ``enabled`` (default: :func:`distributed_world`), else ``model``."""
    if enabled is None:
        enabled = distributed_world()
    return ForwardGate(model, pad_id=pad_id) if enabled else model
