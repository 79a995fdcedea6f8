"""``longflash serve`` flags (vLLM's names) and the entry point that starts uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from longflash.config import parse_bytes
from longflash.entrypoints.chat_utils import CONTENT_FORMATS, load_chat_template

logger = logging.getLogger("longflash.server")

UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def _positive_bytes(value: str) -> int:
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Server-only flags; the engine flags come from ``add_engine_args``."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("LONGFLASH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                        "(default: $LONGFLASH_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) in the API; the first one is used in responses and metrics "
                        "(default: the model argument)")
    p.add_argument("--max-request-body-bytes", type=_positive_bytes, default=32 << 20,
                   help="largest accepted request body, bytes or e.g. 32MiB (larger: 413)")
    p.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    p.add_argument("--disable-log-requests", action="store_true", help="do not log each finished request")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--chat-template", default=None,
                   help="the chat template of every chat request instead of the tokenizer's: a file, or the Jinja "
                        "template text itself (vLLM's rule: a value that is not a readable file is the template, "
                        "if it contains '{', '}' or a newline)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template in chat requests (off by default, as in vLLM: a template runs on "
                        "the engine thread, so a costly one stalls every request)")
    p.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                   help="how the chat template gets a message's content: 'string' (text parts joined with "
                        "newlines), 'openai' (a list of {'type': 'text', 'text': ...} parts), or 'auto' (default: "
                        "'openai' when the template loops over message['content'], else 'string'; as vLLM)")


def _bind_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now (e.g. the port is in use), or None."""
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return str(e)
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind(addr)
        except OSError as e:
            return e.strerror or str(e)
    return None


def run_server(args: argparse.Namespace) -> int:
    """Build the engine (printing its start-up report), then serve until SIGINT/SIGTERM."""
    import uvicorn

    from longflash.engine.llm_engine import LLMEngine
    from longflash.entrypoints.args import engine_config_from_args
    from longflash.entrypoints.server.api_server import build_app
    from longflash.entrypoints.server.async_engine import AsyncEngine
    from longflash.entrypoints.server.metrics import ServerMetrics

    tp, dcp = args.tensor_parallel_size, args.decode_context_parallel_size
    for flag, v in (("--tensor-parallel-size", tp), ("--decode-context-parallel-size", dcp)):
        if v < 1:
            print(f"error: {flag} must be >= 1, got {v}", file=sys.stderr)
            return 2
    if tp % dcp != 0:
        print(f"error: --decode-context-parallel-size ({dcp}) must be >= 1 and divide --tensor-parallel-size "
              f"({tp})", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    busy = _bind_error(args.host, args.port)
    if busy is not None:  # before loading the model, not after it
        print(f"error: cannot listen on {args.host}:{args.port}: {busy}", file=sys.stderr)
        return 2
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = load_chat_template(args.chat_template)
        except ValueError as e:
            print(f"error: --chat-template: {e}", file=sys.stderr)
            return 2
    try:
        config = engine_config_from_args(args)
        engine = LLMEngine(config)  # logs the start-up report: load time, KV cache tokens/blocks, concurrency
    except (ValueError, NotImplementedError) as e:  # a configuration this model/machine cannot serve
        print(f"error: {e}", file=sys.stderr)
        return 2
    model_arg = getattr(args, "model_tag", None) or args.model
    names = args.served_model_name or [model_arg or "longflash-default"]
    spec = config.speculative_config if isinstance(config.speculative_config, dict) else None
    metrics = ServerMetrics(names[0], num_speculative_tokens=engine.num_speculative_tokens)
    server: uvicorn.Server | None = None
    died: list[BaseException] = []

    def on_dead(e: BaseException) -> None:
        # The engine cannot serve any more (e.g. a tensor/decode-context parallel worker died):
        # stop the HTTP server too, as vLLM's API server does when its engine core dies.
        died.append(e)
        if server is not None:
            server.should_exit = True

    async_engine = AsyncEngine(engine, metrics, log_requests=not args.disable_log_requests, on_dead=on_dead)
    metrics.update(engine)
    app = build_app(async_engine, names, config.model, metrics, api_key=args.api_key,
                    max_body_bytes=args.max_request_body_bytes,
                    speculative_config=spec, trust_request_chat_template=args.trust_request_chat_template,
                    chat_template_content_format=args.chat_template_content_format, chat_template=chat_template)
    if chat_template is not None:
        logger.info("chat template: from --chat-template (%d characters), instead of the tokenizer's",
                    len(chat_template))
    logger.info("serving %s as %s on http://%s:%d", config.model, ", ".join(names), args.host, args.port)
    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # SIGINT/SIGTERM: end the requests in flight with a 503 (a stream: an error frame and
            # [DONE]) and queue no new ones, so the graceful shutdown finds no open request to cancel.
            async_engine.stop_all_requests()
            super().handle_exit(sig, frame)

    server = _Uvicorn(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                     access_log=not args.disable_uvicorn_access_log, timeout_graceful_shutdown=5))
    # uvicorn (>= 0.29) re-raises the SIGINT/SIGTERM it handled once it has shut down, to the handlers
    # that were installed before it ran: with Python's defaults that is a KeyboardInterrupt traceback
    # and exit status 130, or for SIGTERM death before the workers are stopped. These handlers take the
    # re-raised signal (the shutdown already happened), so the engine and its workers are stopped below;
    # the exit status is then 0 after SIGINT and 143 (128 + SIGTERM, what a supervisor expects) after
    # SIGTERM.
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, f: received.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # a second Ctrl-C during the shutdown below interrupts it
        async_engine.shutdown()
        engine.shutdown()  # stops the worker processes of a -tp/-dcp engine
    if died:
        print(f"error: the engine died: {type(died[0]).__name__}: {died[0]}", file=sys.stderr)
        return 1
    return 128 + signal.SIGTERM if signal.SIGTERM in received else 0
