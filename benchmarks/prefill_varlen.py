"""The MLA prefill's new-token attention for a batch of requests: one varlen launch
(``triton_prefill.attention_with_lse_varlen``) against one ``attention_with_lse`` launch per request, the
form before session 30 (DeepSeek-V3 shapes: 16 heads, q / k 192 wide, v a 128-wide split view, bf16).

    python3 benchmarks/prefill_varlen.py --out DIR            # GPU

Per length set: milliseconds per call of each form (CUDA events around 20 calls after 3 warm-ups, host
launch overhead included: that is what the per-request form costs the engine), their ratio, and the
varlen result's max difference to the per-request one (0: the same bits). Writes prefill_varlen.json / .md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import provenance  # noqa: E402

CASES = {"64 x 128": [128] * 64, "16000 + 63 x 6": [16000] + [6] * 63, "mixed": [1000, 1, 4096, 37, 129],
         "8 x 1024": [1024] * 8}


def _ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from longflash.attention import triton_prefill as tp
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "commit": provenance.commit(),
           "command": " ".join(["python3"] + sys.argv), "cases": {}}
    for name, lens in CASES.items():
        T, H = sum(lens), 16
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(T, H, 192, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(T, H, 192, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(T, H, 256, device="cuda", generator=g, dtype=torch.bfloat16)[..., 128:]

        def per_request():
            s, outs = 0, []
            for n in lens:
                outs.append(tp.attention_with_lse(q[s:s + n], k[s:s + n], v[s:s + n], 0.1, 0)[0])
                s += n
            return torch.cat(outs)

        def varlen():
            return tp.attention_with_lse_varlen(q, k, v, 0.1, lens, lens, True)[0]

        diff = (varlen().float() - per_request().float()).abs().max().item()
        t_v, t_r = _ms(varlen), _ms(per_request)
        res["cases"][name] = {"requests": len(lens), "tokens": T, "varlen_ms": t_v, "per_request_ms": t_r,
                              "speedup": t_r / t_v, "max_abs_diff": diff}
        print(name, res["cases"][name], flush=True)
    lines = [f"# MLA prefill new-token attention: varlen vs per request ({res['device']})", "",
             f"commit {res['commit']}", "", f"`{res['command']}`", "",
             "| requests | count | tokens | varlen ms | per-request ms | per-request / varlen | max diff |",
             "|---|---|---|---|---|---|---|"]
    for name, c in res["cases"].items():
        lines.append(f"| {name} | {c['requests']} | {c['tokens']} | {c['varlen_ms']:.3f} | {c['per_request_ms']:.3f} | "
                     f"{c['speedup']:.2f}x | {c['max_abs_diff']:.3g} |")
    with open(os.path.join(a.out, "prefill_varlen.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "prefill_varlen.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
