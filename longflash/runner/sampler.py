"""Token sampling from logits: min_tokens, penalties, greedy, temperature, top-k, top-p, min-p,
per-request seeds, logprobs.

Order follows vLLM's V1 sampler: the min_tokens mask, then the repetition, frequency and presence
penalties (``process_logits``), then greedy argmax or temperature, top-k, top-p, min-p; logprobs are
those of the raw model distribution (``log_softmax`` of the unmodified logits, vLLM's default).
"""

from __future__ import annotations

import torch

from longflash.outputs import Logprob
from longflash.sampling_params import SamplingParams


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Every row's argmax, ``torch.argmax(logits, dim=-1)`` ([B, V] -> [B] int64; the first index of the
    maximum, a NaN counting as the maximum): on CUDA for a [B, V] fp32/fp16/bf16 tensor with a contiguous last
    dim the two-launch Triton kernel (``argmax_triton``: PyTorch reads a row with one SM, 28 µs at batch 1 for a
    129,280-token vocabulary on an H200), else ``torch.argmax``."""
    if logits.is_cuda and logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1 \
            and logits.dtype in (torch.float32, torch.float16, torch.bfloat16):
        from longflash.runner.argmax_triton import argmax_triton
        return argmax_triton(logits)
    return torch.argmax(logits, dim=-1)


def needs_logits_processing(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when ``process_logits`` changes this request's logits at its next position: a penalty is
    set, or fewer than ``min_tokens`` output tokens exist. False keeps the plain (free) path."""
    return (params.has_penalties or num_output_tokens < params.min_tokens or bool(params.logit_bias)
            or params.allowed_token_ids is not None)


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_token_ids: list[int],
                   output_token_ids: list[int], draft_token_ids: list[int], eos_token_ids: set[int]) -> torch.Tensor:
    """The allowed-token-ids mask, the min_tokens mask, the logit bias and the penalties for the rows of
    one request's verify step (vLLM V1's order: ``allowed_token_ids`` first).

    Row k scores the position after ``output_token_ids + draft_token_ids[:k]``: under speculative
    decoding the target reaches row k only when drafts 1..k were accepted, so they count as output
    tokens there (and toward min_tokens) although they are not appended to the sequence yet.

    Args:
        logits: [R, V] fp32, R = len(draft_token_ids) + 1 (or fewer rows: only the first R are used).
        params: the request's SamplingParams.
        prompt_token_ids, output_token_ids: the sequence's token ids so far (ints in [0, V)).
        draft_token_ids: the drafts verified by this step (>= R - 1 of them).
        eos_token_ids: the model's EOS ids; masked with ``stop_token_ids`` before min_tokens (as vLLM
            does, also with ignore_eos).
    Returns:
        [R, V] fp32, a new tensor (``logits`` is not modified).
    Raises:
        ValueError if logits is not 2-D or fewer than R - 1 drafts are given.
    Semantics: vLLM's ``MinTokensLogitsProcessor`` and ``apply_penalties`` (repetition over prompt
    and output tokens: positive logits / penalty, others * penalty; then
    logits -= frequency * count + presence * [count > 0] over output tokens).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if len(draft_token_ids) < rows - 1:
        raise ValueError(f"{rows} rows need {rows - 1} draft tokens, got {len(draft_token_ids)}")
    logits = logits.to(torch.float32, copy=True)
    if params.allowed_token_ids is not None:
        apply_allowed_token_ids(logits, params.allowed_token_ids)
    if params.min_tokens:
        apply_min_tokens(logits, len(output_token_ids), params.min_tokens,
                         set(eos_token_ids) | set(params.stop_token_ids))
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < vocab]
        if ids:
            bias = torch.tensor([float(params.logit_bias[t]) for t in ids], dtype=torch.float32, device=logits.device)
            logits[:, ids] += bias
    if params.has_penalties:
        counts = output_token_counts(output_token_ids, draft_token_ids[:rows - 1], rows, vocab, logits.device)
        apply_penalties(logits, prompt_token_ids, counts, params.repetition_penalty, params.frequency_penalty,
                        params.presence_penalty)
    return logits


def apply_allowed_token_ids(logits: torch.Tensor, allowed_token_ids: list[int]) -> None:
    """In place: -inf in every column of logits [R, V] but ``allowed_token_ids`` (vLLM's
    ``allowed_token_ids``: only they can be sampled). Ids outside [0, V) are ignored (the engine refuses
    them at add_request)."""
    masked = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
    ids = [t for t in allowed_token_ids if 0 <= t < logits.shape[1]]
    masked[torch.tensor(ids, dtype=torch.long, device=logits.device)] = False
    logits.masked_fill_(masked, float("-inf"))  # a mask, not boolean indexing: no device -> host sync


def apply_min_tokens(logits: torch.Tensor, num_output_tokens: int, min_tokens: int, stop_ids: set[int]) -> None:
    """In place: -inf at ``stop_ids`` in row k of logits [R, V] while ``num_output_tokens + k`` <
    ``min_tokens``. Ids outside [0, V) are ignored (they cannot be sampled)."""
    masked_rows = min(max(min_tokens - num_output_tokens, 0), logits.shape[0])
    ids = [t for t in stop_ids if 0 <= t < logits.shape[1]]
    if masked_rows and ids:
        logits[:masked_rows, ids] = float("-inf")


def output_token_counts(output_token_ids: list[int], draft_token_ids: list[int], rows: int, vocab: int,
                        device: torch.device) -> torch.Tensor:
    """[rows, vocab] fp32: row k counts ``output_token_ids + draft_token_ids[:k]`` per token id.

    NOTE: rebuilt from the token ids at every step (one host -> device copy of the output ids);
    only requests with a penalty pay it.
    """
    counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
    if output_token_ids:
        ids = torch.tensor(output_token_ids, dtype=torch.long, device=device)
        counts += torch.bincount(ids, minlength=vocab)[:vocab].float()
    if rows > 1:
        step = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        drafts = torch.tensor(draft_token_ids[:rows - 1], dtype=torch.long, device=device)
        step[torch.arange(1, rows, device=device), drafts] = 1.0
        counts += step.cumsum(dim=0)
    return counts


def apply_penalties(logits: torch.Tensor, prompt_token_ids: list[int], output_counts: torch.Tensor,
                    repetition_penalty: float, frequency_penalty: float, presence_penalty: float) -> None:
    """In place on logits [R, V] fp32, with ``output_counts`` [R, V] (``output_token_counts``).

    Repetition (if != 1) over tokens in the prompt or the row's output: positive logits are divided
    by it, the others multiplied; then ``logits -= frequency * count + presence * [count > 0]``
    (vLLM's ``apply_penalties``, OpenAI's presence/frequency penalty formula).
    """
    seen_out = output_counts > 0
    if repetition_penalty != 1.0:
        seen = seen_out.clone()
        if prompt_token_ids:
            ids = torch.tensor(prompt_token_ids, dtype=torch.long, device=logits.device)
            seen[:, ids] = True
        pen = torch.ones_like(logits).masked_fill_(seen, repetition_penalty)
        logits.copy_(torch.where(logits > 0, logits / pen, logits * pen))
    if frequency_penalty != 0.0:
        logits -= frequency_penalty * output_counts
    if presence_penalty != 0.0:
        logits -= presence_penalty * seen_out.to(logits.dtype)


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
