"""MXFP8 quantizer and dequantizer as Triton kernels — same signatures and bytes as ``longflash.ops.mxfp8``.

``quantize_mxfp8_into_triton(hidden, data, scales, col0)`` writes columns ``[col0, col0 + K)`` of
``data [M, K_total]`` and the matching scale columns, exactly like ``quantize_mxfp8_into``.
``dequantize_mxfp8_triton(data, scales, out)`` writes ``bf16(e4m3 * 2^(b - 127))`` into a bf16 ``out``
(e.g. the projection's bounded scratch) in one pass: the bytes of ``dequantize_mxfp8(..., out=bf16)``.

Both kernels run one program per (row block, column block): a ``[BLOCK_M, BLOCK_K]`` tile
(``BLOCK_K = 32 * groups``) is loaded as one 2-D block with wide contiguous accesses, reshaped to
``[BLOCK_M, groups, 32]`` for the per-group work, and written back as a 2-D tile (scales as a
``[BLOCK_M, groups]`` tile). Base offsets are int64, in-tile offsets int32. Tiles come from a fixed
config table keyed by the slice width K (``quantize_config`` / ``dequantize_config``; no autotuning, so
launches are deterministic and capture/compile friendly); keyword args override it.

Quantizer: amax per group, RCEIL scale byte from the fp32 bits of amax, elements scaled by the exact
power of two ``2^(127 - b)`` and rounded to E4M3. Two implementations, selected by ``rounding``:
  * ``"bits"``: NaN mapped to +inf before ``tl.max`` (which drops NaN on sm90), round-to-nearest-even
    with integer operations on the fp32 bits, NaN blocks set to 0x7F by a select (exact everywhere,
    including ``TRITON_INTERPRET=1``, whose emulated ``.to(tl.float8e4nv)`` rounds wrongly);
  * ``"native"`` (the GPU path, ~8 instructions per element instead of ~18): a NaN-propagating max
    (``FMNMX.NAN``; a NaN or inf amax has exponent bits 0xFF either way), the hardware cast
    (``cvt.rn.satfinite``, no clamp: RCEIL keeps ``|q| <= 448`` and the cast saturates anyway), and NaN
    blocks multiplied by NaN (the GPU's NaN product is the canonical NaN, which the cast turns into
    0x7F) instead of a per-byte select.
  Default: ``"bits"`` under the interpreter, ``"native"`` on a GPU. Both give the reference's bytes.
The dequantizer decodes E4M3 exactly (the hardware upcast on a GPU, integer operations in the
interpreter), multiplies by the fp32 scale (one rounding-free fp32 product, as the torch path computes
it) and rounds to bf16 with the hardware cast on a GPU (``"native"``) or integer round-to-nearest-even
in the interpreter (``"bits"``).

Subnormals: the kernels use plain fp32 multiplies (no libdevice), which Triton's NVIDIA backend compiles
without flush-to-zero, so subnormal inputs and products are exact as in the reference.

Triton is imported lazily, so the package imports on installs without it.
"""
from __future__ import annotations

import os

import torch

from longflash.ops import triton_launch
from longflash.ops.mxfp8 import MX_BLOCK, _check_into_args

# Fallback tile when no keyword override is given and K matches no table row (see quantize_config).
DEFAULT_BLOCK_M = 8
DEFAULT_GROUPS = 32
DEFAULT_NUM_WARPS = 8


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Config tables: (block_m, groups, num_warps) by slice width K. Each program moves BLOCK_M * 32 *
# groups elements (16-32 KiB of bf16 in flight with 8 warps: 32 elements per thread, i.e. four 16-byte
# loads and two 16-byte stores). groups is the largest of 32/16/8/4/2/1 dividing K / 32, so the column
# mask disappears (EVEN_K); K = 7168 = 7 * 1024 gives 1024-wide tiles.
_QUANT_TILE_ELEMS = 8192
_DEQUANT_TILE_ELEMS = 16384


def _pick_groups(num_groups: int) -> int:
    for g in (32, 16, 8, 4, 2, 1):
        if num_groups % g == 0:
            return g
    return 1


def _table(m: int, k: int, tile_elems: int) -> tuple[int, int, int]:
    groups = _pick_groups(max(1, k // MX_BLOCK))
    block_m = max(1, min(tile_elems // (MX_BLOCK * groups), 64))
    while block_m > 1 and block_m // 2 >= m:  # decode-sized M: no more than half the tile's rows empty
        block_m //= 2  # (a loop, not int.bit_length, so torch.compile can trace it with symbolic M)
    elems = block_m * groups * MX_BLOCK
    num_warps = 8 if elems >= 8192 else (4 if elems >= 2048 else (2 if elems >= 512 else 1))
    return block_m, groups, num_warps


def quantize_config(m: int, k: int) -> tuple[int, int, int]:
    """(block_m, groups, num_warps) for quantizing an [m, k] slice. K = 7168: (8, 32, 8)."""
    return _table(m, k, _QUANT_TILE_ELEMS)


def dequantize_config(m: int, k: int) -> tuple[int, int, int]:
    """(block_m, groups, num_warps) for dequantizing [m, k]. K = 43008: (16, 32, 8)."""
    return _table(m, k, _DEQUANT_TILE_ELEMS)


# Built on first use. NOTE: plain globals (not functools.lru_cache) so that torch.compile traces the
# launchers as calls of user-defined Triton kernels without graph breaks.
_KERNEL = None
_DEQUANT_KERNEL = None
_KERNEL_INTERPRETED = False


def _kernel():
    global _KERNEL, _DEQUANT_KERNEL, _KERNEL_INTERPRETED
    if _KERNEL is None:
        _KERNEL_INTERPRETED = _interpreting()
        _KERNEL, _DEQUANT_KERNEL = _build_kernels()
    return _KERNEL


def _dequant_kernel():
    if _DEQUANT_KERNEL is None:
        _kernel()
    return _DEQUANT_KERNEL


def _check_tile_offsets(block_m: int, *strides: int) -> None:
    if block_m * max(max(strides), 1) >= 2 ** 31:
        raise ValueError(f"block_m={block_m} x row stride {max(strides)} overflows the kernel's int32 in-tile offsets")


def _build_kernels():
    from longflash.ops import mxfp8_kernels
    return mxfp8_kernels._quantize_mxfp8_kernel, mxfp8_kernels._dequantize_mxfp8_kernel


def quantize_mxfp8_into_triton(hidden: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, col0: int = 0, *,
                               rounding: str | None = None, block_m: int | None = None,
                               groups: int | None = None, num_warps: int | None = None) -> None:
    """Triton twin of ``longflash.ops.mxfp8.quantize_mxfp8_into`` (same args, same bytes, same errors).

    Extra keyword args: ``rounding`` in {None, "bits", "native"} (see module doc); tile shape
    ``block_m`` rows x ``groups`` groups of 32 per program (powers of two) and ``num_warps``;
    None takes ``quantize_config(M, K)``.

    On CUDA in eager mode a repeated call (same dtypes, shapes, strides, devices, alignment, ``col0`` and
    options) skips the checks and Triton's launcher: ``triton_launch`` launches the kernel compiled by
    the first such call directly (host time per call, this CPU with the driver stubbed: 40-53 -> 4-14 µs;
    the GPU benchmark measures it: ``benchmarks/NOTES.md``).
    """
    key = None
    if triton_launch.usable(hidden):
        key = triton_launch.layout_key("mxfp8_quantize", (hidden, data, scales),
                                       (col0, rounding, block_m, groups, num_warps))
        if triton_launch.launch(key, (hidden, data, scales)):
            return
    data_u8 = _check_into_args(hidden, data, scales, col0)
    if hidden.stride(1) != 1:
        raise ValueError("hidden must be contiguous along the last dimension")
    kernel = _kernel()
    if rounding is None:
        rounding = "bits" if (_KERNEL_INTERPRETED or not hidden.is_cuda) else "native"
    if rounding not in ("bits", "native"):
        raise ValueError(f"rounding must be 'bits' or 'native', got {rounding!r}")
    m, k = hidden.shape
    if m == 0 or k == 0:
        return
    tb, tg, tw = quantize_config(m, k)
    block_m = tb if block_m is None else block_m
    groups = tg if groups is None else groups
    num_warps = tw if num_warps is None else num_warps
    block_k = groups * MX_BLOCK
    _check_tile_offsets(block_m, hidden.stride(0), data_u8.stride(0), scales.stride(0))
    grid = (triton_cdiv(m, block_m), triton_cdiv(k, block_k))
    scalars = (m, k, hidden.stride(0), data_u8.stride(0), scales.stride(0), col0, col0 // MX_BLOCK)
    consts = dict(BLOCK_M=block_m, BLOCK_K=block_k, EVEN_M=(m % block_m == 0), EVEN_K=(k % block_k == 0),
                  BITS_ROUNDING=(rounding == "bits"), IS_BF16=(hidden.dtype == torch.bfloat16))
    compiled = kernel[grid](hidden, data_u8, scales, *scalars, **consts, num_warps=num_warps)
    if key is not None:
        triton_launch.store(key, compiled, grid, scalars + tuple(consts.values()))


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def dequantize_mxfp8_triton(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *,
                            rounding: str | None = None, block_m: int | None = None, groups: int | None = None,
                            num_warps: int | None = None) -> torch.Tensor:
    """Fused MXFP8 -> bf16 into ``out`` (one pass); bytes of ``dequantize_mxfp8(data, scales, out=out)``.

    Args:
        data: [M, K] uint8 / float8_e4m3fn (last dim contiguous); scales: [M, K / 32] uint8.
        out: [M, K] bf16, last dim contiguous (e.g. a row-chunk view of the projection scratch).
        rounding: bf16 rounding, None (native on a GPU, integer RNE in the interpreter), "bits", "native".
        block_m / groups / num_warps: tile override; None takes ``dequantize_config(M, K)``.
    Returns:
        ``out``.
    Raises:
        TypeError / ValueError on dtype, shape, stride or device mismatch.
    A repeated call on CUDA in eager mode launches from a cached plan, as ``quantize_mxfp8_into_triton``.
    """
    key = None
    if triton_launch.usable(data):
        key = triton_launch.layout_key("mxfp8_dequantize", (data, scales, out), (rounding, block_m, groups, num_warps))
        if triton_launch.launch(key, (data, scales, out)):
            return out
    if data.dtype == torch.float8_e4m3fn:
        data = data.view(torch.uint8)
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise TypeError(f"data must be a 2-D uint8/float8_e4m3fn tensor, got {data.dtype} {tuple(data.shape)}")
    m, k = data.shape
    if k % MX_BLOCK != 0 or scales.dtype != torch.uint8 or tuple(scales.shape) != (m, k // MX_BLOCK):
        raise ValueError(f"scales {scales.dtype} {tuple(scales.shape)} do not match data {tuple(data.shape)}")
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (m, k):
        raise ValueError(f"out must be bf16 [{m}, {k}], got {out.dtype} {tuple(out.shape)}")
    if data.stride(1) != 1 or scales.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("data, scales and out must be contiguous along the last dimension")
    if not (data.device == scales.device == out.device):
        raise ValueError("data, scales and out must be on one device")
    kernel = _dequant_kernel()
    if rounding is None:
        rounding = "bits" if (_KERNEL_INTERPRETED or not data.is_cuda) else "native"
    if rounding not in ("bits", "native"):
        raise ValueError(f"rounding must be 'bits' or 'native', got {rounding!r}")
    if m == 0 or k == 0:
        return out
    tb, tg, tw = dequantize_config(m, k)
    block_m = tb if block_m is None else block_m
    groups = tg if groups is None else groups
    num_warps = tw if num_warps is None else num_warps
    block_k = groups * MX_BLOCK
    _check_tile_offsets(block_m, data.stride(0), scales.stride(0), out.stride(0))
    grid = (triton_cdiv(m, block_m), triton_cdiv(k, block_k))
    scalars = (m, k, data.stride(0), scales.stride(0), out.stride(0))
    consts = dict(BLOCK_M=block_m, BLOCK_K=block_k, EVEN_M=(m % block_m == 0), EVEN_K=(k % block_k == 0),
                  BITS_ROUNDING=(rounding == "bits"))
    compiled = kernel[grid](data, scales, out, *scalars, **consts, num_warps=num_warps)
    if key is not None:
        triton_launch.store(key, compiled, grid, scalars + tuple(consts.values()))
    return out
