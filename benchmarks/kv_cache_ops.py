"""Achieved bandwidth of the paged KV cache kernels (issue 5): MLA cache write
(``concat_and_cache_mla``, bf16 and fp8 caches) and ``gather_and_maybe_dequant_cache`` (fp8 and bf16
caches into a bf16 workspace), as a fraction of the copy bandwidth measured in the same run.

    python benchmarks/kv_cache_ops.py --out DIR            # GPU: 64K and 256K rows x 576, block 64
    python benchmarks/kv_cache_ops.py --out DIR --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes

Writes DIR/kv_cache_ops.json and DIR/kv_cache_ops.md.

Bytes per op (the minimum traffic, each byte read or written once; benchmarks/NOTES.md):
  write  = T·W·2 (bf16 kv_c + k_pe read) + T·W·e (cache rows written, e = 2 bf16 / 1 fp8) + T·8 (int64
           slot_mapping);
  gather = T·W·e (cache rows read) + T·W·2 (bf16 workspace written) + T·4 (int32 token_to_seq)
           + (requests + 1)·4 (cu_seq_lens) + 4 per block-table entry used.
Every candidate tile (rows per program, warps, eviction policy of the streaming loads) of each kernel
is checked byte-equal to the PyTorch reference at the benchmarked shape and timed two ways, each
against a copy timed the same way:
  * "event": CUDA events around one launch, L2 flushed before each of --reps launches, median (the
    first run's method; added after the run of 77f87ea: a GPU spin before the start event keeps the host's launch
    time out of the interval); ceiling = 1 GiB ``copy_``, same method;
  * "graph": --sets launches over distinct buffer sets (each set larger than L2) captured in one CUDA
    graph, median replay time / sets (back to back, as in a forward pass); ceiling = 1 GiB copies,
    same method.
Each row also gives the fraction of a same-size copy (same method): at 64K rows a copy of the same bytes
itself reaches only ~0.81-0.91 of the 1 GiB copy (fixed cost per launch), so that column is the kernel's
distance from what its size allows. The fp8 write uses k_scale 0.05
(the FMA-corrected division); extra rows time IEEE division (``scale_mode=2``) and k_scale 1.0 (a
power of two: one multiply) at the default tile. Goal: achieved / copy >= 0.85.
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="directory for kv_cache_ops.json / .md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through TRITON_INTERPRET=1")
    ap.add_argument("--rows", type=int, nargs="+", default=[65536, 262144])
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--k-scale", type=float, default=0.05)
    ap.add_argument("--reps", type=int, default=30, help="event timing: launches (median)")
    ap.add_argument("--sets", type=int, default=3, help="graph timing: buffer sets per graph")
    ap.add_argument("--replays", type=int, default=15, help="graph timing: replays (median)")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch  # noqa: E402

sys.path.insert(0, REPO)
from longflash.attention import ops  # noqa: E402
from longflash.attention import triton_ops as tk  # noqa: E402

FP8 = torch.float8_e4m3fn
# (rows per program, num_warps, eviction policy of the streaming loads)
CANDIDATES = [(4, 4, ""), (8, 4, ""), (16, 4, ""), (16, 8, ""), (32, 8, ""), (8, 4, "evict_first")]
SMOKE_CANDIDATES = [(4, 4, ""), (16, 4, "evict_first")]


class Timer:
    def __init__(self, dev, reps, sets, replays):
        self.dev, self.reps, self.sets, self.replays = dev, reps, sets, replays
        self.cuda = dev.type == "cuda"
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev) if self.cuda else None

    def event(self, fn) -> float:
        """Median seconds of fn(), L2 flushed before each launch (CPU: one wall-clock run)."""
        fn()
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            # NOTE: a ~0.2 ms GPU spin before the start event lets the host enqueue fn's launch first, so
            # the event pair times the kernel, not the Python launch path (at 64K rows a kernel is ~40 µs,
            # about as long as its host-side launch; the first H200 run's 64K event times varied 0.49-0.80
            # of copy across tiles whose back-to-back graph times agreed within 2%)
            torch.cuda._sleep(400_000)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    def graph(self, fns) -> float | None:
        """Seconds per call of ``fns`` (one per buffer set) launched back to back in one CUDA graph:
        median over replays of replay time / len(fns). None on the CPU."""
        if not self.cuda:
            return None
        for f in fns:
            f()
        torch.cuda.synchronize()
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(st)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / len(fns))
        del g
        return statistics.median(times)


def copy_bw(timer, nbytes, dev, sets) -> dict:
    """Copy bandwidth (read + write bytes / time) of ``nbytes`` moved (nbytes / 2 copied, rounded down to
    16 bytes: the first H200 run's gather-sized copies were not, and ran at ~2.6 instead of ~3.6 TB/s in
    the graph), both methods."""
    srcs = [torch.empty(nbytes // 2 // 16 * 16, dtype=torch.uint8, device=dev).random_(0, 255) for _ in range(sets)]
    dsts = [torch.empty_like(s) for s in srcs]
    moved = 2 * srcs[0].numel()
    ev = timer.event(lambda: dsts[0].copy_(srcs[0]))
    gr = timer.graph([lambda a=a, b=b: b.copy_(a) for a, b in zip(srcs, dsts)])
    return {"bytes": moved, "event_GBps": moved / ev / 1e9, "graph_GBps": (moved / gr / 1e9) if gr else None}


def layout(T, bs, num_reqs, dev, seed=0):
    """Random physical blocks: slots of T tokens (request r holds tokens [r*per, ...)), its block table,
    cu_seq_lens and token_to_seq; returns the number of block-table entries used too."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nblk = -(-T // bs)
    perm = torch.randperm(nblk + 8, generator=g)
    slots = (perm[torch.arange(T) // bs] * bs + torch.arange(T) % bs).to(dev)
    per = -(-T // num_reqs // bs) * bs  # whole blocks per request
    lens = [max(0, min(per, T - i * per)) for i in range(num_reqs)]
    table = torch.zeros((num_reqs, per // bs), dtype=torch.int32)
    used = 0
    for r in range(num_reqs):
        k = -(-lens[r] // bs)
        used += k
        table[r, :k] = perm[r * per // bs:r * per // bs + k].to(torch.int32)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t2s = torch.repeat_interleave(torch.arange(num_reqs, dtype=torch.int32), torch.tensor(lens))
    return slots, table.to(dev), cu.to(dev), t2s.to(dev), nblk + 8, used


def _entry(op, cache_dtype, T, W, nbytes, cand, equal, t_ev, t_gr, ceilings, same, extra=None):
    bt_, nw, ev = cand
    r = dict(op=op, cache_dtype=str(cache_dtype).replace("torch.", ""), rows=T, width=W, bytes=nbytes,
             block_t=bt_, num_warps=nw, evict=ev or "default", equal_to_reference=equal,
             event_s=t_ev, event_GBps=nbytes / t_ev / 1e9, event_frac_of_copy=nbytes / t_ev / 1e9 / ceilings["event_GBps"],
             event_frac_of_same_size_copy=nbytes / t_ev / 1e9 / same["event_GBps"])
    if t_gr:
        r.update(graph_s=t_gr, graph_GBps=nbytes / t_gr / 1e9, graph_frac_of_copy=nbytes / t_gr / 1e9 / ceilings["graph_GBps"],
                 graph_frac_of_same_size_copy=nbytes / t_gr / 1e9 / same["graph_GBps"],
                 graph_frac_of_event_copy=nbytes / t_gr / 1e9 / ceilings["event_GBps"])
    r.update(extra or {})
    return r


def bench_rows(T, args, dev, timer, ceilings, out):
    R, P, bs = args.kv_lora_rank, args.rope_dim, args.block_size
    Wd = R + P
    cands = SMOKE_CANDIDATES if args.smoke else CANDIDATES
    sets = 1 if dev.type == "cpu" else args.sets
    g = torch.Generator(device=dev).manual_seed(T)
    kvs = [(torch.randn(T, R, generator=g, device=dev) * 3).to(torch.bfloat16) for _ in range(sets)]
    pes = [(torch.randn(T, P, generator=g, device=dev) * 3).to(torch.bfloat16) for _ in range(sets)]
    slots, table, cu, t2s, nb, used = layout(T, bs, 16, dev)
    for cache_dtype in (torch.bfloat16, FP8):
        esz = 1 if cache_dtype == FP8 else 2
        ks = args.k_scale if cache_dtype == FP8 else None
        # --- write
        nbytes = T * Wd * 2 + T * Wd * esz + T * 8
        same = copy_bw(timer, nbytes, dev, sets)
        ref = torch.zeros(nb, bs, Wd, dtype=cache_dtype, device=dev)
        ops.concat_and_cache_mla(kvs[0], pes[0], ref, slots, ks)
        caches = [torch.zeros_like(ref) for _ in range(sets)]
        t_ref = timer.event(lambda: ops.concat_and_cache_mla(kvs[0], pes[0], caches[0], slots, ks))
        variants = [(c, {}, {}) for c in cands]
        if cache_dtype == FP8 and not args.smoke:
            d = tk.kv_config("write", FP8)
            variants += [(d, {"scale_mode": 2}, {"division": "div.rn (scale_mode 2)"}),
                         (d, {"k_scale": 1.0}, {"division": "k_scale 1.0 (multiply)"})]
        for cand, kw, extra in variants:
            k_s = kw.get("k_scale", ks)
            mode = {k: v for k, v in kw.items() if k == "scale_mode"}
            fn = [lambda i=i: tk.concat_and_cache_mla(kvs[i], pes[i], caches[i], slots, k_s, block_t=cand[0],
                                                      num_warps=cand[1], evict=cand[2], **mode) for i in range(sets)]
            caches[0].zero_()
            fn[0]()
            want = ref
            if "k_scale" in kw:
                want = torch.zeros_like(ref)
                ops.concat_and_cache_mla(kvs[0], pes[0], want, slots, k_s)
            equal = bool(torch.equal(want.view(torch.uint8), caches[0].view(torch.uint8)))
            t_ev, t_gr = timer.event(fn[0]), timer.graph(fn)
            extra = dict(extra, reference_s=t_ref, speedup_vs_reference=t_ref / t_ev)
            out.append(_entry("concat_and_cache_mla", cache_dtype, T, Wd, nbytes, cand, equal, t_ev, t_gr, ceilings,
                              same, extra))
        # --- gather + dequant into a bf16 workspace (from the caches written above)
        nbytes = T * Wd * esz + T * Wd * 2 + T * 4 + cu.numel() * 4 + used * 4
        same = copy_bw(timer, nbytes, dev, sets)
        r = ops.gather_and_maybe_dequant_cache(ref, table, cu, None, torch.bfloat16, ks)
        t_ref = timer.event(lambda: ops.gather_and_maybe_dequant_cache(ref, table, cu, None, torch.bfloat16, ks, t2s))
        for cand in cands:
            fn = [lambda i=i: tk.gather_and_maybe_dequant_cache(caches[i], table, cu, None, torch.bfloat16, ks, t2s,
                                                                total=T, block_t=cand[0], num_warps=cand[1],
                                                                evict=cand[2]) for i in range(sets)]
            # NOTE: the output comes from the caching allocator, whose free block of this size may hold an
            # earlier candidate's (correct) result: poison it first so rows the kernel skips show up
            torch.empty(T, Wd, dtype=torch.bfloat16, device=dev).view(torch.int16).fill_(-1)
            k = tk.gather_and_maybe_dequant_cache(ref, table, cu, None, torch.bfloat16, ks, t2s, total=T,
                                                  block_t=cand[0], num_warps=cand[1], evict=cand[2])
            if dev.type == "cpu":  # the interpreter's fp32->bf16 cast is not RNE (one ulp allowed)
                equal = bool(torch.allclose(r.float(), k.float(), rtol=2 ** -7, atol=0))
            else:
                equal = bool(torch.equal(r.view(torch.int16), k.view(torch.int16)))
            t_ev, t_gr = timer.event(fn[0]), timer.graph(fn)
            out.append(_entry("gather_and_maybe_dequant_cache", cache_dtype, T, Wd, nbytes, cand, equal, t_ev, t_gr,
                              ceilings, same, dict(reference_s=t_ref, speedup_vs_reference=t_ref / t_ev)))
        del caches


def best_rows(results):
    """Per (op, cache dtype, rows): the candidate with the highest graph (else event) bandwidth, among
    the default-division rows."""
    best = {}
    for r in results:
        if "division" in r:
            continue
        key = (r["op"], r["cache_dtype"], r["rows"])
        score = r.get("graph_GBps") or r["event_GBps"]
        if key not in best or score > (best[key].get("graph_GBps") or best[key]["event_GBps"]):
            best[key] = r
    return list(best.values())


def main():
    args = ARGS
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    rows = [256] if args.smoke else args.rows
    timer = Timer(dev, args.reps, args.sets, args.replays)
    t0 = time.time()
    ceilings = copy_bw(timer, (1 << 30) if dev.type == "cuda" else (1 << 22), dev, 1 if dev.type == "cpu" else 2)
    commit = provenance.commit()
    import triton
    res = dict(benchmark="kv_cache_ops", commit=commit or "unknown",
               device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
               command="python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
               torch=torch.__version__, triton=triton.__version__, smoke=args.smoke,
               interpreter=os.environ.get("TRITON_INTERPRET") == "1", k_scale=args.k_scale,
               copy_1GiB=ceilings, kv_configs={f"{k[0]},{k[1]}B": v for k, v in tk.KV_CONFIGS.items()},
               goal_frac_of_copy=0.85, results=[])
    os.makedirs(args.out, exist_ok=True)
    for T in rows:
        bench_rows(T, args, dev, timer, ceilings, res["results"])
    res["best"] = best_rows(res["results"])
    res["wall_s"] = time.time() - t0
    with open(os.path.join(args.out, "kv_cache_ops.json"), "w") as f:
        json.dump(res, f, indent=2)
    gcopy = ceilings["graph_GBps"]
    lines = [f"# KV cache kernels: achieved bandwidth ({res['device']})", "",
             f"commit `{res['commit']}`, `{res['command']}`, torch {res['torch']}, triton {res['triton']}"
             + (" — SMOKE RUN (CPU interpreter; times are meaningless)" if args.smoke else ""), "",
             f"copy bandwidth (1 GiB `copy_`, read + write): event {ceilings['event_GBps']:.0f} GB/s"
             + (f", graph {gcopy:.0f} GB/s" if gcopy else "") + f"; fp8 k_scale {args.k_scale}; "
             f"default tiles {res['kv_configs']}; wall {res['wall_s']:.0f} s", "",
             "All candidates (rows/program, warps, eviction policy); fractions of the 1 GiB copy timed the same "
             "way, of a same-size copy, and (graph) of the event-timed 1 GiB copy (a `copy_` captured in a graph is a "
             "memcpy node, which ran slower than the kernels in the first H200 run, so graph / copy exceeded 1):", "",
             "| op | cache | rows | tile | variant | event µs | event / copy | graph µs | graph GB/s | graph / copy "
             "| graph / same-size | graph / event copy | equal ref |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(r, k, fmt):
        return format(r[k], fmt) if r.get(k) is not None else "-"

    for r in res["results"]:
        lines.append(f"| {r['op']} | {r['cache_dtype']} | {r['rows']} | {r['block_t']}/{r['num_warps']}/{r['evict']} | "
                     f"{r.get('division', '')} | {r['event_s'] * 1e6:.1f} | {r['event_frac_of_copy']:.3f} | "
                     f"{format(r['graph_s'] * 1e6, '.1f') if r.get('graph_s') else '-'} | "
                     f"{f(r, 'graph_GBps', '.0f')} | {f(r, 'graph_frac_of_copy', '.3f')} | "
                     f"{f(r, 'graph_frac_of_same_size_copy', '.3f')} | {f(r, 'graph_frac_of_event_copy', '.3f')} | "
                     f"{r['equal_to_reference']} |")
    lines += ["", "Best tile per kernel (goal: / copy >= 0.85):", "",
              "| op | cache | rows x width | bytes | best tile | event / copy | graph / copy | graph / same-size copy "
              "| graph / event copy | event / same-size copy | vs torch ref | equal ref |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["best"]:
        lines.append(f"| {r['op']} | {r['cache_dtype']} | {r['rows']} x {r['width']} | {r['bytes']:,} | "
                     f"{r['block_t']}/{r['num_warps']}/{r['evict']} | {r['event_frac_of_copy']:.3f} | "
                     f"{f(r, 'graph_frac_of_copy', '.3f')} | {f(r, 'graph_frac_of_same_size_copy', '.3f')} | "
                     f"{f(r, 'graph_frac_of_event_copy', '.3f')} | {r['event_frac_of_same_size_copy']:.3f} | "
                     f"{r['speedup_vs_reference']:.1f}x | {r['equal_to_reference']} |")
    with open(os.path.join(args.out, "kv_cache_ops.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    bad = [r for r in res["results"] if not r["equal_to_reference"]]
    if bad:
        print(f"ERROR: {len(bad)} kernel results differ from the reference", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
