"""The Block AttnRes mixer in one Triton kernel; same signature and result as
:func:`longflash.layers.attn_res.attn_res_mix_reference`.

Why: the reference is about 18 small launches per call (upcast and stack the S sources, square, mean,
rsqrt, multiply, dot with the pseudo-query, softmax, weighted sum, downcast, copy into ``out``); a decode
step of a few tokens calls the mixer twice per layer, so each call is launch-bound. Here one launch
computes, per token row, for the S sources in order (``shared/specs/attnres_kimi.md``, "The mixer"):

    q = w * g                                  (fp32, [H]; loaded by every program, never materialised)
    s_j = (sum_d q[d] * x_j[d]) * rsqrt(mean_d(x_j^2) + eps)
    out = sum_j softmax_j(s)_j * x_j           (fp32, rounded once to the sources' dtype)

The softmax is the online (running max) form of Milakov & Gimelshein, "Online normalizer calculation
for softmax" (2018): each source row is read once, its score computed, and the fp32 accumulator and
normaliser rescaled by ``exp(m_old - m_new)``; the result is ``acc / l``. Only the fp32 summation order
differs from the reference (relative error a few fp32 ulps of ``sum_j p_j |x_j|``).

Sources are separate tensors (views into the AttnRes pool, or separate allocations with reuse off): they
go to the kernel as a tuple of pointers and a tuple of row strides, ordinary kernel arguments, so a CUDA
graph captures them like any other launch (no pointer table in device memory, no host-to-device copy).
The source count S is a constexpr: one compiled variant per S (Kimi-K3: S <= 9, the default model: S <= 5).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longflash.layers.attn_res import check_rows


@triton.jit
def mix_sources_online(src_ptrs, src_strides, q, r64, cols, mask, H, eps, S: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_ROWS: tl.constexpr):
    """The online softmax over S source rows of one token tile (shared with the two-phase kernel):
    rows ``r64`` [BLOCK_ROWS] (int64) and columns ``cols`` [BLOCK_H] of the sources ``src_ptrs[j]``
    (row stride ``src_strides[j]``), pseudo-query ``q`` [BLOCK_H] fp32. Returns (m, l, acc): the
    running max and normaliser [BLOCK_ROWS] and the unnormalised sum [BLOCK_ROWS, BLOCK_H], fp32."""
    m = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_ROWS,), tl.float32)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_H), tl.float32)
    for j in tl.static_range(S):
        x = tl.load(src_ptrs[j] + r64[:, None] * src_strides[j] + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        ms = tl.sum(x * x, axis=1) / H
        s = tl.sum(x * q[None, :], axis=1) * tl.math.rsqrt(ms + eps)
        m_new = tl.maximum(m, s)
        alpha = tl.exp(m - m_new)  # 0 for the first source (m = -inf)
        p = tl.exp(s - m_new)
        acc = acc * alpha[:, None] + p[:, None] * x
        l = l * alpha + p
        m = m_new
    return m, l, acc


@triton.jit
def _attn_res_mix_kernel(src_ptrs, src_strides, g_ptr, w_ptr, out_ptr, n_rows, H, stride_o, eps,
                         S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    rmask = rows < n_rows
    cmask = cols < H
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    q = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) * \
        tl.load(g_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    m, l, acc = mix_sources_online(src_ptrs, src_strides, q, r64, cols, mask, H, eps, S, BLOCK_H, BLOCK_ROWS)
    y = acc / l[:, None]
    tl.store(out_ptr + r64[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _tile(H: int, T: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_ROWS, num_warps) for T rows of width H: a whole row per program, up to 16 rows
    and 4096 elements per tile (no more rows than T), 512 elements per warp (2 to 16 warps). The
    compiler issues every source's load up front (good for latency at decode sizes), so a thread holds
    up to S x tile / (32 x num_warps) loaded elements: sm_90 compilation (ptxas -v, strides divisible
    by 16) uses 46-64 registers without spills at H 256 (S 5) and 128 registers with 192 bytes of
    spills at H 7168 (S 9, 16 warps). Chosen without a GPU; ``benchmarks/attn_res_kernel.py`` times
    alternatives."""
    block_h = triton.next_power_of_2(H)
    block_rows = max(1, min(16, 4096 // block_h, triton.next_power_of_2(max(T, 1))))
    return block_h, block_rows, min(16, max(2, block_h * block_rows // 512))


def attn_res_mix_triton(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                        eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`longflash.layers.attn_res.attn_res_mix_reference`.

    Args:
        sources: S >= 1 tensors [T, H] of one float dtype and device (committed bank slots in order, then
            the prefix); rows may have any stride, elements must be contiguous (``stride(-1) == 1``).
        norm_weight: [H] (g). proj_weight: [1, H] or [H] (w). Any float dtype; multiplied in fp32.
        eps: rms_norm_eps.
        out: optional [T, H] buffer of the sources' dtype with contiguous elements; must not overlap a
            source row other than its own (the mixers of the AttnRes plan never write over a source).
    Returns:
        [T, H] in the sources' dtype (``out`` when given). With one source every p is exactly 1, so the
        result equals that source.
    Raises:
        ValueError naming the argument on an empty source list, mismatched shapes/dtypes/devices,
        weights without H elements, an ``out`` of the wrong shape/dtype/device, or a strided last dim.
    """
    T, H = check_rows(sources, "source", "attn_res_mix")
    x0 = sources[0]
    for i, s in enumerate(sources):
        if s.stride(-1) != 1 and H > 1:
            raise ValueError(f"source {i} has element stride {s.stride(-1)}; the kernel needs contiguous rows")
    g, w = norm_weight.reshape(-1), proj_weight.reshape(-1)
    if g.numel() != H or w.numel() != H or g.device != x0.device or w.device != x0.device:
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} and proj_weight {tuple(proj_weight.shape)} "
                         f"must have H={H} elements on {x0.device}")
    g, w = g.contiguous(), w.contiguous()
    if out is None:
        out = torch.empty((T, H), dtype=x0.dtype, device=x0.device)
    elif out.shape != x0.shape or out.dtype != x0.dtype or out.device != x0.device or (out.stride(-1) != 1 and H > 1):
        raise ValueError(f"out must be a [{T}, {H}] {x0.dtype} buffer on {x0.device} with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}")
    if T == 0 or H == 0:
        return out
    block_h, block_rows, num_warps = _tile(H, T)
    _attn_res_mix_kernel[(triton.cdiv(T, block_rows),)](
        tuple(sources), tuple(s.stride(0) for s in sources), g, w, out, T, H, out.stride(0), float(eps),
        S=len(sources), BLOCK_H=block_h, BLOCK_ROWS=block_rows, num_warps=num_warps)
    return out
