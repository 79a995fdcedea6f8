"""The Block AttnRes mixer in two phases (Kimi Team, "Attention Residuals", arXiv 2603.15031: batched
inter-block attention once per block, then the intra-block term merged by online softmax).

Why it is exact (``shared/specs/attnres_kimi.md``, "Order of operations"): inside committed block k
(decoder layers k·bs .. k·bs+bs-1) every mixer reads the same committed slots ``bank[:k+1]``. The
block's first attention mixer reads ``bank[:k] ++ [prefix]`` and step 2 then commits that very prefix
as ``bank[k]``, so it reads ``bank[:k+1]`` and nothing else; the other 2·bs-1 mixers read
``bank[:k+1] ++ [prefix]`` with the running in-block prefix. After the last layer the output mixture
reads ``bank[:NB] ++ [prefix]``, the committed set of the last block: it is one more query of that
block. The mixture is a softmax over sources, so it splits over disjoint source sets:

* phase 1 (:func:`attn_res_block_partials`, once per block): for all Q pseudo-queries
  ``q_i = w_i·g_i`` over the C committed rows ``x_j``: ``s[i, t, j] = (q_i · x_j[t]) ·
  rsqrt(mean(x_j[t]²) + eps)`` (no 1/sqrt(d)), ``lse[i, t] = log Σ_j e^{s[i,t,j]}`` and the normalised
  sum ``acc[i, t] = Σ_j softmax_j(s[i, t])_j · x_j[t]``, all fp32. The bank is read once per block
  instead of once per mixer.
* phase 2 (:func:`attn_res_merge_prefix`, at each mixer with a prefix p): ``s_p`` as above;
  ``m = max(lse, s_p)``, ``a = e^{lse-m}``, ``b = e^{s_p-m}``; ``out = (a·acc + b·p) / (a + b)``, cast to
  the activation dtype. This is ``softmax`` over the C + 1 sources (Milakov & Gimelshein 2018, the LSE
  merge of split attention). The first attention mixer of a block has no prefix term: its result is
  ``acc[0]`` cast to the activation dtype; with C = 1 (block 0) that is the embedding exactly.

Partials are stored fp32 (Q·T·H·4 bytes per block; Kimi-K3's 24-25 queries: 688-717 KB per token, the
storage plan's pool is 143 KB per token), normalised, with the LSE; not the activation dtype, which would
round twice. Only the fp32 summation order differs from the one-phase :func:`attn_res_mix_reference`:
results equal it to a few fp32 ulps (fp32 inputs) and within one rounding step (bf16/fp16).

Both functions run Triton kernels (``attn_res_two_phase_triton``) on CUDA tensors when no gradient is
needed, else the PyTorch definitions ``*_reference`` here (the CPU path and the test oracle).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from longflash.layers.attn_res import check_rows


class AttnResPartials(NamedTuple):
    """Phase-1 result of Q queries over C committed rows (or, after :meth:`query`, of one query).

    acc: [Q, T, H] fp32, the softmax-normalised sum over the committed rows ([T, H] for one query).
    lse: [Q, T] fp32, log-sum-exp (base e) of the query's scores over those rows ([T] for one query).
    """

    acc: torch.Tensor
    lse: torch.Tensor

    @property
    def num_queries(self) -> int:
        return self.acc.shape[0] if self.acc.dim() == 3 else 1

    def query(self, i: int) -> "AttnResPartials":
        """Query i's partial: acc [T, H] and lse [T] (views). Raises IndexError outside 0..Q-1."""
        if self.acc.dim() != 3:
            raise IndexError("query() selects from Q stacked partials; this is one query's partial")
        if not -self.num_queries <= i < self.num_queries:
            raise IndexError(f"query {i} out of range for {self.num_queries} queries")
        return AttnResPartials(self.acc[i], self.lse[i])


def _check_block_args(committed: Sequence[torch.Tensor], norm_weights: torch.Tensor,
                      proj_weights: torch.Tensor) -> tuple[int, int, int]:
    """(T, H, Q) after validating phase-1 arguments; ValueError naming the problem."""
    T, H = check_rows(committed, "committed row", "attn_res_block_partials")
    x0 = committed[0]
    if norm_weights.dim() != 2 or norm_weights.shape[1] != H:
        raise ValueError(f"norm_weights must be [Q, H={H}], got {tuple(norm_weights.shape)}")
    Q = norm_weights.shape[0]
    if proj_weights.shape not in ((Q, H), (Q, 1, H)):
        raise ValueError(f"proj_weights must be [Q={Q}, H={H}] like norm_weights, got {tuple(proj_weights.shape)}")
    if Q < 1:
        raise ValueError("attn_res_block_partials needs at least one query")
    if norm_weights.device != x0.device or proj_weights.device != x0.device:
        raise ValueError(f"weights are on {norm_weights.device}/{proj_weights.device}, rows on {x0.device}")
    return T, H, Q


def _check_merge_args(partial: AttnResPartials, prefix: torch.Tensor, norm_weight: torch.Tensor,
                      proj_weight: torch.Tensor, out: torch.Tensor | None) -> tuple[int, int]:
    """(T, H) after validating phase-2 arguments; ValueError naming the problem."""
    acc, lse = partial
    if prefix.dim() != 2:
        raise ValueError(f"prefix must be [T, H], got {tuple(prefix.shape)}")
    T, H = prefix.shape
    if acc.shape != (T, H) or lse.shape != (T,):
        raise ValueError(f"partial must be one query's (acc [T={T}, H={H}], lse [{T}]) matching the prefix, got "
                         f"acc {tuple(acc.shape)}, lse {tuple(lse.shape)} (select one with partials.query(i))")
    if acc.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError(f"partial acc/lse must be fp32, got {acc.dtype}/{lse.dtype}")
    if acc.device != prefix.device or lse.device != prefix.device:
        raise ValueError(f"partial is on {acc.device}, prefix on {prefix.device}")
    if norm_weight.numel() != H or proj_weight.numel() != H or norm_weight.device != prefix.device \
            or proj_weight.device != prefix.device:
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} and proj_weight {tuple(proj_weight.shape)} "
                         f"must have H={H} elements on {prefix.device}")
    if out is not None and (out.shape != (T, H) or out.dtype != prefix.dtype or out.device != prefix.device):
        raise ValueError(f"out must be a [{T}, {H}] {prefix.dtype} buffer on {prefix.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return T, H


def _needs_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def attn_res_block_partials(committed: Sequence[torch.Tensor], norm_weights: torch.Tensor,
                            proj_weights: torch.Tensor, eps: float) -> AttnResPartials:
    """Phase 1 (arguments and result as :func:`attn_res_block_partials_reference`): one Triton launch
    on CUDA rows with contiguous elements when no gradient is needed, else the reference."""
    _check_block_args(committed, norm_weights, proj_weights)
    if (committed[0].is_cuda and all(x.stride(-1) == 1 for x in committed)
            and not _needs_grad(*committed, norm_weights, proj_weights)):
        from longflash.layers.attn_res_two_phase_triton import attn_res_block_partials_triton
        return attn_res_block_partials_triton(committed, norm_weights, proj_weights, eps)
    return attn_res_block_partials_reference(committed, norm_weights, proj_weights, eps)


def attn_res_merge_prefix(partial: AttnResPartials, prefix: torch.Tensor, norm_weight: torch.Tensor,
                          proj_weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Phase 2 (arguments and result as :func:`attn_res_merge_prefix_reference`): one Triton launch on
    CUDA when no gradient is needed and the rows have contiguous elements, else the reference."""
    _check_merge_args(partial, prefix, norm_weight, proj_weight, out)
    if (prefix.is_cuda and prefix.stride(-1) == 1 and partial.acc.stride(-1) == 1
            and (out is None or out.stride(-1) == 1)
            and not _needs_grad(partial.acc, prefix, norm_weight, proj_weight)):
        from longflash.layers.attn_res_two_phase_triton import attn_res_merge_prefix_triton
        return attn_res_merge_prefix_triton(partial, prefix, norm_weight, proj_weight, eps, out=out)
    return attn_res_merge_prefix_reference(partial, prefix, norm_weight, proj_weight, eps, out=out)


def _keys(rows: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalised keys of fp32 rows [..., H] (no norm weight; it is folded into the query)."""
    return rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)


def attn_res_block_partials_reference(committed: Sequence[torch.Tensor], norm_weights: torch.Tensor,
                                      proj_weights: torch.Tensor, eps: float) -> AttnResPartials:
    """Phase 1: Q pseudo-queries over the C committed rows of one block, fp32 (PyTorch definition).

    Args:
        committed: C >= 1 tensors [T, H] of one dtype and device: ``bank[:k+1]`` for block k.
        norm_weights: [Q, H] (g of each query: the block's ``*_res_norm`` weights in mixer order).
        proj_weights: [Q, H] or [Q, 1, H] (w of each query: the ``*_res_proj`` weights).
        eps: rms_norm_eps.
    Returns:
        :class:`AttnResPartials` with acc [Q, T, H] fp32 (``Σ_j softmax_j(s)_j · x_j``) and lse [Q, T]
        fp32 (``log Σ_j e^{s_j}``). With C = 1 every weight is exactly 1: acc[i] is the row itself.
    Raises:
        ValueError on an empty ``committed`` list, rows of different shape/dtype/device, or weights
        that are not [Q, H] (Q >= 1, matching each other and the rows' H, on the rows' device).
    Formula: ``shared/specs/attnres_kimi.md`` ("The mixer"), restricted to the committed sources.
    """
    T, H, Q = _check_block_args(committed, norm_weights, proj_weights)
    q = proj_weights.float().reshape(Q, H) * norm_weights.float()                 # [Q, H]
    rows = torch.stack([x.float() for x in committed])                            # [C, T, H]
    s = torch.einsum("cth,qh->qtc", _keys(rows, eps), q)                          # [Q, T, C]
    p = torch.softmax(s, dim=-1)
    acc = torch.einsum("qtc,cth->qth", p, rows) if len(committed) > 1 else rows.expand(Q, T, H).clone()
    return AttnResPartials(acc.contiguous(), torch.logsumexp(s, dim=-1).contiguous())


def attn_res_merge_prefix_reference(partial: AttnResPartials, prefix: torch.Tensor, norm_weight: torch.Tensor,
                                    proj_weight: torch.Tensor, eps: float,
                                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Phase 2: merge one query's phase-1 partial with the running prefix (PyTorch definition).

    Args:
        partial: one query's :class:`AttnResPartials` (``partials.query(i)``): acc [T, H] fp32, lse [T] fp32.
        prefix: [T, H] in the activation dtype (the in-block running sum).
        norm_weight: [H] (g). proj_weight: [1, H] or [H] (w): the query's own weights.
        eps: rms_norm_eps.
        out: optional [T, H] buffer of the prefix's dtype to write the result into.
    Returns:
        [T, H] in the prefix's dtype: ``(e^{lse-m}·acc + e^{s_p-m}·prefix) / (e^{lse-m} + e^{s_p-m})``,
        ``m = max(lse, s_p)``, equal to ``attn_res_mix_reference(committed + [prefix], ...)`` up to fp32
        summation order.
    Raises:
        ValueError when acc/lse do not match the prefix's [T, H] / [T] or are not fp32, when the weights
        do not have H elements, or when ``out`` has the wrong shape/dtype/device.
    """
    _check_merge_args(partial, prefix, norm_weight, proj_weight, out)
    acc, lse = partial
    x = prefix.float()
    s_p = (_keys(x, eps) * (proj_weight.float().reshape(-1) * norm_weight.float().reshape(-1))).sum(-1)  # [T]
    m = torch.maximum(lse, s_p)
    a, b = torch.exp(lse - m), torch.exp(s_p - m)
    mixed = ((a.unsqueeze(-1) * acc + b.unsqueeze(-1) * x) / (a + b).unsqueeze(-1)).to(prefix.dtype)
    return mixed if out is None else out.copy_(mixed)
