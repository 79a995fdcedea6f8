"""RMSNorm (Zhang & Sennrich 2019) as used by DeepSeek, Qwen3 and Kimi: fp32 math, weight applied
after casting back to the input dtype (HF ``DeepseekV3RMSNorm`` order)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim.

    Args:
        x: [..., H] any float dtype. weight: [H]. eps: added to the mean square.
    Returns:
        [..., H] in x's dtype (weight multiplies the result cast back to x's dtype).
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add before a pre-norm sublayer, and the norm: ``s = x + residual`` (rounded to x's
    dtype, as a PyTorch add), then :func:`rms_norm` of ``s``. The convention of vLLM's
    ``fused_add_rms_norm``: a decoder layer carries the residual stream separately so the add joins the
    next norm (one launch on the GPU, ``norm_triton.add_rms_norm_triton``).

    Args:
        x: [..., H] a sublayer's output. residual: the residual stream, x's shape and dtype.
        weight: [H]. eps: added to the mean square.
    Returns:
        (normed [..., H], s [..., H]), both in x's dtype.
    Raises:
        ValueError when residual's shape or dtype differs from x's.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    s = x + residual
    return rms_norm(s, weight, eps), s


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``rms_norm(x)``; with ``residual``, :func:`add_rms_norm` (returns (normed, x + residual))."""
        # One launch instead of eight (decode is launch-bound); the kernel has no backward, so autograd
        # (drafter training) keeps the reference.
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad or
                                                  (residual is not None and residual.requires_grad))
        if x.is_cuda and self.weight.dtype == x.dtype and not needs_grad:
            from longflash.layers.norm_triton import add_rms_norm_triton, rms_norm_triton
            if residual is not None:
                return add_rms_norm_triton(x, residual, self.weight, self.eps)
            return rms_norm_triton(x, self.weight, self.eps)
        if residual is not None:
            return add_rms_norm(x, residual, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)
