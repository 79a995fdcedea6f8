"""Grouped-query attention (Ainslie et al. 2023) over a paged K/V cache, with Qwen3's per-head
q/k RMSNorm (applied before RoPE)."""

from __future__ import annotations

import torch
from torch import nn

from longflash.attention import ops
from longflash.layers.norm import RMSNorm
from longflash.layers.rotary import RotaryEmbedding
from longflash.runner.context import get_forward_context


class GQAAttention(nn.Module):
    """``q_proj``/``k_proj``/``v_proj``/``o_proj`` (+ optional ``q_norm``/``k_norm``) attention.

    ``kv_cache`` (set by the runner): [2, num_blocks, block_size, num_kv_heads, head_dim], model
    dtype, bf16 or fp8 (one ``k_scale`` for K and V; ``calculate_kv_scales`` sets it on the first
    forward to amax / 200 and freezes it).
    forward: hidden [T, H] -> [T, H] (reads the forward context).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, rms_norm_eps: float, qk_norm: bool = True, bias: bool = False):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.scale = head_dim ** -0.5
        self.kv_cache: torch.Tensor | None = None
        self.k_scale: float = 1.0  # fp8 dequantization multiplier shared by the K and V caches
        self.k_scale_source: str = "default"
        self.calculate_kv_scales: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary.cos_sin(ctx.positions, q.dtype)
        q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        fp8 = self.kv_cache.dtype == ops.FP8_DTYPE
        if self.calculate_kv_scales and fp8:
            amax = float(torch.maximum(k.abs().max(), v.abs().max())) if T else 0.0
            self.k_scale = amax / 200.0 if amax > 0 else 1.0
            self.k_scale_source = "calculated"
            self.calculate_kv_scales = False  # frozen from now on
        scale = self.k_scale if fp8 else None
        ops.reshape_and_cache(k, v, self.kv_cache[0], self.kv_cache[1], ctx.slot_mapping, scale, scale)
        if ctx.uniform_decode:  # device-tensor lengths with host bounds: no sync (CUDA graphs)
            o = ops.paged_gqa_attention(q, self.kv_cache[0], self.kv_cache[1], ctx.block_table, ctx.query_start_loc,
                                        ctx.seq_lens, self.scale, scale, scale, max_query_len=ctx.max_query_len,
                                        max_seq_len=ctx.max_seq_len)
        else:
            o = ops.paged_gqa_attention(q, self.kv_cache[0], self.kv_cache[1], ctx.block_table,
                                        ctx.query_start_loc_cpu, ctx.seq_lens_cpu, self.scale, scale, scale)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))
