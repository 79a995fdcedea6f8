"""``ops.attention_with_lse_inplace`` (the GPU prefill's dense attention) equals the reference
``ops.attention_with_lse`` within fp32 rounding, including the awkward cases."""

import pytest
import torch

from longflash.attention import ops


def _case(tq, tk, h, hk, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(tq, h, d, generator=g) * 2).to(dtype)
    k = (torch.randn(tk, hk, d, generator=g) * 2).to(dtype)
    v = torch.randn(tk, hk, dv, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("tq,tk,hk,causal_offset", [
    (7, 13, 4, None),     # non-causal context piece
    (9, 9, 4, 0),         # new tokens, causal square
    (5, 12, 1, 7),        # decode-style: one broadcast KV head, queries at the end
    (6, 10, 4, -3),       # the first 3 queries see no key: output 0, LSE -inf
    (3, 4, 4, -10),       # no query sees a key
    (1, 1, 4, 0),         # one token
    (4, 0, 4, None),      # no key at all
    (0, 5, 4, None),      # no query
    (33, 130, 4, 97),     # not a multiple of anything
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_equals_reference(tq, tk, hk, causal_offset, dtype):
    q, k, v = _case(tq, tk, 4, hk, 24, 16, dtype, seed=tq * 1000 + tk)
    want, want_lse = ops.attention_with_lse(q, k, v, 0.3, causal_offset) if tk else (
        q.new_zeros(tq, 4, 16), torch.full((tq, 4), float("-inf")))
    got, got_lse = ops.attention_with_lse_inplace(q, k, v, 0.3, causal_offset)
    assert got.shape == want.shape and got.dtype == q.dtype and got_lse.dtype == torch.float32
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    assert torch.allclose(got_lse[fin], want_lse[fin], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[~fin], torch.zeros_like(got[~fin]))
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one output rounding
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def test_inplace_pieces_merge_to_whole():
    """Split over keys and merged by LSE (the chunked-context prefill) = one call over all keys."""
    q, k, v = _case(20, 70, 4, 4, 24, 16, torch.float32, seed=3)
    whole, whole_lse = ops.attention_with_lse_inplace(q, k, v, 0.2, None)
    out, lse = None, None
    for s in range(0, 70, 16):
        o, l = ops.attention_with_lse_inplace(q, k[s:s + 16], v[s:s + 16], 0.2, None)
        out, lse = (o, l) if out is None else ops.merge_attn_states(out, lse, o, l)
    assert torch.allclose(out, whole, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse, whole_lse, rtol=1e-6, atol=1e-6)


def test_gpu_prefill_takes_the_flash_kernel():
    """The MLA prefill calls ``cache_ops(cache).attention_with_lse``: for a CUDA cache ``triton_ops``'s,
    which runs the Triton flash-attention kernel (``triton_prefill``) on CUDA tensors and the in-place
    form on others; the reference for a CPU cache (``ops``)."""
    pytest.importorskip("triton")
    from longflash.attention import mla, triton_ops, triton_prefill
    assert triton_ops.attention_with_lse is triton_prefill.dispatch_attention_with_lse
    assert mla.cache_ops(torch.empty(1, 16, 8)).attention_with_lse is ops.attention_with_lse
    q, k, v = _case(9, 13, 2, 1, 24, 16, torch.float32, seed=4)
    got, got_lse = triton_ops.attention_with_lse(q, k, v, 0.2, -2)
    want, want_lse = ops.attention_with_lse_inplace(q, k, v, 0.2, -2)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tq,tk,causal_offset", [(2048, 16384, None), (2048, 2048, 0)])
def test_inplace_equals_reference_gpu_real_shapes(tq, tk, causal_offset):
    """DeepSeek-V3 MLA prefill shapes on one rank of TP 8 (16 heads, qk 192, v 128), bf16 inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tq, 16, 192, device="cuda", generator=g).bfloat16()
    k = torch.randn(tk, 16, 192, device="cuda", generator=g).bfloat16()
    v = torch.randn(tk, 16, 128, device="cuda", generator=g).bfloat16()
    want, want_lse = ops.attention_with_lse(q, k, v, 192 ** -0.5, causal_offset)
    got, got_lse = ops.attention_with_lse_inplace(q, k, v, 192 ** -0.5, causal_offset)
    assert torch.allclose(got_lse, want_lse, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_varlen_reference_is_per_request_and_refuses_bad_lengths():
    """``ops.attention_with_lse_varlen`` (the CPU prefill's batched form) = ``attention_with_lse`` per request
    (causal offsets Tk − Tq; a request without keys gets 0 and −inf), and refuses what the Triton form refuses:
    bools, negative or non-int lengths, lengths that do not add up."""
    torch.manual_seed(0)
    lq, lk = [3, 0, 5, 2], [7, 4, 5, 0]
    q, k, v = torch.randn(sum(lq), 2, 16), torch.randn(sum(lk), 2, 16), torch.randn(sum(lk), 2, 8)
    for causal in (True, False):
        out, lse = ops.attention_with_lse_varlen(q, k, v, 0.3, lq, lk, causal)
        qs = ks = 0
        for a, b in zip(lq, lk):
            o1, l1 = ops.attention_with_lse(q[qs:qs + a], k[ks:ks + b], v[ks:ks + b], 0.3, b - a if causal else None)
            assert torch.equal(out[qs:qs + a], o1) and torch.equal(lse[qs:qs + a], l1)
            qs, ks = qs + a, ks + b
    assert bool((out[8:] == 0).all()) and bool(lse[8:].isinf().all())  # the last request has no keys
    for bad_q, bad_k in (([3, 0, 5, True], [7, 4, 5, 0]), ([3, 0, 5, 2], [7, 4, 6, -1]), ([3, 0, 5, 2.0], lk),
                         ([3, 0, 5, 1], lk), (lq, lk[:3])):
        with pytest.raises(ValueError):
            ops.attention_with_lse_varlen(q, k, v, 0.3, bad_q, bad_k, True)
