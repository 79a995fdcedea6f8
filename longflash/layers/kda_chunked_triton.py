"""Triton kernel of the chunked KDA form (prefill), same signature and result as
``longflash.layers.kda.kda_chunked`` (the reference; tests compare them under ``TRITON_INTERPRET=1`` and on
the GPU at 32 heads x 128).

One program per (value tile, head, sequence). The fp32 state tile S [dk, BV] stays in registers while the
program walks its sequence in blocks of BT tokens (``chunk_size``); inside a block the gated delta rule is the
WY/UT transform of the reference (``kda.py``, ``shared/specs/attnres_kimi.md``), with the cumulative log decay
G relative to the block start (G <= 0 and non-increasing for g <= 0):

    L_ij = beta_i <k_i, k_j e^{G_i - G_j}> (i > j),  T = (I + L)^-1 (forward substitution),
    u = T (beta v),  w = T (beta k e^G),  v' = u - w S,
    o = (q e^G) S + A v'  with A_ij = <q_i, k_j e^{G_i - G_j}> (j <= i),
    S <- e^{G_last} S + (k e^{G_last - G})^T v'.

Numerical stability of the per-channel decays: when every |G| of the block is at most ``SAFE_LOG_DECAY`` (84;
e^{+-84} is inside the normal fp32 range, whose limit is e^{+-87.3}), e^{G_i - G_j} is factored as
e^{G_i} e^{-G_j} and L, A are two dots on tensor cores; otherwise (strong decays) the block computes
e^{G_i - G_j} elementwise, column by column, exactly like the reference (no exp of a large positive number).
With Kimi-K3's gate (g >= -5) a 16-token block always takes the factored path (16 x 5 = 80).

Dots use ``input_precision="tf32x3"`` by default (about fp32 accuracy on tensor cores); varlen batches through
``cu_seqlens``. The next block's q/k/g/v/beta are loaded at the top of each iteration, before the current block's
math, so their latency overlaps it (the loop is a ``while``: ``range`` over a runtime bound fails in the
Triton interpreter with NumPy 2.4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longflash.layers.kda import check_cu_seqlens

KERNEL_CHUNK_SIZE = 16  # tokens per block; 16 keeps Kimi-K3 blocks on the factored path and the inverse short
SUPPORTED_CHUNK_SIZES = (16, 32, 64)
SAFE_LOG_DECAY = 84.0
DEFAULT_CONFIG = {"block_v": 32, "num_warps": 4, "input_precision": "tf32x3"}


@triton.jit
def _load_block(q_ptr, k_ptr, g_ptr, v_ptr, beta_ptr, t0, eos, h, H, DK, DV, r, ck, cv, mk, mv):
    tok = t0 + r
    mt = tok < eos
    kq_off = (tok * H + h)[:, None] * DK + ck[None, :]
    m2 = mt[:, None] & mk[None, :]
    q = tl.load(q_ptr + kq_off, mask=m2, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + kq_off, mask=m2, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + kq_off, mask=m2, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + (tok * H + h)[:, None] * DV + cv[None, :], mask=mt[:, None] & mv[None, :],
                other=0.0).to(tl.float32)
    b = tl.load(beta_ptr + tok * H + h, mask=mt, other=0.0).to(tl.float32)
    return q, k, g, v, b


@triton.jit
def _kda_chunked_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_in_ptr, o_ptr, s_out_ptr, cu_ptr, H, DK, DV,
                        scale, SAFE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        DOT_PREC: tl.constexpr):
    vb = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    bos = tl.load(cu_ptr + n).to(tl.int64)
    eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    r = tl.arange(0, BT)
    ck = tl.arange(0, BK)
    cv = vb * BV + tl.arange(0, BV)
    mk = ck < DK
    mv = cv < DV
    s_off = (n * H + h).to(tl.int64) * DK * DV + ck[:, None] * DV + cv[None, :]
    s_mask = mk[:, None] & mv[None, :]
    S = tl.load(s_in_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
    strict = r[:, None] > r[None, :]
    causal = r[:, None] >= r[None, :]
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    q, k, g, v, b = _load_block(q_ptr, k_ptr, g_ptr, v_ptr, beta_ptr, bos, eos, h, H, DK, DV, r, ck, cv, mk, mv)
    t0 = bos
    while t0 < eos:
        # NOTE: the next block's inputs are requested first (masked to zeros past eos), used next iteration.
        qn, kn, gn, vn_in, bn = _load_block(q_ptr, k_ptr, g_ptr, v_ptr, beta_ptr, t0 + BT, eos, h, H, DK, DV,
                                            r, ck, cv, mk, mv)
        q = q * scale
        G = tl.cumsum(g, axis=0)  # [BT, BK], relative to the block start; padded rows have g = 0
        G_last = tl.sum(tl.where(r[:, None] == BT - 1, G, 0.0), axis=0)  # [BK]
        eG = tl.exp(G)
        Qg = q * eG
        Kg = k * eG
        if tl.max(tl.max(tl.abs(G), axis=1), axis=0) <= SAFE:
            Kc = k * tl.exp(-G)  # <= e^SAFE
            Lm = tl.dot(Kg, tl.trans(Kc), input_precision=DOT_PREC)
            Aqk = tl.dot(Qg, tl.trans(Kc), input_precision=DOT_PREC)
            Kd = Kc * tl.exp(G_last)[None, :]
        else:
            Lm = tl.zeros([BT, BT], dtype=tl.float32)
            Aqk = tl.zeros([BT, BT], dtype=tl.float32)
            for j in range(BT):
                sel = r[:, None] == j
                kj = tl.sum(tl.where(sel, k, 0.0), axis=0)
                Gj = tl.sum(tl.where(sel, G, 0.0), axis=0)
                kdec = kj[None, :] * tl.exp(tl.where(r[:, None] >= j, G - Gj[None, :], float("-inf")))
                col = r[None, :] == j
                Lm = tl.where(col, tl.sum(k * kdec, axis=1)[:, None], Lm)
                Aqk = tl.where(col, tl.sum(q * kdec, axis=1)[:, None], Aqk)
            Kd = k * tl.exp(G_last[None, :] - G)
        Lm = tl.where(strict, Lm * b[:, None], 0.0)
        Aqk = tl.where(causal, Aqk, 0.0)
        # T = (I + L)^-1: row i of T is e_i - sum_{j<i} L_ij T_j (rows j < i are final; L_ij = 0 for j >= i)
        Tm = eye
        for i in range(1, BT):
            li = tl.sum(tl.where(r[:, None] == i, Lm, 0.0), axis=0)
            Tm = tl.where(r[:, None] == i, Tm - tl.sum(li[:, None] * Tm, axis=0)[None, :], Tm)
        u = tl.dot(Tm, v * b[:, None], input_precision=DOT_PREC)
        w = tl.dot(Tm, Kg * b[:, None], input_precision=DOT_PREC)
        vnew = u - tl.dot(w, S, input_precision=DOT_PREC)
        o = tl.dot(Qg, S, input_precision=DOT_PREC) + tl.dot(Aqk, vnew, input_precision=DOT_PREC)
        tok = t0 + r
        tl.store(o_ptr + (tok * H + h)[:, None] * DV + cv[None, :], o, mask=(tok < eos)[:, None] & mv[None, :])
        S = S * tl.exp(G_last)[:, None] + tl.dot(tl.trans(Kd), vnew, input_precision=DOT_PREC)
        q, k, g, v, b = qn, kn, gn, vn_in, bn
        t0 += BT
    tl.store(s_out_ptr + s_off, S, mask=s_mask)


def kda_chunked_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, scale: float, chunk_size: int | None = None,
                       cu_seqlens: torch.Tensor | list[int] | None = None,
                       config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA on the GPU; same contract as ``kda_chunked``.

    Args:
        q, k: [T, H, dk] (L2-normalised). v: [T, H, dv]. g: [T, H, dk] log decay. beta: [T, H]. Any float dtype
            (computed in fp32).
        state: [H, dk, dv], or [N, H, dk, dv] with ``cu_seqlens`` (not modified).
        scale: multiplies q (1/sqrt(dk)).
        chunk_size: tokens per kernel block, one of 16, 32, 64 (None: ``KERNEL_CHUNK_SIZE``); the result does
            not depend on it (as in the reference).
        cu_seqlens: None (one sequence) or N+1 offsets into T (0 first, T last, non-decreasing).
        config: overrides of ``DEFAULT_CONFIG`` (``block_v``: dv per program, a power of two >= 16;
            ``num_warps``; ``input_precision``: "tf32x3", "tf32" or "ieee").
    Returns:
        (o [T, H, dv] fp32, final state(s) fp32 with ``state``'s shape).
    Raises:
        ValueError for inconsistent shapes, bad ``cu_seqlens`` or an unsupported chunk size / config.
    """
    T, H, dk = k.shape
    dv = v.shape[-1]
    if q.shape != k.shape or g.shape != k.shape or v.shape[:2] != (T, H) or beta.shape != (T, H):
        raise ValueError(f"kda_chunked_triton: inconsistent shapes q {list(q.shape)} k {list(k.shape)} "
                         f"v {list(v.shape)} g {list(g.shape)} beta {list(beta.shape)}")
    cu = check_cu_seqlens(cu_seqlens, T, state, H, dk, dv, "kda_chunked_triton")
    BT = KERNEL_CHUNK_SIZE if chunk_size is None else chunk_size
    if BT not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"kda_chunked_triton: chunk_size {chunk_size} not supported; use one of {SUPPORTED_CHUNK_SIZES}")
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    bv = cfg["block_v"]
    if set(cfg) != set(DEFAULT_CONFIG) or not isinstance(bv, int) or bv < 16 or bv & (bv - 1) \
            or cfg["input_precision"] not in ("tf32x3", "tf32", "ieee"):
        raise ValueError(f"kda_chunked_triton: bad config {config} (keys {sorted(DEFAULT_CONFIG)}; block_v a power "
                         f"of two >= 16; input_precision tf32x3, tf32 or ieee)")
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    s_in = state.float().contiguous()
    o = torch.empty(T, H, dv, dtype=torch.float32, device=k.device)
    s_out = torch.empty_like(s_in)
    N = cu.numel() - 1
    if T == 0 or N == 0:
        s_out.copy_(s_in)
        return o, s_out
    BK = max(16, triton.next_power_of_2(dk))
    BV = min(bv, max(16, triton.next_power_of_2(dv)))
    _kda_chunked_kernel[(triton.cdiv(dv, BV), H, N)](
        q, k, v, g, beta, s_in, o, s_out, cu.to(device=k.device, dtype=torch.int32), H, dk, dv, float(scale),
        SAFE=SAFE_LOG_DECAY, BT=BT, BK=BK, BV=BV, DOT_PREC=cfg["input_precision"], num_warps=cfg["num_warps"])
    return o, s_out
