"""Gated activations of the MLPs: SwiGLU (SiLU gate) and Kimi-K3's SiTU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` (Shazeer 2020). Shapes equal, any float dtype."""
    return F.silu(gate) * up


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Kimi-K3 SiTU: ``beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)``.

    Source: ``shared/specs/kimi_k3_checkpoint.md`` §5 (betas from ``activation_situ_beta`` and
    ``activation_situ_linear_beta``, 4 and 25 in Kimi-K3).
    """
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))


def get_act_and_mul(config: dict):
    """The gated activation named by ``hidden_act`` in an HF config dict.

    Raises ValueError for an activation the engine does not implement.
    """
    act = config.get("hidden_act", "silu")
    if act in ("silu", "swiglu"):
        return silu_and_mul
    if act == "situ":
        beta = float(config.get("activation_situ_beta", 4.0))
        lbeta = float(config.get("activation_situ_linear_beta", 25.0))
        return lambda g, u: situ_and_mul(g, u, beta, lbeta)
    raise ValueError(f"unsupported config value hidden_act={act!r}; supported: silu, situ")
