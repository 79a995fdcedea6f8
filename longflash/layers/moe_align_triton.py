"""Sort the (token, slot) rows of a routed batch by expert in one Triton launch (the layout of vLLM's
``moe_align_block_size``), and set up the one-launch MXFP4 MoE kernel's scheduler counters.

The PyTorch reference is ``longflash.layers.mxfp4_moe_triton.moe_align`` (about 30 small torch ops, no
host sync); this kernel gives the same layout in one launch (measured cost: ``benchmarks/NOTES.md``). One
program walks the rows three times: a per-expert counter (``atomic_add``, which also gives each row its
rank among the rows of its expert), a prefix sum of the padded counts, then each row is written to
``pad_start[expert] + rank``. On a GPU the ranks follow the atomics' arrival order, so the rows of one
expert may come in another order than the reference's (stable) one; the MoE result does not depend on it
(each row is its own column of the tile products). Under ``TRITON_INTERPRET=1`` the order is the stable one.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

_CHUNK = 1024


@triton.jit
def _moe_align_kernel(ids_ptr, ws_ptr, n, max_blocks, num_experts,
                      E_BINS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """ws_ptr int32 [2 + 2*max_blocks + E_BINS + n + max_blocks*BLOCK_M] (see ``moe_align_triton``)."""
    sched_ptr = ws_ptr
    block_expert_ptr = ws_ptr + 2 + max_blocks
    count_ptr = block_expert_ptr + max_blocks
    rank_ptr = count_ptr + E_BINS
    sorted_ptr = rank_ptr + n
    eo = tl.arange(0, E_BINS)
    tl.store(count_ptr + eo, tl.zeros((E_BINS,), tl.int32))
    # scheduler counters (tile counter, ready counters) 0; sorted ids n (padding); block experts -1
    start = 0
    while start < 2 + max_blocks:
        o = start + tl.arange(0, CHUNK)
        tl.store(sched_ptr + o, tl.zeros((CHUNK,), tl.int32), mask=o < 2 + max_blocks)
        start += CHUNK
    start = 0
    while start < max_blocks * BLOCK_M:
        o = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + o, tl.zeros((CHUNK,), tl.int32) + n, mask=o < max_blocks * BLOCK_M)
        start += CHUNK
    tl.debug_barrier()
    # 1. count per expert; the returned old value is the row's rank within its expert
    start = 0
    while start < n:
        o = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + o, mask=o < n, other=0).to(tl.int32)
        ok = (o < n) & (e >= 0) & (e < num_experts)
        r = tl.atomic_add(count_ptr + e, 1, mask=ok, sem="relaxed")
        tl.store(rank_ptr + o, r, mask=ok)
        start += CHUNK
    tl.debug_barrier()
    # 2. padded prefix sum -> each expert's first padded row; the number of row blocks in use
    counts = tl.load(count_ptr + eo, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_start = tl.cumsum(padded, 0) - padded
    tl.debug_barrier()
    tl.store(count_ptr + eo, pad_start)
    tl.store(sched_ptr + 1, tl.sum(padded, 0) // BLOCK_M)
    tl.debug_barrier()
    # 3. scatter each row to its padded slot
    start = 0
    while start < n:
        o = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + o, mask=o < n, other=0).to(tl.int32)
        ok = (o < n) & (e >= 0) & (e < num_experts)
        r = tl.load(rank_ptr + o, mask=ok, other=0, cache_modifier=".cg")
        base = tl.load(count_ptr + e, mask=ok, other=0, cache_modifier=".cg")
        tl.store(sorted_ptr + base + r, o, mask=ok)
        start += CHUNK
    tl.debug_barrier()
    # 4. the expert of each block in use (its first row is a real row), -1 after
    nb = tl.load(sched_ptr + 1, cache_modifier=".cg")
    start = 0
    while start < max_blocks:
        b = start + tl.arange(0, CHUNK)
        used = b < nb
        row = tl.load(sorted_ptr + b * BLOCK_M, mask=used, other=0, cache_modifier=".cg")
        e = tl.load(ids_ptr + row, mask=used, other=-1).to(tl.int32)
        tl.store(block_expert_ptr + b, e, mask=b < max_blocks)
        start += CHUNK


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``moe_align`` layout in one launch, plus the MXFP4 MoE kernel's zeroed scheduler counters.

    topk_ids [T, k] int (values in [0, num_experts); others are dropped, not checked: that needs a host
    sync) -> (sorted_ids [max_blocks * block_m] int32: flat row t*k+slot, T*k for padding;
    block_expert [max_blocks] int32: expert of each row block, -1 for unused blocks;
    sched [2 + max_blocks] int32: [0] = 0 (tile counter), [1] = the blocks in use, [2:] = 0 (ready counters)),
    with ``max_blocks = T*k // block_m + min(T*k, num_experts)`` as in ``moe_align``. All three are views of
    one int32 workspace. Raises ValueError for a non-2-D ``topk_ids`` or a block_m that is not a power of two.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {list(topk_ids.shape)}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    ids = topk_ids.reshape(-1)
    n = ids.numel()
    max_blocks = n // block_m + min(n, num_experts)
    e_bins = triton.next_power_of_2(max(num_experts, 16))
    ws = torch.empty(2 + 2 * max_blocks + e_bins + n + max_blocks * block_m, dtype=torch.int32, device=ids.device)
    if n:
        _moe_align_kernel[(1,)](ids, ws, n, max_blocks, num_experts, E_BINS=e_bins, BLOCK_M=block_m,
                                CHUNK=_CHUNK, num_warps=4)
    else:
        ws.zero_()
    sched = ws[:2 + max_blocks]
    block_expert = ws[2 + max_blocks:2 + 2 * max_blocks]
    sorted_ids = ws[ws.numel() - max_blocks * block_m:]
    return sorted_ids, block_expert, sched
