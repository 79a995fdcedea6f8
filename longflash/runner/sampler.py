"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Order of the filters follows vLLM: temperature, then top-k, then top-p, then min-p; logprobs are
those of the raw model distribution (``log_softmax`` of the unmodified logits, vLLM's default).
"""

from __future__ import annotations

import torch

from longflash.outputs import Logprob
from longflash.sampling_params import SamplingParams


def apply_sampling_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] fp32 -> probabilities [V] fp32 after temperature/top-k/top-p/min-p."""
    logits = logits / params.temperature
    if params.top_k and params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        remove = (cum - sorted_probs) > params.top_p  # keep the smallest set whose mass reaches top_p
        sorted_probs = sorted_probs.masked_fill(remove, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_probs)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Sample one token id from logits [V] (fp32)."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = apply_sampling_filters(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def compute_logprobs(logits: torch.Tensor, token_id: int, num_top: int, decode=None) -> dict[int, Logprob]:
    """The sampled token's logprob and the top ``num_top`` (rank 1 = most likely)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = float(logp[token_id])
    rank = int((logp > logp[token_id]).sum()) + 1
    out = {token_id: Logprob(chosen, rank, decode(token_id) if decode else None)}
    if num_top > 0:
        vals, ids = torch.topk(logp, min(num_top, logp.shape[-1]))
        for r, (v, i) in enumerate(zip(vals.tolist(), ids.tolist()), start=1):
            if i not in out:
                out[i] = Logprob(v, r, decode(i) if decode else None)
    return out
