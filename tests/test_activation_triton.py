"""The one-launch Triton SwiGLU / SiTU (``activation_triton``) equal the references
``activation.silu_and_mul_ref`` / ``situ_and_mul_ref``:

- on the CPU under ``TRITON_INTERPRET=1`` (a subprocess: set before Triton is imported) in fp32 and fp16
  at awkward shapes (0 rows, 1 row, widths that are not powers of two or span several column blocks,
  3-D input, the two halves of a fused gate_up output [T, 2I]) with values in every branch (0, the tanh
  series region |x| < 1/4, saturation, exp overflow at g = -90) and non-default SiTU betas;
- on the GPU (skipped without CUDA) in bf16 and fp32 at the default model's widths and at Kimi-K3 /
  DeepSeek-V3 widths, through the public ``silu_and_mul``/``situ_and_mul`` (dispatch), and in a CUDA graph;
- compiled for sm_90 without a GPU (Triton's bundled ptxas): IEEE divisions (no ``div.full``).

Bounds (per element, ulp = eps · max(|r|, smallest normal)):
  fp32: |kernel − ref| ≤ 1e-6 · max(|ref|, smallest normal);
  fp16/bf16: |kernel − once| ≤ 1 ulp of ``once`` = the reference evaluated in fp32 on the same inputs and
  rounded once (the kernel's definition); against the reference evaluated in the low dtype (each op
  rounding): ≤ 2 ulp for SwiGLU (2 roundings + the kernel's), ≤ 5 ulp for SiTU (8 roundings, each passed
  on with a factor ≤ 1 by tanh/sigmoid/multiply, + the kernel's), with ulp = eps · max(|ref|, 128 · smallest
  normal) here: the chain's intermediates can be subnormal (u/25 for |u| < 25 · 2^-14 in fp16) and round
  with an absolute error of half the subnormal spacing, which later factors (≤ β · β_lin) enlarge.
(bf16 is not checked in the interpreter: its fp32 -> bf16 cast truncates.)
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from longflash.layers.activation import silu_and_mul_ref, situ_and_mul_ref
from sm90_compile import compile_report

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPECIAL = [0.0, 1e-6, -3e-4, 0.2, -0.26, 1.0, -4.0, 30.0, -30.0, 90.0, -90.0, 200.0]


def _ops():
    from longflash.layers import activation_triton as at
    return {"silu": (at.silu_and_mul_triton, silu_and_mul_ref, ()),
            "situ": (at.situ_and_mul_triton, situ_and_mul_ref, ()),
            "situ-b2-10": (at.situ_and_mul_triton, situ_and_mul_ref, (2.0, 10.0))}


def _cases(device="cpu", dtypes=(torch.float32, torch.float16), shapes=((0, 64), (1, 64), (7, 96), (3, 5, 80),
                                                                          (2, 3000))):
    """(key, gate, up): plain tensors and the halves of one fused [T, 2I] buffer."""
    g = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for shape in shapes:
            gate = torch.randn(*shape, generator=g) * 4
            up = torch.randn(*shape, generator=g) * 4
            if gate.numel():
                n = min(len(_SPECIAL), shape[-1])
                gate.view(-1, shape[-1])[0, :n] = torch.tensor(_SPECIAL[:n])
                up.view(-1, shape[-1])[-1, :n] = torch.tensor(_SPECIAL[:n])
            yield f"{str(dtype)[6:]}-{shape}", gate.to(device, dtype), up.to(device, dtype)
        T, I = 6, 136
        h = (torch.randn(T, 2 * I, generator=g) * 4).to(device, dtype)
        yield f"{str(dtype)[6:]}-fused-halves", h[:, :I], h[:, I:]


def _errors(got: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, ref_fn, args) -> dict:
    if got.numel() == 0:
        return {"fp32": 0.0} if gate.dtype == torch.float32 else {"once_ulps": 0.0, "chain_ulps": 0.0}
    dt = gate.dtype
    tiny = torch.finfo(dt).tiny
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ref_fn(gate, up, *args).float()
        once = ref_fn(gate.float(), up.float(), *args).to(dt).float()
    g = got.float()
    if dt == torch.float32:
        return {"fp32": float(((g - ref).abs() / ref.abs().clamp(min=tiny)).max())}
    eps = torch.finfo(dt).eps
    return {"once_ulps": float(((g - once).abs() / (eps * once.abs().clamp(min=tiny))).max()),
            "chain_ulps": float(((g - ref).abs() / (eps * ref.abs().clamp(min=128 * tiny))).max())}


def _run(cases) -> dict:
    out = {}
    for key, gate, up in cases:
        for name, (fn, ref_fn, args) in _ops().items():
            got = fn(gate, up, *args)
            e = _errors(got, gate, up, ref_fn, args)
            e["shape"] = list(got.shape) == list(gate.shape) and got.dtype == gate.dtype and got.is_contiguous()
            out[f"{key}-{name}"] = e
    return out


def _check_all(res: dict, n_expected: int) -> None:
    assert len(res) == n_expected
    for key, e in res.items():
        assert e["shape"], key
        if "fp32" in e:
            assert e["fp32"] <= 1e-6, (key, e)
        else:
            assert e["once_ulps"] <= 1.0 and e["chain_ulps"] <= (2.0 if key.endswith("silu") else 5.0), (key, e)


def test_act_and_mul_triton_equals_reference_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    _check_all(json.loads(res.stdout.strip().splitlines()[-1]), 3 * len(list(_cases())))


def test_act_and_mul_triton_rejects_bad_input():
    from longflash.layers.activation_triton import silu_and_mul_triton, situ_and_mul_triton
    x = torch.randn(3, 8)
    for fn in (silu_and_mul_triton, situ_and_mul_triton):
        with pytest.raises(ValueError, match="must match"):
            fn(x, torch.randn(3, 9))
        with pytest.raises(ValueError, match="must match"):
            fn(x, x.half())
        with pytest.raises(ValueError, match="floating-point"):
            fn(x.long(), x.long())


def _compile_sm90() -> dict:
    """Compile the kernel for sm_90 with Triton's bundled ptxas (no GPU): the libdevice path the GPU runs.
    Returns {config: {"ok", "div_full": approximate divisions in the PTX, "error"?}}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from longflash.layers import activation_triton as at
    kern = at._act_and_mul_kernel
    out = {}
    for dt in ("bf16", "fp32"):
        for act in (0, 1):
            ptrs = {"g_ptr": "*" + dt, "u_ptr": "*" + dt, "o_ptr": "*" + dt}
            consts = dict(ACT=act, LIBDEVICE=True, BLOCK_ROWS=2, BLOCK_I=1024)
            sig = dict(ptrs, **{n: "i32" for n in ("n_rows", "I", "stride_g", "stride_u", "stride_o")},
                       beta="fp32", linear_beta="fp32", **{c: "constexpr" for c in consts})
            idx = kern.arg_names.index
            key = f"{dt},act={act}"
            try:
                c = triton.compile(ASTSource(fn=kern, signature=sig, attrs={},
                                             constexprs={(idx(n),): v for n, v in consts.items()}),
                                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
                ptx = c.asm.get("ptx", "")
                out[key] = {"ok": bool(c.asm.get("cubin")), "div_full": ptx.count("div.full"),
                            "div_rn": ptx.count("div.rn.f32")}
            except Exception as e:  # reported by the test
                out[key] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return out


def test_kernel_compiles_for_sm90_without_a_gpu():
    res = compile_report(__file__)
    assert len(res) == 4 and all(v["ok"] and v["div_full"] == 0 and v["div_rn"] > 0 for v in res.values()), res


# default model: dense I 512, experts/shared 128 (rows = T·top-k); Kimi-K3: experts 3072, shared 6144,
# dense 33792; DeepSeek-V3: experts 2048, dense 18432
_GPU_SHAPES = [(T, I) for T in (1, 8, 16, 128) for I in (128, 512)] + \
              [(T, I) for T in (1, 16, 512) for I in (2048, 3072, 6144)] + [(1, 18432), (16, 33792)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_and_mul_triton_gpu(dtype):
    from longflash.layers.activation import silu_and_mul, situ_and_mul
    cases = list(_cases("cuda", (dtype,), shapes=_GPU_SHAPES))
    _check_all(_run(cases), 3 * len(cases))
    for key, gate, up in cases:  # the public functions dispatch to the kernel on CUDA
        at = _ops()
        assert torch.equal(silu_and_mul(gate, up), at["silu"][0](gate, up)), key
        assert torch.equal(situ_and_mul(gate, up, 2.0, 10.0), at["situ"][0](gate, up, 2.0, 10.0)), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_act_and_mul_triton_in_cuda_graph():
    """Captured once on the halves of a fused [T, 2I] buffer, replayed after writing new values: equals
    eager."""
    from longflash.layers.activation import silu_and_mul, situ_and_mul
    h = torch.randn(16, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    g, u = h[:, :3072], h[:, 3072:]
    silu_and_mul(g, u), situ_and_mul(g, u)  # warm-up: compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, b = silu_and_mul(g, u), situ_and_mul(g, u)
    for step in range(3):
        h.copy_(torch.randn_like(h) * 4)
        graph.replay()
        assert torch.equal(a, silu_and_mul(g, u)) and torch.equal(b, situ_and_mul(g, u)), step


if __name__ == "__main__":
    if "--compile-sm90" in sys.argv:
        print(json.dumps(_compile_sm90()))
    else:
        warnings.simplefilter("ignore")  # numpy's exp overflow at g = -90 (the result, 0, is checked)
        print(json.dumps(_run(_cases())))
