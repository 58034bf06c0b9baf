"""Groups of responses (one group per prompt) and the trainer presets of :func:`oar.ops.group_advantages`.

A batch of N rewards is split into G groups, given by exactly one of:

- ``offsets``: CSR row starts (G + 1,) int64 (offsets[0] = 0, non-decreasing, offsets[-1] = N; checked by the
  op), the rows of group g being offsets[g] <= i < offsets[g + 1];
- ``group_ids``: one id per row (an integer tensor on any device, or a sequence of hashables such as verl's
  ``uid`` strings), in any row order: interleaved layouts and batches reordered by the trainer (verl's
  ``balance_batch``) are grouped by id;
- ``group_size``: N / group_size groups of consecutive rows.

:func:`resolve_groups` turns any of them into :class:`Groups`: CSR offsets over the rows taken in
``Groups.order`` (a stable permutation that makes each group contiguous, ``None`` when the rows already are).
Groups are numbered in the order of their first row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from oar import _lib

__all__ = ["ADVANTAGE_PRESETS", "Groups", "resolve_groups", "checked_groups", "group_ids_from"]


#: Trainer presets for :func:`oar.ops.group_advantages`, mirroring ``oar::core::preset_options``
#: (include/oar/core/group_advantages.h). Each maps to the keyword arguments ``std``, ``eps`` and
#: ``singleton``; the estimator is chosen separately.
#:
#: - ``"trl"``: TRL ``GRPOTrainer._generate_and_score_completions``: unbiased std, eps 1e-4
#:   (``scale_rewards="group"`` is ``estimator="grpo"``, ``"batch"`` is ``"batch"``, ``"none"`` is
#:   ``"dr_grpo"``).
#: - ``"verl"``: verl ``core_algos.compute_grpo_outcome_advantage``: unbiased std, eps 1e-6, a group of one
#:   response gets mean 0 and std 1, so A = r / (1 + eps) (``norm_adv_by_std_in_grpo=False`` is
#:   ``estimator="dr_grpo"``, where A = r).
#: - ``"openrlhf"``: OpenRLHF ``experience_maker`` ``group_norm``: unbiased std, eps 1e-9 (also ``rloo`` and
#:   ``dr_grpo``). OpenRLHF itself returns NaN (std of one value) or divides by zero (rloo) for a group of
#:   one; this preset gives such a group A = 0 instead.
#: - ``"default"``: unbiased std, eps 1e-6, a group of one gets A = 0.
#:
#: One deliberate difference from all three trainers: they compute ``r - mean`` in float32, so a group of
#: equal but non-representable rewards (e.g. 0.1) can get rounding residue divided by (0 + eps); oar detects
#: all-equal groups by comparing values and returns exactly 0. With 0/1 rewards the results coincide.
def _presets_from_core() -> dict[str, dict]:
    # One source of truth: the C++ table (oar::core::preset_options), read through the pybind11 module.
    core = _lib.load_extension()
    out = {}
    for name in core.ADVANTAGE_PRESET_NAMES:
        o = core.preset_options(name, "grpo")
        out[name] = {"std": o.std, "eps": o.eps, "singleton": o.singleton}
    return out


ADVANTAGE_PRESETS: dict[str, dict] = _presets_from_core()


@dataclass(frozen=True)
class Groups:
    """Groups of a batch of N rows, as :func:`resolve_groups` returns them.

    Attributes:
        offsets: (G + 1,) int64 CSR row starts over the rows taken in ``order`` (not checked here: the op
            validates them and names ``offsets`` in its errors), on the rewards' device.
        order: ``None`` when every group's rows are already contiguous; else (N,) int64 on the rewards'
            device, a stable permutation: row k of the grouped layout is row ``order[k]`` of the caller's
            batch (the rows of one group keep their relative order).
    """

    offsets: torch.Tensor
    order: torch.Tensor | None = None

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (N, ...) in the grouped row order (``x`` itself when no permutation is needed)."""
        return x if self.order is None else x.index_select(0, self.order)

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`gather`: ``y`` (N, ...) in the grouped order -> the caller's row order."""
        return y if self.order is None else torch.empty_like(y).index_copy_(0, self.order, y)

    def caller_rows(self, err: ValueError) -> ValueError:
        """``err`` with every ``rewards[k]`` (a row of the grouped layout) renamed to the caller's row ``order[k]``."""
        if self.order is None:
            return err
        order = self.order.cpu().tolist()
        return ValueError(re.sub(r"rewards\[(\d+)\]", lambda m: f"rewards[{order[int(m.group(1))]}]", str(err)))


def _groups_from_id_list(ids: list, n: int) -> tuple[list[int], list[int] | None]:
    """CSR offsets (groups numbered by first appearance) and the stable grouping permutation (None if contiguous)."""
    key = [0] * n
    first: dict = {}
    for i, v in enumerate(ids):
        try:
            key[i] = first.setdefault(v, len(first))
        except TypeError:
            raise ValueError(f"group_ids must hold hashable ids (ints, strings), got {v!r} at row {i}") from None
    counts = [0] * len(first)
    for k in key:
        counts[k] += 1
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    if all(key[i] <= key[i + 1] for i in range(n - 1)):
        return offsets, None
    # Counting sort: stable, O(N).
    nxt = offsets[:-1]
    order = [0] * n
    for i, k in enumerate(key):
        order[nxt[k]] = i
        nxt[k] += 1
    return offsets, order


def _groups_from_id_tensor(ids: torch.Tensor, device: torch.device) -> Groups:
    """The same as :func:`_groups_from_id_list` with torch ops on the ids' own device (two host syncs: the number
    of groups, and whether the rows are already contiguous)."""
    n = ids.shape[0]
    if n == 0:
        return Groups(torch.zeros(1, dtype=torch.int64, device=device))
    _, inv = torch.unique(ids, return_inverse=True)  # groups numbered by id value ...
    num = int(inv.max()) + 1
    rows = torch.arange(n, device=ids.device)
    first = torch.full((num,), n, dtype=torch.int64, device=ids.device).scatter_reduce(0, inv, rows, "amin")
    rank = torch.empty_like(first)
    rank[torch.argsort(first)] = torch.arange(num, device=ids.device)  # ... renumbered by first appearance
    key = rank[inv]
    offsets = torch.cat([key.new_zeros(1), torch.cumsum(torch.bincount(key, minlength=num), 0)])
    order = None
    if n > 1 and bool((key[1:] < key[:-1]).any()):
        order = torch.sort(key, stable=True).indices.to(device)
    return Groups(offsets.to(device), order)


def resolve_groups(rewards: torch.Tensor, offsets=None, group_ids=None, group_size=None) -> Groups:
    """The groups of ``rewards`` (N,) from exactly one of ``offsets``, ``group_ids``, ``group_size``.

    Args:
        rewards: (N,) tensor; only its length and device are read.
        offsets: (G + 1,) int64 tensor or sequence of ints (CSR row starts; validated by the op).
        group_ids: (N,) integer tensor (any device) or a sequence of N hashable ids, in any row order.
        group_size: int >= 1 dividing N.

    Returns:
        :class:`Groups` with tensors on ``rewards.device``; ``order`` is set only for ``group_ids`` whose
        groups are not contiguous.

    Raises:
        ValueError: naming the argument: more or fewer than one grouping given, offsets that are not integers
            (or a meta tensor for real rewards), group_size < 1 or not dividing N, group_ids of another
            length than N, a string, a float/complex tensor, a tensor that is not 1-D, or unhashable ids.
    """
    given = [name for name, v in (("offsets", offsets), ("group_ids", group_ids), ("group_size", group_size))
             if v is not None]
    if len(given) != 1:
        raise ValueError(f"pass exactly one of offsets, group_ids, group_size; got {given or 'none'}")
    n = rewards.shape[0]
    if offsets is not None:
        if isinstance(offsets, torch.Tensor):
            off = offsets
        else:
            try:
                # An empty list would default to float32; it is an empty (invalid) offsets array, not a dtype error.
                off = torch.as_tensor(offsets, dtype=torch.int64 if len(offsets) == 0 else None)
            except (TypeError, ValueError, RuntimeError, OverflowError) as e:
                raise ValueError(f"offsets must be a sequence of int64 CSR row starts (G + 1,), got {offsets!r} "
                                 f"({e})") from None
        if off.dtype.is_floating_point or off.dtype.is_complex or off.dtype == torch.bool:
            raise ValueError(f"offsets must be an int64 tensor (G + 1,), got dtype {off.dtype}")
        if off.device.type == "meta" and rewards.device.type != "meta":
            raise ValueError(f"offsets must hold data (rewards are on {rewards.device}), got a meta tensor")
        return Groups(off.to(device=rewards.device, dtype=torch.int64))
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        if n % group_size != 0:
            raise ValueError(f"group_size must divide the number of rewards N = {n}, got group_size = {group_size}")
        return Groups(torch.arange(0, n + 1, group_size, dtype=torch.int64, device=rewards.device))
    if isinstance(group_ids, (str, bytes)):
        raise ValueError(f"group_ids must be a sequence with one id per reward, got {type(group_ids).__name__}")
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D (N,), got shape {tuple(group_ids.shape)}")
        if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex:
            raise ValueError(f"group_ids must hold integer ids, got dtype {group_ids.dtype}")
        if group_ids.shape[0] != n:
            raise ValueError(f"group_ids must have one id per reward, N = {n}, got {group_ids.shape[0]}")
        if group_ids.device.type == "meta":
            raise ValueError("group_ids must hold data (the groups depend on the id values), got a meta tensor")
        return _groups_from_id_tensor(group_ids.detach(), rewards.device)
    ids = list(group_ids)
    if len(ids) != n:
        raise ValueError(f"group_ids must have one id per reward, N = {n}, got {len(ids)}")
    off, order = _groups_from_id_list(ids, n)
    return Groups(torch.tensor(off, dtype=torch.int64, device=rewards.device),
                  None if order is None else torch.tensor(order, dtype=torch.int64, device=rewards.device))


def checked_groups(n: int, offsets=None, group_ids=None, group_size=None) -> Groups:
    """:func:`resolve_groups` of ``n`` rows, with the CSR offsets checked here (the op checks them only when it
    runs): non-decreasing from 0 to ``n``. Raises ValueError naming the argument."""
    g = resolve_groups(torch.zeros(n), offsets, group_ids, group_size)
    off = g.offsets.cpu().tolist()
    if not off or off[0] != 0 or off[-1] != n or any(b < a for a, b in zip(off, off[1:])):
        raise ValueError(f"offsets must be non-decreasing CSR row starts from 0 to N = {n}, got {off}")
    return g


def group_ids_from(n: int, *, offsets=None, group_ids=None, group_size=None) -> list | None:
    """One group id per row from exactly one of ``offsets`` (CSR (G + 1,)), ``group_ids`` (N ids, any row order)
    or ``group_size`` (equal consecutive groups), validated as :func:`oar.ops.group_advantages` does; None when none
    is given.

    Raises:
        ValueError: naming the argument (as :func:`oar.groups.resolve_groups`), offsets that do not run
            non-decreasing from 0 to N.
    """
    if offsets is None and group_ids is None and group_size is None:
        return None
    g = checked_groups(n, offsets, group_ids, group_size)
    if group_ids is not None:
        return group_ids.detach().cpu().tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    off = g.offsets.cpu().tolist()
    ids = [0] * n
    for k, (a, b) in enumerate(zip(off, off[1:])):
        ids[a:b] = [k] * (b - a)
    return ids
