"""``longflash`` command line: generate, serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import longflash
from longflash.entrypoints.args import add_engine_args, engine_config_from_args


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


def _cpu_threads_for_default_model(args: argparse.Namespace) -> None:
    """On the CPU with the embedded default model (no ``--model``) and no ``OMP_NUM_THREADS`` set: one
    intra-op thread. The tiny model gains nothing from more, and on a busy 2-core machine PyTorch's thread
    pool contending with other processes made the README's main job 26-65x slower (session 25: 64 tokens in
    30 s against 1.2 s with one thread). A user's ``OMP_NUM_THREADS`` or ``--model`` keeps PyTorch's choice."""
    import os
    import torch
    if os.environ.get("OMP_NUM_THREADS") or getattr(args, "model", None) or getattr(args, "model_tag", None):
        return
    device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and torch.get_num_threads() > 1:
        torch.set_num_threads(1)
        logging.getLogger("longflash").info("CPU: 1 intra-op thread for the tiny default model "
                                            "(set OMP_NUM_THREADS to choose another count)")


def cmd_generate(args: argparse.Namespace) -> int:
    from longflash.engine.llm_engine import LLMEngine
    from longflash.sampling_params import SamplingParams, default_max_tokens

    max_tokens = args.max_tokens if args.max_tokens is not None else default_max_tokens(64)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed, max_tokens=max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens)
    engine = LLMEngine(engine_config_from_args(args))
    prompt = args.prompt
    if args.chat:  # the chat template call of LLM.chat and the server (entrypoints/chat_request.py)
        from longflash.entrypoints.chat_request import render_chat
        prompt = {"prompt_token_ids": render_chat(engine.tokenizer, [{"role": "user", "content": prompt}], True, None)[1]}
    t0 = time.perf_counter()
    rid = engine.add_request(None, prompt, params)
    printed = 0
    if not args.chat:
        sys.stdout.write(args.prompt)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
            final = out
    sys.stdout.write("\n")
    sys.stdout.flush()  # before the log line on stderr: a pipe's stdout is block-buffered (it was glued on)
    if final is None:
        failed = dict(engine.failed_requests)
        print(f"error: generation failed: {failed.get(rid, 'unknown error')}", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t0
    n = len(final.outputs[0].token_ids)
    logging.getLogger("longflash").info("%d tokens in %.2f s (%.1f tok/s), finish_reason=%s", n, dt, n / dt,
                                        final.outputs[0].finish_reason)
    return 0


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: a prefix of a flag is an error, not silently another flag (--chat-template
    # was read as --chat-template-content-format); vLLM's parser takes no prefixes either.
    p = argparse.ArgumentParser(prog="longflash", description="Long-context MLA inference engine", allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"%(prog)s {longflash.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt", allow_abbrev=False)
    add_engine_args(g)
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate at most (default 64, capped at the room left in the context)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 (the default here, unlike the offline API's 1.0) = greedy; > 0 samples")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 or -1: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0; divides positive / multiplies negative logits of prompt and output tokens (1: off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], per token present in the output")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], per occurrence in the output")
    g.add_argument("--min-tokens", type=int, default=0, help="EOS and stop token ids are masked before this many tokens")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeat the flag for several)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", allow_abbrev=False)
    add_engine_args(s, model_positional=True)
    try:
        from longflash.entrypoints.server.cli_args import add_server_args, run_server
        add_server_args(s)
        s.set_defaults(func=run_server)
    except ImportError:
        s.set_defaults(func=lambda a: (print("the server is not available in this build", file=sys.stderr), 2)[1])

    try:
        from longflash.bench import add_bench_parser
        add_bench_parser(sub)
    except ImportError:
        pass
    return p


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest (sub)parser that ``args`` went through (``longflash bench serve``'s, ...)."""
    while True:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, action.dest, None) if action is not None else None
        if name not in (action.choices if action is not None else {}):
            return parser
        parser = action.choices[name]


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status (2 for bad input).
    An unknown flag is reported by the subcommand's parser (``longflash serve: error: ...``, its usage)."""
    _setup_logging()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # what parse_args does, but with the prog and usage of the subcommand that was given
        _chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    import torch
    threads = torch.get_num_threads()
    try:
        _cpu_threads_for_default_model(args)
        return args.func(args) or 0
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # main() called in-process (tests) leaves the caller's thread count


if __name__ == "__main__":
    sys.exit(main())
