"""The per-launch floor of a decode step's CUDA graph: µs per dependent launch of kernels that do almost no work.

Issue 10, benchmark 2: the batch-1 decode graph of the DeepSeek-V3-shaped model runs ~600 dependent
launches; the smallest ones (a 2 MB GEMV, a one-row RMSNorm) cost ~1.5–2 µs each back to back whatever
their bytes (``benchmarks/NOTES.md``, session 22). This measures that floor directly: a chain of N
launches, each reading the previous one's output, captured in one graph and replayed
(``gpu_timing.graph_seconds``), for
- a Triton kernel of one program (and of ``--programs`` programs), without and with programmatic
  dependent launch (``gdc_wait`` before reading, ``gdc_launch_dependents`` at the start; sm_90+);
- a PyTorch elementwise op on one element (``torch.add(..., out=)``);
- a cuBLAS GEMM [1, 64] × [64, 64].
Reported: µs per launch. Writes DIR/launch_floor.json and .md.

    python3 benchmarks/launch_floor.py --out DIR       (GPU; on the CPU a smoke run under TRITON_INTERPRET=1)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if not torch.cuda.is_available():  # the kernels run in Triton's interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import graph_seconds  # noqa: E402
import provenance  # noqa: E402

from longflash.ops.triton_pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_for  # noqa: E402


@triton.jit
def _step_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    v = tl.load(src_ptr + pid)
    tl.store(dst_ptr + pid, v + 1.0)


def chain(kind: str, bufs: list[torch.Tensor], programs: int, pdl: bool, w: torch.Tensor | None):
    """A function launching ``len(bufs) - 1`` dependent launches of ``kind`` (buffer i -> i + 1)."""
    def run():
        for a, b in zip(bufs[:-1], bufs[1:]):
            if kind == "triton":
                _step_kernel[(programs,)](a, b, PDL=pdl, **launch_options(pdl))
            elif kind == "torch add":
                torch.add(a[:1], 1.0, out=b[:1])
            else:  # cuBLAS
                torch.mm(a[:64].view(1, 64), w, out=b[:64].view(1, 64))
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--launches", type=int, default=200, help="dependent launches per graph")
    ap.add_argument("--programs", type=int, default=1024, help="programs of the wide Triton variant")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    n = args.launches if cuda else 4
    width = max(args.programs, 64)
    bufs = [torch.zeros(width, device=dev) for _ in range(n + 1)]
    w = torch.randn(64, 64, device=dev)
    pdl = pdl_for(dev)
    variants = [("triton", 1, False), ("triton", args.programs, False)]
    if pdl:
        variants += [("triton", 1, True), ("triton", args.programs, True)]
    variants += [("torch add", 1, False), ("cuBLAS mm [1,64]x[64,64]", 1, False)]
    res = {"commit": provenance.commit(), "device": torch.cuda.get_device_name(dev) if cuda else "cpu (interpreter)",
           "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(["python3"] + sys.argv),
           "launches": n, "rows": []}
    for kind, programs, with_pdl in variants:
        fn = chain(kind, bufs, programs, with_pdl, w)
        us = graph_seconds(fn, calls=1, replays=10) * 1e6 / n
        row = {"kind": kind, "programs": programs, "pdl": with_pdl, "us_per_launch": us}
        res["rows"].append(row)
        print(f"{kind:28s} programs {programs:5d} pdl {str(with_pdl):5s}: {us:7.3f} us per launch", flush=True)
    ok = float(bufs[-1][0]) > 0  # the last buffer holds the chain's result
    res["chain_ran"] = ok
    with open(os.path.join(args.out, "launch_floor.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# Per-launch floor of a CUDA graph ({res['device']})", "",
             f"commit {res['commit']}; torch {res['torch']}; triton {res['triton']}; {n} dependent launches per graph",
             "", f"`{res['command']}`", "", "| kernel | programs | PDL | µs per launch |", "|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['programs']} | {'yes' if r['pdl'] else 'no'} | {r['us_per_launch']:.3f} |"
              for r in res["rows"]]
    with open(os.path.join(args.out, "launch_floor.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
