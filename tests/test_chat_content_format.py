"""Chat template content format (vLLM's ``--chat-template-content-format``, ``entrypoints/chat_utils.py``):
``string`` joins text parts, ``openai`` passes a list of text parts, ``auto`` detects which one the
template wants from its jinja2 syntax tree; offline (``LLM.chat``) and through the server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from transformers import AutoTokenizer

from longflash import LLM, SamplingParams
from longflash.config import EngineConfig
from longflash.default_model_path import default_model_path
from longflash.engine.llm_engine import LLMEngine
from longflash.entrypoints.chat_utils import detect_content_format, normalize_messages, resolve_content_format
from longflash.entrypoints.cli import build_parser
from longflash.entrypoints.server.api_server import build_app
from longflash.entrypoints.server.async_engine import AsyncEngine
from longflash.entrypoints.server.metrics import ServerMetrics
from server_fixtures import CHAT_TEMPLATE, make_tiny_model

# A template written for OpenAI-style content: it loops over the parts and reads part['text'].
PARTS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                  "{% for p in m['content'] %}{{ p['text'] }}{% if not loop.last %} | {% endif %}{% endfor %}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MSGS = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
# What PARTS_TEMPLATE must render for MSGS (a string content is one part).
SYSTEM = "<|im_start|>system\nbe brief<|im_end|>\n"
PARTS_TEXT = SYSTEM + "<|im_start|>user\nhello | world<|im_end|>\n<|im_start|>assistant\n"
STRING_TEXT = SYSTEM + "<|im_start|>user\nhello\nworld<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template, fmt", [
    (PARTS_TEMPLATE, "openai"),
    (CHAT_TEMPLATE, "string"),
    # attribute access, a loop over a variable set from a slice of messages, a filter on the content
    ("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% if m.content is string %}{{ m.content }}"
     "{% else %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}{{ p.text }}{% endfor %}{% endif %}"
     "{% endfor %}", "openai"),
    # transformers' generation block and loop controls parse
    ("{% for m in messages %}{% generation %}{% for p in m['content'] %}{% break %}{% endfor %}{% endgeneration %}"
     "{% endfor %}", "openai"),
    # a loop over the content of something that is not a message
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% for t in tools %}{% for p in t['content'] %}"
     "{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}{{ m['content'] ", "string"),  # does not parse: vLLM's fallback
])
def test_detect_content_format(template, fmt):
    assert detect_content_format(template) == fmt


def test_the_default_models_template_is_detected_as_string():
    with open(f"{default_model_path()}/tokenizer_config.json") as f:
        assert detect_content_format(json.load(f)["chat_template"]) == "string"


def test_normalize_messages_openai_format():
    msgs = [{"role": "system", "content": None}, {"role": "user", "content": "hi", "name": "u"},
            {"role": "user", "content": [{"type": "text", "text": "A", "extra": 1}, {"type": "text", "text": "B"}]}]
    assert normalize_messages(msgs, "openai") == [
        {"role": "system", "content": []}, {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "u"},
        {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]
    assert normalize_messages(msgs, "string")[2]["content"] == "A\nB"
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        normalize_messages(msgs, "auto")


def test_invalid_content_format_is_a_clear_error():
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai, got 'json"):
        resolve_content_format("json", None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chat-template-content-format", "json"])
    assert build_parser().parse_args(["serve"]).chat_template_content_format == "auto"


@pytest.fixture(scope="module")
def parts_model(tmp_path_factory) -> str:
    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny_parts") / "model"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = PARTS_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(parts_model):
    return LLM(parts_model, max_model_len=128, num_gpu_blocks=32)


def test_offline_chat_content_format(llm):
    encode = lambda text: llm.get_tokenizer().encode(text, add_special_tokens=False)
    sp = SamplingParams(temperature=0, max_tokens=1)
    prompt_ids = lambda **kw: llm.chat(MSGS, sp, **kw)[0].prompt_token_ids
    assert prompt_ids() == prompt_ids(chat_template_content_format="openai") == encode(PARTS_TEXT)
    assert prompt_ids(chat_template_content_format="string") != encode(PARTS_TEXT)
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat(MSGS, sp, chat_template_content_format="list")


def test_offline_chat_string_template_renders_as_before(tmp_path):
    llm = LLM(make_tiny_model(str(tmp_path / "model")), max_model_len=128, num_gpu_blocks=32)
    encode = lambda text: llm.get_tokenizer().encode(text, add_special_tokens=False)
    out = llm.chat(MSGS, SamplingParams(temperature=0, max_tokens=1))[0]
    assert out.prompt_token_ids == encode(STRING_TEXT)


def post(app, path: str, body: dict) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body)
    return asyncio.run(run())


def tokenize(app, body: dict) -> list[int]:
    r = post(app, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def chat_prompt_tokens(app, body: dict) -> int:
    r = post(app, "/v1/chat/completions", {"max_tokens": 1, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_server_chat_content_format(parts_model, llm):
    encode = lambda text: llm.get_tokenizer().encode(text, add_special_tokens=False)
    engine = LLMEngine(EngineConfig(model=parts_model, max_model_len=128, num_gpu_blocks=32))
    metrics = ServerMetrics("m")
    ae = AsyncEngine(engine, metrics)
    ae.start()
    try:
        with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
            build_app(ae, ["m"], parts_model, metrics, chat_template_content_format="parts")
        auto = build_app(ae, ["m"], parts_model, metrics, trust_request_chat_template=True)
        string = build_app(ae, ["m"], parts_model, metrics, chat_template_content_format="string")
        assert tokenize(auto, {"messages": MSGS}) == encode(PARTS_TEXT)
        assert tokenize(string, {"messages": MSGS}) != encode(PARTS_TEXT)
        assert chat_prompt_tokens(auto, {"messages": MSGS}) == len(encode(PARTS_TEXT))
        # auto follows the template that renders: a request's own (string) template
        assert chat_prompt_tokens(auto, {"messages": MSGS, "chat_template": CHAT_TEMPLATE}) == len(encode(STRING_TEXT))
        assert chat_prompt_tokens(auto, {"messages": MSGS, "chat_template_kwargs": {"chat_template": CHAT_TEMPLATE}}
                                  ) == len(encode(STRING_TEXT))
        # without --trust-request-chat-template, chat_template_kwargs cannot carry a template either (it did)
        r = post(string, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1,
                                                  "chat_template_kwargs": {"chat_template": CHAT_TEMPLATE}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.chat_template", r.text
    finally:
        ae.shutdown()
