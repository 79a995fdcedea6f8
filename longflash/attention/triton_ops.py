"""Triton kernels for the paged-cache ops, same signatures as the references in ``ops.py``.

- ``concat_and_cache_mla``: one program per tile of ``BLOCK_T`` tokens writes their whole
  ``[kv_c | k_pe]`` rows at ``slot_mapping`` (−1 skipped); an fp8 cache stores ``sat(x / k_scale)``.
- ``gather_and_maybe_dequant_cache``: one program per tile of ``BLOCK_T`` output rows reads each row of
  request ``token_to_seq[t]`` at its position through the block table and dequantizes (``fp8 · k_scale``).
- ``merge_attn_states``: one program per (token, head) merges two partial results by LSE.
- ``attention_with_lse`` (the MLA prefill's dense attention): the FlashAttention-2 kernel of
  ``triton_prefill.py`` for CUDA tensors (no [H, Tq, Tk] score buffer); the in-place PyTorch form of
  the reference (``ops.attention_with_lse_inplace``) for tensors on any other device;
  ``attention_with_lse_varlen``: the same for a batch of requests laid end to end, one launch.

Both cache kernels are memory-bound: whole 576-wide rows per program (a 512- and a 64-wide tile, no
masked lanes), 16-byte accesses, the row metadata (slot; request, position, block) read once per row.
Tiles come from ``KV_CONFIGS`` (measured on an H200 by ``benchmarks/kv_cache_ops.py``; bytes models
and timings in ``benchmarks/NOTES.md``).

fp8 E4M3: on the GPU the hardware conversions (``cvt.rn.satfinite``, which also saturates to ±448; the
exact upcast). ``x / k_scale`` must be the correctly rounded fp32 quotient, as in the reference; instead
of ``div.rn`` per element (an SFU reciprocal, a range check and a branch: it made the fp8 write
compute-bound) the GPU path multiplies by ``RN(1 / k_scale)`` and corrects the quotient with two FMAs
(exact, see ``_quantize_e4m3``), or just multiplies when ``k_scale`` is a power of two (1.0 by default).
In the CPU interpreter, whose emulated fp8 cast rounds wrongly and whose FMA is not fused
(``shared/specs/mxfp8.md``, Testing caveat), integer operations on the fp32 bits (round to nearest
even) and IEEE division do the same job exactly, so on both the kernels are byte-equal to the
reference (``torch.float8_e4m3fn`` conversion) for every non-NaN input.

Unlike the references, the kernels do not check block-table bounds (that would need a host sync).
This module imports Triton; the engine imports it only for a CUDA cache (``dispatch.cache_ops``), so
``longflash`` itself never needs Triton. For the CPU interpreter set ``TRITON_INTERPRET=1`` before
the first import of triton.
"""

from __future__ import annotations

import math
import os
import struct

import torch
import triton
import triton.language as tl

from longflash.attention.ops import FP8_DTYPE
from longflash.attention.triton_prefill import dispatch_attention_with_lse as attention_with_lse  # noqa: F401
from longflash.attention.triton_prefill import dispatch_attention_with_lse_varlen as attention_with_lse_varlen  # noqa: F401,E501


@triton.jit
def _to_e4m3_bits(x):
    """fp32 (already saturated to ±448) -> E4M3 byte as int32, RNE, NaN -> 0x7F|sign."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    exp = (a >> 23) - 127
    # normal range (|x| >= 2^-6): round the 23-bit mantissa to 3 bits, carry into the exponent
    lsb = (a >> 20) & 1
    normal = ((a + 0x7FFFF + lsb) >> 20) - (120 << 3)
    # subnormal range: value = m * 2^-9, m = RNE(|x| * 2^9) in 0..8 (8 = the smallest normal)
    mant = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(14 - exp, 25)
    sh = tl.maximum(sh, 1)
    q = mant >> sh
    rem = mant & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    mag = tl.where(exp >= -6, normal, sub)
    mag = tl.where(a > 0x7F800000, 0x7F, mag)
    return mag | (sign << 7)

@triton.jit
def _from_e4m3_bits(b):
    """E4M3 byte (int32 0..255) -> fp32, exact."""
    sign = (b >> 7) & 1
    e = (b >> 3) & 15
    m = b & 7
    normal_bits = (sign << 31) | ((e + 120) << 23) | (m << 20)
    normal = normal_bits.to(tl.float32, bitcast=True)
    # NOTE: the sign goes in as a bit: Triton's unary minus is 0 - x, which turns -0.0 into +0.0.
    sub = ((m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, sub, normal)
    nan = (e == 15) & (m == 7)
    return tl.where(nan, float("nan"), val)

@triton.jit
def _quantize_e4m3(x, scale, nscale, rcp, SCALE_MODE: tl.constexpr, HW_FP8: tl.constexpr):
    """fp32 -> E4M3 byte (uint8) of ``sat(x / k_scale)``: the byte torch's conversion gives for the
    correctly rounded fp32 quotient (a NaN gives an E4M3 NaN, its sign unspecified).

    SCALE_MODE 0: no scale; 1: k_scale a power of two, so ``x * (1 / k_scale)`` is the exact quotient;
    2: IEEE division (``div.rn.f32``: per element a reciprocal on the SFU, a range check and a slow-path
    branch); 3: the correctly rounded quotient from ``rcp = RN(1 / k_scale)`` (computed on the host)
    and two FMA residual corrections (Markstein; the first gives a faithful quotient, the second rounds
    it correctly). Mode 3 needs a fused FMA, so the interpreter uses mode 2 instead; the wrapper picks
    it only for 2^-60 <= k_scale <= 2^60, where no step overflows or loses the residual to underflow
    unless the quotient is far below the smallest E4M3 subnormal (then it rounds to ±0 either way)."""
    if SCALE_MODE == 1:
        q = x * rcp
    elif SCALE_MODE == 2:
        q = tl.math.div_rn(x, scale)
    elif SCALE_MODE == 3:
        y = x * rcp
        y1 = tl.math.fma(tl.math.fma(y, nscale, x), rcp, y)
        q = tl.math.fma(tl.math.fma(y1, nscale, x), rcp, y1)
        # |x / k_scale| >> 448 saturates anyway; the select also keeps inf - inf out of the result
        q = tl.where(tl.abs(y) > 1048576.0, y, q)
        # -0.0 / k_scale is -0.0, but the corrections add +0.0 to it: copy the sign bit of x
        qb = (q.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | ((x.to(tl.int32, bitcast=True) >> 31) << 31)
        q = qb.to(tl.float32, bitcast=True)
    else:
        q = x
    if HW_FP8:  # cvt.rn.satfinite: RNE, beyond ±448 (and ±inf) -> ±448, NaN -> NaN
        return q.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)  # NaN passes through NumPy's min/max
    return _to_e4m3_bits(q).to(tl.uint8)


@triton.jit
def _to_cache(x, scale, nscale, rcp, cache_ty: tl.constexpr, FP8: tl.constexpr, SCALE_MODE: tl.constexpr,
              HW_FP8: tl.constexpr):
    if FP8:
        return _quantize_e4m3(x.to(tl.float32), scale, nscale, rcp, SCALE_MODE, HW_FP8)
    return x.to(cache_ty)


@triton.jit
def _write_kernel(kvc_ptr, kpe_ptr, cache_ptr, slot_ptr, scale, nscale, rcp, T, stride_kvc, stride_kpe,
                  R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                  FP8: tl.constexpr, SCALE_MODE: tl.constexpr, HW_FP8: tl.constexpr, BLOCK_T: tl.constexpr,
                  EVICT: tl.constexpr):
    """BLOCK_T whole rows per program: the ``kv_c`` part as a [BLOCK_T, BLOCK_R] tile and the ``k_pe``
    part as a [BLOCK_T, BLOCK_P] tile (576 = 512 + 64: no masked lanes), both loaded before either
    is stored."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1).to(tl.int64)
    rows = (t < T) & (slot >= 0)
    t64 = t.to(tl.int64)
    dst = cache_ptr + slot * (R + P)
    cr = tl.arange(0, BLOCK_R)
    cp = tl.arange(0, BLOCK_P)
    mr = rows[:, None] & (cr < R)[None, :]
    mp = rows[:, None] & (cp < P)[None, :]
    xr = tl.load(kvc_ptr + t64[:, None] * stride_kvc + cr[None, :], mask=mr, other=0.0, eviction_policy=EVICT)
    xp = tl.load(kpe_ptr + t64[:, None] * stride_kpe + cp[None, :], mask=mp, other=0.0, eviction_policy=EVICT)
    cty = cache_ptr.dtype.element_ty
    tl.store(dst[:, None] + cr[None, :], _to_cache(xr, scale, nscale, rcp, cty, FP8, SCALE_MODE, HW_FP8), mask=mr)
    tl.store(dst[:, None] + R + cp[None, :], _to_cache(xp, scale, nscale, rcp, cty, FP8, SCALE_MODE, HW_FP8),
             mask=mp)


@triton.jit
def _from_cache(raw, scale, out_ty: tl.constexpr, FP8: tl.constexpr, HAS_SCALE: tl.constexpr,
                HW_FP8: tl.constexpr):
    if FP8:
        if HW_FP8:  # the upcast is exact in hardware
            x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            x = _from_e4m3_bits(raw.to(tl.int32))
        if HAS_SCALE:
            x = x * scale
        return x.to(out_ty)
    return raw.to(out_ty)


@triton.jit
def _gather_kernel(cache_ptr, bt_ptr, cu_ptr, starts_ptr, t2s_ptr, out_ptr, scale, total, stride_bt,
                   block_size, W: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, FP8: tl.constexpr,
                   HAS_SCALE: tl.constexpr, HAS_STARTS: tl.constexpr, HW_FP8: tl.constexpr,
                   BLOCK_T: tl.constexpr, EVICT: tl.constexpr):
    """BLOCK_T whole output rows per program, each row as a C1-wide and (if W > C1) a C2-wide tile
    (C1 the largest power of two <= W: 576 = 512 + 64); the row's request, position and block are
    looked up once per row."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < total
    b = tl.load(t2s_ptr + t, mask=tm, other=0)
    pos = t - tl.load(cu_ptr + b, mask=tm, other=0)
    if HAS_STARTS:
        pos += tl.load(starts_ptr + b, mask=tm, other=0)
    blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + pos // block_size, mask=tm, other=0).to(tl.int64)
    src = cache_ptr + (blk * block_size + pos % block_size) * W
    dst = out_ptr + t.to(tl.int64) * W
    oty = out_ptr.dtype.element_ty
    c1 = tl.arange(0, C1)
    if FP8:  # NOTE: 8-byte loads put the bytes in the layout of the 16-byte bf16 stores (no shared memory)
        c1 = tl.max_contiguous(c1, 8)
    m1 = tm[:, None] & (c1 < W)[None, :]
    r1 = tl.load(src[:, None] + c1[None, :], mask=m1, other=0, eviction_policy=EVICT)
    if C2 > 0:
        c2 = C1 + tl.arange(0, C2)
        if FP8:
            c2 = tl.max_contiguous(c2, 8)
        m2 = tm[:, None] & (c2 < W)[None, :]
        r2 = tl.load(src[:, None] + c2[None, :], mask=m2, other=0, eviction_policy=EVICT)
        tl.store(dst[:, None] + c1[None, :], _from_cache(r1, scale, oty, FP8, HAS_SCALE, HW_FP8), mask=m1)
        tl.store(dst[:, None] + c2[None, :], _from_cache(r2, scale, oty, FP8, HAS_SCALE, HW_FP8), mask=m2)
    else:
        tl.store(dst[:, None] + c1[None, :], _from_cache(r1, scale, oty, FP8, HAS_SCALE, HW_FP8), mask=m1)


@triton.jit
def _merge_kernel(po_ptr, plse_ptr, so_ptr, slse_ptr, out_ptr, olse_ptr, H, D,
                  s_po_t, s_po_h, s_po_d, s_pl_t, s_pl_h, s_so_t, s_so_h, s_so_d, s_sl_t, s_sl_h,
                  s_o_t, s_o_h, s_o_d, s_ol_t, s_ol_h, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    lp = tl.load(plse_ptr + tok * s_pl_t + h * s_pl_h).to(tl.float32)
    ls = tl.load(slse_ptr + tok * s_sl_t + h * s_sl_h).to(tl.float32)
    lp = tl.where(lp == float("inf"), float("-inf"), lp)
    ls = tl.where(ls == float("inf"), float("-inf"), ls)
    m = tl.maximum(lp, ls)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    wp = tl.exp(lp - m_safe)
    ws = tl.exp(ls - m_safe)
    tot = wp + ws
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, tot))
    cp = wp * inv
    cs = ws * inv
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    po = tl.load(po_ptr + tok * s_po_t + h * s_po_h + d * s_po_d, mask=dm, other=0.0).to(tl.float32)
    so = tl.load(so_ptr + tok * s_so_t + h * s_so_h + d * s_so_d, mask=dm, other=0.0).to(tl.float32)
    o = tl.where(wp > 0, po * cp, 0.0) + tl.where(ws > 0, so * cs, 0.0)
    tl.store(out_ptr + tok * s_o_t + h * s_o_h + d * s_o_d, o.to(out_ptr.dtype.element_ty), mask=dm)
    lse = tl.where(empty, float("-inf"), tl.log(tl.where(empty, 1.0, tot)) + m_safe)
    tl.store(olse_ptr + tok * s_ol_t + h * s_ol_h, lse)



def _kernels():
    return triton, _write_kernel, _gather_kernel, _merge_kernel


# Tiles, (rows per program, num_warps, eviction policy of the streaming loads), per op and cache
# element size. Whole rows per program; the fastest of the candidates benchmarks/kv_cache_ops.py timed
# on the H200 (commit 77f87ea, benchmarks/results/kv_cache_ops.h200.md; back-to-back launches in a CUDA
# graph, 64K and 256K rows x 576). 4 rows / 4 warps was the fastest or within 1.5% of it for three
# kernels at both sizes; for the fp8 gather the tiles were within 3% of each other except 4/4 at 256K
# (8% slower), and 8/4 evict_first was the fastest at 256K and within 1.5% at 64K. Each chosen tile is
# within 1.5% of the fastest at both sizes, so the table does not depend on the size.
KV_CONFIGS: dict[tuple[str, int], tuple[int, int, str]] = {
    ("write", 2): (4, 4, ""),
    ("write", 1): (4, 4, ""),
    ("gather", 2): (4, 4, ""),
    ("gather", 1): (8, 4, "evict_first"),
}


def kv_config(op: str, cache_dtype: torch.dtype) -> tuple[int, int, str]:
    """(block_t, num_warps, evict) of ``KV_CONFIGS`` for ``op`` in {"write", "gather"}; caches of other
    element sizes (fp32) take the bf16 row."""
    esz = torch.empty((), dtype=cache_dtype).element_size()
    return KV_CONFIGS.get((op, esz), KV_CONFIGS[(op, 2)])


def _hw_fp8(t: torch.Tensor) -> bool:
    """Use the hardware E4M3 conversions on a GPU; the integer ones in the CPU interpreter (whose
    emulated fp8 cast rounds wrongly)."""
    return t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _f32(v: float) -> float:
    """``v`` rounded to fp32 (to ±inf beyond the fp32 range, as ``torch.as_tensor(v, dtype=float32)``)."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _write_scale(k_scale, hw: bool) -> tuple[int, float, float, float]:
    """(SCALE_MODE, scale, -scale, RN(1 / scale)) of ``_quantize_e4m3`` for a k_scale (fp32, as the
    reference divides by it). ``1.0 / s`` in float64 rounded to fp32 is RN32(1 / s): the exact
    reciprocal lies at least 2^-49 (relative) from every fp32 midpoint, so the double rounding is safe."""
    if k_scale is None:
        return 0, 1.0, -1.0, 1.0
    s = _f32(float(k_scale))
    if not (s > 0.0 and math.isfinite(s)):
        return 2, s, -s, 1.0
    rcp = _f32(1.0 / s)
    mant, exp = math.frexp(s)
    if mant == 0.5 and -125 <= exp <= 127:  # a power of two in the normal range: 1 / s is exact
        return 1, s, -s, rcp
    if hw and 2.0 ** -60 <= s <= 2.0 ** 60:
        return 3, s, -s, rcp
    return 2, s, -s, rcp


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, k_scale: float | torch.Tensor | None = None,
                         *, block_t: int | None = None, num_warps: int | None = None,
                         evict: str | None = None, scale_mode: int | None = None) -> None:
    """Triton version of :func:`longflash.attention.ops.concat_and_cache_mla` (same semantics and, for
    every non-NaN input, the same cache bytes; a NaN is stored as an E4M3 NaN of either sign).

    ``block_t`` (rows per program, a power of two), ``num_warps`` and ``evict`` (eviction policy of
    the input loads: "" or "evict_first") override ``kv_config("write", dtype)``; benchmarks sweep them.
    ``scale_mode`` (benchmarks and tests) forces the division of an fp8 write with a k_scale: 2 = IEEE
    division, 3 = FMA-corrected reciprocal (GPU only, 2^-60 <= k_scale <= 2^60); see ``_quantize_e4m3``.
    Raises ValueError if the cache is not contiguous with rows of width ``R + P``, or for a
    ``scale_mode`` that cannot apply."""
    triton, write, _, _ = _kernels()
    T = kv_c.shape[0]
    if T == 0:
        return
    R, P = kv_c.shape[1], k_pe.shape[1]
    if kv_cache.shape[-1] != R + P or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache rows must be contiguous of width {R + P}, got shape {tuple(kv_cache.shape)}")
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1:
        kv_c, k_pe = kv_c.contiguous(), k_pe.contiguous()
    fp8 = kv_cache.dtype == FP8_DTYPE
    dst = kv_cache.view(torch.uint8) if fp8 else kv_cache
    hw = _hw_fp8(kv_cache)
    mode, scale, nscale, rcp = _write_scale(k_scale, hw) if fp8 else (0, 1.0, -1.0, 1.0)
    if scale_mode is not None:
        ok = fp8 and k_scale is not None and (scale_mode == 2 or (scale_mode == 3 and hw and mode in (1, 3)))
        if not ok:
            raise ValueError(f"scale_mode={scale_mode} does not apply (fp8={fp8}, k_scale={k_scale}, gpu={hw})")
        mode = scale_mode
    cfg = kv_config("write", kv_cache.dtype)
    block_t = block_t or cfg[0]
    grid = (triton.cdiv(T, block_t),)
    write[grid](kv_c, k_pe, dst, slot_mapping, scale, nscale, rcp, T, kv_c.stride(0), k_pe.stride(0), R=R, P=P,
                BLOCK_R=triton.next_power_of_2(R), BLOCK_P=triton.next_power_of_2(P), FP8=fp8, SCALE_MODE=mode,
                HW_FP8=hw, BLOCK_T=block_t, EVICT=cfg[2] if evict is None else evict,
                num_warps=num_warps or cfg[1])


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float | torch.Tensor | None = None,
                      v_scale: float | torch.Tensor | None = None) -> None:
    """Triton version of :func:`longflash.attention.ops.reshape_and_cache` (same semantics and cache
    bytes): GQA keys/values [T, kv_heads, head_dim] (rows may be strided, the last dim contiguous) into
    caches [num_blocks, block_size, kv_heads, head_dim], slot -1 skipped, fp8 caches quantized with
    ``k_scale`` / ``v_scale``. One launch per plane: a row of width W = kv_heads * head_dim is written by
    the MLA write kernel as its two halves (the kernel's ``kv_c`` and ``k_pe`` parts). Raises ValueError
    for a non-contiguous cache."""
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        T = x.shape[0]
        if T == 0:
            continue
        x2 = x.reshape(T, -1)
        W = x2.shape[1]
        if cache.shape[2:].numel() != W or not cache.is_contiguous():
            raise ValueError(f"cache rows must be contiguous of {W} elements, got shape {tuple(cache.shape)}")
        half = W // 2 if W > 1 else 1
        concat_and_cache_mla(x2[:, :half], x2[:, half:], cache.view(*cache.shape[:2], W), slot_mapping, scale)


def _row_tiles(width: int) -> tuple[int, int]:
    """(C1, C2): C1 the largest power of two <= width, C2 a power of two covering the rest (0 if none)."""
    c1 = 1 << (width.bit_length() - 1)
    return c1, (triton.next_power_of_2(width - c1) if width > c1 else 0)


def gather_and_maybe_dequant_cache(cache: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
                                   seq_starts: torch.Tensor | None, out_dtype: torch.dtype,
                                   k_scale: float | torch.Tensor | None = None,
                                   token_to_seq: torch.Tensor | None = None,
                                   total: int | None = None, *, block_t: int | None = None,
                                   num_warps: int | None = None, evict: str | None = None) -> torch.Tensor:
    """Triton version of :func:`longflash.attention.ops.gather_and_maybe_dequant_cache`.

    ``total`` (rows, = cu_seq_lens[-1]) may be given to avoid a device->host sync. Rows of
    ``cache`` beyond the block size are flattened (``[num_blocks, block_size, *row_shape]``).
    ``block_t`` / ``num_warps`` / ``evict`` override ``kv_config("gather", dtype)`` (as in the write).
    """
    triton, _, gather, _ = _kernels()
    if total is None:
        total = int(cu_seq_lens[-1])
    row_shape = cache.shape[2:]
    W = 1
    for d in row_shape:
        W *= d
    out = torch.empty((total, *row_shape), dtype=out_dtype, device=cache.device)
    if total == 0:
        return out
    num_reqs = cu_seq_lens.numel() - 1
    if token_to_seq is None:
        lens = (cu_seq_lens[1:] - cu_seq_lens[:-1]).long()
        token_to_seq = torch.repeat_interleave(torch.arange(num_reqs, device=cache.device, dtype=torch.int32),
                                               lens, output_size=total)
    fp8 = cache.dtype == FP8_DTYPE
    src = cache.view(torch.uint8) if fp8 else cache
    has_scale = k_scale is not None
    scale = float(k_scale) if has_scale else 1.0
    bt = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    starts = seq_starts if seq_starts is not None else cu_seq_lens
    cfg = kv_config("gather", cache.dtype)
    block_t = block_t or cfg[0]
    c1, c2 = _row_tiles(W)
    grid = (triton.cdiv(total, block_t),)
    gather[grid](src, bt, cu_seq_lens, starts, token_to_seq, out, scale, total, bt.stride(0), cache.shape[1],
                 W=W, C1=c1, C2=c2, FP8=fp8, HAS_SCALE=has_scale, HAS_STARTS=seq_starts is not None,
                 HW_FP8=_hw_fp8(cache), BLOCK_T=block_t, EVICT=cfg[2] if evict is None else evict,
                 num_warps=num_warps or cfg[1])
    return out


def merge_attn_states(prefix_output: torch.Tensor, prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
                      suffix_lse: torch.Tensor, output: torch.Tensor | None = None,
                      output_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`longflash.attention.ops.merge_attn_states` (strided inputs allowed)."""
    triton, _, _, merge = _kernels()
    T, H, D = prefix_output.shape
    if output is None:
        output = torch.empty((T, H, D), dtype=prefix_output.dtype, device=prefix_output.device)
    if output_lse is None:
        output_lse = torch.empty((T, H), dtype=torch.float32, device=prefix_output.device)
    if T == 0 or H == 0:
        return output, output_lse
    BLOCK_D = triton.next_power_of_2(max(D, 1))
    merge[(T, H)](prefix_output, prefix_lse, suffix_output, suffix_lse, output, output_lse, H, D,
                  *prefix_output.stride(), *prefix_lse.stride(), *suffix_output.stride(), *suffix_lse.stride(),
                  *output.stride(), *output_lse.stride(), BLOCK_D=BLOCK_D)
    return output, output_lse
