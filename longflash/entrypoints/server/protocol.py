"""Request models (pydantic, strict types) and response builders in the OpenAI shapes.

Unknown request fields are ignored (as vLLM does); a wrong type is a 400 naming the field. OpenAI fields
and vLLM fields that would change the output but are not implemented (``response_format`` other than
text, ``tools`` / ``functions``, ``suffix``, ``prompt_logprobs``, ``bad_words``, the ``guided_*`` fields and
``structured_outputs``, ``reasoning_effort``, ``modalities`` other than ``["text"]``, ``use_beam_search``,
``length_penalty``, ``logits_processors``, ``return_tokens_as_token_ids``, ``spaces_between_special_tokens``
false, chat ``documents``) are a 400 naming
the field (code ``unsupported_field``), never silently ignored.
Responses are plain dicts built by the functions below (the OpenAI JSON shapes).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from longflash.entrypoints.chat_utils import ROLES, content_text


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# vLLM's structured-output (guided decoding) fields
_STRUCTURED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                      "guided_whitespace_pattern", "structured_outputs")


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat (OpenAI's plus vLLM's extra sampling fields)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None  # rejected unless equal to n (vLLM V1 dropped it)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> bias in [-100, 100]
    user: str | None = None
    # vLLM's extras (SamplingParams): the stop string kept in the text; left truncation of the prompt
    # (k >= 1 or -1); only these token ids can be sampled
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        """A 400 for OpenAI fields whose effect this server does not implement (a request that sets
        them would otherwise get an answer that silently ignores them)."""
        if isinstance(data, dict):
            rf = data.get("response_format")
            unsupported = {
                "response_format": rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"),
                "tools": bool(data.get("tools")),
                "functions": bool(data.get("functions")),
                "tool_choice": data.get("tool_choice") not in (None, "none"),
                "suffix": bool(data.get("suffix")),
                "prompt_logprobs": data.get("prompt_logprobs") is not None,
                # vLLM's fields that constrain or change the output, not implemented here
                "bad_words": bool(data.get("bad_words")),
                **{name: data.get(name) is not None for name in _STRUCTURED_FIELDS},
                "reasoning_effort": data.get("reasoning_effort") is not None,
                "modalities": data.get("modalities") not in (None, [], ["text"]),
                "use_beam_search": bool(data.get("use_beam_search")),
                "length_penalty": data.get("length_penalty") not in (None, 1, 1.0),
                "logits_processors": bool(data.get("logits_processors")),
                "return_tokens_as_token_ids": bool(data.get("return_tokens_as_token_ids")),
                "spaces_between_special_tokens": data.get("spaces_between_special_tokens") is False,
                "documents": bool(data.get("documents")),
            }
            for name, bad in unsupported.items():
                if bad:
                    raise ValueError(f"{name} is not supported by this server")
        return data


class CompletionRequest(_SamplingRequest):
    """``prompt``: a string, a list of token ids, or a batch of one of either. ``add_special_tokens``
    (vLLM's, default true): text prompts get the tokenizer's special tokens (a BOS for DeepSeek/Llama)."""
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True


class _ChatTemplateFields(_Strict):
    """The chat template options of a chat or tokenize request (vLLM's): ``continue_final_message`` leaves
    the last (assistant) message open for the model to continue; ``chat_template`` replaces the
    tokenizer's (needs --trust-request-chat-template); ``chat_template_kwargs`` go to the template, over
    the two flags. Checked by ``chat_request.template_options``."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal[ROLES]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        """Name a content part this text-only server cannot take (e.g. ``image_url``) or a malformed text
        part, instead of pydantic's union errors ("Input should be a valid string")."""
        if isinstance(v, list):
            content_text(v)  # raises ValueError naming the bad part
        return v


class ChatCompletionRequest(_SamplingRequest, _ChatTemplateFields):
    """``messages`` is required and non-empty: checked by ``chat_request.check_messages``, the check of
    ``/tokenize`` too (one error for both routes). ``add_special_tokens`` (vLLM's, default false: the
    template writes the special tokens) adds the tokenizer's on top of the rendered prompt."""
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(_ChatTemplateFields):
    """``prompt`` (text) or ``messages``: the latter rendered exactly as a chat request with the same
    template fields and ``add_special_tokens`` renders it (``chat_request.py``). ``add_special_tokens``
    left out is vLLM's default for each form: true for a text prompt (encoded as ``/v1/completions``
    encodes it), false for messages (the template writes the special tokens)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_tools(cls, data: Any) -> Any:
        """``tools`` would change the rendered prompt (a chat request refuses it too)."""
        if isinstance(data, dict):
            for name in ("tools", "functions"):
                if data.get(name):
                    raise ValueError(f"{name} is not supported by this server")
        return data


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---- errors ---------------------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
                500: "server_error", 503: "server_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API returns it."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


# ---- responses ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(token_ids: list[int], logprobs: list[dict], text_offset0: int,
                        decode) -> dict:
    """Legacy completions ``logprobs`` object for the given tokens: tokens, token_logprobs,
    top_logprobs (dicts token -> logprob, the sampled token included), text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset0
    for tid, lp in zip(token_ids, logprobs):
        sampled = lp.get(tid)
        tok = sampled.decoded_token if sampled is not None and sampled.decoded_token is not None else decode(tid)
        tokens.append(tok)
        token_lps.append(sampled.logprob if sampled is not None else None)
        top: dict[str, float] = {}
        # Distinct ids can decode to the same string (e.g. partial UTF-8 -> U+FFFD): keep the likeliest.
        for k, v in sorted(lp.items(), key=lambda kv: -kv[1].logprob):
            top.setdefault(v.decoded_token if v.decoded_token is not None else decode(k), v.logprob)
        tops.append(top)
        offsets.append(off)
        off += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: list[dict], top_n: int, decode) -> dict:
    """Chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    content = []
    for tid, lp in zip(token_ids, logprobs):
        def entry(k, v):
            tok = v.decoded_token if v.decoded_token is not None else decode(k)
            return {"token": tok, "logprob": v.logprob, "bytes": list(tok.encode("utf-8"))}
        sampled = lp.get(tid)
        item = entry(tid, sampled) if sampled is not None else {"token": decode(tid), "logprob": None, "bytes": None}
        ranked = sorted(((k, v) for k, v in lp.items()), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))
        item["top_logprobs"] = [entry(k, v) for k, v in ranked if v.rank is None or v.rank <= top_n][:top_n]
        content.append(item)
    return {"content": content}


def now() -> int:
    return int(time.time())
