"""RMSNorm (Zhang & Sennrich 2019) as used by DeepSeek, Qwen3 and Kimi: fp32 math, weight applied
after casting back to the input dtype (HF ``DeepseekV3RMSNorm`` order)."""

from __future__ import annotations

from typing import NamedTuple

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


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """:func:`rms_norm` (or, with ``residual``, :func:`add_rms_norm`, returning (normed, x + residual)) in
    one Triton launch on CUDA when the weight has x's dtype and no autograd is needed (the kernel has no
    backward; drafter training keeps the reference), else the reference. Decode is launch-bound: the
    reference is eight launches."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                              (residual is not None and residual.requires_grad))
    if x.is_cuda and weight.dtype == x.dtype and not needs_grad:
        from longflash.layers.norm_triton import add_rms_norm_triton, rms_norm_triton
        if residual is not None:
            return add_rms_norm_triton(x, residual, weight, eps)
        return rms_norm_triton(x, weight, eps)
    if residual is not None:
        return add_rms_norm(x, residual, weight, eps)
    return rms_norm(x, weight, eps)


class PreNorm(NamedTuple):
    """A pending pre-norm: the consumer of a sub-layer input x takes ``rms_norm(x + residual)`` (or
    ``rms_norm(x)`` without a residual) as its input, and the residual stream becomes ``x + residual``.
    A kernel that reads x anyway normalizes it in its prologue (the one-token GEMV, ``gemv.linear_prenorm``;
    the one-token MoE kernel): at batch 1 that saves the norm's own launch, ~2-3 µs on an H200 (session 28,
    ``benchmarks/NOTES.md``). Same rounding points as :func:`add_rms_norm`; only the order of the
    mean-square's fp32 sum differs.

    Fields: ``weight`` [H] (x's dtype for the fused kernels), ``eps``, ``residual`` [..., H] of x's shape and
    dtype or None."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None

    def apply(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm in its own launch (:func:`norm`), for a consumer that does not fuse it: x [..., H] ->
        (normed [..., H], the residual stream ``x + residual``, or x itself without a residual)."""
        if self.residual is None:
            return norm(x, self.weight, self.eps), x
        return norm(x, self.weight, self.eps, self.residual)

    def reference(self, x: torch.Tensor, residual_out: torch.Tensor | None = None) -> torch.Tensor:
        """The normed x by the PyTorch reference (:func:`add_rms_norm` / :func:`rms_norm`), for the
        references of the fusing kernels; writes ``x + residual`` into ``residual_out`` (given iff there is
        a residual: :meth:`check`)."""
        self.check(x, residual_out)
        if self.residual is None:
            return rms_norm(x, self.weight, self.eps)
        h, s = add_rms_norm(x, self.residual, self.weight, self.eps)
        residual_out.copy_(s)
        return h

    def normalized_fp32(self, x: torch.Tensor, residual_out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 ``s · rsqrt(mean(s^2) + eps) · weight``, s = x + residual rounded to x's dtype (or x), with no
        rounding of the result to x's dtype: the reference of the GEMV's prologue (``gemv.gemv_ref``), which
        applies the scale to its output. Writes s into ``residual_out`` (as :meth:`reference`)."""
        self.check(x, residual_out)
        s = x if self.residual is None else x + self.residual
        if residual_out is not None:
            residual_out.copy_(s)
        sf = s.float()
        return sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()

    def check(self, x: torch.Tensor, residual_out: torch.Tensor | None = None) -> None:
        """ValueError unless the weight is [H] of x's dtype, the residual (if any) has x's shape and dtype,
        and ``residual_out`` (what a fusing kernel writes ``x + residual`` into) is a contiguous tensor of x's
        shape and dtype given exactly when there is a residual."""
        H = x.shape[-1]
        if tuple(self.weight.shape) != (H,) or self.weight.dtype != x.dtype:
            raise ValueError(f"pre-norm weight must be [{H}] of x's dtype {x.dtype}, got "
                             f"{tuple(self.weight.shape)} {self.weight.dtype}")
        if self.residual is not None and (self.residual.shape != x.shape or self.residual.dtype != x.dtype):
            raise ValueError(f"residual {tuple(self.residual.shape)} {self.residual.dtype} must match x "
                             f"{tuple(x.shape)} {x.dtype}")
        if (self.residual is None) != (residual_out is None):
            raise ValueError("residual_out must be given exactly when the pre-norm has a residual")
        if residual_out is not None and (residual_out.shape != x.shape or residual_out.dtype != x.dtype
                                         or not residual_out.is_contiguous()):
            raise ValueError(f"residual_out must be a contiguous {tuple(x.shape)} {x.dtype} tensor, got "
                             f"{tuple(residual_out.shape)} {residual_out.dtype}")


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``rms_norm(x)``; with ``residual``, :func:`add_rms_norm` (returns (normed, x + residual))."""
        return norm(x, self.weight, self.eps, residual)

    def pending(self, residual: torch.Tensor | None = None) -> PreNorm:
        """This norm (after the add of ``residual``) as a :class:`PreNorm` for the next sub-layer to fuse."""
        return PreNorm(self.weight, self.eps, residual)
