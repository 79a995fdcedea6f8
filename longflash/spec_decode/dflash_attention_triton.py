"""Triton kernel for the DFlash drafter's paged non-causal block attention, same signature and result as
the reference :func:`longflash.spec_decode.dflash_attention.dflash_block_attention` (tests compare them).

Semantics (``shared/specs/dflash.md``, "Drafter"; the reference's docstring): each query row of request
r sees its context positions ``[lo, min(context_len, L))`` through the block table (lo = 0, or
context_len − window clamped to 0; L = the host bound) and all Bk rows of its own block; GQA; fp32
softmax; LSE = natural log-sum-exp of the scaled logits.

Design (a drafter block is tiny: Bk · rep query rows per kv head, e.g. 8 · 2 = 16):
- stage 1, grid (request · kv-head, split): a program holds the Bk · rep query rows of one kv head of
  one request (row m = block row m // rep, head kv_head · rep + m % rep) as one [BLOCK_M, hd] tile and
  runs an online softmax (base 2) over: the block's own Bk keys (split 0 only), then its split's
  context rows ``lo + s · SPLIT_ROWS ..`` (at most SPLIT_ROWS, BLOCK_N at a time through the block
  table). Loop bounds come from the request's context length loaded on the device, so the work is
  O(real context) whatever the host bound; splits past the context return at once.
- stage 2 (only with several splits), grid (query row · head): merges the partial (out, lse) of the
  request's non-empty splits (the count is recomputed from context_lens) by LSE, the formula of
  ``ops.merge_attn_states``: m = max lse_s, w_s = e^(lse_s − m), out = Σ w_s out_s / Σ w_s,
  lse = m + log Σ w_s.
- the split count S = cdiv(min(L, window), SPLIT_ROWS) comes from the host bound, so the grid is fixed
  for a CUDA graph; SPLIT_ROWS (:func:`choose_split_rows`) is the smallest power of two >= the
  minimum that still gives about ``TARGET_PROGRAMS_PER_SM`` programs per SM at the bound.
- precision: cache rows are rounded to q's dtype on read (as the reference). fp32 q: IEEE fp32 dots.
  16-bit q: QK^T with 16-bit operands and fp32 accumulation (exact products); P·V with P split into
  two 16-bit parts (hi + lo, ~16 significant bits) so the fp32 result stays within ~1e-5 of the
  reference's fp32 softmax (a single 16-bit P would err by ~2^-9).

Bytes per call: Σ_r rows_r · kvh · hd · 2 · elem (K and V once per kv head) + q/out + block table;
FLOPs 4 · Σ_r Bk · nh · (rows_r + Bk) · hd (P·V counted twice for 16-bit q).

In the CPU interpreter (``TRITON_INTERPRET=1``) the context loop is a ``while`` loop (``range`` over
run-time bounds fails there with NumPy 2.4) and every dot runs in fp32 on operands already rounded to
q's dtype (the interpreter's 16-bit ``tl.dot`` is not a float product); on the GPU the loop is a
``for`` that Triton software-pipelines.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from longflash.attention.ops import DECODE_PIECE_ROWS
from longflash.spec_decode.dflash_attention import check_block_attention_args
from longflash.ops.triton_env import interpreting, sm_count
from longflash.ops.triton_math import dot_acc

LOG2E = 1.4426950408889634
MIN_SPLIT_ROWS = 128
MAX_SPLITS = 64
TARGET_PROGRAMS_PER_SM = 4


@triton.jit
def _round(x, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """``x`` rounded to ``DT`` to nearest even. The interpreter's fp32 -> bf16 cast truncates, so there the
    rounding is done on the fp32 bits first (the cast after it is then exact); NaN stays NaN."""
    if INTERPRET and DT == tl.bfloat16:
        xf = x.to(tl.float32)
        bits = xf.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = tl.where(xf != xf, xf, bits.to(tl.float32, bitcast=True))
    return x.to(DT)


@triton.jit
def _as_operand(x, QDT: tl.constexpr, DOT_IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """Round to q's dtype (the reference's rounding), widen to fp32 for IEEE dots."""
    x = _round(x, QDT, INTERPRET)
    if DOT_IEEE:
        x = x.to(tl.float32)
    return x


@triton.jit
def _softmax_tile(q, k, v, keep, m_i, l_i, acc, qk_scale, QDT: tl.constexpr, DOT_IEEE: tl.constexpr,
                  P_SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """One key tile of the online softmax (base 2): q [BLOCK_M, BLOCK_D], k/v [BLOCK_N, BLOCK_D] dot
    operands, ``keep`` [BLOCK_N] visible keys. Returns the updated (m_i, l_i, acc)."""
    s = dot_acc(q, tl.trans(k), None, DOT_IEEE) * qk_scale
    s = tl.where(keep[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if P_SPLIT:  # p = hi + lo, both in q's 16-bit dtype: ~16 significant bits of p
        p_hi = _round(p, QDT, INTERPRET)
        p_lo = _as_operand(p - p_hi.to(tl.float32), QDT, DOT_IEEE, INTERPRET)
        if DOT_IEEE:
            p_hi = p_hi.to(tl.float32)
        acc = dot_acc(p_hi, v, acc, DOT_IEEE)
        acc = dot_acc(p_lo, v, acc, DOT_IEEE)
    else:
        acc = dot_acc(_as_operand(p, QDT, DOT_IEEE, INTERPRET), v, acc, DOT_IEEE)
    return m_new, l_i, acc


@triton.jit
def _context_tile(q, m_i, l_i, acc, start, hi, bt_row, kc_ptr, vc_ptr, g, d, d_ok, qk_scale,
                  stride_kcb, stride_kcr, stride_kch, stride_vcb, stride_vcr, stride_vch,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, QDT: tl.constexpr, DOT_IEEE: tl.constexpr,
                  P_SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """Context positions ``start .. start + BLOCK_N − 1`` (those < ``hi``) through the block table."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    blk = tl.maximum(tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0), 0).to(tl.int64)
    off = n % BLOCK_SIZE
    kmask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(kc_ptr + (blk * stride_kcb + off * stride_kcr + g * stride_kch)[:, None] + d[None, :],
                mask=kmask, other=0.0)
    v = tl.load(vc_ptr + (blk * stride_vcb + off * stride_vcr + g * stride_vch)[:, None] + d[None, :],
                mask=kmask, other=0.0)
    return _softmax_tile(q, _as_operand(k, QDT, DOT_IEEE, INTERPRET), _as_operand(v, QDT, DOT_IEEE, INTERPRET), n_ok,
                         m_i, l_i, acc, qk_scale, QDT, DOT_IEEE, P_SPLIT, INTERPRET)


@triton.jit
def _block_attn_stage1(q_ptr, kb_ptr, vb_ptr, kc_ptr, vc_ptr, bt_ptr, cl_ptr, out_ptr, lse_ptr,
                       stride_qt, stride_qh, stride_kbt, stride_kbh, stride_vbt, stride_vbh,
                       stride_kcb, stride_kcr, stride_kch, stride_vcb, stride_vcr, stride_vch,
                       stride_bt, stride_ot, stride_oh, num_splits, window, ctx_bound, qk_scale,
                       KVH: tl.constexpr, REP: tl.constexpr, BK: tl.constexpr, HD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, SPLIT_ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       SPLIT: tl.constexpr, DOT_IEEE: tl.constexpr, P_SPLIT: tl.constexpr,
                       INTERPRET: tl.constexpr):
    pid = tl.program_id(0)  # request * KVH + kv head
    s = tl.program_id(1)
    b = pid // KVH
    g = pid % KVH
    ctx = tl.load(cl_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    hi = tl.minimum(ctx, ctx_bound)
    c0 = lo + s * SPLIT_ROWS
    c1 = tl.minimum(c0 + SPLIT_ROWS, hi)
    if (s > 0) & (c0 >= hi):  # a split past this request's context: no work, nothing to write
        return
    QDT: tl.constexpr = q_ptr.dtype.element_ty
    m = tl.arange(0, BLOCK_M)
    row_ok = m < BK * REP
    tok = (b * BK + m // REP).to(tl.int64)
    head = g * REP + m % REP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HD
    q = tl.load(q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_IEEE:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if s == 0:  # the block's own keys, always visible
        i = tl.arange(0, BLOCK_B)
        i_ok = i < BK
        brow = (b * BK + i).to(tl.int64)
        bmask = i_ok[:, None] & d_ok[None, :]
        kb = tl.load(kb_ptr + (brow * stride_kbt + g * stride_kbh)[:, None] + d[None, :], mask=bmask, other=0.0)
        vb = tl.load(vb_ptr + (brow * stride_vbt + g * stride_vbh)[:, None] + d[None, :], mask=bmask, other=0.0)
        m_i, l_i, acc = _softmax_tile(q, _as_operand(kb, QDT, DOT_IEEE, INTERPRET),
                                      _as_operand(vb, QDT, DOT_IEEE, INTERPRET), i_ok, m_i, l_i, acc, qk_scale, QDT,
                                      DOT_IEEE, P_SPLIT, INTERPRET)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    # NOTE: the two loops have the same body on purpose: the compiled kernel needs `range` for Triton's
    # pipeliner, the CPU interpreter a `while` over tensor bounds; the work lives in `_context_tile`.
    if INTERPRET:
        start = c0
        while start < c1:
            m_i, l_i, acc = _context_tile(q, m_i, l_i, acc, start, c1, bt_row, kc_ptr, vc_ptr, g, d, d_ok, qk_scale,
                                          stride_kcb, stride_kcr, stride_kch, stride_vcb, stride_vcr, stride_vch,
                                          BLOCK_N, BLOCK_SIZE, QDT, DOT_IEEE, P_SPLIT, INTERPRET)
            start += BLOCK_N
    else:
        for start in range(c0, c1, BLOCK_N):
            m_i, l_i, acc = _context_tile(q, m_i, l_i, acc, start, c1, bt_row, kc_ptr, vc_ptr, g, d, d_ok, qk_scale,
                                          stride_kcb, stride_kcr, stride_kch, stride_vcb, stride_vcr, stride_vch,
                                          BLOCK_N, BLOCK_SIZE, QDT, DOT_IEEE, P_SPLIT, INTERPRET)
    seen = l_i > 0
    o = acc * tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    omask = row_ok[:, None] & d_ok[None, :]
    NH: tl.constexpr = KVH * REP
    if SPLIT:  # partials [T, nh, S, HD] fp32 and [T, nh, S]
        prow = (tok * NH + head) * num_splits + s
        tl.store(out_ptr + prow[:, None] * HD + d[None, :], o, mask=omask)
        tl.store(lse_ptr + prow, lse, mask=row_ok)
    else:
        tl.store(out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + d[None, :],
                 _round(o, out_ptr.dtype.element_ty, INTERPRET), mask=omask)
        tl.store(lse_ptr + tok * NH + head, lse, mask=row_ok)


@triton.jit
def _block_attn_stage2(part_ptr, plse_ptr, cl_ptr, out_ptr, lse_ptr, num_splits, window, ctx_bound,
                       stride_ot, stride_oh, NH: tl.constexpr, BK: tl.constexpr, HD: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT_ROWS: tl.constexpr,
                       HAS_WINDOW: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # = token * NH + head
    tok = row // NH
    h = row % NH
    ctx = tl.load(cl_ptr + tok // BK)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    hi = tl.minimum(ctx, ctx_bound)
    n_real = tl.maximum(tl.cdiv(hi - lo, SPLIT_ROWS), 1)  # the splits stage 1 wrote (split 0 always)
    s = tl.arange(0, BLOCK_S)
    sm = s < tl.minimum(n_real, num_splits)
    ls = tl.load(plse_ptr + row * num_splits + s, mask=sm, other=float("-inf"))
    mx = tl.max(ls, axis=0)
    w = tl.where(sm, tl.exp(ls - mx), 0.0)  # split 0 holds the block: mx is finite
    tot = tl.sum(w, axis=0)
    d = tl.arange(0, BLOCK_D)
    parts = tl.load(part_ptr + (row * num_splits + s)[:, None] * HD + d[None, :],
                    mask=sm[:, None] & (d < HD)[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], axis=0) / tot
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, _round(o, out_ptr.dtype.element_ty, INTERPRET),
             mask=d < HD)
    tl.store(lse_ptr + row, mx + tl.log(tot))


def default_config(block_m: int, head_dim: int) -> dict:
    """Tile of one launch: BLOCK_N context rows per step, num_warps, num_stages (for BLOCK_M query
    rows, head_dim columns). Not yet tuned on the H200: ``benchmarks/dflash_attention.py`` times it."""
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def choose_split_rows(requests: int, kv_heads: int, bound: int, sm_count: int, block_n: int) -> int:
    """Context rows per split: the smallest power of two >= max(``MIN_SPLIT_ROWS``, ``block_n``) such that
    requests · kv_heads · splits <= ``TARGET_PROGRAMS_PER_SM`` · SMs at ``bound`` rows (the host bound of
    one request's visible context), and at most ``MAX_SPLITS`` splits."""
    rows = max(MIN_SPLIT_ROWS, block_n)
    want = max(1, TARGET_PROGRAMS_PER_SM * sm_count // max(1, requests * kv_heads))
    while triton.cdiv(bound, rows) > min(want, MAX_SPLITS):
        rows *= 2
    return rows


def dflash_block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int | None = None, max_context_len: int | None = None,
                           max_rows: int = DECODE_PIECE_ROWS, *, split_rows: int | None = None,
                           config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`longflash.spec_decode.dflash_attention.dflash_block_attention` (same
    arguments, result and errors; see there).

    ``max_rows`` is accepted for the reference's signature (the kernel's working set is one tile).
    ``max_context_len`` (a host bound; default the block table's capacity) fixes the grid, so one
    captured launch serves every replay; context_lens is only read on the device (no host sync).
    ``split_rows`` / ``config``: overrides of :func:`choose_split_rows` (a multiple of BLOCK_N) /
    :func:`default_config`. Returns (out [R·Bk, nh, hd] in q's dtype, lse [R·Bk, nh] fp32).
    Raises ValueError also for CPU tensors without ``TRITON_INTERPRET=1``.
    """
    R, Bk, L = check_block_attention_args(q, k_blk, v_blk, k_cache, v_cache, block_table, context_lens, window,
                                          max_context_len)
    if not q.is_cuda and not interpreting():
        raise ValueError("the Triton DFlash block attention needs CUDA tensors (or TRITON_INTERPRET=1 set before "
                         "Triton is imported); on the CPU use dflash_attention.dflash_block_attention")
    for name, t in (("q", q), ("k_blk", k_blk), ("v_blk", v_blk), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    T, nh, hd = q.shape
    kvh = k_blk.shape[1]
    rep = nh // kvh
    out = torch.empty((T, nh, hd), dtype=q.dtype, device=q.device)
    lse = torch.empty((T, nh), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    cfg = dict(default_config(Bk * rep, hd), **(config or {}))
    block_n = cfg["BLOCK_N"]
    bound = L if window is None else min(L, window)
    if split_rows is None:
        split_rows = choose_split_rows(R, kvh, bound, sm_count(q.device), block_n)
    elif split_rows <= 0 or split_rows % block_n:
        raise ValueError(f"split_rows {split_rows} must be a positive multiple of BLOCK_N={block_n}")
    S = max(1, triton.cdiv(bound, split_rows))
    cl = context_lens if context_lens.dtype == torch.int32 else context_lens.to(torch.int32)
    bt = block_table if block_table.dtype == torch.int32 and block_table.stride(-1) == 1 else \
        block_table.to(torch.int32).contiguous()
    interp = interpreting() or not q.is_cuda
    common = dict(KVH=kvh, REP=rep, BK=Bk, HD=hd, BLOCK_M=max(16, triton.next_power_of_2(Bk * rep)),
                  BLOCK_B=max(16, triton.next_power_of_2(Bk)), BLOCK_N=block_n,
                  BLOCK_D=max(16, triton.next_power_of_2(hd)), BLOCK_SIZE=k_cache.shape[1], SPLIT_ROWS=split_rows,
                  HAS_WINDOW=window is not None, DOT_IEEE=q.dtype == torch.float32 or interp,
                  P_SPLIT=q.dtype != torch.float32, INTERPRET=interp, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    args = (q, k_blk, v_blk, k_cache, v_cache, bt, cl)
    strides = (q.stride(0), q.stride(1), k_blk.stride(0), k_blk.stride(1), v_blk.stride(0), v_blk.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
               v_cache.stride(2), bt.stride(0), out.stride(0), out.stride(1))
    qk_scale = float(scale) * LOG2E
    win = 0 if window is None else int(window)
    if S == 1:
        _block_attn_stage1[(R * kvh, 1)](*args, out, lse, *strides, 1, win, L, qk_scale, SPLIT=False, **common)
        return out, lse
    part = torch.empty((T, nh, S, hd), dtype=torch.float32, device=q.device)
    plse = torch.empty((T, nh, S), dtype=torch.float32, device=q.device)
    _block_attn_stage1[(R * kvh, S)](*args, part, plse, *strides, S, win, L, qk_scale, SPLIT=True, **common)
    _block_attn_stage2[(T * nh,)](part, plse, cl, out, lse, S, win, L, out.stride(0), out.stride(1), NH=nh, BK=Bk,
                                  HD=hd, BLOCK_D=common["BLOCK_D"], BLOCK_S=triton.next_power_of_2(S),
                                  SPLIT_ROWS=split_rows, HAS_WINDOW=window is not None, INTERPRET=interp,
                                  num_warps=1)
    return out, lse
