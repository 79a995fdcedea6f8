"""The default model's config (flat Kimi-K3 text_config schema, kimi_k3_checkpoint.md section 6).

All layers are MLA with RoPE (half-split layout), layer 0 dense, layers 1.. latent MoE; Block
AttnRes with block size 4 over 14 layers (NB = 4 bank slots, the last block, layers 12-13, partial).
"""
from __future__ import annotations

from typing import Any


def default_model_config(vocab_size: int = 8192, bos_token_id: int = 0, eos_token_id: int = 0,
                         pad_token_id: int = 0, **overrides: Any) -> dict[str, Any]:
    """Flat config dict of the embedded default model; `overrides` replace keys (used by tests
    for a tinier model)."""
    cfg: dict[str, Any] = {
        "architectures": ["KimiK3ForCausalLM"],
        "model_type": "kimi_k3",
        "dtype": "bfloat16",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 14,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 128,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "mla_use_nope": False,
        "mla_use_output_gate": True,
        "rope_theta": 10000.0,
        "rope_interleave": False,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 128,
        "routed_expert_hidden_size": 128,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 4,
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "initializer_range": 0.02,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "linear_attn_config": {
            "kda_layers": [],
            "full_attn_layers": [],  # filled below: every layer (1-based) is MLA
            "num_heads": 4,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
    }
    cfg.update(overrides)
    cfg["linear_attn_config"] = dict(cfg["linear_attn_config"])
    cfg["linear_attn_config"]["kda_layers"] = []
    cfg["linear_attn_config"]["full_attn_layers"] = list(range(1, cfg["num_hidden_layers"] + 1))
    return cfg
