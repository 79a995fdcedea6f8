"""An exception inside the engine for one request fails that request only (the app in-process)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from longflash.config import EngineConfig
from longflash.engine.llm_engine import LLMEngine
from longflash.entrypoints.server.api_server import build_app
from longflash.entrypoints.server.async_engine import AsyncEngine
from longflash.entrypoints.server.metrics import ServerMetrics
from server_fixtures import make_tiny_model

POISON = [7, 7, 7, 7, 7]


@pytest.fixture(scope="module")
def app_and_engine(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny_err") / "model"))
    engine = LLMEngine(EngineConfig(model=path, num_gpu_blocks=128, max_model_len=256))
    real_sample = engine._sample

    def faulty_sample(seq, logits, *args, **kwargs):
        # Fails on the third generated token of a poisoned prompt, while other requests share the batch.
        if seq.prompt_token_ids == POISON and seq.num_output_tokens >= 2:
            raise RuntimeError("injected sampler fault")
        return real_sample(seq, logits, *args, **kwargs)

    engine._sample = faulty_sample
    metrics = ServerMetrics("m")
    ae = AsyncEngine(engine, metrics)
    ae.start()
    yield build_app(ae, ["m"], path, metrics), engine
    ae.shutdown()


def test_engine_error_fails_only_that_request(app_and_engine):
    app, engine = app_and_engine
    good = {"prompt": [11, 12, 13, 14], "max_tokens": 30, "temperature": 0.0, "ignore_eos": True}
    bad = {"prompt": POISON, "max_tokens": 30, "temperature": 0.0, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            alone = (await c.post("/v1/completions", json=good)).json()
            rs = await asyncio.gather(c.post("/v1/completions", json=good), c.post("/v1/completions", json=bad),
                                      c.post("/v1/completions", json={**bad, "stream": True}),
                                      c.post("/v1/completions", json=good))
            after = await c.post("/v1/completions", json=good)
            return alone, rs, after

    alone, (g1, b1, b2, g2), after = asyncio.run(run())
    assert g1.status_code == g2.status_code == after.status_code == 200
    assert g1.json()["choices"][0]["text"] == g2.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    assert g1.json()["usage"]["completion_tokens"] == 30
    assert b1.status_code == 500
    err = b1.json()["error"]
    assert err["type"] == "server_error" and "injected sampler fault" in err["message"]
    # The stream had started (200): the failure arrives as an error frame, then [DONE].
    assert b2.status_code == 200
    frames = [f for f in b2.text.split("\n\n") if f]
    assert '"error"' in frames[-2] and "injected sampler fault" in frames[-2] and frames[-1] == "data: [DONE]"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests()


def test_context_length_error_names_the_field_to_change():
    """A prompt that alone fills the context is the prompt's fault, else max_tokens' (the 400's param)."""
    from longflash.entrypoints.server.api_server import _param_of
    msg = "this model's maximum context length is 4096 tokens, but {} prompt tokens + max_tokens {} exceed it"
    assert _param_of(msg.format(9001, 4)) == "prompt"
    assert _param_of(msg.format(4096, 1)) == "prompt"
    assert _param_of(msg.format(90, 5000)) == "max_tokens"
    alone = ("this model's maximum context length is 4096 tokens, but the prompt alone has 4096 tokens (room for "
             "at least one generated token is needed)")
    assert _param_of(alone) == "prompt"
