"""Timing helpers shared by the kernel benchmarks (``attn_res_kernel.py``, ``fused_elementwise.py``,
``moe_routing.py``, ...): CUDA-graph timing per call, the device copy ceiling (eager, see ``copy_gbps``), and the
number of GPU launches of one eager call. Method: ``/work/.library/device/METHOD.md`` (back-to-back
calls in one graph remove the host's launch cost from the kernel's time)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longflash.bench_roofline import measure_copy_bandwidth  # noqa: E402
from longflash.ops.cuda_timing import graph_seconds  # noqa: E402,F401  (the benchmarks import it from here)


def copy_gbps(dev: torch.device, nbytes: int = 1 << 30, replays: int = 10) -> float:
    """Device copy bandwidth in GB/s (bytes read + written per second): ``bench_roofline.
    measure_copy_bandwidth``, an eager ``copy_`` of ``nbytes`` timed with events (median of ``replays``).

    NOTE: until session 26 this timed ``copy_`` inside a CUDA graph, which read 2.70-2.76 TB/s in every H200
    run while the eager copy read 4.0-4.2 TB/s (for uint8 too: ``mla_decode.py``'s ceiling). A contiguous
    ``copy_`` is a ``cudaMemcpyAsync``, captured as a memcpy node of the graph; why that node runs slower
    is not established (``benchmarks/NOTES.md``, session 26). The "of copy" columns this function fed
    before are ~1.5x high (``results/README.md`` lists them)."""
    return measure_copy_bandwidth(dev, nbytes, replays)


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


def kernel_times(fn, calls: int = 24) -> list[tuple[str, float]] | None:
    """Device time per call of each GPU kernel ``fn`` launches, in µs: ``fn(i)`` for i in 0..calls-1
    (eager, under the torch profiler; pass a ring of inputs so weights come from HBM as in a real step),
    each kernel's summed time / ``calls``, in launch order of the first call (names cut at 60 characters;
    a kernel launched more than once per call gets one entry per launch, ``name #1``, ``name #2``, ...; when
    the profiled events are not a multiple of ``calls``, repeated kernels are merged into one entry).
    Profiled kernels run without the launch gaps a dependency adds, so the sum is below the graph time.
    None off CUDA or when the profiler fails (informative only)."""
    if not torch.cuda.is_available():
        return None
    fn(0)
    torch.cuda.synchronize()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                fn(i)
            torch.cuda.synchronize()
        evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
        per_call = len(evs) // calls if len(evs) % calls == 0 else 0
        first = [x.name[:60] for x in evs[:per_call]]  # the first call's launches, in order
        tot: dict[str, float] = {}
        for i, e in enumerate(evs):
            name = e.name[:60]
            if per_call:  # the same launches every call: a kernel launched twice per call gets two entries
                if first.count(name) > 1:
                    name = f"{name} #{first[:i % per_call + 1].count(name)}"
            tot[name] = tot.get(name, 0.0) + e.device_time_total
        return [(k, v / calls) for k, v in tot.items()]
    except Exception as e:  # noqa: BLE001
        print(f"kernel times failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None
