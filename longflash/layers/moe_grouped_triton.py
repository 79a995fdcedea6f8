"""Grouped (fused-MoE) GEMM in Triton over stacked bf16/fp16/fp32 expert weights; same signature and
result as :func:`longflash.layers.moe_grouped.grouped_experts_ref` (fp32 accumulation; the k routed
outputs of a token are summed in fp32, so results agree within rounding, not bitwise).

Layout (vLLM fused_moe): ``expert_align`` (``align_by_expert``'s layout, one launch on CUDA) sorts the
T·k (token, slot) rows by expert into blocks of BLOCK_M rows; a program owns (row block, BLOCK_N output
columns): it loads its block's expert id, the block's input rows (``x[row // k]`` for the gate/up
projection, the intermediate row for the down projection) and that expert's weight tile, and accumulates
``tl.dot`` over K. Unused blocks (expert -1) skip the K loop, so each chosen expert's weights are read
once per block that holds its rows (decode: once). Between the two GEMMs the model's gated activation
runs in PyTorch (SiLU or SiTU).
No host sync: every shape is fixed by T, k and E (CUDA-graph safe).

Bytes (decode, memory-bound): the chosen experts' weights (distinct experts hit x 3·I·D x elem) plus
activations; FLOPs 2 · T·k · 3·I·D.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import triton
import triton.language as tl

from longflash.layers.moe_grouped import expert_align


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_rows_ptr, block_expert_ptr, n_rows, a_div, N, K,
                         stride_am, stride_we, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < n_rows
    a_rows = (rows // a_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_base = w_ptr + tl.maximum(e, 0).to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(e >= 0, K, 0)  # an unused block reads no weights
    kk = tl.arange(0, BLOCK_K)
    if INTERPRET:  # a run-time-bounded ``for`` fails in the interpreter; same loop as a while
        k0 = 0
        while k0 < k_end:
            k = k0 + kk
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & (k < K)[None, :],
                        other=0.0)
            w = tl.load(w_base + offs_n[None, :] * stride_wn + k[:, None], mask=n_ok[None, :] & (k < K)[:, None],
                        other=0.0)
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            k0 += BLOCK_K
    else:
        for k0 in range(0, k_end, BLOCK_K):
            k = k0 + kk
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & (k < K)[None, :],
                        other=0.0)
            w = tl.load(w_base + offs_n[None, :] * stride_wn + k[:, None], mask=n_ok[None, :] & (k < K)[:, None],
                        other=0.0)
            if DOT_IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, add_ptr, out_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr,
                        HAS_ADD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):  # ascending j, the reference's order
        wj = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += wj * tl.load(y_ptr + (t * K + j) * D + d, mask=dm, other=0.0).to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_ADD:  # rounded, then added and rounded again: the reference's ``result + add``
        out = (out.to(tl.float32) + tl.load(add_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)).to(
            out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * D + d, out, mask=dm)


def moe_combine_triton(y: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype,
                       add: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`longflash.layers.moe_grouped.moe_combine_ref` (same arguments and
    result: fp32 products summed over j in ascending order, one rounding to ``out_dtype``), one launch
    instead of the cast, multiply, sum and cast of the PyTorch form (a batch-1 decode step runs it once
    per MoE layer; with ``add``, the shared experts' output is added in the same launch). Grid
    (T, D / BLOCK_D). Raises ValueError when y's rows are not T·k, or ``add`` is not [T, D] of ``out_dtype``."""
    T, k = topk_weights.shape
    if y.dim() != 2 or y.shape[0] != T * k:
        raise ValueError(f"y must be [T*k={T * k}, D], got {tuple(y.shape)}")
    D = y.shape[1]
    if add is not None and (add.shape != (T, D) or add.dtype != out_dtype):
        raise ValueError(f"add must be [{T}, {D}] {out_dtype}, got {tuple(add.shape)} {add.dtype}")
    out = torch.empty(T, D, dtype=out_dtype, device=y.device)
    if T == 0 or D == 0:
        return out
    BLOCK_D = 256
    _moe_combine_kernel[(T, triton.cdiv(D, BLOCK_D))](y.contiguous(), topk_weights.contiguous(),
                                                     add.contiguous() if add is not None else out, out, D, K=k,
                                                     BLOCK_D=BLOCK_D, HAS_ADD=add is not None, num_warps=2)
    return out


def default_config(num_rows: int, num_experts: int) -> dict:
    """Tile sizes by the mean rows per expert hit (decode: small BLOCK_M, narrow BLOCK_N so that the
    few chosen experts still spread over the SMs; prefill: larger tiles for the tensor cores)."""
    per_expert = num_rows / max(1, min(num_rows, num_experts))
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def _gemm(a: torch.Tensor, w: torch.Tensor, sorted_rows: torch.Tensor, block_expert: torch.Tensor, n_rows: int,
          a_div: int, cfg: dict) -> torch.Tensor:
    """out [n_rows, N] with out[r] = a[r // a_div] @ w[expert of r]^T."""
    E, N, K = w.shape
    out = torch.empty(n_rows, N, dtype=a.dtype, device=a.device)
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1" or not a.is_cuda
    grid = (block_expert.numel(), triton.cdiv(N, cfg["BLOCK_N"]))
    _grouped_gemm_kernel[grid](a, w, out, sorted_rows, block_expert, n_rows, a_div, N, K,
                               a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                               BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                               DOT_IEEE=a.dtype == torch.float32, INTERPRET=interp,
                               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def grouped_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, act_and_mul: Callable, add: torch.Tensor | None = None,
                           config: dict | None = None) -> torch.Tensor:
    """Triton version of :func:`longflash.layers.moe_grouped.grouped_experts_ref` (same arguments and
    result within fp32-accumulation rounding). ``config`` overrides :func:`default_config`.

    Raises ValueError for mismatched shapes or dtypes, or weights whose last dim is not contiguous."""
    T, D = x.shape
    E, two_i, K = w13.shape
    if K != D or w2.shape[0] != E or w2.shape[2] * 2 != two_i:
        raise ValueError(f"x [T, {D}], w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit together")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"expert weights ({w13.dtype}, {w2.dtype}) must have x's dtype {x.dtype}")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("expert weights must be contiguous in their last dim")
    k = topk_ids.shape[1]
    if T == 0:
        return x.new_zeros(0, w2.shape[1])
    if add is not None and (add.shape != (T, w2.shape[1]) or add.dtype != x.dtype):
        raise ValueError(f"add must be [{T}, {w2.shape[1]}] {x.dtype}, got {tuple(add.shape)} {add.dtype}")
    n_rows = T * k
    cfg = dict(default_config(n_rows, E), **(config or {}))
    sorted_rows, block_expert, _ = expert_align(topk_ids, E, cfg["BLOCK_M"])  # one launch on CUDA
    x = x.contiguous()
    h = _gemm(x, w13, sorted_rows, block_expert, n_rows, k, cfg)
    I = two_i // 2
    inter = act_and_mul(h[:, :I], h[:, I:]).contiguous()
    y = _gemm(inter, w2, sorted_rows, block_expert, n_rows, 1, cfg)
    return moe_combine_triton(y, topk_weights, x.dtype, add)
