"""MXFP8 reference quantizer (RCEIL, conventions) and the Triton kernel under TRITON_INTERPRET=1."""
import math
import os
import subprocess
import sys
import textwrap
from fractions import Fraction

import json

import pytest
import torch

from longflash.ops.mxfp8 import (dequantize_mxfp8, quantize_mxfp8, quantize_mxfp8_into, rceil_scale_bytes,
                                 scale_bytes_to_float)

# the checkout under test, for the subprocesses (whatever the installed package points at)
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _all_positive_finite_bf16() -> torch.Tensor:
    bits = torch.arange(1, 0x7F80, dtype=torch.int32)  # 0x0001 (min subnormal) .. 0x7F7F (max finite)
    return (bits << 16).view(torch.float32).to(torch.bfloat16)


def _rceil_byte_exact(v: float) -> int:
    """Independent RCEIL: smallest integer E with 448 * 2^E >= v (exact rationals), byte clamp(E + 127, 0, 254)."""
    r = Fraction(v) / 448
    e = math.floor(math.log2(v / 448)) - 1 if v / 448 > 0 else -200
    while Fraction(2) ** e < r:
        e += 1
    while e > -300 and Fraction(2) ** (e - 1) >= r:
        e -= 1
    return min(254, max(0, e + 127))


def test_rceil_scale_byte_for_every_positive_finite_bf16_amax():
    vals = _all_positive_finite_bf16()
    expected = torch.tensor([_rceil_byte_exact(v) for v in vals.float().tolist()], dtype=torch.uint8)
    # Blocks whose amax is the value (first element), the rest zero or smaller in magnitude.
    x = torch.zeros(vals.numel(), 32, dtype=torch.bfloat16)
    x[:, 0] = vals
    x[:, 1] = -vals * 0.5
    data, scales = quantize_mxfp8(x)
    assert torch.equal(scales[:, 0], expected)
    assert torch.equal(rceil_scale_bytes(vals.float()), expected)
    # RCEIL never saturates: the amax element is a finite E4M3 value <= 448 (never the NaN code) and
    # within half an ulp. NOTE: amax > 1.9375 * 2^127 rounds up to 2^128, which MX can hold but fp32
    # cannot, so those few dequantize to inf.
    assert ((data[:, 0] & 0x7F) != 0x7F).all()
    deq = dequantize_mxfp8(data, scales)
    ok = vals.float() < 1.9375 * 2.0 ** 127
    assert torch.isfinite(deq[ok]).all() and ok.sum() == vals.numel() - 8
    rel = (deq[ok, 0] - vals.float()[ok]).abs() / vals.float()[ok]
    assert rel.max().item() <= 2.0 ** -4
    assert expected.min().item() == 0 and expected.max().item() == 247


def _block(values, fill=0.0):
    x = torch.full((1, 32), fill, dtype=torch.float32)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("values, scale_byte, data_bytes", [
    ([0.0] * 32, 0, [0x00] * 32),                                    # all zero
    ([1.0, float("nan"), 2.0], 0xFF, [0x7F] * 32),                   # a NaN: NaN block
    ([1.0, float("inf")], 0xFF, [0x7F] * 32),                         # +Inf
    ([float("-inf"), 3.0], 0xFF, [0x7F] * 32),                        # -Inf
    ([float("nan"), 1e30], 0xFF, [0x7F] * 32),                        # NaN behind a larger finite value
    ([2.0 ** -127, 2.0 ** -133, -(2.0 ** -130)], 0, [0x38, 0x08, 0xA0] + [0] * 29),  # bf16 subnormals
    ([448.0, 1.0, -448.0], 127, [0x7E, 0x38, 0xFE] + [0] * 29),       # amax = 448 * 2^0
    ([56.0, 7.0], 124, [0x7E, 0x66] + [0] * 30),                      # amax = 448 * 2^-3
    ([448.0 * 2 ** 10], 137, [0x7E] + [0] * 31),                      # amax = 448 * 2^10
    ([448.0 * 2 ** -130], 0, [0x66] + [0] * 31),                      # 448 * 2^-130 -> byte clamps to 0
    ([1.75], 119, [0x7E] + [0] * 31),                                 # mantissa exactly 1.75
    ([1.7578125], 120, [0x76] + [0] * 31),                            # just above 1.75: 225 -> 224
    ([1.7421875], 119, [0x7E] + [0] * 31),                            # just below 1.75: 446 -> 448
    ([-1.7578125, 0.0078125], 120, [0xF6, 0x38] + [0] * 30),          # sign, and an exact small value
])
def test_planted_blocks_give_documented_bytes(values, scale_byte, data_bytes):
    x = _block(values)
    data, scales = quantize_mxfp8(x)
    assert scales.tolist() == [[scale_byte]]
    assert data.tolist() == [data_bytes]


def test_negative_zero_keeps_sign_and_scale_decoding():
    data, scales = quantize_mxfp8(_block([-0.0, 0.0]))
    assert scales.tolist() == [[0]] and data[0, :2].tolist() == [0x80, 0x00]
    f = scale_bytes_to_float(torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8))
    assert f[:4].tolist() == [2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 127] and math.isnan(f[4].item())


def test_writes_only_its_columns_and_matches_allocating_form():
    torch.manual_seed(0)
    x = torch.randn(9, 96, dtype=torch.bfloat16) * 3
    d0, s0 = quantize_mxfp8(x)
    data = torch.full((9, 256), 0xAB, dtype=torch.uint8).view(torch.float8_e4m3fn)  # fp8 view accepted
    scales = torch.full((9, 8), 0xCD, dtype=torch.uint8)
    quantize_mxfp8_into(x, data, scales, col0=64)
    d = data.view(torch.uint8)
    assert torch.equal(d[:, 64:160], d0) and torch.equal(scales[:, 2:5], s0)
    assert (d[:, :64] == 0xAB).all() and (d[:, 160:] == 0xAB).all()
    assert (scales[:, :2] == 0xCD).all() and (scales[:, 5:] == 0xCD).all()
    # Dequantized values are within half an E4M3 ulp of the input.
    deq = dequantize_mxfp8(d0, s0)
    step = scale_bytes_to_float(s0).repeat_interleave(32, dim=1)
    assert ((deq - x.float()).abs() <= x.float().abs() * 2.0 ** -4 + 2.0 ** -10 * step).all()


def test_chunked_reference_is_byte_identical(monkeypatch):
    import longflash.ops.mxfp8 as mx
    torch.manual_seed(1)
    x = torch.randn(37, 320) * torch.logspace(-30, 30, 37)[:, None]
    d0, s0 = quantize_mxfp8(x)
    monkeypatch.setattr(mx, "_REF_CHUNK_ELEMS", 700)  # 2 rows per chunk
    d1, s1 = quantize_mxfp8(x)
    assert torch.equal(d0, d1) and torch.equal(s0, s1)


@pytest.mark.parametrize("bad", ["width", "col0", "overflow", "scales", "dtype"])
def test_bad_arguments_raise(bad):
    x = torch.randn(4, 64)
    data = torch.zeros(4, 128, dtype=torch.uint8)
    scales = torch.zeros(4, 4, dtype=torch.uint8)
    with pytest.raises((ValueError, TypeError)):
        if bad == "width":
            quantize_mxfp8_into(torch.randn(4, 48), data, scales, 0)
        elif bad == "col0":
            quantize_mxfp8_into(x, data, scales, 16)
        elif bad == "overflow":
            quantize_mxfp8_into(x, data, scales, 96)
        elif bad == "scales":
            quantize_mxfp8_into(x, data, torch.zeros(4, 3, dtype=torch.uint8), 0)
        else:
            quantize_mxfp8_into(x, data.to(torch.int16), scales, 0)


_INTERPRET_SCRIPT = textwrap.dedent("""
    import torch
    from longflash.ops.mxfp8 import quantize_mxfp8_into
    from longflash.ops.mxfp8_triton import quantize_mxfp8_into_triton

    def check(x, k_total, col0, **kw):
        m = x.shape[0]
        ref_d = torch.full((m, k_total), 0x5A, dtype=torch.uint8)
        ref_s = torch.full((m, k_total // 32), 0x5A, dtype=torch.uint8)
        tri_d, tri_s = ref_d.clone(), ref_s.clone()
        quantize_mxfp8_into(x, ref_d, ref_s, col0)
        quantize_mxfp8_into_triton(x, tri_d, tri_s, col0, **kw)
        assert torch.equal(ref_d, tri_d), (x.shape, col0, kw, (ref_d != tri_d).nonzero()[:5])
        assert torch.equal(ref_s, tri_s), (x.shape, col0, kw)

    torch.manual_seed(0)
    # every positive finite bf16 as a block amax (scale bytes + the rounding of every magnitude)
    bits = torch.arange(1, 0x7F80, dtype=torch.int32)
    vals = (bits << 16).view(torch.float32).to(torch.bfloat16)
    x = torch.zeros(vals.numel(), 32, dtype=torch.bfloat16)
    x[:, 0] = vals
    x[:, 1:] = (torch.randn(vals.numel(), 31) * vals.float()[:, None]).to(torch.bfloat16)
    check(x, 32, 0, block_m=256, groups=1)
    # random rows over a wide dynamic range, several dtypes, shapes (one token, M not a multiple of
    # the tile, groups not a multiple of GROUPS), column offsets and tiles
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m, k, k_total, col0, kw in [(1, 32, 64, 32, {}), (7, 96, 160, 64, {"block_m": 4, "groups": 2}),
                                        (33, 320, 320, 0, {}), (5, 7168, 2 * 7168, 7168, {"groups": 64})]:
            lo, hi = (-6, 4) if dtype == torch.float16 else (-40, 36)
            x = (torch.randn(m, k) * torch.logspace(lo, hi, m)[:, None]).to(dtype)
            check(x, k_total, col0, **kw)
    # planted blocks: zero, NaN, +-Inf, subnormals, exact 448*2^k, 1.75 neighbours, -0.0
    x = torch.zeros(3, 11 * 32)
    x[1, 32 + 3] = float("nan"); x[1, 64] = float("inf"); x[2, 96 + 7] = float("-inf")
    x[0, 128:131] = torch.tensor([2.0 ** -127, 2.0 ** -133, -(2.0 ** -130)])
    x[1, 160] = 448.0 * 2 ** 10; x[2, 192] = 1.7578125; x[0, 224] = 1.7421875; x[1, 256] = 1.75
    x[2, 288] = -0.0; x[0, 320] = float("nan"); x[0, 321] = 1e30
    check(x.to(torch.bfloat16), 11 * 32, 0)
    check(x, 11 * 32, 0)
    # a strided (non-contiguous rows) input: a column slice of a wider tensor
    w = torch.randn(6, 256, dtype=torch.bfloat16)
    check(w[:, 64:192], 128, 0)
    print("TRITON_INTERPRET_OK")
""")


def test_triton_kernel_matches_reference_under_interpreter(tmp_path):
    pytest.importorskip("triton")
    script = tmp_path / "mxfp8_interpret.py"
    script.write_text(_INTERPRET_SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "TRITON_INTERPRET_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_dequantize_in_place_equals_fp32_product_then_cast():
    torch.manual_seed(3)
    x = torch.randn(64, 256) * torch.logspace(-40, 37, 64)[:, None]
    data, scales = quantize_mxfp8(x)
    f32 = dequantize_mxfp8(data, scales)
    # fp32 is exact: e4m3 value times 2^(b - 127), checked against an independent decode
    e4m3 = data.view(torch.float8_e4m3fn).double()
    expect = e4m3 * torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=1)
    assert torch.equal(f32.double(), expect)
    for dt in (torch.bfloat16, torch.float16):
        scratch = torch.full((64, 256), 7.0, dtype=dt)
        got = dequantize_mxfp8(data, scales, out=scratch)
        assert got.data_ptr() == scratch.data_ptr()
        assert torch.equal(got.view(torch.int16), f32.to(dt).view(torch.int16))


_DEQUANT_INTERPRET_SCRIPT = textwrap.dedent("""
    import torch
    from longflash.ops.mxfp8 import dequantize_mxfp8, quantize_mxfp8
    from longflash.ops.mxfp8_triton import dequantize_mxfp8_triton

    def check(data, scales, **kw):
        m, k = data.shape
        ref = dequantize_mxfp8(data, scales, out=torch.full((m, k), 3.0, dtype=torch.bfloat16))
        wide = torch.full((m, k + 64), 5.0, dtype=torch.bfloat16)      # a view with row stride > K
        got = dequantize_mxfp8_triton(data, scales, wide[:, 32:32 + k], **kw)
        assert got.data_ptr() == wide[:, 32:].data_ptr()
        assert torch.equal(ref.view(torch.int16), got.view(torch.int16)), (data.shape, kw,
            (ref.view(torch.int16) != got.view(torch.int16)).nonzero()[:5])
        assert (wide[:, :32] == 5.0).all() and (wide[:, 32 + k:] == 5.0).all()

    # every E4M3 byte (both NaNs, -0, subnormals) under every E8M0 scale byte (0 = 2^-127 subnormal,
    # 254 overflows fp32 for large elements, 255 = NaN): bf16 rounding of subnormal products included
    sb = torch.arange(256, dtype=torch.uint8)
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1)                 # [256 scales, 256 bytes]
    scales = sb[:, None].repeat(1, 8)
    check(data, scales)
    check(data, scales, block_m=32, groups=4, num_warps=4)
    check(data[:37, :96].contiguous(), scales[:37, :3].contiguous(), block_m=16, groups=2)  # masked tiles
    # quantized random data over a wide range, one token, M not a multiple of the tile, K = 7168 + 32
    torch.manual_seed(0)
    for m, k in [(1, 32), (7, 96), (19, 7168 + 32)]:
        x = torch.randn(m, k) * torch.logspace(-40, 36, m)[:, None]
        check(*quantize_mxfp8(x.to(torch.bfloat16)))
    print("TRITON_DEQUANT_INTERPRET_OK")
""")


def test_triton_dequantize_matches_reference_under_interpreter(tmp_path):
    pytest.importorskip("triton")
    script = tmp_path / "mxfp8_dequant_interpret.py"
    script.write_text(_DEQUANT_INTERPRET_SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "TRITON_DEQUANT_INTERPRET_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_config_table():
    from longflash.ops.mxfp8_triton import dequantize_config, quantize_config
    assert quantize_config(4096, 7168) == (8, 32, 8)          # 1024-wide tiles, 7 per row, no column mask
    assert dequantize_config(2048, 43008) == (16, 32, 8)
    for m, k in [(1, 32), (3, 96), (4096, 7168), (17, 7168 + 32), (64, 43008), (5, 2048)]:
        for bm, g, w in (quantize_config(m, k), dequantize_config(m, k)):
            assert (k // 32) % g == 0 and bm & (bm - 1) == 0 and g & (g - 1) == 0 and bm <= max(1, 2 * m)
            assert w in (1, 2, 4, 8)


_SM90_CONFIGS = [  # (kernel, BLOCK_M, groups, warps, even, bits_rounding, input dtype)
    ("quantize", 8, 32, 8, True, False, "bf16"), ("quantize", 16, 32, 8, True, False, "bf16"),
    ("quantize", 4, 32, 4, True, False, "bf16"), ("quantize", 16, 16, 8, False, False, "bf16"),
    ("quantize", 8, 32, 8, True, True, "bf16"), ("quantize", 8, 8, 4, False, False, "fp32"),
    ("quantize", 1, 1, 1, False, False, "fp16"),
    ("dequantize", 16, 32, 8, True, False, "u8"), ("dequantize", 8, 32, 4, True, False, "u8"),
    ("dequantize", 16, 32, 8, False, False, "u8"), ("dequantize", 8, 8, 4, True, True, "u8"),
]


def _compile_sm90() -> dict:
    """Compile both MXFP8 kernels for sm_90 with Triton's bundled ptxas (no GPU needed): catches what
    the interpreter cannot (reshape/reduce layouts, the fp8 cast's lowering, vectorization).
    Returns {config: {"ok": bool, "error"?, "ld_v4"/"st_v4"/"convert_layout" counts}}."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import longflash.ops.mxfp8_triton as mt
    out = {}
    for kind, bm, g, warps, even, bits, dt in _SM90_CONFIGS:
        if kind == "quantize":
            kern = mt._kernel()
            ptrs = {"x_ptr": "*" + dt, "data_ptr": "*u8", "scales_ptr": "*u8"}
            ints = ["M", "K", "stride_xm", "stride_dm", "stride_sm", "col0", "group0"]
            consts = dict(BLOCK_M=bm, BLOCK_K=32 * g, EVEN_M=even, EVEN_K=even, BITS_ROUNDING=bits,
                          IS_BF16=dt == "bf16")
        else:
            kern = mt._dequant_kernel()
            ptrs = {"data_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*bf16"}
            ints = ["M", "K", "stride_dm", "stride_sm", "stride_om"]
            consts = dict(BLOCK_M=bm, BLOCK_K=32 * g, EVEN_M=even, EVEN_K=even, BITS_ROUNDING=bits)
        sig = dict(ptrs, **{n: "i32" for n in ints}, **{c: "constexpr" for c in consts})
        idx = kern.arg_names.index
        # divisibility as Triton specializes it at launch: pointers, strides, K and col0 are multiples
        # of 16 at the production shapes (M need not be)
        src = ASTSource(fn=kern, signature=sig, constexprs={(idx(n),): v for n, v in consts.items()},
                        attrs={(idx(n),): [["tt.divisibility", 16]] for n in list(ptrs) + ints[1:]})
        key = f"{kind},BM={bm},G={g},warps={warps},even={even},bits={bits},{dt}"
        try:
            c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
            ptx, ttgir = c.asm.get("ptx", ""), c.asm.get("ttgir", "")
            out[key] = {"ok": bool(c.asm.get("cubin")),
                        "ld_v4": len(re.findall(r"ld\.global[.a-z]*\.v4", ptx)),
                        "ld_v2": len(re.findall(r"ld\.global[.a-z]*\.v2", ptx)),
                        "st_v4": len(re.findall(r"st\.global[.a-z]*\.v4", ptx)),
                        "convert_layout": ttgir.count("convert_layout"),
                        "cvt_e4m3": len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2", ptx)),
                        "ftz": ptx.count(".ftz")}
        except Exception as e:  # reported by the test
            out[key] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return out


def _compile_inductor_regenerated_sm90() -> dict:
    """What ``torch.compile`` does with the kernels, minus the GPU: Inductor re-generates the source of a
    user-defined Triton kernel with the ``@triton.jit`` helpers it finds among the kernel's globals
    (``user_defined_triton_kernel_transitive_closure_source_code``); that source is written to a file,
    imported and compiled for sm_90 (GPU paths: NaN-propagating max helper, hardware casts). The first
    H200 run failed exactly here (``NameError: '_max_propagate_nan' is not defined``, helpers defined in
    a closure). Returns {kernel: {"ok": bool, "error"?}}."""
    import importlib.util
    import tempfile

    import triton
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import longflash.ops.mxfp8_triton as mt
    out = {}
    cases = [("quantize", mt._kernel(), {"x_ptr": "*bf16", "data_ptr": "*u8", "scales_ptr": "*u8"},
              ["M", "K", "stride_xm", "stride_dm", "stride_sm", "col0", "group0"],
              dict(BLOCK_M=8, BLOCK_K=1024, EVEN_M=True, EVEN_K=True, BITS_ROUNDING=False, IS_BF16=True)),
             ("dequantize", mt._dequant_kernel(), {"data_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*bf16"},
              ["M", "K", "stride_dm", "stride_sm", "stride_om"],
              dict(BLOCK_M=16, BLOCK_K=1024, EVEN_M=True, EVEN_K=True, BITS_ROUNDING=False))]
    tmp = tempfile.mkdtemp()
    for name, kern, ptrs, ints, consts in cases:
        try:
            src = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                   + user_defined_triton_kernel_transitive_closure_source_code(kern))
            path = os.path.join(tmp, f"regenerated_{name}.py")
            with open(path, "w") as f:
                f.write(src)
            spec = importlib.util.spec_from_file_location(f"regenerated_{name}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            k = getattr(mod, kern.__name__)
            idx = k.arg_names.index
            sig = dict(ptrs, **{n: "i32" for n in ints}, **{c: "constexpr" for c in consts})
            c = triton.compile(ASTSource(fn=k, signature=sig, constexprs={(idx(n),): v for n, v in consts.items()},
                                         attrs={}), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
            out[name] = {"ok": bool(c.asm.get("cubin"))}
        except Exception as e:  # reported by the test
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-1500:]}"}
    return out


@pytest.fixture(scope="module")
def sm90_results():
    """One subprocess (no TRITON_INTERPRET) compiling for sm_90: ``_compile_sm90`` and
    ``_compile_inductor_regenerated_sm90``."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")):
        pytest.skip("Triton's bundled ptxas is not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, __file__, "--compile-sm90"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_kernels_compile_for_sm90_without_a_gpu(sm90_results):
    res = sm90_results["kernels"]
    assert len(res) == len(_SM90_CONFIGS) and all(v["ok"] for v in res.values()), res
    for key, v in res.items():
        assert v["ftz"] == 0, key                     # subnormals are kept (no flush-to-zero)
        if "even=True" in key and "bf16" in key:      # production tiles: wide accesses, no shuffle of data
            assert v["ld_v4"] > 0 and v["st_v4"] > 0 and v["convert_layout"] <= 1, (key, v)
            assert v["cvt_e4m3"] > 0 if "bits=False" in key else v["cvt_e4m3"] == 0, (key, v)
        if key.startswith("dequantize") and "even=True" in key:
            # 8-byte loads of E4M3 bytes in the layout of the 16-byte bf16 stores; only the tiny
            # scale tile changes layout
            assert v["ld_v2"] > 0 and v["st_v4"] > 0 and v["convert_layout"] <= 1, (key, v)


def test_inductor_regenerated_source_compiles_for_sm90(sm90_results):
    """torch.compile(fullgraph=True) of the staged accumulator: Inductor's re-generated kernel source
    (kernel + the helpers it finds) compiles for sm_90 (the GPU benchmark's ``compiled`` section runs the
    whole compiled step and checks its bytes)."""
    res = sm90_results["inductor"]
    assert set(res) == {"quantize", "dequantize"} and all(v["ok"] for v in res.values()), res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 300, 4096])
def test_gpu_kernels_equal_reference_at_kimi_k3_shapes(m):
    """Native fp8 cast and bf16 rounding on the GPU: same bytes as the reference / torch path, from the
    full launch path and from the cached launch plan of the second identical call (``triton_launch``);
    at m = 300 the data buffer is only 8-byte aligned (another Triton specialization, another plan)."""
    from longflash.ops import triton_launch
    from longflash.ops.mxfp8_triton import dequantize_mxfp8_triton, quantize_mxfp8_into_triton
    g = torch.Generator(device="cuda").manual_seed(m)
    x = (torch.randn(m, 7168, generator=g, device="cuda") * 10.0 ** torch.randint(-30, 30, (m, 1), device="cuda")).to(torch.bfloat16)
    x[0, 5] = float("nan")
    d_ref = torch.zeros(m, 2 * 7168, dtype=torch.uint8, device="cuda")
    s_ref = torch.zeros(m, 2 * 224, dtype=torch.uint8, device="cuda")
    quantize_mxfp8_into(x, d_ref, s_ref, 7168)
    ref = dequantize_mxfp8(d_ref, s_ref, out=torch.empty(m, 2 * 7168, dtype=torch.bfloat16, device="cuda"))
    off = 8 if m == 300 else 0
    triton_launch.clear()
    for attempt in range(2):  # 0: checks + Triton's launcher (stores a plan); 1: the plan
        d_tri = torch.zeros(m * 2 * 7168 + off, dtype=torch.uint8, device="cuda")[off:].view(m, 2 * 7168)
        s_tri = torch.zeros_like(s_ref)
        quantize_mxfp8_into_triton(x, d_tri, s_tri, 7168)
        assert torch.equal(d_ref, d_tri) and torch.equal(s_ref, s_tri), attempt
        got = dequantize_mxfp8_triton(d_ref, s_ref, torch.empty(m, 2 * 7168, dtype=torch.bfloat16, device="cuda"))
        assert torch.equal(ref.view(torch.int16), got.view(torch.int16)), attempt
    assert len(triton_launch._PLANS) == 2  # one quantize and one dequantize plan were stored and reused


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_native_path_on_planted_blocks_and_every_bf16_amax():
    """The GPU path's shortcuts: NaN-propagating max, NaN blocks by multiplying with NaN (0x7F from the
    satfinite cast, also for -NaN and -inf), no clamp; and every positive finite bf16 as a block amax."""
    from longflash.ops.mxfp8_triton import quantize_mxfp8_into_triton
    x = torch.zeros(4, 12 * 32)
    x[1, 32 + 3] = float("nan"); x[1, 64] = float("inf"); x[2, 96 + 7] = float("-inf"); x[3, 9] = -float("nan")
    x[0, 128:131] = torch.tensor([2.0 ** -127, 2.0 ** -133, -(2.0 ** -130)])
    x[1, 160] = 448.0 * 2 ** 10; x[2, 192] = 1.7578125; x[0, 224] = 1.7421875; x[1, 256] = 1.75
    x[2, 288] = -0.0; x[0, 320] = float("nan"); x[0, 321] = 1e30; x[3, 352:384] = -3.0e38
    bits = torch.arange(1, 0x7F80, dtype=torch.int32)
    vals = (bits << 16).view(torch.float32)
    amax = (torch.rand(vals.numel(), 32) * 2 - 1) * vals[:, None]
    amax[:, 0] = vals
    for t in (x.to(torch.bfloat16), x, amax.to(torch.bfloat16)):
        t = t.cuda()
        m, k = t.shape
        d_ref = torch.zeros(m, k, dtype=torch.uint8, device="cuda")
        s_ref = torch.zeros(m, k // 32, dtype=torch.uint8, device="cuda")
        d_tri, s_tri = d_ref.clone(), s_ref.clone()
        quantize_mxfp8_into(t, d_ref, s_ref, 0)
        quantize_mxfp8_into_triton(t, d_tri, s_tri, 0, rounding="native")
        assert torch.equal(d_ref, d_tri) and torch.equal(s_ref, s_tri), (t.dtype, (d_ref != d_tri).nonzero()[:5])


if __name__ == "__main__" and sys.argv[1:] == ["--compile-sm90"]:
    print(json.dumps({"kernels": _compile_sm90(), "inductor": _compile_inductor_regenerated_sm90()}))
