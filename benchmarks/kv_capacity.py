"""KV cache bytes per token per layer and token capacity at a fixed memory budget, bf16 vs fp8
(issue 5). Pure arithmetic over the cache layouts the engine allocates (``KVCacheSpec``); runs on
the CPU in a second.

    python benchmarks/kv_capacity.py --out DIR [--budget 80GiB] [--block-size 64]

Writes DIR/kv_capacity.json and DIR/kv_capacity.md. Capacity = floor(budget / (bytes per token x
block_size)) x block_size, i.e. whole blocks, as ``LLMEngine`` sizes its pool. The default model's
row is read from ``longflash/default_model/config.json`` when it exists, and checked against a
real engine's start-up report (1 MiB budget).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from longflash.config import parse_bytes  # noqa: E402
from longflash.models.base import KVCacheSpec  # noqa: E402
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)

FP8 = torch.float8_e4m3fn

# name: (layers, row_shape, planes). MLA rows are [kv_c | k_pe] = kv_lora_rank + qk_rope_head_dim.
MODELS = {
    "DeepSeek-V3 / Kimi-K2 (MLA 512+64, 61 layers)": (61, (576,), 1),
    "Qwen3-8B (GQA 8 kv heads x 128, K and V, 36 layers)": (36, (8, 128), 2),
}


def default_model_entry():
    path = os.path.join(REPO, "longflash", "default_model", "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    return (f"longflash default model (Kimi-K3 MLA {c['kv_lora_rank']}+{c['qk_rope_head_dim']}, "
            f"{c['num_hidden_layers']} layers)", (c["num_hidden_layers"], (c["kv_lora_rank"] + c["qk_rope_head_dim"],), 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", default="80GiB", help="KV memory budget (e.g. 80GiB)")
    ap.add_argument("--block-size", type=int, default=64)
    args = ap.parse_args(argv)
    budget = parse_bytes(args.budget)
    bs = args.block_size
    models = dict(MODELS)
    dm = default_model_entry()
    if dm:
        models[dm[0]] = dm[1]
    rows = []
    for name, (layers, row_shape, planes) in models.items():
        spec = KVCacheSpec(layers, row_shape, planes)
        entry = {"model": name}
        for label, dt in (("bf16", torch.bfloat16), ("fp8", FP8)):
            per_tok = spec.bytes_per_token(dt)
            entry[f"{label}_bytes_per_token_per_layer"] = per_tok // layers
            entry[f"{label}_bytes_per_token"] = per_tok
            entry[f"{label}_capacity_tokens"] = budget // (per_tok * bs) * bs
        entry["fp8_over_bf16_capacity"] = entry["fp8_capacity_tokens"] / entry["bf16_capacity_tokens"]
        rows.append(entry)
    check = None
    if dm:  # cross-check with the engine's own start-up report
        from longflash import LLM
        mdir = os.path.join(REPO, "longflash", "default_model")
        rep = {}
        for kvd in ("bfloat16", "fp8"):
            # Target model only: a speculative drafter's own KV pool would add its bytes per token.
            r = LLM(mdir, dtype="float32", block_size=bs, kv_cache_memory="1MiB", kv_cache_dtype=kvd,
                    speculative_config="off").engine.startup_report()
            rep[kvd] = {"kv_bytes_per_token": r["kv_bytes_per_token"], "kv_cache_tokens": r["kv_cache_tokens"]}
        check = {"budget_bytes": 2**20, "engine_report": rep}
    commit = provenance.commit()
    res = {"benchmark": "kv_capacity", "commit": commit, "budget_bytes": budget, "block_size": bs,
           "command": "python " + " ".join(["benchmarks/kv_capacity.py"] + (argv or sys.argv[1:])),
           "rows": rows, "engine_check": check}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv_capacity.json"), "w") as f:
        json.dump(res, f, indent=2)
    lines = [f"# KV capacity at {args.budget} ({budget:,} bytes), block size {bs}", "",
             f"commit `{commit}`, `{res['command']}`", "",
             "| model | bf16 B/token/layer | fp8 B/token/layer | bf16 B/token | fp8 B/token | bf16 tokens | fp8 tokens | fp8/bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['bf16_bytes_per_token_per_layer']:,} | {r['fp8_bytes_per_token_per_layer']:,} | "
                     f"{r['bf16_bytes_per_token']:,} | {r['fp8_bytes_per_token']:,} | {r['bf16_capacity_tokens']:,} | "
                     f"{r['fp8_capacity_tokens']:,} | {r['fp8_over_bf16_capacity']:.3f} |")
    if check:
        e = check["engine_report"]
        lines += ["", f"Engine start-up report for the default model at a 1 MiB budget: bf16 "
                  f"{e['bfloat16']['kv_bytes_per_token']} B/token, {e['bfloat16']['kv_cache_tokens']} tokens; fp8 "
                  f"{e['fp8']['kv_bytes_per_token']} B/token, {e['fp8']['kv_cache_tokens']} tokens."]
    with open(os.path.join(args.out, "kv_capacity.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
