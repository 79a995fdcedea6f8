"""Norms fused into the next kernel's prologue (``norm.PreNorm``, session 28): a pre-norm decoder layer hands its
input and post-attention norms to MLA (the fused q_a/kv_a GEMV) and the MoE (the one-token kernel), MLA fuses
q_a_layernorm into the q_b GEMV and kv_a_layernorm into the cache write of a uniform decode step.

- CPU: ``PreNorm.apply`` / ``reference`` equal ``RMSNorm``; ``gemv.linear_prenorm`` off CUDA is the norm then
  ``F.linear``, bit for bit; bad pre-norms are refused by name; a tiny DeepSeek-V3 served on the CPU generates the
  same greedy tokens with the fusion on and off (the CPU takes each norm's own path: this checks the plumbing of
  the residual stream through ``PreNormDecoderLayer``);
- GPU (skipped without CUDA): the same model at batch 1 with CUDA graphs: graphs equal eager with the fusion on,
  the fused and unfused engines agree on >= 90 % of greedy tokens (bf16, sums in another order), and an eager
  one-token decode step launches 5 RMSNorm kernels fewer (3 layers, the first dense).
The kernels themselves are checked against their references in ``test_gemv_triton.py``,
``test_moe_decode_triton.py`` and ``test_fp8_kv_ops.py``.
"""

import pytest
import torch
import torch.nn.functional as F

from longflash.layers import gemv
from longflash.layers.norm import PreNorm, RMSNorm


def test_prenorm_apply_and_reference_equal_rmsnorm():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(48, generator=g))
    x, r = torch.randn(3, 48, generator=g), torch.randn(3, 48, generator=g)
    with torch.no_grad():
        h, s = norm.pending(r).apply(x)
        want_h, want_s = norm(x, r)
        assert torch.equal(h, want_h) and torch.equal(s, want_s)
        h0, s0 = norm.pending().apply(x)
        assert torch.equal(h0, norm(x)) and s0 is x
        out = torch.empty_like(x)
        assert torch.equal(norm.pending(r).reference(x, out), want_h) and torch.equal(out, want_s)


def test_linear_prenorm_off_cuda_is_norm_then_linear():
    g = torch.Generator().manual_seed(1)
    x, r, w = torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g), torch.randn(24, 64, generator=g)
    nw = 1 + 0.1 * torch.randn(64, generator=g)
    pre = PreNorm(nw, 1e-6, r)
    y, s = gemv.linear_prenorm(x, w, pre)
    h, s_want = pre.apply(x)
    assert torch.equal(y, F.linear(h, w)) and torch.equal(s, s_want)
    # the GEMV's reference: the normalized x in fp32, one rounding of y (the kernel folds the scale into y)
    out = torch.empty_like(x)
    xn = pre.normalized_fp32(x, out)
    assert torch.equal(out, s_want) and torch.allclose(xn, h, rtol=1e-6, atol=0)  # fp32 x: the same to rounding
    assert torch.equal(gemv.gemv_ref(x, w, prenorm=pre, residual_out=out), (xn @ w.t()).to(x.dtype))
    xh, rh, wh = x.half(), r.half(), w.half()
    pre_h = PreNorm(nw.half(), 1e-6, rh)
    assert not torch.equal(pre_h.normalized_fp32(xh, torch.empty_like(xh)), pre_h.apply(xh)[0].float())  # unrounded


def test_bad_prenorms_are_refused_by_name():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    nw = torch.ones(16)
    for pre, out, msg in ((PreNorm(torch.ones(15), 1e-6), None, "pre-norm weight"),
                          (PreNorm(nw.half(), 1e-6), None, "pre-norm weight"),
                          (PreNorm(nw, 1e-6, torch.randn(2, 15)), torch.empty(2, 16), "residual"),
                          (PreNorm(nw, 1e-6, torch.randn(2, 16)), None, "residual_out must be given"),
                          (PreNorm(nw, 1e-6), torch.empty(2, 16), "residual_out must be given"),
                          (PreNorm(nw, 1e-6, torch.randn(2, 16)), torch.empty(16, 2).t(), "contiguous")):
        with pytest.raises(ValueError, match=msg):
            gemv.gemv_ref(x, w, prenorm=pre, residual_out=out)
    with pytest.raises(ValueError, match="2-D"):
        gemv.gemv_ref(x[None], w[None], prenorm=PreNorm(nw, 1e-6))
    with pytest.raises(ValueError, match="only written with a pre-norm"):
        gemv.gemv_ref(x, w, residual_out=torch.empty(2, 16))
    from longflash.attention import ops
    cache = torch.zeros(2, 4, 24)
    with pytest.raises(ValueError, match="no residual"):
        ops.concat_and_cache_mla(torch.randn(1, 16), torch.randn(1, 8), cache, torch.tensor([0]),
                                 kv_c_norm=PreNorm(nw, 1e-6, torch.randn(1, 16)))


def _generate(path, fusion: bool, monkeypatch, **kw):
    from longflash import LLM, SamplingParams
    from longflash.models import base
    monkeypatch.setattr(base, "PRENORM_FUSION", fusion)
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=1, kv_cache_memory="64MiB", **kw)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 17, 33] * 6, [7, 11, 2] * 5]
    out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    return out, llm


def test_cpu_generation_same_with_fusion_on_and_off(tmp_path, monkeypatch):
    from tiny_models import make_deepseek_v3
    path = make_deepseek_v3(str(tmp_path / "m"))
    on, llm = _generate(path, True, monkeypatch, device="cpu")
    llm.shutdown()
    off, llm = _generate(path, False, monkeypatch, device="cpu")
    llm.shutdown()
    assert on == off and all(len(t) == 12 for t in on)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_batch1_fused_norms(tmp_path, monkeypatch):
    """Batch 1 on CUDA: with CUDA graphs, graphs == eager with the fusion on, and fused vs unfused >= 90 % equal
    greedy tokens; in eager steps under the profiler, each one-token decode step launches 5 RMSNorm kernels
    fewer with ``PRENORM_FUSION`` than without (3 layers, the first dense: every layer's input norm and the MoE
    layers' post-attention norms go into the next kernel; the q_a and kv_a norms are fused either way, the dense
    layer's post-attention norm and the final norm stay), and 2 launches in all with it."""
    from tiny_models import make_deepseek_v3
    path = make_deepseek_v3(str(tmp_path / "m"), num_layers=3)
    kw = dict(device="cuda", dtype="bfloat16")
    on, llm = _generate(path, True, monkeypatch, **kw)
    llm.shutdown()
    eager, llm = _generate(path, True, monkeypatch, enforce_eager=True, **kw)
    llm.shutdown()
    off, llm = _generate(path, False, monkeypatch, **kw)
    llm.shutdown()
    assert on == eager
    same = sum(a == b for x, y in zip(on, off) for a, b in zip(x, y))
    assert same >= 0.9 * sum(len(x) for x in on), (on, off)
    n = {fusion: _rms_norm_launches(path, fusion, monkeypatch, max_tokens=5) for fusion in (True, False)}
    assert n[False] - n[True] == 5 * 4, n  # 4 decode steps after the prefill's token
    # the prefill (13 norms: 12 tokens take the unfused paths) and 2 per decode step remain
    assert n[True] == 13 + 2 * 4, n


def _rms_norm_launches(path, fusion: bool, monkeypatch, max_tokens: int) -> int:
    """RMSNorm kernels launched by an eager batch-1 engine generating ``max_tokens`` greedy tokens (profiled
    after a warm-up generation)."""
    from longflash import LLM, SamplingParams
    from longflash.models import base
    monkeypatch.setattr(base, "PRENORM_FUSION", fusion)
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=1, kv_cache_memory="64MiB", device="cuda",
              dtype="bfloat16", enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 9, 17, 33] * 3}]
    llm.generate(prompt, params)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params)
        torch.cuda.synchronize()
    llm.shutdown()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA and "rms_norm" in e.name for e in prof.events())
