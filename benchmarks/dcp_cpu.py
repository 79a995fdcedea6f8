"""Decode-context parallelism on the CPU (issue 6 benchmark): per-rank KV bytes and token capacity vs
DCP size, weight bytes per rank under TP, and step times of DCP 1/2/4 (ratios against DCP 1, same run).

    OMP_NUM_THREADS=1 python benchmarks/dcp_cpu.py --out DIR [--context 2048] [--batch 4] [--decode-steps 16]

Engines: the default model with ``-tp N -dcp N`` (weights sharded over the N ranks, gloo), an fp8 KV
cache and a fixed per-rank KV budget (``--kv-budget``, default 32 MiB). For each N in {1, 2, 4} it
reads the engine's start-up report (per-rank KV bytes, total token capacity), rank 0's weight bytes,
then times: the steps that prefill ``--batch`` random prompts of ``--context`` tokens (512-token
chunks; a request that finished its prompt decodes in them) and then ``--decode-steps`` pure decode
steps of the whole batch (median step time). Ratios are against N = 1 measured
in the same run. Also an arithmetic table for DeepSeek-V3 shapes (61 layers x 576-wide latent rows).

NOTE: the ranks are processes on this machine's cores (``os.cpu_count()`` is printed); when N exceeds
the cores, the step times measure oversubscription and the collectives' latency (gloo over loopback),
not what DCP buys on GPUs (a memory-bound decode reading 1/N of the KV per rank).

Writes DIR/dcp_cpu.json and DIR/dcp_cpu.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from longflash.config import EngineConfig, parse_bytes  # noqa: E402
from longflash.default_model_path import default_model_path  # noqa: E402
from longflash.engine.llm_engine import LLMEngine  # noqa: E402
from longflash.models.weight_report import weight_memory_report  # noqa: E402
from longflash.sampling_params import SamplingParams  # noqa: E402
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)

DSV3_ROW_BYTES_FP8 = 61 * 576  # 61 MLA layers x (kv_lora_rank 512 + rope 64), one byte each


def run_dcp(n: int, args) -> dict:
    cfg = EngineConfig(model=default_model_path(), dtype="float32", block_size=16, kv_cache_memory=args.kv_budget,
                       kv_cache_dtype="fp8", max_num_batched_tokens=512, max_num_seqs=args.batch,
                       tensor_parallel_size=n, decode_context_parallel_size=n, speculative_config="off",
                       skip_tokenizer_init=True, enable_prefix_caching=False)
    t0 = time.perf_counter()
    eng = LLMEngine(cfg)
    start_s = time.perf_counter() - t0
    try:
        rep = eng.startup_report()
        weights = weight_memory_report(eng.model)["total_bytes"]
        g = torch.Generator().manual_seed(0)
        # enough tokens that every request still decodes after the last prefill chunk
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + args.batch * args.context // 512 + 2,
                                ignore_eos=True)
        for _ in range(args.batch):
            eng.add_request(None, torch.randint(2, 8000, (args.context,), generator=g).tolist(), params)
        prefill_s, decode = 0.0, []
        while eng.has_unfinished_requests() and len(decode) < args.decode_steps:
            prefill = any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.requests.values())
            t = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t
            if prefill:
                prefill_s += dt
            else:
                decode.append(dt)
    finally:
        eng.shutdown()
    return {"dcp": n, "tp": n, "start_s": start_s, "kv_cache_bytes_per_rank": rep["kv_cache_bytes"],
            "kv_bytes_per_token_row": rep["kv_bytes_per_token"], "kv_cache_tokens": rep["kv_cache_tokens"],
            "weight_bytes_rank0": weights, "prefill_s": prefill_s, "prefill_tokens": args.batch * args.context,
            "decode_step_s_median": statistics.median(decode) if decode else None, "decode_steps": len(decode)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--kv-budget", default="32MiB")
    ap.add_argument("--sizes", default="1,2,4")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    load = os.getloadavg()[0]
    rows = [run_dcp(int(n), args) for n in args.sizes.split(",")]
    base = rows[0]
    for r in rows:
        r["capacity_ratio"] = r["kv_cache_tokens"] / base["kv_cache_tokens"]
        r["prefill_time_ratio"] = r["prefill_s"] / base["prefill_s"]
        r["decode_time_ratio"] = (r["decode_step_s_median"] / base["decode_step_s_median"]
                                  if r["decode_step_s_median"] and base["decode_step_s_median"] else None)
        r["weight_ratio"] = r["weight_bytes_rank0"] / base["weight_bytes_rank0"]
    budget = parse_bytes(args.kv_budget)
    dsv3 = [{"dcp": n, "per_rank_bytes_per_token": DSV3_ROW_BYTES_FP8 / n,
             "tokens_at_budget": budget // DSV3_ROW_BYTES_FP8 * n} for n in (1, 2, 4, 8)]
    commit = provenance.commit()
    res = {"commit": commit, "cpu_count": os.cpu_count(), "load_avg_1min_at_start": load,
           "torch_threads": torch.get_num_threads(),
           "command": "python benchmarks/dcp_cpu.py " + " ".join(sys.argv[1:]), "args": vars(args), "rows": rows,
           "deepseek_v3_fp8": dsv3}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dcp_cpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = ["# DCP on the CPU: KV per rank, capacity and step time vs DCP size (default model, fp8 KV)", "",
          f"commit `{commit}`, `{res['command']}`; {os.cpu_count()} CPU cores (1-min load average {load:.1f} at the "
          f"start: other jobs share them), {res['torch_threads']} torch thread(s) "
          f"per rank, gloo; `-tp N -dcp N` (weights sharded over the N ranks); per-rank KV budget {args.kv_budget}; "
          f"batch {args.batch} x {args.context}-token prompts (prefill in 512-token steps), "
          f"{args.decode_steps} decode steps.", "",
          "| DCP (= TP) | KV bytes / rank | KV bytes / token row | capacity (tokens) | capacity x | weights / rank "
          "(MiB) | weights x | prefill s | prefill x | decode step ms | decode x |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['dcp']} | {r['kv_cache_bytes_per_rank']:,} | {r['kv_bytes_per_token_row']:,} | "
                  f"{r['kv_cache_tokens']:,} | {r['capacity_ratio']:.2f} | {r['weight_bytes_rank0'] / 2**20:.1f} | "
                  f"{r['weight_ratio']:.3f} | {r['prefill_s']:.2f} | {r['prefill_time_ratio']:.2f} | "
                  f"{r['decode_step_s_median'] * 1e3:.1f} | {r['decode_time_ratio']:.2f} |")
    md += ["", f"DeepSeek-V3 shapes (fp8 latent rows, 61 x 576 B per token), per-rank budget {args.kv_budget}: ",
           "", "| DCP | per-rank bytes per token | tokens at the budget |", "|---|---|---|"]
    md += [f"| {d['dcp']} | {d['per_rank_bytes_per_token']:,.0f} | {d['tokens_at_budget']:,} |" for d in dsv3]
    md += ["", "Ratios are against DCP 1 in the same run. On a CPU with fewer cores than ranks the step times "
           "measure oversubscription and gloo latency, not the memory-bound GPU decode DCP is for."]
    with open(os.path.join(args.out, "dcp_cpu.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
