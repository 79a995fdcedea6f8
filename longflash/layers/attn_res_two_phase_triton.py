"""The two-phase Block AttnRes mixer in Triton; same signatures and results as
:func:`longflash.layers.attn_res_two_phase.attn_res_block_partials_reference` (phase 1, one launch per
block) and :func:`~longflash.layers.attn_res_two_phase.attn_res_merge_prefix_reference` (phase 2, one
launch per mixer). The math and its source are in ``attn_res_two_phase``'s docstring.

Phase 1: program ``pid`` handles query ``pid % Q`` for the token tile ``pid // Q`` (Q consecutive
programs share a tile, so the committed rows they all read come from L2 after the first). Per token
row, over the C committed rows in order, the online softmax of the one-phase kernel
(``attn_res_triton``; Milakov & Gimelshein 2018): running max m, normaliser l, fp32 accumulator
rescaled by ``exp(m_old - m_new)``; stores ``acc / l`` and ``lse = m + log l``. The committed rows go
to the kernel as a tuple of pointers and row strides (C is a constexpr, one compiled variant per C:
Kimi-K3 C <= 8), so CUDA graphs capture it like any other launch.

Phase 2: one program per token tile reads the query's fp32 partial row, its lse and the prefix row,
computes the prefix's score, merges (``m = max(lse, s_p)``, weights ``e^{lse-m}``, ``e^{s_p-m}``) and
stores the normalised result in the prefix's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longflash.layers.attn_res_triton import _tile, mix_sources_online
from longflash.layers.attn_res_two_phase import AttnResPartials, _check_block_args, _check_merge_args


@triton.jit
def _block_partials_kernel(src_ptrs, src_strides, g_ptr, w_ptr, acc_ptr, lse_ptr, n_rows, H, Q, eps,
                           C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    pid = tl.program_id(0)
    qi = pid % Q
    rows = (pid // Q) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    rmask = rows < n_rows
    cmask = cols < H
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    q64 = qi.to(tl.int64)
    q = tl.load(w_ptr + q64 * H + cols, mask=cmask, other=0.0).to(tl.float32) * \
        tl.load(g_ptr + q64 * H + cols, mask=cmask, other=0.0).to(tl.float32)
    m, l, acc = mix_sources_online(src_ptrs, src_strides, q, r64, cols, mask, H, eps, C, BLOCK_H, BLOCK_ROWS)
    base = q64 * n_rows + r64
    tl.store(acc_ptr + base[:, None] * H + cols[None, :], acc / l[:, None], mask=mask)
    tl.store(lse_ptr + base, m + tl.log(l), mask=rmask)


@triton.jit
def _merge_prefix_kernel(acc_ptr, stride_acc, lse_ptr, x_ptr, stride_x, g_ptr, w_ptr, out_ptr, stride_o,
                         n_rows, H, eps, BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    rmask = rows < n_rows
    cmask = cols < H
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    q = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) * \
        tl.load(g_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    acc = tl.load(acc_ptr + r64[:, None] * stride_acc + cols[None, :], mask=mask, other=0.0)
    lse = tl.load(lse_ptr + r64, mask=rmask, other=0.0)
    ms = tl.sum(x * x, axis=1) / H
    s = tl.sum(x * q[None, :], axis=1) * tl.math.rsqrt(ms + eps)
    m = tl.maximum(lse, s)
    a = tl.exp(lse - m)
    b = tl.exp(s - m)
    y = (acc * a[:, None] + x * b[:, None]) / (a + b)[:, None]
    tl.store(out_ptr + r64[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def attn_res_block_partials_triton(committed, norm_weights: torch.Tensor, proj_weights: torch.Tensor,
                                   eps: float) -> AttnResPartials:
    """Triton version of :func:`~longflash.layers.attn_res_two_phase.attn_res_block_partials_reference`.

    Args:
        committed: C >= 1 tensors [T, H] of one float dtype and device, contiguous elements (rows may be
            strided, e.g. views of the AttnRes pool).
        norm_weights: [Q, H] (g). proj_weights: [Q, H] or [Q, 1, H] (w). Any float dtype; fp32 products.
        eps: rms_norm_eps.
    Returns:
        AttnResPartials(acc [Q, T, H] fp32 contiguous, lse [Q, T] fp32).
    Raises:
        ValueError as the reference, and on a committed row whose elements are not contiguous.
    """
    T, H, Q = _check_block_args(committed, norm_weights, proj_weights)
    for j, x in enumerate(committed):
        if x.stride(-1) != 1 and H > 1:
            raise ValueError(f"committed row {j} has element stride {x.stride(-1)}; the kernel needs contiguous rows")
    dev = committed[0].device
    acc = torch.empty((Q, T, H), dtype=torch.float32, device=dev)
    lse = torch.empty((Q, T), dtype=torch.float32, device=dev)
    if T == 0 or H == 0:
        return AttnResPartials(acc, lse)
    g = norm_weights.reshape(Q, H).contiguous()
    w = proj_weights.reshape(Q, H).contiguous()
    block_h, block_rows, num_warps = _tile(H, T)
    _block_partials_kernel[(triton.cdiv(T, block_rows) * Q,)](
        tuple(committed), tuple(x.stride(0) for x in committed), g, w, acc, lse, T, H, Q, float(eps),
        C=len(committed), BLOCK_H=block_h, BLOCK_ROWS=block_rows, num_warps=num_warps)
    return AttnResPartials(acc, lse)


def attn_res_merge_prefix_triton(partial: AttnResPartials, prefix: torch.Tensor, norm_weight: torch.Tensor,
                                 proj_weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`~longflash.layers.attn_res_two_phase.attn_res_merge_prefix_reference`.

    Args and result as the reference; ``partial.acc``, ``prefix`` and ``out`` need contiguous elements
    (rows may be strided). ``out`` may be the prefix's own storage only if nothing reads the prefix
    afterwards (each program reads its rows before writing them). Raises ValueError as the reference and
    on a strided last dimension.
    """
    T, H = _check_merge_args(partial, prefix, norm_weight, proj_weight, out)
    acc, lse = partial
    for name, t in (("partial.acc", acc), ("prefix", prefix), ("out", out)):
        if t is not None and t.stride(-1) != 1 and H > 1:
            raise ValueError(f"{name} has element stride {t.stride(-1)}; the kernel needs contiguous rows")
    if out is None:
        out = torch.empty((T, H), dtype=prefix.dtype, device=prefix.device)
    if T == 0 or H == 0:
        return out
    lse = lse.contiguous()
    g, w = norm_weight.reshape(-1).contiguous(), proj_weight.reshape(-1).contiguous()
    block_h, block_rows, num_warps = _tile(H, T)
    _merge_prefix_kernel[(triton.cdiv(T, block_rows),)](
        acc, acc.stride(0), lse, prefix, prefix.stride(0), g, w, out, out.stride(0), T, H, float(eps),
        BLOCK_H=block_h, BLOCK_ROWS=block_rows, num_warps=num_warps)
    return out
