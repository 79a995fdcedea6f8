"""The MXFP8 Triton kernels (quantize, dequantize) and their ``@triton.jit`` helpers, at module level.

Imported lazily by ``longflash.ops.mxfp8_triton`` (the launchers, config tables and documentation of
what the kernels compute); this module imports Triton, so ``longflash`` never needs it otherwise.

NOTE: the helpers (``_max_propagate_nan``, ``_e4m3_bits``, ``_bf16_bits_rne``) must stay module-level
globals of this file. Inductor, compiling a graph that launches a user-defined Triton kernel
(``torch.compile``), re-generates the kernel's source plus every ``@triton.jit`` function the kernel
names among its globals (``fn.__code__.co_names`` looked up in ``fn.__globals__``); a helper captured
from an enclosing function (a closure variable) is not found there, and the re-generated kernel fails
with ``NameError: '_max_propagate_nan' is not defined`` (the first H200 run, commit 77f87ea).
Whether ``TRITON_INTERPRET=1`` applies is decided when this module is first imported.
"""
from __future__ import annotations

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


@triton.jit
def _bf16_bits_rne(v):
    """fp32 -> bf16 bits (int32), round-to-nearest-even. NaN -> 0xFFFF, the NaN of ATen's
    vectorized CPU fp32 -> bf16 conversion, which the CPU torch path produces (on a GPU both the
    torch path and the hardware cast give the canonical 0x7FFF)."""
    bits = v.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, 0xFFFF, r & 0xFFFF)


@triton.jit
def _max_propagate_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)



@triton.jit
def _quantize_mxfp8_kernel(
    x_ptr, data_ptr, scales_ptr,
    M, K,
    stride_xm, stride_dm, stride_sm,
    col0, group0,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_M: tl.constexpr, EVEN_K: tl.constexpr,
    BITS_ROUNDING: tl.constexpr, IS_BF16: tl.constexpr,
):
    G: tl.constexpr = BLOCK_K // 32
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    # int64 only for the tile's base (row0 * stride can exceed 2^31); in-tile offsets are int32
    # (the launcher checks BLOCK_M * stride < 2^31), which keeps address math cheap and lets the
    # compiler prove contiguity for wide vector loads/stores.
    row0 = pid_m.to(tl.int64) * BLOCK_M
    k0 = pid_k * BLOCK_K
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rg = tl.arange(0, G)
    x_tile = x_ptr + row0 * stride_xm + k0
    d_tile = data_ptr + row0 * stride_dm + col0 + k0
    s_tile = scales_ptr + row0 * stride_sm + group0 + pid_k * G
    x_offs = rm[:, None] * stride_xm + rk[None, :]
    d_offs = rm[:, None] * stride_dm + rk[None, :]
    s_offs = rm[:, None] * stride_sm + rg[None, :]
    if EVEN_M and EVEN_K:
        if IS_BF16:
            # bf16 -> fp32 is a 16-bit shift; done on the bits because the interpreter's bf16 cast
            # mangles subnormals (9.2e-41 -> 0). Identical to the hardware conversion on a GPU.
            xb = tl.load(x_tile.to(tl.pointer_type(tl.uint16)) + x_offs)
            x = (xb.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_tile + x_offs).to(tl.float32)
    else:
        mask = (rm < M - row0)[:, None] & (rk < K - k0)[None, :]
        if IS_BF16:
            xb = tl.load(x_tile.to(tl.pointer_type(tl.uint16)) + x_offs, mask=mask, other=0)
            x = (xb.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_tile + x_offs, mask=mask, other=0.0).to(tl.float32)
    x3 = tl.reshape(x, (BLOCK_M, G, 32))
    if BITS_ROUNDING:
        ax = tl.abs(x3)
        ax = tl.where(ax != ax, float("inf"), ax)  # NaN -> +inf before the max
        amax = tl.max(ax, axis=2)
    else:
        # one NaN-propagating max per element (FMNMX.NAN, |x| a free operand modifier): a NaN
        # block's amax is NaN, whose exponent bits are 0xFF like those of inf
        amax = tl.reduce(tl.abs(x3), 2, _max_propagate_nan)
    abits = amax.to(tl.int32, bitcast=True)
    aexp = (abits >> 23) & 0xFF
    amant = abits & 0x7FFFFF
    sbyte = tl.maximum(aexp - 8 + (amant > 0x600000).to(tl.int32), 0)
    nan_block = aexp == 0xFF
    sbyte = tl.where(nan_block, 0xFF, sbyte)
    inv_bits = tl.where(nan_block, 127, tl.minimum(tl.maximum(254 - sbyte, 1), 254)) << 23
    if BITS_ROUNDING:
        inv = inv_bits.to(tl.float32, bitcast=True)
        q = x3 * inv[:, :, None]
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        qb = _e4m3_bits(q)
        qb = tl.where(nan_block[:, :, None], 0x7F, qb).to(tl.uint8)
    else:
        # NaN blocks multiply by NaN: the GPU's NaN product is the canonical (positive) NaN, which
        # cvt.rn.satfinite turns into 0x7F, so no per-element select. RCEIL keeps |q| <= 448 and
        # satfinite saturates anyway, so no clamp either.
        inv = tl.where(nan_block, 0x7FC00000, inv_bits).to(tl.float32, bitcast=True)
        q = x3 * inv[:, :, None]
        qb = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    qb = tl.reshape(qb, (BLOCK_M, BLOCK_K))
    sb = sbyte.to(tl.uint8)
    if EVEN_M and EVEN_K:
        tl.store(d_tile + d_offs, qb)
        tl.store(s_tile + s_offs, sb)
    else:
        tl.store(d_tile + d_offs, qb, mask=mask)
        smask = (rm < M - row0)[:, None] & (rg < (K - k0) // 32)[None, :]
        tl.store(s_tile + s_offs, sb, mask=smask)


@triton.jit
def _dequantize_mxfp8_kernel(
    data_ptr, scales_ptr, out_ptr,
    M, K,
    stride_dm, stride_sm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_M: tl.constexpr, EVEN_K: tl.constexpr,
    BITS_ROUNDING: tl.constexpr,
):
    """MXFP8 -> bf16, one pass: bf16(fp32(e4m3) * 2^(b - 127)), the torch path's exact bytes."""
    G: tl.constexpr = BLOCK_K // 32
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = pid_m.to(tl.int64) * BLOCK_M
    k0 = pid_k * BLOCK_K
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rg = tl.arange(0, G)
    d_tile = data_ptr + row0 * stride_dm + k0
    s_tile = scales_ptr + row0 * stride_sm + pid_k * G
    o_tile = out_ptr + row0 * stride_om + k0
    # NOTE: the byte loads are declared 8-contiguous (not 16) so that Triton picks the layout of
    # the 8 x bf16 (16-byte) stores for them too: no shared-memory layout conversion in between.
    d_offs = rm[:, None] * stride_dm + tl.max_contiguous(rk, 8)[None, :]
    s_offs = rm[:, None] * stride_sm + rg[None, :]
    o_offs = rm[:, None] * stride_om + rk[None, :]
    if EVEN_M and EVEN_K:
        raw = tl.load(d_tile + d_offs)
        sb = tl.load(s_tile + s_offs).to(tl.int32)
    else:
        mask = (rm < M - row0)[:, None] & (rk < K - k0)[None, :]
        smask = (rm < M - row0)[:, None] & (rg < (K - k0) // 32)[None, :]
        raw = tl.load(d_tile + d_offs, mask=mask, other=0)
        sb = tl.load(s_tile + s_offs, mask=smask, other=127).to(tl.int32)
    if BITS_ROUNDING:
        # E4M3 -> fp32 exactly, with integer ops (valid in the interpreter and on every GPU).
        b = raw.to(tl.int32)
        sign = (b & 0x80) << 24
        e = (b >> 3) & 0xF
        mt = b & 0x7
        normal = (sign | ((e + 120) << 23) | (mt << 20)).to(tl.float32, bitcast=True)
        sub = mt.to(tl.float32) * 0.001953125  # 2^-9 * mantissa (exact), sign set on the bits (-0.0 too)
        sub = (sub.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, sub, normal)
        v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    else:
        # the hardware upcast (cvt.rn.f16x2.e4m3x2, then f16 -> f32) is exact, NaN stays NaN
        v = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    # E8M0 -> fp32: byte 0 is the subnormal 2^-127, 0xFF is NaN.
    sbits = tl.where(sb == 0, 0x00400000, sb << 23)
    sbits = tl.where(sb == 0xFF, 0x7FC00000, sbits)
    scale = sbits.to(tl.float32, bitcast=True)
    v3 = tl.reshape(v, (BLOCK_M, G, 32)) * scale[:, :, None]
    v = tl.reshape(v3, (BLOCK_M, BLOCK_K))
    if BITS_ROUNDING:
        o = _bf16_bits_rne(v).to(tl.uint16)
        o_ptrs = o_tile.to(tl.pointer_type(tl.uint16)) + o_offs
    else:
        o = v.to(tl.bfloat16)
        o_ptrs = o_tile + o_offs
    if EVEN_M and EVEN_K:
        tl.store(o_ptrs, o)
    else:
        tl.store(o_ptrs, o, mask=mask)
