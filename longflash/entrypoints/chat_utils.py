"""Chat messages as the tokenizer's chat template takes them, for ``LLM.chat`` and the server.

OpenAI messages carry ``content`` as a string, as a list of content parts, or as null. How a template
wants it is the *content format* (vLLM's ``--chat-template-content-format``):

- ``string``: one string; text parts joined with ``"\\n"`` (vLLM's convention, so that prompts equal
  vLLM's), null content ``""``.
- ``openai``: a list of ``{"type": "text", "text": ...}`` parts; a string content becomes one part, null
  content ``[]`` (as vLLM).
- ``auto`` (the default): ``openai`` when the template loops over a message's content
  (``{% for part in message['content'] %}``, ``message.content``, through filters, tests and slices, where
  ``message`` is the variable of a loop over ``messages`` or over a variable set from it), else
  ``string`` (vLLM's detection rule, ``vllm/entrypoints/chat_utils.py``), found with jinja2's parser.

Parts of any other type (``image_url``, ``input_audio``, ...) are refused: the models this engine serves
take text only.

A template other than the tokenizer's (``longflash serve --chat-template``, ``LLM.chat(chat_template=...)``,
vLLM's names) is loaded by :func:`load_chat_template` and checked by :func:`check_chat_template`.
"""
from __future__ import annotations

import functools
import logging
import os

import jinja2
import jinja2.ext
from jinja2 import nodes

logger = logging.getLogger("longflash.chat")

ROLES = ("system", "developer", "user", "assistant", "tool")
CONTENT_FORMATS = ("auto", "string", "openai")


def normalize_messages(messages, content_format: str = "string") -> list[dict]:
    """``messages``: a non-empty list of dicts with ``role`` (one of ``ROLES``) and ``content`` (str, a
    list of ``{"type": "text", "text": str}`` parts, or None). ``content_format``: ``string`` or ``openai``
    (see the module docstring; resolve ``auto`` first with :func:`resolve_content_format`). Returns new
    dicts with the content in that format (other keys, e.g. ``name``, kept). Raises ValueError naming the
    message and the problem, or the bad ``content_format``."""
    if content_format not in ("string", "openai"):
        raise ValueError(f"content_format must be 'string' or 'openai' (resolve 'auto' first), got {content_format!r}")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"message {i}: role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        texts = content_texts(m.get("content"), where=f"message {i}")
        try:
            "".join(texts).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"message {i}: content is not valid Unicode text (a lone surrogate?)") from None
        d = dict(m)
        d["content"] = "\n".join(texts) if content_format == "string" else [{"type": "text", "text": t} for t in texts]
        out.append(d)
    return out


def content_text(content, where: str = "") -> str:
    """A message's ``content`` (str, list of text parts, or None) as one string; text parts joined with
    ``"\\n"``. Raises ValueError as :func:`content_texts`."""
    return "\n".join(content_texts(content, where))


def content_texts(content, where: str = "") -> list[str]:
    """The texts of a message's ``content``: ``[content]`` for a string, ``[]`` for None, each part's
    ``text`` for a list. Raises ValueError for a part that is not ``{"type": "text", "text": str}`` (the
    message starts with ``where``, e.g. "message 2", when given)."""
    pre = f"{where}: " if where else ""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
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
    return texts


def check_content_format(content_format: str) -> str:
    """``content_format`` if it is one of ``CONTENT_FORMATS``, else ValueError naming the choices."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                         f"got {content_format!r}")
    return content_format


def resolve_content_format(content_format: str, tokenizer, chat_template: str | None = None) -> str:
    """``string`` or ``openai``: ``content_format`` itself, or for ``auto`` the format detected from the
    template that will render (``chat_template`` if given, else the tokenizer's; ``string`` when there is
    none). Raises ValueError for a ``content_format`` outside ``CONTENT_FORMATS``."""
    if check_content_format(content_format) != "auto":
        return content_format
    text = chat_template
    if text is None and tokenizer is not None:
        try:
            text = tokenizer.get_chat_template()
        except Exception:  # no template: applying it raises its own clear error
            text = None
    return detect_content_format(text) if isinstance(text, str) else "string"


def load_chat_template(value: str) -> str:
    """The template text of vLLM's ``--chat-template`` value: the contents of the file ``value`` names
    when it can be opened, else ``value`` itself when it contains a Jinja character (``{``, ``}`` or a
    newline); checked with :func:`check_chat_template`. Raises ValueError for an empty value, a value that
    looks like a file path (no Jinja character) but cannot be opened, and an empty, blank or unparsable
    template.
    Rule from vLLM's ``load_chat_template`` (``vllm/entrypoints/chat_utils.py``)."""
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"the chat template file {os.path.abspath(value)!r} is not UTF-8 text ({e})") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        if not value.strip():
            raise ValueError("the chat template is empty: give a template file or the template text") from None
        if not any(c in value for c in "{}\n"):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(f"the chat template {value!r} looks like a file path, but it cannot be opened "
                             f"({reason}); give a readable file or the template text itself") from None
        text = value
    return check_chat_template(text)


def check_chat_template(chat_template) -> str:
    """``chat_template`` if it is a non-blank string that jinja2 parses (with transformers' extensions:
    loop controls and ``{% generation %}``); raises ValueError for an empty or blank template and, naming
    the line and jinja2's message, for a syntax error (found when the template is given, not at the first
    chat request)."""
    if not isinstance(chat_template, str):
        raise ValueError(f"chat_template must be a string (Jinja template text), got {type(chat_template).__name__}")
    if not chat_template.strip():
        raise ValueError("the chat template is empty: it would render every conversation as an empty prompt")
    try:
        _environment().parse(chat_template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: line {e.lineno}: {e.message}") from None
    return chat_template


def template_error(e: Exception, content_format: str) -> ValueError:
    """The ValueError for a chat template that failed to render with message content in
    ``content_format`` (``string`` or ``openai``): names the error and, only when the format is plausibly
    the cause (``openai`` content and a TypeError about str/list, e.g. jinja2 concatenating a list of
    parts to a string), suggests ``string``."""
    msg = str(e)
    plausible = content_format == "openai" and isinstance(e, TypeError) and ("str" in msg or "list" in msg)
    hint = ("; chat_template_content_format 'openai' gives the template each message's content as a list of "
            "{'type': 'text', 'text': ...} parts: if the template expects a string, use "
            "chat_template_content_format='string' (--chat-template-content-format string)"
            if plausible else "")
    return ValueError(f"cannot apply the chat template: {type(e).__name__}: {e}{hint}")


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks assistant tokens when rendering):
    parsed as its body, so that templates using it can be inspected."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        return nodes.Scope(parser.parse_statements(("name:endgeneration",), drop_needle=True)).set_lineno(lineno)


def _environment() -> jinja2.Environment:
    """A jinja2 environment that parses what transformers' chat templates may use."""
    return jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _GenerationBlock])


@functools.lru_cache(maxsize=64)
def detect_content_format(chat_template: str) -> str:
    """``openai`` when the Jinja ``chat_template`` loops over a message's content (module docstring),
    else ``string``; also ``string`` (logged) when jinja2 cannot parse the template."""
    try:
        root = _environment().parse(chat_template)
    except jinja2.TemplateSyntaxError as e:
        logger.warning("cannot parse the chat template to detect its content format (%s); using 'string' "
                       "(to choose: --chat-template-content-format for the server, "
                       "LLM.chat(..., chat_template_content_format=...) offline)", e)
        return "string"
    loops = list(root.find_all(nodes.For))
    message_vars = {loop.target.name for loop in loops
                    if isinstance(loop.target, nodes.Name) and _reads(loop.iter, _set_from(root, "messages"))}
    found = any(_reads(loop.iter, message_vars, key="content") for loop in loops) if message_vars else False
    return "openai" if found else "string"


def _set_from(root: nodes.Template, name: str) -> set[str]:
    """``name`` and every variable ``{% set %}`` from it, directly or through another such variable."""
    names = {name}
    assigns = [a for a in root.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)]
    grew = True
    while grew:
        new = {a.target.name for a in assigns if a.target.name not in names and _reads(a.node, names)}
        names |= new
        grew = bool(new)
    return names


def _reads(expr: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """``expr`` is a variable in ``names`` (with ``key``: its item ``['key']`` or attribute ``.key``),
    possibly under filters, tests and slices (``messages | selectattr(...)``, ``messages[1:]``)."""
    while isinstance(expr, (nodes.Filter, nodes.Test)) or (isinstance(expr, nodes.Getitem)
                                                           and isinstance(expr.arg, nodes.Slice)):
        expr = expr.node
    if key is not None:
        if isinstance(expr, nodes.Getitem) and isinstance(expr.arg, nodes.Const) and expr.arg.value == key:
            expr = expr.node
        elif isinstance(expr, nodes.Getattr) and expr.attr == key:
            expr = expr.node
        else:
            return False
    return isinstance(expr, nodes.Name) and expr.ctx == "load" and expr.name in names
