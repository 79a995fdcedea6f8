"""Two-phase vs one-phase Block AttnRes mixers of each block of a Kimi-K3 forward (issue #10).

    python3 benchmarks/attn_res_two_phase.py --out DIR            # GPU, < 90 s
    python3 benchmarks/attn_res_two_phase.py --out DIR --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes

Kimi-K3 shapes: H 7168, block size 12, NB 8 (93 layers: blocks 0-6 have 24 mixers, the last block 9
layers = 18 mixers + the output mixture), bf16, T = 1, 64, 4096. Block k reads C = k + 1 committed
slots. Per block and T:
  * one-phase: the engine's ``attn_res_mix`` (the one-launch kernel) for each of the block's Q mixers:
    the first over the C slots, the others over the C slots + that mixer's own prefix;
  * two-phase: ``attn_res_block_partials`` once (phase 1), query 0 cast from the partial, and
    ``attn_res_merge_prefix`` for the other Q - 1 mixers (phase 2);
  * GPU µs per block: the whole block's mixer calls back to back in one CUDA graph, median replay time
    (sublayers are left out: their outputs, the prefixes, are made once up front, one per mixer);
  * bytes each path must move at least (bf16 = 2 bytes, fp32 partials = 4): one-phase
    ``Σ_i (sources_i + 1)·T·H·2``; two-phase ``C·T·H·2`` (phase 1 reads each slot once) ``+ Q·T·(H+1)·4``
    (partials written) ``+ T·H·(4+2)`` (query 0) ``+ (Q-1)·T·H·(4+2+2)`` (each merge reads its partial and
    prefix and writes its result); GB/s = bytes / time, and its fraction of the copy bandwidth measured
    in the same run the same way;
  * max difference two-phase vs one-phase over the block's mixers in bf16 rounding steps (<= 1 expected:
    both are fp32 inside, summation order differs);
and per T the forward's total (sum over the 8 blocks). Writes DIR/attn_res_two_phase.json and .md.
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
    ap.add_argument("--out", required=True, help="directory for attn_res_two_phase.json / .md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through TRITON_INTERPRET=1")
    ap.add_argument("--replays", type=int, default=10, help="graph replays (median)")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch  # noqa: E402

sys.path.insert(0, REPO)
from longflash.layers.attn_res import attn_res_mix  # noqa: E402
from longflash.layers.attn_res_two_phase import attn_res_block_partials, attn_res_merge_prefix  # noqa: E402
from longflash.layers.attn_res_two_phase_triton import (attn_res_block_partials_triton,  # noqa: E402
                                                        attn_res_merge_prefix_triton)
from longflash.layers.attn_res_triton import attn_res_mix_triton  # noqa: E402
from longflash.models.attn_res_two_phase_mix import block_queries  # noqa: E402
from gpu_timing import copy_gbps, graph_seconds  # noqa: E402

EPS = 1e-5
GPU = dict(H=7168, num_layers=93, block_size=12, T=(1, 64, 4096))
SMOKE = dict(H=48, num_layers=7, block_size=3, T=(1, 5))


def steps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / (eps_dtype |ref| + 1e-6 max|ref|): rounding steps of the output dtype."""
    d, r = (got.float() - ref.float()).abs(), ref.float().abs()
    return float((d / (torch.finfo(ref.dtype).eps * r + 1e-6 * r.max())).max())


def block_bytes(T: int, H: int, C: int, Q: int, el: int) -> tuple[int, int]:
    """(one-phase, two-phase) minimum bytes of one block's Q mixers over C slots (see the docstring)."""
    one = (C + 1) * T * H * el + (Q - 1) * (C + 2) * T * H * el
    two = C * T * H * el + Q * T * (H + 1) * 4 + T * H * (4 + el) + (Q - 1) * T * H * (4 + 2 * el)
    return one, two


def main():
    args = ARGS
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float16  # (the interpreter's fp32 -> bf16 cast truncates)
    # Off CUDA the dispatchers take the PyTorch references; call the kernels (interpreted) directly.
    one_mix = attn_res_mix if cuda else (lambda s, g, w, e, out: attn_res_mix_triton(s, g, w, e, out=out))
    partials = attn_res_block_partials if cuda else attn_res_block_partials_triton
    merge = attn_res_merge_prefix if cuda else attn_res_merge_prefix_triton
    shape = GPU if cuda else SMOKE
    H, blocks = shape["H"], block_queries(shape["num_layers"], shape["block_size"])
    t0 = time.time()
    copy = copy_gbps(dev, 1 << 30, args.replays) if cuda else None
    el = torch.empty((), dtype=dtype).element_size()
    rows = []
    for T in shape["T"]:
        Qmax = max(len(b) for b in blocks)
        g = torch.Generator(device=dev).manual_seed(T)
        bank = (torch.randn(len(blocks), T, H, generator=g, device=dev) * 2).to(dtype)
        prefixes = (torch.randn(Qmax, T, H, generator=g, device=dev) * 2).to(dtype)
        out = torch.empty(T, H, dtype=dtype, device=dev)
        for k, queries in enumerate(blocks):
            C, Q = k + 1, len(queries)
            G = (1 + 0.1 * torch.randn(Q, H, generator=g, device=dev)).to(dtype)
            W = (torch.randn(Q, H, generator=g, device=dev) * H ** -0.5).to(dtype)
            slots = [bank[j] for j in range(C)]

            def one_phase(check=False):
                worst = 0.0
                for i in range(Q):
                    src = slots if i == 0 else slots + [prefixes[i]]
                    r = one_mix(src, G[i], W[i], EPS, out=out)
                    if check:
                        worst = max(worst, steps(two_res[i], r))
                return worst

            def two_phase(keep=None):
                parts = partials(slots, G, W, EPS)
                r = out.copy_(parts.acc[0])
                if keep is not None:
                    keep.append(r.clone())
                for i in range(1, Q):
                    r = merge(parts.query(i), prefixes[i], G[i], W[i], EPS, out=out)
                    if keep is not None:
                        keep.append(r.clone())

            two_res: list[torch.Tensor] = []
            two_phase(two_res)
            worst = one_phase(check=True)
            b_one, b_two = block_bytes(T, H, C, Q, el)
            row = dict(T=T, block=k, C=C, Q=Q, bytes_one=b_one, bytes_two=b_two, steps_two_vs_one=worst)
            if cuda:
                calls = 1 if T * H * C * Q > 1 << 28 else 4
                t1 = graph_seconds(one_phase, calls, args.replays)
                t2 = graph_seconds(two_phase, calls, args.replays)
                row.update(one_us=t1 * 1e6, two_us=t2 * 1e6, speedup=t1 / t2,
                           one_GBps=b_one / t1 / 1e9, two_GBps=b_two / t2 / 1e9,
                           one_frac_of_copy=b_one / t1 / 1e9 / copy, two_frac_of_copy=b_two / t2 / 1e9 / copy)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del G, W, two_res
        del bank, prefixes, out
        if cuda:
            torch.cuda.empty_cache()
    ok = all(r["steps_two_vs_one"] <= 1.0 for r in rows)
    totals = []
    for T in shape["T"]:
        rs = [r for r in rows if r["T"] == T]
        t = dict(T=T, bytes_one=sum(r["bytes_one"] for r in rs), bytes_two=sum(r["bytes_two"] for r in rs))
        if cuda:
            t.update(one_us=sum(r["one_us"] for r in rs), two_us=sum(r["two_us"] for r in rs))
            t["speedup"] = t["one_us"] / t["two_us"]
        totals.append(t)
    meta = dict(commit=provenance.commit(), device=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
                torch=torch.__version__, command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                smoke=args.smoke, dtype=str(dtype).replace("torch.", ""), H=H, num_layers=shape["num_layers"],
                block_size=shape["block_size"], copy_GBps=copy, all_within_one_step=ok, seconds=time.time() - t0)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attn_res_two_phase.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, forward_totals=totals), f, indent=1)
    md = _markdown(meta, rows, totals)
    with open(os.path.join(args.out, "attn_res_two_phase.md"), "w") as f:
        f.write(md)
    print(md)
    if not ok:
        raise SystemExit("two-phase differs from one-phase by more than one rounding step")


def _markdown(meta, rows, totals) -> str:
    f = lambda r, k, fmt: format(r[k], fmt) if k in r else "-"  # noqa: E731
    lines = [f"# AttnRes mixers of one block: two-phase vs one-phase ({meta['device']}, {meta['dtype']}, "
             f"H {meta['H']}, {meta['num_layers']} layers, block {meta['block_size']}, commit {meta['commit'][:10]})",
             "", f"`{meta['command']}`; copy bandwidth {meta['copy_GBps'] or 0:.0f} GB/s (same run, CUDA graph)", "",
             "| T | block | C | Q | one-phase µs | two-phase µs | speedup | one MB | two MB | one GB/s (of copy) "
             "| two GB/s (of copy) | steps two vs one |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['T']} | {r['block']} | {r['C']} | {r['Q']} | {f(r, 'one_us', '.1f')} | "
                     f"{f(r, 'two_us', '.1f')} | {f(r, 'speedup', '.2f')} | {r['bytes_one'] / 1e6:.2f} | "
                     f"{r['bytes_two'] / 1e6:.2f} | {f(r, 'one_GBps', '.0f')} ({f(r, 'one_frac_of_copy', '.2f')}) | "
                     f"{f(r, 'two_GBps', '.0f')} ({f(r, 'two_frac_of_copy', '.2f')}) | {r['steps_two_vs_one']:.2f} |")
    lines += ["", "Forward totals (all blocks):", "", "| T | one-phase µs | two-phase µs | speedup | one MB | two MB |",
              "|---|---|---|---|---|---|"]
    for t in totals:
        lines.append(f"| {t['T']} | {f(t, 'one_us', '.1f')} | {f(t, 'two_us', '.1f')} | {f(t, 'speedup', '.2f')} | "
                     f"{t['bytes_one'] / 1e6:.2f} | {t['bytes_two'] / 1e6:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
