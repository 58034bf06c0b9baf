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

Group: the gate synchronises the ranks that gather one replica's parameters together, not the whole world
(:func:`replica_group`: the sharding dimension of an FSDP2 / HSDP device mesh, FSDP1's process group, DeepSpeed
ZeRO-3's partition group; the world otherwise). Under HSDP the replica groups then run their own numbers of forwards.

Errors: a rank that fails (an exception in the engines between two gated calls, or before its gate) would leave
the others waiting in a collective. Every agreement is therefore also an error report: a failing rank contributes
``KIND_ERROR`` (-1, the minimum) to the next round; the ranks of the group then exchange their messages
(``all_gather_object``) and all raise the same :class:`RankError`, naming every failed rank and its original error.
:func:`agreed_call` runs a whole scoring pass that way (one round on the gate's group, then one on the world), and
:func:`agree_on_errors` is one round, for the checks before it. An error inside a model forward itself (out of memory
mid-forward) leaves the forward's own collectives unmatched and is not covered.

Cost: one scalar all-reduce per model call, plus the dummy calls (each a one-token lookup or forward).
Without ``torch.distributed`` (or with a world of one process) nothing is wrapped: :func:`gate_model`
returns the model unchanged and :func:`distributed_world` returns False.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from oar.attribution.model import NoisedEmbeddings, probe_capabilities

__all__ = ["distributed_world", "ForwardGate", "gate_model", "replica_group", "RankError", "agree_on_errors",
           "agreed_call"]

KIND_ERROR = -1
KIND_EMBED = 0
KIND_FORWARD = 1
KIND_FORWARD_BACKWARD = 2
KIND_DONE = 3


def distributed_world() -> bool:
    """True when torch.distributed is initialized with more than one process."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _world_or(group):
    """``group``, or None (the world) when it spans every rank (one communicator less, and the same one as a caller
    that passes no group)."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == dist.get_world_size():
        return None
    return group


def replica_group(model):
    """The process group whose ranks gather the parameters of one replica of ``model`` together: the ranks that must
    run the same forwards. None means the whole world (also without torch.distributed).

    Found, in order: the shard dimension of the device mesh of a DTensor parameter (FSDP2 ``fully_shard``, and its
    HSDP 2-D mesh ``(dp_replicate, dp_shard)``: the ``Shard`` placement's dimension); FSDP1's ``process_group``
    (HYBRID_SHARD: the intra-node shard group); DeepSpeed ZeRO-3's ``ds_process_group`` of a partitioned parameter;
    else the world. A group that spans every rank is returned as None.

    Args:
        model: the policy module (FSDP1 wrapper, FSDP2 / DeepSpeed module, plain module) or an
            :class:`oar.attribution.HFProbeModel` (its ``.model`` is read); anything else gives None.
    """
    if not distributed_world():
        return None
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
    if not isinstance(module, torch.nn.Module):
        return None
    pg = getattr(module, "process_group", None)  # FSDP1 (FullyShardedDataParallel.process_group)
    if pg is not None and not isinstance(pg, (int, str)):
        return _world_or(pg)
    for p in module.parameters():
        mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
        if mesh is not None and placements is not None:  # a DTensor (FSDP2)
            dims = [i for i, pl in enumerate(placements) if pl.is_shard()]
            if len(dims) == 1:
                return _world_or(mesh.get_group(dims[0]))
            return None
        ds = getattr(p, "ds_process_group", None)  # DeepSpeed ZeRO-3 partitioned parameter
        if ds is not None:
            return _world_or(ds)
    return None


class RankError(RuntimeError):
    """Raised on every rank of a group when one or more of its ranks failed during a synchronised pass.

    Args:
        failures: {global rank: "ExceptionType: message"}.
        during: what the ranks were doing, for the message ("attribution", "the reward functions").

    Attributes:
        failures: {global rank: "ExceptionType: message"} of every rank that failed, sorted by rank.
        during: as given.
    """

    def __init__(self, failures: dict, during: str = "attribution"):
        self.failures = dict(sorted(failures.items()))
        self.during = during
        what = "; ".join(f"rank {r}: {m}" for r, m in self.failures.items())
        super().__init__(f"oar: {len(self.failures)} rank(s) failed during {during}, so every rank stops here "
                         f"(the others would wait in a collective): {what}")


def _own_failures(error) -> dict:
    import torch.distributed as dist

    if error is None:
        return {}
    if isinstance(error, RankError):
        return dict(error.failures)
    return {dist.get_rank(): f"{type(error).__name__}: {error}"}


def _min_round(kind: int, group) -> int:
    """One agreement round: ``all_reduce(MIN)`` of ``kind`` over ``group`` (the gate's rounds and the error rounds
    are the same collective, so a failing rank's report meets whatever round its peers are in)."""
    import torch.distributed as dist

    t = torch.tensor([kind], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def _gathered_error(own: dict, group, during: str = "attribution") -> RankError:
    """Second step of a round that agreed on an error: every rank's known failures, merged (a collective)."""
    import torch.distributed as dist

    objs = [None] * dist.get_world_size(group)
    dist.all_gather_object(objs, own, group=group)
    merged = {}
    for d in objs:
        merged.update(d or {})
    return RankError(merged, during)


def _error_round(error, group, during: str = "attribution") -> RankError | None:
    """One error round over ``group``: None when no rank of it failed, else the agreed :class:`RankError`."""
    own = _own_failures(error)
    if _min_round(KIND_ERROR if own else KIND_DONE, group) != KIND_ERROR:
        return None
    return _gathered_error(own, group, during)


def agree_on_errors(error: BaseException | None = None, group=None, during: str = "attribution") -> None:
    """One error round (a collective over ``group``, default the world; every rank calls it): raises the same
    :class:`RankError` on every rank when any rank passed an ``error`` (chained to it on that rank), else returns.
    Without a distributed world, ``error`` (when given) is raised as it is. ``during`` names the pass in the
    message (``RankError.during``).

    Raises:
        RankError: some rank of the group passed an error.
    """
    if not distributed_world():
        if error is not None:
            raise error
        return
    agreed = _error_round(error, group, during)
    if agreed is not None:
        raise agreed from error


def agreed_call(fn, *, group=None):
    """``fn()``, with its error or another rank's raised on every rank as one :class:`RankError`.

    Two error rounds follow ``fn``: one over ``group`` (the group of the :class:`ForwardGate` that ``fn`` may open:
    a rank failing before its gate meets the gate's rounds of its peers there; a gate that already agreed on an
    error counts as that round), then one over the world (the other replica groups). Every rank must call it.
    Without a distributed world it is ``fn()``.

    Raises:
        RankError: ``fn`` raised on some rank (the failing rank's original error is its ``__cause__``).
    """
    if not distributed_world():
        return fn()
    result, error = None, None
    try:
        result = fn()
    except RankError as e:  # a gate over ``group`` agreed on it: that was this group's round
        error = e
    except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised below
        error = _error_round(e, group)
        error.__cause__ = e
    else:
        error = _error_round(None, group)
    agreed = _error_round(error, None)
    if agreed is not None:
        raise agreed from (error.__cause__ if error is not None else None)
    return result


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
        group: torch.distributed process group of the ranks kept in step (default: :func:`replica_group` of the
            wrapped model, the world when it has none; ``torch.distributed.group.WORLD`` forces the world).

    Attributes:
        real_calls, dummy_calls: model forwards per kind ({1: n, 2: n}).
        real_embeds, dummy_embeds: embedding lookups (``embed`` calls).

    Raises:
        TypeError: ``model`` is not a ProbeModel (names every missing member).
        RankError: from a model call, :meth:`finish` or the ``eval_mode`` scope, when a rank of the group failed
            (an exception inside ``eval_mode`` is reported to the group that way instead of propagating alone).
    """

    supports_prefix_grad = False

    def __init__(self, model, pad_id: int = 0, group=None):
        self._caps = probe_capabilities(model)
        self._model = model
        self._pad_id = int(pad_id)
        self._group = replica_group(model) if group is None else _world_or(group)
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

    @property
    def window_mask_bytes(self):
        """The wrapped model's ``window_mask_bytes`` (the windowed planner's per-kernel mask estimate), None when it
        declares none (the planner then counts dense masks)."""
        return getattr(self._model, "window_mask_bytes", None)

    @contextlib.contextmanager
    def eval_mode(self):
        """The wrapped model's ``eval_mode``; also the scope of the gated work: an exception raised inside it on
        this rank is reported to the group at the next agreement, and every rank of the group raises the same
        :class:`RankError` (chained to the original here)."""
        with self._model.eval_mode():
            try:
                yield
            except Exception as e:
                if isinstance(e, RankError) or self._finished:
                    raise
                self._finished = True
                _min_round(KIND_ERROR, self._group)  # the MIN with this rank's -1: every rank sees the error
                raise _gathered_error(_own_failures(e), self._group) from e

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
        agreed = _min_round(kind, self._group)
        if agreed == KIND_ERROR:  # a rank of the group failed: all stop with its message
            self._finished = True
            raise _gathered_error({}, self._group)
        return agreed

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
        """Runs dummy calls until every rank is done. Collective: every rank must call it once, inside the
        ``eval_mode`` scope as the real calls (``Pipeline`` does): in training mode, a policy with activation
        checkpointing (TRL's default) would recompute a dummy's layers in its backward, and under ZeRO-3 that
        recomputation gathers parameters that no real call of a peer gathers."""
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
