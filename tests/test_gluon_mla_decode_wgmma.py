"""The sm_90 ``wgmma`` variant of the Gluon fp8 MLA decode stage 1 (``attention/gluon_mla_decode_wgmma.py``,
config key ``WGMMA``) equals the PyTorch reference ``ops.mla_decode_attention``.

CPU (no GPU needed): the two relabellings (contraction positions -> rows / dims, value rows -> latent dims)
are permutations; the kernel compiles for sm_90 in each variant the wrapper launches (split / unsplit, DCP
visible lengths, bf16 / fp16 queries, block sizes, stages) with wgmma, cp.async, the 4 x 4 byte-block
transpose, no byte loads and no local memory; the config resolver takes ``WGMMA`` only with the tile it
has (64 rows, 4 warps) and runs the mma.sync kernel where wgmma is not available.
GPU (skipped without CUDA, and without compute capability 9.0): the reference cases of
``test_gluon_mla_decode.py`` (fp8 cache, k_scale ≠ 1, lengths not a multiple of the tile, empty requests,
forced split counts, block sizes 16 and 64, 1-16 heads, q_len up to 16 rows, a q row of magnitude 1e4,
fp16 / bf16 q) and agreement with the mma.sync kernel (the same arithmetic in another order).
"""

import pytest
import torch

from test_gluon_mla_decode import REFERENCE_CASES, _check, _gpu_case

cuda90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                            reason="needs a CUDA device of compute capability 9.0")


def test_relabellings_are_permutations():
    from longflash.attention.gluon_mla_decode_wgmma import k_position_to_dim, latent_dim_of_value_row
    p = torch.arange(576)
    assert sorted(k_position_to_dim(p).tolist()) == list(range(576))
    # a thread's positions 2c, 2c+1, 2c+8, 2c+9 of a 16-wide step are the 4 consecutive dims 4c..4c+3
    for c in range(4):
        assert [k_position_to_dim(x) for x in (2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9)] == [4 * c + i for i in range(4)]
    m = torch.arange(512)
    assert sorted(latent_dim_of_value_row(m).tolist()) == list(range(512))
    for bad in (512, -1, torch.tensor([3, 600])):
        with pytest.raises(ValueError, match="value rows"):
            latent_dim_of_value_row(bad)
    # the thread holding value rows m, m + 8, m + 64, m + 72 of a quarter holds 4 consecutive dims
    for base in (0, 5, 17, 128 + 39):
        dims = [latent_dim_of_value_row(base + o) for o in (0, 8, 64, 72)]
        assert dims == [dims[0] + i for i in range(4)] and dims[0] % 4 == 0, (base, dims)


COMPILE_VARIANTS = {"default": dict(), "unsplit fp16 DCP": dict(split=False, q_dtype="fp16", has_vis=True),
                    "s3 block 64": dict(stages=3, block_size=64), "block 1": dict(block_size=1)}


def _compile_sm90() -> dict:
    """{variant: facts of its sm_90 compile} (run in a subprocess by ``sm90_compile.compile_report``)."""
    import re
    from longflash.attention import gluon_mla_decode_wgmma as g
    out = {}
    for name, kw in COMPILE_VARIANTS.items():
        try:
            k = g.compile_stage1(**kw)
            ptx = k.asm["ptx"]
            out[name] = {"ok": True, "wgmma": "wgmma.mma_async" in ptx, "cp_async": "cp.async" in ptx,
                         "prmt_asm": "prmt.b32 t0" in ptx, "byte_loads": bool(re.search(r"ld\.shared\.(u8|b8|s8)", ptx)),
                         "local": ".local" in ptx, "smem": k.metadata.shared}
        except Exception as e:  # reported by the test
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:3000]}"}
    return out


def test_compiles_for_sm90():
    """Each variant compiles for sm_90 with wgmma, cp.async, the in-thread byte transpose, no byte loads, no
    local memory, and at 2 stages shared memory for two programs per SM (<= 113 KB each: 228 KB per SM, 1 KB
    reserved per program)."""
    from sm90_compile import compile_report
    res = compile_report(__file__)
    assert set(res) == set(COMPILE_VARIANTS)
    bad = {k: v for k, v in res.items() if not (v.get("ok") and v["wgmma"] and v["cp_async"] and v["prmt_asm"]
                                               and not v["byte_loads"] and not v["local"])}
    assert not bad, bad
    assert res["default"]["smem"] <= 113 * 1024


def test_compile_stage1_refuses_what_the_kernel_cannot_take():
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from longflash.attention.gluon_mla_decode_wgmma import compile_stage1
    for kw, msg in ((dict(q_dtype="fp32"), "q_dtype"), (dict(stages=1), "stages"), (dict(block_size=0), "block_size"),
                    (dict(stages=2.5), "stages"), (dict(split="no"), "split"), (dict(target=GPUTarget("cuda", 89, 32)), "9.0")):
        with pytest.raises(ValueError, match=msg):
            compile_stage1(**kw)


def test_resolve_config(monkeypatch):
    """WGMMA is kept on a compute capability 9.0 device, dropped (the mma.sync Gluon kernel) elsewhere, and a
    WGMMA tile other than 64 rows x 4 warps is refused by name."""
    from longflash.attention import triton_mla_decode as tk
    from longflash.attention.ops import FP8_DTYPE
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 576, dtype=FP8_DTYPE)
    monkeypatch.setattr(tk, "gluon_eligible", lambda *a: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for sm90 in (True, False):
        monkeypatch.setattr(tk, "_wgmma_runs_on", lambda idx, v=sm90: v)
        cfg, use = tk.resolve_config(q, cache, 512, 1, {"WGMMA": True})
        assert use and cfg == dict(tk.GLUON_FP8_CONFIG, WGMMA=sm90)
    for bad, key in (({"WGMMA": True, "BLOCK_N": 32}, "BLOCK_N 32"), ({"WGMMA": True, "num_warps": 8}, "num_warps 8"),
                     ({"WGMMA": True, "maxnreg": 168}, "maxnreg 168")):
        with pytest.raises(ValueError, match=rf"wgmma decode tile \(WGMMA=True was asked\): {key}"):
            tk.resolve_config(q, cache, 512, 1, bad)
    with pytest.raises(ValueError, match="WGMMA must be True or False"):
        tk.resolve_config(q, cache, 512, 1, {"WGMMA": "yes"})
    monkeypatch.setattr(tk, "_wgmma_runs_on", lambda idx: True)
    assert tk.resolve_config(q, cache, 512, 1, {"WGMMA": True, "num_stages": 3})[0]["occupancy"] == 1  # 131 KB
    monkeypatch.setattr(tk, "gluon_eligible", lambda *a: False)  # where Gluon cannot run the key is dropped
    cfg, use = tk.resolve_config(q, cache, 512, 1, {"WGMMA": True})
    assert not use and "WGMMA" not in cfg
    cands = tk.candidate_configs(16, FP8_DTYPE)
    assert cands[0].get("WGMMA") and sum(bool(c.get("WGMMA")) for c in cands) == 1  # the default, once
    assert any(c.get("GLUON") and c.get("WGMMA") is False for c in cands)  # the mma.sync kernel, measured against it


@cuda90
@pytest.mark.parametrize("H,seq,ql,bs,qdt", REFERENCE_CASES)
def test_gpu_matches_reference(H, seq, ql, bs, qdt):
    from longflash.attention import ops
    from longflash.attention import triton_mla_decode as tk
    q, cache, bt, qsl = _gpu_case(H, seq, ql, 0.05, bs, qdt=qdt)
    q[0, 0] *= 1e4  # fp16 overflow without the per-row power-of-two scale
    cfg = dict(tk.GLUON_FP8_CONFIG, WGMMA=True)
    assert tk.resolve_config(q, cache, 512, max(ql), cfg)[0]["WGMMA"]
    ro, rl = ops.mla_decode_attention(q.float(), cache, bt, qsl, seq, 576 ** -0.5, 512, 0.05)
    for S in (None, 1, 7):
        out, lse = tk.mla_decode_attention(q, cache, bt, qsl, seq, 576 ** -0.5, 512, 0.05, num_splits=S, config=cfg)
        _check(out, lse, ro, rl)
    o2, _ = tk.mla_decode_attention(q, cache, bt, qsl, seq, 576 ** -0.5, 512, 0.05,
                                    config=dict(cfg, WGMMA=False))  # the mma.sync kernel
    assert ((out.float() - o2.float()).norm() / o2.float().norm()).item() <= 2e-3


if __name__ == "__main__":
    import json
    import sys
    if "--compile-sm90" in sys.argv:
        print(json.dumps(_compile_sm90()))
