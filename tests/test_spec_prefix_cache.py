"""Prefix caching with DFlash speculative decoding: a block completed by accepted drafts is hashed
with its real token ids (they are appended after the verify step, so hashing must wait for them),
and a follow-up turn hits every full block of the first turn's committed tokens.

Before the fix the engine hashed such a block while its last ids were still drafts: the block got a
short token tuple, its hash and every later one in the chain never matched again (lost hits).
"""

from __future__ import annotations

from longflash.config import EngineConfig
from longflash.default_model_path import default_model_path
from longflash.engine.llm_engine import LLMEngine
from longflash.sampling_params import SamplingParams

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
BLOCK = 4


def _generate(eng: LLMEngine, prompt, max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rid = eng.add_request(None, prompt, params)
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == rid and o.finished:
                out = o
    return out


def test_blocks_of_accepted_drafts_are_hashed_with_their_tokens():
    eng = LLMEngine(EngineConfig(model=default_model_path(), block_size=BLOCK, num_gpu_blocks=64,
                                 max_num_batched_tokens=64))
    first = _generate(eng, PROMPT, 16)
    assert first.metrics.mean_acceptance_length > 2.0  # several blocks are completed by accepted drafts
    ids = first.prompt_token_ids + first.outputs[0].token_ids
    hashed = [b for b in eng.block_manager.blocks if b.token_ids is not None and b.block_hash is not None]
    assert hashed and all(len(b.token_ids) == BLOCK for b in hashed)
    assert {b.token_ids for b in hashed} == {tuple(ids[i:i + BLOCK]) for i in range(0, len(ids) - BLOCK, BLOCK)}
    # Second turn = the whole first turn: every full block of its committed tokens (all but the last
    # token, whose KV is never computed) comes from the prefix cache.
    again = _generate(eng, {"prompt_token_ids": ids}, 4)
    assert again.num_cached_tokens == (len(ids) - 1) // BLOCK * BLOCK
