"""Gated MLP (dense layers, shared experts, routed experts)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from longflash.distributed.comm import GroupCoordinator
from longflash.layers import gemv
from longflash.layers.activation import silu_and_mul
from longflash.layers.gemm_layout import kn_layout_faster
from longflash.layers.parallel import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x), up_proj(x)))``; x [T, H] -> [T, H]. No biases.

    Under tensor parallelism (``tp`` a group of N > 1 ranks) ``gate_proj``/``up_proj`` are
    column-parallel and ``down_proj`` row-parallel over the intermediate features (Megatron-LM MLP):
    each rank holds ``intermediate_size / N`` of them and the output is summed over the group, or left
    as this rank's partial sum with ``reduce=False`` (MoE experts, reduced once by the caller).
    Raises ValueError when N does not divide ``intermediate_size``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int,
                 act_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_and_mul, *,
                 tp: GroupCoordinator | None = None, reduce: bool = True):
        super().__init__()
        what = "intermediate size"
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp=tp, what=what)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp=tp, what=what)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp, reduce=reduce, what=what)
        self.act_and_mul = act_and_mul
        self.gate_up_weight: torch.Tensor | None = None  # [2·I, H] once fuse_gate_up() ran

    def fuse_gate_up(self) -> None:
        """Compute gate and up with one GEMM from now on (inference; the engine calls it on GPUs, where
        every launch counts in a decode step): the two weights are copied into one [2·I, H] tensor and
        the parameters become views of its halves (no second copy is kept). The act-and-mul then reads
        the two halves of the GEMM's output in place. On a GPU the [2·I, H] weight is the transposed
        view of an [H, 2·I] tensor when that runs cuBLAS's one-token GEMM faster
        (:func:`longflash.layers.gemm_layout.kn_layout_faster`; only asked with the Triton GEMV off, which
        takes one-token products itself). Idempotent."""
        if self.gate_up_weight is not None:
            return
        g, u = self.gate_proj.weight, self.up_proj.weight
        w = torch.cat([g.detach(), u.detach()])
        # With the few-row Triton GEMV on (``gemv.enabled``), one token never reaches cuBLAS: [N, K] is its layout.
        if not gemv.enabled and kn_layout_faster(w.shape[0], w.shape[1], w.dtype, str(w.device)):
            w = w.t().contiguous().t()  # stored [H, 2·I]: a faster one-token GEMM for this shape (gemm_layout)
        g.data, u.data = w[:g.shape[0]], w[g.shape[0]:]
        self.gate_up_weight = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gu = gemv.linear(x, self.gate_up_weight)
            i = gu.shape[-1] // 2
            return self.down_proj(self.act_and_mul(gu[..., :i], gu[..., i:]))
        return self.down_proj(self.act_and_mul(self.gate_proj(x), self.up_proj(x)))
