"""The MLA prefill's dense attention on one GPU: the Triton flash-attention kernel
(``attention/triton_prefill.py``) against the in-place PyTorch form it replaces
(``ops.attention_with_lse_inplace``) and torch's SDPA, at DeepSeek-V3 shapes on one TP-8 rank
(16 heads, qk 192 = nope 128 + rope 64, v 128, bf16).

    python benchmarks/prefill_attention.py [--configs NAME ...] [--out FILE.json] [--skip-sdpa]
    python benchmarks/prefill_attention.py --smoke --out /tmp/x.json   # CPU: TRITON_INTERPRET=1, tiny shapes

Cases: causal prefill Tq = Tk in {4096, 16384} (offset 0) and a chunked-context piece (Tq 4096 new
tokens against a 32768-row workspace chunk, non-causal). Per case and implementation: milliseconds
(median of CUDA-event timings of CUDA-graph replays, ``gpu_timing.graph_seconds``), TFLOP/s of the
useful work (2 · H · (D + Dv) per visible query-key pair: causal ≈ half the square), the fraction of the
bf16 GEMM rate measured in the same run (8192³ ``torch.matmul``), the speedups over the in-place
baseline (skipped where its [H, Tq, Tk] fp32 scores and their temporaries would need > 40 GB) and over
SDPA, and the kernel's relative error against the baseline's output (or, without it, a row sample of
the fp32 reference). SDPA: each backend (flash, efficient, cudnn) is tried alone with D != Dv; the
table names the fastest that runs and lists the ones that refused (SDPA returns no LSE, which the
chunked prefill needs to merge pieces, so it is a speed reference only). Every Triton tile config of
``--configs`` (default: all of ``PREFILL_CONFIGS``) is timed; the best is marked, and a config with
TMA says whether these tensors let it read k and v through TMA (``tma_ok``; else it ran the pointer path).

Prints a markdown table to stdout (and, with ``--out``, the raw rows as JSON). The numbers mean something
on a GPU only: ``--smoke`` (implied without CUDA) runs the same code on the CPU through Triton's
interpreter with 2 heads and sequences of a few dozen tokens (same D / Dv), to check that every config
and the table still run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H, D, DV = 16, 192, 128
CASES = [("causal4k", 4096, 4096, 0), ("causal16k", 16384, 16384, 0), ("chunk4k_32k", 4096, 32768, None)]
SMOKE_H, SMOKE_CASES = 2, [("causal40", 40, 40, 0), ("chunk24_70", 24, 70, None)]
BASELINE_LIMIT_BYTES = 40e9


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--configs", nargs="+", default=None, metavar="NAME",
                    help="Triton tile configs to time (names of triton_prefill.PREFILL_CONFIGS; default all)")
    ap.add_argument("--cases", nargs="+", default=None, metavar="CASE", choices=[c[0] for c in CASES + SMOKE_CASES],
                    help="a subset of the cases (default all)")
    ap.add_argument("--skip-baseline", action="store_true", help="do not time ops.attention_with_lse_inplace")
    ap.add_argument("--skip-sdpa", action="store_true", help="do not time torch SDPA")
    ap.add_argument("--replays", type=int, default=5, help="timed graph replays per measurement")
    ap.add_argument("--out", default=None, help="also write the raw rows to this JSON file")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the code path: Triton interpreter, tiny shapes (implied without CUDA)")
    return ap.parse_args(argv)


def visible_pairs(tq: int, tk: int, off: int | None) -> int:
    """Query-key pairs a call computes: query i sees min(tk, max(0, i + off + 1)) keys (all tk if non-causal)."""
    if off is None:
        return tq * tk
    return sum(min(tk, max(0, i + off + 1)) for i in range(tq))


def baseline_bytes(tq: int, tk: int, h: int = H) -> float:
    """Peak device memory of ``ops.attention_with_lse_inplace`` beyond its inputs: the fp32 [h, Tq, Tk]
    scores plus fp32 copies of q, k, v (expanded to h heads) and the fp32 output."""
    return 4.0 * (h * tq * tk + tq * h * D + tk * h * (D + DV) + tq * h * DV)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("prefill_attention: no CUDA GPU, running the CPU smoke check (--smoke)", file=sys.stderr)
        args.smoke = True
    if args.smoke:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            print("prefill_attention: --smoke needs TRITON_INTERPRET=1 before Triton is imported", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported
    sys.path.insert(0, REPO)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import provenance
    from gpu_timing import graph_seconds
    from longflash.attention import ops
    from longflash.attention import triton_prefill as tp

    configs = args.configs or list(tp.PREFILL_CONFIGS)
    for name in configs:
        tp.resolve_config(torch.bfloat16, name)  # ValueError for an unknown name, before any timing
    dev = torch.device("cpu" if args.smoke else "cuda")
    h, cases, n_gemm = (SMOKE_H, SMOKE_CASES, 256) if args.smoke else (H, CASES, 8192)
    a = torch.randn(n_gemm, n_gemm, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n_gemm, n_gemm, device=dev, dtype=torch.bfloat16)
    gemm_rate = 2 * n_gemm ** 3 / graph_seconds(lambda: a @ b, 4, args.replays)
    del a, b
    rows, sdpa_refusals = [], {}
    scale = D ** -0.5
    for label, tq, tk, off in cases:
        if args.cases and label not in args.cases:
            continue
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(tq, h, D, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(tk, h, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(tk, h, DV, device=dev, dtype=torch.bfloat16, generator=g)
        flops = 2.0 * h * (D + DV) * visible_pairs(tq, tk, off)

        def row(impl, seconds, **kw):
            r = dict(case=label, tq=tq, tk=tk, causal_offset=off, impl=impl, ms=seconds * 1e3,
                     tflops=flops / seconds / 1e12, gemm_frac=flops / seconds / gemm_rate, **kw)
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            return r

        ref_out = None
        base = None
        if not args.skip_baseline and baseline_bytes(tq, tk, h) <= BASELINE_LIMIT_BYTES:
            ref_out, _ = ops.attention_with_lse_inplace(q, k, v, scale, off)
            base = row("inplace (PyTorch)", graph_seconds(lambda: ops.attention_with_lse_inplace(q, k, v, scale, off),
                                                          1, args.replays))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        sdpa = None
        if not args.skip_sdpa:
            sdpa = time_sdpa(torch, graph_seconds, q, k, v, scale, off, args.replays, sdpa_refusals, label)
            if sdpa is not None:
                sdpa = row(f"SDPA {sdpa[0]}", sdpa[1])
        if ref_out is None:  # a row sample of the fp32 reference (query i keeps its causal rule: offset i + off)
            idx = list(range(0, tq, max(1, tq // 64)))
            ref_rows = torch.cat([ops.attention_with_lse(q[i:i + 1], k, v, scale, None if off is None else i + off)[0]
                                  for i in idx])
        for name in configs:
            fn = lambda: tp.attention_with_lse(q, k, v, scale, off, config=name)  # noqa: E731
            out, _ = fn()
            if ref_out is not None:
                err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
            else:
                err = ((out[idx].float() - ref_rows.float()).norm() / ref_rows.float().norm()).item()
            t = graph_seconds(fn, 3, args.replays)
            cfg = tp.resolve_config(torch.bfloat16, name)
            row(f"triton {name}", t, rel_err=err, speedup_vs_inplace=base["ms"] / (t * 1e3) if base else None,
                speedup_vs_sdpa=sdpa["ms"] / (t * 1e3) if sdpa else None,
                tma=bool(cfg.get("TMA")) and tp.tma_ok(cfg, k, v))
        del q, k, v, ref_out
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(markdown(rows, gemm_rate, sdpa_refusals, provenance.commit(short=True), torch, h, args.smoke))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gemm_rate=gemm_rate, rows=rows, sdpa_refusals=sdpa_refusals), f, indent=1)
    return 0


def time_sdpa(torch, graph_seconds, q, k, v, scale, off, replays, refusals, label):
    """(backend, seconds) of the fastest SDPA backend that runs [1, H, T, D] x [1, H, T, Dv] (causal
    only for Tq == Tk: SDPA's is_causal aligns the mask top-left); every backend's time or refusal is
    recorded in ``refusals[label]``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention
    if off is not None and not (off == 0 and q.shape[0] == k.shape[0]):
        refusals[label] = "causal offset other than a square's 0"
        return None
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    best = None
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        def fn(backend=backend):
            with sdpa_kernel([backend]):
                return scaled_dot_product_attention(qs, ks, vs, is_causal=off is not None, scale=scale)
        try:
            fn()
            torch.cuda.synchronize()
            t = graph_seconds(fn, 3, replays)
        except Exception as e:  # noqa: BLE001  (a backend that refuses D != Dv is a result)
            msg = (str(e) or "?").splitlines()[0][:160]
            refusals.setdefault(label, {})[backend.name] = f"{type(e).__name__}: {msg}"
            continue
        refusals.setdefault(label, {})[backend.name] = f"ran, {t * 1e3:.2f} ms"
        if best is None or t < best[1]:
            best = (backend.name.lower(), t)
    return best


def markdown(rows, gemm_rate, refusals, commit, torch, h=H, smoke=False) -> str:
    import triton
    where = "CPU smoke (Triton interpreter: the times mean nothing)" if smoke else torch.cuda.get_device_name()
    n_gemm = 256 if smoke else 8192
    lines = [f"# MLA prefill attention, {where} (H {h}, D {D}, Dv {DV}, bf16)", "",
             f"commit {commit}; torch {torch.__version__}, triton {triton.__version__}; bf16 GEMM "
             f"{gemm_rate / 1e12:.2g} TFLOP/s ({n_gemm}³, measured in this run)", "",
             "| case | implementation | ms | TFLOP/s | / GEMM rate | vs in-place | vs SDPA | rel err |",
             "|---|---|---|---|---|---|---|---|"]
    for case in dict.fromkeys(r["case"] for r in rows):
        sel = [r for r in rows if r["case"] == case]
        tri = [r for r in sel if r["impl"].startswith("triton")]
        best = min(tri, key=lambda r: r["ms"]) if tri else None
        for r in sel:
            sp = lambda key: f"{r[key]:.1f}x" if r.get(key) else "-"  # noqa: E731
            mark = " (best)" if r is best and len(tri) > 1 else ""
            if "_tma" in r["impl"] and not r.get("tma"):
                mark += " (pointer path: TMA not allowed here)"
            err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
            lines.append(f"| {case} | {r['impl']}{mark} | {r['ms']:.2f} | {r['tflops']:.0f} | {r['gemm_frac']:.2f} | "
                         f"{sp('speedup_vs_inplace')} | {sp('speedup_vs_sdpa')} | {err} |")
    skipped = sorted({r["case"] for r in rows} - {r["case"] for r in rows if r["impl"].startswith("inplace")})
    if skipped:
        lines += ["", f"In-place baseline not run (over {BASELINE_LIMIT_BYTES / 1e9:.0f} GB, or skipped): "
                  + ", ".join(skipped)]
    for case, why in refusals.items():
        lines += ["", f"SDPA backends, {case}: " + (why if isinstance(why, str) else "; ".join(
            f"{b} {m if m.startswith('ran') else 'refused (' + m + ')'}" for b, m in why.items()))]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
