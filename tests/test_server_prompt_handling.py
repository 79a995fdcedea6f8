"""Server prompt handling (the app in-process).

Long text prompts and conversations are tokenized off the engine thread (``api_server.LARGE_PROMPT_CHARS``,
``_Server.prompt_fn``: the server's own tokenizer copy on a worker thread; a fresh user's 30 MB prompt had
stalled every stream for 45 s while the engine thread tokenized it), with the same results and errors as the
engine-thread path (the threshold lowered so that short prompts take the new path); ``echo`` is refused as an
unsupported field."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from longflash.config import EngineConfig
from longflash.engine.llm_engine import LLMEngine
from longflash.entrypoints.server import api_server
from longflash.entrypoints.server.api_server import build_app
from longflash.entrypoints.server.async_engine import AsyncEngine
from longflash.entrypoints.server.metrics import ServerMetrics
from server_fixtures import make_tiny_model


@pytest.fixture(scope="module")
def app_and_engine(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny_long") / "model"))
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=256, max_model_len=256))
    metrics = ServerMetrics("m")
    ae = AsyncEngine(engine, metrics)
    ae.start()
    yield build_app(ae, ["m"], path, metrics), engine
    ae.shutdown()


def _requests():
    text = "the quick brown fox jumps over the lazy dog " * 3
    return [("/v1/completions", {"prompt": text, "max_tokens": 6, "temperature": 0, "ignore_eos": True}),
            ("/v1/completions", {"prompt": [text, "short"], "max_tokens": 4, "temperature": 0, "ignore_eos": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 6,
                                      "temperature": 0, "ignore_eos": True}),
            ("/tokenize", {"prompt": text}),
            ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}),
            ("/v1/completions", {"prompt": "x " * 400, "max_tokens": 4}),                     # too long: 400
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y " * 400}], "max_tokens": 4})]


def _run(app) -> list[tuple[int, dict]]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            out = []
            for route, body in _requests():
                r = await c.post(route, json=body)
                out.append((r.status_code, r.json()))
            return out
    return asyncio.run(go())


def _strip(res):
    """The parts that must match between the paths (ids, texts, usage, errors), without ids and timestamps."""
    status, body = res
    if status != 200:
        return status, body["error"]["message"], body["error"].get("param")
    if "tokens" in body:
        return status, body["tokens"]
    return status, [c.get("text") or c["message"]["content"] for c in body["choices"]], body["usage"]


def test_long_prompts_take_a_worker_thread_with_the_same_results(app_and_engine, monkeypatch):
    app, engine = app_and_engine
    engine_path = [_strip(r) for r in _run(app)]  # every prompt under the threshold: the engine thread
    calls = []  # (text, tokenized on the engine thread) of the completion and /tokenize text prompts
    real = api_server.tokenize_text

    def recording(tok, text, *a):
        calls.append((text, threading.current_thread().name == "longflash-engine"))
        return real(tok, text, *a)
    monkeypatch.setattr(api_server, "tokenize_text", recording)
    monkeypatch.setattr(api_server, "LARGE_PROMPT_CHARS", 16)
    worker_path = [_strip(r) for r in _run(app)]
    assert worker_path == engine_path
    assert [on_engine for text, on_engine in calls if text == "short"] == [True]
    assert len(calls) == 5 and all(not on_engine for text, on_engine in calls if text != "short")  # long ones
    assert engine_path[5][0] == engine_path[6][0] == 400 and "maximum context length" in engine_path[5][1]
    assert engine_path[0][0] == engine_path[2][0] == 200


def test_conversation_chars_counts_text_content():
    msgs = [{"role": "system", "content": "abc"}, {"role": "user", "content": [{"type": "text", "text": "de"},
                                                                               {"type": "image_url", "image_url": {}}]},
            {"role": "assistant", "content": None}]
    assert api_server._conversation_chars(msgs) == 5


def test_echo_is_an_unsupported_field(app_and_engine):
    """``echo: true`` is refused with the code of the other unsupported fields (from the second review)."""
    app, _ = app_and_engine

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": True})
    r = asyncio.run(go())
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_field"
    assert r.json()["error"]["param"] == "echo"
