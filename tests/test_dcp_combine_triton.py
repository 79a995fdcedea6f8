"""The one-launch DCP combine weighting (``distributed/dcp_combine_triton.py``) equals its PyTorch
reference ``dcp.dcp_combine_weights``: under ``TRITON_INTERPRET=1`` on the CPU (a subprocess) with
empty shards (-inf), +inf LSEs, rows where every shard is empty, garbage (NaN) in an empty shard's
output, R in {1, 2, 3, 4} and D not a power of two; on the GPU at DeepSeek-V3's decode shapes. No NaN
is ever produced; summing the ranks' contributions gives ``dcp_combine``'s result."""

import json
import sys

import pytest
import torch

from interpreter_run import run_interpreted
from sm90_compile import compile_report

SCRIPT = r'''
import json, torch
from longflash.distributed.dcp import dcp_combine_weights
from longflash.distributed.dcp_combine_triton import dcp_combine_weights_triton
res = {}
g = torch.Generator().manual_seed(0)
for R, T, H, D in ((1, 3, 2, 40), (2, 5, 4, 96), (3, 2, 3, 512), (4, 1, 16, 33)):
    lses = torch.randn(R, T, H, generator=g) * 3
    lses[0, 0, 0] = float("-inf")                 # an empty shard
    lses[:, -1, -1] = float("-inf")               # every shard empty
    if R > 1:
        lses[1, 0, 1 % H] = float("inf")          # +inf is read as -inf
    for rank in range(R):
        o = torch.randn(T, H, D, generator=g)
        o[lses[rank] == float("-inf")] = float("nan")   # garbage where this rank's shard is empty
        c_ref, l_ref = dcp_combine_weights(lses, o, rank)
        c, l = dcp_combine_weights_triton(lses, o, rank)
        key = f"R{R}-T{T}-H{H}-D{D}-r{rank}"
        res[key] = {"nan": bool(c.isnan().any() or l.isnan().any()),
                    "lse_inf_equal": bool(torch.equal(l.isinf(), l_ref.isinf())),
                    "lse_err": float((l - l_ref).nan_to_num(0, 0, 0).abs().max()),
                    "contrib_err": float((c - c_ref).abs().max() / c_ref.abs().max().clamp_min(1e-30))}
print("RESULT" + json.dumps(res))
'''


@pytest.fixture(scope="module")
def interp():
    return run_interpreted(SCRIPT)


def test_interpreter_equals_reference(interp):
    assert len(interp) == 10
    for key, r in interp.items():
        assert not r["nan"] and r["lse_inf_equal"], key
        assert r["lse_err"] <= 1e-6 and r["contrib_err"] <= 1e-6, (key, r)


def test_reference_sums_to_the_combined_output():
    """Σ_r contrib_r = Σ_r e^{lse_r - LSE} o_r, the spec's combine, with an empty shard weighing 0."""
    from longflash.distributed.dcp import dcp_combine_weights
    g = torch.Generator().manual_seed(1)
    R, T, H, D = 3, 4, 2, 8
    lses, outs = torch.randn(R, T, H, generator=g), torch.randn(R, T, H, D, generator=g)
    lses[2, 1] = float("-inf")
    outs[2, 1] = float("nan")
    total = sum(dcp_combine_weights(lses, outs[r], r)[0] for r in range(R))
    p = torch.softmax(lses, dim=0).nan_to_num(0.0)
    want = (p[..., None] * outs.nan_to_num(0.0)).sum(0)
    assert torch.allclose(total, want, atol=1e-6)
    assert torch.allclose(dcp_combine_weights(lses, outs[0], 0)[1], torch.logsumexp(lses, dim=0), atol=1e-6)


def test_bad_arguments_raise():
    pytest.importorskip("triton")
    from longflash.distributed.dcp_combine_triton import dcp_combine_weights_triton
    with pytest.raises(ValueError, match="lses must be"):
        dcp_combine_weights_triton(torch.zeros(2, 3, 4), torch.zeros(3, 5, 8), 0)
    with pytest.raises(ValueError, match="rank 2 outside"):
        dcp_combine_weights_triton(torch.zeros(2, 3, 4), torch.zeros(3, 4, 8), 2)


def _compile_sm90() -> dict:
    """Compile the kernel for sm_90 with Triton's bundled ptxas (no GPU) at DCP 2 and 4, kv_lora_rank 512,
    bf16 and fp32 outputs: {config: {"ok", "error"?}}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from longflash.distributed.dcp_combine_triton import _dcp_combine_kernel as kern
    out = {}
    for R in (2, 4):
        for dt in ("bf16", "fp32"):
            consts = dict(R=R, D=512, BLOCK_R=R, BLOCK_D=512)
            sig = {"lse_ptr": "*fp32", "o_ptr": "*" + dt, "contrib_ptr": "*fp32", "out_lse_ptr": "*fp32",
                   "TH": "i32", "stride_or": "i32", "stride_cr": "i32", "rank": "i32",
                   **{c: "constexpr" for c in consts}}
            idx = kern.arg_names.index
            try:
                c = triton.compile(ASTSource(fn=kern, signature=sig, attrs={},
                                             constexprs={(idx(n),): v for n, v in consts.items()}),
                                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
                out[f"R{R}-{dt}"] = {"ok": bool(c.asm.get("cubin"))}
            except Exception as e:  # reported by the test
                out[f"R{R}-{dt}"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return out


def test_kernel_compiles_for_sm90_without_a_gpu():
    res = compile_report(__file__)
    assert len(res) == 4 and all(v["ok"] for v in res.values()), res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("R,T,H", [(2, 1, 16), (2, 64, 16), (4, 16 * 8, 32)])
def test_gpu_real_shapes(R, T, H):
    from longflash.distributed.dcp import dcp_combine_weights
    from longflash.distributed.dcp_combine_triton import dcp_combine_weights_triton
    g = torch.Generator(device="cuda").manual_seed(0)
    lses = torch.randn(R, T, H, device="cuda", generator=g) * 4
    lses[0, 0] = float("-inf")
    o = torch.randn(T, H, 512, device="cuda", generator=g).to(torch.bfloat16)
    c_ref, l_ref = dcp_combine_weights(lses, o, 1)
    c, l = dcp_combine_weights_triton(lses, o, 1)
    assert torch.equal(l.isinf(), l_ref.isinf())
    assert (l - l_ref).nan_to_num(0, 0, 0).abs().max().item() <= 1e-5
    assert ((c - c_ref).abs().max() / c_ref.abs().max()).item() <= 1e-5


if __name__ == "__main__" and "--compile-sm90" in sys.argv:
    print(json.dumps(_compile_sm90()))
