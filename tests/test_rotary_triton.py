"""The one-launch Triton RoPE of q and k (``rotary_triton.rotate_qk_triton``) equals the reference
``RotaryEmbedding.rotate_qk_ref`` (``cos_sin`` + ``rotate``, today's math):

- on the CPU under ``TRITON_INTERPRET=1`` (a subprocess: set before Triton is imported) in fp32 and fp16,
  both layouts (half-split, interleaved), default RoPE and YaRN (attention_factor != 1), at awkward shapes
  (0 tokens, 1 token, head counts and widths that are not powers of two, MLA's strided q_pe / k_pe
  slices, 3-D keys, q or k alone, int32 positions, positions up to 10^6);
- on the GPU (skipped without CUDA) in bf16 and fp32 at the default model's shapes and at DeepSeek-V3's
  (128 heads, rotary_dim 64, interleaved, YaRN factor 40), and inside a CUDA graph;
- compiled for sm_90 without a GPU (Triton's bundled ptxas): no approximate sin/cos in the PTX.

Bounds (per element, s = attention_factor · |(x1, x2)|, the exact norm of the rotated pair):
  fp32: |kernel − ref| ≤ 1e-6 · s (fp32 rounding of cos/sin and of the products);
  fp16/bf16: |kernel − once| ≤ 1 ulp of |once| + 1e-6 · s, where ``once`` is the reference evaluated in
  fp32 on the same inputs and the same dtype-rounded cos/sin table, rounded once (the kernel's definition);
  and |kernel − ref| ≤ 2 ulp of s against the reference in the low dtype (its two rounded products and
  rounded sum, 1.5 ulp, plus the kernel's own 0.5).
(bf16 is not checked in the interpreter: its fp32 -> bf16 cast truncates.)
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from longflash.layers.rotary import RotaryEmbedding
from sm90_compile import compile_report

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
YARN_AF = {**YARN, "mscale_all_dim": 0.0}  # attention_factor = yarn_get_mscale(40) = 1.369
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


def _errors(rotary: RotaryEmbedding, x: torch.Tensor, got: torch.Tensor, positions: torch.Tensor) -> dict:
    """Worst errors of ``got`` (kernel output for x) in the units of the module docstring."""
    if x.numel() == 0:
        return {"fp32": 0.0, "once_ulps": 0.0, "chain_ulps": 0.0}
    dt = x.dtype
    ref = rotary.rotate_qk_ref(x, None, positions)[0].float()
    cos, sin = rotary.cos_sin(positions, dt)
    once = rotary.rotate(x.float(), cos.float(), sin.float()).to(dt).float()
    half = rotary.rotary_dim // 2
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if rotary.interleave else (xf[..., :half], xf[..., half:])
    s = (x1.square() + x2.square()).sqrt() * rotary.attention_factor
    s = torch.cat([s, s], dim=-1)
    g = got.float()
    if dt == torch.float32:
        return {"fp32": float(((g - ref).abs() / s.clamp(min=1e-30)).max())}
    eps, tiny = torch.finfo(dt).eps, torch.finfo(dt).tiny
    once_ulps = (g - once).abs() - 1e-6 * s
    return {"once_ulps": float((once_ulps / (eps * once.abs().clamp(min=tiny))).max()),
            "chain_ulps": float(((g - ref).abs() / (eps * s.clamp(min=tiny))).max())}


def _check(errs: dict, key: str) -> None:
    if "fp32" in errs:
        assert errs["fp32"] <= 1e-6, (key, errs)
    else:
        assert errs["once_ulps"] <= 1.0 and errs["chain_ulps"] <= 2.0, (key, errs)


def _cases(device="cpu", dtypes=(torch.float32, torch.float16)):
    """(key, rotary, q or None, k or None, positions) at small awkward shapes."""
    g = torch.Generator().manual_seed(0)
    pos_pool = torch.tensor([0, 1, 2, 17, 4095, 4096, 65537, 999_999])
    for dtype in dtypes:
        for interleave in (False, True):
            for name, params in (("default", DEFAULT), ("yarn", YARN_AF)):
                for rd in (16, 24):
                    rot = RotaryEmbedding(rd, params, 163840, interleave=interleave)
                    tag = f"{str(dtype)[6:]}-{'il' if interleave else 'half'}-{name}-rd{rd}"
                    for T, H in ((0, 3), (1, 1), (5, 3), (8, 5)):
                        pos = pos_pool[torch.randint(0, len(pos_pool), (T,), generator=g)].to(device)
                        q = torch.randn(T, H, 32 + rd, generator=g).to(device=device, dtype=dtype)[..., 32:]
                        k = torch.randn(T, 40 + rd, generator=g).to(device=device, dtype=dtype)[:, 40:]
                        yield f"{tag}-T{T}-H{H}-mla", rot, q, k, pos
                    q = torch.randn(6, 4, rd, generator=g).to(device=device, dtype=dtype)
                    k = torch.randn(6, 2, rd, generator=g).to(device=device, dtype=dtype)
                    pos = torch.arange(6, dtype=torch.int32).to(device) * 1000
                    yield f"{tag}-gqa-int32", rot, q, k, pos
                    yield f"{tag}-q-only", rot, q, None, pos
                    yield f"{tag}-k-only", rot, None, k, pos


def _run(cases, fn) -> dict:
    out = {}
    for key, rot, q, k, pos in cases:
        qo, ko = fn(rot, q, k, pos)
        errs = {}
        for name, x, o in (("q", q, qo), ("k", k, ko)):
            if x is None:
                errs[name] = o is None
                continue
            errs[name] = dict(_errors(rot, x, o, pos), shape=list(o.shape) == list(x.shape), dtype=str(o.dtype))
        out[key] = errs
    return out


def _check_all(res: dict, n_expected: int) -> None:
    assert len(res) == n_expected
    for key, errs in res.items():
        for name in ("q", "k"):
            e = errs[name]
            if isinstance(e, bool):
                assert e, (key, name)  # a None input gives a None output
                continue
            assert e.pop("shape"), (key, name)
            e.pop("dtype")
            _check(e, f"{key}-{name}")


def _interpreter_check() -> dict:
    from longflash.layers.rotary_triton import rotate_qk_triton
    return {"cases": _run(_cases(), rotate_qk_triton), "q_out": _q_out_check(rotate_qk_triton)}


def _q_out_check(fn) -> dict:
    """``fn(rot, q, k, pos, q_out=...)`` writing into the rope slice of a wider buffer (MLA's absorbed query)
    returns that slice, holds exactly what it returns without ``q_out``, leaves the rest of the buffer and
    k's result alone. Returns {case: ok}."""
    out = {}
    for key, rot, q, k, pos in _cases():
        if q is None:
            continue
        buf = torch.full((*q.shape[:-1], 8 + q.shape[-1]), 7.0, dtype=q.dtype)
        qo, ko = fn(rot, q, k, pos, q_out=buf[..., 8:])
        ref_q, ref_k = fn(rot, q, k, pos)
        out[key] = bool(torch.equal(buf[..., 8:], ref_q) and qo.data_ptr() == buf[..., 8:].data_ptr()
                        and (buf[..., :8] == 7).all() and (k is None or torch.equal(ko, ref_k)))
    return out


def test_rotate_qk_triton_equals_reference_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    _check_all(got["cases"], len(list(_cases())))
    assert got["q_out"] and all(got["q_out"].values()), got["q_out"]


def test_rotate_qk_q_out_reference_and_errors():
    """The reference path with ``q_out`` (CPU) writes into the slice exactly what it returns without; a
    q_out of the wrong shape/dtype, a strided last dim, or q_out without q is a ValueError."""
    ok = _q_out_check(lambda rot, q, k, pos, q_out=None: rot.rotate_qk(q, k, pos, q_out=q_out))
    assert ok and all(ok.values()), ok
    rot = RotaryEmbedding(16, DEFAULT, 4096)
    q, k, pos = torch.randn(3, 2, 16), torch.randn(3, 16), torch.arange(3)
    for q_out, qq in ((torch.empty(3, 2, 8), q), (torch.empty(3, 2, 16, dtype=torch.float16), q),
                      (torch.empty(3, 2, 32)[..., ::2], q)):
        with pytest.raises(ValueError, match="q_out must have"):
            rot.rotate_qk(qq, k, pos, q_out=q_out)
    with pytest.raises(ValueError, match="q_out is given but q is None"):
        rot.rotate_qk(None, k, pos, q_out=torch.empty(3, 2, 16))
    for bad_dim in (7, 0, -2):
        with pytest.raises(ValueError, match="positive even"):
            RotaryEmbedding(bad_dim, DEFAULT, 4096)


def test_rotate_qk_cpu_is_the_previous_math():
    """On the CPU rotate_qk is cos_sin + rotate, bit for bit (what MLA computed before)."""
    for key, rot, q, k, pos in _cases(dtypes=(torch.bfloat16,)):
        if q is None or k is None:
            continue
        cos, sin = rot.cos_sin(pos, q.dtype)
        qo, ko = rot.rotate_qk(q, k, pos)
        assert torch.equal(qo, rot.rotate(q, cos, sin)) and torch.equal(ko, rot.rotate(k, cos, sin)), key


def test_rotate_qk_rejects_bad_input():
    rot = RotaryEmbedding(16, DEFAULT, 4096)
    q, k, pos = torch.randn(3, 2, 16), torch.randn(3, 16), torch.arange(3)
    bad = [((None, None, pos), "both are None"), ((q, k, pos.float()), "integer"),
           ((q, k, pos[:2]), "T=2"), ((torch.randn(3, 2, 8), k, pos), "rotary_dim=16"),
           ((q, k.half(), pos), "share a dtype"), ((q, torch.randn(3, 1, 1, 16), pos), "k must be"),
           ((q.long(), None, pos), "floating point")]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            rot.rotate_qk(*args)


def _compile_sm90() -> dict:
    """Compile the kernel for sm_90 with Triton's bundled ptxas (no GPU): the libdevice path the GPU runs.
    Returns {config: {"ok", "approx": approximate sin/cos/ex2 instructions found, "error"?}}."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from longflash.layers import rotary_triton as rt
    kern = rt._rotary_qk_kernel
    out = {}
    for dt in ("bf16", "fp32"):
        for interleave in (False, True):
            ptrs = {"pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "q_ptr": "*" + dt, "k_ptr": "*" + dt,
                    "qo_ptr": "*" + dt, "ko_ptr": "*" + dt}
            ints = ["Hq", "Hk", "n_q_blocks", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_qot",
                    "stride_qoh", "stride_kot", "stride_koh"]
            consts = dict(HALF=32, BLOCK_HALF=32, BLOCK_H=32, INTERLEAVE=interleave, LIBDEVICE=True)
            sig = dict(ptrs, **{n: "i32" for n in ints}, attention_factor="fp32", **{c: "constexpr" for c in consts})
            idx = kern.arg_names.index
            key = f"{dt},interleave={interleave}"
            try:
                c = triton.compile(ASTSource(fn=kern, signature=sig, attrs={},
                                             constexprs={(idx(n),): v for n, v in consts.items()}),
                                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
                ptx = c.asm.get("ptx", "")
                out[key] = {"ok": bool(c.asm.get("cubin")),
                            "approx": len(re.findall(r"\b(?:sin|cos)\.approx", ptx))}
            except Exception as e:  # reported by the test
                out[key] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return out


def test_kernel_compiles_for_sm90_without_a_gpu():
    res = compile_report(__file__)
    assert len(res) == 4 and all(v["ok"] and v["approx"] == 0 for v in res.values()), res


def _gpu_cases(dtype):
    g = torch.Generator().manual_seed(1)
    shapes = [("default", RotaryEmbedding(16, DEFAULT, 4096), 4, 1, T, 4096) for T in (1, 8, 16, 128)]
    shapes += [("dsv3", RotaryEmbedding(64, YARN, 163840, interleave=True), 128, 1, T, 163840)
               for T in (1, 16, 4096)]
    shapes += [("gqa-drafter", RotaryEmbedding(128, DEFAULT, 32768), 32, 8, 16, 32768)]
    for name, rot, H, Hk, T, max_pos in shapes:
        pos = torch.randint(0, max_pos, (T,), generator=g).cuda()
        q = torch.randn(T, H, 128 + rot.rotary_dim, generator=g).to("cuda", dtype)[..., 128:]
        k = (torch.randn(T, 512 + rot.rotary_dim, generator=g).to("cuda", dtype)[:, 512:] if Hk == 1 else
             torch.randn(T, Hk, rot.rotary_dim, generator=g).to("cuda", dtype))
        yield f"{name}-{str(dtype)[6:]}-T{T}", rot, q, k, pos


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotate_qk_triton_gpu(dtype):
    from longflash.layers.rotary_triton import rotate_qk_triton
    cases = list(_gpu_cases(dtype))
    _check_all(_run(cases, rotate_qk_triton), len(cases))
    for key, rot, q, k, pos in cases:  # rotate_qk dispatches to the kernel on CUDA
        a, b = rot.rotate_qk(q, k, pos), rotate_qk_triton(rot, q, k, pos)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rotate_qk_triton_in_cuda_graph():
    """Captured once, replayed with new positions and inputs written in place: equals eager."""
    rot = RotaryEmbedding(64, YARN, 163840, interleave=True)
    q = torch.randn(16, 128, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(16, device="cuda")
    rot.rotate_qk(q, k, pos)  # warm-up: compiles, caches inv_freq on the device
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qo, ko = rot.rotate_qk(q, k, pos)
    for step in range(3):
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        pos.copy_(torch.randint(0, 163840, (16,), device="cuda"))
        graph.replay()
        eq, ek = rot.rotate_qk(q, k, pos)
        assert torch.equal(qo, eq) and torch.equal(ko, ek), step


if __name__ == "__main__":
    if "--compile-sm90" in sys.argv:
        print(json.dumps(_compile_sm90()))
    else:
        print(json.dumps(_interpreter_check()))
