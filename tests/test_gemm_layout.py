"""The fused gate_up weight's layout choice (layers/gemm_layout.py, GatedMLP.fuse_gate_up)."""

import pytest
import torch

from longflash.layers import gemm_layout, gemv, mlp
from longflash.layers.mlp import GatedMLP


def _mlp(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    return GatedMLP(64, 48).to(device=device, dtype=dtype)


@pytest.mark.parametrize("kn", [False, True])
def test_fused_gate_up_equals_unfused_in_either_layout(monkeypatch, kn):
    """Whichever layout the timing picks, the fused MLP computes what the unfused one did, the
    parameters are views of the one fused tensor, and the [K, N] choice really stores [H, 2·I]."""
    monkeypatch.setattr(mlp, "kn_layout_faster", lambda *a: kn)
    monkeypatch.setattr(gemv, "enabled", False)  # the layout is asked only when cuBLAS runs one-token GEMMs
    m = _mlp()
    x = torch.randn(5, 64)
    ref = m(x)
    m.fuse_gate_up()
    w = m.gate_up_weight
    assert w.shape == (96, 64) and m.gate_proj.weight.data_ptr() == w.data_ptr()
    assert m.up_proj.weight.data_ptr() == w[48:].data_ptr()
    assert w.t().is_contiguous() == kn and w.is_contiguous() == (not kn)
    torch.testing.assert_close(m(x), ref, rtol=1e-6, atol=1e-6)


def test_gemv_on_keeps_the_nk_layout(monkeypatch):
    """With the few-row Triton GEMV on, the fused weight stays [2·I, H] row-major whatever cuBLAS's timing
    would say (the GEMV reads it along K)."""
    monkeypatch.setattr(mlp, "kn_layout_faster", lambda *a: True)
    monkeypatch.setattr(gemv, "enabled", True)
    m = _mlp()
    m.fuse_gate_up()
    assert m.gate_up_weight.is_contiguous()


def test_layout_choice_is_off_the_gpu_false():
    assert gemm_layout.kn_layout_faster(1024, 2048, torch.bfloat16, "cpu") is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layout_choice_on_gpu_and_fused_output(monkeypatch):
    """On the GPU the choice is timed (a bool, cached per shape) and the fused bf16 MLP matches the
    unfused one within bf16 rounding at the benchmark model's shared-expert shape."""
    choice = gemm_layout.kn_layout_faster(1024, 2048, torch.bfloat16, "cuda:0")
    assert isinstance(choice, bool)
    assert gemm_layout.kn_layout_faster(1024, 2048, torch.bfloat16, "cuda:0") is choice
    monkeypatch.setattr(gemv, "enabled", False)  # cuBLAS runs the one-token GEMM: its layout is timed
    torch.manual_seed(0)
    m = GatedMLP(2048, 512).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16)
    ref = m(x).float()
    m.fuse_gate_up()
    assert m.gate_up_weight.t().is_contiguous() == choice
    assert (m(x).float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
