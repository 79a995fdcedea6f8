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


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One launch instead of eight (decode is launch-bound); the kernel has no backward, so autograd
        # (drafter training) keeps the reference.
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if x.is_cuda and self.weight.dtype == x.dtype and not needs_grad:
            from longflash.layers.norm_triton import rms_norm_triton
            return rms_norm_triton(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)
