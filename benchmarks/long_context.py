"""Benchmark 4: one 524,288-token prompt + 64 generated tokens on one GPU, FP8 KV cache, chunked prefill.

Usage: ``python3 benchmarks/long_context.py --out DIR`` (one H200, ~130 s expected; the prefill is
aborted at ``--budget-s`` 185 s); on the CPU: ``python3 benchmarks/long_context.py --tokens 4096 --max-num-batched-tokens 1024
--context-workspace-rows 2048 --out DIR`` (~15-30 s; checks the script, 4 chunks, 2 workspace tiles).

Model: the embedded default model (Kimi-K3 architecture, 14 MLA layers, 4 heads, qk 32 + 16 rope,
v 32, kv_lora_rank 64; plain RoPE, theta 1e4, no YaRN) far beyond its ``max_position_embeddings``
(4096): RoPE is computed from the positions, so the model runs at any length (quality past 4K is not
the question here; time, memory and completion are). Like vLLM, the engine refuses a ``max_model_len``
above ``max_position_embeddings`` (vLLM: ``User-specified max_model_len ... is greater than the derived
max_model_len``, overridable with ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` or ``--hf-overrides
'{"max_position_embeddings": N}'``). longflash has no such switch yet, so this script does what
``--hf-overrides`` does: it runs the model from a temporary directory whose ``config.json`` says
``max_position_embeddings = max_model_len`` (every other file is a symlink to the model's), and passes
``max_model_len`` explicitly.

Engine: ``LLMEngine`` with ``kv_cache_dtype="fp8"`` (k_scale 1.0, vLLM's default; ``--calculate-kv-scales``
for amax/200 of the first chunk), chunked prefill of ``--max-num-batched-tokens`` tokens per step,
``--context-workspace-rows`` rows of cached context gathered (and dequantized) per attention call,
speculative decoding off (the target's decode is measured), prefix caching off (one request), CUDA
graphs for decode. The prompt is seeded random token ids; greedy, ignore_eos.

Reported: completed (yes/no), peak GPU memory (``torch.cuda.max_memory_allocated`` / ``_reserved``;
also after start-up, i.e. weights + KV cache), KV cache bytes and capacity (tokens), prefill time (s)
and tok/s (= time to first token), decode tok/s over the 63 decode steps and their bandwidth roofline
(weights + the request's KV rows per step over the copy bandwidth measured here), the engine settings.
If the prefill is still running at ``--budget-s`` the request is aborted and the run reports
``completed: false`` with the projected prefill time (per-chunk time grows linearly with the context,
so the total is fitted as a + b·i over the chunks done). ``long_context.json`` is rewritten during the
run (a timeout keeps the progress) and ``long_context.md`` at the end.

Cost estimate (default model, N = 524,288, chunk C = 8192; per layer H = 4 heads, d_qk = 48, d_v = 32):
causal attention does N²/2 query-key pairs per head, i.e. H·N²/2 = 5.5e11 score elements per layer,
7.7e12 over 14 layers; FLOPs = 2·(d_qk + d_v)·H·N²/2 per layer = 8.8e13, 1.23e15 for the model (the
C×C diagonal square per chunk, computed whole and masked, adds C/N = 1.6 %). The GPU prefill's
attention is dense fp32 over [C x W] score tiles (``triton_ops.attention_with_lse`` =
``ops.attention_with_lse_inplace``), so the cost is the fp32 GEMMs (1.23e15 FLOP at ~30-40 TFLOP/s,
no TF32, skinny shapes: ~30-40 s) plus the passes over the score tiles (~32 B of traffic per element:
2.5e14 B at ~3.5 TB/s, ~70 s): ~100-110 s expected on the H200 (the reference form, ~60 B per
element, would take ~170 s). Everything else (projections, MoE, the gather and up-projection of the
context, ~N²/(2C) rows per layer) is a few percent of that. Peak memory: one [H, C, W] fp32 score
tile (4 x 8192 x 65536 x 4 B = 8.6 GB at the defaults) + the model (28 MB) + the KV cache
(524,352 tokens x 14 layers x 80 B = 587 MB in fp8). Before the run, one such tile is timed in both
forms and their results compared (``attention_tile`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def dump(res: dict, out: str) -> None:
    """Write ``res`` to ``out/long_context.json`` (during the run: a timeout keeps the progress)."""
    with open(os.path.join(out, "long_context.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)


def attention_estimate(cfg: dict, num_tokens: int, chunk: int, score_bytes: float = 32.0) -> dict:
    """Prefill attention cost of one causal ``num_tokens`` prompt in chunks of ``chunk`` (module docstring).

    Args:
        cfg: the model's config.json (MLA dims, heads, layers).
        score_bytes: memory traffic per materialized fp32 score element (dense path; ~32 B).
    Returns:
        score_elements (incl. the masked half of each chunk's diagonal square), causal_flops (the
        visible pairs only: 2·(d_qk + d_v) per head and pair), score_traffic_bytes.
    """
    H, L = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    d_qk, d_v = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    pairs = num_tokens * (num_tokens + 1) / 2
    n_chunks = -(-num_tokens // chunk)
    elements = H * L * (pairs + n_chunks * chunk * (chunk - 1) / 2)
    return {"score_elements": elements, "causal_flops": 2 * (d_qk + d_v) * H * L * pairs,
            "score_traffic_bytes": elements * score_bytes}


def long_model_dir(src: str, max_model_len: int) -> str:
    """A temporary model directory equal to ``src`` except ``max_position_embeddings = max_model_len``
    in its config.json (what vLLM's ``--hf-overrides`` does); the other entries are symlinks.
    The caller removes it."""
    dst = tempfile.mkdtemp(prefix="long-ctx-model-")
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(os.path.abspath(src), name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = max(int(cfg.get("max_position_embeddings") or 0), max_model_len)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _memory(dev: torch.device) -> dict:
    if dev.type == "cuda":
        return {"max_allocated_bytes": torch.cuda.max_memory_allocated(dev),
                "max_reserved_bytes": torch.cuda.max_memory_reserved(dev),
                "allocated_bytes": torch.cuda.memory_allocated(dev)}
    return {"process_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _projection(chunk_times: list[float], total_chunks: int) -> float:
    """Projected prefill seconds: least-squares fit t_i = a + b·i over the chunks done (i = 0..k-1),
    summed over all ``total_chunks``."""
    k = len(chunk_times)
    if k < 3:
        return sum(chunk_times) / max(k, 1) * total_chunks
    xm, ym = (k - 1) / 2, sum(chunk_times) / k
    b = sum((i - xm) * (t - ym) for i, t in enumerate(chunk_times)) / sum((i - xm) ** 2 for i in range(k))
    a = ym - b * xm
    return total_chunks * a + b * total_chunks * (total_chunks - 1) / 2


def attention_tile_check(cfg: dict, rows_q: int, rows_k: int, dev: torch.device, repeats: int = 3) -> dict:
    """One prefill attention tile of the model ([rows_q] queries x [rows_k] context keys, bf16 inputs
    on a GPU, fp32 on the CPU): the reference ``ops.attention_with_lse`` against the in-place form the
    GPU prefill runs (``ops.attention_with_lse_inplace``): max |difference| of output and LSE, median
    time and peak memory of each, and the in-place form's score traffic (32 B per score element) as a
    fraction of the copy bandwidth measured by the caller."""
    from longflash.attention import ops
    H, d, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(rows_q, H, d, device=dev, generator=g).to(dt)
    k = torch.randn(rows_k, H, d, device=dev, generator=g).to(dt)
    v = torch.randn(rows_k, H, dv, device=dev, generator=g).to(dt)
    scale = d ** -0.5
    out = {"rows_q": rows_q, "rows_k": rows_k, "heads": H, "score_elements": H * rows_q * rows_k}
    results = {}
    for name, fn in (("reference", ops.attention_with_lse), ("inplace", ops.attention_with_lse_inplace)):
        times = []
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        for _ in range(repeats):
            _sync(dev)
            t0 = time.perf_counter()
            results[name] = fn(q, k, v, scale, None)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = 1e3 * sorted(times)[len(times) // 2]
        if dev.type == "cuda":
            out[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated(dev) - base
        if name == "reference":
            ref = results.pop(name)
    got = results["inplace"]
    out["max_abs_diff_out"] = (got[0].float() - ref[0].float()).abs().max().item()
    out["max_abs_diff_lse"] = (got[1] - ref[1]).abs().max().item()
    out["speedup"] = out["reference_ms"] / out["inplace_ms"]
    out["inplace_score_gbs"] = 32 * out["score_elements"] / (out["inplace_ms"] / 1e3) / 1e9
    return out


def run(args, res: dict, dev: torch.device) -> None:
    from longflash.bench_roofline import StepBytes, measure_copy_bandwidth
    from longflash.config import EngineConfig
    from longflash.engine.llm_engine import LLMEngine
    from longflash.sampling_params import SamplingParams

    res["copy_gbs"] = measure_copy_bandwidth(dev)
    log(f"copy bandwidth {res['copy_gbs']:.0f} GB/s")
    N, out_len, bs = args.tokens, args.output_len, 16
    max_model_len = -(-(N + out_len) // bs) * bs
    model_dir = long_model_dir(args.model, max_model_len)
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        res["estimate"] = attention_estimate(cfg, N, args.max_num_batched_tokens)
        if not args.skip_tile_check:
            W = min(args.context_workspace_rows, max(N - args.max_num_batched_tokens, 16))
            tc = res["attention_tile"] = attention_tile_check(cfg, min(args.max_num_batched_tokens, N), W, dev)
            tc["inplace_score_traffic_vs_copy"] = tc["inplace_score_gbs"] / res["copy_gbs"]
            log(f"attention tile {tc['rows_q']} x {tc['rows_k']} x {tc['heads']} heads: reference "
                f"{tc['reference_ms']:.1f} ms, in-place {tc['inplace_ms']:.1f} ms ({tc['speedup']:.2f}x, "
                f"{tc['inplace_score_traffic_vs_copy']:.2f} of copy at 32 B/score); max |diff| out "
                f"{tc['max_abs_diff_out']:.2e}, lse {tc['max_abs_diff_lse']:.2e}")
            dump(res, args.out)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
        ec = EngineConfig(model=model_dir, dtype="bfloat16" if dev.type == "cuda" else "float32", device=dev.type,
                          max_model_len=max_model_len, max_num_seqs=1, block_size=bs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          context_workspace_rows=args.context_workspace_rows, kv_cache_dtype=args.kv_cache_dtype,
                          calculate_kv_scales=args.calculate_kv_scales, enable_prefix_caching=False,
                          kv_cache_memory=args.kv_cache_memory, speculative_config="off", skip_tokenizer_init=True,
                          seed=args.seed)
        res["settings"] = {k: getattr(ec, k) for k in (
            "dtype", "max_model_len", "max_num_batched_tokens", "context_workspace_rows", "block_size",
            "kv_cache_dtype", "calculate_kv_scales", "kv_cache_memory", "enable_prefix_caching",
            "speculative_config", "enforce_eager")}
        res["settings"]["max_position_embeddings_override"] = cfg["max_position_embeddings"]
        t0 = time.perf_counter()
        engine = LLMEngine(ec)
        res["engine_start_s"] = time.perf_counter() - t0
        rep = engine.startup_report()
        res["kv_cache"] = {k: rep[k] for k in ("kv_cache_dtype", "kv_cache_tokens", "kv_cache_blocks", "kv_cache_bytes",
                                               "kv_bytes_per_token", "k_scale_source")}
        res["memory_after_start"] = _memory(dev)
        log(f"engine up in {res['engine_start_s']:.1f} s: KV cache {rep['kv_cache_tokens']} tokens "
            f"({rep['kv_cache_bytes'] / 2**20:.0f} MiB {rep['kv_cache_dtype']}, {rep['kv_bytes_per_token']} B/token)")
        dump(res, args.out)

        rng = random.Random(args.seed)
        prompt = [rng.randrange(4, engine.vocab_size) for _ in range(N)]
        rid = engine.add_request(None, {"prompt_token_ids": prompt},
                                 SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
        n_chunks = -(-N // args.max_num_batched_tokens)
        chunk_times: list[float] = []
        step_times: list[float] = []
        tokens: list[int] = []
        t_start = time.perf_counter()
        last_dump = t_start
        aborted = False
        while engine.has_unfinished_requests():
            ts = time.perf_counter()
            outs = engine.step()
            _sync(dev)
            now = time.perf_counter()
            had_token = bool(tokens)
            for o in outs:
                if o.request_id == rid:
                    tokens = list(o.outputs[0].token_ids)
            if had_token:
                step_times.append(now - ts)  # a decode step
                continue
            chunk_times.append(now - ts)  # a prefill chunk (the last one also samples the first token)
            if tokens:
                t_first = now
                continue
            done = min(len(chunk_times) * args.max_num_batched_tokens, N)
            res["progress"] = {"prefill_tokens_done": done, "prefill_s": now - t_start,
                               "projected_prefill_s": _projection(chunk_times, n_chunks)}
            if now - last_dump > 10 or len(chunk_times) == 1:
                dump(res, args.out)
                last_dump = now
                log(f"prefill {done}/{N} tokens in {now - t_start:.1f} s (chunk {1e3 * (now - ts):.0f} ms; "
                    f"projected prefill {res['progress']['projected_prefill_s']:.0f} s)")
            if now - T0 > args.budget_s:
                log(f"budget of {args.budget_s:.0f} s reached during the prefill: request aborted")
                engine.abort_request(rid)
                aborted = True
                break
        res["completed"] = not aborted and len(tokens) == out_len
        res["memory_peak"] = _memory(dev)
        if engine.failed_requests:  # the engine aborts a request whose step raised (e.g. out of memory)
            err = engine.failed_requests[0][1]
            res["error"] = f"{type(err).__name__}: {str(err)[:500]}"
            log(f"request failed: {res['error']}")
        if aborted or not res["completed"]:
            return
        prefill_s = t_first - t_start
        res["prefill"] = {"tokens": N, "chunks": len(chunk_times), "time_s": prefill_s, "tok_s": N / prefill_s,
                          "first_chunk_ms": 1e3 * chunk_times[0], "last_chunk_ms": 1e3 * chunk_times[-1]}
        est = res["estimate"]
        res["prefill"]["attention_tflops_achieved"] = est["causal_flops"] / prefill_s / 1e12
        sb = StepBytes.of_engine(engine)
        steps = len(step_times)
        dec_s = sum(step_times)
        ctx_mean = N + 1 + (steps - 1) / 2  # cached rows a decode step reads, averaged over the steps
        bytes_step = sb.step(1, int(ctx_mean))
        res["decode"] = {"steps": steps, "time_s": dec_s, "tok_s": steps / dec_s if dec_s else 0.0,
                         "step_ms": 1e3 * dec_s / max(steps, 1), "median_step_ms": 1e3 * sorted(step_times)[steps // 2],
                         "bytes_per_step": bytes_step, "kv_bytes_per_step": int(ctx_mean) * sb.kv_row,
                         "roofline_fraction": bytes_step / (dec_s / steps) / (res["copy_gbs"] * 1e9) if dec_s else 0.0}
        res["generated_tokens"] = tokens
        log(f"prefill {N} tokens in {prefill_s:.1f} s ({N / prefill_s:.0f} tok/s); decode {steps} steps "
            f"{res['decode']['tok_s']:.1f} tok/s ({res['decode']['step_ms']:.2f} ms/step, "
            f"{res['decode']['roofline_fraction']:.3f} of the copy roofline)")
        del engine
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def report(res: dict) -> str:
    """The markdown summary of ``res``."""
    gib = 2 ** 30
    s = res.get("settings", {})
    lines = [f"# Long context: {res['args']['tokens']:,}-token prompt + {res['args']['output_len']} tokens, "
             f"default model, {s.get('kv_cache_dtype', '?')} KV cache ({res['device']})", "",
             f"commit {res.get('commit', '?')[:12]}; `{res['command']}`; total {res.get('total_s', 0):.0f} s", "",
             f"completed: **{'yes' if res.get('completed') else 'no'}**", "",
             "| quantity | value |", "|---|---|"]
    m, m0 = res.get("memory_peak", {}), res.get("memory_after_start", {})
    if "max_allocated_bytes" in m:
        lines += [f"| peak GPU memory allocated / reserved | {m['max_allocated_bytes'] / gib:.2f} / "
                  f"{m['max_reserved_bytes'] / gib:.2f} GiB |",
                  f"| allocated after start-up (weights + KV cache) | {m0.get('allocated_bytes', 0) / gib:.2f} GiB |"]
    elif m:
        lines.append(f"| process peak RSS | {m['process_max_rss_bytes'] / gib:.2f} GiB |")
    kv = res.get("kv_cache")
    if kv:
        lines.append(f"| KV cache | {kv['kv_cache_bytes'] / gib:.3f} GiB, {kv['kv_cache_tokens']:,} tokens "
                     f"({kv['kv_cache_dtype']}, {kv['kv_bytes_per_token']} B/token, k_scale {kv['k_scale_source']}) |")
    p, d = res.get("prefill"), res.get("decode")
    if p:
        lines += [f"| prefill time (= TTFT) | {p['time_s']:.1f} s ({p['chunks']} chunks, first "
                  f"{p['first_chunk_ms']:.0f} ms, last {p['last_chunk_ms']:.0f} ms) |",
                  f"| prefill throughput | {p['tok_s']:,.0f} tok/s; causal attention "
                  f"{p['attention_tflops_achieved']:.1f} TFLOP/s |"]
    elif "progress" in res:
        g = res["progress"]
        lines.append(f"| prefill (not finished) | {g['prefill_tokens_done']:,} tokens in {g['prefill_s']:.1f} s; "
                     f"projected {g['projected_prefill_s']:.0f} s |")
    if d:
        lines += [f"| decode | {d['tok_s']:.1f} tok/s over {d['steps']} steps ({d['step_ms']:.2f} ms/step, median "
                  f"{d['median_step_ms']:.2f}) |",
                  f"| decode bytes/step, roofline | {d['bytes_per_step'] / 1e6:.1f} MB (KV "
                  f"{d['kv_bytes_per_step'] / 1e6:.1f} MB), {d['roofline_fraction']:.3f} of {res['copy_gbs']:.0f} GB/s |"]
    if "engine_start_s" in res:
        lines.append(f"| engine start-up | {res['engine_start_s']:.1f} s |")
    tc = res.get("attention_tile")
    if tc:
        lines.append(f"| one prefill attention tile ({tc['rows_q']} x {tc['rows_k']} x {tc['heads']} heads) | "
                     f"reference {tc['reference_ms']:.1f} ms, in-place {tc['inplace_ms']:.1f} ms ({tc['speedup']:.2f}x; "
                     f"{tc['inplace_score_traffic_vs_copy']:.2f} of copy at 32 B/score); max abs diff out "
                     f"{tc['max_abs_diff_out']:.1e}, LSE {tc['max_abs_diff_lse']:.1e} |")
    e = res.get("estimate")
    if e:
        lines.append(f"| estimate: attention | {e['causal_flops']:.3g} FLOP (causal), {e['score_elements']:.3g} fp32 "
                     f"score elements |")
    if res.get("error"):
        lines.append(f"\nerror: {res['error']}")
    lines.append(f"\nsettings: `{json.dumps(s)}`")
    return "\n".join(lines)


def main() -> int:
    from longflash.default_model_path import default_model_path
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    ap.add_argument("--tokens", type=int, default=524288, help="prompt length")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="prefill chunk (tokens per step)")
    ap.add_argument("--context-workspace-rows", type=int, default=64 * 1024)
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "bfloat16", "auto"])
    ap.add_argument("--calculate-kv-scales", action="store_true")
    ap.add_argument("--kv-cache-memory", default=None,
                    help="KV cache budget (default: the request's blocks + 1 %%, so the figure is the request's)")
    ap.add_argument("--budget-s", type=float, default=185.0, help="abort the prefill past this wall time (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-tile-check", action="store_true",
                    help="skip the one-tile reference vs in-place attention check before the run")
    args = ap.parse_args()
    if args.tokens < 1 or args.output_len < 2:
        raise SystemExit("--tokens must be >= 1 and --output-len >= 2")
    args.model = args.model or default_model_path()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.kv_cache_memory is None:
        from longflash.models.loader import build_model, load_config
        meta = build_model(load_config(args.model), torch.float32, torch.device("meta"))  # shapes only
        kv_dtype = {"fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}.get(
            args.kv_cache_dtype, torch.bfloat16 if dev.type == "cuda" else torch.float32)
        blocks = -(-(args.tokens + args.output_len) // 16) + 1
        args.kv_cache_memory = int(blocks * 16 * meta.kv_cache_spec().bytes_per_token(kv_dtype) * 1.01) + 1
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "args": vars(args), "command": " ".join(["python3"] + sys.argv), "completed": False}
    res["commit"] = provenance.commit()
    try:
        run(args, res, dev)
    except Exception as e:  # noqa: BLE001 — recorded (OOM included), then re-raised after the report
        res["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        res["memory_peak"] = _memory(dev)
        log(f"failed: {res['error']}")
        raise
    finally:
        res["total_s"] = time.perf_counter() - T0
        dump(res, args.out)
        md = report(res)
        with open(os.path.join(args.out, "long_context.md"), "w") as f:
            f.write(md + "\n")
        print(md, flush=True)
    return 0 if res["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
