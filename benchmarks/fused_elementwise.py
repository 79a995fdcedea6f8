"""Fused elementwise kernels of issue #10 vs the PyTorch chains they replace, under a CUDA graph:
RoPE of q and k (``RotaryEmbedding.rotate_qk``: one launch vs ``cos_sin`` + two ``rotate``) and the gated
activations (``silu_and_mul`` / ``situ_and_mul``: one launch vs 2 / ~8 PyTorch ops).

    python benchmarks/fused_elementwise.py --out DIR            # GPU: default-model, DeepSeek-V3, Kimi-K3 shapes
    python benchmarks/fused_elementwise.py --out DIR --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes (runs only)

Writes DIR/fused_elementwise.json and DIR/fused_elementwise.md.

Per case: ``kernel_us`` and ``ref_us`` (the PyTorch reference chain, the engine's path before) = median
replay time of one CUDA graph holding --calls back-to-back calls on the same buffers, / --calls; speedup =
ref_us / kernel_us; achieved GB/s = minimum bytes / kernel time and its fraction of the copy bandwidth
measured in this run (a 1 GiB ``copy_``, same graph method). Minimum bytes: RoPE reads and writes
q_pe and k_pe once and reads the int64 positions (inv_freq is 128 B); the activation reads gate and up and
writes the output. Every case also records the kernel's error against the reference (the bounds of
tests/test_rotary_triton.py and tests/test_activation_triton.py): fp32 relative error and, for bf16, ulps
against the reference evaluated in fp32 and rounded once.
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
    ap.add_argument("--out", required=True, help="directory for fused_elementwise.json / .md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through TRITON_INTERPRET=1")
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--replays", type=int, default=10, help="graph replays timed (median)")
    ap.add_argument("--budget-s", type=float, default=55.0, help="skip the remaining cases past this many seconds")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch  # noqa: E402

sys.path.insert(0, REPO)
from longflash.layers.activation import silu_and_mul_ref, situ_and_mul_ref  # noqa: E402
from longflash.layers.activation_triton import silu_and_mul_triton, situ_and_mul_triton  # noqa: E402
from longflash.layers.rotary import RotaryEmbedding  # noqa: E402
from longflash.layers.rotary_triton import rotate_qk_triton  # noqa: E402
from gpu_timing import copy_gbps, graph_seconds  # noqa: E402

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
DSV3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}




def copy_ceiling(dev) -> dict:
    nbytes = (2 << 30) if dev.type == "cuda" else (2 << 20)
    return {"bytes": nbytes, "GBps": copy_gbps(dev, nbytes, ARGS.replays)}


def rope_error(rot, x, got, pos) -> dict:
    ref = rot.rotate_qk_ref(x, None, pos)[0].float()
    half = rot.rotary_dim // 2
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if rot.interleave else (xf[..., :half], xf[..., half:])
    s = (x1.square() + x2.square()).sqrt() * rot.attention_factor
    s = torch.cat([s, s], dim=-1).clamp(min=1e-30)
    if x.dtype == torch.float32:
        return {"fp32_rel_of_pair_norm": float(((got.float() - ref).abs() / s).max())}
    cos, sin = rot.cos_sin(pos, x.dtype)
    once = rot.rotate(xf, cos.float(), sin.float()).to(x.dtype).float()
    eps, tiny = torch.finfo(x.dtype).eps, torch.finfo(x.dtype).tiny
    excess = ((got.float() - once).abs() - 1e-6 * s).clamp(min=0)  # beyond fp32-level error of the pair norm
    return {"ulps_vs_once": float((excess / (eps * once.abs().clamp(min=tiny))).max()),
            "ulps_of_pair_norm_vs_chain": float(((got.float() - ref).abs() / (eps * s)).max())}


def act_error(got, gate, up, ref_fn) -> dict:
    tiny = torch.finfo(gate.dtype).tiny
    ref = ref_fn(gate, up).float()
    if gate.dtype == torch.float32:
        return {"fp32_rel": float(((got.float() - ref).abs() / ref.abs().clamp(min=tiny)).max())}
    once = ref_fn(gate.float(), up.float()).to(gate.dtype).float()
    eps = torch.finfo(gate.dtype).eps
    return {"ulps_vs_once": float(((got.float() - once).abs() / (eps * once.abs().clamp(min=tiny))).max()),
            "ulps_vs_chain": float(((got.float() - ref).abs() / (eps * ref.abs().clamp(min=128 * tiny))).max())}


def rope_cases(smoke: bool):
    if smoke:
        return [("default", 16, False, DEFAULT_ROPE, 4, 1, 2, 4096), ("dsv3", 64, True, DSV3_ROPE, 8, 1, 3, 163840)]
    return ([("default", 16, False, DEFAULT_ROPE, 4, 1, T, 4096) for T in (1, 8, 16, 128)]
            + [("dsv3", 64, True, DSV3_ROPE, 128, 1, T, 163840) for T in (1, 16, 128, 4096)]
            + [("drafter-gqa", 128, False, DEFAULT_ROPE, 32, 8, T, 32768) for T in (16, 256)])


def act_cases(smoke: bool):
    """(model, act, rows, I): default model (SiTU; dense 512, experts/shared 128 at rows = T·top-2),
    Kimi-K3 (SiTU; experts 3072, shared 6144), DeepSeek-V3 (SwiGLU; experts 2048, dense 18432)."""
    if smoke:
        return [("default", "situ", 2, 128), ("dsv3", "silu", 3, 96)]
    return ([("default", "situ", T, 512) for T in (1, 8, 16, 128)]
            + [("default", "situ", 2 * T, 128) for T in (1, 8, 16, 128)]
            + [("kimi-k3", "situ", r, 3072) for r in (8, 128, 4096)] + [("kimi-k3", "situ", r, 6144) for r in (1, 16)]
            + [("dsv3", "silu", r, 2048) for r in (8, 128, 4096)] + [("dsv3", "silu", r, 18432) for r in (1, 16)])


def main():
    dev = torch.device("cuda" if torch.cuda.is_available() and not ARGS.smoke else "cpu")
    dtypes = [torch.float16] if ARGS.smoke else [torch.bfloat16, torch.float32]
    ceiling = copy_ceiling(dev)
    g = torch.Generator().manual_seed(0)
    rows, skipped = [], []
    t_start = time.time()

    def over_budget(case) -> bool:
        if time.time() - t_start > ARGS.budget_s:
            skipped.append(case)
            return True
        return False

    fns = {"silu": (silu_and_mul_triton, silu_and_mul_ref), "situ": (situ_and_mul_triton, situ_and_mul_ref)}
    for dt in dtypes:  # bf16 (the models' dtype) first: a budget cut drops fp32 rows first
        for name, rd, il, params, H, Hk, T, max_pos in rope_cases(ARGS.smoke):
            if over_budget(f"rope_qk {name} T={T} {dt}"):
                continue
            rot = RotaryEmbedding(rd, params, max_pos, interleave=il)
            pos = torch.randint(0, max_pos, (T,), generator=g).to(dev)
            q = torch.randn(T, H, 128 + rd, generator=g).to(dev, dt)[..., 128:]  # MLA's q_pe slice
            k = (torch.randn(T, 512 + rd, generator=g).to(dev, dt)[:, 512:] if Hk == 1
                 else torch.randn(T, Hk, rd, generator=g).to(dev, dt))
            qo, ko = rotate_qk_triton(rot, q, k, pos)
            err = {f"q_{k_}": v for k_, v in rope_error(rot, q, qo, pos).items()}
            err.update({f"k_{k_}": v for k_, v in rope_error(rot, k, ko, pos).items()})
            t_k = graph_seconds(lambda: rotate_qk_triton(rot, q, k, pos), ARGS.calls, ARGS.replays)
            t_r = graph_seconds(lambda: rot.rotate_qk_ref(q, k, pos), ARGS.calls, ARGS.replays)
            nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + 8 * T
            rows.append(dict(op="rope_qk", model=name, dtype=str(dt)[6:], T=T, heads=H, kv_heads=Hk, rotary_dim=rd,
                             interleave=il, kernel_us=t_k * 1e6, ref_us=t_r * 1e6, speedup=t_r / t_k, bytes=nbytes,
                             GBps=nbytes / t_k / 1e9, frac_of_copy=nbytes / t_k / 1e9 / ceiling["GBps"], **err))
        for name, act, n, I in act_cases(ARGS.smoke):
            if over_budget(f"{act}_and_mul {name} rows={n} I={I} {dt}"):
                continue
            kern, ref = fns[act]
            h = (torch.randn(n, 2 * I, generator=g) * 3).to(dev, dt)  # a fused gate_up GEMM output
            gate, up = h[:, :I], h[:, I:]
            err = act_error(kern(gate, up), gate, up, ref)
            t_k = graph_seconds(lambda: kern(gate, up), ARGS.calls, ARGS.replays)
            t_r = graph_seconds(lambda: ref(gate, up), ARGS.calls, ARGS.replays)
            nbytes = 3 * n * I * h.element_size()
            rows.append(dict(op=f"{act}_and_mul", model=name, dtype=str(dt)[6:], T=n, I=I, kernel_us=t_k * 1e6,
                             ref_us=t_r * 1e6, speedup=t_r / t_k, bytes=nbytes, GBps=nbytes / t_k / 1e9,
                             frac_of_copy=nbytes / t_k / 1e9 / ceiling["GBps"], **err))
    commit = provenance.commit()
    result = {"commit": commit, "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor(),
              "torch": torch.__version__, "smoke": ARGS.smoke, "calls_per_graph": ARGS.calls,
              "command": " ".join([sys.executable] + sys.argv), "copy": ceiling, "seconds": time.time() - t_start,
              "skipped_over_budget": skipped, "rows": rows}
    os.makedirs(ARGS.out, exist_ok=True)
    with open(os.path.join(ARGS.out, "fused_elementwise.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = [f"# fused elementwise kernels ({result['device']}, commit {commit[:10]})", "",
          f"copy ceiling {ceiling['GBps']:.0f} GB/s; graph of {ARGS.calls} calls, median of {ARGS.replays} "
          "replays", "",
          "| op | model | dtype | T | shape | kernel µs | ref µs | speedup | GB/s | % copy | error |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"H{r['heads']}/{r['kv_heads']} rd{r['rotary_dim']}" if r["op"] == "rope_qk" else f"I{r['I']}"
        errs = ", ".join(f"{k}={v:.3g}" for k, v in r.items() if "ulps" in k or "fp32" in k)
        md.append(f"| {r['op']} | {r['model']} | {r['dtype']} | {r['T']} | {shape} | {r['kernel_us']:.2f} | "
                  f"{r['ref_us']:.2f} | {r['speedup']:.1f}x | {r['GBps']:.0f} | {100 * r['frac_of_copy']:.1f} | "
                  f"{errs} |")
    if skipped:
        md += ["", f"skipped (over the {ARGS.budget_s:.0f} s budget): " + "; ".join(skipped)]
    with open(os.path.join(ARGS.out, "fused_elementwise.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
