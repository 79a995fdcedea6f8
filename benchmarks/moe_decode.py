"""The MoE sub-layer for one token: the engine's separate launches against the one-token kernel (issue 10, benchmark 2).

The engine's path before session 27 is ``MoE.forward`` with ``moe.ONE_TOKEN_KERNEL`` off (fp32 router GEMM,
the routing kernel, the shared experts' GEMVs, alignment, two grouped GEMMs, activations, combine), with the
shared experts' gate/up fused as the engine does; with it on (the default) ``MoE.forward`` runs the kernel.
The kernel is ``layers/moe_decode_triton.moe_decode_triton``: its default three launches (phase 0, the
routing, phases 1-2 with a grid barrier) with and without the L2 prefetch and with 4-row down blocks
(``down_rows``, the default 16 since session 28), the single persistent launch (every program
routes) with and without the prefetch, and the four phase launches. On the CPU (a smoke run) ``MoE.forward``
takes its CPU path in both engine rows. Shapes are those of ``e2e_decode.py``'s DeepSeek-V3-shaped model:
hidden 2048, 64 experts top-6 in 8 groups (4 kept), I 256, two shared experts, bf16.

Each is checked against ``moe_decode_ref`` and timed as CUDA-graph replays (``gpu_timing.graph_seconds``)
over a ring of layers (weights from HBM, not L2). Reported: µs per call, launches per call, and the bytes
of the weights one token reads (router fp32, the 6 chosen and the shared experts) over that time as a
fraction of the copy bandwidth measured in the same run, and each kernel's device time per call (torch
profiler, ``gpu_timing.kernel_times``). Writes DIR/moe_decode.json and .md.

    python3 benchmarks/moe_decode.py --out DIR          (GPU; on the CPU a smoke run of tiny shapes)
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch

if not torch.cuda.is_available():  # the kernels run in Triton's interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import copy_gbps, graph_seconds, kernel_count, kernel_times  # noqa: E402
import provenance  # noqa: E402

from longflash.layers.activation import silu_and_mul  # noqa: E402
from longflash.layers import moe as moe_mod  # noqa: E402
from longflash.layers.moe import MoE, TopkRouter  # noqa: E402
from longflash.layers.moe_decode_triton import moe_decode_ref, moe_decode_triton  # noqa: E402


def build(D: int, E: int, I: int, n_shared: int, top_k: int, n_group: int, topk_group: int, dev, dt, seed: int):
    """An ``MoE`` layer with random weights (router fp32, experts in ``dt``) and its stacked weights."""
    torch.manual_seed(seed)
    router = TopkRouter(D, E, top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
                        routed_scaling_factor=2.5)
    moe = MoE(D, E, I, router, silu_and_mul, num_shared_experts=n_shared)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.normal_(0, 0.02 if "gate.weight" not in name else 0.05)
    moe = moe.to(dev)
    for m in moe.modules():  # experts in dt, the router's weight and bias fp32 (as the loader keeps them)
        if m is not router:
            for name, p in m.named_parameters(recurse=False):
                p.data = p.data.to(dt)
    moe.shared_experts.fuse_gate_up()
    w13, w2 = moe.stack_experts()
    sh = moe.shared_experts
    return moe, (router.weight, router.e_score_correction_bias, w13, w2, sh.gate_up_weight, sh.down_proj.weight)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="directory for moe_decode.json / .md")
    ap.add_argument("--layers", type=int, default=24, help="distinct layers in the timing ring (GPU)")
    ap.add_argument("--variants", nargs="+", default=None, metavar="TEXT",
                    help="time only the variants whose name contains one of these")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    D, E, I, NS, K, NG, TG = (2048, 64, 256, 2, 6, 8, 4) if cuda else (64, 8, 16, 2, 2, 2, 1)
    dt = torch.bfloat16 if cuda else torch.float32
    route = (K, NG, TG, True, 2.5)
    layers = [build(D, E, I, NS, K, NG, TG, dev, dt, s) for s in range(args.layers if cuda else 1)]
    x = (torch.randn(1, D, generator=torch.Generator().manual_seed(1)) * 0.5).to(device=dev, dtype=dt)
    res = {"commit": provenance.commit(), "device": torch.cuda.get_device_name(dev) if cuda else "cpu (interpreter)",
           "command": shlex.join(["python3"] + sys.argv), "shape": dict(D=D, E=E, I=I, n_shared=NS, top_k=K),
           "copy_gbps": copy_gbps(dev) if cuda else None, "rows": []}
    nbytes = E * D * 4 + (K * 3 * I * D + 3 * NS * I * D) * torch.finfo(dt).bits // 8
    ref = moe_decode_ref(x, *layers[0][1], *route)
    with torch.no_grad():
        def separate(L):  # the engine's path before the one-token kernel (moe.ONE_TOKEN_KERNEL off)
            moe_mod.ONE_TOKEN_KERNEL = False
            try:
                return L[0](x)
            finally:
                moe_mod.ONE_TOKEN_KERNEL = True
        variants = {"engine MoE.forward, separate launches": separate,
                    "engine MoE.forward (one-token kernel)": lambda L: L[0](x),
                    "three launches, no L2 prefetch": lambda L: moe_decode_triton(x, *L[1], *route, prefetch=False),
                    "one launch, no L2 prefetch": lambda L: moe_decode_triton(x, *L[1], *route, route_launch=False,
                                                                              prefetch=False),
                    "three launches, 4-row down blocks": lambda L: moe_decode_triton(x, *L[1], *route, down_rows=4),
                    "one launch (routing in every program)": lambda L: moe_decode_triton(x, *L[1], *route,
                                                                                         route_launch=False),
                    "four phase launches (no grid barrier)": lambda L: moe_decode_triton(x, *L[1], *route, phased=True)}
        if args.variants and not any(v in name for name in variants for v in args.variants):
            ap.error(f"no variant name contains any of {args.variants}; the variants: {sorted(variants)}")
        for name, fn in variants.items():
            if args.variants and not any(v in name for v in args.variants):
                continue
            y = fn(layers[0])
            err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
            it = iter(range(1 << 30))
            sec = graph_seconds(lambda: fn(layers[next(it) % len(layers)]), calls=len(layers), replays=10)
            us = sec * 1e6
            row = {"variant": name, "us": us, "launches": kernel_count(lambda: fn(layers[0])), "rel_err": err,
                   "copy_fraction": nbytes / sec / 1e9 / res["copy_gbps"] if cuda else None,
                   "kernels_us": kernel_times(lambda i: fn(layers[i % len(layers)]), calls=len(layers))}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    res["ok"] = all(r["rel_err"] <= 2e-2 for r in res["rows"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# MoE sub-layer for one token ({res['device']})", "",
             f"commit {res['commit']}; {res['shape']}; {nbytes / 1e6:.1f} MB of weights per call; "
             + (f"copy {res['copy_gbps']:.0f} GB/s" if cuda else "CPU smoke (interpreter)"), "", f"`{res['command']}`", "",
             "| variant | µs per call | launches | fraction of copy | rel err vs reference |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        frac = "" if r["copy_fraction"] is None else f"{r['copy_fraction']:.3f}"
        launches = "" if r["launches"] is None else r["launches"]
        lines.append(f"| {r['variant']} | {r['us']:.1f} | {launches} | {frac} | {r['rel_err']:.1e} |")
    if any(r["kernels_us"] for r in res["rows"]):
        lines += ["", "Device time per call of each kernel (torch profiler, eager, the same ring of layers; no launch "
                  "gaps):", ""]
    for r in res["rows"]:
        if r["kernels_us"]:
            lines.append(f"- {r['variant']}: " + "; ".join(f"`{k}` {v:.1f}" for k, v in r["kernels_us"]))
    with open(os.path.join(args.out, "moe_decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
