"""Hopper (sm_90) ``wgmma`` variant of the Gluon fp8 MLA decode stage 1 (:mod:`longflash.attention.
gluon_mla_decode`): same inputs, results and numerics (fp8 bytes converted to fp16 in registers, q rows
scaled by a power of two into fp16 range, fp32 accumulation, P rounded to fp16), for up to 16 query rows
per request, one warpgroup (4 warps) per program.

Why: the ``mma.sync`` kernel runs 1,135 SASS instructions per warp per 64-row tile at ~1.8 issued per
cycle per SM, which holds it at 0.87 of the copy bandwidth in steady state (``benchmarks/NOTES.md``,
sessions 25-26: its copies alone reach 0.95-0.99; more resident warps did not help). A quarter of the
instructions are the fp8 -> fp16 conversions, which any fp16 product needs; most of the rest is the
``m16n8k16`` MMAs (136 per warp per tile), the partial-score exchange between the 4 warps (each
contracted a quarter of the latent dims) and its barrier. Here both products are transposed so that the
64 cache rows are wgmma's M side and the 16 query rows its N side (``m64n16k16``):

- scores ``S^T [64 rows, 16] = K · Q^T``: K (the cache tile, A) from registers, converted from the fp8
  bytes 128 latent dims (one quarter buffer) at a time; ``Q^T`` (B) from shared memory, written once per program. Each warp
  owns 16 cache rows over all 576 dims, so no partial scores are exchanged;
- values ``O^T [512, 16] = V^T · P^T`` in four 128-dim quarters: ``V^T`` (A) from registers, built from
  4 x 4 byte blocks (4 consecutive rows x 4 consecutive latent dims, four 4-byte loads, then the
  ``prmt`` + ``cvt`` transpose of :func:`gluon_mla_decode._e4m3_block_to_f16_pairs`); ``P^T`` (B) through
  a 2 KB shared buffer;
- the relabellings that make those loads 4 bytes wide: within each 16-wide contraction step, position p
  reads row / latent dim ``dim(p)`` (bits p0 p3 p1 p2 -> d0 d1 d2 d3, :func:`k_position_to_dim`), applied
  alike to both operands of a product, so the sums are unchanged; the 512 value rows (output columns) are
  a bit permutation of the latent dims (:func:`latent_dim_of_value_row`), undone when the output is stored.
Shared memory: 94,464 bytes at 2 stages (two programs per SM), 131,328 at 3 (one). sm_90 compile: 987
loop instructions per warp per 64-row tile (the ``mma.sync`` kernel: 1,135), 255 registers, no spills.
Measured on an H200 (``benchmarks/NOTES.md``, sessions 26-27): equal to the reference as the ``mma.sync``
kernel is, 0.99-1.08x its speed (0.85-0.86 of the copy bandwidth at batch 64 x 128K, the mma.sync kernel
0.78-0.82). The sm_90 default since session 27 (``WGMMA`` in ``triton_mla_decode.GLUON_FP8_CONFIG``; other
GPUs run the mma.sync kernel), after its reference, DCP-local and engine CUDA-graph GPU tests passed.
Gluon kernels run only on the GPU; the CPU suite compiles this one for sm_90 and the GPU tests compare it
with the reference.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from longflash.attention.gluon_mla_decode import (_block_ids, _copy_rows, _e4m3_block_to_f16_pairs, _q_row_scale,
                                                  _split_rows, _swizzled_tile_layout, _visible_rows)

BLOCK_N = gl.constexpr(64)  # cache rows per step: wgmma's M


def k_position_to_dim(p):
    """The row / dim that contraction position ``p`` (any non-negative int, e.g. 0..575) reads: within each
    16-wide step, bits p0 p3 p1 p2 -> d0 d1 d2 d3 (the step, p's bits 4 and up, is kept), so that a thread's
    four positions {2c, 2c+1, 2c+8, 2c+9} of the register operand are the four consecutive dims 4c..4c+3 (one
    4-byte load). Ints or integer tensors."""
    return (p & 1) | (((p >> 3) & 1) << 1) | (((p >> 1) & 1) << 2) | (((p >> 2) & 1) << 3) | (p & ~15)


def latent_dim_of_value_row(m):
    """The latent dim (0..511) that value row ``m`` (0..511, wgmma's M index of ``O^T``) of the kernel reads:
    within each 128-dim quarter, m bits (m0-2, m3, m4-5, m6) -> dim bits (2-4, 0, 5-6, 1); the quarter bits
    7-8 kept. So the thread that holds rows m, m + 8, m + 64, m + 72 of a quarter holds 4 consecutive dims.
    Ints or integer tensors; raises ValueError for a row outside 0..511."""
    lo, hi = (m, m) if isinstance(m, int) else ((int(m.min()), int(m.max())) if m.numel() else (0, 0))
    if lo < 0 or hi > 511:
        raise ValueError(f"value rows are 0..511, got {lo}..{hi}")
    return (((m >> 3) & 1) | (((m >> 6) & 1) << 1) | ((m & 7) << 2) | (((m >> 4) & 3) << 5) | (m & 384))


@gluon.jit
def _dims_of_positions(p):
    """:func:`k_position_to_dim` on an integer tensor inside a kernel."""
    return (p & 1) | (((p >> 3) & 1) << 1) | (((p >> 1) & 1) << 2) | (((p >> 2) & 1) << 3) | (p & ~15)


@gluon.constexpr_function
def _score_load_layout(width):
    """Register layout of a [64 rows, ``width`` positions] uint8 part of the tile (64 or 128 positions) for
    the score product's A operand: the wgmma A fragment (warp w rows 16w.., lane l rows l/4 (+8), positions
    2(l%4) (+1, +8, +9), then the k-steps) with registers ordered so that each thread's first four bytes are
    positions 2c, 2c+1, 2c+8, 2c+9 of one row = 4 consecutive dims."""
    reg = [[0, 1], [0, 8], [8, 0]] + [[0, k] for k in (16, 32, 64) if k < width]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, width])


@gluon.constexpr_function
def _quarter_tile_layout():
    """Shared layout of a quarter of the latent tile, ``[64 rows, 128 dims]`` uint8 (allocated
    ``[STAGES · 4, 64, 128]``): 16-byte units of a row XOR-permuted by the row, unit ^= h(row) with h(1) = 1,
    h(2) = 2, h(4) = 4, h(8) = 2. Conflict-free (``gl.bank_conflicts``, asserted in the kernel) for the
    cp.async writes (128 contiguous bytes per 8 lanes), the score reads (8 consecutive rows x 16 bytes) and
    the value reads (rows r, r + 4, r + 8, r + 12 x 32 bytes)."""
    h = {1: 1, 2: 2, 4: 4, 8: 2}
    bases = [[0, 1 << i] for i in range(7)]
    r = 1
    while r < 64:
        bases.append([r, 16 * h.get(r, 0)])
        r *= 2
    return gl.SharedLinearLayout(bases)


@gluon.constexpr_function
def _value_load_layout():
    """Register layout of a [128 value rows, 64 positions] uint8 quarter for the value product's A operand:
    the wgmma A fragment over two M tiles, registers ordered (m3, m6, p0, p3, ...) = a 4 x 4 byte block of
    4 consecutive dims (m3, m6 -> dim bits 0, 1) x 4 consecutive cache rows (p0, p3 -> row bits 0, 1)."""
    return gl.DistributedLinearLayout(reg_bases=[[8, 0], [64, 0], [0, 1], [0, 8], [0, 16], [0, 32]],
                                      lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[128, 64])


@gluon.jit
def _positions_of(x_smem, WIDTH: gl.constexpr):
    """A [64 rows, WIDTH dims] view -> the same rows with the dims in wgmma positions
    (:func:`k_position_to_dim` within each 16-wide step)."""
    x = x_smem.reshape([64, WIDTH // 16, 2, 2, 2, 2])  # row, step, d3, d2, d1, d0
    return x.permute((0, 1, 4, 2, 3, 5)).reshape([64, WIDTH])


@gluon.jit
def _value_view(kq):
    """A [64 rows, 128 dims] quarter of the tile -> V^T [128 value rows, 64 positions] relabelled
    (:func:`latent_dim_of_value_row`, :func:`k_position_to_dim`)."""
    v = kq.permute((1, 0)).reshape([2, 2, 2, 2, 2, 2, 2, 4, 2, 2, 2, 2])  # D6..D0 | r45 r3 r2 r1 r0
    return v.permute((5, 0, 1, 6, 2, 3, 4, 7, 10, 8, 9, 11)).reshape([128, 64])


@gluon.jit
def _copy_latent(smem, first, cache_ptr, blk, start, hi, BLOCK_SIZE: gl.constexpr, L: gl.constexpr):
    """cp.async of the latent bytes 0..511 of cache rows start .. start + 63 (physical blocks ``blk``, rows
    >= hi zero-filled) into the quarter buffers ``smem.index(first + j)`` [64 rows, 128 dims], j = 0..3."""
    n = start + gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    row = (blk.to(gl.int64) * BLOCK_SIZE + n % BLOCK_SIZE) * 576
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, L))
    ptrs = cache_ptr + gl.expand_dims(row, 1) + gl.expand_dims(c, 0)
    ok = gl.expand_dims(n < hi, 1) & gl.expand_dims(c < 128, 0)
    for j in gl.static_range(4):
        async_copy.async_copy_global_to_shared(smem.index(first + j), ptrs + 128 * j, mask=ok)


@gluon.jit
def _rows_to_positions(p):
    """[64 cache rows, 16] -> [64 positions, 16]: row dim(p) at position p (a relabelling)."""
    x = gl.reshape(p, [4, 2, 2, 2, 2, 16])  # r45 r3 r2 r1 r0 | n
    return gl.reshape(gl.permute(x, (0, 3, 1, 2, 4, 5)), [64, 16])


@gluon.jit
def _value_operand(v8, OPA: gl.constexpr):
    """fp8 bytes [128, 64] (layout :func:`_value_load_layout`) -> the fp16 A operand: each 4 x 4 byte block
    transposed and converted in the thread, the block's coordinates swapped back (a relabelling)."""
    x = gl.reshape(_e4m3_block_to_f16_pairs(v8), [2, 2, 2, 2, 8, 4, 2, 4, 2])  # m6 m5 m4 m3 m012 | k45 p3 p12 p0
    x = gl.permute(x, (6, 1, 2, 8, 4, 5, 0, 7, 3))
    return gl.convert_layout(gl.reshape(x, [128, 64]), OPA)


@gluon.jit
def _score_operands(kq, SL: gl.constexpr, OPA: gl.constexpr):
    """The two [64 rows, 64 positions] fp16 A operands (latent dims 0-63 and 64-127 of the quarter ``kq``
    [64 rows, 128 dims] uint8 shared) of the score product."""
    a = _positions_of(kq, 128).load(SL).to(gl.float8e4nv, bitcast=True).to(gl.float16)
    a0, a1 = gl.split(gl.permute(gl.reshape(a, [64, 2, 64]), (0, 2, 1)))
    return gl.convert_layout(a0, OPA), gl.convert_layout(a1, OPA)


@gluon.jit
def _store_quarter(o, inv, base_ptr, row_stride, ok, J: gl.constexpr, OUT: gl.constexpr):
    """Rows 128J.. of O^T [128, 16] times ``inv`` per column -> out[n, latent dims of the quarter]."""
    o = gl.permute(o * gl.expand_dims(inv, 0), (1, 0))  # [16, 128 value rows]
    o = gl.reshape(gl.permute(gl.reshape(o, [16, 2, 2, 2, 2, 8]), (0, 2, 3, 5, 1, 4)), [16, 128])  # -> dim order
    o = gl.convert_layout(o.to(base_ptr.dtype.element_ty), OUT)
    d = gl.arange(0, 128, layout=gl.SliceLayout(0, OUT))
    gl.store(base_ptr + gl.expand_dims(row_stride, 1) + 128 * J + gl.expand_dims(d, 0), o,
             mask=gl.expand_dims(ok, 1) & gl.expand_dims(d < 128, 0))


@gluon.jit
def mla_decode_fp8_wgmma_stage1(q_ptr, cache_ptr, bt_ptr, qsl_ptr, kvlen_ptr, vis_ptr, out_ptr, lse_ptr,
                                H, stride_bt, stride_qt, stride_qh, stride_ot, stride_oh, num_splits, qk_scale,
                                out_scale, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, HAS_VIS: gl.constexpr,
                                SPLIT: gl.constexpr):
    """Stage 1 over an fp8 (uint8-viewed) cache ``[num_blocks, BLOCK_SIZE, 576]``, arguments and outputs as
    :func:`gluon_mla_decode.mla_decode_fp8_stage1` (grid (head-group, kv-split, request), 4 warps, 64
    cache rows per step, ``STAGES`` cp.async buffers)."""
    gl.static_assert(STAGES >= 2, "STAGES must be >= 2 (the loop consumes a tile copied one iteration earlier)")
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    SL: gl.constexpr = _score_load_layout(128)
    SLR: gl.constexpr = _score_load_layout(64)
    VL: gl.constexpr = _value_load_layout()
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)  # cache rows of S^T
    HEADS: gl.constexpr = gl.SliceLayout(0, MMA)  # query rows
    CPN: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # 8 lanes: 128 bytes of a row
    CPP: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    OUT: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    KN_SH: gl.constexpr = _quarter_tile_layout()
    KP_SH: gl.constexpr = _swizzled_tile_layout(BLOCK_N, 64)

    pid_g = gl.program_id(0)
    pid_s = gl.program_id(1)
    b = gl.program_id(2)
    q_start = gl.load(qsl_ptr + b)
    q_len = gl.load(qsl_ptr + b + 1) - q_start
    kv_len = gl.load(kvlen_ptr + b)

    # q: each row times a power of two 2^e with max |q row| in [2^13, 2^14) (fp16 range; the Triton kernel's
    # F16 rule), stored once as Q^T's nine 64-wide chunks in wgmma positions (B operands, K-major)
    mq = pid_g * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, QL))
    okq = gl.expand_dims(mq < q_len * H, 1)
    q_row = gl.expand_dims(q_ptr + (q_start + mq // H).to(gl.int64) * stride_qt + (mq % H) * stride_qh, 1)
    c512 = gl.expand_dims(gl.arange(0, 512, layout=gl.SliceLayout(0, QL)), 0)
    c64 = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, QL)), 0)
    amax = gl.maximum(gl.max(gl.abs(gl.load(q_row + c512, mask=okq, other=0.0).to(gl.float32)), axis=1),
                      gl.max(gl.abs(gl.load(q_row + 512 + c64, mask=okq, other=0.0).to(gl.float32)), axis=1))
    qs = _q_row_scale(amax)
    q_smem = gl.allocate_shared_memory(gl.float16, [9, 16, 64], B_SH)
    cpos = _dims_of_positions(c64)
    for c in gl.static_range(9):
        qc = gl.load(q_row + 64 * c + cpos, mask=okq, other=0.0).to(gl.float32) * gl.expand_dims(qs, 1)
        q_smem.index(c).store(qc.to(gl.float16))

    kn_smem = gl.allocate_shared_memory(gl.uint8, [STAGES * 4, BLOCK_N, 128], KN_SH)
    kp_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 64], KP_SH)
    pt_smem = gl.allocate_shared_memory(gl.float16, [16, BLOCK_N], B_SH)
    # the swizzles leave the copies in, the score reads, the value reads and q's stores free of bank conflicts
    kq0 = kn_smem.index(0)
    kp0 = kp_smem.index(0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.uint8, [BLOCK_N, 128], CPN), kq0.type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.uint8, [BLOCK_N, 64], CPP), kp0.type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.uint8, [BLOCK_N, 128], SL),
                                       _positions_of(kq0, 128).type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.uint8, [BLOCK_N, 64], SLR), _positions_of(kp0, 64).type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.uint8, [128, BLOCK_N], VL), _value_view(kq0).type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float16, [16, 64], QL), q_smem.index(0).type) == 0)
    fence_async_shared()  # q's stores before wgmma reads them (the loop's first barrier orders the warps)

    h_idx = pid_g * 16 + gl.arange(0, 16, layout=HEADS)
    row_ok = h_idx < q_len * H
    j = h_idx // H
    vis = _visible_rows(vis_ptr, q_start, kv_len, q_len, j, row_ok, HAS_VIS)
    qsc = qk_scale / gl.convert_layout(qs, HEADS)  # exact: qs is a power of two
    lo, hi, num_tiles = _split_rows(kv_len, num_splits, pid_s, pid_g, q_len, H, BLOCK_N)
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt

    BTN: gl.constexpr = gl.SliceLayout(1, CPN)
    BTP: gl.constexpr = gl.SliceLayout(1, CPP)
    for st in gl.static_range(STAGES - 1):
        start0 = lo + st * BLOCK_N
        _copy_latent(kn_smem, 4 * st, cache_ptr, _block_ids(bt_row, start0, hi, BLOCK_N, BLOCK_SIZE, BTN), start0,
                     hi, BLOCK_SIZE, CPN)
        _copy_rows(kp_smem.index(st), cache_ptr, _block_ids(bt_row, start0, hi, BLOCK_N, BLOCK_SIZE, BTP), start0,
                   hi, 512, 64, BLOCK_N, BLOCK_SIZE, CPP)
        async_copy.commit_group()
    start_next = lo + (STAGES - 1) * BLOCK_N
    blk_n = _block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTN)
    blk_p = _block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTP)

    m_i = gl.full([16], float("-inf"), gl.float32, layout=HEADS)
    l_acc = gl.zeros([BLOCK_N, 16], gl.float32, layout=MMA)  # running sums per score slot (summed at the end)
    o0 = gl.zeros([128, 16], gl.float32, layout=MMA)
    o1 = gl.zeros([128, 16], gl.float32, layout=MMA)
    o2 = gl.zeros([128, 16], gl.float32, layout=MMA)
    o3 = gl.zeros([128, 16], gl.float32, layout=MMA)
    pt = pt_smem.permute((1, 0))  # P^T [64 positions, 16]: the value product's B operand
    for i in range(0, num_tiles):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()  # tile i visible to all warps; every warp is done with iteration i - 1
        nxt = (i + STAGES - 1) % STAGES
        _copy_latent(kn_smem, 4 * nxt, cache_ptr, blk_n, start_next, hi, BLOCK_SIZE, CPN)
        _copy_rows(kp_smem.index(nxt), cache_ptr, blk_p, start_next, hi, 512, 64, BLOCK_N, BLOCK_SIZE, CPP)
        async_copy.commit_group()
        start_next = start_next + BLOCK_N
        blk_n = _block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTN)
        blk_p = _block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTP)
        cur = 4 * (i % STAGES)
        # S^T = K · Q^T over the 4 latent quarters (2 chunks each) + the rope chunk: A from registers, B = q^T;
        # each wait keeps at most the last quarter's two products in flight (their A registers alive: the
        # deps), so the operands of at most two quarters are live at once
        s = gl.zeros([BLOCK_N, 16], gl.float32, layout=MMA)
        a0, a1 = _score_operands(kn_smem.index(cur), SL, OPA)
        s = warpgroup_mma(a0, q_smem.index(0).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(a1, q_smem.index(1).permute((1, 0)), s, is_async=True)
        for qq in gl.static_range(1, 4):
            b0, b1 = _score_operands(kn_smem.index(cur + qq), SL, OPA)
            s = warpgroup_mma(b0, q_smem.index(2 * qq).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(b1, q_smem.index(2 * qq + 1).permute((1, 0)), s, is_async=True)
            a0, a1 = warpgroup_mma_wait(2, deps=[a0, a1])
            a0 = b0
            a1 = b1
        ar = _positions_of(kp_smem.index(i % STAGES), 64).load(SLR).to(gl.float8e4nv, bitcast=True).to(gl.float16)
        ar = gl.convert_layout(ar, OPA)
        s = warpgroup_mma(ar, q_smem.index(8).permute((1, 0)), s, is_async=True)
        s, a0, a1, ar = warpgroup_mma_wait(0, deps=[s, a0, a1, ar])
        # online softmax (base 2) over the tile's rows, per query row (column)
        n = lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=ROWS)
        keep = gl.expand_dims(n < hi, 1) & gl.expand_dims(row_ok, 0) & (gl.expand_dims(n, 1) < gl.expand_dims(vis, 0))
        s = gl.where(keep, s * gl.expand_dims(qsc, 0), float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        pr = gl.exp2(s - gl.expand_dims(m_safe, 0))
        l_acc = l_acc * gl.expand_dims(alpha, 0) + pr
        m_i = m_new
        if gl.min(alpha, axis=0) < 1.0:  # a row's max grew: rescale (x 1.0 elsewhere would change nothing)
            al = gl.expand_dims(alpha, 0)
            o0 = o0 * al
            o1 = o1 * al
            o2 = o2 * al
            o3 = o3 * al
        pt.store(_rows_to_positions(pr.to(gl.float16)))
        fence_async_shared()
        gl.thread_barrier()  # all of P^T written before any warp's wgmma reads it
        # O^T += V^T · P^T per quarter, at most two quarters' products (and A operands) in flight
        v0 = _value_operand(_value_view(kn_smem.index(cur)).load(VL), OPA)
        o0 = warpgroup_mma(v0, pt, o0, is_async=True)
        v1 = _value_operand(_value_view(kn_smem.index(cur + 1)).load(VL), OPA)
        o1 = warpgroup_mma(v1, pt, o1, is_async=True)
        o0, v0 = warpgroup_mma_wait(1, deps=[o0, v0])
        v2 = _value_operand(_value_view(kn_smem.index(cur + 2)).load(VL), OPA)
        o2 = warpgroup_mma(v2, pt, o2, is_async=True)
        o1, v1 = warpgroup_mma_wait(1, deps=[o1, v1])
        v3 = _value_operand(_value_view(kn_smem.index(cur + 3)).load(VL), OPA)
        o3 = warpgroup_mma(v3, pt, o3, is_async=True)
        o2, o3, v2, v3 = warpgroup_mma_wait(0, deps=[o2, o3, v2, v3])
    async_copy.wait_group(0)

    l_i = gl.sum(l_acc, axis=0)
    seen = l_i > 0
    inv = gl.where(seen, out_scale / gl.where(seen, l_i, 1.0), 0.0)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tok = (q_start + j).to(gl.int64)
    hh = h_idx % H
    mo = pid_g * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, OUT))
    ok_o = mo < q_len * H
    tok_o = (q_start + mo // H).to(gl.int64)
    if SPLIT:  # partials [T, H, S, 512] fp32 and [T, H, S]; an empty split writes only its LSE
        prow = ((tok_o * H + mo % H) * num_splits + pid_s) * 512
        ok_w = ok_o & (hi > lo)
        _store_quarter(o0, inv, out_ptr, prow, ok_w, 0, OUT)
        _store_quarter(o1, inv, out_ptr, prow, ok_w, 1, OUT)
        _store_quarter(o2, inv, out_ptr, prow, ok_w, 2, OUT)
        _store_quarter(o3, inv, out_ptr, prow, ok_w, 3, OUT)
        gl.store(lse_ptr + (tok * H + hh) * num_splits + pid_s, lse, mask=row_ok)
    else:
        orow = tok_o * stride_ot + (mo % H) * stride_oh
        _store_quarter(o0, inv, out_ptr, orow, ok_o, 0, OUT)
        _store_quarter(o1, inv, out_ptr, orow, ok_o, 1, OUT)
        _store_quarter(o2, inv, out_ptr, orow, ok_o, 2, OUT)
        _store_quarter(o3, inv, out_ptr, orow, ok_o, 3, OUT)
        gl.store(lse_ptr + tok * H + hh, lse, mask=row_ok)


def compile_stage1(target=None, *, stages: int = 2, split: bool = True, has_vis: bool = False, q_dtype: str = "bf16",
                   block_size: int = 16):
    """Ahead-of-time compile of :func:`mla_decode_fp8_wgmma_stage1` for ``target`` (default
    ``GPUTarget("cuda", 90, 32)``: wgmma is sm_90 only), pointer and stride arguments marked 16-divisible as
    the JIT marks real tensors; no GPU needed (Triton's bundled ptxas). Returns Triton's compiled kernel.
    Raises ValueError for arguments the kernel does not take, and Triton's compilation errors."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    target = target or GPUTarget("cuda", 90, 32)
    if q_dtype not in ("bf16", "fp16"):
        raise ValueError(f"q_dtype must be 'bf16' or 'fp16', got {q_dtype!r}")
    if not isinstance(stages, int) or not isinstance(block_size, int) or stages < 2 or block_size < 1:
        raise ValueError(f"stages must be an int >= 2 and block_size an int >= 1, got {stages!r}, {block_size!r}")
    if not isinstance(split, bool) or not isinstance(has_vis, bool):
        raise ValueError(f"split and has_vis must be bools, got {split!r}, {has_vis!r}")
    if target.backend != "cuda" or int(target.arch) != 90:
        raise ValueError(f"the kernel needs compute capability 9.0 (wgmma), got {target}")
    sig = {"q_ptr": f"*{q_dtype}", "cache_ptr": "*u8", "bt_ptr": "*i32", "qsl_ptr": "*i32", "kvlen_ptr": "*i32",
           "vis_ptr": "*i32", "out_ptr": "*fp32" if split else f"*{q_dtype}", "lse_ptr": "*fp32", "H": "i32",
           "stride_bt": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32",
           "num_splits": "i32", "qk_scale": "fp32", "out_scale": "fp32"}
    const = dict(BLOCK_SIZE=block_size, STAGES=stages, HAS_VIS=has_vis, SPLIT=split)
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    div = ["q_ptr", "cache_ptr", "bt_ptr", "qsl_ptr", "kvlen_ptr", "vis_ptr", "out_ptr", "lse_ptr",
           "stride_qt", "stride_qh", "stride_ot", "stride_oh"]
    src = GluonASTSource(fn=mla_decode_fp8_wgmma_stage1, signature=sig,
                         constexprs={(names.index(k),): v for k, v in const.items()},
                         attrs={(names.index(k),): [["tt.divisibility", 16]] for k in div})
    return triton.compile(src, target=target, options=dict(num_warps=4))
