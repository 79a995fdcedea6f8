"""NCCL smoke test of tensor / decode-context parallelism (issue 6): does the GPU path run, and does it
give the single-GPU answers? Correctness only, no timings.

    python3 benchmarks/nccl_smoke.py --out DIR                       # GPU machine
    python3 benchmarks/nccl_smoke.py --out DIR --device cpu --tokens 16   # the same checks over gloo (CPU)

Checks, each recorded as ran / passed / skipped (with the reason) in DIR/nccl_smoke.json and .md:
  * comm_world1 (any device count >= 1): a world-size-1 process group through ``longflash.distributed.comm``
    (backend nccl on a GPU), every collective the engine uses on a one-rank coordinator that holds the
    group (so the collectives really run): all_reduce sum/max, all_gather (dims 0 and 1),
    reduce_scatter, a CPU-tensor all_gather over the gloo twin, the step object's broadcast and
    serialization round trip (tensors back on this rank's GPU), barrier, destroy; the NCCL environment
    defaults as the process saw them.
  * tp{N}_dcp{M} for each (N, M) of --configs with N <= visible GPUs (on the CPU: all), default model,
    speculative decoding off, against the single-device engine:
      - bf16 logits of a --prompt-len token prompt scored in 32-token chunks, "within bf16 tolerance":
        their max |error| against the single-device fp32 logits <= --bf16-err-ratio x the single-device
        bf16 engine's own (bf16 alone moves this 14M model's logits by up to ~2 of |17.8| on the CPU;
        the max |diff| to the single-device bf16 logits and the top-1 agreement are reported too);
      - fp32 logits of the same prompt within --fp32-rel-tol x max |logit|, and --tokens greedy tokens
        of three prompts identical (first divergence reported).
    On a GPU, GPUs 1..N-1 must each gain > 64 MiB while the engine runs (every worker on its own GPU).
  * dflash_tp2_dcp2 (>= 2 GPUs): fp32, the default model with its shipped drafter, greedy tokens equal
    the target alone (the speculative-decoding invariant) and the acceptance length.
  * killed_worker (>= 2 GPUs): -tp 2 -dcp 2; SIGKILL rank 1 between steps: step() raises naming the
    rank, shutdown returns (seconds recorded).
A check whose start would pass --budget-s (seconds since the script started) is skipped (budget).
Exit code 0 when every check that ran passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import provenance  # noqa: E402  (benchmarks/provenance.py: the commit a result came from)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="directory for nccl_smoke.json / .md")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--configs", default="2x1,2x2,4x2,4x4", help="tp x dcp pairs, comma separated")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens per prompt (fp32 check)")
    ap.add_argument("--prompt-len", type=int, default=160, help="tokens of the bf16 scored prompt")
    ap.add_argument("--bf16-err-ratio", type=float, default=1.5,
                    help="bf16: max |logit - fp32 logit| of the TP engine <= this x that of the single-device engine")
    ap.add_argument("--fp32-rel-tol", type=float, default=1e-4, help="fp32: max |logit diff| <= this x max |logit|")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="distributed_timeout_s of the engines")
    ap.add_argument("--budget-s", type=float, default=420.0)
    return ap.parse_args(argv)


T0 = time.monotonic()


def _elapsed() -> float:
    return time.monotonic() - T0


def _engine(device: str, tp: int, dcp: int, dtype: str, timeout_s: float, spec="off", **kw):
    from longflash.config import EngineConfig
    from longflash.default_model_path import default_model_path
    from longflash.engine.llm_engine import LLMEngine
    args = dict(model=default_model_path(), device=device, dtype=dtype, block_size=16, num_gpu_blocks=256,
                max_num_seqs=4, max_num_batched_tokens=256, skip_tokenizer_init=True, tensor_parallel_size=tp,
                decode_context_parallel_size=dcp, speculative_config=spec, distributed_timeout_s=timeout_s)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def _greedy(engine, prompts, n):
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from engine_helpers import greedy_outputs
    return greedy_outputs(engine, prompts, n)


def _prompts(vocab: int = 8192):
    import torch
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (37,), generator=g).tolist(), [5, 6, 7, 8, 9], [11]]


def check_comm_world1(device) -> dict:
    """A world-size-1 group through comm: every collective really runs (the coordinator holds the group)."""
    import torch
    import torch.distributed as dist
    from longflash.distributed import comm, placement
    from longflash.runner.context import ForwardContext
    res = {"items": {}}
    items = res["items"]
    de = placement.rank_device(device, 0)   # cuda:0 (init_distributed makes it current) or the CPU
    comm.init_distributed(0, 1, comm.free_port(), timeout_s=60, device=de)
    try:
        res["backend"] = comm.backend()
        res["device"] = str(de)
        res["env"] = {k: os.environ.get(k) for k in placement.NCCL_ENV_DEFAULTS}
        items["backend is nccl on a GPU, gloo on the CPU"] = comm.backend() == placement.default_backend(de)
        g = comm.GroupCoordinator([0], 0, dist.group.WORLD)
        for dt in (torch.float32, torch.bfloat16):
            x = torch.arange(8, dtype=dt, device=de) - 3
            items[f"all_reduce sum {dt}"] = torch.equal(g.all_reduce(x.clone()), x)
            items[f"all_reduce max {dt}"] = torch.equal(g.all_reduce(x.clone(), op="max"), x)
        y = torch.randn(3, 4, 5, device=de)
        items["all_gather dim 0"] = torch.equal(g.all_gather(y, dim=0), y)
        items["all_gather dim 1"] = torch.equal(g.all_gather(y, dim=1), y)
        items["reduce_scatter dim 1"] = torch.equal(g.reduce_scatter(y, dim=1), y)
        drafts = torch.tensor([[4, 5, 6]], dtype=torch.int64)                         # CPU: the gloo twin
        items["all_gather of a CPU tensor (gloo twin)"] = torch.equal(g.all_gather(drafts, dim=0), drafts)
        t = torch.arange(6, device=de)
        ctx = ForwardContext(positions=t, slot_mapping=t + 10,
                             query_start_loc=torch.tensor([0, 6], dtype=torch.int32, device=de),
                             seq_lens=torch.tensor([6], dtype=torch.int32, device=de),
                             context_lens=torch.zeros(1, dtype=torch.int32, device=de),
                             block_table=torch.zeros(1, 1, dtype=torch.int32, device=de), is_decode=[False],
                             query_start_loc_cpu=[0, 6], seq_lens_cpu=[6], context_lens_cpu=[0], block_size=16,
                             extras={"all_logits": False, "host": torch.ones(2)})
        step = (t + 100, ctx, None)
        items["broadcast_object of the step object"] = g.broadcast_object(step) is step
        back = comm._unpack(comm._pack(step), de)
        items["step object round trip: values, devices"] = (
            torch.equal(back[0], step[0]) and back[0].device == de and back[1].positions.device == de
            and torch.equal(back[1].slot_mapping, ctx.slot_mapping) and back[1].extras["host"].device.type == "cpu")
        g.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(de)
        items["no pending error"] = True
    finally:
        comm.destroy_distributed()
    items["destroyed"] = comm.backend() is None and not dist.is_initialized()
    res["passed"] = all(items.values())
    return res


def _gpu_used(n: int) -> list[int]:
    import torch
    return [int(torch.cuda.mem_get_info(i)[1] - torch.cuda.mem_get_info(i)[0]) for i in range(n)]


def check_engine(device, tp: int, dcp: int, args, refs: dict) -> dict:
    """Logits (bf16 and fp32) and fp32 greedy tokens of -tp tp -dcp dcp against the single-device engine."""
    import torch
    dev = device.type
    res = {"tp": tp, "dcp": dcp}
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, 8192, (args.prompt_len,), generator=g).tolist()
    prompts = _prompts()

    def run(tp_, dcp_, dtype):
        # memory the worker ranks' GPUs gain while the engine runs (rank 0's own GPU reuses the memory its
        # earlier engines left in the caching allocator, so it is not counted)
        before = _gpu_used(tp_) if dev == "cuda" else None
        eng = _engine(dev, tp_, dcp_, dtype, args.timeout_s)
        try:
            used = [a - b for a, b in zip(_gpu_used(tp_), before)][1:] if before is not None else None
            logits = eng.score(prompt, chunk_size=32).float().cpu()
            tokens = None
            if dtype == "float32":
                tokens = [o.outputs[0].token_ids for o in _greedy(eng, prompts, args.tokens)]
            return logits, tokens, used
        finally:
            eng.shutdown()

    if "fp32" not in refs:
        refs["bf16_logits"] = run(1, 1, "bfloat16")[0]
        refs["fp32_logits"], refs["fp32"], _ = run(1, 1, "float32")
    fp32 = refs["fp32_logits"]
    scale = float(fp32.abs().max())
    logits, _, used = run(tp, dcp, "bfloat16")
    # bf16 tolerance: the single-device engine's own bf16 error against fp32, measured on the same prompt
    one_err = float((refs["bf16_logits"] - fp32).abs().max())
    tp_err = float((logits - fp32).abs().max())
    res["max_abs_logit_fp32"] = scale
    res["bf16_err_vs_fp32_one_device"] = one_err
    res["bf16_err_vs_fp32_tp"] = tp_err
    res["bf16_diff_vs_one_device"] = float((logits - refs["bf16_logits"]).abs().max())
    res["bf16_top1_agreement"] = float((logits.argmax(-1) == refs["bf16_logits"].argmax(-1)).float().mean())
    res["bf16_passed"] = tp_err <= args.bf16_err_ratio * one_err
    if used is not None:
        res["worker_gpus_bytes_gained"] = used              # GPUs 1..tp-1: a CUDA context alone is >= 64 MiB
        res["every_worker_on_its_own_gpu"] = all(u > (64 << 20) for u in used)
    logits32, tokens, _ = run(tp, dcp, "float32")
    res["fp32_logits_max_abs_diff"] = float((logits32 - fp32).abs().max())
    res["fp32_logits_passed"] = res["fp32_logits_max_abs_diff"] <= args.fp32_rel_tol * scale
    ref_t = refs["fp32"]
    res["fp32_tokens_per_prompt"] = [len(t) for t in tokens]
    res["fp32_greedy_identical"] = tokens == ref_t
    res["fp32_first_divergence"] = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                                    for x, y in zip(tokens, ref_t)]
    res["passed"] = (res["bf16_passed"] and res["fp32_logits_passed"] and res["fp32_greedy_identical"]
                     and res.get("every_worker_on_its_own_gpu", True))
    return res


def check_dflash(device, args, refs: dict) -> dict:
    """-tp 2 -dcp 2 with the shipped drafter: greedy tokens equal the target alone (fp32)."""
    from longflash.default_model_path import default_model_path
    drafter = os.path.join(default_model_path(), "drafter")
    eng = _engine(device.type, 2, 2, "float32", args.timeout_s,
                  spec={"method": "dflash", "model": drafter})
    try:
        outs = _greedy(eng, _prompts(), args.tokens)
        runner = eng.runner
        res = {"tokens_equal_target": [o.outputs[0].token_ids for o in outs] == refs["fp32"],
               "acceptance_length_per_prompt": [round(o.metrics.mean_acceptance_length, 2) for o in outs],
               "draft_checks": runner.draft_checks,
               "draft_mismatches": runner.draft_mismatches}
    finally:
        eng.shutdown()
    res["passed"] = res["tokens_equal_target"] and res["draft_mismatches"] == 0 and res["draft_checks"] > 0
    return res


def check_killed_worker(device, args) -> dict:
    from longflash.sampling_params import SamplingParams
    eng = _engine(device.type, 2, 2, "float32", args.timeout_s)
    res = {}
    try:
        eng.add_request(None, list(range(2, 40)), SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        for _ in range(3):
            eng.step()
        p = eng.runner.procs[0]
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < args.timeout_s + 30:
                eng.step()
            res["error"] = None
        except Exception as e:  # noqa: BLE001 — the error is the point
            res["error"] = f"{type(e).__name__}: {e}"
        res["seconds_to_error"] = time.monotonic() - t0
    finally:
        t1 = time.monotonic()
        eng.shutdown()
        res["shutdown_seconds"] = time.monotonic() - t1
    res["passed"] = bool(res["error"]) and "rank 1" in res["error"] and res["shutdown_seconds"] < 30
    return res


def main() -> int:
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    import torch
    ngpu = torch.cuda.device_count()
    dev = torch.device("cuda" if (args.device == "cuda" or (args.device == "auto" and ngpu)) else "cpu")
    ranks_available = ngpu if dev.type == "cuda" else 1 << 30
    commit = provenance.commit()
    res = {"benchmark": "nccl_smoke", "commit": commit or "unknown", "command": " ".join(sys.argv),
           "host": platform.node(), "torch": torch.__version__, "device": str(dev), "gpus_visible": ngpu,
           "gpu_names": [torch.cuda.get_device_name(i) for i in range(ngpu)],
           "nccl": _nccl_version() if ngpu else None, "checks": {}}
    checks = res["checks"]

    def attempt(name, need_ranks, fn, est_s):
        if need_ranks > ranks_available:
            checks[name] = {"ran": False, "why": f"needs {need_ranks} GPUs, {ngpu} visible"}
        elif _elapsed() + est_s > args.budget_s:
            checks[name] = {"ran": False, "why": f"budget ({_elapsed():.0f} s of {args.budget_s:.0f} used)"}
        else:
            t = time.monotonic()
            try:
                checks[name] = {"ran": True, **fn()}
            except Exception as e:  # noqa: BLE001 — recorded, the script goes on
                checks[name] = {"ran": True, "passed": False, "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc()[-3000:]}
            checks[name]["seconds"] = round(time.monotonic() - t, 1)
        c = checks[name]
        print(f"[{_elapsed():6.1f} s] {name}: " + (("PASS" if c.get("passed") else "FAIL") if c["ran"]
                                                  else f"skipped ({c['why']})"), flush=True)
        _write(args.out, res)

    attempt("comm_world1", 1, lambda: check_comm_world1(dev), 20)
    refs: dict = {}
    for pair in args.configs.split(","):
        tp, dcp = (int(v) for v in pair.lower().split("x"))
        attempt(f"tp{tp}_dcp{dcp}", tp, lambda tp=tp, dcp=dcp: check_engine(dev, tp, dcp, args, refs),
                60 if refs else 90)
    if "fp32" in refs or ranks_available < 2:   # (with < 2 GPUs: skipped, saying so)
        attempt("dflash_tp2_dcp2", 2, lambda: check_dflash(dev, args, refs), 45)
    else:
        checks["dflash_tp2_dcp2"] = {"ran": False, "why": "no fp32 reference (no engine check ran)"}
    attempt("killed_worker", 2, lambda: check_killed_worker(dev, args), 30)
    res["seconds"] = round(_elapsed(), 1)
    _write(args.out, res)
    ran = [c for c in checks.values() if c["ran"]]
    print(f"{sum(bool(c.get('passed')) for c in ran)}/{len(ran)} checks that ran passed; "
          f"{len(checks) - len(ran)} skipped; {res['seconds']} s")
    return 0 if ran and all(c.get("passed") for c in ran) else 1


def _nccl_version() -> str:
    import torch
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _fmt(v):
    """Floats to 4 significant digits (lists too), the rest as is."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(str(_fmt(x)) for x in v) + "]"
    return v


def _write(out: str, res: dict) -> None:
    with open(os.path.join(out, "nccl_smoke.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)
    lines = [f"# NCCL smoke ({res['device']}, {res['gpus_visible']} GPU(s) visible)", "",
             f"commit `{res['commit']}`, `{res['command']}`, torch {res['torch']}, nccl {res['nccl']}", "",
             "| check | ran | result | details |", "|---|---|---|---|"]
    for name, c in res["checks"].items():
        if not c["ran"]:
            lines.append(f"| {name} | no | - | {c['why']} |")
            continue
        keys = [k for k in c if k not in ("ran", "passed", "traceback", "items")]
        detail = ", ".join(f"{k}={_fmt(c[k])}" for k in keys)
        if "items" in c:
            detail += "; failed items: " + (", ".join(k for k, v in c["items"].items() if not v) or "none")
        lines.append(f"| {name} | yes | {'PASS' if c.get('passed') else 'FAIL'} | {detail} |")
    with open(os.path.join(out, "nccl_smoke.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
