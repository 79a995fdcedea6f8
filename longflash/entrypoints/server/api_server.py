"""FastAPI app: OpenAI-compatible routes on top of the background engine loop.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /version,
POST /tokenize, POST /detokenize, GET /metrics.

Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
input (malformed JSON, invalid UTF-8, wrong types, out-of-range values, prompts the engine rejects),
401 without the API key, 404 for an unknown model or route, 413 for a body over the limit, 500 when
the engine fails a request (the other requests go on).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hmac
import json
import logging
import re
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import longflash
from longflash.engine.llm_engine import tokenize_text
from longflash.entrypoints.chat_request import ChatOptionError, check_messages, render_chat, template_options
from longflash.entrypoints.chat_utils import check_chat_template, check_content_format
from longflash.entrypoints.parallel_sampling import child_params, child_request_ids
from longflash.entrypoints.server.async_engine import (AsyncEngine, EngineRequestError, RequestStream, ServerShuttingDown,
                                                       merge_streams)
from longflash.entrypoints.server.metrics import ServerMetrics
from longflash.entrypoints.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                                                   DetokenizeRequest, TokenizeRequest, chat_logprobs,
                                                   completion_logprobs, error_body, usage)
from longflash.sampling_params import SamplingParams

logger = logging.getLogger("longflash.server")

DEFAULT_MAX_BODY_BYTES = 32 << 20
_PARAM_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "logprobs", "stop", "seed", "n",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids", "logit_bias",
                 "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "truncate_prompt_tokens",
                 "allowed_token_ids")
MAX_N = 128  # completions per request; each is an engine request


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) with int keys; ValueError naming the field
    for a key that is not a token id."""
    if not bias:
        return None
    out = {}
    for k, v in bias.items():
        if not k.strip().lstrip("-").isdigit():
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
        out[int(k)] = v
    return out


def _unavailable_code(e: EngineRequestError) -> str:
    return "server_shutting_down" if isinstance(e, ServerShuttingDown) else "engine_unavailable"


def _param_of(message: str) -> str | None:
    """The request field a ValueError from SamplingParams/the engine is about."""
    first = message.split(" ", 1)[0]
    if first in _PARAM_FIELDS:
        return first
    m = re.search(r"context length is (\d+) tokens, but (\d+) prompt tokens", message)
    if m:  # the prompt alone fills the context: the prompt is what to shorten, else max_tokens
        return "prompt" if int(m.group(2)) >= int(m.group(1)) else "max_tokens"
    if "prompt" in message or "token id" in message:
        return "prompt"
    return None


def _message_dicts(messages: list[ChatMessage] | None) -> list[dict]:
    """The request's messages as dicts (validated again and put in the content format by
    ``chat_request.render_chat``). ApiError 400 (param ``messages``) for missing or empty messages:
    ``chat_request.check_messages``, one error for the chat route and ``/tokenize``."""
    try:
        check_messages(messages)
    except ChatOptionError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code or "invalid_value") from None
    return [m.model_dump(exclude_none=True) for m in messages]


def _template_options(req, default_template: str | None, trusted: bool) -> tuple[bool, dict]:
    """``chat_request.template_options`` of a chat or tokenize request; ApiError 400 naming the field."""
    try:
        return template_options(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs,
                                req.chat_template, default_template, trusted)
    except ChatOptionError as e:
        code = "unsupported_field" if e.param.endswith(".tools") else "invalid_value"
        raise ApiError(400, str(e), param=e.param, code=code) from None


def _max_tokens_field(req) -> str:
    """The output-length field a request set: a chat request's ``max_completion_tokens`` (OpenAI's newer
    name) if given, else ``max_tokens``; errors about the length name it."""
    return "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"


# Bodies above this many bytes are decoded and validated in a worker thread (a 12 MB chat body with
# 400,000 content parts held the event loop for ~2 s: found by a fresh user).
LARGE_BODY_BYTES = 1 << 20
# Text prompts (and chat conversations) of at least this many characters are tokenized (rendered) on a worker
# thread with the server's own tokenizer copy, not on the engine thread between steps: a 3 MB prompt takes ~2-5 s
# to tokenize, during which every stream would stall (found by a fresh-user review, session 28). Shorter ones
# take the engine thread (well under a millisecond each).
LARGE_PROMPT_CHARS = 1 << 16


def _conversation_chars(messages: list[dict]) -> int:
    """The characters of a conversation's text content (strings and text parts; what a chat template renders
    besides its own markup), to send long conversations off the engine thread (``LARGE_PROMPT_CHARS``)."""
    n = 0
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            n += len(c)
        elif isinstance(c, list):
            n += sum(len(p.get("text") or "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


class _Server:
    """The routes' shared state."""

    def __init__(self, async_engine: AsyncEngine, served_model_names: list[str], model_path: str,
                 metrics: ServerMetrics, api_key: str | None, max_body_bytes: int, speculative_config: dict | None,
                 trust_request_chat_template: bool = False, chat_template_content_format: str = "auto",
                 chat_template: str | None = None):
        self.ae = async_engine
        self.engine = async_engine.engine
        self.names = served_model_names
        self.model_path = model_path
        self.metrics = metrics
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_logprobs = self.engine.config.max_logprobs  # the engine argument (--max-logprobs)
        self.speculative_config = speculative_config
        self.trust_request_chat_template = trust_request_chat_template
        self.content_format = check_content_format(chat_template_content_format)
        self.chat_template = None if chat_template is None else check_chat_template(chat_template)
        self.created = int(time.time())
        # a copy for the worker threads that tokenize long prompts (the engine thread keeps the original); None
        # (long prompts then take the engine thread too) without a tokenizer or one that cannot be copied
        self.tokenizer = None
        if self.engine.tokenizer is not None:
            try:
                self.tokenizer = copy.deepcopy(self.engine.tokenizer)
            except Exception as e:  # noqa: BLE001 — an optimization; the engine thread can still tokenize
                logger.warning("long prompts will be tokenized on the engine thread: the tokenizer cannot be "
                               "copied (%s: %s)", type(e).__name__, e)
        self._tokenizer_lock = threading.Lock()
        gc = self.engine.generation_config
        self.defaults = {k: gc[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in gc}
        if gc.get("do_sample") is False:
            self.defaults["temperature"] = 0.0

    # ---- request checks -------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def parse(self, request: Request, cls: type[BaseModel]) -> Any:
        """Read the body under the size limit, decode strict UTF-8, parse JSON, validate types."""
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.max_body_bytes:
            raise ApiError(413, f"the request body ({cl} bytes) exceeds the limit of {self.max_body_bytes} bytes",
                           code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise ApiError(413, f"the request body exceeds the limit of {self.max_body_bytes} bytes",
                               code="request_too_large")
        if len(body) > LARGE_BODY_BYTES:  # parsed off the event loop: /health and streams keep answering
            return await asyncio.to_thread(self._decode, bytes(body), cls)
        return self._decode(bytes(body), cls)

    @staticmethod
    def _decode(body: bytes, cls: type[BaseModel]) -> Any:
        """UTF-8, JSON object, no lone surrogates, ``cls``'s types: the request, or ApiError 400 (also for
        arrays/objects nested deeper than the parser's recursion limit, ~1000 levels: a RecursionError
        was a 500, found by a fresh user)."""
        try:
            return _Server._decode_checked(body, cls)
        except RecursionError:  # json.loads, json.dumps or validation of a deeply nested body
            raise ApiError(400, "the request body is nested too deeply: its JSON arrays/objects reach the "
                           f"parser's recursion limit ({sys.getrecursionlimit()} levels)", code="nested_too_deeply"
                           ) from None

    @staticmethod
    def _decode_checked(body: bytes, cls: type[BaseModel]) -> Any:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ApiError(400, f"the request body is not valid UTF-8 (invalid byte at offset {e.start})",
                           code="invalid_utf8") from None
        try:
            obj = json.loads(text, parse_constant=_reject_constant)
        except ValueError as e:  # JSONDecodeError, or NaN/Infinity (not JSON)
            raise ApiError(400, f"malformed JSON in the request body: {e}", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        try:  # lone surrogates (\ud800) decode from JSON but are not text
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "the request contains an invalid Unicode escape (a lone surrogate)",
                           code="invalid_utf8") from None
        try:
            return cls.model_validate(obj)
        except ValidationError as e:
            err = e.errors()[0]
            if not err["loc"]:  # a whole-request check (protocol: unimplemented OpenAI fields)
                msg = str(err["msg"]).removeprefix("Value error, ")
                raise ApiError(400, msg, param=msg.split(" ", 1)[0], code="unsupported_field") from None
            loc = [str(x) for x in err["loc"]]
            # Drop union-branch names (e.g. prompt.str) so that the param is the field path.
            param = ".".join(x for x in loc if x not in ("str", "int", "list[int]", "list[str]", "list[list[int]]",
                                                         "list[TextPart]", "TextPart"))
            if err["type"] == "missing":  # OpenAI's wording and code for an absent required field
                raise ApiError(400, f"missing required parameter {param!r}", param=param or None,
                               code="missing_required_parameter") from None
            msg = str(err["msg"]).removeprefix("Value error, ")
            raise ApiError(400, f"invalid field {param!r}: {msg}", param=param or None,
                           code="invalid_type" if "type" in err["type"] or "parsing" in err["type"]
                           else "invalid_value") from None

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.names:
            raise ApiError(404, f"The model `{model}` does not exist. Served models: {', '.join(self.names)}",
                           param="model", code="model_not_found")
        return self.names[0]

    def sampling_params(self, req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if not 1 <= req.n <= MAX_N:
            raise ApiError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n", code="invalid_value")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, f"best_of is not supported (vLLM V1 dropped it); leave it out or equal to n, got "
                           f"best_of={req.best_of} with n={req.n}", param="best_of", code="invalid_value")
        if max_tokens is not None and max_tokens < 1:
            name = _max_tokens_field(req)
            raise ApiError(400, f"{name} must be >= 1, got {max_tokens}", param=name, code="invalid_value")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options can only be set when stream is true", param="stream_options",
                           code="invalid_value")
        if logprobs is not None and not 0 <= logprobs <= self.max_logprobs:
            raise ApiError(400, f"logprobs must be in [0, {self.max_logprobs}], got {logprobs}", param="logprobs",
                           code="invalid_value")
        if req.seed is not None and not -2**63 <= req.seed < 2**64:
            raise ApiError(400, f"seed must be a 64-bit integer, got {req.seed}", param="seed", code="invalid_value")
        d = self.defaults

        def pick(name: str, default):
            v = getattr(req, name)
            return v if v is not None else d.get(name, default)

        try:
            return SamplingParams(temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
                                  top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), seed=req.seed,
                                  # None (left out): the rest of the context (LLMEngine.max_output_tokens).
                                  max_tokens=max_tokens, stop=req.stop,
                                  stop_token_ids=req.stop_token_ids,
                                  ignore_eos=req.ignore_eos, logprobs=logprobs,
                                  skip_special_tokens=req.skip_special_tokens, n=req.n,
                                  presence_penalty=pick("presence_penalty", 0.0),
                                  frequency_penalty=pick("frequency_penalty", 0.0),
                                  repetition_penalty=pick("repetition_penalty", 1.0), min_tokens=req.min_tokens,
                                  logit_bias=_logit_bias(req.logit_bias),
                                  include_stop_str_in_output=req.include_stop_str_in_output,
                                  truncate_prompt_tokens=req.truncate_prompt_tokens,
                                  allowed_token_ids=req.allowed_token_ids)
        except ValueError as e:
            raise ApiError(400, str(e), param=_param_of(str(e)), code="invalid_value") from None

    async def add(self, request_id: str, prompt_fn: Callable[[Any], list[int]] | list[Callable[[Any], list[int]]],
                  params: SamplingParams, max_tokens_field: str = "max_tokens") -> list[RequestStream]:
        """Queue a request whose token ids ``prompt_fn(engine)`` computes (once) on the engine thread:
        ``params.n`` engine requests (``parallel_sampling.py``), one stream each, choice i = stream i.
        A list of prompt functions (a batch of prompts) queues ``params.n`` requests per prompt, prompt p's
        choices at ``p * n .. p * n + n - 1``. Everything is queued by one engine-thread command (before
        the next step), or nothing: raises ApiError 400 for input the engine rejects (a length error
        blamed on max_tokens names ``max_tokens_field``, the field the request set)."""
        fns = prompt_fn if isinstance(prompt_fn, list) else [prompt_fn]
        items = []
        for p, fn in enumerate(fns):
            rid = request_id if len(fns) == 1 else f"{request_id}-{p}"
            prompt_ids: list[list[int]] = []  # prompt p's ids, computed once for its n choices

            def build_for(child: SamplingParams, fn=fn, prompt_ids=prompt_ids):
                def build(engine):
                    if not prompt_ids:
                        prompt_ids.append(fn(engine))
                    return {"prompt_token_ids": list(prompt_ids[0])}, child
                return build

            children = child_params(dataclasses.replace(params, stop=list(params.stop),
                                                        stop_token_ids=list(params.stop_token_ids)))
            items += [(cid, build_for(child)) for cid, child in zip(child_request_ids(rid, len(children)), children)]
        try:
            return await self.ae.add_requests(items)
        except ValueError as e:
            msg, param = str(e), _param_of(str(e))
            if param == "max_tokens":  # the engine's word for the limit; name the field the request set
                msg, param = msg.replace("max_tokens", max_tokens_field), max_tokens_field
            raise ApiError(400, msg, param=param, code="invalid_value") from None
        except EngineRequestError as e:
            raise ApiError(503, str(e), code=_unavailable_code(e)) from None

    async def prompt_fn(self, fn: Callable[[Any], list[int]], chars: int) -> Callable[[Any], list[int]]:
        """The prompt function (engine -> token ids) the engine thread calls for a prompt that ``fn(tokenizer)``
        tokenizes (or renders): ``fn`` on the engine's tokenizer there, or, for a prompt of ``chars`` >=
        ``LARGE_PROMPT_CHARS`` characters, ``fn`` run now on a worker thread with the server's tokenizer copy,
        the engine thread then only taking its ids or raising its ValueError (so the error reaches the client
        as it would from the engine thread)."""
        if chars < LARGE_PROMPT_CHARS or self.tokenizer is None:
            return lambda engine: fn(engine.tokenizer)

        def run():
            with self._tokenizer_lock:
                try:
                    return fn(self.tokenizer), None
                except ValueError as e:
                    return None, e
        ids, err = await asyncio.to_thread(run)

        def computed(engine):
            if err is not None:
                raise err
            return ids
        return computed

    def abort(self, streams: list[RequestStream]) -> None:
        """Abort the streams' requests that have not finished (fire and forget)."""
        for stream in streams:
            if not stream.finished:
                self.ae.abort(stream.request_id)

    async def collect(self, streams: list[RequestStream], request: Request) -> list:
        """Final outputs of a non-streaming request's streams; aborts them all if the client goes
        away first or the engine fails one of them."""
        async def drain():
            finals = [None] * len(streams)
            async for i, out in merge_streams(streams):
                finals[i] = out
            return finals

        async def disconnected():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        task = asyncio.ensure_future(drain())
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                self.abort(streams)
        if not task.done() or task.cancelled():
            raise ApiError(499, "the client closed the request", code="client_closed_request")
        try:
            return task.result()
        except ServerShuttingDown as e:
            raise ApiError(503, str(e), code="server_shutting_down") from None
        except EngineRequestError as e:
            self.abort(streams)  # the other choices of this request
            raise ApiError(500, str(e), code="engine_error") from None

    def decode_token(self, tid: int) -> str:
        return self.engine.tokenizer.decode([tid]) if self.engine.tokenizer is not None else ""


def _stream_with_abort(srv: _Server, streams: list[RequestStream],
                       body: Callable[[list[RequestStream]], AsyncIterator[str]]) -> StreamingResponse:
    """SSE response; a client that disconnects mid-stream aborts the request's engine requests (their
    blocks are freed before the next engine step), as does an engine failure of one of them."""
    async def gen():
        try:
            async for frame in body(streams):
                yield frame
        except ServerShuttingDown as e:
            yield _sse(error_body(503, str(e), code="server_shutting_down"))
            yield "data: [DONE]\n\n"
        except EngineRequestError as e:
            yield _sse(error_body(500, str(e), code="engine_error"))
            yield "data: [DONE]\n\n"
        finally:
            srv.abort(streams)

    return StreamingResponse(gen(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})



def _stream_delta(text: str, finished: bool, sent: int, hold: int) -> tuple[str, int]:
    """Text to send now from cumulative ``text`` of which ``sent`` characters went out: all of it
    when finished, else all but the last ``hold`` characters (so a stop string is never partly
    sent). Returns (delta, new sent count)."""
    upto = len(text) if finished else len(text) - hold
    if upto <= sent:
        return "", sent
    return text[sent:upto], upto

class _Sent:
    """What one choice of a stream has sent: characters, tokens, the logprobs' text offset."""

    def __init__(self):
        self.text = self.tokens = self.text_offset = 0


def _usage_of(finals: list, n: int | None = None) -> dict:
    """Usage of a request's choices: each prompt once (a batch of prompts: every ``n``-th choice starts
    the next prompt's), the completion tokens of every choice."""
    step = n or len(finals)
    return usage(sum(len(finals[k].prompt_token_ids) for k in range(0, len(finals), step)),
                 sum(len(f.outputs[0].token_ids) for f in finals))


def _held_back(params: SamplingParams) -> int:
    """Characters to hold back while streaming so that a stop string is never partly sent (none when the
    stop string is kept in the text: vLLM's ``include_stop_str_in_output``)."""
    if params.include_stop_str_in_output:
        return 0
    return max((len(s) for s in params.stop), default=1) - 1


def build_app(async_engine: AsyncEngine, served_model_names: list[str], model_path: str, metrics: ServerMetrics,
              api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              speculative_config: dict | None = None, trust_request_chat_template: bool = False,
              chat_template_content_format: str = "auto", chat_template: str | None = None) -> FastAPI:
    """The FastAPI app. Starts ``async_engine`` on start-up and stops it on shutdown. A request's own
    ``chat_template`` is refused unless ``trust_request_chat_template`` (vLLM's
    ``--trust-request-chat-template``): templates run on the engine thread, so one could stall every user.
    ``chat_template_content_format`` (vLLM's ``--chat-template-content-format``): auto, string or openai
    (``chat_utils.py``); ValueError for another value. ``chat_template`` (the text of vLLM's
    ``--chat-template``): the template of every chat request instead of the tokenizer's (a request's own,
    when trusted, still wins); ValueError if it does not parse."""
    srv = _Server(async_engine, served_model_names, model_path, metrics, api_key, max_body_bytes, speculative_config,
                  trust_request_chat_template, chat_template_content_format, chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not async_engine._thread.is_alive():
            async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="longflash", version=longflash.__version__, lifespan=lifespan)
    app.state.server = srv

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return _error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return _error_response(e.status_code, str(e.detail), code=code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error_response(400, str(e), code="invalid_value")

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("unhandled error in %s", request.url.path)
        return _error_response(500, f"internal server error: {type(e).__name__}", code="internal_error")

    # ---- information routes --------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not async_engine.is_alive:
            return _error_response(503, "the engine loop is not running", code="engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": longflash.__version__}

    @app.get("/v1/models")
    async def models(request: Request):
        srv.check_auth(request)
        data = [{"id": name, "object": "model", "created": srv.created, "owned_by": "longflash",
                 "root": model_path, "parent": None, "max_model_len": srv.engine.max_model_len}
                for name in served_model_names]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- tokenizer routes ----------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(request: Request):
        srv.check_auth(request)
        req: TokenizeRequest = await srv.parse(request, TokenizeRequest)
        srv.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'", param="prompt", code="invalid_value")
        if req.messages is not None:
            messages = _message_dicts(req.messages)
            agp, kwargs = _template_options(req, srv.chat_template, srv.trust_request_chat_template)

        def fn_of(tokenizer):
            if tokenizer is None:
                raise ValueError("the server was started with --skip-tokenizer-init")
            if req.messages is not None:  # the chat route's prompt, from the same options
                return render_chat(tokenizer, messages, agp, kwargs, srv.content_format,
                                   bool(req.add_special_tokens))[1]
            return tokenize_text(tokenizer, req.prompt, req.add_special_tokens is not False)

        chars = _conversation_chars(messages) if req.messages is not None else \
            len(req.prompt) if isinstance(req.prompt, str) else 0
        try:
            ids = await async_engine.run(await srv.prompt_fn(fn_of, chars))
        except ValueError as e:
            raise ApiError(400, str(e), code="invalid_value") from None
        return {"count": len(ids), "max_model_len": srv.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        srv.check_auth(request)
        req: DetokenizeRequest = await srv.parse(request, DetokenizeRequest)
        srv.check_model(req.model)
        vocab = srv.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens",
                           code="invalid_value")

        def fn(engine):
            if engine.tokenizer is None:
                raise ValueError("the server was started with --skip-tokenizer-init")
            return engine.tokenizer.decode(req.tokens)

        try:
            text = await async_engine.run(fn)
        except ValueError as e:
            raise ApiError(400, str(e), code="invalid_value") from None
        return {"prompt": text}

    # ---- completions ---------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        srv.check_auth(request)
        req: CompletionRequest = await srv.parse(request, CompletionRequest)
        model = srv.check_model(req.model)
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo", code="unsupported_field")
        prompts = req.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]  # one prompt: a string or a list of token ids
        params = srv.sampling_params(req, req.max_tokens, req.logprobs)
        if len(prompts) * params.n > MAX_N:
            raise ApiError(400, f"a batch of {len(prompts)} prompts x n = {params.n} asks for {len(prompts) * params.n} "
                           f"completions; at most {MAX_N} per request", param="prompt", code="invalid_value")

        fns = []
        for p in prompts:  # text (a long one tokenized off the engine thread) or token ids
            if isinstance(p, str):
                fns.append(await srv.prompt_fn(lambda tok, p=p: tokenize_text(tok, p, req.add_special_tokens)
                                               if p else [], len(p)))
            else:
                fns.append(lambda engine, p=p: list(p))
        rid = f"cmpl-{uuid.uuid4().hex}"
        # A batch of prompts (vLLM): prompt p's n choices are choices p*n .. p*n + n - 1; one command queues all.
        streams = await srv.add(rid, fns, params)
        n_choices = params.n
        created = int(time.time())
        want_lp = req.logprobs is not None

        if not req.stream:
            finals = await srv.collect(streams, request)
            choices = []
            for i, final in enumerate(finals):
                comp = final.outputs[0]
                lp = (completion_logprobs(comp.token_ids, comp.logprobs or [], 0, srv.decode_token)
                      if want_lp else None)
                choices.append({"index": i, "text": comp.text, "logprobs": lp, "finish_reason": comp.finish_reason,
                                "stop_reason": comp.stop_reason})
            return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                    "usage": _usage_of(finals, n_choices), "system_fingerprint": None}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        hold = _held_back(params)

        async def body(streams: list[RequestStream]):
            sent = [_Sent() for _ in streams]
            finals = [None] * len(streams)
            async for i, out in merge_streams(streams):
                comp, st = out.outputs[0], sent[i]
                delta, st.text = _stream_delta(comp.text, out.finished, st.text, hold)
                lp = None
                if want_lp and len(comp.token_ids) > st.tokens:
                    lp = completion_logprobs(comp.token_ids[st.tokens:], (comp.logprobs or [])[st.tokens:],
                                             st.text_offset, srv.decode_token)
                    st.text_offset += sum(len(t) for t in lp["tokens"])
                st.tokens = len(comp.token_ids)
                if delta or lp is not None or out.finished:
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": i, "text": delta, "logprobs": lp,
                                          "finish_reason": comp.finish_reason if out.finished else None,
                                          "stop_reason": comp.stop_reason if out.finished else None}]}
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
                finals[i] = out
            if include_usage and all(f is not None for f in finals):
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage_of(finals, n_choices)})
            yield "data: [DONE]\n\n"

        return _stream_with_abort(srv, streams, body)

    # ---- chat completions ----------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        srv.check_auth(request)
        req: ChatCompletionRequest = await srv.parse(request, ChatCompletionRequest)
        model = srv.check_model(req.model)
        messages = _message_dicts(req.messages)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs",
                           code="invalid_value")
        top_n = req.top_logprobs or 0
        if top_n and not 0 <= top_n <= srv.max_logprobs:
            raise ApiError(400, f"top_logprobs must be in [0, {srv.max_logprobs}], got {top_n}",
                           param="top_logprobs", code="invalid_value")
        params = srv.sampling_params(req, max_tokens, top_n if req.logprobs else None)
        agp, kwargs = _template_options(req, srv.chat_template, srv.trust_request_chat_template)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        def render(tok):
            return render_chat(tok, messages, agp, kwargs, srv.content_format, req.add_special_tokens)[1]
        prompt_fn = await srv.prompt_fn(render, _conversation_chars(messages))
        streams = await srv.add(rid, prompt_fn, params, _max_tokens_field(req))
        created = int(time.time())

        if not req.stream:
            finals = await srv.collect(streams, request)
            choices = []
            for i, final in enumerate(finals):
                comp = final.outputs[0]
                lp = (chat_logprobs(comp.token_ids, comp.logprobs or [], top_n, srv.decode_token)
                      if req.logprobs else None)
                choices.append({"index": i, "message": {"role": "assistant", "content": comp.text}, "logprobs": lp,
                                "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
            return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                    "usage": _usage_of(finals), "system_fingerprint": None}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        hold = _held_back(params)

        def chunk(index: int, delta: dict, finish_reason=None, lp=None) -> str:
            c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]}
            if include_usage:
                c["usage"] = None
            return _sse(c)

        async def body(streams: list[RequestStream]):
            for i in range(len(streams)):
                yield chunk(i, {"role": "assistant", "content": ""})
            sent = [_Sent() for _ in streams]
            finals = [None] * len(streams)
            async for i, out in merge_streams(streams):
                comp, st = out.outputs[0], sent[i]
                delta, st.text = _stream_delta(comp.text, out.finished, st.text, hold)
                lp = None
                if req.logprobs and len(comp.token_ids) > st.tokens:
                    lp = chat_logprobs(comp.token_ids[st.tokens:], (comp.logprobs or [])[st.tokens:], top_n,
                                       srv.decode_token)
                st.tokens = len(comp.token_ids)
                if delta or lp is not None or out.finished:
                    yield chunk(i, {"content": delta} if delta else {}, comp.finish_reason if out.finished else None,
                                lp)
                finals[i] = out
            if include_usage and all(f is not None for f in finals):
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage_of(finals)})
            yield "data: [DONE]\n\n"

        return _stream_with_abort(srv, streams, body)

    return app
