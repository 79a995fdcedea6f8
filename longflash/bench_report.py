"""Benchmark metrics and the report, in the format of ``vllm bench serve``.

Per request the client (offline loop or HTTP stream) records when it was sent, when each chunk of
tokens arrived and how many tokens it produced. From those: TTFT (first chunk - send), TPOT ((last
chunk - first chunk) / (output tokens - 1), requests with >= 2 tokens), ITL (gaps between consecutive
chunks; a speculative step delivers several tokens in one chunk, as in vLLM), E2EL (last chunk -
send), each as mean / median / p99 in ms; request, output-token and total-token throughput over the
benchmark's duration; speculative decoding's acceptance rate (accepted / draft tokens) and acceptance
length (1 + accepted / drafts, vLLM's definition); and the bandwidth roofline of the decode steps
(``bench_roofline``): bytes per step, step time, achieved GB/s and its fraction of the peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestTiming:
    """One request: send time, chunk arrival times (s, one clock), token counts, success."""

    start: float
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    ok: bool = True
    error: str = ""


def _stats(values_s: list[float], name: str) -> dict:
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    if ms.size == 0:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(timings: list[RequestTiming], duration_s: float, spec: dict | None = None,
              roofline: dict | None = None) -> dict:
    """Metrics of a run (module docstring). ``spec``: counter deltas ``num_drafts``,
    ``num_draft_tokens``, ``num_accepted_tokens`` (None: no speculative decoding). ``roofline``:
    ``bytes`` and ``seconds`` summed over decode steps, ``steps``, ``peak_gbs`` (None: not measured)."""
    done = [t for t in timings if t.ok and t.chunk_times]
    ttft = [t.chunk_times[0] - t.start for t in done]
    tpot = [(t.chunk_times[-1] - t.chunk_times[0]) / (t.output_tokens - 1) for t in done if t.output_tokens > 1]
    itl = [b - a for t in done for a, b in zip(t.chunk_times, t.chunk_times[1:])]
    e2el = [t.chunk_times[-1] - t.start for t in done]
    n_in, n_out = sum(t.prompt_tokens for t in done), sum(t.output_tokens for t in done)
    m = {"completed": len(done), "failed": len(timings) - len(done), "duration_s": duration_s,
         "total_input_tokens": n_in, "total_output_tokens": n_out,
         "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
         "output_throughput": n_out / duration_s if duration_s > 0 else 0.0,
         "total_token_throughput": (n_in + n_out) / duration_s if duration_s > 0 else 0.0,
         **_stats(ttft, "ttft"), **_stats(tpot, "tpot"), **_stats(itl, "itl"), **_stats(e2el, "e2el")}
    if spec is not None:
        drafts, dtoks, acc = spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]
        m.update(spec_decode_num_drafts=drafts, spec_decode_draft_tokens=dtoks, spec_decode_accepted_tokens=acc,
                 spec_decode_acceptance_rate=100.0 * acc / dtoks if dtoks else 0.0,
                 spec_decode_acceptance_length=1.0 + acc / drafts if drafts else 1.0)
    if roofline is not None and roofline.get("steps"):
        steps, nbytes, secs = roofline["steps"], roofline["bytes"], roofline["seconds"]
        gbs = nbytes / secs / 1e9 if secs > 0 else 0.0
        m.update(decode_steps=steps, decode_bytes_per_step=nbytes / steps, decode_step_ms=1e3 * secs / steps,
                 achieved_bandwidth_gbs=gbs, peak_bandwidth_gbs=roofline["peak_gbs"],
                 bandwidth_roofline_fraction=gbs / roofline["peak_gbs"] if roofline["peak_gbs"] else 0.0)
        if roofline.get("estimated"):
            m["roofline_estimated_from"] = roofline["estimated"]
    return m


def format_report(m: dict, title: str = "Serving Benchmark Result") -> str:
    """The report as ``vllm bench serve`` prints it, plus a bandwidth-roofline section."""
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(label, value, fmt=".2f"):
        lines.append(f"{label:<40} {value:<10{fmt}}")

    def section(name):
        lines.append(f"{name:-^50}")

    row("Successful requests:", m["completed"], "")
    if m.get("failed"):
        row("Failed requests:", m["failed"], "")
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"], "")
    row("Total generated tokens:", m["total_output_tokens"], "")
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    for key, name, head in (("ttft", "TTFT", "Time to First Token"),
                            ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                            ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency")):
        section(head)
        row(f"Mean {name} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", m[f"median_{key}_ms"])
        row(f"P99 {name} (ms):", m[f"p99_{key}_ms"])
    if "spec_decode_acceptance_length" in m:
        section("Speculative Decoding")
        row("Acceptance rate (%):", m["spec_decode_acceptance_rate"])
        row("Acceptance length:", m["spec_decode_acceptance_length"])
        row("Drafts:", m["spec_decode_num_drafts"], "")
        row("Draft tokens:", m["spec_decode_draft_tokens"], "")
        row("Accepted tokens:", m["spec_decode_accepted_tokens"], "")
    if "achieved_bandwidth_gbs" in m:
        section("Bandwidth Roofline" + (" (estimated)" if "roofline_estimated_from" in m else ""))
        if "roofline_estimated_from" not in m:
            row("Decode steps:", m["decode_steps"], "")
        row("Bytes read per decode step (MB):", m["decode_bytes_per_step"] / 1e6)
        row("Decode step time (ms):", m["decode_step_ms"], ".3f")
        row("Achieved bandwidth (GB/s):", m["achieved_bandwidth_gbs"])
        row("Peak (copy) bandwidth (GB/s):", m["peak_bandwidth_gbs"])
        row("Fraction of bandwidth roofline:", m["bandwidth_roofline_fraction"], ".3f")
    lines.append("=" * 50)
    return "\n".join(lines)
