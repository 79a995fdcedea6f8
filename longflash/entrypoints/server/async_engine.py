"""The engine stepping in a background thread, with per-request asyncio queues (continuous batching).

All access to the ``LLMEngine`` (adding, aborting, tokenizing, stepping) happens on one thread, the
engine thread. The event loop hands work to it as commands (callables) through a thread-safe queue;
the engine thread runs pending commands between steps, so a request that arrives mid-run joins the
next step. Outputs go back to each request's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``.

NOTE: a request may be aborted twice (client disconnect after it finished, or during add); aborting an
unknown id is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable

from longflash.engine.llm_engine import LLMEngine
from longflash.outputs import RequestOutput

logger = logging.getLogger("longflash.server")


class EngineRequestError(RuntimeError):
    """The engine failed this request (its other requests go on)."""


class ServerShuttingDown(EngineRequestError):
    """The server is shutting down (SIGINT/SIGTERM): the request was stopped or not queued."""


class RequestStream:
    """Outputs of one request, filled by the engine thread, read by one coroutine.

    Items are cumulative ``RequestOutput``s; ``get()`` returns the newest one available (outputs are
    cumulative, so skipping an older one loses nothing) and raises EngineRequestError if the engine
    failed the request.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe: called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed (shutdown)
            pass

    async def get(self) -> RequestOutput:
        item = await self.queue.get()
        while not isinstance(item, BaseException) and not self.queue.empty():
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(i, output)`` of the streams as outputs arrive, until every stream has finished (the choices
    of a request with n > 1). Raises the first EngineRequestError of any stream; the other streams
    are left as they are (the caller aborts them)."""
    if len(streams) == 1:  # no tasks for the common case
        async for out in streams[0]:
            yield 0, out
        return
    queue_: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue_.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 — handed to the reader
            queue_.put_nowait((i, e))
        queue_.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            i, item = await queue_.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class AsyncEngine:
    """Runs ``engine`` on a background thread.

    Args:
        engine: the LLMEngine; from now on touched only by the engine thread.
        metrics: object with ``update(engine)`` and ``count_finished(reason)`` (ServerMetrics), or None.
        log_requests: log each finished request (id, token counts, latency; never the prompt text).
    """

    def __init__(self, engine: LLMEngine, metrics=None, log_requests: bool = True,
                 on_dead: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.on_dead = on_dead
        self.metrics = metrics
        self.log_requests = log_requests
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="longflash-engine", daemon=True)
        self.dead: BaseException | None = None
        self.draining = False  # set by stop_all_requests: no new request is queued

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stop_all_requests(self, reason: str = "the server is shutting down") -> None:
        """Thread-safe (called from the signal handler): queue no new request, and end every request in
        flight with :class:`ServerShuttingDown` (its handler answers 503 / a final error frame and
        ``[DONE]``; its KV blocks are freed before the next engine step)."""
        self.draining = True

        def cmd() -> None:
            for rid, stream in list(self._streams.items()):
                stream.put(ServerShuttingDown(reason))
                self.engine.abort_request(rid)
            self._streams.clear()

        self._submit(cmd)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    # ---- event-loop side ------------------------------------------------------------------
    def _submit(self, cmd: Callable[[], None]) -> None:
        self._commands.put(cmd)
        self._wakeup.set()

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; return its result or raise its error."""
        if self.draining:
            raise ServerShuttingDown("the server is shutting down")
        if not self.is_alive:
            raise EngineRequestError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)

        def cmd() -> None:
            try:
                r = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 — handed to the caller
                loop.call_soon_threadsafe(settle, False, e)
            else:
                loop.call_soon_threadsafe(settle, True, r)

        self._submit(cmd)
        return await fut

    async def add_request(self, request_id: str, build: Callable[[LLMEngine], tuple[Any, Any]]) -> RequestStream:
        """Queue a request. ``build(engine) -> (prompt, SamplingParams)`` runs on the engine thread (it
        may tokenize). Raises ValueError from the engine (nothing queued) for invalid input."""
        return (await self.add_requests([(request_id, build)]))[0]

    async def add_requests(self, items: list[tuple[str, Callable[[LLMEngine], tuple[Any, Any]]]]) -> list[RequestStream]:
        """Queue several requests (e.g. the n choices of one API request) in one engine-thread command:
        all of them before the next engine step, or none (a failing one aborts those already added and
        its ValueError is raised). ``items``: (request id, build) pairs as for :meth:`add_request`."""
        loop = asyncio.get_running_loop()
        streams = [RequestStream(rid, loop) for rid, _ in items]
        arrival = time.time()

        def add(engine: LLMEngine) -> None:
            added: list[str] = []
            try:
                for (rid, build), stream in zip(items, streams):
                    prompt, params = build(engine)
                    engine.add_request(rid, prompt, params, arrival_time=arrival)
                    added.append(rid)
                    self._streams[rid] = stream
            except BaseException:
                for rid in added:
                    self._streams.pop(rid, None)
                    engine.abort_request(rid)
                raise

        try:
            await self.run(add)
        except asyncio.CancelledError:
            for rid, _ in items:
                self.abort(rid)
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """Thread-safe, fire and forget: abort the request and free its KV blocks before the next step."""

        def cmd() -> None:
            self._streams.pop(request_id, None)
            if self.engine.abort_request(request_id):
                logger.info("aborted request %s", request_id)
                if self.metrics is not None:
                    self.metrics.count_finished("abort")

        self._submit(cmd)

    # ---- engine thread --------------------------------------------------------------------
    def _run_commands(self) -> bool:
        ran = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            cmd()

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._wakeup.clear()
                ran = self._run_commands()
                if not self.engine.has_unfinished_requests():
                    if ran and self.metrics is not None:
                        self.metrics.update(self.engine)
                    self.engine.check_health()  # a dead worker rank ends the loop even when idle
                    self._wakeup.wait(timeout=1.0)
                    continue
                self._step()
        except BaseException as e:  # noqa: BLE001 — the loop must report, not vanish
            logger.exception("the engine loop died")
            self.dead = e
            for stream in self._streams.values():
                stream.put(EngineRequestError(f"the engine loop died: {e}"))
            self._streams.clear()
            if self.on_dead is not None:
                self.on_dead(e)

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as e:
            if engine.config.tensor_parallel_size > 1:
                # NOTE: with worker processes a failed step leaves the ranks out of step (a peer
                # died, or a collective timed out mid-forward): nothing can run after it, so the
                # loop dies (requests in flight fail, /health turns 503, the server exits).
                raise
            # A failure of the batched forward cannot be attributed to one request: fail the
            # requests in flight, free their blocks, keep serving.
            logger.exception("engine step failed; failing %d in-flight requests", len(engine.requests))
            for rid in list(engine.requests):
                engine.abort_request(rid)
                self._fail(rid, e)
            outputs = []
        failed, engine.failed_requests = engine.failed_requests, []
        for rid, e in failed:
            self._fail(rid, e)
        if self.metrics is not None:
            self.metrics.update(engine)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                if self.log_requests:
                    self._log_finished(out)
            if stream is not None:
                stream.put(out)

    def _fail(self, request_id: str, e: BaseException) -> None:
        if self.metrics is not None:
            self.metrics.count_finished("error")
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(EngineRequestError(f"the engine failed this request: {type(e).__name__}: {e}"))

    @staticmethod
    def _log_finished(out: RequestOutput) -> None:
        m = out.metrics
        comp = out.outputs[0]
        e2e = m.e2e_latency if m is not None and m.e2e_latency is not None else float("nan")
        ttft = m.time_to_first_token if m is not None and m.time_to_first_token is not None else float("nan")
        logger.info("finished request %s: prompt_tokens=%d output_tokens=%d cached_tokens=%d finish_reason=%s "
                    "ttft=%.3fs latency=%.3fs", out.request_id, len(out.prompt_token_ids), len(comp.token_ids),
                    out.num_cached_tokens, comp.finish_reason, ttft, e2e)
