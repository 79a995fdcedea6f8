"""Qwen3 dense models (``Qwen3ForCausalLM``): GQA with per-head q/k RMSNorm, RoPE, SwiGLU.

Reference implementation for parity tests: HF transformers ``Qwen3ForCausalLM``.
"""

from __future__ import annotations

from longflash.attention.gqa import GQAAttention
from longflash.layers.activation import get_act_and_mul
from longflash.layers.mlp import GatedMLP
from longflash.layers.norm import RMSNorm
from longflash.layers.parallel import ParallelLMHead, model_tp_group
from longflash.layers.rotary import RotaryEmbedding, rope_parameters
from longflash.models.base import CausalLM, DecoderStack, KVCacheSpec, PreNormDecoderLayer


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


class Qwen3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: dict, rotary: RotaryEmbedding, tp=None):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = GQAAttention(H, cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                                      _head_dim(cfg), rotary, eps, qk_norm=True, bias=cfg.get("attention_bias", False),
                                      tp=tp)
        self.mlp = GatedMLP(H, cfg["intermediate_size"], get_act_and_mul(cfg), tp=tp)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)



def build_qwen3_stack(cfg: dict, tp=None) -> DecoderStack:
    """Embedding, decoder layers and final norm; sharded over ``tp`` (None: one process)."""
    if cfg.get("use_sliding_window"):
        raise ValueError("unsupported config value use_sliding_window=true for Qwen3")
    rotary = RotaryEmbedding(_head_dim(cfg), rope_parameters(cfg), cfg.get("max_position_embeddings", 32768))
    layers = [Qwen3DecoderLayer(cfg, rotary, tp) for _ in range(cfg["num_hidden_layers"])]
    return DecoderStack(cfg["vocab_size"], cfg["hidden_size"], layers, cfg.get("rms_norm_eps", 1e-6), tp)


class Qwen3ForCausalLM(CausalLM):
    """forward(input_ids [T] int64) -> final-normed hidden [T, H] (reads the forward context)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.config = cfg
        tp = model_tp_group()
        self.model = build_qwen3_stack(cfg, tp)
        self.lm_head = ParallelLMHead(cfg["hidden_size"], cfg["vocab_size"], tp=tp)

    def kv_cache_spec(self) -> KVCacheSpec:
        """K and V planes of this rank's KV heads (all of them in one process)."""
        attn = self.model.layers[0].self_attn
        return KVCacheSpec(self.config["num_hidden_layers"], (attn.num_kv_heads, attn.head_dim), 2)

    def remap_checkpoint_name(self, name: str) -> str | None:
        if name.endswith("rotary_emb.inv_freq"):
            return None
        return name
