"""Tiny random HF checkpoints for tests, built with HF transformers and saved with save_pretrained."""

from __future__ import annotations

import os

import torch


def _randomize_bias(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.rand(buf.shape, generator=g) * 0.5)


def make_deepseek_v3(path: str, *, q_lora: bool = True, interleave: bool = True, yarn: bool = True,
                     vocab_size: int = 256, num_layers: int = 3, seed: int = 0) -> str:
    """Save a tiny DeepSeek-V3 (MLA + grouped MoE with 2 groups) to ``path``; returns ``path``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    rope = None
    if yarn:
        rope = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
    cfg = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, kv_lora_rank=32, q_lora_rank=48 if q_lora else None, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=512,
        rope_interleave=interleave, rope_scaling=rope, bos_token_id=0, eos_token_id=1, initializer_range=0.1)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        _randomize_bias(model, seed)
    model.save_pretrained(path)
    return path


def make_qwen3(path: str, *, tied: bool = True, vocab_size: int = 256, seed: int = 0) -> str:
    """Save a tiny Qwen3 (GQA 4/2 heads, q/k norm) to ``path``; returns ``path``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied,
                      max_position_embeddings=512, bos_token_id=0, eos_token_id=1, initializer_range=0.1)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(path)
    return path


VARIANTS = {
    "dsv3-qlora-interleave-yarn": lambda p: make_deepseek_v3(p),
    "dsv3-noqlora-halfsplit-yarn": lambda p: make_deepseek_v3(p, q_lora=False, interleave=False, seed=1),
    "dsv3-qlora-halfsplit-noyarn": lambda p: make_deepseek_v3(p, interleave=False, yarn=False, seed=2),
    "qwen3-tied": lambda p: make_qwen3(p),
    "qwen3-untied": lambda p: make_qwen3(p, tied=False, seed=3),
}


def build(variant: str, root: str) -> str:
    path = os.path.join(root, variant)
    if not os.path.isdir(path):
        VARIANTS[variant](path)
    return path
