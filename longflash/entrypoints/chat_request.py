"""The chat template call of one chat request: its options checked, then the prompt rendered.

One path for the server's ``/v1/chat/completions`` and ``/tokenize`` (with ``messages``) and for
``LLM.chat``, so that they render the same prompt from the same options and refuse the same ones:

- :func:`template_options` merges ``chat_template_kwargs`` over ``add_generation_prompt`` /
  ``continue_final_message`` (vLLM's rule: the kwargs win), picks the template (a request's own, when
  trusted, else the server's/caller's default, else the tokenizer's) and raises
  :class:`ChatOptionError` (a ValueError carrying the request field it is about) for what vLLM refuses.
- :func:`check_messages` refuses a missing or empty ``messages`` list with one error (the same on every
  route, naming the ``messages`` field).
- :func:`render_chat` validates the messages (``chat_utils.normalize_messages``) and applies the
  template: the prompt text and its token ids (by default ``add_special_tokens=False``: the template
  writes them; vLLM's ``add_special_tokens`` field adds the tokenizer's on top).
"""
from __future__ import annotations

from typing import Any

from longflash.entrypoints.chat_utils import (check_chat_template, normalize_messages, resolve_content_format,
                                              template_error)

# chat_template_kwargs keys that the chat template call sets itself or that change what it returns
# (transformers' parameters of apply_chat_template): a request may not set them. add_generation_prompt and
# continue_final_message it may (bools); chat_template only when trusted; tools is refused like the field.
RESERVED_TEMPLATE_KWARGS = ("conversation", "conversations", "messages", "tokenize", "return_dict", "return_tensors",
                            "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs")


class ChatOptionError(ValueError):
    """A chat request field that is refused; ``param`` is the request field (e.g.
    ``chat_template_kwargs.tokenize``), ``code`` the OpenAI error code when it is not ``invalid_value``
    (None)."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


EMPTY_MESSAGES = "messages must be a non-empty list of {'role': ..., 'content': ...} messages"


def check_messages(messages) -> None:
    """Refuse a chat request's ``messages`` when it is missing (None) or not a non-empty list: one
    message and ``param`` for every route (code ``missing_required_parameter`` for None). The messages
    themselves are checked by ``chat_utils.normalize_messages``. Raises ChatOptionError."""
    if messages is None:
        raise ChatOptionError(EMPTY_MESSAGES, "messages", "missing_required_parameter")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatOptionError(EMPTY_MESSAGES, "messages")


def template_options(add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None,
                     default_template: str | None = None, trusted: bool = True) -> tuple[bool, dict]:
    """``(add_generation_prompt, kwargs of apply_chat_template)`` of a chat request.

    ``chat_template_kwargs`` (a dict or None) is merged over ``add_generation_prompt`` /
    ``continue_final_message`` (vLLM). The template is ``chat_template`` (a request's own; refused unless
    ``trusted``, the server's ``--trust-request-chat-template``), else one set in ``chat_template_kwargs``
    (same rule), else ``default_template`` (the server's ``--chat-template``; None: the tokenizer's).
    Raises ChatOptionError naming the field for: a non-dict ``chat_template_kwargs``; a key in
    ``RESERVED_TEMPLATE_KWARGS``; ``tools`` (tool calling is not supported); a non-bool
    ``add_generation_prompt`` / ``continue_final_message``; both of them true; an untrusted or unparsable
    template.
    """
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ChatOptionError("chat_template_kwargs must be a dict (JSON object) of keyword arguments of the chat "
                              f"template, got {type(chat_template_kwargs).__name__}", "chat_template_kwargs")
    given = chat_template_kwargs or {}
    kwargs = dict(given)
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise ChatOptionError(f"chat_template_kwargs may not set {key!r}: the chat template call's messages and "
                                  "output are set by longflash itself", f"chat_template_kwargs.{key}")
    if kwargs.get("tools"):
        raise ChatOptionError("tools is not supported by this server (chat_template_kwargs.tools: tool calling is "
                              "not implemented)", "chat_template_kwargs.tools")
    for key, value in (("add_generation_prompt", add_generation_prompt),
                       ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            raise ChatOptionError(f"{key} must be true or false, got {value!r}", key)
        if key in given and not isinstance(given[key], bool):
            raise ChatOptionError(f"chat_template_kwargs.{key} must be true or false, got {given[key]!r}",
                                  f"chat_template_kwargs.{key}")
    agp = kwargs.pop("add_generation_prompt", add_generation_prompt)
    if continue_final_message:
        kwargs.setdefault("continue_final_message", True)
    if kwargs.get("continue_final_message") is False:
        del kwargs["continue_final_message"]
    if kwargs.get("continue_final_message") and agp:
        key = next((k for k in ("add_generation_prompt", "continue_final_message") if k in given), None)
        raise ChatOptionError("continue_final_message needs add_generation_prompt set to false",
                              f"chat_template_kwargs.{key}" if key else "continue_final_message")
    why = "(a template runs on the engine thread)"
    if "chat_template" in kwargs and not trusted:  # the same template by another door
        raise ChatOptionError("chat_template_kwargs may not set chat_template unless the server is started with "
                              f"--trust-request-chat-template {why}", "chat_template_kwargs.chat_template")
    if chat_template is not None:
        if not trusted:
            raise ChatOptionError("a request chat_template is refused unless the server is started with "
                                  f"--trust-request-chat-template {why}", "chat_template")
        kwargs["chat_template"] = chat_template
    if "chat_template" in kwargs:  # a request's own: a syntax error is named (not a 'string' format fallback)
        field = "chat_template" if chat_template is not None else "chat_template_kwargs.chat_template"
        try:
            check_chat_template(kwargs["chat_template"])
        except ValueError as e:
            raise ChatOptionError(str(e), field) from None
    if default_template is not None:
        kwargs.setdefault("chat_template", default_template)
    return agp, kwargs


def render_chat(tokenizer, messages, add_generation_prompt: bool, kwargs: dict | None,
                content_format: str = "auto", add_special_tokens: bool = False) -> tuple[str, list[int]]:
    """``(prompt text, token ids)`` of ``messages`` (OpenAI message dicts) through the chat template
    (``kwargs["chat_template"]`` or the tokenizer's), message content given in ``content_format``
    (``auto``: detected from that template; ``chat_utils.py``). ``kwargs``: from :func:`template_options`.
    The ids are the text encoded without added special tokens (the template writes them), as
    transformers' ``apply_chat_template(tokenize=True)``; ``add_special_tokens=True`` (vLLM's request
    field of the chat and ``/tokenize`` routes) adds the tokenizer's (e.g. a BOS) on top. Raises
    ValueError: no tokenizer or no template, missing/empty messages (:func:`check_messages`), a bad
    message, a template that fails to render (``chat_utils.template_error``)."""
    check_messages(messages)
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; it was not loaded (skip_tokenizer_init / --skip-tokenizer-init)")
    kwargs = dict(kwargs or {})
    if kwargs.get("chat_template") is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; give one (--chat-template, or chat_template=...)")
    fmt = resolve_content_format(content_format, tokenizer, kwargs.get("chat_template"))
    msgs = normalize_messages(messages, fmt)
    try:
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **kwargs)
    except ValueError:
        raise
    except Exception as e:  # jinja2 errors, a TypeError on content of the other format
        raise template_error(e, fmt) from e
    return text, list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
