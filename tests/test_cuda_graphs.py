"""CUDA graphs (GPU only): replaying a captured decode step, DFlash verify step and drafter block forward
of the default model gives the same logits / drafts as running the same padded step eagerly, greedy
generation with graphs equals the eager padded engine, and uniform steps never synchronize the host
(``torch.cuda.set_sync_debug_mode("error")``). The CPU equivalents are in ``test_uniform_decode.py``."""

import pytest
import torch

from longflash import LLM, SamplingParams
from longflash.runner.cuda_graph import uniform_query_len

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KW = dict(max_num_seqs=8, max_num_batched_tokens=96, block_size=4, device="cuda", kv_cache_memory="1GiB")
BF16_LOGIT_ULP = 2.0 ** -3  # one bf16 ulp of a logit in [16, 32): the default model's largest logits
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "To be, or not to be,"]


def _decoding_step(engine, steps: int = 4):
    from test_uniform_decode import PROMPTS as P, _decoding_step as step
    assert P == PROMPTS
    return step(engine, steps)


@pytest.mark.parametrize("spec", ["off", None])
def test_graph_replay_equals_eager_padded_step(spec):
    engine = LLM(speculative_config=spec, **KW).engine
    runner = engine.runner.decode_runner
    assert runner.captured and (spec == "off" or engine.proposer.uniform.graphs)
    sched, reqs, drafts = _decoding_step(engine)
    q = uniform_query_len(sched.scheduled)
    assert q == (1 if spec == "off" else 8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        replay = engine.runner.execute(sched, proposer=engine.proposer)  # bucket 4 graph
    finally:
        torch.cuda.set_sync_debug_mode("default")
    logits, aux = replay.logits.clone(), None if replay.aux is None else replay.aux.clone()
    graphs, runner.graphs = runner.graphs, {}
    runner.pad_like_graph = True
    eager = engine.runner.execute(sched, proposer=engine.proposer)
    runner.graphs, runner.pad_like_graph = graphs, False
    scale = float(eager.logits.abs().max())
    assert float((logits - eager.logits).abs().max()) <= 1e-3 * scale
    assert torch.equal(logits.argmax(-1), eager.logits.argmax(-1))
    if aux is not None:
        assert float((aux - eager.aux).abs().max()) <= 1e-3 * float(eager.aux.abs().max())
        drafter = engine.proposer.uniform
        d_graph = engine.proposer.propose(reqs)
        dgraphs, drafter.graphs = drafter.graphs, {}
        drafter.pad_like_graph = True
        d_eager = engine.proposer.propose(reqs)
        drafter.graphs, drafter.pad_like_graph = dgraphs, False
        assert d_graph == d_eager


def test_generation_with_graphs_equals_eager_padded_engine():
    """Greedy generation with graphs equals the eager padded engine token for token, up to a near-tie: graph
    replay and the eager padded step agree to 1e-3 of the logits' scale (the test above), not bitwise, and the LM
    head writes bf16 logits, so two tokens whose logits lie within one bf16 ulp of each other may round to equal
    values in one run and to neighbours in the other. The default model's logits stay below 32 in magnitude (max
    26.4 over these prompts, measured on the CPU), where one bf16 ulp is at most 2^-3. Seen on an H200: " death" /
    " doom" at token 28 of the third prompt, logprobs equal to 7 digits in one run and 2^-4 apart in the other.
    A divergence must be such a top-2 tie in both runs, at most one prompt may have one, and the continuations
    after it are not compared."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    graphs = LLM(**KW)
    eager = LLM(enforce_eager=True, **KW)
    eager.engine.runner.decode_runner.pad_like_graph = True
    eager.engine.proposer.uniform.pad_like_graph = True
    a = graphs.generate(PROMPTS, params)
    b = eager.generate(PROMPTS, params)
    ties = 0
    for oa, ob in zip(a, b):
        ta, tb = oa.outputs[0].token_ids, ob.outputs[0].token_ids
        assert len(ta) == len(tb) == 48
        i = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if i is None:
            continue
        ties += 1
        for lp in (oa.outputs[0].logprobs[i], ob.outputs[0].logprobs[i]):
            assert ta[i] in lp and tb[i] in lp, (i, ta[i], tb[i], lp)  # both are a run's top-2 at the divergence
            assert abs(lp[ta[i]].logprob - lp[tb[i]].logprob) <= BF16_LOGIT_ULP, (i, lp)
    assert ties <= 1, ties
    assert min(o.metrics.mean_acceptance_length for o in a) > 1.0


def test_eager_uniform_step_does_not_sync():
    """--enforce-eager: the uniform decode step runs without graphs and still never syncs."""
    engine = LLM(speculative_config="off", enforce_eager=True, **KW).engine
    assert not engine.runner.decode_runner.captured
    sched, _, _ = _decoding_step(engine)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = engine.runner.execute(sched)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert res.ctx.uniform_decode and res.logits.shape[0] == len(sched.scheduled)


def _syncs_of(fn) -> int:
    """Number of synchronizing CUDA operations ``fn()`` performs (sync debug mode "warn")."""
    import warnings
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("spec", ["off", None])
def test_engine_steps_sync_only_to_read_tokens(spec):
    """Whole engine steps (chunked prefill with cached context, mixed prefill + decode, decode or DFlash
    verify from graphs) synchronize at most to read the sampled tokens and, with DFlash, the drafts."""
    engine = LLM(speculative_config=spec, max_num_seqs=8, max_num_batched_tokens=24, block_size=4, device="cuda",
                 kv_cache_memory="1GiB").engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request(None, {"prompt_token_ids": list(range(5, 45))}, params)  # 40 tokens: two chunks
    counts = [_syncs_of(engine.step)]
    engine.add_request(None, {"prompt_token_ids": list(range(7, 20))}, params)
    while engine.has_unfinished_requests():
        counts.append(_syncs_of(engine.step))
    assert max(counts) <= (1 if spec == "off" else 2), counts
