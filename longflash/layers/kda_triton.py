"""Triton kernel of the recurrent KDA form (decode / speculative verify), same signature and result as
``longflash.layers.kda.kda_recurrent`` (the reference; tests compare them under ``TRITON_INTERPRET=1``).

One program per (head, dv block): the state tile [dk, BV] stays in registers (fp32) while the program
walks the T tokens in order, so the state is read and written once per call and q/k/v/g/beta once per
token: bytes ≈ 2·H·dk·dv·4 + T·H·(3dk + dv + 1)·4 — the decode roofline of KDA is the state traffic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kda_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_in_ptr, o_ptr, s_out_ptr, T, H, DK, DV, scale,
                          BK: tl.constexpr, BV: tl.constexpr):
    h = tl.program_id(0)
    vb = tl.program_id(1)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk = ok < DK
    mv = ov < DV
    s_off = h * DK * DV + ok[:, None] * DV + ov[None, :]
    s_mask = mk[:, None] & mv[None, :]
    S = tl.load(s_in_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
    t = 0
    while t < T:  # NOTE: a while loop; range(T) over a runtime int fails in the interpreter with NumPy 2.4
        kb = (t * H + h) * DK
        qt = tl.load(q_ptr + kb + ok, mask=mk, other=0.0).to(tl.float32) * scale
        kt = tl.load(k_ptr + kb + ok, mask=mk, other=0.0).to(tl.float32)
        gt = tl.load(g_ptr + kb + ok, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + (t * H + h) * DV + ov, mask=mv, other=0.0).to(tl.float32)
        bt = tl.load(beta_ptr + t * H + h).to(tl.float32)
        S = S * tl.exp(gt)[:, None]
        kv_mem = tl.sum(S * kt[:, None], axis=0)
        delta = (vt - kv_mem) * bt
        S = S + kt[:, None] * delta[None, :]
        o = tl.sum(S * qt[:, None], axis=0)
        tl.store(o_ptr + (t * H + h) * DV + ov, o, mask=mv)
        t += 1
    tl.store(s_out_ptr + s_off, S, mask=s_mask)


def kda_recurrent_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kda_recurrent``: q, k [T, H, dk] (L2-normalised), v [T, H, dv], g [T, H, dk],
    beta [T, H], state [H, dk, dv] (not modified) -> (o [T, H, dv] fp32, final state [H, dk, dv] fp32).
    T may be 0. Raises ValueError for mismatched shapes."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    if q.shape != k.shape or g.shape != k.shape or v.shape[:2] != (T, H) or beta.shape != (T, H) \
            or state.shape != (H, dk, dv):
        raise ValueError(f"kda_recurrent_triton: inconsistent shapes q {list(q.shape)} k {list(k.shape)} "
                         f"v {list(v.shape)} g {list(g.shape)} beta {list(beta.shape)} state {list(state.shape)}")
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    s_in = state.float().contiguous()
    o = torch.empty(T, H, dv, dtype=torch.float32, device=k.device)
    s_out = torch.empty_like(s_in)
    BK = triton.next_power_of_2(dk)
    BV = min(triton.next_power_of_2(dv), 32)
    _kda_recurrent_kernel[(H, triton.cdiv(dv, BV))](q, k, v, g, beta, s_in, o, s_out, T, H, dk, dv, float(scale),
                                                   BK=BK, BV=BV)
    return o, s_out
