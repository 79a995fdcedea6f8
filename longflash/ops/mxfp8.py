"""MXFP8 (OCP Microscaling v1.0) quantizer and dequantizer — the PyTorch reference.

Format (see shared/specs/mxfp8.md):
  * elements: FP8 E4M3 ("fn": max normal 448, no Inf, NaN = 0x7F/0xFF), stored as uint8 bytes;
  * groups of ``MX_BLOCK = 32`` consecutive elements along a row share one E8M0 scale byte ``b``
    meaning ``2^(b - 127)``; ``b = 0xFF`` is NaN; ``b = 0`` is 2^-127 (an fp32 subnormal).
  * layout: data ``[M, K_total]`` uint8 (or a float8_e4m3fn view), scales ``[M, K_total / 32]`` uint8,
    row-major; a slice of width K is written at columns ``[col0, col0 + K)`` and scale columns
    ``[col0 / 32, (col0 + K) / 32)``.

Scale mode RCEIL: ``scale = 2^ceil(log2(amax / 448))``, clamped to ``[2^-127, 2^127]``. It is computed
with integer operations on the fp32 bits of ``amax`` (no division, so no dependence on division
rounding or on flush-to-zero): for ``amax = 1.f * 2^e`` the smallest ``E`` with ``448 * 2^E >= amax``
is ``e - 8`` when ``1.f <= 1.75`` (mantissa bits ``<= 0x600000``) and ``e - 7`` otherwise, so

    byte = max(0, exp_bits(amax) - 8 + (mantissa_bits(amax) > 0x600000))

(an fp32-subnormal amax gives byte 0). This equals the spec's "fp32 bits of amax / 448, plus one if any
mantissa bit is set" wherever ``amax / 448`` is an fp32 normal, and is the exact ceiling below that.
With RCEIL ``|x| / scale <= 448``, so elements never saturate; the reference clamps to ±448 anyway
because PyTorch's eager fp32 -> float8_e4m3fn cast does not saturate.

Conventions (tested):
  * all-zero block -> scale byte 0, data bytes 0 (a -0.0 element keeps its sign: 0x80);
  * a block holding a NaN or ±Inf -> scale byte 0xFF and every data byte 0x7F (E4M3 NaN); NaN is
    mapped to +inf before the max, so a NaN never hides behind a larger finite value;
  * elements are round-to-nearest-even of ``x * 2^-E`` (an exact power-of-two scaling).
"""
from __future__ import annotations

import torch

MX_BLOCK = 32
E4M3_MAX = 448.0
SCALE_NAN = 0xFF
E4M3_NAN = 0x7F
# Elements handled per internal row chunk of the reference: bounds its fp32 temporaries (~16 bytes
# per element) whatever M and K are. Rows are independent, so chunking changes no byte.
_REF_CHUNK_ELEMS = 1 << 18


def _check_into_args(hidden: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, col0: int) -> torch.Tensor:
    """Validate ``quantize_mxfp8_into`` arguments; return ``data`` viewed as uint8."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [M, K], got shape {tuple(hidden.shape)}")
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must be floating point, got {hidden.dtype}")
    m, k = hidden.shape
    if k % MX_BLOCK != 0:
        raise ValueError(f"slice width {k} is not a multiple of {MX_BLOCK}")
    if col0 % MX_BLOCK != 0 or col0 < 0:
        raise ValueError(f"col0={col0} must be a non-negative multiple of {MX_BLOCK}")
    if data.dtype == torch.float8_e4m3fn:
        data = data.view(torch.uint8)
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise TypeError(f"data must be a 2-D uint8 or float8_e4m3fn tensor, got {data.dtype} {tuple(data.shape)}")
    if scales.dtype != torch.uint8 or scales.dim() != 2:
        raise TypeError(f"scales must be a 2-D uint8 tensor, got {scales.dtype} {tuple(scales.shape)}")
    if data.shape[0] != m or scales.shape[0] != m:
        raise ValueError(f"row count mismatch: hidden {m}, data {data.shape[0]}, scales {scales.shape[0]}")
    if data.shape[1] % MX_BLOCK != 0 or scales.shape[1] != data.shape[1] // MX_BLOCK:
        raise ValueError(f"scales {tuple(scales.shape)} do not match data {tuple(data.shape)} / {MX_BLOCK}")
    if col0 + k > data.shape[1]:
        raise ValueError(f"columns [{col0}, {col0 + k}) exceed data width {data.shape[1]}")
    if data.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError("data and scales must be contiguous along the last dimension")
    if hidden.device != data.device or hidden.device != scales.device:
        raise ValueError("hidden, data and scales must be on one device")
    return data


def rceil_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 RCEIL scale bytes from block maxima.

    Args:
        amax: fp32 tensor of block absolute maxima (>= 0; +inf or NaN marks a NaN block).
    Returns:
        uint8 tensor of the same shape: 0xFF for inf/NaN, else
        ``max(0, exp_bits - 8 + (mantissa_bits > 0x600000))``.
    """
    bits = amax.to(torch.float32).view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    byte = (exp - 8 + (mant > 0x600000).to(torch.int32)).clamp_(min=0)
    byte = torch.where(exp == 0xFF, torch.full_like(byte, SCALE_NAN), byte)
    return byte.to(torch.uint8)


def scale_bytes_to_float(scales: torch.Tensor) -> torch.Tensor:
    """fp32 value of E8M0 bytes: 2^(b - 127); byte 0 is the subnormal 2^-127; 0xFF is NaN."""
    b = scales.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == SCALE_NAN, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [m, k]`` (k % 32 == 0) -> (data uint8 [m, k], scales uint8 [m, k / 32])."""
    m, k = x.shape
    xg = x.to(torch.float32).reshape(m, k // MX_BLOCK, MX_BLOCK)
    ax = xg.abs()
    # NOTE: NaN -> +inf before the max, so a NaN anywhere makes the block's amax inf.
    ax = torch.where(torch.isnan(ax), torch.full_like(ax, float("inf")), ax)
    amax = ax.amax(dim=-1)
    sbytes = rceil_scale_bytes(amax)
    # Inverse scale 2^(127 - b) as fp32 bits ((254 - b) << 23); b <= 247 for finite fp32 amax, so it
    # is always an fp32 normal. NaN blocks use 1.0 here and are overwritten below.
    sb = sbytes.to(torch.int32)
    nan_block = sb == SCALE_NAN
    inv = torch.where(nan_block, torch.full_like(sb, 127), 254 - sb).clamp_(1, 254) << 23
    q = xg * inv.view(torch.float32).unsqueeze(-1)
    q = q.clamp_(-E4M3_MAX, E4M3_MAX)
    qb = q.to(torch.float8_e4m3fn).view(torch.uint8)
    qb = torch.where(nan_block.unsqueeze(-1), torch.full_like(qb, E4M3_NAN), qb)
    return qb.reshape(m, k), sbytes


def quantize_mxfp8_into(hidden: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, col0: int = 0) -> None:
    """Quantize ``hidden`` to MXFP8 into columns ``[col0, col0 + K)`` of caller-owned buffers.

    Args:
        hidden: [M, K] floating point (bf16/fp16/fp32), K % 32 == 0; any row stride.
        data: [M, K_total] uint8 or float8_e4m3fn, last dim contiguous; columns outside
            ``[col0, col0 + K)`` are not touched.
        scales: [M, K_total / 32] uint8, last dim contiguous; only scale columns
            ``[col0 / 32, (col0 + K) / 32)`` are written.
        col0: first column, a multiple of 32.
    Raises:
        ValueError / TypeError on shape, dtype, alignment or device mismatch (nothing is written).
    The reference processes about ``_REF_CHUNK_ELEMS`` elements at a time, so temporaries stay bounded.
    """
    data_u8 = _check_into_args(hidden, data, scales, col0)
    m, k = hidden.shape
    g0, g1 = col0 // MX_BLOCK, (col0 + k) // MX_BLOCK
    rows = max(1, _REF_CHUNK_ELEMS // max(k, 1))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        qb, sb = _quantize_rows(hidden[r0:r1])
        data_u8[r0:r1, col0:col0 + k].copy_(qb)
        scales[r0:r1, g0:g1].copy_(sb)


def quantize_mxfp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocating form: ``hidden [M, K]`` -> (data uint8 [M, K], scales uint8 [M, K / 32])."""
    m, k = hidden.shape
    data = torch.empty(m, k, dtype=torch.uint8, device=hidden.device)
    scales = torch.empty(m, k // MX_BLOCK, dtype=torch.uint8, device=hidden.device)
    quantize_mxfp8_into(hidden, data, scales, 0)
    return data, scales


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize MXFP8: ``e4m3(data) * 2^(scale - 127)``.

    Args:
        data: [M, K] uint8 or float8_e4m3fn (K % 32 == 0); scales: [M, K / 32] uint8.
        out_dtype: result dtype when ``out`` is None. fp32 is exact for every byte pair; bf16 is
            exact except where the product falls below bf16's subnormal range (|v| < 2^-126 with
            dropped bits), which only byte-0-scale blocks reach.
        out: optional [M, K] destination (e.g. a bounded scratch); written in place and returned.
    Returns:
        [M, K] tensor; blocks with scale 0xFF are NaN.
    """
    if data.dtype == torch.uint8:
        data = data.view(torch.float8_e4m3fn)
    m, k = data.shape
    if k % MX_BLOCK != 0 or tuple(scales.shape) != (m, k // MX_BLOCK):
        raise ValueError(f"scales {tuple(scales.shape)} do not match data {tuple(data.shape)}")
    if out is None:
        out = torch.empty(m, k, dtype=out_dtype, device=data.device)
    elif tuple(out.shape) != (m, k) or not out.is_floating_point() or out.stride(1) != 1:
        raise ValueError(f"out must be a floating [m, k] = {(m, k)} tensor contiguous in the last dim, "
                         f"got {out.dtype} {tuple(out.shape)}")
    # In place, so the only temporary is the [m, k / 32] scale tensor: E4M3 -> out dtype is exact
    # (fp32/bf16/fp16 hold every E4M3 value), then one multiplication by the fp32 power of two per
    # group, computed in fp32 and rounded once to the out dtype (same as the fp32 product, then a cast).
    out.copy_(data)
    out.view(m, k // MX_BLOCK, MX_BLOCK).mul_(scale_bytes_to_float(scales).unsqueeze(-1))
    return out
