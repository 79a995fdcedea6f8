"""One render path for a chat request (``entrypoints/chat_request.py``): ``/tokenize`` with ``messages``
renders exactly the chat route's prompt from the same fields and refuses what it refuses; ``LLM.chat``
takes vLLM's template keywords with the same checks (found by a fresh user)."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

from longflash import LLM, SamplingParams
from longflash.entrypoints.server.api_server import build_app
from longflash.entrypoints.server.metrics import ServerMetrics
from server_fixtures import make_tiny_model, running_engine

OPEN_TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
OTHER = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_paths") / "model"))


@pytest.fixture(scope="module")
def engine(model_dir):
    with running_engine(model_dir) as ae:
        yield ae


@pytest.fixture(scope="module")
def app(engine):
    return build_app(engine, ["m"], "p", ServerMetrics("m1"), trust_request_chat_template=True)


def _post(app, path: str, body: dict) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body)
    return asyncio.run(run())


@pytest.mark.parametrize("fields", [
    {"continue_final_message": True, "add_generation_prompt": False},
    {"chat_template_kwargs": {"add_generation_prompt": False}},
    {"chat_template_kwargs": {"add_generation_prompt": False, "continue_final_message": True}},
    {"chat_template": OTHER},
    {"chat_template_kwargs": {"chat_template": OTHER}},
])
def test_tokenize_messages_renders_the_chat_prompt(app, fields):
    """/tokenize ignored these fields (it rendered with add_generation_prompt and the default template)."""
    tok = _post(app, "/tokenize", {"messages": OPEN_TURN, **fields})
    chat = _post(app, "/v1/chat/completions", {"messages": OPEN_TURN, "max_tokens": 1, "temperature": 0, **fields})
    assert tok.status_code == 200 and chat.status_code == 200, (tok.text, chat.text)
    plain = _post(app, "/tokenize", {"messages": OPEN_TURN}).json()["count"]
    assert tok.json()["count"] == chat.json()["usage"]["prompt_tokens"] != plain


@pytest.mark.parametrize("fields, param", [
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"return_dict": True}}, "chat_template_kwargs.return_dict"),
    ({"chat_template_kwargs": ["add_generation_prompt"]}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt: true
    ({"chat_template_kwargs": {"continue_final_message": "yes"}}, "chat_template_kwargs.continue_final_message"),
    ({"chat_template_kwargs": {"add_generation_prompt": 0}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": {"tools": [{"type": "function"}]}}, "chat_template_kwargs.tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
def test_tokenize_refuses_what_chat_refuses(app, fields, param):
    for path, extra in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 1})):
        r = _post(app, path, {"messages": OPEN_TURN, **fields, **extra})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == param, (path, r.text)


def test_untrusted_request_template_refused_by_tokenize(engine):
    app = build_app(engine, ["m"], "p", ServerMetrics("m2"))
    r = _post(app, "/tokenize", {"messages": OPEN_TURN, "chat_template": OTHER})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text


@pytest.mark.parametrize("body", [{"messages": []}, {"messages": [], "add_generation_prompt": False}])
def test_empty_messages_same_error_on_both_routes(app, body):
    """``messages: []`` was a pydantic "List should have at least 1 item" error on the chat route and the
    renderer's ValueError without a param on /tokenize (found by a fresh user)."""
    tok = _post(app, "/tokenize", body)
    chat = _post(app, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert tok.status_code == chat.status_code == 400, (tok.text, chat.text)
    assert tok.json() == chat.json()
    err = chat.json()["error"]
    assert err["param"] == "messages" and err["type"] == "invalid_request_error" and err["code"] == "invalid_value"
    assert "non-empty list" in err["message"]


@pytest.mark.parametrize("body", [{}, {"messages": None}])
def test_missing_messages_same_message_as_empty(app, body):
    """A chat request without ``messages`` (or with null) gets the empty list's message and param; the
    code says the field is missing."""
    empty = _post(app, "/v1/chat/completions", {"messages": [], "max_tokens": 1}).json()["error"]
    r = _post(app, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["message"], err["type"], err["param"]) == (empty["message"], empty["type"], empty["param"])
    assert err["code"] == "missing_required_parameter"


def test_tokenize_without_prompt_or_messages_names_both(app):
    r = _post(app, "/tokenize", {})
    assert r.status_code == 400 and "exactly one of 'prompt' or 'messages'" in r.json()["error"]["message"], r.text


BOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def bos_app(model_dir, tmp_path_factory):
    """The tiny model with a tokenizer that adds a BOS token (``<|endoftext|>``) when asked to add special
    tokens, as DeepSeek's and Llama's do (the plain tiny tokenizer adds none)."""
    from tokenizers import processors
    from transformers import AutoTokenizer
    path = str(tmp_path_factory.mktemp("tiny_bos") / "model")
    shutil.copytree(model_dir, path)
    tok = AutoTokenizer.from_pretrained(path)
    bos = tok.convert_tokens_to_ids(BOS)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos)])
    tok.save_pretrained(path)
    with running_engine(path) as ae:
        yield build_app(ae, ["m"], "p", ServerMetrics("m3")), bos


def test_tokenize_messages_honours_add_special_tokens(bos_app):
    """/tokenize with ``messages`` ignored ``add_special_tokens`` (vLLM: default false for messages, the
    template writes the special tokens; true adds the tokenizer's on top); the chat route takes the field
    too and renders the same ids."""
    app, bos = bos_app
    plain = _post(app, "/tokenize", {"messages": OPEN_TURN}).json()["tokens"]
    assert plain[0] != bos
    assert _post(app, "/tokenize", {"messages": OPEN_TURN, "add_special_tokens": False}).json()["tokens"] == plain
    with_bos = _post(app, "/tokenize", {"messages": OPEN_TURN, "add_special_tokens": True}).json()["tokens"]
    assert with_bos == [bos] + plain
    for flag, ids in ((True, with_bos), (False, plain)):
        chat = _post(app, "/v1/chat/completions", {"messages": OPEN_TURN, "add_special_tokens": flag, "max_tokens": 1,
                                                   "temperature": 0})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(ids), chat.text
    r = _post(app, "/v1/chat/completions", {"messages": OPEN_TURN, "add_special_tokens": "yes", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens", r.text


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=128, num_gpu_blocks=32)


def test_offline_chat_takes_vllms_template_keywords(llm, app):
    sp = SamplingParams(temperature=0, max_tokens=1)
    out = llm.chat(OPEN_TURN, sp, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHel"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    same = _post(app, "/tokenize", {"messages": OPEN_TURN, "add_generation_prompt": False,
                                    "continue_final_message": True}).json()["tokens"]
    assert same == out.prompt_token_ids
    kw = llm.chat(OPEN_TURN, sp, chat_template_kwargs={"add_generation_prompt": False})[0]
    assert kw.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHel<|im_end|>\n"
    assert llm.chat(OPEN_TURN, sp)[0].prompt.endswith("Hel<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("kwargs, match", [
    ({"continue_final_message": True}, "continue_final_message needs add_generation_prompt set to false"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs may not set 'tokenize'"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs must be a dict"),
    ({"chat_template_kwargs": {"add_generation_prompt": "no"}}, "add_generation_prompt must be true or false"),
    ({"tools": [{"type": "function"}]}, "tools is not supported"),
])
def test_offline_chat_refuses_what_the_server_refuses(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(OPEN_TURN, SamplingParams(max_tokens=1), **kwargs)


def test_offline_chat_render_error_names_the_conversation(llm):
    raising = "{% if messages|length > 1 %}{{ raise_exception('too long') }}{% endif %}{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="conversation 1: cannot apply the chat template: .*too long"):
        llm.chat([[{"role": "user", "content": "a"}], OPEN_TURN], SamplingParams(max_tokens=1),
                 chat_template=raising)


def test_content_format_hint_only_when_plausible(llm):
    """The 'use string' hint was added to every render error under the openai format."""
    parts = [{"role": "user", "content": "a"}]
    sp = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match="too long") as info:
        llm.chat(parts, sp, chat_template_content_format="openai",
                 chat_template="{{ raise_exception('too long') }}")
    assert "chat_template_content_format='string'" not in str(info.value)
    with pytest.raises(ValueError, match="TypeError.*chat_template_content_format='string'"):
        llm.chat(parts, sp, chat_template_content_format="openai",
                 chat_template="{% for m in messages %}{{ m['role'] + m['content'] }}{% endfor %}")


@pytest.mark.parametrize("value", ["", "  ", "EMPTY_FILE", "BLANK_FILE"])
def test_serve_refuses_an_empty_chat_template(value, tmp_path, capsys):
    from longflash.entrypoints.cli import main
    from server_fixtures import free_port
    if value.endswith("_FILE"):
        f = tmp_path / "t.jinja"
        f.write_text("" if value == "EMPTY_FILE" else "\n  \n")
        value = str(f)
    assert main(["serve", "/nonexistent-model", "--port", str(free_port()), "--chat-template", value]) == 2
    assert "error: --chat-template: the chat template is empty" in capsys.readouterr().err


def test_text_prompts_get_special_tokens_by_default(bos_app):
    """vLLM's default for text prompts: the tokenizer's special tokens are added (a BOS for DeepSeek's and
    Llama's tokenizers) on ``/v1/completions`` and ``/tokenize`` with ``prompt``; ``add_special_tokens:
    false`` leaves them out; messages keep the template's tokens only (tested above)."""
    app, bos = bos_app
    with_bos = _post(app, "/tokenize", {"prompt": "hello world"}).json()["tokens"]
    plain = _post(app, "/tokenize", {"prompt": "hello world", "add_special_tokens": False}).json()["tokens"]
    assert with_bos == [bos] + plain and plain and plain[0] != bos
    assert _post(app, "/tokenize", {"prompt": "hello world", "add_special_tokens": True}).json()["tokens"] == with_bos
    for body, ids in (({}, with_bos), ({"add_special_tokens": False}, plain)):
        r = _post(app, "/v1/completions", {"prompt": "hello world", "max_tokens": 1, "temperature": 0, **body})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text
