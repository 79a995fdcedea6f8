"""Per-request sampling settings, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


class _DefaultMaxTokens(int):
    """The default ``max_tokens`` (16, vLLM's), marked as not chosen by the caller: the engine caps it at
    the room left in the context (``LLMEngine.max_output_tokens``) where an explicit value is refused.
    An ``int`` in every other way, so code that reads ``max_tokens`` sees 16."""


DEFAULT_MAX_TOKENS = _DefaultMaxTokens(16)


def default_max_tokens(n: int) -> int:
    """``n`` as a *default* ``max_tokens`` (e.g. a CLI's own default): capped at the room left in the
    context like the left-out 16, where an explicit value that does not fit is refused."""
    return _DefaultMaxTokens(n)


class RequestOutputKind(enum.IntEnum):
    """What ``LLMEngine.step`` returns for a request (vLLM's ``RequestOutputKind``): CUMULATIVE = after every
    step that produced tokens, the text and token ids so far (the default; the server streams from it);
    FINAL_ONLY = only when the request finishes (offline ``LLM.generate`` / ``LLM.chat``: a long output is
    then not copied at every step). vLLM's DELTA is not implemented (``validate`` refuses it)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request's output tokens.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        min_p: drop tokens whose probability is below min_p times the top probability; 0 disables it.
        seed: per-request RNG seed; the same seed gives the same tokens.
        max_tokens: maximum number of generated tokens (>= 1); None = the rest of the context
            (``max_model_len`` - prompt length, as vLLM). Left out: 16, capped at the rest of the context
            (a prompt that leaves fewer than 16 tokens is not refused); an explicit value that does not fit
            in the context with the prompt is refused by the engine.
        stop: strings that end generation; the matched string is not part of the output text.
        stop_token_ids: token ids that end generation (kept in the token ids, not in the text, as in vLLM V1).
        ignore_eos: keep generating past the EOS token.
        logprobs: None = none; N >= 0 = the sampled token's logprob plus the top N.
        skip_special_tokens: drop special tokens when detokenizing.
        n: number of completions of the prompt (>= 1); ``LLM.generate`` and the server run them as
            n requests with seeds seed, seed + 1, ... (when a seed is given), as vLLM does.
        presence_penalty: in [-2, 2]; subtracted from the logit of every token that occurs in the
            output so far (0 disables it).
        frequency_penalty: in [-2, 2]; subtracted once per occurrence in the output so far (0
            disables it).
        repetition_penalty: > 0; logits of tokens in the prompt or the output so far are divided by
            it when positive and multiplied by it otherwise (1 disables it).
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this many output tokens
            exist (stop strings still apply); 0 <= min_tokens <= max_tokens.
        logit_bias: token id -> bias in [-100, 100] added to that token's logit before sampling (after
            the min_tokens mask, before the penalties, as vLLM's V1 sampler; OpenAI's ``logit_bias``).
        include_stop_str_in_output: keep the matched stop string at the end of the output text (vLLM's).
        truncate_prompt_tokens: None (no truncation), k >= 1 (only the last k prompt tokens are used: left
            truncation, vLLM's), or -1 (the last ``max_model_len`` tokens, vLLM's "-1 = the model's
            limit"); the engine refuses k > ``max_model_len``.
        allowed_token_ids: None, or a non-empty list of token ids: only these can be sampled (the other
            logits are -inf before everything else, as vLLM's allowed-token-ids mask); the engine refuses
            an id outside the vocabulary.
        output_kind: :class:`RequestOutputKind`, CUMULATIVE (default) or FINAL_ONLY.
    The penalties follow vLLM's ``SamplingParams`` (and OpenAI's API for presence/frequency); the
    sampler applies them in vLLM's order (``runner/sampler.py``).
    Raises:
        ValueError from ``validate()`` naming the offending field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.validate()

    @property
    def max_tokens_is_default(self) -> bool:
        """True when ``max_tokens`` was left out (the default 16, capped at the room in the context)."""
        return isinstance(self.max_tokens, _DefaultMaxTokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any of presence/frequency/repetition penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        if self.output_kind not in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            raise ValueError(f"output_kind must be RequestOutputKind.CUMULATIVE or FINAL_ONLY, got {self.output_kind!r} "
                             "(DELTA is not supported)")
        for name in ("temperature", "top_p", "min_p"):
            if not _is_real(getattr(self, name)):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        for name in ("top_k", "max_tokens"):
            if not _is_int(getattr(self, name)) and not (name == "max_tokens" and self.max_tokens is None):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.logprobs is not None and not _is_int(self.logprobs):
            raise ValueError(f"logprobs must be an integer or None, got {self.logprobs!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < _GREEDY_EPS:
            # vLLM's convention: temperatures this small sample the argmax (dividing by them overflows).
            self.temperature = 0.0
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:  # NaN fails the range
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not _is_real(rp) or not (math.isfinite(rp) and rp > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {rp!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict token id -> bias, got {self.logit_bias!r}")
            for t, b in self.logit_bias.items():
                if not _is_int(t) or t < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {t!r}")
                if not _is_real(b) or not -100.0 <= b <= 100.0:  # NaN fails the range
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for token {t}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k >= 1 or k == -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 (keep the last k prompt tokens) or -1 "
                             f"(the model's max_model_len), got {k!r}")
        if self.allowed_token_ids is not None:
            a = self.allowed_token_ids
            if not isinstance(a, list) or not a or not all(_is_int(t) and t >= 0 for t in a):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), got {a!r}")


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
