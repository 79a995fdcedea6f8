"""Timing helpers shared by the kernel benchmarks (``attn_res_kernel.py``, ``fused_elementwise.py``,
``moe_routing.py``): CUDA-graph timing per call, the device copy ceiling timed the same way, and the
number of GPU launches of one eager call. Method: ``/work/.library/device/METHOD.md`` (back-to-back
calls in one graph remove the host's launch cost from the kernel's time)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longflash.ops.cuda_timing import graph_seconds  # noqa: E402,F401  (the benchmarks import it from here)


def copy_gbps(dev: torch.device, nbytes: int = 1 << 30, replays: int = 10) -> float:
    """Device copy bandwidth in GB/s (bytes read + written per second) of a ``nbytes / 2``-byte copy of
    random int32 words, timed like the kernels (:func:`graph_seconds`, 4 copies per graph).

    NOTE: int32, not uint8: a uint8 ``copy_`` measured 2.70-2.76 TB/s in every H200 run where copies of
    4-byte elements measured the 4.0-4.2 TB/s ceiling (``benchmarks/NOTES.md``, session 26; likely cause:
    PyTorch's elementwise copy moves a fixed number of elements, not bytes, per thread). Until session 26 this function copied
    uint8, so the "of copy" columns of the results it fed (``results/README.md`` lists them) are ~1.5x high."""
    n = nbytes // 2 // 16 * 4
    src = torch.empty(n, dtype=torch.int32, device=dev).random_()
    dst = torch.empty_like(src)
    return 2 * n * 4 / graph_seconds(lambda: dst.copy_(src), 4, replays) / 1e9


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
