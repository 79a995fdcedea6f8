"""Benchmark 1 of issue 10: the Triton paged MLA decode/verify kernel (``attention/triton_mla_decode.py``),
bf16 and fp8 latent caches, batch {1, 16, 64} x context {4K, 32K, 128K} x query length {1, 8}, 16 heads
(DeepSeek-V3's 128 / TP 8), rows 512 + 64, block size 16 (the engine's default).

    python benchmarks/mla_decode.py --out DIR            # GPU
    python benchmarks/mla_decode.py --out DIR --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes

Per case: time (median of CUDA-event timings of a CUDA-graph replay, L2 flushed before each
repetition), bytes moved (the fewest: every cache row of every request once, q, out, lse, block-table
entries; the kernel's own fp32 split partials are NOT counted), achieved GB/s and its fraction of the
copy bandwidth measured in the same run (``dst.copy_(src)``, 1 GiB, read + write), FLOPs and the
roofline fraction ``max(bytes / copy_bw, flops / gemm_rate) / time`` with the bf16 GEMM rate measured
in the same run (8192^3 ``torch.matmul``). Goal (issue): bandwidth fraction >= 0.90 at long context.
Order: kernel == reference (fp32 PyTorch op) at GPU shapes; a sweep of the candidate configs
(``candidate_configs``: tile shapes, swap-AB tiles, fp16 dots and register prefetch for fp8) at
B = 16, 32K, each checked against the reference first; the fastest correct candidate per (cache,
q_len) is "chosen" and runs the main table (it is the proposed default); a split-count sweep, 128 heads
and block size 64 with the chosen configs.
Writes DIR/mla_decode.json and DIR/mla_decode.md; prints the table last. Stops adding rows after
``--budget-s`` seconds (the rest is marked skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="directory for mla_decode.json / .md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through TRITON_INTERPRET=1")
    ap.add_argument("--heads", type=int, default=16, help="query heads (GPU; --smoke uses 2)")
    ap.add_argument("--kv-lora-rank", type=int, default=512, help="value width (512: DeepSeek/Kimi; 64: the default model; --smoke uses 64)")
    ap.add_argument("--rope", type=int, default=64, help="rope width of a cache row (64; 16: the default model; --smoke uses 16)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64],
                    help="batch sizes of the main table (GPU; --smoke uses 1 2)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072],
                    help="context lengths of the main table (GPU; --smoke uses 40 100)")
    ap.add_argument("--budget-s", type=float, default=125.0, help="stop adding rows after this many seconds")
    ap.add_argument("--short-splits-only", action="store_true",
                    help="only the batch-1 short-context split-count sweep (and the checks)")
    ap.add_argument("--only", nargs="+", default=None, metavar="CACHE:QLEN",
                    help="sweep and main table only for these (cache, q_len) pairs, e.g. fp8:1; no extras")
    ap.add_argument("--breakdown", action="store_true",
                    help="main-table rows also get each kernel's device time (torch profiler, L2 flushed)")
    return ap.parse_args(argv)


ARGS = parse_args()
import torch  # noqa: E402  (does not import triton)

if ARGS.smoke or not torch.cuda.is_available():
    ARGS.smoke = True
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

sys.path.insert(0, REPO)
from longflash.attention import ops  # noqa: E402
from longflash.attention import triton_mla_decode as tk  # noqa: E402

FP8 = torch.float8_e4m3fn
T0 = time.perf_counter()
DEV = torch.device("cuda" if torch.cuda.is_available() and not ARGS.smoke else "cpu")
CUDA = DEV.type == "cuda"
if CUDA:
    R, P, H, BS = ARGS.kv_lora_rank, ARGS.rope, ARGS.heads, 16
    BATCHES, CONTEXTS, QLENS = ARGS.batches, ARGS.contexts, [1, 8]
else:  # smoke: same code path, tiny
    R, P, H, BS = 64, 16, 2, 4
    BATCHES, CONTEXTS, QLENS = [1, 2], [40, 100], [1, 4]
W = R + P
SCALE = (192 ** -0.5)  # DeepSeek-V3: 1 / sqrt(qk_nope + qk_rope)
K_SCALE = 0.0625
RESULT: dict = {"rows": [], "sweep": [], "splits": [], "short_splits": [], "checks": [], "extra": []}


def out_path(name: str) -> str:
    os.makedirs(ARGS.out, exist_ok=True)
    return os.path.join(ARGS.out, name)


def save() -> None:
    with open(out_path("mla_decode.json"), "w") as f:
        json.dump(RESULT, f, indent=1)


def wanted(dtype: str, q_len: int) -> bool:
    """Whether ``--only`` (if given) names this (cache, q_len) pair."""
    return ARGS.only is None or f"{dtype}:{q_len}" in ARGS.only


def over_budget() -> bool:
    return time.perf_counter() - T0 > ARGS.budget_s


class Timer:
    """Median seconds of one call: a CUDA-graph replay timed with events, L2 flushed before each
    repetition (GPU); wall clock of an eager call (CPU smoke)."""

    def __init__(self):
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEV) if CUDA else None

    def __call__(self, fn, graph: bool = True, target_s: float = 0.12) -> float:
        if not CUDA:
            fn()
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        run = fn
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # compile + warm up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = None
        if graph:
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                run = g.replay
            except Exception as e:  # noqa: BLE001  (time eagerly, and say so)
                print(f"graph capture failed ({e!r:.200}); timing eagerly", flush=True)
                RESULT.setdefault("eager_fallbacks", []).append(repr(e)[:300])
                g, run = None, fn
        run()
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        est = time.perf_counter() - t
        reps = int(min(50, max(5, target_s / max(est, 1e-6))))
        times = []
        for _ in range(reps):
            self.flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        del g
        return statistics.median(times)


TIMER = Timer()


def ceilings() -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 GEMM rate, measured now."""
    n = (1 << 30) if CUDA else (1 << 22)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    t_copy = TIMER(lambda: dst.copy_(src), graph=False)
    m = 8192 if CUDA else 256
    a = torch.randn(m, m, device=DEV).to(torch.bfloat16 if CUDA else torch.float32)
    b = torch.randn(m, m, device=DEV).to(a.dtype)
    t_mm = TIMER(lambda: a @ b, graph=False)
    del src, dst, a, b
    return {"copy_bytes": 2 * n, "copy_s": t_copy, "copy_bw": 2 * n / t_copy, "gemm_n": m, "gemm_s": t_mm,
            "gemm_rate": 2 * m ** 3 / t_mm}


def build_caches(total_rows: int) -> dict:
    """bf16 cache of N(0,1) rows and its fp8 copy (stored = sat(x / K_SCALE)), filled in chunks."""
    nb = -(-total_rows // BS)
    bf = torch.empty(nb, BS, W, dtype=torch.bfloat16, device=DEV)
    f8 = torch.empty(nb, BS, W, dtype=FP8, device=DEV)
    flat, flat8 = bf.view(-1, W), f8.view(-1, W)
    g = torch.Generator(device=DEV).manual_seed(0)
    step = 1 << 20
    for s in range(0, flat.shape[0], step):
        x = torch.randn(min(step, flat.shape[0] - s), W, device=DEV, generator=g)
        flat[s:s + x.shape[0]] = x.to(flat.dtype)
        flat8[s:s + x.shape[0]] = ops.quantize_to_cache(x, FP8, K_SCALE)
    perm = torch.randperm(nb, device=DEV, generator=g).to(torch.int32)
    return {"bf16": bf, "fp8": f8, "perm": perm}


def make_case(caches: dict, dtype: str, B: int, L: int, ql: int, heads: int = H, bs: int = BS, seed: int = 0):
    """Inputs of one call: random queries, B requests of L rows each over random physical blocks."""
    cache = caches[dtype]
    if bs != BS:  # the same memory seen as blocks of bs rows
        flat = cache.view(-1)
        cache = flat[:flat.numel() // (bs * W) * bs * W].view(-1, bs, W)
    nblk = -(-L // bs)
    perm = caches["perm"] if bs == BS else torch.randperm(cache.shape[0], device=DEV).to(torch.int32)
    bt = perm[:B * nblk].view(B, nblk).contiguous()
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = (torch.randn(B * ql, heads, W, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=DEV) * ql
    seq = torch.full((B,), L, dtype=torch.int32, device=DEV)
    ks = K_SCALE if dtype == "fp8" else None
    return q, cache, bt, qsl, seq, ks


def call(q, cache, bt, qsl, seq, ks, ql, L, cfg=None, S=None):
    return tk.mla_decode_attention(q, cache, bt, qsl, seq, SCALE, R, ks, max_query_len=ql, max_seq_len=L,
                                   num_splits=S, config=cfg)


def kernel_times(fn, reps: int = 5) -> dict:
    """{kernel name: mean device µs per call} of ``fn`` (eager calls under the torch profiler, L2 flushed
    before each; the flush itself is left out): where a call's time goes besides stage 1."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            TIMER.flush.zero_()
            fn()
        torch.cuda.synchronize()
    out: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "elementwise" not in e.name and "fill" not in e.name:
            out[e.name[:60]] = out.get(e.name[:60], 0.0) + e.device_time_total / reps
    return out


def measure(caches, ceil, dtype, B, L, ql, heads=H, bs=BS, cfg=None, S=None, breakdown=False) -> dict:
    q, cache, bt, qsl, seq, ks = make_case(caches, dtype, B, L, ql, heads, bs)
    t = TIMER(lambda: call(q, cache, bt, qsl, seq, ks, ql, L, cfg, S))
    kernels = kernel_times(lambda: call(q, cache, bt, qsl, seq, ks, ql, L, cfg, S)) if breakdown and CUDA else None
    nbytes, flops = tk.decode_bytes_and_flops([ql] * B, [L] * B, heads, W, R, cache.element_size(),
                                              q.element_size(), bs)
    floor = max(nbytes / ceil["copy_bw"], flops / ceil["gemm_rate"])
    rows = ql * heads
    used, _ = tk.resolve_config(q, cache, R, ql, cfg)  # the tile that ran (a Gluon request falls back on the CPU)
    groups = -(-rows // used["BLOCK_M"])
    splits = S or tk.choose_num_splits(B, groups, L, rows, R, W, W * cache.element_size(),
                                       tk.sm_count(DEV) * used["occupancy"])
    return {"dtype": dtype, "B": B, "ctx": L, "q_len": ql, "heads": heads, "block_size": bs, "time_us": t * 1e6,
            "bytes": nbytes, "flops": flops, "GBps": nbytes / t / 1e9, "bw_frac": nbytes / t / ceil["copy_bw"],
            "roofline_frac": floor / t, "bound": "bytes" if nbytes / ceil["copy_bw"] >= flops / ceil["gemm_rate"]
            else "flops", "splits": splits, "config": used, **({"kernels_us": kernels} if kernels else {})}


def try_measure(*args, **kw) -> dict:
    """:func:`measure`, or the error (a failing config must not stop the run)."""
    try:
        return measure(*args, **kw)
    except Exception as e:  # noqa: BLE001
        print("measure failed", args[2:], kw, repr(e)[:300], flush=True)
        return {"error": repr(e)[:500], "args": [str(a) for a in args[2:]], "kw": {k: str(v) for k, v in kw.items()}}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(caches, dtype, lens, qls, heads=H, cfg=None, S=None) -> dict:
    """Kernel (list lengths) vs the fp32 PyTorch reference; tensor lengths give the same bits."""
    B = len(lens)
    cache = caches[dtype]
    nblk = [-(-L // BS) for L in lens]
    bt = torch.zeros(B, max(nblk), dtype=torch.int32, device=DEV)
    off = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = caches["perm"][off:off + n]
        off += n
    qsl = [0]
    for n in qls:
        qsl.append(qsl[-1] + n)
    g = torch.Generator(device=DEV).manual_seed(1)
    q = (torch.randn(qsl[-1], heads, W, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
    ks = K_SCALE if dtype == "fp8" else None
    out, lse = tk.mla_decode_attention(q, cache, bt, qsl, lens, SCALE, R, ks, num_splits=S, config=cfg)
    o2, l2 = tk.mla_decode_attention(q, cache, bt, torch.tensor(qsl, dtype=torch.int32, device=DEV),
                                     torch.tensor(lens, dtype=torch.int32, device=DEV), SCALE, R, ks,
                                     max_query_len=max(qls), max_seq_len=max(lens), num_splits=S, config=cfg)
    ro, rl = ops.mla_decode_attention(q.float(), cache, bt, qsl, lens, SCALE, R, ks)
    empty = rl.isinf()
    return {"dtype": dtype, "lens": lens, "q_lens": qls, "heads": heads, "config": cfg, "splits": S,
            "rel_err": rel_err(out, ro), "lse_max_abs": (lse - rl).masked_fill(empty, 0).abs().max().item(),
            "inf_match": bool(torch.equal(lse.isinf(), empty)), "nan": bool(out.isnan().any() or lse.isnan().any()),
            "tensor_path_equal": bool(torch.equal(out, o2) and torch.equal(lse, l2)),
            "ok": None}


def finish_check(c: dict) -> dict:
    c["ok"] = c["rel_err"] <= 1e-2 and c["lse_max_abs"] <= 1e-3 and c["inf_match"] and not c["nan"] \
        and c["tensor_path_equal"]
    return c


def fmt_row(r: dict) -> str:
    c = r["config"]
    cfg = (f"{'gluon ' if c.get('GLUON') else ''}{'wgmma ' if c.get('WGMMA') else ''}"
           f"M{c['BLOCK_M']} N{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}{' vr' if c.get('V_RELOAD') else ''}"
           f"{' T' if c.get('TRANS') else ''}{' f16' if c.get('F16') else ''}{' pre' if c.get('PREFETCH') else ''}"
           f"{' cvt' if c.get('CVT_SMEM') else ''}{' r' + str(c['maxnreg']) if c.get('maxnreg') else ''}")
    return (f"| {r['dtype']} | {r['B']} | {r['ctx']} | {r['q_len']} | {r['heads']} | {r['block_size']} | "
            f"{r['time_us']:.1f} | {r['bytes'] / 1e6:.1f} | {r['GBps']:.0f} | {r['bw_frac']:.3f} | "
            f"{r['roofline_frac']:.3f} ({r['bound']}) | {r['splits']} | {cfg} |")


HEADER = ("| cache | B | ctx | q_len | heads | block | time us | MB moved | GB/s | / copy BW | roofline frac | "
          "splits | config |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def write_md() -> str:
    ceil = RESULT.get("ceilings", {})
    lines = [f"# MLA decode kernel (benchmark 1), {RESULT.get('device')}", "",
             f"commit {RESULT.get('commit')}; torch {RESULT.get('torch')}, triton {RESULT.get('triton')}", ""]
    if ceil:
        lines.append(f"copy bandwidth {ceil['copy_bw'] / 1e12:.3f} TB/s, bf16 GEMM {ceil['gemm_rate'] / 1e12:.0f} "
                     f"TFLOP/s (measured in this run)")
    lines += ["", "## Checks (kernel vs fp32 reference)", "", "| cache | lens | q_lens | heads | config | splits | "
              "rel err | lse err | ok |", "|---|---|---|---|---|---|---|---|---|"]
    for c in RESULT["checks"]:
        lines.append(f"| {c['dtype']} | {c['lens']} | {c['q_lens']} | {c['heads']} | {c['config'] or 'default'} | "
                     f"{c['splits'] or 'auto'} | {c['rel_err']:.2e} | {c['lse_max_abs']:.1e} | {c['ok']} |")
    for title, key in (("Main table (chosen config: fastest of the sweep)", "rows"), ("Tile-config sweep", "sweep"),
                       ("Split-count sweep", "splits"),
                       ("Split-count sweep at batch 1, short contexts (auto = choose_num_splits)", "short_splits"),
                       ("Extra shapes", "extra")):
        rows = [r for r in RESULT[key] if "time_us" in r]
        if rows:
            lines += ["", f"## {title}", "", HEADER] + [fmt_row(r) for r in rows]
    split = [r for r in RESULT["rows"] if r.get("kernels_us")]
    if split:
        lines += ["", "## Device time per kernel (profiler, eager calls; µs)", "",
                  "| cache | B | ctx | q_len | graph replay us | kernels |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['B']} | {r['ctx']} | {r['q_len']} | {r['time_us']:.1f} | "
                  + "; ".join(f"{k} {v:.1f}" for k, v in r["kernels_us"].items()) + " |" for r in split]
    failed = [r for r in RESULT["sweep"] if not r["check"].get("ok") or "error" in r]
    if failed:
        lines += ["", "Sweep candidates that failed (check or run): " + "; ".join(
            str(r["check"].get("config") or r.get("error")) for r in failed)]
    skipped = RESULT.get("skipped", [])
    if skipped:
        lines += ["", f"Skipped (time budget): {len(skipped)} rows"]
    md = "\n".join(lines) + "\n"
    with open(out_path("mla_decode.md"), "w") as f:
        f.write(md)
    return md


def summary() -> str:
    """A few lines for the end of the log: bandwidth fraction per batch at the longest context, the
    roofline fraction for q_len > 1, the fastest sweep config, the checks."""
    out = [f"SUMMARY mla_decode ({RESULT.get('device')}, copy {RESULT['ceilings']['copy_bw'] / 1e12:.2f} TB/s, "
           f"gemm {RESULT['ceilings']['gemm_rate'] / 1e12:.0f} TFLOP/s)"]
    rows = [r for r in RESULT["rows"] if "time_us" in r]
    for d in ("bf16", "fp8"):
        for ql in QLENS:
            sel = sorted((r for r in rows if r["dtype"] == d and r["q_len"] == ql), key=lambda r: (r["ctx"], r["B"]))
            if sel:
                out.append(f"{d} q_len {ql}: " + ", ".join(
                    f"B{r['B']}/{r['ctx'] // 1024}K {r['bw_frac']:.2f}bw {r['roofline_frac']:.2f}rf" for r in sel))
            sw = [r for r in RESULT["sweep"] if "time_us" in r and r["dtype"] == d and r["q_len"] == ql]
            if sw:
                best = min(sw, key=lambda r: r["time_us"])
                out.append(f"  sweep best {best['config']} {best['time_us']:.1f} us vs first candidate (default) "
                           f"{sw[0]['time_us']:.1f} us")
    out.append(f"checks ok: {sum(bool(c['ok']) for c in RESULT['checks'])}/{len(RESULT['checks'])}; "
               f"total {RESULT.get('total_s', 0):.0f} s")
    return "\n".join(out)


def short_split_sweep(caches, ceil) -> None:
    """Batch 1, q_len 1, contexts 256 and 4096 (the decode of short chats and of speculative verify
    at small batch), each cache dtype at the default config: the auto split count against explicit
    counts 1..64 (each split >= 32 rows). At these sizes the kernel is latency-bound: a program walks
    its split's rows tile by tile, so fewer rows per program shortens the chain while the split partials
    add traffic and a second launch."""
    for d in ("bf16", "fp8"):
        for L in ((256, 4096) if CUDA else (40,)):
            for S in (None, 1, 2, 4, 8, 16, 32, 64):
                if S is not None and S * 32 > L:
                    continue
                if over_budget():
                    RESULT.setdefault("skipped", []).append(["short_splits", d, L, S])
                    continue
                r = try_measure(caches, ceil, d, 1, L, 1, S=S)
                r["auto"] = S is None
                RESULT["short_splits"].append(r)
                if "time_us" in r:
                    print(fmt_row(r) + (" (auto)" if S is None else ""), flush=True)
    save()


def main() -> None:
    commit = provenance.commit(short=True)
    import triton
    RESULT.update(commit=commit, torch=torch.__version__, triton=triton.__version__,
                  device=torch.cuda.get_device_name() if CUDA else f"CPU interpreter ({platform.machine()})",
                  shapes=dict(R=R, P=P, heads=H, block_size=BS, k_scale=K_SCALE, scale=SCALE))
    ceil = ceilings()
    RESULT["ceilings"] = ceil
    print(f"copy {ceil['copy_bw'] / 1e12:.3f} TB/s, gemm {ceil['gemm_rate'] / 1e12:.1f} TFLOP/s", flush=True)
    caches = build_caches(max(BATCHES) * max(CONTEXTS) + 64 * BS)
    print(f"caches built at {time.perf_counter() - T0:.1f}s", flush=True)
    # 1. correctness at GPU shapes (list and tensor lengths, odd lengths, 0-length, causal verify)
    small, big = CONTEXTS[0], CONTEXTS[1]
    for dtype in ("bf16", "fp8"):
        for lens, qls in (([small + 7, big, 1, 0], [1, 1, 1, 1]), ([small + 7, big, 3], [8, 16, 4])):
            RESULT["checks"].append(finish_check(check(caches, dtype, lens, qls)))
            print("check", RESULT["checks"][-1], flush=True)
    save()
    if ARGS.short_splits_only:
        short_split_sweep(caches, ceil)
        RESULT["total_s"] = time.perf_counter() - T0
        save()
        print(write_md())
        return
    # 2. tile-config sweep at B=16, 32K (each candidate checked against the reference first); the fastest
    #    correct candidate of each (cache, q_len) runs the main table and is the proposed default
    Bs, Ls = BATCHES[1], CONTEXTS[1]
    RESULT["skipped"] = []
    chosen: dict = {}
    for ql in QLENS:
        for d in ("bf16", "fp8"):
            if not wanted(d, ql):
                continue
            timed = []
            for cfg in tk.candidate_configs(ql * H, FP8 if d == "fp8" else torch.bfloat16, W):
                if over_budget():
                    RESULT["skipped"].append(["sweep", d, ql, cfg])
                    continue
                try:
                    c = finish_check(check(caches, d, [small + 7, big // 2 + 3], [ql, ql], cfg=cfg, S=2))
                except Exception as e:  # noqa: BLE001  (e.g. a config that does not compile)
                    c = {"ok": False, "error": repr(e)[:500], "config": cfg}
                row = {"check": c}
                if c["ok"]:
                    row.update(try_measure(caches, ceil, d, Bs, Ls, ql, cfg=cfg))
                    if "time_us" in row:
                        print(fmt_row(row), flush=True)
                        timed.append(row)
                else:
                    print("sweep candidate FAILED check", c, flush=True)
                RESULT["sweep"].append(row)
                save()
            if timed:
                chosen[(d, ql)] = min(timed, key=lambda r: r["time_us"])["config"]
    RESULT["chosen"] = {f"{d} q_len {ql}": c for (d, ql), c in chosen.items()}
    # 3. the main table with the chosen configs, q_len 1 first (the bandwidth goal), then q_len 8
    plan = [(d, B, L, ql) for ql in QLENS for d in ("bf16", "fp8") for B in BATCHES for L in CONTEXTS
            if wanted(d, ql)]
    for d, B, L, ql in plan:
        if over_budget():
            RESULT["skipped"].append([d, B, L, ql])
            continue
        r = try_measure(caches, ceil, d, B, L, ql, cfg=chosen.get((d, ql)), breakdown=ARGS.breakdown)
        RESULT["rows"].append(r)
        if "time_us" in r:
            print(fmt_row(r), flush=True)
        save()
    if ARGS.only:
        RESULT["total_s"] = time.perf_counter() - T0
        save()
        print(write_md())
        return
    # 4. split count at B=1, 128K, q_len 1; 5. extras: 128 heads, block size 64
    for d in ("bf16", "fp8"):
        for S in ((None, 32, 66, 132, 264) if CUDA else (None, 4)):
            if over_budget():
                RESULT["skipped"].append(["splits", d, S])
                continue
            RESULT["splits"].append(try_measure(caches, ceil, d, BATCHES[0], CONTEXTS[-1], 1,
                                                cfg=chosen.get((d, 1)), S=S))
            if "time_us" in RESULT["splits"][-1]:
                print(fmt_row(RESULT["splits"][-1]), flush=True)
    for kw in (dict(dtype="bf16", heads=128 if CUDA else 4, ql=1), dict(dtype="fp8", heads=128 if CUDA else 4, ql=1),
               dict(dtype="bf16", heads=H, ql=1, bs=64 if CUDA else 8)):
        if over_budget():
            RESULT["skipped"].append(["extra", kw])
            continue
        rows_class = QLENS[-1] if kw["heads"] * kw["ql"] > 32 else 1  # the chosen config of its row count
        r = try_measure(caches, ceil, kw["dtype"], BATCHES[1], CONTEXTS[1], kw["ql"], heads=kw["heads"],
                        bs=kw.get("bs", BS), cfg=chosen.get((kw["dtype"], rows_class)))
        RESULT["extra"].append(r)
        if "time_us" in r:
            print(fmt_row(r), flush=True)
    short_split_sweep(caches, ceil)
    if CUDA:
        c = finish_check(check(caches, "bf16", [big, 5], [1, 2], heads=128))
        RESULT["checks"].append(c)
    RESULT["total_s"] = time.perf_counter() - T0
    save()
    print(write_md())
    print(summary())
    bad = [c for c in RESULT["checks"] if not c["ok"]]
    if bad:
        print("FAILED checks:", bad)
        sys.exit(1)


if __name__ == "__main__":
    main()
