"""Stream-K split of paged MLA decode attention: the schedule, its stage 2 (merge of the partials) and the
choice between it and the per-request split.

Why: the per-request split runs ``batch · head_groups · S`` programs. On an H200 (132 SMs, two programs of
the fp8 wgmma stage 1 per SM: 264 slots) every benchmark-1 shape gets 256 programs, so 4 SMs idle for the
whole call (``benchmarks/NOTES.md``, session 29). Stream-K (Osama et al., "Stream-K: Work-centric Parallel
Decomposition for Dense Matrix-Matrix Multiplication on the GPU", 2023) fills every slot: the work units
(request b, head-group g), u = b · num_groups + g, each ``cdiv(kv_len_b, 64)`` tiles of 64 cache rows (0
for a group past the request's query rows), are laid end to end, and program p of P takes the whole tiles
``[p · tpp, min((p + 1) · tpp, total))``, ``tpp = cdiv(total, P)``. Where its run crosses a unit boundary
it writes one partial per unit. The segment (p, u) goes to slot ``p + u``: each segment after the first
starts at a program boundary or a unit boundary, so the slots are distinct and fewer than ``P + U``, and
unit u's partials are the consecutive slots ``first_u + u .. last_u + u`` with ``first_u = start_u // tpp``
and ``last_u = (start_u + tiles_u - 1) // tpp`` — no table: stage 1 and stage 2 both derive the schedule
on the device from ``query_start_loc`` and ``seq_lens`` (so it follows the real lengths inside a CUDA
graph whose grid was fixed at capture).

Stage 1 is the sm_90 wgmma fp8 kernel (:func:`gluon_mla_decode_wgmma.mla_decode_fp8_wgmma_stage1`,
``STREAM_K``); :func:`stream_k_segments` is the schedule's reference, :func:`merge_stream_k_reference`
the merge's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ROWS = 64  # cache rows per stream-K tile (the wgmma stage 1's BLOCK_N)
GROUP_ROWS = 16  # query rows per head-group (the stage 1's N side)


def unit_tiles(q_lens: list[int], kv_lens: list[int], heads: int, num_groups: int) -> list[int]:
    """Tiles of each unit u = b · num_groups + g: ``cdiv(kv_lens[b], 64)`` when head-group g has query rows
    (``16 g < q_lens[b] · heads``), else 0. Lists of ints; raises ValueError on different lengths."""
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"q_lens ({len(q_lens)}) and kv_lens ({len(kv_lens)}) must have one entry per request")
    return [triton.cdiv(kv, TILE_ROWS) if GROUP_ROWS * g < ql * heads else 0
            for ql, kv in zip(q_lens, kv_lens) for g in range(num_groups)]


def stream_k_segments(tiles: list[int], num_programs: int) -> list[tuple[int, int, int, int, int]]:
    """The stream-K schedule of units with ``tiles[u]`` tiles over ``num_programs`` programs: a list of
    segments ``(program, unit, first tile, end tile, slot)`` (tiles relative to the unit, end exclusive,
    slot = program + unit), in program order. Raises ValueError for num_programs < 1 or a negative count."""
    if num_programs < 1 or any(t < 0 for t in tiles):
        raise ValueError(f"need num_programs >= 1 and tile counts >= 0, got {num_programs}, {tiles}")
    total = sum(tiles)
    tpp = triton.cdiv(total, num_programs)
    starts = [sum(tiles[:u]) for u in range(len(tiles))]
    segs = []
    for p in range(num_programs):
        t0, t1 = p * tpp, min((p + 1) * tpp, total)
        for u, (s, n) in enumerate(zip(starts, tiles)):
            lo, hi = max(t0, s), min(t1, s + n)
            if lo < hi:
                segs.append((p, u, lo - s, hi - s, p + u))
    return segs


def merge_stream_k_reference(part: torch.Tensor, plse: torch.Tensor, q_lens: list[int], kv_lens: list[int],
                             heads: int, num_groups: int, num_programs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`merge_stream_k` (same arguments, lengths as lists): ``out`` [T, H, R]
    fp32 and ``lse`` [T, H] fp32 (natural log; 0 and −inf for a row whose unit has no tiles)."""
    T, R = sum(q_lens), part.shape[-1]
    out = torch.zeros(T, heads, R, dtype=torch.float32)
    lse = torch.full((T, heads), float("-inf"))
    segs = stream_k_segments(unit_tiles(q_lens, kv_lens, heads, num_groups), num_programs)
    q_start = [sum(q_lens[:b]) for b in range(len(q_lens))]
    for b, ql in enumerate(q_lens):
        for mq in range(ql * heads):
            u, r = b * num_groups + mq // GROUP_ROWS, mq % GROUP_ROWS
            slots = [s[4] for s in segs if s[1] == u]
            if not slots:
                continue
            ls = plse[slots, r].float()
            ls = torch.where(ls == float("inf"), float("-inf"), ls)
            m = ls.max()
            if m == float("-inf"):
                continue
            w = torch.exp(ls - m)
            tot = w.sum()
            keep = w > 0
            tok, h = q_start[b] + mq // heads, mq % heads
            out[tok, h] = (part[slots, r].float()[keep] * (w[keep] / tot)[:, None]).sum(0)
            lse[tok, h] = torch.log(tot) + m
    return out, lse


@triton.jit
def _merge_stream_k(part_ptr, plse_ptr, out_ptr, lse_ptr, qsl_ptr, kvlen_ptr, batch, num_groups, H, num_programs,
                    stride_ot, stride_oh, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_U: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)  # = u * 16 + r
    u = pid // 16
    r = pid % 16
    b = u // num_groups
    g = u - b * num_groups
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    mq = g * 16 + r
    if mq < q_len * H:
        # the schedule of stage 1 (every unit's tiles, their prefix sum, tiles per program)
        uu = tl.arange(0, BLOCK_U)
        bb = uu // num_groups
        ok = bb < batch
        ql = tl.load(qsl_ptr + bb + 1, mask=ok, other=0) - tl.load(qsl_ptr + bb, mask=ok, other=0)
        kv = tl.load(kvlen_ptr + bb, mask=ok, other=0)
        tiles = tl.where(ok & ((uu - bb * num_groups) * 16 < ql * H), tl.cdiv(kv, 64), 0)
        tpp = tl.maximum(tl.cdiv(tl.sum(tiles, axis=0), num_programs), 1)
        start_u = tl.sum(tl.where(uu < u, tiles, 0), axis=0)
        n_u = tl.sum(tl.where(uu == u, tiles, 0), axis=0)
        slot0 = start_u // tpp + u
        n_slots = tl.where(n_u > 0, (start_u + n_u - 1) // tpp + u - slot0 + 1, 0)
        s = tl.arange(0, BLOCK_S)
        m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), axis=0)
        s0 = 0
        while s0 < n_slots:  # (while: a range over a reduced count fails in the interpreter, Triton 3.6)
            ls = tl.load(plse_ptr + (slot0 + s0 + s).to(tl.int64) * 16 + r, mask=s0 + s < n_slots,
                         other=float("-inf"))
            m = tl.maximum(m, tl.max(tl.where(ls == float("inf"), float("-inf"), ls), axis=0))
            s0 += BLOCK_S
        empty = m == float("-inf")
        m_safe = tl.where(empty, 0.0, m)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < R
        acc = tl.zeros([BLOCK_C], tl.float32)
        tot = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
        s0 = 0
        while s0 < n_slots:
            sm = s0 + s < n_slots
            row = (slot0 + s0 + s).to(tl.int64) * 16 + r
            ls = tl.load(plse_ptr + row, mask=sm, other=float("-inf"))
            ls = tl.where(ls == float("inf"), float("-inf"), ls)
            w = tl.exp(ls - m_safe)  # exactly 0 for a segment the row sees nothing of
            tot += tl.sum(w, axis=0)
            parts = tl.load(part_ptr + row[:, None] * BLOCK_R + c[None, :], mask=(sm & (w > 0))[:, None] & cm[None, :],
                            other=0.0)
            acc += tl.sum(parts * w[:, None], axis=0)
            s0 += BLOCK_S
        o = acc / tl.where(empty, 1.0, tot)
        tok = (q_start + mq // H).to(tl.int64)
        h = mq % H
        tl.store(out_ptr + tok * stride_ot + h * stride_oh + c, o.to(out_ptr.dtype.element_ty), mask=cm)
        if tl.program_id(1) == 0:
            tl.store(lse_ptr + tok * H + h, tl.where(empty, float("-inf"), tl.log(tl.where(empty, 1.0, tot)) + m_safe))


def block_u(num_units: int) -> int:
    """The power of two >= max(64, num_units) that the kernels' unit vectors span (few compiled variants)."""
    return max(64, triton.next_power_of_2(num_units))


def merge_stream_k(part: torch.Tensor, plse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, heads: int, num_groups: int,
                   num_programs: int) -> None:
    """Stage 2 of the stream-K split: merges each query row's partials by their LSE into ``out``.

    Args:
        part: [>= num_programs + U, 16, BLOCK_R] fp32 partials (slot, row of the head-group, latent dim),
            U = batch · num_groups; plse: [>= num_programs + U, 16] fp32, their natural-log LSEs.
        out: [T, H, R] (written, its dtype), lse: [T, H] fp32 (written; −inf and output 0 for a row that
            sees no cache row).
        query_start_loc: [batch + 1] int32, seq_lens: [batch] int32 (device; the lengths stage 1 ran with).
        heads, num_groups: H and the head-groups of 16 query rows per request; num_programs: stage 1's P.
    Raises ValueError on shapes that disagree. No host sync (CUDA-graph safe).
    """
    T, H, R = out.shape
    batch = seq_lens.numel()
    U = batch * num_groups
    if H != heads or part.dim() != 3 or part.shape[0] < num_programs + U or part.shape[1] != GROUP_ROWS \
            or part.shape[2] < R or plse.shape[0] < num_programs + U or query_start_loc.numel() != batch + 1:
        raise ValueError(f"stream-K merge: part {tuple(part.shape)}, plse {tuple(plse.shape)}, out {tuple(out.shape)},"
                         f" {batch} requests x {num_groups} groups, {num_programs} programs disagree")
    if U == 0 or T == 0:
        return
    BLOCK_S = 16
    BLOCK_C = min(part.shape[2], 256)
    _merge_stream_k[(U * GROUP_ROWS, triton.cdiv(R, BLOCK_C))](
        part, plse, out, lse, query_start_loc, seq_lens, batch, num_groups, H, num_programs, out.stride(0),
        out.stride(1), R=R, BLOCK_R=part.shape[2], BLOCK_U=block_u(U), BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, num_warps=4)


def stream_k_time(batch: int, head_groups: int, max_kv_len: int, query_rows: int, kv_lora_rank: int, width: int,
                  row_bytes: int, slots: int) -> float:
    """Modelled seconds of a stream-K call at ``max_kv_len`` rows per request, in the units of
    :func:`triton_mla_decode.choose_num_splits`' model: ``base / eff + partial``, eff = total tiles /
    ((tpp + 1) · slots) (one tile's time added per program for its second segment's start), partial = the
    ``2 · (slots + U) · 16 · (kv_lora_rank + 1) · 4`` bytes written and read at the nominal bandwidth."""
    from longflash.attention.triton_mla_decode import NOMINAL_BW, NOMINAL_FLOPS
    total = batch * head_groups * triton.cdiv(max_kv_len, TILE_ROWS)
    if total == 0:
        return 0.0
    base = max(batch * max_kv_len * row_bytes / NOMINAL_BW,
               2.0 * batch * query_rows * max_kv_len * (width + kv_lora_rank) / NOMINAL_FLOPS)
    eff = total / ((triton.cdiv(total, slots) + 1) * slots)
    return base / eff + 2.0 * (slots + batch * head_groups) * GROUP_ROWS * (kv_lora_rank + 1) * 4 / NOMINAL_BW
