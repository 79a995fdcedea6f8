"""DFlash proposer: owns the drafter, its draft KV pool and the target taps; drafts a block per
decoding request and keeps the draft context in step with committed tokens.

The draft pool is a separate paged cache per draft layer ([2, num_blocks, block_size, kv_heads,
head_dim], bf16 or the fp32 model dtype, never fp8 even when the target cache is fp8: the drafter's
non-causal attention reads it as is) addressed with the target's block ids and slot mapping, so
prefix-cache sharing and preemption need nothing extra: every committed token's context K/V is
written in the same step that computes its target KV, before its block can be shared.

Under decode-context parallelism (DCP) the draft pool is *replicated*, never sharded (sharding it
changed the draft distribution in production engines, ``shared/specs/dflash.md`` "Engines'
pitfalls"): a logical block covers ``block_size * dcp`` tokens and every rank's pool holds all of
them, with the single-process slot formula on logical blocks (see ``docs/dcp.md``).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import numpy as np
import torch

from longflash.engine.block_table import block_ids_array
from longflash.runner.step_inputs import to_device_async
from longflash.spec_decode.dflash_model import DFlashDraftModel, load_drafter
from longflash.spec_decode.draft_mask import DraftMask, apply_draft_masks, write_mask_codes
from longflash.spec_decode.taps import AuxTapper

logger = logging.getLogger("longflash")


class DFlashProposer:
    """Args: drafter directory, the loaded target model, model dtype and device."""

    def __init__(self, path: str, target, dtype: torch.dtype, device: torch.device, mxfp8_input: bool = False,
                 staged_threshold: int = 512, max_tokens: int = 2048):
        self.path = path
        self.target = target
        self.device = device
        num_layers = len(target.model.layers)
        self.drafter: DFlashDraftModel = load_drafter(path, num_layers, dtype, device)
        cfg = self.drafter.cfg
        if cfg.hidden_size != target.config["hidden_size"]:
            raise ValueError(f"drafter hidden_size {cfg.hidden_size} != target hidden_size {target.config['hidden_size']}")
        self.tapper = AuxTapper(target, cfg.target_layer_ids, cfg.aux_hidden_state_mode)
        self.block_size = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        # the drafter's KV pool in the model dtype (its weights' dtype; an fp16 model had a bf16 pool and failed
        # in the first draft, found by a fresh-user review)
        self.pool_dtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16
        self.kv_caches: list[torch.Tensor] = []
        self.uniform = None  # DraftGraphRunner (enable_uniform): uniform batches on persistent inputs
        # Optional MXFP8 drafter input (shared/specs/mxfp8.md): the taps are quantized to MXFP8 and
        # fc runs on the dequantized buffer. Large forwards quantize each tap as the target produces
        # it (staged); small ones list-and-concatenate first. Both give the same bytes.
        self.mxfp8_input = mxfp8_input
        self.staged_threshold = staged_threshold
        self._staged = None
        if mxfp8_input:
            from longflash.spec_decode.staged_input import StagedDrafterInput, drafter_fc_compatible, mxfp8_buffers
            widths = [cfg.hidden_size] * len(cfg.target_layer_ids)
            self.staged_compatible = drafter_fc_compatible(self.drafter.fc, widths) and self.tapper.in_layer_order
            data, scales, out = mxfp8_buffers(max_tokens, widths, cfg.hidden_size, device=device,
                                              out_dtype=self.drafter.fc.weight.dtype)
            self._staged = StagedDrafterInput(widths, self.drafter.fc.weight, data, scales, out, 0)

    def enable_uniform(self, block_size: int, max_model_len: int, max_num_seqs: int, capturer=None) -> None:
        """Draft from persistent inputs without host syncs (one read of the drafts), through CUDA graphs
        when ``capturer`` (``runner.cuda_graph.GraphCapturer``) is given (``spec_decode.draft_graph``).
        ``block_size``: the cache's tokens per block. Call after :meth:`allocate`."""
        from longflash.spec_decode.draft_graph import DraftGraphRunner
        self.uniform = DraftGraphRunner(self, block_size, max_model_len, max_num_seqs, self.device, capturer)

    def capture_graphs(self) -> None:
        """Capture the drafter's graphs (after :meth:`enable_uniform` with a capturer)."""
        self.uniform.capture()

    @classmethod
    def from_engine_config(cls, path: str, target, dtype: torch.dtype, device: torch.device,
                           config) -> "DFlashProposer":
        """The proposer for drafter directory ``path`` with the drafter-input options of an
        ``EngineConfig`` (the engine and every DCP worker build it the same way)."""
        return cls(path, target, dtype, device, mxfp8_input=config.dflash_mxfp8_input,
                   staged_threshold=config.dflash_staged_threshold, max_tokens=config.max_num_batched_tokens)

    def kv_bytes_per_token(self) -> int:
        """Draft-pool bytes per token (all draft layers, K and V)."""
        kvh, hd = self.drafter.kv_row_shape()
        elem = torch.empty((), dtype=self.pool_dtype).element_size()
        return 2 * kvh * hd * elem * len(self.drafter.layers)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Allocate the draft pool: ``num_blocks`` blocks of ``block_size`` token rows per draft layer.

        ``block_size`` is the tokens of a *logical* block: the target's block size, times
        ``dcp_size`` under DCP (the pool is replicated, so each rank holds every token of a block).
        """
        kvh, hd = self.drafter.kv_row_shape()
        self.kv_caches = []
        for attn in self.drafter.attention_layers():
            attn.kv_cache = torch.zeros((2, num_blocks, block_size, kvh, hd), dtype=self.pool_dtype, device=self.device)
            self.kv_caches.append(attn.kv_cache)

    # ---- the target forward's taps -> fc outputs --------------------------------------------------
    @contextmanager
    def capture(self, num_tokens: int):
        """Context manager around the target forward; yields a holder whose ``fc_out()`` gives
        ``fc(concat(taps))`` [T, H] for all T tokens of the forward."""
        holder = _FcHolder()
        staged = False
        if self.mxfp8_input:
            from longflash.spec_decode.staged_input import use_staged_path
            staged = use_staged_path(num_tokens, self.staged_threshold, torch.cuda.is_current_stream_capturing()
                                     if torch.cuda.is_available() else False, self.staged_compatible,
                                     target_width=self.drafter.cfg.hidden_size,
                                     num_taps=len(self.drafter.cfg.target_layer_ids))
        if staged:
            self._staged.reset(num_tokens)
            with self.tapper.capture(consumer=self._staged.add):
                yield holder
            holder.value = self._staged.finalize()
        else:
            with self.tapper.capture() as taps:
                yield holder
            aux = self.tapper.concat(taps).to(self.drafter.fc.weight.dtype)
            if self.mxfp8_input:
                from longflash.spec_decode.staged_input import concat_then_quantize
                st = self._staged
                holder.value = concat_then_quantize(taps=[aux], weight=st.weight, data=st.data[:num_tokens],
                                                    scales=st.scales[:num_tokens], out=st.out[:num_tokens],
                                                    row_chunk=st.row_chunk)
            else:
                holder.value = self.drafter.fc(aux)

    @torch.inference_mode()
    def write_context(self, fc_out: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Committed tokens' fc outputs [T, H] -> hidden_norm -> context K/V in the draft pool."""
        if fc_out.shape[0] == 0:
            return
        h_ctx = self.drafter.hidden_norm(fc_out)
        self.drafter.write_context(h_ctx.to(self.pool_dtype), positions, slot_mapping)

    @torch.inference_mode()
    def propose(self, requests: list[tuple[int, int, int, list[int]]],
                masks: list[DraftMask | None] | None = None) -> list[list[int]]:
        """Draft tokens for each (pending_token, position s, num_drafts, block_table) request.

        The context of a request is its draft-pool rows for positions < s. Returns per request
        ``num_drafts`` argmax tokens (slots 1..num_drafts of the block). ``masks``: per request, the
        :class:`~longflash.spec_decode.draft_mask.DraftMask` of its sampler (``allowed_token_ids``,
        min_tokens) applied to its draft logits before the argmax, or None (all None: unmasked). With
        :meth:`enable_uniform` the block forward runs on persistent inputs (CUDA graphs: a plain one, or
        the masked one when a request is masked), reading the drafts with one device -> host copy.
        Raises ValueError if ``masks`` does not have one entry per request.
        """
        if masks is not None and len(masks) != len(requests):
            raise ValueError(f"{len(requests)} draft requests but {len(masks)} masks")
        if masks is not None and all(m is None for m in masks):
            masks = None
        if self.uniform is not None:
            drafts = self.uniform.propose(requests, masks)
            if drafts is not None:
                return drafts
        logits = self.draft_logits(requests)
        if masks is not None:
            self._mask_draft_logits(logits, requests, masks)
        best = torch.argmax(logits, dim=-1).tolist()
        out, k = [], 0
        for _, _, n, _ in requests:
            out.append(best[k:k + n])
            k += n
        return out

    def _mask_draft_logits(self, logits: torch.Tensor, requests, masks: list[DraftMask | None]) -> None:
        """In place on :meth:`draft_logits`' rows: each masked request's slots get its masks
        (``draft_mask.apply_draft_masks``, the function the uniform / CUDA-graph path applies)."""
        codes = torch.empty(len(requests), logits.shape[1], dtype=torch.uint8, device=logits.device)
        until = to_device_async(write_mask_codes(codes, masks), torch.int32, logits.device)
        first = 0
        for i, ((_, _, n, _), m) in enumerate(zip(requests, masks)):
            if m is not None and n:
                apply_draft_masks(logits[first:first + n][None], codes[i:i + 1], until[i:i + 1])
            first += n

    @torch.inference_mode()
    def draft_logits(self, requests: list[tuple[int, int, int, list[int]]]) -> torch.Tensor:
        """Logits of the draft slots: [sum of num_drafts, vocab] fp32 (the target's ``compute_logits``),
        request after request, slots 1..num_drafts of each block. Arguments as :meth:`propose`
        (the eager path; the uniform/CUDA-graph path of :meth:`propose` computes the same rows)."""
        # Always the whole block [pending, MASK × (B − 1)] (the drafter was trained on full blocks; its
        # attention inside the block is non-causal, so a shorter block changes every slot), even when
        # fewer drafts are verified near max_tokens; only slots 1..num_drafts are returned.
        B = self.block_size
        tokens, positions, starts, ctx_lens = [], [], [0], []
        for pending, s, n, _ in requests:
            tokens += [pending] + [self.mask_token_id] * (B - 1)
            positions += list(range(s, s + B))
            starts.append(starts[-1] + B)
            ctx_lens.append(s)
        max_blocks = max(len(r[3]) for r in requests)
        table = np.full((len(requests), max_blocks), -1, dtype=np.int32)
        for i, r in enumerate(requests):
            table[i, :len(r[3])] = block_ids_array(r[3])
        dev = self.device
        ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        embeds = self.drafter.embed_block(self.target.model.embed_tokens, ids).to(self.drafter.fc.weight.dtype)
        hidden = self.drafter(embeds, torch.tensor(positions, dtype=torch.int64, device=dev), starts, ctx_lens,
                              torch.from_numpy(table).to(dev))
        rows = [starts[b] + 1 + j for b, r in enumerate(requests) for j in range(r[2])]
        return self.target.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=dev)].to(
            self.target.lm_head.weight.dtype))


class _FcHolder:
    value: torch.Tensor | None = None

    def fc_out(self) -> torch.Tensor:
        return self.value
