"""Paged-cache attention ops: PyTorch references that define the semantics.

Each function here is the reference for a GPU kernel with the same signature (the CPU engine
runs these). Conventions follow vLLM: ``slot = block_id * block_size + offset``, slot -1 = skip;
LSE = natural log-sum-exp of the scaled attention logits.
"""

from __future__ import annotations


import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Rows of one request that the reference attention dequantizes at a time (bounded working set).
DECODE_PIECE_ROWS = 4096


def quantize_to_cache(x: torch.Tensor, cache_dtype: torch.dtype, k_scale: float | torch.Tensor | None) -> torch.Tensor:
    """Convert rows to the cache dtype; for fp8 store ``sat(x / k_scale)`` (saturating to ±448)."""
    if cache_dtype == FP8_DTYPE:
        xf = x.float()
        if k_scale is not None:
            # NOTE: divide by a 0-dim fp32 tensor, not a Python float: CUDA turns division by a CPU
            # scalar into multiplication by its reciprocal, which rounds differently from x / s.
            xf = xf / torch.as_tensor(k_scale, dtype=torch.float32, device=x.device)
        return xf.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x.to(cache_dtype)


def dequantize_from_cache(x: torch.Tensor, out_dtype: torch.dtype, k_scale: float | torch.Tensor | None) -> torch.Tensor:
    """Cache rows back to ``out_dtype``; an fp8 cache is always multiplied by ``k_scale``."""
    if x.dtype == FP8_DTYPE:
        xf = x.float()
        if k_scale is not None:
            xf = xf * torch.as_tensor(k_scale, dtype=torch.float32, device=x.device)
        return xf.to(out_dtype)
    return x.to(out_dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors viewed as uint8 (index_copy_/index_select lack fp8 kernels on the CPU)."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def write_rows(flat: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """``flat[slot_mapping[t]] = rows[t]`` for every t with a slot >= 0, without a device -> host sync
    (no boolean-mask indexing), so it runs inside a CUDA graph.

    Args:
        flat: [num_slots, *row_shape], written in place. rows: [T, *row_shape], flat's dtype.
        slot_mapping: [T] int64, -1 = skip.
    NOTE: entries with slot -1 are redirected to the slot of the first valid entry and carry that
    entry's row, so duplicate indices always write identical bytes (index_copy_'s order among
    duplicates does not matter); with no valid entry at all they rewrite row 0 with its own content.
    """
    if rows.shape[0] == 0:
        return
    valid = slot_mapping >= 0
    # NOTE: index_select with a [1] index, never t[0-dim tensor] (that indexing reads the index on the host).
    first = valid.to(torch.int32).argmax().view(1)  # first valid entry (0 when there is none)
    any_valid = valid.index_select(0, first)
    fb_slot = torch.where(any_valid, slot_mapping.index_select(0, first), 0)
    bshape = (1,) * (rows.dim() - 1)
    fb_row = torch.where(any_valid.view(1, *bshape), rows.index_select(0, first), flat[:1])
    row_mask = valid.view(-1, *bshape)
    flat.index_copy_(0, torch.where(valid, slot_mapping, fb_slot), torch.where(row_mask, rows, fb_row))


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, k_scale: float | torch.Tensor | None = None) -> None:
    """Write MLA latent rows ``[kv_c | k_pe]`` into a paged cache (vLLM ``concat_and_cache_mla``).

    Args:
        kv_c: [T, kv_lora_rank] model dtype (already normed by kv_a_layernorm).
        k_pe: [T, qk_rope_head_dim] model dtype (already rotated).
        kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], model dtype,
            bf16 or float8_e4m3fn; written in place.
        slot_mapping: [T] int64; -1 entries are skipped.
        k_scale: dequantization multiplier for an fp8 cache (stored = sat(x / k_scale)).
    """
    num_blocks, block_size, width = kv_cache.shape
    rows = quantize_to_cache(torch.cat([kv_c, k_pe], dim=-1), kv_cache.dtype, k_scale)
    write_rows(_bytes(kv_cache).view(num_blocks * block_size, width), slot_mapping, _bytes(rows))


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float | torch.Tensor | None = None,
                      v_scale: float | torch.Tensor | None = None) -> None:
    """Write GQA keys/values [T, kv_heads, head_dim] into caches [num_blocks, block_size, kv_heads, head_dim]."""
    nb, bs = key_cache.shape[:2]
    write_rows(_bytes(key_cache).view(nb * bs, *key_cache.shape[2:]), slot_mapping,
               _bytes(quantize_to_cache(key, key_cache.dtype, k_scale)))
    write_rows(_bytes(value_cache).view(nb * bs, *value_cache.shape[2:]), slot_mapping,
               _bytes(quantize_to_cache(value, value_cache.dtype, v_scale)))


def gather_and_maybe_dequant_cache(cache: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
                                   seq_starts: torch.Tensor | None, out_dtype: torch.dtype,
                                   k_scale: float | torch.Tensor | None = None,
                                   token_to_seq: torch.Tensor | None = None, total: int | None = None) -> torch.Tensor:
    """Gather cached rows for a batch of requests into a dense workspace.

    Args:
        cache: [num_blocks, block_size, *row_shape], model dtype or float8_e4m3fn.
        block_table: [num_requests, max_blocks] int32, logical -> physical block.
        cu_seq_lens: [num_requests + 1] int32, row offsets of each request in the output.
        seq_starts: [num_requests] int32 or None (zeros), first position to gather; need not be
            block-aligned.
        out_dtype: dtype of the result (always dequantized from fp8 with ``k_scale``).
        token_to_seq: [cu_seq_lens[-1]] int32, request of each output row (computed if None).
        total: ``cu_seq_lens[-1]`` when the caller knows it (the Triton kernel then reads nothing on the
            host; this reference still checks the table on the host).
    Returns:
        [cu_seq_lens[-1], *row_shape] in ``out_dtype``: row t holds request b = token_to_seq[t] at
        position t - cu_seq_lens[b] + seq_starts[b].
    Raises:
        ValueError if a position lies beyond the request's block table.
    Semantics follow vLLM's gather_and_maybe_dequant_cache.
    """
    total = int(cu_seq_lens[-1]) if total is None else total
    num_reqs = cu_seq_lens.numel() - 1
    block_size = cache.shape[1]
    if total == 0:
        return torch.empty((0, *cache.shape[2:]), dtype=out_dtype, device=cache.device)
    if token_to_seq is None:
        lens = (cu_seq_lens[1:] - cu_seq_lens[:-1]).long()
        token_to_seq = torch.repeat_interleave(torch.arange(num_reqs, device=cache.device), lens)
    token_to_seq = token_to_seq.long()
    t = torch.arange(total, device=cache.device)
    pos = t - cu_seq_lens.long()[token_to_seq]
    if seq_starts is not None:
        pos = pos + seq_starts.long()[token_to_seq]
    logical = pos // block_size
    if int(logical.max()) >= block_table.shape[1]:
        raise ValueError("gather position beyond the request's block table")
    blocks = block_table.long()[token_to_seq, logical]
    if int(blocks.min()) < 0:
        raise ValueError("gather position maps to an unallocated block (-1)")
    flat = _bytes(cache).reshape(cache.shape[0] * block_size, *cache.shape[2:])
    rows = flat.index_select(0, blocks * block_size + pos % block_size)
    if cache.dtype == FP8_DTYPE:
        rows = rows.view(FP8_DTYPE)
    return dequantize_from_cache(rows, out_dtype, k_scale)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       causal_offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of one request, fp32 softmax.

    Args:
        q: [Tq, H, D]; k: [Tk, H or 1, D]; v: [Tk, H or 1, Dv] (a single KV head broadcasts).
        causal_offset: None = non-causal; else query i sees keys j <= i + causal_offset.
    Returns:
        out [Tq, H, Dv] in q's dtype, lse [Tq, H] fp32 (−inf for a query that sees no key).
    """
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float().expand(-1, q.shape[1], -1)) * scale
    if causal_offset is not None:
        tq, tk = q.shape[0], k.shape[0]
        mask = torch.arange(tk, device=q.device)[None, :] > (torch.arange(tq, device=q.device)[:, None] + causal_offset)
        scores = scores.masked_fill(mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]
    # A query with no visible key has an all -inf row: softmax gives NaN there; its output is 0.
    probs = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0)
    out = torch.einsum("hqk,khd->qhd", probs, v.float().expand(-1, q.shape[1], -1))
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def attention_with_lse_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              seq_lens_q: list[int], seq_lens_k: list[int],
                              causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_with_lse` of B requests laid end to end: request b's queries are the next
    ``seq_lens_q[b]`` rows of q [Σ Tq_b, H, D], its keys the next ``seq_lens_k[b]`` rows of k / v; causal:
    ``causal_offset = Tk_b − Tq_b`` (its queries are its last positions), else non-causal. Returns out
    [Σ Tq_b, H, Dv] in q's dtype, lse [Σ Tq_b, H] fp32 (0 and −inf for a query that sees no key).
    Raises ValueError when the lengths do not add up to q's and k's rows. (Reference of
    ``triton_prefill.attention_with_lse_varlen``, one request at a time.)"""
    return varlen_by_request(attention_with_lse, q, k, v, scale, seq_lens_q, seq_lens_k, causal)


def varlen_prefix_sums(seq_lens_q, seq_lens_k, q_rows: int, k_rows: int) -> tuple[list[int], list[int]]:
    """Prefix sums ``[0, n_0, n_0 + n_1, ...]`` of the query and key lengths of a varlen batch (both forms of
    :func:`attention_with_lse_varlen` check their lengths here). Raises ValueError for lengths that are not
    ints >= 0 (bools refused), lists of different lengths, or sums other than ``q_rows`` / ``k_rows``."""
    lq, lk = list(seq_lens_q), list(seq_lens_k)
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in lq + lk):
        raise ValueError(f"sequence lengths must be ints >= 0, got {lq} and {lk}")
    if len(lq) != len(lk) or sum(lq) != q_rows or sum(lk) != k_rows:
        raise ValueError(f"seq_lens_q {lq} ({len(lq)} requests) and seq_lens_k {lk} ({len(lk)}) must describe "
                         f"q's {q_rows} and k's {k_rows} rows")
    cu_q, cu_k = [0], [0]
    for a, b in zip(lq, lk):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    return cu_q, cu_k


def varlen_by_request(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      seq_lens_q: list[int], seq_lens_k: list[int], causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_with_lse_varlen` through ``attend`` (a function with :func:`attention_with_lse`'s
    signature) called once per request; the results concatenated."""
    seq_lens_q, seq_lens_k = list(seq_lens_q), list(seq_lens_k)
    varlen_prefix_sums(seq_lens_q, seq_lens_k, q.shape[0], k.shape[0])
    outs, lses = [], []
    qs = ks = 0
    for tq, tk in zip(seq_lens_q, seq_lens_k):
        o, lse = attend(q[qs:qs + tq], k[ks:ks + tk], v[ks:ks + tk], scale, tk - tq if causal else None)
        outs.append(o)
        lses.append(lse)
        qs, ks = qs + tq, ks + tk
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[-1]), torch.zeros(0, q.shape[1], dtype=torch.float32, device=q.device)
    return torch.cat(outs), torch.cat(lses)


def attention_with_lse_inplace(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                               causal_offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_with_lse` (same arguments, results and math) with less memory traffic: the dense
    attention of ``triton_ops.attention_with_lse`` for tensors that are not on a GPU (CUDA tensors take the
    FlashAttention-2 kernel of ``triton_prefill``; this was the GPU prefill's form before session 24).

    The one [H, Tq, Tk] fp32 score buffer is updated in place (scale, causal mask, ``exp(s - m)``) and
    the division by the row sum is applied to the [Tq, H, Dv] output instead of the probabilities:
    ~32 bytes of traffic per score element and one score-sized allocation, where the reference's
    ``logsumexp`` + ``softmax`` + ``nan_to_num`` chain moves ~60 bytes per element through four
    score-sized buffers (the long-context prefill is bound by exactly this). Equal to the reference
    within fp32 rounding (the normalization happens after the sum over keys, not before); a query with
    no visible key gets output 0 and LSE −inf. No host sync.
    """
    H = q.shape[1]
    tq, tk = q.shape[0], k.shape[0]
    if tk == 0:
        return q.new_zeros(tq, H, v.shape[-1]), torch.full((tq, H), float("-inf"), dtype=torch.float32, device=q.device)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float().expand(-1, H, -1))
    scores.mul_(scale)
    if causal_offset is not None:
        mask = torch.arange(tk, device=q.device)[None, :] > (torch.arange(tq, device=q.device)[:, None] + causal_offset)
        scores.masked_fill_(mask[None], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m.masked_fill_(torch.isinf(m), 0.0)  # a row with no visible key: exp(-inf - 0) = 0, row sum 0, LSE -inf
    probs = scores.sub_(m).exp_()  # unnormalized, in place
    denom = probs.sum(dim=-1)  # [H, Tq]
    lse = denom.log() + m.squeeze(-1)
    out = torch.einsum("hqk,khd->qhd", probs, v.float().expand(-1, H, -1))
    d = denom.transpose(0, 1)[..., None]  # [Tq, H, 1]
    out = torch.where(d > 0, out / d, 0.0)
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         query_start_loc: list[int] | torch.Tensor, seq_lens: list[int] | torch.Tensor, scale: float,
                         kv_lora_rank: int, k_scale: float | torch.Tensor | None = None,
                         max_rows_per_piece: int = DECODE_PIECE_ROWS, *, max_query_len: int | None = None,
                         max_seq_len: int | None = None,
                         visible_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention over a paged latent cache, multi-token causal queries allowed.

    Args:
        q: [T, H, kv_lora_rank + rope] absorbed queries (``q_nope · W_UK`` ++ rotated ``q_pe``).
        kv_cache: [num_blocks, block_size, kv_lora_rank + rope], model dtype or fp8 (dequantized
            on read with ``k_scale``; the reference walks each request's blocks in pieces of at most
            ``max_rows_per_piece`` rows merged by LSE, so no dequantized copy of a whole request,
            let alone the whole cache, is ever made).
        block_table: [B, max_blocks] int32.
        query_start_loc: B + 1 offsets into q; request b's queries are the last
            ``q_len_b`` positions of its ``seq_lens[b]`` cached tokens (causal among themselves).
        seq_lens: B, cached tokens per request (the queries' own rows included).
        scale: softmax scale.
        max_query_len / max_seq_len: host-side bounds for tensor lengths (below).
        visible_lens: optional [T] int tensor on q's device: query t sees the request's first
            ``visible_lens[t]`` rows instead of the causal rule (a DCP rank's local shard,
            ``distributed.dcp.dcp_rank_local_lens`` of the positions + 1); ``seq_lens`` are then the
            rows scanned. Lists are then taken as tensors (the padded path below).
    Returns:
        out [T, H, kv_lora_rank] in q's dtype (multiply by W_UV next), lse [T, H] fp32.

    ``query_start_loc`` and ``seq_lens`` may instead be int32 device tensors ([B + 1], [B]): then no
    length is read on the host (no device sync; the path a CUDA graph captures). Every request is
    padded to ``max_query_len`` queries (default T) and ``max_seq_len`` rows (default: the block
    table's capacity), which must bound the true lengths; rows past a request's own are masked, and a
    block-table entry of -1 is read as block 0 and masked likewise.
    """
    T, H, _ = q.shape
    if visible_lens is not None and not isinstance(seq_lens, torch.Tensor):
        if max_seq_len is None:
            max_seq_len = max(seq_lens, default=0)
        if max_query_len is None:
            max_query_len = max((e - s for s, e in zip(query_start_loc[:-1], query_start_loc[1:])), default=0)
        query_start_loc = torch.tensor(query_start_loc, dtype=torch.int32, device=q.device)
        seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=q.device)
    if isinstance(seq_lens, torch.Tensor):
        def planes(start, n):
            kv = gather_padded_rows(kv_cache, block_table, start, n, q.dtype, k_scale)[:, :, None, :]
            return kv, kv[..., :kv_lora_rank]
        return _padded_attention(q, query_start_loc, seq_lens, scale, planes, kv_cache.shape[1],
                                 block_table.shape[1], max_query_len, max_seq_len, max_rows_per_piece,
                                 visible_lens)
    out = q.new_zeros(T, H, kv_lora_rank)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(seq_lens)):
        s, e, L = query_start_loc[b], query_start_loc[b + 1], seq_lens[b]
        if e == s:
            continue
        o_b, l_b = None, None
        for start, kv in _paged_pieces(kv_cache, block_table[b], L, q.dtype, k_scale, max_rows_per_piece):
            kv = kv[:, None, :]
            o, l = attention_with_lse(q[s:e], kv, kv[..., :kv_lora_rank], scale,
                                      causal_offset=L - (e - s) - start)
            o_b, l_b = (o, l) if o_b is None else merge_attn_states(o_b, l_b, o, l)
        if o_b is not None:  # seq_len 0 (e.g. an empty DCP shard): output 0, LSE -inf
            out[s:e], lse[s:e] = o_b, l_b
    return out, lse


def paged_gqa_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                        query_start_loc: list[int] | torch.Tensor, seq_lens: list[int] | torch.Tensor, scale: float,
                        k_scale: float | torch.Tensor | None = None,
                        v_scale: float | torch.Tensor | None = None,
                        max_rows_per_piece: int = DECODE_PIECE_ROWS, *, max_query_len: int | None = None,
                        max_seq_len: int | None = None) -> torch.Tensor:
    """Causal GQA attention of each request's queries over its cached keys/values.

    Args:
        q: [T, num_heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim].
        query_start_loc / seq_lens / max_query_len / max_seq_len: as in :func:`mla_decode_attention`
            (device tensors take the sync-free padded path).
    Returns:
        [T, num_heads, head_dim] in q's dtype.
    """
    if isinstance(seq_lens, torch.Tensor):
        def planes(start, n):
            return (gather_padded_rows(key_cache, block_table, start, n, q.dtype, k_scale),
                    gather_padded_rows(value_cache, block_table, start, n, q.dtype, v_scale))
        return _padded_attention(q, query_start_loc, seq_lens, scale, planes, key_cache.shape[1],
                                 block_table.shape[1], max_query_len, max_seq_len, max_rows_per_piece)[0]
    T, H, D = q.shape
    kvh = key_cache.shape[2]
    rep = H // kvh
    out = q.new_zeros(T, H, value_cache.shape[-1])
    for b in range(len(seq_lens)):
        s, e, L = query_start_loc[b], query_start_loc[b + 1], seq_lens[b]
        if e == s:
            continue
        o_b, l_b = None, None
        pieces = zip(_paged_pieces(key_cache, block_table[b], L, q.dtype, k_scale, max_rows_per_piece),
                     _paged_pieces(value_cache, block_table[b], L, q.dtype, v_scale, max_rows_per_piece))
        for (start, k), (_, v) in pieces:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            o, l = attention_with_lse(q[s:e], k, v, scale, causal_offset=L - (e - s) - start)
            o_b, l_b = (o, l) if o_b is None else merge_attn_states(o_b, l_b, o, l)
        out[s:e] = o_b
    return out


def _paged_pieces(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, out_dtype: torch.dtype,
                  k_scale: float | torch.Tensor | None, max_rows: int):
    """Yield (first position, dequantized rows [n, *row_shape]) of one request's cached positions
    [0, seq_len) in pieces of at most ``max_rows`` rows (rounded down to whole blocks, at least one)."""
    bs = cache.shape[1]
    step = max(bs, max_rows // bs * bs)
    row = block_table_row[None]
    for start in range(0, seq_len, step):
        n = min(step, seq_len - start)
        cu = torch.tensor([0, n], dtype=torch.int32, device=cache.device)
        st = torch.tensor([start], dtype=torch.int32, device=cache.device)
        yield start, gather_and_maybe_dequant_cache(cache, row, cu, st, out_dtype, k_scale)


def gather_padded_rows(cache: torch.Tensor, block_table: torch.Tensor, start: int, n: int, out_dtype: torch.dtype,
                 k_scale: float | torch.Tensor | None) -> torch.Tensor:
    """Cached rows at positions [start, start + n) of every request of ``block_table``.

    Args:
        cache: [num_blocks, block_size, *row_shape], model dtype or float8_e4m3fn (dequantized with
            ``k_scale``). block_table: [B, max_blocks] int32 covering positions < start + n.
    Returns:
        [B, n, *row_shape] in ``out_dtype``. No device -> host sync: a -1 table entry reads block 0
        (the caller masks positions past each request's length).
    """
    bs = cache.shape[1]
    pos = torch.arange(start, start + n, device=cache.device)
    blocks = block_table[:, pos // bs].long().clamp(min=0)
    flat = _bytes(cache).reshape(cache.shape[0] * bs, *cache.shape[2:])
    rows = flat[blocks * bs + pos % bs]
    if cache.dtype == FP8_DTYPE:
        rows = rows.view(FP8_DTYPE)
    return dequantize_from_cache(rows, out_dtype, k_scale)


def _padded_attention(q: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, planes,
                      block_size: int, max_blocks: int, max_query_len: int | None, max_seq_len: int | None,
                      max_rows: int, visible_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal paged attention with device-tensor lengths and host bounds (no device sync).

    q [T, H, D]; ``planes(start, n)`` -> keys [B, n, G, D], values [B, n, G, Dv] of positions
    [start, start + n) (G kv heads, head h reads group h // (H / G)). Queries go to a padded
    [B, max_query_len] layout; query j of request b sits at position ``seq_lens[b] - q_len_b + j``
    and sees keys at positions <= it (with ``visible_lens`` [T]: keys at positions < visible_lens[t]).
    Pieces of at most ``max_rows`` rows are merged by LSE as in the list path. Returns out [T, H, Dv]
    in q's dtype, lse [T, H] fp32.
    """
    T, H, D = q.shape
    B = seq_lens.numel()
    dev = q.device
    Mq = T if max_query_len is None else max_query_len
    L = max_blocks * block_size if max_seq_len is None else min(max_seq_len, max_blocks * block_size)
    qsl = query_start_loc.long()
    t = torch.arange(T, device=dev)
    req = torch.searchsorted(qsl[1:], t, right=True)
    j = t - qsl[req]
    pos = seq_lens.long()[req] - (qsl[req + 1] - qsl[req]) + j
    if visible_lens is not None:
        pos = visible_lens.long() - 1   # the last visible key row
    slot = req * Mq + j
    qp = q.new_zeros(B * Mq, H, D).index_copy_(0, slot, q)
    qpos = torch.full((B * Mq,), -1, dtype=torch.long, device=dev).index_copy_(0, slot, pos).view(B, Mq)
    step = max(block_size, max_rows // block_size * block_size)
    out, lse = None, None
    for start in range(0, L, step):
        n = min(step, L - start)
        k, v = planes(start, n)
        G = k.shape[2]
        scores = torch.einsum("bqgrd,bkgd->bgrqk", qp.view(B, Mq, G, H // G, D).float(), k.float()) * scale
        hidden = torch.arange(start, start + n, device=dev)[None, None, :] > qpos[:, :, None]  # [B, Mq, n]
        scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
        l = torch.logsumexp(scores, dim=-1).permute(0, 3, 1, 2).reshape(B * Mq, H)
        # A query with no visible key has an all -inf row: softmax gives NaN there; its output is 0.
        probs = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0)
        o = torch.einsum("bgrqk,bkgd->bqgrd", probs, v.float()).reshape(B * Mq, H, v.shape[-1]).to(q.dtype)
        out, lse = (o, l) if out is None else merge_attn_states(out, lse, o, l)
    if out is None:  # no key positions at all
        return q.new_zeros(T, H, planes(0, 0)[1].shape[-1]), torch.full((T, H), float("-inf"), device=dev)
    return out[slot], lse[slot]


def merge_attn_states(prefix_output: torch.Tensor, prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
                      suffix_lse: torch.Tensor, output: torch.Tensor | None = None,
                      output_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets by their LSEs (vLLM
    ``merge_attn_states``; LSEs here are [T, H], token-major).

    Args:
        prefix_output / suffix_output: [T, H, D], any strides (e.g. a slice of a padded-V output).
        prefix_lse / suffix_lse: [T, H] fp32 natural-log LSE, any strides. +inf is treated as -inf
            (an empty key segment); a side whose LSE is -inf has weight exactly 0, even if its
            output holds garbage or NaN.
        output / output_lse: optional destinations ([T, H, D] / [T, H]); may alias neither input.
    Returns:
        (output [T, H, D] in prefix_output's dtype, lse [T, H] fp32). Where both LSEs are -inf the
        output is 0 and the LSE -inf; never NaN from the merge itself.
    Formula: m = max(lse_p, lse_s); w = e^(lse - m); out = (w_p o_p + w_s o_s) / (w_p + w_s);
    lse = m + log(w_p + w_s).
    """
    # NOTE: Python scalars, not torch.tensor(..., device=...): a host -> device copy would block the host
    # and cannot be captured in a CUDA graph (the drafter's padded forward merges with this on GPUs).
    neg_inf = float("-inf")
    lp = prefix_lse.float()
    ls = suffix_lse.float()
    lp = torch.where(lp == float("inf"), neg_inf, lp)
    ls = torch.where(ls == float("inf"), neg_inf, ls)
    m = torch.maximum(lp, ls)
    empty = m == float("-inf")
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    wp = torch.exp(lp - m_safe)
    ws = torch.exp(ls - m_safe)
    tot = wp + ws
    inv = torch.where(empty, torch.zeros_like(tot), 1.0 / torch.where(empty, torch.ones_like(tot), tot))
    zero = 0.0
    po = torch.where((wp > 0)[..., None], prefix_output.float() * (wp * inv)[..., None], zero)
    so = torch.where((ws > 0)[..., None], suffix_output.float() * (ws * inv)[..., None], zero)
    out_f = po + so
    lse = torch.where(empty, neg_inf, torch.log(torch.where(empty, torch.ones_like(tot), tot)) + m_safe)
    if output is None:
        output = out_f.to(prefix_output.dtype)
    else:
        output.copy_(out_f)
    if output_lse is None:
        output_lse = lse
    else:
        output_lse.copy_(lse)
    return output, output_lse
