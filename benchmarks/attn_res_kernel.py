"""The fused AttnRes mixer kernel (``longflash/layers/attn_res_triton.py``) against the PyTorch chain
(``attn_res_mix_reference``), both captured in CUDA graphs (issue #10).

    python3 benchmarks/attn_res_kernel.py --out DIR            # GPU, < 60 s
    python3 benchmarks/attn_res_kernel.py --out DIR --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes

Shapes (bf16 sources and weights, as in the engine; S sources = views of one pool, ``out`` another view):
the default model (H 256, S 2 and 5 = its largest mixer) at T = 1, 8, 16, 128, and Kimi-K3 / DeepSeek-V3
width (H 7168, S 2 and 9 = Kimi-K3's largest mixer) at T = 1, 16, 128, 4096. Per shape:
  * max |kernel - reference| in bf16 rounding steps (|diff| / (eps_bf16 |ref|)), must be <= 1;
  * GPU µs per call of the kernel and of the reference chain: N calls back to back in one CUDA graph,
    median replay time / N (the decode step's situation: sources just written, mostly in L2);
  * the kernel's achieved bandwidth (bytes = (S + 1)·T·H·2 + 2·H·2: each source row read once, out
    written once, weights) and its fraction of a device copy measured the same way in the same run;
  * for a few shapes, tiles other than the default (rows per program, warps) timed the same way.
Kernel launches per call are counted once with ``torch.profiler`` (reference chain vs kernel).
The tile choice (``attn_res_triton._tile``) was made without a GPU (register use from ptxas only);
the alternative tiles are there to check it. Writes DIR/attn_res_kernel.json and DIR/attn_res_kernel.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="directory for attn_res_kernel.json / .md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through TRITON_INTERPRET=1")
    ap.add_argument("--replays", type=int, default=20, help="graph replays (median)")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch  # noqa: E402

sys.path.insert(0, REPO)
from longflash.layers import attn_res_triton  # noqa: E402
from longflash.layers.attn_res import attn_res_mix_reference  # noqa: E402
from longflash.layers.attn_res_triton import attn_res_mix_triton  # noqa: E402
from gpu_timing import copy_gbps, graph_seconds as graph_time, kernel_count  # noqa: E402

EPS = 1e-5
# (H, S values, T values, extra tiles (BLOCK_H, BLOCK_ROWS, num_warps) timed at the listed T)
GPU_SHAPES = [(256, (2, 5), (1, 8, 16, 128), [(256, 16, 4), (256, 4, 2)], (16, 128)),
              (7168, (2, 9), (1, 16, 128, 4096), [(8192, 1, 8), (8192, 1, 32)], (1, 4096))]
SMOKE_SHAPES = [(48, (2, 5), (1, 3), [(64, 1, 1)], (3,)), (80, (3,), (2,), [], ())]








def steps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / (eps_dtype |ref| + 1e-6 max|ref|): rounding steps of the output dtype."""
    if ref.numel() == 0:
        return 0.0
    d = (got.float() - ref.float()).abs()
    r = ref.float().abs()
    return float((d / (torch.finfo(ref.dtype).eps * r + 1e-6 * r.max())).max())


def with_tile(tile):
    """Run the launcher with a fixed (BLOCK_H, BLOCK_ROWS, num_warps) instead of ``_tile(H)``."""
    default = attn_res_triton._tile

    def fn(*a, **k):
        attn_res_triton._tile = lambda H, T: tile
        try:
            return attn_res_mix_triton(*a, **k)
        finally:
            attn_res_triton._tile = default
    return fn


def main():
    args = ARGS
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float16  # (the interpreter's fp32 -> bf16 cast truncates)
    shapes = GPU_SHAPES if cuda else SMOKE_SHAPES
    t0 = time.time()
    copy = copy_gbps(dev, 1 << 30, args.replays) if cuda else None
    rows, launches = [], {}
    for H, S_list, T_list, tiles, tile_T in shapes:
        for S in S_list:
            for T in T_list:
                g = torch.Generator(device=dev).manual_seed(T * 131 + S)
                pool = (torch.randn(S + 1, T, H, generator=g, device=dev) * 2).to(dtype)
                gw = (1 + 0.1 * torch.randn(H, generator=g, device=dev)).to(dtype)
                w = (torch.randn(1, H, generator=g, device=dev) * H ** -0.5).to(dtype)
                src, out = [pool[i] for i in range(S)], pool[S]
                ref = attn_res_mix_reference(src, gw, w, EPS)
                variants = [("default", attn_res_mix_triton, attn_res_triton._tile(H, T))]
                if T in tile_T:
                    variants += [(f"tile{t}", with_tile(t), t) for t in tiles]
                nbytes = (S + 1) * T * H * pool.element_size() + 2 * H * gw.element_size()
                calls = 4 if T * H * S > 1 << 24 else 20
                t_ref = graph_time(lambda: attn_res_mix_reference(src, gw, w, EPS, out=out), calls,
                                   args.replays) if cuda else None
                if cuda and (H, S) not in launches:
                    launches[(H, S)] = (kernel_count(lambda: attn_res_mix_reference(src, gw, w, EPS, out=out)),
                                        kernel_count(lambda: attn_res_mix_triton(src, gw, w, EPS, out=out)))
                for name, fn, tile in variants:
                    got = fn(src, gw, w, EPS, out=out)
                    r = dict(H=H, S=S, T=T, variant=name, tile=list(tile), bytes=nbytes, steps_vs_reference=steps(got, ref))
                    if cuda:
                        t_k = graph_time(lambda: fn(src, gw, w, EPS, out=out), calls, args.replays)
                        r.update(kernel_us=t_k * 1e6, reference_us=t_ref * 1e6, speedup=t_ref / t_k,
                                 kernel_GBps=nbytes / t_k / 1e9, frac_of_copy=nbytes / t_k / 1e9 / copy)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    ok = all(r["steps_vs_reference"] <= 1.0 for r in rows)
    meta = dict(commit=provenance.commit(), device=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
                torch=torch.__version__, command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                smoke=args.smoke, dtype=str(dtype).replace("torch.", ""), copy_GBps=copy, all_within_one_step=ok,
                launches_per_call={f"H{h}-S{s}": {"reference": a, "kernel": b} for (h, s), (a, b) in launches.items()},
                seconds=time.time() - t0)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attn_res_kernel.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "attn_res_kernel.md"), "w") as f:
        f.write(_markdown(meta, rows))
    print(_markdown(meta, rows))
    if not ok:
        raise SystemExit("kernel differs from the reference by more than one rounding step")


def _markdown(meta, rows) -> str:
    lines = [f"# AttnRes mixer kernel vs PyTorch chain ({meta['device']}, {meta['dtype']}, commit {meta['commit'][:10]})",
             "", f"`{meta['command']}`; copy bandwidth {meta['copy_GBps'] or 0:.0f} GB/s (same run, CUDA graph); "
             f"launches per call: {meta['launches_per_call']}", "",
             "| H | S | T | tile (BLOCK_H, rows, warps) | kernel µs | reference µs | speedup | GB/s | of copy | steps vs ref |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tile = f"{tuple(r['tile'])}{'' if r['variant'] == 'default' else ' (alt)'}"
        if "kernel_us" in r:
            lines.append(f"| {r['H']} | {r['S']} | {r['T']} | {tile} | "
                         f"{r['kernel_us']:.2f} | {r['reference_us']:.2f} | {r['speedup']:.1f}x | {r['kernel_GBps']:.0f} | "
                         f"{r['frac_of_copy']:.2f} | {r['steps_vs_reference']:.2f} |")
        else:
            lines.append(f"| {r['H']} | {r['S']} | {r['T']} | {tile} | - | - | - | - | - | {r['steps_vs_reference']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
