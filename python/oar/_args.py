"""Coercion of plain-Python arguments (strings, numbers, flags) with errors that name the argument.

A wrong type gets a ``ValueError`` such as ``"eps must be a real number, got str '1e-4'"`` instead of a
dispatcher ``RuntimeError`` ("Expected a value of type 'str' ...") or a silent coercion (``bool("no")`` is
True). Used by the op wrappers (:mod:`oar.ops`), the baselines, the attribution engines and the trainer
adapters. Private: the names and messages may change with the callers.
"""

from __future__ import annotations

import torch


def str_arg(name: str, value) -> str:
    """``value`` itself when it is a ``str``; ValueError naming ``name`` otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {type(value).__name__} {value!r}")
    return value


def float_arg(name: str, value) -> float:
    """``float(value)`` for real numbers (int, float, numpy scalars, 0-d tensors); ValueError for bool, str, bytes
    and anything ``float()`` refuses."""
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}") from None


def bool_arg(name: str, value) -> bool:
    """``bool(value)`` for True/False, numpy bools and the ints 0/1; ValueError for strings, floats, tensors and
    other values (``bool("no")`` would be True)."""
    ok = isinstance(value, bool)
    if not ok and not isinstance(value, (str, bytes, float, torch.Tensor)):
        try:
            ok = value in (True, False)  # numpy bools, 0/1
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise ValueError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def int_arg(name: str, value, *, tensors: bool = False) -> int:
    """``int(value)`` for objects with ``__index__`` (int, numpy integers) that fit in int64; with ``tensors``,
    also integer 0-d tensors (row and position indices of the engines; the ops' scalar arguments refuse them, so
    that a traced call never reads a tensor's value). ValueError for bool, floats, other tensors and
    out-of-range values (``int(0.5)`` would silently pick row 0)."""
    if tensors and isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an int, got tensor of shape {tuple(value.shape)} and dtype {value.dtype}")
        value = int(value)
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value.__index__())
    if not -(2**63) <= v < 2**63:
        raise ValueError(f"{name} must fit in int64, got {v}")
    return v


def token_ids_arg(name: str, value) -> tuple[int, ...]:
    """A sequence of int token ids (a list/tuple of ints, or a 1-D integer tensor) as a tuple; ValueError naming
    ``name`` for a str, a tensor of another kind, a non-iterable or a non-int element (named ``name[i]``)."""
    if isinstance(value, torch.Tensor) and value.dim() == 1 and not (
            value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
        value = value.tolist()
    if isinstance(value, (str, bytes, torch.Tensor)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a sequence of int token ids, got {type(value).__name__} {value!r}")
    return tuple(int_arg(f"{name}[i]", x) for x in value)


# ---- tensors (the library's one set of tensor checks; messages name the argument and the caller's dims) ----


def _ndim(dims: str) -> int:
    return len([d for d in dims.strip("()").split(",") if d.strip()])


def tensor_arg(name: str, value, dims: str, shape: tuple | None = None) -> torch.Tensor:
    """``value`` itself when it is a tensor with data of ``dims`` (the caller's dimension names, e.g. ``"(B, C)"``)
    and, when given, exactly ``shape``. ValueError naming ``name``, the expected and the actual shape otherwise."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a {dims} torch.Tensor, got {type(value).__name__}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must be a {dims} = {tuple(shape)} tensor, got {tuple(value.shape)}")
    if value.dim() != _ndim(dims):
        raise ValueError(f"{name} must be {_ndim(dims)}-D {dims}, got shape {tuple(value.shape)}")
    if value.device.type == "meta":
        raise ValueError(f"{name} must hold data, got a tensor on the meta device")
    return value


def ids_arg(name: str, value, dims: str, shape: tuple | None = None) -> torch.Tensor:
    """:func:`tensor_arg` of token ids: an integer dtype (ValueError naming the dtype for floating, complex and
    bool). The range against a vocabulary is the caller's check (it knows the vocabulary)."""
    value = tensor_arg(name, value, dims, shape)
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor of token ids, got dtype {value.dtype}")
    return value


def real_arg(name: str, value, dims: str, shape: tuple | None = None) -> torch.Tensor:
    """:func:`tensor_arg` of a real tensor: bool (as 0/1), integer or floating dtype, as :func:`oar.ops.group_advantages`
    takes rewards; ValueError naming the dtype for complex."""
    value = tensor_arg(name, value, dims, shape)
    if value.dtype.is_complex:
        raise ValueError(f"{name} must be real, got dtype {value.dtype}")
    return value


def mask_arg(name: str, value, dims: str, shape: tuple | None = None) -> torch.Tensor:
    """:func:`tensor_arg` of a mask, returned as a bool tensor on its device: bool, or any real dtype holding only
    0 and 1 (ValueError naming the dtype otherwise)."""
    value = tensor_arg(name, value, dims, shape)
    if value.dtype.is_complex or (value.dtype != torch.bool and not bool(((value == 0) | (value == 1)).all())):
        raise ValueError(f"{name} must be a bool or 0/1 mask, got dtype {value.dtype} with other values")
    return value.detach().bool()


def finite_arg(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` when every element is finite; ValueError naming the first non-finite element otherwise."""
    bad = ~torch.isfinite(value)
    if bool(bad.any()):
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"{name} must be finite, got {float(value[idx])} at {list(idx)}")
    return value


def fits_float32(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` (finite, e.g. a float64 input or result) as float32; ValueError naming ``name`` and the first
    element beyond float32's range otherwise."""
    f = value.float()
    bad = ~torch.isfinite(f)
    if bool(bad.any()):
        idx = [int(i) for i in torch.nonzero(bad)[0]]
        raise ValueError(f"{name} must fit in float32 (|x| <= 3.4e38), got {name}{idx} = "
                         f"{float(value[tuple(idx)]):.6g}; rescale the input")
    return f
