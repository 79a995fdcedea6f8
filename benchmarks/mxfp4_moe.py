"""Grouped MXFP4 MoE (W4A16, one launch per layer) at Kimi-K3 expert shapes: a small config sweep per token
count, each config checked against the reference, times against the machine's ceilings.

    python benchmarks/mxfp4_moe.py --out DIR                     # GPU: Lt 3584, Im 3072, top-16 of 896
    python benchmarks/mxfp4_moe.py --smoke --out /tmp/mxfp4_smoke  # tiny, CPU (PyTorch reference, or the
    TRITON_INTERPRET=1 python benchmarks/mxfp4_moe.py --smoke --out /tmp/s   # kernel under the interpreter)

For 1, 64 and 4096 tokens it times one routed-expert layer (``run_mxfp4_experts_triton``: align + the one
kernel launch + the output cast) for every config of a small sweep (tile sizes, warps, stages, persistent
programs per SM, register cap, decode, align), up to 64 tokens as CUDA graph replays (as the engine's
decode steps run; the eager Python call's time is reported beside it), and reports, with denominators
measured in the same run:
- bytes moved (packed weights + scales of the experts hit, activations) per second, as a fraction of the
  device copy bandwidth (a 1 GiB ``copy_``: read + write) -- the decode ceiling;
- FLOP/s (2 * tokens * top_k * 3 * Lt * Im) as a fraction of the cuBLAS bf16 GEMM rate at the experts'
  gate/up and down shapes -- the prefill ceiling;
- packed weight bytes per layer vs bf16 (4.25 vs 16 bits per weight).
Every config's output is compared with the fp32 PyTorch reference on the same bf16 inputs (max abs error
over max |ref|); a config over 2e-2 is reported as wrong and never "best". The bf16 PTX decode is also
checked bitwise on all 256 bytes. Routing is random top-k (uniform). ``--experts N`` keeps fewer experts in
memory (the per-layer byte figures are still for 896); ``--no-sweep`` times only the default config;
``--budget-s`` (100) skips the remaining sweep configs after that many seconds (the suite step allows 120).
Writes DIR/mxfp4_moe.json and DIR/mxfp4_moe.md after every config.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from longflash.layers.activation import situ_and_mul  # noqa: E402
from longflash.layers.mxfp4 import MXFP4Experts, e2m1_table, e8m0_to_float, run_mxfp4_experts  # noqa: E402
import gpu_timing  # noqa: E402
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)

K3 = dict(hidden=3584, inter=3072, experts=896, top_k=16)
SMOKE = dict(hidden=256, inter=128, experts=8, top_k=2)
MAX_REL_ERR = 2e-2  # bf16 rounding of x·W and of the activation, fp32 accumulation

# Tile sweeps (see benchmarks/NOTES.md). BLOCK_W = 64 per warpgroup (4 warps): the dequantized weights are
# the wgmma's register operand, so two warpgroups on one BLOCK_W = 64 tile would both decode it.
# Second version (after the first H200 run): more resident warps per SM (maxnreg 128 lets 3-4 programs of
# 4 warps fit: the kernel needs 110 registers at that cap, no spills, the same loop code), deeper pipelines,
# the one-launch align vs the torch ops (diagnostic), the Triton decode (diagnostic: decode cost), down
# tiles of 2 x 64 output columns (`pair`: the bytes per K step of a gate/up tile; 168 registers without a
# cap, so 3 programs per SM fit; prefill BM 64 drops from 255 to 167 registers).
# Each sweep entry names every tile key (maxnreg None = no cap): entries override `default_config`.
_D = dict(BLOCK_M=16, BLOCK_W=64, BLOCK_K=128, num_warps=4, num_stages=4, programs_per_sm=2, maxnreg=None)
DECODE_SWEEP = {
    "d_w64_k128_s4": dict(_D),
    "d_w64_k128_s4_torch_align": dict(_D, align="torch"),
    "d_w64_k128_s4_r128_p3": dict(_D, maxnreg=128, programs_per_sm=3),
    "d_w64_k128_s4_r128_p4": dict(_D, maxnreg=128, programs_per_sm=4),
    "d_w64_k128_s5_r128_p4": dict(_D, maxnreg=128, programs_per_sm=4, num_stages=5),
    "d_w64_k128_s3_r128_p4": dict(_D, maxnreg=128, programs_per_sm=4, num_stages=3),
    "d_w64_k128_s4_pair_p3": dict(_D, down_pair=True, programs_per_sm=3),
    "d_w64_k128_s4_pair_r128_p4": dict(_D, down_pair=True, maxnreg=128, programs_per_sm=4),
    "d_w64_k128_s4_r128_p4_triton_decode": dict(_D, maxnreg=128, programs_per_sm=4, decode="small"),
    "d_w64_k128_s4_triton_decode": dict(_D, decode="small"),
}
_P = dict(BLOCK_M=64, BLOCK_W=64, BLOCK_K=64, num_warps=4, num_stages=3, programs_per_sm=2, maxnreg=None)
PREFILL_SWEEP = {
    "p_m64_w64_k64_s3": dict(_P),
    "p_m64_w64_k64_s4": dict(_P, num_stages=4),
    "p_m64_w64_k64_s3_pair_p3": dict(_P, down_pair=True, programs_per_sm=3),
    "p_m128_w64_k64_s3": dict(_P, BLOCK_M=128),
    "p_m128_w64_k32_s4": dict(_P, BLOCK_M=128, BLOCK_K=32, num_stages=4),
    "p_m128_w128_k64_s2": dict(_P, BLOCK_M=128, BLOCK_W=128, BLOCK_K=64, num_warps=8, num_stages=2,
                               programs_per_sm=1),
}
GRAPH_MAX_TOKENS = 64  # decode sizes are also timed as CUDA graph replays (how the engine runs them)


def _time(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of ``dst.copy_(src)`` counting the read and the write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), 10, 3, device)
    return 2 * nbytes / t


def gemm_rate(device: torch.device, shapes: list[tuple[int, int, int]], dtype: torch.dtype) -> dict:
    """FLOP/s of ``a @ b.T`` (a [M, K], b [N, K]) per shape and the best of them."""
    out = {}
    for M, N, K in shapes:
        a = torch.randn(M, K, device=device, dtype=dtype)
        b = torch.randn(N, K, device=device, dtype=dtype)
        t = _time(lambda: a @ b.T, 10, 3, device)
        out[f"{M}x{N}x{K}"] = 2 * M * N * K / t
    out["best"] = max(out.values())
    return out


def make_experts(E: int, D: int, I: int, device: torch.device, seed: int = 0) -> MXFP4Experts:
    """Random packed experts: uniform bytes (any byte order is as random as another, so the buffers are
    filled directly), scale bytes 119..123 (2^-8..2^-4)."""
    torch.manual_seed(seed)
    with torch.device(device):
        ex = MXFP4Experts(E, D, I, situ_and_mul, "situ", (4.0, 25.0))
    ex.w13_weight_packed.random_(0, 256)
    ex.w2_weight_packed.random_(0, 256)
    ex.w13_weight_scale.random_(119, 124)
    ex.w2_weight_scale.random_(119, 124)
    ex.reset_scale_stats()
    return ex


def expert_bytes(D: int, I: int) -> int:
    """Packed bytes of one expert (w1, w3, w2: codes + scales)."""
    return 3 * (D * I // 2 + D * I // 32)


def ptx_decode_check() -> bool | str:
    """The bf16 PTX decode on every byte at a few scale bytes, bitwise against the fp32 decode in bf16."""
    from longflash.layers.mxfp4_moe_triton import decode_bf16_pairs_gpu
    try:
        q = torch.arange(256, dtype=torch.uint8).repeat(6).cuda()
        s = torch.tensor([2, 100, 119, 127, 128, 252], dtype=torch.uint8).repeat_interleave(256).cuda()
        lo, hi = decode_bf16_pairs_gpu(q, s)
        sc = e8m0_to_float(s)
        want_lo = (e2m1_table(device="cuda")[(q & 15).long()] * sc).to(torch.bfloat16)
        want_hi = (e2m1_table(device="cuda")[(q >> 4).long()] * sc).to(torch.bfloat16)
        return bool(torch.equal(lo.view(torch.int16), want_lo.view(torch.int16))
                    and torch.equal(hi.view(torch.int16), want_hi.view(torch.int16)))
    except Exception as e:  # recorded, not fatal
        return f"{type(e).__name__}: {e}"[:300]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="directory for mxfp4_moe.json and mxfp4_moe.md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--experts", type=int, default=None, help="experts kept in memory (default 896)")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,64,4096)")
    ap.add_argument("--no-sweep", action="store_true", help="time only the default config")
    ap.add_argument("--budget-s", type=float, default=100.0,
                    help="skip the remaining sweep configs (not the defaults) once this many seconds have passed")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    shp = dict(SMOKE if args.smoke else K3)
    if args.experts:
        shp["experts"] = args.experts
    D, I, E, k = shp["hidden"], shp["inter"], shp["experts"], shp["top_k"]
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([1, 4, 16] if args.smoke else [1, 64, 4096])
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    use_triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    # NOTE: Triton 3.6's interpreter computes tl.dot of bf16 operands wrongly (checked: 2e10 off on a
    # 16x16 product), so the CPU interpreter run uses fp16 activations; the GPU uses bf16.
    dtype = torch.float16 if device.type == "cpu" and use_triton else torch.bfloat16

    copy_bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    gemm = gemm_rate(device, [(4096, 2 * I, D), (4096, D, I), (16384, 2 * I, D)] if not args.smoke
                     else [(256, 2 * I, D), (256, D, I)], dtype)
    ex = make_experts(E, D, I, device)
    if use_triton:
        from longflash.layers.mxfp4_moe_triton import default_config, run_mxfp4_experts_triton

    n_exp_layer = E if args.smoke else K3["experts"]
    per_layer_weights = n_exp_layer * 3 * D * I
    packed_layer = n_exp_layer * expert_bytes(D, I)
    result = {
        "benchmark": "mxfp4_moe", "commit": provenance.commit(), "command": "python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "backend": "triton" if use_triton else "pytorch-reference",
        "shapes": dict(latent=D, intermediate=I, experts_in_memory=E, top_k=k, activation_dtype=str(dtype).replace("torch.", "")),
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "bf16_gemm_TFLOPs": {kk: v / 1e12 for kk, v in gemm.items()},
        "packed_bytes_per_layer": packed_layer, "bf16_bytes_per_layer": 2 * per_layer_weights,
        "packed_over_bf16": packed_layer / (2 * per_layer_weights),
        "bits_per_weight": 8 * packed_layer / per_layer_weights,
        "max_rel_err_allowed": MAX_REL_ERR, "runs": [],
    }
    if use_triton:
        import triton
        result["triton"] = triton.__version__
    if device.type == "cuda":
        result["ptx_decode_bitwise"] = ptx_decode_check()

    gen = torch.Generator(device="cpu").manual_seed(1)
    for T in tokens:
        x = (torch.randn(T, D, generator=gen) * 0.05).to(device, dtype)
        scores = torch.rand(T, E, generator=gen)
        topk_w, topk_ids = scores.topk(k, dim=-1)
        topk_w = (topk_w / topk_w.sum(-1, keepdim=True)).to(device)
        topk_ids = topk_ids.to(device)
        hit = int(torch.unique(topk_ids).numel())
        w_bytes = hit * expert_bytes(D, I)
        act_bytes = 2 * (T * D + T * k * I * 2) + 4 * T * D * 2  # x, inter w+r, fp32 out (atomics) + cast
        flops = 2 * T * k * 3 * D * I
        ref = run_mxfp4_experts(x.float(), ex, topk_w, topk_ids) if use_triton else None
        iters = 5 if args.smoke else (20 if T <= 64 else 5)
        configs: list[tuple[str, dict | None]] = [("default", None)]
        if use_triton and not args.no_sweep:
            sweep = DECODE_SWEEP if T * k <= 4 * E else PREFILL_SWEEP
            configs += list(sweep.items())[:2] if args.smoke else list(sweep.items())
            configs.append(("default_again", None))  # the same config timed twice: the run's spread
        for name, cfg in configs:
            if name not in ("default", "default_again") and time.perf_counter() - t_start > args.budget_s:
                result["runs"].append({"tokens": T, "config": name, "tiles": {}, "error": "skipped: --budget-s"})
                continue
            if use_triton:
                fn = lambda c=cfg: run_mxfp4_experts_triton(x, ex, topk_w, topk_ids, c)  # noqa: E731
                used = dict(default_config(T, k, E), **(cfg or {}))
            else:
                fn = lambda: run_mxfp4_experts(x, ex, topk_w, topk_ids)  # noqa: E731
                used = {}
            run = {"tokens": T, "config": name, "tiles": used, "experts_hit": hit}
            try:
                if ref is not None:
                    got = fn().float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    run["rel_err"] = err if err == err else float("inf")  # NaN -> inf
                t = _time(fn, iters, 1, device)
                if device.type == "cuda" and T <= GRAPH_MAX_TOKENS:
                    run["eager_us"] = t * 1e6
                    t = gpu_timing.graph_seconds(fn, calls=1, replays=20)  # the engine's decode steps are CUDA graphs
                    run["graph"] = True
            except Exception as e:  # a variant that does not compile or run here is recorded, not fatal
                run["error"] = f"{type(e).__name__}: {e}"[:500]
                result["runs"].append(run)
                print(f"T={T:5d} {name:28s} failed: {run['error'][:200]}", flush=True)
                continue
            bw = (w_bytes + act_bytes) / t
            run.update(time_us=t * 1e6, weight_bytes=w_bytes, activation_bytes=act_bytes, GBps=bw / 1e9,
                       frac_copy_bandwidth=bw / copy_bw, TFLOPs=flops / t / 1e12, frac_bf16_gemm=flops / t / gemm["best"])
            result["runs"].append(run)
            _write(result, args.out, t_start)  # after every config: a suite timeout loses nothing done
            how = f" (graph; eager {run['eager_us']:.1f})" if "eager_us" in run else ""
            print(f"T={T:5d} {name:30s} {t * 1e6:10.1f} us{how}  "
                  f"{bw / 1e9:8.1f} GB/s ({bw / copy_bw:6.1%} of copy)  "
                  f"{flops / t / 1e12:7.1f} TFLOP/s ({flops / t / gemm['best']:6.1%} of bf16 GEMM)  "
                  f"rel err {run.get('rel_err', float('nan')):.2e}", flush=True)
        x = ref = None  # free before the next token count
    _write(result, args.out, t_start)
    print(markdown(result))
    return result


def _write(result: dict, out: str, t_start: float) -> None:
    """Best correct config per token count, wall time; DIR/mxfp4_moe.json and DIR/mxfp4_moe.md."""
    best = {}
    for r in result["runs"]:
        if "error" in r or r.get("rel_err", 0.0) > MAX_REL_ERR:
            continue
        if r["tokens"] not in best or r["time_us"] < best[r["tokens"]]["time_us"]:
            best[r["tokens"]] = r
    result["best"] = {str(t): {"config": r["config"], "tiles": r["tiles"], "time_us": r["time_us"],
                               "frac_copy_bandwidth": r["frac_copy_bandwidth"], "frac_bf16_gemm": r["frac_bf16_gemm"]}
                      for t, r in best.items()}
    result["wall_s"] = time.perf_counter() - t_start
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "mxfp4_moe.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "mxfp4_moe.md"), "w") as f:
        f.write(markdown(result))


def _tiles(t: dict) -> str:
    if not t:
        return "-"
    s = ",".join(str(t[k]) for k in ("BLOCK_M", "BLOCK_W", "BLOCK_K", "num_warps", "num_stages", "programs_per_sm"))
    defaults = (("decode", "auto"), ("maxnreg", None), ("down_pair", False), ("align", "triton"))
    extra = [f"{k}={t[k]}" for k, d in defaults if t.get(k, d) != d]
    return ",".join([s] + extra)


def markdown(r: dict) -> str:
    s = r["shapes"]
    lines = [f"## MXFP4 grouped MoE, one launch per layer ({r['backend']}) -- {r['device']}", "",
             f"commit `{r['commit']}`; command `{r['command']}`; torch {r['torch']}"
             + (f", triton {r['triton']}" if "triton" in r else ""), "",
             f"Latent {s['latent']}, intermediate {s['intermediate']}, top-{s['top_k']} of {s['experts_in_memory']} "
             f"experts in memory, {s['activation_dtype']} activations, random routing. Copy bandwidth {r['copy_bandwidth_GBps']:.0f} GB/s; "
             f"bf16 GEMM {r['bf16_gemm_TFLOPs']['best']:.0f} TFLOP/s (best of "
             + ", ".join(k for k in r["bf16_gemm_TFLOPs"] if k != "best") + ").",
             f"Packed weights per layer: {r['packed_bytes_per_layer'] / 2**30:.2f} GiB vs bf16 "
             f"{r['bf16_bytes_per_layer'] / 2**30:.2f} GiB ({r['packed_over_bf16']:.4f}x, {r['bits_per_weight']:.2f} bits/weight)."]
    if "ptx_decode_bitwise" in r:
        lines.append(f"bf16 PTX decode bitwise equal to the reference on all 256 bytes: {r['ptx_decode_bitwise']}.")
    lines += ["", "| tokens | config | tiles (M,W,K,warps,stages,progs/SM) | experts hit | time (us) | eager (us) "
              "| GB/s | of copy BW | TFLOP/s | of bf16 GEMM | rel err |",
              "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["runs"]:
        tiles = _tiles(x["tiles"])
        if "error" in x:
            lines.append(f"| {x['tokens']} | {x['config']} | {tiles} | failed: {x['error'][:120]} | | | | | | | |")
            continue
        err = x.get("rel_err")
        flag = "" if err is None or err <= r["max_rel_err_allowed"] else " WRONG"
        eager = f"{x['eager_us']:.1f}" if "eager_us" in x else "-"
        lines.append(f"| {x['tokens']} | {x['config']} | {tiles} | {x['experts_hit']} | {x['time_us']:.1f} | {eager} "
                     f"| {x['GBps']:.0f} | "
                     f"{x['frac_copy_bandwidth']:.1%} | {x['TFLOPs']:.1f} | {x['frac_bf16_gemm']:.1%} | "
                     + ("-" if err is None else f"{err:.2e}{flag}") + " |")
    lines += ["", "Best (correct) per token count: " + "; ".join(
        f"{t}: `{b['config']}` {b['time_us']:.1f} us ({b['frac_copy_bandwidth']:.1%} of copy, "
        f"{b['frac_bf16_gemm']:.1%} of bf16 GEMM)" for t, b in r["best"].items()) + ".",
        "", "`default` = `default_config` (`default_again`: timed again after the sweep, the run's spread); "
        "`d_*`/`p_*` = decode/prefill sweep (`BLOCK_W` weight rows per tile, `BLOCK_K` columns per step, `s` stages, "
        "`r128` maxnreg 128, `p3`/`p4` programs per SM, `pair` down tiles of 2 x BLOCK_W columns); "
        "time = CUDA graph replay for "
        f"<= {GRAPH_MAX_TOKENS} tokens on a GPU (eager: the Python call, launches included), else eager; "
        "rel err = max |kernel - fp32 reference| / max |reference|.",
        f"\nWall time {r['wall_s']:.1f} s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
