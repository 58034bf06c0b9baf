"""CUDA implementations vs the CPU ones (and the reference). Skipped, with the reason printed, where no GPU
is present; on a GPU machine they must pass. Run with `pytest -rs` to see the skip reasons."""

import pytest
import torch

import oar
from oar import ops, reference

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
requires_kernels = pytest.mark.skipif(not oar.has_cuda_kernels(),
                                      reason="oar was built without CUDA kernels (no nvcc at build time)")


def test_build_info_reports_cuda_state():
    info = oar.build_info()
    assert info["cuda_ops_registered"] == oar.has_cuda_kernels()
    if info["cuda_ops_registered"]:
        assert info["cuda_kernels"] and info["torch_cuda_built_against"]


@requires_gpu
@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H", [1, 7, 64, 576, 1000])
def test_grad_x_input_cuda_matches_cpu(dtype, H):
    g = torch.Generator().manual_seed(H)
    grad = torch.randn(3, 41, H, generator=g).to(dtype)
    inp = torch.randn(3, 41, H, generator=g).to(dtype)
    cpu = ops.grad_x_input(grad, inp)
    gpu = ops.grad_x_input(grad.cuda(), inp.cuda())
    assert gpu.device.type == "cuda" and gpu.dtype == torch.float32
    bound = 1e-5 * (grad.float().abs() * inp.float().abs()).sum(-1) + 1e-6
    assert ((gpu.cpu() - cpu).abs() <= bound).all()
    torch.testing.assert_close(gpu.cpu().double(), reference.grad_x_input(grad, inp), rtol=1e-4, atol=1e-4)


@requires_gpu
@requires_kernels
def test_grad_x_input_cuda_opcheck_and_noncontiguous():
    x = torch.randn(2, 8, 16, device="cuda").transpose(0, 1)
    y = torch.randn(2, 8, 16, device="cuda").transpose(0, 1)
    torch.testing.assert_close(ops.grad_x_input(x, y).cpu(), ops.grad_x_input(x.cpu(), y.cpu()), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.oar.grad_x_input.default, (torch.randn(2, 3, 16, device="cuda"),
                                                                 torch.randn(2, 3, 16, device="cuda")))


@requires_gpu
@requires_kernels
def test_grad_x_input_cuda_device_mismatch_names_argument():
    with pytest.raises(ValueError, match="input must be on the same device as grad"):
        ops.grad_x_input(torch.randn(1, 2, 4, device="cuda"), torch.randn(1, 2, 4))
