"""Full-sequence PyTorch reference of the (text-only) Kimi-K3 architecture, used to train the
embedded default model and as the logits reference that the engine is tested against.

Everything here is written straight from the project specs:
  * /work/shared/specs/attnres_kimi.md  -- Block AttnRes mixer and its order of operations, MLA with
    sigmoid output gate, latent MoE with sigmoid/noaux_tc router, SiTU activation.
  * /work/shared/specs/kimi_k3_checkpoint.md -- tensor names and shapes (sections 1-5), flat config
    keys (section 6). Our default model is text-only, so names carry no `language_model.` prefix, and
    all layers are MLA *with* RoPE (`mla_use_nope: false`, `rope_theta`), half-split (NeoX /
    rotate_half) layout on the `qk_rope_head_dim` part (`rope_interleave: false`).

No paging, no KV cache, no fused kernels: one causal forward over whole sequences
(`F.scaled_dot_product_attention(is_causal=True)`, positions 0..T-1 for every row).

Numerics (these are part of the contract the engine's tests rely on):
  * every RMSNorm is `w * x / sqrt(mean(x^2) + eps)` computed in fp32 and cast back to x's dtype,
    eps = `rms_norm_eps` for all of them (incl. q_a_layernorm, kv_a_layernorm, routed_expert_norm);
  * the AttnRes mixer (scores, softmax, weighted sum) runs in fp32 and casts back to the dtype of
    the source rows;
  * the router runs in fp32 (`sigmoid(x.float() @ W.float().T)`), autocast disabled;
  * logits are returned in fp32.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "KimiK3TrainModel",
    "rms_norm",
    "attn_res_mix",
    "situ",
    "apply_rope_half",
    "rope_cos_sin",
    "load_config",
]


# ----------------------------------------------------------------------------- primitives


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm `weight * x / sqrt(mean(x^2) + eps)`.

    Args:
        x: [..., D] any float dtype.
        weight: [D].
        eps: added inside the square root.
    Returns:
        [..., D] in x's dtype; the computation runs in fp32.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm module with a single `weight` [D] parameter (initialised to ones)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def attn_res_mix(
    sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """AttnResMix(rows) = sum_j p_j * rows_j, p = softmax_j(s_j),
    s_j = sum_d w[d] * g[d] * rows_j[d] / sqrt(mean_d(rows_j^2) + eps)   (attnres_kimi.md "The mixer").

    Keys are RMS-normalised rows, values are the raw rows, no 1/sqrt(d). Scores, softmax and the
    weighted sum run in fp32; the result is cast back to the dtype of the first source.
    With a single source the result is that source exactly (softmax of one score is 1.0).

    Args:
        sources: list of S tensors [..., H] (bank slots in order, then the prefix).
        norm_weight: [H], the `*_res_norm.weight` (g).
        proj_weight: [1, H], the `*_res_proj.weight` (pseudo-query w, Linear H->1 without bias).
        eps: rms_norm_eps.
    Returns:
        [..., H] in the dtype of sources[0].
    """
    out_dtype = sources[0].dtype
    rows = torch.stack([s.float() for s in sources], dim=-2)  # [..., S, H] fp32
    q = proj_weight.float().reshape(-1) * norm_weight.float()  # fused w*g, [H] fp32
    keys = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
    scores = (keys * q).sum(-1)  # [..., S]
    p = torch.softmax(scores, dim=-1)
    out = (p.unsqueeze(-1) * rows).sum(-2)
    return out.to(out_dtype)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU activation `beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)`
    (kimi_k3_checkpoint.md section 5; K3 uses beta=4, linear_beta=25). Shapes broadcast; dtype of g."""
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for half-split (NeoX, rotate_half) RoPE.

    inv_freq[i] = theta^(-2i/rotary_dim), i < rotary_dim/2; freqs = pos * inv_freq;
    emb = cat(freqs, freqs). Computed in fp32.

    Args:
        positions: [T] integer positions.
    Returns:
        (cos, sin), each [T, rotary_dim] fp32.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE: `x*cos + rotate_half(x)*sin`, rotate_half(x) = cat(-x2, x1) with
    x1 = x[..., :d/2], x2 = x[..., d/2:]. x: [B, T, N, d]; cos/sin: [T, d] fp32. Returns x's dtype.
    Computed in fp32."""
    xf = x.float()
    d = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., d:], xf[..., :d]], dim=-1)
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    return (xf * c + rot * s).to(x.dtype)


def load_config(path_or_dict: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    """Accept a config dict, a config.json path or a model directory; return the flat text config.
    A nested K3 `text_config` is unwrapped."""
    if isinstance(path_or_dict, dict):
        cfg = dict(path_or_dict)
    else:
        p = str(path_or_dict)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        with open(p) as f:
            cfg = json.load(f)
    if "text_config" in cfg:
        cfg = dict(cfg["text_config"])
    return cfg


# ----------------------------------------------------------------------------- attention


class MLAAttention(nn.Module):
    """Multi-head latent attention with q-LoRA, RoPE on the qk_rope part and a sigmoid output gate.

    Tensors (checkpoint section 3), shapes [out, in]:
      q_a_proj [rq, H], q_a_layernorm [rq], q_b_proj [Nh*(dn+dr), rq]  (head-major, [nope | rope]),
      kv_a_proj_with_mqa [rkv+dr, H] (output [latent | k_rot], k_rot shared by all heads),
      kv_a_layernorm [rkv], kv_b_proj [Nh*(dn+dv), rkv] (head-major, [k_nope | v]),
      g_proj [Nh*dv, H], o_proj [H, Nh*dv].
    Output: `o_proj(attn * sigmoid(g_proj(x)))` with x the (input_layernorm-ed) layer input.
    Softmax scale (dn+dr)^-0.5.
    """

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        H = cfg["hidden_size"]
        self.nh = cfg["num_attention_heads"]
        self.dn = cfg["qk_nope_head_dim"]
        self.dr = cfg["qk_rope_head_dim"]
        self.dv = cfg["v_head_dim"]
        self.rq = cfg["q_lora_rank"]
        self.rkv = cfg["kv_lora_rank"]
        self.eps = cfg["rms_norm_eps"]
        self.use_rope = not cfg.get("mla_use_nope", False)
        self.rope_theta = float(cfg.get("rope_theta", 10000.0))
        if cfg.get("rope_interleave", False):
            raise ValueError("only the half-split (rope_interleave: false) RoPE layout is implemented")
        if cfg.get("rope_scaling"):
            raise ValueError("rope_scaling is not supported by the training module")
        if self.rq is None:
            raise ValueError("q_lora_rank null (q_proj path) is not used by the default model")
        self.use_gate = cfg.get("mla_use_output_gate", True)
        self.scale = (self.dn + self.dr) ** -0.5
        self.q_a_proj = nn.Linear(H, self.rq, bias=False)
        self.q_a_layernorm = RMSNorm(self.rq, self.eps)
        self.q_b_proj = nn.Linear(self.rq, self.nh * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.rkv + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rkv, self.eps)
        self.kv_b_proj = nn.Linear(self.rkv, self.nh * (self.dn + self.dv), bias=False)
        if self.use_gate:
            self.g_proj = nn.Linear(H, self.nh * self.dv, bias=False)
        self.o_proj = nn.Linear(self.nh * self.dv, H, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                cache: Any = None) -> torch.Tensor:
        """x: [B, T, H] (already input_layernorm-ed); cos/sin: [T, dr] fp32 at the rows' positions.
        ``cache``: None (causal over the T rows), or a per-layer KV cache with
        ``attend(q, k, v, scale) -> o`` ([B, Nh, T, d] each) that appends k/v after the cached rows and
        attends over all of them (``longflash.training.kv_cache``). Returns [B, T, H]."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, self.nh, self.dn + self.dr)
        q_nope, q_pe = q[..., : self.dn], q[..., self.dn :]
        kv_a = self.kv_a_proj_with_mqa(x)
        kv_c, k_pe = kv_a[..., : self.rkv], kv_a[..., self.rkv :]
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_c)).view(B, T, self.nh, self.dn + self.dv)
        k_nope, v = kv[..., : self.dn], kv[..., self.dn :]
        k_pe = k_pe.view(B, T, 1, self.dr)
        if self.use_rope:
            q_pe = apply_rope_half(q_pe, cos, sin)
            k_pe = apply_rope_half(k_pe, cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(B, T, self.nh, self.dr)], dim=-1)
        dqk = self.dn + self.dr
        # NOTE: zero-padding v to the qk width changes no value (the pad columns of the output are
        # sliced off) and lets every SDPA backend (incl. flash) take the call.
        if self.dv < dqk:
            v = F.pad(v, (0, dqk - self.dv))
        if cache is None:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.scale
            )  # [B, Nh, T, dqk]
        else:
            o = cache.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scale)
        o = o.transpose(1, 2)[..., : self.dv].reshape(B, T, self.nh * self.dv)
        if self.use_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)


# ----------------------------------------------------------------------------- MLPs


class SiTUMLP(nn.Module):
    """gate/up/down MLP with SiTU: `down(situ(gate(x), up(x)))`. Used for the dense layer-0 MLP
    (`mlp.*`, intermediate_size) and the fused shared experts (`shared_experts.*`,
    moe_intermediate_size * num_shared_experts)."""

    def __init__(self, hidden: int, inter: int, beta: float, lbeta: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.beta, self.lbeta = beta, lbeta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), self.beta, self.lbeta))


class Expert(nn.Module):
    """One routed expert in the latent width Lt: w1 = gate [Im, Lt], w3 = up [Im, Lt], w2 = down [Lt, Im]."""

    def __init__(self, lt: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(lt, inter, bias=False)
        self.w2 = nn.Linear(inter, lt, bias=False)
        self.w3 = nn.Linear(lt, inter, bias=False)


class Router(nn.Module):
    """`block_sparse_moe.gate`: weight [E, H] and the fp32 buffer `e_score_correction_bias` [E]."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))


class LatentMoE(nn.Module):
    """Kimi-K3 latent MoE (checkpoint section 5):
      1. s = sigmoid(fp32 gate(x)) on the un-projected x;
      2. top-k on s + e_score_correction_bias (noaux_tc, one group); weights = s[topk], renormalised
         (sum + 1e-20) and multiplied by routed_scaling_factor;
      3. y = routed_expert_up_proj(routed_expert_norm(sum_k w_k * expert_k(routed_expert_down_proj(x))))
             + shared_experts(x).

    Implementation note: every expert is evaluated on every token and multiplied by a dense
    [N, E] weight matrix that is zero outside the top-k. This is the same function (0 * finite = 0)
    and is fast for the small expert counts of the default model. The summation over experts runs
    in expert-index order. `last_expert_counts` ([E] fp32, tokens routed to each expert in the last
    forward) is kept for the aux-loss-free bias update in training.
    """

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        H = cfg["hidden_size"]
        self.E = cfg["num_experts"]
        self.k = cfg["num_experts_per_token"]
        self.lt = cfg["routed_expert_hidden_size"]
        inter = cfg["moe_intermediate_size"]
        self.eps = cfg["rms_norm_eps"]
        self.beta = cfg.get("activation_situ_beta", 4.0)
        self.lbeta = cfg.get("activation_situ_linear_beta", 25.0)
        self.renorm = cfg.get("moe_renormalize", True)
        self.scaling = cfg.get("routed_scaling_factor", 1.0)
        if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ValueError("only the sigmoid router is implemented")
        if cfg.get("num_expert_group", 1) != 1 or cfg.get("topk_group", 1) != 1:
            raise ValueError("only one expert group is implemented")
        if self.lt is None:
            raise ValueError("routed_expert_hidden_size null (no latent projection) is not used")
        self.gate = Router(H, self.E)
        self.routed_expert_down_proj = nn.Linear(H, self.lt, bias=False)
        if cfg.get("latent_moe_use_norm", True):
            self.routed_expert_norm = RMSNorm(self.lt, self.eps)
        else:
            self.routed_expert_norm = None
        self.routed_expert_up_proj = nn.Linear(self.lt, H, bias=False)
        self.experts = nn.ModuleList([Expert(self.lt, inter) for _ in range(self.E)])
        ns = cfg.get("num_shared_experts", 0) or 0
        self.shared_experts = SiTUMLP(H, inter * ns, self.beta, self.lbeta) if ns > 0 else None
        self.last_expert_counts: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, H]. Returns (topk_idx [N, k] int64, topk_w [N, k] fp32)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            s = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))  # [N, E] fp32
            choice = s + self.gate.e_score_correction_bias.float()
            idx = torch.topk(choice, self.k, dim=-1, sorted=True).indices
            w = s.gather(-1, idx)
            if self.renorm:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            w = w * self.scaling
        return idx, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] (post_attention_layernorm-ed). Returns [B, T, H]."""
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        idx, w = self.route(xf)
        with torch.no_grad():  # scatter_add, not bincount: no host sync on CUDA
            flat = idx.reshape(-1)
            self.last_expert_counts = torch.zeros(self.E, dtype=torch.float32, device=x.device).scatter_add_(
                0, flat, torch.ones_like(flat, dtype=torch.float32))
        dense_w = torch.zeros(xf.shape[0], self.E, dtype=torch.float32, device=x.device).scatter(-1, idx, w)
        z = self.routed_expert_down_proj(xf)  # [N, Lt]
        W1 = torch.stack([e.w1.weight for e in self.experts])  # [E, Im, Lt]
        W3 = torch.stack([e.w3.weight for e in self.experts])
        W2 = torch.stack([e.w2.weight for e in self.experts])  # [E, Lt, Im]
        g = torch.einsum("nl,eil->nei", z, W1.to(z.dtype))
        u = torch.einsum("nl,eil->nei", z, W3.to(z.dtype))
        a = situ(g, u, self.beta, self.lbeta)
        y = torch.einsum("nei,eli->nel", a, W2.to(a.dtype))
        routed = (y * dense_w.to(y.dtype).unsqueeze(-1)).sum(1)  # [N, Lt]
        if self.routed_expert_norm is not None:
            routed = self.routed_expert_norm(routed)
        out = self.routed_expert_up_proj(routed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(xf)
        return out.reshape(shp)


# ----------------------------------------------------------------------------- decoder


class DecoderLayer(nn.Module):
    """One Kimi-K3 decoder layer (MLA + dense-or-MoE MLP) with its Block-AttnRes tensors
    `self_attention_res_{norm,proj}` and `mlp_res_{norm,proj}` (checkpoint section 2)."""

    def __init__(self, cfg: dict[str, Any], layer_idx: int):
        super().__init__()
        H = cfg["hidden_size"]
        eps = cfg["rms_norm_eps"]
        self.layer_idx = layer_idx
        self.eps = eps
        lac = cfg.get("linear_attn_config")
        if lac and lac.get("kda_layers") and (layer_idx + 1) in lac["kda_layers"]:
            raise ValueError("KDA layers are not implemented by the training module")
        self.self_attn = MLAAttention(cfg)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attention_res_norm = RMSNorm(H, eps)
        self.mlp_res_norm = RMSNorm(H, eps)
        self.self_attention_res_proj = nn.Linear(H, 1, bias=False)
        self.mlp_res_proj = nn.Linear(H, 1, bias=False)
        fk = cfg.get("first_k_dense_replace", 1)
        freq = cfg.get("moe_layer_freq", 1)
        self.is_moe = layer_idx >= fk and layer_idx % freq == 0 and cfg.get("num_experts")
        beta = cfg.get("activation_situ_beta", 4.0)
        lbeta = cfg.get("activation_situ_linear_beta", 25.0)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(cfg)
        else:
            self.mlp = SiTUMLP(H, cfg["intermediate_size"], beta, lbeta)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if self.is_moe else self.mlp(x)


class KimiK3TrainModel(nn.Module):
    """Text-only Kimi-K3 causal LM (all-MLA with RoPE, Block AttnRes, latent MoE), full-sequence.

    Args:
        config: flat text config dict (kimi_k3_checkpoint.md section 6 keys), a config.json path
            or a model directory (a nested `text_config` is unwrapped).

    `state_dict()` keys equal the checkpoint tensor names without the `language_model.` prefix,
    e.g. `model.layers.3.block_sparse_moe.experts.5.w1.weight`, `lm_head.weight`.

    forward(input_ids [B, T] int64) -> logits [B, T, vocab] fp32. Positions are 0..T-1, attention is
    causal over the whole row (no document masking).
    """

    def __init__(self, config: dict[str, Any] | str | os.PathLike):
        super().__init__()
        cfg = load_config(config)
        self.config = cfg
        H = cfg["hidden_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.bs = cfg["attn_res_block_size"]
        if self.bs is None:
            raise ValueError("attn_res_block_size null (plain residual) is not implemented")
        self.nb = math.ceil(self.num_layers / self.bs)
        self.eps = cfg["rms_norm_eps"]
        if cfg.get("tie_word_embeddings", False):
            raise ValueError("tied embeddings are not used by Kimi-K3")
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg["vocab_size"], H)
        self.model.layers = nn.ModuleList([DecoderLayer(cfg, l) for l in range(self.num_layers)])
        self.model.norm = RMSNorm(H, self.eps)
        self.model.output_attn_res_norm = RMSNorm(H, self.eps)
        self.model.output_attn_res_proj = nn.Linear(H, 1, bias=False)
        self.lm_head = nn.Linear(H, cfg["vocab_size"], bias=False)
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) for projections and embeddings; output projections (o_proj,
        down_proj, w2, routed_expert_up_proj) scaled by 1/sqrt(2*num_layers); RMSNorm weights 1;
        AttnRes pseudo-queries zero (uniform mixing at init, as in the AttnRes paper);
        e_score_correction_bias zero."""
        std = self.config.get("initializer_range", 0.02)
        out_std = std / math.sqrt(2 * self.num_layers)
        for name, p in self.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            elif any(s in name for s in ("o_proj", "down_proj.", "w2", "routed_expert_up_proj")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)
        for m in self.modules():
            if isinstance(m, Router):
                m.e_score_correction_bias.zero_()

    # ------------------------------------------------------------------ forward
    def hidden_states(self, input_ids: torch.Tensor, cache: Any = None) -> torch.Tensor:
        """Final hidden states after model.norm: [B, T, H] (activation dtype).

        With a ``cache`` (``longflash.training.kv_cache.KVCache``) the rows sit at positions
        ``cache.length .. cache.length + T - 1``, attend to the cached rows too, and are appended to
        the cache (incremental decoding); without one they sit at 0..T-1."""
        B, T = input_ids.shape
        cfg = self.config
        h = self.model.embed_tokens(input_ids)
        start = 0 if cache is None else cache.length
        cos = sin = None
        if not cfg.get("mla_use_nope", False):
            cos, sin = rope_cos_sin(
                torch.arange(start, start + T, device=input_ids.device), cfg["qk_rope_head_dim"],
                float(cfg.get("rope_theta", 10000.0))
            )
        bank: list[torch.Tensor] = []  # committed block sums; slot 0 = embedding
        prefix = h  # running sum inside the current block; starts as the embedding
        for l, layer in enumerate(self.model.layers):
            n = math.ceil(l / self.bs)
            wr = l % self.bs == 0
            assert len(bank) == n
            # 1. mixture for the attention sublayer
            x = attn_res_mix(bank[:n] + [prefix], layer.self_attention_res_norm.weight,
                             layer.self_attention_res_proj.weight, self.eps)
            # 2. commit the old prefix at a block boundary (l = 0 stores the embedding)
            if wr:
                bank.append(prefix)
            # 3. attention on the normed mixture
            a = layer.self_attn(layer.input_layernorm(x), cos, sin, None if cache is None else cache.layer(l))
            # 4.
            prefix = a if wr else prefix + a
            # 5. mixture for the MLP sublayer
            x = attn_res_mix(bank[: n + int(wr)] + [prefix], layer.mlp_res_norm.weight,
                             layer.mlp_res_proj.weight, self.eps)
            # 6./7.
            prefix = prefix + layer.ffn(layer.post_attention_layernorm(x))
        assert len(bank) == self.nb
        y = attn_res_mix(bank + [prefix], self.model.output_attn_res_norm.weight,
                         self.model.output_attn_res_proj.weight, self.eps)
        if cache is not None:
            cache.advance(T)
        return self.model.norm(y)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] int64 -> logits [B, T, vocab] fp32."""
        return self.lm_head(self.hidden_states(input_ids)).float()

    # ------------------------------------------------------------------ utilities
    def moe_layers(self) -> list[LatentMoE]:
        return [l.block_sparse_moe for l in self.model.layers if l.is_moe]

    def num_parameters(self) -> dict[str, int]:
        """{'total': all weights incl. embeddings and lm_head (router bias excluded),
        'active': weights touched per token (non-expert weights + top-k routed experts)}."""
        total = sum(p.numel() for p in self.parameters())
        expert = 0
        active_expert = 0
        for moe in self.moe_layers():
            per = sum(p.numel() for p in moe.experts[0].parameters())
            expert += per * moe.E
            active_expert += per * moe.k
        return {"total": total, "active": total - expert + active_expert}

    @torch.no_grad()
    def generate_greedy(self, input_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
        """Greedy decoding by re-running the full forward each step (no KV cache). Returns new ids."""
        dev = next(self.parameters()).device
        ids = list(input_ids)
        out: list[int] = []
        for _ in range(max_new_tokens):
            logits = self(torch.tensor([ids], device=dev))[0, -1]
            t = int(torch.argmax(logits))
            out.append(t)
            ids.append(t)
            if eos_token_id is not None and t == eos_token_id:
                break
        return out

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "KimiK3TrainModel":
        """Load an exported directory (config.json + model.safetensors). Weights are cast to `dtype`
        except `e_score_correction_bias`, which stays fp32. Raises on missing/unexpected tensors."""
        from safetensors.torch import load_file

        model = cls(os.path.join(str(path), "config.json"))
        sd = load_file(os.path.join(str(path), "model.safetensors"))
        model.load_state_dict(sd, strict=True)
        model.to(device=device, dtype=dtype)
        for m in model.modules():
            if isinstance(m, Router):
                m.e_score_correction_bias.data = m.e_score_correction_bias.data.float()
        model.eval()
        return model

    def export_state_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Checkpoint tensors: everything in `dtype` except e_score_correction_bias (fp32, as in K3)."""
        out = {}
        for k, v in self.state_dict().items():
            v = v.detach().cpu().contiguous()
            out[k] = v.float() if k.endswith("e_score_correction_bias") else v.to(dtype)
        return out
