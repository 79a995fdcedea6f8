"""Block Attention Residuals mixer (Kimi Team, "Attention Residuals", arXiv 2603.15031).

``AttnResMix(rows) = Σ_j p_j · rows_j``, ``p = softmax_j(s_j)``,
``s_j = Σ_d w[d]·g[d]·rows_j[d] / sqrt(mean_d(rows_j²) + eps)``: RMS-normalised keys dotted with a
learned pseudo-query ``w`` (``*_res_proj``, Linear H→1) times the norm weight ``g`` (``*_res_norm``);
values are the raw rows; fp32 scores, softmax and sum; no 1/sqrt(d). Source:
``shared/specs/attnres_kimi.md`` ("The mixer").

``attn_res_mix_reference`` is the PyTorch definition (the CPU path and the test oracle);
``attn_res_mix`` runs the one-launch Triton kernel (``attn_res_triton``) on CUDA tensors when no
gradient is needed and ``out`` (if given) has the sources' dtype, else the reference.
"""

from __future__ import annotations

import torch


def check_rows(rows, what: str, needed_by: str) -> tuple[int, int]:
    """(T, H) of a mixer's row list (sources or committed bank slots): non-empty, each [T, H] with the
    same shape, dtype and device. Raises ValueError naming ``what`` ("source", "committed row") and the
    index at fault; ``needed_by`` names the caller in the empty-list message."""
    if len(rows) == 0:
        raise ValueError(f"{needed_by} needs at least one {what}")
    x0 = rows[0]
    if x0.dim() != 2:
        raise ValueError(f"{what}s must be [T, H], got {tuple(x0.shape)}")
    for i, x in enumerate(rows):
        if x.shape != x0.shape or x.dtype != x0.dtype or x.device != x0.device:
            raise ValueError(f"{what} {i} is {tuple(x.shape)} {x.dtype} on {x.device}; {what} 0 is "
                             f"{tuple(x0.shape)} {x0.dtype} on {x0.device}")
    return tuple(x0.shape)


def attn_res_mix(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                 eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Mix S source rows per token (arguments and result as :func:`attn_res_mix_reference`).

    More than one CUDA source with contiguous rows (and ``out`` of their dtype) takes the fused kernel:
    one launch instead of ~18; the fp32 summation order differs (a few fp32 ulps; at most one rounding
    step in bf16). Raises ValueError on an empty source list, and (kernel path) on sources or weights
    that do not match (``attn_res_mix_triton``)."""
    if not sources:
        raise ValueError("attn_res_mix needs at least one source")
    x0 = sources[0]
    if (len(sources) > 1 and x0.is_cuda and all(s.stride(-1) == 1 for s in sources)
            and (out is None or (out.dtype == x0.dtype and out.stride(-1) == 1))):
        needs_grad = torch.is_grad_enabled() and (any(s.requires_grad for s in sources) or norm_weight.requires_grad
                                                  or proj_weight.requires_grad)
        if not needs_grad:  # the kernel has no backward
            from longflash.layers.attn_res_triton import attn_res_mix_triton
            return attn_res_mix_triton(sources, norm_weight, proj_weight, eps, out=out)
    return attn_res_mix_reference(sources, norm_weight, proj_weight, eps, out=out)


def attn_res_mix_reference(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                           eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Mix S source rows per token (PyTorch definition, ~18 launches).

    Args:
        sources: S tensors [T, H] (committed bank slots in order, then the prefix), same dtype.
        norm_weight: [H] (g). proj_weight: [1, H] or [H] (w).
        eps: rms_norm_eps.
        out: optional [T, H] buffer to write the result into.
    Returns:
        [T, H] in the sources' dtype. With one source the result is that source exactly.
    Raises:
        ValueError on an empty source list (mismatched shapes fail in ``torch.stack``).
    """
    if not sources:
        raise ValueError("attn_res_mix needs at least one source")
    if len(sources) == 1:
        return sources[0] if out is None else out.copy_(sources[0])
    q = proj_weight.float().reshape(-1) * norm_weight.float()
    rows = torch.stack([s.float() for s in sources], dim=-2)  # [T, S, H]
    keys = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.softmax((keys * q).sum(-1), dim=-1)  # [T, S]
    mixed = (p.unsqueeze(-1) * rows).sum(-2).to(sources[0].dtype)
    return mixed if out is None else out.copy_(mixed)
