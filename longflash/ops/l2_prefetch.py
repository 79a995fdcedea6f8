"""Prefetch a byte range of global memory into the GPU's L2 cache from inside a Triton kernel.

Why: a persistent kernel (e.g. ``layers/moe_decode_triton.py``) knows, once the routing is done, every byte
its later phases will read. Loads into registers are limited by the registers that hold them (a few 32 KB
blocks per SM in flight) and wait out a full memory latency per round; ``prefetch.global.L2`` instructions
(PTX ISA, "prefetch, prefetchu") return at once and let HBM stream the whole range into L2 at the copy rate
while the program computes; the later loads then hit L2. The H200's L2 (50 MB) holds one MoE sub-layer's
weights (~25 MB at the benchmark model's shapes). ``::evict_last`` keeps the lines over streaming data.

A prefetch changes no value, so the reference of a kernel that uses it is the kernel without it; in Triton's
CPU interpreter (no inline PTX) :func:`prefetch_l2` does nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

LINE_BYTES = tl.constexpr(128)  # L2 line size that one prefetch instruction covers (NVIDIA GPUs since Volta)


@triton.jit
def prefetch_l2(base_ptr, nbytes, part, parts, LINES: tl.constexpr, INTERPRET: tl.constexpr,
                EVICT_LAST: tl.constexpr):
    """Prefetch part ``part`` of ``parts`` of the ``nbytes`` bytes at ``base_ptr`` (any element type) into L2:
    the 128-byte lines ``part, part + parts, ...`` of the range, LINES per instruction batch (one per thread
    at LINES = 32 x num_warps). ``nbytes``: int (bytes); ``part`` / ``parts``: the caller's program id and
    program count, so a grid together covers the range once. ``EVICT_LAST``: the lines are kept over
    streaming data (``prefetch.global.L2::evict_last``), else a plain ``prefetch.global.L2``. The loop runs a
    scalar trip count (a vector test would synchronize the warps at every batch). No-op when INTERPRET."""
    if not INTERPRET:
        base = base_ptr.to(tl.pointer_type(tl.int8))
        n_lines = tl.cdiv(nbytes, LINE_BYTES)
        j = part + parts * tl.arange(0, LINES)
        for _ in range(0, tl.cdiv(n_lines - part, parts * LINES)):
            ok = j < n_lines
            ptr = base + tl.where(ok, j, 0).to(tl.int64) * LINE_BYTES
            # predicated: lanes past the range issue nothing
            if EVICT_LAST:
                tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t"
                                          "@p prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;\n\t}",
                                          "=r,l,r", [ptr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t"
                                          "@p prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;\n\t}",
                                          "=r,l,r", [ptr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
            j += parts * LINES


MAX_RANGES = 8  # byte ranges one prefetch_ranges launch takes


@triton.jit
def _prefetch_ranges_kernel(p0, n0, p1, n1, p2, n2, p3, n3, p4, n4, p5, n5, p6, n6, p7, n7,
                            NR: tl.constexpr, LINES: tl.constexpr, INTERPRET: tl.constexpr):
    """Prefetch the first NR of ranges (p_i, n_i bytes) into L2, in order, the grid splitting each range."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    prefetch_l2(p0, n0, pid, P, LINES, INTERPRET, False)
    if NR > 1:
        prefetch_l2(p1, n1, pid, P, LINES, INTERPRET, False)
    if NR > 2:
        prefetch_l2(p2, n2, pid, P, LINES, INTERPRET, False)
    if NR > 3:
        prefetch_l2(p3, n3, pid, P, LINES, INTERPRET, False)
    if NR > 4:
        prefetch_l2(p4, n4, pid, P, LINES, INTERPRET, False)
    if NR > 5:
        prefetch_l2(p5, n5, pid, P, LINES, INTERPRET, False)
    if NR > 6:
        prefetch_l2(p6, n6, pid, P, LINES, INTERPRET, False)
    if NR > 7:
        prefetch_l2(p7, n7, pid, P, LINES, INTERPRET, False)


def prefetch_ranges(tensors, programs: int = 32, num_warps: int = 4) -> None:
    """Prefetch the storage bytes of ``tensors`` (CUDA tensors, each contiguous: ``numel * element_size``
    bytes from its data pointer) into L2 with plain ``prefetch.global.L2`` instructions, in list order, one
    launch per ``MAX_RANGES`` tensors of ``programs`` programs. It changes no value; the caller runs it on a
    side stream so that HBM streams the weights of later kernels while the current ones are latency-bound
    (``runner/weight_prefetch.py``). Raises ValueError for a non-contiguous or non-CUDA tensor."""
    from longflash.ops.triton_env import interpreting
    tensors = [t for t in tensors if t.numel()]
    for t in tensors:
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"prefetch_ranges takes contiguous CUDA tensors, got {t.device} {tuple(t.shape)} "
                             f"strides {t.stride()}")
    for i in range(0, len(tensors), MAX_RANGES):
        chunk = tensors[i:i + MAX_RANGES]
        args = []
        for k in range(MAX_RANGES):
            t = chunk[k] if k < len(chunk) else chunk[0]
            args += [t, t.numel() * t.element_size() if k < len(chunk) else 0]
        _prefetch_ranges_kernel[(programs,)](*args, NR=len(chunk), LINES=32 * num_warps, INTERPRET=interpreting(),
                                             num_warps=num_warps)
