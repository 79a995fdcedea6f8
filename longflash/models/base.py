"""What every causal LM in the registry provides to the model runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from longflash.layers.parallel import VocabParallelEmbedding


@dataclass
class KVCacheSpec:
    """Per-layer paged cache layout.

    ``row_shape`` is the shape of one token's entry: MLA ``(kv_lora_rank + qk_rope_head_dim,)``;
    GQA ``(num_kv_heads, head_dim)`` for each of K and V (``num_planes`` = 2).
    """

    num_layers: int
    row_shape: tuple[int, ...]
    num_planes: int  # 1 for an MLA latent cache, 2 for separate K and V

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of KV per token over all layers."""
        n = 1
        for d in self.row_shape:
            n *= d
        return n * self.num_planes * self.num_layers * torch.empty((), dtype=dtype).element_size()

    def block_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        if self.num_planes == 1:
            return (num_blocks, block_size, *self.row_shape)
        return (self.num_planes, num_blocks, block_size, *self.row_shape)


class PreNormDecoderLayer(nn.Module):
    """A pre-norm residual layer ``x += self_attn(input_layernorm(x)); x += feed_forward(
    post_attention_layernorm(x))`` (DeepSeek-V3, Qwen3, Kimi-Linear) that carries the residual stream
    apart for :class:`DecoderStack`: (x, residual) -> (feed-forward output, residual stream), the
    hidden state (HF's) being their sum; each add happens inside the next norm (``RMSNorm(x, residual)``,
    one launch on the GPU; vLLM's fused_add_rms_norm convention), with the same arithmetic.
    Subclasses set ``self_attn``, ``input_layernorm``, ``post_attention_layernorm`` and ``mlp`` (or
    override :meth:`feed_forward`)."""

    carries_residual = True

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(h)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h), residual)
        return self.feed_forward(h), residual


class DecoderStack(nn.Module):
    """``embed_tokens`` → pre-norm residual layers → ``norm`` (DeepSeek-V3, Qwen3, Kimi-Linear).

    Each layer maps hidden [T, H] -> [T, H], or, when it has ``carries_residual = True``, takes and
    returns ``(x, residual)`` with the residual stream kept apart (its hidden state is x + residual;
    residual None on the first layer): the add then joins the next norm, ``RMSNorm(x, residual)``
    (vLLM's fused_add_rms_norm convention). forward(input_ids [T]) -> final-normed hidden [T, H].
    ``embed_tokens`` is vocab-parallel over ``tp`` (None: the full table).
    """

    def __init__(self, vocab_size: int, hidden_size: int, layers, rms_norm_eps: float, tp=None):
        super().__init__()
        from longflash.layers.norm import RMSNorm
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size, tp=tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            if getattr(layer, "carries_residual", False):
                x, residual = layer(x, residual)
                continue
            if residual is not None:
                x, residual = x + residual, None
            x = layer(x)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class CausalLM(nn.Module):
    """Base class: subclasses define ``model`` (with ``embed_tokens``, ``layers``, ``norm``) and
    ``lm_head``, ``kv_cache_spec()``, and may override ``remap_checkpoint_name``.

    Under tensor parallelism (``layers.parallel.model_tp_group()`` at construction) the weights are
    this rank's shards, ``forward`` and ``compute_logits`` are collectives over the TP group (every rank
    calls them with the same shapes), and their results are replicated on every rank.
    """

    config: dict

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> final-normed hidden [T, H] (reads the forward context)."""
        return self.model(input_ids)

    def attention_layers(self) -> list[nn.Module]:
        """Modules holding a ``kv_cache`` attribute, in layer order."""
        return [m for m in self.modules() if hasattr(m, "kv_cache")]

    def recurrent_state_layers(self) -> list[nn.Module]:
        """Linear-attention (KDA) modules holding per-request recurrent state, in layer order."""
        return [m for m in self.modules() if hasattr(m, "state_shapes")]

    def kv_cache_spec(self) -> KVCacheSpec:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [N, H] -> logits [N, vocab] fp32."""
        return self.lm_head(hidden).float()

    def remap_checkpoint_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> parameter name, or None to skip the tensor."""
        return name

    def tie_weights_if_needed(self, loaded: set[str]) -> set[str]:
        """Tie ``lm_head`` to the embedding when the config asks for it (or the checkpoint lacks it)."""
        if "lm_head.weight" not in loaded and self.config.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
            loaded = loaded | {"lm_head.weight"}
        return loaded
