"""Request outputs returned by the engine and the offline API (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    """Per-request timings (seconds since the epoch, ``time.time()``) and counters.

    ``mean_acceptance_length`` is tokens committed per target forward after the first token (decode steps,
    and the recompute prefill of a preempted request, which commits one): 1.0 without speculative decoding;
    bonus token included with it.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_decode_steps: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def mean_acceptance_length(self) -> float:
        if self.num_decode_steps == 0:
            return 1.0
        # The first token comes from prefill; the rest from decode steps.
        return max(self.num_generation_tokens - 1, 0) / self.num_decode_steps


@dataclass
class Logprob:
    """Log-probability (natural log, fp32) of one token, with its rank and decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence.

    ``logprobs``: per generated token a dict token_id -> Logprob (the sampled token plus the
    top-N), or None when logprobs were not requested.
    ``finish_reason``: None while running, then "stop" or "length" (or "abort").
    ``stop_reason``: the stop string or stop token id that ended it, if any.
    ``cumulative_logprob``: the sum of the generated tokens' logprobs (natural log, of the raw model
        distribution), or None when logprobs were not requested (vLLM's convention).
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Output of one request: prompt, generated sequences (one), whether finished, metrics.

    ``prompt_token_ids`` is the engine's own list of the request's prompt ids, shared by every output of the
    request (as in vLLM; copying it per streamed step was O(prompt) host work): read it, do not mutate it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
