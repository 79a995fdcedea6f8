"""The DCP LSE combine's per-rank weighting in one Triton launch; same signature and result as
:func:`longflash.distributed.dcp.dcp_combine_weights` (the PyTorch reference).

Why: the reference is ~20 small launches (inf handling, max, exp, sum, log, the weight, the masked
multiply) per MLA layer of every decode step under decode-context parallelism; under CUDA graphs each
costs a few µs. Here one program per (token, head) row reads the R all-gathered LSEs
(``shared/specs/mla_dcp_fp8.md``, DCP: ``LSE = log Σ_r e^{lse_r}``, weight ``e^{lse_rank - LSE}``, +inf
read as -inf, an empty shard weighs exactly 0, never NaN), writes the row's LSE and its D-wide
contribution ``out_local · weight`` in fp32 (0 where the weight is 0, whatever out_local holds).
Only exp/log rounding of Triton's math differs from the reference (fp32 ulps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dcp_combine_kernel(lse_ptr, o_ptr, contrib_ptr, out_lse_ptr, TH, stride_or, stride_cr, rank,
                        R: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    ranks = tl.arange(0, BLOCK_R)
    l = tl.load(lse_ptr + ranks * TH + row, mask=ranks < R, other=float("-inf"))
    l = tl.where(l == float("inf"), float("-inf"), l)
    m = tl.max(l, axis=0)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    tot = tl.sum(tl.where(l == float("-inf"), 0.0, tl.exp(l - m_safe)), axis=0)
    tot_safe = tl.where(empty, 1.0, tot)
    tl.store(out_lse_ptr + row, tl.where(empty, float("-inf"), tl.log(tot_safe) + m_safe))
    mine = tl.load(lse_ptr + rank * TH + row)
    mine = tl.where(mine == float("inf"), float("-inf"), mine)
    w = tl.where(mine == float("-inf"), 0.0, tl.exp(mine - m_safe) / tot_safe)
    r64 = row.to(tl.int64)
    for d0 in tl.static_range(0, D, BLOCK_D):  # D (kv_lora_rank) is one value per model
        cols = d0 + tl.arange(0, BLOCK_D)
        dm = cols < D
        o = tl.load(o_ptr + r64 * stride_or + cols, mask=dm, other=0.0).to(tl.float32)
        tl.store(contrib_ptr + r64 * stride_cr + cols, tl.where(w > 0, o * w, 0.0), mask=dm)


def dcp_combine_weights_triton(lses: torch.Tensor, out_local: torch.Tensor,
                               rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`longflash.distributed.dcp.dcp_combine_weights` (arguments, result and
    errors as there). Raises ValueError when the shapes disagree or ``rank`` is outside [0, R)."""
    if lses.dim() != 3 or out_local.dim() != 3 or lses.shape[1:] != out_local.shape[:2]:
        raise ValueError(f"lses must be [R, T, H] and out_local [T, H, D], got {tuple(lses.shape)} and "
                         f"{tuple(out_local.shape)}")
    R, T, H = lses.shape
    D = out_local.shape[2]
    if not 0 <= rank < R:
        raise ValueError(f"rank {rank} outside the {R} ranks of lses")
    lse = lses.float().contiguous()
    o = out_local.reshape(T * H, D)
    if o.stride(-1) != 1:
        o = o.contiguous()
    contrib = torch.empty(T, H, D, dtype=torch.float32, device=out_local.device)
    out_lse = torch.empty(T, H, dtype=torch.float32, device=out_local.device)
    if T * H == 0:
        return contrib, out_lse
    _dcp_combine_kernel[(T * H,)](lse, o, contrib, out_lse, T * H, o.stride(0), D, rank, R=R, D=D,
                                  BLOCK_R=triton.next_power_of_2(R), BLOCK_D=min(1024, triton.next_power_of_2(D)),
                                  num_warps=4)
    return contrib, out_lse
