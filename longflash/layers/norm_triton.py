"""RMSNorm in one Triton kernel; same signature and result as :func:`longflash.layers.norm.rms_norm`.

The reference is eight small elementwise/reduction launches per call (upcast, square, mean, add, rsqrt,
multiply, downcast, weight); in a decode step of a few tokens each is launch-bound, and a model calls
RMSNorm 4-5 times per layer. Here one program normalizes BLOCK_ROWS rows: fp32 mean of squares, fp32
``x * rsqrt(mean + eps)``, rounded to x's dtype, then multiplied by the weight in x's dtype (the product
of two bf16 values is exact in fp32, so the single rounding equals PyTorch's bf16 multiply). Only the
mean's summation order differs from the reference. Used on CUDA tensors when the weight has x's dtype
(``norm.RMSNorm``); anything else takes the reference. With a residual (:func:`add_rms_norm_triton`) the
same launch first adds the residual stream and writes the sum (vLLM's fused_add_rms_norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longflash.ops.triton_pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_for


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, D, stride_x, stride_o, eps, res_ptr, res_out_ptr, stride_r,
                     BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n_rows
    cmask = cols < D
    m = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)  # a weight: readable before gdc_wait
    if PDL:  # programmatic dependent launch (triton_env.pdl_enabled): x is the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # s = x + residual rounded to the dtype (a PyTorch add), kept as the new residual
        r = tl.load(res_ptr + r64[:, None] * stride_r + cols[None, :], mask=m, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + r64[:, None] * D + cols[None, :], s, mask=m)
        x = s.to(tl.float32)
    ms = tl.sum(x * x, axis=1) / D
    y = x * tl.math.rsqrt(ms + eps)[:, None]
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32) * w[None, :]
    tl.store(out_ptr + r64[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    t2 = t.reshape(-1, D)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None):
    D = x.shape[-1]
    if weight.shape != (D,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{D}] of x's dtype {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    x2 = _rows(x, D)
    out = torch.empty((x2.shape[0], D), dtype=x.dtype, device=x.device)
    r2 = _rows(residual, D) if residual is not None else x2
    res_out = torch.empty_like(out) if residual is not None else out
    n = x2.shape[0]
    if n:
        BLOCK_D = triton.next_power_of_2(D)
        BLOCK_ROWS = max(1, min(16, 4096 // BLOCK_D))
        pdl = pdl_for(x.device)
        _rms_norm_kernel[(triton.cdiv(n, BLOCK_ROWS),)](x2, weight, out, n, D, x2.stride(0), out.stride(0), float(eps),
                                                        r2, res_out, r2.stride(0), BLOCK_D=BLOCK_D,
                                                        BLOCK_ROWS=BLOCK_ROWS, HAS_RESIDUAL=residual is not None,
                                                        PDL=pdl, num_warps=4 if BLOCK_D <= 2048 else 8,
                                                        **launch_options(pdl))
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of :func:`longflash.layers.norm.rms_norm`: x [..., H], weight [H] of x's dtype.

    Returns [..., H] in x's dtype. Raises ValueError when the weight's shape or dtype does not match."""
    return _launch(x, weight, eps, None)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`longflash.layers.norm.add_rms_norm` (same arguments and result): one launch
    reads x and residual, writes ``s = x + residual`` (rounded to x's dtype) and the norm of s.

    Returns (normed, s), both [..., H] in x's dtype. Raises ValueError when residual's shape or dtype
    differs from x's, or the weight's from [H] of x's dtype."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    return _launch(x, weight, eps, residual)
