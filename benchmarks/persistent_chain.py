"""Dependent launches vs one persistent kernel with grid barriers (issue 10, benchmark 2).

What a persistent batch-1 decode step could gain.
A chain of ``--phases`` one-token GEMVs ``y[i + 1] = W_i · y[i]`` (W_i [d, d] bf16, fp32 accumulation,
y rounded to bf16 per step: the shape of a decode step's dense projections) is run three ways, each timed
as CUDA-graph replays (``gpu_timing.graph_seconds``):
- ``launches``: one launch of the engine's GEMV (``layers/gemv_triton.py``, PDL on sm_90+) per phase;
- ``persistent``: one launch, one program per ``block_n`` output rows (≤ the SM count), the phases
  separated by a grid barrier (``longflash/ops/grid_sync.py``); each program loads its rows of W_i
  *before* waiting for phase i - 1 (weights do not depend on the previous phase);
- ``persistent, no prefetch``: the same, weights loaded after the wait;
and ``barrier only``: phases that do nothing but the barrier (µs per grid barrier). Reported: µs per phase,
the weights' bytes per phase over that time as a fraction of the copy bandwidth measured in the same run.
Each variant's last vector is checked against a step-by-step PyTorch recomputation (rel err).

    python3 benchmarks/persistent_chain.py --out DIR          (GPU)
    python3 benchmarks/persistent_chain.py --out DIR          (CPU: a smoke run, one program, interpreter)
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

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import copy_gbps, graph_seconds  # noqa: E402
import provenance  # noqa: E402

from longflash.layers.gemv_triton import gemv_triton  # noqa: E402
from longflash.ops.grid_sync import grid_arrive, grid_reset_if_last, grid_wait  # noqa: E402
from longflash.ops.triton_env import interpreting, sm_count  # noqa: E402


@triton.jit
def _chain_phase(w_ptr, ys_ptr, bar_ptr, i, P, D, rows, k, PREFETCH: tl.constexpr, WORK: tl.constexpr):
    """Phase i of the chain for this program's ``rows``: ys[i + 1][rows] = W_i[rows] · ys[i]."""
    if WORK:
        wp = w_ptr + i.to(tl.int64) * D * D + rows[:, None].to(tl.int64) * D + k[None, :]
        if PREFETCH:
            w = tl.load(wp)
        if i > 0:
            grid_wait(bar_ptr, i * P)
        if not PREFETCH:
            w = tl.load(wp)
        x = tl.load(ys_ptr + i.to(tl.int64) * D + k)
        y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(ys_ptr + (i + 1).to(tl.int64) * D + rows, y.to(ys_ptr.dtype.element_ty))
    else:
        if i > 0:
            grid_wait(bar_ptr, i * P)
    return grid_arrive(bar_ptr)


@triton.jit
def _chain_kernel(w_ptr, ys_ptr, bar_ptr, L, D, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PREFETCH: tl.constexpr, WORK: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    before = 0
    if INTERPRET:  # a loop bounded by a run-time argument fails in the interpreter; the same loop as a while
        i = 0
        while i < L:
            before = _chain_phase(w_ptr, ys_ptr, bar_ptr, i, P, D, rows, k, PREFETCH, WORK)
            i += 1
    else:
        for i in range(0, L):
            before = _chain_phase(w_ptr, ys_ptr, bar_ptr, i, P, D, rows, k, PREFETCH, WORK)
    grid_reset_if_last(bar_ptr, before, L * P)


def persistent_chain(w: torch.Tensor, ys: torch.Tensor, bar: torch.Tensor, block_n: int, prefetch: bool = True,
                     work: bool = True, num_warps: int = 8) -> None:
    """Run the chain ys[i + 1] = w[i] · ys[i] (w [L, D, D], ys [L + 1, D], same dtype) in one launch of
    D / block_n programs, one per SM at most; ``bar`` is an int32 counter, 0 on entry (and on return).

    Raises:
        ValueError: block_n not a positive divisor of D; more programs than the device's SMs (they must all be
            resident at once, or the barrier never opens); more than one program in Triton's interpreter
            (it runs programs one after another)."""
    L, D, _ = w.shape
    if block_n < 1 or D % block_n:
        raise ValueError(f"block_n must be a positive divisor of D = {D}, got {block_n}")
    programs = D // block_n
    limit = 1 if interpreting() else sm_count(w.device)
    if programs > limit:
        raise ValueError(f"D / block_n = {programs} programs, more than the {limit} that can wait at a grid barrier "
                         + ("in the interpreter (one program at a time)" if interpreting() else "(one per SM)"))
    _chain_kernel[(programs,)](w, ys, bar, L, D, BLOCK_N=block_n, BLOCK_K=D, PREFETCH=prefetch, WORK=work,
                               INTERPRET=interpreting(), num_warps=num_warps)


def block_n_for(d: int, programs: int) -> int:
    """The smallest power of two ``block_n`` dividing ``d`` with ``d / block_n`` <= ``programs``."""
    block_n = 1
    while d // block_n > programs or d % block_n:
        block_n *= 2
    return block_n


def rel_err(w: torch.Tensor, ys: torch.Tensor) -> float:
    """Largest per-phase relative error of ys[i + 1] against W_i · ys[i] recomputed in fp32."""
    ref = torch.einsum("lnk,lk->ln", w.float(), ys[:-1].float())
    return float(((ys[1:].float() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="directory for persistent_chain.json / .md")
    ap.add_argument("--phases", type=int, default=48, help="dependent GEMVs per chain (GPU; the CPU smoke runs 3)")
    ap.add_argument("--dims", type=int, nargs="+", default=[1024, 2048],
                    help="d of the [d, d] weights (GPU; the CPU smoke runs 64)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    sms = sm_count(dev)
    L = args.phases if cuda else 3
    dims = args.dims if cuda else [64]
    res = {"commit": provenance.commit(), "device": torch.cuda.get_device_name(dev) if cuda else "cpu (interpreter)",
           "torch": torch.__version__, "triton": triton.__version__, "command": shlex.join(["python3"] + sys.argv),
           "phases": L, "sms": sms, "copy_gbps": copy_gbps(dev) if cuda else None, "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    bar = torch.zeros(1, dtype=torch.int32, device=dev)
    for d in dims:
        block_n = block_n_for(d, sms if cuda else 1)  # one program per SM (one in the interpreter)
        w = (torch.randn(L, d, d, device=dev, generator=g) / d ** 0.5).to(torch.bfloat16)
        x0 = torch.randn(d, device=dev, generator=g).to(torch.bfloat16)
        mb = d * d * 2 / 1e6
        variants = {
            "launches": lambda ys: [gemv_triton(ys[i:i + 1], w[i], out=ys[i + 1:i + 2]) for i in range(L)],
            "persistent": lambda ys: persistent_chain(w, ys, bar, block_n),
            "persistent, no prefetch": lambda ys: persistent_chain(w, ys, bar, block_n, prefetch=False),
            "barrier only": lambda ys: persistent_chain(w, ys, bar, block_n, work=False),
        }
        for name, fn in variants.items():
            ys = torch.zeros(L + 1, d, dtype=torch.bfloat16, device=dev)
            ys[0] = x0
            sec = graph_seconds(lambda: fn(ys), calls=1, replays=10)
            us = sec * 1e6 / L
            err = rel_err(w, ys) if name != "barrier only" else None
            frac = (mb * 1e6 / (us * 1e-6) / 1e9 / res["copy_gbps"]) if cuda and name != "barrier only" else None
            row = {"d": d, "MB_per_phase": mb, "variant": name, "programs": (d // block_n) if "launch" not in name
                   else None, "us_per_phase": us, "copy_fraction": frac, "rel_err": err}
            res["rows"].append(row)
            print(f"d {d:5d} {name:24s}: {us:7.3f} us/phase" + (f", {frac:.3f} of copy" if frac else "")
                  + (f", rel err {err:.1e}" if err is not None else ""), flush=True)
    ok = all(r["rel_err"] is None or r["rel_err"] < 2e-2 for r in res["rows"]) and int(bar.item()) == 0
    res["ok"] = ok
    with open(os.path.join(args.out, "persistent_chain.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# Dependent launches vs a persistent kernel with grid barriers ({res['device']})", "",
             f"commit {res['commit']}; torch {res['torch']}; triton {res['triton']}; {L} dependent phases per chain; "
             + (f"copy {res['copy_gbps']:.0f} GB/s" if res['copy_gbps'] else "no copy ceiling (CPU smoke)"), "",
             f"`{res['command']}`", "",
             "| d | MB per phase | variant | programs | µs per phase | fraction of copy | rel err |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['d']} | {r['MB_per_phase']:.1f} | {r['variant']} | {r['programs'] or 'engine GEMV'} | "
                     f"{r['us_per_phase']:.3f} | {'' if r['copy_fraction'] is None else format(r['copy_fraction'], '.3f')} | "
                     f"{'' if r['rel_err'] is None else format(r['rel_err'], '.1e')} |")
    lines += ["", f"all checks passed: {ok}"]
    with open(os.path.join(args.out, "persistent_chain.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
