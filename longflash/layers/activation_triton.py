"""SwiGLU and SiTU gate-times-up in one Triton launch; same signatures and results (within one rounding)
as :func:`longflash.layers.activation.silu_and_mul` and :func:`~longflash.layers.activation.situ_and_mul`.

The references are 2 (SwiGLU) and ~8 (SiTU: divide, tanh, multiply, sigmoid, multiply, divide, tanh,
multiply, multiply) launches per call, each rounding to the activation dtype; a decode step calls them
once per MLP and per MoE expert group. Here one program reads a tile of gate and up (rows may be strided
views, e.g. the two halves of a fused gate_up GEMM output [T, 2I]), computes the reference's formula in
fp32 in the reference's operation order, and rounds once to the output dtype.

Formulas: SwiGLU ``silu(g)·u = g / (1 + e^-g) · u`` (Shazeer 2020, arXiv 2002.05202); SiTU
``β·tanh(g/β)·sigmoid(g) · β_lin·tanh(u/β_lin)`` (``shared/specs/kimi_k3_checkpoint.md`` §5).

On a GPU exp and tanh come from libdevice (``__nv_expf``/``__nv_tanhf``, the functions PyTorch's CUDA
``sigmoid``/``tanh`` call) and divisions are IEEE round-to-nearest; the interpreter (no libdevice) uses
``tl.exp`` and :func:`tanh_portable`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from longflash.ops.triton_math import exp_f32

_ACT_SILU = 0
_ACT_SITU = 1


@triton.jit
def tanh_portable(x):
    """fp32 tanh from ``tl.exp`` alone: the odd Taylor series to x^9 for |x| < 1/4 (truncation < 1e-9
    relative, no cancellation), ``(1 - e^-2|x|) / (1 + e^-2|x|)`` with x's sign elsewhere."""
    ax = tl.abs(x)
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    t = tl.exp(-2.0 * ax)
    big = tl.math.div_rn(1.0 - t, 1.0 + t)
    big = tl.where(x < 0, -big, big)
    return tl.where(ax < 0.25, series, big)


@triton.jit
def _tanh(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.tanh(x)
    else:
        return tanh_portable(x)


@triton.jit
def gated_act_f32(g, u, beta, linear_beta, ACT: tl.constexpr, LIBDEVICE: tl.constexpr):
    """fp32 ``act(g) * u`` in the reference's operation order; ACT 0 = SwiGLU, 1 = SiTU."""
    if ACT == 1:
        sig = tl.math.div_rn(1.0, 1.0 + exp_f32(-g, LIBDEVICE))
        a = beta * _tanh(tl.math.div_rn(g, beta), LIBDEVICE) * sig
        return a * (linear_beta * _tanh(tl.math.div_rn(u, linear_beta), LIBDEVICE))
    else:
        return tl.math.div_rn(g, 1.0 + exp_f32(-g, LIBDEVICE)) * u


@triton.jit
def _act_and_mul_kernel(g_ptr, u_ptr, o_ptr, n_rows, I, stride_g, stride_u, stride_o, beta, linear_beta,
                        ACT: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m = (rows < n_rows)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=m, other=0.0).to(tl.float32)
    y = gated_act_f32(g, u, beta, linear_beta, ACT, LIBDEVICE)
    tl.store(o_ptr + r64 * stride_o + cols[None, :], y.to(o_ptr.dtype.element_ty), mask=m)


def _launch(gate: torch.Tensor, up: torch.Tensor, act: int, beta: float, linear_beta: float) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate and up must match in shape, dtype and device, got {tuple(gate.shape)} {gate.dtype} "
                         f"{gate.device} and {tuple(up.shape)} {up.dtype} {up.device}")
    if gate.dim() == 0 or not gate.dtype.is_floating_point:
        raise ValueError(f"gate/up must be floating-point tensors of at least 1 dim, got {gate.dim()}-D {gate.dtype}")
    I = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = out.numel() // I if I else 0
    if n == 0 or I == 0:
        return out
    g2, u2 = gate.reshape(n, I), up.reshape(n, I)
    g2 = g2 if g2.stride(-1) == 1 else g2.contiguous()
    u2 = u2 if u2.stride(-1) == 1 else u2.contiguous()
    BLOCK_I = min(triton.next_power_of_2(I), 1024)
    # 512 elements per program (not from n: one compiled variant per width, whatever the batch): the
    # exact exp/tanh/division chain is latency-bound, so many small programs beat few large ones (H200,
    # decode step of the default model: 2048 per program took 8 us per call on the MoE's padded rows)
    BLOCK_ROWS = max(1, 512 // BLOCK_I)
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1" or not gate.is_cuda
    _act_and_mul_kernel[(triton.cdiv(n, BLOCK_ROWS), triton.cdiv(I, BLOCK_I))](
        g2, u2, out, n, I, g2.stride(0), u2.stride(0), I, float(beta), float(linear_beta),
        ACT=act, LIBDEVICE=not interp, BLOCK_ROWS=BLOCK_ROWS, BLOCK_I=BLOCK_I,
        num_warps=4)
    return out


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton :func:`~longflash.layers.activation.silu_and_mul`: gate, up [..., I] of one float dtype (any
    row strides, e.g. halves of a fused [T, 2I] GEMM output) -> new contiguous [..., I] of that dtype.
    Raises ValueError when gate and up differ in shape, dtype or device."""
    return _launch(gate, up, _ACT_SILU, 1.0, 1.0)


def situ_and_mul_triton(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0,
                        linear_beta: float = 25.0) -> torch.Tensor:
    """Triton :func:`~longflash.layers.activation.situ_and_mul` (Kimi-K3 SiTU; same arguments, shapes and
    errors as :func:`silu_and_mul_triton`)."""
    return _launch(gate, up, _ACT_SITU, beta, linear_beta)
