"""Triton kernel of the chunked KDA form (prefill), same signature and result as
``longflash.layers.kda.kda_chunked`` (the reference; tests compare them under ``TRITON_INTERPRET=1`` and on
the GPU at 32 heads x 128).

One program per (value tile, head, sequence). The fp32 state tile S [dk, BV] stays in registers while the
program walks its sequence in blocks of BT tokens (``chunk_size``, default 16); inside a block the gated delta
rule is the WY/UT transform of the reference (``kda.py``, ``shared/specs/attnres_kimi.md``), with the cumulative
log decay G relative to the block start (G <= 0 and non-increasing for g <= 0):

    L_ij = beta_i <k_i, k_j e^{G_i - G_j}> (i > j),  T = (I + L)^-1,
    u = T (beta v),  w = T (beta k e^G),  v' = u - w S,
    o = (q e^G) S + A v'  with A_ij = <q_i, k_j e^{G_i - G_j}> (j <= i),
    S <- e^{G_last} S + (k e^{G_last - G})^T v'.

T comes from recursive block inversion (log2(BT) levels of two small dots; each level only multiplies exact
inverses of smaller diagonal blocks, unlike a Neumann/doubling series, whose powers of L blow up for
near-parallel keys). The channel dimension is handled as four slices of KS = dk/4 (S as four [KS, BV] tiles):
every dot's operands stay small, which keeps the fp32 working set in registers (no spills at BV 64, 8 warps on
sm_90, checked with ptxas).

Numerical stability of the per-channel decays: when every |G| of the block is at most ``SAFE_LOG_DECAY`` (84;
e^{+-84} is inside the normal fp32 range, whose limit is e^{+-87.3}), e^{G_i - G_j} is factored as
e^{G_i} e^{-G_j} and L, A are dots on tensor cores; otherwise (strong decays) the block computes
e^{G_i - G_j} elementwise, column by column, exactly like the reference (no exp of a large positive number).
With Kimi-K3's gate (g >= -5) a 16-token block always takes the factored path (16 x 5 = 80).
k e^{G_last - G} uses the reference's formula (exponent <= 0).

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

KERNEL_CHUNK_SIZE = 16  # tokens per block: Kimi-K3 blocks always factored, small register working set
SUPPORTED_CHUNK_SIZES = (16, 32, 64)
SAFE_LOG_DECAY = 84.0
DEFAULT_CONFIG = {"block_v": 64, "num_warps": 8, "input_precision": "tf32x3"}  # fewest spills on sm_90


@triton.jit
def _load_qkg(q_ptr, k_ptr, g_ptr, tok, mt, h, H, DK, c):
    """[BT, KS] tiles of q, k, g: tokens ``tok`` (valid where ``mt``), head h, channels ``c``."""
    off = (tok * H + h)[:, None] * DK + c[None, :]
    m2 = mt[:, None] & (c < DK)[None, :]
    return (tl.load(q_ptr + off, mask=m2, other=0.0).to(tl.float32),
            tl.load(k_ptr + off, mask=m2, other=0.0).to(tl.float32),
            tl.load(g_ptr + off, mask=m2, other=0.0).to(tl.float32))


@triton.jit
def _load_vb(v_ptr, beta_ptr, tok, mt, h, H, DV, cv):
    v = tl.load(v_ptr + (tok * H + h)[:, None] * DV + cv[None, :], mask=mt[:, None] & (cv < DV)[None, :],
                other=0.0).to(tl.float32)
    return v, tl.load(beta_ptr + tok * H + h, mask=mt, other=0.0).to(tl.float32)


@triton.jit
def _factored(Lm, Aqk, q, k, G, eG, DOT_PREC: tl.constexpr):
    """One channel slice of L and A with e^{G_i - G_j} = e^{G_i} e^{-G_j} (only when |G| <= SAFE)."""
    kc = tl.trans(k * tl.exp(-G))
    Lm = tl.dot(k * eG, kc, Lm, input_precision=DOT_PREC)
    return Lm, tl.dot(q * eG, kc, Aqk, input_precision=DOT_PREC)


@triton.jit
def _elementwise(Lm, Aqk, q, k, G, j, r):
    """One channel slice of column j of L and A with e^{G_i - G_j} computed directly (as the reference)."""
    sel = r[:, None] == j
    kj = tl.sum(tl.where(sel, k, 0.0), axis=0)
    Gj = tl.sum(tl.where(sel, G, 0.0), axis=0)
    kdec = kj[None, :] * tl.exp(tl.where(r[:, None] >= j, G - Gj[None, :], float("-inf")))
    col = r[None, :] == j
    Lm = tl.where(col, Lm + tl.sum(k * kdec, axis=1)[:, None], Lm)
    return Lm, tl.where(col, Aqk + tl.sum(q * kdec, axis=1)[:, None], Aqk)


@triton.jit
def _read_state(Tm, q, k, eG, b, S, vnew, o, DOT_PREC: tl.constexpr):
    """One channel slice: v' -= (T (beta k e^G)) S,  o += (q e^G) S."""
    w = tl.dot(Tm, k * eG * b[:, None], input_precision=DOT_PREC)
    vnew -= tl.dot(w, S, input_precision=DOT_PREC)
    return vnew, tl.dot(q * eG, S, o, input_precision=DOT_PREC)


@triton.jit
def _write_state(S, k, G, vnew, r, BT: tl.constexpr, DOT_PREC: tl.constexpr):
    """One channel slice: S <- e^{G_last} S + (k e^{G_last - G})^T v'."""
    G_last = tl.sum(tl.where(r[:, None] == BT - 1, G, 0.0), axis=0)
    kd = k * tl.exp(G_last[None, :] - G)
    return S * tl.exp(G_last)[:, None] + tl.dot(tl.trans(kd), vnew, input_precision=DOT_PREC)


@triton.jit
def _absmax(G):
    return tl.max(tl.max(tl.abs(G), axis=1), axis=0)


@triton.jit
def _kda_chunked_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_in_ptr, o_ptr, s_out_ptr, cu_ptr, H, DK, DV,
                        scale, SAFE: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr, KS: tl.constexpr,
                        BV: tl.constexpr, DOT_PREC: tl.constexpr):
    vb = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    bos = tl.load(cu_ptr + n).to(tl.int64)
    eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    r = tl.arange(0, BT)
    c0 = tl.arange(0, KS)
    c1 = KS + c0
    c2 = 2 * KS + c0
    c3 = 3 * KS + c0
    cv = vb * BV + tl.arange(0, BV)
    mv = cv < DV
    # the state as four row slices [KS, BV] (channel slices keep every dot's operands small: no spills)
    s_base = s_in_ptr + (n * H + h).to(tl.int64) * DK * DV
    S0 = tl.load(s_base + c0[:, None] * DV + cv[None, :], mask=(c0 < DK)[:, None] & mv[None, :], other=0.0)
    S1 = tl.load(s_base + c1[:, None] * DV + cv[None, :], mask=(c1 < DK)[:, None] & mv[None, :], other=0.0)
    S2 = tl.load(s_base + c2[:, None] * DV + cv[None, :], mask=(c2 < DK)[:, None] & mv[None, :], other=0.0)
    S3 = tl.load(s_base + c3[:, None] * DV + cv[None, :], mask=(c3 < DK)[:, None] & mv[None, :], other=0.0)
    strict = r[:, None] > r[None, :]
    causal = r[:, None] >= r[None, :]
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    tok = bos + r
    q0, k0, g0 = _load_qkg(q_ptr, k_ptr, g_ptr, tok, tok < eos, h, H, DK, c0)
    q1, k1, g1 = _load_qkg(q_ptr, k_ptr, g_ptr, tok, tok < eos, h, H, DK, c1)
    q2, k2, g2 = _load_qkg(q_ptr, k_ptr, g_ptr, tok, tok < eos, h, H, DK, c2)
    q3, k3, g3 = _load_qkg(q_ptr, k_ptr, g_ptr, tok, tok < eos, h, H, DK, c3)
    v, b = _load_vb(v_ptr, beta_ptr, tok, tok < eos, h, H, DV, cv)
    t0 = bos
    while t0 < eos:
        # NOTE: the next block's inputs are requested first (masked to zeros past eos), used next iteration.
        nt = t0 + BT + r
        nq0, nk0, ng0 = _load_qkg(q_ptr, k_ptr, g_ptr, nt, nt < eos, h, H, DK, c0)
        nq1, nk1, ng1 = _load_qkg(q_ptr, k_ptr, g_ptr, nt, nt < eos, h, H, DK, c1)
        nq2, nk2, ng2 = _load_qkg(q_ptr, k_ptr, g_ptr, nt, nt < eos, h, H, DK, c2)
        nq3, nk3, ng3 = _load_qkg(q_ptr, k_ptr, g_ptr, nt, nt < eos, h, H, DK, c3)
        nv, nb = _load_vb(v_ptr, beta_ptr, nt, nt < eos, h, H, DV, cv)
        q0, q1, q2, q3 = q0 * scale, q1 * scale, q2 * scale, q3 * scale
        # cumulative log decay from the block start; padded rows have g = 0
        G0 = tl.cumsum(g0, axis=0)
        G1 = tl.cumsum(g1, axis=0)
        G2 = tl.cumsum(g2, axis=0)
        G3 = tl.cumsum(g3, axis=0)
        e0, e1, e2, e3 = tl.exp(G0), tl.exp(G1), tl.exp(G2), tl.exp(G3)
        Lm = tl.zeros([BT, BT], dtype=tl.float32)
        Aqk = tl.zeros([BT, BT], dtype=tl.float32)
        if tl.maximum(tl.maximum(_absmax(G0), _absmax(G1)), tl.maximum(_absmax(G2), _absmax(G3))) <= SAFE:
            Lm, Aqk = _factored(Lm, Aqk, q0, k0, G0, e0, DOT_PREC)
            Lm, Aqk = _factored(Lm, Aqk, q1, k1, G1, e1, DOT_PREC)
            Lm, Aqk = _factored(Lm, Aqk, q2, k2, G2, e2, DOT_PREC)
            Lm, Aqk = _factored(Lm, Aqk, q3, k3, G3, e3, DOT_PREC)
        else:
            for j in range(BT):
                Lm, Aqk = _elementwise(Lm, Aqk, q0, k0, G0, j, r)
                Lm, Aqk = _elementwise(Lm, Aqk, q1, k1, G1, j, r)
                Lm, Aqk = _elementwise(Lm, Aqk, q2, k2, G2, j, r)
                Lm, Aqk = _elementwise(Lm, Aqk, q3, k3, G3, j, r)
        Lm = tl.where(strict, Lm * b[:, None], 0.0)
        Aqk = tl.where(causal, Aqk, 0.0)
        # T = (I + L)^-1 by recursive block inversion: Tm holds the inverse of I + L restricted to its diagonal
        # blocks of size s; the blocks of size 2s are [[X1, 0], [C, X2]] -> [[X1^-1, 0], [-X2^-1 C X1^-1, X2^-1]],
        # i.e. Tm <- Tm - Tm Lc Tm with Lc the lower-left s x s block of each 2s block (log2(BT) levels of dots).
        Tm = eye
        for lvl in tl.static_range(LOG2_BT):
            blk = 1 << lvl
            Lc = tl.where((r[:, None] // (2 * blk) == r[None, :] // (2 * blk)) & (r[:, None] // blk != r[None, :] // blk),
                          Lm, 0.0)
            Tm = Tm - tl.dot(tl.dot(Tm, Lc, input_precision=DOT_PREC), Tm, input_precision=DOT_PREC)
        vnew = tl.dot(Tm, v * b[:, None], input_precision=DOT_PREC)  # u = T (beta v)
        o = tl.zeros([BT, BV], dtype=tl.float32)
        vnew, o = _read_state(Tm, q0, k0, e0, b, S0, vnew, o, DOT_PREC)
        vnew, o = _read_state(Tm, q1, k1, e1, b, S1, vnew, o, DOT_PREC)
        vnew, o = _read_state(Tm, q2, k2, e2, b, S2, vnew, o, DOT_PREC)
        vnew, o = _read_state(Tm, q3, k3, e3, b, S3, vnew, o, DOT_PREC)
        o = tl.dot(Aqk, vnew, o, input_precision=DOT_PREC)
        tok = t0 + r
        tl.store(o_ptr + (tok * H + h)[:, None] * DV + cv[None, :], o, mask=(tok < eos)[:, None] & mv[None, :])
        S0 = _write_state(S0, k0, G0, vnew, r, BT, DOT_PREC)
        S1 = _write_state(S1, k1, G1, vnew, r, BT, DOT_PREC)
        S2 = _write_state(S2, k2, G2, vnew, r, BT, DOT_PREC)
        S3 = _write_state(S3, k3, G3, vnew, r, BT, DOT_PREC)
        q0, k0, g0, q1, k1, g1, q2, k2, g2, q3, k3, g3 = nq0, nk0, ng0, nq1, nk1, ng1, nq2, nk2, ng2, nq3, nk3, ng3
        v, b = nv, nb
        t0 += BT
    s_base = s_out_ptr + (n * H + h).to(tl.int64) * DK * DV
    tl.store(s_base + c0[:, None] * DV + cv[None, :], S0, mask=(c0 < DK)[:, None] & mv[None, :])
    tl.store(s_base + c1[:, None] * DV + cv[None, :], S1, mask=(c1 < DK)[:, None] & mv[None, :])
    tl.store(s_base + c2[:, None] * DV + cv[None, :], S2, mask=(c2 < DK)[:, None] & mv[None, :])
    tl.store(s_base + c3[:, None] * DV + cv[None, :], S3, mask=(c3 < DK)[:, None] & mv[None, :])


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
    if T == 0:
        s_out.copy_(s_in)
        return o, s_out
    KS = max(16, triton.next_power_of_2(triton.cdiv(dk, 4)))  # channel slice: four slices cover dk
    BV = min(bv, max(16, triton.next_power_of_2(dv)))
    _kda_chunked_kernel[(triton.cdiv(dv, BV), H, cu.numel() - 1)](
        q, k, v, g, beta, s_in, o, s_out, cu.to(device=k.device, dtype=torch.int32), H, dk, dv, float(scale),
        SAFE=SAFE_LOG_DECAY, BT=BT, LOG2_BT=BT.bit_length() - 1, KS=KS, BV=BV, DOT_PREC=cfg["input_precision"],
        num_warps=cfg["num_warps"])
    return o, s_out
