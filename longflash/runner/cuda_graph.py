"""Uniform decode/verify steps on persistent inputs, replayed from CUDA graphs at bucketed batch sizes.

A step is *uniform* when every scheduled request decodes: one pending token plus the same number L of
speculative tokens (L = 0 for plain decode, the DFlash block for a verify). Such a step's forward reads
only the persistent device inputs of :class:`StepInputs` and host-side bounds (the forward context's
``uniform_decode``): the attention ops take device-tensor lengths, the cache writes skip slot -1
without a mask, MoE dispatch is sync-free, so the forward never synchronizes the host and can be
captured.

Graphs (vLLM's scheme): one per (query length, batch bucket), buckets 1, 2, 4, 8, then multiples of
16 up to ``max_num_seqs``; captured largest first into one shared memory pool (a smaller graph reuses
the larger ones' freed intermediates). A batch of B requests replays the smallest bucket >= B with the
rows past B padded (token 0, slot -1: no cache write, seq_len = query length over block 0); the pad
rows' logits are ignored. Under a graph the decode op is bounded by the cache capacity
(``max_seq_len`` = blocks per request * block size); eagerly (``--enforce-eager``, or a batch no
bucket fits) the same uniform path runs unpadded with the step's own bounds.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch
from torch import nn

from longflash.layers.mlp import GatedMLP
from longflash.runner.context import ForwardContext, set_forward_context
from longflash.engine.block_table import block_ids_array
from longflash.runner.step_inputs import StepInputs

logger = logging.getLogger("longflash")


def prepare_uniform_model(model) -> None:
    """Make ``model``'s forward launch fewer kernels for uniform steps on a GPU (every rank of a TP/DCP
    engine does the same): bf16 routed experts stacked for the grouped, capture-safe MoE kernel
    (``MoE.stack_experts``), one GEMM for gate + up of every other ``GatedMLP`` (``fuse_gate_up``; the
    routed experts keep views of their stacked weights instead), one GEMM for MLA's q_a and kv_a
    projections (``MLAAttention.fuse_qkv_a``). Parameters become views; no copy is kept, except MLA's
    transposed W_UK for the few-row query absorption (``MLAAttention.make_w_uk_t``)."""
    routed = {id(e) for m in model.modules() if isinstance(getattr(m, "experts", None), nn.ModuleList)
              for e in m.experts}
    for m in model.modules():
        if hasattr(m, "stack_experts") and not getattr(m, "grouped_experts", True):
            m.stack_experts()
        if isinstance(m, GatedMLP) and id(m) not in routed:
            m.fuse_gate_up()
        if hasattr(m, "fuse_qkv_a"):
            m.fuse_qkv_a()
            m.make_w_uk_t()


def release_graphs(graphs: dict) -> None:
    """Destroy the CUDA graphs of ``graphs`` (values: (graph, outputs...)) now and empty it: their memory
    and, under NCCL, the communicator resources they hold (NCCL ties captured collectives' resources to
    the graph's lifetime, so a process group is destroyed only after its graphs)."""
    for g, *_ in graphs.values():
        g.reset()
    graphs.clear()


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch buckets: 1, 2, 4, 8, then multiples of 16, up to and including ``max_num_seqs``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class GraphCapturer:
    """One memory pool and warm-up stream shared by every graph of an engine (target and drafter)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.num_graphs = 0

    def capture(self, fn, warmup: int = 2):
        """Run ``fn`` ``warmup`` times on a side stream (compiles Triton kernels, fills per-device
        caches), then capture it. Returns (graph, fn's output at capture)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # NOTE: under NCCL (tensor / decode-context parallelism) the warm-up's collectives are finished
        # first and the capture is thread-local, so the process group's watchdog thread may query its
        # events while this thread captures (pytorch/pytorch#104487, #148594).
        nccl = torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_backend() == "nccl"
        if nccl:
            torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local" if nccl else "global"):
            out = fn()
        self.num_graphs += 1
        return graph, out


def uniform_query_len(scheduled) -> int | None:
    """1 + L when every scheduled request decodes its pending token plus the same number L of
    speculative tokens; None otherwise (a prefill chunk, recomputation, or mixed L)."""
    q = None
    for s in scheduled:
        seq = s.seq
        if s.num_new_tokens != 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            return None
        if q is None:
            q = 1 + s.num_lookahead_tokens
        elif 1 + s.num_lookahead_tokens != q:
            return None
    return q


class DecodeGraphRunner:
    """Runs uniform decode/verify steps of ``model`` from persistent inputs, through CUDA graphs when
    ``capturer`` is given (CUDA only), eagerly otherwise (also on the CPU: the tests compare it with
    the general step).

    Args:
        model: the CausalLM (its attention layers hold their caches).
        block_size: tokens per cache block. max_model_len: tokens per request at most.
        max_num_seqs: largest batch. query_lens: the query lengths to serve (1, and 1 + the number of
            draft tokens with DFlash).
        device: the model's device. capturer: the shared :class:`GraphCapturer`, or None (eager).
    """

    def __init__(self, model, block_size: int, max_model_len: int, max_num_seqs: int, query_lens: list[int],
                 device: torch.device, capturer: GraphCapturer | None = None):
        self.model = model
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.capacity = self.max_blocks * block_size
        self.buckets = capture_sizes(max_num_seqs)
        self.query_lens = sorted(set(query_lens))
        self.device = device
        self.capturer = capturer
        max_b, max_t = self.buckets[-1], self.buckets[-1] * max(self.query_lens)
        self.inputs = StepInputs({
            "input_ids": (torch.int64, (max_t,)), "positions": (torch.int64, (max_t,)),
            "slot_mapping": (torch.int64, (max_t,)), "draft_slot_mapping": (torch.int64, (max_t,)),
            "query_start_loc": (torch.int32, (max_b + 1,)),
            "seq_lens": (torch.int32, (max_b,)), "context_lens": (torch.int32, (max_b,)),
            "block_table": (torch.int32, (max_b, self.max_blocks))}, device)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (q, bucket) -> (graph, logits, aux, packed)
        self.proposer = None
        self.capture_time_s = 0.0
        # Run eager steps exactly as a graph would (bucket padding, capacity bound): for tests.
        self.pad_like_graph = False
        # DCP: (block_table [B, n], positions [B, q]) -> this rank's target-cache slots; None: one process.
        self.shard_slot_mapping = None
        self.parallel = None  # the owning runner's ParallelState, named in every context (ForwardContext.parallel)

    # ---- eligibility ------------------------------------------------------------------------------
    def query_len(self, sched) -> int | None:
        """The step's query length if this runner serves it, else None (the general path runs)."""
        q = uniform_query_len(sched.scheduled)
        if q is None or q not in self.query_lens or len(sched.scheduled) > self.buckets[-1]:
            return None
        if any(len(s.seq.block_table) > self.max_blocks for s in sched.scheduled):
            return None
        return q

    def _bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    # ---- inputs -----------------------------------------------------------------------------------
    def plan(self, scheduled, q: int, ahead: bool = False) -> "UniformBatch":
        """The step's requests as host arrays (what a TP/DCP rank 0 posts to its workers). ``ahead``
        (q = 1 only): the step after the one in flight, whose results are not read yet: each request's
        query position is one past its ``num_computed_tokens`` and its token id is not known on the host
        (0 here; :meth:`run_ahead` copies the device's ids in)."""
        B = len(scheduled)
        n = max(len(s.seq.block_table) for s in scheduled)
        tokens = np.empty(B * q, dtype=np.int64)
        starts = np.empty(B, dtype=np.int64)
        table = np.full((B, n), -1, dtype=np.int32)
        for i, s in enumerate(scheduled):
            seq, start, L = s.seq, s.seq.num_computed_tokens + ahead, s.num_lookahead_tokens
            tokens[i * q] = 0 if ahead else seq.token_ids[start]
            if L:
                tokens[i * q + 1:(i + 1) * q] = seq.spec_token_ids[:L]
            starts[i] = start
            table[i, :len(seq.block_table)] = block_ids_array(seq.block_table)  # cached: no per-step conversion
        return UniformBatch(q, tokens, starts, table)

    def slot_mapping(self, block_table: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One-process cache slots [B, q] of positions [B, q] through block_table [B, n]:
        ``block * block_size + offset``. The target cache of a DCP rank takes ``shard_slot_mapping``'s
        instead; the DFlash draft pool, replicated on every rank, always takes these."""
        bs = self.block_size
        return np.take_along_axis(block_table, positions // bs, axis=1).astype(np.int64) * bs + positions % bs

    def _fill(self, batch: "UniformBatch", rows: int) -> tuple[list[int], list[int]]:
        """Write ``batch``'s inputs, padded to ``rows`` requests, into the host buffer and copy them to
        the device. Returns the real requests' seq_lens and context_lens."""
        inp = self.inputs
        inp.begin()
        h = inp.host
        q, B = batch.q, batch.num_reqs
        positions = batch.starts[:, None] + np.arange(q)[None, :]                           # [B, q]
        T, Tp = B * q, rows * q
        if B:
            h["input_ids"][:T] = batch.token_ids
            h["positions"][:T] = positions.reshape(-1)
            slots = self.slot_mapping(batch.block_table, positions).reshape(-1)
            h["draft_slot_mapping"][:T] = slots
            if self.shard_slot_mapping is not None:
                slots = self.shard_slot_mapping(batch.block_table, positions).reshape(-1)
            h["slot_mapping"][:T] = slots
        n = batch.block_table.shape[1]
        h["block_table"][:B, :n] = batch.block_table
        h["block_table"][:B, n:] = -1
        seq_lens, ctx_lens = (batch.starts + q).tolist(), batch.starts.tolist()
        h["seq_lens"][:B] = seq_lens
        h["context_lens"][:B] = ctx_lens
        if rows > B:  # pad rows: no cache write; q rows of block 0 to attend over
            h["input_ids"][T:Tp] = 0
            h["positions"][T:Tp] = list(range(q)) * (rows - B)
            h["slot_mapping"][T:Tp] = -1
            h["draft_slot_mapping"][T:Tp] = -1
            h["seq_lens"][B:rows] = q
            h["context_lens"][B:rows] = 0
            h["block_table"][B:rows] = 0
        h["query_start_loc"][:rows + 1] = range(0, Tp + 1, q)
        inp.copy_to_device()
        return seq_lens, ctx_lens

    def _context(self, rows: int, q: int, max_seq_len: int, seq_lens: list[int], ctx_lens: list[int]) -> ForwardContext:
        d, T = self.inputs.dev, rows * q
        return ForwardContext(
            positions=d["positions"][:T], slot_mapping=d["slot_mapping"][:T],
            query_start_loc=d["query_start_loc"][:rows + 1], seq_lens=d["seq_lens"][:rows],
            context_lens=d["context_lens"][:rows], block_table=d["block_table"][:rows], is_decode=[True] * rows,
            query_start_loc_cpu=list(range(0, T + 1, q)), seq_lens_cpu=seq_lens, context_lens_cpu=ctx_lens,
            block_size=self.block_size, logits_indices=None, uniform_decode=True, max_query_len=q,
            max_seq_len=max_seq_len, extras={"draft_slot_mapping": d["draft_slot_mapping"][:T]},
            parallel=self.parallel)

    def _forward(self, ctx: ForwardContext, proposer, draft_bound: int = 0):
        """logits [T, vocab] fp32 of every row; with a proposer, the drafter's fc outputs [T, H] and,
        when it drafts on persistent inputs (``proposer.uniform``), the chained step's packed result
        (:meth:`DraftGraphRunner.draft_after_verify`: every row's argmax, the greedy acceptance and the
        next drafts), after writing the draft-pool context of every row. ``draft_bound``: host bound
        of the next context lengths (0: the largest seq_len of ``ctx``)."""
        T = ctx.query_start_loc_cpu[-1]
        input_ids = self.inputs.dev["input_ids"][:T]
        aux = packed = None
        with set_forward_context(ctx):
            if proposer is not None:
                with proposer.capture(T) as holder:
                    hidden = self.model(input_ids)
                aux = holder.fc_out()
            else:
                hidden = self.model(input_ids)
            logits = self.model.compute_logits(hidden)
        if proposer is not None and proposer.uniform is not None:
            # NOTE: every row's draft context is written, the rejected drafts' too: the next step's
            # context length masks them and its verify rewrites those positions first (as the target
            # cache's rejected rows), so no block is shared with a stale row (prefix caching hashes
            # committed tokens only).
            proposer.write_context(aux, ctx.positions, ctx.extras["draft_slot_mapping"])
            packed = proposer.uniform.draft_after_verify(input_ids, logits, ctx.max_query_len, ctx.context_lens,
                                                         ctx.block_table, draft_bound or max(ctx.seq_lens_cpu))
        return logits, aux, packed

    # ---- graphs -----------------------------------------------------------------------------------
    def capture(self, proposer=None) -> None:
        """Capture every (query length, bucket) graph, largest token count first, into the shared
        pool. ``proposer``: the DFlash proposer whose fc outputs the forwards also produce."""
        if self.capturer is None:
            raise RuntimeError("CUDA graphs are off for this runner (no capturer)")
        self.proposer = proposer
        t0 = time.perf_counter()
        keys = sorted(((q, b) for q in self.query_lens for b in self.buckets), key=lambda k: (-k[0] * k[1], -k[0]))
        for q, b in keys:
            self._fill(UniformBatch.empty(q), b)
            ctx = self._context(b, q, self.capacity, [q] * b, [0] * b)
            graph, outs = self.capturer.capture(lambda: self._forward(ctx, proposer, self.capacity))
            self.graphs[(q, b)] = (graph, *outs)
        torch.cuda.synchronize(self.device)
        self.capture_time_s = time.perf_counter() - t0
        logger.info("CUDA graphs: %d decode/verify graphs (query lengths %s, batch buckets %s) captured in %.2f s",
                    len(keys), self.query_lens, self.buckets, self.capture_time_s)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def release(self) -> None:
        """Destroy the captured graphs (:func:`release_graphs`); uniform steps run eagerly afterwards."""
        release_graphs(self.graphs)

    # ---- a step -----------------------------------------------------------------------------------
    def mode(self, batch_size: int, q: int, proposer=None) -> tuple[bool, int]:
        """How a uniform step of ``batch_size`` requests runs: (replay a graph, rows after padding)."""
        key = (q, self._bucket(batch_size))
        graph = key in self.graphs and proposer is self.proposer  # graphs are captured for one proposer setting
        return graph, key[1] if graph or self.pad_like_graph else batch_size

    def run(self, sched, q: int, proposer=None, announce=None):
        """Run a uniform step (``query_len(sched) == q``). Returns (logits [B*q, vocab] fp32, spans,
        context, aux [B*q, H] or None, chain or None), logits row = token row; spans as
        ``ModelRunner.prepare``. ``chain`` (with a proposer drafting on persistent inputs): the step's
        :class:`ChainedStep` (every row's argmax and, per request, the next drafts under greedy
        acceptance), read from the device in one copy when first used. ``announce(batch, graph, rows)``
        is called before the forward (a TP/DCP rank 0 posts the step to its workers there)."""
        scheduled = sched.scheduled
        batch = self.plan(scheduled, q)
        graph, rows = self.mode(len(scheduled), q, proposer)
        if announce is not None:
            announce(batch, graph, rows)
        logits, ctx, aux, packed = self.run_batch(batch, graph, rows, proposer)
        spans = self.spans(scheduled, q)
        chain = ChainedStep(packed, len(scheduled), rows, q, proposer.block_size - 1) if packed is not None else None
        return logits, spans, ctx, aux, chain

    @staticmethod
    def spans(scheduled, q: int) -> list[tuple[int, int]]:
        """Logit spans of a uniform step (``ModelRunner.prepare``'s): q rows for a verify or a request
        at its last token, 0 rows otherwise."""
        spans = []
        for i, s in enumerate(scheduled):
            done = s.num_lookahead_tokens or s.seq.num_computed_tokens + 1 == len(s.seq.token_ids)
            spans.append((i * q, q if done else 0))
        return spans

    def run_ahead(self, scheduled, token_ids: torch.Tensor):
        """Launch a plain decode step (q = 1, no proposer) for ``scheduled`` one position past each
        request's ``num_computed_tokens``, its input ids ``token_ids`` [B] int64 on the device (the
        previous step's sampled tokens, not yet read by the host: ``engine/async_scheduling.py``). The
        caller has reserved the cache slot of that position. Returns as :meth:`run`."""
        batch = self.plan(scheduled, 1, ahead=True)
        graph, rows = self.mode(len(scheduled), 1)
        logits, ctx, aux, _ = self.run_batch(batch, graph, rows, token_ids=token_ids)
        return logits, [(i, 1) for i in range(len(scheduled))], ctx, aux, None

    def run_batch(self, batch: "UniformBatch", graph: bool, rows: int, proposer=None,
                  token_ids: torch.Tensor | None = None):
        """The forward of a planned batch (every rank of a TP/DCP engine runs it with rank 0's
        ``mode``). ``token_ids``: [B*q] int64 device tensor replacing ``batch.token_ids`` (copied on the
        device after the host inputs). Returns (logits [B*q, vocab] fp32, context, aux [B*q, H] or
        None, packed chain result or None)."""
        q, B = batch.q, batch.num_reqs
        seq_lens, ctx_lens = self._fill(batch, rows)
        if token_ids is not None:
            self.inputs.dev["input_ids"][:B * q].copy_(token_ids)
        ctx = self._context(B, q, max(seq_lens), seq_lens, ctx_lens)
        if graph:
            g, logits, aux, packed = self.graphs[(q, rows)]
            g.replay()
        elif rows > B:
            pad = rows - B
            logits, aux, packed = self._forward(self._context(rows, q, self.capacity, seq_lens + [q] * pad,
                                                              ctx_lens + [0] * pad), proposer, self.capacity)
        else:
            logits, aux, packed = self._forward(ctx, proposer)
        T = B * q
        return logits[:T], ctx, (aux[:T] if aux is not None else None), packed


@dataclasses.dataclass
class UniformBatch:
    """A uniform step's requests as host arrays: q query tokens per request.

    Attributes:
        q: query length (1 + draft tokens).
        token_ids: [B*q] int64, each request's pending token then its drafts.
        starts: [B] int64, each request's first query position (= its cached context length).
        block_table: [B, n] int32 logical block ids, -1 past a request's blocks.
    """

    q: int
    token_ids: np.ndarray
    starts: np.ndarray
    block_table: np.ndarray

    @property
    def num_reqs(self) -> int:
        return len(self.starts)

    @staticmethod
    def empty(q: int) -> "UniformBatch":
        return UniformBatch(q, np.empty(0, np.int64), np.empty(0, np.int64), np.empty((0, 0), np.int32))


class ChainedStep:
    """Host view of a chained verify step's packed device result (``DraftGraphRunner.draft_after_verify``)
    for the B real requests of a batch padded to ``rows``; read from the device on first use (the
    step's one device -> host sync happens in ``LLMEngine.step``, never inside the forward).

    Attributes:
        greedy_ids: [B·q] argmax token of every row (the sampler's greedy choice).
        next_drafts: per request (expected position of the next pending token, expected pending
            token, drafts [Bk - 1]); valid for the next step only if the request committed exactly
            the greedy tokens (``LLMEngine`` checks both expectations before using the drafts).
    """

    def __init__(self, packed: torch.Tensor, B: int, rows: int, q: int, num_drafts: int):
        self._packed, self._shape = packed, (B, rows, q, num_drafts)
        self._greedy_ids: list[int] | None = None
        self._next: list[tuple[int, int, list[int]]] | None = None

    def _read(self) -> None:
        B, rows, q, nd = self._shape
        v = self._packed.tolist()  # NOTE: the step's one device -> host sync
        tokens, o = v[:B * q], rows * q
        accepted, start, drafts = v[o:o + B], v[o + rows:o + rows + B], v[o + 2 * rows:]
        self._greedy_ids = tokens
        self._next = [(start[i], tokens[i * q + accepted[i]], drafts[i * nd:(i + 1) * nd]) for i in range(B)]

    @property
    def greedy_ids(self) -> list[int]:
        if self._greedy_ids is None:
            self._read()
        return self._greedy_ids

    @property
    def next_drafts(self) -> list[tuple[int, int, list[int]]]:
        if self._next is None:
            self._read()
        return self._next
