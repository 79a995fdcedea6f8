"""Seconds per call of a GPU function, timed as CUDA-graph replays (``/work/.library/device/METHOD.md``:
back-to-back calls in one graph remove the host's launch cost from the kernel's time). Used by the
engine where it picks a kernel by timing (``layers/gemm_layout.py``) and by the benchmarks
(``benchmarks/gpu_timing.py``)."""

from __future__ import annotations

import statistics
import time

import torch


def graph_seconds(fn, calls: int, replays: int) -> float:
    """Median seconds per call of ``fn``: ``calls`` back-to-back calls captured in one CUDA graph (after
    a warm-up call on the current and on a side stream: compiles, allocator, cuBLAS workspace),
    ``replays`` replays timed with events. Off CUDA (the CPU smoke runs): the wall time of one call."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    fn()
    torch.cuda.synchronize()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        fn()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    del g
    return statistics.median(times)
