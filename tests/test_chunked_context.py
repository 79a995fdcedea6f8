"""Chunked-context prefill: planner invariants, a bounded workspace, and logits equal to the
unchunked path (DESIGN invariant 3) on the tiny test models, with fp32 and bf16 caches."""

import random

import pytest

from longflash import LLM, SamplingParams
from longflash.attention import mla as mla_mod
from longflash.attention import ops
from longflash.attention.chunked_context import plan_context_chunks

# ---------------------------------------------------------------------------- planner


def _check_plan(ctx, W, bs):
    chunks = plan_context_chunks(ctx, W, bs)
    segs = [s for c in chunks for s in c.segments]
    for c in chunks:
        assert 0 < c.num_rows <= W                       # no chunk above W, no empty chunk
        off = 0
        for s in c.segments:
            assert s.length > 0 and ctx[s.req] > 0         # never a request without context
            assert s.offset == off                         # rows packed densely
            off += s.length
    # Request order kept, each request's positions ascending and covered exactly once.
    assert [s.req for s in segs] == sorted(s.req for s in segs)
    for r, n in enumerate(ctx):
        mine = [s for s in segs if s.req == r]
        pos = 0
        for s in mine:
            assert s.start == pos
            assert s.start % bs == 0                       # splits at block-aligned points
            pos += s.length
        assert pos == n
    assert sum(c.num_rows for c in chunks) == sum(ctx)
    # The gather args reproduce the segments.
    for c in chunks:
        idx, cu, st = c.gather_args()
        assert idx.tolist() == [s.req for s in c.segments] and int(cu[-1]) == c.num_rows
        assert st.tolist() == [s.start for s in c.segments]
    return chunks


@pytest.mark.parametrize("ctx", [[960, 16 * 7], [37, 1000, 5], [64, 0, 64, 0], [0, 0], [], [1], [16 * 64 * 3 + 5]])
@pytest.mark.parametrize("W", [16, 48, 100, 1024])
def test_planner_invariants(ctx, W):
    chunks = _check_plan(ctx, W, 16)
    if ctx == [16 * 64 * 3 + 5] and W == 1024:
        assert len(chunks) >= 3                           # a context >= 3 x W takes >= 3 chunks
    if not any(ctx):
        assert chunks == []


def test_planner_random_and_packing():
    rng = random.Random(0)
    for _ in range(200):
        bs = rng.choice([1, 4, 16, 64])
        W = rng.choice([bs, bs * 3, bs * 5 + rng.randrange(bs), 1000])
        ctx = [rng.choice([0, rng.randrange(1, 400)]) for _ in range(rng.randrange(1, 6))]
        _check_plan(ctx, W, bs)
    # Small contexts share one chunk (packing), in order.
    chunks = plan_context_chunks([5, 7, 3], 64, 16)
    assert len(chunks) == 1 and [s.req for s in chunks[0].segments] == [0, 1, 2]
    with pytest.raises(ValueError):
        plan_context_chunks([10], 8, 16)


# ---------------------------------------------------------------------------- end to end


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def k3_path(tmp_path_factory):
    from test_kimi_k3 import SMALL, _save_random

    from longflash.training.config import default_model_config
    path = tmp_path_factory.mktemp("k3cc") / "flat"
    _save_random(path, default_model_config(**SMALL))
    return str(path)


@pytest.fixture
def recorder(monkeypatch):
    """Records every chunk plan made by MLA prefill and the rows of each gather it issues."""
    rec = {"chunks": [], "gather_rows": []}
    real_plan, real_gather = mla_mod.plan_context_chunks, ops.gather_and_maybe_dequant_cache

    def plan(ctx, W, bs):
        out = real_plan(ctx, W, bs)
        rec["chunks"].append((len(out), W))
        return out

    def gather(cache, bt, cu, *a, **k):
        rec["gather_rows"].append(int(cu[-1]))
        return real_gather(cache, bt, cu, *a, **k)

    monkeypatch.setattr(mla_mod, "plan_context_chunks", plan)
    monkeypatch.setattr(ops, "gather_and_maybe_dequant_cache", gather)
    return rec


PROMPT = [(i * 37 + 11) % 250 + 2 for i in range(150)]


@pytest.mark.parametrize("variant", ["dsv3-qlora-interleave-yarn", "dsv3-noqlora-halfsplit-yarn", "k3"])
@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16"])
def test_tiny_workspace_logits_equal_unchunked(tiny_model, k3_path, recorder, variant, kv_dtype):
    path = k3_path if variant == "k3" else tiny_model(variant)
    kw = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=128, kv_cache_dtype=kv_dtype)
    big = LLM(path, **kw).engine
    tiny = LLM(path, context_workspace_rows=8, **kw).engine
    want = big.score(PROMPT, chunk_size=40)
    recorder["chunks"].clear(), recorder["gather_rows"].clear()
    got = tiny.score(PROMPT, chunk_size=40)
    assert _rel(got, want) <= 1e-5
    # The last prefill chunk's 120-token context went through >= 3 (here 15) workspace chunks of <= 8 rows.
    assert max(n for n, W in recorder["chunks"] if W == 8) >= 3
    assert recorder["gather_rows"] and max(recorder["gather_rows"]) <= 8
    if kv_dtype == "auto":  # fp32 cache: equal to one unchunked forward too
        assert _rel(got, big.score(PROMPT)) <= 1e-5


def test_tiny_workspace_batched_prefix_hits_same_greedy(tiny_model):
    """Mixed batch: prefix-cache hits, chunked prefill under a 7-token budget, decode; W = 4 rows."""
    path = tiny_model("dsv3-qlora-interleave-yarn")
    base = list(range(10, 58))
    prompts = [base + [i, i + 1, i + 2] for i in range(60, 64)] + [[5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref_llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=256,
                  enable_prefix_caching=False)
    ref = [ref_llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=256,
              max_num_batched_tokens=7, context_workspace_rows=4)
    llm.generate([{"prompt_token_ids": prompts[0]}], params)  # warms the prefix cache
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.block_manager.prefix_cache_hits > 0
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_workspace_rows_validated():
    from longflash.config import EngineConfig
    with pytest.raises(ValueError):
        EngineConfig(model="x", block_size=16, context_workspace_rows=8)
