"""The forward context: per-step batch metadata that attention layers read (nano-vllm ``Context``).

The model runner sets it before a forward and clears it after; attention layers take no metadata
arguments. Token-major tensors cover all scheduled tokens of the step, in request order.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class ForwardContext:
    """Batch metadata of one forward.

    Attributes:
        positions: [T] int64, absolute position of each token.
        slot_mapping: [T] int64, cache slot of each token (block_id * block_size + offset), -1 = skip.
        query_start_loc: [B + 1] int32, token offset of each request (cumulative query lengths).
        seq_lens: [B] int32, tokens in the cache for each request after this step's writes.
        context_lens: [B] int32, tokens already cached before this step (seq_len - query_len).
        block_table: [B, max_blocks] int32, logical -> physical block id (-1 padding).
        is_decode: per request, True if it uses the absorbed/decode attention path
            (its queries are generated tokens, possibly several for speculative verify).
        query_start_loc_cpu / seq_lens_cpu / context_lens_cpu: the same as Python lists (no syncs).
        block_size: tokens per physical block.
        logits_indices: [N] int64, token rows whose logits are needed (one per sampled position).
        uniform_decode: every request decodes ``max_query_len`` tokens (a plain decode step, or a
            speculative verify with the same number of drafts everywhere). Attention layers then take
            one batched call that reads only the device tensors plus the host bounds below, never the
            per-request lists: the path a CUDA graph captures (the lists may describe the capture's
            batch, not the replayed one).
        max_query_len / max_seq_len: host-side upper bounds of the query lengths and of ``seq_lens``
            (under a CUDA graph: the bucket's capacity); 0 = unknown (compute from the lists).
        parallel: the ``comm.ParallelState`` of the runner that built this context (its DCP group),
            so two engines in one process (one with DCP, one without) never read each other's; None:
            the process-wide ``comm.get_parallel_state()`` (runner-less callers). Never sent to workers.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    is_decode: list[bool]
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    context_lens_cpu: list[int]
    block_size: int
    logits_indices: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)
    uniform_decode: bool = False
    max_query_len: int = 0
    max_seq_len: int = 0
    parallel: object | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    """The current forward's context. Raises RuntimeError outside a forward."""
    if _CONTEXT is None:
        raise RuntimeError("no forward context is set: attention layers run only inside ModelRunner.forward")
    return _CONTEXT


@contextmanager
def set_forward_context(ctx: ForwardContext):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev
