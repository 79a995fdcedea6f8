"""Benchmark 2: end-to-end decode of a DeepSeek-V3-architecture model with random weights.

Usage: ``python3 benchmarks/e2e_decode.py --out DIR`` (one H200 call, <= ``--budget-s`` 220 s; ``--tiny``
or no GPU: a tiny config on the CPU, to check the script in a few seconds).

1. Ceilings measured in the same run: device copy bandwidth (1 GiB, read + write) and the bf16 GEMM rate.
2. A random-weights ``DeepseekV3ForCausalLM`` (HF transformers) is built on the device in bf16: 24 layers,
   hidden 2048, 16 heads, DeepSeek-V3's MLA dims (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128,
   qk_rope 64, v 128), 64 routed experts top-6 of intermediate 256 in 8 groups (top-4 groups), 2 shared
   experts, first layer dense (intermediate 8192), vocab 129,280: 3.3B parameters. It is saved with
   ``save_pretrained`` (safetensors) to a temporary directory.
3. HF ``generate`` on those weights (greedy, ``cache_implementation="static"``, SDPA attention, each
   ``experts_implementation`` the installed version offers) at batch 1 and 64: decode tok/s =
   batch x (N - 1) / (t(N new tokens) - t(1 new token)). ``disable_compile=True``: on a GPU,
   transformers >= 4.5x compiles the forward by itself when the cache is static; that compile (minutes
   for this model, again per batch shape and experts implementation) does not fit the run, so HF's
   figure is its best *eager* setting. A failing implementation is recorded and skipped.
4. longflash on the saved checkpoint (CUDA graphs on; then, when the budget leaves time,
   ``--enforce-eager`` for the graphs' gain): the same prompts, ``--output-len`` tokens after a
   warm-up run of the same batch shape; decode tok/s over the decode-only steps, their bytes (weights
   read for the step's tokens, routed experts by the expected number hit, + KV rows;
   ``longflash.bench_roofline``) and the fraction of the copy-bandwidth roofline.
5. Check: longflash's greedy tokens against HF's for the first rows of each batch (equal in fp32 on
   the CPU; in bf16 random-weight logits have near-ties, so a late divergence is not an error).
Goals (issue #10): roofline fraction >= 0.75 at batch 1; >= 5x HF's decode tok/s.
Progress lines carry the seconds since the start; ``e2e_decode.json`` is rewritten after every phase
(a timeout keeps what finished) and ``e2e_decode.md`` at the end.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)

FULL = dict(vocab_size=129280, hidden_size=2048, intermediate_size=8192, moe_intermediate_size=256,
            num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
            n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4, first_k_dense_replace=1,
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096, rope_theta=10000.0,
            rope_interleave=True, initializer_range=0.02, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
TINY = dict(FULL, vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            max_position_embeddings=512, initializer_range=0.1)
T0 = time.perf_counter()
# --baselines: name -> (module, switch) set to False for that run (issue 10's "report ratios against a
# baseline measured in the same run")
BASELINES = {"cublas": ("longflash.layers.gemv", "enabled"), "no-pdl": ("longflash.ops.triton_env", "PDL"),
             "moe-launches": ("longflash.layers.moe", "ONE_TOKEN_KERNEL"),
             "sync-scheduling": ("EngineConfig", "async_scheduling"),  # an engine setting, not a module switch
             "sync-when-waiting": ("longflash.engine.async_scheduling", "LAUNCH_WITH_WAITING")}


def model_config(dev: torch.device, max_len: int) -> tuple[dict, torch.dtype]:
    """The DeepSeek-V3-shaped config (``FULL`` on a GPU, ``TINY`` on the CPU) with room for ``max_len``
    positions, and the dtype its checkpoint is built in (bf16 on a GPU, fp32 on the CPU); shared by
    ``long_decode.py`` and ``profile_prefill.py``."""
    cfg = dict(FULL if dev.type == "cuda" else TINY)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], max_len)
    return cfg, torch.bfloat16 if dev.type == "cuda" else torch.float32


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


def dump(res: dict, out: str) -> None:
    """Write ``res`` to ``out/e2e_decode.json`` (after every phase: a timeout keeps what finished)."""
    with open(os.path.join(out, "e2e_decode.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def gemm_tflops(dev: torch.device) -> float:
    """bf16 GEMM rate (TFLOP/s, median of 10) on random data; 8192^3 on a GPU, 512^3 fp32 on the CPU."""
    n, dt = (8192, torch.bfloat16) if dev.type == "cuda" else (512, torch.float32)
    a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
    a @ b
    times = []
    for _ in range(10):
        _sync(dev)
        t0 = time.perf_counter()
        a @ b
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times) / 1e12


def build_checkpoint(cfg: dict, dev: torch.device, dtype: torch.dtype, path: str, seed: int = 0):
    """A random-weights HF DeepseekV3ForCausalLM on ``dev`` in ``dtype``, saved to ``path`` (safetensors);
    returns the model. The router's ``e_score_correction_bias`` (zeros after init) is set to U[0, 0.5) so
    the grouped top-k selection depends on it, as in a trained checkpoint."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    config = DeepseekV3Config(**cfg)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = DeepseekV3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(prev)
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape, generator=g, device=dev) * 0.5)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="4GB")
    n = per_expert_checkpoint(path)
    if n:
        log(f"save_pretrained wrote {n} fused expert tensors: rewritten per expert")
    return model


def per_expert_checkpoint(path: str) -> int:
    """Rewrite fused routed-expert tensors in the safetensors files of ``path`` as DeepSeek-V3's
    per-expert tensors (what vLLM and longflash read); returns the number of fused tensors rewritten.

    transformers 5.x keeps a layer's routed experts fused in memory (``mlp.experts.gate_up_proj``
    [E, 2I, H], gate rows first, and ``mlp.experts.down_proj`` [E, H, I]); ``save_pretrained`` of the
    versions checked here (5.24) already writes ``mlp.experts.{e}.{gate,up,down}_proj.weight``, so this
    is a no-op there; it guards a version that saves the fused layout."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    rewritten = 0
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        f = os.path.join(path, name)
        with safe_open(f, "pt") as st:
            metadata = st.metadata()
            fused = [k for k in st.keys() if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
        if not fused:
            continue
        tensors = load_file(f)
        for k in fused:
            w, prefix = tensors.pop(k), k.rsplit(".", 1)[0]
            for e in range(w.shape[0]):
                if k.endswith("gate_up_proj"):
                    gate, up = w[e].chunk(2, dim=0)
                    tensors[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                    tensors[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
                else:
                    tensors[f"{prefix}.{e}.down_proj.weight"] = w[e].contiguous()
            rewritten += 1
        save_file(tensors, f, metadata=metadata)
    index = os.path.join(path, "model.safetensors.index.json")
    if rewritten and os.path.isfile(index):  # sharded: the weight map names the new tensors
        with open(index) as fh:
            idx = json.load(fh)
        wm = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(path, name), "pt") as st:
                    wm.update({k: name for k in st.keys()})
        idx["weight_map"] = wm
        with open(index, "w") as fh:
            json.dump(idx, fh, indent=2)
    return rewritten


def hf_decode(model, prompts: torch.Tensor, new_tokens: int, dev: torch.device) -> dict:
    """HF greedy generate with a static cache, no auto-compile; decode tok/s from t(N) - t(1).
    Returns the timings and the generated tokens of the first 4 rows."""
    B = prompts.shape[0]
    mask = torch.ones_like(prompts)

    def gen(n: int):
        _sync(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(prompts, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 cache_implementation="static", disable_compile=True, pad_token_id=0)
        _sync(dev)
        return time.perf_counter() - t0, out

    gen(2)  # warm-up (allocates the static cache, first-use kernels)
    t1, _ = gen(1)
    tn, out = gen(new_tokens)
    step = (tn - t1) / (new_tokens - 1)
    if step <= 0:
        raise RuntimeError(f"t({new_tokens} tokens) {tn:.4f} s <= t(1 token) {t1:.4f} s: timing noise")
    return {"batch": B, "decode_step_ms": 1e3 * step, "decode_tok_s": B / step, "prefill_plus_1_s": t1,
            "tokens": out[:4, prompts.shape[1]:].tolist()}


def hf_bench(model, prompts: dict[int, torch.Tensor], new_tokens: int, dev: torch.device, deadline: float) -> dict:
    """``hf_decode`` per experts implementation (those ``set_experts_implementation`` accepts, else the
    model's default) and batch; a failure (e.g. ``batched_mm``, which copies the chosen experts'
    weights per token, runs out of memory on a 64 x 128-token prefill) is recorded for that pair only;
    an implementation is skipped once ``elapsed() > deadline``. ``best``: per batch the fastest."""
    impls = ["default"]
    if hasattr(model, "set_experts_implementation"):
        impls = ["grouped_mm", "batched_mm", "eager"]
    res: dict[str, dict] = {}
    for impl in impls:
        if res and elapsed() > deadline:
            res[impl] = {"skipped": f"time budget (at {elapsed():.0f} s)"}
            log(f"HF {impl}: skipped (time budget)")
            continue
        try:
            if impl != "default":
                model.set_experts_implementation(impl)
        except Exception as e:  # noqa: BLE001 — an implementation this version lacks is recorded
            res[impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(f"HF {impl}: {res[impl]['error']}")
            continue
        res[impl] = {}
        for b, p in prompts.items():
            try:
                r = res[impl][str(b)] = hf_decode(model, p, new_tokens, dev)
                log(f"HF {impl} batch {b}: {r['decode_tok_s']:.1f} tok/s, step {r['decode_step_ms']:.2f} ms")
            except Exception as e:  # noqa: BLE001 — recorded; the other pairs still run
                res[impl][f"error_batch_{b}"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"HF {impl} batch {b}: {res[impl][f'error_batch_{b}']}")
                _free(dev)
    best = {}
    for b in prompts:
        runs = [(v[str(b)]["decode_tok_s"], k) for k, v in res.items() if str(b) in v]
        if runs:
            tok_s, impl = max(runs)
            best[str(b)] = {"decode_tok_s": tok_s, "experts_implementation": impl}
    return {"runs": res, "best": best}


def greedy_tokens(engine, rows: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations (``n`` tokens, ignore_eos) of ``rows`` through ``engine``, in row order."""
    from longflash.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": r}, params) for r in rows]
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = list(o.outputs[0].token_ids)
    return [got[i] for i in ids]


def device_us(avg) -> float:
    """A profiler key average's own device time (µs), under either torch attribute name."""
    return getattr(avg, "self_device_time_total", None) or getattr(avg, "self_cuda_time_total", 0.0)


def profile_steps(engine, steps: int) -> tuple[list, float]:
    """``steps`` engine steps under torch.profiler (CUDA activity; graph replays included): (the CUDA
    kernels' key averages, wall seconds per step)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - t0) / steps
    return [a for a in prof.key_averages() if getattr(a, "device_type", None) == DeviceType.CUDA], wall


def kernel_profile(engine, prompts: list[list[int]], steps: int = 6) -> dict:
    """Kernels per decode step and their GPU time against the step's wall time (torch.profiler, CUDA
    activity; graph replays included), and the kernels taking most time: where a step's time goes."""
    from longflash.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for p in prompts:
        engine.add_request(None, {"prompt_token_ids": p}, params)
    engine.step()  # prefill
    engine.step()
    avgs, wall = profile_steps(engine, steps)
    while engine.has_unfinished_requests():
        engine.step()
    dev_us = device_us
    total_us = sum(dev_us(a) for a in avgs)
    top = sorted(avgs, key=dev_us, reverse=True)[:12]
    return {"batch": len(prompts), "steps": steps, "wall_ms_per_step": 1e3 * wall,
            "kernels_per_step": sum(a.count for a in avgs) / steps, "kernel_ms_per_step": total_us / 1e3 / steps,
            "top": [{"kernel": a.key[:90], "per_step": a.count / steps, "us_per_step": dev_us(a) / steps}
                    for a in top]}


def op_shape_profile(engine, prompts: list[list[int]], steps: int = 2, top: int = 30) -> list[dict]:
    """An eager engine's decode steps under torch.profiler with CPU + CUDA activity and input shapes:
    the PyTorch ops with the most device time, per input shape (which GEMM a kernel of the graph
    profile is). Rows: op, input shapes, calls per step, device us per step."""
    from torch.profiler import ProfilerActivity, profile
    from longflash.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for p in prompts:
        engine.add_request(None, {"prompt_token_ids": p}, params)
    engine.step()
    engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    avgs = [a for a in prof.key_averages(group_by_input_shape=True) if a.key.startswith("aten::") and device_us(a) > 0]
    avgs.sort(key=device_us, reverse=True)
    return [{"op": a.key, "shapes": str(a.input_shapes)[:160], "per_step": a.count / steps,
             "device_us_per_step": device_us(a) / steps} for a in avgs[:top]]


def graph_replay_ms(dr, batch: int, replays: int = 50) -> float | None:
    """Milliseconds per replay of the captured one-token decode graph of ``batch`` rows, replayed
    back to back (its last inputs: it rewrites the same cache slots), timed with CUDA events: the GPU's
    share of a decode step without the host's scheduling and sampling. None without that graph."""
    graphs = getattr(dr, "graphs", None) or {}
    entry = graphs.get((1, dr._bucket(batch))) if graphs else None
    if entry is None:
        return None
    g = entry[0]
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def ours_bench(path: str, prompts: dict[int, torch.Tensor], output_len: int, dev: torch.device, peak_gbs: float,
               max_model_len: int, enforce_eager: bool, hf_tokens: dict[int, list[list[int]]],
               profile_deadline: float, op_shapes: bool = False, engine_kw: dict | None = None,
               label: str | None = None, max_num_seqs: int | None = None) -> dict:
    """longflash on the checkpoint at ``path``: per batch a warm-up run of the same shape (4 tokens),
    the timed ``run_offline`` and its roofline, greedy tokens vs HF's (``hf_tokens``: batch -> rows),
    and on a GPU a kernel profile while ``elapsed() < profile_deadline``. ``engine_kw`` overrides
    ``EngineConfig`` fields (e.g. ``kv_cache_dtype``, ``max_num_batched_tokens``; ``benchmarks/long_decode.py``);
    ``label`` names the run in the log (a baseline's key). ``max_num_seqs`` (default: the largest batch)
    below a batch leaves that batch's other requests waiting for a slot (the serving steady state)."""
    from longflash.bench import run_offline
    from longflash.bench_roofline import StepBytes
    from longflash.config import EngineConfig
    from longflash.engine.llm_engine import LLMEngine
    name = "eager" if enforce_eager else ("graphs" if dev.type == "cuda" else "default")
    if label:  # a baseline's run: its row name in the log too
        name = f"{name} ({label})"
    t0 = time.perf_counter()
    kw = dict(model=path, dtype="bfloat16" if dev.type == "cuda" else "float32", device=dev.type,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs or max(prompts),
              max_num_batched_tokens=max(2048, max(prompts) * max_model_len // 2),
              kv_cache_memory="8GiB" if dev.type == "cuda" else "256MiB", skip_tokenizer_init=True,
              enforce_eager=enforce_eager, enable_prefix_caching=False)
    engine = LLMEngine(EngineConfig(**dict(kw, **(engine_kw or {}))))
    dr = engine.runner.decode_runner
    out = {"engine_start_s": time.perf_counter() - t0, "graph_capture_s": getattr(dr, "capture_time_s", 0.0) or 0.0}
    log(f"longflash {name}: engine up in {out['engine_start_s']:.1f} s (graph capture {out['graph_capture_s']:.1f} s)")
    sb = StepBytes.of_engine(engine)
    out["weight_bytes_step_1_token"], out["weight_bytes_step_64_tokens"] = sb.weights(1), sb.weights(64)
    out["kv_bytes_per_token"] = sb.kv_row
    for b, p in prompts.items():
        rows = p.tolist()
        reqs = [{"prompt_token_ids": row} for row in rows]
        run_offline(engine, reqs, 4)  # warm-up of this batch shape (JIT compiles, allocator growth)
        m = run_offline(engine, reqs, output_len, peak_gbs)
        r = out[str(b)] = {
            # (a decode step holds at most max_num_seqs of the batch's requests)
            "batch": b, "decode_tok_s": min(b, engine.config.max_num_seqs) / (m["decode_step_ms"] / 1e3),
            "decode_step_ms": m["decode_step_ms"],
            "bytes_per_step": m["decode_bytes_per_step"], "achieved_gbs": m["achieved_bandwidth_gbs"],
            "roofline_fraction": m["bandwidth_roofline_fraction"], "output_tok_s": m["output_throughput"],
            "mean_ttft_ms": m["mean_ttft_ms"], "decode_steps": m["decode_steps"]}
        replay = graph_replay_ms(dr, min(b, engine.config.max_num_seqs))
        if replay is not None:
            r["graph_replay_ms"] = replay
            log(f"longflash {name} batch {b}: the decode step's CUDA graph alone {replay:.3f} ms per replay "
                f"(the rest of the step, {r['decode_step_ms'] - replay:.3f} ms, is host work)")
        log(f"longflash {name} batch {b}: {r['decode_tok_s']:.1f} tok/s, step {r['decode_step_ms']:.3f} ms, "
            f"{r['bytes_per_step'] / 1e6:.0f} MB/step, {r['roofline_fraction']:.3f} of the copy roofline; "
            f"output {r['output_tok_s']:.1f} tok/s over the whole run ({r['decode_steps']} decode-only steps)")
        ref = hf_tokens.get(b)
        if ref:
            ours = greedy_tokens(engine, rows[:len(ref)], len(ref[0]))
            agree = [next((i for i, (x, y) in enumerate(zip(o, h)) if x != y), len(h)) for o, h in zip(ours, ref)]
            r["greedy_vs_hf"] = {"tokens_per_row": len(ref[0]), "matching_prefix_per_row": agree,
                                 "ours_row0": ours[0], "hf_row0": ref[0]}
            log(f"longflash {name} batch {b}: greedy tokens equal to HF's for the first {agree} of {len(ref[0])}")
        if op_shapes and enforce_eager and dev.type == "cuda" and b == min(prompts):
            r["op_shapes"] = op_shape_profile(engine, rows)
            for o in r["op_shapes"]:
                log(f"  {o['device_us_per_step']:8.1f} us/step x{o['per_step']:5.1f} {o['op']} {o['shapes']}")
        if dev.type == "cuda" and elapsed() < profile_deadline:
            try:
                r["profile"] = kernel_profile(engine, rows)
            except Exception as e:  # noqa: BLE001 — the profile is a diagnostic; the numbers above stand
                r["profile"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    del engine
    return out


def report(res: dict, batches: list[int]) -> str:
    """The markdown summary of ``res`` (whatever phases finished)."""
    hf_best = res.get("hf", {}).get("best", {})
    lines = [f"# E2E decode, DeepSeek-V3 architecture, random weights ({res.get('params', 0) / 1e9:.2f}B params, "
             f"{res['device']})", "",
             f"copy bandwidth {res['copy_gbs']:.0f} GB/s, bf16 GEMM {res['gemm_tflops']:.3g} TFLOP/s; "
             f"commit {res.get('commit', '?')[:12]}; transformers {res.get('transformers', '?')}; "
             f"total {res.get('total_s', elapsed()):.0f} s", "",
             f"`{res['command']}`", "",
             "| engine | batch | decode tok/s | step ms | graph replay ms | MB/step | GB/s | roofline fraction | "
             "vs HF best | output tok/s (whole run) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    keys = ["longflash"] + [f"longflash_{n}" for n in BASELINES] + ["longflash_again", "longflash_eager"]
    for key in keys:
        for b in batches:
            r = res.get(key, {}).get(str(b))
            if not r:
                continue
            hf = hf_best.get(str(b), {}).get("decode_tok_s")
            r["speedup_vs_hf_best"] = r["decode_tok_s"] / hf if hf else None
            gr = r.get("graph_replay_ms")
            lines.append(f"| {key} | {b} | {r['decode_tok_s']:.1f} | {r['decode_step_ms']:.3f} | "
                         f"{'' if gr is None else f'{gr:.3f}'} | "
                         f"{r['bytes_per_step'] / 1e6:.0f} | {r['achieved_gbs']:.0f} | {r['roofline_fraction']:.3f} | "
                         f"{r['speedup_vs_hf_best'] or float('nan'):.1f}x | {r['output_tok_s']:.1f} |")
    for b in batches:
        best = hf_best.get(str(b))
        if best:
            lines.append(f"| HF generate (static cache, eager, experts {best['experts_implementation']}) | {b} | "
                         f"{best['decode_tok_s']:.1f} | {1e3 * b / best['decode_tok_s']:.3f} | | | | | 1.0x |")
    for impl, v in res.get("hf", {}).get("runs", {}).items():
        for key, msg in v.items():
            if key.startswith("error") or key == "skipped":
                lines.append(f"\nHF experts {impl} ({key}): {msg}")
    for b in batches:
        g, e = res.get("longflash", {}).get(str(b)), res.get("longflash_eager", {}).get(str(b))
        if g and e and res["device"] != "cpu":
            lines.append(f"\nCUDA graphs vs eager at batch {b}: {g['decode_tok_s'] / e['decode_tok_s']:.2f}x")
        for name in BASELINES:
            c = res.get(f"longflash_{name}", {}).get(str(b))
            if g and c:
                lines.append(f"\nlongflash vs longflash_{name} at batch {b}: {g['decode_tok_s'] / c['decode_tok_s']:.3f}x")
        if g and "greedy_vs_hf" in g:
            c = g["greedy_vs_hf"]
            lines.append(f"\nbatch {b}: longflash greedy tokens equal to HF's for the first "
                         f"{c['matching_prefix_per_row']} of {c['tokens_per_row']} per row")
    lines.append("\nGoals: roofline fraction >= 0.75 at batch 1; >= 5x HF generate.")
    for key in keys:
        for b in batches:
            prof = res.get(key, {}).get(str(b), {}).get("profile")
            if prof and "error" not in prof:
                lines.append(f"\n{key} batch {b}: {prof['kernels_per_step']:.0f} kernels per decode step, "
                             f"{prof['kernel_ms_per_step']:.3f} ms of kernel time in {prof['wall_ms_per_step']:.3f} ms; "
                             "top: "
                             + "; ".join(f"{t['kernel'][:40]} x{t['per_step']:.0f} {t['us_per_step']:.0f} us"
                                         for t in prof["top"][:5]))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (the default when there is no GPU)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-new-tokens", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=220.0,
                    help="wall-clock target: later HF experts implementations, the eager run and the kernel "
                         "profiles are skipped when they would not fit")
    ap.add_argument("--skip-eager", action="store_true", help="do not run longflash --enforce-eager")
    ap.add_argument("--baselines", nargs="*", default=[], choices=sorted(BASELINES),
                    help="after the default run, run longflash (CUDA graphs) with these switched off, each a row "
                         "of its own: "
                         "'cublas' = every few-row GEMM on cuBLAS (longflash.layers.gemv.enabled = False), "
                         "'no-pdl' = no programmatic dependent launch (longflash.ops.triton_env.PDL = False), "
                         "'moe-launches' = one-token MoE sub-layers as separate launches instead of the one-token "
                         "kernel (longflash.layers.moe.ONE_TOKEN_KERNEL = False; CUDA only, on the CPU the same path), "
                         "'sync-scheduling' = --no-async-scheduling (each step ends by reading its tokens; on the CPU "
                         "async scheduling is off anyway, so the same configuration), "
                         "'sync-when-waiting' = async scheduling, but every step synchronous while a request waits "
                         "(longflash.engine.async_scheduling.LAUNCH_WITH_WAITING = False; see --max-num-seqs; on "
                         "the CPU async scheduling is off, so again the same configuration)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="longflash's max_model_len, at most the config's 4096 positions (512 with --tiny; "
                         "default: input + output + 8 rounded up to 64, i.e. 256): under a CUDA graph the "
                         "attention's split count is chosen for this capacity (NOTES session 28)")
    ap.add_argument("--no-profile", action="store_true",
                    help="no kernel profiles (torch.profiler) after the timed runs: a test of whether a profile "
                         "slows the host work of the later runs in the process (the run-order drift of "
                         "benchmarks/NOTES.md, sessions 22 and 28)")
    ap.add_argument("--repeat-default", action="store_true",
                    help="after the baselines, run the default configuration once more (longflash_again): "
                         "the drift between runs in one process")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="longflash's max_num_seqs (default: the largest --batch); below a batch, that batch's "
                         "other requests wait for a slot (a full batch with a queue, as a loaded server)")
    ap.add_argument("--skip-hf", action="store_true", help="no HF transformers baseline (and no token comparison)")
    ap.add_argument("--op-shapes", action="store_true",
                    help="eager run: the ops with most device time per input shape at the smallest batch")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    tiny = args.tiny or dev.type != "cuda"
    if tiny:
        args.batch = [min(b, 4) for b in args.batch]
        args.input_len, args.output_len = min(args.input_len, 16), min(args.output_len, 8)
        args.hf_new_tokens = min(args.hf_new_tokens, 8)
    if args.hf_new_tokens < 2 or args.output_len < 2 or min(args.batch) < 1 or args.input_len < 1 \
            or (args.max_num_seqs is not None and args.max_num_seqs < 1):
        raise SystemExit("--hf-new-tokens and --output-len must be >= 2, --batch, --input-len and --max-num-seqs >= 1")
    cfg = TINY if tiny else FULL
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    res = {"config": cfg, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "args": vars(args), "command": " ".join(["python3"] + sys.argv)}
    res["commit"] = provenance.commit()
    try:
        import transformers
        res["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001 — provenance only
        pass
    from longflash.bench_roofline import measure_copy_bandwidth
    res["copy_gbs"] = measure_copy_bandwidth(dev)
    res["gemm_tflops"] = gemm_tflops(dev)
    log(f"copy {res['copy_gbs']:.0f} GB/s, GEMM {res['gemm_tflops']:.3g} TFLOP/s")
    dump(res, args.out)
    tmp = tempfile.mkdtemp(prefix="e2e-dsv3-")
    try:
        t0 = time.perf_counter()
        hf = build_checkpoint(cfg, dev, dtype, tmp)
        res["params"] = sum(p.numel() for p in hf.parameters())
        res["build_and_save_s"] = time.perf_counter() - t0
        log(f"built and saved {res['params'] / 1e9:.2f}B parameters in {res['build_and_save_s']:.1f} s")
        dump(res, args.out)
        rng = random.Random(0)
        rows = [[rng.randrange(4, cfg["vocab_size"]) for _ in range(args.input_len)] for _ in range(max(args.batch))]
        prompts = {b: torch.tensor(rows[:b], device=dev) for b in args.batch}
        # HF gets at most ~35 % of the budget: longflash's load, graph capture and runs need the rest.
        res["hf"] = {"runs": {}, "best": {}} if args.skip_hf else \
            hf_bench(hf, prompts, args.hf_new_tokens, dev, deadline=0.35 * args.budget_s)
        dump(res, args.out)
        del hf
        _free(dev)
        hf_tokens = {b: res["hf"]["runs"][v["experts_implementation"]][str(b)]["tokens"]
                     for b, v in ((int(k), v) for k, v in res["hf"]["best"].items())}
        max_len = args.max_model_len or -(-(args.input_len + args.output_len + 8) // 64) * 64
        # The default first, then each baseline, then (--repeat-default) the default again: runs in one
        # process drift (session 22 measured the host's share of a step growing from run to run while the
        # graph's own time stayed put), so the repeat shows how much of a difference is order.
        runs = ["longflash"] + [f"longflash_{n}" for n in args.baselines] + \
            (["longflash_again"] if args.repeat_default else [])
        for key in runs:
            switch = BASELINES.get(key[len("longflash_"):])
            engine_kw = {switch[1]: False} if switch and switch[0] == "EngineConfig" else None
            mod = importlib.import_module(switch[0]) if switch and not engine_kw else None
            if mod is not None:
                setattr(mod, switch[1], False)
            try:
                res[key] = ours_bench(tmp, prompts, args.output_len, dev, res["copy_gbs"], max_len, False, hf_tokens,
                                      profile_deadline=0.0 if args.no_profile else 0.7 * args.budget_s,
                                      engine_kw=engine_kw, label=None if key == "longflash" else key,
                                      max_num_seqs=args.max_num_seqs)
            finally:
                if mod is not None:
                    setattr(mod, switch[1], True)
            dump(res, args.out)
            _free(dev)
        if args.skip_eager or (dev.type == "cuda" and elapsed() > 0.7 * args.budget_s):
            log("longflash eager: skipped" + ("" if args.skip_eager else " (time budget)"))
        else:
            res["longflash_eager"] = ours_bench(tmp, prompts, args.output_len, dev, res["copy_gbs"], max_len, True,
                                                {}, profile_deadline=0.0, op_shapes=args.op_shapes,
                                                max_num_seqs=args.max_num_seqs)
            dump(res, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["total_s"] = elapsed()
    md = report(res, args.batch)
    dump(res, args.out)
    with open(os.path.join(args.out, "e2e_decode.md"), "w") as f:
        f.write(md + "\n")
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
