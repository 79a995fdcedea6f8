"""FP8 paged KV cache ops: write -> gather round trips, saturation, scale-1.0 identity, LSE merge
edge cases, and the Triton kernels against the PyTorch references (``TRITON_INTERPRET=1``, in a
subprocess so that the interpreter flag is set before triton is first imported)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from longflash.attention import ops

FP8 = torch.float8_e4m3fn
R, P = 24, 8  # a latent row [kv_c | k_pe] of width 32


def _layout(block_size, seq_lens, seed):
    """Random physical blocks for each request (a random permutation of the pool, -1 padded)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // block_size) for n in seq_lens]
    pool = sum(nblk) + 3
    perm = torch.randperm(pool, generator=g).tolist()
    table = torch.full((len(seq_lens), max(max(nblk), 1)), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(nblk):
        table[b, :n] = torch.tensor(perm[k:k + n], dtype=torch.int32)
        k += n
    return pool, table


def _write_requests(cache, table, seq_lens, rows, k_scale, block_size):
    slots = []
    for b, n in enumerate(seq_lens):
        slots += [int(table[b, p // block_size]) * block_size + p % block_size for p in range(n)]
    slots = torch.tensor(slots, dtype=torch.int64)
    ops.concat_and_cache_mla(rows[:, :R], rows[:, R:], cache, slots, k_scale)
    return slots


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("k_scale", [1.0, 0.1, 3.7])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_write_gather_round_trip(cache_dtype, k_scale, block_size):
    seq_lens = [70, 0, 5, 130, 1]
    pool, table = _layout(block_size, seq_lens, seed=block_size)
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(sum(seq_lens), R + P, generator=g) * k_scale * 20  # spans much of the fp8 range
    cache = torch.zeros(pool, block_size, R + P, dtype=cache_dtype)
    _write_requests(cache, table, seq_lens, rows, k_scale, block_size)
    per_req = list(torch.split(rows, seq_lens))
    # Unaligned starts; the zero-length requests and a zero-length slice of a long one gather nothing.
    starts = [3, 0, 1, 17, 0]
    lens = [60, 0, 4, 0, 1]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = ops.gather_and_maybe_dequant_cache(cache, table, cu, torch.tensor(starts, dtype=torch.int32),
                                             torch.float32, k_scale)
    assert out.shape == (sum(lens), R + P) and out.dtype == torch.float32
    want = torch.cat([per_req[b][starts[b]:starts[b] + lens[b]] for b in range(len(seq_lens))])
    if cache_dtype == torch.bfloat16:
        assert torch.equal(out, want.to(torch.bfloat16).float())
    else:
        # Exactly the E4M3 rounding of x / k_scale, times k_scale ...
        q = (want / torch.tensor(k_scale)).clamp(-448, 448).to(FP8).float() * torch.tensor(k_scale)
        assert torch.equal(out, q)
        # ... which is within half an E4M3 ulp (3 mantissa bits) of the input, or of the subnormal step.
        err = (out - want).abs()
        assert bool((err <= want.abs() * 2.0 ** -4 + k_scale * 2.0 ** -10).all())
    # Whole sequences with seq_starts=None (starts at 0), mixed with an empty request.
    cu = torch.tensor([0, 70, 70, 75, 205, 206], dtype=torch.int32)
    full = ops.gather_and_maybe_dequant_cache(cache, table, cu, None, torch.float32, k_scale)
    assert full.shape == (206, R + P)
    if cache_dtype == torch.bfloat16:
        assert torch.equal(full, rows.to(torch.bfloat16).float())


def test_slot_minus_one_is_skipped_and_bad_positions_raise():
    cache = torch.zeros(2, 16, R + P, dtype=FP8)
    rows = torch.ones(3, R + P)
    ops.concat_and_cache_mla(rows[:, :R], rows[:, R:], cache, torch.tensor([0, -1, 17]), 1.0)
    flat = cache.view(32, R + P).float()
    assert flat[0].eq(1).all() and flat[17].eq(1).all()
    assert int(flat.ne(0).any(dim=1).sum()) == 2
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError):
        ops.gather_and_maybe_dequant_cache(cache, table, torch.tensor([0, 5], dtype=torch.int32),
                                           torch.tensor([30], dtype=torch.int32), torch.float32, 1.0)


@pytest.mark.parametrize("k_scale", [1.0, 0.1, 3.7])
def test_values_beyond_fp8_range_saturate(k_scale):
    cache = torch.zeros(1, 16, R + P, dtype=FP8)
    big = torch.tensor([1e4, -1e4, 449.0 * k_scale, -1e30, 448.0 * k_scale, 1e30])[:, None].expand(-1, R + P)
    ops.concat_and_cache_mla(big[:, :R].contiguous(), big[:, R:].contiguous(), cache, torch.arange(6), k_scale)
    out = ops.gather_and_maybe_dequant_cache(cache, torch.tensor([[0]], dtype=torch.int32),
                                             torch.tensor([0, 6], dtype=torch.int32), None, torch.float32, k_scale)
    sat = 448.0 * torch.tensor(k_scale).item()
    want = torch.tensor([sat, -sat, sat, -sat, sat, sat])[:, None].expand(-1, R + P)
    assert torch.allclose(out, want, rtol=1e-6)
    assert not out.isnan().any() and not out.isinf().any()


def test_fp8_scale_one_bit_identical_to_no_scale():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(40, R + P, generator=g) * 50
    a = torch.zeros(4, 16, R + P, dtype=FP8)
    b = torch.zeros_like(a)
    slots = torch.randperm(64, generator=g)[:40]
    ops.concat_and_cache_mla(rows[:, :R], rows[:, R:], a, slots, 1.0)
    ops.concat_and_cache_mla(rows[:, :R], rows[:, R:], b, slots)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    cu = torch.tensor([0, 50], dtype=torch.int32)
    st = torch.tensor([7], dtype=torch.int32)
    ga = ops.gather_and_maybe_dequant_cache(a, table, cu, st, torch.float32, 1.0)
    gb = ops.gather_and_maybe_dequant_cache(a, table, cu, st, torch.float32)
    assert torch.equal(ga, gb)


@pytest.mark.parametrize("k_scale", [0.1, 3.7])
def test_gqa_cache_round_trip_fp8(k_scale):
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 20, 2, 8, generator=g) * k_scale * 30
    kc = torch.zeros(3, 16, 2, 8, dtype=FP8)
    vc = torch.zeros_like(kc)
    slots = torch.arange(20) + 11
    ops.reshape_and_cache(k, v, kc, vc, slots, k_scale, k_scale)
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    st = torch.tensor([11], dtype=torch.int32)
    for src, cache in ((k, kc), (v, vc)):
        out = ops.gather_and_maybe_dequant_cache(cache, table, cu, st, torch.float32, k_scale)
        s = torch.tensor(k_scale)
        assert torch.equal(out, (src / s).clamp(-448, 448).to(FP8).float() * s)


def test_decode_attention_reads_fp8_in_bounded_pieces():
    """Absorbed decode over an fp8 cache in 16-row pieces equals attention over the dequantized rows."""
    g = torch.Generator().manual_seed(3)
    L, H = 75, 2
    rows = torch.randn(L, R + P, generator=g)
    cache = torch.zeros(6, 16, R + P, dtype=FP8)
    table = torch.tensor([[5, 2, 0, 4, 1]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // 16]) * 16 + p % 16 for p in range(L)])
    ops.concat_and_cache_mla(rows[:, :R], rows[:, R:], cache, slots, 0.05)
    q = torch.randn(3, H, R + P, generator=g)
    out, lse = ops.mla_decode_attention(q, cache, table, [0, 3], [L], 0.2, R, 0.05, max_rows_per_piece=16)
    kv = ops.gather_and_maybe_dequant_cache(cache, table, torch.tensor([0, L], dtype=torch.int32), None,
                                            torch.float32, 0.05)[:, None]
    want, want_lse = ops.attention_with_lse(q, kv, kv[..., :R], 0.2, causal_offset=L - 3)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- merge_attn_states

def _merge_ref_dense(po, pl, so, sl):
    """The merge as attention over the union of both key sets (float64)."""
    pl = torch.where(pl == float("inf"), torch.tensor(float("-inf")), pl).double()
    sl = torch.where(sl == float("inf"), torch.tensor(float("-inf")), sl).double()
    lse = torch.logaddexp(pl, sl)
    wp = torch.exp(pl - lse).nan_to_num(0.0)
    ws = torch.exp(sl - lse).nan_to_num(0.0)
    return (wp[..., None] * po.double() + ws[..., None] * so.double()), lse


def test_merge_matches_union_attention():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, 2, 8, generator=g)
    k = torch.randn(12, 2, 8, generator=g)
    v = torch.randn(12, 2, 6, generator=g)
    o_all, l_all = ops.attention_with_lse(q, k, v, 0.3, None)
    o1, l1 = ops.attention_with_lse(q, k[:7], v[:7], 0.3, None)
    o2, l2 = ops.attention_with_lse(q, k[7:], v[7:], 0.3, None)
    o, lse = ops.merge_attn_states(o1, l1, o2, l2)
    assert torch.allclose(o, o_all, rtol=1e-5, atol=1e-6)
    assert torch.allclose(lse, l_all, rtol=1e-6, atol=1e-6)


def test_merge_edge_cases_never_nan():
    inf = float("inf")
    po = torch.randn(4, 1, 3)
    so = torch.randn(4, 1, 3)
    pl = torch.tensor([[-inf], [inf], [0.5], [-inf]])
    sl = torch.tensor([[-inf], [1.0], [inf], [2.0]])
    po[0], so[0] = float("nan"), 7.0  # garbage behind a -inf LSE must not leak
    po[3] = float("nan")
    o, lse = ops.merge_attn_states(po, pl, so, sl)
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(o[0], torch.zeros(1, 3)) and lse[0, 0] == -inf          # both -inf: 0, -inf
    assert torch.equal(o[1], so[1]) and lse[1, 0] == 1.0                       # +inf prefix = empty
    assert torch.equal(o[2], po[2]) and lse[2, 0] == 0.5                       # +inf suffix = empty
    assert torch.equal(o[3], so[3]) and lse[3, 0] == 2.0                       # NaN output with weight 0
    # Both sides finite but far apart: no overflow.
    o, lse = ops.merge_attn_states(po[2:3], torch.tensor([[1000.0]]), so[2:3], torch.tensor([[-1000.0]]))
    assert torch.allclose(o, po[2:3]) and lse.item() == 1000.0


def test_merge_strided_inputs_padded_v():
    """Prefix is a slice of a padded-V buffer (bigger head stride), suffix is transposed memory."""
    g = torch.Generator().manual_seed(5)
    T, H, D = 6, 3, 5
    padded = torch.randn(T, H, D + 3, generator=g)
    po = padded[..., :D]
    so = torch.randn(H, T, D, generator=g).transpose(0, 1)
    pl = torch.randn(H, T, generator=g).t()  # [T, H] with strides (1, T)
    sl = torch.randn(T, H, generator=g)
    o, lse = ops.merge_attn_states(po, pl, so, sl)
    want, want_lse = _merge_ref_dense(po, pl, so, sl)
    assert torch.allclose(o.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- Triton == reference

_KERNEL_SCRIPT = r"""
import json, os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from longflash.attention import ops, triton_ops as tk
FP8 = torch.float8_e4m3fn
res = {}
g = torch.Generator().manual_seed(0)
R, P = 24, 8
# cache write: fp8 bytes must equal torch's E4M3 conversion exactly (integer rounding in the kernel)
x = torch.randn(300, R + P, generator=g) * torch.logspace(-4, 3, 300)[:, None]
x[0, :9] = torch.tensor([1.9375, 0.1216, 1.0625, 449.0, -1e6, 2.0 ** -10, -1e-9, -0.0, -2.0 ** -11])
for bs in (16, 64):
    nb = -(-300 // bs) + 2
    slots = torch.randperm(nb * bs, generator=g)[:300]
    slots[5] = -1
    for cdt, scales in ((FP8, (None, 1.0, 0.1, 3.7)), (torch.bfloat16, (None,)), (torch.float32, (None,))):
        for s in scales:
            a = torch.zeros(nb, bs, R + P, dtype=cdt)
            b = torch.zeros_like(a)
            ops.concat_and_cache_mla(x[:, :R], x[:, R:], a, slots, s)
            tk.concat_and_cache_mla(x[:, :R], x[:, R:], b, slots, s)
            key = f"write_{cdt}_{s}_{bs}"
            if cdt == torch.bfloat16:  # the interpreter's fp32->bf16 cast is not RNE: one bf16 ulp
                res[key] = bool(torch.allclose(a.float(), b.float(), rtol=2.0 ** -7, atol=0))
            else:  # fp8 (integer rounding in the kernel) and fp32: byte-equal
                res[key] = bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
            # gather + dequant, unaligned starts, a zero-length request, random tables
            table = torch.randperm(nb, generator=g).to(torch.int32).view(1, -1).repeat(3, 1)
            table[1] = torch.randperm(nb, generator=g).to(torch.int32)
            lens = torch.tensor([40, 0, 77])
            starts = torch.tensor([5, 3, 13], dtype=torch.int32)
            cu = torch.cat([torch.zeros(1), lens.cumsum(0)]).to(torch.int32)
            for out_dtype in (torch.float32, torch.bfloat16):
                r = ops.gather_and_maybe_dequant_cache(a, table, cu, starts, out_dtype, s)
                k = tk.gather_and_maybe_dequant_cache(a, table, cu, starts, out_dtype, s)
                key = f"gather_{cdt}_{s}_{bs}_{out_dtype}"
                if out_dtype == torch.float32:  # bitwise: -0.0 must stay -0.0
                    res[key] = bool(torch.equal(r.view(torch.int32), k.view(torch.int32)))
                else:  # the interpreter's fp32->bf16 cast is not RNE: allow one bf16 ulp
                    res[key] = bool(torch.allclose(r.float(), k.float(), rtol=2.0 ** -7, atol=0))
            z = tk.gather_and_maybe_dequant_cache(a, table, torch.zeros(4, dtype=torch.int32), None, torch.float32, s)
            res[f"gather_empty_{cdt}_{s}_{bs}"] = z.shape == (0, R + P)
# whole-row tiles: W = 56 (a 32- and a masked 32-wide tile), several rows per program, -1 slots, the
# benchmark's knobs (rows per program, eviction policy), NaN inputs (stored as an E4M3 NaN)
R2, P2, bs = 40, 16, 16
x2 = torch.randn(40, R2 + P2, generator=g) * torch.logspace(-3, 3, 40)[:, None]
x2[3, :4] = torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0])
slots = torch.randperm(6 * bs, generator=g)[:40]
slots[[0, 33, 39]] = -1
nan_rows = torch.zeros(40, R2 + P2, dtype=torch.bool)
nan_rows[3, :2] = True
for cdt, s in ((FP8, 0.1), (FP8, 0.5), (FP8, None), (torch.float32, None)):
    a = torch.zeros(6, bs, R2 + P2, dtype=cdt)
    ops.concat_and_cache_mla(x2[:, :R2], x2[:, R2:], a, slots, s)
    for kw in ({}, {"block_t": 2, "num_warps": 2, "evict": "evict_first"}, {"block_t": 64}):
        b = a.clone()
        b.view(torch.uint8).view(a.shape[0] * bs, -1)[slots[slots >= 0]] = 0x5A  # poison the rows to write
        tk.concat_and_cache_mla(x2[:, :R2], x2[:, R2:], b, slots, s, **kw)
        ab, bb = a.view(torch.uint8), b.view(torch.uint8)
        key = f"write_w56_{cdt}_{s}_{kw}"
        if cdt == FP8:  # NaN inputs: any E4M3 NaN; every other byte equal
            nan_pos = torch.zeros(6 * bs, R2 + P2, dtype=torch.bool)
            nan_pos[slots[3]] = nan_rows[3]
            nan_pos = nan_pos.view(ab.shape)
            res[key] = bool(torch.equal(ab[~nan_pos], bb[~nan_pos]) and ((bb[nan_pos] & 0x7F) == 0x7F).all())
        else:
            res[key] = bool(torch.equal(ab, bb))
        table = torch.randperm(6, generator=g).to(torch.int32).view(1, -1).repeat(2, 1)
        cu = torch.tensor([0, 27, 40], dtype=torch.int32)
        starts = torch.tensor([2, 31], dtype=torch.int32)
        r = ops.gather_and_maybe_dequant_cache(a, table, cu, starts, torch.float32, s)
        k = tk.gather_and_maybe_dequant_cache(a, table, cu, starts, torch.float32, s, **kw)
        same_nan = torch.equal(r.isnan(), k.isnan())
        fin = ~r.isnan()
        res[f"gather_w56_{cdt}_{s}_{kw}"] = bool(same_nan and torch.equal(r[fin].view(torch.int32), k[fin].view(torch.int32)))
# merge: edge cases and strided inputs
inf = float("inf")
T, H, D = 7, 3, 20
padded = torch.randn(T, H, D + 12, generator=g)
po = padded[..., :D]
so = torch.randn(H, T, D, generator=g).transpose(0, 1)
pl = torch.randn(H, T, generator=g).t()
sl = torch.randn(T, H, generator=g)
pl[0, 0], sl[0, 0] = -inf, -inf
pl[1, 1] = inf
sl[2, 2] = inf
pl[3, 0] = -inf
po[3, 0] = float("nan")
ro, rl = ops.merge_attn_states(po, pl, so, sl)
ko, kl = tk.merge_attn_states(po, pl, so, sl)
res["merge_out_close"] = bool(torch.allclose(ro, ko, rtol=1e-6, atol=1e-7))
res["merge_lse_close"] = bool(torch.allclose(rl, kl, rtol=1e-6, atol=1e-7, equal_nan=False))
res["merge_no_nan"] = not bool(ko.isnan().any() or kl.isnan().any())
res["merge_both_neginf"] = bool(ko[0, 0].eq(0).all()) and kl[0, 0].item() == -inf
out = torch.empty(T, H, D + 4)[..., :D]
olse = torch.empty(H, T).t()
tk.merge_attn_states(po, pl, so, sl, out, olse)
res["merge_strided_out"] = bool(torch.allclose(out, ro, rtol=1e-6, atol=1e-7) and torch.allclose(olse, rl, rtol=1e-6, atol=1e-7))
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def kernel_results():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _KERNEL_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def test_triton_kernels_equal_reference_under_interpreter(kernel_results):
    assert len(kernel_results) > 60
    bad = [k for k, v in kernel_results.items() if not v]
    assert not bad, bad


# ---------------------------------------------------------------------------- sm_90 compilation

_SM90_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from longflash.attention import triton_ops as tk
out = {}
def build(kern, sig, consts, warps, key):
    idx = kern.arg_names.index
    sig = dict(sig, **{c: "constexpr" for c in consts})
    ptrs_ints = [n for n, t in sig.items() if t.startswith("*") or n.startswith("stride")]
    src = ASTSource(fn=kern, signature=sig, constexprs={(idx(n),): v for n, v in consts.items()},
                    attrs={(idx(n),): [["tt.divisibility", 16]] for n in ptrs_ints})
    try:
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        ptx = c.asm["ptx"]
        out[key] = {"ok": bool(c.asm.get("cubin")), "shared": c.metadata.shared,
                    "ld_v4": len(re.findall(r"ld\.global\S*\.v4", ptx)),
                    "ld_v2": len(re.findall(r"ld\.global\S*\.v2", ptx)),
                    "st_v4": len(re.findall(r"st\.global\S*\.v4", ptx)),
                    "cvt_e4m3": len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2", ptx)),
                    "div_rn": len(re.findall(r"div\.rn\.f32", ptx)), "fma": len(re.findall(r"fma\.rn\.f32", ptx)),
                    "evict_first": ptx.count("evict_first"), "ftz": ptx.count(".ftz")}
    except Exception as e:
        out[key] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:1500]}"}
wsig = dict(kvc_ptr="*bf16", kpe_ptr="*bf16", cache_ptr="*u8", slot_ptr="*i64", scale="fp32", nscale="fp32",
            rcp="fp32", T="i32", stride_kvc="i32", stride_kpe="i32")
for fp8, mode, bt, warps, ev in [(False, 0, 4, 4, ""), (True, 0, 4, 4, ""), (True, 1, 4, 4, ""), (True, 2, 4, 4, ""),
                                  (True, 3, 4, 4, ""), (True, 3, 32, 8, "evict_first")]:
    sig = dict(wsig, cache_ptr="*u8" if fp8 else "*bf16")
    build(tk._write_kernel, sig, dict(R=512, P=64, BLOCK_R=512, BLOCK_P=64, FP8=fp8, SCALE_MODE=mode, HW_FP8=True,
                                      BLOCK_T=bt, EVICT=ev), warps, f"write,fp8={fp8},mode={mode},bt={bt},ev={ev}")
gsig = dict(cache_ptr="*u8", bt_ptr="*i32", cu_ptr="*i32", starts_ptr="*i32", t2s_ptr="*i32", out_ptr="*bf16",
            scale="fp32", total="i32", stride_bt="i32", block_size="i32")
for fp8, bt, warps, ev in [(False, 4, 4, ""), (True, 8, 4, "evict_first"), (True, 16, 4, "")]:
    sig = dict(gsig, cache_ptr="*u8" if fp8 else "*bf16")
    build(tk._gather_kernel, sig, dict(W=576, C1=512, C2=64, FP8=fp8, HAS_SCALE=fp8, HAS_STARTS=True, HW_FP8=True,
                                       BLOCK_T=bt, EVICT=ev), warps, f"gather,fp8={fp8},bt={bt},ev={ev}")
print("RESULT" + json.dumps(out))
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """The GPU-only paths (hardware casts, FMA-corrected division) compile for sm_90 with Triton's
    bundled ptxas: 16-byte loads, no shared-memory layout change, no div.rn in the FMA path, no FTZ."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")):
        pytest.skip("Triton's bundled ptxas is not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT"):])
    assert len(res) == 9 and all(v["ok"] for v in res.values()), res
    for key, v in res.items():
        assert v["shared"] == 0 and v["ftz"] == 0, (key, v)
        assert v["ld_v4"] + v["ld_v2"] > 0 and v["st_v4"] > 0, (key, v)
        if key.startswith("write,fp8=True"):
            assert v["cvt_e4m3"] > 0, (key, v)
        if "mode=3" in key:
            assert v["div_rn"] == 0 and v["fma"] > 0, (key, v)
        if "mode=2" in key:
            assert v["div_rn"] > 0, (key, v)
        assert (v["evict_first"] > 0) == ("evict_first" in key), (key, v)


# ---------------------------------------------------------------------------- GPU: hardware paths

_GPU_SCALES = [None, 1.0, 0.5, 2.0 ** -20, 0.05, 3.7, 1 / 200, 0.0123, 1.3 * 2.0 ** -59, 1.1 * 2.0 ** 61, 1e-30]


def _every_bf16_row_tile(device):
    """All 65536 bf16 bit patterns as rows of 576 (zero padded): [114, 576], and its NaN mask."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.cat([x, torch.zeros(114 * 576 - x.numel(), dtype=torch.bfloat16)]).view(114, 576)
    return x.to(device), x.isnan().to(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_of_every_bf16_value_and_every_byte_equals_reference():
    """Hardware fp8 write (multiply / FMA-corrected reciprocal / IEEE division, satfinite cast): every
    bf16 bit pattern under many k_scales gives the reference's bytes (NaN inputs: an E4M3 NaN); the
    hardware upcast in the gather: every E4M3 byte gives the reference's value."""
    from longflash.attention import triton_ops as tk
    x, nan = _every_bf16_row_tile("cuda")
    slots = torch.arange(114, device="cuda")
    g = torch.Generator().manual_seed(11)
    scales = _GPU_SCALES + (2.0 ** (torch.rand(24, generator=g) * 40 - 20)).tolist()
    bad = []
    for s in scales:
        ref = torch.zeros(2, 64, 576, dtype=FP8, device="cuda")
        ops.concat_and_cache_mla(x[:, :512], x[:, 512:], ref, slots, s)
        ref = ref.view(torch.uint8).view(128, 576)[:114]
        modes = [None] + ([2, 3] if s is not None and 2.0 ** -60 <= s <= 2.0 ** 60 else [])
        for mode in modes:
            got = torch.zeros(2, 64, 576, dtype=FP8, device="cuda")
            tk.concat_and_cache_mla(x[:, :512], x[:, 512:], got, slots, s, scale_mode=mode)
            got = got.view(torch.uint8).view(128, 576)[:114]
            if not (torch.equal(ref[~nan], got[~nan]) and bool(((got[nan] & 0x7F) == 0x7F).all())):
                bad.append((s, mode, int((ref[~nan] != got[~nan]).sum())))
    assert not bad, bad
    # the gather: every E4M3 byte (NaNs, -0, subnormals) dequantized under several scales
    cache = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(64 * 576 // 256).view(1, 64, 576).view(FP8)
    one = torch.tensor([[0]], dtype=torch.int32, device="cuda")
    cu1 = torch.tensor([0, 64], dtype=torch.int32, device="cuda")
    for s in (None, 1.0, 0.05, 3.7, 2.0 ** -100):
        for out_dt in (torch.bfloat16, torch.float32):
            r = ops.gather_and_maybe_dequant_cache(cache, one, cu1, None, out_dt, s).float()
            k = tk.gather_and_maybe_dequant_cache(cache, one, cu1, None, out_dt, s).float()
            assert torch.equal(r.isnan(), k.isnan()) and torch.equal(r[~r.isnan()].view(torch.int32), k[~k.isnan()].view(torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cfg,cases,out_dts", [
    ({}, ((torch.bfloat16, None), (FP8, 0.05), (FP8, 1.0), (FP8, None)), (torch.bfloat16, torch.float32)),
    # another tile (32 rows, 8 warps, evict_first): one fp8 and the bf16 cache, bf16 workspace (fewer compiles)
    ({"block_t": 32, "num_warps": 8, "evict": "evict_first"}, ((torch.bfloat16, None), (FP8, 0.05)), (torch.bfloat16,)),
])
def test_gpu_kernels_equal_reference_at_mla_shapes(cfg, cases, out_dts):
    """64K rows x 576 (DeepSeek/Kimi latent rows), block 64: write (bf16 and fp8 caches, -1 slots) and
    gather + dequant (unaligned starts, bf16 and fp32 workspaces), default tiles and one other."""
    from longflash.attention import triton_ops as tk
    T, bs = 65536, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    kv_c = (torch.randn(T, 512, generator=g, device="cuda") * 3).to(torch.bfloat16)
    k_pe = (torch.randn(T, 64, generator=g, device="cuda") * 3).to(torch.bfloat16)
    nblk = T // bs + 8
    slots = torch.randperm(nblk * bs, generator=g, device="cuda")[:T]
    slots[::1000] = -1
    table = torch.stack([torch.randperm(nblk, generator=g, device="cuda") for _ in range(4)]).to(torch.int32)
    cu = torch.tensor([0, 20000, 20000, 50001, 60000], dtype=torch.int32, device="cuda")
    starts = torch.tensor([3, 0, 17, 1000], dtype=torch.int32, device="cuda")
    for dt, s in cases:
        ref = torch.zeros(nblk, bs, 576, dtype=dt, device="cuda")
        got = ref.clone()
        got.view(torch.uint8).view(nblk * bs, -1)[slots[slots >= 0]] = 0x5A  # poison the rows to write
        ops.concat_and_cache_mla(kv_c, k_pe, ref, slots, s)
        tk.concat_and_cache_mla(kv_c, k_pe, got, slots, s, **cfg)
        assert torch.equal(ref.view(torch.uint8), got.view(torch.uint8)), (dt, s)
        for out_dt in out_dts:
            r = ops.gather_and_maybe_dequant_cache(ref, table, cu, starts, out_dt, s)
            k = tk.gather_and_maybe_dequant_cache(ref, table, cu, starts, out_dt, s, **cfg)
            assert torch.equal(r.view(torch.uint8), k.view(torch.uint8)), (dt, s, out_dt)
