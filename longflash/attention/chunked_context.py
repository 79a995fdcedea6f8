"""Chunked-context prefill: plan how the cached context of a batch's prefill requests is gathered
through a bounded workspace, and merge partial attention results by LSE.

A prefill chunk whose request already has cached context (its second and later prefill chunks, or a
prefix-cache hit) attends (a) to its new tokens causally and (b) to the cached context non-causally.
(b) runs over workspace chunks of at most ``W`` rows: requests are packed in order into a chunk
until it is full; a context longer than what is left in the chunk is split at a block-aligned
position (so every piece after the first starts on a block boundary) and continues in the next
chunk. A request with no context never appears in a chunk. Each chunk is one
``gather_and_maybe_dequant_cache`` call (its ``cu_seq_lens``/``seq_starts``/``token_to_seq`` come
from the plan), so the peak workspace is W rows whatever the context length
(``shared/specs/mla_dcp_fp8.md``, vLLM's chunked-context MLA prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longflash.attention.ops import merge_attn_states

__all__ = ["ContextSegment", "ContextChunk", "plan_context_chunks", "merge_attn_states"]

DEFAULT_CONTEXT_WORKSPACE_ROWS = 64 * 1024


@dataclass(frozen=True)
class ContextSegment:
    """Positions [start, start + length) of request ``req`` (index in the batch), at workspace rows
    [offset, offset + length) of its chunk. ``length`` > 0 always."""

    req: int
    start: int
    length: int
    offset: int


@dataclass(frozen=True)
class ContextChunk:
    """One workspace fill: segments in request order, ``num_rows`` <= W."""

    segments: tuple[ContextSegment, ...]

    @property
    def num_rows(self) -> int:
        return sum(s.length for s in self.segments)

    def gather_args(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(req_ids [n] int64, cu_seq_lens [n + 1] int32, seq_starts [n] int32) for the gather op;
        the block table passed with them is the batch's table indexed by ``req_ids``."""
        from longflash.runner.step_inputs import to_device_async  # pinned, non-blocking: no host sync
        device = torch.device(device)
        req = to_device_async([s.req for s in self.segments], torch.int64, device)
        cu = to_device_async([0] + [s.offset + s.length for s in self.segments], torch.int32, device)
        starts = to_device_async([s.start for s in self.segments], torch.int32, device)
        return req, cu, starts


def plan_context_chunks(context_lens: list[int], workspace_rows: int, block_size: int) -> list[ContextChunk]:
    """Pack cached context rows of requests into workspace chunks of at most ``workspace_rows`` rows.

    Args:
        context_lens: cached tokens before this step, per request of the batch (0 = no context).
        workspace_rows: W, rows of one chunk; must be >= block_size.
        block_size: tokens per block; a request split across chunks is cut at a multiple of it.
    Returns:
        Chunks in order; concatenated, their segments cover every context position of every request
        exactly once, in request order and ascending position. Empty when no request has context.
    Raises:
        ValueError if workspace_rows < block_size (no aligned split point would exist).
    """
    if workspace_rows < block_size:
        raise ValueError(f"context workspace of {workspace_rows} rows is smaller than one block ({block_size})")
    chunks: list[ContextChunk] = []
    cur: list[ContextSegment] = []
    used = 0
    for req, n in enumerate(context_lens):
        pos = 0
        while pos < n:
            room = workspace_rows - used
            take = n - pos
            if take > room:
                # Cut so that the next piece starts on a block boundary; if not even one aligned
                # piece fits in the remaining room, close this chunk and start a fresh one.
                cut = (pos + room) // block_size * block_size - pos
                if cut <= 0:
                    chunks.append(ContextChunk(tuple(cur)))
                    cur, used = [], 0
                    continue
                take = cut
            cur.append(ContextSegment(req, pos, take, used))
            used += take
            pos += take
            if used == workspace_rows:
                chunks.append(ContextChunk(tuple(cur)))
                cur, used = [], 0
    if cur:
        chunks.append(ContextChunk(tuple(cur)))
    return chunks
