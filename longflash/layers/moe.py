"""Mixture of experts with DeepSeek-V3 routing (arXiv 2412.19437 §2.1.2).

Router: ``s = sigmoid(x · W_gate^T)`` in fp32 (or softmax); choice scores ``s + e_score_correction_bias``
(auxiliary-loss-free balancing, "noaux_tc"); experts split into ``n_group`` groups, a group's score is the
sum of its two best choice scores, the best ``topk_group`` groups are kept; top-k experts among them;
weights are ``s`` (without bias) at those experts, renormalised when ``norm_topk_prob`` and multiplied
by ``routed_scaling_factor``. Matches HF ``DeepseekV3TopkRouter``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from longflash.distributed.comm import GroupCoordinator
from longflash.layers.activation import silu_and_mul
from longflash.layers.mlp import GatedMLP
from longflash.layers.norm import RMSNorm


class TopkRouter(nn.Module):
    """Parameters ``weight`` [E, H] and ``e_score_correction_bias`` [E] (fp32)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, scoring_func: str = "sigmoid",
                 use_bias: bool = True):
        super().__init__()
        if num_experts % n_group:
            raise ValueError(f"n_routed_experts ({num_experts}) must be divisible by n_group ({n_group})")
        if top_k > num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) exceeds the number of experts ({num_experts})")
        if scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"unsupported config value scoring_func={scoring_func!r}; supported: sigmoid, softmax")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) if use_bias else None
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.scoring_func = scoring_func

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64).

        The logits are one fp32 GEMM (``F.linear``; the loader keeps router weights fp32, so ``.float()``
        copies nothing there). On CUDA the routing after it is one Triton launch
        (``moe_router_triton.topk_routing_triton``), elsewhere (and under autograd) :func:`topk_routing`."""
        weight = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        logits = F.linear(x.float(), weight)
        bias = self.e_score_correction_bias
        args = (bias, self.top_k, self.n_group, self.topk_group, self.norm_topk_prob, self.routed_scaling_factor,
                self.scoring_func)
        needs_grad = torch.is_grad_enabled() and logits.requires_grad
        if logits.is_cuda and not needs_grad:  # one launch instead of ~10-25 (decode is launch-bound)
            from longflash.layers.moe_router_triton import topk_routing_triton
            return topk_routing_triton(logits, *args)
        return topk_routing(logits, *args)


def check_routing_args(logits: torch.Tensor, e_score_correction_bias: torch.Tensor | None, top_k: int,
                       n_group: int, topk_group: int, scoring_func: str) -> None:
    """Raise ValueError naming the problem when :func:`topk_routing`'s arguments do not fit together."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, num_experts], got shape {list(logits.shape)}")
    E = logits.shape[1]
    if not logits.is_floating_point():
        raise ValueError(f"router logits must be floating point, got {logits.dtype}")
    if e_score_correction_bias is not None and tuple(e_score_correction_bias.shape) != (E,):
        raise ValueError(f"e_score_correction_bias must be [{E}], got {list(e_score_correction_bias.shape)}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k ({top_k}) must be in [1, num_experts={E}]")
    if n_group < 1 or E % n_group:
        raise ValueError(f"num_experts ({E}) must be divisible by n_group ({n_group})")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group ({topk_group}) must be in [1, n_group={n_group}]")
    if scoring_func not in ("sigmoid", "softmax"):
        raise ValueError(f"unsupported scoring_func={scoring_func!r}; supported: sigmoid, softmax")


def topk_routing(logits: torch.Tensor, e_score_correction_bias: torch.Tensor | None, top_k: int, n_group: int = 1,
                 topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 scoring_func: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 "noaux_tc" routing of router logits (the PyTorch reference of
    ``moe_router_triton.topk_routing_triton``; HF ``DeepseekV3TopkRouter`` after its GEMM).

    Args:
        logits: [T, E] fp32 router logits (``x · W_gate^T``).
        e_score_correction_bias: [E] fp32 or None; added to the scores for the choice only.
        top_k: experts per token. n_group / topk_group: E splits into n_group groups of E / n_group; a
            group's score is the sum of its two best choice scores (its best when groups have one expert);
            experts outside the best topk_group groups cannot be chosen (choice -inf).
        norm_topk_prob: divide the k weights by their sum + 1e-20. routed_scaling_factor: final multiplier.
        scoring_func: "sigmoid" (per expert) or "softmax" (over the E experts).
    Returns:
        (topk_weights [T, k] fp32: the scores without bias at the chosen experts, renormalised and
        scaled; topk_ids [T, k] int64). The order of the k slots is ``torch.topk(sorted=False)``'s,
        which PyTorch does not specify (it differs between the CPU and CUDA).
    Raises:
        ValueError for logits that are not [T, E], a bias of another length, top_k outside [1, E], E not
        divisible by n_group, topk_group outside [1, n_group] or an unknown scoring_func.
    Formulas: arXiv 2412.19437 §2.1.2 (sigmoid scores, bias for the choice only) and HF transformers.
    """
    check_routing_args(logits, e_score_correction_bias, top_k, n_group, topk_group, scoring_func)
    T, E = logits.shape
    scores = logits.sigmoid() if scoring_func == "sigmoid" else logits.softmax(-1)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if grouped.shape[-1] >= 2 else grouped.max(-1)[0]
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        score_mask = group_mask[:, :, None].expand_as(grouped).reshape(T, E)
        choice = choice.masked_fill(score_mask == 0, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


def run_experts(x: torch.Tensor, experts: nn.ModuleList, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Reference expert computation: for each expert hit, its tokens through it, weighted and summed.

    x [T, D]; topk_* [T, k]. Returns [T, D_out] in x's dtype (fp32 accumulation is not used, to
    match HF's ``index_add_`` order in the model dtype).
    """
    out = None
    for e in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)
        y = experts[e](x[token_idx]) * topk_weights[token_idx, slot, None].to(x.dtype)
        if out is None:
            out = x.new_zeros(x.shape[0], y.shape[-1])
        out.index_add_(0, token_idx, y)
    if out is None:
        out = x.new_zeros(x.shape[0], experts[0].down_proj.out_features)
    return out


# The one-token CUDA path of ``MoE.forward``: the whole sub-layer in the one-token kernel
# (``moe_decode_triton``: three launches) instead of 12; benchmarks set it False for a baseline in the same run.
ONE_TOKEN_KERNEL = True


class MoE(nn.Module):
    """Routed experts + optional shared experts, with Kimi-K3's optional latent projection
    (``routed_expert_down_proj`` → experts → ``routed_expert_norm`` → ``routed_expert_up_proj``).

    The router always sees the un-projected x. x [T, H] -> [T, H].
    Tensor parallelism (``tp`` of N > 1 ranks): tensor-parallel experts, i.e. every routed and shared
    expert's intermediate features are split over the ranks (router, latent projections and norm
    replicated); the routed partial sums are all-reduced once per layer (before the latent norm when
    there is one), the shared experts' with them or separately.
    ``experts``, when given, replaces the bf16 ``nn.ModuleList`` of ``GatedMLP`` routed experts with a module
    called as ``experts(h, topk_weights, topk_ids) -> [T, latent]`` (e.g. ``MXFP4Experts``, packed weights).
    """

    def __init__(self, hidden_size: int, num_experts: int, moe_intermediate_size: int, router: TopkRouter,
                 act_and_mul: Callable, num_shared_experts: int = 0, latent_size: int | None = None,
                 latent_norm: bool = False, rms_norm_eps: float = 1e-6, experts: nn.Module | None = None, *,
                 tp: GroupCoordinator | None = None):
        super().__init__()
        self.gate = router
        expert_width = latent_size or hidden_size
        self.grouped_experts = experts is not None
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        if self.tp is not None and experts is not None:
            raise NotImplementedError("tensor parallelism with packed (MXFP4) routed experts is not implemented; "
                                      "run this checkpoint with tensor_parallel_size 1")
        # NOTE: under TP every expert (and the shared experts) returns its partial sum; forward reduces.
        self.experts = experts if experts is not None else nn.ModuleList(
            GatedMLP(expert_width, moe_intermediate_size, act_and_mul, tp=self.tp, reduce=False)
            for _ in range(num_experts))
        self.shared_experts = (GatedMLP(hidden_size, moe_intermediate_size * num_shared_experts, act_and_mul,
                                        tp=self.tp, reduce=False) if num_shared_experts else None)
        self.latent_size = latent_size
        if latent_size:
            self.routed_expert_down_proj = nn.Linear(hidden_size, latent_size, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent_size, hidden_size, bias=False)
            self.routed_expert_norm = RMSNorm(latent_size, rms_norm_eps) if latent_norm else None

    def stack_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' weights stacked (w13 [E, 2I, D], w2 [E, D, I]; ``moe_grouped``), made
        once; the experts' own weights become views of them (no copy kept)."""
        if getattr(self, "_stacked", None) is None:
            from longflash.layers.moe_grouped import stack_expert_weights
            self._stacked = stack_expert_weights(self.experts)
        return self._stacked

    def one_token_weights(self, x: torch.Tensor) -> tuple | None:
        """The weights :func:`~longflash.layers.moe_decode_triton.moe_decode_triton` takes for ``x``
        (router weight and bias, stacked w13 / w2, the shared experts' fused gate/up and down), or None where
        the one-token kernel does not apply: ``ONE_TOKEN_KERNEL`` off, not exactly one bf16/fp16 CUDA token,
        autograd on, packed experts, a latent projection, tensor parallelism or any multi-process group (its
        grid barriers need every SM; a collective on another stream could hold some), softmax scoring, an
        activation other than SiLU, an fp32-less router, experts or shared experts in another dtype than x, unfused or
        non-contiguous shared weights."""
        if not (ONE_TOKEN_KERNEL and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
                and x.dtype in (torch.bfloat16, torch.float16) and not torch.is_grad_enabled()):
            return None
        if self.grouped_experts or self.latent_size or self.tp is not None or self.gate.scoring_func != "sigmoid":
            return None
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            return None
        from longflash.ops.triton_env import interpreting
        sh = self.shared_experts
        if interpreting() or self.experts[0].act_and_mul is not silu_and_mul or self.gate.weight.dtype != torch.float32:
            return None
        if sh is not None and (sh.act_and_mul is not silu_and_mul or sh.gate_up_weight is None
                               or not sh.gate_up_weight.is_contiguous() or not sh.down_proj.weight.is_contiguous()):
            return None
        w13, w2 = self.stack_experts()
        if w13.dtype != x.dtype or (sh is not None and {sh.gate_up_weight.dtype, sh.down_proj.weight.dtype} != {x.dtype}):
            return None
        return (self.gate.weight, self.gate.e_score_correction_bias, w13, w2,
                sh.gate_up_weight if sh is not None else None, sh.down_proj.weight if sh is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        one = self.one_token_weights(x)
        if one is not None:  # one token on CUDA (batch-1 decode): the one-token kernel
            from longflash.layers.moe_decode_triton import moe_decode_triton
            g = self.gate
            return moe_decode_triton(x, *one, g.top_k, g.n_group, g.topk_group, g.norm_topk_prob,
                                     g.routed_scaling_factor)
        topk_weights, topk_ids = self.gate(x)
        h = self.routed_expert_down_proj(x) if self.latent_size else x
        shared = None  # the shared experts' output, when the routed combine adds it in the same launch
        if self.grouped_experts:
            y = self.experts(h, topk_weights, topk_ids)
        elif h.is_cuda:  # sync-free and capture-safe (CUDA graphs): grouped GEMM over stacked weights
            from longflash.layers.moe_grouped_triton import grouped_experts_triton
            if self.shared_experts is not None and not self.latent_size:
                shared = self.shared_experts(x)
            y = grouped_experts_triton(h, *self.stack_experts(), topk_weights, topk_ids, self.experts[0].act_and_mul,
                                       add=shared)
        else:
            y = run_experts(h, self.experts, topk_weights, topk_ids)
        if self.latent_size:
            if self.tp is not None:  # the norm needs the whole routed sum
                y = self.tp.all_reduce(y)
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
            if self.shared_experts is not None:
                s = self.shared_experts(x)
                y = y + (self.tp.all_reduce(s) if self.tp is not None else s)
            return y
        if self.shared_experts is not None and shared is None:
            y = y + self.shared_experts(x)
        return self.tp.all_reduce(y) if self.tp is not None else y


def is_kimi_moe_layer(cfg: dict, layer_idx: int) -> bool:
    """Kimi-Linear / Kimi-K3 rule: MoE iff ``layer_idx >= first_k_dense_replace`` and
    ``layer_idx % moe_layer_freq == 0`` (``shared/specs/kimi_k3_checkpoint.md`` §5)."""
    return bool(cfg.get("num_experts")) and layer_idx >= cfg.get("first_k_dense_replace", 1) \
        and layer_idx % cfg.get("moe_layer_freq", 1) == 0


def kimi_router(cfg: dict) -> TopkRouter:
    """The ``block_sparse_moe.gate`` router from Kimi config keys (num_experts, num_experts_per_token,
    use_grouped_topk + num_expert_group/topk_group, moe_renormalize, routed_scaling_factor,
    moe_router_activation_func, topk_method)."""
    grouped = cfg.get("use_grouped_topk", True)
    return TopkRouter(cfg["hidden_size"], cfg["num_experts"], cfg["num_experts_per_token"],
                      (cfg.get("num_expert_group") or 1) if grouped else 1,
                      (cfg.get("topk_group") or 1) if grouped else 1,
                      cfg.get("moe_renormalize", True), cfg.get("routed_scaling_factor", 1.0),
                      cfg.get("moe_router_activation_func", "sigmoid"),
                      use_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc")
