"""Few-row matrix products ``y = x · W^T`` (M ≤ 8 rows of x) in one Triton kernel, split over the output
features across the whole GPU; same signature and result as :func:`longflash.layers.gemv.gemv_ref`.

Why: at batch 1 a decode step's dense projections read 2–9 MB of weights each, and cuBLAS runs them
with 64-wide output tiles and no split of K, so a [1, 2048] × [2048, 2112] product occupies ~33 of the
H200's 132 SMs and reaches 0.37–0.45 of the copy bandwidth (``benchmarks/results/e2e_decode_op_shapes
.h200.md``). Here one program owns ``BLOCK_N`` output features of one batch entry and walks all of K
in ``BLOCK_K`` steps: a few hundred programs stream the weight once, each keeps fp32 partial products
[BLOCK_M, BLOCK_N, BLOCK_K] in registers and reduces over K once at the end. Any strides: W may be
[N, K] row-major (``nn.Linear``), the transposed view of a [K, N] tensor, or a per-head batch of
either (MLA's absorbed ``W_UK`` / ``W_UV``); y may be a strided view (a slice of a wider buffer).
On sm_90+ the kernel is launched with programmatic dependent launch (``triton_env.pdl_enabled``): its
first weight step loads while the previous kernel finishes.
Accumulation is fp32 with one rounding to the output dtype, as cuBLAS; only the summation order
differs. Deterministic (no atomics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from longflash.layers.gemv import DTYPES
from longflash.ops.triton_env import interpreting
from longflash.ops.triton_pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_for

MAX_ROWS = 8  # rows of x this kernel takes; more go to cuBLAS


@dataclass(frozen=True)
class GemvConfig:
    """Tile of one program: ``block_n`` output features × ``block_k`` of K per step, ``num_warps``."""

    block_n: int
    block_k: int
    num_warps: int

    def __str__(self) -> str:
        return f"N{self.block_n} K{self.block_k} w{self.num_warps}"


@triton.jit
def _load_w(w_base, k0, K, swk, nmask, BLOCK_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_base + offs_k[None, :] * swk, mask=nmask[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _mac(acc, x_base, w, k0, K, sxk, mmask, BLOCK_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_base + offs_k[None, :] * sxk, mask=mmask[:, None] & (offs_k < K)[None, :], other=0.0)
    return acc + x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K,
                 sxb, sxm, sxk, swb, swn, swk, syb, sym, syn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
                 PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    nmask = offs_n < N
    mmask = offs_m < M
    x_base = x_ptr + b * sxb + offs_m[:, None].to(tl.int64) * sxm
    w_base = w_ptr + b * swb + offs_n[:, None].to(tl.int64) * swn
    # The first weight step does not depend on the previous kernel: under programmatic dependent launch
    # it is in flight while that kernel finishes; x (its output) is read only after gdc_wait.
    w = _load_w(w_base, 0, K, swk, nmask, BLOCK_K)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = _mac(tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32), x_base, w, 0, K, sxk, mmask, BLOCK_K)
    if INTERPRET:  # a loop bounded by a run-time argument fails in the interpreter; the same loop as a while
        k0 = BLOCK_K
        while k0 < K:
            acc = _mac(acc, x_base, _load_w(w_base, k0, K, swk, nmask, BLOCK_K), k0, K, sxk, mmask, BLOCK_K)
            k0 += BLOCK_K
    else:
        for k0 in range(BLOCK_K, K, BLOCK_K):
            acc = _mac(acc, x_base, _load_w(w_base, k0, K, swk, nmask, BLOCK_K), k0, K, sxk, mmask, BLOCK_K)
    y = tl.sum(acc, axis=2)
    y_ptrs = y_ptr + b * syb + offs_m[:, None].to(tl.int64) * sym + offs_n[None, :] * syn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def block_m_of(m: int) -> int:
    """The padded row count of the tile (power of two ≥ m)."""
    return triton.next_power_of_2(max(m, 1))


def default_config(m: int, n: int, k: int) -> GemvConfig:
    """The tile used when none is given, from the H200 sweep of ``benchmarks/gemv.py``
    (``results/gemv.h200.md``): 2 warps, 2048 weight elements per program step at one or two rows
    (2 × 1024 at K = 2048: the fastest tile at every K-contiguous shape of the benchmark model) and
    fewer with more rows (fp32 partials of at most 64 registers per thread); ``block_k`` divides K
    when a power of two ≥ 64 does (K = 1536: 512), so no step is mostly masked. Made for weights
    contiguous along K; a [K, N]-stored weight runs correctly but slowly (programs = N / block_n)."""
    bm = block_m_of(m)
    elems = 2048 if bm <= 2 else 4096 // bm
    bk = 1024
    while bk > 64 and k % bk:
        bk //= 2
    if k % bk:
        bk = 1024
    bk = min(bk, triton.next_power_of_2(k), elems // 2)
    return GemvConfig(elems // bk, bk, 2)


def _as3(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)


def gemv_triton(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                config: GemvConfig | None = None) -> torch.Tensor:
    """Triton version of :func:`longflash.layers.gemv.gemv_ref` (same arguments and result up to the
    order of the fp32 sums): ``y[b] = x[b] · w[b]^T``.

    Args:
        x: [M, K] or [B, M, K], M ≤ ``MAX_ROWS``, bf16/fp16/fp32, any strides.
        w: [N, K] or [B, N, K] (with x's batch), x's dtype, any strides.
        out: optional [M, N] / [B, M, N] of x's dtype (may be a strided view) receiving y.
        config: the tile (default: :func:`default_config`).
    Returns:
        y [M, N] / [B, M, N] in x's dtype (``out`` when given).
    Raises:
        ValueError on mismatched shapes or dtypes, or M > ``MAX_ROWS``.
    """
    x3, w3 = _as3(x), _as3(w)
    if x.dim() not in (2, 3) or w.dim() != x.dim():
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} must both be 2-D or both 3-D")
    B, M, K = x3.shape
    if w3.shape[0] != B or w3.shape[2] != K:
        raise ValueError(f"w {tuple(w.shape)} does not match x {tuple(x.shape)} (batch and K)")
    if w.dtype != x.dtype or x.dtype not in DTYPES:
        raise ValueError(f"x and w must share a dtype of {DTYPES}, got {x.dtype} and {w.dtype}")
    if M > MAX_ROWS:
        raise ValueError(f"gemv_triton takes at most {MAX_ROWS} rows of x, got {M}")
    N = w3.shape[1]
    shape = (B, M, N) if x.dim() == 3 else (M, N)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != shape or out.dtype != x.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be {shape} {x.dtype}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    y3 = _as3(out)
    cfg = config or default_config(M, N, K)
    grid = (triton.cdiv(N, cfg.block_n), B)
    pdl = pdl_for(x.device)
    _gemv_kernel[grid](x3, w3, y3, M, N, K, *x3.stride(), *w3.stride(), *y3.stride(),
                       BLOCK_M=block_m_of(M), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       INTERPRET=interpreting(), PDL=pdl, num_warps=cfg.num_warps, **launch_options(pdl))
    return out
