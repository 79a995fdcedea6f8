"""Profile decode and DFlash speculative steps of the engine (issue #10 item 5, issue #8's GPU bar).

Usage: ``python3 benchmarks/profile_step.py --out DIR [--model PATH] [--batch-size 1 16] [--steps 24]``

For each batch size and speculative decoding off / on: a warmed-up engine (CUDA graphs unless
``--enforce-eager``) runs ``--steps`` decode steps of greedy requests under ``torch.profiler``, with
``record_function`` ranges around the step's phases (schedule, propose, execute, the host read of the
sampled tokens is inside ``step``, flush of the draft context). Reported per step:
- wall time of ``LLMEngine.step`` (ms), and of each phase (host-side time, CPU clock);
- GPU busy time (sum of kernel durations) and its share of the wall time;
- the kernel list with each kernel's share of GPU time (top 25).
Writes ``profile_step.json`` and ``profile_step.md`` to ``--out`` (and one chrome trace per run,
gzipped, with ``--trace``).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _wrap(obj, name: str, label: str) -> None:
    """Put ``obj.name`` inside a ``record_function(label)`` range."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapped(*a, **k):
        with torch.profiler.record_function(label):
            return fn(*a, **k)
    setattr(obj, name, wrapped)


def _engine(args, spec: str | None):
    from longflash.config import EngineConfig
    from longflash.default_model_path import default_model_path
    from longflash.engine.llm_engine import LLMEngine
    cfg = EngineConfig(model=args.model or default_model_path(), max_num_seqs=max(args.batch_size),
                       kv_cache_memory=args.kv_cache_memory, enforce_eager=args.enforce_eager,
                       speculative_config=spec, seed=0)
    return LLMEngine(cfg)


def _add(engine, batch: int, input_len: int, max_tokens: int, seed: int) -> None:
    from longflash.bench import make_prompts
    from longflash.sampling_params import SamplingParams
    prompts = make_prompts(engine.tokenizer, engine.model.config["vocab_size"], engine.max_model_len, batch,
                           input_len, "code", seed)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(None, p, sp)


def _decode_ready(engine) -> None:
    """Step until every request has its first token (prefill done)."""
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    engine.step()


def profile_run(args, spec: str | None, batch: int, out_dir: str) -> dict:
    """Profile ``args.steps`` decode steps at ``batch``; returns the per-step report."""
    from torch.profiler import ProfilerActivity, profile
    engine = _engine(args, spec)
    # warm-up: one full batch to the end (Triton compiles, graph capture)
    _add(engine, batch, args.input_len, args.steps + 16, seed=100)
    while engine.has_unfinished_requests():
        engine.step()
    runner = engine.runner
    _wrap(engine.scheduler, "schedule", "phase:schedule")
    _wrap(runner, "propose", "phase:propose")
    _wrap(runner, "execute", "phase:execute")
    _wrap(runner, "flush_draft_context", "phase:flush_draft_context")
    _add(engine, batch, args.input_len, 8 * args.steps + 64, seed=1)
    _decode_ready(engine)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    spec0 = (engine.stats.spec_num_drafts, engine.stats.spec_num_accepted_tokens)
    tok0 = engine.stats.generation_tokens
    step_ms = []
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            t = time.perf_counter()
            with torch.profiler.record_function("phase:step"):
                engine.step()
            step_ms.append((time.perf_counter() - t) * 1e3)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    tokens = engine.stats.generation_tokens - tok0
    drafts = engine.stats.spec_num_drafts - spec0[0]
    accepted = engine.stats.spec_num_accepted_tokens - spec0[1]
    engine.shutdown()
    events = prof.key_averages()
    phases, kernels = {}, []
    for e in events:
        if e.key.startswith("phase:"):
            phases[e.key[6:]] = round(e.cpu_time_total / 1e3 / args.steps, 3)  # ms per step
    gpu_total = 0.0
    for e in events:
        dev_us = getattr(e, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "self_cuda_time_total", 0)
        if (dev_us and not e.key.startswith("phase:") and getattr(e, "device_type", None) is not None
                and str(e.device_type).endswith("CUDA")):
            kernels.append((e.key, dev_us, e.count))
            gpu_total += dev_us
    kernels.sort(key=lambda k: -k[1])
    if args.trace:
        path = os.path.join(out_dir, f"trace_{'on' if spec is None else 'off'}_b{batch}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(path)
    wall = sum(step_ms) / len(step_ms)
    return {
        "spec": "on" if spec is None else "off", "batch": batch, "steps": args.steps,
        "step_ms_mean": round(wall, 3), "step_ms_min": round(min(step_ms), 3),
        "tokens_per_step": round(tokens / args.steps, 3),
        "ms_per_token_per_request": round(wall * batch / max(tokens, 1), 3),
        "acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "phase_ms_per_step": phases,
        "gpu_busy_ms_per_step": round(gpu_total / 1e3 / args.steps, 3),
        "gpu_busy_share": round(gpu_total / 1e3 / args.steps / wall, 3),
        "kernels": [{"name": k[:90], "ms_per_step": round(us / 1e3 / args.steps, 4), "calls_per_step":
                     round(c / args.steps, 2), "share": round(us / gpu_total, 4) if gpu_total else None}
                    for k, us, c in kernels[:25]],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="4GiB")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--trace", action="store_true", help="also write gzipped chrome traces")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    runs = []
    for batch in args.batch_size:
        for spec in ("off", None):
            r = profile_run(args, spec, batch, args.out)
            runs.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "kernels"}), flush=True)
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "args": vars(args), "runs": runs}
    with open(os.path.join(args.out, "profile_step.json"), "w") as f:
        json.dump(report, f, indent=2)
    lines = ["# Decode / DFlash step profile", "", f"device {report['device']}, torch {report['torch']}", "",
             "| spec | batch | step ms | tokens/step | ms/token/request | acceptance | GPU busy ms | busy share | phases (ms/step) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ph = ", ".join(f"{k} {v}" for k, v in r["phase_ms_per_step"].items())
        lines.append(f"| {r['spec']} | {r['batch']} | {r['step_ms_mean']} | {r['tokens_per_step']} | "
                     f"{r['ms_per_token_per_request']} | {r['acceptance_length']} | {r['gpu_busy_ms_per_step']} | "
                     f"{r['gpu_busy_share']} | {ph} |")
    for r in runs:
        lines += ["", f"## kernels: spec {r['spec']}, batch {r['batch']} (per step)", "",
                  "| kernel | ms/step | calls/step | share |", "|---|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['ms_per_step']} | {k['calls_per_step']} | {k['share']} |" for k in r["kernels"]]
    with open(os.path.join(args.out, "profile_step.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
