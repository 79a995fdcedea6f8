"""Few-row products ``y = x · W^T``: the reference, and the dispatch the layers call (``linear``).

At batch 1 (and small verify batches) a decode step's dense projections are matrix-vector products;
on a GPU they go to :mod:`longflash.layers.gemv_triton`, which spreads the weight over every SM (cuBLAS
leaves most of them idle at these shapes). Everything else is ``F.linear`` / ``torch.matmul``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows of x up to which a CUDA product takes the Triton kernel (``gemv_triton.MAX_ROWS`` at most), and the
# largest weight (N · K elements) it takes at two rows. H200 sweep (``benchmarks/results/gemv.h200.md``):
# at one row the kernel beat or tied cuBLAS at every K-contiguous shape (2 MB to the 530 MB LM head); at two
# rows it won at every per-layer shape of the benchmark model (≤ 9.4 MB) but lost on the 29 MB DeepSeek-V3
# o_proj shard, the 67 MB dense gate_up and the LM head; at four rows it lost at most shapes.
GEMV_MAX_ROWS = 2
GEMV_TWO_ROW_MAX_WEIGHT = 1 << 23  # 8.4 M elements (16 MB in bf16): every per-layer weight of the benchmark model
enabled = True
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # of x and w, in the reference and the kernel


def gemv_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y[b] = x[b] · w[b]^T`` in fp32, rounded once to x's dtype (the reference of ``gemv_triton``).

    Args:
        x: [M, K] or [B, M, K], bf16 / fp16 / fp32 (``DTYPES``), any strides.
        w: [N, K] or [B, N, K], x's dtype.
        out: optional [M, N] / [B, M, N] of x's dtype receiving y.
    Returns:
        y [M, N] / [B, M, N] in x's dtype (``out`` when given).
    Raises:
        ValueError on mismatched shapes or dtypes.
    """
    if x.dim() not in (2, 3) or w.dim() != x.dim() or w.shape[-1] != x.shape[-1] or \
            (x.dim() == 3 and w.shape[0] != x.shape[0]):
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} do not match (both 2-D or both 3-D, same K "
                         "and batch)")
    if w.dtype != x.dtype or x.dtype not in DTYPES:
        raise ValueError(f"x and w must share a dtype of {DTYPES}, got {x.dtype} and {w.dtype}")
    y = torch.matmul(x.float(), w.float().transpose(-1, -2)).to(x.dtype)
    return y if out is None else _check_out(out, y).copy_(y)


def _check_out(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``out`` if it has y's shape and dtype, else ValueError."""
    if out.shape != y.shape or out.dtype != y.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be {tuple(y.shape)} {y.dtype}")
    return out


def use_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x · w^T`` goes to the Triton kernel: CUDA, one row (or two with a weight of at most
    ``GEMV_TWO_ROW_MAX_WEIGHT`` elements per batch entry), a 16-bit dtype shared by both, w contiguous
    along K (its programs split N; a [K, N]-stored weight would leave the GPU idle), and no autograd (the
    kernel has no backward)."""
    rows = x.shape[-2]
    return (enabled and x.is_cuda and 0 < rows <= GEMV_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == x.dtype and w.stride(-1) == 1
            and (rows == 1 or w.shape[-1] * w.shape[-2] <= GEMV_TWO_ROW_MAX_WEIGHT)
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias) for x [..., K], w [N, K]: few-row CUDA products through the Triton GEMV,
    the rest through cuBLAS. Returns [..., N] in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if use_gemv(x2, w):
        from longflash.layers.gemv_triton import gemv_triton
        return gemv_triton(x2, w).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)


def bmm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head products ``y[b] = x[b] · w[b]^T`` for x [B, M, K], w [B, N, K] (any strides): few-row
    CUDA products through the Triton GEMV (written straight into ``out``, a [B, M, N] view, when
    given), the rest through ``torch.matmul``. Returns [B, M, N] in x's dtype. Raises ValueError for an
    ``out`` of another shape or dtype (both paths)."""
    if use_gemv(x, w):
        from longflash.layers.gemv_triton import gemv_triton
        return gemv_triton(x, w, out)
    y = torch.matmul(x, w.transpose(-1, -2))
    return y if out is None else _check_out(out, y).copy_(y)
