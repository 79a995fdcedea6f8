"""Rotary position embedding (Su et al. 2021) with the half-split (NeoX) and interleaved (GPT-J,
DeepSeek ``rope_interleave``) layouts, and DeepSeek YaRN scaling (Peng et al. 2023, arXiv 2309.00071).

The YaRN frequencies, correction range and mscale follow HF transformers'
``_compute_yarn_parameters`` and DeepSeek-V3's reference code.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# dtypes the fused kernels take (fp32 math inside); others use the reference
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(config: dict) -> dict:
    """Normalise the RoPE settings of an HF config (v4 ``rope_theta`` + ``rope_scaling`` or v5
    ``rope_parameters``) into one dict with ``rope_type`` and ``rope_theta``."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling")
    if scaling:
        params.update(scaling)
    if "rope_theta" not in params:
        params["rope_theta"] = config.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def _yarn_inv_freq(dim: int, base: float, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    orig = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / orig
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    truncate = params.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extra = 1.0 / pos_freqs
    inter = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = inter * (1 - extra_factor) + extra * extra_factor
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    return inv_freq, float(attention_factor)


def softmax_scale_mscale(params: dict) -> float:
    """Multiplier on the softmax scale from YaRN's ``mscale_all_dim`` (DeepSeek): mscale²; else 1."""
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = yarn_get_mscale(params["factor"], params["mscale_all_dim"])
        return m * m
    return 1.0


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query/key parts of width ``rotary_dim`` at given positions.

    Args:
        rotary_dim: width of the rotated part (even).
        params: output of :func:`rope_parameters`.
        max_position_embeddings: the model's context length (YaRN default factor).
        interleave: pairs (x0, x1), (x2, x3)… (DeepSeek) instead of halves (x_i, x_{i+d/2}).
            The interleaved variant writes its output de-interleaved ([evens | odds] rotated), exactly
            like HF's ``apply_rotary_pos_emb_interleave``; queries and keys share the layout, so
            their dot products equal the interleaved rotation's.
    Raises:
        ValueError for a RoPE type other than default and yarn, or an odd or non-positive rotary_dim.
    """

    def __init__(self, rotary_dim: int, params: dict, max_position_embeddings: int, interleave: bool = False):
        super().__init__()
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number (pairs of features rotate), got {rotary_dim}")
        base = float(params["rope_theta"])
        rope_type = params["rope_type"]
        if rope_type == "default":
            exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
            inv_freq = 1.0 / (base ** exponents)
            self.attention_factor = 1.0
        elif rope_type in ("yarn", "deepseek_yarn"):
            inv_freq, self.attention_factor = _yarn_inv_freq(rotary_dim, base, params, max_position_embeddings)
        else:
            raise ValueError(f"unsupported config value rope_scaling.type={rope_type!r}; supported: default, yarn")
        self.rotary_dim = rotary_dim
        self.interleave = interleave
        # A plain attribute, not a buffer: models are built on the meta device and this must stay real.
        self.inv_freq = inv_freq
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """``inv_freq`` [rotary_dim // 2] fp32 on ``device`` (copied once per device, then cached: under a
        CUDA graph the first call must happen before capture, e.g. in the warm-up forward)."""
        inv_freq = self._inv_freq_on.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[device] = self.inv_freq.to(device)
        return inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, rotary_dim // 2] for int64 ``positions`` [T]."""
        inv_freq = self.inv_freq_on(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        cos = (freqs.cos() * self.attention_factor).to(dtype)
        sin = (freqs.sin() * self.attention_factor).to(dtype)
        return cos, sin

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, rotary_dim] (or [T, rotary_dim]) with cos/sin [T, rotary_dim // 2]."""
        if x.dim() == 3:
            cos, sin = cos[:, None, :], sin[:, None, :]
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def check_qk(self, q: torch.Tensor | None, k: torch.Tensor | None, positions: torch.Tensor,
                 q_out: torch.Tensor | None = None) -> torch.dtype:
        """Validate :meth:`rotate_qk`'s arguments; returns the dtype of the rotated outputs.

        Raises ValueError when both q and k are None, when a tensor is not [T, rotary_dim] or
        [T, heads, rotary_dim] with T = len(positions), when q and k differ in dtype or device, when a
        dtype is not floating point, when positions is not a 1-D integer tensor on their device, or when
        ``q_out`` is given without q or is not q's shape, dtype and device with a unit last-dim stride."""
        if q_out is not None and q is None:
            raise ValueError("q_out is given but q is None (q_out receives the rotated q)")
        if q_out is not None and (q_out.shape != q.shape or q_out.dtype != q.dtype or
                                  q_out.device != q.device or q_out.stride(-1) != 1):
            raise ValueError("q_out must have q's shape, dtype and device and a unit last-dim stride, got "
                             f"{tuple(q_out.shape)} {q_out.dtype} strides {q_out.stride()}")
        xs = [(n, x) for n, x in (("q", q), ("k", k)) if x is not None]
        if not xs:
            raise ValueError("rotate_qk needs q or k (both are None)")
        if positions.dim() != 1 or positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise ValueError(f"positions must be a 1-D integer tensor, got {tuple(positions.shape)} "
                             f"{positions.dtype}")
        T = positions.shape[0]
        for name, x in xs:
            if x.dim() not in (2, 3) or x.shape[0] != T or x.shape[-1] != self.rotary_dim:
                raise ValueError(f"{name} must be [T={T}, rotary_dim={self.rotary_dim}] or [T, heads, "
                                 f"rotary_dim], got {tuple(x.shape)}")
            if not x.dtype.is_floating_point:
                raise ValueError(f"{name} must be floating point, got {x.dtype}")
            if x.device != positions.device:
                raise ValueError(f"{name} is on {x.device} but positions on {positions.device}")
        if len(xs) == 2 and q.dtype != k.dtype:
            raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
        return xs[0][1].dtype

    def rotate_qk_ref(self, q: torch.Tensor | None, k: torch.Tensor | None, positions: torch.Tensor,
                      q_out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Reference of :meth:`rotate_qk`: ``cos_sin(positions, dtype)`` then :meth:`rotate` of q and k
        (the math of the engine before the fused kernel, every step in q's dtype)."""
        dtype = self.check_qk(q, k, positions, q_out)
        cos, sin = self.cos_sin(positions, dtype)
        q_rot = self.rotate(q, cos, sin) if q is not None else None
        if q_out is not None:
            q_rot = q_out.copy_(q_rot)
        return q_rot, self.rotate(k, cos, sin) if k is not None else None

    def rotate_qk(self, q: torch.Tensor | None, k: torch.Tensor | None, positions: torch.Tensor,
                  q_out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Rotate queries and keys at ``positions`` in one call.

        Args:
            q: [T, heads, rotary_dim] or [T, rotary_dim], any float dtype (a strided view such as MLA's
                q_pe slice is fine), or None (e.g. the DFlash drafter's context keys alone).
            k: the same for keys ([T, rotary_dim] MLA k_pe, [T, kv_heads, rotary_dim] GQA), or None.
            positions: [T] integer positions on the same device.
            q_out: optional tensor of q's shape and dtype with a unit last-dim stride (e.g. the rope
                slice of MLA's absorbed query buffer) that receives q_rot.
        Returns:
            (q_rot, k_rot) of q's and k's shapes and dtype (None where the input is None; q_rot is
            ``q_out`` when given), laid out as :meth:`rotate` lays them out (interleaved input ->
            de-interleaved output).
        Raises:
            ValueError for shapes/dtypes/devices that do not fit (:meth:`check_qk`).
        On CUDA (fp32/fp16/bf16) without autograd: one Triton launch (``rotary_triton.rotate_qk_triton``: cos/sin computed
        in-kernel, fp32 math, one rounding); elsewhere :meth:`rotate_qk_ref`.
        """
        x = q if q is not None else k
        needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k))
        if x is not None and x.is_cuda and x.dtype in _TRITON_DTYPES and not needs_grad:
            from longflash.layers.rotary_triton import rotate_qk_triton
            return rotate_qk_triton(self, q, k, positions, q_out)
        return self.rotate_qk_ref(q, k, positions, q_out)
