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
def prefetch_l2(base_ptr, nbytes, part, parts, LINES: tl.constexpr, INTERPRET: tl.constexpr):
    """Prefetch part ``part`` of ``parts`` of the ``nbytes`` bytes at ``base_ptr`` (any element type) into L2:
    the 128-byte lines ``part, part + parts, ...`` of the range, LINES per instruction batch (one per thread
    at LINES = 32 x num_warps). ``nbytes``: int (bytes); ``part`` / ``parts``: the caller's program id and
    program count, so a grid together covers the range once. The loop runs a scalar trip count (session 28;
    a vector loop test synchronized the warps at every batch; the MoE kernel measured 27.2 against 27.8 µs).
    No-op when INTERPRET."""
    if not INTERPRET:
        base = base_ptr.to(tl.pointer_type(tl.int8))
        n_lines = tl.cdiv(nbytes, LINE_BYTES)
        j = part + parts * tl.arange(0, LINES)
        for _ in range(0, tl.cdiv(n_lines - part, parts * LINES)):
            ok = j < n_lines
            ptr = base + tl.where(ok, j, 0).to(tl.int64) * LINE_BYTES
            # predicated: lanes past the range issue nothing
            tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t"
                                      "@p prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;\n\t}",
                                      "=r,l,r", [ptr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
            j += parts * LINES
