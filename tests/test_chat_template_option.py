"""A chat template other than the tokenizer's (vLLM's ``--chat-template`` on ``longflash serve``, a file or
the template text; ``LLM.chat(chat_template=...)`` offline), ``chat_template_kwargs`` keys that the server
sets itself, and the chat errors a fresh user found unclear (``entrypoints/chat_utils.py``)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from longflash import LLM, SamplingParams
from longflash.entrypoints.chat_utils import detect_content_format, load_chat_template
from longflash.entrypoints.cli import main
from longflash.entrypoints.server.api_server import build_app
from longflash.entrypoints.server.metrics import ServerMetrics
from server_fixtures import free_port, make_tiny_model, running_engine

# Written for OpenAI-style content (loops over the parts): 'auto' must detect it when it is the template
# that renders, although the tokenizer's own template (server_fixtures.CHAT_TEMPLATE) takes strings.
PARTS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                  "{% for p in m['content'] %}{{ p['text'] }}{% if not loop.last %} | {% endif %}{% endfor %}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MSGS = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
PARTS_TEXT = "<|im_start|>user\nhello | world<|im_end|>\n<|im_start|>assistant\n"
STRING_TEXT = "<|im_start|>user\nhello\nworld<|im_end|>\n<|im_start|>assistant\n"
BROKEN = "{% for m in messages %}{{ m['content'] }}"  # no endfor


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_tmpl") / "model"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=128, num_gpu_blocks=32)


def test_load_chat_template_file_text_or_error(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(PARTS_TEMPLATE)
    assert load_chat_template(str(f)) == PARTS_TEMPLATE
    assert load_chat_template(PARTS_TEMPLATE) == PARTS_TEMPLATE       # not a file: the text itself
    with pytest.raises(ValueError, match="'missing.jinja' looks like a file path, but it cannot be opened"):
        load_chat_template("missing.jinja")
    with pytest.raises(ValueError, match="does not parse: line 1: .*endfor"):
        load_chat_template(BROKEN)
    f.write_text("line one\n{% if x %}\n")
    with pytest.raises(ValueError, match="does not parse: line 2"):
        load_chat_template(str(f))


@pytest.mark.parametrize("value, message", [
    ("x", "error: --chat-template: the chat template 'x' looks like a file path, but it cannot be opened"),
    (BROKEN, "error: --chat-template: the chat template does not parse: line 1"),
])
def test_serve_refuses_a_bad_chat_template_at_startup(value, message, capsys):
    """Before the model loads (the path given is not even a model), exit status 2, one line."""
    assert main(["serve", "/nonexistent-model", "--port", str(free_port()), "--chat-template", value]) == 2
    assert message in capsys.readouterr().err


def _post(app, path: str, body: dict) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body)
    return asyncio.run(run())


@pytest.fixture(scope="module")
def engine(model_dir):
    with running_engine(model_dir) as ae:
        yield ae


def _chat(app, **body) -> httpx.Response:
    return _post(app, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, "temperature": 0, **body})


def test_server_chat_template_replaces_the_tokenizers(engine, llm):
    encode = lambda text: llm.get_tokenizer().encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match="does not parse"):
        build_app(engine, ["m"], "p", ServerMetrics("m2"), chat_template=BROKEN)
    app = build_app(engine, ["m"], "p", ServerMetrics("m3"), chat_template=PARTS_TEMPLATE)
    plain = build_app(engine, ["m"], "p", ServerMetrics("m4"))
    # 'auto' detects the content format of the template that renders (the server's, not the tokenizer's)
    r = _post(app, "/tokenize", {"messages": MSGS})
    assert r.status_code == 200 and r.json()["tokens"] == encode(PARTS_TEXT), r.text
    assert _post(plain, "/tokenize", {"messages": MSGS}).json()["tokens"] == encode(STRING_TEXT)
    r = _chat(app)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(encode(PARTS_TEXT)), r.text


@pytest.mark.parametrize("key", ["messages", "tokenize", "conversation", "return_dict", "return_tensors",
                                 "truncation", "tokenizer_kwargs"])
def test_chat_template_kwargs_the_server_sets_are_refused_by_name(engine, key):
    """They reached apply_chat_template: "got multiple values for keyword argument" (a 400 with param
    "prompt" or null), or a changed return type / a truncated prompt."""
    app = build_app(engine, ["m"], "p", ServerMetrics("m5"))
    r = _chat(app, chat_template_kwargs={key: True})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == f"chat_template_kwargs.{key}" and repr(key) in err["message"], err


def test_chat_template_kwargs_override_generation_prompt(engine, llm):
    """vLLM merges chat_template_kwargs over add_generation_prompt / continue_final_message."""
    n = lambda text: len(llm.get_tokenizer().encode(text, add_special_tokens=False))
    app = build_app(engine, ["m"], "p", ServerMetrics("m6"))
    r = _chat(app, chat_template_kwargs={"add_generation_prompt": False})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == n("<|im_start|>user\nhello\nworld<|im_end|>\n")
    open_turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    r = _chat(app, messages=open_turn, chat_template_kwargs={"add_generation_prompt": False,
                                                             "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == n("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHel")
    # both on, one of them from chat_template_kwargs: a 400 naming that key
    for body, param in (({"chat_template_kwargs": {"continue_final_message": True}},  # add_generation_prompt: True
                         "chat_template_kwargs.continue_final_message"),
                        ({"continue_final_message": True, "add_generation_prompt": False,
                          "chat_template_kwargs": {"add_generation_prompt": True}},
                         "chat_template_kwargs.add_generation_prompt")):
        r = _chat(app, messages=open_turn, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_request_chat_template_that_does_not_parse_is_named(engine):
    app = build_app(engine, ["m"], "p", ServerMetrics("m7"), trust_request_chat_template=True)
    r = _chat(app, chat_template=BROKEN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "does not parse: line 1" in r.json()["error"]["message"]
    r = _chat(app, chat_template_kwargs={"chat_template": BROKEN})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.chat_template", r.text


def test_server_openai_format_on_a_string_template_suggests_string(engine):
    app = build_app(engine, ["m"], "p", ServerMetrics("m8"), chat_template_content_format="openai",
                    chat_template="{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %}")
    r = _chat(app)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "TypeError" in msg and "chat_template_content_format='string'" in msg, msg


def test_offline_chat_template(llm):
    encode = lambda text: llm.get_tokenizer().encode(text, add_special_tokens=False)
    sp = SamplingParams(temperature=0, max_tokens=1)
    assert llm.chat(MSGS, sp)[0].prompt_token_ids == encode(STRING_TEXT)
    # auto follows the given template (it loops over the parts)
    assert llm.chat(MSGS, sp, chat_template=PARTS_TEMPLATE)[0].prompt_token_ids == encode(PARTS_TEXT)
    with pytest.raises(ValueError, match="the chat template does not parse: line 1"):
        llm.chat(MSGS, sp, chat_template=BROKEN)


def test_offline_chat_errors_name_the_format_and_the_conversation(llm):
    sp = SamplingParams(temperature=0, max_tokens=1)
    # a template that concatenates strings, given a list of parts: was a bare jinja2 TypeError
    with pytest.raises(ValueError, match=r"TypeError.*chat_template_content_format 'openai'.*"
                                         r"chat_template_content_format='string'"):
        llm.chat(MSGS, sp, chat_template_content_format="openai",
                 chat_template="{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %}")
    conv = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="conversation 1: messages must be a non-empty list"):
        llm.chat([conv, []], sp)
    with pytest.raises(ValueError, match="conversation 0: message 0: role must be one of"):
        llm.chat([[{"role": "wizard", "content": "x"}], conv], sp)
    assert len(llm.chat([conv, conv], sp)) == 2  # still serving


def test_unparseable_tokenizer_template_warning_names_both_knobs(caplog):
    with caplog.at_level(logging.WARNING, logger="longflash.chat"):
        assert detect_content_format(BROKEN + "{# warning test #}") == "string"
    assert "--chat-template-content-format" in caplog.text
    assert "LLM.chat(..., chat_template_content_format=...)" in caplog.text
