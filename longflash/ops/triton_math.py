"""Small ``@triton.jit`` helpers shared by several kernels (imported only where Triton is)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def dot_acc(a, b, c, IEEE: tl.constexpr):
    """``a @ b (+ c)`` with fp32 accumulation; IEEE fp32 products under ``IEEE`` (the interpreter's and
    the fp32 tests' choice), the default (TF32 for fp32 inputs) otherwise."""
    if IEEE:
        return tl.dot(a, b, c, input_precision="ieee")
    else:
        return tl.dot(a, b, c)


@triton.jit
def exp_f32(x, LIBDEVICE: tl.constexpr):
    """fp32 ``exp``: libdevice's ``__nv_expf`` (what PyTorch's CUDA ops call: bitwise-equal results) on a
    GPU; ``tl.exp`` under the interpreter, which has no libdevice."""
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)
