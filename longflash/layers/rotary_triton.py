"""RoPE of queries and keys in one Triton launch; same signature and result as
:meth:`longflash.layers.rotary.RotaryEmbedding.rotate_qk_ref`.

The reference is ``cos_sin`` (cast, multiply, cos, sin, two scales, two casts) plus one ``rotate`` per
tensor (slices, four multiplies, two adds, a cat): about 15 launches per MLA layer, each launch-bound in a
decode step. Here one program takes one token and a block of heads of q or of k: it computes
``freqs = float(position) * inv_freq`` in fp32, ``cos = cos(freqs) * attention_factor`` and ``sin``
likewise, rounded to the input dtype exactly as ``cos_sin(positions, dtype)`` rounds them, then
``[x1·cos − x2·sin | x2·cos + x1·sin]`` in fp32, rounded once to the input dtype (the reference rounds
each product and each sum). x1/x2 are the halves (NeoX) or the even/odd elements (interleaved; the output
is then de-interleaved, like the reference). Formula: Su et al. 2021 (RoFormer) eq. 34; YaRN's
attention_factor: Peng et al. 2023.

On a GPU the cos/sin come from libdevice (``__nv_cosf``/``__nv_sinf``, full range reduction: the same
functions PyTorch's CUDA ``cos``/``sin`` use); the interpreter (no libdevice) uses ``tl.cos``/``tl.sin``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from longflash.ops.triton_env import interpreting


@triton.jit
def _rotate_heads(x_ptr, o_ptr, t, h0, n_heads, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Rotate heads h0 .. h0+BLOCK_H-1 of token t (cos/sin [BLOCK_HALF] fp32) from x into o."""
    heads = h0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    m = (heads < n_heads)[:, None] & (i < HALF)[None, :]
    row_x = x_ptr + t.to(tl.int64) * stride_xt + heads[:, None].to(tl.int64) * stride_xh
    if INTERLEAVE:
        x1 = tl.load(row_x + 2 * i[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(row_x + 2 * i[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(row_x + i[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(row_x + HALF + i[None, :], mask=m, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    row_o = o_ptr + t.to(tl.int64) * stride_ot + heads[:, None].to(tl.int64) * stride_oh
    dt = o_ptr.dtype.element_ty
    tl.store(row_o + i[None, :], (x1 * c - x2 * s).to(dt), mask=m)
    tl.store(row_o + HALF + i[None, :], (x2 * c + x1 * s).to(dt), mask=m)


@triton.jit
def _rotary_qk_kernel(pos_ptr, inv_freq_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, Hq, Hk, n_q_blocks,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                      attention_factor, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                      INTERLEAVE: tl.constexpr, LIBDEVICE: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    i = tl.arange(0, BLOCK_HALF)
    freqs = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=i < HALF, other=0.0)
    if LIBDEVICE:
        cos = libdevice.cos(freqs)
        sin = libdevice.sin(freqs)
    else:
        cos = tl.cos(freqs)
        sin = tl.sin(freqs)
    # the reference's table: cos(freqs) * attention_factor rounded to the input dtype
    dt = qo_ptr.dtype.element_ty
    cos = (cos * attention_factor).to(dt).to(tl.float32)
    sin = (sin * attention_factor).to(dt).to(tl.float32)
    if hb < n_q_blocks:
        _rotate_heads(q_ptr, qo_ptr, t, hb * BLOCK_H, Hq, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                      HALF, BLOCK_HALF, BLOCK_H, INTERLEAVE)
    else:
        _rotate_heads(k_ptr, ko_ptr, t, (hb - n_q_blocks) * BLOCK_H, Hk, stride_kt, stride_kh, stride_kot,
                      stride_koh, cos, sin, HALF, BLOCK_HALF, BLOCK_H, INTERLEAVE)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[T, rd] -> [T, 1, rd] view; [T, heads, rd] with a unit stride in the last dim (else a copy)."""
    x3 = x[:, None, :] if x.dim() == 2 else x
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def rotate_qk_triton(rotary, q: torch.Tensor | None, k: torch.Tensor | None, positions: torch.Tensor,
                     q_out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Triton version of :meth:`RotaryEmbedding.rotate_qk_ref` (same arguments, same result within one
    rounding of the output; see the module docstring). ``rotary`` is the ``RotaryEmbedding``.

    Args:
        q: [T, heads, rotary_dim] or [T, rotary_dim] (any strides with a unit last-dim stride, e.g. the
            q_pe slice of MLA's q), or None.
        k: the same for keys (MLA: [T, rotary_dim] k_pe; GQA: [T, kv_heads, rotary_dim]), or None.
        positions: [T] integer positions on the tensors' device.
        q_out: optional [q's shape] tensor of q's dtype, unit last-dim stride, receiving q_rot.
    Returns:
        (q_rot, k_rot): new contiguous tensors of q's and k's shapes and dtype (None for a None input;
        q_rot is ``q_out`` when given).
    Raises:
        ValueError (from ``RotaryEmbedding.check_qk``) for shapes, dtypes or devices that do not fit.
    """
    dtype = rotary.check_qk(q, k, positions, q_out)
    x_any = q if q is not None else k
    T = positions.shape[0]
    if q_out is None and q is not None:
        q_out = torch.empty(q.shape, dtype=dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=dtype, device=k.device) if k is not None else None
    if T == 0:
        return q_out, k_out
    q3 = _as_3d(q) if q is not None else None
    k3 = _as_3d(k) if k is not None else None
    qo3 = _as_3d(q_out) if q is not None else None
    ko3 = k_out.view(k3.shape) if k is not None else None
    Hq = q3.shape[1] if q is not None else 0
    Hk = k3.shape[1] if k is not None else 0
    half = rotary.rotary_dim // 2
    BLOCK_HALF = triton.next_power_of_2(half)
    BLOCK_H = max(1, min(triton.next_power_of_2(max(Hq, Hk)), 1024 // BLOCK_HALF))
    n_q_blocks = triton.cdiv(Hq, BLOCK_H)
    n_blocks = n_q_blocks + triton.cdiv(Hk, BLOCK_H)
    # a missing tensor's pointer and strides are never used (no program takes its branch)
    qa, qoa = (q3, qo3) if q is not None else (k3, ko3)
    ka, koa = (k3, ko3) if k is not None else (q3, qo3)
    interp = interpreting() or not x_any.is_cuda
    _rotary_qk_kernel[(T, n_blocks)](
        positions, rotary.inv_freq_on(positions.device), qa, ka, qoa, koa, Hq, Hk, n_q_blocks,
        qa.stride(0), qa.stride(1), ka.stride(0), ka.stride(1), qoa.stride(0), qoa.stride(1),
        koa.stride(0), koa.stride(1), float(rotary.attention_factor),
        HALF=half, BLOCK_HALF=BLOCK_HALF, BLOCK_H=BLOCK_H, INTERLEAVE=bool(rotary.interleave),
        LIBDEVICE=not interp, num_warps=4 if BLOCK_H * BLOCK_HALF >= 512 else 1)
    return q_out, k_out
