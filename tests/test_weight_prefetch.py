"""The side-stream L2 weight prefetch of few-token decode steps (``runner/weight_prefetch.py``,
``ops/l2_prefetch.prefetch_ranges``):

- CPU: the plan of a DeepSeek-V3 model after the decode-time fusions lists, per layer, the layer's decode
  weights after its q projections, then the next layer's first (qkv_a), in the order a step reads them; a layer
  without ``decode_weights`` gives no plan; on the CPU no prefetcher is built and the forward is unchanged;
- sm_90 compile without a GPU: the prefetch kernel issues plain ``prefetch.global.L2`` with no barrier in its
  loop (a scalar trip count), the one-token MoE kernel still issues ``::evict_last`` prefetches;
- GPU (skipped without CUDA): with every tensor prefetched (``MIN_BYTES`` 0), greedy generation with CUDA
  graphs gives the same tokens as with the prefetch off, and each one-token step launches one prefetch per
  layer on a second stream.
"""

import json
import sys

import pytest
import torch

from longflash.runner import weight_prefetch


def _tiny_deepseek(tmp_path):
    from tiny_models import make_deepseek_v3
    return make_deepseek_v3(str(tmp_path / "m"), num_layers=3)


def test_plan_lists_the_decode_weights_in_order(tmp_path):
    from longflash import LLM
    llm = LLM(model=_tiny_deepseek(tmp_path), skip_tokenizer_init=True, device="cpu", max_num_seqs=1,
              kv_cache_memory="64MiB")
    model = llm.engine.model
    assert model.model.weight_prefetch is None  # no prefetcher off CUDA
    for layer in model.model.layers:  # the decode-time fusions the GPU engine makes
        layer.self_attn.fuse_qkv_a()
        layer.self_attn.make_w_uk_t()
        if hasattr(layer.mlp, "fuse_gate_up"):
            layer.mlp.fuse_gate_up()
        if getattr(layer.mlp, "shared_experts", None) is not None:
            layer.mlp.shared_experts.fuse_gate_up()
    plan = weight_prefetch.plan_ranges(model.model.layers)
    L = model.model.layers

    def attn(i):
        a = L[i].self_attn
        return [a.w_uk_t, a.kv_b_proj.weight, a.o_proj.weight]  # after q_a/kv_a and q_b (SKIP)
    want = [attn(0) + [L[0].mlp.gate_up_weight, L[0].mlp.down_proj.weight, L[1].self_attn.qkv_a_weight]]
    for i in (1, 2):
        sh = L[i].mlp.shared_experts
        nxt = [L[i + 1].self_attn.qkv_a_weight] if i + 1 < len(L) else []
        want.append(attn(i) + [L[i].mlp.gate.weight, sh.gate_up_weight, sh.down_proj.weight] + nxt)
    assert [[id(t) for t in r] for r in plan] == [[id(t) for t in r] for r in want]
    assert weight_prefetch.plan_ranges(list(L) + [torch.nn.Linear(2, 2)]) is None
    llm.shutdown()


def _compile_sm90() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from longflash.layers import moe_decode_triton as m
    from longflash.layers.moe_router_triton import _IDX_BITS
    from longflash.ops import l2_prefetch
    out = {}
    k = l2_prefetch._prefetch_ranges_kernel
    sig = {n: ("*bf16" if n.startswith("p") else "i64") for n in k.arg_names if n[0] in "pn" and n[1:].isdigit()}
    consts = dict(NR=3, LINES=128, INTERPRET=False)
    c = triton.compile(ASTSource(fn=k, signature=dict(sig, **{n: "constexpr" for n in consts}),
                                 constexprs={(k.arg_names.index(n),): v for n, v in consts.items()}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = c.asm["ptx"]
    out["ranges"] = {"plain": ptx.count("prefetch.global.L2 ["), "evict_last": ptx.count("evict_last"),
                     "bar": ptx.count("bar.sync") + ptx.count("barrier.sync")}
    types = dict(x_ptr="*bf16", rw_ptr="*fp32", bias_ptr="*fp32", w13_ptr="*bf16", w2_ptr="*bf16", sw13_ptr="*bf16",
                 sw2_ptr="*bf16", part_ptr="*fp32", rid_ptr="*i64", rwt_ptr="*fp32", g_ptr="*bf16", gs_ptr="*bf16",
                 y_ptr="*bf16", bar_ptr="*i32", D="i32", I="i32", IS="i32", n_slices="i32", scale="fp32")
    const = dict(E_P=64, N_GROUP=8, GROUP_SIZE=8, NG_P=8, GS_P=8, TOP_K=6, TOPK_GROUP=4, HAS_BIAS=True, RENORM=True,
                 HAS_SHARED=True, I_P=256, IS_P=512, RK=64, K_STEP=2048, NS_C=32, TK_P=8, DOWN_ROWS=16, PREFETCH=True,
                 ELT=2, NUM_WARPS=8, GATE_PAIR=False, PHASE=5, INTERPRET=False, IDX_BITS=_IDX_BITS)
    names = m._moe_decode_kernel.arg_names
    c = triton.compile(ASTSource(m._moe_decode_kernel, {n: types.get(n, "constexpr") for n in names},
                                 constexprs={(names.index(n),): v for n, v in const.items()}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    out["moe"] = {"evict_last": c.asm["ptx"].count("prefetch.global.L2::evict_last"), "ok": bool(c.asm.get("cubin"))}
    return out


def test_prefetch_kernels_compile_for_sm90_without_a_gpu():
    from sm90_compile import compile_report
    res = compile_report(__file__)
    assert res["ranges"]["plain"] > 0 and res["ranges"]["evict_last"] == 0 and res["ranges"]["bar"] == 0, res
    assert res["moe"]["ok"] and res["moe"]["evict_last"] > 0, res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_prefetch_changes_no_token(tmp_path, monkeypatch):
    from longflash import LLM, SamplingParams
    monkeypatch.setattr(weight_prefetch, "MIN_BYTES", 0)
    path = _tiny_deepseek(tmp_path)
    prompts = [{"prompt_token_ids": [5, 9, 17, 33] * 6}, {"prompt_token_ids": [7, 11, 2] * 5}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = {}
    for enabled in (True, False):
        monkeypatch.setattr(weight_prefetch, "ENABLED", enabled)
        llm = LLM(model=path, skip_tokenizer_init=True, device="cuda", dtype="bfloat16", max_num_seqs=1,
                  kv_cache_memory="64MiB")
        assert llm.engine.model.model.weight_prefetch is not None
        out[enabled] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if enabled:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
                torch.cuda.synchronize()
            names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            assert sum("_prefetch_ranges_kernel" in n for n in names) == 3 * 2  # 3 layers x 2 decode steps
        llm.shutdown()
    assert out[True] == out[False]


if __name__ == "__main__":
    if "--compile-sm90" in sys.argv:
        print(json.dumps(_compile_sm90()))
