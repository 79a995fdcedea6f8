"""Decode speed under tensor / decode-context parallelism on GPUs (issue 11): decode tokens/s at batch 1
and 64 with a 32K-token context for ``tp1`` (one GPU), ``-tp 2 -dcp 1`` and ``-tp 2 -dcp 2`` (ratios
against tp1 and against dcp 1, same run), and the share of a decode step spent in collectives.

    python3 benchmarks/multi_gpu_speed.py --out DIR [--configs 1x1,2x1,2x2] [--context 32768] [--batches 1,64:8192]
    python3 benchmarks/multi_gpu_speed.py --out DIR --tiny          # CPU (gloo), tiny shapes: checks the script

Model: DeepSeek-V3 architecture with random weights (``e2e_decode.FULL``: hidden 2048, 16 heads, DeepSeek-V3's
MLA dims, 64 experts top-6) but ``--layers`` 8 instead of 24 (1.1B parameters) so that the 64 x 32K-token
prefill fits the device call; the decode step's KV bytes and weight bytes both scale with the layer count,
so the weights-to-KV balance that decides what DCP buys is that of the 24-layer model. bf16 weights and
KV cache, CUDA graphs (captured on every rank, NCCL collectives inside) unless ``--eager``.

Per config and batch: random prompts of ``--context`` tokens prefilled in 16K-token chunks (time
recorded), then ``--steps`` timed decode steps (``LLMEngine.step`` wall time: the host's scheduling,
the step broadcast to the workers, the forward, the sampled-token read), median -> tok/s = batch /
step. Then ``--profile-steps`` steps under ``torch.profiler`` on rank 0: the device time of NCCL
kernels / the steps' wall time = the share of the step in collectives (rank 0's view; its GPU waits
inside a collective for the slower rank too, so that time counts as collective). A batch whose
prefill (estimated from the batch-1 prefill) would pass ``--budget-s`` is skipped and said so.
Writes DIR/multi_gpu_speed.json (after every measurement) and DIR/multi_gpu_speed.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="1x1,2x1,2x2", help="tp x dcp pairs")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batches", default="1,64", help="batch sizes, each optionally with its own context: 1,64:8192")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--kv-cache-memory", default="40GiB", help="per GPU")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager engines (no CUDA graphs)")
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny config and sizes")
    a = ap.parse_args(argv)
    if a.tiny:
        a.context, a.batches, a.steps, a.profile_steps, a.kv_cache_memory = 96, "1,4:48", 4, 2, "64MiB"
    return a


def batch_specs(spec: str, context: int) -> list[tuple[int, int]]:
    """"1,64:8192" -> [(1, context), (64, 8192)]: (batch, context tokens)."""
    out = []
    for item in spec.split(","):
        b, _, c = item.partition(":")
        out.append((int(b), int(c) if c else context))
    return out


def nccl_share(engine, steps: int) -> dict:
    """Rank 0: ``steps`` decode steps under torch.profiler; NCCL kernels' device time per step and its
    share of the steps' wall time."""
    from e2e_decode import device_us as us, profile_steps
    avgs, wall = profile_steps(engine, steps)
    nccl = sum(us(a) for a in avgs if "nccl" in a.key.lower()) / 1e3 / steps
    total = sum(us(a) for a in avgs) / 1e3 / steps
    return {"wall_ms_per_step": 1e3 * wall, "kernel_ms_per_step": total, "nccl_ms_per_step": nccl,
            "nccl_share_of_step": nccl / (1e3 * wall), "nccl_kernels_per_step":
            sum(a.count for a in avgs if "nccl" in a.key.lower()) / steps}


def run_config(path: str, tp: int, dcp: int, args, dev: str, res: dict, budget_end: float) -> dict:
    from longflash.config import EngineConfig
    from longflash.engine.llm_engine import LLMEngine
    from longflash.sampling_params import SamplingParams
    batches = batch_specs(args.batches, args.context)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=path, device=dev, dtype="bfloat16" if dev == "cuda" else "float32", tensor_parallel_size=tp,
        decode_context_parallel_size=dcp, max_model_len=max(c for _, c in batches) + 128,
        max_num_seqs=max(b for b, _ in batches), max_num_batched_tokens=min(16384, args.context), kv_cache_memory=args.kv_cache_memory,
        skip_tokenizer_init=True, enforce_eager=args.eager or dev != "cuda", enable_prefix_caching=False,
        speculative_config="off", distributed_timeout_s=300))
    dr = engine.runner.decode_runner
    out = {"tp": tp, "dcp": dcp, "engine_start_s": time.perf_counter() - t0,
           "graphs": bool(dr is not None and dr.captured), "graph_capture_s": getattr(dr, "capture_time_s", 0.0),
           "kv_cache_tokens": engine.startup_report()["kv_cache_tokens"], "batches": {}}
    log(f"tp{tp} dcp{dcp}: engine up in {out['engine_start_s']:.1f} s, graphs {out['graphs']} "
        f"({out['graph_capture_s']:.1f} s), KV capacity {out['kv_cache_tokens']:,} tokens")
    g = torch.Generator().manual_seed(0)
    prefill_tok = None  # seconds per prefilled token x context (attention dominates: ~linear in the context)
    try:
        for b, ctx_len in batches:
            if prefill_tok is not None and time.perf_counter() + prefill_tok * b * ctx_len ** 2 * 1.3 + 20 > budget_end:
                out["batches"][str(b)] = {"skipped": f"estimated prefill {prefill_tok * b * ctx_len ** 2:.0f} s "
                                                     f"passes the budget"}
                log(f"tp{tp} dcp{dcp} batch {b}: skipped (budget)")
                continue
            params = SamplingParams(temperature=0.0, max_tokens=args.steps + args.profile_steps + 4, ignore_eos=True)
            for _ in range(b):
                engine.add_request(None, {"prompt_token_ids": torch.randint(2, 120000 if dev == "cuda" else 200,
                                                                             (ctx_len,), generator=g).tolist()},
                                   params)
            t = time.perf_counter()
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.requests.values()):
                engine.step()
            prefill_s = time.perf_counter() - t
            prefill_tok = prefill_s / (b * ctx_len ** 2) if prefill_tok is None else prefill_tok
            engine.step()  # first all-decode step (the graph's first replay at this bucket)
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            step = statistics.median(times)
            r = out["batches"][str(b)] = {"batch": b, "context": ctx_len, "prefill_s": prefill_s,
                                          "decode_step_ms": 1e3 * step, "decode_tok_s": b / step,
                                          "step_ms_min_max": [1e3 * min(times), 1e3 * max(times)]}
            if dev == "cuda":
                try:
                    r["profile"] = nccl_share(engine, args.profile_steps)
                except Exception as e:  # noqa: BLE001 — a diagnostic; the timing above stands
                    r["profile"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            while engine.has_unfinished_requests():
                engine.step()
            p = r.get("profile", {})
            log(f"tp{tp} dcp{dcp} batch {b}: prefill {prefill_s:.1f} s, decode {r['decode_tok_s']:.1f} tok/s "
                f"(step {r['decode_step_ms']:.2f} ms), NCCL {p.get('nccl_ms_per_step', float('nan')):.3f} ms/step "
                f"= {p.get('nccl_share_of_step', float('nan')):.3f} of the step")
            _write(args.out, res)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    return out


def _write(out: str, res: dict) -> None:
    with open(os.path.join(out, "multi_gpu_speed.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)


def _ratio(x: float) -> str:
    """A ratio cell: '-' when its baseline was not in the run (NaN)."""
    return "-" if x != x else f"{x:.2f}"


def report(res: dict) -> str:
    rows = res["configs"]
    base = {b: r["batches"][b]["decode_tok_s"] for r in rows if r["tp"] == 1
            for b in r["batches"] if "decode_tok_s" in r["batches"][b]}
    dcp1 = {(r["tp"], b): r["batches"][b]["decode_tok_s"] for r in rows if r["dcp"] == 1
            for b in r["batches"] if "decode_tok_s" in r["batches"][b]}
    md = [f"# Decode speed under TP / DCP ({res['device']})", "",
          f"commit `{res['commit']}`, `{res['command']}`, torch {res['torch']}, nccl {res.get('nccl')}; model: "
          f"{res['model']}", "",
          "| tp | dcp | graphs | batch | context | prefill s | decode step ms | decode tok/s | x tp1 | x dcp1 "
          "| NCCL ms/step | NCCL share of step | KV capacity (tokens) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for b, m in r["batches"].items():
            if "decode_tok_s" not in m:
                md.append(f"| {r['tp']} | {r['dcp']} | {r['graphs']} | {b} | | {m.get('skipped', '')} | | | | | | | |")
                continue
            p = m.get("profile", {})
            x1 = m["decode_tok_s"] / base[b] if b in base else float("nan")
            xd = m["decode_tok_s"] / dcp1[(r["tp"], b)] if (r["tp"], b) in dcp1 else float("nan")
            md.append(f"| {r['tp']} | {r['dcp']} | {r['graphs']} | {b} | {m['context']} | {m['prefill_s']:.1f} | "
                      f"{m['decode_step_ms']:.2f} | {m['decode_tok_s']:.1f} | {_ratio(x1)} | {_ratio(xd)} | "
                      f"{p.get('nccl_ms_per_step', float('nan')):.3f} | {p.get('nccl_share_of_step', float('nan')):.3f} | "
                      f"{r['kv_cache_tokens']:,} |")
    md += ["", "x tp1: decode tok/s / the one-GPU engine's at the same batch; x dcp1: / the same tp with dcp 1. "
           "NCCL share: rank 0's NCCL kernel time / step wall time (torch.profiler)."]
    return "\n".join(md) + "\n"


def main() -> int:
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    from e2e_decode import FULL, TINY, build_checkpoint
    dev = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    cfg = dict(TINY if args.tiny else FULL, num_hidden_layers=2 if args.tiny else args.layers,
               max_position_embeddings=args.context + 128)
    commit = provenance.commit()
    res = {"benchmark": "multi_gpu_speed", "commit": commit or "unknown",
           "command": "python3 benchmarks/multi_gpu_speed.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
           "device": ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if dev == "cuda"
           else "CPU", "nccl": ".".join(map(str, torch.cuda.nccl.version())) if dev == "cuda" else None,
           "model": f"DeepSeek-V3 architecture, random weights, {cfg['num_hidden_layers']} layers, hidden "
                    f"{cfg['hidden_size']}, {cfg['n_routed_experts']} experts top-{cfg['num_experts_per_tok']}",
           "args": vars(args), "configs": []}
    budget_end = T0 + args.budget_s
    with tempfile.TemporaryDirectory() as path:
        model = build_checkpoint(cfg, torch.device(dev), torch.bfloat16 if dev == "cuda" else torch.float32, path)
        res["params"] = sum(p.numel() for p in model.parameters())
        del model
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
        log(f"checkpoint: {res['params'] / 1e9:.2f}B parameters")
        for pair in args.configs.split(","):
            tp, dcp = (int(v) for v in pair.split("x"))
            if dev == "cuda" and tp > torch.cuda.device_count():
                res["configs"].append({"tp": tp, "dcp": dcp, "graphs": None, "kv_cache_tokens": 0,
                                       "batches": {}, "skipped": "not enough GPUs"})
                continue
            if time.perf_counter() + 40 > budget_end:
                log(f"tp{tp} dcp{dcp}: skipped (budget)")
                continue
            res["configs"].append(run_config(path, tp, dcp, args, dev, res, budget_end))
            _write(args.out, res)
    res["seconds"] = time.perf_counter() - T0
    _write(args.out, res)
    md = report(res)
    with open(os.path.join(args.out, "multi_gpu_speed.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
