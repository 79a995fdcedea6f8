"""Timing helpers shared by the kernel benchmarks (``attn_res_kernel.py``, ``fused_elementwise.py``,
``moe_routing.py``): CUDA-graph timing per call, the device copy ceiling timed the same way, and the
number of GPU launches of one eager call. Method: ``/work/.library/device/METHOD.md`` (back-to-back
calls in one graph remove the host's launch cost from the kernel's time)."""

from __future__ import annotations

import statistics
import sys
import time

import torch


def graph_seconds(fn, calls: int, replays: int) -> float:
    """Median seconds per call of ``fn``: ``calls`` back-to-back calls captured in one CUDA graph (after
    a warm-up call on the current and on a side stream: compiles, allocator), ``replays`` replays timed
    with events. Off CUDA (the CPU smoke runs): the wall time of one call."""
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


def copy_gbps(dev: torch.device, nbytes: int = 1 << 30, replays: int = 10) -> float:
    """Device copy bandwidth in GB/s (bytes read + written per second) of a ``nbytes / 2``-byte copy,
    timed like the kernels (:func:`graph_seconds`, 4 copies per graph)."""
    n = nbytes // 2 // 16 * 16
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * n / graph_seconds(lambda: dst.copy_(src), 4, replays) / 1e9


def kernel_count(fn) -> int | None:
    """GPU kernels (and memcpy/memset) one eager call of ``fn`` launches; None off CUDA or when the
    profiler fails (a count is informative only)."""
    if not torch.cuda.is_available():
        return None
    fn()
    torch.cuda.synchronize()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as e:  # noqa: BLE001
        print(f"launch count failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None
