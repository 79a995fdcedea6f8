"""Row argmax of a logits matrix in two Triton launches; same signature and result as :func:`argmax_ref`
(``torch.argmax(logits, dim=-1)``: the first index of the row's maximum, a NaN counting as the maximum).

Why: the engine reads every row's argmax once per decode step (the greedy tokens, ``LLMEngine.step``), and
PyTorch reduces a row in one thread block, so at batch 1 one SM reads the whole vocabulary row: 27-28 µs
per step for DeepSeek-V3's 129,280 logits on an H200 (the profile in
``benchmarks/results/e2e_decode_prenorm_first.h200.json``; a ~2 ms step), against 1.6 µs for this kernel's
first stage (``e2e_decode_prenorm.h200.json``). Here stage 1 gives each program ``CHUNK`` logits of one row
(127 programs per row at batch 1) and writes the chunk's maximum, its first index and whether it holds a NaN;
stage 2 scans a row's chunks in order. The result does not depend on the chunking: the first index of the maximum (or of the first NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longflash.ops.triton_env import interpreting

CHUNK = 1024  # logits per stage-1 program: 127 programs per row at a vocabulary of 129,280


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)``: logits [B, V] float (any dtype, any strides) -> [B] int64."""
    return torch.argmax(logits, dim=-1)


@triton.jit
def _argmax_chunks(x_ptr, V, stride, val_ptr, idx_ptr, nan_ptr, n_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    big: tl.constexpr = 2147483647
    is_nan = x != x
    nan_idx = tl.min(tl.where(is_nan, offs, big), axis=0)
    m = tl.max(tl.where(is_nan, float("-inf"), x), axis=0)
    idx = tl.min(tl.where(x == m, offs, big), axis=0)
    has_nan = nan_idx < big
    p = row * n_chunks + c
    tl.store(val_ptr + p, m)
    tl.store(idx_ptr + p, tl.where(has_nan, nan_idx, tl.minimum(idx, V - 1)))
    tl.store(nan_ptr + p, has_nan.to(tl.int32))


@triton.jit
def _argmax_rows(val_ptr, idx_ptr, nan_ptr, out_ptr, n_chunks, NC_P: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, NC_P)
    cm = c < n_chunks
    p = row * n_chunks + c
    v = tl.load(val_ptr + p, mask=cm, other=float("-inf"))
    i = tl.load(idx_ptr + p, mask=cm, other=0)
    n = tl.load(nan_ptr + p, mask=cm, other=0)
    big: tl.constexpr = 2147483647
    first_nan = tl.min(tl.where(n != 0, c, big), axis=0)
    m = tl.max(v, axis=0)
    first_max = tl.min(tl.where((v == m) & cm, c, big), axis=0)
    pick = tl.where(first_nan < big, first_nan, first_max)
    tl.store(out_ptr + row, tl.sum(tl.where(c == pick, i, 0), axis=0).to(tl.int64))


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`argmax_ref`: logits [B, V] (fp32/fp16/bf16, the last dim contiguous) ->
    [B] int64. A row of all -inf gives index 0, as torch. Raises ValueError for another rank, dtype or an
    empty vocabulary, or a last-dim stride other than 1."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits must be [B, V] fp32/fp16/bf16, got {tuple(logits.shape)} {logits.dtype}")
    B, V = logits.shape
    if V == 0 or (logits.stride(1) != 1 and B > 0):
        raise ValueError(f"logits must have a non-empty, contiguous last dim, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    n_chunks = triton.cdiv(V, CHUNK)
    val = torch.empty(B * n_chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(B * n_chunks, dtype=torch.int32, device=logits.device)
    nan = torch.empty(B * n_chunks, dtype=torch.int32, device=logits.device)
    _argmax_chunks[(B, n_chunks)](logits, V, logits.stride(0), val, idx, nan, n_chunks, CHUNK=CHUNK,
                                  num_warps=1 if interpreting() else 4)
    _argmax_rows[(B,)](val, idx, nan, out, n_chunks, NC_P=triton.next_power_of_2(n_chunks), num_warps=4)
    return out
