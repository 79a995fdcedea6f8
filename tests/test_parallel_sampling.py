"""``n`` completions per prompt (LLM.generate and the OpenAI server, streaming included) and the
server's new sampling fields: penalties, min_tokens, their validation; a tiny random Qwen3 with a
trained tokenizer, the app in-process."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from longflash import LLM, SamplingParams
from longflash.entrypoints.parallel_sampling import child_params, child_request_ids
from longflash.entrypoints.server.api_server import build_app
from longflash.entrypoints.server.async_engine import AsyncEngine
from longflash.entrypoints.server.metrics import ServerMetrics
from server_fixtures import make_tiny_model

ENGINE_KW = dict(num_gpu_blocks=256, max_model_len=256, block_size=4)
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_n") / "model"))


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, **ENGINE_KW)


@pytest.fixture(scope="module")
def app(model_path):
    llm = LLM(model_path, **ENGINE_KW)
    ae = AsyncEngine(llm.engine, ServerMetrics("m"), log_requests=False)
    ae.start()
    yield build_app(ae, ["m"], model_path, ServerMetrics("m2"))
    ae.shutdown()


def test_child_params_and_ids():
    kids = child_params(SamplingParams(n=3, seed=2 ** 64 - 2, temperature=0.5, max_tokens=4, stop=["x"]))
    assert [k.seed for k in kids] == [2 ** 64 - 2, 2 ** 64 - 1, 0] and all(k.n == 1 for k in kids)
    assert all(k.temperature == 0.5 and k.stop == ["x"] for k in kids) and kids[0].stop is not kids[1].stop
    assert [k.seed for k in child_params(SamplingParams(n=2))] == [None, None]
    one = SamplingParams()
    assert child_params(one) == [one] and child_params(one)[0] is one
    assert child_request_ids("r", 1) == ["r"] and child_request_ids("r", 2) == ["0_r", "1_r"]


def _sampled(n: int = 1, seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=n, seed=seed, **kw)


def test_llm_n_seeded_equals_separate_requests(llm):
    out = llm.generate([PROMPT, "Hello world"], [_sampled(3, seed=11), _sampled(1, seed=5)])
    assert [len(o.outputs) for o in out] == [3, 1] and out[0].finished
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    alone = [llm.generate(PROMPT, _sampled(seed=11 + i))[0].outputs[0].token_ids for i in range(3)]
    assert [c.token_ids for c in out[0].outputs] == alone
    assert len({tuple(t) for t in alone}) == 3
    assert out[1].outputs[0].token_ids == llm.generate("Hello world", _sampled(seed=5))[0].outputs[0].token_ids
    unseeded = llm.generate(PROMPT, _sampled(3))[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) == 3
    with pytest.raises(ValueError, match="^n must be 1"):
        llm.engine.add_request(None, PROMPT, _sampled(2))


async def _post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, json=body)


def _frames(r: httpx.Response) -> list:
    assert r.status_code == 200, r.text
    frames = [f[len("data: "):] for f in r.text.split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_server_n3_choices_and_stream_indices(app, llm, route):
    chat = route.endswith("chat/completions")
    base = {"max_tokens": 8, "temperature": 1.0, "seed": 21, "ignore_eos": True, "n": 3}
    base.update({"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT})
    r = asyncio.run(_post(app, route, base))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] if chat else c["text"] for c in body["choices"]]
    assert body["usage"]["completion_tokens"] == 24 and all(c["finish_reason"] == "length" for c in body["choices"])
    # Choice i is the n = 1 request with seed 21 + i.
    for i in range(3):
        one = asyncio.run(_post(app, route, {**base, "n": 1, "seed": 21 + i})).json()
        assert (one["choices"][0]["message"]["content"] if chat else one["choices"][0]["text"]) == texts[i]
    if not chat:
        ids = llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
        offline = llm.generate({"prompt_token_ids": ids}, _sampled(3, seed=21))[0]
        assert [c.text for c in offline.outputs] == texts

    chunks = _frames(asyncio.run(_post(app, route, {**base, "stream": True, "stream_options": {"include_usage": True}})))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    streamed, finish = ["", "", ""], [None, None, None]
    for ch in chunks[:-1]:
        (c,) = ch["choices"]
        streamed[c["index"]] += (c["delta"].get("content") or "") if chat else c["text"]
        if c["finish_reason"] is not None:
            assert finish[c["index"]] is None
            finish[c["index"]] = c["finish_reason"]
    assert streamed == texts and finish == ["length"] * 3
    if chat:  # the role chunk comes first for every choice
        assert [ch["choices"][0]["index"] for ch in chunks[:3]] == [0, 1, 2]
        assert all(ch["choices"][0]["delta"]["role"] == "assistant" for ch in chunks[:3])


def test_server_n3_openai_client(app):
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/v1") as h:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=h, max_retries=0)
            r = await client.completions.create(model="m", prompt=PROMPT, n=3, max_tokens=5, seed=3, temperature=1.0)
            s = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=2,
                                                     max_tokens=4, stream=True, temperature=1.0)
            return r, [ch async for ch in s]
    r, chunks = asyncio.run(run())
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {ch.choices[0].index for ch in chunks if ch.choices} == {0, 1}


def test_server_penalties_and_min_tokens_pass_through(app, llm):
    greedy = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    plain = asyncio.run(_post(app, "/v1/completions", greedy)).json()["choices"][0]["text"]
    pen = {"repetition_penalty": 1.8, "presence_penalty": 0.7, "frequency_penalty": 0.4}
    text = asyncio.run(_post(app, "/v1/completions", {**greedy, **pen})).json()["choices"][0]["text"]
    ids = llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    offline = llm.generate({"prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **pen))[0].outputs[0]
    assert text == offline.text != plain
    # min_tokens holds back a stop token id the model emits early.
    first = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=24,
                                                                   ignore_eos=True))[0].outputs[0].token_ids
    stop = next(t for j, t in enumerate(first) if j >= 1 and t not in first[:j])
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "stop_token_ids": [stop]}
    early = asyncio.run(_post(app, "/v1/completions", body)).json()
    late = asyncio.run(_post(app, "/v1/completions", {**body, "min_tokens": 12})).json()
    assert early["usage"]["completion_tokens"] == first.index(stop) + 1 < 12
    assert late["usage"]["completion_tokens"] >= 12


BAD = [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"best_of": 2}, "best_of"), ({"n": 2, "best_of": 3}, "best_of"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": "x"}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": 1000}, "min_tokens"),  # above the default max_tokens (the rest of the context)
]


@pytest.mark.parametrize("extra,param", BAD, ids=[json.dumps(b[0]) for b in BAD])
def test_server_rejects_bad_values(app, extra, param):
    body = {"prompt": PROMPT, **extra}
    r = asyncio.run(_post(app, "/v1/completions", body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    ok = asyncio.run(_post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 2}))
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
