"""The DFlash drafter's block attention: Triton kernel vs the PyTorch padded path (issues #8, #10).

    python3 benchmarks/dflash_attention.py --out DIR      # GPU: the shipped drafter's shapes, <= 60 s
    python3 benchmarks/dflash_attention.py --out DIR      # no GPU: tiny shapes under TRITON_INTERPRET=1

Writes DIR/dflash_attention.json and DIR/dflash_attention.md (JSON rewritten after every section):
  * ceilings measured in this run: copy bandwidth (1 GiB ``copy_``, read + write bytes) and a bf16
    GEMM rate (8192^3), CUDA events;
  * ``attention``: µs per call of ``dflash_block_attention`` (shipped drafter: 4 heads, 2 kv heads,
    hd 64, Bk 8, bf16 pool of 16-row blocks) at batch 1 and 16, contexts 256 / 1024 / 4096, both
    paths captured in a CUDA graph with the graph's host bound (capacity 4096, as the draft graph);
    each graph holds ``--calls`` calls over distinct pools (one per drafter layer, as in the forward;
    at batch 1 they fit in L2, at batch 16 not), so µs per call = replay time / calls. Columns: the
    torch path (the reference: the context gathered padded up to the bound), the kernel, the
    speedup, the kernel's real-context K/V bytes per µs as a fraction of the copy bandwidth, and the
    max |kernel − reference| (bf16);
  * ``drafter``: the shipped drafter's whole padded block forward (5 layers, as the draft graph
    runs it, without the LM head) before (torch attention path) and after (kernel): µs per replay
    of one CUDA graph captured at the capacity bound and replayed with each context length,
    kernels per forward (``torch.profiler``, CUDA kernel events of one eager call and of one graph
    replay), and max |after − before| of the hidden states ("before" also has the rotary table
    computed once per forward, so the difference is the attention alone);
  * ``split_sweep`` (last; cut at ``--budget-s``): the kernel at the largest context with forced
    rows per split (the default's choice flagged), to check :func:`choose_split_rows`.
On the CPU (no CUDA): tiny shapes, no graphs, wall-clock µs (meaningless as speed; the run checks
that the code paths work), no kernel counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():  # the kernel runs in Triton's interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from longflash.spec_decode import dflash_attention as da  # noqa: E402
from longflash.spec_decode import dflash_attention_triton as tk  # noqa: E402
from longflash.spec_decode import dflash_model  # noqa: E402
from longflash.ops.triton_env import sm_count  # noqa: E402
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)

NH, KVH, HD, BK, BLOCK = 4, 2, 64, 8, 16  # the shipped drafter; the engine's pool block size


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--capacity", type=int, default=4096, help="host bound (the draft graph's max_model_len)")
    ap.add_argument("--calls", type=int, default=5, help="attention calls per captured graph (distinct pools)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=55.0, help="sections that would start later are skipped")
    return ap.parse_args(argv)


class Timer:
    """µs per call of ``fn``: on CUDA, ``fn`` captured in a graph (after a warm-up on a side stream) and
    replayed back to back between two events (mean over replays); on the CPU, wall clock."""

    def __init__(self, cuda: bool, replays: int):
        self.cuda, self.replays = cuda, replays

    def capture(self, fn):
        if not self.cuda:
            return fn
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    def time_us(self, replay) -> float:
        replay()
        if not self.cuda:
            t = time.perf_counter()
            replay()
            return (time.perf_counter() - t) * 1e6
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(self.replays):
            replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3 / self.replays


def ceilings(dev) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 GEMM FLOP/s, CUDA events (best of 5)."""
    if dev.type != "cuda":
        return {"copy_TBps": None, "gemm_TFLOPs": None}

    def best(fn, n=5):
        fn()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(n):
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3)
        return min(ts)

    def copy_s():
        x = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)  # 1 GiB
        y = torch.empty_like(x)
        return best(lambda: y.copy_(x))

    def gemm_s():
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        return best(lambda: a @ b)
    c, g = copy_s(), gemm_s()
    torch.cuda.empty_cache()
    return {"copy_TBps": round(2 * (1 << 30) / c / 1e12, 3), "gemm_TFLOPs": round(2 * 8192 ** 3 / g / 1e12, 1)}


def make_inputs(R, cap, n_pools, dev, seed=0):
    """q/k_blk/v_blk [R·Bk, ...] bf16, ``n_pools`` pools [2, R·cap/16 + 1, 16, kvh, hd] bf16, a random
    block table covering ``cap`` positions per request, context_lens buffer (int32, filled later)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    mb = cap // BLOCK
    nb = R * mb + 1
    pools = [torch.randn(2, nb, BLOCK, KVH, HD, generator=g, device=dev).to(torch.bfloat16) for _ in range(n_pools)]
    bt = torch.randperm(nb, generator=g, device=dev)[:R * mb].view(R, mb).to(torch.int32)
    q = torch.randn(R * BK, NH, HD, generator=g, device=dev).to(torch.bfloat16)
    kb = torch.randn(R * BK, KVH, HD, generator=g, device=dev).to(torch.bfloat16)
    vb = torch.randn(R * BK, KVH, HD, generator=g, device=dev).to(torch.bfloat16)
    return q, kb, vb, pools, bt, torch.zeros(R, dtype=torch.int32, device=dev)


def attention_section(args, dev, timer, ceil, rep) -> list:
    rows = []
    copy_bps = (ceil["copy_TBps"] or 0) * 1e12
    for R in args.batch:
        q, kb, vb, pools, bt, cl = make_inputs(R, args.capacity, args.calls, dev)
        scale = HD ** -0.5

        def calls(fn, **kw):
            outs = []

            def run():
                outs.clear()
                for p in pools:
                    outs.append(fn(q, kb, vb, p[0], p[1], bt, cl, scale, None, args.capacity, **kw)[0])
            return run, outs
        run_t, outs_t = calls(da.dflash_block_attention)
        run_k, outs_k = calls(tk.dflash_block_attention)
        rep_t, rep_k = timer.capture(run_t), timer.capture(run_k)
        for ctx in args.contexts:
            cl.fill_(ctx)
            t_us = timer.time_us(rep_t) / len(pools)
            k_us = timer.time_us(rep_k) / len(pools)
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs_k, outs_t))
            nbytes = R * ctx * KVH * HD * 2 * 2 + 2 * q.numel() * 2  # real K/V once, q in, out
            row = {"batch": R, "context": ctx, "bound": args.capacity, "torch_us": round(t_us, 2),
                   "kernel_us": round(k_us, 2), "speedup": round(t_us / k_us, 2),
                   "kernel_GBps": round(nbytes / k_us / 1e3, 1),
                   "frac_copy": round(nbytes / (k_us * 1e-6) / copy_bps, 4) if copy_bps else None,
                   "max_abs_diff": diff,
                   "split_rows": tk.choose_split_rows(R, KVH, args.capacity, sm_count(dev), 64)}
            rows.append(row)
            rep(row)
    return rows


def sweep_section(args, dev, timer, rep) -> list:
    """The kernel at the largest context with forced rows per split (CUDA only)."""
    if dev.type != "cuda":
        return []
    sweep = []
    for R in args.batch:
        q, kb, vb, pools, bt, cl = make_inputs(R, args.capacity, args.calls, dev)
        cl.fill_(args.contexts[-1])
        for sr in (None, 128, 256, 512, 1024, args.capacity):
            if time.time() - args.t0 > args.budget_s:
                return sweep

            def run(sr=sr):
                for p in pools:
                    tk.dflash_block_attention(q, kb, vb, p[0], p[1], bt, cl, HD ** -0.5, None, args.capacity,
                                              split_rows=sr)
            us = timer.time_us(timer.capture(run)) / len(pools)
            chosen = sr or tk.choose_split_rows(R, KVH, args.capacity, sm_count(dev), 64)
            sweep.append({"batch": R, "context": args.contexts[-1], "split_rows": chosen, "default": sr is None,
                          "kernel_us": round(us, 2)})
            rep(sweep[-1])
    return sweep


def count_kernels(fn) -> int | None:
    """CUDA kernel (and memcpy/memset) events of one call of ``fn`` under torch.profiler."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    n = 0
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            n += 1
    return n


def drafter_section(args, dev, timer, rep) -> list:
    from longflash.default_model_path import default_model_path
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    drafter = dflash_model.load_drafter(os.path.join(default_model_path(), "drafter"), 14, dtype, dev)
    rows = []
    paths = {"before": lambda q: da.dflash_block_attention, "after": lambda q: tk.dflash_block_attention}
    original = dflash_model.block_attention_op
    try:
        for R in args.batch:
            g = torch.Generator(device=dev).manual_seed(1)
            mb = args.capacity // BLOCK
            nb = R * mb + 1
            for attn in drafter.attention_layers():
                attn.kv_cache = torch.randn(2, nb, BLOCK, KVH, HD, generator=g, device=dev).to(dtype)
            bt = torch.randperm(nb, generator=g, device=dev)[:R * mb].view(R, mb).to(torch.int32)
            x = torch.randn(R * BK, drafter.cfg.hidden_size, generator=g, device=dev).to(dtype)
            pos = torch.zeros(R * BK, dtype=torch.int64, device=dev)
            cl = torch.zeros(R, dtype=torch.int32, device=dev)
            res, replays, outs = {}, {}, {}
            for name, op in paths.items():
                holder = {}

                def fwd(holder=holder, op=op):  # on the CPU (no graph) each call picks its path again
                    dflash_model.block_attention_op = op
                    with torch.inference_mode():
                        holder["h"] = drafter.forward_padded(x, pos, cl, bt, args.capacity)
                eager = count_kernels(lambda fwd=fwd: fwd({}))  # own holder: the graph's output stays in `holder`
                replays[name] = (timer.capture(fwd), holder)
                res[name] = {"kernels_eager": eager,
                             "kernels_graph_replay": count_kernels(replays[name][0]) if dev.type == "cuda" else None}
            for ctx in args.contexts:
                cl.fill_(ctx)
                pos.copy_((ctx + torch.arange(BK, device=dev)).repeat(R))
                row = {"batch": R, "context": ctx, "bound": args.capacity}
                for name in paths:
                    row[f"{name}_us"] = round(timer.time_us(replays[name][0]), 1)
                    outs[name] = replays[name][1]["h"].float().clone()
                    row[f"{name}_kernels_eager"] = res[name]["kernels_eager"]
                    row[f"{name}_kernels_graph"] = res[name]["kernels_graph_replay"]
                row["speedup"] = round(row["before_us"] / row["after_us"], 2)
                row["max_abs_diff"] = (outs["after"] - outs["before"]).abs().max().item()
                row["ref_max_abs"] = outs["before"].abs().max().item()
                rows.append(row)
                rep(row)
    finally:
        dflash_model.block_attention_op = original
    return rows


def write(out_dir: str, result: dict) -> None:
    with open(os.path.join(out_dir, "dflash_attention.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# DFlash block attention: kernel vs torch path ({result['device']})", "",
             f"commit {result['commit']}; `{result['command']}`; ceilings: copy {result['ceilings']['copy_TBps']} "
             f"TB/s, bf16 GEMM {result['ceilings']['gemm_TFLOPs']} TFLOP/s", "",
             "## attention (µs per call, CUDA graph, host bound = capacity)", "",
             "| batch | context | torch µs | kernel µs | speedup | kernel GB/s | frac of copy | split rows "
             "| max abs diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['torch_us']} | {r['kernel_us']} | {r['speedup']} | "
              f"{r['kernel_GBps']} | {r['frac_copy']} | {r['split_rows']} | {r['max_abs_diff']:.3g} |"
              for r in result.get("attention", [])]
    if result.get("split_sweep"):
        lines += ["", "## split sweep (kernel µs per call, context = largest)", "",
                  "| batch | split rows | default | µs |", "|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['split_rows']} | {r['default']} | {r['kernel_us']} |"
                  for r in result["split_sweep"]]
    if result.get("drafter"):
        lines += ["", "## drafter block forward (5 layers, one CUDA graph replay)", "",
                  "| batch | context | before µs | after µs | speedup | kernels before (graph/eager) | "
                  "kernels after (graph/eager) | max abs diff (max abs) |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['context']} | {r['before_us']} | {r['after_us']} | {r['speedup']} | "
                  f"{r['before_kernels_graph']}/{r['before_kernels_eager']} | {r['after_kernels_graph']}/"
                  f"{r['after_kernels_eager']} | {r['max_abs_diff']:.3g} ({r['ref_max_abs']:.3g}) |"
                  for r in result["drafter"]]
    if result.get("errors"):
        lines += ["", "## errors", ""] + [f"- {k}: {v.splitlines()[-1]}" for k, v in result["errors"].items()]
    with open(os.path.join(out_dir, "dflash_attention.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    args.t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda:  # tiny shapes: the interpreter is slow
        args.batch, args.contexts, args.capacity, args.calls, args.replays = [1, 2], [16, 40], 64, 2, 1
    commit = provenance.commit()
    result = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu (TRITON_INTERPRET=1)", "commit": commit,
              "command": "python3 benchmarks/dflash_attention.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "torch": torch.__version__, "errors": {}}
    timer = Timer(cuda, args.replays)

    def rep(row):
        print(json.dumps(row), f"t={time.time() - args.t0:.1f}s", flush=True)
    result["ceilings"] = ceilings(dev)
    rep(result["ceilings"])
    for name, fn in (("attention", lambda: attention_section(args, dev, timer, result["ceilings"], rep)),
                     ("drafter", lambda: drafter_section(args, dev, timer, rep)),
                     ("split_sweep", lambda: sweep_section(args, dev, timer, rep))):
        if time.time() - args.t0 > args.budget_s:
            result["errors"][name] = "skipped: over the time budget"
            continue
        try:
            result[name] = fn()
        except Exception:  # record and go on: the other section's numbers are still useful
            result["errors"][name] = traceback.format_exc()
            print(result["errors"][name], flush=True)
        write(args.out, result)
    write(args.out, result)
    print(open(os.path.join(args.out, "dflash_attention.md")).read())
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
