"""Gluon (Triton's explicit-layout dialect) stage 1 of the paged MLA decode attention over an **fp8** cache,
for up to 16 query rows per request (q_len · heads ≤ 16: DeepSeek-V3 / Kimi-K2 at 16 heads per GPU).
Same inputs and results as the Triton kernel's stage 1 (:mod:`longflash.attention.triton_mla_decode`,
which also provides stage 2, the split merge) and the PyTorch reference
(:func:`longflash.attention.ops.mla_decode_attention`).

Why a second kernel: the attention's value product ``P · V`` contracts over cache rows, but each row's
bytes are contiguous along the latent dimension, and an MMA operand needs the contraction dimension
packed in its registers. For 16-bit data ``ldmatrix.trans`` transposes on the way out of shared memory;
8-bit data has no such instruction, so Triton assembles the fp8 value operand one byte per shared-memory
load (``benchmarks/NOTES.md``, session 21: 37 % of the instructions, the fp8 kernel at 0.34-0.37 of copy
bandwidth while the bf16 one reaches 0.94). Here the layouts are explicit (4 warps, one program per
(16 query rows, kv-split, request), BLOCK_N cache rows per step):

- the cache tile ``[BLOCK_N, 512 | 64]`` bytes is copied to shared memory with ``cp.async`` (``STAGES``
  buffers; block ids loaded one tile ahead) under an XOR swizzle chosen so that the copies and all reads
  below are free of bank conflicts (``gl.bank_conflicts``, asserted at compile time);
- scores: warp w contracts latent dims 128w..128w+127 and rope dims 16w..16w+15 (a batched ``mma.sync``
  m16n8k16 in fp16, q held in registers for the whole kernel, operands of ``k_width`` 4: one 4-byte
  shared load per cache row and 4 dims); the four partial tiles meet in a conflict-free exchange buffer
  where each warp sums a quarter of the columns, so the softmax is not computed 4 times;
- online softmax in base 2 with a cross-warp row max; the running sum is kept per score slot and
  reduced once at the end; the output rescale is skipped when no row's max grew (x 1.0 otherwise);
- the value operand is read as 4 × 4 byte blocks (4 consecutive cache rows × 4 consecutive latent
  dims, four 4-byte loads) through a *relabelled* view of the tile: logical value column n is latent
  dim ``σ(n)`` (:func:`latent_dim_of_column`), chosen so that the MMA operand layout holds exactly those
  blocks. Four ``prmt`` + eight ``cvt.rn.f16x2.e4m3x2`` per block transpose and convert inside the
  thread (:func:`_e4m3_block_to_f16_pairs`), P comes through a conflict-free buffer, the 4 warps split
  the 512 output columns, and the output leaves through one shared-memory exchange into latent-dim order
  (:func:`_columns_to_latent_dims`) with 16-byte coalesced stores.
``WARPS`` = 8 splits each program's score and value columns over 8 warps instead (σ then over column bits
6-7); correct, but slower on the H200 (NOTES "Session 25"), so the default stays 4.

Measured on an H200 (``benchmarks/results/mla_decode_s25.h200.md``, NOTES "Session 25"): 0.67-0.85 of the
copy bandwidth at batch 16-64 × 32K-128K (the Triton fp8 tile: 0.34-0.37; the bf16 kernel: 0.85-0.99 of
copy for twice the bytes, so fp8 decode is 1.6-1.7x faster than bf16). Its copies alone reach 0.95-0.99
(``benchmarks/mla_decode_copy_ceiling.py``): the remaining limit is the arithmetic, about 1.8 instructions
issued per cycle per SM whether 8 or 16 warps are resident, a quarter of them the per-byte fp8 -> fp16
conversions (each byte converted once per product).

Numerics are those of the Triton kernel's fp16 path (``F16``): q rows scaled by a power of two into
fp16 range, fp8 values exact in fp16, fp32 accumulation, online softmax in base 2, P rounded to fp16.
``k_scale`` is folded into the score scale and the output scale. Gluon kernels run only on the GPU
(sm_89+: ``cvt.rn.f16x2.e4m3x2``); the CPU suite compiles them for sm_90 and the GPU tests compare them
with the reference.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

@gluon.constexpr_function
def _first_register_bit(warps):
    """B: the lowest value-column bit held in registers by the value MMA's B operand (3 lane bits, then
    log2(warps) warp bits): 5 for 4 warps, 6 for 8."""
    return 3 + (warps.bit_length() - 1)


def latent_dim_of_column(n, warps=4):
    """σ: the latent dim that logical value column ``n`` (0..511) of the kernel's PV product reads with
    ``warps`` (4 or 8) warps per program. A bit permutation with B = 3 + log2(warps): n bits B..B+1 ->
    dim bits 0-1, n bits 0..B-1 -> dim bits 2..B+1, the bits above kept (4 warps: n bits 5-6 -> dim
    bits 0-1, bits 0-4 -> 2-6). Works on ints and on integer tensors; raises ValueError for a column
    outside 0..511 or a warp count other than 4 or 8."""
    if warps not in (4, 8):
        raise ValueError(f"warps must be 4 or 8, got {warps}")
    if isinstance(n, int):
        lo = hi = n
    else:
        lo, hi = (int(n.min()), int(n.max())) if n.numel() else (0, 0)
    if lo < 0 or hi > 511:
        raise ValueError(f"value columns are 0..511, got {lo}..{hi}")
    b = _first_register_bit(warps)
    return ((n >> b) & 3) | ((n & ((1 << b) - 1)) << 2) | (n & (511 & ~((1 << (b + 2)) - 1)))


@gluon.constexpr_function
def _swizzled_tile_layout(rows, width):
    """Shared layout of one ``[rows, width]`` uint8 cache tile (allocated ``[STAGES, rows, width]``): 16-byte
    chunks of a row XOR-permuted by the row, chunk ^= h(row), h linear over the row bits. h is chosen so
    that every access pattern of the kernel touches distinct banks per wavefront (asserted at compile time
    with ``gl.bank_conflicts``): the cp.async writes (rows x 16-byte chunks per thread group), the score
    reads (8 consecutive rows x 16 bytes), the value reads (rows 4t + c, t = 0..3, x 32 bytes)."""
    if width == 512:
        h = {1: 4, 2: 1, 4: 2, 8: 4} if rows == 32 else {1: 2, 2: 4, 4: 3, 8: 4}
    else:
        h = {2: 2, 4: 1}
    bases = [[0, 1 << i] for i in range(4)]
    i = 1
    while i < width // 16:
        bases.append([0, 16 * i])
        i *= 2
    r = 1
    while r < rows:
        bases.append([r, 16 * h.get(r, 0)])
        r *= 2
    return gl.SharedLinearLayout(bases)


@gluon.constexpr_function
def _value_load_layout(rows, warps):
    """Register layout of a ``[rows, 512]`` value tile in the relabelled (logical column) view: the MMA's
    B-operand layout (m16n8k16, ``warps`` warps along N, k_width 4) with its registers reordered so that
    each thread's first four registers are four consecutive latent dims of one cache row (one 4-byte load)."""
    b = _first_register_bit(warps)
    reg = [[0, 1 << b], [0, 2 << b], [1, 0], [2, 0]]
    k = 16
    while k < rows:
        reg.append([k, 0])
        k *= 2
    c = 4 << b
    while c < 512:
        reg.append([0, c])
        c *= 2
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[4, 0], [8, 0], [0, 1], [0, 2], [0, 4]],
                                      warp_bases=[[0, 8 << i] for i in range(warps.bit_length() - 1)],
                                      block_bases=[], shape=[rows, 512])


@gluon.constexpr_function
def _col_lo(warps):
    """2^B (:func:`_first_register_bit`): the value columns below the register bits."""
    return 1 << _first_register_bit(warps)


@gluon.constexpr_function
def _col_hi(warps):
    """512 >> (B + 2): the value-column chunks above the two register bits that hold consecutive dims."""
    return 512 >> (_first_register_bit(warps) + 2)


@gluon.constexpr_function
def _exchange_layout(parts, rows, cols, elem_bytes, unit_bytes, f):
    """Shared layout of a ``[parts, rows, cols]`` exchange buffer (``parts`` 1 drops that dim): ``unit_bytes``
    chunks of a row XOR-permuted by the row, unit ^= f(row) (``f`` gives f(1), f(2), f(4), ...), so the
    register layouts that store and load it hit distinct banks (checked by ``gl.bank_conflicts``)."""
    rank3 = parts > 1
    def basis(p, r, c):
        return [p, r, c] if rank3 else [r, c]
    per_unit = unit_bytes // elem_bytes
    bases = []
    e = 1
    while e < cols:
        bases.append(basis(0, 0, e))
        e *= 2
    for i, r in enumerate([1 << k for k in range((rows - 1).bit_length())]):
        bases.append(basis(0, r, per_unit * (f[i] if i < len(f) else 0)))
    p = 1
    while p < parts:
        bases.append(basis(p, 0, 0))
        p *= 2
    return gl.SharedLinearLayout(bases)


@gluon.constexpr_function
def _with_parts_in_registers(ll, parts):
    """``ll`` (a [rows, cols] DistributedLinearLayout) with a leading dim of ``parts`` held in registers."""
    def z(b):
        return [0] + list(b)
    reg = [[1 << i, 0, 0] for i in range(parts.bit_length() - 1)] + [z(b) for b in ll.reg_bases]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[z(b) for b in ll.lane_bases],
                                      warp_bases=[z(b) for b in ll.warp_bases], block_bases=[],
                                      shape=[parts] + list(ll.shape))


@gluon.jit
def _e4m3_block_to_f16_pairs(v):
    """fp8 E4M3 bytes -> fp16, a 4 x 4 byte block (4 cache rows x 4 latent dims: 16 consecutive registers of
    the value load layout) per ``prmt`` + ``cvt`` group: four byte permutes pair each dim's bytes of rows
    (0, 1) and (2, 3), eight ``cvt.rn.f16x2.e4m3x2`` convert the pairs. The result holds, at the element
    of block position (row a, dim c), the value of (row c, dim a): the caller swaps those coordinates
    back (:func:`_swap_block_coords`), which the layouts make a relabelling, not a data movement."""
    return gl.inline_asm_elementwise(
        """{ .reg .b32 t0, t1, t2, t3; .reg .b16 l, h;
        prmt.b32 t0, $8, $9, 0x5140; prmt.b32 t1, $10, $11, 0x5140;
        prmt.b32 t2, $8, $9, 0x7362; prmt.b32 t3, $10, $11, 0x7362;
        mov.b32 {l, h}, t0; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $2, h;
        mov.b32 {l, h}, t1; cvt.rn.f16x2.e4m3x2 $1, l; cvt.rn.f16x2.e4m3x2 $3, h;
        mov.b32 {l, h}, t2; cvt.rn.f16x2.e4m3x2 $4, l; cvt.rn.f16x2.e4m3x2 $6, h;
        mov.b32 {l, h}, t3; cvt.rn.f16x2.e4m3x2 $5, l; cvt.rn.f16x2.e4m3x2 $7, h; }""",
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [v], dtype=gl.float16, is_pure=True, pack=16)


@gluon.jit
def _swap_block_coords(x, BLOCK_N: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr):
    """[BLOCK_N, 512] -> same shape with row bits 0-1 and column bits B..B+1 exchanged (a relabelling;
    LO = 2^B, HI = 512 >> (B + 2), :func:`_col_lo`, :func:`_col_hi`)."""
    x = gl.reshape(x, [BLOCK_N // 4, 4, HI, 4, LO])
    x = gl.permute(x, (0, 3, 2, 1, 4))
    return gl.reshape(x, [BLOCK_N, 512])


@gluon.jit
def _columns_to_latent_dims(o, LO: gl.constexpr, HI: gl.constexpr):
    """[16, 512] in logical value columns -> [16, 512] in latent-dim order (element d is column σ⁻¹(d),
    :func:`latent_dim_of_column`): a reshape/permute of the column bits, a relabelling of registers."""
    o = gl.reshape(o, [16, HI, 4, LO])  # column bits B+2.. | B..B+1 | 0..B-1
    o = gl.permute(o, (0, 1, 3, 2))  # -> dim bits B+2.. | 2..B+1 | 0-1
    return gl.reshape(o, [16, 512])


@gluon.jit
def _q_row_scale(amax):
    """Per q row, the power of two 2^e that puts max |q row| (``amax``, fp32) in [2^13, 2^14): fp16 range for
    the fp16 products (the Triton kernel's F16 rule); 1 for an all-zero row."""
    e = 127 + 13 - (((amax.to(gl.int32, bitcast=True) >> 23) & 255) - 127)
    return gl.where(amax > 0, (gl.minimum(gl.maximum(e, 1), 254) << 23).to(gl.float32, bitcast=True), 1.0)


@gluon.jit
def _visible_rows(vis_ptr, q_start, kv_len, q_len, j, row_ok, HAS_VIS: gl.constexpr):
    """Cache rows each query row sees: the DCP-local visible lengths (HAS_VIS), else causal (query j of the
    request's q_len sits at position kv_len - q_len + j and sees the rows at or before it)."""
    if HAS_VIS:
        vis = gl.load(vis_ptr + (q_start + j).to(gl.int64), mask=row_ok, other=0)
    else:
        vis = kv_len - q_len + j + 1
    return vis


@gluon.jit
def _split_rows(kv_len, num_splits, pid_s, pid_g, q_len, H, BLOCK_N: gl.constexpr):
    """This program's cache rows [lo, hi) of its request (splits of whole BLOCK_N tiles; none for a head-group
    past the request's query rows) and its number of tiles."""
    chunk = gl.cdiv(gl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = gl.minimum(lo + chunk, kv_len)
    hi = gl.where(pid_g * 16 < q_len * H, hi, lo)
    return lo, hi, gl.cdiv(hi - lo, BLOCK_N)


@gluon.jit
def _block_ids(bt_row, start, hi, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, L: gl.constexpr):
    """Physical block of each cache row start .. start + BLOCK_N - 1 (0 past ``hi``), in layout ``L``."""
    n = start + gl.arange(0, BLOCK_N, layout=L)
    return gl.load(bt_row + n // BLOCK_SIZE, mask=n < hi, other=0)


@gluon.jit
def _copy_rows(smem, cache_ptr, blk, start, hi, COL0: gl.constexpr, WIDTH: gl.constexpr, BLOCK_N: gl.constexpr,
               BLOCK_SIZE: gl.constexpr, L: gl.constexpr):
    """cp.async of bytes COL0 .. COL0 + WIDTH - 1 of cache rows start .. (physical blocks ``blk``; rows
    >= hi zero-filled) into ``smem`` [BLOCK_N, WIDTH]."""
    n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
    row = (blk.to(gl.int64) * BLOCK_SIZE + n % BLOCK_SIZE) * 576 + COL0
    c = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, L))
    async_copy.async_copy_global_to_shared(smem, cache_ptr + gl.expand_dims(row, 1) + gl.expand_dims(c, 0),
                                           mask=gl.expand_dims(n < hi, 1) & gl.expand_dims(c < WIDTH, 0))


@gluon.jit
def _partial_scores(q_n, q_p, kn, kp, BLOCK_N: gl.constexpr, OPB3: gl.constexpr, MMA3: gl.constexpr):
    """[4, 16, BLOCK_N] fp32: warp w's partial scores of the tile in ``kn`` [BLOCK_N, 512] / ``kp``
    [BLOCK_N, 64] (uint8 shared memory) over latent dims 128w.. and rope dims 16w.. (batched fp16 MMA)."""
    kt = kn.reshape([BLOCK_N, 4, 128]).permute((1, 2, 0)).load(OPB3)
    s3 = mma_v2(q_n, kt.to(gl.float8e4nv, bitcast=True).to(gl.float16),
                gl.zeros([4, 16, BLOCK_N], gl.float32, layout=MMA3))
    kpt = kp.reshape([BLOCK_N, 4, 16]).permute((1, 2, 0)).load(OPB3)
    return mma_v2(q_p, kpt.to(gl.float8e4nv, bitcast=True).to(gl.float16), s3)


@gluon.jit
def mla_decode_fp8_stage1(q_ptr, cache_ptr, bt_ptr, qsl_ptr, kvlen_ptr, vis_ptr, out_ptr, lse_ptr,
                          H, stride_bt, stride_qt, stride_qh, stride_ot, stride_oh, num_splits, qk_scale, out_scale,
                          BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr,
                          HAS_VIS: gl.constexpr, SPLIT: gl.constexpr, WARPS: gl.constexpr = 4):
    """Stage 1 over an fp8 (uint8-viewed) cache ``[num_blocks, BLOCK_SIZE, 576]``; grid (head-group,
    kv-split, request), arguments as the Triton kernel's ``_mla_decode_stage1``; 4 warps. Writes the
    split's partial ``[T, H, S, 512]`` fp32 output and LSE (SPLIT) or the final output in q's dtype and
    LSE. Scores: warp w contracts latent dims 128w..128w+127 and rope dims 16w..16w+15 (a batched MMA,
    q held in registers), the four partial score tiles are summed; values: the 4 warps split the 512
    output columns."""
    gl.static_assert((BLOCK_N == 32) | (BLOCK_N == 64), "BLOCK_N must be 32 or 64")
    gl.static_assert((WARPS == 4) | ((WARPS == 8) & (BLOCK_N == 64)), "WARPS must be 4, or 8 with BLOCK_N 64")
    LO: gl.constexpr = _col_lo(WARPS)
    HI: gl.constexpr = _col_hi(WARPS)
    gl.static_assert(STAGES >= 2, "STAGES must be >= 2 (the loop consumes a tile copied one iteration earlier)")
    MMA3: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, WARPS // 4],
                                                   instr_shape=[1, 16, 8])
    OPA3: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=4)
    OPB3: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA3, k_width=4)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8])
    # the four partial score tiles, each thread holding its 4 scores (of the MMA layout) from all four
    PARTS: gl.constexpr = _with_parts_in_registers(gl.to_linear_layout(MMA, [16, BLOCK_N]), 4)
    RED_SH: gl.constexpr = _exchange_layout(4, 16, BLOCK_N, 4, 32, [1, 2])
    P_SH: gl.constexpr = _exchange_layout(1, 16, BLOCK_N, 2, 16, [0, 2, 1] if BLOCK_N == 32 else [2, 4, 1])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    COLS: gl.constexpr = gl.SliceLayout(0, MMA)
    # cp.async layouts, 16-byte chunks: a warp copies 2 rows x 256 bytes (latent) or 8 rows x 64 bytes (rope)
    # per instruction, so each group of 8 lanes writes 128 contiguous bytes (no bank conflicts whatever the
    # swizzle) and a thread computes BLOCK_N / 8 (BLOCK_N / 32) row addresses per tile
    CPN: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [WARPS, 1], [1, 0])
    CPP: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
    VL: gl.constexpr = _value_load_layout(BLOCK_N, WARPS)
    KN_SH: gl.constexpr = _swizzled_tile_layout(BLOCK_N, 512)
    KP_SH: gl.constexpr = _swizzled_tile_layout(BLOCK_N, 64)

    pid_g = gl.program_id(0)
    pid_s = gl.program_id(1)
    b = gl.program_id(2)
    q_start = gl.load(qsl_ptr + b)
    q_len = gl.load(qsl_ptr + b + 1) - q_start
    kv_len = gl.load(kvlen_ptr + b)

    # q [16 rows, 576] as [4 warps, 16, 128] (latent) and [4, 16, 16] (rope) MMA operands, each row scaled by a
    # power of two 2^e so that its max |q| lies in [2^13, 2^14) (fp16 range; the Triton kernel's F16 rule)
    QROW: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, OPA3))
    mq = pid_g * 16 + gl.arange(0, 16, layout=QROW)
    okq = gl.expand_dims(gl.expand_dims(mq < q_len * H, 0), 2)
    q_row = gl.expand_dims(gl.expand_dims(q_ptr + (q_start + mq // H).to(gl.int64) * stride_qt + (mq % H) * stride_qh, 0), 2)
    wq = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, OPA3))), 1), 2)
    dq = gl.expand_dims(gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, OPA3))), 0), 1)
    pq = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, OPA3))), 0), 1)
    q_n = gl.load(q_row + wq * 128 + dq, mask=okq, other=0.0).to(gl.float32)
    q_p = gl.load(q_row + 512 + wq * 16 + pq, mask=okq, other=0.0).to(gl.float32)
    amax = gl.maximum(gl.max(gl.max(gl.abs(q_n), axis=2), axis=0), gl.max(gl.max(gl.abs(q_p), axis=2), axis=0))
    qs = _q_row_scale(amax)
    qs3 = gl.expand_dims(gl.expand_dims(qs, 0), 2)
    q_n = (q_n * qs3).to(gl.float16)
    q_p = (q_p * qs3).to(gl.float16)

    kn_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], KN_SH)
    kp_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 64], KP_SH)
    # the swizzle leaves the copies in, the two score reads and the value read free of bank conflicts
    kn0 = kn_smem.index(0)
    kp0 = kp_smem.index(0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.uint8, [BLOCK_N, 512], CPN), kn0.type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.uint8, [BLOCK_N, 64], CPP), kp0.type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.uint8, [4, 128, BLOCK_N], OPB3),
                                       kn0.reshape([BLOCK_N, 4, 128]).permute((1, 2, 0)).type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.uint8, [4, 16, BLOCK_N], OPB3),
                                       kp0.reshape([BLOCK_N, 4, 16]).permute((1, 2, 0)).type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.uint8, [BLOCK_N, 512], VL), kn0.reshape(
        [BLOCK_N, HI, LO, 4]).permute((0, 1, 3, 2)).reshape([BLOCK_N, 512]).type) == 0)
    red_smem = gl.allocate_shared_memory(gl.float32, [4, 16, BLOCK_N], RED_SH)
    p_smem = gl.allocate_shared_memory(gl.float16, [16, BLOCK_N], P_SH)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float32, [4, 16, BLOCK_N], MMA3), red_smem.type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float32, [4, 16, BLOCK_N], PARTS), red_smem.type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float16, [16, BLOCK_N], MMA), p_smem.type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float16, [16, BLOCK_N], OPA), p_smem.type) == 0)

    m_idx = pid_g * 16 + gl.arange(0, 16, layout=ROWS)
    row_ok = m_idx < q_len * H
    j = m_idx // H
    vis = _visible_rows(vis_ptr, q_start, kv_len, q_len, j, row_ok, HAS_VIS)
    qsc = qk_scale / gl.convert_layout(qs, ROWS)  # exact: qs is a power of two
    lo, hi, num_tiles = _split_rows(kv_len, num_splits, pid_s, pid_g, q_len, H, BLOCK_N)
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt

    BTN: gl.constexpr = gl.SliceLayout(1, CPN)
    BTP: gl.constexpr = gl.SliceLayout(1, CPP)
    for st in gl.static_range(STAGES - 1):
        start0 = lo + st * BLOCK_N
        _copy_rows(kn_smem.index(st), cache_ptr, _block_ids(bt_row, start0, hi, BLOCK_N, BLOCK_SIZE, BTN), start0,
                   hi, 0, 512, BLOCK_N, BLOCK_SIZE, CPN)
        _copy_rows(kp_smem.index(st), cache_ptr, _block_ids(bt_row, start0, hi, BLOCK_N, BLOCK_SIZE, BTP), start0,
                   hi, 512, 64, BLOCK_N, BLOCK_SIZE, CPP)
        async_copy.commit_group()
    # the block ids of the tile to copy next are loaded one iteration ahead (off the copy's critical path)
    start_next = lo + (STAGES - 1) * BLOCK_N
    blk_n = _block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTN)
    blk_p = _block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTP)

    m_i = gl.full([16], float("-inf"), gl.float32, layout=ROWS)
    l_acc = gl.zeros([16, BLOCK_N], gl.float32, layout=MMA)  # running softmax sums per score slot (summed at the end)
    acc = gl.zeros([16, 512], gl.float32, layout=MMA)
    for i in range(0, num_tiles):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()  # tile i visible to all warps; every warp is done with iteration i - 1
        nxt = (i + STAGES - 1) % STAGES
        _copy_rows(kn_smem.index(nxt), cache_ptr, blk_n, start_next, hi, 0, 512, BLOCK_N, BLOCK_SIZE, CPN)
        _copy_rows(kp_smem.index(nxt), cache_ptr, blk_p, start_next, hi, 512, 64, BLOCK_N, BLOCK_SIZE, CPP)
        async_copy.commit_group()
        start_next = start_next + BLOCK_N
        blk_n = _block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTN)
        blk_p = _block_ids(bt_row, start_next, hi, BLOCK_N, BLOCK_SIZE, BTP)
        kn = kn_smem.index(i % STAGES)
        # scores: warp w's partial over its 128 latent + 16 rope dims
        s3 = _partial_scores(q_n, q_p, kn, kp_smem.index(i % STAGES), BLOCK_N, OPB3, MMA3)
        # the sum of the four partial tiles, each warp summing its quarter of the columns
        red_smem.store(s3)
        gl.thread_barrier()
        s = gl.convert_layout(gl.sum(red_smem.load(PARTS), axis=0), MMA, assert_trivial=True)
        # online softmax (base 2)
        n = lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=COLS)
        keep = gl.expand_dims(row_ok, 1) & gl.expand_dims(n < hi, 0) & (gl.expand_dims(n, 0) < gl.expand_dims(vis, 1))
        s = gl.where(keep, s * gl.expand_dims(qsc, 1), float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        pr = gl.exp2(s - gl.expand_dims(m_safe, 1))
        l_acc = l_acc * gl.expand_dims(alpha, 1) + pr
        m_i = m_new
        if gl.min(alpha, axis=0) < 1.0:  # a row's max grew: rescale (x 1.0 elsewhere would change nothing)
            acc = acc * gl.expand_dims(alpha, 1)
        p_smem.store(pr.to(gl.float16))
        gl.thread_barrier()
        pa = p_smem.load(OPA)
        # acc [16, 512 logical columns] += P · V; column n reads latent dim σ(n) (4 x 4 byte blocks per thread)
        v = kn.reshape([BLOCK_N, HI, LO, 4]).permute((0, 1, 3, 2)).reshape([BLOCK_N, 512]).load(VL)
        vb = gl.convert_layout(_swap_block_coords(_e4m3_block_to_f16_pairs(v), BLOCK_N, LO, HI), OPB)
        acc = mma_v2(pa, vb, acc)
    async_copy.wait_group(0)

    l_i = gl.sum(l_acc, axis=1)
    seen = l_i > 0
    inv = gl.where(seen, out_scale / gl.where(seen, l_i, 1.0), 0.0)
    o = acc * gl.expand_dims(inv, 1)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tok = (q_start + j).to(gl.int64)
    h = m_idx % H
    # the output in latent-dim order: a relabelling of the logical columns (σ), then one exchange through
    # shared memory so that each warp stores 512 contiguous bytes of a row per instruction (16-byte stores);
    # stored straight from the MMA layout, each 4-byte store touched a separate 32-byte sector
    OUT: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS // 4, 4], [1, 0])
    ORows: gl.constexpr = gl.SliceLayout(1, OUT)
    mo = pid_g * 16 + gl.arange(0, 16, layout=ORows)
    dcol = gl.expand_dims(gl.arange(0, 512, layout=gl.SliceLayout(0, OUT)), 0)
    ok_o = gl.expand_dims(mo < q_len * H, 1) & (dcol < 512)
    tok_o = (q_start + mo // H).to(gl.int64)
    if SPLIT:  # partials [T, H, S, 512] fp32 and [T, H, S]
        od = gl.convert_layout(_columns_to_latent_dims(o, LO, HI), OUT)
        prow = (tok_o * H + mo % H) * num_splits + pid_s
        gl.store(out_ptr + gl.expand_dims(prow, 1) * 512 + dcol, od, mask=ok_o & (hi > lo))  # none for an empty split
        gl.store(lse_ptr + (tok * H + h) * num_splits + pid_s, lse, mask=row_ok)
    else:
        od = gl.convert_layout(_columns_to_latent_dims(o.to(out_ptr.dtype.element_ty), LO, HI), OUT)
        optr = out_ptr + gl.expand_dims(tok_o * stride_ot + (mo % H) * stride_oh, 1) + dcol
        gl.store(optr, od, mask=ok_o)
        gl.store(lse_ptr + tok * H + h, lse, mask=row_ok)


def compile_stage1(target=None, *, block_n: int = 64, stages: int = 2, split: bool = True, has_vis: bool = False,
                   q_dtype: str = "bf16", block_size: int = 16, maxnreg: int | None = None, warps: int = 4):
    """Ahead-of-time compile of :func:`mla_decode_fp8_stage1` (no GPU needed; Triton's bundled ptxas) for
    ``target`` (default ``GPUTarget("cuda", 90, 32)``, an H100/H200; the kernel needs sm_89+), with the
    pointer and stride arguments marked 16-divisible as the JIT marks real tensors. ``q_dtype``: "bf16" or
    "fp16". ``warps``: 4 or 8 (8 only with ``block_n`` 64). Returns Triton's compiled kernel (``asm["ptx"]``, ``asm["cubin"]``, ``metadata.shared`` in bytes).
    Used by the CPU tests and ``benchmarks/mla_decode_sm90_report.py``. Raises ValueError for arguments the
    kernel does not take, and Triton's compilation errors (e.g. a failed bank-conflict static assert)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    target = target or GPUTarget("cuda", 90, 32)
    if q_dtype not in ("bf16", "fp16"):
        raise ValueError(f"q_dtype must be 'bf16' or 'fp16', got {q_dtype!r}")
    if block_n not in (32, 64) or stages < 2 or block_size < 1 or warps not in (4, 8) or (warps == 8 and block_n != 64):
        raise ValueError(f"block_n must be 32 or 64, stages >= 2, block_size >= 1 and warps 4 (or 8 with block_n 64), "
                         f"got {block_n}, {stages}, {block_size}, {warps}")
    if target.backend != "cuda" or int(target.arch) < 89:
        raise ValueError(f"the kernel needs a CUDA target of compute capability >= 8.9 (fp8 conversions), got {target}")
    sig = {"q_ptr": f"*{q_dtype}", "cache_ptr": "*u8", "bt_ptr": "*i32", "qsl_ptr": "*i32", "kvlen_ptr": "*i32",
           "vis_ptr": "*i32", "out_ptr": "*fp32" if split else f"*{q_dtype}", "lse_ptr": "*fp32", "H": "i32",
           "stride_bt": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32",
           "num_splits": "i32", "qk_scale": "fp32", "out_scale": "fp32"}
    const = dict(BLOCK_N=block_n, BLOCK_SIZE=block_size, STAGES=stages, HAS_VIS=has_vis, SPLIT=split, WARPS=warps)
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    div = ["q_ptr", "cache_ptr", "bt_ptr", "qsl_ptr", "kvlen_ptr", "vis_ptr", "out_ptr", "lse_ptr",
           "stride_qt", "stride_qh", "stride_ot", "stride_oh"]
    src = GluonASTSource(fn=mla_decode_fp8_stage1, signature=sig,
                         constexprs={(names.index(k),): v for k, v in const.items()},
                         attrs={(names.index(k),): [["tt.divisibility", 16]] for k in div})
    return triton.compile(src, target=target, options=dict(num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {})))
