"""Decode at long context through the engine: the DeepSeek-V3-shaped random model of ``e2e_decode.py`` (3.3B,
16 heads, kv_lora_rank 512 + rope 64) with a bf16 and an fp8 KV cache, ``--batch`` requests of
``--input-len`` random tokens each, ``--output-len`` greedy tokens (CUDA graphs on).

    python3 benchmarks/long_decode.py --out DIR                       # GPU: batch 16 x 16K tokens
    python3 benchmarks/long_decode.py --out DIR --tiny                # CPU check in seconds

Per cache dtype: decode tok/s and step time over the decode-only steps, bytes per step (weights for the
step's tokens + the KV rows read, ``longflash.bench_roofline``) and the fraction of the copy-bandwidth
roofline measured in the same run, and the decode step's CUDA graph replayed alone (the device's share of a
step: engines run later in one process carry more host time per step, NOTES session 22, so compare graph
replays within a run, or steps across fresh processes). The MLA decode at 16 query rows runs the Triton
kernel for bf16 and the Gluon kernel for fp8. Writes long_decode.json / .md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_decode as e2e  # noqa: E402  (the model, the checkpoint builder and the engine run)
import provenance  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (the default without a GPU)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=16384)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"], choices=["auto", "fp8"])
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384, help="prefill chunk (tokens per step)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if dev.type != "cuda":
        args.batch, args.input_len, args.output_len = min(args.batch, 2), min(args.input_len, 64), min(args.output_len, 4)
        args.max_num_batched_tokens = min(args.max_num_batched_tokens, 64)
    if args.batch < 1 or args.input_len < 1 or args.output_len < 2:
        raise SystemExit("--batch and --input-len must be >= 1, --output-len >= 2")
    max_len = -(-(args.input_len + args.output_len + 8) // 64) * 64
    cfg, dtype = e2e.model_config(dev, max_len)
    res = {"config": cfg, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "args": vars(args), "command": " ".join(["python3"] + sys.argv),
           "commit": provenance.commit()}
    from longflash.bench_roofline import measure_copy_bandwidth
    res["copy_gbs"] = measure_copy_bandwidth(dev)
    tmp = tempfile.mkdtemp(prefix="long-decode-dsv3-")
    try:
        model = e2e.build_checkpoint(cfg, dev, dtype, tmp)
        res["params"] = sum(p.numel() for p in model.parameters())
        del model
        e2e._free(dev)
        rng = random.Random(0)
        rows = [[rng.randrange(4, cfg["vocab_size"]) for _ in range(args.input_len)] for _ in range(args.batch)]
        prompts = {args.batch: torch.tensor(rows)}
        for kv in args.kv_cache_dtypes:
            t0 = time.perf_counter()
            r = e2e.ours_bench(tmp, prompts, args.output_len, dev, res["copy_gbs"], max_len, False, {},
                               profile_deadline=0.0,  # a profile would time the long prefill, not decode
                               engine_kw={"kv_cache_dtype": kv, "max_num_batched_tokens": args.max_num_batched_tokens,
                                          "kv_cache_memory": "16GiB" if dev.type == "cuda" else "256MiB"})
            r["total_s"] = time.perf_counter() - t0
            res[kv] = r
            e2e._free(dev)
            with open(os.path.join(args.out, "long_decode.json"), "w") as f:
                json.dump(res, f, indent=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [f"# Long-context decode through the engine, DeepSeek-V3 shape ({res['params'] / 1e9:.2f}B, random weights, "
             f"{res['device']})", "", f"commit {res['commit'][:12]}; copy {res['copy_gbs']:.0f} GB/s; "
             f"batch {args.batch} x {args.input_len} prompt tokens, {args.output_len} output tokens", "",
             f"`{res['command']}`", "",
             "| KV cache | decode tok/s | step ms | graph replay ms | MB/step | roofline fraction | mean TTFT s |",
             "|---|---|---|---|---|---|---|"]
    for kv in args.kv_cache_dtypes:
        r = res.get(kv, {}).get(str(args.batch))
        if not r:
            continue
        gr = r.get("graph_replay_ms")
        lines.append(f"| {kv} | {r['decode_tok_s']:.1f} | {r['decode_step_ms']:.3f} | {'' if gr is None else f'{gr:.3f}'} | "
                     f"{r['bytes_per_step'] / 1e6:.0f} | {r['roofline_fraction']:.3f} | {r['mean_ttft_ms'] / 1e3:.2f} |")
    a, b = (res.get(k, {}).get(str(args.batch)) for k in ("auto", "fp8"))
    if a and b:
        lines.append(f"\nfp8 vs bf16 cache in one process: {b['decode_tok_s'] / a['decode_tok_s']:.2f}x decode tok/s, "
                     f"{a['graph_replay_ms'] / b['graph_replay_ms']:.2f}x graph replay" if a.get("graph_replay_ms") and
                     b.get("graph_replay_ms") else f"\nfp8 vs {'bf16' if dev.type == 'cuda' else 'fp32 (auto on the CPU)'} "
                     f"cache: {b['decode_tok_s'] / a['decode_tok_s']:.2f}x")
    md = "\n".join(lines)
    with open(os.path.join(args.out, "long_decode.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
