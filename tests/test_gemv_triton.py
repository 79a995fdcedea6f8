"""The few-row Triton GEMV (``layers/gemv_triton.py``) equals its reference ``gemv.gemv_ref``, and the
layers' dispatch (``gemv.linear`` / ``gemv.bmm``) sends only what it should to it:

- on the CPU under ``TRITON_INTERPRET=1`` (a subprocess: set before Triton is imported) in fp32 and fp16
  at awkward shapes: 1..8 rows, N and K not multiples of the tile, K < the tile, [N, K] and transposed
  [K, N] weights, per-head batches, x as a strided view, y written into a slice of a wider buffer, and
  every tile of the benchmark's sweep on one shape;
- on the GPU (skipped without CUDA) in bf16 at the benchmark model's shapes against cuBLAS's error,
  and an MLA uniform-decode forward through it against the cuBLAS path.
Bound: |y − ref| ≤ 4 · K · eps(dtype) · Σ_k |x_k · w_k| + 1 ulp of |ref| (fp32 sums in another order,
then one rounding); fp32 to a few ulps of the same scale. (bf16 is not checked in the interpreter: its
fp32 -> bf16 cast truncates.)
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from longflash.layers import gemv
from longflash.layers.gemv import gemv_ref

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cases(device="cpu", dtypes=(torch.float32, torch.float16)):
    """(key, x, w, out or None) at awkward shapes."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)
    for dt in dtypes:
        def cast(t):
            return t.to(device=device, dtype=dt)
        for M, N, K in ((1, 37, 100), (2, 64, 256), (3, 130, 64), (5, 5, 33), (8, 67, 700), (1, 1, 1), (2, 40, 2048)):
            yield f"{dt}-nk-M{M}-N{N}-K{K}", cast(r(M, K)), cast(r(N, K)), None
        yield f"{dt}-kn", cast(r(2, 96)), cast(r(96, 80)).t(), None
        yield f"{dt}-x-strided", cast(r(3, 200))[:, 10:110], cast(r(48, 100)), None
        yield f"{dt}-batched-kn-out-slice", cast(r(4, 2, 48)), cast(r(4, 48, 40)).transpose(1, 2), \
            torch.full((4, 2, 56), 7.0, dtype=dt, device=device)[:, :, :40]
        # MLA's absorbed products: x = q_nope [T, H, d] as a per-head view, y into q_abs's latent slice
        q_nope = cast(r(1, 3, 24))[..., :16]
        yield f"{dt}-mla-w_uk", q_nope.transpose(0, 1), cast(r(3, 16, 32)).transpose(1, 2), \
            torch.full((1, 3, 40), 7.0, dtype=dt, device=device)[..., :32].transpose(0, 1)
        yield f"{dt}-mla-w_uv", cast(r(2, 3, 32)).transpose(0, 1), cast(r(3, 16, 32)), None


def _error(x, w, y, ref) -> float:
    """max |y − ref| over the bound of the module docstring (≤ 1 passes)."""
    eps = torch.finfo(x.dtype).eps
    mag = torch.matmul(x.float().abs(), w.float().abs().transpose(-1, -2))
    bound = 4 * x.shape[-1] * torch.finfo(torch.float32).eps * mag + eps * ref.float().abs() + 1e-30
    return float(((y.float() - ref.float()).abs() / bound).max()) if y.numel() else 0.0


def _run(fn, cases) -> dict:
    out = {}
    for key, x, w, o in cases:
        before = o.detach().clone() if o is not None else None
        base = o._base if o is not None and o._base is not None else None
        full_before = base.detach().clone() if base is not None else None
        y = fn(x, w, o)
        ref = gemv_ref(x, w)
        res = {"err": _error(x, w, y, ref), "shape": list(y.shape) == list(ref.shape), "dtype": y.dtype == x.dtype}
        if o is not None:
            res["into_out"] = y.data_ptr() == o.data_ptr() and before is not None
            # the buffer outside the out view is untouched
            mask = torch.ones_like(base, dtype=torch.bool)
            o_idx = torch.zeros_like(base, dtype=torch.bool)
            o_idx.view(-1)[_flat_indices(o, base)] = True
            res["outside_kept"] = bool(torch.equal(base[mask & ~o_idx], full_before[mask & ~o_idx]))
        out[key] = res
    return out


def _flat_indices(view: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Flat indices into ``base`` (contiguous) of every element of ``view``."""
    idx = torch.arange(base.numel()).view(base.shape)
    return torch.as_strided(idx, view.shape, view.stride(), view.storage_offset()).reshape(-1)


def _interpreter_check() -> dict:
    from longflash.layers.gemv_triton import GemvConfig, gemv_triton
    res = {"cases": _run(lambda x, w, o: gemv_triton(x, w, o), _cases())}
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 300, generator=g), torch.randn(70, 300, generator=g)
    tiles = {}
    for bn, bk, nw in ((2, 128, 2), (16, 64, 4), (8, 1024, 8)):
        tiles[f"N{bn} K{bk} w{nw}"] = _error(x, w, gemv_triton(x, w, config=GemvConfig(bn, bk, nw)), gemv_ref(x, w))
    wkn = torch.randn(300, 70, generator=g).t()
    for bn, bk, nw in ((32, 8, 2), (128, 64, 8)):
        tiles[f"kn N{bn} K{bk} w{nw}"] = _error(x, wkn, gemv_triton(x, wkn, config=GemvConfig(bn, bk, nw)),
                                                gemv_ref(x, wkn))
    res["tiles"] = tiles
    return res


def _check(res: dict) -> None:
    for key, r in res.items():
        assert r.pop("shape") and r.pop("dtype"), key
        assert r.pop("err") <= 1.0, key
        assert all(r.values()), (key, r)


def test_gemv_triton_equals_reference_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got["cases"]) == len(list(_cases()))
    _check(got["cases"])
    assert got["tiles"] and all(e <= 1.0 for e in got["tiles"].values()), got["tiles"]


def test_reference_and_dispatch_on_the_cpu():
    """gemv_ref is fp32 math rounded once; on the CPU ``linear`` is F.linear and ``bmm`` torch.matmul,
    bit for bit (the dispatch sends nothing to Triton off CUDA)."""
    res = _run(lambda x, w, o: gemv_ref(x, w, o), _cases(dtypes=(torch.float32,)))
    _check(res)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 5, 64, generator=g), torch.randn(24, 64, generator=g)
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))
    xb, wb = torch.randn(4, 2, 32, generator=g), torch.randn(4, 16, 32, generator=g)
    out = torch.empty(4, 2, 16)
    assert gemv.bmm(xb, wb, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, torch.matmul(xb, wb.transpose(1, 2)))
    assert not gemv.use_gemv(x[0], w)


def test_use_gemv_rules():
    """Only CUDA, 1..GEMV_MAX_ROWS rows (two only up to GEMV_TWO_ROW_MAX_WEIGHT weight elements), a 16-bit
    dtype shared by x and w, w contiguous along K, no autograd."""
    class FakeCuda:  # the rules read attributes only; a real CUDA tensor is not needed to check them
        def __init__(self, rows, dtype=torch.bfloat16, requires_grad=False, cuda=True, k_stride=1, k=64):
            self.is_cuda, self.dtype, self.requires_grad = cuda, dtype, requires_grad
            self.shape, self.k_stride = (rows, k), k_stride

        def stride(self, dim):
            assert dim == -1
            return self.k_stride
    w = FakeCuda(32)
    assert gemv.use_gemv(FakeCuda(1), w) and gemv.use_gemv(FakeCuda(gemv.GEMV_MAX_ROWS), w)
    assert not gemv.use_gemv(FakeCuda(gemv.GEMV_MAX_ROWS + 1), w)
    assert not gemv.use_gemv(FakeCuda(0), w)
    assert not gemv.use_gemv(FakeCuda(1, torch.float32), FakeCuda(32, torch.float32))
    assert not gemv.use_gemv(FakeCuda(1), FakeCuda(32, torch.float16))
    assert not gemv.use_gemv(FakeCuda(1, cuda=False), w)
    assert not gemv.use_gemv(FakeCuda(1), FakeCuda(32, k_stride=32))  # a [K, N]-stored weight
    big = FakeCuda(gemv.GEMV_TWO_ROW_MAX_WEIGHT // 64 + 1)  # one row more than the two-row cap allows
    assert gemv.use_gemv(FakeCuda(1), big) and not gemv.use_gemv(FakeCuda(2), big)
    assert gemv.use_gemv(FakeCuda(2), FakeCuda(gemv.GEMV_TWO_ROW_MAX_WEIGHT // 64))
    with torch.enable_grad():
        assert not gemv.use_gemv(FakeCuda(1, requires_grad=True), w)
    try:
        gemv.enabled = False
        assert not gemv.use_gemv(FakeCuda(1), w)
    finally:
        gemv.enabled = True


def test_gemv_triton_rejects_bad_input():
    pytest.importorskip("triton")
    from longflash.layers.gemv_triton import MAX_ROWS, gemv_triton
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    bad = [((torch.randn(MAX_ROWS + 1, 16), w), "at most"), ((x, torch.randn(8, 15)), "does not match"),
           ((x, w.half()), "dtype"), ((x, torch.randn(2, 8, 16)), "2-D or both 3-D"),
           ((x, w, torch.empty(2, 9)), "out")]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            gemv_triton(*args)
    with pytest.raises(ValueError, match="do not match"):
        gemv_ref(x, torch.randn(8, 15))
    ints = (torch.ones(2, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32))
    for fn in (gemv_triton, gemv_ref):
        with pytest.raises(ValueError, match="share a dtype"):
            fn(*ints)
        with pytest.raises(ValueError, match="share a dtype"):
            fn(x.double(), w.double())


def test_bmm_fallback_checks_out_like_the_kernel():
    """The torch path of ``gemv.bmm`` (CPU, many rows) refuses an ``out`` of another shape or dtype with the
    kernel's ValueError instead of broadcasting or casting into it."""
    x, w = torch.randn(2, 1, 8), torch.randn(2, 4, 8)
    for out in (torch.zeros(2, 3, 4), torch.zeros(2, 1, 4, dtype=torch.float16), torch.empty(2, 1, 5)):
        with pytest.raises(ValueError, match="out"):
            gemv.bmm(x, w, out=out)
        with pytest.raises(ValueError, match="out"):
            gemv_ref(x, w, out)


BENCH_SHAPES = [(1, 2112, 2048, "nk"), (1, 3072, 1536, "nk"), (1, 2048, 2048, "nk"), (1, 1024, 2048, "nk"),
                (1, 1024, 2048, "kn"), (1, 2048, 512, "nk"), (16, 512, 128, "kn"), (16, 128, 512, "nk"),
                (1, 2048, 8192, "nk")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemv_triton_gpu_model_shapes():
    """bf16 at the benchmark model's shapes, 1..8 rows: within the bound, and never more than 2x
    cuBLAS's own error against the fp32 reference (+ 1 ulp)."""
    from longflash.layers.gemv_triton import gemv_triton
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, N, K, layout in BENCH_SHAPES:
        for M in (1, 2, 4, 8):
            w = torch.randn((B, N, K) if layout == "nk" else (B, K, N), generator=g, device="cuda").bfloat16()
            w = w if layout == "nk" else w.transpose(1, 2)
            w = w if B > 1 else w[0]
            x = torch.randn((B, M, K) if B > 1 else (M, K), generator=g, device="cuda").bfloat16()
            ref = gemv_ref(x, w).float()
            y = gemv_triton(x, w).float()
            cub = (F.linear(x, w) if B == 1 else torch.matmul(x, w.transpose(1, 2))).float()
            ulp = torch.finfo(torch.bfloat16).eps * ref.abs().max().item()
            key = (B, N, K, layout, M)
            assert _error(x, w, y, ref) <= 1.0, key
            assert (y - ref).abs().max().item() <= 2 * (cub - ref).abs().max().item() + ulp, key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_linear_dispatch_gpu_and_graph_replay():
    """``gemv.linear`` on one bf16 token runs the Triton kernel (equal to calling it directly), and a CUDA
    graph of it replays to the eager result bit for bit."""
    from longflash.layers.gemv_triton import gemv_triton
    w = torch.randn(2112, 2048, device="cuda").bfloat16()
    x = torch.randn(1, 2048, device="cuda").bfloat16()
    eager = gemv.linear(x, w)
    assert torch.equal(eager, gemv_triton(x, w))
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemv.linear(static_x, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv.linear(static_x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)


def _compile_sm90() -> dict:
    """Compile the GEMV and the RMSNorm kernels for sm_90 with programmatic dependent launch on (Triton's
    bundled ptxas, no GPU): {kernel: {"ok", "wait": griddepcontrol.wait found in the PTX, "launch": its
    launch_dependents, "pdl_launch": compiled for a PDL launch}}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from longflash.layers import gemv_triton, norm_triton
    specs = {
        "gemv": (gemv_triton._gemv_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                                            **{n: "i32" for n in ("M", "N", "K", "sxb", "sxm", "sxk", "swb", "swn",
                                                                  "swk", "syb", "sym", "syn")}},
                 dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, INTERPRET=False, PDL=True)),
        "rms_norm": (norm_triton._rms_norm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                                                    "n_rows": "i32", "D": "i32", "stride_x": "i32", "stride_o": "i32",
                                                    "eps": "fp32", "res_ptr": "*bf16", "res_out_ptr": "*bf16",
                                                    "stride_r": "i32"},
                     dict(BLOCK_D=2048, BLOCK_ROWS=1, HAS_RESIDUAL=True, PDL=True)),
    }
    out = {}
    for name, (kern, sig, consts) in specs.items():
        idx = kern.arg_names.index
        try:
            c = triton.compile(ASTSource(fn=kern, signature=dict(sig, **{k: "constexpr" for k in consts}), attrs={},
                                         constexprs={(idx(n),): v for n, v in consts.items()}),
                               target=GPUTarget("cuda", 90, 32), options=dict(num_warps=2, launch_pdl=True))
            ptx = c.asm.get("ptx", "")
            out[name] = {"ok": bool(c.asm.get("cubin")), "wait": "griddepcontrol.wait" in ptx,
                         "launch": "griddepcontrol.launch_dependents" in ptx, "pdl_launch": bool(c.metadata.launch_pdl)}
        except Exception as e:  # reported by the test
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return out


def test_kernels_compile_for_sm90_with_pdl_without_a_gpu():
    """With programmatic dependent launch on, both kernels compile for sm_90 and carry the griddepcontrol
    wait and launch_dependents instructions (the interpreter, which cannot run inline PTX, never sees them)."""
    from sm90_compile import compile_report
    res = compile_report(__file__)
    assert len(res) == 2 and all(v.get("ok") and v["wait"] and v["launch"] and v["pdl_launch"]
                                 for v in res.values()), res


def test_pdl_off_the_gpu_and_under_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    from longflash.ops import triton_env, triton_pdl
    assert triton_pdl.HAS_GDC  # Triton 3.6, the pinned release, has griddepcontrol
    assert triton_pdl.launch_options(False) == {} and triton_pdl.launch_options(True) == {"launch_pdl": True}
    assert not triton_pdl.pdl_for(torch.device("cpu"))
    assert not triton_env.pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not triton_env.pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(triton_env, "PDL", False)
    assert not triton_env.pdl_enabled(torch.device("cuda", 0))


if __name__ == "__main__":
    if "--compile-sm90" in sys.argv:
        print(json.dumps(_compile_sm90()))
    else:
        print(json.dumps(_interpreter_check()))
