"""Keeping ranks in step while attribution runs forwards (docs/trainers.md, "ZeRO-3/FSDP").

Under DeepSpeed ZeRO-3 or FSDP every forward (and backward) of the policy issues collectives (parameter
all-gathers), so every rank must run the same sequence of forwards: a rank that runs fewer would leave the
others waiting forever. The number of attribution forwards depends on the local data (rows with a non-zero
advantage, reasoning lengths, the chunk plan), so it differs between ranks.

:class:`ForwardGate` wraps a :class:`~oar.attribution.ProbeModel` and agrees with the other ranks *before*
each forward: every rank contributes the kind of its next model call (1 = forward without grad, 2 =
forward + backward, 3 = done) to an ``all_reduce(MIN)``. A rank whose next call is the agreed kind runs it;
a rank whose next call is of a later kind (or that is done) runs a dummy call of the agreed kind (a
one-token forward, plus its backward for kind 2) and asks again. Hence all ranks run the same number of
calls of each kind in the same order, the engines stay unchanged, and the plan never has to be known in
advance. Engines call forwards in kind order (no-grad clean logits first, then forward + backward for
OAR-G), which is what makes the MIN rule sufficient.

Cost: one scalar all-reduce per model call, plus the dummy calls (each a one-token forward).
Without ``torch.distributed`` (or with a world of one process) nothing is wrapped: :func:`gate_model`
returns the model unchanged and :func:`distributed_world` returns False.
"""

from __future__ import annotations

import torch

__all__ = ["distributed_world", "ForwardGate", "gate_model"]

KIND_FORWARD = 1
KIND_FORWARD_BACKWARD = 2
KIND_DONE = 3

# ProbeModel calls that run the policy without grad (the prefix-cache calls are OAR-P's fast path).
_NO_GRAD_CALLS = ("tail_logits_and_cache", "tail_logits_cached", "tail_logits_shared_prefix", "full_logits")


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


class ForwardGate:
    """A :class:`~oar.attribution.ProbeModel` proxy that keeps every rank's model calls in step.

    Every attribute not listed here is forwarded to the wrapped model. ``tail_logits`` with
    ``inputs_embeds`` that require grad counts as a forward + backward (the caller differentiates it before
    its next call); every other model call counts as a forward. Call :meth:`finish` once the local work is
    done (also on a rank with nothing to do): it runs dummy calls until every rank is done.

    Args:
        model: the ProbeModel (``oar.attribution.as_probe_model(policy)``).
        pad_id: token id of the dummy one-token forwards.
        group: torch.distributed process group (default: the world).

    Attributes:
        real_calls, dummy_calls: counters per kind ({1: n, 2: n}).
    """

    # OAR-G's prefix path differentiates through tail_logits_cached, which this gate counts as a no-grad
    # call: keep OAR-G on the plain path under a gate so that every rank runs the same collectives.
    supports_prefix_grad = False

    def __init__(self, model, pad_id: int = 0, group=None):
        self._model = model
        self._pad_id = int(pad_id)
        self._group = group
        self._finished = False
        self.real_calls = {KIND_FORWARD: 0, KIND_FORWARD_BACKWARD: 0}
        self.dummy_calls = {KIND_FORWARD: 0, KIND_FORWARD_BACKWARD: 0}

    def __getattr__(self, name):
        attr = getattr(self._model, name)
        if name in _NO_GRAD_CALLS and callable(attr):
            def gated(*args, **kwargs):
                self._wait_turn(KIND_FORWARD)
                self.real_calls[KIND_FORWARD] += 1
                return attr(*args, **kwargs)

            return gated
        return attr

    # ---- ProbeModel interface ------------------------------------------------------------------------
    def embed(self, input_ids):
        return self._model.embed(input_ids)

    def tail_logits(self, *, input_ids=None, inputs_embeds=None, attention_mask, position_ids, keep: int):
        kind = (KIND_FORWARD_BACKWARD if inputs_embeds is not None and inputs_embeds.requires_grad
                and torch.is_grad_enabled() else KIND_FORWARD)
        self._wait_turn(kind)
        self.real_calls[kind] += 1
        return self._model.tail_logits(input_ids=input_ids, inputs_embeds=inputs_embeds,
                                       attention_mask=attention_mask, position_ids=position_ids, keep=keep)

    # ---- agreement -----------------------------------------------------------------------------------
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
        """One-token forward (kind 1), or forward + backward w.r.t. the input embedding (kind 2): the same
        collectives as a real call of that kind, with no effect on parameters or their ``.grad``."""
        m = self._model
        dev = m.device if hasattr(m, "device") else torch.device("cpu")
        ids = torch.full((1, 1), self._pad_id, dtype=torch.long, device=dev)
        attn = torch.ones((1, 1), dtype=torch.long, device=dev)
        pos = torch.zeros((1, 1), dtype=torch.long, device=dev)
        if kind == KIND_FORWARD:
            with torch.no_grad():
                m.tail_logits(input_ids=ids, attention_mask=attn, position_ids=pos, keep=1)
        else:
            with torch.enable_grad():
                with torch.no_grad():
                    e = m.embed(ids).detach()
                e.requires_grad_(True)
                out = m.tail_logits(inputs_embeds=e, attention_mask=attn, position_ids=pos, keep=1)
                torch.autograd.grad(out.float().sum(), e)
        self.dummy_calls[kind] += 1


def gate_model(model, pad_id: int = 0, enabled: bool | None = None):
    """``ForwardGate(model)`` when ``enabled`` (default: :func:`distributed_world`), else ``model``."""
    if enabled is None:
        enabled = distributed_world()
    return ForwardGate(model, pad_id=pad_id) if enabled else model
