"""Kimi-K3 text model (MLA layers, Block AttnRes, latent MoE with SiTU) in the engine.

Checkpoint names and config keys: ``shared/specs/kimi_k3_checkpoint.md``; order of operations of
Block AttnRes: ``shared/specs/attnres_kimi.md``. Accepts ``KimiK3ForConditionalGeneration`` (nested
``text_config``, ``language_model.`` prefix; vision towers skipped) and text-only ``KimiK3ForCausalLM``.
KDA (linear attention) layers (``linear_attn_config.kda_layers``, 1-based) are built by
``models/kimi_linear.py``'s ``make_kda`` (``layers/kda.py``); MLA layers are the others. Routed experts
may be MXFP4-packed (``quantization_config`` compressed-tensors ``mxfp4-pack-quantized``; ``layers/mxfp4.py``).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from longflash.attention.mla import MLAAttention
from longflash.layers.activation import get_act_and_mul
from longflash.layers.attn_res import attn_res_mix
from longflash.layers.mlp import GatedMLP
from longflash.layers.moe import MoE, is_kimi_moe_layer, kimi_router
from longflash.layers.mxfp4 import MXFP4Experts, check_mxfp4_quant_config, routed_experts_packed
from longflash.layers.norm import RMSNorm
from longflash.layers.parallel import ParallelLMHead, VocabParallelEmbedding, model_tp_group
from longflash.layers.rotary import RotaryEmbedding, rope_parameters
from longflash.models.attn_res_plan import ATTN_MIX, MLP_MIX, attn_res_plan, execute_plan
from longflash.models.attn_res_two_phase_mix import AttnResTwoPhase
from longflash.models.base import CausalLM, KVCacheSpec
from longflash.models.kimi_linear import kda_layer_ids, make_kda, mla_kv_cache_spec

logger = logging.getLogger("longflash")

_OTHER_TOWERS = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "audio_tower.")


def text_config(config: dict) -> dict:
    """The flat text config (unwraps ``text_config``; copies a top-level quantization_config up)."""
    if "text_config" in config:
        cfg = dict(config["text_config"])
        for key in ("tie_word_embeddings", "quantization_config"):
            if key in config and key not in cfg:
                cfg[key] = config[key]
        return cfg
    return dict(config)


def check_supported(cfg: dict) -> None:
    """Raises ValueError for config values this engine does not implement."""
    kda_layer_ids(cfg)  # raises for lists that do not partition the layers
    if cfg.get("attn_res_block_size") is None:
        raise ValueError("unsupported config value attn_res_block_size=null (plain residual Kimi models)")
    if cfg.get("quantization_config"):
        check_mxfp4_quant_config(cfg["quantization_config"])


class KimiK3DecoderLayer(nn.Module):
    """One decoder layer: gated MLA, dense (``mlp``) or latent MoE (``block_sparse_moe``) FFN, and
    its AttnRes weights ``self_attention_res_{norm,proj}`` and ``mlp_res_{norm,proj}``."""

    def __init__(self, cfg: dict, layer_idx: int, rotary: RotaryEmbedding | None, is_kda: bool = False, tp=None):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-5)
        self.self_attn = make_kda(cfg) if is_kda else MLAAttention(
            H, cfg["num_attention_heads"], cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["qk_nope_head_dim"],
            cfg["qk_rope_head_dim"], cfg["v_head_dim"], eps, rotary,
            (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5,
            output_gate=cfg.get("mla_use_output_gate", True), tp=tp)
        act = get_act_and_mul(cfg)
        n_exp = cfg.get("num_experts") or 0
        self.is_moe = is_kimi_moe_layer(cfg, layer_idx)
        if self.is_moe:
            router = kimi_router(cfg)
            experts = None
            if routed_experts_packed(cfg.get("quantization_config"), layer_idx):
                act_name = cfg.get("hidden_act", "silu")
                experts = MXFP4Experts(n_exp, cfg.get("routed_expert_hidden_size") or H, cfg["moe_intermediate_size"],
                                       act, "situ" if act_name == "situ" else "silu",
                                       (cfg.get("activation_situ_beta", 4.0), cfg.get("activation_situ_linear_beta", 25.0))
                                       if act_name == "situ" else ())
            self.block_sparse_moe = MoE(H, n_exp, cfg["moe_intermediate_size"], router, act,
                                        cfg.get("num_shared_experts", 0) or 0, cfg.get("routed_expert_hidden_size"),
                                        cfg.get("latent_moe_use_norm", True), eps, experts=experts, tp=tp)
        else:
            self.mlp = GatedMLP(H, cfg["intermediate_size"], act, tp=tp)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attention_res_norm = RMSNorm(H, eps)
        self.self_attention_res_proj = nn.Linear(H, 1, bias=False)
        self.mlp_res_norm = RMSNorm(H, eps)
        self.mlp_res_proj = nn.Linear(H, 1, bias=False)
        self.eps = eps

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if self.is_moe else self.mlp(x)


class KimiK3Model(nn.Module):
    """Embedding, decoder layers, Block AttnRes mixers and final norm; sharded over ``tp`` (None: one
    process; the AttnRes mixers act on the replicated hidden states)."""

    def __init__(self, cfg: dict, tp=None):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-5)
        rotary = None
        if not cfg.get("mla_use_nope", True):
            rotary = RotaryEmbedding(cfg["qk_rope_head_dim"], rope_parameters(cfg),
                                     cfg.get("max_position_embeddings", 4096),
                                     interleave=cfg.get("rope_interleave", False))
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], H, tp=tp)
        kda = kda_layer_ids(cfg)
        self.layers = nn.ModuleList(KimiK3DecoderLayer(cfg, i, rotary, i in kda, tp)
                                    for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(H, eps)
        self.output_attn_res_norm = RMSNorm(H, eps)
        self.output_attn_res_proj = nn.Linear(H, 1, bias=False)
        self.block_size = cfg["attn_res_block_size"]
        self.num_bank_slots = math.ceil(cfg["num_hidden_layers"] / self.block_size)
        self.eps = eps
        # AttnRes output-storage reuse (config key ``attn_res_reuse``, default on): the lifetime plan
        # is built and checked here, once per (num_layers, block size); False allocates every output.
        self.attn_res_reuse = bool(cfg.get("attn_res_reuse", True))
        self.attn_res_schedule, self.attn_res_storage = attn_res_plan(cfg["num_hidden_layers"], self.block_size)
        # Two-phase mixers (config key ``attn_res_two_phase``, default off; ``attn_res_two_phase_mix``):
        # the committed slots are read once per block. Off by default: its fp32 partials cost Q*H*4
        # bytes per token per block (Kimi-K3: ~700 KB/token, ~5x the AttnRes pool), and on an H200 it
        # pays only at decode (a forward's mixers 2.15x faster at 1 token, 0.97-0.99x at 64-4096 tokens;
        # docs/attn_res.md, benchmarks/attn_res_two_phase.py).
        self.attn_res_two_phase = bool(cfg.get("attn_res_two_phase", False))
        self._two_phase = AttnResTwoPhase(cfg["num_hidden_layers"], self.block_size, eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden [T, H]. Block AttnRes order of operations of
        attnres_kimi.md, executed through the storage plan (``attn_res_plan``): every embedding, mixer,
        attention/MLP output and prefix sum is written into its planned view of one per-forward pool
        (or, with ``attn_res_reuse`` off, into its own allocation; the two are bitwise equal). The bank
        and prefix live only for this forward."""
        layers, eps = self.layers, self.eps
        weight = self.embed_tokens.weight

        def weights(l, kind):
            if l is None:
                return self.output_attn_res_norm.weight, self.output_attn_res_proj.weight
            if kind == ATTN_MIX:
                return layers[l].self_attention_res_norm.weight, layers[l].self_attention_res_proj.weight
            assert kind == MLP_MIX
            return layers[l].mlp_res_norm.weight, layers[l].mlp_res_proj.weight

        def mix(l, kind, sources, out):
            return attn_res_mix(sources, *weights(l, kind), eps, out=out)

        def attn(l, h, out):
            return out.copy_(layers[l].self_attn(layers[l].input_layernorm(h)))

        def mlp(l, h, out):
            return out.copy_(layers[l].ffn(layers[l].post_attention_layernorm(h)))

        res = execute_plan(self.attn_res_schedule, self.attn_res_storage, input_ids.shape[0], weight.shape[1],
                           weight.dtype, weight.device,
                           embed=lambda out: self.embed_tokens(input_ids, out=out),
                           mix=self._two_phase.mixer(weights) if self.attn_res_two_phase else mix,
                           attn=attn, mlp=mlp, reuse=self.attn_res_reuse)
        return self.norm(res.y)


class KimiK3ForCausalLM(CausalLM):
    """forward(input_ids [T] int64) -> final-normed hidden [T, H] (reads the forward context)."""

    def __init__(self, config: dict):
        super().__init__()
        cfg = text_config(config)
        check_supported(cfg)
        self.config = cfg
        self.nested = "text_config" in config
        tp = model_tp_group()
        self.model = KimiK3Model(cfg, tp)
        self.lm_head = ParallelLMHead(cfg["hidden_size"], cfg["vocab_size"], tp=tp)
        self._warned_towers = False

    def kv_cache_spec(self) -> KVCacheSpec:
        c = self.config
        return mla_kv_cache_spec(c, c["num_hidden_layers"] - len(kda_layer_ids(c)))

    def remap_checkpoint_name(self, name: str) -> str | None:
        if name.startswith("language_model."):
            name = name[len("language_model."):]
            if name.startswith("layers."):  # vLLM's alias of language_model.model.layers.
                name = "model." + name
        elif any(name.startswith(t) for t in _OTHER_TOWERS):
            if not self._warned_towers:
                logger.warning("skipping non-text towers of the checkpoint (vision/projector tensors)")
                self._warned_towers = True
            return None
        if ".block_sparse_moe.experts." in name:
            name = name.replace(".w1.", ".gate_proj.").replace(".w3.", ".up_proj.").replace(".w2.", ".down_proj.")
        if name.endswith("rotary_emb.inv_freq"):
            return None
        return name
