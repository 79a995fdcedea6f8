"""DeepSeek-V3 / Kimi-K2 (``DeepseekV3ForCausalLM``): MLA + DeepSeekMoE, HF checkpoint layout.

Reference implementation for parity tests: HF transformers ``DeepseekV3ForCausalLM``.
"""

from __future__ import annotations

from longflash.attention.mla import MLAAttention
from longflash.layers.activation import get_act_and_mul
from longflash.layers.mlp import GatedMLP
from longflash.layers.moe import MoE, TopkRouter
from longflash.layers.norm import RMSNorm
from longflash.layers.parallel import ParallelLMHead, model_tp_group
from longflash.layers.rotary import RotaryEmbedding, rope_parameters, softmax_scale_mscale
from longflash.models.base import CausalLM, DecoderStack, KVCacheSpec, PreNormDecoderLayer


def _is_moe_layer(cfg: dict, layer_idx: int) -> bool:
    n_routed = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    return (n_routed > 0 and layer_idx >= cfg.get("first_k_dense_replace", 0)
            and layer_idx % cfg.get("moe_layer_freq", 1) == 0)


class DeepseekV3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: dict, layer_idx: int, rotary: RotaryEmbedding, softmax_scale: float, tp=None):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = MLAAttention(
            H, cfg["num_attention_heads"], cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["qk_nope_head_dim"],
            cfg["qk_rope_head_dim"], cfg["v_head_dim"], eps, rotary, softmax_scale, tp=tp)
        act = get_act_and_mul(cfg)
        if _is_moe_layer(cfg, layer_idx):
            n_routed = cfg.get("n_routed_experts") or cfg.get("num_experts")
            router = TopkRouter(H, n_routed, cfg["num_experts_per_tok"], cfg.get("n_group") or 1,
                                cfg.get("topk_group") or 1, cfg.get("norm_topk_prob", True),
                                cfg.get("routed_scaling_factor", 1.0), cfg.get("scoring_func", "sigmoid"),
                                use_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc")
            self.mlp = MoE(H, n_routed, cfg["moe_intermediate_size"], router, act, cfg.get("n_shared_experts") or 0,
                           tp=tp)
        else:
            self.mlp = GatedMLP(H, cfg["intermediate_size"], act, tp=tp)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)



def build_deepseek_v3_stack(cfg: dict, tp=None) -> DecoderStack:
    """Embedding, decoder layers and final norm; sharded over ``tp`` (None: one process)."""
    params = rope_parameters(cfg)
    rotary = RotaryEmbedding(cfg["qk_rope_head_dim"], params, cfg.get("max_position_embeddings", 4096),
                             interleave=cfg.get("rope_interleave", True))
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5 * softmax_scale_mscale(params)
    layers = [DeepseekV3DecoderLayer(cfg, i, rotary, scale, tp) for i in range(cfg["num_hidden_layers"])]
    return DecoderStack(cfg["vocab_size"], cfg["hidden_size"], layers, cfg.get("rms_norm_eps", 1e-6), tp)


class DeepseekV3ForCausalLM(CausalLM):
    """forward(input_ids [T] int64) -> final-normed hidden [T, H] (reads the forward context)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.config = cfg
        tp = model_tp_group()
        self.model = build_deepseek_v3_stack(cfg, tp)
        self.lm_head = ParallelLMHead(cfg["hidden_size"], cfg["vocab_size"], tp=tp)

    def kv_cache_spec(self) -> KVCacheSpec:
        c = self.config
        return KVCacheSpec(c["num_hidden_layers"], (c["kv_lora_rank"] + c["qk_rope_head_dim"],), 1)

    def remap_checkpoint_name(self, name: str) -> str | None:
        # Multi-token-prediction layers (model.layers.{N..}) are not used for decoding.
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= self.config["num_hidden_layers"]:
                return None
        if name.endswith("rotary_emb.inv_freq"):
            return None
        return name
