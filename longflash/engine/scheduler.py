"""Continuous batching under a token budget (vLLM v1's unified scheduler, in small).

Each step the scheduler hands out at most ``max_num_batched_tokens`` tokens: first to running
requests (one token for a decode, the next prompt chunk for a prefill in progress), then to
waiting requests in arrival order, so prefills and decodes mix in one step. A request is never
given more tokens than it has uncomputed. When the KV pool cannot grow a running request, the most
recently admitted running request is preempted (its blocks freed, its tokens recomputed later).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from longflash.engine.block_manager import BlockManager
from longflash.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int          # tokens whose KV this step computes (and writes)
    num_lookahead_tokens: int = 0  # extra speculative tokens verified in this step

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides which sequences run in the next step and how many tokens each computes.

    Args:
        block_manager: the KV block pool.
        max_num_batched_tokens: token budget of one step.
        max_num_seqs: running sequences at most.
        enable_chunked_prefill: allow a prompt to be split across steps.
    """

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 enable_chunked_prefill: bool = True):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its blocks. Returns it, or None if unknown."""
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self.block_manager.free(seq)
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self.block_manager.free(seq)
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self, lookahead_fn: Callable[[Sequence], int] | None = None) -> SchedulerOutput:
        """Plan one step. ``lookahead_fn(seq)`` gives the speculative tokens to verify after the
        pending token of a decoding sequence (None: no speculative decoding); their KV slots are
        reserved in the same step and count against the token budget."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        scheduled_ids: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_uncomputed_tokens
            decoding = remaining == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
            lookahead = lookahead_fn(seq) if (decoding and lookahead_fn is not None) else 0
            num_new = min(remaining, budget)
            if lookahead and num_new + lookahead > budget:
                lookahead = 0
            ok = True
            while not self.block_manager.can_append(seq, num_new + lookahead):
                victim = self.running[-1]
                if victim.request_id in scheduled_ids:
                    # Never preempt work already planned this step: preempt this one instead.
                    victim = seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    ok = False
                    break
            if not ok:
                continue  # seq removed from running; index i now holds the next one
            self.block_manager.append_slots(seq, num_new + lookahead)
            scheduled.append(ScheduledSeq(seq, num_new, lookahead))
            scheduled_ids.add(seq.request_id)
            budget -= num_new + lookahead
            i += 1

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                want = seq.num_uncomputed_tokens if seq.block_table == [] else 0
                num_new = min(len(seq.token_ids), budget)
                if not self.enable_chunked_prefill and want > budget:
                    break
                if not self.block_manager.allocate_for_new(seq, num_new):
                    break
                # allocate_for_new set num_computed_tokens to the cached prefix length.
                num_new = min(seq.num_uncomputed_tokens, budget)
                self.block_manager.append_slots(seq, num_new)
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                scheduled.append(ScheduledSeq(seq, num_new))
                scheduled_ids.add(seq.request_id)
                budget -= num_new
        return SchedulerOutput(scheduled, preempted)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence from running and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
