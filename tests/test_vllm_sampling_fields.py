"""vLLM's request fields that change the output: ``include_stop_str_in_output``, ``truncate_prompt_tokens``,
``allowed_token_ids`` are implemented (offline ``SamplingParams`` and the server); ``bad_words``, the
``guided_*`` fields, ``structured_outputs``, ``reasoning_effort`` and ``modalities`` other than text are a
400 ``unsupported_field`` naming the field (they were silently ignored: found by a fresh user)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from longflash import LLM, SamplingParams
from longflash.entrypoints.server.api_server import build_app
from longflash.entrypoints.server.async_engine import AsyncEngine
from longflash.entrypoints.server.metrics import ServerMetrics
from longflash.runner.sampler import process_logits
from server_fixtures import make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(make_tiny_model(str(tmp_path_factory.mktemp("tiny_fields") / "model")), max_model_len=128,
               num_gpu_blocks=32)


@pytest.fixture(scope="module")
def app(llm):
    ae = AsyncEngine(llm.engine, ServerMetrics("m"))
    ae.start()
    yield build_app(ae, ["m"], "p", ServerMetrics("m1"))
    ae.shutdown()


def _post(app, path: str, body: dict) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body)
    return asyncio.run(run())


def test_sampling_params_validate_the_new_fields():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1"):
            SamplingParams(truncate_prompt_tokens=bad)
    for bad in ([], [-1], [1.0], "3"):
        with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="include_stop_str_in_output must be true or false"):
        SamplingParams(include_stop_str_in_output=1)
    assert SamplingParams(truncate_prompt_tokens=-1, allowed_token_ids=(3, 4)).allowed_token_ids == [3, 4]


def test_allowed_token_ids_mask_comes_first():
    logits = torch.randn(2, 10)
    sp = SamplingParams(allowed_token_ids=[2, 7], logit_bias={3: 100.0})
    out = process_logits(logits, sp, [1], [], [5], set())
    assert torch.isinf(out[:, [0, 1, 3, 4, 5, 6, 8, 9]]).all() and torch.equal(out[:, [2, 7]], logits[:, [2, 7]])


def test_offline_allowed_token_ids_and_truncation(llm):
    out = llm.generate("Hello world, hello", SamplingParams(temperature=1.0, seed=1, max_tokens=12,
                                                            allowed_token_ids=[40, 41], ignore_eos=True))[0]
    assert set(out.outputs[0].token_ids) <= {40, 41} and len(out.outputs[0].token_ids) == 12
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog.")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                 truncate_prompt_tokens=3))[0]
    assert cut.prompt_token_ids == ids[-3:]
    assert cut.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids[-3:]}, sp)[0].outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1)
                        )[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(129\) must be <= max_model_len \(128\)"):
        llm.generate("hi", SamplingParams(truncate_prompt_tokens=129))
    with pytest.raises(ValueError, match="allowed_token_ids contains 100000, outside the vocabulary"):
        llm.generate("hi", SamplingParams(allowed_token_ids=[1, 100000]))
    # every allowed id is an EOS / stop id that min_tokens masks: refused when added (it used to fail in the
    # sampler with a PyTorch error, or, greedy, emit a masked token)
    eos = sorted(llm.engine.eos_token_ids)
    for bad in (SamplingParams(allowed_token_ids=eos, min_tokens=3, max_tokens=8),
                SamplingParams(allowed_token_ids=[40, 41], stop_token_ids=[40, 41], min_tokens=1, max_tokens=8,
                               temperature=0.8, seed=0)):
        with pytest.raises(ValueError, match="all EOS / stop_token_ids, which min_tokens"):
            llm.generate("hi", bad)
    ok = llm.generate("hi", SamplingParams(allowed_token_ids=[40, 41], stop_token_ids=[40], min_tokens=2,
                                           max_tokens=4, temperature=0))[0].outputs[0].token_ids
    assert ok[:2] == [41, 41]  # 40 masked before min_tokens, then allowed


def test_truncated_prompt_text_is_vllms(llm):
    """``RequestOutput.prompt`` of a truncated prompt follows vLLM: the text as given (v1
    ``LLMEngine.add_request`` and the server's renderer pass the input's text, untruncated), None for token
    ids, the rendered conversation for ``LLM.chat``; ``prompt_token_ids`` are the kept tokens."""
    text = "The quick brown fox jumps over the lazy dog."
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    sp = SamplingParams(max_tokens=1, truncate_prompt_tokens=3)
    for prompt, shown in ((text, text), ({"prompt": text}, text), ({"prompt_token_ids": ids}, None), (ids, None)):
        for n in (1, 2):
            out = llm.generate(prompt, SamplingParams(max_tokens=1, truncate_prompt_tokens=3, n=n))[0]
            assert (out.prompt, out.prompt_token_ids) == (shown, ids[-3:]), (prompt, n)
    chat = llm.chat([{"role": "user", "content": text}], sp)[0]
    full = llm.chat([{"role": "user", "content": text}], SamplingParams(max_tokens=1))[0]
    assert chat.prompt == full.prompt and chat.prompt_token_ids == full.prompt_token_ids[-3:]


def test_include_stop_str_in_output(llm):
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = llm.generate("Hello world", base)[0].outputs[0].text
    stop = text[3:5]
    assert stop and stop not in text[:4]
    cut = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop))[0]
    kept = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop,
                                                      include_stop_str_in_output=True))[0]
    assert cut.outputs[0].text == text[:3] and kept.outputs[0].text == text[:5]
    assert kept.outputs[0].stop_reason == stop


def test_server_fields(app, llm):
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog.")
    r = _post(app, "/v1/completions", {"prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4, r.text
    r = _post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                                            "allowed_token_ids": [40], "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == llm.get_tokenizer().decode([40] * 6)
    text = _post(app, "/v1/completions", {"prompt": "Hello world", "max_tokens": 12, "temperature": 0,
                                          "ignore_eos": True}).json()["choices"][0]["text"]
    for stream in (False, True):
        r = _post(app, "/v1/completions", {"prompt": "Hello world", "max_tokens": 12, "temperature": 0,
                                           "ignore_eos": True, "stop": text[3:5], "include_stop_str_in_output": True,
                                           "stream": stream})
        got = (r.json()["choices"][0]["text"] if not stream else
               "".join(__import__("json").loads(line[6:])["choices"][0]["text"]
                       for line in r.text.splitlines() if line.startswith("data: {")))
        assert got == text[:5], (stream, r.text)
    for body, param in (({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
                        ({"truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
                        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
                        ({"allowed_token_ids": []}, "allowed_token_ids")):
        r = _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("field, value", [
    ("bad_words", ["x"]), ("guided_json", {"type": "object"}), ("guided_regex", "a+"), ("guided_choice", ["a"]),
    ("guided_grammar", "root ::= 'a'"), ("structured_outputs", {"regex": "a"}), ("reasoning_effort", "low"),
    ("modalities", ["text", "audio"]), ("use_beam_search", True), ("length_penalty", 0.5),
    ("logits_processors", ["mod.fn"]), ("return_tokens_as_token_ids", True), ("spaces_between_special_tokens", False),
    ("documents", [{"text": "d"}]),
])
def test_unimplemented_vllm_fields_are_refused_by_name(app, field, value):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = _post(app, path, {**body, "max_tokens": 1, field: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "unsupported_field" and field in err["message"], err
    for neutral in ({"modalities": ["text"]}, {"modalities": []}, {"use_beam_search": False},
                    {"length_penalty": 1.0}, {"spaces_between_special_tokens": True}):  # asks for nothing unsupported
        r = _post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                **neutral})
        assert r.status_code == 200, (neutral, r.text)
