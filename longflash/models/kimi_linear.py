"""Kimi-Linear (``KimiLinearForCausalLM``, e.g. Kimi-Linear-48B-A3B): KDA and NoPE-MLA layers with a
plain residual stream and DeepSeek-style MoE (``block_sparse_moe``). Also the helpers that build KDA
layers for the hybrid Kimi-K3 text model (``models/kimi_k3.py``).

Config: ``linear_attn_config`` with 1-based ``kda_layers`` / ``full_attn_layers`` (layer l, 0-based, is
KDA iff l+1 is in ``kda_layers``), ``num_heads``, ``head_dim``, ``short_conv_kernel_size``, and for Kimi-K3
``use_full_rank_gate`` and ``gate_lower_bound``. A config whose ``architectures`` is
``KimiLinearForCausalLM`` but carries ``attn_res_block_size`` (Kimi-K3's text config) is built as Kimi-K3.
Reference for parity tests: HF transformers ``KimiLinearForCausalLM`` (its modules are renamed; the
checkpoint names are the ones here).
"""

from __future__ import annotations

import torch

from longflash.attention.mla import MLAAttention
from longflash.layers.activation import get_act_and_mul
from longflash.layers.kda import KimiDeltaAttention
from longflash.layers.mlp import GatedMLP
from longflash.layers.moe import MoE, is_kimi_moe_layer, kimi_router
from longflash.layers.norm import RMSNorm
from longflash.layers.parallel import ParallelLMHead, model_tp_group
from longflash.models.base import CausalLM, DecoderStack, KVCacheSpec, PreNormDecoderLayer


def kda_layer_ids(cfg: dict) -> set[int]:
    """0-based ids of the KDA layers (``linear_attn_config.kda_layers`` is 1-based).

    Raises ValueError when the two 1-based lists overlap or leave a layer out.
    """
    lac = cfg.get("linear_attn_config") or {}
    kda = {int(i) - 1 for i in lac.get("kda_layers") or []}
    if kda and "full_attn_layers" in lac:
        full = {int(i) - 1 for i in lac["full_attn_layers"]}
        n = cfg["num_hidden_layers"]
        if kda & full or (kda | full) != set(range(n)):
            raise ValueError(f"linear_attn_config: kda_layers and full_attn_layers (1-based) must partition 1..{n}")
    return kda


def make_kda(cfg: dict) -> KimiDeltaAttention:
    """A KDA layer from ``linear_attn_config``. Raises NotImplementedError under tensor parallelism
    (KDA heads are not sharded yet)."""
    if model_tp_group() is not None:
        raise NotImplementedError("tensor parallelism for models with KDA (linear attention) layers is not "
                                  "implemented; run with tensor_parallel_size 1")
    lac = cfg["linear_attn_config"]
    return KimiDeltaAttention(cfg["hidden_size"], lac["num_heads"], lac["head_dim"], lac.get("short_conv_kernel_size", 4),
                              cfg.get("rms_norm_eps", 1e-5), bool(lac.get("use_full_rank_gate", False)),
                              lac.get("gate_lower_bound"))


def mla_kv_cache_spec(cfg: dict, num_mla_layers: int) -> KVCacheSpec:
    return KVCacheSpec(num_mla_layers, (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"],), 1)


class KimiLinearDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: dict, layer_idx: int, is_kda: bool, tp=None):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-5)
        if is_kda:
            self.self_attn = make_kda(cfg)
        else:
            if not cfg.get("mla_use_nope", True):
                raise ValueError("unsupported config value mla_use_nope=false for KimiLinearForCausalLM")
            # NOTE: Kimi-Linear's q_a/kv_a layernorms use the class default eps 1e-6 (HF, official code).
            self.self_attn = MLAAttention(
                H, cfg["num_attention_heads"], cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["qk_nope_head_dim"],
                cfg["qk_rope_head_dim"], cfg["v_head_dim"], 1e-6, None,
                (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5,
                output_gate=cfg.get("mla_use_output_gate", False), tp=tp)
        act = get_act_and_mul(cfg)
        self.is_moe = is_kimi_moe_layer(cfg, layer_idx)
        if self.is_moe:
            self.block_sparse_moe = MoE(H, cfg["num_experts"], cfg["moe_intermediate_size"], kimi_router(cfg), act,
                                        cfg.get("num_shared_experts", 0) or 0, tp=tp)
        else:
            self.mlp = GatedMLP(H, cfg["intermediate_size"], act, tp=tp)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(h) if self.is_moe else self.mlp(h)


def build_kimi_linear_stack(cfg: dict, tp=None) -> DecoderStack:
    """Embedding, decoder layers and final norm; sharded over ``tp`` (None: one process)."""
    kda = kda_layer_ids(cfg)
    layers = [KimiLinearDecoderLayer(cfg, i, i in kda, tp) for i in range(cfg["num_hidden_layers"])]
    return DecoderStack(cfg["vocab_size"], cfg["hidden_size"], layers, cfg.get("rms_norm_eps", 1e-5), tp)


class KimiLinearForCausalLM(CausalLM):
    """forward(input_ids [T] int64) -> final-normed hidden [T, H] (reads the forward context)."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = dict(config)
        tp = model_tp_group()
        self.model = build_kimi_linear_stack(self.config, tp)
        self.lm_head = ParallelLMHead(config["hidden_size"], config["vocab_size"], tp=tp)
        self.num_mla_layers = config["num_hidden_layers"] - len(kda_layer_ids(config))

    def kv_cache_spec(self) -> KVCacheSpec:
        return mla_kv_cache_spec(self.config, self.num_mla_layers)

    def remap_checkpoint_name(self, name: str) -> str | None:
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= self.config["num_hidden_layers"]:
            return None  # MTP layers
        if ".block_sparse_moe.experts." in name:
            name = name.replace(".w1.", ".gate_proj.").replace(".w3.", ".up_proj.").replace(".w2.", ".down_proj.")
        if name.endswith("rotary_emb.inv_freq"):
            return None
        return name


def build_kimi_linear(config: dict) -> CausalLM:
    """Registry entry of ``KimiLinearForCausalLM``: Kimi-K3 text configs (nested ``text_config`` or
    ``attn_res_block_size`` set) are built as ``KimiK3ForCausalLM``, others as Kimi-Linear."""
    if "text_config" in config or config.get("attn_res_block_size") is not None:
        from longflash.models.kimi_k3 import KimiK3ForCausalLM
        return KimiK3ForCausalLM(config)
    return KimiLinearForCausalLM(config)
