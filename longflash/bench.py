"""``longflash bench latency|throughput|serve``: benchmarks with ``vllm bench serve``'s report.

``latency``: per batch size (``--batch-size 1 8``), one batch of requests of ``--input-len`` prompt
tokens and ``--output-len`` output tokens (greedy, ignore_eos) run offline through the engine; with
``--compare-spec`` the same run with speculative decoding off and on and the ratio of output tok/s
(same process). ``throughput``: ``--num-prompts`` requests at once. ``serve``: an OpenAI server
(started as a subprocess unless ``--base-url`` is given) and concurrent streaming clients
(``bench_serve.py``). Every report has TTFT, TPOT, ITL, E2EL (mean/median/p99), request and token
throughput, the acceptance rate and length of speculative decoding, and the decode steps' bytes,
achieved GB/s and fraction of the copy-bandwidth roofline (``bench_roofline.py``; peak measured on the
device or given with ``--peak-bandwidth-gbs``). Prompts are held-out code/prose windows of the
default model's data when available, else deterministic random token ids.
"""

from __future__ import annotations

import json
import random
import time

from longflash.bench_report import RequestTiming, format_report, summarize
from longflash.entrypoints.args import add_engine_args, engine_config_from_args


def make_prompts(tokenizer, vocab_size: int, max_model_len: int, n: int, input_len: int, kind: str,
                 seed: int, output_len: int = 1) -> list[dict]:
    """n prompts of exactly ``input_len`` tokens: windows of the held-out texts joined into one token
    stream (random token ids when there is no tokenizer or kind is ``random``).

    Raises ValueError when input_len + output_len does not fit max_model_len.
    """
    top = max_model_len - max(1, output_len)
    if input_len < 1 or input_len > top:
        raise ValueError(f"--input-len must be in [1, {top}] (max_model_len {max_model_len} minus --output-len "
                         f"{output_len}), got {input_len}")
    rng = random.Random(seed)
    if tokenizer is not None and kind in ("code", "prose"):
        from longflash.bench_prompts import held_out_texts
        stream: list[int] = []
        for text in held_out_texts(kind):
            stream += tokenizer.encode(text, add_special_tokens=False)
        while len(stream) <= input_len:
            stream = stream + stream
        return [{"prompt_token_ids": stream[s:s + input_len]}
                for s in (rng.randrange(len(stream) - input_len) for _ in range(n))]
    return [{"prompt_token_ids": [rng.randrange(4, vocab_size) for _ in range(input_len)]} for _ in range(n)]


def _prompts(engine, args, n: int, seed: int) -> list[dict]:
    return make_prompts(engine.tokenizer, engine.vocab_size, engine.max_model_len, n, args.input_len,
                        args.prompt_kind, seed, args.output_len)


def _spec_counters(engine) -> dict:
    st = engine.stats
    return {"num_drafts": st.spec_num_drafts, "num_draft_tokens": st.spec_num_draft_tokens,
            "num_accepted_tokens": st.spec_num_accepted_tokens}


def _decode_step_bytes(engine, step_bytes) -> int | None:
    """Bytes the next step must read when every running request decodes (None otherwise: a prefill
    or mixed step is not a decode step; nor is a step that may admit a waiting request, i.e. one with
    requests waiting and a batch slot free)."""
    sch = engine.scheduler
    if not sch.running or (sch.waiting and len(sch.running) < sch.max_num_seqs):
        return None
    tokens = ctx = dreq = dctx = 0
    for seq in sch.running:
        if seq.num_uncomputed_tokens != 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            return None
        L = engine._lookahead(seq) if engine.proposer is not None else 0
        tokens += 1 + L
        ctx += seq.num_computed_tokens + 1 + L
        if L:
            dreq, dctx = dreq + 1, dctx + seq.num_computed_tokens
    return step_bytes.step(tokens, ctx, dreq, dctx)


def run_offline(engine, prompts: list[dict], output_len: int, peak_gbs: float | None = None) -> dict:
    """Run ``prompts`` (all sent at once) to ``output_len`` greedy tokens each; return ``summarize``'s
    metrics (roofline over the decode-only steps when ``peak_gbs`` is given) plus the older keys
    ``output_tok_s``, ``mean_ttft_ms``, ``mean_tpot_ms``, ``mean_acceptance_length``, ``steps``."""
    from longflash.bench_roofline import StepBytes
    from longflash.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    step_bytes = StepBytes.of_engine(engine) if peak_gbs else None
    spec0 = _spec_counters(engine)
    n_failed0 = len(engine.failed_requests)
    t0 = time.perf_counter()
    timings = {}
    for p in prompts:
        rid = engine.add_request(None, p, params)
        timings[rid] = RequestTiming(t0, prompt_tokens=len(p["prompt_token_ids"]))
    roof = {"bytes": 0, "seconds": 0.0, "steps": 0, "peak_gbs": peak_gbs}
    steps = 0
    while engine.has_unfinished_requests():
        nbytes = _decode_step_bytes(engine, step_bytes) if step_bytes is not None else None
        ts = time.perf_counter()
        outs = engine.step()
        te = time.perf_counter()
        steps += 1
        if nbytes is not None:
            roof["bytes"] += nbytes
            roof["seconds"] += te - ts
            roof["steps"] += 1
        for o in outs:
            t, n = timings[o.request_id], len(o.outputs[0].token_ids)
            if n > t.output_tokens:
                t.chunk_times.append(te)
                t.output_tokens = n
    duration = time.perf_counter() - t0
    for rid, err in engine.failed_requests[n_failed0:]:
        if rid in timings:
            timings[rid].ok, timings[rid].error = False, str(err)
    spec1 = _spec_counters(engine)
    spec = {k: spec1[k] - spec0[k] for k in spec0} if engine.proposer is not None else None
    m = summarize(list(timings.values()), duration, spec, roof if peak_gbs else None)
    m.update(output_tok_s=m["output_throughput"], mean_ttft_ms=m["mean_ttft_ms"], mean_tpot_ms=m["mean_tpot_ms"],
             mean_acceptance_length=m.get("spec_decode_acceptance_length", 1.0), steps=steps)
    return m


def _check_counts(args) -> None:
    sizes = list(getattr(args, "batch_size", [])) + [getattr(args, "num_prompts", 1), args.output_len]
    if min(sizes) < 1:
        raise ValueError("--batch-size, --num-prompts and --output-len must be >= 1")
    if getattr(args, "input_len", 1) < 1:  # (its upper bound, max_model_len - --output-len, needs the model)
        raise ValueError(f"--input-len must be >= 1, got {args.input_len}")
    if getattr(args, "num_iters_warmup", 0) < 0:
        raise ValueError("--num-iters-warmup must be >= 0")
    if getattr(args, "num_iters", 1) < 1:
        raise ValueError("--num-iters must be >= 1")
    rate = getattr(args, "request_rate", float("inf"))
    if not rate > 0:  # also NaN
        raise ValueError(f"--request-rate must be > 0 requests/s (inf: all at once), got {rate}")
    mc = getattr(args, "max_concurrency", None)
    if mc is not None and mc < 1:
        raise ValueError(f"--max-concurrency must be >= 1 (leave it out for no limit), got {mc}")


def _warm_up(engine, args, batch_size: int) -> None:
    """``--num-iters-warmup`` untimed runs of a batch of the measured shape (``batch_size`` prompts of
    ``--input-len`` tokens to ``--output-len`` tokens), so one-time costs (Triton JIT compiles of each
    kernel variant a step shape selects, CUDA graph capture, allocator growth) stay out of the timed
    run, as in ``vllm bench latency``. The warm-up prompts are other windows (seed + 1 + i) than the
    measured ones, so the timed run does not start from prefix-cache hits."""
    for i in range(args.num_iters_warmup):
        run_offline(engine, _prompts(engine, args, batch_size, args.seed + 1 + i),
                    args.output_len)


def peak_bandwidth(args, device) -> float:
    """``--peak-bandwidth-gbs`` if given, else the measured device copy bandwidth (GB/s)."""
    if args.peak_bandwidth_gbs:
        return float(args.peak_bandwidth_gbs)
    from longflash.bench_roofline import measure_copy_bandwidth
    return measure_copy_bandwidth(device)


def cmd_latency(args) -> int:
    from longflash.engine.llm_engine import LLMEngine
    _check_counts(args)
    cfgs = [("spec_off", "off"), ("spec_on", None)] if args.compare_spec else [("run", args.speculative_config)]
    report = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "runs": {}}
    peak = None
    for name, sc in cfgs:
        args.speculative_config = sc
        engine = LLMEngine(engine_config_from_args(args))
        peak = peak or peak_bandwidth(args, engine.device)
        report["peak_bandwidth_gbs"] = peak
        report["kv_bytes_per_token"] = engine.kv_bytes_per_token
        for bsz in args.batch_size:
            _warm_up(engine, args, bsz)
            # --num-iters timed batches, each of other prompts (seed, seed + 1000, ...): the same prompts
            # in the spec-on and spec-off runs
            its = [run_offline(engine, _prompts(engine, args, bsz, args.seed + 1000 * i), args.output_len, peak)
                   for i in range(args.num_iters)]
            r = its[0] if len(its) == 1 else _mean_of_iters(its)
            report["runs"].setdefault(str(bsz), {})[name] = r
            print(format_report(r, f"Latency Benchmark Result [{name}, batch {bsz}]"), flush=True)
        engine.shutdown()
    if args.compare_spec:
        for bsz, runs in report["runs"].items():
            ratio = runs["spec_on"]["output_throughput"] / runs["spec_off"]["output_throughput"]
            runs["speedup_spec_on_vs_off"] = round(ratio, 3)
            # decode speedup: mean time per output token after the first (TPOT), prefill excluded
            tpot_on, tpot_off = runs["spec_on"]["mean_tpot_ms"], runs["spec_off"]["mean_tpot_ms"]
            decode = tpot_off / tpot_on if tpot_on else float("nan")
            runs["decode_speedup_spec_on_vs_off"] = round(decode, 3)
            print(f"batch {bsz}: DFlash speedup {ratio:.2f}x (output tok/s incl. prefill, same run), decode "
                  f"speedup {decode:.2f}x (mean TPOT {tpot_off:.3f} -> {tpot_on:.3f} ms), acceptance length "
                  f"{runs['spec_on']['mean_acceptance_length']:.2f}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _mean_of_iters(its: list[dict]) -> dict:
    """Metrics of one batch from several timed batches: the mean of each numeric metric over the batches (a
    count, an int in every batch, stays an int when its mean is whole: "Successful requests: 1", not 1.0), the
    acceptance length over all drafts (sum of accepted / sum of drafts), and the per-batch
    (output tok/s, mean TPOT ms, acceptance length) under ``iters``."""
    def num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    out = {}
    for k in its[0]:
        vals = [r.get(k) for r in its]
        if all(num(v) for v in vals):
            mean = sum(vals) / len(vals)
            out[k] = int(mean) if all(isinstance(v, int) for v in vals) and mean == int(mean) else mean
    drafts = sum(r.get("spec_decode_num_drafts", 0) for r in its)
    if drafts:
        accepted = sum(r.get("spec_decode_accepted_tokens", 0) for r in its)
        out["mean_acceptance_length"] = out["spec_decode_acceptance_length"] = 1 + accepted / drafts
    out["iters"] = [{"output_throughput": r["output_throughput"], "mean_tpot_ms": r["mean_tpot_ms"],
                     "mean_acceptance_length": r["mean_acceptance_length"]} for r in its]
    return out


def cmd_throughput(args) -> int:
    from longflash.engine.llm_engine import LLMEngine
    _check_counts(args)
    engine = LLMEngine(engine_config_from_args(args))
    peak = peak_bandwidth(args, engine.device)
    prompts = _prompts(engine, args, args.num_prompts, args.seed)
    _warm_up(engine, args, args.num_prompts)
    r = run_offline(engine, prompts, args.output_len, peak)
    engine.shutdown()
    print(format_report(r, "Throughput Benchmark Result"), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(r, args={k: v for k, v in vars(args).items() if k != "func"}), f, indent=2)
    return 0


def add_bench_parser(sub) -> None:
    from longflash.bench_serve import add_serve_bench_args, cmd_serve
    b = sub.add_parser("bench", help="latency / throughput / serving benchmarks (vLLM's report)",
                       allow_abbrev=False)
    bsub = b.add_subparsers(dest="bench_command", required=True)
    for name, fn in (("latency", cmd_latency), ("throughput", cmd_throughput), ("serve", cmd_serve)):
        p = bsub.add_parser(name, allow_abbrev=False)
        add_engine_args(p)
        p.add_argument("--input-len", type=int, default=64)
        p.add_argument("--output-len", type=int, default=64)
        p.add_argument("--prompt-kind", choices=["code", "prose", "random"], default="code")
        p.add_argument("--output-json", default=None)
        if name != "serve":
            p.add_argument("--num-iters-warmup", type=int, default=1,
                           help="untimed runs of the measured batch shape before the timed run (vLLM's flag)")
        p.add_argument("--peak-bandwidth-gbs", type=float, default=None,
                       help="copy bandwidth of the roofline in GB/s (default: measured on the device)")
        if name == "latency":
            p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
            p.add_argument("--compare-spec", action="store_true", help="run with DFlash off and on, report the ratio")
            p.add_argument("--num-iters", type=int, default=1,
                           help="timed batches per batch size, each of other prompts; metrics are their means")
        else:
            p.add_argument("--num-prompts", type=int, default=32)
        if name == "serve":
            add_serve_bench_args(p)
        p.set_defaults(func=fn)
