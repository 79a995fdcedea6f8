"""MoE routing + expert alignment: the fused Triton path vs the PyTorch chain (issue 10).

    python benchmarks/moe_routing.py --out DIR            # GPU (about 30-60 s)
    python benchmarks/moe_routing.py --out DIR --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes (checks only)

Writes DIR/moe_routing.json and DIR/moe_routing.md.

For the default model (H 256, E 8, k 2), DeepSeek-V3 (H 7168, E 256, k 8, 8 groups keep 4, x2.5), Kimi-K2
(E 384, k 8) and Kimi-K3 (E 896, k 16), bf16 activations, T in --tokens, it times (median per call of
--calls back-to-back calls captured in one CUDA graph, replayed --replays times):
  * route_ref: ``F.linear(x.float(), W)`` + ``moe.topk_routing`` (the chain TopkRouter ran before);
  * route_fused: ``TopkRouter.forward`` (the same GEMM + ``topk_routing_triton``, one launch);
  * routing_ref / routing_fused: the routing alone on the same fp32 logits;
  * align_ref / align_fused: ``align_by_expert`` vs ``expert_align`` (``moe_align_triton``), BLOCK_M 16;
  * chain_ref / chain_fused: routing + alignment, what one MoE layer runs before its expert GEMMs,
and counts the GPU ops (kernels, memsets) of one eager call of each at the first T (torch.profiler). Checks on the same data: ids equal
to the reference as sets per token (rows that differ), weights' max relative difference, and without
renormalisation the fraction of sigmoid weights bitwise equal to the reference's (1.0 expected on
CUDA; the CPU smoke run compares NumPy's exp with torch's), and that TopkRouter.forward gives the kernel's result. A num_warps sweep of
the fused kernel at T = 1 and 128 shows whether the launcher's default is the fastest. Bandwidth: the
fused kernel's bytes (logits T·E·4 + bias E·4 + outputs T·k·12) / time, and the router GEMM's weight
read E·H·4 / route time, each as a fraction of a 1 GiB device copy measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="directory for moe_routing.json / .md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through TRITON_INTERPRET=1")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 128])
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--replays", type=int, default=20, help="graph replays (median)")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, REPO)
from longflash.layers.moe import TopkRouter, topk_routing  # noqa: E402
from longflash.layers.moe_grouped import align_by_expert, expert_align  # noqa: E402
from longflash.layers.moe_router_triton import topk_routing_triton  # noqa: E402
from gpu_timing import copy_gbps, graph_seconds, kernel_count  # noqa: E402

# name, H, E, k, n_group, topk_group, routed_scaling_factor
MODELS = [("default", 256, 8, 2, 1, 1, 1.0), ("deepseek_v3", 7168, 256, 8, 8, 4, 2.5),
          ("kimi_k2", 7168, 384, 8, 1, 1, 2.827), ("kimi_k3", 7168, 896, 16, 1, 1, 1.0)]
SMOKE_MODELS = [("default", 256, 8, 2, 1, 1, 1.0), ("tiny_grouped", 64, 32, 4, 4, 2, 2.5)]
BLOCK_M = 16
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)








def compare(got, ref) -> dict:
    (gw, gi), (rw, ri) = got, ref
    rs, ro = ri.sort(1)
    gs, go = gi.sort(1)
    rw, gw = rw.gather(1, ro), gw.gather(1, go)
    return dict(rows_ids_differ=int((gs != rs).any(1).sum()),
                weight_rel=float((gw - rw).abs().max() / rw.abs().max().clamp_min(1e-30)),
                weight_bitwise_frac=float((gw == rw).float().mean()))


def make_router(H, E, k, ng, tg, scale, dev):
    router = TopkRouter(H, E, k, ng, tg, routed_scaling_factor=scale).to(dev)
    g = torch.Generator().manual_seed(E)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g) / math.sqrt(H))
        router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.05)
    return router


def bench_model(name, H, E, k, ng, tg, scale, dev, copy_bps, tokens) -> list[dict]:
    router = make_router(H, E, k, ng, tg, scale, dev)
    bias = router.e_score_correction_bias
    args = (bias, k, ng, tg, True, scale, "sigmoid")
    rows = []
    for T in tokens:
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dev, torch.bfloat16)
        with torch.no_grad():
            logits = F.linear(x.float(), router.weight)
            ref = topk_routing(logits, *args)
            got = topk_routing_triton(logits, *args)
            check = compare(got, ref)
            routed = router(x)  # on CUDA the same kernel through TopkRouter.forward
            check["router_forward_equal"] = bool(torch.equal(routed[1], got[1]) and torch.equal(routed[0], got[0]))
            raw = compare(topk_routing_triton(logits, bias, k, ng, tg, False, scale),
                          topk_routing(logits, bias, k, ng, tg, False, scale))
            ids = got[1]
            fns = {
                "route_ref": lambda: topk_routing(F.linear(x.float(), router.weight), *args),
                "route_fused": lambda: router(x),
                "routing_ref": lambda: topk_routing(logits, *args),
                "routing_fused": lambda: topk_routing_triton(logits, *args),
                "align_ref": lambda: align_by_expert(ids, E, BLOCK_M),
                "align_fused": lambda: expert_align(ids, E, BLOCK_M),
                "chain_ref": lambda: align_by_expert(topk_routing(F.linear(x.float(), router.weight), *args)[1],
                                                     E, BLOCK_M),
                "chain_fused": lambda: expert_align(router(x)[1], E, BLOCK_M),
            }
            t = {key: graph_seconds(fn, ARGS.calls, ARGS.replays) for key, fn in fns.items()}
            n = {key: kernel_count(fn) if T == tokens[0] else None for key, fn in fns.items()}
        kernel_bytes = T * E * 4 + E * 4 + T * k * 12
        row = dict(model=name, T=T, E=E, k=k, n_group=ng, topk_group=tg, **{f"{key}_us": v * 1e6 for key, v in t.items()},
                   **{f"{key}_kernels": v for key, v in n.items()},
                   speedup_routing=t["routing_ref"] / t["routing_fused"], speedup_chain=t["chain_ref"] / t["chain_fused"],
                   speedup_align=t["align_ref"] / t["align_fused"],
                   fused_kernel_GBps=kernel_bytes / t["routing_fused"] / 1e9,
                   fused_kernel_frac_copy=kernel_bytes / t["routing_fused"] / copy_bps if copy_bps else None,
                   router_weight_frac_copy=E * H * 4 / t["route_fused"] / copy_bps if copy_bps else None,
                   **{f"check_{key}": v for key, v in check.items()},
                   check_raw_weight_bitwise_frac=raw["weight_bitwise_frac"], check_raw_rows_ids_differ=raw["rows_ids_differ"])
        rows.append(row)
        log(f"{name} T={T}: routing {t['routing_ref']*1e6:.1f} -> {t['routing_fused']*1e6:.1f} us, "
            f"chain {t['chain_ref']*1e6:.1f} -> {t['chain_fused']*1e6:.1f} us, ids differ in {check['rows_ids_differ']} rows")
    return rows


def warps_sweep(name, H, E, k, ng, tg, scale, dev, tokens) -> list[dict]:
    out = []
    bias = torch.randn(E, generator=torch.Generator().manual_seed(1)).to(dev) * 0.05
    for T in tokens:
        logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).to(dev)
        ref = topk_routing_triton(logits, bias, k, ng, tg, True, scale)
        for w in (1, 2, 4, 8):
            got = topk_routing_triton(logits, bias, k, ng, tg, True, scale, num_warps=w)
            same = bool(torch.equal(got[1], ref[1]))
            us = graph_seconds(lambda: topk_routing_triton(logits, bias, k, ng, tg, True, scale, num_warps=w), ARGS.calls, ARGS.replays) * 1e6
            out.append(dict(model=name, T=T, num_warps=w, us=us, ids_equal_default=same))
    return out


def main():
    dev = torch.device("cpu" if ARGS.smoke or not torch.cuda.is_available() else "cuda")
    models = SMOKE_MODELS if ARGS.smoke else MODELS
    tokens = [1, 8] if ARGS.smoke else ARGS.tokens
    copy_bps = copy_gbps(dev) * 1e9 if dev.type == "cuda" else None  # bytes/s
    log(f"device {dev}; copy {copy_bps / 1e12 if copy_bps else float('nan'):.2f} TB/s")
    rows, sweep = [], []
    for m in models:
        rows += bench_model(*m, dev, copy_bps, tokens)
    for m in models:
        sweep += warps_sweep(*m, dev, [1] if ARGS.smoke else [1, 128])
    commit = provenance.commit()
    meta = dict(commit=commit, device=torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor(),
                torch=torch.__version__, command=" ".join([sys.executable] + sys.argv), smoke=ARGS.smoke,
                copy_TBps=copy_bps / 1e12 if copy_bps else None, calls_per_graph=ARGS.calls, replays=ARGS.replays)
    os.makedirs(ARGS.out, exist_ok=True)
    with open(os.path.join(ARGS.out, "moe_routing.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, warps_sweep=sweep), f, indent=1)
    lines = [f"# MoE routing + alignment, fused vs PyTorch ({meta['device']}, commit {commit[:10]})", "",
             f"copy: {meta['copy_TBps']} TB/s; times: median per call in a CUDA graph of {ARGS.calls} calls", "",
             "| model | T | routing ref µs (kernels) | fused µs | x | align ref µs (kernels) | fused µs | chain ref µs | "
             "chain fused µs | x | rows ids differ | weight rel | raw bitwise | fused GB/s (of copy) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        frac = f" ({r['fused_kernel_frac_copy']:.4f})" if r["fused_kernel_frac_copy"] is not None else ""
        lines.append(f"| {r['model']} | {r['T']} | {r['routing_ref_us']:.1f} ({r['routing_ref_kernels']}) | "
                     f"{r['routing_fused_us']:.1f} ({r['routing_fused_kernels']}) | {r['speedup_routing']:.1f} | "
                     f"{r['align_ref_us']:.1f} ({r['align_ref_kernels']}) | {r['align_fused_us']:.1f} "
                     f"({r['align_fused_kernels']}) | {r['chain_ref_us']:.1f} | {r['chain_fused_us']:.1f} | "
                     f"{r['speedup_chain']:.1f} | {r['check_rows_ids_differ']} | {r['check_weight_rel']:.1e} | "
                     f"{r['check_raw_weight_bitwise_frac']:.3f} | {r['fused_kernel_GBps']:.1f}{frac} |")
    lines += ["", "num_warps sweep of the fused kernel (µs):", "", "| model | T | 1 | 2 | 4 | 8 |", "|---|---|---|---|---|---|"]
    for key in dict.fromkeys((s["model"], s["T"]) for s in sweep):
        v = {s["num_warps"]: s["us"] for s in sweep if (s["model"], s["T"]) == key}
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(f"{v.get(w, float('nan')):.1f}" for w in (1, 2, 4, 8)) + " |")
    with open(os.path.join(ARGS.out, "moe_routing.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    bad = [r for r in rows if r["check_rows_ids_differ"] or r["check_weight_rel"] > 1e-6
           or (not ARGS.smoke and not r["check_router_forward_equal"])]
    bad += [s for s in sweep if not s["ids_equal_default"]]
    if bad:
        print("CHECK FAILED:", bad)
        sys.exit(1)


if __name__ == "__main__":
    main()
