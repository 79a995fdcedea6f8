"""Dense (non-paged) DFlash drafter forward over many anchored blocks at once.

Used for drafter training (SpecForge recipe, ``shared/specs/dflash.md`` "Training recipe") and as
the reference the engine's paged drafter is tested against. For each sequence and anchor a, the
block ``[x_a, MASK × (B−1)]`` sits at positions a..a+B−1; its queries see context positions < a
(bounded by a layer's sliding window) and every row of their own block; nothing of other blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longflash.spec_decode.dflash_model import DFlashDraftModel


def _rope(rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [S, T, heads, d], positions [S, T]."""
    S, T = positions.shape
    cos, sin = rotary.cos_sin(positions.reshape(-1), x.dtype)
    out = rotary.rotate(x.reshape(S * T, *x.shape[2:]), cos, sin)
    return out.view_as(x)


def block_attention_mask(anchors: torch.Tensor, block_size: int, ctx_len: int, window: int | None) -> torch.Tensor:
    """Boolean visibility [S, N·B, T + N·B] for anchors [S, N] (True = may attend)."""
    S, N = anchors.shape
    B = block_size
    q_anchor = anchors.repeat_interleave(B, dim=1)  # [S, N·B]
    ctx_pos = torch.arange(ctx_len, device=anchors.device)
    vis_ctx = ctx_pos[None, None, :] < q_anchor[:, :, None]
    if window is not None:
        vis_ctx &= ctx_pos[None, None, :] >= (q_anchor[:, :, None] - window)
    blk = torch.arange(N, device=anchors.device).repeat_interleave(B)
    vis_blk = (blk[:, None] == blk[None, :]).expand(S, -1, -1)
    return torch.cat([vis_ctx, vis_blk], dim=-1)


def dense_forward(drafter: DFlashDraftModel, aux: torch.Tensor, block_embeds: torch.Tensor,
                  anchors: torch.Tensor) -> torch.Tensor:
    """Drafter hidden states (final-normed) of anchored blocks.

    Args:
        aux: [S, T, K·H] target taps of S sequences (context features for positions 0..T−1).
        block_embeds: [S, N, B, H] embeddings of ``[x_a, MASK…]`` per anchor.
        anchors: [S, N] int64 block start positions a (context = positions < a).
    Returns:
        [S, N, B, H].
    """
    S, N, B, H = block_embeds.shape
    T = aux.shape[1]
    cfg = drafter.cfg
    nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h_ctx = drafter.context_features(aux)  # [S, T, H]
    ctx_pos = torch.arange(T, device=aux.device).expand(S, T)
    blk_pos = (anchors[:, :, None] + torch.arange(B, device=aux.device)).reshape(S, N * B)
    h = block_embeds.reshape(S, N * B, H)
    for i, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = _rope(attn.rotary, attn.q_norm(attn.q_proj(x).view(S, N * B, nh, hd)), blk_pos)
        k_c = _rope(attn.rotary, attn.k_norm(attn.k_proj(h_ctx).view(S, T, kvh, hd)), ctx_pos)
        k_b = _rope(attn.rotary, attn.k_norm(attn.k_proj(x).view(S, N * B, kvh, hd)), blk_pos)
        v_c = attn.v_proj(h_ctx).view(S, T, kvh, hd)
        v_b = attn.v_proj(x).view(S, N * B, kvh, hd)
        k = torch.cat([k_c, k_b], dim=1).repeat_interleave(nh // kvh, dim=2)
        v = torch.cat([v_c, v_b], dim=1).repeat_interleave(nh // kvh, dim=2)
        mask = block_attention_mask(anchors, B, T, cfg.window(i))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask[:, None], scale=attn.scale)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(S, N * B, nh * hd))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).view(S, N, B, H)
