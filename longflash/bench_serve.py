"""``longflash bench serve``: concurrent streaming clients against the OpenAI server (``vllm bench serve``).

Unless ``--base-url`` names a running server, ``longflash serve`` is started as a subprocess on a free
port with the bench's engine flags, and stopped at the end. ``--num-prompts`` completions of
``--input-len`` prompt tokens (token ids) and ``--output-len`` greedy output tokens (ignore_eos) are
sent over ``/v1/completions`` with ``stream`` (usage included): all at once, or at ``--request-rate``
requests/s (Poisson arrivals), at most ``--max-concurrency`` in flight. Each client thread records the
send time and the arrival of every chunk with text; the report is ``bench_report``'s. Speculative
decoding counters come from ``/metrics`` (before/after deltas). The bandwidth roofline is an estimate
(the client sees no engine steps): one decode step per chunk, its time the median ITL, its bytes
those of a step of the mean concurrency at the mean context (``bench_roofline.StepBytes`` on a model
built on the meta device).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from longflash.bench_report import RequestTiming, format_report, summarize
from longflash.entrypoints.args import add_engine_args


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None,
                   help="benchmark the server at this URL (default: start `longflash serve` on a free port)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("LONGFLASH_API_KEY"),
                   help="bearer token for a --base-url server started with --api-key (default: $OPENAI_API_KEY, "
                        "as vllm bench serve, else $LONGFLASH_API_KEY)")
    p.add_argument("--server-start-timeout-s", type=float, default=900.0,
                   help="seconds to wait for the started server's /health (a --base-url server: 10 s at most)")


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` that differ from their defaults, as ``longflash serve`` arguments."""
    ref = argparse.ArgumentParser(add_help=False)
    add_engine_args(ref)
    out = []
    for a in ref._actions:
        if not a.option_strings:
            continue
        v = getattr(args, a.dest, a.default)
        if v == a.default:
            continue
        flag = next(s for s in a.option_strings if s.startswith("--"))
        if isinstance(a, argparse._StoreTrueAction):
            out.append(flag)
        elif isinstance(a, argparse.BooleanOptionalAction):
            out.append(flag if v else "--no-" + flag[2:])
        else:
            out += [flag, json.dumps(v) if isinstance(v, dict) else str(v)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _headers(api_key: str | None, **extra) -> dict:
    return dict(extra, **({"Authorization": f"Bearer {api_key}"} if api_key else {}))


def _get(host: str, port: int, path: str, timeout: float = 10.0, api_key: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers=_headers(api_key))
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def spec_counters(text: str) -> dict:
    """Sum the vLLM speculative-decoding counters of a Prometheus ``/metrics`` page."""
    names = {"vllm:spec_decode_num_drafts_total": "num_drafts",
             "vllm:spec_decode_num_draft_tokens_total": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "num_accepted_tokens"}
    out = {v: 0 for v in names.values()}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m and m.group(1) in names:
            out[names[m.group(1)]] += int(float(m.group(3)))
    return out


def _stream_completion(host: str, port: int, model: str, prompt: list[int], output_len: int, t: RequestTiming,
                       timeout: float, api_key: str | None = None) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        t.start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, _headers(api_key, **{"Content-Type": "application/json"}))
        r = conn.getresponse()
        if r.status != 200:
            body = r.read().decode(errors="replace")
            try:  # the server's JSON error: its message
                body = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            t.ok, t.error = False, f"HTTP {r.status}: {body[:500]}"
            return
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                t.output_tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                t.chunk_times.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 — a failed request is reported, not fatal
        t.ok, t.error = False, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def _start_server(args, port: int, log_path: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "longflash.entrypoints.cli", "serve", *engine_argv(args), "--host", "127.0.0.1",
            "--port", str(port), "--disable-log-requests", "--disable-uvicorn-access-log",
            "--uvicorn-log-level", "warning"]
    log = open(log_path, "w")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))


def _wait_healthy(proc, host: str, port: int, timeout: float, log_path: str, base_url: str | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"the server exited with code {proc.returncode} during start-up:\n{tail}")
        try:
            if _get(host, port, "/health", timeout=2.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    where = f" at {base_url}" if base_url else ""
    raise RuntimeError(f"the server{where} did not answer /health within {timeout:.0f} s")


def _roofline_estimate(args, m: dict, spec: dict | None, peak_gbs: float) -> dict | None:
    """Bytes of a step of the mean concurrency at the mean context, over the median ITL."""
    import torch

    from longflash.bench_roofline import StepBytes
    from longflash.config import resolve_dtype
    from longflash.default_model_path import default_model_path
    from longflash.models.loader import load_config
    from longflash.models.registry import get_model_class, resolve_architecture
    if not m["completed"] or not m["median_itl_ms"]:
        return None
    path = args.model or default_model_path()
    cfg = load_config(path)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, cfg.get("torch_dtype") or cfg.get("dtype"), device)
    with torch.device("meta"):
        model = get_model_class(resolve_architecture(cfg))(cfg).to(dtype)
    kvd = {"auto": dtype, "bfloat16": torch.bfloat16}.get(args.kv_cache_dtype, torch.float8_e4m3fn)
    sb = StepBytes(model, model.kv_cache_spec().bytes_per_token(kvd))
    itl_s = m["median_itl_ms"] / 1e3
    concurrency = min(args.num_prompts, args.max_concurrency or args.num_prompts)
    per_step = 1.0 + (spec["num_draft_tokens"] / spec["num_drafts"] if spec and spec["num_drafts"] else 0.0)
    tokens = max(1, round(concurrency * per_step))
    context = concurrency * (args.input_len + args.output_len // 2)
    nbytes = sb.step(tokens, context)
    return {"bytes": nbytes, "seconds": itl_s, "steps": 1, "peak_gbs": peak_gbs,
            "estimated": "median ITL, mean concurrency and context, target weights and KV only"}


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from longflash.bench import _check_counts, make_prompts, peak_bandwidth
    from longflash.default_model_path import default_model_path
    from longflash.engine.llm_engine import load_tokenizer
    from longflash.models.loader import load_config
    _check_counts(args)
    path = args.model or default_model_path()
    cfg = load_config(path)
    tok = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer or path)
    max_len = args.max_model_len or int(cfg.get("max_position_embeddings") or 4096)
    prompts = [p["prompt_token_ids"] for p in make_prompts(tok, cfg["vocab_size"], max_len, args.num_prompts,
                                                           args.input_len, args.prompt_kind, args.seed,
                                                           args.output_len)]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    peak = peak_bandwidth(args, device)  # measured before the server holds the device
    proc, log_path = None, None
    if args.base_url:
        # "127.0.0.1:8000" (no scheme) would parse as scheme "127.0.0.1": read it as http://
        u = urllib.parse.urlparse(args.base_url if "://" in args.base_url else "http://" + args.base_url)
        host, port = u.hostname or "127.0.0.1", u.port or 80
    else:
        host, port = "127.0.0.1", _free_port()
        log_path = os.path.join(tempfile.mkdtemp(prefix="longflash-bench-serve-"), "server.log")
        proc = _start_server(args, port, log_path)
        print(f"started `longflash serve` (pid {proc.pid}) on port {port}; log {log_path}", flush=True)
    if proc is None:
        print(f"benchmarking the server at {args.base_url}", flush=True)
        try:  # a running server answers at once or is not there: no start-up to wait for
            _wait_healthy(None, host, port, min(10.0, args.server_start_timeout_s), log_path, args.base_url)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    try:
        if proc is not None:
            _wait_healthy(proc, host, port, args.server_start_timeout_s, log_path)
        key = args.api_key if proc is None else None  # a started server has no key
        status, body = _get(host, port, "/v1/models", api_key=key)
        if status != 200:
            hint = " (the server wants an API key: --api-key or $OPENAI_API_KEY)" if status == 401 else ""
            print(f"error: GET /v1/models answered HTTP {status}{hint}: {body[:300].decode(errors='replace')}",
                  file=sys.stderr)
            return 1
        model = json.loads(body)["data"][0]["id"]
        # warm-up: one short request (first-use compilation stays out of the numbers)
        _stream_completion(host, port, model, prompts[0], 4, RequestTiming(0.0), timeout=600, api_key=key)
        spec0 = spec_counters(_get(host, port, "/metrics", api_key=key)[1].decode())
        timings = [RequestTiming(0.0, prompt_tokens=len(p)) for p in prompts]
        workers = min(args.num_prompts, args.max_concurrency or args.num_prompts)
        rng = random.Random(args.seed)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = []
            for p, t in zip(prompts, timings):
                futures.append(pool.submit(_stream_completion, host, port, model, p, args.output_len, t, 3600, key))
                if args.request_rate != float("inf"):
                    time.sleep(rng.expovariate(args.request_rate))
            for f in futures:
                f.result()
        duration = time.perf_counter() - t0
        spec1 = spec_counters(_get(host, port, "/metrics", api_key=key)[1].decode())
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            if sys.exc_info()[0] is None:  # the server's log is kept (and named above) only when the run failed
                shutil.rmtree(os.path.dirname(log_path), ignore_errors=True)
    spec = {k: spec1[k] - spec0[k] for k in spec0}
    spec = spec if spec["num_drafts"] else None
    m = summarize(timings, duration, spec)
    roof = _roofline_estimate(args, m, spec, peak)
    if roof is not None:
        m = summarize(timings, duration, spec, roof)
    errors = sorted({t.error for t in timings if not t.ok})
    if errors:
        m["errors"] = errors[:5]
    print(format_report(m), flush=True)
    for e in m.get("errors", []):  # why requests failed (e.g. the server's 400), not only how many
        print(f"failed request: {e}", file=sys.stderr)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(m, args={k: v for k, v in vars(args).items() if k != "func"}), f, indent=2)
    return 0 if not m["failed"] else 1

