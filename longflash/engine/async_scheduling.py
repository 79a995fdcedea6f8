"""Async scheduling of plain greedy decode steps (vLLM's ``--async-scheduling``, its default since v0.14).

A synchronous step ends by reading its sampled tokens: the host waits for the GPU, then processes them
(detokenization, stop checks, outputs) and prepares the next step while the GPU idles, ~0.25-0.6 ms of a
~2 ms batch-1 decode step on an H200 (``benchmarks/NOTES.md``, session 28). Here, after a uniform
decode step N (one token per request, no drafts), step N+1 is launched *before* N's tokens are read:

1. N's argmax is taken on the device and copied to pinned host memory (an event marks the copy);
2. each request's cache slot for position ``num_computed_tokens + 1`` is reserved (what the scheduler
   would reserve after N), and N+1 is launched with its input ids copied on the device from N's argmax
   (``DecodeGraphRunner.run_ahead``);
3. the host waits for the event only (it precedes N+1 on the stream) and processes N's tokens while
   N+1 runs. The next ``LLMEngine.step`` call processes N+1 the same way, launching N+2 first.

Step N+1 is the step the scheduler would plan after N for every request that N does not finish: one
token each, at the same positions, with N's greedy token as input. The schedule itself can differ from
the synchronous engine's by a step: a request arriving while N+1 is in flight is admitted one step later,
and the slot reserved for a request that N then finishes by EOS or a stop may have evicted a prefix-cached
block the synchronous engine keeps (outputs are the same; ``num_cached_tokens`` of a later request may
differ). If processing N raises (e.g. Ctrl-C), N+1 is dropped (``LLMEngine._finish_step``). A request that N
finishes (EOS, stop, length) or that is aborted meanwhile has its row of N+1 discarded
(``LLMEngine._is_live``); that row's KV went to a position past its committed tokens, in a block no
prefix-cache hash covers, and blocks freed meanwhile are reused only by work queued after N+1 on the
same stream.

Only plain greedy requests take this path: N's logits live in the CUDA graph's output buffer, which N+1
overwrites before the host reads N's tokens, and a plain greedy token is the row's argmax, taken on the
device before N+1 is launched. So a step ends synchronously (as before) when any request samples,
asks for logprobs, has penalties, a logit bias, allowed token ids or an active min_tokens (at N or
N+1), when a DFlash drafter is on, when a request is waiting and the batch has a free slot after N (its
prefill is admitted at the next step without delay), when a request recomputes its tokens after a
preemption (a one-token step that samples nothing looks like a decode step), when running requests were
left out of N (a token budget below the batch), or when the KV pool cannot reserve the slots. A request
whose token of step N is its last by length (``max_tokens``, ``max_model_len``) is left out of step N+1
(its slot counts as free).

Waiting requests and a full batch (``max_num_seqs`` requests running after N, the serving steady state
under load): N+1 is launched ahead; no waiting request could be admitted there unless N finishes a
request by EOS or a stop string, and such a request's slot is taken one step later than the synchronous
engine would (vLLM's async scheduler has the same one-step delay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longflash.engine.block_manager import BlockManager
from longflash.engine.scheduler import ScheduledSeq, SchedulerOutput
from longflash.runner.model_runner import StepResult
from longflash.runner.sampler import needs_logits_processing, row_argmax
from longflash.runner.step_inputs import to_device_async

# Launch ahead while requests wait behind a full batch (module docstring). Off: any waiting request keeps
# steps synchronous (the rule before session 30; ``benchmarks/e2e_decode.py --baselines sync-when-waiting``).
LAUNCH_WITH_WAITING = True


@dataclass
class AheadStep:
    """A launched decode step whose tokens are not read yet: its schedule and its ``StepResult``."""

    sched: SchedulerOutput
    result: StepResult


class AsyncDecode:
    """Launches the decode step after a plain greedy uniform decode step before its tokens are read.

    Args:
        runner: the engine's ``ModelRunner`` (``supports_async_scheduling``; uniform decode enabled,
            else :meth:`next_rows` is always empty).
        block_manager: the KV block pool (slots for the launched step are reserved from it).
        max_model_len: tokens per request at most.
        max_num_seqs: largest batch (size of the pinned token buffer).
        device: the model's device.
    """

    def __init__(self, runner, block_manager: BlockManager, max_model_len: int, max_num_seqs: int,
                 device: torch.device):
        self.runner = runner
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        cuda = device.type == "cuda"
        self._host_ids = torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None
        self.num_launched = 0  # steps launched ahead since start-up

    def next_rows(self, sched: SchedulerOutput, res: StepResult, num_waiting: int, live: list[int],
                  num_running: int) -> list[int]:
        """The requests (indices into ``sched.scheduled``) of the step to launch before step ``sched``'s
        tokens are read (``res``: its result): those of ``live`` (still running; a step launched ahead may
        hold requests finished or aborted since) that ``sched`` does not finish by length. Empty when
        ``sched`` must end synchronously (the conditions in the module docstring; ``num_waiting`` and
        ``num_running``: the scheduler's queue and running requests now)."""
        dr = self.runner.decode_runner
        if not live or num_running != len(live) or res.chain is not None or dr is None or dr.query_len(sched) != 1:
            return []
        bm, need, rows = self.block_manager, 0, []
        for i in live:
            seq = sched.scheduled[i].seq
            if seq.num_computed_tokens + 1 != len(seq.token_ids):
                # NOTE: a one-token step of a preempted request's recompute (past its prompt, not at its last
                # token) samples nothing: its next input is a known token, not this step's argmax
                return []
            p, k = seq.sampling_params, seq.num_output_tokens
            if not p.greedy or seq.output_logprobs is not None or needs_logits_processing(p, k):
                return []  # NOTE: sched's own logits are overwritten by the launched step before they are read
            if k + 1 >= p.max_tokens or len(seq.token_ids) + 1 >= self.max_model_len:
                continue  # sched's token is its last (StopChecker's length rule)
            if needs_logits_processing(p, k + 1):
                return []
            need += max(bm.blocks_needed(seq.num_computed_tokens + 2) - len(seq.block_table), 0)
            rows.append(i)
        if num_waiting and (len(rows) < self.max_num_seqs or not LAUNCH_WITH_WAITING):
            return []  # a free slot after sched: the waiting request's prefill is scheduled next, without delay
        return rows if need <= bm.num_free_blocks else []

    def launch(self, sched: SchedulerOutput, res: StepResult, rows: list[int]) -> tuple[list[int], AheadStep]:
        """Launch the step after ``sched`` for its requests ``rows`` (:meth:`next_rows`, not empty),
        then read ``sched``'s greedy tokens. Returns (the token of every row of ``sched``, in order; the
        launched step). The host waits for ``sched``'s argmax only, not for the launched step."""
        ids = row_argmax(res.logits)  # [B] int64 on the device: sched's tokens, the next step's inputs
        host = self._host_ids[:ids.shape[0]]
        host.copy_(ids, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if len(rows) < ids.shape[0]:
            ids = ids[to_device_async(rows, torch.int64, ids.device)]
        nxt = SchedulerOutput([ScheduledSeq(sched.scheduled[i].seq, 1) for i in rows], [])
        for s in nxt.scheduled:  # NOTE: num_computed_tokens is still sched's: + 1 for sched, + 1 for the next
            self.block_manager.append_slots(s.seq, 2)
        ahead = AheadStep(nxt, self.runner.execute_ahead(nxt, ids))
        self.num_launched += 1
        if self._copied is not None:
            self._copied.synchronize()
        return host.tolist(), ahead
