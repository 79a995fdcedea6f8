"""Gated MLP (dense layers, shared experts, routed experts)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from longflash.distributed.comm import GroupCoordinator
from longflash.layers.activation import silu_and_mul
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_proj(x), self.up_proj(x)))
