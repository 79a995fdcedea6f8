"""The DCP process model: rank 0 schedules and broadcasts each step; every rank runs the model.

Rank 0 owns the scheduler and a :class:`DCPModelRunner` whose ``prepare`` posts each step's
(input ids, forward context) on the :class:`~longflash.distributed.comm.StepChannel`; ranks 1..N-1
run :meth:`DCPModelRunner.serve_forever`. Every rank holds the full model (weights replicated: tensor
parallel weight sharding is a later step) and its own KV shard: logical blocks cover
``block_size * dcp_size`` tokens (rank 0's block manager uses that as ``tokens_per_block``) and each
rank stores its positions in its physical block of the same id (``dcp.dcp_slot_mapping``). MLA layers
read the DCP group from ``comm.get_parallel_state()``.
"""

from __future__ import annotations

import dataclasses

import torch

from longflash.distributed.comm import ParallelState, StepChannel
from longflash.distributed.dcp import check_dcp_args, dcp_slot_mapping
from longflash.runner.context import ForwardContext, set_forward_context
from longflash.runner.model_runner import ModelRunner


class DCPModelRunner(ModelRunner):
    """A ModelRunner whose cache holds this rank's DCP shard.

    Args (besides ModelRunner's): ``parallel`` (this rank's groups and interleave size), ``channel``
    (the step channel over the DCP group's ranks; rank 0 posts, others receive).
    ``block_size`` is the physical block size of this rank's cache; ``self.block_size`` becomes the
    logical block (``block_size * dcp_size`` tokens), as the base ``prepare`` indexes block tables.
    """

    def __init__(self, model, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype, device: torch.device,
                 calculate_kv_scales: bool = False, context_workspace_rows: int | None = None, *,
                 parallel: ParallelState, channel: StepChannel):
        check_dcp_args(block_size, parallel.dcp_size, parallel.cp_kv_cache_interleave_size)
        super().__init__(model, num_blocks, block_size, kv_cache_dtype, device, calculate_kv_scales,
                         context_workspace_rows)
        self.parallel = parallel
        self.channel = channel
        self.physical_block_size = block_size
        # NOTE: the base prepare() computes single-process slots with self.block_size; localize()
        # replaces them, so only the logical block indexing of that code matters.
        self.block_size = block_size * parallel.dcp_size

    def localize(self, ctx: ForwardContext) -> ForwardContext:
        """The context with this rank's slot mapping (-1 where another rank owns the token) and the
        physical block size."""
        lens = ctx.query_start_loc[1:] - ctx.query_start_loc[:-1]
        token_to_req = torch.repeat_interleave(torch.arange(ctx.num_reqs, device=lens.device), lens.long())
        slots = dcp_slot_mapping(ctx.positions, ctx.block_table, self.physical_block_size, self.parallel.dcp_size,
                                 self.parallel.dcp_rank, self.parallel.cp_kv_cache_interleave_size, token_to_req)
        return dataclasses.replace(ctx, slot_mapping=slots, block_size=self.physical_block_size)

    def prepare(self, sched):
        input_ids, ctx, spans = super().prepare(sched)
        self.channel.post((input_ids, ctx))
        return input_ids, self.localize(ctx), spans

    @torch.inference_mode()
    def serve_forever(self) -> None:
        """Worker loop: run each posted step's forward until rank 0 posts None. Any failure (a
        collective whose peer died or timed out) propagates, so the worker exits non-zero."""
        while True:
            msg = self.channel.recv()
            if msg is None:
                return
            input_ids, ctx = msg
            with set_forward_context(self.localize(ctx)):
                self.model(input_ids)

    def shutdown(self) -> None:
        """Rank 0: tell the workers to exit."""
        self.channel.post(None)
