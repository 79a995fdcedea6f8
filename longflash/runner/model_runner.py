"""Turns a scheduled step into tensors, runs the model, returns logits (nano-vllm ``ModelRunner``)."""

from __future__ import annotations

import logging

import torch

from longflash.engine.scheduler import SchedulerOutput
from longflash.models.base import CausalLM
from longflash.runner.context import ForwardContext, set_forward_context

logger = logging.getLogger("longflash")


class ModelRunner:
    """Owns the model and its paged KV cache.

    Args:
        model: a loaded CausalLM.
        num_blocks / block_size: cache geometry (tokens per block).
        kv_cache_dtype: torch dtype of the cache (model dtype, bf16 or float8_e4m3fn).
        device: where tensors live.
        calculate_kv_scales: each attention layer sets its fp8 ``k_scale`` from its first batch.
        context_workspace_rows: W of chunked-context prefill (None = the layers' default).
    """

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype,
                 device: torch.device, calculate_kv_scales: bool = False,
                 context_workspace_rows: int | None = None):
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype
        spec = model.kv_cache_spec()
        self.kv_caches = []
        for layer in model.attention_layers():
            cache = torch.zeros(spec.block_shape(num_blocks, block_size), dtype=kv_cache_dtype, device=device)
            layer.kv_cache = cache
            if calculate_kv_scales and hasattr(layer, "calculate_kv_scales"):
                layer.calculate_kv_scales = True
            if context_workspace_rows is not None and hasattr(layer, "context_workspace_rows"):
                layer.context_workspace_rows = context_workspace_rows
            self.kv_caches.append(cache)

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, ForwardContext, list[int]]:
        """Build input ids and the forward context.

        Returns (input_ids [T], context, sample_rows) where sample_rows[i] is the index into the
        logits of the i-th scheduled sequence, or -1 if that sequence does not sample this step
        (a prefill chunk that does not reach its last token).
        """
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        qsl, seq_lens, ctx_lens, is_decode, sample_rows, logits_idx = [0], [], [], [], [], []
        max_blocks = max(len(s.seq.block_table) for s in sched.scheduled)
        table = torch.full((len(sched.scheduled), max_blocks), -1, dtype=torch.int32)
        for i, s in enumerate(sched.scheduled):
            seq, start = s.seq, s.seq.num_computed_tokens
            n = s.num_new_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            bt = seq.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            table[i, :len(bt)] = torch.tensor(bt, dtype=torch.int32)
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            ctx_lens.append(start)
            is_decode.append(start >= seq.num_prompt_tokens)
            if end == len(seq.token_ids):
                sample_rows.append(len(logits_idx))
                logits_idx.append(qsl[-1] - 1)
            else:
                sample_rows.append(-1)
        dev = self.device
        ctx = ForwardContext(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            block_table=table.to(dev),
            is_decode=is_decode,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=ctx_lens,
            block_size=bs,
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=dev),
        )
        return torch.tensor(input_ids, dtype=torch.int64, device=dev), ctx, sample_rows

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, all_logits: bool = False) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns (logits [N, vocab] fp32 for sampling rows, sample_rows); with
        ``all_logits`` the logits of every scheduled token [T, vocab] instead."""
        input_ids, ctx, sample_rows = self.prepare(sched)
        with set_forward_context(ctx):
            hidden = self.model(input_ids)
            rows = hidden if all_logits else hidden[ctx.logits_indices]
            logits = self.model.compute_logits(rows)
        return logits, sample_rows
