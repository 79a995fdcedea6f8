"""Chat messages as the tokenizer's chat template takes them, for ``LLM.chat`` and the server.

OpenAI messages carry ``content`` as a string, as a list of content parts, or as null. Chat templates
expect a string, so the text parts are joined with ``"\\n"`` (vLLM's convention, so that prompts equal
vLLM's); a null content becomes ``""``. Parts of any other type (``image_url``, ``input_audio``, ...) are
refused: the models this engine serves take text only.
"""
from __future__ import annotations

ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_messages(messages) -> list[dict]:
    """``messages``: a non-empty list of dicts with ``role`` (one of ``ROLES``) and ``content`` (str, a
    list of ``{"type": "text", "text": str}`` parts, or None). Returns new dicts with string content
    (other keys, e.g. ``name``, kept). Raises ValueError naming the message and the problem."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"message {i}: role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        d = dict(m)
        d["content"] = content_text(m.get("content"), where=f"message {i}")
        try:
            d["content"].encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"message {i}: content is not valid Unicode text (a lone surrogate?)") from None
        out.append(d)
    return out


def content_text(content, where: str = "") -> str:
    """A message's ``content`` (str, list of text parts, or None) as one string; text parts joined with
    ``"\\n"``. Raises ValueError for a part that is not ``{"type": "text", "text": str}`` (the message
    starts with ``where``, e.g. "message 2", when given)."""
    pre = f"{where}: " if where else ""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{pre}content must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            if isinstance(kind, str):
                raise ValueError(f"{pre}content part type {kind!r} is not supported: the model takes text "
                                 "only (parts of type 'text')")
            raise ValueError(f"{pre}content part {j} must be {{'type': 'text', 'text': <string>}}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{pre}content part {j} (type 'text') needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)
