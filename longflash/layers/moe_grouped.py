"""Capture-safe MoE dispatch over stacked expert weights (no data-dependent shapes, no host sync).

The eager dispatch (``moe.run_experts``) visits each expert hit with ``torch.unique(...).tolist()`` and
``torch.where`` (host syncs, shapes that change with the routing), which a CUDA graph cannot hold.
Here the routed experts' weights are stacked (``w13 [E, 2I, D]`` = gate rows then up rows, ``w2
[E, D_out, I]``, nn.Linear layout) and:

* :func:`grouped_experts_ref` — the PyTorch reference: every expert over every token, weighted by its
  routing weight (0 where not chosen) and summed in expert order, which equals ``run_experts`` (same
  per-token products, same order of additions; the unchosen experts add exact zeros).
* ``moe_grouped_triton.grouped_experts_triton`` — the same function on the GPU, reading only the
  chosen experts' weights: the (token, slot) rows are sorted by expert into blocks of BLOCK_M rows
  (:func:`align_by_expert`, a fixed-size layout bounded without a host sync) and one grouped GEMM per
  projection runs over the blocks (vLLM's fused_moe layout).

Stacking (:func:`stack_expert_weights`) re-points each expert's ``nn.Linear`` weights at views of the
stacked tensors, so no memory is duplicated and the eager path keeps working on the same storage.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def stack_expert_weights(experts: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``GatedMLP`` experts into (w13 [E, 2I, D], w2 [E, D_out, I]) and make every expert's
    ``gate_proj``/``up_proj``/``down_proj`` weight a view of them (the old storage is released).

    Raises ValueError when the experts' shapes or dtypes differ or a projection has a bias."""
    g0 = experts[0].gate_proj.weight
    for m in experts:
        for lin in (m.gate_proj, m.up_proj, m.down_proj):
            if lin.bias is not None:
                raise ValueError("stacked MoE experts must have no bias")
        if m.gate_proj.weight.shape != g0.shape or m.up_proj.weight.shape != g0.shape \
                or m.gate_proj.weight.dtype != g0.dtype:
            raise ValueError("all routed experts must have the same shapes and dtype to be stacked")
    I = g0.shape[0]
    with torch.no_grad():
        w13 = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in experts])
        w2 = torch.stack([m.down_proj.weight for m in experts])
    for e, m in enumerate(experts):
        m.gate_proj.weight = nn.Parameter(w13[e, :I], requires_grad=False)
        m.up_proj.weight = nn.Parameter(w13[e, I:], requires_grad=False)
        m.down_proj.weight = nn.Parameter(w2[e], requires_grad=False)
    return w13, w2


def grouped_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, act_and_mul: Callable, add: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts without data-dependent shapes (PyTorch reference of the grouped kernel).

    Args:
        x: [T, D] activations. w13: [E, 2I, D] (gate rows, then up rows). w2: [E, D_out, I].
        topk_weights: [T, k] fp32 routing weights. topk_ids: [T, k] int64 expert ids in [0, E),
            distinct within a row.
        act_and_mul: the gated activation ``act(gate, up)``.
        add: optional [T, D_out] in x's dtype added to the result (the shared experts' output), as
            ``result + add`` in x's dtype.
    Returns:
        [T, D_out] in x's dtype: Σ over chosen experts e of ``w_e · down_e(act(gate_e x, up_e x))``,
        each product rounded to x's dtype and added in ascending expert order, as ``moe.run_experts``.
    """
    E, two_i, _ = w13.shape
    I = two_i // 2
    combine = torch.zeros(x.shape[0], E, dtype=topk_weights.dtype, device=x.device)
    combine.scatter_(1, topk_ids, topk_weights)  # [T, E]: the routing weight, 0 where not chosen
    out = x.new_zeros(x.shape[0], w2.shape[1])
    for e in range(E):
        h = torch.nn.functional.linear(x, w13[e])
        y = torch.nn.functional.linear(act_and_mul(h[:, :I], h[:, I:]), w2[e])
        out += y * combine[:, e, None].to(x.dtype)
    return out if add is None else out + add


def moe_combine_ref(y: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype,
                    add: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted sum of each token's k routed-expert outputs (PyTorch reference of
    ``moe_grouped_triton.moe_combine_triton``).

    Args:
        y: [T·k, D] expert outputs, row t·k + j = the j-th chosen expert of token t (any float dtype).
        topk_weights: [T, k] routing weights (any float dtype; used in fp32).
        out_dtype: the result's dtype.
        add: optional [T, D] ``out_dtype`` tensor added after the rounding (``result + add`` as a PyTorch
            add in ``out_dtype``: the shared experts' output, no launch of its own on the GPU).
    Returns:
        [T, D] ``Σ_j topk_weights[t, j] · y[t·k + j]`` computed in fp32 (products, then the sum over j
        in ascending order), rounded once to ``out_dtype`` (then ``+ add``).
    Raises:
        ValueError when y's rows are not T·k, or ``add`` is not [T, D] of ``out_dtype``.
    """
    T, k = topk_weights.shape
    if y.dim() != 2 or y.shape[0] != T * k:
        raise ValueError(f"y must be [T*k={T * k}, D], got {tuple(y.shape)}")
    if add is not None and (add.shape != (T, y.shape[1]) or add.dtype != out_dtype):
        raise ValueError(f"add must be [{T}, {y.shape[1]}] {out_dtype}, got {tuple(add.shape)} {add.dtype}")
    acc = torch.zeros(T, y.shape[1], dtype=torch.float32, device=y.device)
    yf, wf = y.view(T, k, y.shape[1]).float(), topk_weights.float()
    for j in range(k):
        acc += wf[:, j, None] * yf[:, j]
    return acc.to(out_dtype) if add is None else acc.to(out_dtype) + add


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the flattened (token, slot) rows by expert into blocks of ``block_m`` rows, each block
    holding one expert's rows (the last block of an expert padded). vLLM's ``moe_align_block_size``
    layout; the PyTorch reference of ``moe_align_triton`` and the layout of both grouped-MoE kernels.

    topk_ids [T, k] int -> (sorted_rows [max_blocks * block_m] int32: flat row t*k + slot, or T*k for
    padding; block_expert [max_blocks] int32: the expert of each block, -1 for unused blocks;
    num_blocks [1] int32: the blocks in use, which come first), with
    ``max_blocks = T*k // block_m + min(T*k, E)``, a bound on the padded count known without a sync.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    first_padded = pad_end - padded
    first_sorted = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = first_padded[expert_of] + torch.arange(n, device=dev) - first_sorted[expert_of]
    max_blocks = n // block_m + min(n, num_experts)
    sorted_rows = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_rows.index_copy_(0, dest, order.to(torch.int32))
    blocks = torch.arange(max_blocks, device=dev)
    block_end = pad_end // block_m
    block_expert = torch.searchsorted(block_end, blocks, right=True)
    block_expert = torch.where(blocks < block_end[-1], block_expert, torch.full_like(block_expert, -1))
    return sorted_rows, block_expert.to(torch.int32), block_end[-1:].to(torch.int32)


def expert_align(topk_ids: torch.Tensor, num_experts: int,
                 block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`align_by_expert`'s layout and return contract, in one Triton launch on CUDA
    (``moe_align_triton``; ~30 small launches otherwise) and by :func:`align_by_expert` elsewhere.

    On CUDA the rows of one expert may come in another order than ``align_by_expert``'s stable one (the
    kernel's atomics decide it); the blocks, their experts and ``num_blocks`` are the same, and the grouped
    MoE's result does not depend on that order (each row is its own row of the tile products). Raises
    ValueError for a non-2-D ``topk_ids`` or (on CUDA) a ``block_m`` that is not a power of two."""
    if topk_ids.is_cuda:
        from longflash.layers.moe_align_triton import moe_align_triton
        sorted_rows, block_expert, sched = moe_align_triton(topk_ids, num_experts, block_m)
        return sorted_rows, block_expert, sched[1:2]
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {list(topk_ids.shape)}")
    return align_by_expert(topk_ids, num_experts, block_m)
