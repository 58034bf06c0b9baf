"""oar.ops.build_masked_batch (method.md section 3) against the plain-PyTorch reference, with opcheck, edge shapes
and error messages, on every device (``device``: "cpu", and "cuda" where a GPU and the CUDA kernels are present; the
CUDA cases compare against the CPU op too), bad input as one table, torch.compile of the wrapper."""

from __future__ import annotations

import pytest
import torch

import oar  # noqa: F401  (loads the op library)
from oar import ops
from oar import reference as ref

from _devices import DEVICES, eager_checks, gen, no_pending_device_errors, on, bad_input_tests, to_device  # noqa: F401


def test_build_masked_batch_matches_reference():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (4, 47), generator=g)
    rows = torch.randint(0, 4, (131,), generator=g)
    pos = torch.randint(0, 47, (131,), generator=g)
    got = ops.build_masked_batch(ids, rows, pos, pad_id=151643)
    torch.testing.assert_close(got, ref.build_masked_batch(ids, rows, pos, 151643), rtol=0, atol=0)
    # Exactly one entry differs from the source row (when the source token was not already PAD).
    diff = (got != ids[rows]).sum(1)
    assert (diff <= 1).all() and (got[torch.arange(131), pos] == 151643).all()


def test_build_masked_batch_edges():
    ids = torch.arange(12).reshape(3, 4)
    empty = ops.build_masked_batch(ids, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), 0)
    assert empty.shape == (0, 4) and empty.dtype == torch.int64
    # Non-contiguous ids (a transposed view) are copied, not misread.
    t = torch.arange(12).reshape(4, 3).t()
    got = ops.build_masked_batch(t, torch.tensor([2, 0]), torch.tensor([0, 3]), -1)
    torch.testing.assert_close(got, ref.build_masked_batch(t, torch.tensor([2, 0]), torch.tensor([0, 3]), -1))


def test_build_masked_batch_opcheck():
    ids = torch.randint(0, 50, (3, 9))
    rows, pos = torch.tensor([0, 2, 2]), torch.tensor([8, 0, 4])
    torch.library.opcheck(torch.ops.oar.build_masked_batch.default, (ids, rows, pos, 7))


def test_build_masked_batch_errors():
    ids = torch.zeros(2, 5, dtype=torch.long)
    r, p = torch.tensor([0, 1]), torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"row_index\[1\] must be in \[0, B=2\), got 2"):
        ops.build_masked_batch(ids, torch.tensor([0, 2]), p, 0)
    with pytest.raises(ValueError, match=r"positions\[0\] must be in \[0, T=5\), got 5"):
        ops.build_masked_batch(ids, r, torch.tensor([5, 0]), 0)
    with pytest.raises(ValueError, match=r"positions\[1\] must be in \[0, T=5\), got -1"):
        ops.build_masked_batch(ids, r, torch.tensor([0, -1]), 0)
    with pytest.raises(ValueError, match=r"positions must be \(M,\) like row_index = \(2,\), got \(3,\)"):
        ops.build_masked_batch(ids, r, torch.tensor([0, 1, 2]), 0)
    with pytest.raises(ValueError, match=r"input_ids must have dtype in \{Long\}, got Int"):
        ops.build_masked_batch(ids.int(), r, p, 0)
    with pytest.raises(ValueError, match=r"input_ids must be 2-D \(B, T\)"):
        ops.build_masked_batch(ids[0], r, p, 0)
    with pytest.raises(ValueError, match=r"row_index must have dtype in \{Long\}, got Int"):
        ops.build_masked_batch(ids, r.int(), p, 0)


# ---- bad input: one table ----------------------------------------------------------------------------------------
# Each row: (the callable, its keyword arguments, the exception, a regex of the message). Tensors are moved to the
# device under test; meta tensors stay on meta.

MB = ops.build_masked_batch
_TOK = torch.randint(0, 9, (2, 4), generator=gen(71))

#: Argument and data checks, on every device (CUDA: eager checks, the CPU's messages).
BAD_INPUT = [
    pytest.param(MB, dict(input_ids=_TOK, row_index=torch.tensor([0.0]), positions=torch.tensor([0]), pad_id=0),
                 ValueError, r"row_index must have dtype", id="row_index_dtype"),
    pytest.param(MB, dict(input_ids=_TOK, row_index=torch.tensor([0, 2]), positions=torch.tensor([0, 1]), pad_id=0),
                 ValueError, r"row_index\[1\] must be in \[0, B=2\)", id="row_index_range"),
    pytest.param(MB, dict(input_ids=_TOK, row_index=torch.tensor([0, 1]), positions=torch.tensor([4, 1]), pad_id=0),
                 ValueError, r"positions\[0\] must be in \[0, T=4\)", id="positions_range"),
]

_IDS3 = torch.zeros(1, 3, dtype=torch.long)

#: Checks of the Python wrapper's pad_id, of arguments the dispatcher sees as None, and of the fake (meta) kernel.
BAD_INPUT_CPU = [
    pytest.param(MB, dict(input_ids=_IDS3, row_index=torch.tensor([0]), positions=torch.tensor([1]), pad_id=1.7),
                 ValueError, r"pad_id must be an int, got float 1.7", id="pad_id_float"),
    pytest.param(MB, dict(input_ids=_IDS3, row_index=torch.tensor([0]), positions=torch.tensor([1]), pad_id="a"),
                 ValueError, r"pad_id must be an int, got str 'a'", id="pad_id_str"),
    pytest.param(MB, dict(input_ids=_IDS3, row_index=torch.tensor([0]), positions=torch.tensor([1]), pad_id=None),
                 ValueError, r"pad_id must be an int, got NoneType None", id="pad_id_none"),
    pytest.param(MB, dict(input_ids=_IDS3, row_index=torch.tensor([0]), positions=torch.tensor([1]), pad_id=2**63),
                 ValueError, r"pad_id must fit in int64, got 9223372036854775808", id="pad_id_too_large"),
    # An undefined tensor used to be reported as shape (0,), dtype UNKNOWN_SCALAR or "tensor does not have a device".
    pytest.param(MB, dict(input_ids=torch.zeros(1, 2, dtype=torch.long), row_index=None, positions=torch.tensor([0]),
                          pad_id=0), ValueError, r"row_index must be a tensor, got None", id="row_index_none"),
    # The fake kernel used to allocate on the first argument's device and return uninitialized memory.
    pytest.param(MB, dict(input_ids=_IDS3, row_index=torch.tensor([0], device="meta"), positions=torch.tensor([0]),
                          pad_id=0), ValueError, r"row_index must be on the same device as input_ids \(cpu\), got meta",
                 id="fake_mixed_devices"),
]


test_bad_input, test_bad_input_cpu = bad_input_tests(BAD_INPUT, BAD_INPUT_CPU)


# ---- every device (CUDA: parity with the CPU op; moved from test_cuda.py) ------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B, T, M", [(1, 1, 1), (3, 7, 10), (4, 2048, 9), (2, 5001, 33), (64, 1024, 4096)])
def test_build_masked_batch_parity(device, B, T, M):
    g = gen(B * T + M)
    ids = torch.randint(0, 50_000, (B, T), generator=g)
    rows = torch.randint(0, B, (M,), generator=g)
    pos = torch.randint(0, T, (M,), generator=g)
    cpu = ops.build_masked_batch(ids, rows, pos, 7)
    dev = ops.build_masked_batch(on(ids, device), on(rows, device), on(pos, device), 7)
    assert dev.dtype == torch.int64 and dev.shape == (M, T)
    assert torch.equal(dev.cpu(), cpu)
    assert torch.equal(cpu, ref.build_masked_batch(ids, rows, pos, 7))


@pytest.mark.parametrize("device", DEVICES)
def test_build_masked_batch_misaligned_input_and_empty(device):
    flat = on(torch.arange(1 + 6 * 8), device)
    ids = flat[1:].view(6, 8)  # even T but an 8-byte storage offset: the CUDA kernel's 8-byte copy path
    rows = on(torch.tensor([5, 0, 3]), device)
    pos = on(torch.tensor([7, 0, 4]), device)
    got = ops.build_masked_batch(ids, rows, pos, -1)
    assert torch.equal(got.cpu(), ops.build_masked_batch(ids.cpu(), rows.cpu(), pos.cpu(), -1))
    assert torch.equal(got.cpu(), ref.build_masked_batch(ids.cpu(), rows.cpu(), pos.cpu(), -1))
    empty = ops.build_masked_batch(ids, on(torch.zeros(0, dtype=torch.long), device),
                                   on(torch.zeros(0, dtype=torch.long), device), 0)
    assert empty.shape == (0, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_on_device(device):
    tok = torch.randint(0, 100, (4, 6), generator=gen(0))
    args = (tok, torch.tensor([0, 3, 3]), torch.tensor([5, 0, 2]))
    torch.library.opcheck(torch.ops.oar.build_masked_batch.default, tuple(a.to(device) for a in args) + (9,))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_wrapper_fullgraph(backend):
    """oar.ops.build_masked_batch traces into one graph (pad_id coerced at trace time) and gives the eager values."""
    torch._dynamo.reset()
    ids = torch.randint(0, 1000, (3, 11), generator=gen(4))
    rows, pos = torch.tensor([2, 0, 1, 2]), torch.tensor([10, 0, 5, 3])

    def f(i, r, p):
        return ops.build_masked_batch(i, r, p, pad_id=151643), ops.build_masked_batch(i, r, p, 0)

    for g, e in zip(torch.compile(f, backend=backend, fullgraph=True)(ids, rows, pos), f(ids, rows, pos)):
        assert torch.equal(g, e)
