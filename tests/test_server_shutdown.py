"""Server shutdown (SIGINT/SIGTERM → ``AsyncEngine.stop_all_requests``, installed by ``longflash serve``'s
uvicorn subclass): every request in flight — each choice of an n > 1 request — ends with
``ServerShuttingDown`` (the handlers answer 503 / an error frame and ``[DONE]``), its KV blocks are freed,
and no new request is queued. The n choices of a request are queued by one engine-thread command."""

import asyncio
import signal

import pytest

from longflash import LLM, SamplingParams
from longflash.entrypoints.server.async_engine import AsyncEngine, ServerShuttingDown
from longflash.entrypoints.server.metrics import ServerMetrics
from server_fixtures import ServerProcess, make_tiny_model


def test_stop_all_requests_ends_streams_and_refuses_new_ones():
    llm = LLM(speculative_config="off", max_num_seqs=4)
    engine = llm.engine
    free0 = engine.block_manager.num_free_blocks
    ae = AsyncEngine(engine, ServerMetrics("m"), log_requests=False)
    ae.start()
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    def build(engine):
        return {"prompt_token_ids": [5, 6, 7]}, SamplingParams(**{**params.__dict__})

    async def run():
        streams = await ae.add_requests([("0_a", build), ("1_a", build), ("b", build)])
        await streams[0].get()  # generating
        ae.stop_all_requests()
        ends = []
        for s in streams:
            while True:
                try:
                    out = await s.get()
                except ServerShuttingDown as e:
                    ends.append(str(e))
                    break
                assert not out.finished
        with pytest.raises(ServerShuttingDown):
            await ae.add_requests([("c", build)])
        return ends

    try:
        ends = asyncio.run(run())
    finally:
        ae.shutdown()
    assert ends == ["the server is shutting down"] * 3
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == free0


@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 0), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_serve_exits_with_the_documented_status_and_no_traceback(tmp_path, sig, status):
    """``longflash serve`` after SIGINT exits 0 and after SIGTERM 143, without a traceback, once the
    engine is stopped (uvicorn >= 0.29 re-raises the signal after its shutdown: Python's default SIGINT
    handler then printed a KeyboardInterrupt traceback and the status was 130 / -2; found by a fresh user)."""
    model = make_tiny_model(str(tmp_path / "model"))
    srv = ServerProcess(model, "--speculative-config", "off")
    try:
        srv.proc.send_signal(sig)
        assert srv.proc.wait(timeout=60) == status, srv.log()[-3000:]
        assert "Traceback" not in srv.log(), srv.log()[-3000:]
    finally:
        srv.stop()
