"""AttnRes storage-reuse harness: the Kimi-K3 Block AttnRes schedule with random sublayers.

The real schedule (93 layers, block size 12, 8 bank slots) runs through ``execute_plan`` with small
random sublayers (Linear + tanh) standing in for attention and MLP and the engine's mixer
(``attn_res_mix``). It measures, at [T, H] (default [4096, 7168] bf16, on CUDA):

* invariant 5 of DESIGN.md: reuse on is bitwise equal to separate allocation for every output element
  (T·H) and every bank element (NB·T·H), for three repetitions with different inputs;
* the production-bug plan (layer 84's attention output written into the eighth slot's storage)
  forced through: how many output and bank elements change (and that ``check_plan`` rejects it);
* peak ``torch.cuda.max_memory_allocated`` of one forward with reuse on vs off, and the pool size;
* time per forward, reuse on vs off (ratio against the off baseline of the same run).

    python benchmarks/attn_res_harness.py --out benchmarks/results     # GPU, writes JSON + markdown
    python benchmarks/attn_res_harness.py --smoke                      # tiny shape on the CPU

The tests (``tests/test_attn_res_plan.py``) import ``RandomSublayers`` and ``run_harness`` from here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from longflash.layers.attn_res import attn_res_mix
from longflash.models.attn_res_plan import (ATTN_MIX, PlanError, Schedule, StoragePlan, attn_res_plan,
                                            check_plan, execute_plan, production_bug_plan)
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)


class RandomSublayers:
    """Random stand-ins for a model's AttnRes weights and sublayers.

    attn/mlp of layer l: ``tanh((h @ W[l % num_weights]) * scale[l])`` written into ``out`` (the matmul
    allocates, so ``h`` is fully read before ``out`` is written). Mixer weights: norm ``1 + 0.1·N(0,1)``,
    pseudo-query ``N(0, 1/H)`` per layer and sublayer, so mixtures are far from uniform.
    """

    def __init__(self, num_layers: int, hidden_size: int, dtype: torch.dtype, device, seed: int = 0,
                 num_weights: int = 4, eps: float = 1e-5):
        g = torch.Generator(device=device).manual_seed(seed)
        H = hidden_size

        def randn(*shape, std=1.0):
            return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

        self.w_attn = [randn(H, H, std=H ** -0.5) for _ in range(num_weights)]
        self.w_mlp = [randn(H, H, std=H ** -0.5) for _ in range(num_weights)]
        self.scale = 0.5 + torch.rand(num_layers, 2, H, generator=g, device=device).to(dtype)
        self.norm = 1 + 0.1 * randn(num_layers + 1, 2, H).float()
        self.proj = randn(num_layers + 1, 2, H, std=H ** -0.5).float()
        self.eps, self.num_weights = eps, num_weights

    def mix(self, layer, kind, sources, out):
        l = layer if layer is not None else -1
        j = 0 if kind == ATTN_MIX or layer is None else 1
        return attn_res_mix(sources, self.norm[l, j], self.proj[l, j], self.eps, out=out)

    def attn(self, layer, h, out):
        t = torch.mm(h, self.w_attn[layer % self.num_weights]).mul_(self.scale[layer, 0])
        return torch.tanh(t, out=out)

    def mlp(self, layer, h, out):
        t = torch.mm(h, self.w_mlp[layer % self.num_weights]).mul_(self.scale[layer, 1])
        return torch.tanh(t, out=out)


def run_harness(schedule: Schedule, plan: StoragePlan, x: torch.Tensor, sub: RandomSublayers, reuse: bool):
    """One AttnRes forward of ``x`` [T, H] (the embedding) through ``plan``; returns ``AttnResOut``."""
    return execute_plan(schedule, plan, x.shape[0], x.shape[1], x.dtype, x.device,
                        embed=lambda out: out.copy_(x), mix=sub.mix, attn=sub.attn, mlp=sub.mlp, reuse=reuse)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _peak(fn, device):
    """(peak bytes allocated during fn above what was allocated before, bytes before) on CUDA; None on CPU."""
    if torch.device(device).type != "cuda":
        fn()
        return None, None
    _sync(device)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak, base


def _time(fn, device, iters):
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def _cuda_graph(sched, plan, x, sub, iters) -> dict:
    """Capture the planned forward (pool allocated inside the capture, so addresses are static) and
    compare a replay bitwise with eager separate allocation; never raises (a failure is recorded)."""
    try:
        ref = run_harness(sched, plan, x, sub, reuse=False)
        static_x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_harness(sched, plan, static_x, sub, reuse=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run_harness(sched, plan, static_x, sub, reuse=True)
        graph.replay()
        torch.cuda.synchronize()
        diff = int((out.y != ref.y).sum()) + sum(int((a != b).sum()) for a, b in zip(out.bank, ref.bank))
        seconds = _time(graph.replay, "cuda", iters)
        del graph, out, ref
        return {"cuda_graph_elements_differing": diff, "cuda_graph_bitwise_equal": diff == 0,
                "seconds_per_forward_cuda_graph": seconds}
    except Exception as e:  # noqa: BLE001 - recorded, the rest of the benchmark still runs
        return {"cuda_graph_error": f"{type(e).__name__}: {e}"}


def bench(T: int, H: int, num_layers: int, block_size: int, dtype: torch.dtype, device: str, reps: int = 3,
          iters: int = 3) -> dict:
    sched, plan = attn_res_plan(num_layers, block_size)
    sub = RandomSublayers(num_layers, H, dtype, device, seed=1234)
    NB = sched.num_bank_slots
    res: dict = {"T": T, "H": H, "num_layers": num_layers, "block_size": block_size, "bank_slots": NB,
                 "dtype": str(dtype).replace("torch.", ""), "device": device, "pool_buffers": plan.pool_size,
                 "separate_peak_buffers": sched.max_live_separate(), "output_elements": T * H,
                 "bank_elements": NB * T * H}
    if torch.device(device).type == "cuda":
        res["device_name"] = torch.cuda.get_device_name()

    # Bitwise equality, three repetitions with different inputs.
    reps_out = []
    ref0 = None
    for r in range(reps):
        g = torch.Generator(device=device).manual_seed(100 + r)
        x = torch.randn(T, H, generator=g, device=device).to(dtype)
        off = run_harness(sched, plan, x, sub, reuse=False)
        on = run_harness(sched, plan, x, sub, reuse=True)
        out_diff = int((on.y != off.y).sum())
        bank_diff = sum(int((a != b).sum()) for a, b in zip(on.bank, off.bank))
        reps_out.append({"rep": r, "output_elements_differing": out_diff, "bank_elements_differing": bank_diff,
                         "bitwise_equal": out_diff == 0 and bank_diff == 0 and torch.equal(on.y, off.y)})
        if r == 0:
            ref0 = (x, off.y, [b for b in off.bank])
        del on, off
    res["repetitions"] = reps_out
    res["bitwise_equal_all"] = all(r["bitwise_equal"] for r in reps_out)

    # The production bug forced through.
    bsched, bplan = production_bug_plan(num_layers, block_size)
    try:
        check_plan(bsched, bplan)
        res["bug_plan_rejected"] = None
    except PlanError as e:
        res["bug_plan_rejected"] = str(e)
    x, y_ref, bank_ref = ref0
    bug = run_harness(bsched, bplan, x, sub, reuse=True)
    res["bug_output_elements_changed"] = int((bug.y != y_ref).sum())
    res["bug_bank_elements_changed"] = sum(int((a != b).sum()) for a, b in zip(bug.bank, bank_ref))
    del bug, ref0, y_ref, bank_ref

    # Peak memory and time per forward.
    for name, reuse in (("on", True), ("off", False)):
        peak, base = _peak(lambda: run_harness(sched, plan, x, sub, reuse), device)
        res[f"peak_bytes_reuse_{name}"] = peak
        res["bytes_allocated_before_forward"] = base
        res[f"seconds_per_forward_reuse_{name}"] = _time(lambda: run_harness(sched, plan, x, sub, reuse), device,
                                                         iters)
    res["time_ratio_on_over_off"] = res["seconds_per_forward_reuse_on"] / res["seconds_per_forward_reuse_off"]
    # Denominators: the 2·L sublayer matmuls alone (same shape, measured here) and their FLOP rate.
    w = sub.w_attn[0]
    t_mm = _time(lambda: torch.mm(x, w), device, 10)
    res["seconds_sublayer_matmuls_alone"] = 2 * num_layers * t_mm
    res["sublayer_matmul_share_of_forward"] = res["seconds_sublayer_matmuls_alone"] / res["seconds_per_forward_reuse_on"]
    res["matmul_tflops_alone"] = 2 * T * H * H / t_mm / 1e12
    elem = torch.empty((), dtype=dtype).element_size()
    res["row_bytes"] = T * H * elem
    res["pool_bytes"] = plan.pool_size * T * H * elem
    if res["peak_bytes_reuse_on"] is not None:
        res["peak_saving_bytes"] = res["peak_bytes_reuse_off"] - res["peak_bytes_reuse_on"]
        res["peak_saving_rows"] = res["peak_saving_bytes"] / res["row_bytes"]
    # Last (a failed capture must not spoil the measurements above): the plan under a CUDA graph,
    # captured once, a replay compared bitwise with eager separate allocation.
    if torch.device(device).type == "cuda":
        res.update(_cuda_graph(sched, plan, x, sub, iters))
    return res


def markdown(res: dict, command: str, commit: str) -> str:
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:,.1f} MiB ({b:,} B)"  # noqa: E731
    lines = [f"# AttnRes storage reuse harness ({res['num_layers']} layers, block {res['block_size']}, "
             f"{res['bank_slots']} slots, [{res['T']}, {res['H']}] {res['dtype']})", "",
             f"- device: {res.get('device_name', res['device'])}; commit `{commit}`; command `{command}`",
             f"- pool: {res['pool_buffers']} buffers of [T, H] with reuse "
             f"(separate allocation peaks at {res['separate_peak_buffers']} live values)", "",
             "| rep | output elements differing (of {:,}) | bank elements differing (of {:,}) | bitwise equal |".format(
                 res["output_elements"], res["bank_elements"]),
             "|---|---|---|---|"]
    for r in res["repetitions"]:
        lines.append(f"| {r['rep']} | {r['output_elements_differing']:,} | {r['bank_elements_differing']:,} | "
                     f"{r['bitwise_equal']} |")
    lines += ["", "| measure | reuse on | reuse off |", "|---|---|---|",
              f"| peak allocated during one forward | {mib(res['peak_bytes_reuse_on'])} | "
              f"{mib(res['peak_bytes_reuse_off'])} |",
              f"| time per forward | {res['seconds_per_forward_reuse_on'] * 1e3:.2f} ms | "
              f"{res['seconds_per_forward_reuse_off'] * 1e3:.2f} ms |", "",
              f"- pool with reuse: {mib(res['pool_bytes'])} ({res['pool_buffers']} rows of [T, H]); saving on the "
              f"peak: {mib(res.get('peak_saving_bytes'))} = {res.get('peak_saving_rows', float('nan')):.2f} rows; "
              f"the rest of the peak is the reference mixer's fp32 temporaries ([T, sources, H])",
              f"- time ratio on/off: {res['time_ratio_on_over_off']:.3f}; the {2 * res['num_layers']} sublayer "
              f"matmuls alone take {res['seconds_sublayer_matmuls_alone'] * 1e3:.1f} ms "
              f"({res['sublayer_matmul_share_of_forward']:.0%} of a forward, {res['matmul_tflops_alone']:.0f} TFLOP/s); "
              f"the rest is the reference mixer and elementwise ops",
              _graph_line(res),
              f"- production-bug plan forced through: {res['bug_output_elements_changed']:,} of "
              f"{res['output_elements']:,} output elements and {res['bug_bank_elements_changed']:,} bank elements "
              f"changed; checker: `{res['bug_plan_rejected']}`", ""]
    return "\n".join(lines)


def _graph_line(res: dict) -> str:
    if "cuda_graph_error" in res:
        return f"- CUDA graph capture of the planned forward failed: `{res['cuda_graph_error']}`"
    if "cuda_graph_bitwise_equal" not in res:
        return "- CUDA graph: not run (CPU)"
    return (f"- planned forward captured in a CUDA graph: replay bitwise equal to eager separate allocation: "
            f"{res['cuda_graph_bitwise_equal']} ({res['cuda_graph_elements_differing']:,} elements differ); "
            f"{res['seconds_per_forward_cuda_graph'] * 1e3:.2f} ms per replay")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", help="directory for attn_res_harness.json and .md")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=93)
    ap.add_argument("--block-size", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.device = 16, 64, args.device or "cpu"
        torch.set_num_threads(1)  # thousands of tiny ops: extra threads only spin on a shared CPU
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        res = bench(args.tokens, args.hidden, args.layers, args.block_size, getattr(torch, args.dtype), device,
                    reps=args.reps, iters=args.iters)
    commit = provenance.commit()
    command = "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))
    res.update(commit=commit, command=command, torch=torch.__version__, python=platform.python_version())
    md = markdown(res, command, commit)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = "attn_res_harness" + ("_smoke" if args.smoke else "")
        with open(os.path.join(args.out, stem + ".json"), "w") as f:
            json.dump(res, f, indent=2)
        with open(os.path.join(args.out, stem + ".md"), "w") as f:
            f.write(md)
    ok = res["bitwise_equal_all"] and res["bug_plan_rejected"] and res["bug_output_elements_changed"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
