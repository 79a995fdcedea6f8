"""Triton kernels for the paged-cache ops, same signatures as the references in ``ops.py``.

- ``concat_and_cache_mla``: one program per (token tile, column tile) writes ``[kv_c | k_pe]`` rows
  at ``slot_mapping`` (−1 skipped); an fp8 cache stores ``sat(x / k_scale)``.
- ``gather_and_maybe_dequant_cache``: one program per (output-row tile, column tile) reads the row of
  request ``token_to_seq[t]`` at its position through the block table and dequantizes (``fp8 · k_scale``).
- ``merge_attn_states``: one program per (token, head) merges two partial results by LSE.

fp8 E4M3: on the GPU the hardware conversions (``cvt.rn.satfinite`` after clamping to ±448; the exact
upcast). In the CPU interpreter, whose emulated fp8 cast rounds wrongly (``shared/specs/mxfp8.md``,
Testing caveat), integer operations on the fp32 bits (round to nearest even) do the same job exactly,
so on both the kernels are byte-equal to ``torch.float8_e4m3fn`` conversion.

Unlike the references, the kernels do not check block-table bounds (that would need a host sync).
This module imports Triton; the engine imports it only for a CUDA cache (``mla.cache_ops``), so
``longflash`` itself never needs Triton. For the CPU interpreter set ``TRITON_INTERPRET=1`` before
the first import of triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from longflash.attention.ops import FP8_DTYPE, FP8_MAX


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
def _write_kernel(kvc_ptr, kpe_ptr, cache_ptr, slot_ptr, scale, T, stride_kvc, stride_kpe,
                  R: tl.constexpr, P: tl.constexpr, FP8: tl.constexpr, HAS_SCALE: tl.constexpr,
                  FP8_MAX_C: tl.constexpr, HW_FP8: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1).to(tl.int64)
    rmask = (t < T) & (slot >= 0)
    W: tl.constexpr = R + P
    in_c = d < R
    in_p = (d >= R) & (d < W)
    t64 = t.to(tl.int64)
    xc = tl.load(kvc_ptr + t64[:, None] * stride_kvc + d[None, :], mask=rmask[:, None] & in_c[None, :], other=0.0)
    xp = tl.load(kpe_ptr + t64[:, None] * stride_kpe + (d - R)[None, :], mask=rmask[:, None] & in_p[None, :],
                 other=0.0)
    x = tl.where(in_c[None, :], xc.to(tl.float32), xp.to(tl.float32))
    dst = cache_ptr + slot[:, None] * W + d[None, :]
    wmask = rmask[:, None] & (d < W)[None, :]
    if FP8:
        if HAS_SCALE:
            x = tl.math.div_rn(x, scale)
        x = tl.minimum(tl.maximum(x, -FP8_MAX_C), FP8_MAX_C)
        if HW_FP8:  # cvt.rn.satfinite (RNE), byte-equal to torch's conversion
            tl.store(dst, x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True), mask=wmask)
        else:
            tl.store(dst, _to_e4m3_bits(x).to(tl.uint8), mask=wmask)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=wmask)

@triton.jit
def _gather_kernel(cache_ptr, bt_ptr, cu_ptr, starts_ptr, t2s_ptr, out_ptr, scale, total, stride_bt,
                   block_size, W: tl.constexpr, FP8: tl.constexpr, HAS_SCALE: tl.constexpr,
                   HAS_STARTS: tl.constexpr, HW_FP8: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = t < total
    b = tl.load(t2s_ptr + t, mask=tmask, other=0)
    pos = t - tl.load(cu_ptr + b, mask=tmask, other=0)
    if HAS_STARTS:
        pos += tl.load(starts_ptr + b, mask=tmask, other=0)
    blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + pos // block_size, mask=tmask, other=0).to(tl.int64)
    src = cache_ptr + (blk * block_size + pos % block_size)[:, None] * W + d[None, :]
    m = tmask[:, None] & (d < W)[None, :]
    raw = tl.load(src, mask=m, other=0)
    if FP8:
        if HW_FP8:  # the upcast is exact in hardware
            x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            x = _from_e4m3_bits(raw.to(tl.int32))
        if HAS_SCALE:
            x = x * scale
    else:
        x = raw.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * W + d[None, :], x.to(out_ptr.dtype.element_ty), mask=m)

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


def _block_d(width: int) -> int:
    """Columns per program: a power of two dividing the row (576 -> 64, no masked lanes), else the
    whole row padded to a power of two."""
    p = width & -width
    return min(p, 128) if p >= 32 else triton.next_power_of_2(width)


def _hw_fp8(t: torch.Tensor) -> bool:
    """Use the hardware E4M3 conversions on a GPU; the integer ones in the CPU interpreter (whose
    emulated fp8 cast rounds wrongly)."""
    return t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _scale_arg(k_scale) -> tuple[float, bool]:
    if k_scale is None:
        return 1.0, False
    return float(k_scale), True


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, k_scale: float | torch.Tensor | None = None,
                         *, block_t: int | None = None, num_warps: int = 4) -> None:
    """Triton version of :func:`longflash.attention.ops.concat_and_cache_mla` (same semantics).
    ``block_t`` (rows per program) and ``num_warps`` are tuning knobs (benchmarks sweep them)."""
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
    scale, has_scale = _scale_arg(k_scale)
    BLOCK_D = _block_d(R + P)
    BLOCK_T = block_t or max(1, 4096 // BLOCK_D)
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(R + P, BLOCK_D))
    write[grid](kv_c, k_pe, dst, slot_mapping, scale, T, kv_c.stride(0), k_pe.stride(0), R=R, P=P, FP8=fp8,
                HAS_SCALE=has_scale, FP8_MAX_C=FP8_MAX, HW_FP8=_hw_fp8(kv_cache), BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
                num_warps=num_warps)


def gather_and_maybe_dequant_cache(cache: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
                                   seq_starts: torch.Tensor | None, out_dtype: torch.dtype,
                                   k_scale: float | torch.Tensor | None = None,
                                   token_to_seq: torch.Tensor | None = None,
                                   total: int | None = None, *, block_t: int | None = None,
                                   num_warps: int = 4) -> torch.Tensor:
    """Triton version of :func:`longflash.attention.ops.gather_and_maybe_dequant_cache`.

    ``total`` (rows, = cu_seq_lens[-1]) may be given to avoid a device->host sync. Rows of
    ``cache`` beyond the block size are flattened (``[num_blocks, block_size, *row_shape]``).
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
    scale, has_scale = _scale_arg(k_scale)
    bt = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    starts = seq_starts if seq_starts is not None else cu_seq_lens
    BLOCK_D = _block_d(W)
    BLOCK_T = block_t or max(1, 4096 // BLOCK_D)
    grid = (triton.cdiv(total, BLOCK_T), triton.cdiv(W, BLOCK_D))
    gather[grid](src, bt, cu_seq_lens, starts, token_to_seq, out, scale, total, bt.stride(0), cache.shape[1],
                 W=W, FP8=fp8, HAS_SCALE=has_scale, HAS_STARTS=seq_starts is not None, HW_FP8=_hw_fp8(cache),
                 BLOCK_T=BLOCK_T,
                 BLOCK_D=BLOCK_D, num_warps=num_warps)
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
