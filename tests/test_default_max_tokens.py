"""The output limit of a request that does not set max_tokens (``LLMEngine.max_output_tokens``), offline and
through the server: vLLM's rule, the room left in the context (offline: SamplingParams' default 16 capped at
that room), so a prompt that fits never gets a length error about a max_tokens the user did not send. A prompt
that alone fills the context, and an explicit max_tokens that does not fit, are still refused by name."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from longflash import LLM, SamplingParams
from longflash.config import EngineConfig
from longflash.engine.llm_engine import LLMEngine
from longflash.entrypoints.server.api_server import build_app
from longflash.entrypoints.server.async_engine import AsyncEngine
from longflash.entrypoints.server.metrics import ServerMetrics
from server_fixtures import make_tiny_model

MAX_MODEL_LEN = 64
GREEDY = dict(temperature=0.0, ignore_eos=True)


def ids(n: int) -> list[int]:
    return [10 + i % 400 for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_max_tokens") / "model"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=MAX_MODEL_LEN, num_gpu_blocks=64)


def lengths(outs) -> list[int]:
    return [len(c.token_ids) for o in outs for c in o.outputs]


def test_offline_left_out_max_tokens_is_capped_at_the_room(llm):
    sp = SamplingParams(**GREEDY)  # max_tokens left out: 16
    out = llm.generate([{"prompt_token_ids": ids(60)}], sp)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    # The caller's params are not changed: the same object still gives 16 tokens to a short prompt.
    assert sp.max_tokens == 16 and sp.max_tokens_is_default
    assert lengths(llm.generate([{"prompt_token_ids": ids(5)}, {"prompt_token_ids": ids(55)}], sp)) == [16, 9]
    assert lengths(llm.generate([{"prompt_token_ids": ids(58)}], SamplingParams(n=2, seed=1, **GREEDY))) == [6, 6]


def test_offline_none_is_the_rest_of_the_context(llm):
    out = llm.generate([{"prompt_token_ids": ids(30)}], SamplingParams(max_tokens=None, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) == MAX_MODEL_LEN - 30 and out.finish_reason == "length"


def test_offline_chat_near_the_end_of_the_context(llm):
    from longflash.entrypoints.chat_request import render_chat
    tok_len = lambda k: len(render_chat(llm.engine.tokenizer, [{"role": "user", "content": "hello " * k}], True, None)[1])
    k = next(k for k in range(1, 200) if tok_len(k) > MAX_MODEL_LEN - 16)
    room = MAX_MODEL_LEN - tok_len(k)
    assert 1 <= room < 16
    out = llm.chat([{"role": "user", "content": "hello " * k}], SamplingParams(**GREEDY))[0].outputs[0]
    assert len(out.token_ids) == room and out.finish_reason == "length"


@pytest.mark.parametrize("n_prompt, kw, match", [
    (60, {"max_tokens": 16}, "maximum context length is 64 tokens, but 60 prompt tokens \\+ max_tokens 16 exceed"),
    (64, {}, "maximum context length is 64 tokens, but the prompt alone has 64 tokens"),
    (70, {"max_tokens": None}, "maximum context length is 64 tokens, but the prompt alone has 70 tokens"),
    (60, {"min_tokens": 8}, "min_tokens \\(8\\) exceeds the 4 output tokens that fit: max_model_len 64 - 60 prompt"),
])
def test_offline_length_errors_name_what_the_user_set(llm, n_prompt, kw, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": ids(n_prompt)}], SamplingParams(**{**GREEDY, **kw}))


@pytest.fixture(scope="module")
def app(model_dir):
    engine = LLMEngine(EngineConfig(model=model_dir, max_model_len=MAX_MODEL_LEN, num_gpu_blocks=64))
    metrics = ServerMetrics("m")
    ae = AsyncEngine(engine, metrics)
    ae.start()
    yield build_app(ae, ["m"], model_dir, metrics)
    ae.shutdown()


def post_all(app, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.post(path, json=body) for path, body in requests]
    return asyncio.run(run())


def test_server_left_out_max_tokens_is_the_rest_of_the_context(app):
    chat = {"messages": [{"role": "user", "content": "hello " * 20}], **GREEDY}
    r_cmpl, r_n, r_chat = post_all(app, [("/v1/completions", {"prompt": ids(50), **GREEDY}),
                                         ("/v1/completions", {"prompt": ids(60), "n": 2, **GREEDY}),
                                         ("/v1/chat/completions", chat)])
    assert r_cmpl.status_code == 200, r_cmpl.text
    cmpl = r_cmpl.json()
    assert cmpl["usage"]["completion_tokens"] == 14 and cmpl["choices"][0]["finish_reason"] == "length"
    assert r_n.status_code == 200 and r_n.json()["usage"]["completion_tokens"] == 8  # 2 choices x 4
    usage = r_chat.json()["usage"]
    assert r_chat.status_code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN


def test_server_length_errors_name_the_field_the_request_set(app):
    chat_msgs = [{"role": "user", "content": "hello " * 20}]
    rs = post_all(app, [
        ("/v1/completions", {"prompt": ids(60), "min_tokens": 8, **GREEDY}),
        ("/v1/completions", {"prompt": ids(64), **GREEDY}),
        ("/v1/completions", {"prompt": ids(60), "max_tokens": 10, **GREEDY}),
        ("/v1/chat/completions", {"messages": chat_msgs, "max_completion_tokens": 60, **GREEDY}),
    ])
    errs = [r.json()["error"] for r in rs]
    assert [r.status_code for r in rs] == [400] * 4, errs
    assert errs[0]["param"] == "min_tokens" and "max_tokens" not in errs[0]["message"]
    assert "min_tokens (8) exceeds the 4 output tokens" in errs[0]["message"]
    assert errs[1]["param"] == "prompt" and "prompt alone has 64 tokens" in errs[1]["message"]
    assert errs[2]["param"] == "max_tokens" and "60 prompt tokens + max_tokens 10 exceed" in errs[2]["message"]
    assert errs[3]["param"] == "max_completion_tokens" and "max_completion_tokens 60 exceed" in errs[3]["message"]
