"""The sampler's vocabulary masks applied to DFlash drafts (``spec_decode/draft_mask.py``):
``allowed_token_ids`` and the min_tokens mask of EOS / ``stop_token_ids``.

Before, the drafter proposed its unmasked argmax: outputs stayed the target's (the verify rows are
masked), but drafts the target can never accept were verified, and the acceptance length of a
request restricted to an arbitrary 300-id set fell to ~1.07 on the default model. Here: the masks
match ``process_logits``' -inf pattern row for row, the eager and the uniform (CUDA-graph) drafting
paths propose the same masked drafts, every draft the engine verifies for a masked request is one the
target could sample (general and chained uniform steps, and under DCP on every rank), and greedy /
seeded outputs equal target-only decoding.
"""

from __future__ import annotations

import pytest
import torch

from longflash import LLM, SamplingParams
from longflash.runner.sampler import process_logits
from longflash.spec_decode.draft_mask import DISALLOWED, STOP, DraftMask, apply_draft_masks, draft_mask, write_mask_codes

KW = dict(max_num_seqs=8, max_num_batched_tokens=96, block_size=4)
PROMPTS = ["def fibonacci(n):", "To be, or not to be, that is the question:", "class Stack:\n    def __init__(self):"]
ARBITRARY = list(range(1000, 1300))  # 300 ids the default model rarely picks on its own
MAX_TOKENS = 48


# ---- the masks ---------------------------------------------------------------------------------------
def test_draft_mask_only_when_the_sampler_masks():
    assert draft_mask(SamplingParams(), 0, {0}) is None
    assert draft_mask(SamplingParams(min_tokens=3, max_tokens=8), 3, {0}) is None   # min_tokens reached
    assert draft_mask(SamplingParams(logit_bias={5: -100.0}, presence_penalty=1.0), 0, {0}) is None
    m = draft_mask(SamplingParams(min_tokens=5, stop_token_ids=[9, 0], max_tokens=8), 3, {0, 2})
    assert m == DraftMask(None, 3, 5, (0, 2, 9))
    m = draft_mask(SamplingParams(allowed_token_ids=[7, 4]), 6, {0})
    assert m == DraftMask((7, 4), 6, 0, ())
    with pytest.raises(ValueError, match="num_output_tokens must be >= 0"):
        draft_mask(SamplingParams(), -1, {0})


def test_mask_codes_match_process_logits_rows():
    """Draft slot j of a request gets exactly the -inf columns of its verify row j."""
    g = torch.Generator().manual_seed(0)
    n, vocab = 4, 12
    logits = torch.randn(3, n, vocab, generator=g)
    p1 = SamplingParams(allowed_token_ids=[2, 5, 9], min_tokens=5, stop_token_ids=[9, 3], max_tokens=20)
    p2 = SamplingParams(min_tokens=6, stop_token_ids=[11, 40], max_tokens=20)   # 40: outside the vocabulary
    eos = {0}
    out1, out2 = [3, 4, 5], [1, 1, 1, 1]       # output tokens so far (the pending token included)
    masks = [draft_mask(p1, len(out1), eos), draft_mask(p2, len(out2), eos), None]
    codes = torch.full((4, vocab), 7, dtype=torch.uint8)
    until = write_mask_codes(codes, masks, rows=4)
    assert until == [2, 2, 0] and not codes[2:].any()                         # reset rows 2 (unmasked) and 3 (pad)
    assert codes[0].tolist() == [DISALLOWED] * 2 + [0] + [DISALLOWED] * 2 + [0] + [DISALLOWED] * 3 + [STOP] + \
        [DISALLOWED] * 2                                                       # 3 is a stop id but not allowed
    masked = logits.clone()
    apply_draft_masks(masked, codes[:3], torch.tensor(until, dtype=torch.int32))
    for i, (p, out) in enumerate(((p1, out1), (p2, out2))):
        ref = process_logits(torch.cat([logits[i], logits[i, :1]]), p, [1], out, [7] * n, eos)[:n]
        assert torch.equal(torch.isinf(masked[i]), torch.isinf(ref)), i
    assert torch.isinf(masked[0, 1, 9]) and torch.isfinite(masked[0, 2, 9])  # 3 + 1 < 5 masks the stop, 3 + 2 not
    assert torch.isinf(masked[1, :2, [0, 11]]).all() and torch.isfinite(masked[1, 2:]).all()
    finite = torch.isfinite(masked)
    assert torch.equal(masked[finite], logits[finite]) and torch.equal(masked[2], logits[2])   # masks only
    with pytest.raises(ValueError, match=r"codes must be \[>= 3, vocab\] uint8"):
        write_mask_codes(torch.zeros(2, vocab, dtype=torch.uint8), masks)
    with pytest.raises(ValueError, match=r"codes must be \[>= 3, vocab\] uint8"):
        write_mask_codes(torch.zeros(3, vocab), masks)
    with pytest.raises(ValueError, match=r"logits \[R, n, vocab\], codes \[R, vocab\]"):
        apply_draft_masks(logits, codes, torch.tensor(until))


# ---- the proposer: eager and uniform (CUDA-graph) paths -------------------------------------------------
def _draft_requests(engine):
    """The draft requests of a scheduled step after a few steps of PROMPTS (all decoding)."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for p in PROMPTS:
        engine.add_request(None, p, params)
    for _ in range(4):
        engine.step()
    sched = engine.scheduler.schedule(engine._lookahead)
    return [(s.seq.token_ids[-1], s.seq.num_computed_tokens, s.num_lookahead_tokens, s.seq.block_table)
            for s in sched.scheduled if s.num_lookahead_tokens]


def test_proposer_paths_propose_the_same_masked_drafts():
    engine = LLM(**KW).engine
    reqs = _draft_requests(engine)
    assert len(reqs) == 3 and all(n == 7 for _, _, n, _ in reqs)
    allowed_only = DraftMask(tuple(ARBITRARY), 10, 0, ())
    in_set = engine.proposer.propose(reqs, [None, None, allowed_only])[2]
    stop = (0, 17, in_set[0], in_set[2])      # request 2's favourite tokens at slots 0 and 2 as stop ids
    masks = [allowed_only, None, DraftMask(tuple(ARBITRARY), 10, 13, stop)]
    plain = engine.proposer.propose(reqs)
    assert engine.proposer.propose(reqs, [None] * 3) == plain
    logits = engine.proposer.draft_logits(reqs).clone().view(3, 7, -1)  # cloned: not an inference tensor
    codes = torch.empty(3, logits.shape[-1], dtype=torch.uint8)
    apply_draft_masks(logits, codes, torch.tensor(write_mask_codes(codes, masks)))
    expected = torch.argmax(logits, dim=-1).tolist()
    eager = engine.proposer.propose(reqs, masks)
    assert eager == expected and eager[1] == plain[1]
    assert eager[0] != plain[0] and set(eager[0]) <= set(ARBITRARY)
    assert set(eager[2]) <= set(ARBITRARY) and not set(eager[2][:3]) & set(stop)   # 10 + j < 13: slots 0..2
    assert eager[2][0] != in_set[0] and eager[2][2] != in_set[2]
    # Near max_tokens fewer drafts are verified: still the whole block, its first n slots.
    short = [(p, s, n, t) for (p, s, _, t), n in zip(reqs, (2, 7, 4))]
    assert engine.proposer.propose(short, masks) == [e[:n] for e, n in zip(eager, (2, 7, 4))]
    engine.enable_uniform_decode(cuda_graphs=False)
    for pad_like_graph in (False, True):
        engine.proposer.uniform.pad_like_graph = pad_like_graph
        assert engine.proposer.propose(reqs, masks) == eager
        assert engine.proposer.propose(short, masks) == [e[:n] for e, n in zip(eager, (2, 7, 4))]
        assert engine.proposer.propose(reqs) == plain
    with pytest.raises(ValueError, match="3 draft requests but 2 masks"):
        engine.proposer.propose(reqs, masks[:2])


# ---- the engine: greedy and seeded outputs, drafts, acceptance ---------------------------------------------
@pytest.fixture(scope="module")
def engines():
    base = LLM(speculative_config="off", **KW)
    general = LLM(**KW)
    chained = LLM(**KW)
    chained.engine.enable_uniform_decode(cuda_graphs=False)  # chained verify + next draft, as on the GPU
    return base, general, chained


def _record_drafts(llm) -> list[tuple[SamplingParams, int, list[int]]]:
    """(sampling params, output tokens, drafts) of every request at every verify step of ``llm``'s
    engine, from now on."""
    seen, eng = [], llm.engine
    real = eng.runner.execute

    def execute(sched, *args, **kw):
        for s in sched.scheduled:
            if s.num_lookahead_tokens:
                seen.append((s.seq.sampling_params, s.seq.num_output_tokens,
                             list(s.seq.spec_token_ids[:s.num_lookahead_tokens])))
        return real(sched, *args, **kw)

    eng.runner.execute = execute
    return seen


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _acceptance_length(llm, run) -> tuple[list, float]:
    st = llm.engine.stats
    a0, d0 = st.spec_num_accepted_tokens, st.spec_num_drafts
    outs = run()
    return outs, 1 + (st.spec_num_accepted_tokens - a0) / (st.spec_num_drafts - d0)


@pytest.mark.parametrize("which", ["general", "chained"])
def test_allowed_token_ids_drafts_in_set_and_greedy_equals_target_only(engines, which):
    base, general, chained = engines
    spec = general if which == "general" else chained
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=ARBITRARY)
    ref = _ids(base.generate(PROMPTS, params))
    assert all(set(r) <= set(ARBITRARY) for r in ref)
    seen = _record_drafts(spec)
    outs, acc = _acceptance_length(spec, lambda: spec.generate(PROMPTS, params))
    assert _ids(outs) == ref
    assert seen and all(set(d) <= set(ARBITRARY) for _, _, d in seen)
    # Unmasked drafts (before the masks): 1.09 here; masked: 1.57.
    assert acc > 1.4, acc
    # Seeded sampling: the same tokens as target-only (one draw per committed token either way).
    seeded = [SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True,
                             allowed_token_ids=ARBITRARY) for i in range(len(PROMPTS))]
    assert _ids(spec.generate(PROMPTS, seeded)) == _ids(base.generate(PROMPTS, seeded))
    assert all(set(d) <= set(ARBITRARY) for _, _, d in seen)


@pytest.mark.parametrize("which", ["general", "chained"])
def test_min_tokens_stop_ids_not_drafted_before_min_tokens(engines, which):
    base, general, chained = engines
    spec = general if which == "general" else chained
    free = _ids(base.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)))
    counts: dict[int, int] = {}
    for t in (t for r in free for t in r):
        counts[t] = counts.get(t, 0) + 1
    stops = sorted(counts, key=lambda t: -counts[t])[:8]          # the model's favourite tokens
    min_tokens = MAX_TOKENS - 8
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, min_tokens=min_tokens,
                            stop_token_ids=stops)
    seen = _record_drafts(spec)
    outs = spec.generate(PROMPTS, params)
    assert _ids(outs) == _ids(base.generate(PROMPTS, params))
    masked = [(n, d) for _, n, d in seen if n < min_tokens]
    assert masked and all(d[j] not in stops for n, d in masked for j in range(min(len(d), min_tokens - n)))


def test_dcp_workers_draft_with_the_masks(engines):
    """Under ``-tp 2 -dcp 2`` (gloo) every rank drafts with rank 0's masks: the all-gathered drafts
    agree (a worker drafting unmasked would count mismatches) and are all in the allowed set."""
    from longflash.config import EngineConfig
    from longflash.default_model_path import default_model_path
    from longflash.engine.llm_engine import LLMEngine
    base = engines[0]
    eng = LLMEngine(EngineConfig(model=default_model_path(), block_size=4, num_gpu_blocks=64, max_num_batched_tokens=64,
                                 tensor_parallel_size=2, decode_context_parallel_size=2, distributed_timeout_s=60))
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=ARBITRARY)
        drafts, real = [], eng.runner.propose

        def propose(proposer, requests, masks=None):
            out = real(proposer, requests, masks)
            drafts.extend(out)
            return out

        eng.runner.propose = propose
        ids = [eng.add_request(None, p, params) for p in PROMPTS]
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0].token_ids) for o in eng.step() if o.finished)
        assert [done[i] for i in ids] == _ids(base.generate(PROMPTS, params))
        assert drafts and all(set(d) <= set(ARBITRARY) for d in drafts)
        assert eng.runner.draft_checks > 0 and eng.runner.draft_mismatches == 0
    finally:
        eng.shutdown()


# ---- GPU only: CUDA graphs (chained verify steps, drafter graphs) --------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_masked_drafts_with_graphs_equal_eager_and_target_only():
    """A batch mixing masked and unmasked requests on the CUDA-graph engine: the masked ones are drafted
    by the masked drafter graphs (never from the chained drafts, never eagerly), the outputs equal the
    eager padded engine's and target-only decoding's."""
    kw = dict(max_num_seqs=8, max_num_batched_tokens=96, block_size=4, device="cuda", kv_cache_memory="1GiB",
              dtype="float32")
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [SamplingParams(allowed_token_ids=ARBITRARY, **greedy), SamplingParams(**greedy),
              SamplingParams(min_tokens=MAX_TOKENS - 8, stop_token_ids=[15, 17, 294], **greedy)]
    graphs = LLM(**kw)
    eager = LLM(enforce_eager=True, **kw)
    eager.engine.runner.decode_runner.pad_like_graph = True
    eager.engine.proposer.uniform.pad_like_graph = True
    base = LLM(speculative_config="off", **kw)
    graphs.generate(PROMPTS, params)  # captures the graphs
    uniform = graphs.engine.proposer.uniform
    assert graphs.engine.runner.decode_runner.captured and uniform.graphs and uniform.masked_graphs
    eager_forwards, real_forward = [], uniform._forward
    uniform._forward = lambda *args: eager_forwards.append(args) or real_forward(*args)
    seen = _record_drafts(graphs)
    a = graphs.generate(PROMPTS, params)
    assert not eager_forwards
    assert _ids(a) == _ids(eager.generate(PROMPTS, params)) == _ids(base.generate(PROMPTS, params))
    assert set(_ids(a)[0]) <= set(ARBITRARY)
    allowed = [d for sp, _, d in seen if sp.allowed_token_ids is not None]
    stopped = [(n, d) for sp, n, d in seen if sp.min_tokens and n < sp.min_tokens]
    assert allowed and all(set(d) <= set(ARBITRARY) for d in allowed)
    assert stopped and all(d[j] not in (15, 17, 294) for n, d in stopped for j in range(min(len(d), MAX_TOKENS - 8 - n)))
    assert a[0].metrics.mean_acceptance_length > 1.3 and a[1].metrics.mean_acceptance_length > 1.3
