"""MXFP8 quantizer as a Triton kernel — same signature and bytes as ``longflash.ops.mxfp8``.

``quantize_mxfp8_into_triton(hidden, data, scales, col0)`` writes columns ``[col0, col0 + K)`` of
``data [M, K_total]`` and the matching scale columns, exactly like ``quantize_mxfp8_into``. One program
handles a ``[BLOCK_M, GROUPS, 32]`` tile: amax per group (NaN mapped to +inf first, since ``tl.max``
drops NaN on sm90), RCEIL scale byte from the fp32 bits of amax, elements scaled by the exact power of
two ``2^(127 - b)`` and rounded to E4M3.

E4M3 rounding has two implementations, selected by ``rounding``:
  * ``"bits"``: round-to-nearest-even with integer operations on the fp32 bits (exact everywhere,
    including ``TRITON_INTERPRET=1``, whose emulated ``.to(tl.float8e4nv)`` rounds wrongly);
  * ``"native"``: the hardware cast (``cvt.rn.satfinite`` on sm90) after clamping to ±448.
  Default: ``"bits"`` under the interpreter, ``"native"`` on a GPU. Both give the reference's bytes.

Subnormal inputs: the kernel uses plain fp32 multiplies (no libdevice), which Triton's NVIDIA
backend compiles without flush-to-zero, so bf16/fp32 subnormals scale exactly as in the reference.

Triton is imported lazily, so the package imports on installs without it.
"""
from __future__ import annotations

import os

import torch

from longflash.ops.mxfp8 import MX_BLOCK, _check_into_args

DEFAULT_BLOCK_M = 16
DEFAULT_GROUPS = 8
DEFAULT_NUM_WARPS = 4


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Built on first use. NOTE: a plain global (not functools.lru_cache) so that torch.compile traces
# ``quantize_mxfp8_into_triton`` as a call of a user-defined Triton kernel without graph breaks.
_KERNEL = None
_KERNEL_INTERPRETED = False


def _kernel():
    global _KERNEL, _KERNEL_INTERPRETED
    if _KERNEL is None:
        _KERNEL_INTERPRETED = _interpreting()
        _KERNEL = _build_kernel()
    return _KERNEL


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _e4m3_bits(q):
        """|q| <= 448 fp32 -> E4M3 byte (int32), round-to-nearest-even, integer ops only."""
        bits = q.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        # Normal E4M3 range (|q| >= 2^-6): keep 3 mantissa bits, RNE, rebias exponent 127 -> 7.
        rne = a + 0x7FFFF + ((a >> 20) & 1)
        normal = (rne >> 20) - (120 << 3)
        # Subnormal E4M3 (|q| < 2^-6): value / 2^-9 = mant24 >> (141 - exp), RNE on the dropped bits.
        e = a >> 23
        mant24 = (a & 0x7FFFFF) | 0x800000
        s = tl.minimum(tl.maximum(141 - e, 1), 26)
        quo = mant24 >> s
        rem = mant24 & ((1 << s) - 1)
        half = 1 << (s - 1)
        up = (rem > half) | ((rem == half) & ((quo & 1) == 1))
        sub = quo + up.to(tl.int32)
        sub = tl.where(e == 0, 0, sub)  # fp32 subnormals (< 2^-126) round to 0
        mag = tl.where(a >= 0x3C800000, normal, sub)
        mag = tl.minimum(mag, 0x7E)  # saturate (unreachable with RCEIL; kept for safety)
        return sign | mag

    # NOTE: Triton resolves callee names through the module globals (jit and interpreter alike),
    # so the helper defined in this lazy factory is published there before the kernel is built.
    globals()["_e4m3_bits"] = _e4m3_bits

    @triton.jit
    def _quantize_mxfp8_kernel(
        x_ptr, data_ptr, scales_ptr,
        M, NUM_GROUPS,
        stride_xm, stride_dm, stride_sm,
        col0, group0,
        BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, BITS_ROUNDING: tl.constexpr, IS_BF16: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_g = tl.program_id(1)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        groups = pid_g * GROUPS + tl.arange(0, GROUPS)
        lanes = tl.arange(0, 32)
        row_ok = rows < M
        grp_ok = groups < NUM_GROUPS
        mask2 = row_ok[:, None] & grp_ok[None, :]
        mask3 = mask2[:, :, None]
        cols = (groups[:, None] * 32 + lanes[None, :]).to(tl.int64)  # [GROUPS, 32] within the slice
        x_offs = rows[:, None, None] * stride_xm + cols[None, :, :]
        if IS_BF16:
            # bf16 -> fp32 is a 16-bit shift; done on the bits because the interpreter's bf16 cast
            # mangles subnormals (9.2e-41 -> 0). Identical to the hardware conversion on a GPU.
            xb = tl.load(x_ptr.to(tl.pointer_type(tl.uint16)) + x_offs, mask=mask3, other=0)
            x = (xb.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_ptr + x_offs, mask=mask3, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        ax = tl.where(ax != ax, float("inf"), ax)  # NaN -> +inf before the max
        amax = tl.max(ax, axis=2)
        abits = amax.to(tl.int32, bitcast=True)
        aexp = (abits >> 23) & 0xFF
        amant = abits & 0x7FFFFF
        sbyte = tl.maximum(aexp - 8 + (amant > 0x600000).to(tl.int32), 0)
        nan_block = aexp == 0xFF
        sbyte = tl.where(nan_block, 0xFF, sbyte)
        inv_bits = tl.where(nan_block, 127, tl.minimum(tl.maximum(254 - sbyte, 1), 254)) << 23
        inv = inv_bits.to(tl.float32, bitcast=True)
        q = x * inv[:, :, None]
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        if BITS_ROUNDING:
            qb = _e4m3_bits(q)
        else:
            qb = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        qb = tl.where(nan_block[:, :, None], 0x7F, qb)
        tl.store(data_ptr + rows[:, None, None] * stride_dm + col0 + cols[None, :, :],
                 qb.to(tl.uint8), mask=mask3)
        tl.store(scales_ptr + rows[:, None] * stride_sm + group0 + groups[None, :].to(tl.int64),
                 sbyte.to(tl.uint8), mask=mask2)

    return _quantize_mxfp8_kernel


def quantize_mxfp8_into_triton(hidden: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, col0: int = 0, *,
                               rounding: str | None = None, block_m: int = DEFAULT_BLOCK_M,
                               groups: int = DEFAULT_GROUPS, num_warps: int = DEFAULT_NUM_WARPS) -> None:
    """Triton twin of ``longflash.ops.mxfp8.quantize_mxfp8_into`` (same args, same bytes, same errors).

    Extra keyword args: ``rounding`` in {None, "bits", "native"} (see module doc); tile shape
    ``block_m`` rows x ``groups`` groups of 32 per program; ``num_warps``.
    """
    data_u8 = _check_into_args(hidden, data, scales, col0)
    if hidden.stride(1) != 1:
        raise ValueError("hidden must be contiguous along the last dimension")
    kernel = _kernel()
    if rounding is None:
        rounding = "bits" if (_KERNEL_INTERPRETED or not hidden.is_cuda) else "native"
    if rounding not in ("bits", "native"):
        raise ValueError(f"rounding must be 'bits' or 'native', got {rounding!r}")
    m, k = hidden.shape
    num_groups = k // MX_BLOCK
    if m == 0 or k == 0:
        return
    grid = ((m + block_m - 1) // block_m, (num_groups + groups - 1) // groups)
    kernel[grid](
        hidden, data_u8, scales,
        m, num_groups,
        hidden.stride(0), data_u8.stride(0), scales.stride(0),
        col0, col0 // MX_BLOCK,
        BLOCK_M=block_m, GROUPS=groups, BITS_ROUNDING=(rounding == "bits"),
        IS_BF16=(hidden.dtype == torch.bfloat16),
        num_warps=num_warps,
    )
