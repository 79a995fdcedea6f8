"""Which implementation of the cache ops runs for a cache: the Triton kernels on a GPU, the PyTorch
references elsewhere (``attention/ops.py``; same signatures). Triton is imported only for a CUDA cache,
so the CPU engine never needs it."""

from __future__ import annotations

import torch

from longflash.attention import ops


def cache_ops(cache: torch.Tensor):
    """The module implementing the cache write / gather / merge ops (``concat_and_cache_mla``,
    ``reshape_and_cache``, ``gather_and_maybe_dequant_cache``, ``merge_attn_states``) and the prefill's
    dense attention for ``cache``'s device: ``triton_ops`` on a GPU (the attention: the FlashAttention-2
    kernel of ``triton_prefill``), ``ops`` elsewhere."""
    if cache.is_cuda:
        from longflash.attention import triton_ops
        return triton_ops
    return ops
