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


def make_drafter(path: str, target_config: dict, *, block_size: int = 4, num_layers: int = 2, mask_token_id: int = 3,
                 target_layer_ids: list[int] | None = None, seed: int = 0, scale: float = 0.1,
                 layer_types: list[str] | None = None, sliding_window: int | None = None) -> str:
    """Save a random-weights DFlash drafter (z-lab ``DFlashDraftModel`` format) for a target config."""
    import json

    from safetensors.torch import save_file

    H = target_config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
           "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "intermediate_size": 2 * H, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
           "vocab_size": target_config["vocab_size"], "block_size": block_size,
           "num_target_layers": target_config["num_hidden_layers"],
           "dflash_config": {"mask_token_id": mask_token_id}}
    if target_layer_ids is not None:
        cfg["dflash_config"]["target_layer_ids"] = target_layer_ids
    if layer_types is not None:
        cfg["layer_types"], cfg["sliding_window"] = layer_types, sliding_window
    from longflash.spec_decode.dflash_config import DFlashConfig
    from longflash.spec_decode.dflash_model import DFlashDraftModel
    dcfg = DFlashConfig.from_dict(cfg, target_config["num_hidden_layers"])
    model = DFlashDraftModel(dcfg)
    sd = {}
    for name, p in model.named_parameters():
        sd[name] = torch.ones(p.shape) if p.dim() == 1 else torch.randn(p.shape, generator=g) * scale
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(sd, os.path.join(path, "model.safetensors"))
    return path
