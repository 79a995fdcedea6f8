"""The DFlash drafter's paged non-causal block attention: the PyTorch reference
(``spec_decode/dflash_attention.py``) against a dense fp64 per-request computation, and the Triton kernel
(``spec_decode/dflash_attention_triton.py``) against the reference.

CPU: the reference and its argument checks in this process; the kernel in one subprocess under
``TRITON_INTERPRET=1`` (set before Triton is imported) at small shapes: head_dim 16-64 (48: not a power of
two), 1-2 kv heads, rep 1-2, Bk 4-8 (5: not a power of two), pool blocks of 4 and 16, contexts 0, 1, not
block-aligned and longer than one split, window None and small, a host bound below a context, random
block tables with -1 past the context, fp32 / bf16 / fp16 q over bf16 and fp32 pools, one and several
splits; pool rows that no query may see are NaN for the kernel (so a read of one shows up as NaN).
sm_90 compilation of both stages without a GPU (Triton's bundled ptxas). GPU (skipped without CUDA):
the shipped drafter's shapes (4 heads, 2 kv heads, hd 64, Bk 8) at batch 1 and 16, contexts up to 4096;
a CUDA graph captured once at the capacity bound and replayed with other lengths; the drafter's padded
block forward (kernel) against its eager forward.

Accuracy: the reference takes fp32 copies of the same (rounded) inputs, so its result is the fp32
softmax of exactly the kernel's operands. fp32 q: |out − ref| ≤ 2e-5 (values O(1); fp32 summation
order). 16-bit q: the output is the fp32 result rounded once to 16 bits, so it must lie within 1 ulp
+ 1e-5 of the fp32 reference (0.5 ulp from rounding; the kernel's fp32-level error, ~1e-5 at most
with P split in two 16-bit parts, can cross a rounding boundary, and is many ulps of an output near
0) and equal the reference's own 16-bit output almost everywhere (≥ 97 % of elements). LSE:
|lse − ref| ≤ 2e-5 + 2^-20 · |ref|.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from interpreter_run import run_interpreted
from longflash.spec_decode import dflash_attention as da

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_case(ctx, Bk, kvh, rep, hd, bs, qdt, cdt, seed=0, device="cpu", spare_blocks=3):
    """Random inputs: q/k_blk/v_blk [R·Bk, ...] in ``qdt``, pool planes [nb, bs, kvh, hd] in ``cdt``, a
    random block table (-1 past each context, one spare column), context_lens int32."""
    g = torch.Generator(device=device).manual_seed(seed)
    R = len(ctx)
    nb = sum(-(-c // bs) for c in ctx) + spare_blocks
    kc = torch.randn(nb, bs, kvh, hd, generator=g, device=device).to(cdt)
    vc = torch.randn(nb, bs, kvh, hd, generator=g, device=device).to(cdt)
    perm = torch.randperm(nb, generator=g, device=device).to(torch.int32)
    mb = max(1, max(-(-c // bs) for c in ctx)) + 1
    bt = torch.full((R, mb), -1, dtype=torch.int32, device=device)
    i = 0
    for b, c in enumerate(ctx):
        n = -(-c // bs)
        bt[b, :n] = perm[i:i + n]
        i += n
    T = R * Bk
    q = torch.randn(T, kvh * rep, hd, generator=g, device=device).to(qdt)
    kb = torch.randn(T, kvh, hd, generator=g, device=device).to(qdt)
    vb = torch.randn(T, kvh, hd, generator=g, device=device).to(qdt)
    return q, kb, vb, kc, vc, bt, torch.tensor(ctx, dtype=torch.int32, device=device)


def poison_invisible(kc, vc, bt, ctx, window, bound):
    """Copies of the pool planes with NaN in every row no query may see (outside each request's
    [lo, min(ctx, bound)) and in blocks no request owns)."""
    keep = torch.zeros(kc.shape[:2], dtype=torch.bool)
    bs, table = kc.shape[1], bt.cpu().long()
    for b, c in enumerate(ctx):
        pos = torch.arange(0 if window is None else max(0, c - window), min(c, bound))
        keep[table[b, pos // bs], pos % bs] = True
    keep = keep.to(kc.device)[:, :, None, None]
    nan = torch.tensor(float("nan"), dtype=kc.dtype, device=kc.device)
    return torch.where(keep, kc, nan), torch.where(keep, vc, nan)


def compare(out, lse, ref32, ref_lse, ref_native) -> dict:
    """Accuracy numbers of a kernel result against the fp32 reference (see the module docstring)."""
    o = out.float()
    d = (o - ref32).abs()
    if out.dtype == torch.float32:
        ulps = float("nan")
    else:
        # one ulp of the 16-bit format at each reference value (the spacing above |ref| rounded down)
        r16 = ref32.abs().to(out.dtype)
        ulp = (torch.nextafter(r16, torch.full_like(r16, float("inf"))).float() - r16.float()).clamp_min(1e-30)
        ulps = ((d - 1e-5).clamp_min(0) / ulp).max().item() if d.numel() else 0.0  # 1e-5: fp32-level slack
    lse_err = ((lse - ref_lse).abs() - 2.0 ** -20 * ref_lse.abs()).max().item() if lse.numel() else 0.0
    return dict(abs=d.max().item() if d.numel() else 0.0, ulps=ulps,
                equal_frac=(out == ref_native).float().mean().item() if out.numel() else 1.0,
                lse=lse_err, nan=bool(out.isnan().any() or lse.isnan().any()),
                shape_ok=out.shape == ref_native.shape and out.dtype == ref_native.dtype and lse.shape == ref_lse.shape)


def case_problems(r: dict, fp32: bool) -> list[str]:
    """What is wrong with one case (empty: nothing)."""
    bad = []
    if not r["shape_ok"] or r["nan"]:
        bad.append("shape/dtype or NaN")
    if fp32 and r["abs"] > 2e-5:
        bad.append(f"abs {r['abs']:.3g}")
    if not fp32 and not (r["ulps"] <= 1.0 and r["equal_frac"] >= 0.97):
        bad.append(f"ulps {r['ulps']:.3g}, equal {r['equal_frac']:.3f}")
    if r["lse"] > 2e-5:
        bad.append(f"lse {r['lse']:.3g}")
    return bad


def run_case(fn, ctx, Bk, kvh, rep, hd, bs, qdt, cdt, window=None, bound=None, device="cpu", seed=0,
             poison=True, **kw) -> dict:
    """``fn`` (the kernel) on one random case vs the reference; pool rows no query may see are NaN for
    ``fn`` when ``poison``."""
    q, kb, vb, kc, vc, bt, cl = make_case(ctx, Bk, kvh, rep, hd, bs, qdt, cdt, seed, device)
    L = bt.shape[1] * bs if bound is None else bound
    pk, pv = poison_invisible(kc, vc, bt, ctx, window, L) if poison else (kc, vc)
    out, lse = fn(q, kb, vb, pk, pv, bt, cl, 0.3, window, bound, **kw)
    f = torch.float32
    ref32, ref_lse = da.dflash_block_attention(q.to(f), kb.to(f), vb.to(f), kc.to(qdt).to(f), vc.to(qdt).to(f), bt, cl,
                                               0.3, window, bound, max_rows=8)
    ref_native, _ = da.dflash_block_attention(q, kb, vb, kc, vc, bt, cl, 0.3, window, bound, max_rows=8)
    return compare(out, lse, ref32, ref_lse, ref_native)


# ------------------------------------------------------------------------------- reference (this process)

def _dense_fp64(q, kb, vb, kc, vc, bt, ctx, scale, window, bound):
    """Per request and head: softmax over [visible context rows ; block] in fp64, rows read one by one."""
    R = len(ctx)
    T, nh, hd = q.shape
    Bk, kvh, bs = T // R, kb.shape[1], kc.shape[1]
    out = torch.zeros(T, nh, hd, dtype=torch.float64)
    lse = torch.zeros(T, nh, dtype=torch.float64)
    for b, c in enumerate(ctx):
        lo = 0 if window is None else max(0, c - window)
        rows = [(int(bt[b, p // bs]), p % bs) for p in range(lo, min(c, bound))]
        for h in range(nh):
            g = h // (nh // kvh)
            k = torch.stack([kc[blk, off, g] for blk, off in rows] + list(kb[b * Bk:(b + 1) * Bk, g])).double()
            v = torch.stack([vc[blk, off, g] for blk, off in rows] + list(vb[b * Bk:(b + 1) * Bk, g])).double()
            s = q[b * Bk:(b + 1) * Bk, h].double() @ k.T * scale
            lse[b * Bk:(b + 1) * Bk, h] = torch.logsumexp(s, dim=-1)
            out[b * Bk:(b + 1) * Bk, h] = torch.softmax(s, dim=-1) @ v
    return out, lse


@pytest.mark.parametrize("ctx,Bk,kvh,rep,hd,bs,window,bound", [
    ([0, 1, 13, 30], 4, 2, 2, 16, 4, None, None),
    ([9, 30, 2], 5, 1, 2, 16, 4, 7, None),
    ([30, 17], 4, 2, 1, 32, 16, 20, 24),  # a host bound below a context: rows past it are not read
])
def test_reference_equals_dense_fp64(ctx, Bk, kvh, rep, hd, bs, window, bound):
    q, kb, vb, kc, vc, bt, cl = make_case(ctx, Bk, kvh, rep, hd, bs, torch.float32, torch.float32)
    out, lse = da.dflash_block_attention(q, kb, vb, kc, vc, bt, cl, 0.3, window, bound, max_rows=8)
    ro, rl = _dense_fp64(q, kb, vb, kc, vc, bt, ctx, 0.3, window, bt.shape[1] * bs if bound is None else bound)
    assert out.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:2]
    assert (out.double() - ro).abs().max().item() <= 1e-5
    assert (lse.double() - rl).abs().max().item() <= 1e-5
    # pieces of 4 rows and one piece give the same function
    o1, l1 = da.dflash_block_attention(q, kb, vb, kc, vc, bt, cl, 0.3, window, bound, max_rows=4096)
    assert (o1 - out).abs().max().item() <= 1e-6 and (l1 - lse).abs().max().item() <= 1e-6


def test_reference_bad_input_raises():
    q, kb, vb, kc, vc, bt, cl = make_case([5, 3], 4, 2, 2, 16, 4, torch.float32, torch.float32)
    f = da.dflash_block_attention
    bad = {
        "heads": lambda: f(q[:, :3], kb, vb, kc, vc, bt, cl, 0.3),
        "kv_shape": lambda: f(q, kb[:, :1], vb, kc, vc, bt, cl, 0.3),
        "cache_shape": lambda: f(q, kb, vb, kc[..., :8], vc, bt, cl, 0.3),
        "cache_dtype": lambda: f(q, kb, vb, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), bt, cl, 0.3),
        "q_dtype": lambda: f(q.bfloat16(), kb, vb, kc, vc, bt, cl, 0.3),
        "blocks": lambda: f(q[:7], kb[:7], vb[:7], kc, vc, bt, cl, 0.3),
        "table_rows": lambda: f(q, kb, vb, kc, vc, bt[:1], cl, 0.3),
        "lens_dtype": lambda: f(q, kb, vb, kc, vc, bt, cl.float(), 0.3),
        "window": lambda: f(q, kb, vb, kc, vc, bt, cl, 0.3, window=0),
        "bound": lambda: f(q, kb, vb, kc, vc, bt, cl, 0.3, max_context_len=-1),
    }
    for name, fn in bad.items():
        with pytest.raises(ValueError):
            fn()
    e_out, e_lse = f(q[:0], kb[:0], vb[:0], kc, vc, bt[:0], cl[:0], 0.3)
    assert e_out.shape == (0, 4, 16) and e_lse.shape == (0, 4)


def test_dispatcher_picks_reference_on_cpu():
    q = torch.zeros(8, 4, 16)
    assert da.block_attention_op(q) is da.dflash_block_attention


# ------------------------------------------------------------------------------- kernel under the interpreter

_SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from test_dflash_attention import run_case, make_case
from longflash.spec_decode import dflash_attention_triton as tk
bf, f32, f16 = torch.bfloat16, torch.float32, torch.float16
N16 = dict(config=dict(BLOCK_N=16))
res = {}
cases = {
    # name: (ctx, Bk, kvh, rep, hd, bs, q dtype, pool dtype, window, bound, kernel options)
    "fp32_bs4_S3": ([0, 1, 37, 70], 8, 2, 2, 64, 4, f32, f32, None, 96, dict(split_rows=32, **N16)),
    "bf16_bs16_S3": ([0, 1, 37, 70], 8, 2, 2, 64, 16, bf, bf, None, 96, dict(split_rows=32, **N16)),
    "bf16_window_S": ([5, 70, 3], 4, 1, 2, 16, 4, bf, bf, 9, None, dict(split_rows=16, **N16)),
    "fp32q_bf16pool_window_auto": ([70, 0], 4, 2, 1, 32, 16, f32, bf, 20, None, N16),
    "fp16q_bf16pool_S1": ([33, 2], 8, 2, 2, 64, 16, f16, bf, None, None, dict(split_rows=128, **N16)),
    "bf16_bound_below_ctx": ([70, 20], 4, 2, 2, 32, 4, bf, bf, None, 40, dict(split_rows=16, **N16)),
    "fp32_hd48_bk5": ([23, 1], 5, 2, 2, 48, 4, f32, f32, None, None, dict(split_rows=16, **N16)),
    "bf16_all_empty_S4": ([0, 0], 4, 1, 1, 16, 4, bf, bf, None, 64, dict(split_rows=16, **N16)),
    "fp32_bn64_default": ([100, 7], 8, 2, 2, 64, 16, f32, f32, None, None, {}),
}
for name, (ctx, Bk, kvh, rep, hd, bs, qdt, cdt, win, bound, kw) in cases.items():
    res[name] = run_case(tk.dflash_block_attention, ctx, Bk, kvh, rep, hd, bs, qdt, cdt, win, bound, **kw)
    res[name]["fp32"] = qdt == f32
# int64 context_lens / block table and auto splits give the same bits as int32
q, kb, vb, kc, vc, bt, cl = make_case([37, 5], 8, 2, 2, 64, 4, bf, bf)
o1, l1 = tk.dflash_block_attention(q, kb, vb, kc, vc, bt, cl, 0.3, None, 48, split_rows=16, config=dict(BLOCK_N=16))
o2, l2 = tk.dflash_block_attention(q, kb, vb, kc, vc, bt.long(), cl.long(), 0.3, None, 48, split_rows=16,
                                   config=dict(BLOCK_N=16))
res["int64_same_bits"] = bool(torch.equal(o1, o2) and torch.equal(l1, l2))
bad = {"split_rows": lambda: tk.dflash_block_attention(q, kb, vb, kc, vc, bt, cl, 0.3, split_rows=24,
                                                      config=dict(BLOCK_N=16)),
       "heads": lambda: tk.dflash_block_attention(q[:, :3], kb, vb, kc, vc, bt, cl, 0.3),
       "last_dim": lambda: tk.dflash_block_attention(q.transpose(1, 2).contiguous().transpose(1, 2), kb, vb, kc, vc,
                                                    bt, cl, 0.3)}
for k, fn in bad.items():
    try:
        fn()
        res[f"raises_{k}"] = False
    except ValueError:
        res[f"raises_{k}"] = True
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def interp_results():
    return run_interpreted(_SCRIPT)


def test_case_check_bounds():
    """The checks fail on their own: a 2-ulp 16-bit error, too few equal elements, an fp32 error, NaN."""
    ok = dict(shape_ok=True, nan=False, abs=1e-6, ulps=0.6, equal_frac=0.99, lse=0.0)
    assert case_problems(ok, fp32=False) == [] and case_problems(dict(ok, ulps=float("nan")), fp32=True) == []
    assert case_problems(dict(ok, ulps=2.0), fp32=False)
    assert case_problems(dict(ok, equal_frac=0.9), fp32=False)
    assert case_problems(dict(ok, abs=1e-4), fp32=True)
    assert case_problems(dict(ok, nan=True), fp32=True)
    assert case_problems(dict(ok, lse=1e-4), fp32=False)


def test_interpreter_equals_reference(interp_results):
    cases = {k: v for k, v in interp_results.items() if isinstance(v, dict)}
    assert len(cases) == 9, sorted(cases)
    bad = {n: p for n, r in cases.items() if (p := case_problems(r, r["fp32"]))}
    assert not bad, bad  # every failing case at once


def test_interpreter_lengths_dtypes_and_errors(interp_results):
    assert interp_results["int64_same_bits"]
    bad = [k for k, v in interp_results.items() if k.startswith("raises_") and not v]
    assert not bad and sum(k.startswith("raises_") for k in interp_results) == 3, bad


def test_kernel_needs_cuda_or_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.cuda.is_available():
        pytest.skip("only meaningful on a CPU without the interpreter")
    from longflash.spec_decode import dflash_attention_triton as tk
    q, kb, vb, kc, vc, bt, cl = make_case([5], 4, 1, 1, 16, 4, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        tk.dflash_block_attention(q, kb, vb, kc, vc, bt, cl, 0.3)


# ------------------------------------------------------------------------------- sm_90 compilation

_SM90_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from longflash.spec_decode import dflash_attention_triton as tk
out = {}
def build(kern, sig, consts, warps, stages, key):
    idx = kern.arg_names.index
    sig = dict(sig, **{c: "constexpr" for c in consts})
    src = ASTSource(fn=kern, signature=sig, constexprs={(idx(n),): v for n, v in consts.items()},
                    attrs={(idx(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")})
    try:
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
        ptx = c.asm["ptx"]
        out[key] = dict(ok=bool(c.asm.get("cubin")), mma=ptx.count("mma.sync") + ptx.count("wgmma.mma_async"))
    except Exception as e:
        out[key] = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:1500]}")
names = ["q_ptr", "kb_ptr", "vb_ptr", "kc_ptr", "vc_ptr", "bt_ptr", "cl_ptr", "out_ptr", "lse_ptr"]
for qdt, cdt, split, win in (("bf16", "bf16", True, False), ("bf16", "bf16", False, True), ("fp32", "fp32", True, True),
                             ("fp32", "bf16", False, False), ("fp16", "bf16", True, False)):
    sig = dict(zip(names, [f"*{qdt}"] * 3 + [f"*{cdt}"] * 2 + ["*i32", "*i32", "*fp32" if split else f"*{qdt}",
                                                                "*fp32"]))
    for n in tk._block_attn_stage1.arg_names[9:33]:
        sig[n] = "fp32" if n == "qk_scale" else "i32"
    consts = dict(KVH=2, REP=2, BK=8, HD=64, BLOCK_M=16, BLOCK_B=16, BLOCK_N=64, BLOCK_D=64, BLOCK_SIZE=16,
                  SPLIT_ROWS=128, HAS_WINDOW=win, SPLIT=split, DOT_IEEE=qdt == "fp32", P_SPLIT=qdt != "fp32",
                  INTERPRET=False)
    build(tk._block_attn_stage1, sig, consts, 4, 2, f"stage1,{qdt},{cdt},split={split},win={win}")
sig2 = dict(part_ptr="*fp32", plse_ptr="*fp32", cl_ptr="*i32", out_ptr="*bf16", lse_ptr="*fp32", num_splits="i32",
            window="i32", ctx_bound="i32", stride_ot="i32", stride_oh="i32")
build(tk._block_attn_stage2, sig2, dict(NH=4, BK=8, HD=64, BLOCK_D=64, BLOCK_S=32, SPLIT_ROWS=128, HAS_WINDOW=True),
      1, 1, "stage2")
print("RESULT" + json.dumps(out))
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """Both stages compile for sm_90 (the GPU-only paths: `range` loop, early exit, 16-bit dots with the
    split P); 16-bit q uses tensor-core MMAs, fp32 q IEEE FMAs."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")):
        pytest.skip("Triton's bundled ptxas is not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT"):])
    assert len(res) == 6 and all(v["ok"] for v in res.values()), res
    for key, v in res.items():
        if key.startswith("stage1,bf16") or key.startswith("stage1,fp16"):
            assert v["mma"] > 0, (key, v)
        if key.startswith("stage1,fp32"):
            assert v["mma"] == 0, (key, v)


# ------------------------------------------------------------------------------- GPU, real shapes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("ctx,qdt,window", [
    ([4096], torch.bfloat16, None),
    ([1000], torch.float32, None),
    ([0, 1, 17, 4096, 1000, 255, 256, 257, 3000, 4000, 64, 2, 4095, 100, 1500, 999], torch.bfloat16, None),
    ([0, 1, 17, 4096, 1000, 255, 256, 257, 3000, 4000, 64, 2, 4095, 100, 1500, 999], torch.float32, 256),
    ([4096, 300], torch.bfloat16, 1000),
])
def test_gpu_drafter_shapes(ctx, qdt, window):
    """The shipped drafter's attention (4 heads, 2 kv heads, hd 64, Bk 8), pool blocks of 16, the graph's
    bound (4096) and the automatic split count, plus forced 1 and 32-row splits of other sizes."""
    from longflash.spec_decode import dflash_attention_triton as tk
    cdt = torch.float32 if qdt == torch.float32 else torch.bfloat16
    for kw in ({}, dict(split_rows=4096), dict(split_rows=128)):
        r = run_case(tk.dflash_block_attention, ctx, 8, 2, 2, 64, 16, qdt, cdt, window, 4096, device="cuda", **kw)
        assert not case_problems(r, qdt == torch.float32), (kw, r)


@cuda
def test_gpu_cuda_graph_replays_other_lengths():
    """One graph captured at the capacity bound (lengths 0) serves later replays with other context
    lengths and block tables, written into the same input buffers: each replay equals the reference."""
    from longflash.spec_decode import dflash_attention_triton as tk
    R, cap, bs = 16, 4096, 16
    q, kb, vb, kc, vc, bt, cl = make_case([cap] * R, 8, 2, 2, 64, bs, torch.bfloat16, torch.bfloat16, device="cuda")
    cl.zero_()
    fn = lambda: tk.dflash_block_attention(q, kb, vb, kc, vc, bt, cl, 0.125, None, cap)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fn()
    g = torch.Generator(device="cuda").manual_seed(1)
    for lens in ([0] * R, [1, 4096, 17, 300] * 4, list(range(0, 4096, 256))):
        cl.copy_(torch.tensor(lens, dtype=torch.int32))
        mb = cap // bs  # the table's spare last column stays as it is (never read below the bound)
        bt[:, :mb] = torch.randperm(kc.shape[0], generator=g, device="cuda")[:R * mb].view(R, mb).to(torch.int32)
        graph.replay()
        f = torch.float32
        ref32, ref_lse = da.dflash_block_attention(q.to(f), kb.to(f), vb.to(f), kc.to(f), vc.to(f), bt, cl, 0.125,
                                                   None, cap)
        ref_native, _ = da.dflash_block_attention(q, kb, vb, kc, vc, bt, cl, 0.125, None, cap)
        r = compare(out, lse, ref32, ref_lse, ref_native)
        assert not case_problems(r, fp32=False), (lens[:4], r)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_drafter_padded_forward_equals_eager(dtype):
    """The shipped drafter's padded block forward (the kernel on CUDA) against its eager per-request
    forward (PyTorch attention), the graph's capacity bound as the host bound."""
    from longflash.default_model_path import default_model_path
    from longflash.spec_decode import dflash_attention_triton as tk
    from longflash.spec_decode.dflash_model import load_drafter
    dev = torch.device("cuda")
    assert da.block_attention_op(torch.zeros(1, device=dev)) is tk.dflash_block_attention
    drafter = load_drafter(os.path.join(default_model_path(), "drafter"), 14, dtype, dev)
    g = torch.Generator(device="cuda").manual_seed(0)
    kvh, hd = drafter.kv_row_shape()
    for attn in drafter.attention_layers():
        attn.kv_cache = torch.randn(2, 330, 16, kvh, hd, generator=g, device=dev).to(dtype)
    bk, ctx_lens = 8, [5, 0, 1100, 4000]
    bt = torch.full((4, 256), -1, dtype=torch.int32, device=dev)
    perm = torch.randperm(330, generator=g, device=dev).to(torch.int32)
    i = 0
    for b, c in enumerate(ctx_lens):
        n = -(-c // 16)
        bt[b, :n] = perm[i:i + n]
        i += n
    x = torch.randn(4 * bk, drafter.cfg.hidden_size, generator=g, device=dev).to(dtype)
    pos = torch.cat([torch.arange(s, s + bk) for s in ctx_lens]).to(dev)
    with torch.inference_mode():
        ref = drafter(x, pos, [0, bk, 2 * bk, 3 * bk, 4 * bk], ctx_lens, bt).float()
        out = drafter.forward_padded(x, pos, torch.tensor(ctx_lens, dtype=torch.int32, device=dev), bt, 4096).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel <= (1e-5 if dtype == torch.float32 else 1e-2), rel
