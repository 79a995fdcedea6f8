"""The Triton flash-attention prefill kernel (``attention/triton_prefill.py``) equals its PyTorch reference
``ops.attention_with_lse``.

CPU: one subprocess under ``TRITON_INTERPRET=1`` (the variable must be set before Triton is imported)
runs small shapes with 16 x 16 tiles: causal offsets None, 0, positive (a chunk at the end of its
sequence), negative (leading queries see no key), beyond Tk and below -Tq; Tk = 0 and Tq = 0; one KV
head broadcast to all heads; k and v as the MLA prefill builds them (k a concatenation, v a split view
of the up-projection with a token stride that is not its width); a transposed q (last dim strided);
widths that are not powers of two (D 48 = 32 + 16, 24, 40, 192 = 128 + 64; Dv 32, 16, 20, 128); fp32
and bf16; another tile config; key / value tiles through TMA tensor descriptors (the interpreter's
descriptors check TMA's alignment rules: same bits as the pointer tiles, and the pointer fallback for
rows TMA cannot read); OVERLAP (unmasked tiles in pairs: 0, 1, 6 pairs, an odd tile left over). The interpreter runs bf16 inputs through fp32 dots (its bf16 dots are wrong),
so its bf16 cases check the masking and indexing, not the GPU's rounding of p to bf16.
sm_90 (no GPU, Triton's bundled ptxas): every tile config compiles at D 192 / Dv 128 bf16 without
register spills, on wgmma with cp.async pipelining (TMA copies for the TMA configs, whose wgmmas ptxas
must not serialize); the fp32 tile and the default model's widths too.
GPU (skipped without CUDA): DeepSeek-V3 shapes on one TP-8 rank (16 heads, D 192, Dv 128, bf16), Tq
1000-4096, Tk up to 8192, every tile config, TMA configs bitwise against their pointer tiles, fp32
inputs, a CUDA graph capture (no host sync).

Accuracy: against the fp64 reference on the same inputs. fp32: ‖out − ref‖/‖ref‖ <= 1e-5 and |lse −
ref| <= 1e-5 (a few fp32 ulps of LSEs of size ~10). bf16: 1e-2 and 1e-3, the bounds of the other
attention kernels' tests (the interpreter's bf16 output store truncates, ~4e-3; on the GPU the
rounding of p and of the output, a few 1e-3). The −inf LSE pattern must match exactly and those
outputs be exactly 0.
"""

import json
import sys

import numpy as np
import pytest
import torch

from interpreter_run import run_interpreted

_SCRIPT = r"""
import json, os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from longflash.attention import ops
from longflash.attention import triton_prefill as tp

res = {}
g = torch.Generator().manual_seed(0)


def make(tq, tk, h, hk, d, dv, dtype, split_v=False):
    q = (torch.randn(tq, h, d, generator=g) * 1.5).to(dtype)
    k = (torch.randn(tk, hk, d, generator=g) * 1.5).to(dtype)
    if split_v:  # MLA prefill: kv_b_proj output [tk, H, nope + dv] split; k = cat(k_nope, k_pe broadcast)
        kv = torch.randn(tk, hk, 24 + dv, generator=g).to(dtype)
        k_nope, v = kv.split([24, dv], dim=-1)
        k = torch.cat([k_nope, k[:, :1, 24:].expand(-1, hk, -1)], dim=-1)
    else:
        v = torch.randn(tk, hk, dv, generator=g).to(dtype)
    return q, k, v


def ref64(q, k, v, scale, off):  # ops.attention_with_lse's math in fp64 (the op itself computes in fp32)
    H, tq, tk = q.shape[1], q.shape[0], k.shape[0]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().expand(-1, H, -1)) * scale
    if off is not None:
        s = s.masked_fill(torch.arange(tk)[None, :] > torch.arange(tq)[:, None] + off, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(nan=0.0)
    return torch.einsum("hqk,khd->qhd", p, v.double().expand(-1, H, -1)), lse.transpose(0, 1)


def compare(name, q, k, v, off, scale=0.3, config=None):
    out, lse = tp.attention_with_lse(q, k, v, scale, off, config=config)
    ro, rl = ref64(q, k, v, scale, off)
    tma = None
    if config is not None and config.get("TMA"):  # against the pointer path with the same tiles: same bits
        po, pl = tp.attention_with_lse(q, k, v, scale, off, config=dict(config, TMA=False))
        tma = dict(used=tp.tma_ok(config, k, v), same=bool(torch.equal(out, po) and torch.equal(lse, pl)))
    empty = rl.isinf()
    fo, fl = ops.attention_with_lse(q, k, v, scale, off)  # the fp32 reference's own error, for scale
    rel = lambda o: ((o.double() - ro).norm() / ro.norm().clamp_min(1e-30)).item() if o.numel() else 0.0
    lerr = lambda l: (l.double() - rl).masked_fill(empty, 0).abs().max().item() if l.numel() else 0.0
    res[name] = dict(
        rel=rel(out), lse=lerr(lse), ref_rel=rel(fo), ref_lse=lerr(fl),
        inf_match=bool(torch.equal(lse.isinf(), empty)) and not bool((lse == float("inf")).any()),
        empty_zero=bool((out[empty] == 0).all()), nan=bool(out.isnan().any() or lse.isnan().any()),
        n_empty=int(empty.sum()), n_rows=int(empty.numel()),
        shape_ok=out.shape == ro.shape and out.dtype == q.dtype and lse.shape == rl.shape
        and lse.dtype == torch.float32, fp32=q.dtype == torch.float32, tma=tma)


for dt in (torch.float32, torch.bfloat16):
    n = str(dt)[6:]
    compare(f"causal0_{n}", *make(37, 37, 2, 2, 48, 32, dt), 0)
    compare(f"noncausal_{n}", *make(21, 50, 2, 2, 48, 32, dt), None)
    compare(f"chunk_end_{n}", *make(20, 53, 2, 2, 48, 32, dt), 33)      # queries at the end of 53 keys
    compare(f"negative_{n}", *make(40, 30, 2, 2, 48, 32, dt), -21)      # 21 leading queries see nothing
    compare(f"mqa_{n}", *make(19, 35, 3, 1, 24, 16, dt), 16)           # one KV head for 3 query heads
    compare(f"split_v_{n}", *make(33, 33, 2, 2, 40, 20, dt, split_v=True), 0)
    compare(f"d192_{n}", *make(18, 40, 1, 1, 192, 128, dt), 22)
compare("tile_edge", *make(30, 45, 2, 2, 48, 32, torch.float32), 14)  # key 15 is just out of query 0's sight
compare("beyond_tk", *make(9, 12, 2, 2, 48, 32, torch.float32), 50)     # everything visible
compare("below_tq", *make(9, 12, 2, 2, 48, 32, torch.float32), -40)     # nothing visible
compare("tk0_causal", *make(6, 0, 2, 2, 48, 32, torch.float32), 0)
compare("tk0", *make(6, 0, 2, 2, 48, 32, torch.bfloat16), None)
compare("tq0", *make(0, 7, 2, 2, 48, 32, torch.float32), 0)
compare("one_token", *make(1, 1, 2, 2, 48, 32, torch.float32), 0)
q, k, v = make(17, 17, 2, 2, 48, 32, torch.float32)
compare("q_transposed", q.transpose(0, 2).contiguous().transpose(0, 2), k, v, 0)  # stride(-1) != 1: copied
compare("config_m32_n16", *make(45, 60, 2, 2, 48, 32, torch.float32), 14,
        config=dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1))
compare("large_scores", *make(24, 24, 2, 2, 48, 32, torch.float32), 0, scale=30.0)  # max subtraction matters
# key / value tiles through TMA tensor descriptors (the interpreter's descriptors check TMA's alignment)
TMA = dict(tp.INTERPRET_CONFIG, TMA=True)
for dt in (torch.float32, torch.bfloat16):
    n = str(dt)[6:]
    compare(f"tma_causal0_{n}", *make(37, 37, 2, 2, 48, 32, dt), 0, config=TMA)
    compare(f"tma_mqa_{n}", *make(19, 35, 3, 1, 24, 16, dt), 16, config=TMA)
    compare(f"tma_d192_{n}", *make(18, 40, 1, 1, 192, 128, dt), 22, config=TMA)
    compare(f"tma_split_v_{n}", *make(33, 33, 2, 2, 40, 20, dt, split_v=True), 0, config=TMA)  # bf16: 88-byte rows
compare("tma_noncausal", *make(21, 50, 2, 2, 48, 32, torch.float32), None, config=TMA)
compare("tma_negative", *make(40, 30, 2, 2, 48, 32, torch.float32), -21, config=TMA)
compare("tma_tk0", *make(6, 0, 2, 2, 48, 32, torch.float32), 0, config=TMA)
compare("tma_m32_n32", *make(45, 60, 2, 2, 48, 32, torch.float32), 14, config=dict(TMA, BLOCK_M=32, BLOCK_N=32))
# OVERLAP: unmasked tiles in pairs (0, 1 and 6 pairs; an odd tile left to the masked steps; no pair at all)
OV = dict(TMA, OVERLAP=True)
for dt in (torch.float32, torch.bfloat16):
    n = str(dt)[6:]
    compare(f"tma_ov_causal0_{n}", *make(37, 37, 2, 2, 48, 32, dt), 0, config=OV)
    compare(f"tma_ov_d192_{n}", *make(18, 40, 1, 1, 192, 128, dt), 22, config=OV)
    compare(f"tma_ov_split_v_{n}", *make(33, 33, 2, 2, 40, 20, dt, split_v=True), 0, config=OV)
compare("tma_ov_noncausal", *make(21, 50, 2, 2, 48, 32, torch.float32), None, config=OV)  # 3 tiles: a pair + 1
compare("tma_ov_long", *make(10, 200, 2, 1, 24, 16, torch.float32), None, config=OV)     # 6 pairs + a ragged end
compare("tma_ov_chunk_end", *make(20, 53, 2, 2, 48, 32, torch.float32), 33, config=OV)
compare("tma_ov_negative", *make(40, 30, 2, 2, 48, 32, torch.float32), -21, config=OV)
compare("tma_ov_one_token", *make(1, 1, 2, 2, 48, 32, torch.float32), 0, config=OV)


def compare_varlen(name, lq, lk, causal, dt=torch.float32, config=None, hk=2, split_v=False):
    # attention_with_lse_varlen of requests laid end to end: the single-request kernel's bits per request,
    # and the PyTorch reference (ops.attention_with_lse_varlen)
    parts = [make(a, b, 2, hk, 48, 32, dt, split_v) for a, b in zip(lq, lk)]
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    out, lse = tp.attention_with_lse_varlen(q, k, v, 0.3, lq, lk, causal, config=config)
    same, qs = True, 0
    for (pq, pk, pv), a, b in zip(parts, lq, lk):
        o1, l1 = tp.attention_with_lse(pq, pk, pv, 0.3, b - a if causal else None, config=config)
        same = same and bool(torch.equal(out[qs:qs + a], o1) and torch.equal(lse[qs:qs + a], l1))
        qs += a
    ro, rl = ops.attention_with_lse_varlen(q, k, v, 0.3, lq, lk, causal)
    empty = rl.isinf()
    res["varlen_" + name] = dict(
        same_as_single=same, inf_match=bool(torch.equal(lse.isinf(), empty)),
        rel=((out.double() - ro.double()).norm() / ro.double().norm().clamp_min(1e-30)).item(),
        lse=(lse - rl).masked_fill(empty, 0).abs().max().item() if lse.numel() else 0.0,
        shape_ok=out.shape == ro.shape and lse.shape == rl.shape, fp32=dt == torch.float32)


compare_varlen("causal", [37, 1, 70, 16], [37, 1, 70, 16], True)
compare_varlen("causal_bf16_split_v", [33, 5, 64], [33, 5, 64], True, torch.bfloat16, split_v=True)
compare_varlen("chunk_ends", [20, 3], [53, 40], True)                  # queries at the ends of longer keys
compare_varlen("noncausal_empty", [21, 0, 4], [50, 9, 0], False)      # a request without queries, one without keys
compare_varlen("mqa", [19, 7], [35, 7], True, hk=1)
compare_varlen("tma", [37, 1, 70], [37, 1, 70], True, config=TMA)
compare_varlen("tma_ov_bf16", [37, 64, 2], [37, 64, 2], True, torch.bfloat16, config=OV)
try:
    tp.attention_with_lse_varlen(*make(5, 5, 2, 2, 48, 32, torch.float32), 0.3, [2, 2], [2, 3], True)
    res["varlen_bad_lengths_raise"] = False
except ValueError:
    res["varlen_bad_lengths_raise"] = True
print("RESULT" + json.dumps(res))
"""

N_CASES = 2 * 7 + 10 + 2 * 4 + 4 + 2 * 3 + 5
N_VARLEN = 7


@pytest.fixture(scope="module")
def interp_results():
    return run_interpreted(_SCRIPT, timeout_s=300)


def _case_problems(r: dict) -> list[str]:
    """What is wrong with one case's result (empty: nothing). The bounds (module docstring) grow by 4x
    the fp32 reference's own error against fp64 (``ref_rel``, ``ref_lse``): with scores in the hundreds
    an fp32 ulp of a score is ~1e-5, and any fp32 evaluation errs by that much."""
    bad = []
    if not r["shape_ok"] or r["nan"]:
        bad.append("shape/dtype or NaN")
    if not (r["inf_match"] and r["empty_zero"]):
        bad.append("-inf LSE pattern or empty rows not 0")
    if r["rel"] > (1e-5 if r["fp32"] else 1e-2) + 4 * r["ref_rel"]:
        bad.append(f"rel {r['rel']:.3g} (fp32 reference {r['ref_rel']:.3g})")
    if r["lse"] > (1e-5 if r["fp32"] else 1e-3) + 4 * r["ref_lse"]:
        bad.append(f"lse {r['lse']:.3g} (fp32 reference {r['ref_lse']:.3g})")
    return bad


def test_case_check_bounds():
    """The checks fail on their own: a wrong LSE pattern, an fp32 error a bf16 case would pass, NaN, an
    error well beyond the fp32 reference's."""
    ok = dict(shape_ok=True, nan=False, inf_match=True, empty_zero=True, rel=0.0, lse=0.0, ref_rel=0.0,
              ref_lse=0.0, fp32=True)
    assert _case_problems(ok) == []
    assert _case_problems(dict(ok, rel=3e-3)) and not _case_problems(dict(ok, rel=3e-3, fp32=False))
    assert _case_problems(dict(ok, lse=1e-4)) and _case_problems(dict(ok, lse=2e-3, fp32=False))
    assert _case_problems(dict(ok, inf_match=False)) and _case_problems(dict(ok, nan=True))
    assert not _case_problems(dict(ok, rel=3e-5, ref_rel=1e-5)) and _case_problems(dict(ok, rel=6e-5, ref_rel=1e-5))


def test_interpreter_equals_reference(interp_results):
    r = {n: v for n, v in interp_results.items() if not n.startswith("varlen_")}
    assert len(r) == N_CASES, sorted(r)
    bad = {n: p for n, c in r.items() if (p := _case_problems(c))}
    assert not bad, bad  # every failing case at once
    # the awkward rows exist: queries that see no key, and none / all of them in the extreme offsets
    assert r["negative_float32"]["n_empty"] == 21 * 2 and r["negative_bfloat16"]["n_empty"] == 21 * 2
    assert r["below_tq"]["n_empty"] == r["below_tq"]["n_rows"] == 18 and r["beyond_tk"]["n_empty"] == 0
    assert r["tk0"]["n_empty"] == r["tk0"]["n_rows"] == 12 and r["tq0"]["n_rows"] == 0
    # the TMA path gives the pointer path's bits, and runs wherever TMA's alignment allows: not for bf16
    # rows of 88 bytes (the split view)
    tma = {n: c["tma"] for n, c in r.items() if n.startswith("tma_")}
    assert all(t["same"] for t in tma.values()), tma
    assert [n for n, t in tma.items() if not t["used"]] == ["tma_split_v_bfloat16", "tma_ov_split_v_bfloat16"], tma


def test_interpreter_varlen_is_the_single_request_kernel(interp_results):
    """``attention_with_lse_varlen`` (one launch for requests laid end to end: the MLA prefill's new tokens)
    gives each request the single-request kernel's bits (pointer, TMA and paired-tile configs; causal with
    queries at the end of longer keys, non-causal, a request without queries or without keys, one KV head)
    and the reference's result; lengths that do not add up are refused."""
    v = {n: c for n, c in interp_results.items() if n.startswith("varlen_") and isinstance(c, dict)}
    assert len(v) == N_VARLEN, sorted(v)
    bad = {n: c for n, c in v.items() if not (c["same_as_single"] and c["inf_match"] and c["shape_ok"]
                                              and c["rel"] < (1e-5 if c["fp32"] else 1e-2)
                                              and c["lse"] < (1e-5 if c["fp32"] else 1e-3))}
    assert not bad, bad
    assert interp_results["varlen_bad_lengths_raise"]


def test_bad_input_raises():
    """Shape, dtype and argument errors are ValueError / TypeError naming the problem (checked before
    any launch, so CPU tensors suffice)."""
    pytest.importorskip("triton")
    from longflash.attention import triton_prefill as tp
    q, k, v = torch.randn(4, 2, 48), torch.randn(5, 2, 48), torch.randn(5, 2, 32)
    cases = [((q[0], k, v, 0.3, 0), "3-D"), ((q, k[:4], v, 0.3, 0), "same number of keys"),
             ((q, torch.randn(5, 3, 48), v, 0.3, 0), "heads"), ((q, k, torch.randn(5, 3, 32), 0.3, 0), "heads"),
             ((q, k[..., :40], v, 0.3, 0), "widths"), ((q, k.bfloat16(), v, 0.3, 0), "dtype"),
             ((q.long(), k.long(), v.long(), 0.3, 0), "dtype")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            tp.attention_with_lse(*args)
    for scale in (0.0, -0.3, float("inf"), float("nan"), np.float32(-1.0)):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            tp.attention_with_lse(q, k, v, scale, 0)
    for scale in (True, torch.tensor(0.3), "0.3"):
        with pytest.raises(TypeError, match="scale must be a real number"):
            tp.attention_with_lse(q, k, v, scale, 0)
    for off in (True, 1.5, "0"):
        with pytest.raises(TypeError, match="causal_offset"):
            tp.attention_with_lse(q, k, v, 0.3, off)
    for cfg, msg in (("m1", "unknown prefill config"), (dict(BLOCK_K=16), "unknown prefill config keys"),
                     (dict(BLOCK_M=48), "power of two"), (dict(BLOCK_N=8), "power of two"),
                     (dict(num_warps=3), "num_warps"), (dict(num_stages=0), "num_stages"),
                     (dict(TMA=1), "TMA must be a bool"), (dict(OVERLAP=None), "OVERLAP must be a bool"),
                     (dict(MASKED_STAGES=0), "MASKED_STAGES"), (dict(MASKED_STAGES=True), "MASKED_STAGES")):
        with pytest.raises(ValueError, match=msg):
            tp.resolve_config(torch.bfloat16, cfg)
    assert tp.split_width(192) == (128, 64) and tp.split_width(48) == (32, 16)
    assert tp.split_width(24) == (16, 16) and tp.split_width(8) == (16, 0) and tp.split_width(128) == (128, 0)
    with pytest.raises(ValueError, match="width"):
        tp.split_width(0)


def test_tma_ok_follows_tma_alignment_rules():
    """TMA descriptors need 16-byte-aligned per-head bases and token strides and tile sides <= 256; other
    tensors take the pointer path (checked on CPU tensors: only addresses and strides matter)."""
    pytest.importorskip("triton")
    from longflash.attention import triton_prefill as tp
    cfg = tp.PREFILL_CONFIGS["m128_n128_w8_s2_tma"]
    k, v = torch.randn(64, 4, 192, dtype=torch.bfloat16), torch.randn(64, 4, 128, dtype=torch.bfloat16)
    assert tp.tma_ok(cfg, k, v)
    kv = torch.randn(64, 4, 256, dtype=torch.bfloat16)  # the MLA up-projection split: v at a 256-byte offset
    assert tp.tma_ok(cfg, k, kv[..., 128:]) and tp.tma_ok(cfg, k[:, :1], v[:, :1])  # one broadcast KV head
    assert not tp.tma_ok(cfg, k, kv[..., 4:132])  # base 8 bytes off
    rows = torch.randn(64, 1, 196, dtype=torch.bfloat16)[..., :192]  # token stride 392 bytes
    assert tp.tma_ok(cfg, rows.contiguous(), v[:, :1]) and not tp.tma_ok(cfg, rows, v[:, :1])
    heads = torch.randn(64, 4, 196, dtype=torch.bfloat16)[..., :192]  # head stride 392 bytes, token 1568
    assert not tp.tma_ok(cfg, heads, v) and tp.tma_ok(cfg, heads[:, :1], v[:, :1])  # one head: stride unused
    assert not tp.tma_ok(cfg, torch.randn(8, 1, 576, dtype=torch.bfloat16), torch.randn(8, 1, 512))  # 512 > 256
    assert not tp.tma_ok(cfg, k.transpose(0, 2).contiguous().transpose(0, 2), v)  # last dim not contiguous


def test_scratch_allocator_installed_only_where_none_is_set():
    """A TMA launch needs a Triton allocator for its descriptors: the module installs its own in a context
    without one and leaves a caller's in place (run in copies of the context: nothing leaks)."""
    import contextvars

    triton = pytest.importorskip("triton")
    from triton.runtime import _allocation

    from longflash.attention import triton_prefill as tp

    def fresh():
        triton.set_allocator(_allocation.NullAllocator())
        tp._ensure_scratch_allocator()
        return _allocation._allocator.get()

    def callers():
        mine = lambda size, alignment, stream: None  # noqa: E731
        triton.set_allocator(mine)
        tp._ensure_scratch_allocator()
        return _allocation._allocator.get() is mine

    assert contextvars.copy_context().run(fresh) is tp._scratch
    assert contextvars.copy_context().run(callers)


# ---------------------------------------------------------------------------------------- sm_90 compile

def _ptxas_report(ptx: str) -> dict:
    """Registers, spill bytes and whether ptxas serializes the wgmma instructions (its "Potential
    Performance Loss" warnings C7510-C7520: a wait after every wgmma) of ``ptx`` by Triton's bundled
    ``ptxas -v`` for sm_90a."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                          text=True).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return {"regs": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else None,
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in info}


def _compile_sm90() -> dict:
    """{variant: facts of its sm_90 compile}: registers and spill bytes (ptxas -v), shared memory, wgmma,
    cp.async (per-thread copies), TMA copies (``cp.async.bulk.tensor``), whether the config asks for TMA
    (run in a subprocess by ``sm90_compile.compile_report``)."""
    import re

    from longflash.attention import triton_prefill as tp
    out = {}
    variants = {f"{n} d192": (cfg, "bf16", 192, 128, True) for n, cfg in tp.PREFILL_CONFIGS.items()}
    variants["default d192 non-causal"] = (tp.default_config(torch.bfloat16, 192, 128), "bf16", 192, 128, False)
    variants["default fp16 d48 (default model)"] = (tp.default_config(torch.float16, 48, 32), "fp16", 48, 32, True)
    variants["fp32 d192"] = (tp.FP32_CONFIG, "fp32", 192, 128, True)
    variants["default d192 varlen"] = (tp.default_config(torch.bfloat16, 192, 128), "bf16", 192, 128, True)
    for name, (cfg, dt, d, dv, causal) in variants.items():
        try:
            c = tp.compile_fwd(cfg, dt, d, dv, causal, varlen=name.endswith("varlen"))
            ptx = c.asm["ptx"]
            out[name] = {"ok": True, "smem": c.metadata.shared, "wgmma": "wgmma.mma_async" in ptx,
                         "cp_async": re.search(r"cp\.async\.c[ag]\.", ptx) is not None,
                         "tma": "cp.async.bulk.tensor" in ptx, "tma_config": bool(cfg.get("TMA")),
                         "async_expected": bool(cfg.get("TMA")) or cfg.get("MASKED_STAGES") == 1,
                         **_ptxas_report(ptx)}
        except Exception as e:  # reported by the test
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:3000]}"}
    return out


def test_compiles_for_sm90_without_spills():
    """Every config compiles for sm_90 without spills into at most 227 KB of shared memory, on wgmma (not
    fp32); a TMA config's key / value tiles come by TMA copies (no cp.async left), the others' by
    cp.async; ptxas keeps the wgmmas asynchronous for TMA and MASKED_STAGES=1 configs (with both key
    loops pipelined through cp.async it serializes them: recorded, not asserted)."""
    from sm90_compile import compile_report
    res = compile_report(__file__)
    from longflash.attention.triton_prefill import PREFILL_CONFIGS
    assert len(res) == len(PREFILL_CONFIGS) + 4, sorted(res)
    assert sum(v.get("tma_config", False) for v in res.values()) >= 5, res
    assert sum(v.get("async_expected", False) for v in res.values()) >= 9, res
    bad = {k: v for k, v in res.items()
           if not (v.get("ok") and v["spill_bytes"] == 0 and v["smem"] <= 227 * 1024
                   and (v["wgmma"] or k.startswith("fp32"))
                   and (v["tma"], v["cp_async"]) == ((True, False) if v["tma_config"] else (False, True))
                   and not (v["async_expected"] and v["wgmma_serialized"]))}
    assert not bad, bad


# ------------------------------------------------------------------------------------- GPU, real shapes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_inputs(tq, tk, hk=16, split_v=False, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tq, 16, 192, device="cuda", generator=g).to(dtype)
    k = torch.randn(tk, hk, 192, device="cuda", generator=g).to(dtype)
    if split_v:
        v = torch.randn(tk, hk, 128 + 128, device="cuda", generator=g).to(dtype).split([128, 128], dim=-1)[1]
    else:
        v = torch.randn(tk, hk, 128, device="cuda", generator=g).to(dtype)
    return q, k, v


def _check_gpu(q, k, v, off, config=None, rel_bound=1e-2, lse_bound=1e-3):
    from longflash.attention import ops
    from longflash.attention import triton_prefill as tp
    out, lse = tp.attention_with_lse(q, k, v, 192 ** -0.5, off, config=config)
    ro, rl = ops.attention_with_lse(q.float(), k.float(), v.float(), 192 ** -0.5, off)
    empty = rl.isinf()
    assert out.shape == ro.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert torch.equal(lse.isinf(), empty) and bool((out[empty] == 0).all())
    assert not bool(out.isnan().any() or lse.isnan().any())
    rel = ((out.float() - ro).norm() / ro.norm()).item()
    assert rel <= rel_bound, rel
    err = (lse - rl).masked_fill(empty, 0).abs().max().item()
    assert err <= lse_bound, err
    return out, lse


@cuda
@pytest.mark.parametrize("tq,tk,off,hk,split_v", [
    (1000, 1000, 0, 16, False),       # new tokens, causal, not a multiple of the tile
    (4096, 4096, 0, 16, True),        # v a split view (the MLA up-projection)
    (2048, 8192, None, 16, False),    # a chunked-context piece
    (1500, 8192, 8192 - 1500, 1, False),  # a chunk at the end of its sequence, one broadcast KV head
    (3000, 3000, -700, 16, False),    # 700 leading queries see nothing
])
def test_gpu_real_shapes(tq, tk, off, hk, split_v):
    _check_gpu(*_gpu_inputs(tq, tk, hk, split_v), off)


CONFIG_NAMES = ["m128_n128_w8_s2", "m128_n64_w8_s3", "m128_n64_w8_s4", "m128_n64_w8_s2", "m64_n64_w4_s2",
                "m128_n128_w8_s2_tma", "m128_n64_w8_s3_tma", "m128_n64_w8_s4_tma", "m64_n128_w4_s2_tma",
                "m64_n64_w4_s2_tma", "m128_n64_w8_s2_tma_ov", "m128_n32_w8_s4_tma_ov", "m128_n128_w8_s2_ms1",
                "m128_n64_w8_s3_ms1"]


def test_default_config_fits_shared_memory(monkeypatch):
    """The GPU default is the first of DEFAULT_ORDER whose operand buffers fit (the estimate matches the
    sm_90 compile's 128 KB / 208 KB at D 192); fp32 and the interpreter have their own tiles; the GPU
    tests below cover every config."""
    pytest.importorskip("triton")
    from longflash.attention import triton_prefill as tp
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert sorted(CONFIG_NAMES) == sorted(tp.PREFILL_CONFIGS)
    assert tp.smem_bytes(tp.PREFILL_CONFIGS["m128_n64_w8_s2"], 192, 128) == 131072
    assert tp.smem_bytes(tp.PREFILL_CONFIGS["m128_n128_w8_s2"], 192, 128) == 212992
    assert tp.default_config(torch.bfloat16, 192, 128) == tp.PREFILL_CONFIGS["m128_n64_w8_s3_tma"]
    assert tp.default_config(torch.bfloat16, 256, 256) == tp.PREFILL_CONFIGS["m128_n64_w8_s2"]
    # a partial dict fills its tile keys from the default at its widths (not the D 192 tile: 262 KB at D 256)
    assert tp.resolve_config(torch.bfloat16, {"num_warps": 8}, 256, 256) == tp.PREFILL_CONFIGS["m128_n64_w8_s2"]
    assert "TMA" not in tp.resolve_config(torch.bfloat16, {"BLOCK_N": 32})
    assert tp.default_config(torch.float32, 192, 128) == tp.FP32_CONFIG
    # widths no tile fits go to the PyTorch form (dispatch_attention_with_lse); every current model's fit
    assert tp.fits(192, 128) and tp.fits(48, 32) and tp.fits(256, 256) and not tp.fits(576, 512)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tp.default_config(torch.bfloat16, 192, 128) == tp.INTERPRET_CONFIG


@cuda
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_gpu_every_config(name):
    _check_gpu(*_gpu_inputs(1111, 3333), 3333 - 1111, config=name)
    _check_gpu(*_gpu_inputs(777, 2000), None, config=name)


@cuda
@pytest.mark.parametrize("name", [n for n in CONFIG_NAMES if "_tma" in n])
def test_gpu_tma_gives_the_pointer_tiles_bits(name):
    """A TMA config gives the bits of its tiles read through pointers (the same values reach the same
    dots) on the MLA prefill's views (v a split of the up-projection; one broadcast KV head); tensors TMA
    cannot read (392-byte head stride) take the pointer path."""
    from longflash.attention import triton_prefill as tp
    cfg = tp.PREFILL_CONFIGS[name]
    cases = [(*_gpu_inputs(1000, 2500, split_v=True), 1500), (*_gpu_inputs(700, 1300, hk=1), None)]
    q, k, v = _gpu_inputs(500, 900)
    cases.append((q, torch.nn.functional.pad(k, (0, 4))[..., :192], v, 400))
    for i, (q, k, v, off) in enumerate(cases):
        assert tp.tma_ok(cfg, k, v) == (i < 2)
        a = tp.attention_with_lse(q, k, v, 0.1, off, config=name)
        b = tp.attention_with_lse(q, k, v, 0.1, off, config=dict(cfg, TMA=False))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (name, i)


@cuda
@pytest.mark.parametrize("shift", [1, 37, 64, 200])
def test_gpu_result_does_not_depend_on_the_chunk_start(shift):
    """The rows of q[shift:] (offset shifted by ``shift``) get the same bits as in the whole call: a
    query's key tiles run masked or unmasked depending on its neighbours, and both paths compute alike
    (chunked prefill splits a prompt at arbitrary token boundaries). Not checked in the interpreter:
    NumPy's matmul itself rounds a row differently at different row positions."""
    from longflash.attention import triton_prefill as tp
    q, k, v = _gpu_inputs(1000, 1300)
    for cfg in (None, "m128_n64_w8_s3", "m64_n64_w4_s2", "m128_n128_w8_s2_tma", "m64_n64_w4_s2_tma",
                "m128_n64_w8_s2_tma_ov"):
        whole, whole_lse = tp.attention_with_lse(q, k, v, 0.1, 300, config=cfg)
        part, part_lse = tp.attention_with_lse(q[shift:], k, v, 0.1, 300 + shift, config=cfg)
        assert torch.equal(whole[shift:], part) and torch.equal(whole_lse[shift:], part_lse), cfg


@cuda
def test_gpu_fp32_inputs():
    _check_gpu(*_gpu_inputs(700, 1300, dtype=torch.float32), 600, rel_bound=1e-5, lse_bound=1e-4)


@cuda
@pytest.mark.parametrize("config", [None, "m128_n128_w8_s2_tma"])
def test_gpu_dispatch_and_cuda_graph(config):
    """``triton_ops.attention_with_lse`` runs the kernel on CUDA tensors (same bits); the kernel has no
    host sync, so it captures into a CUDA graph whose replay on new inputs equals eager; a TMA config too
    (the scratch of its device-made descriptors is allocated during the capture, in the graph's pool)."""
    from longflash.attention import triton_ops
    from longflash.attention import triton_prefill as tp
    q, k, v = _gpu_inputs(1024, 2048)
    a = tp.attention_with_lse(q, k, v, 0.1, 1024, config=config)
    if config is None:
        b = triton_ops.attention_with_lse(q, k, v, 0.1, 1024)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = tp.attention_with_lse(q, k, v, 0.1, 1024, config=config)
    for seed in (1, 2):
        q2, k2, v2 = _gpu_inputs(1024, 2048, seed=seed)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        graph.replay()
        want = tp.attention_with_lse(q, k, v, 0.1, 1024, config=config)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@cuda
@pytest.mark.parametrize("lens", [[128] * 64, [1000, 1, 4096, 37, 129]])
def test_gpu_varlen_equals_single_requests(lens):
    """Real MLA prefill shapes (16 heads, 192 / 128 wide, v a split view): one varlen launch gives every
    request the single-request kernel's bits (default config: TMA on an H200)."""
    from longflash.attention import triton_prefill as tp
    from longflash.attention import triton_ops
    q, k, v = _gpu_inputs(sum(lens), sum(lens), 16, True)
    out, lse = triton_ops.attention_with_lse_varlen(q, k, v, 0.1, lens, lens, True)
    s = 0
    for n in lens:
        o1, l1 = tp.attention_with_lse(q[s:s + n], k[s:s + n], v[s:s + n], 0.1, 0)
        assert torch.equal(out[s:s + n], o1) and torch.equal(lse[s:s + n], l1), (n, s)
        s += n


if __name__ == "__main__":
    if "--compile-sm90" in sys.argv:
        print(json.dumps(_compile_sm90()))
    else:  # run the interpreter script inline (debugging)
        exec(_SCRIPT)
