"""Grouped-query attention (Ainslie et al. 2023) over a paged K/V cache, with Qwen3's per-head
q/k RMSNorm (applied before RoPE)."""

from __future__ import annotations

import torch
from torch import nn

from longflash.attention import ops
from longflash.attention.dispatch import cache_ops
from longflash.distributed.comm import GroupCoordinator
from longflash.layers.norm import RMSNorm
from longflash.layers.parallel import ColumnParallelLinear, RowParallelLinear, split_evenly, tp_rank_of, tp_size_of
from longflash.layers.rotary import RotaryEmbedding
from longflash.runner.context import get_forward_context


class GQAAttention(nn.Module):
    """``q_proj``/``k_proj``/``v_proj``/``o_proj`` (+ optional ``q_norm``/``k_norm``) attention.

    ``kv_cache`` (set by the runner): [2, num_blocks, block_size, num_kv_heads, head_dim], model
    dtype, bf16 or fp8 (one ``k_scale`` for K and V; ``calculate_kv_scales`` sets it on the first
    forward to amax / 200 and freezes it).
    forward: hidden [T, H] -> [T, H] (reads the forward context).

    Tensor parallelism (``tp`` of N > 1 ranks): query heads split over the ranks (``q_proj``
    column-parallel, ``o_proj`` row-parallel with an all-reduce); KV heads split too when N divides
    them, else (N a multiple of the KV heads) each rank holds the one KV head its query heads use
    (replicated, as in vLLM). ``num_heads``/``num_kv_heads`` are this rank's; the cache holds its KV heads.
    Raises ValueError when the heads do not split.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, rms_norm_eps: float, qk_norm: bool = True, bias: bool = False, *,
                 tp: GroupCoordinator | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
        n = tp_size_of(tp)
        _, local_heads = split_evenly(num_heads, tp, "num_attention_heads")
        if num_kv_heads % n == 0:
            kv_shard = (tp_rank_of(tp) * (num_kv_heads // n) * head_dim, num_kv_heads // n * head_dim)
        elif n % num_kv_heads == 0:
            kv_shard = (tp_rank_of(tp) // (n // num_kv_heads) * head_dim, head_dim)
        else:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({n}): one must divide "
                             f"the other")
        self.num_heads, self.num_kv_heads, self.head_dim = local_heads, kv_shard[1] // head_dim, head_dim
        self.q_proj = ColumnParallelLinear(hidden_size, num_heads * head_dim, bias, tp=tp, what="num_attention_heads")
        self.k_proj = ColumnParallelLinear(hidden_size, num_kv_heads * head_dim, bias, tp=tp, shard=kv_shard)
        self.v_proj = ColumnParallelLinear(hidden_size, num_kv_heads * head_dim, bias, tp=tp, shard=kv_shard)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, tp=tp, what="num_attention_heads")
        self.tp = tp
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
            amax = torch.maximum(k.abs().max(), v.abs().max()).float().reshape(1) if T else k.new_zeros(1).float()
            if tp_size_of(self.tp) > 1:  # every rank holds some KV heads: the scale of all of them
                amax = self.tp.all_reduce(amax, op="max")
            amax = float(amax)
            self.k_scale = amax / 200.0 if amax > 0 else 1.0
            self.k_scale_source = "calculated"
            self.calculate_kv_scales = False  # frozen from now on
        scale = self.k_scale if fp8 else None
        cache_ops(self.kv_cache).reshape_and_cache(k, v, self.kv_cache[0], self.kv_cache[1], ctx.slot_mapping, scale, scale)
        if ctx.uniform_decode:  # device-tensor lengths with host bounds: no sync (CUDA graphs)
            o = ops.paged_gqa_attention(q, self.kv_cache[0], self.kv_cache[1], ctx.block_table, ctx.query_start_loc,
                                        ctx.seq_lens, self.scale, scale, scale, max_query_len=ctx.max_query_len,
                                        max_seq_len=ctx.max_seq_len)
        else:
            o = ops.paged_gqa_attention(q, self.kv_cache[0], self.kv_cache[1], ctx.block_table,
                                        ctx.query_start_loc_cpu, ctx.seq_lens_cpu, self.scale, scale, scale)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))
