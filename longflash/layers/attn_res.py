"""Block Attention Residuals mixer (Kimi Team, "Attention Residuals", arXiv 2603.15031).

``AttnResMix(rows) = Σ_j p_j · rows_j``, ``p = softmax_j(s_j)``,
``s_j = Σ_d w[d]·g[d]·rows_j[d] / sqrt(mean_d(rows_j²) + eps)``: RMS-normalised keys dotted with a
learned pseudo-query ``w`` (``*_res_proj``, Linear H→1) times the norm weight ``g`` (``*_res_norm``);
values are the raw rows; fp32 scores, softmax and sum; no 1/sqrt(d). Source:
``shared/specs/attnres_kimi.md`` ("The mixer").
"""

from __future__ import annotations

import torch


def attn_res_mix(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                 eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Mix S source rows per token.

    Args:
        sources: S tensors [T, H] (committed bank slots in order, then the prefix), same dtype.
        norm_weight: [H] (g). proj_weight: [1, H] or [H] (w).
        eps: rms_norm_eps.
        out: optional [T, H] buffer to write the result into.
    Returns:
        [T, H] in the sources' dtype. With one source the result is that source exactly.
    """
    if len(sources) == 1:
        return sources[0] if out is None else out.copy_(sources[0])
    q = proj_weight.float().reshape(-1) * norm_weight.float()
    rows = torch.stack([s.float() for s in sources], dim=-2)  # [T, S, H]
    keys = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.softmax((keys * q).sum(-1), dim=-1)  # [T, S]
    mixed = (p.unsqueeze(-1) * rows).sum(-2).to(sources[0].dtype)
    return mixed if out is None else out.copy_(mixed)
