"""Staged MXFP8 drafter input: bitwise equal to concatenate-then-quantize, misuse raises, bounded memory."""
import logging

import pytest
import torch

import longflash.ops.mxfp8 as mx
from longflash.ops.mxfp8 import dequantize_mxfp8
from longflash.spec_decode import staged_input as si
from longflash.spec_decode.staged_input import (LiveTensorBytes, StagedDrafterInput, concat_then_quantize,
                                                drafter_fc_compatible, mxfp8_buffers, project_mxfp8, use_staged_path)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), unlike torch.equal, for which NaN != NaN."""
    ity = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ity), b.view(ity))


def _taps(m, widths, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    taps = [torch.randn(m, w, generator=g) * (4.0 ** i) for i, w in enumerate(widths)]
    if m > 2:
        taps[0][1, 5] = float("nan")   # a NaN block, a zero block: conventions travel through both paths
        taps[-1][2, :32] = 0.0
    return [t.to(dtype) for t in taps]


@pytest.mark.parametrize("m, widths, n, row_chunk", [
    (1, [32], 16, 8),
    (5, [64, 96, 32], 24, 2),
    (9, [256, 256, 256], 64, 4),
    (3, [7168] * 6, 32, 2),          # Kimi-K3 shape: six taps of 7168 columns
    (0, [64, 64], 8, 4),             # zero tokens
])
def test_staged_equals_concat_then_quantize_bitwise(m, widths, n, row_chunk):
    taps = _taps(m, widths)
    weight = (torch.randn(n, sum(widths), generator=torch.Generator().manual_seed(1)) * 0.02)
    data_s, scales_s, out_s = mxfp8_buffers(m + 3, widths, n, out_dtype=weight.dtype)
    data_c, scales_c, out_c = mxfp8_buffers(m, widths, n, out_dtype=weight.dtype)
    acc = StagedDrafterInput(widths, weight, data_s, scales_s, out_s, m, row_chunk=row_chunk)
    for i, t in enumerate(taps):
        acc.add(i, t)
    y_s = acc.finalize()
    y_c = concat_then_quantize(taps, weight, data_c, scales_c, out_c, row_chunk=row_chunk)
    assert y_s.shape == (m, n) and (m == 0 or y_s.data_ptr() == out_s.data_ptr())
    assert torch.equal(data_s[:m], data_c) and torch.equal(scales_s[:m], scales_c)
    assert _bits_equal(y_s, y_c)
    if m:
        # and the projection is the exact product of the dequantized input (not just self-consistent)
        ref = dequantize_mxfp8(data_c, scales_c).double() @ weight.double().t()
        fin = torch.isfinite(ref)
        assert torch.allclose(y_c.double()[fin], ref[fin], rtol=1e-4, atol=1e-4)
        assert torch.isnan(y_c[1]).all() if m > 2 else True


def test_buffers_reused_across_steps_and_bf16_weight():
    widths, n = [64, 128], 32
    weight = torch.randn(n, sum(widths), dtype=torch.bfloat16)
    data, scales, out = mxfp8_buffers(16, widths, n)
    acc = StagedDrafterInput(widths, weight, data.view(torch.float8_e4m3fn), scales, out, 16, row_chunk=5)
    for step, m in enumerate([16, 3, 11]):
        acc.reset(m)
        taps = _taps(m, widths, seed=step)
        for i, t in enumerate(taps):
            acc.add(i, t)
        y = acc.finalize()
        dc, sc, oc = mxfp8_buffers(m, widths, n)
        assert _bits_equal(y, concat_then_quantize(taps, weight, dc, sc, oc, row_chunk=5))
        assert y.data_ptr() == out.data_ptr()


def _acc(widths=(32, 64), m=4):
    weight = torch.randn(8, sum(widths))
    data, scales, out = mxfp8_buffers(m, widths, 8, out_dtype=torch.float32)
    return StagedDrafterInput(widths, weight, data, scales, out, m), [torch.randn(m, w) for w in widths]


def test_misuse_raises():
    acc, taps = _acc()
    with pytest.raises(RuntimeError, match="order"):
        acc.add(1, taps[1])                      # wrong order (tap 0 missing)
    with pytest.raises(ValueError, match="shape"):
        acc.add(0, taps[1])                      # wrong width
    with pytest.raises(ValueError, match="shape"):
        acc.add(0, taps[0][:3])                  # wrong token count
    with pytest.raises(RuntimeError, match="missing"):
        acc.finalize()                           # finalize with taps missing
    acc.add(0, taps[0])
    with pytest.raises(RuntimeError, match="already"):
        acc.add(0, taps[0])                      # repeated tap
    with pytest.raises(RuntimeError, match="missing"):
        acc.finalize()
    acc.add(1, taps[1])
    with pytest.raises(RuntimeError, match="order"):
        acc.add(2, taps[1])                      # beyond the last tap
    y = acc.finalize().clone()
    with pytest.raises(RuntimeError, match="twice"):
        acc.finalize()                           # finalize twice
    with pytest.raises(RuntimeError, match="after finalize"):
        acc.add(0, taps[0])                      # add after finalize
    acc.reset()
    acc.add(0, taps[0]); acc.add(1, taps[1])
    assert _bits_equal(acc.finalize(), y)        # usable again after reset, same result
    with pytest.raises(ValueError):
        acc.reset(5)                             # more tokens than the buffers hold


def test_construction_checks():
    w = torch.randn(8, 96)
    data, scales, out = mxfp8_buffers(4, [32, 64], 8, out_dtype=torch.float32)
    with pytest.raises(ValueError):
        StagedDrafterInput([48, 48], w, data, scales, out, 4)         # width not a multiple of 32
    with pytest.raises(ValueError):
        StagedDrafterInput([32, 64], torch.randn(8, 64), data, scales, out, 4)
    with pytest.raises(ValueError):
        StagedDrafterInput([32, 64], w, data, scales, out.to(torch.bfloat16), 4)
    with pytest.raises(ValueError):
        project_mxfp8(data, scales, w, out, row_chunk=0)


def test_policy_and_one_time_log(caplog, monkeypatch):
    monkeypatch.setattr(si, "_activation_logged", False)
    assert not use_staged_path(8, threshold=512, capturing=False, drafter_compatible=True)      # decode-sized
    assert not use_staged_path(4096, threshold=512, capturing=True, drafter_compatible=True)    # CUDA graph
    assert not use_staged_path(4096, threshold=512, capturing=False, drafter_compatible=False)
    with caplog.at_level(logging.INFO, logger="longflash"):
        assert use_staged_path(4096, 512, False, True, target_width=7168, num_taps=6)
        assert use_staged_path(8192, 512, False, True, target_width=7168, num_taps=6)
    lines = [r.getMessage() for r in caplog.records if "staged MXFP8" in r.getMessage()]
    assert len(lines) == 1 and "4096 tokens" in lines[0] and "7168" in lines[0] and "6 taps" in lines[0]
    assert use_staged_path(512, threshold=512)
    assert drafter_fc_compatible(torch.nn.Linear(96, 8, bias=False), [32, 64])
    assert not drafter_fc_compatible(torch.nn.Linear(96, 8, bias=True), [32, 64])
    assert not drafter_fc_compatible(torch.nn.Linear(96, 8, bias=False), [48, 48])


def _peak_bytes(staged: bool, m, widths, n, weight, row_chunk) -> int:
    """Peak live bytes of one step: buffers, taps as the target produces them, quantize, project."""
    with torch.no_grad(), LiveTensorBytes() as mem:
        data, scales, out = mxfp8_buffers(m, widths, n, out_dtype=weight.dtype)
        g = torch.Generator().manual_seed(0)
        if staged:
            acc = StagedDrafterInput(widths, weight, data, scales, out, m, row_chunk=row_chunk)
            for i, w in enumerate(widths):
                h = torch.randn(m, w, generator=g, dtype=torch.bfloat16)   # the target layer's output
                acc.add(i, h)
                del h                                                      # released right after add
            y = acc.finalize()
        else:
            taps = [torch.randn(m, w, generator=g, dtype=torch.bfloat16) for w in widths]
            y = concat_then_quantize(taps, weight, data, scales, out, row_chunk=row_chunk)
            del taps
        assert y.shape == (m, n)
    return mem.peak


def test_peak_live_bytes_staged_vs_concat(monkeypatch):
    # Scaled-down Kimi-K3 step (6 taps). The reference quantizer's temporaries are bounded by its
    # element chunk; it is set small here so that, as with the GPU kernel, the buffers dominate.
    monkeypatch.setattr(mx, "_REF_CHUNK_ELEMS", 1 << 14)
    m, widths, n, row_chunk = 256, [256] * 6, 256, 32
    weight = torch.randn(n, sum(widths), dtype=torch.bfloat16)
    staged = _peak_bytes(True, m, widths, n, weight, row_chunk)
    concat = _peak_bytes(False, m, widths, n, weight, row_chunk)
    tap_bytes = m * sum(widths) * 2
    mx_bytes = m * sum(widths) * (1 + 1 / 32)
    # sanity of the tracker: concat holds all taps and their concatenation at once
    assert concat >= 2 * tap_bytes + mx_bytes
    assert staged >= mx_bytes + m * widths[0] * 2
    assert staged <= 0.55 * concat, (staged, concat, staged / concat)


def test_live_bytes_tracker_counts_allocations_and_frees():
    with LiveTensorBytes() as mem:
        a = torch.empty(1000, dtype=torch.float32)        # 4000 B
        b = a.view(10, 100)                               # view: no new storage
        c = torch.empty(500, dtype=torch.uint8)           # +500
        del a, b
        d = torch.empty(250, dtype=torch.float64)         # 4000 freed, +2000
        assert mem.live == 2500
    assert mem.peak == 4500 and c.numel() and d.numel()


def test_accumulator_under_torch_compile_fullgraph():
    widths, n, m = [64, 96], 16, 6
    weight = torch.randn(n, sum(widths))
    data, scales, out = mxfp8_buffers(m, widths, n, out_dtype=torch.float32)
    acc = StagedDrafterInput(widths, weight, data, scales, out, m, row_chunk=4)
    taps = _taps(m, widths, dtype=torch.float32)

    def step(t0, t1):
        acc.reset()
        acc.add(0, t0)
        acc.add(1, t1)
        return acc.finalize()

    eager = step(*taps).clone()
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(*taps).clone()
    assert _bits_equal(got, eager)
    taps2 = _taps(m, widths, dtype=torch.float32, seed=7)
    got2 = compiled(*taps2).clone()
    assert _bits_equal(got2, step(*taps2))


def test_projection_dequantizer_choice_and_override():
    """CPU default is the torch dequantizer; a caller-given one (e.g. the fused Triton kernel on CUDA)
    is used by both paths, and a byte-identical dequantizer gives bitwise-identical outputs."""
    assert si.default_dequantize_fn(torch.empty(0, dtype=torch.uint8), torch.bfloat16) is si._dequantize_torch
    assert si.DEFAULT_ROW_CHUNK == 1024  # meets staged/concat <= 1.00 on the H200 (benchmarks/NOTES.md)
    widths, n, m = [64, 96], 16, 7
    weight = torch.randn(n, sum(widths), dtype=torch.bfloat16)
    taps = _taps(m, widths)
    calls = []

    def dq(d, s, o):
        calls.append(d.shape[0])
        return dequantize_mxfp8(d, s, out=o)

    data, scales, out = mxfp8_buffers(m, widths, n)
    acc = StagedDrafterInput(widths, weight, data, scales, out, m, row_chunk=3, dequantize_fn=dq)
    for i, t in enumerate(taps):
        acc.add(i, t)
    y = acc.finalize()
    assert calls == [3, 3, 1]
    dc, sc, oc = mxfp8_buffers(m, widths, n)
    yc = concat_then_quantize(taps, weight, dc, sc, oc, row_chunk=3, dequantize_fn=dq,
                              scratch=torch.empty(3, sum(widths), dtype=torch.bfloat16))
    assert calls == [3, 3, 1, 3, 3, 1] and _bits_equal(y, yc)
    d2, s2, o2 = mxfp8_buffers(m, widths, n)
    assert _bits_equal(concat_then_quantize(taps, weight, d2, s2, o2, row_chunk=3), y)   # default dequantizer
