"""Triton flash attention with LSE for the MLA prefill's dense attention: same signature and result as
:func:`longflash.attention.ops.attention_with_lse` (the reference; ``tests/test_triton_prefill.py``
compares them), without the reference's [H, Tq, Tk] score buffer.

Algorithm: the FlashAttention-2 forward pass (Dao 2023, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning", Algorithm 1). One program per (head, BLOCK_M queries) keeps its
query tile on chip and walks the keys BLOCK_N at a time: ``s = q · kᵀ`` with ``tl.dot`` (bf16/fp16
operands, fp32 accumulation; fp32 inputs take IEEE fp32 products), an online softmax in base 2 (the
softmax scale times log2(e) is folded into one multiplier, so ``exp2`` replaces ``exp``), and
``acc = acc · 2^(m_old − m_new) + p · v``. At the end ``out = acc / l`` and the natural-log LSE is
``(m + log2 l) · ln 2``; a query that sees no key keeps ``l = 0`` and gets output 0 and LSE −inf,
as the reference.

Work layout:
- the query/key width D is split into a power-of-two part and a remainder (192 = 128 + 64, DeepSeek-V3's
  qk_nope 128 + rope 64), so no dot runs on padding; other widths pad each part to a power of two >= 16
  with masked lanes. Dv pads to a power of two >= 16 likewise.
- causal (query i sees keys j <= i + causal_offset): the key loop stops at the last tile any query of
  the program sees, and the tiles that every query of the program sees in full run without masks; only
  the few tiles on the diagonal (and the ragged end of Tk) apply the mask. Both kinds of step compute
  a visible score alike, so a query's result does not depend on which tile it falls in (a prompt split
  into prefill chunks at any token gets the same bits; tested on the GPU).
- key and value tiles: pointer tiles (cp.async pipelining on sm_80+), or under a config's ``TMA`` key
  TMA tensor descriptors that each program makes for its head's [Tk, width] views (one global-scratch
  allocation per launch, 128 bytes per descriptor); out-of-bounds rows and columns read as 0 either
  way, so the same values reach the same dots and both give the same bits (the interpreter tests check
  it; a GPU test too). Tensors whose alignment TMA does not allow take the pointer tiles.
- ``OVERLAP`` configs run the unmasked key tiles in pairs with each tile's scores computed before the
  previous tile's softmax (:func:`_key_pair`), the scores' two dots in the other order (D2 part first):
  results differ from the plain step's by fp32 rounding, and do not depend on the chunk start either.
- grid (H, cdiv(Tq, BLOCK_M)) with the head the fastest axis and the query tiles in reverse order: the
  programs with the most causal work start first (a longest-first schedule), and the heads that share a
  single KV head's tiles run together.

Memory: O((Tq + Tk) · H · D) (the inputs and the output), against the reference's O(H · Tq · Tk) fp32
scores. FLOPs of a causal call ≈ 2 · H · (D + Dv) · (visible query-key pairs).

In the CPU interpreter (``TRITON_INTERPRET=1``) the key loops are ``while`` loops (a ``for`` over
run-time tensor bounds fails there); on the GPU they are ``for`` loops that Triton software-pipelines.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import operator

import torch
import triton
import triton.language as tl

from longflash.attention.ops import varlen_prefix_sums
from longflash.ops.tile_config import check_tile_shape
from longflash.ops.triton_env import interpreting
from longflash.ops.triton_math import dot_acc
from longflash.runner.step_inputs import to_device_async

LOG2E = 1.4426950408889634

# Tile configs: BLOCK_M queries x BLOCK_N keys per step, num_warps, and num_stages (depth of the software
# pipeline of the key/value loads: cp.async, or TMA copies under TMA=True, into multi-buffered shared
# memory). All are Hopper FlashAttention-2 shapes (8 warps = two warpgroups over 128 query rows, wgmma
# on both dots; or one over 64 rows); benchmarks/prefill_attention.py times them. At D = 192, Dv = 128
# (bf16, sm_90; tests/test_triton_prefill.py compiles them) none spills: 128x128 s2 uses 255 registers
# and 208 KB of shared memory, 128x64 s2 198 and 128 KB, s3 172 KB, 64x64 w4 s2 104 KB (two programs
# per SM).
# H200, 16 heads, D 192 / Dv 128 bf16 (benchmarks/prefill_attention.py; bf16 GEMM measured at ~790
# TFLOP/s): causal 16K x 16K, 128x128 s2 3.09 ms (445 TFLOP/s, 0.57 of the GEMM rate), 128x64 s3 3.15;
# non-causal 4K x 32K chunk, 128x64 s3 3.18 ms, 128x128 s2 3.21. In an earlier run of all five (the
# same kernel before the masked and unmasked steps were made alike, ~3% slower): causal 16K 128x64 s4
# 3.29, 64x64 3.71, 128x64 s2 4.11 ms; causal 4K 128x128 s2 0.22 ms. For comparison, the in-place
# PyTorch form took 107.9 / 47.0 ms and cuDNN's SDPA (no LSE) 2.24 / 2.03 ms.
# The "_tma" entries (issue #10) read the key and value tiles through TMA tensor descriptors: Triton then
# pipelines them as TMA copies completing on mbarriers (no per-thread addresses: 128x128 s2 needs 200
# registers instead of 255) instead of cp.async; same smem plus the barriers. H200
# (benchmarks/results/prefill_attention_tma.h200.md): 128x64 s3 TMA, the best, causal 16K 2.59 ms (0.66
# of the GEMM rate) against 3.19 for the best cp.async tile, causal 4K 0.190 vs 0.219, the 4K x 32K chunk
# 2.46 vs 3.18; the "_ms1" and "_ov" entries below measured slower than 128x64 s3 TMA in session 26
# (causal 16K 2.77-3.42 ms vs 2.50; results/prefill_attention_s26_sweep.h200.json). NOTE: with cp.async ptxas
# serializes every wgmma of the kernel (its warning C7515, "non wgmma instructions defining accumulator
# registers"; only with both key loops in the kernel, not with either alone): the SASS waits after each HGMMA, 32 waits for 32 HGMMAs at 128x64 s3, where the TMA
# kernel keeps one wait per dot (6 for 32). The "_ms1" entries are the cp.async kernels with the masked
# key loop not pipelined (MASKED_STAGES=1: its 1-3 tiles per program load without prefetch), which
# ptxas does not serialize either: they tell the TMA copies' gain from the de-serialization's.
# 64x128 w4 exists only with TMA (with cp.async it spills 680 bytes); 128x128 s3 needs 289 KB of shared
# memory and does not fit. The "_ov" entries add OVERLAP (:func:`_key_pair`: the next tile's scores run
# during a softmax, for every second tile); their unrolled pair of steps needs two sets of key/value
# buffers (128x64 s2: 224 KB), and their pointer fallback is poor (128x64 spills registers).
PREFILL_CONFIGS: dict[str, dict] = {
    "m128_n128_w8_s2": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    "m128_n64_w8_s3": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "m128_n64_w8_s4": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
    "m128_n64_w8_s2": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    "m64_n64_w4_s2": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    "m128_n128_w8_s2_tma": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, TMA=True),
    "m128_n64_w8_s3_tma": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, TMA=True),
    "m128_n64_w8_s4_tma": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4, TMA=True),
    "m64_n128_w4_s2_tma": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, TMA=True),
    "m64_n64_w4_s2_tma": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, TMA=True),
    "m128_n64_w8_s2_tma_ov": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, TMA=True, OVERLAP=True),
    "m128_n32_w8_s4_tma_ov": dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=4, TMA=True, OVERLAP=True),
    "m128_n128_w8_s2_ms1": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, MASKED_STAGES=1),
    "m128_n64_w8_s3_ms1": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, MASKED_STAGES=1),
}
# The default for bf16/fp16 is the first config in this order whose operand buffers fit
# (:func:`smem_bytes` <= SMEM_BUDGET): wider heads than DeepSeek-V3's fall back to smaller tiles. The first,
# 128x64 s3 through TMA, is the H200's fastest at every measured shape (session 25,
# benchmarks/results/prefill_attention_tma.h200.md: 1.16-1.29x the cp.async 128x128 s2 it replaces); where TMA
# cannot read the tensors or the GPU has no TMA (compute capability < 9.0) the same tile runs through pointers.
DEFAULT_ORDER = ("m128_n64_w8_s3_tma", "m128_n128_w8_s2", "m128_n64_w8_s3", "m128_n64_w8_s2", "m64_n64_w4_s2")
# Keys a config may add to the four above, with their default: TMA reads the key and value tiles through
# TMA tensor descriptors (see :func:`tma_ok`; the pointer path where alignment does not allow it);
# OVERLAP runs the unmasked key tiles in pairs with the scores computed a tile ahead (:func:`_key_pair`);
# MASKED_STAGES (None: num_stages) is the software-pipeline depth of the masked key loop alone.
OPTIONAL_KEYS = {"TMA": False, "OVERLAP": False, "MASKED_STAGES": None}
SMEM_BUDGET = 220 * 1024  # sm_90: 227 KB per block, less a margin for the compiler's scratch
FP32_CONFIG = dict(BLOCK_M=32, BLOCK_N=16, num_warps=8, num_stages=2)
# The interpreter runs a program's tiles as NumPy ops: small tiles keep the CPU tests fast and put
# several tiles (and the causal diagonal) inside the tests' short sequences.
INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def split_width(d: int) -> tuple[int, int]:
    """(D1, D2) tile widths of a query/key width ``d`` >= 1: D1 the largest power of two <= d (at least
    16, tl.dot's minimum), D2 a power of two >= 16 covering the rest, 0 if none (192 -> (128, 64),
    48 -> (32, 16), 24 -> (16, 16), 8 -> (16, 0)). Raises ValueError for d < 1."""
    if d < 1:
        raise ValueError(f"head width must be >= 1, got {d}")
    d1 = max(16, 1 << (d.bit_length() - 1))
    return d1, (max(16, triton.next_power_of_2(d - d1)) if d > d1 else 0)


@triton.jit
def _load_rows(ptrs, n, Tk, c, C: tl.constexpr, BLOCK_C: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """A [BLOCK_N, BLOCK_C] tile of key / value rows ``n`` at ``ptrs``, columns ``c`` (< C real): rows >= Tk
    (only under ``MASKED``) and padding columns read as 0; widened to fp32 under ``IEEE``."""
    if MASKED:
        x = tl.load(ptrs, mask=(n < Tk)[:, None] & (c < C)[None, :], other=0.0)
    elif BLOCK_C > C:
        x = tl.load(ptrs, mask=(c < C)[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    if IEEE:
        x = x.to(tl.float32)
    return x


@triton.jit
def _kv_tile(src, off, start, col0, n, Tk, c, C: tl.constexpr, BLOCK_C: tl.constexpr, MASKED: tl.constexpr,
             IEEE: tl.constexpr, TMA: tl.constexpr):
    """A [BLOCK_N, BLOCK_C] tile of key / value rows ``n = start + [0, BLOCK_N)``, widened to fp32 under
    ``IEEE``. Under ``TMA`` ``src`` is a tensor descriptor read at column ``col0`` (rows >= Tk and columns
    past its width come back 0: TMA's out-of-bounds fill, in any step); otherwise ``src`` is the pointer
    tile of rows [0, BLOCK_N), columns ``c`` (< C real), moved ``off`` elements (``start`` rows) on
    (:func:`_load_rows`)."""
    if TMA:
        x = src.load([start, col0])
        if IEEE:
            x = x.to(tl.float32)
    else:
        x = _load_rows(src + off, n, Tk, c, C, BLOCK_C, MASKED, IEEE)
    return x


@triton.jit
def _scores(q1, q2, k_src1, k_src2, start, n, koff, Tk, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
            BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
            LONG_LAST: tl.constexpr):
    """Raw scores ``q · kᵀ`` [BLOCK_M, BLOCK_N] fp32 of the key rows ``n = start + [0, BLOCK_N)`` (``koff``
    elements into the pointer tiles; rows >= Tk read as 0 under ``MASKED`` or ``TMA``). ``LONG_LAST``: the
    D2-wide product first and the D1-wide one accumulated onto it (the longer dot last: the one an
    overlapped step leaves running); else D1 first."""
    d1 = tl.arange(0, D1)
    if LONG_LAST and D2 > 0:
        k2 = _kv_tile(k_src2, koff, start, D1, n, Tk, tl.arange(0, D2), D - D1, D2, MASKED, IEEE, TMA)
        s = dot_acc(q2, tl.trans(k2), None, IEEE)
        k1 = _kv_tile(k_src1, koff, start, 0, n, Tk, d1, D, D1, MASKED, IEEE, TMA)
        s = dot_acc(q1, tl.trans(k1), s, IEEE)
    else:
        k1 = _kv_tile(k_src1, koff, start, 0, n, Tk, d1, D, D1, MASKED, IEEE, TMA)
        s = dot_acc(q1, tl.trans(k1), None, IEEE)
        if D2 > 0:
            # the second part's columns D1 + d2 (< D real): D - D1 of its D2
            k2 = _kv_tile(k_src2, koff, start, D1, n, Tk, tl.arange(0, D2), D - D1, D2, MASKED, IEEE, TMA)
            s = dot_acc(q2, tl.trans(k2), s, IEEE)
    return s


@triton.jit
def _softmax_pv(s, acc, m_i, l_i, v_src, start, n, voff, rows, Tk, causal_offset, qk_scale,
                DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                CAUSAL: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
    """The online-softmax update of (acc, m, l) by the raw scores ``s`` of the key rows ``n = start + [0,
    BLOCK_N)`` and their value rows (``voff`` elements into the pointer tile). ``MASKED``: apply the Tk
    bound and (``CAUSAL``) the causal rule, and guard rows that have seen no key yet (m = −inf); otherwise
    every (query, key) pair is visible."""
    # NOTE: the mask goes on the raw dot and both paths then run the same operations (max, then one
    # FMA per score), so a query's result does not depend on whether the other queries of its tile made
    # a key tile masked: the same query gets the same bits wherever its chunk starts. Needs qk_scale > 0.
    if MASKED:
        ok = (n < Tk)[None, :]
        if CAUSAL:
            ok = ok & (n[None, :] <= rows[:, None] + causal_offset)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: p = 0
    else:
        m_use = m_new
    v = _kv_tile(v_src, voff, start, 0, n, Tk, tl.arange(0, BLOCK_DV), DV, BLOCK_DV, MASKED, IEEE, TMA)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
    return acc, m_new, l_i


@triton.jit
def _key_tile(q1, q2, acc, m_i, l_i, k_src1, k_src2, v_src, start, rows, Tk, causal_offset, qk_scale,
              stride_kt, stride_vt, D: tl.constexpr, DV: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
              BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              IEEE: tl.constexpr, TMA: tl.constexpr, LONG_LAST: tl.constexpr):
    """One BLOCK_N-key step of the online softmax for the program's query tile: its scores (``LONG_LAST``:
    see :func:`_scores`), then the update (:func:`_softmax_pv`; ``MASKED`` there). ``k_src1`` / ``k_src2``
    / ``v_src``: the key parts' and the values' tensor descriptors under ``TMA``, else their pointer tiles
    (:func:`_kv_tile`)."""
    n = start + tl.arange(0, BLOCK_N)
    koff = start.to(tl.int64) * stride_kt  # pointer tiles only
    voff = start.to(tl.int64) * stride_vt
    s = _scores(q1, q2, k_src1, k_src2, start, n, koff, Tk, D, D1, D2, BLOCK_N, MASKED, IEEE, TMA, LONG_LAST)
    return _softmax_pv(s, acc, m_i, l_i, v_src, start, n, voff, rows, Tk, causal_offset, qk_scale, DV, BLOCK_DV,
                       BLOCK_N, MASKED, CAUSAL, IEEE, TMA)


@triton.jit
def _key_pair(s_a, q1, q2, acc, m_i, l_i, k_src1, k_src2, v_src, start, rows, Tk, causal_offset, qk_scale,
              stride_kt, stride_vt, D: tl.constexpr, DV: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
              BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
              TMA: tl.constexpr):
    """Two unmasked key steps (tiles ``start`` and ``start + BLOCK_N``), each tile's scores issued before
    the softmax of the tile before it (FlashAttention-3's intra-warpgroup overlap, Shah et al. 2024).
    ``s_a``: the raw scores of tile ``start`` (from the pair before, or the kernel's prologue); returns
    (acc, m, l, the raw scores of tile ``start + 2 BLOCK_N``), read with masked loads (it may pass Tk and
    goes unused at the end of the range). What Triton 3.6 makes of it on sm_90: a dot whose result is
    used in the same iteration is waited for at once, so only the scores carried to the next pair (the
    D1-wide part of tile start + 2 BLOCK_N, 2/3 of its product) run while tile start + BLOCK_N's softmax
    does. NOTE: two steps per call on purpose: with one, the carried scores are copied into the next
    step's registers at the loop's back edge while their wgmma runs, and ptxas serializes every wgmma
    of the kernel (its warning C7514)."""
    n = start + tl.arange(0, BLOCK_N)
    so = BLOCK_N * stride_kt
    koff = start.to(tl.int64) * stride_kt
    voff = start.to(tl.int64) * stride_vt
    s_b = _scores(q1, q2, k_src1, k_src2, start + BLOCK_N, n + BLOCK_N, koff + so, Tk, D, D1, D2, BLOCK_N, False,
                  IEEE, TMA, True)
    acc, m_i, l_i = _softmax_pv(s_a, acc, m_i, l_i, v_src, start, n, voff, rows, Tk, causal_offset, qk_scale, DV,
                                BLOCK_DV, BLOCK_N, False, CAUSAL, IEEE, TMA)
    s_a = _scores(q1, q2, k_src1, k_src2, start + 2 * BLOCK_N, n + 2 * BLOCK_N, koff + 2 * so, Tk, D, D1, D2,
                  BLOCK_N, True, IEEE, TMA, True)
    acc, m_i, l_i = _softmax_pv(s_b, acc, m_i, l_i, v_src, start + BLOCK_N, n + BLOCK_N, voff + BLOCK_N * stride_vt,
                                rows, Tk, causal_offset, qk_scale, DV, BLOCK_DV, BLOCK_N, False, CAUSAL, IEEE, TMA)
    return acc, m_i, l_i, s_a


@triton.jit
def _prefill_fwd_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, tile_ptr, qk_scale, Tq, Tk, causal_offset,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_ot, stride_oh, stride_lt, D: tl.constexpr, DV: tl.constexpr,
                        D1: tl.constexpr, D2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                        INTERPRET: tl.constexpr, TMA: tl.constexpr, OVERLAP: tl.constexpr,
                        MASKED_STAGES: tl.constexpr, VARLEN: tl.constexpr = False):
    """Grid (H, cdiv(Tq, BLOCK_M)); the last dimension of every tensor is contiguous (stride 1); a
    head stride of 0 broadcasts one KV head. ``qk_scale`` = softmax scale · log2(e). ``TMA``: the key and
    value tiles are read through tensor descriptors made here (the host checked TMA's alignment rules,
    :func:`tma_ok`), else through pointer tiles; the query tile through pointers either way. ``OVERLAP``:
    the unmasked tiles run in pairs of :func:`_key_pair`.
    ``VARLEN``: grid (H, number of query tiles); program (h, t) runs the query tile of row t of the int32
    table ``tile_ptr`` [tiles, 5] = (first query m0 of the tile, the request's first row q0 in q / out /
    lse, its queries Tq, its first row k0 in k / v, its keys Tk > 0); Tq, Tk and causal_offset are then
    the request's (causal: ``Tk - Tq``, its queries are its last Tq positions)."""
    h = tl.program_id(0).to(tl.int64)
    if VARLEN:
        row = tile_ptr + tl.program_id(1) * 5
        m0 = tl.load(row)
        q0 = tl.load(row + 1).to(tl.int64)
        Tq = tl.load(row + 2)
        k0 = tl.load(row + 3).to(tl.int64)
        Tk = tl.load(row + 4)
        causal_offset = Tk - Tq
        q_ptr += q0 * stride_qt
        out_ptr += q0 * stride_ot
        lse_ptr += q0 * stride_lt
        k_ptr += k0 * stride_kt
        v_ptr += k0 * stride_vt
    else:
        m0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M  # longest (causal) work first
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < Tq
    rows64 = rows.to(tl.int64)
    d1 = tl.arange(0, D1)
    dv = tl.arange(0, BLOCK_DV)
    q_base = q_ptr + h * stride_qh + rows64[:, None] * stride_qt
    q1 = tl.load(q_base + d1[None, :], mask=row_ok[:, None] & (d1 < D)[None, :], other=0.0)
    if IEEE:
        q1 = q1.to(tl.float32)
    q2 = q1  # unused when D2 == 0
    n = tl.arange(0, BLOCK_N)
    k_src1 = k_ptr + h * stride_kh + n.to(tl.int64)[:, None] * stride_kt + d1[None, :]
    k_src2 = k_src1
    if D2 > 0:
        d2 = D1 + tl.arange(0, D2)
        q2 = tl.load(q_base + d2[None, :], mask=row_ok[:, None] & (d2 < D)[None, :], other=0.0)
        if IEEE:
            q2 = q2.to(tl.float32)
        k_src2 = k_ptr + h * stride_kh + n.to(tl.int64)[:, None] * stride_kt + d2[None, :]
    v_src = v_ptr + h * stride_vh + n.to(tl.int64)[:, None] * stride_vt + dv[None, :]
    if TMA:
        # the key / value pointer tiles above give way to descriptors of each head's [Tk, width] view
        # (unused pointers are dropped by the compiler); the query tile is read once, through pointers
        k_src1 = tl.make_tensor_descriptor(k_ptr + h * stride_kh, [Tk, D], [stride_kt, 1], [BLOCK_N, D1])
        if D2 > 0:
            k_src2 = tl.make_tensor_descriptor(k_ptr + h * stride_kh, [Tk, D], [stride_kt, 1], [BLOCK_N, D2])
        else:
            k_src2 = k_src1
        v_src = tl.make_tensor_descriptor(v_ptr + h * stride_vh, [Tk, DV], [stride_vt, 1], [BLOCK_N, BLOCK_DV])

    # key range: [0, full_end) is visible to every query of the tile (no mask), [full_end, hi) needs one
    if CAUSAL:
        hi = tl.minimum(Tk, tl.maximum(m0 + BLOCK_M + causal_offset, 0))
        full_end = tl.minimum(hi, tl.maximum(m0 + causal_offset + 1, 0))
    else:
        hi = Tk
        full_end = Tk
    full_end = (full_end // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # NOTE: each loop appears twice on purpose: the compiled kernel needs `range` for Triton's pipeliner,
    # the interpreter a `while` over tensor bounds; the steps are `_key_tile` and `_key_pair`.
    # OVERLAP: the unmasked range runs in pairs of tiles; an odd last one joins the masked steps (exact for
    # a tile every query sees; a third loop for it makes ptxas serialize the wgmmas, warning C7515), whose
    # scores then take the pairs' dot order, so that a query's bits do not depend on whether its tile ran
    # in a pair. The prologue reads the first pair's scores (a wasted tile when there is no pair).
    if OVERLAP:
        pair_end = (full_end // (2 * BLOCK_N)) * (2 * BLOCK_N)
        s_a = _scores(q1, q2, k_src1, k_src2, pair_end * 0, tl.arange(0, BLOCK_N), pair_end.to(tl.int64) * 0, Tk, D,
                      D1, D2, BLOCK_N, True, IEEE, TMA, True)
    else:
        pair_end = full_end
    if INTERPRET:
        start = full_end * 0
        if OVERLAP:
            while start < pair_end:
                acc, m_i, l_i, s_a = _key_pair(s_a, q1, q2, acc, m_i, l_i, k_src1, k_src2, v_src, start, rows, Tk,
                                               causal_offset, qk_scale, stride_kt, stride_vt, D, DV, D1, D2,
                                               BLOCK_DV, BLOCK_N, CAUSAL, IEEE, TMA)
                start += 2 * BLOCK_N
        else:
            while start < full_end:
                acc, m_i, l_i = _key_tile(q1, q2, acc, m_i, l_i, k_src1, k_src2, v_src, start, rows, Tk,
                                          causal_offset, qk_scale, stride_kt, stride_vt, D, DV, D1, D2, BLOCK_DV,
                                          BLOCK_N, False, CAUSAL, IEEE, TMA, False)
                start += BLOCK_N
        while start < hi:
            acc, m_i, l_i = _key_tile(q1, q2, acc, m_i, l_i, k_src1, k_src2, v_src, start, rows, Tk,
                                      causal_offset, qk_scale, stride_kt, stride_vt, D, DV, D1, D2, BLOCK_DV,
                                      BLOCK_N, True, CAUSAL, IEEE, TMA, OVERLAP)
            start += BLOCK_N
    else:
        if OVERLAP:
            for start in range(0, pair_end, 2 * BLOCK_N):
                acc, m_i, l_i, s_a = _key_pair(s_a, q1, q2, acc, m_i, l_i, k_src1, k_src2, v_src, start, rows, Tk,
                                               causal_offset, qk_scale, stride_kt, stride_vt, D, DV, D1, D2,
                                               BLOCK_DV, BLOCK_N, CAUSAL, IEEE, TMA)
        else:
            for start in range(0, full_end, BLOCK_N):
                acc, m_i, l_i = _key_tile(q1, q2, acc, m_i, l_i, k_src1, k_src2, v_src, start, rows, Tk,
                                          causal_offset, qk_scale, stride_kt, stride_vt, D, DV, D1, D2, BLOCK_DV,
                                          BLOCK_N, False, CAUSAL, IEEE, TMA, False)
        for start in tl.range(pair_end, hi, BLOCK_N, num_stages=MASKED_STAGES):
            acc, m_i, l_i = _key_tile(q1, q2, acc, m_i, l_i, k_src1, k_src2, v_src, start, rows, Tk,
                                      causal_offset, qk_scale, stride_kt, stride_vt, D, DV, D1, D2, BLOCK_DV,
                                      BLOCK_N, True, CAUSAL, IEEE, TMA, OVERLAP)

    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc * tl.where(seen, 1.0 / l_safe, 0.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_ptrs = out_ptr + h * stride_oh + rows64[:, None] * stride_ot + dv[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv < DV)[None, :])
    tl.store(lse_ptr + h + rows64 * stride_lt, lse, mask=row_ok)


def smem_bytes(config: dict, d: int, dv: int, elem: int = 2) -> int:
    """Shared memory of a config's operand buffers in bytes: the query tile plus ``num_stages`` key and
    value tiles (``elem`` bytes per element; padded widths). Matches the compiled kernel's allocation
    at D 192 / Dv 128 bf16 (128 KB for 128x64 s2, 208 KB for 128x128 s2; a TMA config adds 1 KB of
    mbarriers). Not modelled: an OVERLAP config's two sets of key/value buffers."""
    d1, d2 = split_width(d)
    bdv = max(16, triton.next_power_of_2(dv))
    return elem * (config["BLOCK_M"] * (d1 + d2)
                   + max(1, config["num_stages"]) * config["BLOCK_N"] * (d1 + d2 + bdv))


def default_config(dtype: torch.dtype, d: int = 192, dv: int = 128) -> dict:
    """The tile config a call with no ``config`` runs: ``INTERPRET_CONFIG`` under the interpreter,
    ``FP32_CONFIG`` for fp32 inputs, else the first of ``DEFAULT_ORDER`` whose operand buffers fit in
    ``SMEM_BUDGET`` (the smallest tile if none does: it will not launch on sm_90; :func:`dispatch_attention_with_lse`
    sends such widths to the PyTorch form, see :func:`fits`)."""
    if interpreting():
        return dict(INTERPRET_CONFIG)
    if dtype == torch.float32:
        return dict(FP32_CONFIG)
    for name in DEFAULT_ORDER:
        if smem_bytes(PREFILL_CONFIGS[name], d, dv) <= SMEM_BUDGET:
            return dict(PREFILL_CONFIGS[name])
    return dict(PREFILL_CONFIGS[DEFAULT_ORDER[-1]])


def fits(d: int, dv: int) -> bool:
    """Whether some 16-bit tile of ``DEFAULT_ORDER`` fits ``SMEM_BUDGET`` at widths ``d`` / ``dv`` (D 192 /
    Dv 128: the first, 128 x 64 with 3 stages, 172 KB; D 576 / Dv 512 would need 352 KB even at the smallest
    tile)."""
    return any(smem_bytes(PREFILL_CONFIGS[name], d, dv) <= SMEM_BUDGET for name in DEFAULT_ORDER)


def resolve_config(dtype: torch.dtype, config: dict | str | None = None, d: int = 192, dv: int = 128) -> dict:
    """The tile config a call runs: ``config`` (a ``PREFILL_CONFIGS`` name, or a dict with BLOCK_M,
    BLOCK_N, num_warps, num_stages whose missing keys come from the default's; its optional keys are off
    unless the dict sets them) or, if None,
    :func:`default_config` for ``dtype`` and widths ``d`` / ``dv``. A dict may also set the optional keys of
    ``OPTIONAL_KEYS`` (``TMA``: read k and v through tensor descriptors; ``OVERLAP``: key tiles in pairs;
    ``MASKED_STAGES``: the masked loop's pipeline depth).
    Raises ValueError for an unknown name, unknown keys, tile sizes that are not powers of two >= 16,
    num_warps not a power of two in 1..16, num_stages not an int >= 1, a TMA / OVERLAP that is not a
    bool, or a MASKED_STAGES that is neither None nor an int >= 1."""
    if config is None:
        return default_config(dtype, d, dv)
    if isinstance(config, str):
        if config not in PREFILL_CONFIGS:
            raise ValueError(f"unknown prefill config {config!r}; known: {sorted(PREFILL_CONFIGS)}")
        return dict(PREFILL_CONFIGS[config])
    # the four tile keys of the default at these widths; the optional keys stay off unless the dict sets them
    base = {k: v for k, v in default_config(dtype, d, dv).items() if k not in OPTIONAL_KEYS}
    unknown = set(config) - set(base) - set(OPTIONAL_KEYS)
    if unknown:
        raise ValueError(f"unknown prefill config keys {sorted(unknown)}; allowed: {sorted({*base, *OPTIONAL_KEYS})}")
    cfg = {**base, **config}
    check_tile_shape(cfg, "prefill config")
    for key in ("TMA", "OVERLAP"):
        if not isinstance(cfg.get(key, False), bool):
            raise ValueError(f"{key} must be a bool, got {cfg[key]!r}")
    ms = cfg.get("MASKED_STAGES")
    if ms is not None and (not isinstance(ms, int) or isinstance(ms, bool) or ms < 1):
        raise ValueError(f"MASKED_STAGES must be None or an int >= 1, got {ms!r}")
    return cfg


def tma_ok(cfg: dict, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel can read the key and value tiles of ``k`` [Tk, heads, D] and ``v`` [Tk, heads, Dv]
    through TMA tensor descriptors with tile config ``cfg``. TMA's rules (CUDA's ``cuTensorMapEncodeTiled``;
    Triton's ``tl.make_tensor_descriptor`` states the same): every head's [Tk, width] view starts on a
    16-byte boundary and its token stride is a multiple of 16 bytes, so the base address and the token and
    head strides must be (a single, broadcast head's stride is never used); the last dimension is
    contiguous; a tile side is at most 256 elements. The MLA prefill's k (a concatenation) and v (a split
    view of the up-projection: 256-byte offset, 512-byte head stride in bf16) qualify; a value width of
    20 bf16 per row does not (40-byte stride); nor does a GPU without TMA (compute capability < 9.0). False
    means the pointer path (same results)."""
    d1, d2 = split_width(k.shape[-1])
    if max(cfg["BLOCK_N"], d1, d2, triton.next_power_of_2(v.shape[-1])) > 256:
        return False
    if k.is_cuda and not _has_tma(k.device.index if k.device.index is not None else torch.cuda.current_device()):
        return False
    for t in (k, v):
        e = t.element_size()
        if (t.data_ptr() % 16 or t.stride(-1) != 1 or (t.stride(0) * e) % 16
                or (t.shape[1] > 1 and (t.stride(1) * e) % 16)):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    """CUDA device ``device_index`` has the Tensor Memory Accelerator (compute capability >= 9.0, Hopper)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's global-scratch allocator (``triton.set_allocator``) for the tensor descriptors a TMA program
    makes on the device (128 bytes each): ``size`` bytes on the current CUDA device, on the current stream
    (the kernel's; PyTorch's allocations are 512-byte aligned, more than any ``alignment`` Triton asks)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """Install :func:`_scratch` as Triton's allocator in this thread's context unless one is set (Triton's
    default raises at the launch of a kernel that needs scratch). NOTE: Triton 3.6 has no public getter:
    this reads its ``runtime._allocation._allocator`` context variable."""
    from triton.runtime import _allocation
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale) -> None:
    """The argument checks both launches share (their docstrings' Raises)."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number (a float), got {type(scale).__name__}")
    if not 0 < float(scale) < math.inf:
        raise ValueError(f"scale must be a finite number > 0, got {float(scale)!r}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be 3-D ([T, heads, width]), got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    H = q.shape[1]
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same number of keys, got {k.shape[0]} and {v.shape[0]}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[1] not in (1, H):
            raise ValueError(f"{name} must have 1 or {H} heads (q's), got {t.shape[1]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k widths differ: {q.shape[2]} vs {k.shape[2]}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of {_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.is_cuda or interpreting()):
        raise ValueError("the Triton prefill kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before "
                         "Triton is imported)")


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       causal_offset: int | None, *, config: dict | str | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of one request with its log-sum-exp, as one Triton kernel (FlashAttention-2
    forward, Dao 2023); the result of :func:`longflash.attention.ops.attention_with_lse` (fp32
    softmax) up to fp32 rounding and, for bf16/fp16, the rounding of the probabilities to the input
    dtype before the ``p · v`` product (as every flash-attention kernel does).

    Args:
        q: [Tq, H, D] fp16, bf16 or fp32; any strides with a contiguous last dimension (others are copied).
        k: [Tk, H or 1, D], v: [Tk, H or 1, Dv], q's dtype and device; a single KV head broadcasts to all
            H query heads (read once per head, never expanded in memory); views such as a split of a
            wider [Tk, H, nope + Dv] projection are read through their strides.
        scale: softmax scale applied to q · k, a finite float > 0 (e.g. (qk_nope + rope) ** -0.5).
        causal_offset: None = non-causal; an int = query i sees keys j <= i + causal_offset (may be
            negative, so leading queries see nothing, or >= Tk, so all see everything).
        config: tile config override (``PREFILL_CONFIGS`` name or dict, see :func:`resolve_config`);
            benchmarks sweep it. A config with ``TMA`` reads k and v through tensor descriptors where
            :func:`tma_ok` allows (else through pointers, same results) and installs a Triton allocator for
            the descriptors' scratch (128 bytes per descriptor and program) if none is set.
    Returns:
        out [Tq, H, Dv] in q's dtype; lse [Tq, H] fp32, natural log of Σ_j exp(scale · q·k_j) over the
        visible keys. A query that sees no key (Tk == 0, or a negative causal_offset) gets out 0 and
        lse −inf. Tq == 0 or Tk == 0 launch nothing. No host sync.
    Raises:
        ValueError on mismatched shapes, dtypes or devices, a scale that is not finite and > 0, or off
        CUDA without the interpreter;
        TypeError for a causal_offset that is neither None nor an int, or a scale that is not a real number
        (Python or NumPy float/int; not a bool or a tensor).
    """
    if causal_offset is not None:
        if isinstance(causal_offset, bool) or not hasattr(causal_offset, "__index__"):
            raise TypeError(f"causal_offset must be None or an int, got {causal_offset!r}")
        causal_offset = operator.index(causal_offset)
    _check(q, k, v, scale)
    Tq, H, D = q.shape
    Tk, Dv = k.shape[0], v.shape[2]
    out = torch.empty((Tq, H, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((Tq, H), dtype=torch.float32, device=q.device)
    if Tq == 0 or H == 0:
        return out, lse
    if Tk == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    causal = causal_offset is not None
    # query i sees nothing below -i (every key j >= 0) and everything from Tk - 1 - i on: clamping to
    # [-Tq, Tk] keeps every answer and the argument in int32
    off = max(-Tq, min(Tk, causal_offset)) if causal else 0
    cfg = resolve_config(q.dtype, config, D, Dv)
    interp = interpreting()  # NOTE: the interpreter's bf16/fp16 dots are wrong: it widens to fp32 dots
    d1, d2 = split_width(D)
    tma = cfg.get("TMA", False) and tma_ok(cfg, k, v)
    if tma and not interp:
        _ensure_scratch_allocator()
    grid = (H, triton.cdiv(Tq, cfg["BLOCK_M"]))
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _prefill_fwd_kernel[grid](
            q, k, v, out, lse, lse, float(scale) * LOG2E, Tq, Tk, off,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1) if k.shape[1] > 1 else 0,
            v.stride(0), v.stride(1) if v.shape[1] > 1 else 0, out.stride(0), out.stride(1), lse.stride(0),
            D=D, DV=Dv, D1=d1, D2=d2, BLOCK_DV=max(16, triton.next_power_of_2(Dv)), BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, IEEE=q.dtype == torch.float32 or interp, INTERPRET=interp, TMA=tma,
            OVERLAP=cfg.get("OVERLAP", False), MASKED_STAGES=cfg.get("MASKED_STAGES"),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, lse



def attention_with_lse_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              seq_lens_q: list[int], seq_lens_k: list[int], causal: bool, *,
                              config: dict | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_with_lse` of B requests in one launch (the kernel's VARLEN form: one program per
    head and query tile of each request with keys, so a short request beside a long one costs no idle
    programs): request b's
    queries are the next ``seq_lens_q[b]`` rows of q and its keys the next ``seq_lens_k[b]`` rows of k / v;
    causal: its queries are its last ``seq_lens_q[b]`` key positions (``causal_offset = Tk_b − Tq_b``, the
    prefill's new tokens attending among themselves when the lengths are equal), else non-causal.

    Args:
        q: [Σ Tq_b, H, D]; k: [Σ Tk_b, H or 1, D]; v: [Σ Tk_b, H or 1, Dv] (as :func:`attention_with_lse`).
        seq_lens_q, seq_lens_k: B host ints >= 0 each (lists: the grid is sized from them, no device sync).
    Returns:
        out [Σ Tq_b, H, Dv] in q's dtype, lse [Σ Tq_b, H] fp32; a query that sees no key: 0 and −inf.
    Raises:
        ValueError as :func:`attention_with_lse`, and for lengths that are not ints >= 0, lists of different
        lengths, or sums other than q's and k's rows.
    """
    _check(q, k, v, scale)
    cu_q, cu_k = varlen_prefix_sums(seq_lens_q, seq_lens_k, q.shape[0], k.shape[0])
    Tq, H, D = q.shape
    Dv = v.shape[2]
    out = torch.empty((Tq, H, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((Tq, H), dtype=torch.float32, device=q.device)
    cfg = resolve_config(q.dtype, config, D, Dv)
    bm = cfg["BLOCK_M"]
    # the work table: one row per query tile of a request that has keys, the tiles that see the most keys
    # first (the single-request launch's longest-first order, across requests); a request without keys
    # gets 0 and -inf here and no tile (no empty programs, no zero-size TMA descriptor)
    tiles = []
    for b in range(len(cu_q) - 1):
        q0, nq, k0, nk = cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b], cu_k[b + 1] - cu_k[b]
        if nq and not nk:
            out[q0:q0 + nq].zero_()
            lse[q0:q0 + nq].fill_(float("-inf"))
        if nq and nk:
            for m0 in range(0, nq, bm):
                seen = min(nk, max(m0 + bm + nk - nq, 0)) if causal else nk
                tiles.append((seen, m0, q0, nq, k0, nk))
    if not tiles or H == 0:
        return out, lse
    tiles.sort(key=lambda t: -t[0])
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    interp = interpreting()
    d1, d2 = split_width(D)
    tma = cfg.get("TMA", False) and tma_ok(cfg, k, v)
    if tma and not interp:
        _ensure_scratch_allocator()
    table = to_device_async([x for t in tiles for x in t[1:]], torch.int32, q.device)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _prefill_fwd_kernel[(H, len(tiles))](
            q, k, v, out, lse, table, float(scale) * LOG2E, 0, 0, 0,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1) if k.shape[1] > 1 else 0,
            v.stride(0), v.stride(1) if v.shape[1] > 1 else 0, out.stride(0), out.stride(1), lse.stride(0),
            D=D, DV=Dv, D1=d1, D2=d2, BLOCK_DV=max(16, triton.next_power_of_2(Dv)), BLOCK_M=bm,
            BLOCK_N=cfg["BLOCK_N"], CAUSAL=bool(causal), IEEE=q.dtype == torch.float32 or interp, INTERPRET=interp,
            TMA=tma, OVERLAP=cfg.get("OVERLAP", False), MASKED_STAGES=cfg.get("MASKED_STAGES"), VARLEN=True,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, lse


def compile_fwd(config: dict, dtype: str = "bf16", d: int = 192, dv: int = 128, causal: bool = True,
                target=None, varlen: bool = False):
    """Compile the kernel ahead of time without a GPU (Triton's ``triton.compile``; the sm_90 checks in
    ``tests/test_triton_prefill.py``). ``config``: a tile dict as in ``PREFILL_CONFIGS``; ``dtype``:
    Triton's name of the input dtype ("bf16", "fp16", "fp32"); ``target``: a
    ``triton.backends.compiler.GPUTarget``, default sm_90. Pointers and the token/head strides are
    marked 16-divisible, as the JIT marks them for real tensors. Returns the ``CompiledKernel``
    (``.asm["ptx"]``, ``.metadata.shared``); ``varlen``: the kernel's VARLEN form (:func:`attention_with_lse_varlen`).
    Raises ValueError for an unknown dtype name."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"dtype must be 'bf16', 'fp16' or 'fp32', got {dtype!r}")
    cfg = resolve_config(torch.float32 if dtype == "fp32" else torch.bfloat16, dict(config))
    d1, d2 = split_width(d)
    sig = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
           "lse_ptr": "*fp32", "tile_ptr": "*i32" if varlen else "*fp32",
           "qk_scale": "fp32",
           **{n: "i32" for n in ("Tq", "Tk", "causal_offset", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                                 "stride_vt", "stride_vh", "stride_ot", "stride_oh", "stride_lt")}}
    const = dict(D=d, DV=dv, D1=d1, D2=d2, BLOCK_DV=max(16, triton.next_power_of_2(dv)), BLOCK_M=cfg["BLOCK_M"],
                 BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, IEEE=dtype == "fp32", INTERPRET=False,
                 TMA=cfg.get("TMA", False), OVERLAP=cfg.get("OVERLAP", False),
                 MASKED_STAGES=cfg.get("MASKED_STAGES"), VARLEN=varlen)
    sig.update({c: "constexpr" for c in const})
    names = list(sig)
    div = [n for n in names if n.endswith("_ptr") or (n.startswith("stride_") and n != "stride_lt")]
    src = ASTSource(fn=_prefill_fwd_kernel, signature=sig, constexprs={(names.index(c),): v for c, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div})
    return triton.compile(src, target=target or GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))


def dispatch_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                causal_offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``triton_ops.attention_with_lse`` (the MLA prefill's dense attention for a CUDA cache): this
    module's kernel (:func:`attention_with_lse`) for CUDA tensors whose widths a tile fits (:func:`fits`:
    every current model's), the in-place PyTorch form
    (:func:`longflash.attention.ops.attention_with_lse_inplace`, same arguments and results) for any
    other device or wider heads. Same arguments, returns and errors as the function it calls."""
    if q.is_cuda and (q.dtype == torch.float32 or fits(q.shape[-1], v.shape[-1])):
        return attention_with_lse(q, k, v, scale, causal_offset)
    from longflash.attention.ops import attention_with_lse_inplace
    return attention_with_lse_inplace(q, k, v, scale, causal_offset)


def dispatch_attention_with_lse_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                       seq_lens_q: list[int], seq_lens_k: list[int],
                                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``triton_ops.attention_with_lse_varlen``: :func:`attention_with_lse_varlen` (one launch) where
    :func:`dispatch_attention_with_lse` would take the kernel, else ``ops.attention_with_lse_varlen`` (its
    in-place form, one request at a time). Same arguments, returns and errors."""
    if q.is_cuda and (q.dtype == torch.float32 or fits(q.shape[-1], v.shape[-1])):
        return attention_with_lse_varlen(q, k, v, scale, seq_lens_q, seq_lens_k, causal)
    from longflash.attention.ops import attention_with_lse_inplace, varlen_by_request
    return varlen_by_request(attention_with_lse_inplace, q, k, v, scale, seq_lens_q, seq_lens_k, causal)
