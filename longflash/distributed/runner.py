"""The TP/DCP process model: rank 0 schedules and broadcasts each step; every rank runs the model.

Rank 0 owns the scheduler and a :class:`DCPModelRunner` whose ``prepare`` posts each step's
(input ids, forward context) on the :class:`~longflash.distributed.comm.StepChannel`; ranks 1..N-1
run :meth:`DCPModelRunner.serve_forever`. Every rank holds its tensor-parallel shard of the weights
(``layers/parallel.py``; the forward and the vocab-parallel logits are collectives, so workers compute
the same logit rows as rank 0) and its own KV shard: logical blocks cover
``block_size * dcp_size`` tokens (rank 0's block manager uses that as ``tokens_per_block``) and each
rank stores its positions in its physical block of the same id (``dcp.dcp_slot_mapping``). MLA layers
read the DCP group from the forward context (``ForwardContext.parallel``, this runner's state).

Uniform decode and verify steps (every request decodes its pending token and the same number of drafts)
run on persistent inputs and, on GPUs, from CUDA graphs on every rank: rank 0 posts
:class:`EnableUniform` once and :class:`CaptureGraphs` when it captures (every rank captures the same
(query length, bucket) graphs, then the same drafter graphs, in the same order, so the NCCL
collectives inside them pair up), then each step's :class:`UniformStep` (the planned host arrays,
whether to replay a graph, the draft-pool writes pending from earlier general steps); every rank
fills its own inputs (its shard's slots, ``shard_slot_mapping``; the replicated draft pool's
one-process slots) and runs the same forward. With DFlash that forward is the chained step: the
draft context of every row is written and the next block drafted inside it, on every rank.

DFlash under DCP (``docs/dcp.md``): every rank holds a *replicated* draft pool (all
``block_size * dcp_size`` tokens of a logical block, single-process slots on logical blocks) and
runs the drafter SPMD (the drafter uses the target's embedding and LM head, collectives under
tensor parallelism). Rank 0 posts a :class:`DraftMirror` before it drafts (the requests) and with
each step (whether the forward captures the taps); both carry the draft-context writes rank 0 made
since its last post, as rows of the last capturing forward, whose fc outputs every rank computed
from the same replicated taps. Workers repeat the writes, then the drafting; the drafts of all ranks
are all-gathered and rank 0 counts requests drafted differently elsewhere (``draft_mismatches``,
expected 0; rank 0's drafts are the ones verified).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from longflash.distributed.comm import ParallelState, StepChannel
from longflash.distributed.dcp import check_dcp_args, dcp_slot_mapping
from longflash.runner.context import ForwardContext, set_forward_context
from longflash.runner.cuda_graph import GraphCapturer, UniformBatch, prepare_uniform_model
from longflash.runner.model_runner import ModelRunner, StepResult

logger = logging.getLogger("longflash")


@dataclasses.dataclass
class DraftMirror:
    """What the worker ranks' DFlash proposers repeat. Posted alone to draft, or with a step.

    Attributes:
        commits: (first_row, num_rows) of the last capturing forward whose context K/V rank 0 wrote
            into its draft pool since its previous post, in write order (applied first).
        requests: draft requests (``DFlashProposer.propose`` arguments); empty with a step.
        capture: with a step: whether its forward captures the taps (fc outputs) for later writes.
        masks: the requests' draft masks (``DFlashProposer.propose``'s ``masks``; None: unmasked). A
            worker drafts with the same masks, so its drafts (and its choice of graph or eager
            forward, whose collectives must pair with rank 0's) are rank 0's.
    """

    commits: list[tuple[int, int]]
    requests: list[tuple[int, int, int, list[int]]]
    capture: bool = False
    masks: list | None = None


@dataclasses.dataclass
class EnableUniform:
    """Rank 0 turned on uniform decode steps (``ModelRunner.enable_uniform_decode`` arguments; with
    CUDA graphs when ``cuda_graphs``): workers prepare their model the same way and do the same."""

    max_model_len: int
    max_num_seqs: int
    query_lens: list[int]
    cuda_graphs: bool
    draft_block_size: int | None = None  # with DFlash: ``DFlashProposer.enable_uniform``'s block_size


@dataclasses.dataclass
class CaptureGraphs:
    """Rank 0 captures its decode graphs now: every rank captures the same ones, in the same order."""


@dataclasses.dataclass
class UniformStep:
    """One uniform decode step: the planned requests, whether rank 0 replays a graph, and the rows
    the batch is padded to (``DecodeGraphRunner.mode``)."""

    batch: UniformBatch
    graph: bool
    rows: int
    spec: bool = False                                          # DFlash: the chained verify forward
    commits: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # DraftMirror.commits


def shard_slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int, dcp_size: int,
                       dcp_rank: int, interleave: int = 1) -> np.ndarray:
    """Host form of :func:`dcp.dcp_slot_mapping` for a uniform step: positions [B, q] (int64) through
    block_table [B, n] (logical block ids) to this rank's cache slots [B, q] (int64; -1 where another
    rank owns the position). ``block_size`` is the physical (per-rank) block size."""
    vbs = block_size * dcp_size
    blk = np.take_along_axis(block_table, positions // vbs, axis=1).astype(np.int64)
    vo = positions % vbs
    local = (vo // (dcp_size * interleave)) * interleave + vo % interleave
    return np.where((vo // interleave) % dcp_size == dcp_rank, blk * block_size + local, -1)


class DCPModelRunner(ModelRunner):
    """A ModelRunner whose cache holds this rank's DCP shard.

    Args (besides ModelRunner's): ``parallel`` (this rank's groups and interleave size), ``channel``
    (the step channel over the DCP group's ranks; rank 0 posts, others receive), ``proposer`` (this
    rank's DFlash proposer with its replicated draft pool allocated, or None).
    ``block_size`` is the physical block size of this rank's cache; ``self.block_size`` becomes the
    logical block (``block_size * dcp_size`` tokens), as the base ``prepare`` indexes block tables.
    """

    supports_async_scheduling = False  # every step is posted to the worker ranks by rank 0

    def __init__(self, model, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype, device: torch.device,
                 calculate_kv_scales: bool = False, context_workspace_rows: int | None = None, *,
                 parallel: ParallelState, channel: StepChannel, proposer=None):
        check_dcp_args(block_size, parallel.dcp_size, parallel.cp_kv_cache_interleave_size)
        super().__init__(model, num_blocks, block_size, kv_cache_dtype, device, calculate_kv_scales,
                         context_workspace_rows)
        self.parallel = parallel
        self.channel = channel
        self.physical_block_size = block_size
        # NOTE: the base prepare() computes single-process slots with self.block_size; localize()
        # replaces them, so only the logical block indexing of that code matters.
        self.block_size = block_size * parallel.dcp_size
        self.proposer = proposer
        self._commits: list[tuple[int, int]] = []  # rank 0: draft-pool writes since the last post
        self._capture = False
        self.draft_checks = 0        # rank 0: draft steps checked against the workers' drafts
        self.draft_mismatches = 0    # rank 0: requests for which some worker drafted other tokens
        self._last: tuple[torch.Tensor, ForwardContext] | None = None  # worker: last forward's (fc out, ctx)

    def localize(self, ctx: ForwardContext) -> ForwardContext:
        """The context with this rank's slot mapping (-1 where another rank owns the token) and the
        physical block size. The single-process slots on logical blocks, which address the
        replicated draft pool, stay in ``extras["draft_slot_mapping"]``."""
        lens = ctx.query_start_loc[1:] - ctx.query_start_loc[:-1]
        token_to_req = torch.repeat_interleave(torch.arange(ctx.num_reqs, device=lens.device), lens.long())
        slots = dcp_slot_mapping(ctx.positions, ctx.block_table, self.physical_block_size, self.parallel.dcp_size,
                                 self.parallel.dcp_rank, self.parallel.cp_kv_cache_interleave_size, token_to_req)
        return dataclasses.replace(ctx, slot_mapping=slots, block_size=self.physical_block_size,
                                   extras={**ctx.extras, "draft_slot_mapping": ctx.slot_mapping},
                                   parallel=self.parallel)

    # ---- rank 0 ---------------------------------------------------------------------------------
    def check_workers(self) -> None:
        """Rank 0, before posting a step: raise if a worker is known to be gone (the locally started
        ones: ``_Rank0Runner``); a no-op here."""

    def propose(self, proposer, requests, masks=None):
        """Post the requests and their draft masks (workers draft them too, after the pending
        draft-pool writes), draft, and compare every rank's drafts with rank 0's."""
        self.channel.post(DraftMirror(self._take_commits(), requests, masks=masks), plain=True)
        drafts = proposer.propose(requests, masks)
        self._check_drafts(drafts)
        return drafts

    def _take_commits(self) -> list[tuple[int, int]]:
        commits, self._commits = self._commits, []
        return commits

    def write_draft_context(self, proposer, res, first_row: int, num_rows: int) -> None:
        """Rank 0's write into its replicated draft pool (logical-block slots: every position on
        every rank); the workers repeat it before the next step. A chained step wrote every row's
        context inside its forward, on every rank: nothing to do."""
        if res.chain is not None:
            return
        r = slice(first_row, first_row + num_rows)
        proposer.write_context(res.aux[r], res.ctx.positions[r], res.ctx.extras["draft_slot_mapping"][r])
        self._commits.append((first_row, num_rows))

    @torch.inference_mode()
    def execute(self, sched, all_logits: bool = False, tapper=None, proposer=None):
        self._capture = proposer is not None
        self._all_logits = all_logits  # the workers compute the same logit rows (vocab-parallel LM head)
        dr = self.decode_runner
        if dr is not None and tapper is None and not all_logits:
            q = dr.query_len(sched)
            if q is not None:  # a uniform step: every rank runs it on persistent inputs (graph or not)
                self.check_workers()

                def announce(batch, graph, rows):
                    commits = self._take_commits() if proposer is not None else []
                    self.channel.post(UniformStep(batch, graph, rows, proposer is not None, commits), plain=True)
                return StepResult(*dr.run(sched, q, proposer, announce))
        return super().execute(sched, all_logits, tapper, proposer)

    def enable_uniform_decode(self, max_model_len: int, max_num_seqs: int, query_lens: list[int],
                              capturer=None) -> None:
        """``ModelRunner.enable_uniform_decode`` on every rank (rank 0 posts :class:`EnableUniform`);
        the steps' cache slots are this rank's shard's."""
        if self.channel.group.is_first_rank:
            self.channel.post(EnableUniform(max_model_len, max_num_seqs, list(query_lens), capturer is not None,
                                            self.physical_block_size if self.proposer is not None else None))
        super().enable_uniform_decode(max_model_len, max_num_seqs, query_lens, capturer)
        ps = self.parallel
        self.decode_runner.shard_slot_mapping = lambda bt, pos: shard_slot_mapping(
            bt, pos, self.physical_block_size, ps.dcp_size, ps.dcp_rank, ps.cp_kv_cache_interleave_size)

    def capture_graphs(self, proposer=None) -> None:
        """Capture the decode (and drafter) graphs on every rank (rank 0 posts :class:`CaptureGraphs`).
        The ranks then agree (over the CPU group): if capture failed anywhere, every rank drops its
        graphs and runs the same steps eagerly; rank 0 raises so the engine logs it."""
        first = self.channel.group.is_first_rank
        if first:
            self.channel.post(CaptureGraphs())
        error = None
        try:
            super().capture_graphs(proposer)
        except Exception as e:  # noqa: BLE001 — agreed on below
            error = e
            logger.exception("rank %d: CUDA graph capture failed", self.parallel.tp_rank)
        failed = self.channel.group.all_reduce(torch.tensor([int(error is not None)]), op="max")
        if int(failed):
            self.drop_graphs(proposer)
            if first:
                raise RuntimeError("CUDA graph capture failed on a rank") from error

    def prepare(self, sched):
        input_ids, ctx, spans = super().prepare(sched)
        mirror = DraftMirror(self._take_commits(), [], self._capture) if self.proposer is not None else None
        ctx.extras["all_logits"] = getattr(self, "_all_logits", False)
        self.channel.post((input_ids, dataclasses.replace(ctx, parallel=None), mirror))  # groups stay local
        return input_ids, self.localize(ctx), spans

    def _check_drafts(self, drafts: list[list[int]]) -> None:
        """Every rank: all-gather the drafts; rank 0 counts the requests some rank drafted differently."""
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
        every = self.channel.group.all_gather(flat[None], dim=0)                 # [ranks, total drafts]
        if not self.channel.group.is_first_rank:
            return
        self.draft_checks += 1
        bad, k = 0, 0
        for d in drafts:
            bad += int((every[:, k:k + len(d)] != every[:1, k:k + len(d)]).any())
            k += len(d)
        if bad:
            self.draft_mismatches += bad
            logger.warning("DCP: %d request(s) drafted differently on a worker rank than on rank 0 (%d so far): "
                           "the replicated draft pools disagree (rank 0's drafts are verified)",
                           bad, self.draft_mismatches)

    # ---- workers --------------------------------------------------------------------------------
    def _write_commits(self, commits: list[tuple[int, int]]) -> None:
        """Repeat rank 0's draft-pool writes (rows of the last capturing forward)."""
        for first, n in commits:
            if self._last is None:
                raise RuntimeError("DCP worker: a draft-context write names a forward that captured no taps")
            aux, ctx = self._last
            r = slice(first, first + n)
            self.proposer.write_context(aux[r], ctx.positions[r], ctx.extras["draft_slot_mapping"][r])

    @torch.inference_mode()
    def serve_forever(self) -> None:
        """Worker loop: run each posted step's forward until rank 0 posts None. Any failure (a
        collective whose peer died or timed out) propagates, so the worker exits non-zero."""
        while True:
            msg = self.channel.recv()
            if msg is None:
                return
            if isinstance(msg, DraftMirror):  # draft with rank 0
                self._write_commits(msg.commits)
                self._check_drafts(self.proposer.propose(msg.requests, msg.masks))
                continue
            if isinstance(msg, UniformStep):
                self._write_commits(msg.commits)
                self.decode_runner.run_batch(msg.batch, msg.graph, msg.rows, self.proposer if msg.spec else None)
                continue
            if isinstance(msg, EnableUniform):
                self._enable_uniform_as_rank0(msg)
                continue
            if isinstance(msg, CaptureGraphs):
                self.capture_graphs(self.proposer)  # never raises here: a failure drops every rank's graphs
                continue
            input_ids, ctx, mirror = msg
            if mirror is not None:
                self._write_commits(mirror.commits)
            ctx = self.localize(ctx)
            with set_forward_context(ctx):
                if mirror is not None and mirror.capture:
                    with self.proposer.capture(input_ids.shape[0]) as holder:
                        hidden = self.model(input_ids)
                    self._last = (holder.fc_out(), ctx)
                else:
                    hidden = self.model(input_ids)
                    self._last = None
                # The LM head is vocab-parallel (a collective): compute the rows rank 0 computes.
                self.model.compute_logits(hidden if ctx.extras.get("all_logits") else hidden[ctx.logits_indices])

    def release_graphs(self) -> None:
        """Destroy this rank's CUDA graphs (before its process group: ``DecodeGraphRunner.release``)."""
        self.drop_graphs(self.proposer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _enable_uniform_as_rank0(self, msg: EnableUniform) -> None:
        """A worker: what ``LLMEngine.enable_uniform_decode`` did on rank 0 (model and drafter prepared
        the same way, one graph pool shared by the target and drafter graphs)."""
        capturer = GraphCapturer(self.device) if msg.cuda_graphs else None
        if self.device.type == "cuda":
            prepare_uniform_model(self.model)
            if self.proposer is not None:
                self.proposer.drafter.fuse_projections()
        self.enable_uniform_decode(msg.max_model_len, msg.max_num_seqs, msg.query_lens, capturer)
        if self.proposer is not None and msg.draft_block_size is not None:
            self.proposer.enable_uniform(msg.draft_block_size, msg.max_model_len, msg.max_num_seqs, capturer)

    def shutdown(self) -> None:
        """Rank 0: tell the workers to exit."""
        self.channel.post(None)
