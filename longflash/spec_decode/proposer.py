"""DFlash proposer: owns the drafter, its draft KV pool and the target taps; drafts a block per
decoding request and keeps the draft context in step with committed tokens.

The draft pool is a separate paged cache per draft layer ([2, num_blocks, block_size, kv_heads,
head_dim], bf16 or the fp32 model dtype, never fp8) addressed with the target's block ids and slot
mapping, so prefix-cache sharing and preemption need nothing extra: every committed token's context
K/V is written in the same step that computes its target KV, before its block can be shared.
"""

from __future__ import annotations

import logging

import torch

from longflash.spec_decode.dflash_model import DFlashDraftModel, load_drafter
from longflash.spec_decode.taps import AuxTapper

logger = logging.getLogger("longflash")


class DFlashProposer:
    """Args: drafter directory, the loaded target model, model dtype and device."""

    def __init__(self, path: str, target, dtype: torch.dtype, device: torch.device):
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
        self.pool_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.bfloat16
        self.kv_caches: list[torch.Tensor] = []

    def kv_bytes_per_token(self) -> int:
        """Draft-pool bytes per token (all draft layers, K and V)."""
        kvh, hd = self.drafter.kv_row_shape()
        elem = torch.empty((), dtype=self.pool_dtype).element_size()
        return 2 * kvh * hd * elem * len(self.drafter.layers)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        kvh, hd = self.drafter.kv_row_shape()
        self.kv_caches = []
        for attn in self.drafter.attention_layers():
            attn.kv_cache = torch.zeros((2, num_blocks, block_size, kvh, hd), dtype=self.pool_dtype, device=self.device)
            self.kv_caches.append(attn.kv_cache)

    @torch.inference_mode()
    def write_context(self, aux: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Committed tokens' taps aux [T, K·H] -> context K/V in the draft pool at their slots."""
        if aux.shape[0] == 0:
            return
        h_ctx = self.drafter.context_features(aux.to(self.drafter.fc.weight.dtype))
        self.drafter.write_context(h_ctx.to(self.pool_dtype), positions, slot_mapping)

    @torch.inference_mode()
    def propose(self, requests: list[tuple[int, int, int, list[int]]]) -> list[list[int]]:
        """Draft tokens for each (pending_token, position s, num_drafts, block_table) request.

        The context of a request is its draft-pool rows for positions < s. Returns per request
        ``num_drafts`` argmax tokens (slots 1..num_drafts of the block).
        """
        tokens, positions, starts, ctx_lens = [], [], [0], []
        for pending, s, n, _ in requests:
            tokens += [pending] + [self.mask_token_id] * n
            positions += list(range(s, s + n + 1))
            starts.append(starts[-1] + n + 1)
            ctx_lens.append(s)
        max_blocks = max(len(r[3]) for r in requests)
        table = torch.full((len(requests), max_blocks), -1, dtype=torch.int32)
        for i, r in enumerate(requests):
            table[i, :len(r[3])] = torch.tensor(r[3], dtype=torch.int32)
        dev = self.device
        ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        embeds = self.drafter.embed_block(self.target.model.embed_tokens, ids).to(self.drafter.fc.weight.dtype)
        hidden = self.drafter(embeds, torch.tensor(positions, dtype=torch.int64, device=dev), starts, ctx_lens,
                              table.to(dev))
        rows = [i for b in range(len(requests)) for i in range(starts[b] + 1, starts[b + 1])]
        logits = self.target.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=dev)].to(
            self.target.lm_head.weight.dtype))
        best = torch.argmax(logits, dim=-1).tolist()
        out, k = [], 0
        for _, _, n, _ in requests:
            out.append(best[k:k + n])
            k += n
        return out
