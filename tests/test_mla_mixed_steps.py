"""Mixed MLA steps (``MLAAttention._prefill`` / ``_decode``): every prefill request's new tokens in one
up-projection and one varlen attention call, and a step's decode requests in one decode call when they
lead the batch, give each request what it gets alone.

The scheduler lays a step out as [running decodes, running prefill chunk, new prefills], so the general
layouts (a decode between two prefills: rows that are not contiguous, decodes that do not lead) come only
from a hand-made ``SchedulerOutput``: the first test runs them through the model runner and compares each
request's logits with teacher-forced scoring of its tokens (``LLMEngine.score``). The second runs the
scheduler's own mixed steps (chunked prefill continuations, prefix-cache hits giving context to some
prefill requests of a step but not to others, one-token prompts, preemption and the recompute of
generated tokens as a multi-token decode) and compares every request's tokens with generating it alone.
"""

import random
from collections import Counter

import pytest

from longflash import LLM, SamplingParams
from longflash.attention import mla
from longflash.engine.scheduler import ScheduledSeq, SchedulerOutput
from longflash.engine.sequence import Sequence

VARIANT = "dsv3-qlora-interleave-yarn"
BASE = dict(skip_tokenizer_init=True, dtype="float32", block_size=4)


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model(VARIANT)


def _spy_layouts(monkeypatch) -> Counter:
    """Count the step layouts the MLA layers see: for the prefill requests, whether their rows are
    contiguous and whether some / all have cached context; for the decode requests, whether they lead the
    batch and whether one has several query tokens."""
    seen = Counter()
    prefill, decode = mla.MLAAttention._prefill, mla.MLAAttention._decode

    def spy_prefill(self, q_nope, q_pe, kv_c, k_pe, reqs, ctx, out, kernels):
        qsl, cl = ctx.query_start_loc_cpu, ctx.context_lens_cpu
        contiguous = all(qsl[a + 1] == qsl[b] for a, b in zip(reqs, reqs[1:]))
        with_ctx = sum(cl[b] > 0 for b in reqs)
        seen["prefill " + ("contiguous" if contiguous else "scattered")] += 1
        if 0 < with_ctx < len(reqs):
            seen["prefill some with context"] += 1
        return prefill(self, q_nope, q_pe, kv_c, k_pe, reqs, ctx, out, kernels)

    def spy_decode(self, q_nope, q_pe, reqs, ctx, *args):
        qsl = ctx.query_start_loc_cpu
        seen["decode " + ("leading" if reqs == list(range(len(reqs))) else "not leading")] += 1
        if any(qsl[b + 1] - qsl[b] > 1 for b in reqs) and len(reqs) > 1:
            seen["decode several, one multi-token"] += 1
        return decode(self, q_nope, q_pe, reqs, ctx, *args)

    monkeypatch.setattr(mla.MLAAttention, "_prefill", spy_prefill)
    monkeypatch.setattr(mla.MLAAttention, "_decode", spy_decode)
    return seen


def test_layouts_the_scheduler_does_not_make(path, monkeypatch):
    """Hand-made steps through the model runner: decodes between prefills (scattered prefill rows, decodes
    not leading), a chunked prefill continuation with context beside new prefills without any, a one-token
    prompt, a multi-token decode (a recompute past the prompt) beside one-token decodes. Each request's
    logits equal its tokens' teacher-forced logits (fp32: the observed difference is ~2e-6)."""
    llm = LLM(path, **BASE, num_gpu_blocks=256, enable_prefix_caching=False)
    eng = llm.engine
    rng = random.Random(0)
    seen = _spy_layouts(monkeypatch)

    def seq(name, n, num_prompt=None):
        ids = [rng.randrange(2, 256) for _ in range(n)]
        s = Sequence(name, ids[:num_prompt or n], SamplingParams(max_tokens=64))
        for t in ids[num_prompt or n:]:
            s.append_token(t)  # generated tokens: positions past the prompt run as decodes
        assert eng.block_manager.allocate_for_new(s, 0)
        return s

    def step(*items):
        for s, n in items:
            eng.block_manager.append_slots(s, n)
        res = eng.runner.execute(SchedulerOutput([ScheduledSeq(s, n) for s, n in items], []), all_logits=True)
        r, errs = 0, []
        for s, n in items:
            want = eng.score(s.token_ids[:s.num_computed_tokens + n])[s.num_computed_tokens:]
            errs.append((res.logits[r:r + n] - want).abs().max().item())
            r += n
            s.num_computed_tokens += n
        return errs

    a, b, c, d, e, f, g, h = (seq("a", 13), seq("b", 10, 7), seq("c", 6, 3), seq("d", 6), seq("e", 1),
                              seq("f", 9), seq("g", 4), seq("h", 11, 8))
    errs = step((a, 5), (b, 7), (c, 3), (h, 8))            # prefills only; a is chunked
    errs += step((b, 1), (a, 4), (c, 1), (d, 6))           # decode, prefill with context, decode, new prefill
    errs += step((e, 1), (b, 1), (f, 9))                   # prefill (one-token prompt), decode, prefill
    errs += step((h, 2), (b, 1), (c, 1), (g, 4), (a, 4))   # a 2-token decode leading one-token decodes
    assert max(errs) < 1e-4, errs
    for layout in ("prefill scattered", "prefill contiguous", "prefill some with context", "decode leading",
                   "decode not leading", "decode several, one multi-token"):
        assert seen[layout], (layout, seen)


def test_scheduler_mixed_steps_equal_each_request_alone(path, monkeypatch):
    """Chunked prefill (5-token budget) of prompts that share a prefix (prefix-cache hits for some of a
    step's prefill requests), one-token prompts, three slots and a 12-block pool (preemption: generated
    tokens recomputed as a multi-token decode beside other decodes): every request's greedy tokens equal
    generating it alone, and every block comes back."""
    rng = random.Random(3)
    shared = [rng.randrange(2, 256) for _ in range(9)]
    prompts = [[5, 6], [8, 9], shared + [7, 8], [rng.randrange(2, 256) for _ in range(13)], [42], shared + [9],
               [rng.randrange(2, 256) for _ in range(6)], shared, [17], shared + [3, 4, 5, 6], [10, 11]]
    max_tokens = [20, 30, 11, 6, 9, 12, 3, 8, 1, 10, 30]
    alone_llm = LLM(path, **BASE, num_gpu_blocks=64, enable_prefix_caching=False)
    alone = [alone_llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=n,
                                                                          ignore_eos=True))[0].outputs[0].token_ids
             for p, n in zip(prompts, max_tokens)]
    seen = _spy_layouts(monkeypatch)
    llm = LLM(path, **BASE, num_gpu_blocks=12, max_num_seqs=3, max_num_batched_tokens=5)
    eng = llm.engine
    ids = []
    for p, n in zip(prompts, max_tokens):
        ids.append(eng.add_request(None, {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=n,
                                                                                 ignore_eos=True)))
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids
    assert [final[i] for i in ids] == alone
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    assert eng.scheduler.num_preemptions > 0 and eng.block_manager.prefix_cache_hits > 0
    # the scheduler's layouts: prefill rows contiguous, decodes leading
    assert seen["prefill contiguous"] and seen["decode leading"] and seen["prefill some with context"], seen
    assert seen["decode several, one multi-token"], seen
    assert not seen["prefill scattered"] and not seen["decode not leading"], seen
