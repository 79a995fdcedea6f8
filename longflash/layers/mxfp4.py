"""MXFP4 (OCP Microscaling v1.0 FP4) routed-expert weights, compressed-tensors ``mxfp4-pack-quantized``.

Format (``shared/specs/kimi_k3_checkpoint.md`` §5, scale conventions ``shared/specs/mxfp8.md``):

- Elements are E2M1 codes: bit 3 is the sign, the low 3 bits index {0, .5, 1, 1.5, 2, 3, 4, 6}.
- Two codes per byte along the input dimension: the **low nibble is element 2k**, the high nibble 2k+1.
  ``weight_packed`` is uint8 ``[out, in / 2]``.
- ``weight_scale`` is uint8 E8M0 ``[out, in / 32]``, one byte per 32 consecutive input columns:
  value ``2^(b - 127)``; byte 0 is ``2^-127`` (an fp32 subnormal, not zero) and 0xFF is NaN.

The weights stay packed in memory (4.25 bits per weight: 4 for the code, 8/32 for the scale).
``run_mxfp4_experts`` is the W4A16 PyTorch reference: it dequantizes one expert's matrices at a time
to the activation dtype and runs them like ``run_experts``; ``mxfp4_moe_triton.run_mxfp4_experts_triton``
is the grouped GPU kernel with the same signature.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

MXFP4_GROUP_SIZE = 32

# E2M1 code -> value; codes 8..15 are the negatives of 0..7 (code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_table(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """[16] decode table of E2M1 codes (exact in fp32, bf16 and fp16)."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes -> fp32 ``2^(b - 127)``, same shape.

    Built from the fp32 bit patterns, so byte 0 is the subnormal ``2^-127`` (a naive ``b << 23``
    decoder gives 0) and byte 0xFF is NaN. Raises TypeError for a non-uint8 input.
    """
    if scale.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8, got {scale.dtype}")
    b = scale.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def unpack_e2m1(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 ``[..., n / 2]`` -> ``[..., n]`` E2M1 values; the low nibble of byte k is element 2k."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed E2M1 codes must be uint8, got {packed.dtype}")
    table = e2m1_table(dtype, packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).long()  # [..., n/2, 2]: (even, odd)
    return table[codes].flatten(-2)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight_packed`` [out, in/2] + ``weight_scale`` [out, in/32] -> [out, in] in ``dtype``.

    The product is computed in fp32 (exact: a 2-bit mantissa times a power of two) and then cast.
    Raises ValueError when the scale shape does not match the packed shape.
    """
    out, half = packed.shape[-2:]
    if scale.shape[-2:] != (out, half * 2 // MXFP4_GROUP_SIZE) or (half * 2) % MXFP4_GROUP_SIZE:
        raise ValueError(f"MXFP4 scale shape {list(scale.shape)} does not match packed shape {list(packed.shape)} "
                         f"(one scale per {MXFP4_GROUP_SIZE} input columns)")
    vals = unpack_e2m1(packed, torch.float32)
    s = e8m0_to_float(scale).repeat_interleave(MXFP4_GROUP_SIZE, dim=-1)
    return (vals * s).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (``weight_packed`` uint8 [out, in/2], ``weight_scale`` uint8 [out, in/32]).

    Scale per group of 32: the smallest power of two with amax / scale <= 6 (no element saturates);
    elements rounded to the nearest E2M1 value (ties toward the smaller magnitude). An all-zero group
    gets scale byte 0. Used to make test checkpoints; any valid encoding decodes the same way.
    Raises ValueError when ``in`` is not a multiple of 32.
    """
    out, n = w.shape
    if n % MXFP4_GROUP_SIZE:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {MXFP4_GROUP_SIZE}, got {n}")
    g = w.float().reshape(out, n // MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE)
    amax = g.abs().amax(-1)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127))
    scale_byte = (exp + 127).to(torch.uint8)
    x = g / e8m0_to_float(scale_byte)[..., None]
    mags = e2m1_table(torch.float32, w.device)[:8]
    idx = (x.abs()[..., None] - mags).abs().argmin(-1)  # first minimum: ties go to the smaller value
    codes = (idx | ((x < 0) & (idx > 0)).long() << 3).to(torch.uint8).reshape(out, n)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), scale_byte.reshape(out, n // MXFP4_GROUP_SIZE).contiguous()


# ---- quantization_config --------------------------------------------------------------------------------

MXFP4_FORMAT = "mxfp4-pack-quantized"


def check_mxfp4_quant_config(qcfg: dict) -> None:
    """Accepts compressed-tensors ``mxfp4-pack-quantized`` weight-only configs; raises ValueError otherwise."""
    method = qcfg.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"unsupported quantization_config.quant_method={method!r}; supported: compressed-tensors "
                         f"with format {MXFP4_FORMAT!r}")
    groups = qcfg.get("config_groups") or {}
    formats = {qcfg.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    formats.discard(None)
    if formats != {MXFP4_FORMAT}:
        raise ValueError(f"unsupported quantization_config format {sorted(formats) or None}; supported: {MXFP4_FORMAT!r}")
    for name, g in groups.items():
        w = g.get("weights") or {}
        want = {"num_bits": 4, "type": "float", "group_size": MXFP4_GROUP_SIZE}
        bad = {k: w.get(k) for k, v in want.items() if k in w and w.get(k) != v}
        if bad:
            raise ValueError(f"unsupported quantization_config.config_groups.{name}.weights {bad}; MXFP4 needs {want}")
        if g.get("input_activations") or g.get("output_activations"):
            raise ValueError(f"unsupported quantization_config.config_groups.{name}: only weight-only MXFP4 "
                             f"(input_activations/output_activations null) is supported")


def _ignored(name: str, ignore: list[str]) -> bool:
    for pat in ignore:
        if pat.startswith("re:") and re.match(pat[3:], name):
            return True
        if name == pat:
            return True
    return False


def routed_experts_packed(qcfg: dict | None, layer_idx: int) -> bool:
    """Whether layer ``layer_idx``'s routed experts are MXFP4-packed under ``qcfg``.

    Only routed experts (``block_sparse_moe.experts.{e}.w{1,2,3}``) are ever packed (spec §5); they stay
    bf16 when an ``ignore`` entry matches expert 0's w1/w2/w3 under its checkpoint name (with or without
    the ``language_model.`` prefix). NOTE: an ignore regex that selects only some experts of a layer is
    not supported; the loader then reports the mismatching tensor.
    """
    if not qcfg:
        return False
    ignore = list(qcfg.get("ignore") or [])
    for prefix in ("", "language_model."):
        for w in ("w1", "w2", "w3"):
            if _ignored(f"{prefix}model.layers.{layer_idx}.block_sparse_moe.experts.0.{w}", ignore):
                return False
    return True


# ---- packed expert container ----------------------------------------------------------------------------

def to_kernel_byte_order(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., in/2]`` checkpoint bytes -> the order ``MXFP4Experts`` keeps them in: within each 32-column
    group (16 bytes) byte ``c + 4j`` moves to ``4c + j`` (a 4x4 transpose, its own inverse). So the 4 bytes
    one thread of the Hopper MMA needs (columns 2c, 2c+1, 2c+8, 2c+9, ... of the group) are one aligned word
    (``mxfp4_moe_triton`` puts the columns back in order in registers). Raises ValueError for a width that
    is not a multiple of 16 bytes."""
    if packed.shape[-1] % 16:
        raise ValueError(f"packed MXFP4 rows must be a multiple of 16 bytes (32 columns), got {packed.shape[-1]}")
    lead = packed.shape[:-1]
    return packed.reshape(*lead, -1, 4, 4).transpose(-1, -2).reshape(*lead, packed.shape[-1])


from_kernel_byte_order = to_kernel_byte_order  # the 4x4 transpose is an involution

_PROJ = ("gate_proj", "up_proj", "down_proj")  # checkpoint w1, w3, w2 after remap_checkpoint_name


class MXFP4Experts(nn.Module):
    """All routed experts of one MoE layer, MXFP4-packed and stacked.

    Buffers (uint8):
        w13_weight_packed [E, 2*I, D/2], w13_weight_scale [E, 2*I, D/32]: rows 0..I-1 are the gate (w1),
            rows I..2I-1 the up projection (w3);
        w2_weight_packed [E, D, I/2], w2_weight_scale [E, D, I/32]: the down projection (w2).
    D = expert input/output width (the latent width Lt for Kimi-K3), I = moe_intermediate_size.
    NOTE: the packed bytes are kept in ``to_kernel_byte_order`` (a 4x4 transpose within each 16-byte group),
    not in checkpoint order; write them through ``load_checkpoint_tensor`` and read them through
    ``dequantize`` (or ``from_kernel_byte_order``).

    ``forward(x [T, D], topk_weights [T, k] fp32, topk_ids [T, k] int64) -> [T, D]`` in x's dtype: the
    Triton grouped kernel on CUDA, the PyTorch reference elsewhere (``backend`` = auto|reference|triton).
    The checkpoint tensors ``{e}.{gate,up,down}_proj.weight_{packed,scale}`` are copied in through
    ``load_checkpoint_tensor`` (the loader's hook for stacked weights).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act_and_mul: Callable,
                 activation: str = "silu", act_params: tuple[float, ...] = ()):
        super().__init__()
        for what, n in (("expert width", hidden_size), ("moe_intermediate_size", intermediate_size)):
            if n % MXFP4_GROUP_SIZE:
                raise ValueError(f"MXFP4 experts need {what} to be a multiple of {MXFP4_GROUP_SIZE}, got {n}")
        E, D, I, G = num_experts, hidden_size, intermediate_size, MXFP4_GROUP_SIZE
        self.num_experts, self.hidden_size, self.intermediate_size = E, D, I
        self.act_and_mul = act_and_mul
        self.activation, self.act_params = activation, tuple(float(p) for p in act_params)
        self.backend = "auto"
        self.register_buffer("w13_weight_packed", torch.empty(E, 2 * I, D // 2, dtype=torch.uint8))
        self.register_buffer("w13_weight_scale", torch.empty(E, 2 * I, D // G, dtype=torch.uint8))
        self.register_buffer("w2_weight_packed", torch.empty(E, D, I // 2, dtype=torch.uint8))
        self.register_buffer("w2_weight_scale", torch.empty(E, D, I // G, dtype=torch.uint8))
        self._loaded = bytearray(E * 6)  # (expert, proj, packed|scale) -> 1 once copied in
        self._scale_range: dict[str, tuple[int, int]] = {}  # "w13"/"w2" -> (min, max) scale byte (kernel decode)

    # -- loading --
    def _target(self, e: int, proj: str, kind: str) -> torch.Tensor:
        I = self.intermediate_size
        if proj == "down_proj":
            return (self.w2_weight_packed if kind == "weight_packed" else self.w2_weight_scale)[e]
        full = self.w13_weight_packed if kind == "weight_packed" else self.w13_weight_scale
        return full[e, :I] if proj == "gate_proj" else full[e, I:]

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor ``{e}.{gate,up,down}_proj.weight_{packed,scale}`` into its slot.

        Raises ValueError for an unknown name, an unpacked ``.weight``, a wrong dtype or shape.
        """
        parts = name.split(".")
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in _PROJ:
            raise ValueError(f"not a routed-expert tensor name: {name!r}")
        e, proj, kind = int(parts[0]), parts[1], parts[2]
        if e >= self.num_experts:
            raise ValueError(f"expert index {e} out of range (num_experts={self.num_experts})")
        if kind not in ("weight_packed", "weight_scale"):
            raise ValueError(f"expected MXFP4 weight_packed/weight_scale for a packed expert (per quantization_config), "
                             f"got {kind!r}")
        if tensor.dtype != torch.uint8:
            raise ValueError(f"{kind} must be uint8, got {tensor.dtype}")
        dst = self._target(e, proj, kind)
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"has shape {list(tensor.shape)} in the checkpoint, expected {list(dst.shape)}")
        with torch.no_grad():
            dst.copy_(to_kernel_byte_order(tensor) if kind == "weight_packed" else tensor)
        if kind == "weight_scale" and tensor.numel():
            key = "w2" if proj == "down_proj" else "w13"
            lo, hi = self._scale_range.get(key, (255, 0))
            self._scale_range[key] = (min(lo, int(tensor.min())), max(hi, int(tensor.max())))
        self._loaded[e * 6 + _PROJ.index(proj) * 2 + (kind == "weight_scale")] = 1

    def missing_checkpoint_tensors(self) -> list[str]:
        """Names (relative to this module) never passed to ``load_checkpoint_tensor``."""
        return [f"{i // 6}.{_PROJ[(i % 6) // 2]}.{('weight_packed', 'weight_scale')[i % 2]}"
                for i, v in enumerate(self._loaded) if not v]

    def scale_byte_range(self, which: str) -> tuple[int, int]:
        """(smallest, largest) E8M0 byte of ``w13`` or ``w2`` (the kernel picks its decode by it): tracked
        while loading, else computed once from the buffer (a device sync). NOTE: call
        ``reset_scale_stats()`` after writing the scale buffers directly."""
        if which not in self._scale_range:
            buf = self.w13_weight_scale if which == "w13" else self.w2_weight_scale
            self._scale_range[which] = (int(buf.min()), int(buf.max())) if buf.numel() else (127, 127)
        return self._scale_range[which]

    def reset_scale_stats(self) -> None:
        self._scale_range = {}

    # -- compute --
    def dequantize(self, e: int, proj: str, dtype: torch.dtype) -> torch.Tensor:
        """One expert's matrix [out, in] in ``dtype`` (the tile the reference works on)."""
        return dequantize_mxfp4(from_kernel_byte_order(self._target(e, proj, "weight_packed")),
                                self._target(e, proj, "weight_scale"), dtype)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        use_triton = self.backend == "triton" or (self.backend == "auto" and x.is_cuda)
        if use_triton:
            from longflash.layers.mxfp4_moe_triton import run_mxfp4_experts_triton
            return run_mxfp4_experts_triton(x, self, topk_weights, topk_ids)
        return run_mxfp4_experts(x, self, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, format=mxfp4, activation={self.activation}")


def run_mxfp4_experts(x: torch.Tensor, experts: MXFP4Experts, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """W4A16 reference: for each expert hit, dequantize its three matrices to x's dtype (one expert at a
    time, never the whole layer) and run its tokens through it; weighted sum like ``run_experts``.

    x [T, D]; topk_weights [T, k] fp32; topk_ids [T, k] int64 in [0, E). Returns [T, D] in x's dtype.
    """
    out = x.new_zeros(x.shape[0], experts.hidden_size)
    for e in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)
        xe = x[token_idx]
        g = F.linear(xe, experts.dequantize(e, "gate_proj", x.dtype))
        u = F.linear(xe, experts.dequantize(e, "up_proj", x.dtype))
        y = F.linear(experts.act_and_mul(g, u), experts.dequantize(e, "down_proj", x.dtype))
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].to(x.dtype))
    return out
