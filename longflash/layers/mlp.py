"""Gated MLP (dense layers, shared experts, routed experts)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from longflash.layers.activation import silu_and_mul


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x), up_proj(x)))``; x [T, H] -> [T, H]. No biases."""

    def __init__(self, hidden_size: int, intermediate_size: int,
                 act_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_and_mul):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_and_mul = act_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_proj(x), self.up_proj(x)))
