"""Triton paged MLA decode/verify attention (absorbed path), same signature and result as
:func:`longflash.attention.ops.mla_decode_attention` (the reference; tests compare them).

Semantics (``shared/specs/mla_dcp_fp8.md``, MLA decode path): query width ``kv_lora_rank + rope``
against the cache rows ``[kv_c | k_pe]``; values are the first ``kv_lora_rank`` entries of the same row;
request b's ``q_len`` queries sit at positions ``seq_len - q_len + j`` and see the rows at positions
<= their own (causal among themselves); LSE = natural log-sum-exp of the scaled logits, −inf (output 0)
for a query that sees no row.

Design (memory-bound at decode: each cache row must be read once per request for all its heads):
- stage 1, grid (head-group, kv-split, request): a program takes BLOCK_M consecutive query rows of one
  request (row m = token j · H + head h, so the heads of several tokens share a tile) and walks the
  request's rows of its kv-split BLOCK_N at a time through the block table: scores with ``tl.dot``
  (bf16 operands, fp32 accumulation; the 576-wide dot is the 512 + 64 parts), online softmax in
  base 2, ``acc += p · kv_c``. The head-group is the fastest grid axis, so the programs that read the
  same rows run together and share them through L2. An fp8 cache is loaded as bytes and converted in
  registers; ``k_scale`` is folded into the score scale and the final output (exact: K and V are the
  same row times k_scale). With one split the program writes the final output and LSE.
- stage 2 (only with several splits), grid (query row, column tile): combines the splits' partial
  (out, lse) by LSE (the formula of ``merge_attn_states``: m = max lse, w_s = e^(lse_s − m),
  out = Σ w_s out_s / Σ w_s, lse = m + log Σ w_s; an empty split has weight exactly 0).
- number of splits (:func:`choose_num_splits`): the minimum of a time model that weighs filling the
  SMs (batch × head-groups × splits programs, wave quantization) against the partials' traffic.

Bytes moved (the decode roofline): Σ_b seq_len_b · W · elem (cache rows) + q, out, lse, block table;
FLOPs 2 · Σ_b q_len_b · H · seq_len_b · (W + kv_lora_rank). ``benchmarks/NOTES.md`` has the numbers.

In the CPU interpreter (``TRITON_INTERPRET=1``): the fp8 bytes are decoded with exact integer
operations (the interpreter's fp8 casts round wrongly) and the kv loop is a ``while`` loop (a ``for``
over run-time bounds fails there with NumPy 2.4); on the GPU it is a ``for`` loop that Triton
software-pipelines.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from longflash.attention.ops import DECODE_PIECE_ROWS, FP8_DTYPE
from longflash.attention.triton_ops import _from_e4m3_bits
from longflash.ops.tile_config import check_tile_shape
from longflash.ops.triton_env import interpreting, sm_count
from longflash.ops.triton_math import dot_acc

LOG2E = 1.4426950408889634
MIN_SPLIT_ROWS = 64
NARROW_WIDTH = 128  # cache rows of at most this many elements take the long narrow tiles (default_config)
# the keys a tile config may set (default_config documents them)
CONFIG_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "V_RELOAD", "TRANS", "F16", "PREFETCH",
                         "CVT_SMEM", "maxnreg", "occupancy", "GLUON", "WGMMA"})
MAX_SPLITS = 256
# Rates of the split-count model (choose_num_splits): H200 copy bandwidth, and a bf16 tensor-core rate
# this kernel may reach (about half the measured GEMM rate).
NOMINAL_BW = 4.0e12
NOMINAL_FLOPS = 4.0e14


@triton.jit
def _load_rows(ptrs, mask, FP8: tl.constexpr, HW_FP8: tl.constexpr, QDT: tl.constexpr, DOT_IEEE: tl.constexpr,
               EVICT: tl.constexpr):
    """Cache elements -> dot operand: fp8 bytes decoded exactly (hardware cast, or integer operations in
    the interpreter), rounded to q's dtype ``QDT``, widened to fp32 under DOT_IEEE."""
    x = tl.load(ptrs, mask=mask, other=0, eviction_policy=EVICT)
    if FP8:
        if HW_FP8:
            x = x.to(tl.float8e4nv, bitcast=True).to(QDT)
        else:  # fp8 values are exact in bf16/fp16/fp32
            x = _from_e4m3_bits(x.to(tl.int32)).to(QDT)
    else:
        x = x.to(QDT)
    if DOT_IEEE:
        x = x.to(tl.float32)
    return x


@triton.jit
def _e4m3_to_f16(x, HW_FP8: tl.constexpr, DDT: tl.constexpr, DOT_IEEE: tl.constexpr):
    """fp8 E4M3 bytes (uint8) -> ``DDT`` (fp16 on the GPU), exact: on the GPU one ``cvt.rn.f16x2.e4m3x2``
    per byte pair, written as inline asm that Triton does not move past a layout conversion (it would
    otherwise convert after reading the bytes in the MMA operand layout, one small shared-memory load
    per byte pair); integer decoding in the interpreter."""
    if HW_FP8:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4).to(DDT)
    else:
        y = _from_e4m3_bits(x.to(tl.int32)).to(DDT)
    if DOT_IEEE:
        y = y.to(tl.float32)
    return y


@triton.jit
def _load_raw(cache_ptr, blk, n, hi, R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_P: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The cache bytes of one tile (rows ``n``, physical blocks ``blk``) into registers:
    ([BLOCK_N, BLOCK_R], [BLOCK_N, BLOCK_P]) uint8, 0 past ``hi``."""
    W: tl.constexpr = R + P
    row = (blk.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE) * W
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    n_ok = n < hi
    raw_n = tl.load(cache_ptr + row[:, None] + r[None, :], mask=n_ok[:, None] & (r < R)[None, :], other=0)
    raw_p = tl.load(cache_ptr + row[:, None] + R + p[None, :], mask=n_ok[:, None] & (p < P)[None, :], other=0)
    return raw_n, raw_p


@triton.jit
def _kv_tile(q_nope, q_pe, m_i, l_i, acc, start, hi, blk, raw_n, raw_p, vis, row_ok, cache_ptr, qsc,
             R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, HW_FP8: tl.constexpr,
             DDT: tl.constexpr, DOT_IEEE: tl.constexpr, V_RELOAD: tl.constexpr, TRANS: tl.constexpr,
             PREFETCH: tl.constexpr, CVT_SMEM: tl.constexpr):
    """One BLOCK_N-row tile (rows start.., physical blocks ``blk``) of the online softmax: returns the
    updated (m_i, l_i, acc), base-2 logits; ``qsc`` [BLOCK_M] is each query row's logit scale.
    Dot operands are rounded to ``DDT``; with DOT_IEEE (fp32 q, or the interpreter, whose ``tl.dot``
    multiplies bf16 bit patterns as integers) they are then widened to fp32.
    TRANS = False: q tiles [BLOCK_M, BLOCK_R] / [BLOCK_M, BLOCK_P], scores S = q K^T [BLOCK_M, BLOCK_N],
    acc [BLOCK_M, BLOCK_R] += P V. TRANS = True (swap AB): q given transposed ([BLOCK_R, BLOCK_M],
    [BLOCK_P, BLOCK_M]), S^T = K q^T [BLOCK_N, BLOCK_M], acc^T [BLOCK_R, BLOCK_M] += V^T P^T: the cache
    rows are the MMA's M side (64 rows fill a Hopper wgmma even for 16 query rows) and both the cache
    tile and q^T are read by the tensor cores straight from shared memory (q is not re-read into
    registers every tile). PREFETCH (fp8): the tile's bytes ``raw_n``/``raw_p`` were loaded into
    registers one iteration earlier; they are converted once and the converted tile feeds both dots."""
    W: tl.constexpr = R + P
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    row = (blk.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE) * W
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    kmask = n_ok[:, None] & (r < R)[None, :]
    if PREFETCH:
        kn = _e4m3_to_f16(raw_n, HW_FP8, DDT, DOT_IEEE)
        kp = _e4m3_to_f16(raw_p, HW_FP8, DDT, DOT_IEEE)
    elif CVT_SMEM:  # this tile's bytes (pipelined loads), converted once in their load layout
        kn = _e4m3_to_f16(tl.load(cache_ptr + row[:, None] + r[None, :], mask=kmask, other=0,
                                  eviction_policy="evict_last"), HW_FP8, DDT, DOT_IEEE)
        kp = _e4m3_to_f16(tl.load(cache_ptr + row[:, None] + R + p[None, :], mask=n_ok[:, None] & (p < P)[None, :],
                                  other=0, eviction_policy="evict_last"), HW_FP8, DDT, DOT_IEEE)
    else:
        kn = _load_rows(cache_ptr + row[:, None] + r[None, :], kmask, FP8, HW_FP8, DDT, DOT_IEEE, "evict_last")
        kp = _load_rows(cache_ptr + row[:, None] + R + p[None, :], n_ok[:, None] & (p < P)[None, :], FP8, HW_FP8,
                        DDT, DOT_IEEE, "evict_last")
    if V_RELOAD:  # a second load of the same rows for the PV dot (served by L1/L2, not HBM)
        v = _load_rows(cache_ptr + row[:, None] + r[None, :], kmask, FP8, HW_FP8, DDT, DOT_IEEE, "evict_first")
    else:
        v = kn
    if TRANS:
        s = dot_acc(kp, q_pe, dot_acc(kn, q_nope, None, DOT_IEEE), DOT_IEEE)
        s = s * qsc[None, :]
        keep = row_ok[None, :] & n_ok[:, None] & (n[:, None] < vis[None, :])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet: no NaN
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(pr, axis=0)
        pr = pr.to(DDT)
        if DOT_IEEE:
            pr = pr.to(tl.float32)
        acc = dot_acc(tl.trans(v), pr, acc * alpha[None, :], DOT_IEEE)
    else:
        s = dot_acc(q_pe, tl.trans(kp), dot_acc(q_nope, tl.trans(kn), None, DOT_IEEE), DOT_IEEE)
        s = s * qsc[:, None]
        keep = row_ok[:, None] & n_ok[None, :] & (n[None, :] < vis[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        pr = pr.to(DDT)
        if DOT_IEEE:
            pr = pr.to(tl.float32)
        acc = dot_acc(pr, v, acc * alpha[:, None], DOT_IEEE)
    return m_new, l_i, acc


@triton.jit
def _mla_decode_stage1(q_ptr, cache_ptr, bt_ptr, qsl_ptr, kvlen_ptr, vis_ptr, out_ptr, lse_ptr,
                       H, stride_bt, stride_qt, stride_qh, stride_ot, stride_oh, num_splits, qk_scale, out_scale,
                       R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
                       HW_FP8: tl.constexpr, HAS_VIS: tl.constexpr, SPLIT: tl.constexpr, DOT_IEEE: tl.constexpr,
                       V_RELOAD: tl.constexpr, TRANS: tl.constexpr, F16: tl.constexpr, PREFETCH: tl.constexpr,
                       CVT_SMEM: tl.constexpr, INTERPRET: tl.constexpr):
    pid_g = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    kv_len = tl.load(kvlen_ptr + b)
    m_idx = pid_g * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m_idx < q_len * H
    j = m_idx // H
    h = m_idx % H
    tok = (q_start + j).to(tl.int64)
    if HAS_VIS:
        vis = tl.load(vis_ptr + tok, mask=row_ok, other=0)
    else:
        vis = kv_len - q_len + j + 1  # query j at position kv_len - q_len + j sees rows <= it
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    q_row = q_ptr + tok * stride_qt + h * stride_qh
    q_nope = tl.load(q_row[:, None] + r[None, :], mask=row_ok[:, None] & (r < R)[None, :], other=0.0)
    q_pe = tl.load(q_row[:, None] + R + p[None, :], mask=row_ok[:, None] & (p < P)[None, :], other=0.0)
    qsc = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale
    if F16:  # fp8 cache, fp16 dots: each q row times a power of two 2^e with max |q row| in [2^13, 2^14)
        DDT: tl.constexpr = tl.float16
        amax = tl.maximum(tl.max(tl.abs(q_nope.to(tl.float32)), axis=1), tl.max(tl.abs(q_pe.to(tl.float32)), axis=1))
        e = 127 + 13 - (((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 127)
        qs = tl.where(amax > 0, (tl.minimum(tl.maximum(e, 1), 254) << 23).to(tl.float32, bitcast=True), 1.0)
        q_nope = (q_nope.to(tl.float32) * qs[:, None]).to(tl.float16)
        q_pe = (q_pe.to(tl.float32) * qs[:, None]).to(tl.float16)
        qsc = qsc / qs  # exact: qs is a power of two
    else:
        DDT: tl.constexpr = q_ptr.dtype.element_ty
    if DOT_IEEE:
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    if TRANS:
        q_nope = tl.trans(q_nope)
        q_pe = tl.trans(q_pe)
    # this program's rows [lo, hi) of the request: splits of a per-request chunk, whole tiles each
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, kv_len)
    hi = tl.where(pid_g * BLOCK_M < q_len * H, hi, lo)  # a head-group past this request's rows: no work
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if TRANS:
        acc = tl.zeros([BLOCK_R, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    # NOTE: the block ids of the next tile are loaded one iteration ahead, so the cache-row loads'
    # addresses come from loop-carried values and the pipeliner can overlap them with the math.
    n0 = lo + tl.arange(0, BLOCK_N)
    blk = tl.load(bt_row + n0 // BLOCK_SIZE, mask=n0 < hi, other=0)
    raw_n = 0
    raw_p = 0
    if PREFETCH:  # this tile's bytes in registers, the next tile's loaded during this tile's math
        raw_n, raw_p = _load_raw(cache_ptr, blk, n0, hi, R, P, BLOCK_R, BLOCK_P, BLOCK_SIZE)
    # NOTE: the two loops below have the same body on purpose: the compiled kernel needs `range` so
    # Triton's pipeliner overlaps the next tile's loads (num_stages), while the CPU interpreter needs a
    # `while` over tensor bounds. The per-tile work lives in `_kv_tile`; only the prefetch hand-over
    # is repeated.
    if INTERPRET:
        start = lo
        while start < hi:
            nxt = start + BLOCK_N + tl.arange(0, BLOCK_N)
            blk_next = tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < hi, other=0)
            if PREFETCH:
                raw_n2, raw_p2 = _load_raw(cache_ptr, blk_next, nxt, hi, R, P, BLOCK_R, BLOCK_P, BLOCK_SIZE)
            m_i, l_i, acc = _kv_tile(q_nope, q_pe, m_i, l_i, acc, start, hi, blk, raw_n, raw_p, vis, row_ok, cache_ptr,
                                     qsc, R, P, BLOCK_R, BLOCK_P, BLOCK_N, BLOCK_SIZE, FP8, HW_FP8, DDT, DOT_IEEE,
                                     V_RELOAD, TRANS, PREFETCH, CVT_SMEM)
            blk = blk_next
            if PREFETCH:
                raw_n = raw_n2
                raw_p = raw_p2
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            nxt = start + BLOCK_N + tl.arange(0, BLOCK_N)
            blk_next = tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < hi, other=0)
            if PREFETCH:
                raw_n2, raw_p2 = _load_raw(cache_ptr, blk_next, nxt, hi, R, P, BLOCK_R, BLOCK_P, BLOCK_SIZE)
            m_i, l_i, acc = _kv_tile(q_nope, q_pe, m_i, l_i, acc, start, hi, blk, raw_n, raw_p, vis, row_ok, cache_ptr,
                                     qsc, R, P, BLOCK_R, BLOCK_P, BLOCK_N, BLOCK_SIZE, FP8, HW_FP8, DDT, DOT_IEEE,
                                     V_RELOAD, TRANS, PREFETCH, CVT_SMEM)
            blk = blk_next
            if PREFETCH:
                raw_n = raw_n2
                raw_p = raw_p2
    if TRANS:
        acc = tl.trans(acc)
    seen = l_i > 0
    inv = tl.where(seen, out_scale / tl.where(seen, l_i, 1.0), 0.0)
    o = acc * inv[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    om = row_ok[:, None] & (r < R)[None, :]
    if SPLIT:  # partials [T, H, S, BLOCK_R] fp32 and [T, H, S]; a split with no rows writes only its LSE (-inf:
        # stage 2 never reads its partial), so a graph sized for a long capacity writes little at short context
        prow = (tok * H + h) * num_splits + pid_s
        tl.store(out_ptr + prow[:, None] * BLOCK_R + r[None, :], o, mask=om & (hi > lo))
        tl.store(lse_ptr + prow, lse, mask=row_ok)
    else:
        tl.store(out_ptr + tok[:, None] * stride_ot + h[:, None] * stride_oh + r[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=om)
        tl.store(lse_ptr + tok * H + h, lse, mask=row_ok)


@triton.jit
def _mla_decode_stage2(part_ptr, plse_ptr, out_ptr, lse_ptr, H, num_splits, stride_ot, stride_oh,
                       R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # = token * H + head
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    sm = s < num_splits
    ls = tl.load(plse_ptr + row * num_splits + s, mask=sm, other=float("-inf"))
    ls = tl.where(ls == float("inf"), float("-inf"), ls)
    m = tl.max(ls, axis=0)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    w = tl.exp(ls - m_safe)  # exactly 0 for an empty split
    tot = tl.sum(w, axis=0)
    w = w / tl.where(empty, 1.0, tot)
    cm = c < R
    parts = tl.load(part_ptr + (row * num_splits + s)[:, None] * BLOCK_R + c[None, :],
                    mask=(sm & (w > 0))[:, None] & cm[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], axis=0)
    tok = row // H
    h = row % H
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + c, o.to(out_ptr.dtype.element_ty), mask=cm)
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + row, tl.where(empty, float("-inf"), tl.log(tl.where(empty, 1.0, tot)) + m_safe))


# fp8 cache, <= 16 query rows, on a GPU that runs it: the Gluon stage 1 (``gluon_mla_decode``; BLOCK_N cache
# rows per step, num_stages cp.async buffers, 4 warps; on sm_90 its wgmma form, ``gluon_mla_decode_wgmma``).
# Where it cannot run (CPU interpreter, widths other than 512 + 64, no sm_89+) the Triton tile below takes its
# place (``resolve_config``); fp32 queries take the 16-row bf16 tile.
GLUON_FP8_CONFIG = {"GLUON": True, "BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "V_RELOAD": False,
                    "TRANS": False, "F16": True, "PREFETCH": False, "occupancy": 2, "WGMMA": True}
TRITON_FP8_CONFIG = {"GLUON": False, "BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "V_RELOAD": True, "TRANS": False,
                     "F16": True, "PREFETCH": False, "occupancy": 2}


def gluon_eligible(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, query_rows: int) -> bool:
    """Whether the Gluon fp8 stage 1 can take this call: an fp8 cache of 512 + 64-wide rows, bf16/fp16
    queries, <= 16 query rows per request, a CUDA device of compute capability >= 8.9 (the fp8 -> fp16
    conversion instruction), Triton with Gluon, and the interpreter off."""
    if kv_cache.dtype != FP8_DTYPE or q.dtype not in (torch.bfloat16, torch.float16) or not q.is_cuda:
        return False
    if interpreting() or kv_lora_rank != 512 or q.shape[-1] != 576 or query_rows > 16:
        return False
    return _gluon_runs_on(_cuda_index(q.device))


def _cuda_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (the current device for plain ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _wgmma_runs_on(device_index: int) -> bool:
    """CUDA device ``device_index`` has compute capability 9.0 (Hopper: ``wgmma``), cached."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


@functools.lru_cache(maxsize=None)
def _gluon_runs_on(device_index: int) -> bool:
    """CUDA device ``device_index`` has compute capability >= 8.9 and this Triton has Gluon (cached: the
    decode wrapper asks at every layer of every eager step)."""
    if torch.cuda.get_device_capability(device_index) < (8, 9):
        return False
    try:
        from longflash.attention import gluon_mla_decode  # noqa: F401
    except ImportError:  # Triton without Gluon
        return False
    return True


def resolve_config(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, max_query_len: int,
                   config: dict | None = None) -> tuple[dict, bool]:
    """The tile a call runs and whether the Gluon kernel runs it: ``config`` (keys of :func:`default_config`)
    over the default for ``max_query_len · heads`` query rows. When the result asks for Gluon but
    :func:`gluon_eligible` says no, or ``config`` sets ``GLUON=False`` over a Gluon default, the Triton tile
    for that shape (``TRITON_FP8_CONFIG`` at <= 16 rows) takes the Gluon default's place, with the
    caller's other keys applied on top. fp32 queries over an fp8 cache always take the 16-row bf16 tile
    (see the note in :func:`mla_decode_attention`).
    Raises ValueError for keys outside ``CONFIG_KEYS``, BLOCK_M / BLOCK_N that are not powers of two >= 16,
    num_warps not a power of two in 1..16, num_stages not an int >= 1, and a Gluon tile the kernel does not
    support (BLOCK_N not 32/64, num_stages < 2, num_warps not 4 or 8 (8 only with BLOCK_N 64), BLOCK_M not
    16), each naming the key. A Gluon tile of 8 warps without ``maxnreg`` gets occupancy 1 unless ``config``
    sets it. ``WGMMA`` (a bool, else ValueError) asks for the sm_90 wgmma stage 1: it needs BLOCK_N 64, 4
    warps and no ``maxnreg`` (ValueError naming the key when ``config`` sets WGMMA=True; a default's WGMMA
    is dropped instead), stays set only on a compute capability 9.0 device (elsewhere the mma.sync Gluon
    kernel runs), and is dropped when the Triton kernel runs. A Gluon tile buffering more than 128 cache rows
    (num_stages x BLOCK_N; e.g. 3 x 64: 131 KB of shared memory in the sm_90 compile reports) gets occupancy 1
    unless ``config`` sets it."""
    fp8 = kv_cache.dtype == FP8_DTYPE
    H = q.shape[1]
    rows = 16 if q.dtype == torch.float32 and fp8 else max_query_len * H
    # fp32 queries keep the 576-wide tiles' rules at every width: the narrow 128-row tile with fp32 dots needs
    # 255 registers and spills 648 bytes over an fp8 cache (sm_90 compile; fresh-user review, session 25)
    base = default_config(rows, torch.bfloat16 if q.dtype == torch.float32 else kv_cache.dtype,
                          576 if q.dtype == torch.float32 else q.shape[-1])
    user = dict(config or {})
    unknown = set(user) - CONFIG_KEYS
    if unknown:
        raise ValueError(f"unknown MLA decode config keys {sorted(unknown)}; allowed: {sorted(CONFIG_KEYS)}")
    cfg = dict(base, **user)
    use_gluon = bool(cfg.get("GLUON", False)) and gluon_eligible(q, kv_cache, kv_lora_rank, max_query_len * H)
    if not use_gluon and base.get("GLUON", False):
        cfg = dict(TRITON_FP8_CONFIG, **{k: v for k, v in user.items() if k != "GLUON"})
    check_tile_shape(cfg, "MLA decode config")
    if not isinstance(cfg.get("WGMMA", False), bool):
        raise ValueError(f"MLA decode config key WGMMA must be True or False, got {cfg['WGMMA']!r}")
    if not use_gluon:
        cfg["GLUON"] = False
        cfg.pop("WGMMA", None)  # a Gluon-only key: the Triton kernel runs
        return cfg, use_gluon
    bad = [msg for ok, msg in ((cfg["BLOCK_M"] == 16, f"BLOCK_M must be 16 (got {cfg['BLOCK_M']})"),
                               (cfg["BLOCK_N"] in (32, 64), f"BLOCK_N must be 32 or 64 (got {cfg['BLOCK_N']})"),
                               (cfg["num_stages"] >= 2, f"num_stages must be >= 2 (got {cfg['num_stages']})"),
                               (cfg["num_warps"] in (4, 8), f"num_warps must be 4 or 8 (got {cfg['num_warps']})"),
                               (cfg["num_warps"] != 8 or cfg["BLOCK_N"] == 64, "num_warps 8 needs BLOCK_N 64"))
           if not ok]
    if bad:
        raise ValueError("the Gluon fp8 decode tile: " + "; ".join(bad))
    if cfg.get("WGMMA", False):  # the sm_90 wgmma variant: 64 rows, one warpgroup; elsewhere the mma.sync kernel
        bad = [f"{k} {cfg.get(k)} (must be {v})" for k, v in (("BLOCK_N", 64), ("num_warps", 4), ("maxnreg", None))
               if cfg.get(k) != v]
        if bad and "WGMMA" not in user:  # the default's WGMMA under a caller's other tile: the mma.sync kernel
            cfg["WGMMA"], bad = False, []
        if bad:
            raise ValueError("the Gluon wgmma decode tile (WGMMA=True was asked): " + "; ".join(bad))
        cfg["WGMMA"] = cfg["WGMMA"] and _wgmma_runs_on(_cuda_index(q.device))
    if cfg["num_stages"] * cfg["BLOCK_N"] > 128 and "occupancy" not in user:
        cfg["occupancy"] = 1  # both Gluon forms: > 128 buffered rows of 576 fp8 bytes leave one program per SM
    if cfg["num_warps"] == 8 and not cfg.get("maxnreg") and "occupancy" not in user:
        cfg["occupancy"] = 1  # 168 registers x 256 threads: one program per SM (sm_90 compile report)
    return cfg, use_gluon


def default_config(max_query_rows: int, cache_dtype: torch.dtype, width: int = 576) -> dict:
    """Tile shape for a batch whose largest request has ``max_query_rows`` = q_len · H query rows over cache rows
    of ``width`` = kv_lora_rank + rope elements:
    BLOCK_M (query rows per program, >= 16 for ``tl.dot``), BLOCK_N (cache rows per step), num_warps,
    num_stages, V_RELOAD (load the value tile a second time instead of reusing the key tile: with an
    fp8 cache and mma.sync tiles this lets Triton pipeline the byte loads through shared memory),
    TRANS (swap AB: cache rows on the MMA's M side, see ``_kv_tile``), F16 (fp8 cache: fp16 dots,
    q rows scaled by powers of two; otherwise the dots run in q's dtype), PREFETCH (with F16: the
    next tile's bytes loaded into registers during this tile, converted once for both dots),
    CVT_SMEM (with F16, not PREFETCH; optional key, default False: the tile's bytes loaded in the loop
    as usual, so Triton pipelines them with cp.async, then converted once in their load layout and the
    fp16 tile fed to both dots through shared memory; no V reload), maxnreg (optional key, default None:
    a cap on registers per thread, so more programs fit an SM), occupancy (programs resident per SM,
    from registers and shared memory; used by the split count), GLUON (fp8 cache, <= 16 rows: the Gluon
    stage 1 of ``gluon_mla_decode`` with BLOCK_N rows per step and num_stages cp.async buffers; it needs
    :func:`gluon_eligible`, otherwise ``TRITON_FP8_CONFIG`` runs; ``GLUON=False`` in ``config`` selects
    that Triton tile, see :func:`resolve_config`), WGMMA (with GLUON: the sm_90 ``wgmma`` stage 1 of
    ``gluon_mla_decode_wgmma``, BLOCK_N 64, 4 warps; on other GPUs the ``mma.sync`` Gluon kernel runs).
    Session 23 (commit c7e5ac0, ``benchmarks/results/mla_decode_gluon.h200.md``): fp8 <= 16 rows Gluon N64 s2
    (0.60 of copy at B16/32K, 0.77-0.79 at B16-64 x 128K), replacing the Triton fp8 tile (TRITON_FP8_CONFIG);
    session 27 (``results/mla_decode_wgmma_default_ab.h200.md``): on sm_90 its wgmma form (WGMMA), 0.848 of
    copy at B64 x 128K against 0.784 for the mma.sync form in the same run, equal at 32K and at B16.
    The fastest configs of the second H200 run (commit 7143052, ``benchmarks/results/mla_decode.h200.md``,
    sweep at B = 16, 32K, ``chosen``): <= 16 rows bf16 M16 N64 w4 s2 (0.84 of copy bandwidth there, 0.95-1.00
    at B 16/64 x 128K; the third and fourth runs, f5c1d69 and 8d8d43d, measured M16 N32 w4 s3 faster at
    B16/32K, 0.836 vs 0.778, and equal elsewhere, so it is the default since session 21), fp8 M16 N32 w4 s3 with V reload and fp16 dots (0.34; 0.36-0.37 at 128K); 128 rows
    M64 N64 w8 s2 for both caches. 17-32 rows were not measured (the first run's M32 N32 w4 s3).
    Narrow rows (``width`` <= ``NARROW_WIDTH``, e.g. the default model's 64 + 16) with <= 16 query rows: 128
    cache rows per step, 3 stages (session 25, ``benchmarks/results/mla_decode_narrow.h200.md``, 4 heads, B16 x
    128K: 0.758 of copy for bf16 and 0.350 for fp8, against 0.524 / 0.245 for the 32-row tile used before, whose
    program walked a 2,048-row split in 64 steps of 2.5 KB; 256 rows over 4 or 8 warps and 512 rows measured
    slower).
    ``benchmarks/mla_decode.py`` times :func:`candidate_configs` against them."""
    fp8 = cache_dtype == FP8_DTYPE
    if max_query_rows <= 16 and width <= NARROW_WIDTH:
        return {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "V_RELOAD": fp8, "TRANS": False,
                "F16": fp8, "PREFETCH": False, "occupancy": 2}
    if max_query_rows <= 16 and fp8:
        return dict(GLUON_FP8_CONFIG)
    if max_query_rows <= 16:  # M16 N32 w4 s3: the B16/32K sweep's best in runs 3 and 4 (0.836 vs N64 s2 0.778)
        return {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "V_RELOAD": False, "TRANS": False,
                "F16": False, "PREFETCH": False, "occupancy": 2}
    if max_query_rows <= 32:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "V_RELOAD": fp8, "TRANS": False,
                "F16": False, "PREFETCH": False, "occupancy": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "V_RELOAD": False, "TRANS": False,
            "F16": False, "PREFETCH": False, "occupancy": 1}


def candidate_configs(max_query_rows: int, cache_dtype: torch.dtype, width: int = 576) -> list[dict]:
    """Tile configs that ``benchmarks/mla_decode.py`` times against each other, the default first. fp8 with
    <= 16 rows: Gluon tiles (BLOCK_N 32/64 cache rows, 2-4 cp.async buffers), then the Triton fp16-dot
    tile they replace (``TRITON_FP8_CONFIG``, session 21's default) and its register-prefetch and
    convert-once variants; bf16: the run-2 default and the session-21 candidates.
    ``benchmarks/mla_decode_sm90_report.py`` lists their sm_90 compile reports (registers, spills,
    shared memory, MMA kind, pipelined loads, loop instructions). ``occupancy`` = programs per SM that
    registers and shared memory allow (from those reports). No duplicates. (The register-capped and
    8-warp Triton fp8 tiles that session 21 measured slower are described in ``benchmarks/NOTES.md``.)
    Narrow rows (``width`` <= ``NARROW_WIDTH``) with <= 16 query rows: 128-512 cache rows per step, and the
    32-row tile used for them before session 25."""
    fp8 = cache_dtype == FP8_DTYPE
    d = default_config(max_query_rows, cache_dtype, width)
    if max_query_rows <= 16 and width <= NARROW_WIDTH:
        old = dict(TRITON_FP8_CONFIG) if fp8 else default_config(max_query_rows, cache_dtype)
        cands = [dict(d, BLOCK_N=256, num_warps=8, num_stages=2), dict(d, BLOCK_N=256, num_stages=2),
                 dict(d, BLOCK_N=512, num_warps=8, num_stages=2, occupancy=1 if fp8 else 2), old]
    elif max_query_rows <= 16 and fp8:
        g = GLUON_FP8_CONFIG
        tr = TRITON_FP8_CONFIG
        pre = dict(tr, num_warps=8, num_stages=1, V_RELOAD=False, PREFETCH=True, occupancy=1)
        cvt = dict(tr, V_RELOAD=False, CVT_SMEM=True)
        # (session 23: N32 under a 168-register cap, three programs per SM, measured 0.56 vs 0.57 and now spills
        # 8 bytes: not a candidate)
        # 8 warps (session 25): each warp half the score columns and half the value columns, 600 loop instructions
        # per warp per 64 rows against 1135; two programs per SM need a 128-register cap (72 bytes of spills)
        # session 27: the default is the sm_90 wgmma stage 1 (gluon_mla_decode_wgmma); the rest are the mma.sync
        # Gluon kernel (session 23's default, WGMMA=False) and its variants
        m = dict(g, WGMMA=False)
        w8 = [dict(m, num_warps=8, maxnreg=128), dict(m, num_warps=8, occupancy=1),
              dict(m, num_warps=8, num_stages=4, occupancy=1)]
        cands = [m, *w8, dict(m, num_stages=3, occupancy=1), dict(m, BLOCK_N=32, num_stages=2),
                 dict(m, BLOCK_N=32, num_stages=4), tr, pre, cvt]
    elif max_query_rows <= 32:
        base = dict(d, BLOCK_N=32, num_warps=4, num_stages=3, V_RELOAD=fp8, TRANS=False, F16=False,
                    PREFETCH=False, occupancy=2)  # run 2's default
        if fp8:
            cands = [base, dict(base, F16=True), dict(base, V_RELOAD=False, F16=True, CVT_SMEM=True)]
        else:
            t = dict(base, BLOCK_N=64, num_stages=2, TRANS=True, occupancy=1)
            # session 21: 8 warps under a 128-register cap, two programs per SM (sm_90: no spills, 93-94 KB)
            occ = [dict(d, num_warps=8, maxnreg=128, occupancy=2),
                   dict(d, BLOCK_N=32, num_stages=3, num_warps=8, maxnreg=128, occupancy=2)]
            cands = [*occ, base, dict(base, num_warps=8), dict(base, BLOCK_N=64, num_stages=2), t, dict(t, num_warps=8)]
    elif fp8:
        cands = [dict(d, BLOCK_N=32, num_stages=3), dict(d, F16=True),
                 dict(d, BLOCK_N=32, num_stages=1, F16=True, PREFETCH=True)]
    else:
        cands = [dict(d, BLOCK_N=32), dict(d, TRANS=True)]
    out = [d]
    for c in cands:
        if c not in out:
            out.append(c)
    return out


@functools.lru_cache(maxsize=4096)
def choose_num_splits(batch: int, head_groups: int, max_kv_len: int, query_rows: int, kv_lora_rank: int,
                      width: int, row_bytes: int, slots: int) -> int:
    """kv-splits per request, minimizing a time model (cached: no per-call host cost).

    ``t(S) = base / eff(S) + partial(S) / BW``: ``base`` = max(cache bytes / BW, FLOPs / rate) at
    nominal H200 rates (``NOMINAL_BW``, ``NOMINAL_FLOPS``); ``eff`` = programs / (waves · slots), the
    filled fraction of the ``slots`` = SMs × resident programs per SM (wave quantization included;
    fewer programs than slots leave SMs idle); ``partial`` = the fp32 split results written and
    read, ``2 · batch · query_rows · (kv_lora_rank + 1) · 4 · S`` bytes. Each split covers a whole
    number k of ``MIN_SPLIT_ROWS``-row units (S = cdiv(L, k · MIN_SPLIT_ROWS)); a near-tie (within 2 %)
    keeps the smaller S."""
    if max_kv_len <= 0:
        return 1
    base = max(batch * max_kv_len * row_bytes / NOMINAL_BW,
               2.0 * batch * query_rows * max_kv_len * (width + kv_lora_rank) / NOMINAL_FLOPS)
    best_s, best_t = 1, float("inf")
    # candidates: splits of a whole number of MIN_SPLIT_ROWS-row units (S = cdiv(L, k * MIN_SPLIT_ROWS)), so
    # that no program walks a last, nearly empty tile (63 splits of 4096 rows = 66 rows each took 18.1 us
    # on an H200, 64 of 64 rows 15.4 us: a lone program spends ~3.3 us per tile)
    cands = sorted({triton.cdiv(max_kv_len, k * MIN_SPLIT_ROWS)
                    for k in range(1, triton.cdiv(max_kv_len, MIN_SPLIT_ROWS) + 1)})
    for s in (c for c in cands if c <= MAX_SPLITS):
        programs = batch * head_groups * s
        eff = programs / (triton.cdiv(programs, slots) * slots)
        partial = 2.0 * batch * query_rows * (kv_lora_rank + 1) * 4 * s / NOMINAL_BW if s > 1 else 0.0
        t = base / eff + partial
        if t < best_t * 0.98:
            best_s, best_t = s, t
    return best_s


def _as_int32(x, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.int32)
    return torch.tensor(list(x), dtype=torch.int32, device=device)


def mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         query_start_loc: list[int] | torch.Tensor, seq_lens: list[int] | torch.Tensor,
                         scale: float, kv_lora_rank: int, k_scale: float | torch.Tensor | None = None,
                         max_rows_per_piece: int = DECODE_PIECE_ROWS, *, max_query_len: int | None = None,
                         max_seq_len: int | None = None, visible_lens: torch.Tensor | None = None,
                         num_splits: int | None = None, config: dict | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`longflash.attention.ops.mla_decode_attention` (same semantics).

    Args:
        q: [T, H, kv_lora_rank + rope] absorbed queries, bf16/fp16 (fp32 runs the dots in IEEE fp32);
            last dim contiguous.
        kv_cache: [num_blocks, block_size, kv_lora_rank + rope], contiguous, q's dtype or
            float8_e4m3fn (read as ``fp8 · k_scale``); any block_size.
        block_table: [>= B, max_blocks] int32 on q's device.
        query_start_loc: B + 1 offsets into q (list, or int32 tensor), from 0 to T.
        seq_lens: B cached tokens per request, the queries' own rows included (list or int32 tensor).
        scale: softmax scale. kv_lora_rank: value width (the first entries of each row).
        k_scale: fp8 dequantization multiplier (None = 1).
        max_rows_per_piece: accepted for the reference's signature; the kernel's working set is one
            tile, so it is unused.
        max_query_len / max_seq_len: host-side bounds used when the lengths are tensors (no device
            sync; they fix the grid, e.g. per CUDA-graph bucket; defaults T and the block table's
            capacity); computed from lists otherwise.
        visible_lens: optional [T] int32 device tensor: query t sees the request's first
            ``visible_lens[t]`` rows instead of the causal rule (decode-context parallelism's local
            shard, :func:`mla_decode_attention_dcp_local`); ``seq_lens`` are then the rows scanned.
        num_splits / config: overrides of :func:`choose_num_splits` / :func:`default_config`.
    Returns:
        out [T, H, kv_lora_rank] in q's dtype, lse [T, H] fp32 (natural log; −inf and output 0 for a
        query that sees no row, e.g. seq_len 0).
    Raises:
        ValueError on inconsistent shapes, dtypes or lengths; a request longer than its block table
        (checked when the lengths are lists); a ``config`` :func:`resolve_config` refuses; ``num_splits`` < 1.
        The wrapper never syncs with the device when the lengths are tensors and ``k_scale`` is a Python
        number (CUDA-graph capture).
    """
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits must be None (chosen by the split model) or an int >= 1, got {num_splits!r}")
    if q.dim() != 3 or kv_cache.dim() != 3:
        raise ValueError(f"q must be [T, H, W] and kv_cache [num_blocks, block_size, W], got {tuple(q.shape)} "
                         f"and {tuple(kv_cache.shape)}")
    T, H, W = q.shape
    R = int(kv_lora_rank)
    P = W - R
    if kv_cache.shape[-1] != W or not 0 < R < W:
        raise ValueError(f"query width {W} must equal the cache row width {kv_cache.shape[-1]} and exceed "
                         f"kv_lora_rank {R}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} not supported (bf16, fp16, fp32)")
    fp8 = kv_cache.dtype == FP8_DTYPE
    if not fp8 and kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must be q's ({q.dtype}) or float8_e4m3fn")
    if block_table.dim() != 2 or block_table.device != q.device or kv_cache.device != q.device:
        raise ValueError("block_table must be 2-D and q, kv_cache, block_table on one device")
    if not q.is_cuda and not interpreting():
        raise ValueError("the Triton MLA decode kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before "
                         "Triton is imported); on the CPU use ops.mla_decode_attention")
    B = (query_start_loc.numel() if isinstance(query_start_loc, torch.Tensor) else len(query_start_loc)) - 1
    nb = seq_lens.numel() if isinstance(seq_lens, torch.Tensor) else len(seq_lens)
    if B < 0 or nb != B or block_table.shape[0] < B:
        raise ValueError(f"query_start_loc has {B + 1} entries, seq_lens {nb}, block_table {block_table.shape[0]}"
                         " rows: need B + 1, B and >= B")
    block_size = kv_cache.shape[1]
    capacity = block_table.shape[1] * block_size
    if not isinstance(query_start_loc, torch.Tensor):
        if query_start_loc[0] != 0 or query_start_loc[-1] != T or \
                any(e < s for s, e in zip(query_start_loc, query_start_loc[1:])):
            raise ValueError(f"query_start_loc must be non-decreasing from 0 to T={T}")
        max_query_len = max((e - s for s, e in zip(query_start_loc, query_start_loc[1:])), default=0)
    elif max_query_len is None:
        max_query_len = T  # a bound without a device sync
    if not isinstance(seq_lens, torch.Tensor):
        if any(L < 0 for L in seq_lens):
            raise ValueError("seq_lens must be >= 0")
        max_seq_len = max(seq_lens, default=0)
        if max_seq_len > capacity:
            raise ValueError(f"a sequence of {max_seq_len} rows exceeds the block table "
                             f"({block_table.shape[1]} blocks of {block_size})")
    else:  # a bound without a device sync (rows past a request's own length are never read)
        max_seq_len = capacity if max_seq_len is None else min(max_seq_len, capacity)
    if visible_lens is not None and (visible_lens.shape != (T,) or visible_lens.device != q.device):
        raise ValueError(f"visible_lens must be [T={T}] on q's device")
    out = torch.empty((T, H, R), dtype=q.dtype, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0 or H == 0 or B == 0:
        return out, lse
    if q.stride(-1) != 1:
        q = q.contiguous()
    qsl = _as_int32(query_start_loc, q.device)
    kvl = _as_int32(seq_lens, q.device)
    bt = block_table if block_table.dtype == torch.int32 and block_table.stride(-1) == 1 else \
        block_table.to(torch.int32).contiguous()
    # NOTE: fp32 queries over an fp8 cache take the 16-row bf16 tile (M16 N32, 3 stages) whatever the
    # row count: the fp8 tiles with fp32 dots need more shared memory than an SM has (H200, 16 query
    # rows: 245,760 > 232,448 bytes; found by benchmarks/multi_gpu.py's fp32 DeepSeek-V3 run), and on
    # the H200 the GPU test passed at 16 rows with this tile but failed at 64 and 128 rows with the
    # larger ones. fp32 is the reference/test dtype, not a fast path.
    cfg, use_gluon = resolve_config(q, kv_cache, R, max_query_len, config)
    BLOCK_M, BLOCK_N = cfg["BLOCK_M"], cfg["BLOCK_N"]
    groups = max(1, triton.cdiv(max_query_len * H, BLOCK_M))
    row_bytes = W * kv_cache.element_size()
    S = num_splits or choose_num_splits(B, groups, max_seq_len, max_query_len * H, R, W, row_bytes,
                                        sm_count(q.device) * cfg["occupancy"])
    BLOCK_R, BLOCK_P = triton.next_power_of_2(R), max(16, triton.next_power_of_2(P))
    ks = 1.0 if k_scale is None or not fp8 else float(k_scale)
    interp = interpreting() or not q.is_cuda
    src = kv_cache.view(torch.uint8) if fp8 else kv_cache
    vis = visible_lens.to(torch.int32) if visible_lens is not None else qsl
    f16 = bool(cfg.get("F16", False)) and fp8 and q.dtype != torch.float32  # fp16 dots need an fp8 cache
    pre = f16 and bool(cfg.get("PREFETCH", False))
    cvt = f16 and not pre and bool(cfg.get("CVT_SMEM", False))
    common = dict(R=R, P=P, BLOCK_R=BLOCK_R, BLOCK_P=BLOCK_P, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                  BLOCK_SIZE=block_size, FP8=fp8, HW_FP8=not interp, HAS_VIS=visible_lens is not None,
                  DOT_IEEE=q.dtype == torch.float32 or interp, V_RELOAD=bool(cfg["V_RELOAD"]) and not (pre or cvt),
                  TRANS=bool(cfg.get("TRANS", False)), F16=f16, PREFETCH=pre, CVT_SMEM=cvt,
                  INTERPRET=interp, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  **({"maxnreg": int(cfg["maxnreg"])} if cfg.get("maxnreg") and not interp else {}))
    grid = (groups, S, B)
    qk_scale = float(scale) * ks * LOG2E
    if use_gluon and cfg.get("WGMMA", False):
        from longflash.attention.gluon_mla_decode_wgmma import mla_decode_fp8_wgmma_stage1
        stage1 = mla_decode_fp8_wgmma_stage1
        common = dict(BLOCK_SIZE=block_size, STAGES=cfg["num_stages"], HAS_VIS=visible_lens is not None, num_warps=4)
    elif use_gluon:
        from longflash.attention.gluon_mla_decode import mla_decode_fp8_stage1
        stage1 = mla_decode_fp8_stage1
        common = dict(BLOCK_N=BLOCK_N, BLOCK_SIZE=block_size, STAGES=cfg["num_stages"],
                      HAS_VIS=visible_lens is not None, WARPS=cfg["num_warps"], num_warps=cfg["num_warps"],
                      **({"maxnreg": int(cfg["maxnreg"])} if cfg.get("maxnreg") else {}))
    else:
        stage1 = _mla_decode_stage1
    if S == 1:
        stage1[grid](q, src, bt, qsl, kvl, vis, out, lse, H, bt.stride(0), q.stride(0),
                     q.stride(1), out.stride(0), out.stride(1), 1, qk_scale, ks, SPLIT=False, **common)
        return out, lse
    part = torch.empty((T, H, S, BLOCK_R), dtype=torch.float32, device=q.device)
    plse = torch.empty((T, H, S), dtype=torch.float32, device=q.device)
    stage1[grid](q, src, bt, qsl, kvl, vis, part, plse, H, bt.stride(0), q.stride(0),
                 q.stride(1), out.stride(0), out.stride(1), S, qk_scale, ks, SPLIT=True, **common)
    BLOCK_S = triton.next_power_of_2(S)
    BLOCK_C = min(BLOCK_R, max(16, 4096 // BLOCK_S))
    _mla_decode_stage2[(T * H, triton.cdiv(R, BLOCK_C))](part, plse, out, lse, H, S, out.stride(0), out.stride(1),
                                                         R=R, BLOCK_R=BLOCK_R, BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C,
                                                         num_warps=4)
    return out, lse


def mla_decode_attention_dcp_local(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                   query_start_loc: list[int], seq_lens: list[int], scale: float,
                                   kv_lora_rank: int, dcp_size: int, dcp_rank: int, interleave: int = 1,
                                   k_scale: float | torch.Tensor | None = None,
                                   max_rows_per_piece: int = DECODE_PIECE_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`longflash.distributed.dcp.mla_decode_attention_local` (same signature
    and result): attention over this DCP rank's shard of each request. ``seq_lens`` are global; query
    at global position P sees the first ``local_len(P + 1)`` local rows (spec's local-length formula),
    and the request's scan covers ``local_len(seq_len)`` rows."""
    from longflash.distributed.dcp import check_dcp_args, dcp_local_seq_lens
    check_dcp_args(kv_cache.shape[1], dcp_size, interleave)
    qpos = []
    for b, L in enumerate(seq_lens):
        n = query_start_loc[b + 1] - query_start_loc[b]
        qpos.extend(range(L - n, L))
    vis_cpu = dcp_local_seq_lens([p + 1 for p in qpos], dcp_size, interleave)[:, dcp_rank] if qpos else \
        torch.zeros(0, dtype=torch.int64)
    local = dcp_local_seq_lens(list(seq_lens), dcp_size, interleave)[:, dcp_rank].tolist() if seq_lens else []
    vis = vis_cpu.to(device=q.device, dtype=torch.int32)
    return mla_decode_attention(q, kv_cache, block_table, query_start_loc, local, scale, kv_lora_rank, k_scale,
                                max_rows_per_piece, visible_lens=vis)


def decode_bytes_and_flops(batch_q_lens: list[int], seq_lens: list[int], heads: int, width: int, kv_lora_rank: int,
                           cache_elem_bytes: int, q_elem_bytes: int = 2, block_size: int = 64) -> tuple[int, int]:
    """The roofline's two numbers for one call: the fewest bytes moved (each visible cache row once,
    q, out, lse, the block-table entries) and the FLOPs (QK over ``width``, PV over ``kv_lora_rank``,
    causal rows counted exactly)."""
    nbytes, flops = 0, 0
    for n, L in zip(batch_q_lens, seq_lens):
        nbytes += L * width * cache_elem_bytes + math.ceil(L / block_size) * 4
        nbytes += n * heads * (width + kv_lora_rank) * q_elem_bytes + n * heads * 4
        seen = sum(max(0, L - n + j + 1) for j in range(n))
        flops += 2 * heads * seen * (width + kv_lora_rank)
    return nbytes, flops
