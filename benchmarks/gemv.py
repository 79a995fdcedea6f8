"""Few-row GEMV vs cuBLAS at a batch-1 decode step's projection shapes, with a sweep of the GEMV's tiles.

cuBLAS (``F.linear`` / ``torch.matmul``) against the Triton GEMV (``longflash/layers/gemv_triton.py``;
issue 10, benchmark 2).

    python3 benchmarks/gemv.py --out DIR        (GPU; on the CPU: a tiny smoke run of the same code under
                                                 TRITON_INTERPRET=1, no timings worth reading)

Shapes: the projections of the DeepSeek-V3-shaped benchmark model (``e2e_decode.py``: hidden 2048,
q_lora_rank 1536, 16 heads, MLA's absorbed per-head ``W_UK`` / ``W_UV``, shared experts, the dense first
layer, the LM head) and two of DeepSeek-V3 itself (hidden 7168), at M = 1, 2, 4 rows of x.
Each time is the median per call of CUDA-graph replays (``gpu_timing.graph_seconds``) over a ring of
weight copies of ≥ 256 MB in all, so every call reads its weight from HBM as in a decode step (a
single weight of a few MB would stay in the 50 MB L2). Reported: µs, GB/s (weight + x + y bytes / time)
and the fraction of the device copy bandwidth measured in the same run; the error of each form
against the fp32 reference (``gemv.gemv_ref``). Writes DIR/gemv.json and DIR/gemv.md.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # the kernel runs in Triton's interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import graph_seconds  # noqa: E402
import provenance  # noqa: E402

from longflash.bench_roofline import measure_copy_bandwidth  # noqa: E402
from longflash.layers.gemv import gemv_ref  # noqa: E402
from longflash.layers.gemv_triton import GemvConfig, block_m_of, default_config, gemv_triton  # noqa: E402

# (name, batch, N, K, layout): "nk" = W [N, K] row-major (nn.Linear), "kn" = W stored [K, N] (its transpose)
SHAPES = [("qkv_a (q_a + kv_a)", 1, 2112, 2048, "nk"), ("q_b", 1, 3072, 1536, "nk"), ("o_proj", 1, 2048, 2048, "nk"),
          ("shared gate_up", 1, 1024, 2048, "nk"), ("shared gate_up [K,N]", 1, 1024, 2048, "kn"),
          ("shared down", 1, 2048, 512, "nk"), ("W_UK (per head, [K,N])", 16, 512, 128, "kn"),
          ("W_UK_T (per head copy)", 16, 512, 128, "nk"),
          ("W_UV (per head)", 16, 128, 512, "nk"), ("dense gate_up", 1, 16384, 2048, "nk"),
          ("dense down", 1, 2048, 8192, "nk"), ("lm_head", 1, 129280, 2048, "nk"),
          ("DSV3 qkv_a", 1, 2112, 7168, "nk"), ("DSV3 o_proj / tp8", 1, 7168, 2048, "nk")]
ROWS = [1, 2, 4]
RING_BYTES = 256 << 20


def sweep_configs(bm: int) -> list[GemvConfig]:
    """Tiles tried: fp32 partials of at most 128 registers per thread."""
    grid = itertools.product([1, 2, 4, 8], [256, 512, 1024, 2048], [1, 2, 4])
    return [GemvConfig(n, k, w) for n, k, w in grid if bm * n * k <= 128 * 32 * w]


def weights_ring(B: int, N: int, K: int, layout: str, dev, dtype, tiny: bool) -> list[torch.Tensor]:
    """Copies of one random weight (as the [B, N, K] or [N, K] view the product takes) filling the ring."""
    nbytes = B * N * K * 2
    n = 2 if tiny else max(2, -(-RING_BYTES // nbytes))
    ring = []
    for _ in range(n):
        w = (torch.randn(B, N, K, device=dev) * K ** -0.5).to(dtype) if layout == "nk" else \
            (torch.randn(B, K, N, device=dev) * K ** -0.5).to(dtype).transpose(1, 2)
        ring.append(w if B > 1 else w[0])
    return ring


def timed(fn_of_w, ring: list[torch.Tensor]) -> float:
    """Median seconds per call of ``fn_of_w(w)`` over the ring (one graph of len(ring) calls)."""
    it = itertools.cycle(ring)
    return graph_seconds(lambda: fn_of_w(next(it)), calls=len(ring), replays=5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop sweeping tiles after this many seconds")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = SHAPES if cuda else [(n, min(b, 2), min(N, 96), min(K, 64), lay) for n, b, N, K, lay in SHAPES[:8]]
    res = {"commit": provenance.commit(), "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
           "torch": torch.__version__, "command": " ".join(["python3"] + sys.argv), "rows": []}
    res["copy_gbs"] = measure_copy_bandwidth(dev)
    print(f"copy {res['copy_gbs']:.0f} GB/s", flush=True)
    for (name, B, N, K, layout), M in itertools.product(shapes, ROWS):
        ring = weights_ring(B, N, K, layout, dev, dtype, not cuda)
        x = torch.randn(B, M, K, device=dev).to(dtype) if B > 1 else torch.randn(M, K, device=dev).to(dtype)
        nbytes = (ring[0].numel() + x.numel() + B * M * N) * x.element_size()
        ref = gemv_ref(x, ring[0]).float()
        scale = ref.abs().max().item() or 1.0
        row = {"shape": name, "B": B, "N": N, "K": K, "layout": layout, "M": M, "bytes": nbytes}
        cublas = (lambda w: F.linear(x, w)) if B == 1 else (lambda w: torch.matmul(x, w.transpose(1, 2)))
        row["cublas_us"] = timed(cublas, ring) * 1e6
        row["cublas_err"] = (cublas(ring[0]).float() - ref).abs().max().item() / scale
        dflt = default_config(M, N, K)
        row["default_config"] = str(dflt)
        row["default_us"] = timed(lambda w: gemv_triton(x, w, config=dflt), ring) * 1e6
        row["triton_err"] = (gemv_triton(x, ring[0], config=dflt).float() - ref).abs().max().item() / scale
        best = (row["default_us"], str(dflt))
        sweep = []
        # [K, N] weights: cuBLAS and the default tile only (one program per block_n columns: no sweep helps)
        if cuda and layout == "nk" and time.perf_counter() - t0 < args.budget_s:
            for cfg in sweep_configs(block_m_of(M)):
                try:
                    us = timed(lambda w: gemv_triton(x, w, config=cfg), ring) * 1e6
                except Exception as e:  # noqa: BLE001 — a tile that does not compile is skipped
                    print(f"  {cfg}: {type(e).__name__}", flush=True)
                    continue
                sweep.append((round(us, 2), str(cfg)))
                best = min(best, (us, str(cfg)))
        row["best_us"], row["best_config"] = best
        row["sweep"] = sorted(sweep)[:8]
        for k in ("cublas", "default", "best"):
            row[f"{k}_frac"] = nbytes / (row[f"{k}_us"] * 1e-6) / 1e9 / res["copy_gbs"]
        res["rows"].append(row)
        print(f"{name:24s} M{M} cuBLAS {row['cublas_us']:6.2f} us ({row['cublas_frac']:.2f}) | triton default "
              f"{row['default_us']:6.2f} us ({row['default_frac']:.2f}) {dflt} | best {row['best_us']:6.2f} us "
              f"({row['best_frac']:.2f}) {row['best_config']} | err {row['cublas_err']:.1e} / {row['triton_err']:.1e}",
              flush=True)
        with open(os.path.join(args.out, "gemv.json"), "w") as f:
            json.dump(res, f, indent=1)
    lines = [f"# Few-row GEMV vs cuBLAS ({res['device']})", "",
             f"commit {res['commit']}; torch {res['torch']}; copy bandwidth {res['copy_gbs']:.0f} GB/s (same run)", "",
             f"`{res['command']}`", "",
             "Median µs per call of CUDA-graph replays over a ≥ 256 MB ring of weight copies (weights from HBM); "
             "fraction = bytes / time / copy bandwidth; err = max |y − fp32 ref| / max |ref|.", "",
             "| shape | B | N | K | W | M | MB | cuBLAS µs | frac | Triton default µs | frac | tile | best µs | frac | "
             "best tile | speedup (default) | err cuBLAS | err Triton |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['shape']} | {r['B']} | {r['N']} | {r['K']} | {r['layout']} | {r['M']} | {r['bytes'] / 1e6:.2f} "
                     f"| {r['cublas_us']:.2f} | {r['cublas_frac']:.2f} | {r['default_us']:.2f} | {r['default_frac']:.2f} "
                     f"| {r['default_config']} | {r['best_us']:.2f} | {r['best_frac']:.2f} | {r['best_config']} "
                     f"| {r['cublas_us'] / r['default_us']:.2f}x | {r['cublas_err']:.1e} | {r['triton_err']:.1e} |")
    with open(os.path.join(args.out, "gemv.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0



if __name__ == "__main__":
    sys.exit(main())
