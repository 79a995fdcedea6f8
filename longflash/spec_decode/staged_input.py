"""Staged MXFP8 drafter input: quantize each target tap as it is produced, project once at the end.

At a large prefill step the DFlash drafter input is ``concat(taps) [T, sum(widths)]`` (Kimi-K3: six
taps of width 7168). Retaining the bf16 taps, concatenating them and then quantizing overlaps two large
allocations. ``StagedDrafterInput`` instead quantizes each tap into its column range of a caller-owned
MXFP8 buffer the moment the target produces it (the caller drops the bf16 tap right after ``add``), and
``finalize()`` runs the drafter ``fc`` once into a caller-owned output buffer.

Bitwise equality with ``concat_then_quantize`` (DESIGN invariant 4, shared/specs/mxfp8.md) holds because
groups of 32 never cross a tap boundary (every width % 32 == 0), each group depends only on its own 32
inputs, both paths use the same quantizer writing disjoint columns of a buffer of the same shape, and
both run the same ``project_mxfp8`` (same row chunks, same GEMM calls) on the assembled buffer.

Policy: ``use_staged_path`` — staged only for large forwards that are not being captured into a CUDA
graph and only with a compatible drafter; decode-sized forwards keep list-and-concatenate.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longflash.ops.mxfp8 import MX_BLOCK, dequantize_mxfp8, quantize_mxfp8_into

logger = logging.getLogger("longflash")

QuantizeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]

# Forwards with at least this many tokens use the staged path (when allowed).
DEFAULT_STAGED_MIN_TOKENS = 512
# Rows dequantized per GEMM call in project_mxfp8: scratch = row_chunk * K_total elements
# (Kimi-K3, K_total = 43008: 84 MiB of bf16 at 1024). Measured on an H200 at M = 4096, the whole
# projection (quantize all taps + dequant + GEMM), staged / concatenated in the same run: 0.993 at 1024,
# 1.035 at 2048, 1.044 at 4096 (the staged time itself is the same at 1024 and 2048, 4.16 vs 4.18 ms;
# larger chunks only speed up the concatenated path). 1024 meets the goal <= 1.00 and halves the
# scratch, so the staged step peak falls further below half of the concatenated one. Third run
# (77f87ea, v2 kernels): in CUDA graphs 0.931 / 0.955 / 0.929 at 512 / 1024 / 2048; eager 1.045-1.054
# at all three: host launch time, which cached launch plans (ops/triton_launch.py) should remove (next
# run); step peak 0.317 / 0.348 / 0.441 (benchmarks/results/mxfp8_staged.h200.md, benchmarks/NOTES.md).
DEFAULT_ROW_CHUNK = 1024

DequantizeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_quantize_fn(hidden: torch.Tensor) -> QuantizeFn:
    """The quantizer for ``hidden``'s device: the Triton kernel on CUDA when triton imports, else the reference."""
    if hidden.is_cuda:
        from longflash.ops.mxfp8_triton import quantize_mxfp8_into_triton, triton_available
        if triton_available():
            return quantize_mxfp8_into_triton
    return quantize_mxfp8_into


def _dequantize_torch(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp8(data, scales, out=out)


def default_dequantize_fn(data: torch.Tensor, dtype: torch.dtype) -> DequantizeFn:
    """The dequantizer for ``data``'s device and the scratch dtype: the fused Triton kernel (one pass,
    same bytes as the torch path) on CUDA for bf16 when triton imports, else ``dequantize_mxfp8``."""
    if data.is_cuda and dtype == torch.bfloat16:
        from longflash.ops.mxfp8_triton import dequantize_mxfp8_triton, triton_available
        if triton_available():
            return dequantize_mxfp8_triton
    return _dequantize_torch


def project_mxfp8(data: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                  row_chunk: int = DEFAULT_ROW_CHUNK, scratch: torch.Tensor | None = None,
                  dequantize_fn: DequantizeFn | None = None) -> torch.Tensor:
    """``out = dequant(data, scales) @ weight.T``, dequantizing ``row_chunk`` rows at a time.

    The exact MX GEMM on Hopper and CPU (no native MX matrix instruction there): each row chunk is
    dequantized into a bounded scratch of ``weight.dtype`` and multiplied with torch/cuBLAS. The staged
    and the concatenated path both call this, with the same chunking, so their outputs are bitwise
    equal. A native MX GEMM (Blackwell ``torch._scaled_mm`` with swizzled e8m0 scales) can replace the
    loop behind this same signature.

    Args:
        data: [M, K] uint8 / float8_e4m3fn; scales: [M, K / 32] uint8.
        weight: [N, K] (the drafter ``fc`` weight, no bias), fp32 or bf16.
        out: [M, N] caller-owned output, dtype of ``weight``; written in place.
        row_chunk: rows per GEMM call (> 0).
        scratch: optional [>= min(row_chunk, M), K] buffer of ``weight.dtype``; allocated if None.
        dequantize_fn: ``(data, scales, out) -> out`` writing ``weight.dtype`` values; default
            ``default_dequantize_fn`` (fused Triton kernel for bf16 on CUDA, else the torch path —
            identical bytes either way).
    Returns:
        ``out``.
    Raises:
        ValueError on shape mismatch.
    """
    m, k = data.shape
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} does not match input width {k}")
    if tuple(out.shape) != (m, weight.shape[0]) or out.dtype != weight.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} != ({m}, {weight.shape[0]}) {weight.dtype}")
    if row_chunk <= 0:
        raise ValueError(f"row_chunk must be positive, got {row_chunk}")
    rows = min(row_chunk, m)
    if m == 0:
        return out
    if scratch is None:
        scratch = torch.empty(rows, k, dtype=weight.dtype, device=data.device)
    elif scratch.shape[0] < rows or scratch.shape[1] != k or scratch.dtype != weight.dtype:
        raise ValueError(f"scratch {tuple(scratch.shape)} {scratch.dtype} too small for ({rows}, {k}) {weight.dtype}")
    dequant = dequantize_fn or default_dequantize_fn(data, weight.dtype)
    wt = weight.t()
    for r0 in range(0, m, row_chunk):
        r1 = min(m, r0 + row_chunk)
        buf = scratch[: r1 - r0]
        dequant(data[r0:r1], scales[r0:r1], buf)
        torch.mm(buf, wt, out=out[r0:r1])
    return out


def concat_then_quantize(taps: Sequence[torch.Tensor], weight: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                         out: torch.Tensor, row_chunk: int = DEFAULT_ROW_CHUNK,
                         quantize_fn: QuantizeFn | None = None, scratch: torch.Tensor | None = None,
                         dequantize_fn: DequantizeFn | None = None) -> torch.Tensor:
    """The list-and-concatenate path: ``cat(taps)`` -> MXFP8 into ``data``/``scales`` -> ``project_mxfp8``.

    Same buffers and projection as ``StagedDrafterInput``; the comparison baseline and the path for
    decode-sized or captured forwards. Returns ``out``.
    """
    cat = torch.cat(list(taps), dim=-1)
    (quantize_fn or default_quantize_fn(cat))(cat, data, scales, 0)
    del cat
    return project_mxfp8(data, scales, weight, out, row_chunk, scratch, dequantize_fn)


class StagedDrafterInput:
    """Accumulates target taps into a caller-owned MXFP8 buffer and projects once.

    Args:
        tap_widths: ordered widths of the taps (target hidden size each), every one % 32 == 0.
        weight: [N, sum(tap_widths)] drafter ``fc`` weight (no bias).
        data: [max_tokens, sum(tap_widths)] uint8/float8_e4m3fn caller-owned MXFP8 input buffer.
        scales: [max_tokens, sum(tap_widths) / 32] uint8 caller-owned scale buffer.
        out: [max_tokens, N] caller-owned output buffer, ``weight.dtype``.
        num_tokens: tokens of the first step (<= max_tokens); ``reset(n)`` rebinds for later steps.
        row_chunk: rows per GEMM call in ``project_mxfp8``.
        quantize_fn: quantizer with the ``quantize_mxfp8_into`` signature; default picks the
            Triton kernel on CUDA, the reference elsewhere.
        scratch: optional caller-owned dequantization scratch for ``project_mxfp8``.
        dequantize_fn: dequantizer for ``project_mxfp8``; default ``default_dequantize_fn`` (resolved
            on the first ``finalize``).

    Per step: ``add(0, h0) ... add(n-1, h_{n-1})`` in order, once each, then ``finalize()`` which
    returns ``out[:num_tokens]``. A tap out of order, repeated, of the wrong shape, an ``add`` after
    ``finalize``, a ``finalize`` with a tap missing, or a second ``finalize`` raise ``RuntimeError`` /
    ``ValueError`` and leave the state unchanged; ``reset()`` starts the next step.
    """

    def __init__(self, tap_widths: Sequence[int], weight: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                 out: torch.Tensor, num_tokens: int, *, row_chunk: int = DEFAULT_ROW_CHUNK,
                 quantize_fn: QuantizeFn | None = None, scratch: torch.Tensor | None = None,
                 dequantize_fn: DequantizeFn | None = None):
        widths = [int(w) for w in tap_widths]
        if not widths:
            raise ValueError("at least one tap is required")
        for w in widths:
            if w <= 0 or w % MX_BLOCK != 0:
                raise ValueError(f"tap width {w} is not a positive multiple of {MX_BLOCK}")
        total = sum(widths)
        if data.dtype == torch.float8_e4m3fn:
            data = data.view(torch.uint8)
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != total:
            raise ValueError(f"data must be [max_tokens, {total}] uint8/float8_e4m3fn, got {data.dtype} {tuple(data.shape)}")
        if scales.dtype != torch.uint8 or tuple(scales.shape) != (data.shape[0], total // MX_BLOCK):
            raise ValueError(f"scales must be [{data.shape[0]}, {total // MX_BLOCK}] uint8, got {tuple(scales.shape)}")
        if weight.dim() != 2 or weight.shape[1] != total:
            raise ValueError(f"weight {tuple(weight.shape)} does not take {total} input features")
        if out.dim() != 2 or out.shape[0] != data.shape[0] or out.shape[1] != weight.shape[0] or out.dtype != weight.dtype:
            raise ValueError(f"out must be [{data.shape[0]}, {weight.shape[0]}] {weight.dtype}, got {out.dtype} {tuple(out.shape)}")
        self.tap_widths = tuple(widths)
        self.col_offsets = tuple(sum(widths[:i]) for i in range(len(widths)))
        self.total_width = total
        self.max_tokens = data.shape[0]
        self.weight, self.data, self.scales, self.out = weight, data, scales, out
        self.row_chunk = row_chunk
        self.quantize_fn = quantize_fn
        self.scratch = scratch
        self.dequantize_fn = dequantize_fn
        self.num_tokens = 0
        self._next_tap = 0
        self._finalized = False
        self.reset(num_tokens)

    @property
    def num_taps(self) -> int:
        return len(self.tap_widths)

    def reset(self, num_tokens: int | None = None) -> None:
        """Start a new step (optionally with another token count); the buffers are reused."""
        if num_tokens is not None:
            if not 0 <= num_tokens <= self.max_tokens:
                raise ValueError(f"num_tokens={num_tokens} outside [0, {self.max_tokens}]")
            self.num_tokens = int(num_tokens)
        self._next_tap = 0
        self._finalized = False

    def add(self, tap_index: int, hidden: torch.Tensor) -> None:
        """Quantize tap ``tap_index`` ([num_tokens, tap_widths[tap_index]]) into its columns.

        The caller may free ``hidden`` as soon as this returns.
        """
        if self._finalized:
            raise RuntimeError("add() after finalize(); call reset() to start the next step")
        if not 0 <= tap_index < self.num_taps:
            raise RuntimeError(f"taps must arrive in order: got tap {tap_index}, the step has taps 0..{self.num_taps - 1}")
        if tap_index != self._next_tap:
            if 0 <= tap_index < self._next_tap:
                raise RuntimeError(f"tap {tap_index} was already added (expected tap {self._next_tap})")
            raise RuntimeError(f"taps must arrive in order: got tap {tap_index}, expected tap {self._next_tap}")
        width = self.tap_widths[tap_index]
        if tuple(hidden.shape) != (self.num_tokens, width):
            raise ValueError(f"tap {tap_index} has shape {tuple(hidden.shape)}, expected ({self.num_tokens}, {width})")
        n, c0 = self.num_tokens, self.col_offsets[tap_index]
        if self.quantize_fn is None:  # resolved once, on the first add (outside any compiled region)
            self.quantize_fn = default_quantize_fn(hidden)
        quantize = self.quantize_fn
        quantize(hidden, self.data[:n], self.scales[:n], c0)
        self._next_tap += 1

    def finalize(self) -> torch.Tensor:
        """Run the projection once; return ``out[:num_tokens]`` (a view of the caller's buffer)."""
        if self._finalized:
            raise RuntimeError("finalize() called twice; call reset() to start the next step")
        if self._next_tap != self.num_taps:
            raise RuntimeError(f"finalize() with {self.num_taps - self._next_tap} tap(s) missing "
                               f"(next expected tap {self._next_tap} of {self.num_taps})")
        n = self.num_tokens
        if self.dequantize_fn is None:  # resolved once, like quantize_fn
            self.dequantize_fn = default_dequantize_fn(self.data, self.weight.dtype)
        project_mxfp8(self.data[:n], self.scales[:n], self.weight, self.out[:n], self.row_chunk, self.scratch,
                      self.dequantize_fn)
        self._finalized = True
        return self.out[:n]


def mxfp8_buffers(max_tokens: int, tap_widths: Sequence[int], out_features: int, *, device=None,
                  out_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate (data uint8, scales uint8, out) buffers sized for ``StagedDrafterInput``."""
    total = sum(tap_widths)
    return (torch.empty(max_tokens, total, dtype=torch.uint8, device=device),
            torch.empty(max_tokens, total // MX_BLOCK, dtype=torch.uint8, device=device),
            torch.empty(max_tokens, out_features, dtype=out_dtype, device=device))


def drafter_fc_compatible(fc: torch.nn.Module, tap_widths: Sequence[int]) -> bool:
    """True when ``fc`` is a plain bias-free Linear over ``sum(tap_widths)`` features and every
    width is a multiple of 32 (so no MX group crosses a tap boundary)."""
    return (isinstance(fc, torch.nn.Linear) and fc.bias is None and fc.in_features == sum(tap_widths)
            and len(tap_widths) > 0 and all(w > 0 and w % MX_BLOCK == 0 for w in tap_widths))


_activation_logged = False


def use_staged_path(num_tokens: int, threshold: int = DEFAULT_STAGED_MIN_TOKENS, capturing: bool = False,
                    drafter_compatible: bool = True, *, target_width: int | None = None,
                    num_taps: int | None = None) -> bool:
    """Whether this forward uses the staged MXFP8 drafter input.

    True iff ``drafter_compatible`` and not ``capturing`` (a CUDA-graph capture) and
    ``num_tokens >= threshold``. The first time it returns True in the process it logs one INFO line
    naming the tokens, the target width and the number of taps (pass them as keywords).
    """
    global _activation_logged
    staged = bool(drafter_compatible) and not capturing and num_tokens >= threshold
    if staged and not _activation_logged:
        _activation_logged = True
        logger.info("staged MXFP8 drafter input active: %d tokens, target width %s, %s taps (threshold %d)",
                    num_tokens, target_width, num_taps, threshold)
    return staged


class LiveTensorBytes(TorchDispatchMode):
    """Measures live tensor storage bytes allocated inside the mode (CPU or GPU), and their peak.

    Every op output whose storage is new (not one of the op's inputs' storages and not yet tracked)
    counts ``storage.nbytes()`` until the storage is freed (weakref callback). Tensors that existed
    before the mode are not counted, even when viewed inside it. ``peak`` is the high-water mark.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: dict[int, weakref.ref] = {}

    def _free(self, key: int, nbytes: int) -> None:
        if self._tracked.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = set()
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                seen.add(a.untyped_storage().data_ptr())
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            nbytes = st.nbytes()
            if key in seen or key in self._tracked or nbytes == 0:
                continue
            self._tracked[key] = weakref.ref(st, lambda _, k=key, n=nbytes: self._free(k, n))
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return out
