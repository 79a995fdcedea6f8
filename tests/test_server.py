"""``longflash serve`` end to end: a real server subprocess on a free localhost port, driven by the
official ``openai`` client and raw httpx; a tiny random Qwen3 with a trained BPE tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_fixtures import ServerProcess, make_tiny_model

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256
BODY_LIMIT = 65536
NUM_SPEC = 4


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--api-key", API_KEY, "--served-model-name", MODEL, "--max-model-len",
                       str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "512", "--max-request-body-bytes",
                       str(BODY_LIMIT), "--disable-uvicorn-access-log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _headers() -> dict:
    return {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def metrics(server) -> dict[tuple[str, tuple], float]:
    """All samples of /metrics, keyed by (sample name, sorted labels without model_name)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == MODEL
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def m(snapshot, name: str, **labels) -> float:
    return snapshot[(name, tuple(sorted(labels.items())))]


def wait_idle(server, timeout: float = 20.0) -> dict:
    """Poll /metrics until no request runs or waits and every KV block is free."""
    deadline = time.time() + timeout
    while True:
        snap = metrics(server)
        if (m(snap, "vllm:num_requests_running") == 0 and m(snap, "vllm:num_requests_waiting") == 0
                and m(snap, "longflash:kv_cache_free_blocks") == m(snap, "longflash:kv_cache_total_blocks")):
            return snap
        if time.time() > deadline:
            raise AssertionError(f"server not idle: {snap}")
        time.sleep(0.05)


GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


# ---- the openai client ------------------------------------------------------------------------
def test_completions_openai_client(server, client):
    r = client.completions.create(model=MODEL, prompt="Hello world, the quick brown", max_tokens=12, **GREEDY)
    assert r.object == "text_completion" and r.model == MODEL
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12 and r.usage.prompt_tokens > 0

    # Streaming without include_usage: no usage anywhere, text concatenates to the same greedy text.
    chunks = list(client.completions.create(model=MODEL, prompt="Hello world, the quick brown", max_tokens=12,
                                            stream=True, **GREEDY))
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    # With include_usage: one final chunk with empty choices carries the usage.
    chunks = list(client.completions.create(model=MODEL, prompt="Hello world, the quick brown", max_tokens=12,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == choice.text

    # Token-id prompts give the same result as the text they encode.
    ids = httpx.post(server.url + "/tokenize", headers=_headers(),
                     json={"prompt": "Hello world, the quick brown"}).json()["tokens"]
    assert len(ids) == r.usage.prompt_tokens
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, **GREEDY)
    assert r2.choices[0].text == choice.text


def test_completions_batch_of_prompts(client):
    """A list of prompts (vLLM): prompt p's n choices are indices p*n .. p*n+n-1, each equal to the same
    prompt sent alone; usage counts every prompt once; streamed chunks carry those indices."""
    prompts = ["Hello world, the quick brown", "def fibonacci(n):", "To be, or not to be"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, **GREEDY) for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=2, **GREEDY)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) and r.usage.completion_tokens == 36
    text = {}
    for c in client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=6, stream=True, **GREEDY):
        for ch in c.choices:
            text[ch.index] = text.get(ch.index, "") + ch.text
    assert text == {0: alone[0].choices[0].text, 1: alone[1].choices[0].text}


def test_logit_bias(server):
    """OpenAI's logit_bias: +100 on one token makes greedy decoding emit only it (the text is that
    token's), also with another token biased down."""
    body = {**OK_COMPLETION, "prompt": "def fibonacci(n):", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = _post(server, "/v1/completions", {**body, "logit_bias": {"5": 100}})
    assert r.status_code == 200, r.text
    want = httpx.post(server.url + "/detokenize", headers=_headers(), json={"tokens": [5] * 4}).json()["prompt"]
    assert r.json()["choices"][0]["text"] == want
    both = _post(server, "/v1/completions", {**body, "logit_bias": {"5": -100, "6": 100}}).json()
    want6 = httpx.post(server.url + "/detokenize", headers=_headers(), json={"tokens": [6] * 4}).json()["prompt"]
    assert both["choices"][0]["text"] == want6


def test_completions_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="To be, or not", max_tokens=5, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        # Greedy: the sampled token is the most likely one.
        assert tok_lp <= 0 and abs(tok_lp - max(top.values())) < 1e-5
        assert 1 <= len(top) <= 4


def test_chat_openai_client(server, client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to the world"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, **GREEDY)
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length"
    assert r.usage.completion_tokens == 10
    # The prompt is the chat template applied by the tokenizer.
    tok = httpx.post(server.url + "/tokenize", headers=_headers(), json={"messages": msgs}).json()
    assert tok["count"] == r.usage.prompt_tokens
    # Text parts are joined with newlines (vLLM's chat utils), not concatenated.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say hello"}, {"type": "text", "text": "world"}]}]
    joined = [{"role": "user", "content": "Say hello\nworld"}]
    ids = [httpx.post(server.url + "/tokenize", headers=_headers(), json={"messages": m}).json()["tokens"]
           for m in (parts, joined)]
    assert ids[0] == ids[1]

    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.usage is None for ch in chunks)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    assert chunks[-1].choices[0].finish_reason == "length"

    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()
    assert all(ch.usage is None for ch in chunks[:-1])

    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, logprobs=True, top_logprobs=2,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5 for t in content)


def _ascii_stop(text: str) -> str:
    """A 2-character printable-ASCII substring of ``text`` after its first 3 characters."""
    for i in range(3, len(text) - 1):
        s = text[i:i + 2]
        if all(32 < ord(ch) < 127 for ch in s):
            return s
    raise AssertionError(f"no ASCII pair in {text!r}")


@pytest.mark.parametrize("chat", [False, True])
def test_stop_strings(client, chat):
    def run(stream: bool, **kw):
        if chat:
            msgs = [{"role": "user", "content": "It was the best of times"}]
            if stream:
                chunks = client.chat.completions.create(model=MODEL, messages=msgs, stream=True, **kw)
                chunks = [ch for ch in chunks if ch.choices]
                return "".join(ch.choices[0].delta.content or "" for ch in chunks), chunks[-1].choices[0].finish_reason
            c = client.chat.completions.create(model=MODEL, messages=msgs, **kw).choices[0]
            return c.message.content, c.finish_reason
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt="It was the best of times", stream=True, **kw))
            return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason
        c = client.completions.create(model=MODEL, prompt="It was the best of times", **kw).choices[0]
        return c.text, c.finish_reason

    full, reason = run(False, max_tokens=40, **GREEDY)
    assert reason == "length"
    stop = _ascii_stop(full)
    expected = full[:full.find(stop)]
    for stream in (False, True):
        text, reason = run(stream, max_tokens=40, stop=[stop, "\x00never\x00"], **GREEDY)
        assert (text, reason) == (expected, "stop")


def test_seeded_sampling_reproducible(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=1.0, top_p=0.95,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(seed=1234, stream=True, **kw))
    assert a == b == streamed
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert others - {a}, "different seeds should sample different text"
    msgs = [{"role": "user", "content": "hello"}]
    c1 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.8, seed=7)
    c2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.8, seed=7)
    assert c1.choices[0].message.content == c2.choices[0].message.content


def test_models_health_version_tokenize(server, client):
    models = client.models.list()
    assert [x.id for x in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    import longflash
    assert httpx.get(server.url + "/version").json() == {"version": longflash.__version__}
    tok = httpx.post(server.url + "/tokenize", headers=_headers(), json={"prompt": "Hello world"}).json()
    assert tok["max_model_len"] == MAX_MODEL_LEN and tok["count"] == len(tok["tokens"]) > 0
    detok = httpx.post(server.url + "/detokenize", headers=_headers(), json={"tokens": tok["tokens"]}).json()
    assert detok == {"prompt": "Hello world"}


# ---- bad input --------------------------------------------------------------------------------
def _post(server, path, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=data, headers=_headers() if headers is None else headers,
                      timeout=30)


OK_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}

# (name, path, body, headers or None, status, param, code)
BAD_INPUTS = [
    ("malformed_json", "/v1/completions", b'{"model": "tiny", "prompt": "hi",', None, 400, None, "invalid_json"),
    ("not_an_object", "/v1/completions", b'["hi"]', None, 400, None, "invalid_json"),
    ("invalid_utf8", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe hi"}', None, 400, None,
     "invalid_utf8"),
    ("lone_surrogate", "/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}', None, 400, None,
     "invalid_utf8"),
    ("max_tokens_type", "/v1/completions", {**OK_COMPLETION, "max_tokens": "ten"}, None, 400, "max_tokens",
     "invalid_type"),
    ("temperature_type", "/v1/completions", {**OK_COMPLETION, "temperature": "hot"}, None, 400, "temperature",
     "invalid_type"),
    ("prompt_type", "/v1/completions", {**OK_COMPLETION, "prompt": 5}, None, 400, "prompt", "invalid_type"),
    ("prompt_mixed_list", "/v1/completions", {**OK_COMPLETION, "prompt": [1, "a"]}, None, 400, "prompt", None),
    ("missing_prompt", "/v1/completions", {"model": MODEL}, None, 400, "prompt", "missing_required_parameter"),
    ("messages_type", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, None, 400, "messages", None),
    ("empty_messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, None, 400, "messages", None),
    ("bad_role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, None,
     400, "messages.0.role", None),
    ("nan_temperature", "/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', None, 400, None,
     "invalid_json"),
    ("seed_overflow", "/v1/completions", {**OK_COMPLETION, "seed": 2**70}, None, 400, "seed", "invalid_value"),
    ("image_content", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     None, 400, "messages.0.content", "invalid_value"),
    ("text_part_without_text", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, None, 400,
     "messages.0.content", "invalid_value"),
    ("tool_choice_without_tools", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
     "content": "x"}], "tool_choice": "required"}, None, 400, "tool_choice", "unsupported_field"),
    ("max_tokens_zero", "/v1/completions", {**OK_COMPLETION, "max_tokens": 0}, None, 400, "max_tokens",
     "invalid_value"),
    ("max_tokens_negative", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, None, 400, "max_tokens",
     "invalid_value"),
    ("max_completion_tokens_zero", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, None, 400,
     "max_completion_tokens", "invalid_value"),
    ("stream_options_without_stream", "/v1/completions", {**OK_COMPLETION, "stream_options": {"include_usage": True}},
     None, 400, "stream_options", "invalid_value"),
    ("temperature_negative", "/v1/completions", {**OK_COMPLETION, "temperature": -0.5}, None, 400, "temperature",
     "invalid_value"),
    ("top_p_zero", "/v1/completions", {**OK_COMPLETION, "top_p": 0.0}, None, 400, "top_p", "invalid_value"),
    ("top_p_above_one", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, None, 400, "top_p",
     "invalid_value"),
    ("too_long", "/v1/completions", {**OK_COMPLETION, "max_tokens": MAX_MODEL_LEN}, None, 400, "max_tokens",
     "invalid_value"),
    ("too_long_max_completion_tokens", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
     "content": "x"}], "max_completion_tokens": MAX_MODEL_LEN}, None, 400, "max_completion_tokens", "invalid_value"),
    ("too_long_prompt", "/v1/completions", {**OK_COMPLETION, "prompt": list(range(10, 10 + MAX_MODEL_LEN)),
                                            "max_tokens": 1}, None, 400, "prompt", "invalid_value"),
    ("unknown_model", "/v1/completions", {**OK_COMPLETION, "model": "gpt-7"}, None, 404, "model",
     "model_not_found"),
    ("empty_prompt", "/v1/completions", {**OK_COMPLETION, "prompt": ""}, None, 400, "prompt", "invalid_value"),
    ("empty_token_prompt", "/v1/completions", {**OK_COMPLETION, "prompt": []}, None, 400, "prompt",
     "invalid_value"),
    ("token_out_of_vocab", "/v1/completions", {**OK_COMPLETION, "prompt": [1, 2, 10**6]}, None, 400, "prompt",
     "invalid_value"),
    ("token_negative", "/v1/completions", {**OK_COMPLETION, "prompt": [-1]}, None, 400, "prompt", "invalid_value"),
    ("body_too_large", "/v1/completions", {**OK_COMPLETION, "prompt": "x" * (BODY_LIMIT + 10)}, None, 413, None,
     "request_too_large"),
    ("n_zero", "/v1/completions", {**OK_COMPLETION, "n": 0}, None, 400, "n", "invalid_value"),
    ("logprobs_too_many", "/v1/completions", {**OK_COMPLETION, "logprobs": 1000}, None, 400, "logprobs",
     "invalid_value"),
    ("no_api_key", "/v1/completions", OK_COMPLETION, {"Content-Type": "application/json"}, 401, None,
     "invalid_api_key"),
    ("wrong_api_key", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
     {"Authorization": "Bearer nope"}, 401, None, "invalid_api_key"),
    ("unknown_route", "/v1/embeddings", OK_COMPLETION, None, 404, None, "not_found"),
    ("detokenize_out_of_vocab", "/detokenize", {"tokens": [10**6]}, None, 400, "tokens", "invalid_value"),
    ("logit_bias_bad_key", "/v1/completions", {**OK_COMPLETION, "logit_bias": {"abc": 1}}, None, 400,
     "logit_bias", "invalid_value"),
    ("logit_bias_out_of_range", "/v1/completions", {**OK_COMPLETION, "logit_bias": {"5": 200}}, None, 400,
     "logit_bias", "invalid_value"),
    ("logit_bias_out_of_vocab", "/v1/completions", {**OK_COMPLETION, "logit_bias": {"1000000": 1}}, None, 400,
     "logit_bias", "invalid_value"),
    ("suffix_unsupported", "/v1/completions", {**OK_COMPLETION, "suffix": "x"}, None, 400, "suffix",
     "unsupported_field"),
    ("response_format_json", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
     "response_format": {"type": "json_object"}}, None, 400, "response_format", "unsupported_field"),
    ("tools_unsupported", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
     "tools": [{"type": "function", "function": {"name": "f"}}]}, None, 400, "tools", "unsupported_field"),
    ("prompt_logprobs_unsupported", "/v1/completions", {**OK_COMPLETION, "prompt_logprobs": 1}, None, 400,
     "prompt_logprobs", "unsupported_field"),
    ("continue_with_generation_prompt", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, None, 400,
     "continue_final_message", "invalid_value"),
    ("chat_template_untrusted", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1/0 }}"}, None, 400,
     "chat_template", "invalid_value"),
    ("batch_too_large", "/v1/completions", {**OK_COMPLETION, "prompt": ["a", "b", "c"], "n": 50}, None, 400,
     "prompt", "invalid_value"),
    ("batch_one_bad_prompt", "/v1/completions", {**OK_COMPLETION, "prompt": [[1, 2], [10**6]]}, None, 400,
     "prompt", "invalid_value"),
    ("stop_token_out_of_vocab", "/v1/completions", {**OK_COMPLETION, "stop_token_ids": [10**9]}, None, 400,
     "stop_token_ids", "invalid_value"),
    # a RecursionError in the JSON parser was a 500 with two tracebacks (found by a fresh user)
    ("nested_too_deeply", "/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     None, 400, None, "nested_too_deeply"),
    ("nested_too_deeply_in_ignored_field", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "extra": ' + b'{"a": ' * 3000 + b"1"
     + b"}" * 3000 + b"}", None, 400, None, "nested_too_deeply"),
]


@pytest.mark.parametrize("name,path,body,headers,status,param,code", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(server, name, path, body, headers, status, param, code):
    r = _post(server, path, body, headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    if name == "image_content":  # the unsupported part is named, not pydantic's union errors
        assert "'image_url' is not supported" in err["message"], err["message"]
    if name.startswith("nested_too_deeply"):
        assert "nested too deeply" in err["message"], err["message"]
    # The server keeps serving.
    ok = _post(server, "/v1/completions", OK_COMPLETION)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_bad_input_openai_client_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


# ---- concurrency, abort, metrics ------------------------------------------------------------------
def test_32_concurrent_streaming_clients(server, client):
    before = wait_idle(server)
    total = m(before, "longflash:kv_cache_total_blocks")
    assert m(before, "longflash:kv_cache_free_blocks") == total
    # Shared prefixes exercise the prefix cache; varied lengths give mixed prefill/decode batches.
    prompts = [f"Paged attention stores keys {i} and values {'in blocks ' * (i % 5)}" for i in range(32)]

    def stream_one(i: int) -> str:
        kw = dict(model=MODEL, max_tokens=8 + i % 9, stream=True, **GREEDY)
        if i % 2:
            chunks = client.chat.completions.create(messages=[{"role": "user", "content": prompts[i]}], **kw)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return "".join(c.choices[0].text for c in client.completions.create(prompt=prompts[i], **kw))

    alone = [stream_one(i) for i in range(32)]
    results: list[str | None] = [None] * 32
    errors = []
    start = threading.Barrier(32)

    def worker(i):
        try:
            start.wait()
            results[i] = stream_one(i)
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(e)

    running_seen = []
    done = threading.Event()

    def poll_running():
        while not done.is_set():
            running_seen.append(m(metrics(server), "vllm:num_requests_running"))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    poller = threading.Thread(target=poll_running)
    poller.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    poller.join()
    assert not errors, errors
    assert max(running_seen) >= 2, "the concurrent requests never shared a batch"
    assert results == alone
    after = wait_idle(server)
    assert m(after, "longflash:kv_cache_free_blocks") == total
    assert m(after, "vllm:num_requests_running") == 0
    assert m(after, "vllm:request_success_total", finished_reason="length") - \
        m(before, "vllm:request_success_total", finished_reason="length") == 64


def test_abort_stream_frees_blocks(server):
    before = wait_idle(server)
    total = m(before, "longflash:kv_cache_total_blocks")
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 200,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/completions", headers=_headers(), json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            during = metrics(server)
            assert m(during, "longflash:kv_cache_free_blocks") < total
            assert m(during, "vllm:num_requests_running") == 1
        # Leaving the block closes the connection mid-stream.
    after = wait_idle(server)
    assert m(after, "longflash:kv_cache_free_blocks") == total
    assert m(after, "vllm:request_success_total", finished_reason="abort") == \
        m(before, "vllm:request_success_total", finished_reason="abort") + 1
    assert m(after, "vllm:request_success_total", finished_reason="length") == \
        m(before, "vllm:request_success_total", finished_reason="length")


def test_abort_non_streaming_on_disconnect(server):
    before = wait_idle(server)
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": MAX_MODEL_LEN - 10, "temperature": 0.0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=_headers(), json=body, timeout=httpx.Timeout(30, read=0.3))
    after = wait_idle(server)
    assert m(after, "vllm:request_success_total", finished_reason="abort") == \
        m(before, "vllm:request_success_total", finished_reason="abort") + 1


def test_metrics_names_and_counters(server, client):
    before = wait_idle(server)
    for fam in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                "vllm:e2e_request_latency_seconds_count", "vllm:spec_decode_num_drafts_total",
                "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"):
        assert (fam, ()) in before, fam
    assert m(before, "vllm:spec_decode_num_drafts_total") == 0  # this server runs without a drafter
    assert 0.0 == m(before, "vllm:kv_cache_usage_perc")

    prompt = "Continuous batching lets many requests share one forward pass, " * 3
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, **GREEDY)
    after = metrics(server)

    def delta(name, **labels):
        return m(after, name, **labels) - m(before, name, **labels)

    p, g = r.usage.prompt_tokens, r.usage.completion_tokens
    assert g == 7
    assert delta("vllm:prompt_tokens_total") == p
    assert delta("vllm:generation_tokens_total") == g
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == g - 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_sum") > 0
    assert delta("vllm:prefix_cache_queries_total") == p

    # The same prompt again hits the prefix cache for its full blocks (16 tokens each).
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    again = metrics(server)
    hits = m(again, "vllm:prefix_cache_hits_total") - m(after, "vllm:prefix_cache_hits_total")
    assert hits == (p - 1) // 16 * 16 and hits > 0
    assert m(again, "vllm:num_preemptions_total") == 0


def test_startup_and_request_logs(server, client):
    client.completions.create(model=MODEL, prompt="A very secret prompt text", max_tokens=2)
    time.sleep(0.2)
    log = server.log()
    assert "KV cache:" in log and "maximum concurrency" in log and "model loaded in" in log
    finished = [line for line in log.splitlines() if "finished request cmpl-" in line]
    assert finished and all("prompt_tokens=" in x and "output_tokens=" in x and "latency=" in x for x in finished)
    assert "secret" not in log


# ---- command line -------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longflash.entrypoints.cli", "serve", *args], capture_output=True,
                          text=True, timeout=120)


def test_cli_rejects_bad_flags(model_dir):
    r = _cli(model_dir, "--no-such-flag")
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr
    r = _cli(model_dir, "--speculative-config", "{not json")
    assert r.returncode == 2 and "--speculative-config" in r.stderr and "not valid JSON" in r.stderr
    r = _cli(model_dir, "--speculative-config", '{"num_speculative_tokens": 0}')
    assert r.returncode == 2 and "num_speculative_tokens" in r.stderr
    r = _cli(model_dir, "-tp", "2", "-dcp", "2")  # a GQA model: no latent cache to shard by context
    assert r.returncode == 2 and "error: decode-context parallelism needs an MLA model" in r.stderr, r.stderr[-2000:]
    r = _cli(model_dir, "-tp", "2", "-dcp", "3")
    assert r.returncode == 2 and "must be >= 1 and divide" in r.stderr


def test_spec_decode_metrics_with_a_drafter(model_dir, tmp_path):
    """With a DFlash drafter the vLLM spec-decode counters move consistently and greedy output is
    unchanged (lossless verify)."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import make_drafter
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    drafter = make_drafter(str(tmp_path / "drafter"), cfg, block_size=NUM_SPEC + 1, num_layers=1,
                           mask_token_id=3, target_layer_ids=[0, 1])
    spec = json.dumps({"method": "dflash", "model": drafter, "num_speculative_tokens": NUM_SPEC})
    prompt = "Speculative decoding drafts a block and verifies it in one forward. " * 2
    with ServerProcess(model_dir, "--served-model-name", MODEL, "--num-gpu-blocks-override", "512",
                       "--disable-uvicorn-access-log") as plain:
        ref = openai.OpenAI(base_url=plain.url + "/v1", api_key="x", max_retries=0).completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, **GREEDY).choices[0].text
    with ServerProcess(model_dir, "--served-model-name", MODEL, "--num-gpu-blocks-override", "512",
                       "--speculative-config", spec, "--disable-uvicorn-access-log") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
        assert r.choices[0].text == ref
        after = metrics(s)
        drafts = m(after, "vllm:spec_decode_num_drafts_total")
        proposed = m(after, "vllm:spec_decode_num_draft_tokens_total")
        accepted = m(after, "vllm:spec_decode_num_accepted_tokens_total")
        per_pos = [m(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                   for i in range(NUM_SPEC)]
        assert drafts >= 1 and proposed <= drafts * NUM_SPEC and accepted <= proposed
        assert sum(per_pos) == accepted
        assert all(per_pos[i] >= per_pos[i + 1] for i in range(NUM_SPEC - 1))
        # Tokens: 1 from prefill, then each verify commits accepted + 1.
        assert accepted + drafts + 1 >= 24 - NUM_SPEC


def test_continue_final_message_and_chat_template(server):
    """vLLM's chat extras (a fresh user found them silently ignored): ``continue_final_message`` leaves
    the assistant turn open (fewer prompt tokens: no end-of-turn), a request ``chat_template`` replaces
    the tokenizer's."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    base = {"model": MODEL, "messages": msgs, "max_tokens": 1, "temperature": 0, "add_generation_prompt": False}

    def prompt_tokens(**kw) -> int:
        r = httpx.post(server.url + "/v1/chat/completions", json={**base, **kw}, headers=_headers(), timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]
    closed, open_ = prompt_tokens(), prompt_tokens(continue_final_message=True)
    assert open_ < closed
    # a request chat_template needs --trust-request-chat-template (vLLM's flag): it runs on the engine thread
    tmpl = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    r = httpx.post(server.url + "/v1/chat/completions", json={**base, "chat_template": tmpl}, headers=_headers())
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "--trust-request-chat-template" in r.json()["error"]["message"]


def test_request_chat_template_when_trusted(model_dir):
    with ServerProcess(model_dir, "--trust-request-chat-template", "--max-model-len", "256",
                       "--num-gpu-blocks-override", "64", "--disable-uvicorn-access-log") as s:
        body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
                "max_tokens": 1, "temperature": 0, "add_generation_prompt": False}
        tokens = [httpx.post(s.url + "/v1/chat/completions", json={**body, **kw}, timeout=60).json()["usage"]
                  ["prompt_tokens"] for kw in ({}, {"chat_template": "{% for m in messages %}{{ m['content'] }}"
                                                                     "{% endfor %}"})]
        assert tokens[1] < tokens[0]   # "hiHel" alone: no role markers
        r = httpx.post(s.url + "/v1/chat/completions", json={**body, "chat_template": "{{ 1/0 }}"}, timeout=60)
        assert r.status_code == 400 and "division by zero" in r.json()["error"]["message"], r.text
        assert httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        # a body over LARGE_BODY_BYTES is decoded in a worker thread: same answers, same errors
        big = {**body, "user": "u" * (2 << 20)}
        assert httpx.post(s.url + "/v1/chat/completions", json=big, timeout=60).json()["usage"]["prompt_tokens"] \
            == tokens[0]
        r = httpx.post(s.url + "/v1/chat/completions", json={**big, "max_tokens": "many"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        deep = b'{"messages": ' + b"[" * (2 << 20) + b"]" * (2 << 20) + b"}"  # too deep to parse, in the thread
        r = httpx.post(s.url + "/v1/chat/completions", content=deep, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "nested_too_deeply", r.text
        assert "Traceback" not in s.log()



def test_bench_serve_base_url_with_api_key(server, model_dir):
    """``bench serve --base-url`` against a server started with --api-key: --api-key (or
    $OPENAI_API_KEY, as vllm bench serve) is sent; without it the 401 is a one-line error, not a
    traceback (found by a fresh user: KeyError 'data')."""
    cmd = [sys.executable, "-m", "longflash.entrypoints.cli", "bench", "serve", "--base-url", server.url,
           "--model", model_dir, "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
           "--peak-bandwidth-gbs", "10"]
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "LONGFLASH_API_KEY")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1 and "HTTP 401" in r.stderr and "--api-key" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(env, OPENAI_API_KEY=API_KEY))
    assert r.returncode == 0 and "Serving Benchmark Result" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
