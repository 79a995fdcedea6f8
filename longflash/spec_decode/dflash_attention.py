"""The DFlash drafter's paged non-causal block attention: the PyTorch reference and the dispatcher.

Each of R requests drafts a block of Bk rows (contiguous in q, request-major). A query row of request r
attends, non-causally, to its request's cached context positions ``[lo, context_len)`` (``lo = 0``, or
``context_len - window`` clamped to 0 for a sliding-window layer) read from the paged draft pool
through ``block_table``, and to all Bk block rows of its own request (always visible). GQA: query head
h reads kv head ``h // (nh / kvh)``. Softmax in fp32, scale ``head_dim^-0.5`` given by the caller.
Source: ``shared/specs/dflash.md`` ("Drafter": non-causal over [context ; block], the window bounds the
context lookback only).

The reference is the math of the drafter's padded block forward before the kernel existed: the
context is gathered padded in pieces of whole pool blocks up to the host bound (no device sync; what
a CUDA graph captures), masked per request, and merged by LSE with the block's own part. It does
O(bound) work; the Triton kernel (``dflash_attention_triton``) reads only each request's real context.
:func:`block_attention_op` picks the kernel for CUDA tensors (when Triton is importable), else the
reference (the CPU engine and CPU tests).
"""

from __future__ import annotations

import functools

import torch

from longflash.attention import ops

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_block_attention_args(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                               window: int | None, max_context_len: int | None) -> tuple[int, int, int]:
    """Validate the arguments of :func:`dflash_block_attention` (shapes, dtypes, devices only: nothing
    is read from the device). Returns (R requests, Bk rows per block, L = host bound of context
    positions: ``min(max_context_len, max_blocks · block_size)``). Raises ValueError naming the problem."""
    if q.dim() != 3 or k_blk.dim() != 3 or v_blk.dim() != 3:
        raise ValueError(f"q, k_blk, v_blk must be [T, heads, head_dim], got {tuple(q.shape)}, {tuple(k_blk.shape)}, "
                         f"{tuple(v_blk.shape)}")
    T, nh, hd = q.shape
    if k_blk.shape != v_blk.shape or k_blk.shape[0] != T or k_blk.shape[2] != hd:
        raise ValueError(f"k_blk and v_blk must both be [T={T}, kv_heads, {hd}], got {tuple(k_blk.shape)} and "
                         f"{tuple(v_blk.shape)}")
    kvh = k_blk.shape[1]
    if kvh == 0 or nh % kvh:
        raise ValueError(f"{nh} query heads are not a multiple of {kvh} kv heads")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (kvh, hd):
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, {kvh}, {hd}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.dtype not in _FLOAT_DTYPES or k_blk.dtype != q.dtype or v_blk.dtype != q.dtype:
        raise ValueError(f"q, k_blk, v_blk must share one of bf16/fp16/fp32, got {q.dtype}, {k_blk.dtype}, "
                         f"{v_blk.dtype}")
    if k_cache.dtype not in _FLOAT_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the draft pool must be bf16/fp16/fp32 (one dtype for K and V), got {k_cache.dtype} "
                         f"and {v_cache.dtype}")
    if context_lens.dim() != 1 or context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"context_lens must be a 1-D int32/int64 tensor, got {tuple(context_lens.shape)} "
                         f"{context_lens.dtype}")
    R = context_lens.numel()
    if (R == 0) != (T == 0) or (R and T % R):
        raise ValueError(f"{T} query rows do not split into equal blocks of {R} requests")
    if block_table.dim() != 2 or block_table.shape[0] != R or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be [R={R}, max_blocks] int32, got {tuple(block_table.shape)} "
                         f"{block_table.dtype}")
    devs = {t.device for t in (q, k_blk, v_blk, k_cache, v_cache, block_table, context_lens)}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    capacity = block_table.shape[1] * k_cache.shape[1]
    if max_context_len is not None and max_context_len < 0:
        raise ValueError(f"max_context_len must be >= 0, got {max_context_len}")
    L = capacity if max_context_len is None else min(int(max_context_len), capacity)
    return R, (T // R if R else 0), L


def dflash_block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int | None = None, max_context_len: int | None = None,
                           max_rows: int = ops.DECODE_PIECE_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of each request's block over [its paged context ; its block] (reference).

    Args:
        q: [R·Bk, nh, hd] bf16/fp16/fp32, request r owning rows ``r·Bk .. r·Bk + Bk − 1``.
        k_blk, v_blk: [R·Bk, kvh, hd] in q's dtype, the block's own keys/values (nh = kvh · rep).
        k_cache, v_cache: [num_blocks, block_size, kvh, hd] bf16/fp16/fp32, the draft pool's planes
            (``kv_cache[0]``, ``kv_cache[1]``); rows are rounded to q's dtype on read.
        block_table: [R, max_blocks] int32, logical -> physical pool block; a -1 entry is read as
            block 0 and must lie past the request's context (masked).
        context_lens: [R] int32 device tensor (never read on the host): cached context rows per request.
        scale: softmax scale (the drafter's ``head_dim^-0.5``).
        window: None, or the sliding window: context positions >= context_len − window are visible.
        max_context_len: host bound of ``context_lens`` (under a CUDA graph: the pool capacity);
            positions >= min(max_context_len, max_blocks · block_size) are never read. None: the table's capacity.
        max_rows: the reference gathers at most this many context rows per piece (rounded down to
            whole pool blocks, at least one).
    Returns:
        out [R·Bk, nh, hd] in q's dtype (fp32 softmax and accumulation), lse [R·Bk, nh] fp32 (natural
        log-sum-exp of the scaled logits; finite, since the block rows are always visible).
    Raises:
        ValueError on inconsistent shapes, dtypes or devices (:func:`check_block_attention_args`).
    """
    R, Bk, L = check_block_attention_args(q, k_blk, v_blk, k_cache, v_cache, block_table, context_lens, window,
                                          max_context_len)
    T, nh, hd = q.shape
    G = k_blk.shape[1]
    if T == 0:
        return q.new_empty(0, nh, hd), torch.empty(0, nh, dtype=torch.float32, device=q.device)
    qg = q.float().view(R, Bk, G, nh // G, hd)
    out, lse = _grouped_attention(qg, k_blk.view(R, Bk, G, hd), v_blk.view(R, Bk, G, hd), None, scale)
    ctx_len = context_lens.long()
    lo = (ctx_len - window).clamp(min=0) if window is not None else torch.zeros_like(ctx_len)
    bs = k_cache.shape[1]
    step = max(bs, max_rows // bs * bs)
    for start in range(0, L, step):
        n = min(step, L - start)
        k = ops.gather_padded_rows(k_cache, block_table, start, n, q.dtype, None)
        v = ops.gather_padded_rows(v_cache, block_table, start, n, q.dtype, None)
        pos = torch.arange(start, start + n, device=q.device)[None, :]
        o, l = _grouped_attention(qg, k, v, (pos >= lo[:, None]) & (pos < ctx_len[:, None]), scale)
        out, lse = ops.merge_attn_states(out, lse, o, l)
    return out.to(q.dtype).view(T, nh, hd), lse


def _grouped_attention(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of queries qg [R, Bk, G, rep, D] (fp32) over keys/values [R, n, G, D];
    ``visible`` [R, n] bool or None (all). Returns out [R·Bk, G·rep, D] fp32 and lse [R·Bk, G·rep]
    (-inf, output 0 for a query that sees no key)."""
    R, Bk, G, rep, D = qg.shape
    s = torch.einsum("bqgrd,bkgd->bgrqk", qg, k.float()) * scale
    if visible is not None:
        s = s.masked_fill(~visible[:, None, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1).permute(0, 3, 1, 2).reshape(R * Bk, G * rep)
    probs = torch.softmax(s, dim=-1).nan_to_num(nan=0.0)
    out = torch.einsum("bgrqk,bkgd->bqgrd", probs, v.float()).reshape(R * Bk, G * rep, -1)
    return out, lse


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def block_attention_op(q: torch.Tensor):
    """:func:`dflash_block_attention` for ``q``'s device: the Triton kernel
    (``dflash_attention_triton.dflash_block_attention``, same signature and result) for CUDA tensors
    when Triton is importable, the PyTorch reference elsewhere."""
    if q.is_cuda and _triton_importable():
        from longflash.spec_decode import dflash_attention_triton
        return dflash_attention_triton.dflash_block_attention
    return dflash_block_attention
