"""Driver for a Nsight Compute profile of the MLA decode kernel (issue 10, benchmark 5: where the fp8
path loses against bf16). Builds one decode case like ``benchmarks/mla_decode.py`` (16 heads, rows
512 + 64, block size 16, random physical blocks) and calls the kernel ``--iters`` times; run it under
``ncu`` with a kernel filter (``benchmarks/ncu_mla_decode.sh`` does). Prints the case and the kernel's
wall time per call (events, no L2 flush: only a sanity number; the timed figures are mla_decode.py's).

    python3 benchmarks/ncu_mla_decode.py --dtype fp8 --batch 16 --ctx 32768 --config default

``--config``: ``default`` (:func:`default_config`) or a name from ``VARIANTS`` (a few keys over the default).
Needs CUDA.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longflash.attention import ops  # noqa: E402
from longflash.attention import triton_mla_decode as tk  # noqa: E402

R, P, H, BS = 512, 64, 16, 16
W = R + P
SCALE = 192 ** -0.5
K_SCALE = 0.0625
FP8 = torch.float8_e4m3fn
# keys over default_config(16 rows, fp8): the version-3 tile (convert once after the pipelined loads)
VARIANTS = {"cvt": {"V_RELOAD": False, "F16": True, "CVT_SMEM": True},
            "w8r128": {"num_warps": 8, "maxnreg": 128, "occupancy": 2}}  # 8 warps, 2 programs per SM


def build(dtype: str, batch: int, ctx: int, seed: int = 0):
    """One case: q [B, H, W] bf16, cache [blocks, BS, W] (bf16, or fp8 = x / K_SCALE), block table
    [B, ctx / BS] int32 over a random permutation of the blocks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb = batch * (-(-ctx // BS))
    x = torch.randn(nb * BS, W, device="cuda", generator=g)
    cache = (ops.quantize_to_cache(x, FP8, K_SCALE) if dtype == "fp8" else x.to(torch.bfloat16)).view(nb, BS, W)
    bt = torch.randperm(nb, device="cuda", generator=g).to(torch.int32).view(batch, -1).contiguous()
    q = (torch.randn(batch, H, W, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return q, cache, bt, qsl, seq, (K_SCALE if dtype == "fp8" else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--config", default="default", choices=("default", *VARIANTS))
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA (this is a profiling driver)")
    q, cache, bt, qsl, seq, ks = build(a.dtype, a.batch, a.ctx)
    cfg = dict(tk.default_config(H, cache.dtype), **VARIANTS.get(a.config, {}))
    run = lambda: tk.mla_decode_attention(q, cache, bt, qsl, seq, SCALE, R, ks, max_query_len=1,  # noqa: E731
                                          max_seq_len=a.ctx, config=cfg)
    out, _ = run()
    ref, _ = ops.mla_decode_attention(q[:1].float(), cache, bt[:1], [0, 1], [a.ctx], SCALE, R, ks)
    err = ((out[:1].float() - ref).norm() / ref.norm()).item()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(a.iters):
        run()
    e1.record()
    torch.cuda.synchronize()
    us = e0.elapsed_time(e1) * 1e3 / a.iters
    print(f"{a.dtype} B{a.batch} ctx{a.ctx} config={a.config} {cfg} rel_err(request 0)={err:.2e} "
          f"{us:.1f} us/call (incl. stage 2)")


if __name__ == "__main__":
    main()
