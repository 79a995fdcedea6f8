"""Turns a scheduled step into tensors, runs the model, returns logits (nano-vllm ``ModelRunner``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from longflash.distributed.comm import single_process_state
from longflash.engine.block_table import block_ids_array
from longflash.engine.scheduler import SchedulerOutput
from longflash.models.base import CausalLM
from longflash.runner.context import ForwardContext, set_forward_context
from longflash.runner.state_pool import RecurrentStatePool
from longflash.runner.step_inputs import to_device_async

logger = logging.getLogger("longflash")


@dataclass
class StepResult:
    """logits [N, vocab] fp32; spans[i] = (first row, rows) of scheduled sequence i; the forward
    context (positions, slot_mapping of every token); aux taps [T, K·H] or None; ``chain``: a chained
    DFlash step's host results (``runner.cuda_graph.ChainedStep``: every row's argmax and the next
    drafts; the draft context of every row is then already written) or None."""

    logits: torch.Tensor
    spans: list[tuple[int, int]]
    ctx: ForwardContext
    aux: torch.Tensor | None = None
    chain: object | None = None


class ModelRunner:
    """Owns the model and its paged KV cache.

    ``supports_async_scheduling``: :meth:`execute_ahead` may launch a step before the previous one's
    tokens are read (one process; the TP/DCP runners post every step to their workers instead).

    Args:
        model: a loaded CausalLM.
        num_blocks / block_size: cache geometry (tokens per block).
        kv_cache_dtype: torch dtype of the cache (model dtype, bf16 or float8_e4m3fn).
        device: where tensors live.
        calculate_kv_scales: each attention layer sets its fp8 ``k_scale`` from its first batch.
        context_workspace_rows: W of chunked-context prefill (None = the layers' default).
        max_num_seqs: requests that may hold linear-attention (KDA) state at once; the model's
            ``state_pool`` (None without KDA layers) gets one more slot for ``LLMEngine.score``.
    """

    supports_async_scheduling = True

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype,
                 device: torch.device, calculate_kv_scales: bool = False,
                 context_workspace_rows: int | None = None, max_num_seqs: int = 64):
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
        kda_layers = model.recurrent_state_layers()
        self.state_pool = (RecurrentStatePool(kda_layers, max_num_seqs + 1, next(model.parameters()).dtype, device)
                           if kda_layers else None)
        self.decode_runner = None  # uniform decode/verify steps on persistent inputs (CUDA graphs)
        self.parallel = single_process_state()  # what this runner's forward contexts name (DCP: its groups)
        self._draft_rows: list[tuple[int, int]] = []  # draft-context rows awaiting flush_draft_context

    def enable_uniform_decode(self, max_model_len: int, max_num_seqs: int, query_lens: list[int],
                              capturer=None) -> None:
        """Run uniform decode/verify steps (``cuda_graph.uniform_query_len``) on persistent inputs,
        replayed from CUDA graphs when ``capturer`` (a ``cuda_graph.GraphCapturer``) is given.
        Raises ValueError for a model with recurrent (KDA) state, whose per-request state slots are
        host lists."""
        if self.state_pool is not None:
            raise ValueError("uniform decode steps / CUDA graphs do not support linear-attention (KDA) layers")
        from longflash.runner.cuda_graph import DecodeGraphRunner
        self.decode_runner = DecodeGraphRunner(self.model, self.block_size, max_model_len, max_num_seqs, query_lens,
                                               self.device, capturer)
        self.decode_runner.parallel = self.parallel

    def capture_graphs(self, proposer=None) -> None:
        """Capture the uniform decode/verify graphs (``DecodeGraphRunner.capture``; ``proposer``: the
        DFlash proposer whose fc outputs they also produce), then the proposer's drafter graphs when it
        drafts on persistent inputs. Raises what capture raises."""
        self.decode_runner.capture(proposer)
        if proposer is not None and proposer.uniform is not None:
            proposer.capture_graphs()

    def drop_graphs(self, proposer=None) -> None:
        """Destroy every captured graph (capture failed, or shutting down): the same steps run eagerly."""
        if self.decode_runner is not None:
            self.decode_runner.release()
        if proposer is not None and proposer.uniform is not None:
            proposer.uniform.release()

    def free_state(self, request_id: str) -> None:
        """Return a request's recurrent-state slot (finished, aborted, preempted); no-op without one."""
        if self.state_pool is not None:
            self.state_pool.free(request_id)

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, ForwardContext, list[tuple[int, int]]]:
        """Build input ids and the forward context.

        A decoding sequence with ``num_lookahead_tokens`` L verifies ``[pending, spec_token_ids[:L]]``
        (L + 1 query tokens, causal). Returns (input_ids [T], context, logit_spans) where
        logit_spans[i] = (first logits row, number of rows) of the i-th scheduled sequence:
        L + 1 rows for a verify, 1 row when the sequence reaches its last token, 0 for a prefill
        chunk that does not.
        """
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        qsl, seq_lens, ctx_lens, is_decode, spans, logits_idx = [0], [], [], [], [], []
        max_blocks = max(len(s.seq.block_table) for s in sched.scheduled)
        table = np.full((len(sched.scheduled), max_blocks), -1, dtype=np.int32)
        for i, s in enumerate(sched.scheduled):
            seq, start = s.seq, s.seq.num_computed_tokens
            n, L = s.num_new_tokens, s.num_lookahead_tokens
            end = start + n + L
            input_ids.extend(seq.token_ids[start:start + n])
            if L:
                input_ids.extend(seq.spec_token_ids[:L])
            positions.extend(range(start, end))
            bt = seq.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            table[i, :len(bt)] = block_ids_array(bt)
            qsl.append(qsl[-1] + n + L)
            seq_lens.append(end)
            ctx_lens.append(start)
            is_decode.append(start >= seq.num_prompt_tokens)
            if L:
                spans.append((len(logits_idx), L + 1))
                logits_idx.extend(range(qsl[-2], qsl[-1]))
            elif start + n == len(seq.token_ids):
                spans.append((len(logits_idx), 1))
                logits_idx.append(qsl[-1] - 1)
            else:
                spans.append((len(logits_idx), 0))
        dev = self.device
        ctx = ForwardContext(
            positions=to_device_async(positions, torch.int64, dev),
            slot_mapping=to_device_async(slots, torch.int64, dev),
            query_start_loc=to_device_async(qsl, torch.int32, dev),
            seq_lens=to_device_async(seq_lens, torch.int32, dev),
            context_lens=to_device_async(ctx_lens, torch.int32, dev),
            block_table=to_device_async(table, torch.int32, dev),
            is_decode=is_decode,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=ctx_lens,
            block_size=bs,
            logits_indices=to_device_async(logits_idx, torch.int64, dev),
            parallel=self.parallel,
        )
        if self.state_pool is not None:
            ctx.extras["state_slots"] = [self.state_pool.slot_for(s.seq.request_id) for s in sched.scheduled]
            ctx.extras["state_verify"] = [s.num_lookahead_tokens > 0 for s in sched.scheduled]
        return to_device_async(input_ids, torch.int64, dev), ctx, spans

    def propose(self, proposer, requests: list[tuple[int, int, int, list[int]]], masks=None) -> list[list[int]]:
        """Draft tokens of a DFlash ``proposer`` (``DFlashProposer.propose``, with its per-request draft
        ``masks`` or None); the DCP runner also has every worker rank draft the same requests."""
        return proposer.propose(requests, masks)

    def write_draft_context(self, proposer, res: StepResult, first_row: int, num_rows: int) -> None:
        """Write the draft-pool context K/V of rows ``[first_row, first_row + num_rows)`` of the
        forward ``res`` (committed tokens of one request) from its ``aux`` (fc outputs). With uniform
        decode enabled (the CUDA path) the rows are collected and written by one call in
        :meth:`flush_draft_context` (one write instead of one per request). A chained step (``res.chain``)
        wrote every row's context inside its forward: nothing to do."""
        if res.chain is not None:
            return
        if self.decode_runner is not None:
            self._draft_rows.append((first_row, num_rows))
            return
        r = slice(first_row, first_row + num_rows)
        proposer.write_context(res.aux[r], res.ctx.positions[r], res.ctx.slot_mapping[r])

    def flush_draft_context(self, proposer, res: StepResult) -> None:
        """Write the rows collected by :meth:`write_draft_context` for the forward ``res`` (no-op when
        none were collected)."""
        rows, self._draft_rows = getattr(self, "_draft_rows", []), []
        idx = [r for first, n in rows for r in range(first, first + n)]
        if idx:
            i = to_device_async(idx, torch.int64, res.aux.device)
            proposer.write_context(res.aux[i], res.ctx.positions[i], res.ctx.slot_mapping[i])

    @torch.inference_mode()
    def execute_ahead(self, sched: SchedulerOutput, token_ids: torch.Tensor) -> StepResult:
        """Launch the plain decode step after the one in flight (``DecodeGraphRunner.run_ahead``: each
        request one position past its ``num_computed_tokens``, input ids ``token_ids`` [B] int64 on the
        device). Needs uniform decode enabled; the caller reserved the cache slots."""
        return StepResult(*self.decode_runner.run_ahead(sched.scheduled, token_ids))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, all_logits: bool = False, tapper=None, proposer=None) -> StepResult:
        """Run one step: the model over all scheduled tokens, logits of the sampled rows (of every
        token with ``all_logits``). With a ``tapper``, ``aux`` holds the concatenated taps [T, K·H];
        with a DFlash ``proposer``, ``aux`` holds the drafter's ``fc`` outputs [T, H] instead."""
        if self.decode_runner is not None and tapper is None and not all_logits:
            q = self.decode_runner.query_len(sched)
            if q is not None:
                return StepResult(*self.decode_runner.run(sched, q, proposer))
        input_ids, ctx, spans = self.prepare(sched)
        aux = None
        with set_forward_context(ctx):
            if proposer is not None:
                with proposer.capture(input_ids.shape[0]) as holder:
                    hidden = self.model(input_ids)
                aux = holder.fc_out()
            elif tapper is not None:
                with tapper.capture() as taps:
                    hidden = self.model(input_ids)
                aux = tapper.concat(taps)
            else:
                hidden = self.model(input_ids)
            rows = hidden if all_logits else hidden[ctx.logits_indices]
            logits = self.model.compute_logits(rows)
        return StepResult(logits, spans, ctx, aux)
