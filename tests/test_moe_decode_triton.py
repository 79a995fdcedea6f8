"""The one-token MoE sub-layer (``layers/moe_decode_triton.py``) equals its reference ``moe_decode_ref``, and
the reference equals the engine's ``MoE`` layer (router, noaux_tc routing, routed and shared SiLU experts):

- CPU: the reference against ``MoE.forward`` (fp32, groups, bias, shared experts); the Triton kernel under
  ``TRITON_INTERPRET=1`` (a subprocess: set before Triton is imported) in fp32 and fp16, in its three launch
  forms with one program (the default: phase 0, the routing launch, phases 1-2 with a barrier; the single
  persistent launch; with one program the barriers open at once, so their targets are checked only on the
  GPU) and as phase launches of 1, 3 and 7 programs (the work split; with 3 also 4-row down blocks), with odd sizes (D 70, I 12), without
  shared experts, without bias, one group, top_k = E, a strided x and bias; refused inputs name the problem;
  where ``MoE.forward`` takes the kernel; every launch compiles for sm_90 without spills and issues its L2
  prefetches (Triton's bundled ptxas, no GPU);
- GPU (skipped without CUDA): bf16 at the DeepSeek-V3-shaped benchmark model's shapes (D 2048, 64 experts
  top-6 in 8 groups, I 256, two shared experts), each launch form against the reference, with and without
  the L2 prefetch (bitwise equal), with 4-row down blocks, and 200 persistent calls over 4 inputs each bitwise equal to a one-program
  call, for the default and the single launch (a stale read across a barrier would show); ``MoE.forward``
  on one token (three launches, equal to the separate launches, captured in a CUDA graph).
Bounds: |y − ref| ≤ 1e-5 · max |ref| in fp32, 1e-3 in fp16 (sums in another order, one ulp of an intermediate
rounding), 2e-2 in bf16; the routing is the reference's unless two choice scores tie (random inputs avoid it).
"""


import pytest
import torch

from interpreter_run import run_interpreted
from longflash.layers.moe_decode_triton import moe_decode_ref

def _case(D=64, E=8, I=16, IS=24, dt=torch.float32, device="cpu", seed=0, bias=True, shared=True):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale)
    x = r(1, D).to(device=device, dtype=dt)
    rw = r(E, D, scale=0.2).to(device)
    b = r(E, scale=0.1).to(device) if bias else None
    w13 = r(E, 2 * I, D, scale=D ** -0.5).to(device=device, dtype=dt)
    w2 = r(E, D, I, scale=I ** -0.5).to(device=device, dtype=dt)
    s13 = r(2 * IS, D, scale=D ** -0.5).to(device=device, dtype=dt) if shared else None
    s2 = r(D, IS, scale=IS ** -0.5).to(device=device, dtype=dt) if shared else None
    return x, rw, b, w13, w2, s13, s2


# (case kwargs, routing: top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
CASES = {"groups bias shared": (dict(), (2, 2, 1, True, 2.5)),
         "odd sizes": (dict(D=70, I=12, IS=20), (3, 4, 2, True, 1.0)),
         "no shared no bias": (dict(bias=False, shared=False), (2, 1, 1, False, 1.0)),
         "top_k = E": (dict(E=4), (4, 1, 1, True, 1.0))}


def _err(y, ref) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


def _interpreter_check() -> dict:
    from longflash.layers.moe_decode_triton import moe_decode_triton
    out = {}
    for name, (kw, route) in CASES.items():
        for dt in (torch.float32, torch.float16):
            args = _case(dt=dt, **kw)
            ref = moe_decode_ref(*args, *route)
            for P, phased, rl, dr in ((1, False, True, 16), (1, False, False, 16), (1, True, True, 16),
                                      (3, True, True, 16), (7, True, True, 16), (3, True, True, 4)):
                y = moe_decode_triton(*args, *route, programs=P, phased=phased, route_launch=rl, down_rows=dr)
                key = (f"{name} {dt} P{P}{' phased' if phased else ''}{'' if rl else ' one launch'}"
                       f" down_rows {dr}")
                out[key] = [_err(y, ref), BOUND[dt]]
    # a strided x and bias (the kernel reads both as contiguous)
    x, rw, b, w13, w2, s13, s2 = _case()
    xs = torch.zeros(1, 2 * x.shape[1])
    xs[:, ::2] = x
    bs = torch.zeros(2 * b.shape[0])
    bs[::2] = b
    y = moe_decode_triton(xs[:, ::2], rw, bs[::2], w13, w2, s13, s2, 2, 2, 1, programs=3, phased=True)
    out["strided x and bias"] = [_err(y, moe_decode_ref(x, rw, b, w13, w2, s13, s2, 2, 2, 1)), BOUND[torch.float32]]
    return out


# (no bf16 under the interpreter: Triton 3.6's interpreter rounds fp32 -> bf16 toward zero, the GPU and torch to
# nearest, so a bf16 comparison there can differ by whole bf16 ulps; bf16 is checked on the GPU)
BOUND = {torch.float32: 1e-5, torch.float16: 1e-3}


def test_kernel_equals_reference_interpreter():
    got = run_interpreted("import json, sys; sys.path.insert(0, 'tests'); import test_moe_decode_triton as t; "
                          "print('RESULT' + json.dumps(t._interpreter_check()))")
    assert len(got) == len(CASES) * 2 * 6 + 1
    bad = {k: v for k, (v, bound) in got.items() if not v <= bound}
    assert not bad, bad


def test_reference_equals_the_moe_layer():
    """moe_decode_ref on the stacked weights of an ``MoE`` layer (fp32, 8 experts in 2 groups, top-2, a shared
    expert pair) gives the layer's forward for one token."""
    from longflash.layers.activation import silu_and_mul
    from longflash.layers.moe import MoE, TopkRouter
    from longflash.layers.moe_grouped import stack_expert_weights
    torch.manual_seed(0)
    D, E, I = 48, 8, 16
    router = TopkRouter(D, E, 2, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
    moe = MoE(D, E, I, router, silu_and_mul, num_shared_experts=2)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(1, D)
    want = moe(x)
    w13, w2 = stack_expert_weights(moe.experts)
    sh = moe.shared_experts
    s13 = torch.cat([sh.gate_proj.weight, sh.up_proj.weight])
    got = moe_decode_ref(x, router.weight.float(), router.e_score_correction_bias, w13, w2, s13, sh.down_proj.weight,
                         2, 2, 1, True, 2.5)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def test_refused_inputs_name_the_problem():
    from longflash.layers.moe_decode_triton import moe_decode_triton
    x, rw, b, w13, w2, s13, s2 = _case()
    route = (2, 2, 1)
    for args, msg in (((x.expand(2, -1), rw, b, w13, w2, s13, s2), "one token"),
                      ((x, rw.half(), b, w13, w2, s13, s2), "router weight"),
                      ((x, rw, b, w13[:, :-1], w2, s13, s2), "w13"),
                      ((x, rw, b, w13, w2[:, :, :-1], s13, s2), "w2"),
                      ((x, rw, b, w13, w2, s13, None), "shared"),
                      ((x.half(), rw, b, w13, w2, s13, s2), "must share one of"),
                      ((x, rw[0], b, w13, w2, s13, s2), "router weight"),
                      ((x, rw, b.int(), w13, w2, s13, s2), "floating point")):
        with pytest.raises(ValueError, match=msg):
            moe_decode_ref(*args, *route)
    with pytest.raises(ValueError, match="top_k"):
        moe_decode_ref(x, rw, b, w13, w2, s13, s2, 9)
    with pytest.raises(ValueError, match="kept groups"):  # 2 groups of 4 experts, one kept: at most 4
        moe_decode_ref(x, rw, b, w13, w2, s13, s2, 5, 2, 1)
    with pytest.raises(ValueError, match="persistent launch"):
        moe_decode_triton(x, rw, b, w13, w2, s13, s2, *route, programs=3, phased=False)  # CPU: one program
    for bad in (3, 0, 128, 4.0, True):
        with pytest.raises(ValueError, match="down_rows must be a power of two"):
            moe_decode_triton(x, rw, b, w13, w2, s13, s2, *route, down_rows=bad)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="programs must be an int >= 1"):
            moe_decode_triton(x, rw, b, w13, w2, s13, s2, *route, programs=bad, phased=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_benchmark_model_shapes():
    from longflash.layers.moe_decode_triton import moe_decode_triton
    args = _case(D=2048, E=64, I=256, IS=512, dt=torch.bfloat16, device="cuda")
    route = (6, 8, 4, True, 2.5)
    ref = moe_decode_ref(*args, *route)
    for phased, rl in ((False, True), (False, False), (True, True)):
        y = moe_decode_triton(*args, *route, phased=phased, route_launch=rl)
        assert _err(y, ref) <= 2e-2
        assert torch.equal(moe_decode_triton(*args, *route, phased=phased, route_launch=rl, prefetch=False), y)
        assert _err(moe_decode_triton(*args, *route, phased=phased, route_launch=rl, down_rows=4), ref) <= 2e-2
    # nothing depends on the grid: every persistent launch equals a one-program launch bitwise, call after call
    cases = [_case(D=2048, E=64, I=256, IS=512, dt=torch.bfloat16, device="cuda", seed=s) for s in range(4)]
    for rl in (True, False):  # the default three launches and the one launch
        one = [moe_decode_triton(*a, *route, programs=1, phased=False, route_launch=rl) for a in cases]
        assert all(torch.equal(moe_decode_triton(*cases[i % 4], *route, phased=False, route_launch=rl), one[i % 4])
                   for i in range(200))




def _moe_layer(D, E, I, dt, device):
    """An ``MoE`` layer as the loader leaves it: experts in ``dt``, router fp32, shared gate/up fused."""
    from longflash.layers.activation import silu_and_mul
    from longflash.layers.moe import MoE, TopkRouter
    torch.manual_seed(0)
    router = TopkRouter(D, E, 6 if E >= 8 else 2, n_group=8 if E >= 8 else 2, topk_group=4 if E >= 8 else 1,
                        norm_topk_prob=True, routed_scaling_factor=2.5)
    moe = MoE(D, E, I, router, silu_and_mul, num_shared_experts=2)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.normal_(0, 0.05 if "gate.weight" in name else 0.02)
    moe = moe.to(device)
    for m in moe.modules():
        if m is not router:
            for _, p in m.named_parameters(recurse=False):
                p.data = p.data.to(dt)
    moe.shared_experts.fuse_gate_up()
    return moe


def test_one_token_path_applies_only_where_it_can(monkeypatch):
    """``MoE.one_token_weights`` (the one-token kernel path of ``MoE.forward``) says no on the CPU, for two tokens,
    fp32, under autograd, with the module switch off, shared experts in another dtype and a transposed shared
    weight; the CPU forward is unchanged."""
    from longflash.layers import moe as moe_mod
    layer = _moe_layer(32, 8, 16, torch.bfloat16, "cpu")
    x = torch.randn(1, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert layer.one_token_weights(x) is None  # CPU
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))  # past the device check, then:
    with torch.no_grad():
        assert layer.one_token_weights(x.expand(2, -1)) is None
        assert layer.one_token_weights(x.float()) is None
        monkeypatch.setattr(moe_mod, "ONE_TOKEN_KERNEL", False)
        assert layer.one_token_weights(x) is None
        monkeypatch.setattr(moe_mod, "ONE_TOKEN_KERNEL", True)
        assert layer.one_token_weights(x) is not None
        sw = layer.shared_experts.gate_up_weight
        layer.shared_experts.gate_up_weight = sw.float()
        assert layer.one_token_weights(x) is None  # shared experts in another dtype than x
        layer.shared_experts.gate_up_weight = sw.t().contiguous().t()
        assert layer.one_token_weights(x) is None  # a transposed (cuBLAS-layout) shared weight: not here
    assert layer.one_token_weights(x) is None  # autograd on


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_moe_forward_one_token_kernel():
    """On CUDA ``MoE.forward`` of one bf16 token runs the one-token kernel (three launches per call), equal to the
    separate launches (``ONE_TOKEN_KERNEL`` off) within bf16 rounding, and it captures in a CUDA graph."""
    from longflash.layers import moe as moe_mod
    layer = _moe_layer(2048, 64, 256, torch.bfloat16, "cuda")
    xs = [torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16) * 0.5 for _ in range(4)]
    with torch.no_grad():
        assert layer.one_token_weights(xs[0]) is not None
        fused = [layer(x) for x in xs]
        moe_mod.ONE_TOKEN_KERNEL = False
        try:
            sep = [layer(x) for x in xs]
        finally:
            moe_mod.ONE_TOKEN_KERNEL = True
        for a, b in zip(fused, sep):
            assert _err(a, b) <= 2e-2
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            layer(xs[0])
            torch.cuda.synchronize()
        assert sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()) == 3
        static = xs[0].clone()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = layer(static)
        for x, want in zip(xs, fused):
            static.copy_(x)
            g.replay()
            assert torch.equal(out, want)


def _compile_sm90() -> dict:
    """Compile each launch of the kernel (PHASE 0, 4, 5 and the single launch 3) for sm_90 at the benchmark
    model's shapes with the JIT's divisibility of the sizes (Triton's bundled ptxas, no GPU): registers,
    spilled bytes and the L2 prefetch instructions of each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from longflash.layers import moe_decode_triton as m
    from longflash.layers.moe_router_triton import _IDX_BITS
    from sm90_compile import ptxas_usage
    types = dict(x_ptr="*bf16", rw_ptr="*fp32", bias_ptr="*fp32", w13_ptr="*bf16", w2_ptr="*bf16", sw13_ptr="*bf16",
                 sw2_ptr="*bf16", part_ptr="*fp32", rid_ptr="*i64", rwt_ptr="*fp32", g_ptr="*bf16", gs_ptr="*bf16",
                 y_ptr="*bf16", bar_ptr="*i32", D="i32", I="i32", IS="i32", n_slices="i32", scale="fp32")
    names = m._moe_decode_kernel.arg_names
    div16 = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if types.get(n, "").startswith("*") or n in ("D", "I", "IS")}
    out = {}
    for phase in (0, 4, 5, 3):
        const = dict(E_P=64, N_GROUP=8, GROUP_SIZE=8, NG_P=8, GS_P=8, TOP_K=6, TOPK_GROUP=4, HAS_BIAS=True,
                     RENORM=True, HAS_SHARED=True, I_P=256, IS_P=512, RK=64, K_STEP=2048, NS_C=32, TK_P=8,
                     DOWN_ROWS=16, PREFETCH=True, ELT=2, NUM_WARPS=8, PHASE=phase, INTERPRET=False,
                     IDX_BITS=_IDX_BITS)
        c = triton.compile(ASTSource(m._moe_decode_kernel, {n: types.get(n, "constexpr") for n in names},
                                     constexprs={(names.index(n),): v for n, v in const.items()}, attrs=div16),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1 if phase == 4 else 8))
        use = ptxas_usage(c.asm["ptx"])
        out[str(phase)] = {"ok": bool(c.asm.get("cubin")), "regs": use["regs"], "spills": use["spill_bytes"],
                           "prefetch": c.asm["ptx"].count("prefetch.global.L2::evict_last")}
    return out


def test_kernel_compiles_for_sm90_without_a_gpu():
    """Every launch compiles for sm_90 without spills (8 warps; the routing launch 1 warp), and the launches that
    know the routing or the shared weights issue their L2 prefetches (phase 0: the shared down rows; 5 and 3:
    the chosen experts' rows); the routing launch issues none."""
    from sm90_compile import compile_report
    res = compile_report(__file__)
    assert set(res) == {"0", "4", "5", "3"} and all(v["ok"] and v["spills"] == 0 for v in res.values()), res
    assert res["0"]["prefetch"] > 0 and res["5"]["prefetch"] > 0 and res["3"]["prefetch"] > 0, res
    assert res["4"]["prefetch"] == 0, res


if __name__ == "__main__":
    import json
    import sys
    if "--compile-sm90" in sys.argv:
        print(json.dumps(_compile_sm90()))
