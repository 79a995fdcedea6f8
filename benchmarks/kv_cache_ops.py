"""Achieved bandwidth of the paged KV cache kernels (issue 5): MLA cache write
(``concat_and_cache_mla``, bf16 and fp8 caches) and ``gather_and_maybe_dequant_cache`` (fp8 and bf16
caches into a bf16 workspace), as a fraction of the copy bandwidth measured in the same run.

    python benchmarks/kv_cache_ops.py --out DIR            # GPU: 64K and 256K rows x 576, block 64
    python benchmarks/kv_cache_ops.py --out DIR --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes

Writes DIR/kv_cache_ops.json and DIR/kv_cache_ops.md. Bytes moved per op are the minimum traffic:
write = inputs read (bf16 kv_c + k_pe) + cache rows written + slot_mapping; gather = cache rows read
+ workspace written + per-row token_to_seq. Copy bandwidth = 2 x bytes / time of ``dst.copy_(src)``
at 1 GiB (the device figure) and at each op's own size. Times are medians of CUDA-event timings with
the L2 flushed before each repetition. The Triton kernels are also checked against the PyTorch
references (fp8 bytes equal, gathered rows equal) at the benchmarked shapes, and timed against them
(ratio). Goal: achieved / copy >= 0.85.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for kv_cache_ops.json / .md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through TRITON_INTERPRET=1")
    ap.add_argument("--rows", type=int, nargs="+", default=[65536, 262144])
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch  # noqa: E402

sys.path.insert(0, REPO)
from longflash.attention import ops  # noqa: E402
from longflash.attention import triton_ops as tk  # noqa: E402

FP8 = torch.float8_e4m3fn


class Timer:
    def __init__(self, dev, reps):
        self.dev, self.reps = dev, reps
        self.cuda = dev.type == "cuda"
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev) if self.cuda else None

    def __call__(self, fn) -> float:
        """Median seconds of fn()."""
        fn()
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)


def copy_bw(timer, nbytes, dev) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timer(lambda: dst.copy_(src))


def layout(T, bs, num_reqs, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    nblk = -(-T // bs)
    perm = torch.randperm(nblk + 8, generator=g)
    slots = (perm[torch.arange(T) // bs] * bs + torch.arange(T) % bs).to(dev)
    per = -(-T // num_reqs // bs) * bs  # whole blocks per request; request r holds tokens [r*per, ...)
    lens = [max(0, min(per, T - i * per)) for i in range(num_reqs)]
    table = torch.zeros((num_reqs, per // bs), dtype=torch.int32)
    for r in range(num_reqs):
        k = -(-lens[r] // bs)
        table[r, :k] = perm[r * per // bs:r * per // bs + k].to(torch.int32)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t2s = torch.repeat_interleave(torch.arange(num_reqs, dtype=torch.int32), torch.tensor(lens))
    return slots, table.to(dev), cu.to(dev), t2s.to(dev), nblk + 8


def bench_rows(T, args, dev, timer, peak_copy, out):
    R, P, bs = args.kv_lora_rank, args.rope_dim, args.block_size
    Wd = R + P
    g = torch.Generator(device="cpu").manual_seed(T)
    kv_c = (torch.randn(T, R, generator=g) * 3).to(torch.bfloat16).to(dev)
    k_pe = (torch.randn(T, P, generator=g) * 3).to(torch.bfloat16).to(dev)
    slots, table, cu, t2s, nb = layout(T, bs, 16, dev)
    scale = 0.05
    # (rows per program, warps); None = the wrapper's default (4096 elements per program)
    sweep = [(None, 4), (32, 4), (128, 8)] if dev.type == "cuda" else [(None, 4)]
    for cache_dtype in (torch.bfloat16, FP8):
        esz = 1 if cache_dtype == FP8 else 2
        ks = scale if cache_dtype == FP8 else None
        # --- write
        ref_cache = torch.zeros(nb, bs, Wd, dtype=cache_dtype, device=dev)
        ker_cache = torch.zeros_like(ref_cache)
        ops.concat_and_cache_mla(kv_c, k_pe, ref_cache, slots, ks)
        tk.concat_and_cache_mla(kv_c, k_pe, ker_cache, slots, ks)
        equal = bool(torch.equal(ref_cache.view(torch.uint8), ker_cache.view(torch.uint8)))
        nbytes = T * Wd * 2 + T * Wd * esz + T * 8
        t_ref = timer(lambda: ops.concat_and_cache_mla(kv_c, k_pe, ref_cache, slots, ks))
        best = None
        for bt_, nw in sweep:
            t = timer(lambda: tk.concat_and_cache_mla(kv_c, k_pe, ker_cache, slots, ks, block_t=bt_, num_warps=nw))
            if best is None or t < best[0]:
                best = (t, bt_, nw)
        same = copy_bw(timer, nbytes, dev)
        out.append(dict(op="concat_and_cache_mla", rows=T, width=Wd, block_size=bs,
                        cache_dtype=str(cache_dtype).replace("torch.", ""), input_dtype="bfloat16",
                        k_scale=ks, bytes=nbytes, kernel_s=best[0], block_t=best[1], num_warps=best[2],
                        GBps=nbytes / best[0] / 1e9, frac_of_copy=nbytes / best[0] / peak_copy,
                        frac_of_same_size_copy=nbytes / best[0] / same, reference_s=t_ref,
                        speedup_vs_reference=t_ref / best[0], equal_to_reference=equal))
        # --- gather + dequant into a bf16 workspace
        nbytes = T * Wd * esz + T * Wd * 2 + T * 4
        r = ops.gather_and_maybe_dequant_cache(ker_cache, table, cu, None, torch.bfloat16, ks)
        k = tk.gather_and_maybe_dequant_cache(ker_cache, table, cu, None, torch.bfloat16, ks, t2s, total=T)
        equal = bool(torch.equal(r.view(torch.int16), k.view(torch.int16)))
        if dev.type == "cpu":  # the interpreter's fp32->bf16 cast is not RNE (one ulp allowed)
            equal = bool(torch.allclose(r.float(), k.float(), rtol=2 ** -7, atol=0))
        t_ref = timer(lambda: ops.gather_and_maybe_dequant_cache(ker_cache, table, cu, None, torch.bfloat16, ks, t2s))
        best = None
        for bt_, nw in sweep:
            t = timer(lambda: tk.gather_and_maybe_dequant_cache(ker_cache, table, cu, None, torch.bfloat16, ks, t2s,
                                                                total=T, block_t=bt_, num_warps=nw))
            if best is None or t < best[0]:
                best = (t, bt_, nw)
        same = copy_bw(timer, nbytes, dev)
        out.append(dict(op="gather_and_maybe_dequant_cache", rows=T, width=Wd, block_size=bs,
                        cache_dtype=str(cache_dtype).replace("torch.", ""), output_dtype="bfloat16",
                        k_scale=ks, bytes=nbytes, kernel_s=best[0], block_t=best[1], num_warps=best[2],
                        GBps=nbytes / best[0] / 1e9, frac_of_copy=nbytes / best[0] / peak_copy,
                        frac_of_same_size_copy=nbytes / best[0] / same, reference_s=t_ref,
                        speedup_vs_reference=t_ref / best[0], equal_to_reference=equal))


def main():
    args = ARGS
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    rows = [256] if args.smoke else args.rows
    timer = Timer(dev, args.reps)
    t0 = time.time()
    peak_copy = copy_bw(timer, (1 << 30) if dev.type == "cuda" else (1 << 22), dev)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    import triton
    res = dict(benchmark="kv_cache_ops", commit=commit,
               device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
               command="python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
               torch=torch.__version__, triton=triton.__version__, smoke=args.smoke,
               interpreter=os.environ.get("TRITON_INTERPRET") == "1",
               copy_GBps_1GiB=peak_copy / 1e9, goal_frac_of_copy=0.85, results=[])
    os.makedirs(args.out, exist_ok=True)
    for T in rows:
        bench_rows(T, args, dev, timer, peak_copy, res["results"])
    res["wall_s"] = time.time() - t0
    with open(os.path.join(args.out, "kv_cache_ops.json"), "w") as f:
        json.dump(res, f, indent=2)
    lines = [f"# KV cache kernels: achieved bandwidth ({res['device']})", "",
             f"commit `{commit}`, `{res['command']}`, torch {res['torch']}, triton {res['triton']}"
             + (" — SMOKE RUN (CPU interpreter; times are meaningless)" if args.smoke else ""), "",
             f"copy bandwidth (1 GiB `copy_`, read + write): **{peak_copy / 1e9:.0f} GB/s**", "",
             "| op | cache | rows x width | bytes | kernel µs | GB/s | / copy | / same-size copy | vs torch ref | equal ref |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["results"]:
        lines.append(f"| {r['op']} | {r['cache_dtype']} | {r['rows']} x {r['width']} | {r['bytes']:,} | "
                     f"{r['kernel_s'] * 1e6:.1f} | {r['GBps']:.0f} | {r['frac_of_copy']:.2f} | "
                     f"{r['frac_of_same_size_copy']:.2f} | {r['speedup_vs_reference']:.1f}x | {r['equal_to_reference']} |")
    with open(os.path.join(args.out, "kv_cache_ops.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    bad = [r for r in res["results"] if not r["equal_to_reference"]]
    if bad:
        print(f"ERROR: {len(bad)} kernel results differ from the reference", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
