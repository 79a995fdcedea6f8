"""The DFlash drafter's block forward on persistent inputs, replayed from CUDA graphs.

The proposer always drafts whole blocks ``[pending, MASK x (B - 1)]`` (the drafter is trained on full
blocks) and returns each request's first n drafts, so the block forward of R requests runs from the
persistent inputs of a :class:`~longflash.runner.step_inputs.StepInputs` (block token ids,
positions, context lengths, block table; one host -> device copy) through
``DFlashDraftModel.forward_padded`` (no host sync), and ends with the argmax of the B - 1 draft slots
on the device; the host reads the [R, B - 1] draft tokens once. Graphs: one per batch bucket
(``cuda_graph.capture_sizes``), captured largest first into the engine's shared pool; pad rows have
no context and their drafts are ignored. Batches larger than the largest bucket, or requests whose
block table outgrows ``max_model_len``, take the proposer's general path.

Vocabulary masks (``spec_decode.draft_mask``: a request's ``allowed_token_ids`` and min_tokens): a batch
with a masked request replays the bucket's *masked* graph, the same block forward with
``apply_draft_masks`` between the LM head and the argmax, reading the persistent mask codes [R, vocab]
(uint8, written by device ops before the replay) and the ``stop_until`` counts (in the step inputs).
Unmasked batches replay the plain graphs and pay nothing for it. The chained drafts of
:meth:`DraftGraphRunner.draft_after_verify` are unmasked: the engine drafts masked requests afresh.
"""

from __future__ import annotations

import logging
import time

import torch

from longflash.engine.block_table import block_ids_array
from longflash.runner.cuda_graph import GraphCapturer, capture_sizes, release_graphs
from longflash.runner.step_inputs import StepInputs
from longflash.spec_decode.draft_mask import apply_draft_masks, write_mask_codes

logger = logging.getLogger("longflash")


class DraftGraphRunner:
    """Args: the ``DFlashProposer``; cache ``block_size``; ``max_model_len``; ``max_num_seqs``; device;
    ``capturer`` (None: eager, also on the CPU)."""

    def __init__(self, proposer, block_size: int, max_model_len: int, max_num_seqs: int, device: torch.device,
                 capturer: GraphCapturer | None = None):
        self.proposer = proposer
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.capacity = self.max_blocks * block_size
        self.num_drafts = proposer.block_size - 1  # draft slots of a block
        self.buckets = capture_sizes(max_num_seqs)
        self.capturer = capturer
        bk, max_r = self.num_drafts + 1, self.buckets[-1]
        self.inputs = StepInputs({
            "input_ids": (torch.int64, (max_r * bk,)), "positions": (torch.int64, (max_r * bk,)),
            "context_lens": (torch.int32, (max_r,)), "block_table": (torch.int32, (max_r, self.max_blocks)),
            "stop_until": (torch.int32, (max_r,))}, device)
        # Vocabulary-mask codes per request row (draft_mask.write_mask_codes), read by the masked graphs:
        # max_num_seqs x vocab bytes (64 x 163840: 10 MiB).
        self.mask_codes = torch.zeros(max_r, proposer.target.lm_head.vocab_size, dtype=torch.uint8, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.masked_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_time_s = 0.0
        self.pad_like_graph = False  # eager runs padded to the bucket with the capacity bound (tests)

    def _fill(self, requests, rows: int, masks=None) -> int:
        """Write the requests (then pad rows up to ``rows``) and copy; returns the largest context.
        ``masks``: the requests' draft masks (``DFlashProposer.propose``'s), written into the mask
        codes and ``stop_until`` (pad rows unmasked), or None (the codes are then left as they are:
        only masked forwards read them)."""
        inp = self.inputs
        inp.begin()
        h = inp.host
        h["stop_until"][:rows] = 0
        if masks is not None:
            h["stop_until"][:len(masks)] = write_mask_codes(self.mask_codes, masks, rows)
        bk, mask_token = self.num_drafts + 1, self.proposer.mask_token_id
        for i, (pending, s, _, table) in enumerate(requests):
            t0 = i * bk
            h["input_ids"][t0] = pending
            h["input_ids"][t0 + 1:t0 + bk] = mask_token
            h["positions"][t0:t0 + bk] = range(s, s + bk)
            h["context_lens"][i] = s
            h["block_table"][i, :len(table)] = block_ids_array(table)
            h["block_table"][i, len(table):] = -1
        R = len(requests)
        if rows > R:  # pad rows: no context, the block attends to itself
            h["input_ids"][R * bk:rows * bk] = mask_token
            h["positions"][R * bk:rows * bk] = list(range(bk)) * (rows - R)
            h["context_lens"][R:rows] = 0
            h["block_table"][R:rows] = 0
        inp.copy_to_device()
        return max((r[1] for r in requests), default=0)

    def _forward(self, rows: int, max_context_len: int, masked: bool = False) -> torch.Tensor:
        """Draft tokens [rows, n] int64 (argmax of the target's LM head over draft slots 1..n), with the
        persistent mask codes and ``stop_until`` applied when ``masked``."""
        d = self.inputs.dev
        bk = self.num_drafts + 1
        masks = (self.mask_codes[:rows], d["stop_until"][:rows]) if masked else None
        return self.block_forward(d["input_ids"][:rows * bk], d["positions"][:rows * bk], d["context_lens"][:rows],
                                  d["block_table"][:rows], max_context_len, masks)

    def block_forward(self, ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                      block_table: torch.Tensor, max_context_len: int, masks=None) -> torch.Tensor:
        """The drafter's block forward from device tensors (no host sync): ids / positions [R·Bk] int64
        (blocks ``[pending, MASK x (Bk - 1)]`` at positions s..s+Bk-1), context_lens [R] (= s),
        block_table [R, max_blocks] int32, ``max_context_len`` a host bound of context_lens. Returns the
        draft tokens [R, Bk - 1] int64 (argmax of the target's LM head over slots 1..Bk-1). ``masks``:
        None, or (mask codes [R, vocab] uint8, stop_until [R] int32) applied to the slots' logits before
        the argmax (``draft_mask.apply_draft_masks``)."""
        p = self.proposer
        bk = self.num_drafts + 1
        rows = context_lens.shape[0]
        embeds = p.drafter.embed_block(p.target.model.embed_tokens, ids).to(p.drafter.fc.weight.dtype)
        hidden = p.drafter.forward_padded(embeds, positions, context_lens, block_table, max_context_len)
        slots = hidden.view(rows, bk, -1)[:, 1:].reshape(rows * self.num_drafts, -1)
        logits = p.target.compute_logits(slots.to(p.target.lm_head.weight.dtype))
        if masks is not None:
            apply_draft_masks(logits.view(rows, self.num_drafts, -1), *masks)
        return torch.argmax(logits, dim=-1).view(rows, self.num_drafts)

    def draft_after_verify(self, input_ids: torch.Tensor, logits: torch.Tensor, q: int, context_lens: torch.Tensor,
                           block_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
        """The next step's drafts, computed on the device right after a uniform verify (or decode) step
        of R requests with q query tokens each, assuming every request commits its greedy tokens.

        input_ids [R·q] (pending token then the q - 1 drafts of each request), logits [R·q, vocab] of
        those rows, context_lens [R] (position of each pending token), block_table [R, max_blocks]; the
        draft pool already holds the context K/V of all R·q rows (written by the same step: rows past a
        request's committed length are masked by the next context length and rewritten by the next
        verify before they are read as context). Greedy acceptance (``shared/specs/dflash.md`` §4):
        a = the length of the longest prefix of drafts equal to the target's argmax, bonus = the
        argmax after them; the next block is ``[bonus, MASK x (Bk - 1)]`` at position s + a + 1 with
        context s + a + 1. Returns one int64 vector [R·q + 2R + R·(Bk - 1)]: the argmax tokens of
        every row, a, s + a + 1, and the drafts (read by the host in one copy; the engine uses the
        drafts only when what it committed equals this assumption)."""
        R = context_lens.shape[0]
        tokens = torch.argmax(logits, dim=-1).view(R, q)
        if q > 1:
            match = tokens[:, :-1] == input_ids.view(R, q)[:, 1:]
            accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
        else:
            accepted = torch.zeros(R, dtype=torch.int64, device=tokens.device)
        bonus = tokens.gather(1, accepted[:, None])[:, 0]
        start = context_lens.to(torch.int64) + accepted + 1
        bk = self.num_drafts + 1
        ids = torch.full((R, bk), self.proposer.mask_token_id, dtype=torch.int64, device=tokens.device)
        ids[:, 0] = bonus
        positions = start[:, None] + torch.arange(bk, device=tokens.device)[None, :]
        drafts = self.block_forward(ids.view(-1), positions.view(-1), start.to(torch.int32), block_table,
                                    max_context_len)
        return torch.cat([tokens.view(-1), accepted, start, drafts.view(-1)])

    def release(self) -> None:
        """Destroy the captured drafter graphs (``cuda_graph.release_graphs``); drafting runs eagerly."""
        release_graphs(self.graphs)
        release_graphs(self.masked_graphs)

    def capture(self) -> None:
        """Capture two graphs per batch bucket, masked and plain, largest first, into the shared pool."""
        if self.capturer is None:
            raise RuntimeError("CUDA graphs are off for this drafter (no capturer)")
        t0 = time.perf_counter()
        for b in sorted(self.buckets, reverse=True):
            for masked, graphs in ((True, self.masked_graphs), (False, self.graphs)):
                self._fill([], b, [] if masked else None)
                graph, best = self.capturer.capture(lambda: self._forward(b, self.capacity, masked))
                graphs[b] = (graph, best)
        torch.cuda.synchronize(self.capturer.device)
        self.capture_time_s = time.perf_counter() - t0
        logger.info("CUDA graphs: %d DFlash drafter graphs (block of %d, batch buckets %s, plain and masked) "
                    "captured in %.2f s", 2 * len(self.buckets), self.num_drafts + 1, self.buckets, self.capture_time_s)

    def propose(self, requests, masks=None) -> list[list[int]] | None:
        """Drafts for ``DFlashProposer.propose`` requests (each its first n of the B - 1 slots), or
        None when they exceed the largest bucket or a block table outgrows ``max_model_len``.
        ``masks``: their draft masks (``DFlashProposer.propose``'s; None when no request is masked:
        the plain graphs)."""
        R = len(requests)
        if not R or R > self.buckets[-1] or any(n > self.num_drafts or len(t) > self.max_blocks
                                                for _, _, n, t in requests):
            return None
        masked = masks is not None
        bucket = next(b for b in self.buckets if b >= R)
        graph = (self.masked_graphs if masked else self.graphs).get(bucket)
        if graph is not None:
            self._fill(requests, bucket, masks)
            graph[0].replay()
            best = graph[1][:R]
        elif self.pad_like_graph:
            self._fill(requests, bucket, masks)
            best = self._forward(bucket, self.capacity, masked)[:R]
        else:
            best = self._forward(R, self._fill(requests, R, masks), masked)
        return [row[:n] for row, (_, _, n, _) in zip(best.tolist(), requests)]
