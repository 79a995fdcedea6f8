"""DFlash speculative decoding under decode-context parallelism (CPU, gloo, fp32 model) and with an
FP8 target cache (issue 14; ``shared/specs/dflash.md`` "Engines' pitfalls").

Under ``-dcp N`` the draft KV pool is replicated on every rank (never sharded), so DCP 2 and 4 must
propose the same drafts as DCP 1: greedy tokens, acceptance length per request and every step's
draft logits equal DCP 1's, and the drafts of every worker rank equal rank 0's. A second turn
re-uses cached blocks whose draft KV was written by verify commits (prefix-cache hit). The start-up
report sizes the target's per-rank shard and the replicated draft pool separately.
"""

from __future__ import annotations

import pytest
import torch

from longflash.config import EngineConfig
from longflash.default_model_path import default_model_path
from longflash.engine.llm_engine import LLMEngine
from longflash.sampling_params import SamplingParams

from engine_helpers import greedy_outputs

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "To be, or not to be, that is the question:", "import os\nimport sys\n"]
MAX_TOKENS = 16
SECOND_TURN_LEN = 33      # prompt 0 is 22 tokens: its 38 tokens hold two full blocks of 16 after turn one
# DCP changes the target's fp32 sums (LSE combine) by ~1e-6; a sharded draft pool changes the
# draft logits by O(1) (test_sharded_draft_pool_changes_draft_logits measures it).
DRAFT_LOGITS_ATOL = 1e-3


def _engine(dcp: int, kv_cache_dtype: str, **kw) -> LLMEngine:
    args = dict(model=default_model_path(), block_size=4, num_gpu_blocks=64, max_num_batched_tokens=64,
                kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=dcp, decode_context_parallel_size=dcp,
                distributed_timeout_s=60)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def _generate(eng: LLMEngine, prompts: list, max_tokens: int = MAX_TOKENS) -> list:
    return greedy_outputs(eng, prompts, max_tokens)


def _run(dcp: int, kv_cache_dtype: str) -> dict:
    """Greedy outputs, acceptance, every draft step's logits (rank 0) and the start-up report."""
    eng = _engine(dcp, kv_cache_dtype)
    draft_logits = []
    real = eng.proposer.draft_logits

    def recording(requests):
        out = real(requests)
        draft_logits.append(out.clone())
        return out

    eng.proposer.draft_logits = recording
    try:
        first = _generate(eng, PROMPTS)
        # Second turn: the first 33 tokens of prompt 0 + its output. 32 of them come from the prefix
        # cache (two logical blocks at DCP 4, 8 at DCP 1: the same hit length, so fp8 reads back the
        # same rows), including blocks whose draft KV was written by verify commits.
        turn = (first[0].prompt_token_ids + first[0].outputs[0].token_ids)[:SECOND_TURN_LEN]
        again = _generate(eng, [{"prompt_token_ids": turn}], max_tokens=8)
        outs = first + again
        return {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "acceptance": [o.metrics.mean_acceptance_length for o in outs],
            "decode_steps": [o.metrics.num_decode_steps for o in outs],
            "cached": again[0].num_cached_tokens,
            "draft_logits": draft_logits,
            "report": eng.startup_report(),
            "checks": (getattr(eng.runner, "draft_checks", None), getattr(eng.runner, "draft_mismatches", None)),
        }
    finally:
        eng.shutdown()


_REFS: dict[str, dict] = {}


def _reference(kv_cache_dtype: str) -> dict:
    if kv_cache_dtype not in _REFS:
        _REFS[kv_cache_dtype] = _run(1, kv_cache_dtype)
    return _REFS[kv_cache_dtype]


@pytest.mark.parametrize("dcp,kv_cache_dtype", [(2, "auto"), (2, "fp8"), (4, "auto"), (4, "fp8")])
def test_dcp_dflash_equals_dcp1(dcp, kv_cache_dtype):
    ref = _reference(kv_cache_dtype)
    got = _run(dcp, kv_cache_dtype)
    assert got["tokens"] == ref["tokens"] and [len(t) for t in got["tokens"]] == [MAX_TOKENS] * len(PROMPTS) + [8]
    assert got["acceptance"] == ref["acceptance"] and got["decode_steps"] == ref["decode_steps"]
    assert max(ref["acceptance"]) > 2.0          # the drafter does propose accepted tokens here
    assert got["cached"] == ref["cached"] == SECOND_TURN_LEN - 1
    # The same drafts, step by step, from the same draft logits (rank 0) ...
    assert len(got["draft_logits"]) == len(ref["draft_logits"]) > 0
    worst = max(float((a - b).abs().max()) for a, b in zip(got["draft_logits"], ref["draft_logits"]))
    assert all(a.shape == b.shape for a, b in zip(got["draft_logits"], ref["draft_logits"]))
    print(f"dcp {dcp} {kv_cache_dtype}: acceptance per request {got['acceptance']} (DCP 1: {ref['acceptance']}), "
          f"draft logits max |diff| {worst:.2e} over {len(got['draft_logits'])} draft steps")
    assert worst <= DRAFT_LOGITS_ATOL, worst
    # ... and on every worker rank (their drafts are all-gathered and compared with rank 0's).
    assert got["checks"] == (len(got["draft_logits"]), 0)
    # Start-up report: the target cache is sharded (per-rank bytes as DCP 1, capacity x dcp), the
    # draft pool replicated (x dcp bytes per rank: every rank holds all block_size * dcp tokens).
    r, r1 = got["report"], ref["report"]
    assert r["kv_cache_tokens"] == dcp * r1["kv_cache_tokens"]
    assert r["target_kv_cache_bytes"] == r1["target_kv_cache_bytes"] > 0
    assert r["draft_kv_cache_bytes"] == dcp * r1["draft_kv_cache_bytes"] > 0
    assert r["kv_cache_bytes"] == r["target_kv_cache_bytes"] + r["draft_kv_cache_bytes"]
    assert r["kv_bytes_per_token"] == r["target_kv_bytes_per_token"] + dcp * r["draft_kv_bytes_per_token"]
    assert r["draft_kv_cache_dtype"] == "float32"    # the model dtype, never the fp8 of the target cache
    assert r["kv_cache_dtype"] == ("float8_e4m3fn" if kv_cache_dtype == "fp8" else "float32")


def test_num_blocks_counts_replicated_draft_bytes_per_rank():
    """The KV budget (per rank) pays for bs target rows and bs * dcp draft rows per block."""
    budget = 4 << 20
    one = _engine(1, "fp8", num_gpu_blocks=None, kv_cache_memory=budget)
    two = _engine(2, "fp8", num_gpu_blocks=None, kv_cache_memory=budget)
    try:
        t, d = one.target_kv_bytes_per_token, one.draft_kv_bytes_per_token
        assert (two.target_kv_bytes_per_token, two.draft_kv_bytes_per_token) == (t, d) and d > 0
        assert one.num_blocks == budget // (4 * (t + d))
        assert two.num_blocks == budget // (4 * (t + 2 * d))
        rep = two.startup_report()
        assert rep["kv_cache_bytes"] <= budget < rep["kv_cache_bytes"] + 4 * (t + 2 * d)
        assert rep["kv_capacity_tokens_by_dtype"]["float8_e4m3fn"] == rep["kv_cache_tokens"] == 8 * two.num_blocks
        assert two.proposer.kv_caches[0].shape[1:3] == (two.num_blocks, 8)   # logical blocks of 4 * dcp tokens
    finally:
        two.shutdown()


def test_sharded_draft_pool_changes_draft_logits():
    """What the equality above guards against: the draft pool written like the target's DCP 2 shard
    of rank 0 (the other rank's positions never written) changes the draft logits far beyond
    DRAFT_LOGITS_ATOL."""
    from longflash.engine.scheduler import ScheduledSeq, SchedulerOutput
    from longflash.engine.sequence import Sequence
    eng = _engine(1, "auto", enable_prefix_caching=False)
    prop = eng.proposer
    ids = eng.tokenize(PROMPTS[0])
    seq = Sequence("probe", ids, SamplingParams(max_tokens=8))
    assert eng.block_manager.allocate_for_new(seq, len(ids))
    res = eng.runner.execute(SchedulerOutput([ScheduledSeq(seq, len(ids))], []), proposer=prop)
    request = [(ids[-1], len(ids), prop.block_size - 1, seq.block_table)]
    with torch.inference_mode():
        prop.write_context(res.aux, res.ctx.positions, res.ctx.slot_mapping)
        full = prop.draft_logits(request)
        for cache in prop.kv_caches:
            cache.zero_()
        mine = res.ctx.positions % 2 == 0
        prop.write_context(res.aux, res.ctx.positions, torch.where(mine, res.ctx.slot_mapping, -1))
        sharded = prop.draft_logits(request)
    diff = float((full - sharded).abs().max())
    print(f"sharded draft pool: draft logits max |diff| {diff:.3f}")
    assert diff > 100 * DRAFT_LOGITS_ATOL


def test_fp8_target_cache_with_bf16_draft_pool_single_process():
    """DFlash with --kv-cache-dtype fp8 in one process: the target cache is fp8, the draft pool bf16
    (bf16 model) and read as such by the drafter; both are sized in the start-up report; greedy
    output equals target-only greedy over the same fp8 cache (fp32 model)."""
    eng = _engine(1, "fp8", dtype="bfloat16")
    r = eng.startup_report()
    assert r["kv_cache_dtype"] == "float8_e4m3fn" and r["draft_kv_cache_dtype"] == "bfloat16"
    assert all(c.dtype == torch.bfloat16 for c in eng.proposer.kv_caches)
    assert all(m.kv_cache.dtype == torch.float8_e4m3fn for m in eng.model.attention_layers())
    cfg = eng.model_config
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert r["target_kv_bytes_per_token"] == cfg["num_hidden_layers"] * latent            # 1 byte per element
    kvh, hd = eng.proposer.drafter.kv_row_shape()
    assert r["draft_kv_bytes_per_token"] == len(eng.proposer.drafter.layers) * 2 * kvh * hd * 2   # K and V, bf16
    assert r["target_kv_cache_bytes"] == 64 * 4 * r["target_kv_bytes_per_token"]
    assert r["draft_kv_cache_bytes"] == 64 * 4 * r["draft_kv_bytes_per_token"]
    outs = _generate(eng, PROMPTS)
    assert max(o.metrics.mean_acceptance_length for o in outs) > 2.0

    spec = _reference("fp8")                                        # fp32 model, fp8 target cache
    base = _generate(_engine(1, "fp8", speculative_config="off"), PROMPTS)
    assert [o.outputs[0].token_ids for o in base] == spec["tokens"][:len(PROMPTS)]
