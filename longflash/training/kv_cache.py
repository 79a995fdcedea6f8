"""Dense KV cache and batched incremental greedy generation for the training reference model.

``KimiK3TrainModel.hidden_states(ids, cache)`` runs rows at positions ``cache.length ..`` against the
cached keys/values of every MLA layer, so a greedy continuation of G tokens costs one prefill plus G
one-token forwards instead of G full recomputes (used to regenerate DFlash drafter training data).
All rows of a batch share one length (no padding, no paging): the cache is ``[L, B, Nh, T_max, d]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _LayerView:
    def __init__(self, cache: "KVCache", layer: int):
        self.cache, self.layer = cache, layer

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return self.cache.attend(self.layer, q, k, v, scale)


class KVCache:
    """Per-layer keys/values of B rows of equal length.

    Args:
        num_layers, batch, num_heads, head_dim: cache shape ``[num_layers, batch, num_heads, max_len, head_dim]``
            for K and for V (V zero-padded to the qk width by the model, so one head_dim).
        max_len: positions the cache can hold.
        dtype, device: of the stored keys/values (keys/values are cast on write).
    ``length`` is the number of cached positions; the model advances it after each forward.
    """

    def __init__(self, num_layers: int, batch: int, num_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.k = torch.zeros(num_layers, batch, num_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.max_len = max_len
        self.length = 0

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, dtype: torch.dtype, device) -> "KVCache":
        """A cache sized for ``KimiK3TrainModel`` ``model``."""
        attn = model.model.layers[0].self_attn
        return cls(len(model.model.layers), batch, attn.nh, max_len, attn.dn + attn.dr, dtype, device)

    def layer(self, i: int) -> _LayerView:
        return _LayerView(self, i)

    def advance(self, n: int) -> None:
        self.length += n

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Append k/v [B, Nh, T, d] at ``length`` and attend q [B, Nh, T, d] over positions < length + T,
        causally inside the T new rows. Raises ValueError when the cache would overflow."""
        t0, T = self.length, q.shape[2]
        if t0 + T > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {t0} cached + {T} new do not fit")
        self.k[layer, :, :, t0:t0 + T] = k
        self.v[layer, :, :, t0:t0 + T] = v
        K = self.k[layer, :, :, :t0 + T]
        V = self.v[layer, :, :, :t0 + T]
        if t0 == 0:
            return F.scaled_dot_product_attention(q, K.to(q.dtype), V.to(q.dtype), is_causal=True, scale=scale)
        if T == 1:
            return F.scaled_dot_product_attention(q, K.to(q.dtype), V.to(q.dtype), scale=scale)
        mask = torch.ones(T, t0 + T, dtype=torch.bool, device=q.device).tril(t0)
        return F.scaled_dot_product_attention(q, K.to(q.dtype), V.to(q.dtype), attn_mask=mask, scale=scale)


@torch.no_grad()
def greedy_generate(model, prompts: torch.Tensor, gen_len: int, cache_dtype: torch.dtype | None = None,
                    autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Greedy continuations of a batch of equal-length prompts with a KV cache.

    Args:
        model: ``KimiK3TrainModel``.
        prompts: [B, P] int64 token ids.
        gen_len: new tokens per row (>= 0).
        cache_dtype: K/V storage dtype (default: the model's parameter dtype).
        autocast_dtype: e.g. torch.bfloat16 to run the forwards under autocast (CUDA), None for none.
    Returns:
        [B, P + gen_len] int64: the prompts followed by their continuations. Ties in argmax pick the
        lowest id (torch.argmax), as ``generate_greedy`` does.
    """
    if prompts.dim() != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be [B, P] with P >= 1, got {tuple(prompts.shape)}")
    if gen_len < 0:
        raise ValueError(f"gen_len must be >= 0, got {gen_len}")
    B, P = prompts.shape
    dev = prompts.device
    param = next(model.parameters())
    cache = KVCache.for_model(model, B, P + gen_len, cache_dtype or param.dtype, dev)
    out = torch.empty(B, P + gen_len, dtype=torch.int64, device=dev)
    out[:, :P] = prompts
    ids = prompts
    for t in range(gen_len):
        with torch.autocast(dev.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            h = model.hidden_states(ids, cache)[:, -1]
            logits = model.lm_head(h).float()
        nxt = logits.argmax(-1)
        out[:, P + t] = nxt
        ids = nxt[:, None]
    return out
