"""The one-launch Triton MXFP4 MoE kernel equals the PyTorch reference ``run_mxfp4_experts``: on the CPU under
``TRITON_INTERPRET=1`` at small, awkward shapes (0 and 1 token, rows not a multiple of BLOCK_M, widths not a
multiple of BLOCK_W/BLOCK_K, every decode), compiled for sm_90 without a GPU, and on the GPU at Kimi-K3
expert shapes (there also the bf16 PTX decode, bitwise).

The interpreter must be selected before triton is imported, so the CPU checks run in a subprocess
(this file run as a script). Triton 3.6's interpreter computes ``tl.dot`` of bf16 operands wrongly (a 16x16
product off by ~1e10, while loads/casts are right) and has no inline asm, so low-precision activations are
checked in fp16 there and in bf16 on the GPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32 tolerance: same products, another summation order (atomics, an exp-based tanh in the kernel).
FP32_REL = 1e-5


def _experts(E, D, I, activation, seed=0, device="cpu"):
    """Random experts written the way the loader writes them (``load_checkpoint_tensor``)."""
    from longflash.layers.activation import silu_and_mul, situ_and_mul
    from longflash.layers.mxfp4 import MXFP4Experts, quantize_mxfp4
    g = torch.Generator(device=device).manual_seed(seed)
    act = situ_and_mul if activation == "situ" else silu_and_mul
    with torch.device(device):
        ex = MXFP4Experts(E, D, I, act, activation, (4.0, 25.0) if activation == "situ" else ())
    for e in range(E):  # quantized where they live (the GPU test's K3-sized experts too)
        for proj, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            p, s = quantize_mxfp4(torch.randn(*shape, generator=g, device=device) * 0.5)
            ex.load_checkpoint_tensor(f"{e}.{proj}.weight_packed", p)
            ex.load_checkpoint_tensor(f"{e}.{proj}.weight_scale", s)
    return ex


def _routing(T, E, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(T, k, generator=g)
    return w.to(device), ids.to(device)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _interpreter_checks() -> dict:
    """Run under TRITON_INTERPRET=1; returns the numbers the test asserts on."""
    from longflash.layers.mxfp4 import e2m1_table, e8m0_to_float, run_mxfp4_experts
    from longflash.layers.moe_align_triton import moe_align_triton
    from longflash.layers.mxfp4_moe_triton import moe_align, run_mxfp4_experts_triton

    out: dict = {}
    codes = torch.arange(16, dtype=torch.uint8).repeat(8)
    scales = torch.tensor([0, 1, 100, 126, 127, 128, 254, 255], dtype=torch.uint8).repeat_interleave(16)
    got = torch.empty(128)
    _decode_kernel[(1,)](codes, scales, got, N=128)
    want = e2m1_table()[codes.long()] * e8m0_to_float(scales)
    out["decode_bitwise_equal"] = bool(torch.equal(got.view(torch.int32)[~want.isnan()],
                                                   want.view(torch.int32)[~want.isnan()]))
    out["decode_nan_equal"] = bool(torch.equal(got.isnan(), want.isnan()))
    # fast path for scale bytes <= 128: every code in the low and in the high nibble
    scales = torch.tensor([0, 1, 2, 100, 120, 126, 127, 128], dtype=torch.uint8).repeat_interleave(16)
    lo, hi = torch.empty(128), torch.empty(128)
    _decode_small_kernel[(1,)](codes | (((15 - codes) & 15) << 4), scales, lo, hi, N=128)
    want_lo = e2m1_table()[codes.long()] * e8m0_to_float(scales)
    want_hi = e2m1_table()[(15 - codes).long()] * e8m0_to_float(scales)
    out["decode_small_bitwise_equal"] = bool(torch.equal(lo.view(torch.int32), want_lo.view(torch.int32))
                                             and torch.equal(hi.view(torch.int32), want_hi.view(torch.int32)))

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3], [3, 0]])
    sorted_ids, block_expert, num_blocks = moe_align(ids, 5, 4)
    out["align"] = [sorted_ids.tolist(), block_expert.tolist(), num_blocks.tolist()]
    # the one-launch align equals the reference (the interpreter's atomics run in order: the stable order)
    same = {}
    for T, k, E, bm in [(5, 2, 5, 4), (1, 16, 896, 16), (33, 3, 7, 16), (300, 4, 40, 64), (700, 2, 3, 16)]:
        ids = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(T))
        ref_ids, ref_be, ref_nb = moe_align(ids, E, bm)
        got_ids, got_be, sched = moe_align_triton(ids, E, bm)
        same[f"T={T},k={k},E={E},bm={bm}"] = bool(
            torch.equal(ref_ids, got_ids) and torch.equal(ref_be, got_be) and int(sched[1]) == int(ref_nb[0])
            and int(sched[0]) == 0 and not sched[2:].any())
    out["align_triton_equal"] = same

    errs = {}
    # (E, D, I, k): D = 3 groups of 32, not a multiple of BLOCK_K 64/128 nor of BLOCK_W 64; and widths that
    # are multiples of 128 (the unmasked K path); BLOCK_W > D and > I in one case.
    small, even = (5, 96, 64, 2), (4, 256, 128, 3)
    cases = [(small, 0, "situ", None), (small, 1, "situ", None), (small, 5, "situ", None),
             (small, 33, "silu", dict(BLOCK_M=32, BLOCK_W=16, BLOCK_K=32)),
             (small, 5, "situ", dict(BLOCK_M=16, BLOCK_W=128, BLOCK_K=128, programs_per_sm=1)),
             (small, 33, "situ", dict(decode="general", BLOCK_K=64)),
             (even, 20, "situ", dict(BLOCK_M=16, BLOCK_W=32, BLOCK_K=128, decode="small")),
             (even, 40, "silu", dict(BLOCK_M=64, BLOCK_W=64, BLOCK_K=256)),
             # the reference align ops (a register cap: ignored by the interpreter), K 96 = 3 chunks of 32
             (even, 7, "situ", dict(BLOCK_K=128, align="torch", maxnreg=128)),
             (small, 9, "silu", dict(BLOCK_K=32, programs_per_sm=4)),
             # paired down tiles: D 96 = 1.5 pairs of BLOCK_W 32 (the second half of the last pair masked), and
             # D 256 = 2 whole pairs of 64
             (small, 33, "situ", dict(BLOCK_M=16, BLOCK_W=32, BLOCK_K=32, down_pair=True)),
             (even, 20, "silu", dict(down_pair=True))]
    for (E, D, I, k), T, act, cfg in cases:
        ex = _experts(E, D, I, act, seed=T)
        w, ids = _routing(T, E, k, seed=T)
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(T))
        ref = run_mxfp4_experts(x, ex, w, ids)
        got = run_mxfp4_experts_triton(x, ex, w, ids, cfg)
        key = f"E={E},D={D},I={I},k={k},T={T},{act},{cfg}"
        if T == 0:
            errs[key] = 0.0 if got.shape == (0, D) else float("inf")
        else:
            errs[key] = _rel(got, ref)
    out["rel_err"] = errs
    # scale bytes > 128 (weights ~2^8): the general decode is chosen automatically
    E, D, I, k = small
    ex = _experts(E, D, I, "situ")
    for b in (ex.w13_weight_scale, ex.w2_weight_scale):
        b += 10
    ex.reset_scale_stats()
    out["large_scale_range"] = list(ex.scale_byte_range("w13"))
    w, ids = _routing(9, E, k, seed=9)
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(9)) * 1e-6
    out["large_scale_rel_err"] = _rel(run_mxfp4_experts_triton(x, ex, w, ids), run_mxfp4_experts(x, ex, w, ids))
    # Low-precision activations: fp16 (the interpreter's tl.dot is wrong for bf16 operands, see the
    # module docstring; bf16 is checked on the GPU). Reference in fp32 on the same fp16 inputs.
    ex = _experts(E, D, I, "situ")
    w, ids = _routing(33, E, k, seed=7)
    x = (torch.randn(33, D, generator=torch.Generator().manual_seed(7)) * 0.3).half()
    out["fp16_rel_err"] = _rel(run_mxfp4_experts_triton(x, ex, w, ids), run_mxfp4_experts(x.float(), ex, w, ids))
    return out


@pytest.fixture(scope="module")
def interp():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_interpreter_decode_in_registers_is_exact(interp):
    assert interp["decode_bitwise_equal"] and interp["decode_nan_equal"]
    assert interp["decode_small_bitwise_equal"]  # the fast path (scale bytes <= 128), subnormal trick included


def test_one_launch_align_equals_reference(interp):
    same = interp["align_triton_equal"]
    assert len(same) == 5 and all(same.values()), same


def test_moe_align_sorts_and_pads_per_expert(interp):
    # flat rows: 0:3 1:0 2:3 3:1 4:0 5:3 6:2 7:3 8:3 9:0 ; N = 10 pads; BLOCK_M 4, max_blocks 10//4 + 5 = 7
    P = 10
    sorted_ids, block_expert, num_blocks = interp["align"]
    assert sorted_ids == [1, 4, 9, P, 3, P, P, P, 6, P, P, P, 0, 2, 5, 7, 8, P, P, P, P, P, P, P, P, P, P, P]
    assert block_expert == [0, 1, 2, 3, 3, -1, -1]
    assert num_blocks == [5]


def test_interpreter_kernel_equals_reference(interp):
    assert len(interp["rel_err"]) == 12
    for case, err in interp["rel_err"].items():
        assert err <= FP32_REL, (case, err)
    assert interp["fp16_rel_err"] <= 3e-3  # fp16 rounding of x·W, the activation and the slot rows
    assert interp["large_scale_range"][1] > 128 and interp["large_scale_rel_err"] <= FP32_REL


def test_bad_input_raises_clear_errors():
    from longflash.layers.mxfp4_moe_triton import run_mxfp4_experts_triton
    ex = _experts(2, 64, 32, "situ")
    x, w, ids = torch.zeros(1, 64), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="unknown MXFP4 MoE config keys"):
        run_mxfp4_experts_triton(x, ex, w, ids, {"dot_scaled": True})
    with pytest.raises(ValueError, match="BLOCK_K must be a power of two >= 32"):
        run_mxfp4_experts_triton(x, ex, w, ids, {"BLOCK_K": 48})
    with pytest.raises(ValueError, match="decode 'asm' is not exact here"):
        run_mxfp4_experts_triton(x, ex, w, ids, {"decode": "asm"})  # bf16 PTX: CUDA only
    with pytest.raises(ValueError, match="the experts expect"):
        run_mxfp4_experts_triton(torch.zeros(1, 32), ex, w, ids)
    with pytest.raises(ValueError, match="must both be"):
        run_mxfp4_experts_triton(x, ex, w, ids[:, :0])
    with pytest.raises(ValueError, match="align must be triton or torch"):
        run_mxfp4_experts_triton(x, ex, w, ids, {"align": "cuda"})


def _compile_sm90() -> dict:
    """Compile the kernel for sm_90 with Triton's bundled ptxas (no GPU needed): catches what the
    interpreter cannot (lowering of the dots, the inline PTX, layouts). Returns {variant: "ok" | error}."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from longflash.layers.mxfp4_moe_triton import _mxfp4_moe_kernel as kern
    ptrs = {"x_ptr": "*bf16", "w13q_ptr": "*u8", "w13s_ptr": "*u8", "w2q_ptr": "*u8", "w2s_ptr": "*u8",
            "inter_ptr": "*bf16", "out_ptr": "*fp32", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
            "topk_w_ptr": "*fp32", "sched_ptr": "*i32"}
    ints = ["num_rows", "top_k", "stride_xm", "stride_13qe", "stride_13qn", "stride_13se", "stride_13sn",
            "stride_2qe", "stride_2qn", "stride_2se", "stride_2sn", "stride_im", "stride_om"]
    out = {}
    # the decode and prefill defaults first (BM 16 under the register cap, BM 128), then other paths
    for dec, bm, bw, bk, warps, maxnreg, pair in [(2, 16, 64, 128, 4, 128, False), (2, 128, 64, 64, 4, None, False),
                                                  (2, 64, 64, 64, 4, None, True), (1, 16, 64, 128, 4, None, False),
                                                  (0, 32, 64, 64, 4, None, True)]:
        consts = dict(D=3584, I=3072, ACT=1, BLOCK_M=bm, BLOCK_W=bw, BLOCK_K=bk, DOT_PRECISION="tf32",
                      DECODE13=dec, DECODE2=dec, DOWN_PAIR=pair)
        sig = dict(ptrs, **{n: "i32" for n in ints}, beta="fp32", linear_beta="fp32", **{c: "constexpr" for c in consts})
        idx = kern.arg_names.index
        src = ASTSource(fn=kern, signature=sig, constexprs={(idx(n),): v for n, v in consts.items()},
                        attrs={(idx(n),): [["tt.divisibility", 16]] for n in list(ptrs) + ints[2:]})
        key = f"decode={dec},BM={bm},BW={bw},BK={bk},warps={warps},maxnreg={maxnreg},down_pair={pair}"
        try:
            opts = dict(num_warps=warps, num_stages=3, **({"maxnreg": maxnreg} if maxnreg else {}))
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
            out[key] = "ok" if compiled.asm.get("cubin") else "no cubin"
        except Exception as e:  # reported by the test
            out[key] = f"{type(e).__name__}: {str(e)[:2000]}"
    from longflash.layers.moe_align_triton import _moe_align_kernel as align
    sig = {"ids_ptr": "*i64", "ws_ptr": "*i32", "n": "i32", "max_blocks": "i32", "num_experts": "i32",
           "E_BINS": "constexpr", "BLOCK_M": "constexpr", "CHUNK": "constexpr"}
    consts = dict(E_BINS=1024, BLOCK_M=16, CHUNK=1024)
    idx = align.arg_names.index
    src = ASTSource(fn=align, signature=sig, constexprs={(idx(n),): v for n, v in consts.items()},
                    attrs={(idx(n),): [["tt.divisibility", 16]] for n in ("ids_ptr", "ws_ptr")})
    try:
        out["align"] = "ok" if triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm.get("cubin") else "no cubin"
    except Exception as e:  # reported by the test
        out["align"] = f"{type(e).__name__}: {str(e)[:2000]}"
    return out


def test_kernel_compiles_for_sm90_without_a_gpu():
    if not os.path.exists(os.path.join(os.path.dirname(__import__("triton").__file__), "backends/nvidia/bin/ptxas")):
        pytest.skip("Triton's bundled ptxas is not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, __file__, "--compile-sm90"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(res) == 6 and all(v == "ok" for v in res.values()), res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_ptx_decode_is_exact():
    """Every byte (both nibbles) at scale bytes across [2, 252]: the PTX decode equals the fp32 reference
    rounded to bf16 (exact: E2M1 times a power of two), bit for bit."""
    from longflash.layers.mxfp4 import e2m1_table, e8m0_to_float
    from longflash.layers.mxfp4_moe_triton import decode_bf16_pairs_gpu
    q = torch.arange(256, dtype=torch.uint8).repeat(8).cuda()
    s = torch.tensor([2, 3, 100, 119, 127, 128, 200, 252], dtype=torch.uint8).repeat_interleave(256).cuda()
    lo, hi = decode_bf16_pairs_gpu(q, s)
    sc = e8m0_to_float(s)
    want_lo = (e2m1_table(device="cuda")[(q & 15).long()] * sc).to(torch.bfloat16)
    want_hi = (e2m1_table(device="cuda")[(q >> 4).long()] * sc).to(torch.bfloat16)
    assert torch.equal(lo.view(torch.int16), want_lo.view(torch.int16))
    assert torch.equal(hi.view(torch.int16), want_hi.view(torch.int16))


@pytest.fixture(scope="module")
def k3_experts():
    """Kimi-K3 expert shapes (Lt 3584, Im 3072), 32 experts in memory (to keep the GPU tests small)."""
    return _experts(32, 3584, 3072, "situ", device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 64, 300])
def test_gpu_kernel_equals_reference_at_kimi_k3_shapes(T, k3_experts):
    """Top-16 of 32 experts; 1 token takes the decode tiles, 64 tokens (32 rows per expert) BLOCK_M 32, 300
    the prefill tiles: bf16 activations with the PTX decode (the default config); at 64 tokens also the
    Triton decode with 4 programs per SM under a 128-register cap, paired down tiles and the reference
    align ops, and fp32
    activations. Against the fp32 reference of the same inputs. One compile per case (5 in all)."""
    from longflash.layers.mxfp4 import run_mxfp4_experts
    from longflash.layers.mxfp4_moe_triton import run_mxfp4_experts_triton
    ex, k = k3_experts, 16
    w, ids = _routing(T, ex.num_experts, k, seed=T, device="cuda")
    x = (torch.randn(T, 3584, generator=torch.Generator().manual_seed(T)) * 0.05).to("cuda", torch.bfloat16)
    ref = run_mxfp4_experts(x.float(), ex, w, ids)  # fp32 reference of the same bf16 inputs
    configs = [None] + ([dict(decode="small", maxnreg=128, programs_per_sm=4, align="torch", down_pair=True)]
                        if T == 64 else [])
    for cfg in configs:
        got = run_mxfp4_experts_triton(x, ex, w, ids, cfg)
        assert torch.isfinite(got).all()
        assert _rel(got, ref) <= 2e-2, cfg  # bf16 rounding of x·W and of the activation (fp32 accumulation)
    if T == 64:
        assert _rel(run_mxfp4_experts_triton(x.float(), ex, w, ids), ref) <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_one_launch_align_matches_reference():
    """On the GPU the rows of one expert may come in any order (atomics): per block the same expert, per
    expert the same rows, the same padding and block count as the reference."""
    from longflash.layers.moe_align_triton import moe_align_triton
    from longflash.layers.mxfp4_moe_triton import moe_align
    for T, k, E, bm in [(1, 16, 896, 16), (64, 16, 896, 16), (4096, 16, 896, 64), (3000, 2, 5, 16)]:
        ids = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(T)).cuda()
        ref_ids, ref_be, ref_nb = moe_align(ids, E, bm)
        got_ids, got_be, sched = moe_align_triton(ids, E, bm)
        assert torch.equal(got_be, ref_be) and int(sched[1]) == int(ref_nb[0]) and int(sched[0]) == 0
        assert not sched[2:].any()
        # same rows per block once sorted (a block holds rows of one expert; padding T*k sorts last)
        n_used = int(ref_nb[0]) * bm
        r = ref_ids[:n_used].view(-1, bm).sort(dim=1).values
        g = got_ids[:n_used].view(-1, bm).sort(dim=1).values
        # rows of an expert with > bm rows may move between its blocks: compare per expert
        for e in torch.unique(ref_be[ref_be >= 0]).tolist():
            sel = ref_be[: int(ref_nb[0])] == e
            assert torch.equal(r[sel].flatten().sort().values, g[sel].flatten().sort().values), (T, e)
        assert (got_ids[n_used:] == T * k).all()


if __name__ == "__main__" and sys.argv[1:] == ["--compile-sm90"]:
    import triton
    print(json.dumps(_compile_sm90()))
elif __name__ == "__main__":
    import triton
    import triton.language as tl

    from longflash.layers.mxfp4_moe_triton import _hi_nibble_small, _lo_nibble_small, _mxfp4_decode, _small_scale_fp32

    @triton.jit
    def _decode_kernel(q_ptr, s_ptr, o_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        q = tl.load(q_ptr + offs).to(tl.int32)
        s = tl.load(s_ptr + offs).to(tl.int32)
        tl.store(o_ptr + offs, _mxfp4_decode(q, s))

    @triton.jit
    def _decode_small_kernel(q_ptr, s_ptr, lo_ptr, hi_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        q = tl.load(q_ptr + offs).to(tl.int32)
        sc = _small_scale_fp32(tl.load(s_ptr + offs).to(tl.int32))
        tl.store(lo_ptr + offs, _lo_nibble_small(q, sc))
        tl.store(hi_ptr + offs, _hi_nibble_small(q, sc))

    print(json.dumps(_interpreter_checks()))
