"""Grouped MoE with MXFP4 expert weights dequantized in registers (W4A16), Triton.

Same signature and result as the PyTorch reference ``longflash.layers.mxfp4.run_mxfp4_experts``:
``run_mxfp4_experts_triton(x [T, D], experts: MXFP4Experts, topk_weights [T, k], topk_ids [T, k]) -> [T, D]``.

Algorithm (vLLM ``fused_moe`` shape, with MXFP4 B tiles):
1. ``moe_align``: the T*k (token, slot) rows sorted by expert and padded per expert to BLOCK_M, so every
   row block belongs to one expert; computed with device ops only (no host sync), the number of blocks
   bounded by ``T*k // BLOCK_M + min(T*k, E)``; unused blocks carry expert -1 and exit at once.
2. GEMM 1 (one launch for all experts): ``act(x·W1ᵀ, x·W3ᵀ)`` -> ``inter [T*k, I]`` (gate and up tiles in
   the same program, SiTU or SiLU fused).
3. GEMM 2 (one launch): ``inter·W2ᵀ`` times the routing weight -> ``[T*k, D]``; then the k slots of each
   token are summed in fp32 (deterministic; no atomics).
In the kernels a B tile is loaded as packed bytes [BK/2, BN]; the low nibbles are the even input columns
and the high nibbles the odd ones, so the A tile is loaded as its even and odd columns and two dots
accumulate (no interleave in registers). E2M1 and E8M0 are decoded with integer bit operations, exact
also under ``TRITON_INTERPRET=1`` (byte 0 -> 2^-127, 0xFF -> NaN, as in the reference).
Triton is imported lazily (this module is only imported on the Triton path).
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from longflash.layers.mxfp4 import MXFP4Experts

_ACT_CODES = {"silu": 0, "situ": 1}


@triton.jit
def _e8m0_to_fp32(s):
    """int32 E8M0 bytes -> fp32 2^(s-127); byte 0 is the subnormal 2^-127, 0xFF is NaN (integer ops only)."""
    bits = tl.where(s == 0, 0x00400000, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_fp32(mag, sign_bit):
    """mag: int32 low 3 bits of E2M1 codes, sign_bit: int32 0 or 0x80000000 -> fp32 value.

    For mag >= 2 the fp32 bits are ``(mag << 22) + (126 << 23)`` (exponent e + 126, mantissa bit m);
    mag 1 is 0.5 (``126 << 23``) and mag 0 is 0 -- i.e. ``mag * (126 << 23)`` for mag < 2.
    """
    bits = tl.where(mag >= 2, (mag << 22) + (126 << 23), mag * (126 << 23))
    return (bits | sign_bit).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_decode(q, s):
    """q: int32 E2M1 codes (0..15), s: int32 E8M0 bytes (broadcast to q) -> fp32 q * 2^(s-127)."""
    return _e2m1_to_fp32(q & 7, (q & 8) << 28) * _e8m0_to_fp32(s)


@triton.jit
def _small_scale_fp32(s):
    """int32 E8M0 bytes <= 128 -> fp32 2^126 * 2^(s-127) = 2^(s-1) (a normal number)."""
    return ((s + 126) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _lo_nibble_small(q, sc):
    """Low-nibble code of the int32 bytes q times sc = 2^(s-1): bits (mag << 22) | sign, then one multiply."""
    return (((q << 22) & 0x01C00000) | ((q << 28) & (-2147483648))).to(tl.float32, bitcast=True) * sc


@triton.jit
def _hi_nibble_small(q, sc):
    return (((q << 18) & 0x01C00000) | ((q << 24) & (-2147483648))).to(tl.float32, bitcast=True) * sc


@triton.jit
def _mxfp4_group_dot(acc, a_even, a_odd, w_ptrs, w_mask, s_ptrs, s_mask, DOT_PRECISION: tl.constexpr,
                     SMALL_SCALES: tl.constexpr):
    """acc += a[:, 32 columns] @ W[32 columns, :] for one MXFP4 group (16 packed bytes per column).

    a_even/a_odd [BM, 16]: the even/odd input columns; w_ptrs [16, BN] packed bytes; s_ptrs [1, BN] the
    group's scale bytes (decoded once per column).
    SMALL_SCALES (every scale byte <= 128, checked by the caller): the code's bits go straight into an
    fp32 exponent/mantissa, ``bits = (mag << 22) | sign`` -- i.e. ``2^-126 * (e ? 2^(e-1)(1+m/2) : m/2)``,
    a subnormal for e = 0 -- and one multiply by ``2^126 * scale = 2^(s-1)`` (a normal fp32 for s <= 128)
    gives the exact value: ~5 ops per code. (Relies on IEEE subnormals in ``mul.f32``; Triton emits no .ftz.)
    Otherwise the general decode (any byte, 0xFF = NaN) costs ~10.
    """
    q = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.int32)
    s = tl.load(s_ptrs, mask=s_mask, other=127).to(tl.int32)
    dt = a_even.dtype
    if SMALL_SCALES:
        sc = _small_scale_fp32(s)
        w_lo = _lo_nibble_small(q, sc)
        w_hi = _hi_nibble_small(q, sc)
    else:
        sc = _e8m0_to_fp32(s)
        w_lo = _e2m1_to_fp32(q & 7, (q & 0x08) << 28) * sc           # low nibble: element 2k
        w_hi = _e2m1_to_fp32((q >> 4) & 7, (q & 0x80) << 24) * sc    # high nibble: element 2k+1
    acc = tl.dot(a_even, w_lo.to(dt), acc, input_precision=DOT_PRECISION)
    return tl.dot(a_odd, w_hi.to(dt), acc, input_precision=DOT_PRECISION)


@triton.jit
def _tanh(x):
    # Odd Taylor series near 0 (no cancellation), (1 - e^-2|x|) / (1 + e^-2|x|) elsewhere.
    ax = tl.abs(x)
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    t = tl.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    big = tl.where(x < 0, -big, big)
    return tl.where(ax < 0.25, series, big)


@triton.jit
def _mxfp4_moe_gemm_kernel(
    a_ptr, wq_ptr, ws_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
    num_rows, a_row_div, N,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    beta, linear_beta,
    K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_SCALED: tl.constexpr, A_FORMAT: tl.constexpr, SMALL_SCALES: tl.constexpr,
):
    """out[r, n] = f(sum_k A[r // a_row_div, k] * W[e, n, k]) for the rows r of this block's expert e.

    K (the reduction width, a multiple of 32) is a compile-time constant: one compile per layer shape
    (also, a runtime loop bound fails in the Triton 3.6 interpreter with NumPy 2).

    GATED: W rows n (gate) and n + N (up) both, out = act(gate, up). MUL_ROUTED_WEIGHT: out *= topk_w[r].
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    e64 = e.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_ok = rows < num_rows
    a_rows = rows // a_row_div
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    dt = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = wq_ptr + e64 * stride_we + offs_n[None, :] * stride_wn      # [1, BN]
    a_base = a_ptr + a_rows[:, None] * stride_am                        # [BM, 1]
    if DOT_SCALED:
        # tl.dot_scaled (GPU only; the interpreter lacks it): Triton upcasts the e2m1 tile itself.
        # NOTE: its E8M0 decode maps byte 0 to 0, not 2^-127 (weights below 6 * 2^-127 either way).
        offs_k = tl.arange(0, BLOCK_K)
        offs_j = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 32)
        s_base_t = ws_ptr + e64 * stride_se + offs_n[:, None] * stride_sn   # [BN, 1]
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_base + k0 + offs_k[None, :], mask=row_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
            kj = k0 // 2 + offs_j
            w_mask = (2 * kj < K)[:, None] & n_ok[None, :]
            sg = k0 // 32 + offs_g
            s_mask = n_ok[:, None] & (32 * sg < K)[None, :]
            q = tl.load(w_base + kj[:, None], mask=w_mask, other=0)
            sc = tl.load(s_base_t + sg[None, :], mask=s_mask, other=127)
            acc = tl.dot_scaled(a, None, A_FORMAT, q, sc, "e2m1", acc)
            if GATED:
                q = tl.load(w_base + N * stride_wn + kj[:, None], mask=w_mask, other=0)
                sc = tl.load(s_base_t + N * stride_sn + sg[None, :], mask=s_mask, other=127)
                acc_up = tl.dot_scaled(a, None, A_FORMAT, q, sc, "e2m1", acc_up)
    else:
        offs_j = tl.arange(0, 16)  # the 16 packed bytes of one 32-column group
        s_base = ws_ptr + e64 * stride_se + offs_n[None, :] * stride_sn     # [1, BN]
        for k0 in range(0, K, BLOCK_K):
            for g in tl.static_range(BLOCK_K // 32):
                kg = k0 + 32 * g
                kj = kg // 2 + offs_j
                k_ok = kg < K
                a_mask = row_ok[:, None] & k_ok
                a_even = tl.load(a_base + 2 * kj[None, :], mask=a_mask, other=0.0)
                a_odd = tl.load(a_base + 2 * kj[None, :] + 1, mask=a_mask, other=0.0)
                w_mask = n_ok[None, :] & k_ok
                s_mask = n_ok[None, :] & k_ok
                acc = _mxfp4_group_dot(acc, a_even, a_odd, w_base + kj[:, None], w_mask, s_base + kg // 32, s_mask,
                                       DOT_PRECISION, SMALL_SCALES)
                if GATED:
                    acc_up = _mxfp4_group_dot(acc_up, a_even, a_odd, w_base + N * stride_wn + kj[:, None], w_mask,
                                              s_base + N * stride_sn + kg // 32, s_mask, DOT_PRECISION, SMALL_SCALES)
    if GATED:
        # The reference rounds gate/up to the activation dtype before the activation; so do we.
        g = acc.to(dt).to(tl.float32)
        u = acc_up.to(dt).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        if ACT == 1:  # SiTU: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)
            acc = beta * _tanh(g / beta) * sig * (linear_beta * _tanh(u / linear_beta))
        else:  # SiLU gate: silu(g) * u
            acc = g * sig * u
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0)
        acc = acc.to(dt).to(tl.float32) * w[:, None].to(dt).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the flattened (token, slot) rows by expert, padding each expert's rows to ``block_m``.

    topk_ids [T, k] int -> (sorted_ids [max_blocks * block_m] int32: flat row index t*k+slot, ``T*k`` for
    padding; block_expert [max_blocks] int32: the expert of each row block, -1 for unused blocks).
    ``max_blocks = T*k // block_m + min(T*k, E)`` bounds the padded count without a host sync.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    se = flat[order]
    dest = pad_start[se] + torch.arange(n, device=dev) - start[se]
    max_blocks = n // block_m + min(n, num_experts)
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    blocks = torch.arange(max_blocks, device=dev)
    block_end = pad_end // block_m
    block_expert = torch.searchsorted(block_end, blocks, right=True)
    block_expert = torch.where(blocks < block_end[-1], block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def default_config(num_tokens: int, top_k: int, num_experts: int) -> dict:
    """Tile sizes by the mean number of rows per expert hit (decode: small BLOCK_M; prefill: 64)."""
    rows = num_tokens * top_k
    per_expert = rows / max(1, min(rows, num_experts))
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, dot_scaled=False)
    if per_expert <= 48:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, dot_scaled=False)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, dot_scaled=False)


def run_mxfp4_experts_triton(x: torch.Tensor, experts: MXFP4Experts, topk_weights: torch.Tensor,
                             topk_ids: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """Grouped W4A16 MoE: x [T, D] (bf16/fp16/fp32), topk_weights [T, k], topk_ids [T, k] -> [T, D] in x's dtype.

    ``config`` overrides the tile sizes of ``default_config`` (keys BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
    num_stages), may set ``general_decode=True`` (the any-scale-byte decode even when every byte is <= 128),
    and may set ``dot_scaled=True``: let ``tl.dot_scaled`` upcast the weights instead of the
    in-register decode (CUDA, bf16/fp16 activations only; not runnable under the interpreter, and it decodes
    scale byte 0 as 0 instead of 2^-127). Raises ValueError for a shape that does not match ``experts``, an
    unknown activation, or dot_scaled with fp32 activations.
    """
    T, D = x.shape
    I, E = experts.intermediate_size, experts.num_experts
    if D != experts.hidden_size:
        raise ValueError(f"x has width {D}, the experts expect {experts.hidden_size}")
    if experts.activation not in _ACT_CODES:
        raise ValueError(f"unsupported activation {experts.activation!r} in the MXFP4 MoE kernel")
    if T == 0:
        return x.new_zeros(0, D)
    k = topk_ids.shape[1]
    cfg = dict(default_config(T, k, E), **(config or {}))
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if bk % 32:
        raise ValueError(f"BLOCK_K must be a multiple of 32 (one MXFP4 scale group), got {bk}")
    dot_scaled = bool(cfg.get("dot_scaled", False))
    if dot_scaled and not cfg.get("allow_broken_dot_scaled", False):
        # NOTE: measured on an H200 (benchmarks/results/gpu_tests.h200.log): the tl.dot_scaled variant
        # gives rel. error 1.4-1.7 against the reference at Kimi-K3 shapes. Refused until fixed; the
        # benchmark can still time it with allow_broken_dot_scaled=True.
        raise ValueError("the tl.dot_scaled MXFP4 variant is disabled: it disagrees with the reference on the H200")
    a_format = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(x.dtype)
    if dot_scaled and a_format is None:
        raise ValueError(f"dot_scaled needs bf16 or fp16 activations, got {x.dtype}")
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    x = x.contiguous()
    sorted_ids, block_expert = moe_align(topk_ids, E, bm)
    rows = T * k
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    beta, lbeta = (experts.act_params + (4.0, 25.0))[:2] if experts.activation == "situ" else (1.0, 1.0)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    general = cfg.get("general_decode", False)  # force the any-scale decode (tests)
    small13 = not general and experts.max_scale_byte("w13") <= 128
    small2 = not general and experts.max_scale_byte("w2") <= 128
    inter = torch.empty(rows, I, dtype=x.dtype, device=x.device)
    w13, s13 = experts.w13_weight_packed, experts.w13_weight_scale
    _mxfp4_moe_gemm_kernel[(block_expert.numel(), triton.cdiv(I, bn))](
        x, w13, s13, inter, sorted_ids, block_expert, weights,
        rows, k, I,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), inter.stride(0),
        float(beta), float(lbeta),
        K=D, GATED=True, ACT=_ACT_CODES[experts.activation], MUL_ROUTED_WEIGHT=False,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=prec,
        DOT_SCALED=dot_scaled, A_FORMAT=a_format or "bf16", SMALL_SCALES=small13, **launch)
    y = torch.empty(rows, D, dtype=x.dtype, device=x.device)
    w2, s2 = experts.w2_weight_packed, experts.w2_weight_scale
    _mxfp4_moe_gemm_kernel[(block_expert.numel(), triton.cdiv(D, bn))](
        inter, w2, s2, y, sorted_ids, block_expert, weights,
        rows, 1, D,
        inter.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        1.0, 1.0,
        K=I, GATED=False, ACT=0, MUL_ROUTED_WEIGHT=True,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=prec,
        DOT_SCALED=dot_scaled, A_FORMAT=a_format or "bf16", SMALL_SCALES=small2, **launch)
    return y.view(T, k, D).float().sum(1).to(x.dtype)
