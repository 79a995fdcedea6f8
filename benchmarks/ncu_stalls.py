"""Summarize a Nsight Compute source page (``ncu -i REP --page source --csv --print-source sass``): the
share of warp-stall samples per stall reason, per SASS opcode (with its two main reasons), and the
executed-instruction mix. Used for the MLA decode profiles (``benchmarks/ncu_mla_decode.sh``).

    python3 benchmarks/ncu_stalls.py FILE.source.csv [...]
"""
from __future__ import annotations

import collections
import csv
import sys


def opcode(src: str) -> str:
    """The SASS opcode of a source line without predicate and modifiers (``@P0 LDS.U8 R1, [R2]`` -> LDS)."""
    parts = src.split()
    if not parts:
        return "?"
    op = parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]
    return op.split(".")[0]


def summarize(path: str, top: int = 10) -> str:
    rows = list(csv.reader(open(path)))
    hdr = rows[1]
    idx = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total, by_op, samples, executed = collections.Counter(), collections.defaultdict(collections.Counter), \
        collections.Counter(), collections.Counter()
    for r in rows[2:]:
        if len(r) < len(hdr):
            continue
        src = r[idx["Source"]].strip()
        op = opcode(src)
        samples[op] += int(r[idx["Warp Stall Sampling (All Samples)"]] or 0)
        executed[" ".join(src.split()[:1]) if not src.startswith("@") else src.split()[1]] += \
            int(r[idx["Instructions Executed"]] or 0)
        for s in stalls:
            v = int(r[idx[s]] or 0)
            total[s] += v
            by_op[op][s] += v
    n, ne = sum(total.values()) or 1, sum(executed.values()) or 1
    out = [f"{path}: {n} stall samples", "", "| stall reason | share |", "|---|---|"]
    out += [f"| {s[6:]} | {v / n:.3f} |" for s, v in total.most_common(top)]
    out += ["", "| opcode | share of samples | main stalls |", "|---|---|---|"]
    out += [f"| {op} | {v / n:.3f} | " + ", ".join(f"{s[6:]} {c / n:.3f}" for s, c in by_op[op].most_common(2)) + " |"
            for op, v in samples.most_common(top)]
    out += ["", "| instruction | share of executed |", "|---|---|"]
    out += [f"| {k} | {v / ne:.3f} |" for k, v in executed.most_common(top)]
    return "\n".join(out)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(summarize(p))
        print()
