"""Uniform decode steps under tensor / decode-context parallelism (the path CUDA graphs replay on every
rank; CPU, gloo, eager): rank 0 posts each step's planned inputs, every rank fills its own (its DCP
shard's slots) and runs the same forward; rows padded to the graph bucket as a graph would. Greedy
tokens equal the single-process engine's (tiny DeepSeek-V3, fp32); the host slot formula equals
``dcp_slot_mapping``; the reference decode op's ``visible_lens`` equals the DCP local reference. Graph
capture and replay over NCCL: ``benchmarks/multi_gpu_speed.py`` (2 GPUs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longflash.attention import ops
from longflash.config import EngineConfig
from longflash.distributed.dcp import dcp_rank_local_lens, dcp_slot_mapping, mla_decode_attention_local
from longflash.distributed.runner import shard_slot_mapping
from longflash.engine.llm_engine import LLMEngine

from engine_helpers import greedy_tokens


def _engine(model, tp, dcp, **kw):
    args = dict(model=model, block_size=4, num_gpu_blocks=128, max_num_batched_tokens=16, context_workspace_rows=4,
                skip_tokenizer_init=True, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                speculative_config="off", distributed_timeout_s=30, max_num_seqs=6)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


@pytest.mark.parametrize("tp,dcp,kw", [(2, 2, {"kv_cache_dtype": "fp8", "cp_kv_cache_interleave_size": 2}),
                                       (2, 1, {})])
def test_uniform_steps_under_tp_equal_single_process(tiny_model, tp, dcp, kw):
    model = tiny_model("dsv3-qlora-interleave-yarn")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 200, (n,), generator=g).tolist() for n in (37, 5, 1)]
    ref = _engine(model, 1, 1, **kw)
    try:
        want = greedy_tokens(ref, prompts, 24)
    finally:
        ref.shutdown()
    eng = _engine(model, tp, dcp, **kw)
    try:
        assert eng.enable_uniform_decode(cuda_graphs=False) is False
        dr = eng.runner.decode_runner
        dr.pad_like_graph = True                      # 3 requests -> bucket 4, capacity bound: as a graph
        calls = []
        run_batch = dr.run_batch
        dr.run_batch = lambda batch, graph, rows, proposer=None: (calls.append(rows), run_batch(batch, graph, rows))[1]
        got = greedy_tokens(eng, prompts, 24)
        assert eng.runner.procs[0].exitcode is None   # the worker followed every posted step
    finally:
        eng.shutdown()
    assert got == want
    assert len(calls) >= 20 and 4 in calls            # the uniform path ran, padded


@pytest.mark.parametrize("dcp,interleave,bs", [(2, 1, 4), (2, 2, 4), (4, 2, 8), (1, 1, 4)])
def test_shard_slot_mapping_equals_dcp_slot_mapping(dcp, interleave, bs):
    g = torch.Generator().manual_seed(dcp * 10 + interleave)
    B, q, n = 5, 3, 6
    table = torch.randperm(64, generator=g)[:B * n].view(B, n).int()
    starts = torch.randint(0, n * bs * dcp - q, (B,), generator=g)
    pos = starts[:, None] + torch.arange(q)[None, :]
    for rank in range(dcp):
        got = shard_slot_mapping(table.numpy(), pos.numpy(), bs, dcp, rank, interleave)
        want = dcp_slot_mapping(pos.reshape(-1), table, bs, dcp, rank, interleave,
                                torch.arange(B).repeat_interleave(q))
        assert np.array_equal(got.reshape(-1), want.numpy())


@pytest.mark.parametrize("dcp,interleave", [(2, 1), (2, 4), (4, 1)])
def test_reference_decode_visible_lens_equals_dcp_local(dcp, interleave):
    """ops.mla_decode_attention with device-tensor lengths and ``visible_lens`` (the uniform DCP form)
    equals ``mla_decode_attention_local`` (list lengths) on every rank's shard."""
    g = torch.Generator().manual_seed(dcp + interleave)
    H, R, rope, bs, nb = 4, 16, 8, 8, 24
    cache = torch.randn(nb, bs, R + rope, generator=g)
    seq_lens, q_lens = [45, 9, 3], [3, 1, 2]
    qsl = [0, 3, 4, 6]
    T = qsl[-1]
    q = torch.randn(T, H, R + rope, generator=g)
    table = torch.randperm(nb, generator=g)[:12].view(3, 4).int()
    pos = torch.cat([torch.arange(L - n, L) for L, n in zip(seq_lens, q_lens)])
    for rank in range(dcp):
        want_o, want_l = mla_decode_attention_local(q, cache, table, qsl, seq_lens, 0.3, R, dcp, rank, interleave)
        local = dcp_rank_local_lens(torch.tensor(seq_lens, dtype=torch.int32), dcp, rank, interleave)
        vis = dcp_rank_local_lens(pos + 1, dcp, rank, interleave).int()
        o, lse = ops.mla_decode_attention(q, cache, table, torch.tensor(qsl, dtype=torch.int32), local, 0.3, R,
                                          max_query_len=3, max_seq_len=table.shape[1] * bs, visible_lens=vis)
        empty = want_l == float("-inf")
        assert torch.equal(empty, lse == float("-inf"))
        assert torch.allclose(o, want_o, atol=1e-5) and torch.allclose(lse[~empty], want_l[~empty], atol=1e-5)


DFLASH_PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return",
                  "To be, or not to be, that is the question:", "import os\nimport sys\n"]


@pytest.mark.parametrize("tp,dcp", [(2, 2)])  # (tp 2, dcp 1) passes too (measured; left out for CI time)
def test_chained_dflash_steps_under_tp_equal_single_process(tp, dcp):
    """DFlash under ``-tp 2`` (``-dcp 2``: the draft pool replicated, the target cache sharded) with
    uniform verify steps on persistent inputs, padded as a graph replays them: every rank writes the
    draft context and drafts the next block inside the verify forward (the chained step). Greedy
    tokens equal the single-process engine without speculation; chained drafts were used; the workers'
    drafts (non-chained proposals) equal rank 0's."""
    from longflash.default_model_path import default_model_path
    kw = dict(model=default_model_path(), block_size=4, num_gpu_blocks=256, max_num_batched_tokens=64,
              dtype="float32", max_num_seqs=4, distributed_timeout_s=60)
    ref = LLMEngine(EngineConfig(**kw, speculative_config="off"))
    try:
        want = greedy_tokens(ref, DFLASH_PROMPTS, 24)
    finally:
        ref.shutdown()
    eng = LLMEngine(EngineConfig(**kw, tensor_parallel_size=tp, decode_context_parallel_size=dcp))
    try:
        assert eng.proposer is not None
        eng.enable_uniform_decode(cuda_graphs=False)
        dr = eng.runner.decode_runner
        dr.pad_like_graph = True
        verify_rows = []
        run_batch = dr.run_batch

        def counting(batch, graph, rows, proposer=None):
            verify_rows.append((batch.q, rows, proposer is not None))
            return run_batch(batch, graph, rows, proposer)
        dr.run_batch = counting
        chained = []
        use = eng._use_chained_drafts

        def counting_use(seq, n, unmasked=True):
            r = use(seq, n, unmasked)
            chained.append(r)
            return r
        eng._use_chained_drafts = counting_use
        got = greedy_tokens(eng, DFLASH_PROMPTS, 24)
        mismatches, checks = eng.runner.draft_mismatches, eng.runner.draft_checks
    finally:
        eng.shutdown()
    assert got == want
    assert any(q > 1 and spec for q, _, spec in verify_rows)    # uniform verify steps ran, chained
    assert sum(chained) >= 3                                    # drafts computed inside verify forwards used
    assert checks > 0 and mismatches == 0
