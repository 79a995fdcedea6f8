"""DeepSeek-V3 / Kimi "noaux_tc" MoE routing in one Triton launch; same signature and result as
:func:`longflash.layers.moe.topk_routing` (the PyTorch reference, which is ~10 launches without groups and
~25 with them: sigmoid, bias add, group top-2, group top-k, mask, top-k, gather, sum, divide, scale).

One program per token holds the token's E router logits (padded to a power of two, laid out
[n_group, E / n_group]) in registers and does every step there:

1. scores: ``1 / (1 + exp(-l))`` (sigmoid) or ``exp(l - max) / Σ exp(l - max)`` (softmax), with libdevice
   ``expf`` and IEEE division, the functions PyTorch's CUDA kernels call, so sigmoid scores are bitwise
   PyTorch's; the choice score adds ``e_score_correction_bias`` (bitwise).
2. groups (n_group > 1): a group's score is its best plus its second-best choice score; the best topk_group
   groups stay (equal group scores: the lowest group ids), the others' choice scores become -inf.
3. top-k: k rounds, each removing the largest key ``(ordered bits of the choice score, -expert id)``. The
   ordered bits are PyTorch's radix-select keys (``TopKTypeConfig<float>``: sign flip, NaN largest, -0.0
   below +0.0), so the chosen set is every expert above the k-th choice score and, among experts equal
   to it, the lowest ids.
4. output: the k slots in ascending expert id; weights are the scores (without bias) at the chosen
   experts, divided by their sum + 1e-20 when norm_topk_prob, times routed_scaling_factor.

What is guaranteed against the reference (``torch.topk(sorted=False)`` specifies neither the order of the
k slots nor which of several equal k-th scores it takes; on CUDA both can depend on warp scheduling):
* the chosen experts are the reference's as a set whenever the choice scores have no exact tie at the
  k-th place (and no tie at the topk_group-th group score); with ties the kernel takes the lowest ids,
  as ``torch.sort(stable=True)`` of the keys would;
* sigmoid scores and the bias add are bitwise PyTorch's CUDA ones (libdevice ``expf`` and IEEE division,
  as in PyTorch's kernels; FTZ only changes subnormal intermediates, which round to the same result);
  softmax scores differ by the sum's order (about an ulp);
* weights agree within fp32 rounding (the k-term sum is a tree, not PyTorch's order); without
  norm_topk_prob they are the reference's scores times the factor, bitwise for sigmoid on CUDA.
Against the CPU reference (another exp) the scores agree within a few ulps. Under ``TRITON_INTERPRET=1``
NumPy's exp stands in for libdevice's.

No host sync and no data-dependent shape: capture-safe (CUDA graphs).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from longflash.layers.moe import check_routing_args
from longflash.ops.triton_math import exp_f32

_IDX_BITS = 20  # expert id bits of a key; keys are (ordered score bits << 20) | (2^20 - 1 - id) < 2^52
MAX_EXPERTS = 1 << 12  # one token's padded logits live in one program's registers


@triton.jit
def _ordered(v):
    """fp32 -> int64 in [0, 2^32) ordered as PyTorch's radix select orders floats (NaN largest)."""
    b = v.to(tl.int32, bitcast=True)
    o = tl.where(b >= 0, b.to(tl.int64) + 2147483648, (~b).to(tl.int64))
    return tl.where(v != v, 4294967295, o)


@triton.jit
def _unordered(o):
    """Inverse of ``_ordered`` (int64 in [0, 2^32) -> fp32)."""
    b = tl.where(o >= 2147483648, o - 2147483648, ~o).to(tl.int32)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def route_scores(x, bias_ptr, scale, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, NG_P: tl.constexpr,
                 GS_P: tl.constexpr, TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SOFTMAX: tl.constexpr, RENORM: tl.constexpr, INTERPRET: tl.constexpr, IDX_BITS: tl.constexpr):
    """Steps 1-4 of the module docstring for one token, before the slots are ordered: ``x`` [NG_P, GS_P] fp32
    router logits laid out [group, expert in group] (-inf padding); ``bias_ptr`` the [E] fp32 choice bias
    (read when HAS_BIAS); ``scale`` routed_scaling_factor. Returns (sel, w, ids), each [NG_P * GS_P]: whether
    the expert is chosen, its weight (0 where not chosen; renormalised when RENORM, times ``scale``) and its
    id. Shared by the routing kernel and the one-token MoE kernel (``moe_decode_triton``)."""
    g = tl.arange(0, NG_P)[:, None]
    j = tl.arange(0, GS_P)[None, :]
    valid = (g < N_GROUP) & (j < GROUP_SIZE)
    e = g * GROUP_SIZE + j  # expert id, [NG_P, GS_P]
    one = tl.full(x.shape, 1.0, tl.float32)
    if SOFTMAX:
        ex = exp_f32(x - tl.max(tl.max(x, 1), 0), not INTERPRET)  # padding: exp(-inf) = 0
        scores = tl.math.div_rn(ex, one * tl.sum(tl.sum(ex, 1), 0))
    else:
        scores = tl.math.div_rn(one, 1.0 + exp_f32(-x, not INTERPRET))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    low = (1 << IDX_BITS) - 1 - e.to(tl.int64)
    key = tl.where(valid, (_ordered(choice) << IDX_BITS) | low, -1)
    if N_GROUP > 1:
        # group score: best + second best choice score (the best alone for one-expert groups)
        k1 = tl.max(key, 1)
        gscore = _unordered(k1 >> IDX_BITS)
        if GROUP_SIZE > 1:
            k2 = tl.max(tl.where(key == k1[:, None], -1, key), 1)
            gscore = gscore + _unordered(k2 >> IDX_BITS)
        gi = tl.arange(0, NG_P)
        gkey = tl.where(gi < N_GROUP, (_ordered(gscore) << IDX_BITS) | ((1 << IDX_BITS) - 1 - gi), -1)
        keep = gi < 0
        for _ in tl.static_range(TOPK_GROUP):
            m = tl.max(gkey, 0)
            keep = keep | (gkey == m)
            gkey = tl.where(gkey == m, -1, gkey)
        neg_inf = tl.full(x.shape, float("-inf"), tl.float32)
        key = tl.where(valid, (_ordered(tl.where(keep[:, None], choice, neg_inf)) << IDX_BITS) | low, -1)
    # top-k: k rounds of "largest key", i.e. largest ordered score, then lowest id
    key = tl.reshape(key, (NG_P * GS_P,))
    sc = tl.reshape(scores, (NG_P * GS_P,))
    ids = tl.reshape(e, (NG_P * GS_P,))
    rest = key
    for _ in tl.static_range(TOP_K):
        rest = tl.where(rest == tl.max(rest, 0), -1, rest)
    sel = rest != key
    w = tl.where(sel, sc, 0.0)
    if RENORM:
        w = tl.math.div_rn(w, tl.full(w.shape, 1.0, tl.float32) * (tl.sum(w, 0) + 1e-20))
    return sel, w * scale, ids


@triton.jit
def _topk_routing_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_l, scale,
                         N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, NG_P: tl.constexpr, GS_P: tl.constexpr,
                         TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                         SOFTMAX: tl.constexpr, RENORM: tl.constexpr, INTERPRET: tl.constexpr,
                         IDX_BITS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, NG_P)[:, None]
    j = tl.arange(0, GS_P)[None, :]
    valid = (g < N_GROUP) & (j < GROUP_SIZE)
    x = tl.load(logits_ptr + t * stride_l + g * GROUP_SIZE + j, mask=valid, other=float("-inf")).to(tl.float32)
    sel, w, ids = route_scores(x, bias_ptr, scale, N_GROUP, GROUP_SIZE, NG_P, GS_P, TOP_K, TOPK_GROUP, HAS_BIAS,
                               SOFTMAX, RENORM, INTERPRET, IDX_BITS)
    # slots in ascending expert id (torch.topk(sorted=False) leaves the order unspecified)
    a = sel.to(tl.int32)
    pos = tl.cumsum(a, 0) - a
    tl.store(w_ptr + t * TOP_K + pos, w, mask=sel)
    tl.store(ids_ptr + t * TOP_K + pos, ids.to(tl.int64), mask=sel)


def topk_routing_triton(logits: torch.Tensor, e_score_correction_bias: torch.Tensor | None, top_k: int,
                        n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                        routed_scaling_factor: float = 1.0, scoring_func: str = "sigmoid", *,
                        num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`longflash.layers.moe.topk_routing` (same arguments and result; see the
    module docstring for what is bitwise and what is within fp32 rounding).

    Args:
        logits: [T, E] fp32 router logits (last dim contiguous; rows may be strided).
        e_score_correction_bias: [E] fp32 or None. top_k, n_group, topk_group, norm_topk_prob,
            routed_scaling_factor, scoring_func: as in ``topk_routing``.
        num_warps: override of the launch's warps (default: by the padded expert count).
    Returns:
        (topk_weights [T, k] fp32, topk_ids [T, k] int64).
    Raises:
        ValueError as ``topk_routing``, and for logits that are not fp32, a last dim that is not
        contiguous, or more than MAX_EXPERTS experts.
    """
    check_routing_args(logits, e_score_correction_bias, top_k, n_group, topk_group, scoring_func)
    if logits.dtype != torch.float32:
        raise ValueError(f"router logits must be fp32, got {logits.dtype}")
    T, E = logits.shape
    if E > MAX_EXPERTS:
        raise ValueError(f"num_experts ({E}) exceeds the fused router's limit {MAX_EXPERTS}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return w, ids
    bias = e_score_correction_bias
    if bias is not None:
        bias = bias.to(device=logits.device, dtype=torch.float32).contiguous()
    group_size = E // n_group
    ng_p, gs_p = triton.next_power_of_2(n_group), triton.next_power_of_2(group_size)
    if num_warps is None:
        num_warps = 1 if ng_p * gs_p <= 256 else (2 if ng_p * gs_p <= 512 else 4)
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1" or not logits.is_cuda
    _topk_routing_kernel[(T,)](logits, bias if bias is not None else logits, w, ids, logits.stride(0),
                               float(routed_scaling_factor), N_GROUP=n_group, GROUP_SIZE=group_size, NG_P=ng_p,
                               GS_P=gs_p, TOP_K=top_k, TOPK_GROUP=topk_group, HAS_BIAS=bias is not None,
                               SOFTMAX=scoring_func == "softmax", RENORM=bool(norm_topk_prob), INTERPRET=interpret,
                               IDX_BITS=_IDX_BITS, num_warps=num_warps)
    return w, ids
