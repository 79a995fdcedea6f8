"""Hopper (sm_90) stage 1 of the paged MLA decode attention over an **fp8** cache with ``wgmma`` on fp8
operands: no fp8 -> fp16 conversion of the cache anywhere. Same inputs and results as
:func:`longflash.attention.gluon_mla_decode.mla_decode_fp8_stage1` (up to 16 query rows per request, bf16
queries, 512 + 64-wide rows; the wrapper is :func:`longflash.attention.triton_mla_decode.mla_decode_attention`)
and the PyTorch reference :func:`longflash.attention.ops.mla_decode_attention`.

Why: on sm_90 ``mma.sync`` with e4m3 operands is emulated (ptxas converts both operands to fp16 and issues
``HMMA.16816``; measured in the SASS, ``benchmarks/NOTES.md`` session 24), so the ``mma.sync`` kernel spends
a quarter of its instructions converting bytes (0.60-0.79 of copy bandwidth). Hopper's native fp8 tensor-core
instruction is ``wgmma``, which needs both 8-bit operands K-major. Both products are arranged so that they are:

- scores, transposed: ``S^T [BLOCK_N cache rows, 16 q] = K [rows, 512 | 64] · Q^T``. A = the cache tile in
  shared memory (K-major: a row's latent bytes are contiguous; 128/64-byte NVMMA swizzle, filled by
  ``cp.async``), B = q in shared memory, written once, as two e4m3 terms (q = (t0 + t1) · 2^-e per row: exact
  for bf16 q down to 2^-10 of the row's largest entry, :func:`_e4m3_terms`) stacked along N (N = 32);
- values, transposed: ``O^T [512, 16] = V^T [512, rows] · P^T [rows, 16]``. A = V^T from registers: each
  thread loads 16 consecutive latent bytes of 4 cache rows (``LDS.128``) and 32 byte permutes (``prmt``)
  turn them into 16 registers of 4 consecutive cache rows each, the K-major 8-bit A fragment. Logical row m
  of O^T is latent dim ``σ(m)`` (:func:`latent_dim_of_row`) so that a thread's fragment rows are 16
  consecutive dims; the output is stored through σ. B = P^T in shared memory (K-major: P [16, rows]) as two
  e4m3 terms of P · 2^8 (about 9 significant bits, between bf16's 8 and fp16's 11).

The fp8 tensor cores accumulate with reduced precision, so every tile's products start from zero
(``use_acc=False``) and are added to the fp32 running output by the CUDA cores (``acc = acc · α + o``).
Online softmax in base 2 per query column (the column max crosses the 4 warps), running sums per score slot
reduced once at the end. One warpgroup (4 warps) per program; grid and split semantics as the Triton kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from longflash.attention.gluon_mla_decode import _block_ids, _copy_rows


def latent_dim_of_row(m):
    """σ: the latent dim held by row ``m`` (0..511) of the kernel's transposed value product O^T (a bit
    permutation: m bit 3 -> dim bit 0, m bits 6-8 -> dim bits 1-3, m bits 0-2 -> dim bits 4-6, m bits 4-5 ->
    dim bits 7-8), so that the 16 rows of a thread's wgmma A fragment are 16 consecutive latent dims.
    Works on ints and integer tensors; raises ValueError for a row outside 0..511."""
    if isinstance(m, int):
        lo = hi = m
    else:
        lo, hi = (int(m.min()), int(m.max())) if m.numel() else (0, 0)
    if lo < 0 or hi > 511:
        raise ValueError(f"value rows are 0..511, got {lo}..{hi}")
    return ((m >> 3) & 1) | (((m >> 6) & 7) << 1) | ((m & 7) << 4) | (((m >> 4) & 3) << 7)


@gluon.constexpr_function
def _value_load_layout():
    """Register layout of the ``[64, 512]`` cache tile (natural coordinates: cache row, latent dim) for the
    value operand: registers 0-3 are 16 consecutive latent bytes of one row (one 16-byte shared load),
    registers 4-5 rows +1 and +8, 6-7 rows +16, +32; lanes: rows +2, +4 and dims +16..+112; warps: dims +128,
    +256. Each group of 8 lanes reads rows r, r+2, r+4, r+6 x 32 bytes, which the 128-byte NVMMA swizzle
    (16-byte chunk ^= row % 8) puts in distinct banks. With σ, the cache-row order π of
    :func:`_value_operand` and the in-thread transpose it becomes the wgmma A fragment of V^T."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0], [16, 0], [32, 0]],
                                      lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]],
                                      warp_bases=[[0, 128], [0, 256]], block_bases=[], shape=[64, 512])


@gluon.jit
def _rows_to_k_major(v):
    """16 registers = 4 cache rows x 16 consecutive latent bytes -> 16 registers each holding one latent
    dim's bytes of the 4 rows (32 ``prmt``; four 4 x 4 byte transposes). Element (row j, dim c) of the
    input pack lands at pack position 4c + j."""
    return gl.inline_asm_elementwise(
        """{ .reg .b32 t<4>;
        prmt.b32 t0, $16, $20, 0x5140; prmt.b32 t1, $24, $28, 0x5140;
        prmt.b32 t2, $16, $20, 0x7362; prmt.b32 t3, $24, $28, 0x7362;
        prmt.b32 $0, t0, t1, 0x5410; prmt.b32 $1, t0, t1, 0x7632;
        prmt.b32 $2, t2, t3, 0x5410; prmt.b32 $3, t2, t3, 0x7632;
        prmt.b32 t0, $17, $21, 0x5140; prmt.b32 t1, $25, $29, 0x5140;
        prmt.b32 t2, $17, $21, 0x7362; prmt.b32 t3, $25, $29, 0x7362;
        prmt.b32 $4, t0, t1, 0x5410; prmt.b32 $5, t0, t1, 0x7632;
        prmt.b32 $6, t2, t3, 0x5410; prmt.b32 $7, t2, t3, 0x7632;
        prmt.b32 t0, $18, $22, 0x5140; prmt.b32 t1, $26, $30, 0x5140;
        prmt.b32 t2, $18, $22, 0x7362; prmt.b32 t3, $26, $30, 0x7362;
        prmt.b32 $8, t0, t1, 0x5410; prmt.b32 $9, t0, t1, 0x7632;
        prmt.b32 $10, t2, t3, 0x5410; prmt.b32 $11, t2, t3, 0x7632;
        prmt.b32 t0, $19, $23, 0x5140; prmt.b32 t1, $27, $31, 0x5140;
        prmt.b32 t2, $19, $23, 0x7362; prmt.b32 t3, $27, $31, 0x7362;
        prmt.b32 $12, t0, t1, 0x5410; prmt.b32 $13, t0, t1, 0x7632;
        prmt.b32 $14, t2, t3, 0x5410; prmt.b32 $15, t2, t3, 0x7632; }""",
        "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r", [v], dtype=gl.uint8, is_pure=True, pack=64)


@gluon.jit
def _value_operand(tile, VL: gl.constexpr, OPA: gl.constexpr):
    """V^T [512 logical rows, 64 logical k] fp8 as two halves (rows 0-255, 256-511) in the wgmma A-fragment
    layout ``OPA`` (of a [256, 64] operand) from the cache tile
    ``tile`` [64, 512] (fp8 shared memory): logical row m is latent dim σ(m) (:func:`latent_dim_of_row`),
    logical k is cache row π(k) (bits: k0 -> row bit 0, k1 -> 3, k2 -> 1, k3 -> 2, k4 -> 4, k5 -> 5; P^T is
    stored in the same order, :func:`_rows_in_k_order`). 16-byte loads, in-thread transposes, then
    relabellings that move no data: after the transpose an element labelled (row r, dim d) holds the
    value of row bits (0, 3) = its label's dim bits (0, 1) and dim bits 0-3 = its label's dim bits (2, 3)
    and row bits (0, 3); y's bit i below takes x's bit ORDER[i] (x: [r5..r0, d8..d0], y: [k5..k0, m8..m0])."""
    x = _rows_to_k_major(tile.load(VL).to(gl.uint8, bitcast=True))
    x = gl.reshape(x, [2] * 15)
    # k5 k4 <- r5 r4; k3 k2 <- r2 r1; k1 k0 <- d1 d0 (true rows 3, 0); m8 m7 <- r3 r0 (true dims 3, 2);
    # m6 <- d3, m3 <- d2 (true dims 1, 0); m5 m4 <- d8 d7; m2 m1 m0 <- d6 d5 d4
    y = gl.permute(x, (0, 1, 3, 4, 13, 14, 2, 5, 11, 6, 7, 12, 8, 9, 10))
    y = gl.reshape(y, [64, 512])
    # the two halves of V^T (logical rows m8 = 0, 1: register bits), each a [256, 64] A fragment
    v0, v1 = gl.split(gl.permute(gl.reshape(gl.permute(y, (1, 0)), [2, 256, 64]), (1, 2, 0)))
    return (gl.convert_layout(v0, OPA).to(gl.float8e4nv, bitcast=True),
            gl.convert_layout(v1, OPA).to(gl.float8e4nv, bitcast=True))


@gluon.jit
def _rows_in_k_order(p):
    """[64 cache rows, N] -> [64 logical k, N]: row k of the result is cache row π(k) (see
    :func:`_value_operand`); a relabelling."""
    N: gl.constexpr = p.shape[1]
    x = gl.reshape(p, [2, 2, 2, 2, 2, 2, N])  # r5 r4 r3 r2 r1 r0
    return gl.reshape(gl.permute(x, (0, 1, 3, 4, 2, 5, 6)), [64, N])  # k5 k4 k3 k2 k1 k0 = r5 r4 r2 r1 r3 r0


@gluon.jit
def _e4m3_terms(x):
    """``x`` (fp32, |x| <= 448) as two fp8 E4M3 tensors (t0, t1), t0 = RN(x), t1 = RN(x - t0): 4 + 4
    significant bits; a bf16 value of magnitude >= 2^-2 is exactly t0 + t1, below that the error is at
    most 2^-10 absolute."""
    t0 = x.to(gl.float8e4nv)
    t1 = (x - t0.to(gl.float32)).to(gl.float8e4nv)
    return t0, t1


@gluon.jit
def mla_decode_fp8_wgmma_stage1(q_ptr, cache_ptr, bt_ptr, qsl_ptr, kvlen_ptr, vis_ptr, out_ptr, lse_ptr,
                                H, stride_bt, stride_qt, stride_qh, stride_ot, stride_oh, num_splits, qk_scale,
                                out_scale, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr,
                                HAS_VIS: gl.constexpr, SPLIT: gl.constexpr):
    """Stage 1 over an fp8 (uint8-viewed) cache ``[num_blocks, BLOCK_SIZE, 576]``, bf16 q; grid (head-group,
    kv-split, request), arguments and outputs as :func:`~longflash.attention.gluon_mla_decode.mla_decode_fp8_stage1`;
    one warpgroup (4 warps), sm_90."""
    gl.static_assert(BLOCK_N == 64, "BLOCK_N must be 64 (one wgmma M block of cache rows)")
    gl.static_assert(STAGES >= 2, "STAGES must be >= 2 (the loop consumes a tile copied one iteration earlier)")
    # scores S^T [BLOCK_N, 32]: columns 0-15 the q rows' first e4m3 term, 16-31 the second
    MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 32])
    # values O^T [512, 16]
    MMA_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 32])
    OPA_O: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_O, k_width=4)
    KN_SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    KP_SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    QN_SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    QP_SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    P_SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    CPN: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])
    CPP: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    VL: gl.constexpr = _value_load_layout()
    SROW: gl.constexpr = gl.SliceLayout(1, MMA_S)

    pid_g = gl.program_id(0)
    pid_s = gl.program_id(1)
    b = gl.program_id(2)
    q_start = gl.load(qsl_ptr + b)
    q_len = gl.load(qsl_ptr + b + 1) - q_start
    kv_len = gl.load(kvlen_ptr + b)
    cache8 = cache_ptr.to(gl.pointer_type(gl.float8e4nv), bitcast=True)

    # q [16 rows, 576], each row scaled by a power of two 2^e so that its max |q| lies in [2^7, 2^8) (e4m3's max
    # is 448), written once to shared memory as two e4m3 terms: rows 0-15 the first, 16-31 the second
    mq = pid_g * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, QL))
    okq = gl.expand_dims(mq < q_len * H, 1)
    q_row = gl.expand_dims(q_ptr + (q_start + mq // H).to(gl.int64) * stride_qt + (mq % H) * stride_qh, 1)
    dn = gl.expand_dims(gl.arange(0, 512, layout=gl.SliceLayout(0, QL)), 0)
    dp = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, QL)), 0)
    q_n = gl.load(q_row + dn, mask=okq, other=0.0).to(gl.float32)
    q_p = gl.load(q_row + 512 + dp, mask=okq & (dp < 64), other=0.0).to(gl.float32)
    amax = gl.maximum(gl.max(gl.abs(q_n), axis=1), gl.max(gl.abs(q_p), axis=1))
    e = 127 + 7 - (((amax.to(gl.int32, bitcast=True) >> 23) & 255) - 127)
    qs = gl.where(amax > 0, (gl.minimum(gl.maximum(e, 1), 254) << 23).to(gl.float32, bitcast=True), 1.0)
    qn_smem = gl.allocate_shared_memory(gl.float8e4nv, [32, 512], QN_SH)
    qp_smem = gl.allocate_shared_memory(gl.float8e4nv, [32, 64], QP_SH)
    n0, n1 = _e4m3_terms(q_n * gl.expand_dims(qs, 1))
    qn_smem.slice(0, 16).store(n0)
    qn_smem.slice(16, 16).store(n1)
    p0, p1 = _e4m3_terms(q_p * gl.expand_dims(qs, 1))
    qp_smem.slice(0, 16).store(p0)
    qp_smem.slice(16, 16).store(p1)

    kn_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, 512], KN_SH)
    kp_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, 64], KP_SH)
    p0_smem = gl.allocate_shared_memory(gl.float8e4nv, [16, BLOCK_N], P_SH)
    p1_smem = gl.allocate_shared_memory(gl.float8e4nv, [16, BLOCK_N], P_SH)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [BLOCK_N, 512], VL), kn_smem.index(0).type) == 0)

    m_idx = pid_g * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, MMA_O))
    row_ok = m_idx < q_len * H
    j = m_idx // H
    if HAS_VIS:
        vis = gl.load(vis_ptr + (q_start + j).to(gl.int64), mask=row_ok, other=0)
    else:
        vis = kv_len - q_len + j + 1
    qsc = qk_scale / gl.convert_layout(qs, gl.SliceLayout(0, MMA_O))  # exact: qs is a power of two

    chunk = gl.cdiv(gl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = gl.minimum(lo + chunk, kv_len)
    hi = gl.where(pid_g * 16 < q_len * H, hi, lo)
    num_tiles = gl.cdiv(hi - lo, BLOCK_N)
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt

    BTN: gl.constexpr = gl.SliceLayout(1, CPN)
    BTP: gl.constexpr = gl.SliceLayout(1, CPP)
    for st in gl.static_range(STAGES - 1):
        start0 = lo + st * BLOCK_N
        _copy_rows(kn_smem.index(st), cache8, _block_ids(bt_row, start0, hi, BLOCK_N, BLOCK_SIZE, BTN), start0,
                   hi, 0, 512, BLOCK_N, BLOCK_SIZE, CPN)
        _copy_rows(kp_smem.index(st), cache8, _block_ids(bt_row, start0, hi, BLOCK_N, BLOCK_SIZE, BTP), start0,
                   hi, 512, 64, BLOCK_N, BLOCK_SIZE, CPP)
        async_copy.commit_group()
    start_next = lo + (STAGES - 1) * BLOCK_N
    blk_n = _block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTN)
    blk_p = _block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTP)

    m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA_O))
    l_acc = gl.zeros([BLOCK_N, 16], gl.float32, layout=MMA_O)  # running sums per score slot (summed at the end)
    acc0 = gl.zeros([256, 16], gl.float32, layout=MMA_O)  # O^T rows 0-255
    acc1 = gl.zeros([256, 16], gl.float32, layout=MMA_O)  # O^T rows 256-511
    for i in range(0, num_tiles):
        async_copy.wait_group(STAGES - 2)
        fence_async_shared()  # the tile's cp.async writes (and q's stores), before wgmma reads them
        gl.thread_barrier()  # tile i visible to all warps; every warp is done with iteration i - 1
        nxt = (i + STAGES - 1) % STAGES
        _copy_rows(kn_smem.index(nxt), cache8, blk_n, start_next, hi, 0, 512, BLOCK_N, BLOCK_SIZE, CPN)
        _copy_rows(kp_smem.index(nxt), cache8, blk_p, start_next, hi, 512, 64, BLOCK_N, BLOCK_SIZE, CPP)
        async_copy.commit_group()
        start_next = start_next + BLOCK_N
        blk_n = _block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTN)
        blk_p = _block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTP)
        kn = kn_smem.index(i % STAGES)
        kp = kp_smem.index(i % STAGES)
        # S^T = K · Q^T over the 512 latent and 64 rope dims (async), while the value operand is built
        s2 = warpgroup_mma(kn, qn_smem.permute((1, 0)), gl.zeros([BLOCK_N, 32], gl.float32, MMA_S),
                           use_acc=False, is_async=True)
        s2 = warpgroup_mma(kp, qp_smem.permute((1, 0)), s2, is_async=True)
        v0, v1 = _value_operand(kn, VL, OPA_O)
        s2 = warpgroup_mma_wait(0, deps=[s2])
        t0, t1 = gl.split(gl.permute(gl.reshape(s2, [BLOCK_N, 2, 16]), (0, 2, 1)))
        s = gl.convert_layout(t0 + t1, MMA_O)  # [BLOCK_N, 16]: both have cache rows on M and q on N
        # online softmax (base 2) per q column
        n = lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA_O))
        keep = gl.expand_dims(row_ok, 0) & gl.expand_dims(n < hi, 1) & (gl.expand_dims(n, 1) < gl.expand_dims(vis, 0))
        s = gl.where(keep, s * gl.expand_dims(qsc, 0), float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        pr = gl.exp2(s - gl.expand_dims(m_safe, 0))
        l_acc = l_acc * gl.expand_dims(alpha, 0) + pr
        m_i = m_new
        # P^T as two e4m3 terms of P · 2^8 (<= 256), K-major in shared memory (P [16, rows])
        a0, a1 = _e4m3_terms(gl.permute(_rows_in_k_order(pr * 256.0), (1, 0)))
        p0_smem.store(a0)
        p1_smem.store(a1)
        fence_async_shared()
        gl.thread_barrier()
        # O^T += V^T · P^T, each half from zero (the fp8 tensor cores' accumulation is not fp32), added here
        alpha2 = gl.expand_dims(alpha, 0)
        o = warpgroup_mma(v0, p0_smem.permute((1, 0)), gl.zeros([256, 16], gl.float32, MMA_O),
                          use_acc=False, is_async=True)
        o = warpgroup_mma(v0, p1_smem.permute((1, 0)), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=[o])
        acc0 = acc0 * alpha2 + o
        o = warpgroup_mma(v1, p0_smem.permute((1, 0)), gl.zeros([256, 16], gl.float32, MMA_O),
                          use_acc=False, is_async=True)
        o = warpgroup_mma(v1, p1_smem.permute((1, 0)), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=[o])
        acc1 = acc1 * alpha2 + o
    async_copy.wait_group(0)

    l_i = gl.sum(l_acc, axis=0)
    seen = l_i > 0
    inv = gl.where(seen, out_scale / (gl.where(seen, l_i, 1.0) * 256.0), 0.0)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tok = (q_start + j).to(gl.int64)
    h = m_idx % H
    if SPLIT:  # partials [T, H, S, 512] fp32 and [T, H, S]
        base = out_ptr + gl.expand_dims(((tok * H + h) * num_splits + pid_s) * 512, 0)
        gl.store(lse_ptr + (tok * H + h) * num_splits + pid_s, lse, mask=row_ok)
    else:
        base = out_ptr + gl.expand_dims(tok * stride_ot + h * stride_oh, 0)
        gl.store(lse_ptr + tok * H + h, lse, mask=row_ok)
    _store_half(base, acc0 * gl.expand_dims(inv, 0), 0, row_ok, MMA_O)
    _store_half(base, acc1 * gl.expand_dims(inv, 0), 256, row_ok, MMA_O)


@gluon.jit
def _store_half(base, o, M0: gl.constexpr, row_ok, MMA_O: gl.constexpr):
    """Rows M0 .. M0 + 255 of O^T (``o`` [256, 16] fp32) to ``base`` + latent dim σ(m) (``base`` [1, 16]
    pointers, one per q row), in the pointee dtype, for the valid q rows."""
    mc = M0 + gl.arange(0, 256, layout=gl.SliceLayout(1, MMA_O))
    col = gl.expand_dims(((mc >> 3) & 1) | (((mc >> 6) & 7) << 1) | ((mc & 7) << 4) | (((mc >> 4) & 3) << 7), 1)
    gl.store(base + col, o.to(base.dtype.element_ty), mask=gl.expand_dims(row_ok, 0) & (col < 512))


def compile_stage1(target=None, *, stages: int = 2, split: bool = True, has_vis: bool = False, block_size: int = 16):
    """Ahead-of-time compile of :func:`mla_decode_fp8_wgmma_stage1` for ``target`` (default
    ``GPUTarget("cuda", 90, 32)``; the kernel needs sm_90: wgmma), BLOCK_N 64, bf16 q, with the pointer and
    stride arguments marked 16-divisible as the JIT marks real tensors. Returns Triton's compiled kernel.
    Raises ValueError for arguments the kernel does not take, and Triton's compilation errors."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    target = target or GPUTarget("cuda", 90, 32)
    if stages < 2 or block_size < 1:
        raise ValueError(f"stages must be >= 2 and block_size >= 1, got {stages}, {block_size}")
    if target.backend != "cuda" or int(target.arch) != 90:
        raise ValueError(f"the kernel needs a CUDA target of compute capability 9.0 (wgmma), got {target}")
    sig = {"q_ptr": "*bf16", "cache_ptr": "*u8", "bt_ptr": "*i32", "qsl_ptr": "*i32", "kvlen_ptr": "*i32",
           "vis_ptr": "*i32", "out_ptr": "*fp32" if split else "*bf16", "lse_ptr": "*fp32", "H": "i32",
           "stride_bt": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32",
           "num_splits": "i32", "qk_scale": "fp32", "out_scale": "fp32"}
    const = dict(BLOCK_N=64, BLOCK_SIZE=block_size, STAGES=stages, HAS_VIS=has_vis, SPLIT=split)
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    div = ["q_ptr", "cache_ptr", "bt_ptr", "qsl_ptr", "kvlen_ptr", "vis_ptr", "out_ptr", "lse_ptr",
           "stride_qt", "stride_qh", "stride_ot", "stride_oh"]
    src = GluonASTSource(fn=mla_decode_fp8_wgmma_stage1, signature=sig,
                         constexprs={(names.index(k),): v for k, v in const.items()},
                         attrs={(names.index(k),): [["tt.divisibility", 16]] for k in div})
    return triton.compile(src, target=target, options=dict(num_warps=4))
