"""The cached context of MLA prefill requests (``MLAAttention._prefill``), attended per workspace chunk with
one varlen non-causal call over the chunk's segments and one LSE merge into the requests' rows, against
dense attention of each request over its whole context plus its new tokens (fp64), at the layer.

The batch is laid out so that the plan (``chunked_context.plan_context_chunks``, 8 rows, blocks of 4) holds
every kind of chunk: segments of prefill requests that are not consecutive among the step's prefill requests
(a prefill without context between them: the merge takes an index tensor of rows), one request's context
over several chunks, chunks with a single segment, two consecutive segments (a slice of rows); decode rows
between prefill rows (the prefill rows are scattered) stay untouched. The cache is fp32 or fp8 (dequantized
by the gather). Under DCP (``dcp_size`` ranks, interleave 1 or block_size) each rank holds its shard of
every context and the latents are all-gathered per chunk: contexts of 1 and 3 tokens leave some ranks
nothing of a request, a long one spans several chunks. The DCP group here is an in-process stand-in (one
thread per rank, ``all_gather`` through a barrier); ``test_dcp_model.py`` runs the same path over gloo.
"""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pytest
import torch

from longflash.attention import mla, ops
from longflash.distributed import dcp as dcp_ops

R_LAT, ROPE, NOPE, V, H = 16, 8, 8, 8, 2   # kv_lora_rank, rope, nope, v_head_dim, heads
BS, W = 4, 8                               # block size, context workspace rows
K_SCALE = 0.05
SENTINEL = 7.0

# (new tokens, cached context, is decode) per request of the step, in batch order
BATCH = [(1, 10, True),    # decode: the prefill rows below are not contiguous
         (3, 5, False),    # prefill with context            -> chunk 0
         (4, 0, False),    # prefill without context (between two with context)
         (2, 2, False),    # prefill with context            -> chunk 0: segments of prefill requests 0 and 2
         (1, 7, True),     # decode
         (5, 30, False),   # 30 rows: chunks 1-3 alone, then its last 6 rows beside the next request
         (1, 2, False)]    # prefill with context            -> the last chunk, consecutive with the one above
# under DCP: contexts of 1 and 3 tokens, of which some ranks hold nothing, beside the long one
DCP_BATCH = [(1, 10, True), (3, 1, False), (4, 0, False), (2, 3, False), (1, 7, True), (5, 30, False),
             (1, 2, False)]


def _layer(seed: int) -> mla.MLAAttention:
    torch.manual_seed(seed)
    layer = mla.MLAAttention(32, H, None, R_LAT, NOPE, ROPE, V, 1e-6, None, (NOPE + ROPE) ** -0.5)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    layer.context_workspace_rows = W
    return layer


def _step(seed: int, fp8: bool, batch: list):
    """Random latents of every context (fp8-rounded when ``fp8``), the step's queries and new latents,
    a block table of shuffled blocks, and the query start offsets."""
    g = torch.Generator().manual_seed(seed)
    qsl = [0]
    for n, _, _ in batch:
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    ctx_lat = []
    for _, c, _ in batch:
        lat = torch.randn(c, R_LAT + ROPE, generator=g) * 2
        if fp8:  # what the cache returns: the latents rounded to e4m3 at K_SCALE
            lat = (lat / K_SCALE).to(ops.FP8_DTYPE).float() * K_SCALE
        ctx_lat.append(lat)
    q_nope, q_pe = torch.randn(T, H, NOPE, generator=g), torch.randn(T, H, ROPE, generator=g)
    kv_c, k_pe = torch.randn(T, R_LAT, generator=g), torch.randn(T, ROPE, generator=g)
    max_blocks = max(c + n for n, c, _ in batch) // BS + 2
    num_blocks = len(batch) * max_blocks + 1
    block_table = torch.randperm(num_blocks, generator=g)[:len(batch) * max_blocks].view(len(batch), max_blocks)
    return qsl, ctx_lat, (q_nope, q_pe, kv_c, k_pe), block_table.to(torch.int32), num_blocks


def _rank_cache(ctx_lat, block_table, num_blocks, fp8, dcp_size=1, rank=0, interleave=1) -> torch.Tensor:
    """Rank ``rank``'s paged cache: position p of a request lies on rank ``(p // I) % dcp`` at local row
    ``(p // (I·dcp))·I + p % I`` (``dcp.dcp_local_to_global`` inverted); unwritten rows hold large garbage,
    so a row read past a rank's true local length shows in the result."""
    cache = torch.randn(num_blocks, BS, R_LAT + ROPE, generator=torch.Generator().manual_seed(99)) * 1e3
    for b, lat in enumerate(ctx_lat):
        for p in range(lat.shape[0]):
            if (p // interleave) % dcp_size == rank:
                j = (p // (interleave * dcp_size)) * interleave + p % interleave
                cache[block_table[b, j // BS], j % BS] = lat[p]
    return (cache / K_SCALE).to(ops.FP8_DTYPE) if fp8 else cache


def _dense(layer, qsl, ctx_lat, inputs, batch: list) -> torch.Tensor:
    """Each prefill request's new tokens over [its context, its new tokens], causal, fp64; decode rows
    keep the sentinel."""
    q_nope, q_pe, kv_c, k_pe = inputs
    q = torch.cat([q_nope, q_pe], dim=-1)
    want = torch.full((qsl[-1], H, V), SENTINEL, dtype=torch.float64)
    for b, (_, c, decode) in enumerate(batch):
        if decode:
            continue
        s, e = qsl[b], qsl[b + 1]
        lat = torch.cat([ctx_lat[b], torch.cat([kv_c[s:e], k_pe[s:e]], dim=-1)])
        k, v = layer._up_project(*lat.split([R_LAT, ROPE], dim=-1))
        want[s:e], _ = ops.attention_with_lse(q[s:e].double(), k.double(), v.double(), layer.scale, causal_offset=c)
    return want


def _prefill(layer, cache, qsl, inputs, block_table, parallel, batch: list) -> torch.Tensor:
    """``_prefill`` of the step's prefill requests into an output whose rows start as the sentinel."""
    out = torch.full((qsl[-1], H, V), SENTINEL)
    ctx = SimpleNamespace(query_start_loc_cpu=qsl, context_lens_cpu=[c for _, c, _ in batch],
                          block_table=block_table, parallel=parallel)
    reqs = [b for b, (_, _, decode) in enumerate(batch) if not decode]
    layer = _with_cache(layer, cache)
    mla.MLAAttention._prefill(layer, *inputs, reqs, ctx, out, ops)
    return out


def _with_cache(layer, cache):
    """A shallow copy of ``layer`` (same weights) reading ``cache`` (one per DCP rank)."""
    twin = copy.copy(layer)
    twin.kv_cache = cache
    twin.k_scale = K_SCALE if cache.dtype == ops.FP8_DTYPE else 1.0
    return twin


def _record_plans(monkeypatch) -> list:
    plans = []
    real = mla.plan_context_chunks

    def plan(context_lens, workspace_rows, block_size):
        out = real(context_lens, workspace_rows, block_size)
        plans.append([[s.req for s in chunk.segments] for chunk in out])
        return out

    monkeypatch.setattr(mla, "plan_context_chunks", plan)
    return plans


@pytest.mark.parametrize("fp8", [False, True])
def test_context_chunks_equal_dense_attention(monkeypatch, fp8):
    layer = _layer(0)
    qsl, ctx_lat, inputs, block_table, num_blocks = _step(1, fp8, BATCH)
    cache = _rank_cache(ctx_lat, block_table, num_blocks, fp8)
    plans = _record_plans(monkeypatch)
    got = _prefill(layer, cache, qsl, inputs, block_table, SimpleNamespace(dcp_size=1), BATCH)
    want = _dense(layer, qsl, ctx_lat, inputs, BATCH)
    assert (got.double() - want).abs().max().item() <= 2e-5
    # the chunks the batch was built for (segments named by their request's index among the prefill requests)
    assert plans == [[[0, 2], [3], [3], [3], [3, 4]]], plans


class _ThreadGroup:
    """In-process DCP group for one thread per rank (``threading.current_thread().dcp_rank``):
    ``all_gather`` concatenates every rank's tensor in rank order, as ``GroupCoordinator.all_gather``."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=60)
        self._parts: list = [None] * world_size

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self._parts[threading.current_thread().dcp_rank] = x
        self._barrier.wait()
        out = torch.cat(self._parts, dim=dim)
        self._barrier.wait()  # every rank has read the parts before the next call overwrites them
        return out

    def abort(self) -> None:
        self._barrier.abort()


@pytest.mark.parametrize("dcp_size,interleave,fp8", [(2, 1, False), (4, 1, True), (4, BS, False)])
def test_dcp_context_chunks_with_empty_local_shards_equal_dense_attention(monkeypatch, dcp_size, interleave, fp8):
    layer = _layer(2)
    qsl, ctx_lat, inputs, block_table, num_blocks = _step(3, fp8, DCP_BATCH)
    local = dcp_ops.dcp_local_seq_lens([c for _, c, _ in DCP_BATCH], dcp_size, interleave)
    assert (local[[1, 3]] == 0).any()  # some rank holds nothing of a prefill request with context
    plans = _record_plans(monkeypatch)
    group = _ThreadGroup(dcp_size)
    outs, errors = [None] * dcp_size, []

    def run(rank):
        threading.current_thread().dcp_rank = rank
        try:
            cache = _rank_cache(ctx_lat, block_table, num_blocks, fp8, dcp_size, rank, interleave)
            ps = SimpleNamespace(dcp_size=dcp_size, dcp_rank=rank, cp_kv_cache_interleave_size=interleave, dcp=group)
            outs[rank] = _prefill(layer, cache, qsl, inputs, block_table, ps, DCP_BATCH)
        except BaseException as e:  # noqa: BLE001 - reported below; the other ranks must not wait for this one
            errors.append(e)
            group.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(dcp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    want = _dense(layer, qsl, ctx_lat, inputs, DCP_BATCH)
    for rank, got in enumerate(outs):
        assert (got.double() - want).abs().max().item() <= 2e-5, rank
    # the long context went through several chunks of the per-rank plan
    assert all(sum(seg == [3] for seg in p) >= 1 and len(p) >= 2 for p in plans), plans
