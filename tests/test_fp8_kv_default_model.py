"""FP8 KV cache and chunked-context prefill on the embedded default model (trained Kimi-K3
architecture): validation perplexity, greedy agreement with the bf16 cache, pass-key retrieval at
2048 tokens with a tiny context workspace and prefix-cache hits. Skipped only while the default
model has not landed (no ``longflash/default_model/config.json``)."""

import math
import os

import pytest
import torch

from longflash import LLM, SamplingParams

MODEL_DIR = os.path.join(os.path.dirname(__file__), "..", "longflash", "default_model")
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(MODEL_DIR, "config.json")),
                                reason="the default model has not landed yet")


@pytest.fixture(scope="module")
def engines():
    kw = dict(dtype="float32", block_size=16, num_gpu_blocks=1024, max_num_batched_tokens=512)
    bf = LLM(MODEL_DIR, kv_cache_dtype="bfloat16", **kw)
    f8 = LLM(MODEL_DIR, kv_cache_dtype="fp8", context_workspace_rows=128, **kw)
    return bf, f8


@pytest.fixture(scope="module")
def code_val(engines):
    """Token stream of the held-out stdlib files (the model card's code validation split)."""
    from longflash.training.data import load_code
    tok = engines[0].engine.tokenizer
    _, val = load_code()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = []
    for doc in val[:6]:
        ids += tok.encode(doc, add_special_tokens=False) + [eos]
    return ids, eos


def _nll(engine, ids, eos):
    # 128-token prefill chunks: 3/4 of the positions attend to context read back from the cache.
    logits = engine.score(ids[:-1], chunk_size=128)
    tgt = torch.tensor(ids[1:])
    ce = torch.nn.functional.cross_entropy(logits, tgt, reduction="none")
    keep = tgt != eos
    return float(ce[keep].mean())


def test_fp8_validation_perplexity_within_2_percent(engines, code_val):
    ids, eos = code_val
    bf, f8 = engines
    rows = [ids[i * 512:(i + 1) * 512 + 1] for i in range(4)]
    nll_bf = sum(_nll(bf.engine, r, eos) for r in rows) / len(rows)
    nll_f8 = sum(_nll(f8.engine, r, eos) for r in rows) / len(rows)
    ppl_bf, ppl_f8 = math.exp(nll_bf), math.exp(nll_f8)
    print(f"code-val ppl over {len(rows)}x512 tokens: bf16 cache {ppl_bf:.4f}, fp8 cache {ppl_f8:.4f} "
          f"({(ppl_f8 / ppl_bf - 1) * 100:+.3f}%)")
    assert nll_bf < 4.0  # the trained model, not noise (model card: 2.90 nats/token at 2048-token rows)
    assert ppl_f8 <= 1.02 * ppl_bf


def _logprobs_close(a, b) -> bool:
    """vLLM's ``check_logprobs_close`` (tests/models/utils.py), the criterion of its fp8 KV-cache tests
    (fp8 vs auto cache): two greedy outputs match when their tokens are equal up to the first position
    where they differ, and there each one's token is among the other's top-N logprobs (after which the
    continuations are conditioned on different text and are not compared)."""
    for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
        if ta != tb:
            return ta in lb and tb in la
    return True


def test_fp8_greedy_64_tokens_agree_with_bf16(engines, code_val):
    """Greedy 64 tokens from 20 held-out code prompts, fp8 cache vs bf16 cache: the outputs match (vLLM's
    ``check_logprobs_close`` with its fp8-KV tests' 8 logprobs) on >= 90% of the prompts.

    "Match" is vLLM's criterion for exactly this comparison, not whole-sequence equality: on this
    14M-parameter model whole-sequence equality measures near-ties, not the cache (a bf16 cache against
    an fp32 cache already matches only 15/20, fp8 against bf16 5/20; the first divergence follows a
    near-tied step, after which the continuations differ). Also asserted: along the bf16 cache's greedy
    continuation, the fp8 engine (context read back from its cache in 8-token chunks) picks the same
    next token at >= 90% of the 20 x 64 positions (measured 99.3%; bf16 itself 99.5%) and at >= 80% of
    each prompt's. The whole-sequence match count is printed.
    """
    ids, _ = code_val
    bf, f8 = engines
    prompts = [ids[3000 + i * 997:3000 + i * 997 + 40] for i in range(20)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=8)
    outs = [[o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
            for llm in (bf, f8)]
    same = sum(a.token_ids == b.token_ids for a, b in zip(*outs))
    close = sum(_logprobs_close(a, b) for a, b in zip(*outs))
    agree = []
    for p, cont in zip(prompts, (o.token_ids for o in outs[0])):
        seq = p + cont
        pred = f8.engine.score(seq, chunk_size=8)[len(p) - 1:len(seq) - 1].argmax(-1).tolist()
        agree.append(sum(a == b for a, b in zip(pred, cont)) / len(cont))
    mean = sum(agree) / len(agree)
    print(f"greedy 64 tokens, fp8 vs bf16 cache: logprobs-close (vLLM, top-8) {close}/20, whole-sequence "
          f"equal {same}/20; per-token agreement along the bf16 continuation {mean:.4f} (min {min(agree):.3f})")
    assert close >= 18
    assert mean >= 0.90 and min(agree) >= 0.80


def test_fp8_passkey_2048_tiny_workspace_prefix_hits():
    from longflash.training.data import make_passkey_prompt, passkey_answer_matches
    llm = LLM(MODEL_DIR, dtype="float32", block_size=16, num_gpu_blocks=1024, max_num_batched_tokens=512,
              kv_cache_dtype="fp8", calculate_kv_scales=True, context_workspace_rows=64)
    tok = llm.engine.tokenizer
    trials = [make_passkey_prompt(tok, 2048, seed) for seed in range(10)]
    params = SamplingParams(temperature=0, max_tokens=8)
    # All prompts share the intro (and often filler) prefix: later requests hit the prefix cache.
    outs = llm.generate([p for p, _ in trials], params)
    ok = sum(passkey_answer_matches(o.outputs[0].text, key) for o, (_, key) in zip(outs, trials))
    print(f"passkey@2048, fp8 cache, W=64, prefix hits {llm.engine.block_manager.prefix_cache_hits}: {ok}/10")
    assert llm.engine.block_manager.prefix_cache_hits > 0
    assert all(len(tok.encode(p, add_special_tokens=False)) > 1900 for p, _ in trials)
    assert ok >= 9
