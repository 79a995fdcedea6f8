"""Helpers shared by the engine-level tests (tensor/decode-context parallel, DFlash under DCP)."""

from __future__ import annotations

from longflash.sampling_params import SamplingParams


def greedy_outputs(engine, prompts: list, max_tokens: int) -> list:
    """Run ``prompts`` (text, token ids or ``{"prompt_token_ids": ...}``) to ``max_tokens`` greedy
    tokens each (ignore_eos) on an ``LLMEngine``; returns the finished ``RequestOutput`` of each
    prompt, in prompt order."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def greedy_tokens(engine, prompts: list, max_tokens: int) -> list[list[int]]:
    """``greedy_outputs``' generated token ids per prompt."""
    return [o.outputs[0].token_ids for o in greedy_outputs(engine, prompts, max_tokens)]
