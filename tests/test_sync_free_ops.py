"""Ops of the sync-free decode path (no device -> host read; what a CUDA graph captures) equal the
general ops on the CPU: cache writes that skip slot -1 without a boolean mask, and the paged MLA / GQA
attention references with device-tensor lengths and host bounds against the same references with
Python lists (fp32 and fp8 caches, multi-token causal queries, an empty request, pieces merged by LSE)."""

import pytest
import torch

from longflash.attention import ops


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max(1, max |b|)."""
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def test_write_rows_skips_minus_one_slots():
    flat = torch.randn(10, 3)
    ref = flat.clone()
    rows = torch.randn(5, 3)
    ops.write_rows(flat, torch.tensor([-1, 3, -1, 0, 7]), rows)
    ref[3], ref[0], ref[7] = rows[1], rows[3], rows[4]
    assert torch.equal(flat, ref)
    ops.write_rows(flat, torch.tensor([-1, -1]), torch.randn(2, 3))  # nothing valid: nothing changes
    assert torch.equal(flat, ref)


def _paged_case(seed: int, block_size: int = 4):
    g = torch.Generator().manual_seed(seed)
    nb = 24
    seq, qlens = [5, 1, 9, 13, 0], [1, 1, 3, 2, 0]
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    bt = torch.full((len(seq), 5), -1, dtype=torch.int32)
    perm, k = torch.randperm(nb, generator=g), 0
    for b, L in enumerate(seq):
        nblk = -(-L // block_size)
        bt[b, :nblk] = perm[k:k + nblk]
        k += nblk
    return g, nb, seq, qsl, bt


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_mla_decode_tensor_lengths_equal_lists(cache_dtype):
    g, nb, seq, qsl, bt = _paged_case(0)
    R, W, H = 16, 24, 3
    cache = (torch.randn(nb, 4, W, generator=g)).to(cache_dtype)
    q = torch.randn(qsl[-1], H, W, generator=g)
    ks = 0.5 if cache_dtype != torch.float32 else None
    ref, ref_lse = ops.mla_decode_attention(q, cache, bt, qsl, seq, 0.3, R, ks, max_rows_per_piece=8)
    qsl_t, seq_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq, dtype=torch.int32)
    for bounds in (dict(max_query_len=3, max_seq_len=13), {}):  # tight bounds; defaults (T, table capacity)
        out, lse = ops.mla_decode_attention(q, cache, bt, qsl_t, seq_t, 0.3, R, ks, max_rows_per_piece=8, **bounds)
        assert _close(out, ref) <= 1e-6 and torch.equal(lse.isinf(), ref_lse.isinf())
        assert _close(lse[~lse.isinf()], ref_lse[~ref_lse.isinf()]) <= 1e-6


def test_gqa_tensor_lengths_equal_lists():
    g, nb, seq, qsl, bt = _paged_case(1)
    kc, vc = torch.randn(nb, 4, 2, 8, generator=g), torch.randn(nb, 4, 2, 8, generator=g)
    q = torch.randn(qsl[-1], 4, 8, generator=g)
    ref = ops.paged_gqa_attention(q, kc, vc, bt, qsl, seq, 0.3)
    out = ops.paged_gqa_attention(q, kc, vc, bt, torch.tensor(qsl, dtype=torch.int32),
                                  torch.tensor(seq, dtype=torch.int32), 0.3, max_query_len=3)
    assert _close(out, ref) <= 1e-6
