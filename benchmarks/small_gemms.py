"""The small GEMMs of a batch-1 decode step (issue 10, benchmark 2's profile): formulations timed as
CUDA-graph replays on the GPU, to pick the one the model uses.

    python3 benchmarks/small_gemms.py --out DIR     (GPU; on the CPU: a tiny smoke run)

1. MoE router logits, fp32 ``x · W_gate^T`` for T tokens, E experts, hidden K: ``F.linear`` (today),
   ``torch.mv`` per token (T = 1 only), the transposed product ``(W · x^T)^T``, and the broadcast
   product + row sum. The profile of the DeepSeek-V3-shaped model (E 64, K 2048) showed one 8x64-tile
   GEMM of 12.5 us per MoE layer at T = 1: one program walks all of K.
2. MLA's two input projections of the same normed hidden state, ``q_a_proj`` [q_lora_rank, K] and
   ``kv_a_proj_with_mqa`` [kv_lora_rank + rope, K]: two GEMMs (today) vs one over the concatenated
   weight, bf16.
3. bf16 ``x · W^T`` at the shared experts' gate_up shape (:func:`gate_up_rows`), 4. the MoE combine
   (:func:`combine_rows`).
Each row: median us per call (20 replays of a graph of 20 calls, L2 not flushed: weights this small
stay in L2 across decode steps only when nothing else runs, so this is a lower bound for all
formulations alike), and the max abs difference from ``F.linear`` in fp64.
Writes DIR/small_gemms.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import graph_seconds  # noqa: E402

SHAPES_ROUTER = [(64, 2048), (256, 7168), (384, 7168)]  # (E, K): bench model, DeepSeek-V3, Kimi-K2
SHAPES_QKV_A = [(1536, 576, 2048), (1536, 576, 7168)]  # (q_lora_rank, kv_lora_rank + rope, K)
TOKENS = [1, 2, 4, 16, 64]


def time_graph(fn, reps: int = 20, inner: int = 20) -> float:
    """Median seconds per call of ``fn`` captured ``inner`` times in one CUDA graph (CPU: wall clock)."""
    return graph_seconds(fn, calls=inner, replays=reps)


def router_rows(dev) -> list[dict]:
    rows = []
    for E, K in SHAPES_ROUTER:
        w = torch.randn(E, K, device=dev) * K ** -0.5
        for T in TOKENS:
            x = torch.randn(T, K, device=dev)
            ref = F.linear(x.double(), w.double())
            forms = {"F.linear": lambda: F.linear(x, w), "mm(W, x^T)^T": lambda: torch.mm(w, x.t()).t(),
                     "mul+sum": lambda: (x[:, None, :] * w[None]).sum(-1)}
            if T == 1:
                forms["mv"] = lambda: torch.mv(w, x[0])[None]
            for name, fn in forms.items():
                err = (fn().double() - ref).abs().max().item()
                rows.append({"op": "router fp32", "shape": f"E{E} K{K}", "T": T, "form": name,
                             "us": time_graph(fn) * 1e6, "max_abs_err": err})
                print(rows[-1], flush=True)
    return rows


def qkv_a_rows(dev, dtype) -> list[dict]:
    rows = []
    for Q, KV, K in SHAPES_QKV_A:
        wq = (torch.randn(Q, K, device=dev) * K ** -0.5).to(dtype)
        wkv = (torch.randn(KV, K, device=dev) * K ** -0.5).to(dtype)
        wcat = torch.cat([wq, wkv])
        for T in TOKENS:
            x = torch.randn(T, K, device=dev).to(dtype)
            for name, fn in {"two GEMMs": lambda: (F.linear(x, wq), F.linear(x, wkv)),
                             "one GEMM": lambda: F.linear(x, wcat).split([Q, KV], dim=-1)}.items():
                rows.append({"op": "q_a + kv_a", "shape": f"{Q}+{KV} K{K}", "T": T, "form": name,
                             "us": time_graph(fn) * 1e6})
                print(rows[-1], flush=True)
    return rows


SHAPES_GATE_UP = [(1024, 2048), (512, 2048), (2112, 2048), (4096, 7168)]  # (N, K) of a bf16 x · W^T


def gate_up_rows(dev, dtype) -> list[dict]:
    """bf16 ``x · W^T`` at small T for the N, K of the batch-1 profile's slow GEMM (the shared experts'
    fused gate_up, N 1024, K 2048: 12.6 us, an 8x64 tile) and neighbours: formulations cuBLAS may
    serve with different kernels."""
    rows = []
    for N, K in SHAPES_GATE_UP:
        w = (torch.randn(N, K, device=dev) * K ** -0.5).to(dtype)
        wt = w.t().contiguous()  # [K, N] row-major
        zero = torch.zeros(N, device=dev, dtype=dtype)
        for T in TOKENS:
            x = torch.randn(T, K, device=dev).to(dtype)
            ref = F.linear(x.double(), w.double())
            forms = {"F.linear": lambda: F.linear(x, w), "mm(W, x^T)^T": lambda: torch.mm(w, x.t()).t(),
                     "x @ W^T stored [K, N]": lambda: x @ wt, "addmm(0, x, W^T)": lambda: torch.addmm(zero, x, w.t()),
                     "two halves": lambda: torch.cat([F.linear(x, w[:N // 2]), F.linear(x, w[N // 2:])], -1)}
            for name, fn in forms.items():
                rows.append({"op": "gate_up bf16", "shape": f"N{N} K{K}", "T": T, "form": name,
                             "us": time_graph(fn) * 1e6, "max_abs_err": (fn().double() - ref).abs().max().item()})
                print(rows[-1], flush=True)
    return rows


def combine_rows(dev, dtype) -> list[dict]:
    """The MoE combine of the routed experts' outputs y [T·k, D] (dtype) by topk_weights [T, k] fp32:
    today's ``(y.float() * w).sum(1).to(dtype)`` (4 launches) against one-launch torch forms."""
    rows = []
    for k, D in ((6, 2048), (8, 7168)):
        for T in TOKENS:
            y = torch.randn(T * k, D, device=dev).to(dtype)
            w = torch.rand(T, k, device=dev)
            ref = (y.view(T, k, D).double() * w.double()[..., None]).sum(1)
            forms = {"float*w sum": lambda: (y.view(T, k, D).float() * w[..., None]).sum(1).to(dtype),
                     "bmm fp32": lambda: torch.bmm(w[:, None, :], y.view(T, k, D).float()).squeeze(1).to(dtype),
                     "bmm dtype": lambda: torch.bmm(w[:, None, :].to(dtype), y.view(T, k, D)).squeeze(1)}
            for name, fn in forms.items():
                rows.append({"op": "moe combine", "shape": f"k{k} D{D}", "T": T, "form": name,
                             "us": time_graph(fn) * 1e6, "max_abs_err": (fn().double() - ref).abs().max().item()})
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", choices=("gate_up",), help="only the gate_up and MoE-combine tables")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda:  # smoke: one small shape each
        SHAPES_ROUTER[:] = [(8, 64)]
        SHAPES_QKV_A[:] = [(32, 16, 64)]
        SHAPES_GATE_UP[:] = [(32, 64)]
        TOKENS[:] = [1, 4]
    dt = torch.bfloat16 if cuda else torch.float32
    if a.only == "gate_up":
        rows = gate_up_rows(dev, dt) + combine_rows(dev, dt)
    else:
        rows = router_rows(dev) + qkv_a_rows(dev, dt) + gate_up_rows(dev, dt) + combine_rows(dev, dt)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "small_gemms.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows}, f, indent=1)
    lines = ["| op | shape | T | form | us | max abs err vs fp64 |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['shape']} | {r['T']} | {r['form']} | {r['us']:.2f} | "
              f"{r.get('max_abs_err', float('nan')):.2e} |" for r in rows]
    with open(os.path.join(a.out, "small_gemms.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
