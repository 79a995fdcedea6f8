"""Which memory layout of a fused projection weight a small-batch GEMM runs faster with on this GPU.

``F.linear(x, W)`` with ``W`` [N, K] row-major and with ``W`` the transposed view of a [K, N] row-major
tensor compute the same product, but cuBLAS picks different kernels for them. At batch 1 its choice for
some shapes is far from the bandwidth bound: on the H200, ``x [1, 2048] · W^T`` with N = 1024 (the
DeepSeek-V3-shaped benchmark model's fused shared-expert gate_up) runs an 8x64-tile kernel in 12.4 us,
while the [K, N] layout runs in 5.2 us, as fast as its neighbours N = 512 and 2112
(``benchmarks/results/small_gemms_gate_up.h200.md``). The engine asks once per shape, when it fuses
weights for decode (``GatedMLP.fuse_gate_up``), by timing both at one token.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from longflash.ops.cuda_timing import graph_seconds

logger = logging.getLogger("longflash")

# The [K, N] layout is taken only when it is this much faster: near-equal timings must not make two
# engine starts pick different kernels (and so different roundings) for the same weights.
MARGIN = 1.3


@functools.lru_cache(maxsize=256)
def kn_layout_faster(n: int, k: int, dtype: torch.dtype, device: str) -> bool:
    """True when ``F.linear(x, W)`` for one token x [1, k] and W [n, k] runs at least ``MARGIN`` times
    faster with W stored as a [k, n] row-major tensor (W its transposed view) than row-major [n, k],
    timed on ``device`` (a CUDA device string) with random weights. False off CUDA. Cached per shape."""
    if not device.startswith("cuda"):
        return False
    dev = torch.device(device)
    with torch.cuda.device(dev):
        w_nk = torch.randn(n, k, device=dev).to(dtype)
        w_kn = w_nk.t().contiguous()
        x = torch.randn(1, k, device=dev).to(dtype)
        # CUDA-graph replays as in a decode step: timed eagerly, the host's launch cost (~5 us per
        # F.linear) hides the kernels' difference
        t_nk = graph_seconds(lambda: F.linear(x, w_nk), calls=20, replays=5) * 1e6
        t_kn = graph_seconds(lambda: F.linear(x, w_kn.t()), calls=20, replays=5) * 1e6
    faster = t_kn * MARGIN < t_nk
    logger.info("fused weight [%d, %d] %s: one-token GEMM %.1f us as [N, K], %.1f us as [K, N]%s", n, k, dtype,
                 t_nk, t_kn, " (using [K, N])" if faster else "")
    return faster
