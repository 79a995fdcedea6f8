"""Gated activations of the MLPs: SwiGLU (SiLU gate) and Kimi-K3's SiTU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


# dtypes the fused kernel takes (fp32 math inside); others use the reference
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _use_triton(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """The one-launch kernel (``activation_triton``) serves CUDA tensors of one dtype and shape when no
    gradient is needed (it has no backward: drafter training keeps the reference)."""
    needs_grad = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    return (gate.is_cuda and up.is_cuda and gate.dtype == up.dtype and gate.dtype in _TRITON_DTYPES
            and gate.shape == up.shape and not needs_grad)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` (Shazeer 2020). Shapes equal, any float dtype.

    On CUDA: one Triton launch (``activation_triton.silu_and_mul_triton``, fp32 math, one rounding);
    elsewhere :func:`silu_and_mul_ref`."""
    if _use_triton(gate, up):
        from longflash.layers.activation_triton import silu_and_mul_triton
        return silu_and_mul_triton(gate, up)
    return silu_and_mul_ref(gate, up)


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`silu_and_mul` (two PyTorch ops, each rounding to the input dtype)."""
    return F.silu(gate) * up


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Kimi-K3 SiTU: ``beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)``.

    Source: ``shared/specs/kimi_k3_checkpoint.md`` §5 (betas from ``activation_situ_beta`` and
    ``activation_situ_linear_beta``, 4 and 25 in Kimi-K3). gate, up: [..., I] of one shape.
    On CUDA: one Triton launch (``activation_triton.situ_and_mul_triton``, fp32 math, one rounding);
    elsewhere :func:`situ_and_mul_ref`.
    """
    if _use_triton(gate, up):
        from longflash.layers.activation_triton import situ_and_mul_triton
        return situ_and_mul_triton(gate, up, beta, linear_beta)
    return situ_and_mul_ref(gate, up, beta, linear_beta)


def situ_and_mul_ref(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0,
                     linear_beta: float = 25.0) -> torch.Tensor:
    """Reference of :func:`situ_and_mul` (eight PyTorch ops, each rounding to the input dtype)."""
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))


def get_act_and_mul(config: dict):
    """The gated activation named by ``hidden_act`` in an HF config dict.

    Raises ValueError for an activation the engine does not implement.
    """
    act = config.get("hidden_act", "silu")
    if act in ("silu", "swiglu"):
        return silu_and_mul
    if act == "situ":
        beta = float(config.get("activation_situ_beta", 4.0))
        lbeta = float(config.get("activation_situ_linear_beta", 25.0))
        return lambda g, u: situ_and_mul(g, u, beta, lbeta)
    raise ValueError(f"unsupported config value hidden_act={act!r}; supported: silu, situ")
