"""A/B of MLA decode tile configs at a few shapes in one process (issue 10, benchmark 1).

Each config's result is checked against the fp32 reference on request 0, then timed as CUDA-graph replays
(``gpu_timing.graph_seconds``, q_len 1, 16 heads, rows 512 + 64, block size 16, random physical blocks:
``ncu_mla_decode.build``); reported as µs per call and the cache bytes over that time as a fraction of the
copy bandwidth measured in the same run. A quicker check than ``mla_decode.py``'s full sweep.

    python3 benchmarks/mla_decode_ab.py --out DIR --dtype fp8 --configs '{}' '{"WGMMA": true}' \\
        --shapes 16x32768 16x131072 64x131072

``--configs``: JSON dicts of keys over :func:`triton_mla_decode.default_config` (``{}`` = the default); the
table records each config as the wrapper resolved it (e.g. ``WGMMA`` false off sm_90). Needs CUDA. Writes
DIR/mla_decode_ab.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import copy_gbps, graph_seconds  # noqa: E402
import provenance  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="directory for mla_decode_ab.json / .md")
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="fp8", help="cache dtype")
    ap.add_argument("--configs", nargs="+", default=["{}"], help="JSON dicts over the default config")
    ap.add_argument("--shapes", nargs="+", default=["16x32768", "16x131072", "64x131072"], metavar="BxCTX",
                    help="batch x context length per row (q_len 1, 16 heads)")
    a = ap.parse_args()
    try:
        configs = [json.loads(t) for t in a.configs]
        shapes = [tuple(int(x) for x in sh.split("x")) for sh in a.shapes]
    except ValueError as e:
        raise SystemExit(f"--configs must be JSON objects and --shapes BxCTX: {e}")
    if not all(isinstance(c, dict) for c in configs) or not all(len(sh) == 2 and min(sh) > 0 for sh in shapes):
        raise SystemExit("--configs must be JSON objects and --shapes positive BxCTX pairs")
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    from longflash.attention import ops
    from longflash.attention import triton_mla_decode as tk
    import ncu_mla_decode as nm
    os.makedirs(a.out, exist_ok=True)
    res = {"commit": provenance.commit(), "device": torch.cuda.get_device_name(), "command": shlex.join(["python3"] + sys.argv),
           "copy_gbps": copy_gbps(torch.device("cuda")), "rows": []}
    for batch, ctx in shapes:
        q, cache, bt, qsl, seq, ks = nm.build(a.dtype, batch, ctx)
        ref, rlse = ops.mla_decode_attention(q[:1].float(), cache, bt[:1], [0, 1], [ctx], nm.SCALE, nm.R, ks)
        nbytes = batch * ctx * cache.shape[-1] * cache.element_size()
        for cfg in configs:
            def run():
                return tk.mla_decode_attention(q, cache, bt, qsl, seq, nm.SCALE, nm.R, ks, max_query_len=1,
                                               max_seq_len=ctx, config=cfg or None)
            try:
                out, lse = run()
                err = ((out[:1].float() - ref).norm() / ref.norm()).item()
                lse_err = (lse[:1] - rlse).abs().max().item()
                us = graph_seconds(run, calls=4, replays=10) * 1e6
                resolved = tk.resolve_config(q, cache, nm.R, 1, cfg or None)[0]
                row = {"B": batch, "ctx": ctx, "config": cfg, "resolved": resolved, "us": us, "rel_err": err,
                       "lse_err": lse_err,
                       "copy_fraction": nbytes / (us * 1e-6) / 1e9 / res["copy_gbps"]}
            except Exception as e:  # noqa: BLE001 — reported in the table
                row = {"B": batch, "ctx": ctx, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    lines = [f"# MLA decode config A/B ({res['device']}, {a.dtype} cache, q_len 1, 16 heads)", "",
             f"commit {res['commit']}; copy {res['copy_gbps']:.0f} GB/s", "", f"`{res['command']}`", "",
             "| B | ctx | config | kernel | µs | fraction of copy | rel err | LSE err |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        rc = r.get("resolved", {})
        kernel = ("gluon wgmma" if rc.get("WGMMA") else "gluon") if rc.get("GLUON") else "triton" if rc else ""
        lines.append(f"| {r['B']} | {r['ctx']} | `{json.dumps(r['config'])}` | {kernel} | " +
                     (f"{r['us']:.1f} | {r['copy_fraction']:.3f} | {r['rel_err']:.1e} | {r['lse_err']:.1e} |"
                      if "us" in r else f"error: {r['error']} | | | |"))
    with open(os.path.join(a.out, "mla_decode_ab.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "mla_decode_ab.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if all("us" in r and r["rel_err"] < 1e-2 for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
