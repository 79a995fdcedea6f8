"""``longflash bench``: offline latency/throughput benchmarks with vLLM-style reports.

``longflash bench latency [--model PATH] --batch-size 1 8 --input-len 64 --output-len 64`` measures,
per batch size, time to first token, time per output token and output tokens/s of decode (greedy,
ignore_eos), and with ``--compare-spec`` the same run with speculative decoding off and on (ratio
in the same process). ``longflash bench throughput`` runs N requests at once and reports requests/s
and tokens/s. Prompts are held-out code/prose windows of the default model's data when available,
else deterministic random token ids.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from longflash.entrypoints.args import add_engine_args, engine_config_from_args


def _prompts(engine, n: int, input_len: int, kind: str, seed: int) -> list[dict]:
    """n prompts of exactly ``input_len`` tokens: windows of the held-out texts joined into one token
    stream (random token ids when there is no tokenizer or kind is ``random``).

    Raises ValueError when input_len leaves no room for output within max_model_len.
    """
    if input_len < 1 or input_len >= engine.max_model_len:
        raise ValueError(f"--input-len must be in [1, {engine.max_model_len - 1}] (max_model_len), got {input_len}")
    rng = random.Random(seed)
    tok = engine.tokenizer
    if tok is not None and kind in ("code", "prose"):
        from longflash.bench_prompts import held_out_texts
        stream: list[int] = []
        for text in held_out_texts(kind):
            stream += tok.encode(text, add_special_tokens=False)
        while len(stream) <= input_len:
            stream = stream + stream
        return [{"prompt_token_ids": stream[s:s + input_len]}
                for s in (rng.randrange(len(stream) - input_len) for _ in range(n))]
    vocab = engine.vocab_size
    return [{"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(input_len)]} for _ in range(n)]


def _run_batch(engine, prompts, output_len: int) -> dict:
    from longflash.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [engine.add_request(None, p, params) for p in prompts]
    first, finals = {}, {}
    step_times = []
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        outs = engine.step()
        step_times.append(time.perf_counter() - ts)
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            if o.finished:
                finals[o.request_id] = (now, o)
    total = time.perf_counter() - t0
    n_out = sum(len(finals[i][1].outputs[0].token_ids) for i in ids)
    ttft = [first[i] - t0 for i in ids]
    tpot = [(finals[i][0] - first[i]) / max(1, len(finals[i][1].outputs[0].token_ids) - 1) for i in ids]
    acc = [finals[i][1].metrics.mean_acceptance_length for i in ids]
    return {"requests": len(ids), "total_s": round(total, 4), "output_tokens": n_out,
            "output_tok_s": round(n_out / total, 2), "mean_ttft_ms": round(1000 * statistics.mean(ttft), 2),
            "mean_tpot_ms": round(1000 * statistics.mean(tpot), 3), "mean_acceptance_length": round(statistics.mean(acc), 3),
            "steps": len(step_times)}


def _check_counts(args) -> None:
    sizes = list(getattr(args, "batch_size", [])) + [getattr(args, "num_prompts", 1), args.output_len]
    if min(sizes) < 1:
        raise ValueError("--batch-size, --num-prompts and --output-len must be >= 1")


def cmd_latency(args) -> int:
    from longflash.engine.llm_engine import LLMEngine
    _check_counts(args)
    cfgs = [("spec_off", "off"), ("spec_on", None)] if args.compare_spec else [("run", args.speculative_config)]
    report = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "runs": {}}
    for name, sc in cfgs:
        args.speculative_config = sc
        cfg = engine_config_from_args(args)
        engine = LLMEngine(cfg)
        report["kv_bytes_per_token"] = engine.kv_bytes_per_token
        for bsz in args.batch_size:
            prompts = _prompts(engine, bsz, args.input_len, args.prompt_kind, args.seed)
            _run_batch(engine, prompts[:1], 4)  # warm-up
            r = _run_batch(engine, prompts, args.output_len)
            report["runs"].setdefault(str(bsz), {})[name] = r
            print(f"[{name}] batch {bsz}: {r['output_tok_s']} output tok/s, TTFT {r['mean_ttft_ms']} ms, "
                  f"TPOT {r['mean_tpot_ms']} ms, acceptance length {r['mean_acceptance_length']}", flush=True)
    if args.compare_spec:
        for bsz, runs in report["runs"].items():
            ratio = runs["spec_on"]["output_tok_s"] / runs["spec_off"]["output_tok_s"]
            runs["speedup_spec_on_vs_off"] = round(ratio, 3)
            print(f"batch {bsz}: DFlash speedup {ratio:.2f}x (same run)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def cmd_throughput(args) -> int:
    from longflash.engine.llm_engine import LLMEngine
    _check_counts(args)
    engine = LLMEngine(engine_config_from_args(args))
    prompts = _prompts(engine, args.num_prompts, args.input_len, args.prompt_kind, args.seed)
    r = _run_batch(engine, prompts, args.output_len)
    r["requests_per_s"] = round(r["requests"] / r["total_s"], 3)
    print(json.dumps(r, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="latency / throughput benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    for name, fn in (("latency", cmd_latency), ("throughput", cmd_throughput)):
        p = bsub.add_parser(name)
        add_engine_args(p)
        p.add_argument("--input-len", type=int, default=64)
        p.add_argument("--output-len", type=int, default=64)
        p.add_argument("--prompt-kind", choices=["code", "prose", "random"], default="code")
        p.add_argument("--output-json", default=None)
        if name == "latency":
            p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
            p.add_argument("--compare-spec", action="store_true", help="run with DFlash off and on, report the ratio")
        else:
            p.add_argument("--num-prompts", type=int, default=32)
        p.set_defaults(func=fn)
