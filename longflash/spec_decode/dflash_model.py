"""DFlash block-diffusion drafter (Chen, Liang, Liu, arXiv 2602.06036; z-lab/dflash checkpoint format).

A few Qwen3-style layers with no embedding or LM head of their own (the target's are used).
Context features ``h_ctx = hidden_norm(fc(concat(taps)))`` are computed once per committed token and
their per-layer K/V written into a paged **draft KV pool** that shares block ids and slots with the
target's cache. A draft block ``[pending, MASK × (B−1)]`` then attends non-causally over
``[context ; block]``; sliding-window layers bound only the context lookback.
Source of the layer math: ``shared/specs/dflash.md`` ("Drafter").
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from longflash.attention import ops
from longflash.attention.dispatch import cache_ops
from longflash.layers.mlp import GatedMLP
from longflash.layers.norm import RMSNorm
from longflash.layers.rotary import RotaryEmbedding
from longflash.spec_decode.dflash_attention import block_attention_op
from longflash.spec_decode.dflash_config import DFlashConfig


class DFlashAttention(nn.Module):
    """q from the block only; k/v from [context ; block]; per-head q_norm/k_norm; RoPE at absolute
    positions; GQA; scale head_dim^-0.5; non-causal."""

    def __init__(self, cfg: DFlashConfig, rotary: RotaryEmbedding, window: int | None):
        super().__init__()
        H, nh, kvh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, kvh, hd
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, kvh * hd, bias=False)
        self.v_proj = nn.Linear(H, kvh * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.rotary = rotary
        self.window = window
        self.scale = hd ** -0.5
        self.kv_cache: torch.Tensor | None = None  # draft pool: [2, num_blocks, block_size, kvh, hd]
        self.kv_weight: torch.Tensor | None = None  # [2·kvh·hd, H] once fuse_kv() ran

    def fuse_kv(self) -> None:
        """Compute keys and values with one GEMM from now on (inference, GPUs): k_proj and v_proj
        become views of one [2·kvh·hd, H] weight (no second copy). Idempotent."""
        if self.kv_weight is None:
            k, v = self.k_proj.weight, self.v_proj.weight
            w = torch.cat([k.detach(), v.detach()])
            k.data, v.data = w[:k.shape[0]], w[k.shape[0]:]
            self.kv_weight = w

    def _kv_proj(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [T, kvh, hd] projections of h [T, H] (views of one GEMM's output after fuse_kv)."""
        T, shape = h.shape[0], (h.shape[0], self.num_kv_heads, self.head_dim)
        if self.kv_weight is None:
            return self.k_proj(h).view(shape), self.v_proj(h).view(shape)
        kv = F.linear(h, self.kv_weight)
        w = kv.shape[-1] // 2
        return kv[:, :w].view(T, *shape[1:]), kv[:, w:].view(T, *shape[1:])

    def kv(self, h: torch.Tensor, positions: torch.Tensor,
           cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated, normed keys and values of rows h [T, H] at ``positions`` [T]; ``cos_sin``: the
        rotary table of those positions when the caller already has it (else computed)."""
        k, v = self._kv_proj(h)
        k = self.k_norm(k)
        if cos_sin is None and h.is_cuda:  # one fused launch (cos/sin computed in the kernel)
            return self.rotary.rotate_qk(None, k, positions)[1], v
        cos, sin = cos_sin if cos_sin is not None else self.rotary.cos_sin(positions, h.dtype)
        return self.rotary.rotate(k, cos, sin), v

    def write_context(self, h_ctx: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        k, v = self.kv(h_ctx, positions, cos_sin)
        cache_ops(self.kv_cache).reshape_and_cache(k, v, self.kv_cache[0], self.kv_cache[1], slot_mapping)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, block_starts: list[int],
                context_lens: list[int], block_table: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                context_rows: dict | None = None) -> torch.Tensor:
        """x [N, H] (normed block rows of all requests, concatenated); request b owns rows
        ``block_starts[b]:block_starts[b+1]`` and has ``context_lens[b]`` cached context tokens.
        ``cos_sin``: rotary table of ``positions`` (computed if None); ``context_rows``: a dict the
        layers of one forward share, caching each request's pool row indices (:func:`_context_rows`)."""
        N = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(N, self.num_heads, self.head_dim))
        cos, sin = cos_sin if cos_sin is not None else self.rotary.cos_sin(positions, x.dtype)
        q = self.rotary.rotate(q, cos, sin)
        k_blk, v_blk = self.kv(x, positions, (cos, sin))
        kv_blk = torch.stack([k_blk, v_blk])
        out = x.new_empty(N, self.num_heads, self.head_dim)
        rep = self.num_heads // self.num_kv_heads
        nb, bs = self.kv_cache.shape[1:3]
        flat = self.kv_cache.view(2, nb * bs, *self.kv_cache.shape[3:])
        rows_of = {} if context_rows is None else context_rows
        for b, ctx_len in enumerate(context_lens):
            s, e = block_starts[b], block_starts[b + 1]
            lo = 0 if self.window is None else max(0, ctx_len - self.window)
            key = (b, lo, ctx_len)
            if key not in rows_of:
                rows_of[key] = _context_rows(block_table[b], lo, ctx_len, bs)
            # K and V of the context (one gather of both planes) then of the block, GQA heads repeated
            kv = torch.cat([flat.index_select(1, rows_of[key]).to(x.dtype), kv_blk[:, s:e]], dim=1)
            kv = kv.repeat_interleave(rep, dim=2)
            out[s:e], _ = ops.attention_with_lse(q[s:e], kv[0], kv[1], self.scale, causal_offset=None)
        return self.o_proj(out.reshape(N, -1))

    def forward_padded(self, x: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                       block_table: torch.Tensor, max_context_len: int, max_rows: int = ops.DECODE_PIECE_ROWS,
                       cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """:meth:`forward` for R requests of one block length Bk, from device tensors only (no host
        sync; what a CUDA graph captures).

        x [R·Bk, H], positions [R·Bk]; context_lens [R] int32 (device); block_table [R, max_blocks];
        ``max_context_len``: a host bound of context_lens (under a graph: the cache capacity);
        ``cos_sin``: rotary table of ``positions`` (computed if None). The attention over each
        request's ``[lo, context_len)`` context rows (lo = context_len - window for a sliding-window
        layer, else 0) and its own block is :func:`~longflash.spec_decode.dflash_attention.dflash_block_attention`:
        the Triton kernel on a GPU (work O(real context)), the PyTorch reference elsewhere (context
        gathered padded in pieces of at most ``max_rows`` rows). Returns [R·Bk, H].
        """
        N = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(N, self.num_heads, self.head_dim))
        if cos_sin is None and x.is_cuda:  # q and the block's keys rotated in one fused launch
            k, v_blk = self._kv_proj(x)
            q, k_blk = self.rotary.rotate_qk(q, self.k_norm(k), positions)
        else:
            cos, sin = cos_sin if cos_sin is not None else self.rotary.cos_sin(positions, x.dtype)
            q = self.rotary.rotate(q, cos, sin)
            k_blk, v_blk = self.kv(x, positions, (cos, sin))
        out, _ = block_attention_op(q)(q, k_blk, v_blk, self.kv_cache[0], self.kv_cache[1], block_table, context_lens,
                                       self.scale, self.window, max_context_len, max_rows)
        return self.o_proj(out.reshape(N, -1))


def _context_rows(table_row: torch.Tensor, lo: int, ctx_len: int, block_size: int) -> torch.Tensor:
    """Flat draft-pool row indices [ctx_len - lo] int64 of positions ``lo..ctx_len-1`` of one request
    (``table_row`` [max_blocks] int32: logical -> physical block), the rows
    ``ops.gather_and_maybe_dequant_cache`` reads. Raises ValueError for a position beyond the block
    table or in an unallocated (-1) block."""
    pos = torch.arange(lo, ctx_len, device=table_row.device)
    if ctx_len == lo:
        return pos
    if (ctx_len - 1) // block_size >= table_row.shape[0]:
        raise ValueError("gather position beyond the request's block table")
    blocks = table_row.long()[pos // block_size]
    if int(blocks.min()) < 0:
        raise ValueError("gather position maps to an unallocated block (-1)")
    return blocks * block_size + pos % block_size


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, rotary: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, rotary, cfg.window(layer_idx))
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DFlashDraftModel(nn.Module):
    """Parameters named as in released drafters: ``layers.{i}.*``, ``norm``, ``fc``, ``hidden_norm``.

    Use:
        ``context_features(aux [T, K·H]) -> h_ctx [T, H]``;
        ``write_context(h_ctx, positions, slot_mapping)`` into the draft pool;
        ``forward(block_embeds [N, H], positions [N], block_starts, context_lens, block_table)``
        -> final-normed hidden [N, H]; logits via the target's ``lm_head``.
    """

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        self.layers = nn.ModuleList(DFlashLayer(cfg, rotary, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mask_embedding: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def fuse_projections(self) -> None:
        """One GEMM for each layer's keys + values and for each MLP's gate + up (inference on GPUs;
        ``DFlashAttention.fuse_kv``, ``GatedMLP.fuse_gate_up``)."""
        for layer in self.layers:
            layer.self_attn.fuse_kv()
            layer.mlp.fuse_gate_up()

    def attention_layers(self) -> list[DFlashAttention]:
        return [layer.self_attn for layer in self.layers]

    def kv_row_shape(self) -> tuple[int, int]:
        return (self.cfg.num_key_value_heads, self.cfg.head_dim)

    def context_features(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [T, K·H] (taps concatenated in ``target_layer_ids`` order) -> h_ctx [T, H]."""
        return self.hidden_norm(self.fc(aux))

    def write_context(self, h_ctx: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # NOTE: all layers share one RotaryEmbedding, so the rotary table is computed once here (on
        # CUDA each layer's fused RoPE kernel computes it in registers instead).
        cos_sin = None if h_ctx.is_cuda else self.layers[0].self_attn.rotary.cos_sin(positions, h_ctx.dtype)
        for attn in self.attention_layers():
            attn.write_context(h_ctx, positions, slot_mapping, cos_sin)

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, block_starts: list[int],
                context_lens: list[int], block_table: torch.Tensor) -> torch.Tensor:
        h = block_embeds
        # Shared by every layer (one rotary module, one block table): computed once per forward.
        cos_sin = self.layers[0].self_attn.rotary.cos_sin(positions, h.dtype)
        context_rows: dict = {}
        for layer in self.layers:
            h = h + layer.self_attn(layer.input_layernorm(h), positions, block_starts, context_lens, block_table,
                                    cos_sin, context_rows)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def forward_padded(self, block_embeds: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                       block_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
        """:meth:`forward` for requests of one block length from device tensors (no host sync; see
        ``DFlashAttention.forward_padded``): block_embeds [R·Bk, H], context_lens [R] -> [R·Bk, H]."""
        h = block_embeds
        # Shared by every layer (one rotary module): computed once per forward, as in :meth:`forward`
        # (on CUDA each layer's fused RoPE kernel computes it in registers instead).
        cos_sin = None if h.is_cuda else self.layers[0].self_attn.rotary.cos_sin(positions, h.dtype)
        for layer in self.layers:
            h = h + layer.self_attn.forward_padded(layer.input_layernorm(h), positions, context_lens, block_table,
                                                   max_context_len, cos_sin=cos_sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def embed_block(self, embed_tokens: nn.Embedding, token_ids: torch.Tensor) -> torch.Tensor:
        """Target embeddings of block tokens, with the drafter's own mask row when it ships one."""
        e = embed_tokens(token_ids)
        if self.mask_embedding is not None:
            e = torch.where((token_ids == self.cfg.mask_token_id)[:, None], self.mask_embedding.to(e.dtype), e)
        return e


def load_drafter(path: str, num_target_layers: int, dtype: torch.dtype, device: torch.device) -> DFlashDraftModel:
    """Load a DFlash drafter directory (config.json, *.safetensors, optional mask_embedding.pt).

    Raises ValueError / ModelLoadError naming the problem (bad config, missing tensor, shape).
    """
    from longflash.models.loader import ModelLoadError, iterate_tensors, safetensors_files
    with open(os.path.join(path, "config.json")) as f:
        cfg = DFlashConfig.from_dict(json.load(f), num_target_layers)
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"drafter target_layer_ids {cfg.target_layer_ids} name layers outside the target's "
                         f"{num_target_layers}")
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    loaded = set()
    for name, t in iterate_tensors(safetensors_files(path), progress=False):
        name = name[len("model."):] if name.startswith("model.") else name
        if name not in params:
            continue
        if tuple(t.shape) != tuple(params[name].shape):
            raise ModelLoadError(f"drafter tensor {name!r} has shape {list(t.shape)}, expected {list(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(t.to(dtype))
        loaded.add(name)
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ModelLoadError(f"drafter checkpoint is missing tensor {missing[0]!r}")
    mask_path = os.path.join(path, "mask_embedding.pt")
    if os.path.isfile(mask_path):
        emb = torch.load(mask_path, map_location="cpu", weights_only=True)
        model.mask_embedding = emb.reshape(-1).to(device=device, dtype=dtype)
    return model.eval()
