"""Repetition/presence/frequency penalties and min_tokens (vLLM's semantics): the sampler against
hand-computed values, validation, and the engine with and without DFlash speculative decoding."""

from __future__ import annotations

import math

import pytest
import torch

from longflash import LLM, SamplingParams
from longflash.runner.sampler import process_logits

# ---- the sampler against hand-computed values -----------------------------------------------------


def _reference(logits: list[list[float]], prompt: list[int], output: list[int], drafts: list[int],
               rep: float, freq: float, pres: float, min_tokens: int, stop_ids: set[int]) -> list[list[float]]:
    """Element by element, in plain Python: row k sees output + drafts[:k]."""
    out = []
    for k, row in enumerate(logits):
        seen_out = output + drafts[:k]
        new = []
        for t, x in enumerate(row):
            if len(seen_out) < min_tokens and t in stop_ids:
                x = -math.inf
            if t in prompt or t in seen_out:
                x = x / rep if x > 0 else x * rep
            x -= freq * seen_out.count(t) + pres * (t in seen_out)
            new.append(x)
        out.append(new)
    return out


def test_penalties_hand_computed_small():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = process_logits(logits, params, prompt_token_ids=[1], output_token_ids=[2, 2, 3], draft_token_ids=[],
                         eos_token_ids=set())
    # token 0: unseen -> 2.0; 1: prompt only -> -1*2 = -2; 2: twice in output -> 0.5/2 - 0.5*2 - 0.25 = -1.0;
    # 3: once -> -0.5*2 - 0.5 - 0.25 = -1.75; 4, 5 unseen.
    assert got.tolist() == [[2.0, -2.0, -1.0, -1.75, 3.0, 0.0]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]]  # not modified in place


def test_penalties_per_verify_row_count_the_drafts_before_it():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=g) * 3
    prompt, output, drafts = [1, 7, 7], [2, 3, 2], [3, 9, 2]
    params = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4, min_tokens=5,
                            stop_token_ids=[9], max_tokens=20)
    got = process_logits(logits, params, prompt, output, drafts, eos_token_ids={0})
    ref = _reference(logits.tolist(), prompt, output, drafts, 1.7, 0.6, -0.4, 5, {0, 9})
    torch.testing.assert_close(got, torch.tensor(ref), rtol=1e-6, atol=1e-6)
    # min_tokens: rows 0 and 1 (3 and 4 outputs) mask EOS 0 and stop id 9; rows 2 and 3 do not.
    assert torch.isinf(got[:2, [0, 9]]).all() and torch.isfinite(got[2:]).all()


def test_penalties_off_and_bad_shapes():
    logits = torch.randn(2, 5)
    same = process_logits(logits, SamplingParams(), [1, 2], [3], [4], eos_token_ids={0})
    assert torch.equal(same, logits)
    with pytest.raises(ValueError, match="rows, vocab"):
        process_logits(logits[0], SamplingParams(), [1], [], [], set())
    with pytest.raises(ValueError, match="draft tokens"):
        process_logits(logits, SamplingParams(), [1], [], [], set())


@pytest.mark.parametrize("kw,field", [
    (dict(n=0), "n"), (dict(n=1.5), "n"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=17, max_tokens=16), "min_tokens"),
])
def test_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kw)


# ---- the engine: the default model, with and without its drafter ---------------------------------
PROMPTS = ["def fibonacci(n):", "To be, or not to be, that is the question:", "class Stack:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def default_pair():
    kw = dict(max_num_seqs=8, max_num_batched_tokens=96, block_size=4)
    base, spec = LLM(speculative_config="off", **kw), LLM(**kw)
    assert base.engine.proposer is None and spec.engine.proposer is not None
    return base, spec


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.5), dict(presence_penalty=1.0, frequency_penalty=0.5),
                                dict(repetition_penalty=0.8, frequency_penalty=-0.5)])
def test_greedy_penalties_speculative_equals_reference(default_pair, kw):
    base, spec = default_pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **kw)
    plain = _ids(base.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    ref = _ids(base.generate(PROMPTS, params))
    outs = spec.generate(PROMPTS, params)
    assert _ids(outs) == ref
    assert ref != plain
    assert max(o.metrics.mean_acceptance_length for o in outs) > 1.0  # drafts were accepted
    # The target-only run is itself the penalized argmax of teacher-forced logits, step by step.
    eng = base.engine
    for p, out in zip(PROMPTS, ref):
        prompt = eng.tokenize(p)
        logits = eng.score(prompt + out[:-1])[len(prompt) - 1:]
        for j, t in enumerate(out):
            row = process_logits(logits[j:j + 1], params, prompt, out[:j], [], eng.eos_token_ids)[0]
            assert int(row.argmax()) == t


def test_seeded_sampling_with_penalties_speculative_equals_target_only(default_pair):
    base, spec = default_pair
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.5) for i in range(3)]
    assert _ids(spec.generate(PROMPTS, params)) == _ids(base.generate(PROMPTS, params))


def test_min_tokens_masks_stop_token_ids(default_pair):
    base, spec = default_pair
    prompt = PROMPTS[1]
    first = base.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop = first.token_ids[2]  # the model emits it as its third token
    assert stop not in first.token_ids[:2]
    early = base.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))[0].outputs[0]
    assert early.token_ids == first.token_ids[:3] and early.stop_reason == stop
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop], min_tokens=8)
    outs = [llm.generate(prompt, params)[0].outputs[0] for llm in (base, spec)]
    assert outs[0].token_ids == outs[1].token_ids
    assert len(outs[0].token_ids) >= 8 and stop not in outs[0].token_ids[:8]


def test_penalties_on_chained_uniform_steps(default_pair):
    """Uniform (chained) verify steps read every row's plain argmax from the device and draft the next
    block assuming it; a request with penalties or min_tokens must still take its processed argmax."""
    base, _ = default_pair
    chained = LLM(max_num_seqs=8, max_num_batched_tokens=96, block_size=4)
    chained.engine.enable_uniform_decode(cuda_graphs=False)
    greedy = dict(temperature=0, max_tokens=40, ignore_eos=True)
    params = [SamplingParams(presence_penalty=1.0, **greedy), SamplingParams(**greedy),
              SamplingParams(min_tokens=30, stop_token_ids=[15], **greedy)]
    outs = chained.generate(PROMPTS, params)
    assert _ids(outs) == _ids(base.generate(PROMPTS, params))
    assert chained.engine.stats.spec_num_accepted_tokens > 0


# ---- GPU only: real vocabulary width, CUDA graphs ----------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
def test_gpu_process_logits_equals_cpu_at_kimi_vocab():
    g = torch.Generator().manual_seed(1)
    vocab, rows = 163840, 8
    logits = torch.randn(rows, vocab, generator=g) * 4
    prompt = torch.randint(0, vocab, (4096,), generator=g).tolist()
    output = torch.randint(0, vocab, (700,), generator=g).tolist()
    drafts = torch.randint(0, vocab, (rows - 1,), generator=g).tolist()
    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, min_tokens=703,
                            stop_token_ids=[5, 7], max_tokens=1000)
    cpu = process_logits(logits, params, prompt, output, drafts, {163585})
    dev = process_logits(logits.cuda(), params, prompt, output, drafts, {163585})
    torch.testing.assert_close(dev.cpu(), cpu, rtol=1e-6, atol=1e-6)
    assert torch.isinf(dev[:3, [5, 7, 163585]]).all() and torch.isfinite(dev[3:, [5, 7, 163585]]).all()


@gpu
def test_gpu_penalized_greedy_with_graphs_equals_eager_padded_engine():
    kw = dict(max_num_seqs=8, max_num_batched_tokens=96, block_size=4, device="cuda", kv_cache_memory="1GiB")
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, repetition_penalty=1.5,
                            frequency_penalty=0.3, min_tokens=10)
    graphs = LLM(**kw)
    eager = LLM(enforce_eager=True, **kw)
    eager.engine.runner.decode_runner.pad_like_graph = True
    eager.engine.proposer.uniform.pad_like_graph = True
    a = graphs.generate(PROMPTS, params)
    b = eager.generate(PROMPTS, params)
    assert _ids(a) == _ids(b)
    assert _ids(a) != _ids(graphs.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)))
    assert min(o.metrics.mean_acceptance_length for o in a) > 1.0
