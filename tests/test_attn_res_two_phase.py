"""The two-phase Block AttnRes mixer (``layers/attn_res_two_phase.py``, ``models/attn_res_two_phase_mix.py``)
equals the one-phase mixer: per mixer of small multi-block schedules (fp32 within a few ulps, bf16 within
one rounding step), end to end through ``execute_plan`` (reuse on bitwise equal to reuse off), in the
Kimi-K3 tiny model's logits and greedy tokens; the Triton kernels equal the references under
``TRITON_INTERPRET=1`` (and on a GPU at Kimi-K3 shapes); bad input raises ValueError naming the problem.

Error measures as ``tests/test_attn_res_triton.py``: fp32 ``max|a - b| / max|b|``; fp16/bf16 in rounding
steps ``max |a - b| / (eps_dtype |b| + 1e-6 max|b|)`` (at most 1: the fp32 results differ by a few fp32
ulps and are rounded once)."""

import math
import os
import sys

import pytest
import torch

from longflash import LLM, SamplingParams
from longflash.layers.attn_res import attn_res_mix_reference
from longflash.layers.attn_res_two_phase import (AttnResPartials, attn_res_block_partials,
                                                 attn_res_block_partials_reference, attn_res_merge_prefix,
                                                 attn_res_merge_prefix_reference)
from longflash.models.attn_res_plan import ATTN_MIX, OUT_MIX, attn_res_plan, execute_plan
from longflash.models.attn_res_two_phase_mix import AttnResTwoPhase, block_queries
from longflash.training.config import default_model_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from attn_res_harness import RandomSublayers  # noqa: E402
from interpreter_run import run_interpreted  # noqa: E402
from sm90_compile import compile_report  # noqa: E402
from test_kimi_k3 import SMALL, _save_random  # noqa: E402

EPS = 1e-5


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _steps(a, b):
    d, r = (a.float() - b.float()).abs(), b.float().abs()
    return float((d / (torch.finfo(b.dtype).eps * r + 1e-6 * r.max())).max())


def _within(a, b, fp32_rel=2e-6):
    return _rel(a, b) <= fp32_rel if b.dtype == torch.float32 else _steps(a, b) <= 1.0


def _weights_of(sub):
    def weights(layer, kind):
        l, j = (layer, 0 if kind == ATTN_MIX else 1) if layer is not None else (-1, 0)
        return sub.norm[l, j], sub.proj[l, j]
    return weights


def _run(sched, plan, x, sub, mix, reuse):
    return execute_plan(sched, plan, x.shape[0], x.shape[1], x.dtype, x.device, embed=lambda out: out.copy_(x),
                        mix=mix, attn=sub.attn, mlp=sub.mlp, reuse=reuse)


def _one_phase(sub):
    weights = _weights_of(sub)
    return lambda l, kind, src, out: attn_res_mix_reference(src, *weights(l, kind), EPS, out=out)


SCHEDULES = [(7, 3), (4, 4), (5, 1), (93, 12)]  # partial last block; one block (C = 1 throughout); bs 1; Kimi-K3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_layers,bs", SCHEDULES)
def test_every_mixer_equals_one_phase(num_layers, bs, dtype):
    """Record every one-phase mixer's sources and result; per block, phase 1 over the first mixer's
    sources (which are exactly the slots every later mixer of the block reads besides its prefix) and
    phase 2 with each later mixer's prefix reproduce each result."""
    T, H = 5, 48
    sched, plan = attn_res_plan(num_layers, bs)
    sub = RandomSublayers(num_layers, H, dtype, "cpu", seed=num_layers)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    seen = {}

    def record(l, kind, src, out):
        res = _one_phase(sub)(l, kind, src, out)
        seen[(l, kind)] = ([s.clone() for s in src], res.clone())
        return res
    _run(sched, plan, x, sub, record, reuse=False)
    weights = _weights_of(sub)
    blocks = block_queries(num_layers, bs)
    assert len(blocks) == sched.num_bank_slots and blocks[-1][-1] == (None, OUT_MIX)
    assert sum(len(b) for b in blocks) == len(seen) == 2 * num_layers + 1
    for k, queries in enumerate(blocks):
        committed, first = seen[queries[0]]
        assert len(committed) == k + 1  # bank[:k] ++ [the prefix committed as bank[k]]
        G = torch.stack([weights(*q)[0] for q in queries])
        W = torch.stack([weights(*q)[1] for q in queries])
        parts = attn_res_block_partials_reference(committed, G, W, EPS)
        assert parts.acc.shape == (len(queries), T, H) and parts.lse.shape == (len(queries), T)
        got0 = parts.acc[0].to(dtype)
        if k == 0:
            assert torch.equal(got0, x) and torch.equal(first, x)  # C = 1: the embedding exactly
        assert _within(got0, first), (k, _rel(got0, first), _steps(got0, first))
        for i, q in enumerate(queries[1:], start=1):
            src, want = seen[q]
            assert len(src) == k + 2 and all(torch.equal(a, b) for a, b in zip(src, committed)), q
            got = attn_res_merge_prefix_reference(parts.query(i), src[-1], *weights(*q), EPS)
            assert got.dtype == dtype and _within(got, want), (q, _rel(got, want), _steps(got, want))


@pytest.mark.parametrize("num_layers,bs", [(7, 3), (93, 12)])
def test_forward_two_phase_equals_one_phase_and_reuse_is_bitwise(num_layers, bs):
    """Through ``execute_plan`` with the two-phase callback: output mixture and every bank slot within
    1e-5 of the one-phase forward (fp32, errors compound over layers); reuse on == reuse off bitwise."""
    T, H = 6, 64
    sched, plan = attn_res_plan(num_layers, bs)
    sub = RandomSublayers(num_layers, H, torch.float32, "cpu", seed=7)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    ref = _run(sched, plan, x, sub, _one_phase(sub), reuse=False)
    two = AttnResTwoPhase(num_layers, bs, EPS)
    on = _run(sched, plan, x, sub, two.mixer(_weights_of(sub)), reuse=True)
    off = _run(sched, plan, x, sub, two.mixer(_weights_of(sub)), reuse=False)
    assert torch.equal(on.y, off.y) and all(torch.equal(a, b) for a, b in zip(on.bank, off.bank))
    assert _rel(on.y, ref.y) <= 1e-5 and all(_rel(a, b) <= 1e-5 for a, b in zip(on.bank, ref.bank))
    assert not torch.equal(on.y, ref.y) or num_layers < 2  # the two paths really differ in summation order


def test_mixer_rejects_sources_other_than_the_committed_slots():
    sub = RandomSublayers(4, 16, torch.float32, "cpu")
    mix = AttnResTwoPhase(4, 2, EPS).mixer(_weights_of(sub))
    e, p = torch.randn(3, 16), torch.randn(3, 16)
    mix(0, "attn_mix", [e], None)
    with pytest.raises(RuntimeError, match="mlp_mix of layer 0 \\(block 0\\)"):
        mix(0, "mlp_mix", [e.clone(), p], None)


def test_stacked_weights_follow_in_place_weight_updates():
    sub = RandomSublayers(4, 16, torch.float32, "cpu")
    two = AttnResTwoPhase(4, 2, EPS)
    G, _ = two.stacked_weights(1, _weights_of(sub))
    assert two.stacked_weights(1, _weights_of(sub))[0] is G  # cached
    sub.norm[2, 1].add_(1.0)  # layer 2's mlp mixer: query 1 of block 1
    G2, _ = two.stacked_weights(1, _weights_of(sub))
    assert torch.equal(G2[1], sub.norm[2, 1]) and not torch.equal(G2[1], G[1])


def _engine(path):
    return LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=256,
               enable_prefix_caching=False)


PROMPTS = [list(range(3, 40)), [7], [100 + (i * 37) % 400 for i in range(23)]]


def test_kimi_k3_tiny_logits_and_greedy_two_phase_on_off(tmp_path):
    """The Kimi-K3 test config (7 layers, block 3): logits within 1e-5, greedy tokens equal, and the
    option comes from the model config (``attn_res_two_phase``)."""
    import json
    cfg = default_model_config(**SMALL)
    _save_random(tmp_path / "k3", cfg, seed=5)
    llm = _engine(str(tmp_path / "k3"))
    model = llm.engine.model.model
    assert model.attn_res_two_phase is False  # default off
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    off = [llm.engine.score(p) for p in PROMPTS]
    off_tok = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)]
    model.attn_res_two_phase = True
    on = [llm.engine.score(p) for p in PROMPTS]
    on_tok = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)]
    assert all(_rel(a, b) <= 1e-5 for a, b in zip(on, off)), [_rel(a, b) for a, b in zip(on, off)]
    assert not all(torch.equal(a, b) for a, b in zip(on, off))  # the option took effect (summation order)
    assert on_tok == off_tok
    (tmp_path / "k3" / "config.json").write_text(json.dumps(dict(cfg, attn_res_two_phase=True)))
    llm2 = _engine(str(tmp_path / "k3"))
    assert llm2.engine.model.model.attn_res_two_phase is True
    assert torch.equal(llm2.engine.score(PROMPTS[0]), on[0])


def test_bad_arguments_raise():
    x = torch.randn(3, 16)
    G, W = torch.ones(2, 16), torch.randn(2, 16)
    with pytest.raises(ValueError, match="at least one committed row"):
        attn_res_block_partials([], G, W, EPS)
    with pytest.raises(ValueError, match="committed row 1"):
        attn_res_block_partials([x, torch.randn(3, 8)], G, W, EPS)
    with pytest.raises(ValueError, match="must be \\[T, H\\]"):
        attn_res_block_partials([x[0]], G, W, EPS)
    with pytest.raises(ValueError, match="norm_weights must be \\[Q, H=16\\]"):
        attn_res_block_partials([x], torch.ones(2, 8), W, EPS)
    with pytest.raises(ValueError, match="proj_weights must be \\[Q=2, H=16\\]"):
        attn_res_block_partials([x], G, torch.randn(3, 16), EPS)
    parts = attn_res_block_partials([x, x * 2], G, W, EPS)
    with pytest.raises(ValueError, match="one query's"):
        attn_res_merge_prefix(parts, x, G[0], W[0], EPS)
    with pytest.raises(ValueError, match="one query's"):
        attn_res_merge_prefix(parts.query(0), torch.randn(4, 16), G[0], W[0], EPS)
    with pytest.raises(ValueError, match="must be fp32"):
        attn_res_merge_prefix(AttnResPartials(parts.acc[0].half(), parts.lse[0]), x, G[0], W[0], EPS)
    with pytest.raises(ValueError, match="H=16 elements"):
        attn_res_merge_prefix(parts.query(1), x, torch.ones(8), W[1], EPS)
    with pytest.raises(ValueError, match="out must be"):
        attn_res_merge_prefix(parts.query(1), x, G[1], W[1], EPS, out=torch.empty(3, 16, dtype=torch.float16))
    with pytest.raises(IndexError, match="query 2 out of range"):
        parts.query(2)
    with pytest.raises(ValueError, match="num_layers >= 1"):
        block_queries(0, 3)


_INTERP_SCRIPT = r"""
import json, torch
from longflash.layers.attn_res import attn_res_mix_reference
from longflash.layers.attn_res_two_phase import attn_res_block_partials_reference, attn_res_merge_prefix_reference
from longflash.layers.attn_res_two_phase_triton import attn_res_block_partials_triton, attn_res_merge_prefix_triton
torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
res = {}
for dtype in (torch.float32, torch.float16):
    for T, C, Q, H, strided in ((0, 2, 3, 48, False), (1, 1, 3, 48, False), (7, 3, 5, 80, True),
                                (33, 5, 2, 256, False), (2, 8, 25, 96, True)):
        width = H + 16 if strided else H
        pool = (torch.randn(C + 2, T, width, generator=gen) * torch.linspace(0.5, 4, C + 2).view(-1, 1, 1))
        pool = pool.to(dtype)[..., :H]
        G = (torch.rand(Q, H, generator=gen) + 0.5).to(dtype)
        W = (torch.randn(Q, 1, H, generator=gen) * H ** -0.5 * 3).to(dtype)
        src = [pool[j] for j in range(C)]
        ref = attn_res_block_partials_reference(src, G, W, 1e-5)
        got = attn_res_block_partials_triton(src, G, W, 1e-5)
        key = f"{str(dtype)[6:]}-T{T}-C{C}-Q{Q}-H{H}{'-strided' if strided else ''}"
        e = dict(shape_ok=got.acc.shape == (Q, T, H) and got.lse.shape == (Q, T))
        if T:
            e["acc_rel"] = float((got.acc - ref.acc).abs().max() / ref.acc.abs().max())
            e["lse_rel"] = float((got.lse - ref.lse).abs().max() / max(1.0, float(ref.lse.abs().max())))
            e["c1_exact"] = C != 1 or bool(torch.equal(got.acc[0], src[0].float()))
            steps = []
            for i in range(Q):
                out = pool[C + 1]
                m = attn_res_merge_prefix_triton(got.query(i), pool[C], G[i], W[i], 1e-5, out=out)
                assert m.data_ptr() == out.data_ptr()
                r = attn_res_merge_prefix_reference(got.query(i), pool[C], G[i], W[i], 1e-5)
                one = attn_res_mix_reference(src + [pool[C]], G[i], W[i], 1e-5)
                d = lambda a, b: float(((a.float() - b.float()).abs() / (torch.finfo(dtype).eps * b.float().abs()
                                        + 1e-6 * b.float().abs().max())).max())
                steps.append(max(d(m, r), d(m, one)) if dtype != torch.float32 else
                             max(float((m - r).abs().max() / r.abs().max()), float((m - one).abs().max() / one.abs().max())))
            e["merge"] = max(steps)
        res[key] = e
print("RESULT" + json.dumps(res))
"""


def test_kernels_equal_references_interpreter():
    """Phase 1 and phase 2 kernels vs the references (and the merged result vs the one-phase mixer) at
    awkward shapes: 0 and 1 tokens, C = 1, a tile that does not divide T, H not a power of two, strided
    rows (views of a wider pool), Q = 25 (Kimi-K3's last block with the output mixture)."""
    res = run_interpreted(_INTERP_SCRIPT, timeout_s=300)
    assert len(res) == 10
    for key, e in res.items():
        assert e["shape_ok"], key
        if key.split("-")[1] == "T0":
            continue
        assert e["acc_rel"] <= 1e-6 and e["lse_rel"] <= 5e-7 and e["c1_exact"], (key, e)
        assert e["merge"] <= (2e-6 if key.startswith("float32") else 1.0), (key, e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_phase_gpu_kimi_shapes():
    """H 7168, bf16 and fp32, C 1 and 8, Q 25, T 1/64/512: the dispatch takes the kernels (bitwise equal
    to calling them) and every query's merged result equals the one-phase mixer within one bf16 step
    (fp32: rel 2e-6)."""
    from longflash.layers.attn_res_two_phase_triton import (attn_res_block_partials_triton,
                                                            attn_res_merge_prefix_triton)
    gen = torch.Generator(device="cuda").manual_seed(0)
    H, Q = 7168, 25
    for dtype in (torch.bfloat16, torch.float32):
        for T in (1, 64, 512):
            for C in (1, 8):
                pool = (torch.randn(C + 2, T, H, generator=gen, device="cuda") * 2).to(dtype)
                G = (1 + 0.1 * torch.randn(Q, H, generator=gen, device="cuda")).to(dtype)
                W = (torch.randn(Q, H, generator=gen, device="cuda") * H ** -0.5).to(dtype)
                src = [pool[j] for j in range(C)]
                parts = attn_res_block_partials(src, G, W, EPS)
                direct = attn_res_block_partials_triton(src, G, W, EPS)
                assert torch.equal(parts.acc, direct.acc) and torch.equal(parts.lse, direct.lse)
                for i in (0, 1, Q - 1):
                    got = attn_res_merge_prefix(parts.query(i), pool[C], G[i], W[i], EPS, out=pool[C + 1])
                    assert torch.equal(got, attn_res_merge_prefix_triton(parts.query(i), pool[C], G[i], W[i], EPS))
                    want = attn_res_mix_reference(src + [pool[C]], G[i], W[i], EPS)
                    assert _within(got, want), (dtype, T, C, i, _rel(got, want), _steps(got, want))
                first = parts.acc[0].to(dtype)
                assert _within(first, attn_res_mix_reference(src, G[0], W[0], EPS)), (dtype, T, C)


def _compile_sm90() -> dict:
    """Compile both kernels for sm_90 (run by ``sm90_compile.compile_report`` in a subprocess)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from longflash.layers import attn_res_two_phase_triton as tp
    from longflash.layers.attn_res_triton import _tile
    div = [["tt.divisibility", 16]]
    out = {}

    def build(kern, sig, constexprs, aligned, warps, key):
        idx = kern.arg_names.index
        attrs = {}
        for n in aligned:
            if isinstance(sig[n], tuple):
                attrs |= {(idx(n), j): div for j in range(len(sig[n]))}
            else:
                attrs[(idx(n),)] = div
        try:
            c = triton.compile(ASTSource(fn=kern, signature=sig, attrs=attrs,
                                         constexprs={(idx(k),): v for k, v in constexprs.items()}),
                               target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
            out[key] = dict(ok=bool(c.asm.get("cubin")), vector_loads=c.asm["ptx"].count("ld.global.v"))
        except Exception as e:
            out[key] = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:1500]}")
    for dt, H, T, C in (("bf16", 7168, 1, 1), ("bf16", 7168, 4096, 8), ("bf16", 256, 16, 4), ("fp32", 7168, 64, 3)):
        bh, rows, warps = _tile(H, T)
        sig = dict(src_ptrs=tuple([f"*{dt}"] * C), src_strides=tuple(["i32"] * C), g_ptr=f"*{dt}", w_ptr=f"*{dt}",
                   acc_ptr="*fp32", lse_ptr="*fp32", n_rows="i32", H="i32", Q="i32", eps="fp32",
                   C="constexpr", BLOCK_H="constexpr", BLOCK_ROWS="constexpr")
        build(tp._block_partials_kernel, sig, dict(C=C, BLOCK_H=bh, BLOCK_ROWS=rows),
              ("src_ptrs", "src_strides", "g_ptr", "w_ptr", "acc_ptr", "H"), warps, f"partials-{dt}-H{H}-T{T}-C{C}")
        sig = dict(acc_ptr="*fp32", stride_acc="i32", lse_ptr="*fp32", x_ptr=f"*{dt}", stride_x="i32", g_ptr=f"*{dt}",
                   w_ptr=f"*{dt}", out_ptr=f"*{dt}", stride_o="i32", n_rows="i32", H="i32", eps="fp32",
                   BLOCK_H="constexpr", BLOCK_ROWS="constexpr")
        build(tp._merge_prefix_kernel, sig, dict(BLOCK_H=bh, BLOCK_ROWS=rows),
              ("acc_ptr", "stride_acc", "x_ptr", "stride_x", "g_ptr", "w_ptr", "out_ptr", "stride_o", "H"), warps,
              f"merge-{dt}-H{H}-T{T}")
    return out


def test_kernels_compile_for_sm90_without_a_gpu():
    """Both kernels compile for sm_90 (Triton's bundled ptxas) at Kimi-K3 and default-model tiles, with
    vectorised loads."""
    res = compile_report(__file__)
    assert len(res) == 8 and all(v["ok"] and v["vector_loads"] > 0 for v in res.values()), res


if __name__ == "__main__" and "--compile-sm90" in sys.argv:
    import json
    print(json.dumps(_compile_sm90()))
