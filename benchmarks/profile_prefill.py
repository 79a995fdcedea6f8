"""Where a long prefill's time goes: one ``--input-len``-token prompt of the DeepSeek-V3-shaped random model
(``e2e_decode.py``'s 3.3B checkpoint) through the engine, prefilled in chunks of ``--max-num-batched-tokens``
under ``torch.profiler`` (after one warm-up prompt of the same length).

    python3 benchmarks/profile_prefill.py --out DIR                 # GPU: one 16K-token prompt, fp8 cache
    python3 benchmarks/profile_prefill.py --out DIR --tiny          # CPU check in seconds

Reports the prefill's wall time (seconds; the time to the first token of a lone request), its tokens per
second, the sum of kernel durations, and the kernels grouped by name with their share of GPU time (top 25),
the numbers that say which op to speed up for TTFT (``long_decode.py`` measures TTFT under load).
Writes ``profile_prefill.json`` / ``.md`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_decode as e2e  # noqa: E402  (the model and its checkpoint builder)
import provenance  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (the default without a GPU)")
    ap.add_argument("--input-len", type=int, default=16384)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384, help="prefill chunk (tokens per step)")
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=["auto", "fp8"])
    ap.add_argument("--requests", type=int, default=1,
                    help="prompts submitted together (4 output tokens each): the later ones prefill in steps that "
                         "also decode the earlier ones; each step's wall time is reported")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if dev.type != "cuda":
        args.input_len, args.max_num_batched_tokens = min(args.input_len, 48), min(args.max_num_batched_tokens, 32)
    if args.input_len < 1 or args.max_num_batched_tokens < 1 or args.requests < 1:
        raise SystemExit("--input-len, --max-num-batched-tokens and --requests must be >= 1")
    os.makedirs(args.out, exist_ok=True)
    max_len = -(-(args.input_len + 8) // 64) * 64
    cfg, dtype = e2e.model_config(dev, max_len)
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "args": vars(args), "command": " ".join(["python3"] + sys.argv), "commit": provenance.commit()}
    from longflash import LLM, SamplingParams
    tmp = tempfile.mkdtemp(prefix="profile-prefill-dsv3-")
    try:
        model = e2e.build_checkpoint(cfg, dev, dtype, tmp)
        del model
        e2e._free(dev)
        llm = LLM(model=tmp, dtype="bfloat16" if dev.type == "cuda" else "float32", device=dev.type,
                  max_model_len=max_len, max_num_seqs=args.requests, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory="16GiB" if dev.type == "cuda" else "256MiB", kv_cache_dtype=args.kv_cache_dtype,
                  skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=False)
        rng = random.Random(0)
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

        def prompt():
            return {"prompt_token_ids": [rng.randrange(4, cfg["vocab_size"]) for _ in range(args.input_len)]}

        llm.generate([prompt()], sp, use_tqdm=False)  # warm-up: compiles every kernel of the shape
        p = prompt()
        eng = llm.engine
        if args.requests > 1:  # the mixed steps' shapes warm up too
            for _ in range(args.requests):
                eng.add_request(None, prompt(), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            while eng.has_unfinished_requests():
                eng.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda"
                                                        else [])
        steps = []  # (wall s, requests whose first token came in the step)
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            if args.requests == 1:
                llm.generate([p], sp, use_tqdm=False)
            else:
                ids = [eng.add_request(None, p if i == 0 else prompt(),
                                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
                       for i in range(args.requests)]
                first = set()
                while eng.has_unfinished_requests():
                    ts = time.perf_counter()
                    outs = eng.step()
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    new = [ids.index(o.request_id) for o in outs if o.request_id not in first and o.outputs
                           and o.outputs[0].token_ids]
                    first.update(ids[i] for i in new)
                    steps.append([time.perf_counter() - ts, new])
            if dev.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kern: dict[str, list] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = kern.setdefault(e.name[:90], [0, 0.0])
                k[0] += 1
                k[1] += e.device_time_total / 1e3  # ms
        busy = sum(v[1] for v in kern.values())
        res.update(prefill_s=wall, tok_s=args.input_len * args.requests / wall, kernel_ms=busy, kernels=len(kern),
                   steps=steps,
                   top=sorted(([n, c, ms] for n, (c, ms) in kern.items()), key=lambda r: -r[2])[:25])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with open(os.path.join(args.out, "profile_prefill.json"), "w") as f:
        json.dump(res, f, indent=1)
    what = (f"One {args.input_len}-token prefill" if args.requests == 1 else
            f"{args.requests} prompts of {args.input_len} tokens submitted together")
    lines = [f"# {what}, DeepSeek-V3 shape (random weights, {res['device']})", "",
             f"commit {res['commit'][:12]}; chunks of {args.max_num_batched_tokens} tokens; {args.kv_cache_dtype} cache",
             "", f"`{res['command']}`", "",
             f"{args.requests} prompt(s): {res['prefill_s']:.3f} s ({res['tok_s']:.0f} prompt tok/s); kernel time "
             f"{res['kernel_ms']:.1f} ms", "",
             "| kernel | calls | ms | share of kernel time |", "|---|---|---|---|"]
    lines += [f"| `{n}` | {c} | {ms:.2f} | {ms / max(res['kernel_ms'], 1e-9):.3f} |" for n, c, ms in res["top"]]
    if res["steps"]:
        lines += ["", f"{args.requests} requests of {args.input_len} tokens, 4 output tokens each: engine steps", "",
                  "| step | wall ms | first tokens of requests |", "|---|---|---|"]
        lines += [f"| {i} | {t * 1e3:.1f} | {new} |" for i, (t, new) in enumerate(res["steps"])]
    md = "\n".join(lines)
    with open(os.path.join(args.out, "profile_prefill.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
