"""Grouped MoE with MXFP4 expert weights dequantized in registers (W4A16), Triton: one launch per layer.

Same signature and result as the PyTorch reference ``longflash.layers.mxfp4.run_mxfp4_experts``:
``run_mxfp4_experts_triton(x [T, D], experts: MXFP4Experts, topk_weights [T, k], topk_ids [T, k]) -> [T, D]``.

What one call does (bytes/FLOPs model and measurements: ``benchmarks/NOTES.md``):

1. No host sync: ``moe_align_triton`` (one launch; ``moe_align`` here is its PyTorch reference) sorts the
   T*k (token, slot) rows by expert and pads each expert to BLOCK_M rows (row blocks of one expert each,
   the vLLM ``moe_align_block_size`` layout) and zeroes the int32 scheduler counters; the fp32 output is
   zeroed (``torch.zeros``).
2. **One kernel launch** for all experts and both GEMMs. The work is a list of tiles:
   - gate/up tiles ``(row block m, I-tile j)``: ``h = act(x W1ᵀ, x W3ᵀ)`` for BLOCK_W intermediate columns
     of the block's rows (gate and up share the activation loads; SiTU or SiLU fused), stored in x's dtype
     to a scratch ``inter [T*k, I]``; then the block's ready counter is incremented (release);
   - down tiles ``(row block m, D-tile d)``: wait until all gate/up tiles of block m are done (acquire),
     then ``y = h W2ᵀ`` for BLOCK_W output columns over the whole I, times the routing weight, added with
     fp32 atomics into ``out [T, D]`` (the k slots of a token meet there; the summation order varies).
   A persistent grid of programs takes tiles in order from an atomic counter: every gate/up tile is handed
   out before any down tile, so a waiting down tile only waits on tiles that running programs hold and
   finish without waiting (no deadlock whatever the residency; under ``TRITON_INTERPRET=1`` the programs
   run one after the other and never wait).
3. A cast of ``out`` to x's dtype.

Both GEMMs are computed transposed ("swap AB"): a tile is ``W_tile [BLOCK_W, K] @ actᵀ [K, BLOCK_M]``, so
the dequantized weights are the MMA's left operand, which Hopper's ``wgmma`` reads from registers (weight
rows fill its M = 64 even for one token; the tokens are its N) and the activations the right one.
MXFP4 decode, per BLOCK_K chunk: the packed bytes [BLOCK_W, BLOCK_K/2] (kept by ``MXFP4Experts`` with each
16-byte group 4x4-transposed, ``mxfp4.to_kernel_byte_order``, so each thread's MMA fragment is one aligned
word) and their scale bytes are decoded to [BLOCK_W, BLOCK_K] in registers:
- bf16 on CUDA with every scale byte in [2, 252] (any real checkpoint): inline PTX, byte-table ``prmt``
  lookups and one ``bf16x2`` multiply, ~2.4 instructions per weight (``_dequant_bf16x2_asm``);
- otherwise integer bit operations in Triton, exact under ``TRITON_INTERPRET=1`` too (byte 0 -> 2^-127,
  0xFF -> NaN, as in the reference).
Triton is imported lazily (this module is only imported on the Triton path).
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from longflash.layers.moe_align_triton import moe_align_triton
from longflash.layers.moe_grouped import align_by_expert
from longflash.layers.mxfp4 import MXFP4Experts

_ACT_CODES = {"silu": 0, "situ": 1}


# ---- decode helpers ------------------------------------------------------------------------------------

@triton.jit
def _e8m0_to_fp32(s):
    """int32 E8M0 bytes -> fp32 2^(s-127); byte 0 is the subnormal 2^-127, 0xFF is NaN (integer ops only)."""
    bits = tl.where(s == 0, 0x00400000, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_fp32(mag, sign_bit):
    """mag: int32 low 3 bits of E2M1 codes, sign_bit: int32 0 or 0x80000000 -> fp32 value.

    For mag >= 2 the fp32 bits are ``(mag << 22) + (126 << 23)`` (exponent e + 126, mantissa bit m);
    mag 1 is 0.5 (``126 << 23``) and mag 0 is 0 -- i.e. ``mag * (126 << 23)`` for mag < 2.
    """
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), mag * (126 << 23))
    return (bits | sign_bit).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_decode(q, s):
    """q: int32 E2M1 codes (0..15), s: int32 E8M0 bytes (broadcast to q) -> fp32 q * 2^(s-127)."""
    return _e2m1_to_fp32(q & 7, (q & 8) << 28) * _e8m0_to_fp32(s)


@triton.jit
def _small_scale_fp32(s):
    """int32 E8M0 bytes <= 128 -> fp32 2^126 * 2^(s-127) = 2^(s-1) (a normal number)."""
    return ((s + 126) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _lo_nibble_small(q, sc):
    """Low-nibble code of the int32 bytes q times sc = 2^(s-1): bits (mag << 22) | sign, then one multiply.

    ``bits = (mag << 22) | sign`` is ``2^-126 * (e ? 2^(e-1)(1+m/2) : m/2)`` -- the E2M1 value times 2^-126,
    a subnormal for e = 0 -- so one multiply by ``2^126 * scale`` gives the exact product. (Relies on IEEE
    subnormals in ``mul.f32``; Triton emits no .ftz.)
    """
    return (((q << 22) & 0x01C00000) | ((q << 28) & (-2147483648))).to(tl.float32, bitcast=True) * sc


@triton.jit
def _hi_nibble_small(q, sc):
    """High-nibble code of the int32 bytes q times sc = 2^(s-1) (see ``_lo_nibble_small``)."""
    return (((q << 18) & 0x01C00000) | ((q << 24) & (-2147483648))).to(tl.float32, bitcast=True) * sc


# E2M1 magnitude (0..7) -> the high / low byte of its bf16 value {0, .5, 1, 1.5, 2, 3, 4, 6}, as the two
# 4-byte halves of an 8-entry ``prmt`` table: 0x0000 0x3F00 0x3F80 0x3FC0 0x4000 0x4040 0x4080 0x40C0.
# In: $4 four packed bytes, $5..$8 their scales as bf16x2 (s, s). Out: $0..$3 one bf16x2 per byte, (low
# nibble, high nibble) times its scale.
_BF16X2_E2M1_ASM = tl.constexpr("""
{
.reg .b32 m, mh, q4, h0, h1, l0, l1, g0, g1, neg0;
and.b32 m, $4, 0x77777777;
shr.u32 mh, m, 16;
prmt.b32 h0, 0x3F3F3F00, 0x40404040, m;
prmt.b32 h1, 0x3F3F3F00, 0x40404040, mh;
prmt.b32 l0, 0xC0800000, 0xC0804000, m;
prmt.b32 l1, 0xC0800000, 0xC0804000, mh;
shl.b32 q4, $4, 4;
prmt.b32 g0, q4, $4, 0xD9C8;
prmt.b32 g1, q4, $4, 0xFBEA;
and.b32 g0, g0, 0x80808080;
and.b32 g1, g1, 0x80808080;
or.b32 h0, h0, g0;
or.b32 h1, h1, g1;
prmt.b32 $0, l0, h0, 0x5140;
prmt.b32 $1, l0, h0, 0x7362;
prmt.b32 $2, l1, h1, 0x5140;
prmt.b32 $3, l1, h1, 0x7362;
mov.b32 neg0, 0x80008000;
fma.rn.bf16x2 $0, $0, $5, neg0;
fma.rn.bf16x2 $1, $1, $6, neg0;
fma.rn.bf16x2 $2, $2, $7, neg0;
fma.rn.bf16x2 $3, $3, $8, neg0;
}
""")


@triton.jit
def _dequant_bf16x2_asm(q, sc2):
    """uint8 packed bytes q, int32 scale pairs sc2 (bf16x2 bits (s, s), same shape) -> int32 bf16x2 per byte:
    (low-nibble weight, high-nibble weight), i.e. input columns 2j and 2j+1 side by side as the MMA wants them.

    PTX, 4 bytes per call: the magnitudes index two ``prmt`` byte tables (high and low byte of the bf16
    value), the sign bytes come from ``prmt``'s sign-replicate mode, one more ``prmt`` per output register
    puts the bytes in place, one ``fma.rn.bf16x2`` applies the scale (+ -0.0, so that +0 stays +0):
    ~2.4 instructions per weight. Exact when every product is a normal bf16 (the caller checks
    2 <= scale byte <= 252). CUDA only (the interpreter has no inline asm).
    """
    return tl.inline_asm_elementwise(_BF16X2_E2M1_ASM, "=r,=r,=r,=r,r,r,r,r,r", [q, sc2], dtype=tl.int32,
                                     is_pure=True, pack=4)


@triton.jit
def _dequant_pairs(q, s, dt: tl.constexpr, DECODE: tl.constexpr):
    """Packed bytes q (uint8, any shape) and their scale bytes s (int32, broadcastable) -> weights in ``dt``
    with a new last dimension of 2: [..., 0] the low nibble (input column 2j), [..., 1] the high one (2j+1).

    DECODE 0: any scale byte (0 -> 2^-127, 0xFF -> NaN), ~10 integer ops per weight.
    DECODE 1 (every scale byte <= 128, checked by the caller): ~5 integer ops and one multiply per weight
    (``_lo_nibble_small``). DECODE 2 (bf16, 2 <= every scale byte <= 252, CUDA): ``_dequant_bf16x2_asm``.
    """
    if DECODE == 2:
        # the scale byte as a bf16x2 pair (s, s): (s << 7) | (s << 23), one multiply for s < 256
        pairs = _dequant_bf16x2_asm(q, tl.broadcast_to(s * 0x00800080, q.shape))
        # the two halves of each int32 are put back side by side: a no-op in registers
        lo = pairs.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (pairs >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        q = q.to(tl.int32)
        if DECODE == 1:
            sc = _small_scale_fp32(s)
            lo = _lo_nibble_small(q, sc)
            hi = _hi_nibble_small(q, sc)
        else:
            sc = _e8m0_to_fp32(s)
            lo = _e2m1_to_fp32(q & 7, (q & 0x08) << 28) * sc
            hi = _e2m1_to_fp32((q >> 4) & 7, (q & 0x80) << 24) * sc
    return tl.join(lo.to(dt), hi.to(dt))


@triton.jit
def _tanh(x):
    # Odd Taylor series near 0 (no cancellation), (1 - e^-2|x|) / (1 + e^-2|x|) elsewhere.
    ax = tl.abs(x)
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    t = tl.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    big = tl.where(x < 0, -big, big)
    return tl.where(ax < 0.25, series, big)


# ---- one weight-tile x activation-tile product -----------------------------------------------------------

@triton.jit
def _load_scales(s_row_ptrs, w_ok, kc, K: tl.constexpr, NG: tl.constexpr):
    """The scale bytes [BW, NG] (int32) of groups kc/32 .. kc/32 + NG - 1; masked ones read 127.

    NOTE: a few bytes per row -- too narrow for ``cp.async``, so Triton leaves these loads synchronous;
    the caller issues them one chunk ahead. (Loading 4 groups as one int32 makes them asynchronous but
    then Triton decodes in a blocked layout and moves every weight through shared memory: slower.)
    """
    offs_g = kc // 32 + tl.arange(0, NG)
    sc = tl.load(s_row_ptrs + offs_g[None, :], mask=w_ok & ((offs_g * 32) < K)[None, :], other=127)
    return sc.to(tl.int32)


@triton.jit
def _load_dequant(q_row_ptrs, sc, w_ok, kc, K: tl.constexpr, dt: tl.constexpr, BLOCK_K: tl.constexpr,
                  DECODE: tl.constexpr):
    """Weight columns kc .. kc + BLOCK_K - 1 of BW rows as a [BW, BLOCK_K] tile in ``dt``.

    q_row_ptrs [BW, 1]: each row's packed bytes; sc [BW, BLOCK_K / 32] int32: the chunk's scale bytes
    (``_load_scales``); w_ok [BW, 1]: valid rows; masked weights are 0. The packed bytes are stored in ``MXFP4Experts``' kernel order (``KERNEL_BYTE_ORDER``:
    the 16 bytes of a group as a transposed 4x4) and put back in column order here -- a relabelling of
    registers once Triton loads each thread's 4 bytes (the ones its MMA fragment needs) as one word.
    """
    NG: tl.constexpr = BLOCK_K // 32
    BW: tl.constexpr = q_row_ptrs.shape[0]
    offs_g = tl.arange(0, NG)
    q_ptrs = q_row_ptrs[:, :, None] + (kc // 2 + offs_g * 16)[None, :, None] + tl.arange(0, 16)[None, None, :]
    q = tl.load(q_ptrs, mask=w_ok[:, :, None] & (((kc + 32 * offs_g) < K)[None, :, None]), other=0)
    w = _dequant_pairs(q, sc[:, :, None], dt, DECODE)  # [BW, NG, 16 stored bytes, 2 nibbles]
    # stored byte 4c + j of a group holds the group's byte c + 4j
    w = tl.permute(tl.reshape(w, (BW, NG, 4, 4, 2)), (0, 1, 3, 2, 4))
    return tl.reshape(w, (BW, BLOCK_K))


@triton.jit
def _wt_dot_act(acc, acc2, wq_row_ptrs, ws_row_ptrs, w_ok, second_q, second_s, second_ok, a_col_ptrs, a_ok,
                K: tl.constexpr, dt: tl.constexpr, GATED: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_PRECISION: tl.constexpr, DECODE: tl.constexpr, A_CACHE: tl.constexpr):
    """acc [BW, BM] += W [BW, K] @ Aᵀ [K, BM] over the whole K, W MXFP4-packed; when GATED also
    acc2 += W' Aᵀ with W' the rows ``second_q`` / ``second_s`` bytes further on (the up projection, or
    the next BW rows of a paired down tile), valid where ``second_ok`` [BW, 1]; both share the activations.

    wq_row_ptrs / ws_row_ptrs [BW, 1]: start of each weight row's packed / scale bytes; w_ok [BW, 1]: valid
    rows. a_col_ptrs [1, BM]: start of each activation row; a_ok [1, BM]: valid rows. K (a multiple of 32)
    is a compile-time constant (also: a runtime loop bound fails in the Triton 3.6 interpreter with
    NumPy 2); the activations are masked along K only when K is not a multiple of BLOCK_K.
    NOTE: the scales are loaded one chunk ahead. Two chunks ahead (two loop-carried scale tiles) makes
    Triton 3.6's pipeliner drop cp.async for the weight loads altogether (sm_90 SASS: no LDGSTS).
    """
    NG: tl.constexpr = BLOCK_K // 32
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_col_ptrs + offs_k[:, None]
    # the scales are loaded one chunk ahead (too narrow for cp.async, so Triton leaves them synchronous)
    sc_next = _load_scales(ws_row_ptrs, w_ok, 0, K, NG)
    sc2_next = sc_next
    if GATED:
        sc2_next = _load_scales(ws_row_ptrs + second_s, second_ok, 0, K, NG)
    for kc in range(0, K, BLOCK_K):
        sc = sc_next
        sc2 = sc2_next
        sc_next = _load_scales(ws_row_ptrs, w_ok & (kc + BLOCK_K < K), kc + BLOCK_K, K, NG)
        if GATED:
            sc2_next = _load_scales(ws_row_ptrs + second_s, second_ok & (kc + BLOCK_K < K), kc + BLOCK_K, K, NG)
        if K % BLOCK_K == 0:
            a = tl.load(a_ptrs + kc, mask=a_ok, other=0.0, cache_modifier=A_CACHE)
        else:
            a = tl.load(a_ptrs + kc, mask=a_ok & ((kc + offs_k[:, None]) < K), other=0.0, cache_modifier=A_CACHE)
        w = _load_dequant(wq_row_ptrs, sc, w_ok, kc, K, dt, BLOCK_K, DECODE)
        acc = tl.dot(w, a, acc, input_precision=DOT_PRECISION)
        if GATED:
            w = _load_dequant(wq_row_ptrs + second_q, sc2, second_ok, kc, K, dt, BLOCK_K, DECODE)
            acc2 = tl.dot(w, a, acc2, input_precision=DOT_PRECISION)
    return acc, acc2


@triton.jit
def _gate_up_tile(m, j, x_ptr, w13q_ptr, w13s_ptr, inter_ptr, sorted_ids_ptr, block_expert_ptr, ready_ptr,
                  num_rows, top_k, stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_im,
                  beta, linear_beta,
                  D: tl.constexpr, I: tl.constexpr, ACT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, DECODE: tl.constexpr):
    """h[rows of block m, I-tile j] = act(x W1ᵀ, x W3ᵀ) -> inter; then ready[m] += 1 (release)."""
    e = tl.load(block_expert_ptr + m).to(tl.int64)
    rows = tl.load(sorted_ids_ptr + m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    toks = (rows // top_k).to(tl.int64)
    offs_i = j * BLOCK_W + tl.arange(0, BLOCK_W)
    i_ok = offs_i < I
    dt = x_ptr.dtype.element_ty
    acc_g = tl.zeros((BLOCK_W, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_W, BLOCK_M), dtype=tl.float32)
    acc_g, acc_u = _wt_dot_act(acc_g, acc_u, w13q_ptr + e * stride_qe + offs_i[:, None].to(tl.int64) * stride_qn,
                               w13s_ptr + e * stride_se + offs_i[:, None].to(tl.int64) * stride_sn, i_ok[:, None],
                               I * stride_qn, I * stride_sn, i_ok[:, None],
                               x_ptr + toks[None, :] * stride_xm, row_ok[None, :],
                               D, dt, True, BLOCK_K, DOT_PRECISION, DECODE, "")
    # The reference rounds gate/up to the activation dtype before the activation; so do we.
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    if ACT == 1:  # SiTU: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)
        h = beta * _tanh(g / beta) * sig * (linear_beta * _tanh(u / linear_beta))
    else:  # SiLU gate: silu(g) * u
        h = g * sig * u
    tl.store(inter_ptr + rows[None, :].to(tl.int64) * stride_im + offs_i[:, None], h.to(inter_ptr.dtype.element_ty),
             mask=i_ok[:, None] & row_ok[None, :])
    # every thread's stores, then one release increment (the cooperative-groups grid-sync pattern)
    tl.debug_barrier()
    tl.atomic_add(ready_ptr + m, 1, sem="release", scope="gpu")


@triton.jit
def _down_tile(m, d, inter_ptr, w2q_ptr, w2s_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
               ready_ptr, num_rows, top_k, stride_im, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
               D: tl.constexpr, I: tl.constexpr, N_I_TILES: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_PRECISION: tl.constexpr, DECODE: tl.constexpr, DOWN_PAIR: tl.constexpr):
    """out[tokens of block m, D-tile d] += routing weight * (h W2ᵀ), once block m's h is complete.
    DOWN_PAIR: the tile is 2 x BLOCK_W output columns, two products sharing each activation chunk (as a
    gate/up tile does): the same packed bytes per K step as a gate/up tile."""
    # wait for the N_I_TILES gate/up tiles of this block (all handed out before this tile, see the module doc)
    while tl.atomic_add(ready_ptr + m, 0, sem="acquire", scope="gpu") < N_I_TILES:
        pass
    tl.debug_barrier()
    e = tl.load(block_expert_ptr + m).to(tl.int64)
    rows = tl.load(sorted_ids_ptr + m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    toks = (rows // top_k).to(tl.int64)
    offs_d = d * BLOCK_W * (1 + DOWN_PAIR) + tl.arange(0, BLOCK_W)
    d_ok = offs_d < D
    d2_ok = (offs_d + BLOCK_W) < D
    dt = inter_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_W, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_W, BLOCK_M), dtype=tl.float32)
    # inter is read through L2 (.cg): other SMs wrote it during this launch
    acc, acc2 = _wt_dot_act(acc, acc2, w2q_ptr + e * stride_qe + offs_d[:, None].to(tl.int64) * stride_qn,
                            w2s_ptr + e * stride_se + offs_d[:, None].to(tl.int64) * stride_sn, d_ok[:, None],
                            BLOCK_W * stride_qn, BLOCK_W * stride_sn, d2_ok[:, None],
                            inter_ptr + rows[None, :].to(tl.int64) * stride_im, row_ok[None, :],
                            I, dt, DOWN_PAIR, BLOCK_K, DOT_PRECISION, DECODE, ".cg")
    w = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0)
    # the reference's rounding: y in the activation dtype, times the weight in that dtype
    wt = w[None, :].to(dt).to(tl.float32)
    y = (acc.to(dt).to(tl.float32) * wt).to(dt).to(tl.float32)
    out_ptrs = out_ptr + toks[None, :] * stride_om + offs_d[:, None]
    tl.atomic_add(out_ptrs, y, mask=d_ok[:, None] & row_ok[None, :], sem="relaxed")
    if DOWN_PAIR:
        y2 = (acc2.to(dt).to(tl.float32) * wt).to(dt).to(tl.float32)
        tl.atomic_add(out_ptrs + BLOCK_W, y2, mask=d2_ok[:, None] & row_ok[None, :], sem="relaxed")


@triton.jit
def _mxfp4_moe_kernel(
    x_ptr, w13q_ptr, w13s_ptr, w2q_ptr, w2s_ptr, inter_ptr, out_ptr,
    sorted_ids_ptr, block_expert_ptr, topk_w_ptr, sched_ptr,
    num_rows, top_k,
    stride_xm, stride_13qe, stride_13qn, stride_13se, stride_13sn,
    stride_2qe, stride_2qn, stride_2se, stride_2sn, stride_im, stride_om,
    beta, linear_beta,
    D: tl.constexpr, I: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DECODE13: tl.constexpr, DECODE2: tl.constexpr, DOWN_PAIR: tl.constexpr,
):
    """The whole routed-expert layer (see the module docstring). sched_ptr int32: [0] the tile counter,
    [1] the number of row blocks in use, [2 + m] the finished gate/up tiles of block m; zero except [1]."""
    N_I_TILES: tl.constexpr = (I + BLOCK_W - 1) // BLOCK_W
    N_D_TILES: tl.constexpr = (D + BLOCK_W * (1 + DOWN_PAIR) - 1) // (BLOCK_W * (1 + DOWN_PAIR))
    n_blocks = tl.load(sched_ptr + 1)
    n_gate_up = n_blocks * N_I_TILES
    n_tiles = n_gate_up + n_blocks * N_D_TILES
    ready_ptr = sched_ptr + 2
    t = tl.atomic_add(sched_ptr, 1, sem="relaxed", scope="gpu")
    while t < n_tiles:
        if t < n_gate_up:
            _gate_up_tile(t // N_I_TILES, t % N_I_TILES, x_ptr, w13q_ptr, w13s_ptr, inter_ptr, sorted_ids_ptr,
                          block_expert_ptr, ready_ptr, num_rows, top_k, stride_xm, stride_13qe, stride_13qn,
                          stride_13se, stride_13sn, stride_im, beta, linear_beta, D, I, ACT,
                          BLOCK_M, BLOCK_W, BLOCK_K, DOT_PRECISION, DECODE13)
        else:
            td = t - n_gate_up
            _down_tile(td // N_D_TILES, td % N_D_TILES, inter_ptr, w2q_ptr, w2s_ptr, out_ptr, sorted_ids_ptr,
                       block_expert_ptr, topk_w_ptr, ready_ptr, num_rows, top_k, stride_im, stride_2qe,
                       stride_2qn, stride_2se, stride_2sn, stride_om, D, I, N_I_TILES,
                       BLOCK_M, BLOCK_W, BLOCK_K, DOT_PRECISION, DECODE2, DOWN_PAIR)
        t = tl.atomic_add(sched_ptr, 1, sem="relaxed", scope="gpu")


# ---- host side -----------------------------------------------------------------------------------------

@triton.jit
def _decode_bf16_pairs_kernel(q_ptr, s_ptr, lo_ptr, hi_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    q = tl.load(q_ptr + offs, mask=ok, other=0)
    s = tl.load(s_ptr + offs, mask=ok, other=127).to(tl.int32)
    pairs = _dequant_bf16x2_asm(q, (s << 7) | (s << 23))
    tl.store(lo_ptr + offs, pairs.to(tl.int16), mask=ok)
    tl.store(hi_ptr + offs, (pairs >> 16).to(tl.int16), mask=ok)


def decode_bf16_pairs_gpu(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's bf16 PTX decode on its own (CUDA): packed bytes q [N] uint8 and their scale bytes s [N]
    uint8 in [2, 252] -> (low-nibble, high-nibble) weights [N] bf16. Reference: ``e2m1_table()[code] *
    e8m0_to_float(s)`` rounded to bf16 (exact). Raises ValueError for other dtypes, shapes or devices."""
    if q.dtype != torch.uint8 or s.dtype != torch.uint8 or q.shape != s.shape or q.dim() != 1 or not q.is_cuda:
        raise ValueError("decode_bf16_pairs_gpu needs 1-D uint8 CUDA tensors of one length")
    lo = torch.empty(q.shape, dtype=torch.int16, device=q.device)
    hi = torch.empty_like(lo)
    _decode_bf16_pairs_kernel[(triton.cdiv(q.numel(), 1024),)](q, s, lo, hi, q.numel(), BLOCK=1024)
    return lo.view(torch.bfloat16), hi.view(torch.bfloat16)


# ``moe_align``: the PyTorch layout reference (one implementation, shared with the bf16 grouped MoE).
moe_align = align_by_expert


CONFIG_KEYS = ("BLOCK_M", "BLOCK_W", "BLOCK_K", "num_warps", "num_stages", "programs_per_sm", "decode", "maxnreg",
               "down_pair", "align")
DECODES = {"general": 0, "small": 1, "asm": 2}


def default_config(num_tokens: int, top_k: int, num_experts: int) -> dict:
    """Tiles by the mean number of rows per expert hit: decode (<= 16) takes BLOCK_M 16, the MMA's smallest N,
    4 programs per SM under a 128-register cap, 3 stages; prefill takes BLOCK_M 128 with one warpgroup on 64
    weight rows, two programs per SM. Both are the fastest correct configs of the second H200 sweep (commit
    7143052, ``benchmarks/results/mxfp4_moe.h200.md``): decode 185 us at 1 token and 5816 us at 64 tokens
    (36.3 % / 43.8 % of copy bandwidth; the previous default 209 / 7044 us), prefill 22.5 ms at 4096 tokens
    (24.2 % of bf16 GEMM; BLOCK_M 64: 26.0 ms). The middle tile (17-48 rows per expert) was not measured.
    NOTE: BLOCK_W should be 64 x (num_warps / 4): the dequantized tile is the wgmma's register operand, and
    warpgroups that split the tokens instead would each decode it. ``maxnreg`` caps the registers per thread
    (None: the compiler's choice), so that more programs fit on an SM; ``down_pair``: down tiles of
    2 x BLOCK_W output columns (two products per activation chunk, the bytes per K step of a gate/up tile);
    ``align``: ``triton`` (one launch) or ``torch`` (the reference ops).
    Picked from ``benchmarks/mxfp4_moe.py`` sweeps (``benchmarks/NOTES.md``)."""
    rows = num_tokens * top_k
    per_expert = rows / max(1, min(rows, num_experts))
    common = dict(decode="auto", maxnreg=None, down_pair=False, align="triton")
    if per_expert <= 16:
        return dict(common, BLOCK_M=16, BLOCK_W=64, BLOCK_K=128, num_warps=4, num_stages=3, programs_per_sm=4,
                    maxnreg=128)
    if per_expert <= 48:
        return dict(BLOCK_M=32, BLOCK_W=64, BLOCK_K=128, num_warps=4, num_stages=3, programs_per_sm=2, **common)
    return dict(BLOCK_M=128, BLOCK_W=64, BLOCK_K=64, num_warps=4, num_stages=3, programs_per_sm=2, **common)


def choose_decode(experts: MXFP4Experts, which: str, dtype: torch.dtype, on_cuda: bool, want: str = "auto") -> int:
    """The in-register decode for ``w13`` or ``w2``: ``asm`` (bf16 on CUDA, every scale byte in [2, 252], so
    each weight is a normal bf16), else ``small`` (every byte <= 128), else ``general`` (any byte).
    ``want`` forces one; raises ValueError when the forced one cannot give exact weights."""
    lo, hi = experts.scale_byte_range(which)
    ok = {"asm": on_cuda and dtype == torch.bfloat16 and 2 <= lo and hi <= 252, "small": hi <= 128, "general": True}
    if want == "auto":
        return DECODES[next(d for d in ("asm", "small", "general") if ok[d])]
    if want not in DECODES:
        raise ValueError(f"unknown decode {want!r}; known: auto, {', '.join(DECODES)}")
    if not ok[want]:
        raise ValueError(f"decode {want!r} is not exact here ({which} scale bytes {lo}..{hi}, {dtype}, "
                         f"{'CUDA' if on_cuda else 'no CUDA'})")
    return DECODES[want]


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the interpreter runs the programs one after the other


def run_mxfp4_experts_triton(x: torch.Tensor, experts: MXFP4Experts, topk_weights: torch.Tensor,
                             topk_ids: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """Grouped W4A16 MoE in one launch: x [T, D] (bf16/fp16/fp32), topk_weights [T, k], topk_ids [T, k]
    (int, in [0, E)) -> [T, D] in x's dtype.

    ``config`` overrides ``default_config`` (keys in ``CONFIG_KEYS``): tile sizes BLOCK_M (token rows),
    BLOCK_W (weight rows), BLOCK_K (input columns per step; all powers of two, >= 16, BLOCK_K >= 32);
    num_warps, num_stages; programs_per_sm (the persistent grid is SMs x this); decode (auto, asm, small,
    general: see ``choose_decode``); maxnreg (None or a register cap per thread); down_pair (bool);
    align (triton or torch). Raises ValueError for a shape that does not match ``experts``, an unknown
    activation, an unknown config key or value, a bad tile size or a decode that is not exact here.
    """
    if x.dim() != 2 or x.shape[1] != experts.hidden_size:
        raise ValueError(f"x has shape {list(x.shape)}, the experts expect [T, {experts.hidden_size}]")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must both "
                         f"be [T={x.shape[0]}, k]")
    if experts.activation not in _ACT_CODES:
        raise ValueError(f"unsupported activation {experts.activation!r} in the MXFP4 MoE kernel")
    bad = sorted(set(config or {}) - set(CONFIG_KEYS))
    if bad:
        raise ValueError(f"unknown MXFP4 MoE config keys {bad}; known: {list(CONFIG_KEYS)}")
    T, D = x.shape
    I, E = experts.intermediate_size, experts.num_experts
    if T == 0:
        return x.new_zeros(0, D)
    k = topk_ids.shape[1]
    cfg = dict(default_config(T, k, E), **(config or {}))
    bm, bw, bk = cfg["BLOCK_M"], cfg["BLOCK_W"], cfg["BLOCK_K"]
    for name, v, least in (("BLOCK_M", bm, 16), ("BLOCK_W", bw, 16), ("BLOCK_K", bk, 32)):
        if v < least or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {least}, got {v}")
    if cfg["align"] not in ("triton", "torch"):
        raise ValueError(f"align must be triton or torch, got {cfg['align']!r}")
    on_cuda = x.is_cuda
    dec13 = choose_decode(experts, "w13", x.dtype, on_cuda, cfg["decode"])
    dec2 = choose_decode(experts, "w2", x.dtype, on_cuda, cfg["decode"])
    x = x.contiguous()
    if cfg["align"] == "triton":
        sorted_ids, block_expert, sched = moe_align_triton(topk_ids, E, bm)
    else:
        sorted_ids, block_expert, num_blocks = moe_align(topk_ids, E, bm)
        sched = torch.zeros(2 + block_expert.numel(), dtype=torch.int32, device=x.device)
        sched[1:2] = num_blocks
    max_blocks = block_expert.numel()
    rows = T * k
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    beta, lbeta = (experts.act_params + (4.0, 25.0))[:2] if experts.activation == "situ" else (1.0, 1.0)
    inter = torch.empty(rows, I, dtype=x.dtype, device=x.device)
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    pair = bool(cfg["down_pair"])
    n_tiles_max = max_blocks * (triton.cdiv(I, bw) + triton.cdiv(D, bw * (1 + pair)))
    grid = (max(1, min(n_tiles_max, _num_sms(x.device) * cfg["programs_per_sm"])),)
    w13q, w13s, w2q, w2s = (experts.w13_weight_packed, experts.w13_weight_scale,
                            experts.w2_weight_packed, experts.w2_weight_scale)
    _mxfp4_moe_kernel[grid](
        x, w13q, w13s, w2q, w2s, inter, out, sorted_ids, block_expert, weights, sched,
        rows, k,
        x.stride(0), w13q.stride(0), w13q.stride(1), w13s.stride(0), w13s.stride(1),
        w2q.stride(0), w2q.stride(1), w2s.stride(0), w2s.stride(1), inter.stride(0), out.stride(0),
        float(beta), float(lbeta),
        D=D, I=I, ACT=_ACT_CODES[experts.activation], BLOCK_M=bm, BLOCK_W=bw, BLOCK_K=bk,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", DECODE13=dec13, DECODE2=dec2,
        DOWN_PAIR=pair, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {}))
    return out if x.dtype == torch.float32 else out.to(x.dtype)
