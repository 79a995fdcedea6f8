"""Decode-context parallelism (DCP): KV sharding formulas and the LSE combine.

Facts from ``shared/specs/mla_dcp_fp8.md`` (DCP section), with I = ``cp_kv_cache_interleave_size``:
- owner of position p: ``(p // I) % dcp_size``;
- a logical block names a virtual block of ``block_size * dcp_size`` tokens; each rank keeps its share
  in its own physical block with the same id. Slot on the owner:
  ``vbs = block_size*dcp; blk = block_table[p // vbs]; vo = p % vbs;
  local = (vo // (dcp*I))*I + vo % I; slot = blk*block_size + local``, -1 on the other ranks;
- local lengths: ``base = L // I // dcp * I; rem = L - base*dcp; local[r] = base + clip(rem - r*I, 0, I)``.
So on each rank the shard of a request is a dense run of local rows [0, local_len) addressed through the
*same* block table with the physical ``block_size`` (local row j -> block ``block_table[j // block_size]``),
and the paged-cache ops of ``attention.ops`` work on it unchanged.

We require ``block_size % I == 0`` (then round-robin groups of I never straddle a virtual block and the
slot formula is the inverse of :func:`dcp_local_to_global`).

Everything here except :func:`dcp_decode_combine_group` / :func:`dcp_mla_decode` is a pure tensor
function that also runs in one process (tests simulate the ranks in a loop).
"""

from __future__ import annotations

import torch

from longflash.attention import ops


def check_dcp_args(block_size: int, dcp_size: int, interleave: int) -> None:
    """Raises ValueError unless dcp_size >= 1, interleave >= 1 and interleave divides block_size."""
    if dcp_size < 1:
        raise ValueError(f"dcp_size must be >= 1, got {dcp_size}")
    if interleave < 1 or block_size % interleave:
        raise ValueError(f"cp_kv_cache_interleave_size ({interleave}) must be >= 1 and divide "
                         f"block_size ({block_size})")


def dcp_owner(positions: torch.Tensor, dcp_size: int, interleave: int = 1) -> torch.Tensor:
    """DCP rank that stores each position: ``(p // I) % dcp_size``. positions: any int tensor."""
    return (positions // interleave) % dcp_size


def dcp_slot_mapping(positions: torch.Tensor, block_table: torch.Tensor, block_size: int, dcp_size: int,
                     dcp_rank: int, interleave: int = 1,
                     token_to_req: torch.Tensor | None = None) -> torch.Tensor:
    """Cache slot of each token on DCP rank ``dcp_rank`` (-1 where another rank owns it).

    Args:
        positions: [T] int, absolute positions.
        block_table: [B, max_blocks] int, logical (virtual, ``block_size*dcp_size`` tokens) block ->
            physical block id; a 1-D row is taken as one request.
        block_size: tokens per *physical* block (per rank).
        token_to_req: [T] int, row of ``block_table`` of each token (None: all row 0).
    Returns:
        [T] int64 slots ``block_id * block_size + local`` (spec formula) or -1.
    Raises:
        ValueError on bad DCP arguments, or a position beyond its block table / in a -1 block that
        this rank owns.
    """
    check_dcp_args(block_size, dcp_size, interleave)
    bt = block_table.long()
    if bt.dim() == 1:
        bt = bt[None]
    p = positions.long()
    req = torch.zeros_like(p) if token_to_req is None else token_to_req.long()
    vbs = block_size * dcp_size
    logical = p // vbs
    if p.numel() and int(logical.max()) >= bt.shape[1]:
        raise ValueError("position beyond its request's block table")
    vo = p % vbs
    local = (vo // (dcp_size * interleave)) * interleave + vo % interleave
    mine = dcp_owner(p, dcp_size, interleave) == dcp_rank
    blk = bt[req, logical] if p.numel() else p
    if bool((mine & (blk < 0)).any()):
        raise ValueError("position maps to an unallocated block (-1)")
    return torch.where(mine, blk * block_size + local, torch.full_like(p, -1))


def dcp_local_seq_lens(seq_lens: torch.Tensor | list[int], dcp_size: int, interleave: int = 1) -> torch.Tensor:
    """Tokens of each request stored on each rank.

    Args:
        seq_lens: [B] int (tensor or list), global lengths L.
    Returns:
        [B, dcp_size] int64: ``base + clip(rem - r*I, 0, I)`` with ``base = L // I // dcp * I``,
        ``rem = L - base*dcp``. Rows sum to L.
    """
    L = torch.as_tensor(seq_lens, dtype=torch.int64).reshape(-1)
    base = L // interleave // dcp_size * interleave
    rem = L - base * dcp_size
    r = torch.arange(dcp_size, dtype=torch.int64)
    return base[:, None] + (rem[:, None] - r[None, :] * interleave).clamp(0, interleave)


def dcp_rank_local_lens(lens: torch.Tensor, dcp_size: int, dcp_rank: int, interleave: int = 1) -> torch.Tensor:
    """Rank ``dcp_rank``'s column of :func:`dcp_local_seq_lens`, elementwise on ``lens``' device and
    dtype (no host copy: the form a CUDA graph captures). lens: any int tensor of global lengths."""
    base = lens // interleave // dcp_size * interleave
    return base + (lens - base * dcp_size - dcp_rank * interleave).clamp(0, interleave)


def dcp_padded_local_len(context_len: int, dcp_size: int, interleave: int = 1) -> int:
    """Rows every rank gathers for a context of ``context_len`` tokens: ``cdiv(L, dcp·I)·I``, the largest
    local length (spec: "per-rank padded length"); rows past a rank's true local length are garbage."""
    return -(-context_len // (dcp_size * interleave)) * interleave


def dcp_gathered_rows(start: int, length: int, offset: int, local_lens: list[int], rows_per_rank: int) -> torch.Tensor:
    """Indices of the real rows of one context segment in a DCP all-gathered workspace.

    Each rank gathered local rows ``[start, start + length)`` of a request into its rows
    ``[offset, offset + length)`` of a ``rows_per_rank``-row workspace; the all-gather put rank r's
    workspace at rows ``[r·rows_per_rank, (r+1)·rows_per_rank)``. Rank r holds ``local_lens[r]`` true rows
    of the request, so rows ``j >= local_lens[r] - start`` are padding and are left out.
    Returns int64 [number of real rows], rank-major, ascending within a rank.
    """
    parts = [r * rows_per_rank + offset + torch.arange(max(0, min(length, n - start)), dtype=torch.int64)
             for r, n in enumerate(local_lens)]
    return torch.cat(parts)


def dcp_local_to_global(local_idx: torch.Tensor, dcp_size: int, dcp_rank: int, interleave: int = 1) -> torch.Tensor:
    """Absolute position of local row j on ``dcp_rank``: ``((j // I) * dcp + rank) * I + j % I``."""
    j = local_idx.long()
    return ((j // interleave) * dcp_size + dcp_rank) * interleave + j % interleave


def dcp_combine(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine per-rank partial attention over disjoint key shards.

    Args:
        outs: [R, T, H, D] rank r's output (normalized over its own keys); lses: [R, T, H] fp32,
            natural log; -inf (or +inf, treated as -inf) marks an empty shard whose output may hold
            anything, NaN included.
    Returns:
        (out [T, H, D] in outs' dtype, lse [T, H] fp32): ``LSE = log sum_r e^{lse_r}``,
        ``out = sum_r e^{lse_r - LSE} out_r``; an empty shard has weight exactly 0; if every shard is
        empty the output is 0 and the LSE -inf (never NaN).
    """
    l = lses.float()
    l = torch.where(l == float("inf"), torch.full_like(l, float("-inf")), l)
    m = l.amax(dim=0)
    empty = m == float("-inf")
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    w = torch.exp(l - m_safe)                     # [R, T, H], 0 for empty shards
    tot = w.sum(dim=0)
    tot_safe = torch.where(empty, torch.ones_like(tot), tot)
    w = w / tot_safe
    contrib = torch.where((w > 0)[..., None], outs.float() * w[..., None], torch.zeros((), device=outs.device))
    out = contrib.sum(dim=0)
    lse = torch.where(empty, torch.full_like(m, float("-inf")), torch.log(tot_safe) + m_safe)
    return out.to(outs.dtype), lse


def _masked_attention_with_lse(q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int, scale: float,
                               key_start: int, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, H, W], kv [Tk, W] rows with local indices key_start.. ; query i sees local rows
    < visible[i]. Returns out [Tq, H, kv_lora_rank] (q dtype), lse [Tq, H] fp32."""
    scores = torch.einsum("qhd,kd->hqk", q.float(), kv.float()) * scale
    kidx = key_start + torch.arange(kv.shape[0], device=q.device)
    mask = kidx[None, :] >= visible[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0)
    out = torch.einsum("hqk,kd->qhd", probs, kv[:, :kv_lora_rank].float())
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def mla_decode_attention_local(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                               query_start_loc: list[int], seq_lens: list[int], scale: float, kv_lora_rank: int,
                               dcp_size: int, dcp_rank: int, interleave: int = 1,
                               k_scale: float | torch.Tensor | None = None,
                               max_rows_per_piece: int = ops.DECODE_PIECE_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of each request's queries over *this rank's shard* of its cache.

    Same arguments as :func:`longflash.attention.ops.mla_decode_attention` (``seq_lens`` are the
    *global* lengths, queries are the last q_len positions, causal among themselves), plus the DCP
    layout. Query at global position P sees the local rows whose global position is <= P, i.e. the
    first ``local_len(P + 1)`` rows (global position is increasing in the local index).
    Returns out [T, H, kv_lora_rank] (q dtype) and lse [T, H] fp32; a query with no local key gets
    out 0 and lse -inf. With ``dcp_size == 1`` this equals ``ops.mla_decode_attention``.
    On a GPU the Triton kernel computes it (``triton_mla_decode.mla_decode_attention_dcp_local``).
    """
    if q.is_cuda:
        from longflash.attention.triton_mla_decode import mla_decode_attention_dcp_local
        return mla_decode_attention_dcp_local(q, kv_cache, block_table, query_start_loc, seq_lens, scale,
                                              kv_lora_rank, dcp_size, dcp_rank, interleave, k_scale)
    T, H, _ = q.shape
    bs = kv_cache.shape[1]
    check_dcp_args(bs, dcp_size, interleave)
    out = q.new_zeros(T, H, kv_lora_rank)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    step = max(bs, max_rows_per_piece // bs * bs)
    for b in range(len(seq_lens)):
        s, e, L = query_start_loc[b], query_start_loc[b + 1], seq_lens[b]
        if e == s:
            continue
        qpos = torch.arange(L - (e - s), L)
        visible = dcp_local_seq_lens(qpos + 1, dcp_size, interleave)[:, dcp_rank].to(q.device)
        n_local = int(visible.max())
        o_b, l_b = None, None
        for start in range(0, n_local, step):
            n = min(step, n_local - start)
            cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
            st = torch.tensor([start], dtype=torch.int32, device=q.device)
            kv = ops.gather_and_maybe_dequant_cache(kv_cache, block_table[b:b + 1], cu, st, q.dtype, k_scale)
            o, l = _masked_attention_with_lse(q[s:e], kv, kv_lora_rank, scale, start, visible)
            o_b, l_b = (o, l) if o_b is None else ops.merge_attn_states(o_b, l_b, o, l)
        if o_b is not None:
            out[s:e], lse[s:e] = o_b, l_b
    return out, lse


def dcp_combine_weights(lses: torch.Tensor, out_local: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's weighted share of the DCP LSE combine (PyTorch reference of
    ``dcp_combine_triton.dcp_combine_weights_triton``, same signature).

    Args:
        lses: [R, T, H] fp32, every rank's LSE (all-gathered); +inf is read as -inf (an empty shard).
        out_local: [T, H, D] this rank's partial output. rank: this rank's index in ``lses``.
    Returns:
        (contrib [T, H, D] fp32 = out_local · e^{lse_rank - LSE}, exactly 0 where that weight is 0 even
        if out_local holds garbage there; LSE [T, H] fp32 = log Σ_r e^{lse_r}, -inf where every shard is
        empty). Summing contrib over the ranks gives the combined output (``dcp_combine``'s formula).
    """
    l = torch.where(lses == float("inf"), torch.full_like(lses, float("-inf")), lses)
    m = l.amax(dim=0)
    empty = m == float("-inf")
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    tot = torch.exp(l - m_safe).sum(dim=0)
    tot_safe = torch.where(empty, torch.ones_like(tot), tot)
    LSE = torch.where(empty, torch.full_like(m, float("-inf")), torch.log(tot_safe) + m_safe)
    w = torch.exp(l[rank] - m_safe) / tot_safe                                 # 0 where mine is -inf
    contrib = torch.where((w > 0)[..., None], out_local.float() * w[..., None],
                          torch.zeros((), device=out_local.device))
    return contrib, LSE


def dcp_decode_combine_group(out_local: torch.Tensor, lse_local: torch.Tensor, group,
                             scatter_heads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The distributed form of :func:`dcp_combine` over a DCP ``GroupCoordinator``.

    Args:
        out_local: [T, H, D] this rank's partial output over its shard; lse_local: [T, H] fp32.
        group: ``comm.GroupCoordinator`` of the DCP ranks (identity when of size 1).
        scatter_heads: False: every rank gets all H heads (all-reduce); True: heads are the DCP
            group's all-gathered query heads and rank i keeps heads [i*H/R, (i+1)*H/R)
            (reduce-scatter over heads, the spec's layout under TP).
    Returns:
        (out [T, H or H/R, D] in out_local's dtype, lse [T, H or H/R] fp32).
    Steps: all-gather LSEs; ``LSE = log sum_r e^{lse_r}``; scale the local output by
    ``e^{lse_local - LSE}`` (exactly 0 for an empty shard; :func:`dcp_combine_weights`, one Triton
    launch on CUDA instead of ~20); sum over ranks.
    """
    R = group.world_size
    lses = group.all_gather(lse_local.float().contiguous()[None], dim=0)   # [R, T, H]
    if out_local.is_cuda:
        from longflash.distributed.dcp_combine_triton import dcp_combine_weights_triton
        contrib, LSE = dcp_combine_weights_triton(lses, out_local, group.rank_in_group)
    else:
        contrib, LSE = dcp_combine_weights(lses, out_local, group.rank_in_group)
    if scatter_heads:
        out = group.reduce_scatter(contrib, dim=1)
        H = LSE.shape[1] // R
        LSE = LSE[:, group.rank_in_group * H:(group.rank_in_group + 1) * H]
    else:
        out = group.all_reduce(contrib.contiguous())
    return out.to(out_local.dtype), LSE


def dcp_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, query_start_loc: list[int],
                   seq_lens: list[int], scale: float, kv_lora_rank: int, group, interleave: int = 1,
                   k_scale: float | torch.Tensor | None = None,
                   gather_heads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DCP absorbed decode/verify over ``group`` (a ``comm.GroupCoordinator`` of the DCP ranks).

    ``gather_heads=False``: q [T, H, W] holds all heads on every rank; attend over the local shard
    (:func:`mla_decode_attention_local`) and combine by all-reduce; every rank gets out [T, H,
    kv_lora_rank], lse [T, H].
    ``gather_heads=True`` (tensor parallelism, the spec's decode): q [T, h, W] holds this rank's h heads;
    the DCP group's query heads are all-gathered ([T, h * R, W], rank order), attended over the local
    shard, combined by LSE and reduce-scattered over heads, so this rank gets its own heads back:
    out [T, h, kv_lora_rank], lse [T, h]. Every rank of the group must call it with the same T and h.
    A rank with an empty shard contributes exactly 0 (:func:`dcp_decode_combine_group`).
    """
    if gather_heads:
        q = group.all_gather(q, dim=1)
    o, l = mla_decode_attention_local(q, kv_cache, block_table, query_start_loc, seq_lens, scale, kv_lora_rank,
                                      group.world_size, group.rank_in_group, interleave, k_scale)
    return dcp_decode_combine_group(o, l, group, scatter_heads=gather_heads)
