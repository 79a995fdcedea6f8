"""The Gluon fp8 MLA decode stage 1 (``attention/gluon_mla_decode.py``), reached through
``triton_mla_decode.mla_decode_attention`` for an fp8 cache and <= 16 query rows, equals the PyTorch
reference ``ops.mla_decode_attention``.

CPU (no GPU needed): the value-column relabelling σ is a permutation of the 512 latent dims; the kernel
compiles for sm_90 in each variant the wrapper launches (split / unsplit output, DCP visible lengths,
bf16 / fp16 queries, the benchmark's tile shapes), with its compile-time checks that the three
shared-memory access patterns have no bank conflicts; calls the Gluon kernel cannot take (interpreter,
fp32 queries, other widths) fall back to the Triton kernel.
GPU (skipped without CUDA): real shapes against the reference (fp8 cache, k_scale ≠ 1), lengths not a
multiple of the tile, empty requests, forced split counts, block sizes 16 and 64, 1-16 heads with q_len
up to 16 rows, a q row of magnitude 1e4 (fp16 range), DCP-local visible lengths, every benchmark tile;
and the Triton fp16-dot tile's result, which does the same arithmetic in another order.
Bounds as in ``test_triton_mla_decode.py`` (fp8 values are exact in fp16, q is rounded to fp16 after a
power-of-two scale, P to fp16): ‖out − ref‖/‖ref‖ ≤ 1e-2, LSE within 1e-3 relative.
"""

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_latent_dim_of_column_is_a_permutation():
    from longflash.attention.gluon_mla_decode import latent_dim_of_column
    for bad in (512, -1, torch.tensor([0, 600])):
        with pytest.raises(ValueError, match="0..511"):
            latent_dim_of_column(bad)
    n = torch.arange(512)
    d = latent_dim_of_column(n)
    assert sorted(d.tolist()) == list(range(512))
    # warp w's columns n = 8w.. (bits 3-4) read dims with bits 5-6 = w; a thread's 4 register columns
    # n, n+32, n+64, n+96 read 4 consecutive dims
    assert [latent_dim_of_column(c) for c in (0, 32, 64, 96)] == [0, 1, 2, 3]
    assert latent_dim_of_column(8) == 32 and latent_dim_of_column(1) == 4
    # 8 warps: columns n = 8w.. (bits 3-5) per warp, a thread's register columns n, n+64, n+128, n+192 read
    # 4 consecutive dims
    d8 = latent_dim_of_column(n, warps=8)
    assert sorted(d8.tolist()) == list(range(512))
    assert [latent_dim_of_column(c, 8) for c in (0, 64, 128, 192)] == [0, 1, 2, 3]
    assert latent_dim_of_column(1, 8) == 4 and latent_dim_of_column(32, 8) == 128 and latent_dim_of_column(256, 8) == 256
    with pytest.raises(ValueError, match="warps"):
        latent_dim_of_column(0, warps=2)


COMPILE_VARIANTS = {"default": dict(), "unsplit fp16 DCP": dict(split=False, q_dtype="fp16", has_vis=True),
                    "N32 s4 block 64": dict(block_n=32, stages=4, block_size=64),
                    "N32 s2 block 1": dict(block_n=32, block_size=1),
                    "8 warps r128": dict(warps=8, maxnreg=128), "8 warps s4 unsplit": dict(warps=8, stages=4, split=False)}


def _compile_sm90() -> dict:
    """{variant: facts of its sm_90 compile} (run in a subprocess by ``sm90_compile.compile_report``)."""
    import re
    from longflash.attention import gluon_mla_decode as g
    out = {}
    for name, kw in COMPILE_VARIANTS.items():
        try:
            ptx = g.compile_stage1(**kw).asm["ptx"]
            out[name] = {"ok": True, "mma_f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx,
                         "cp_async": "cp.async" in ptx, "prmt_asm": "prmt.b32 t0" in ptx,
                         "byte_loads": bool(re.search(r"ld\.shared\.(u8|b8|s8)", ptx)), "local": ".local" in ptx}
        except Exception as e:  # reported by the test
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:3000]}"}
    return out


def test_compiles_for_sm90():
    """Each variant the wrapper launches compiles for sm_90 (with its static asserts: no bank conflicts on the
    copies, the score reads, the value read and the two exchange buffers); the value operand is built from
    4-byte shared loads + byte permutes (no byte loads), the products run on mma.sync, no local memory in the
    PTX (ptxas spills under a register cap are reported by benchmarks/mla_decode_sm90_report.py)."""
    from sm90_compile import compile_report
    res = compile_report(__file__)
    assert set(res) == set(COMPILE_VARIANTS)
    bad = {k: v for k, v in res.items() if not (v.get("ok") and v["mma_f16"] and v["cp_async"] and v["prmt_asm"]
                                               and not v["byte_loads"] and not v["local"])}
    assert not bad, bad


def test_compile_stage1_refuses_what_the_kernel_cannot_take():
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from longflash.attention.gluon_mla_decode import compile_stage1
    for kw, msg in ((dict(q_dtype="fp32"), "q_dtype"), (dict(block_n=16), "block_n"), (dict(stages=1), "stages"),
                    (dict(block_size=0), "block_size"), (dict(target=GPUTarget("cuda", 80, 32)), "8.9"),
                    (dict(warps=2), "warps"), (dict(warps=8, block_n=32), "warps")):
        with pytest.raises(ValueError, match=msg):
            compile_stage1(**kw)


def test_resolve_config(monkeypatch):
    """Which tile runs: the Gluon default where eligible; the Triton fp8 tile (with the caller's other keys)
    where Gluon cannot run or ``GLUON=False`` is asked; other shapes keep their own defaults; a Gluon tile the
    kernel cannot run is refused by name."""
    from longflash.attention import triton_mla_decode as tk
    from longflash.attention.ops import FP8_DTYPE
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 576, dtype=FP8_DTYPE)
    assert tk.resolve_config(q, cache, 512, 1) == (dict(tk.TRITON_FP8_CONFIG), False)  # CPU: not eligible
    assert tk.resolve_config(q, cache, 512, 1, {"BLOCK_N": 64}) == (dict(tk.TRITON_FP8_CONFIG, BLOCK_N=64), False)
    monkeypatch.setattr(tk, "gluon_eligible", lambda *a: True)
    monkeypatch.setattr(tk, "_cuda_index", lambda device: 0)
    monkeypatch.setattr(tk, "_wgmma_runs_on", lambda idx: True)
    assert tk.resolve_config(q, cache, 512, 1) == (dict(tk.GLUON_FP8_CONFIG), True)  # sm_90: the wgmma kernel
    # the default's WGMMA under a tile wgmma cannot take, or off sm_90: the mma.sync kernel, no error
    assert tk.resolve_config(q, cache, 512, 1, {"BLOCK_N": 32})[0]["WGMMA"] is False
    assert tk.resolve_config(q, cache, 512, 1, {"num_warps": 8, "maxnreg": 128})[0]["WGMMA"] is False
    monkeypatch.setattr(tk, "_wgmma_runs_on", lambda idx: False)
    assert tk.resolve_config(q, cache, 512, 1) == (dict(tk.GLUON_FP8_CONFIG, WGMMA=False), True)
    # occupancy from the buffered rows (num_stages x BLOCK_N), unless the caller sets it
    assert tk.resolve_config(q, cache, 512, 1, {"num_stages": 3, "WGMMA": False})[0]["occupancy"] == 1
    assert tk.resolve_config(q, cache, 512, 1, {"BLOCK_N": 32, "num_stages": 4})[0]["occupancy"] == 2
    assert tk.resolve_config(q, cache, 512, 1, {"num_stages": 3, "occupancy": 2})[0]["occupancy"] == 2
    assert tk.resolve_config(q, cache, 512, 1, {"GLUON": False}) == (dict(tk.TRITON_FP8_CONFIG), False)
    assert tk.resolve_config(q, cache, 512, 1, {"BLOCK_N": 32})[0]["BLOCK_N"] == 32
    assert tk.resolve_config(q, cache, 512, 1, {"num_warps": 8})[0]["num_warps"] == 8
    for bad in ({"num_stages": 1}, {"BLOCK_N": 16}, {"num_warps": 2}, {"num_warps": 8, "BLOCK_N": 32}):
        with pytest.raises(ValueError, match="Gluon fp8 decode tile"):
            tk.resolve_config(q, cache, 512, 1, bad)
    monkeypatch.setattr(tk, "gluon_eligible", lambda q, c, r, rows: rows <= 16)
    cfg, gl = tk.resolve_config(q, cache, 512, 2, {"GLUON": True})  # 32 rows: the 32-row Triton tile
    assert not gl and cfg == dict(tk.default_config(32, FP8_DTYPE), GLUON=False)
    cfg, gl = tk.resolve_config(q.float(), cache, 512, 1)  # fp32 q: the 16-row bf16 tile
    assert not gl and cfg == dict(tk.default_config(16, torch.bfloat16), GLUON=False)


def test_fallback_where_gluon_cannot_run():
    """Under the CPU interpreter (and for fp32 queries or other widths) the default fp8 config, which asks
    for Gluon, runs the Triton kernel instead: checked by the interpreter tests of
    ``test_triton_mla_decode.py``; here, the eligibility rule itself."""
    from longflash.attention import triton_mla_decode as tk
    from longflash.attention.ops import FP8_DTYPE
    assert tk.default_config(16, FP8_DTYPE)["GLUON"] and not tk.TRITON_FP8_CONFIG["GLUON"]
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 576, dtype=FP8_DTYPE)
    assert not tk.gluon_eligible(q, cache, 512, 16)  # CPU tensors
    assert all(not c.get("GLUON") for c in tk.candidate_configs(128, FP8_DTYPE))


def _gpu_case(H, seq, ql, ks, bs=16, seed=0, qdt=torch.bfloat16):
    """(q, fp8 cache, block table, query_start_loc) at real shapes: ``test_triton_mla_decode``'s case builder."""
    from test_triton_mla_decode import _gpu_case as case
    return case(H, seq, ql, torch.float8_e4m3fn, ks, bs=bs, seed=seed, qdt=qdt)


def _check(out, lse, ro, rl):
    empty = rl.isinf()
    assert torch.equal(lse.isinf(), empty) and bool((out[empty] == 0).all())
    assert not bool(out.isnan().any() or lse.isnan().any())
    rel = ((out.float() - ro).norm() / ro.norm()).item()
    assert rel <= 1e-2, rel
    lse_err = ((lse - rl).abs() / rl.abs().clamp_min(1.0)).masked_fill(empty, 0)
    assert lse_err.max().item() <= 1e-3


# (heads, seq_lens, q_lens, block_size, q dtype) of the GPU reference checks (also test_gluon_mla_decode_wgmma.py)
REFERENCE_CASES = [
    (16, [4096 + 13, 70000, 1, 0, 777], [1] * 5, 16, torch.bfloat16),
    (16, [33, 20000, 5], [1, 1, 1], 64, torch.float16),
    (8, [5000, 2, 300], [2, 2, 1], 16, torch.bfloat16),   # 16 rows: 2 tokens x 8 heads, causal among them
    (4, [3000, 4, 0], [4, 4, 1], 16, torch.bfloat16),     # 16 rows, a query that precedes its cache row
    (1, [129, 7000], [1, 16], 16, torch.bfloat16),
]


@cuda
@pytest.mark.parametrize("H,seq,ql,bs,qdt", REFERENCE_CASES)
def test_gpu_matches_reference(H, seq, ql, bs, qdt):
    from longflash.attention import ops
    from longflash.attention import triton_mla_decode as tk
    q, cache, bt, qsl = _gpu_case(H, seq, ql, 0.05, bs, qdt=qdt)
    q[0, 0] *= 1e4  # fp16 overflow without the per-row power-of-two scale
    assert tk.gluon_eligible(q, cache, 512, max(ql) * H)
    ro, rl = ops.mla_decode_attention(q.float(), cache, bt, qsl, seq, 576 ** -0.5, 512, 0.05)
    mma = dict(tk.GLUON_FP8_CONFIG, WGMMA=False)  # this file's kernel (on sm_90 the default is the wgmma one)
    for S in (None, 1, 7):
        out, lse = tk.mla_decode_attention(q, cache, bt, qsl, seq, 576 ** -0.5, 512, 0.05, num_splits=S, config=mma)
        _check(out, lse, ro, rl)
    # the Triton fp16-dot tile: the same arithmetic in another order
    o2, l2 = tk.mla_decode_attention(q, cache, bt, qsl, seq, 576 ** -0.5, 512, 0.05, config=tk.TRITON_FP8_CONFIG)
    assert ((out.float() - o2.float()).norm() / o2.float().norm()).item() <= 2e-3


@cuda
@pytest.mark.parametrize("cfg", [c for c in __import__("longflash.attention.triton_mla_decode", fromlist=["x"])
                                 .candidate_configs(16, torch.float8_e4m3fn) if c.get("GLUON")])
def test_gpu_every_benchmark_tile(cfg):
    from longflash.attention import ops
    from longflash.attention import triton_mla_decode as tk
    seq = [4096 + 13, 20000, 1, 0, 777]
    q, cache, bt, qsl = _gpu_case(16, seq, [1] * 5, 0.3, seed=1)
    ro, rl = ops.mla_decode_attention(q.float(), cache, bt, qsl, seq, 576 ** -0.5, 512, 0.3)
    out, lse = tk.mla_decode_attention(q, cache, bt, qsl, seq, 576 ** -0.5, 512, 0.3, config=cfg)
    _check(out, lse, ro, rl)


@cuda
def test_gpu_dcp_local_visible_lengths():
    from longflash.attention import triton_mla_decode as tk
    from longflash.distributed import dcp
    seq = [3000, 17, 9000]
    q, cache, bt, qsl = _gpu_case(16, [-(-L // 2) + 16 for L in seq], [1, 1, 1], 0.05)
    for rank in (0, 1):
        out, lse = tk.mla_decode_attention_dcp_local(q, cache, bt, qsl, seq, 576 ** -0.5, 512, 2, rank, 1, 0.05)
        ro, rl = dcp.mla_decode_attention_local(q.float(), cache, bt, qsl, seq, 576 ** -0.5, 512, 2, rank, 1, 0.05)
        _check(out, lse, ro, rl)


@cuda
def test_gpu_engine_fp8_cache_graphs_equal_eager(tmp_path, monkeypatch):
    """A DeepSeek-V3-shaped model (16 heads, kv_lora_rank 512, rope 64) serving from an fp8 cache: the decode
    steps take the Gluon kernel (eligible at 16 query rows), CUDA-graph replay gives the eager engine's
    greedy tokens, and the Triton fp16-dot tile (same arithmetic, another order) agrees on >= 90 % of them."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from longflash import LLM, SamplingParams
    from longflash.attention import triton_mla_decode as tk
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=128, intermediate_size=192, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=512,
        q_lora_rank=96, qk_rope_head_dim=64, v_head_dim=32, qk_nope_head_dim=32, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=4096, bos_token_id=0,
        eos_token_id=1, initializer_range=0.1)
    DeepseekV3ForCausalLM(cfg).eval().save_pretrained(str(tmp_path))
    kw = dict(model=str(tmp_path), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", block_size=16, skip_tokenizer_init=True,
              max_num_seqs=4, max_num_batched_tokens=512, kv_cache_memory="1GiB")
    prompts = [[5, 9, 17, 33] * 40, [7, 11] * 150, [3] * 20]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16, device="cuda")
    assert tk.gluon_eligible(q, torch.zeros(1, 16, 576, dtype=torch.float8_e4m3fn, device="cuda"), 512, 16)

    def run(**extra):
        llm = LLM(**kw, **extra)
        if extra.get("enforce_eager"):
            llm.engine.runner.decode_runner.pad_like_graph = True
        out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        llm.shutdown()
        return out
    graphs = run()
    assert graphs == run(enforce_eager=True)
    monkeypatch.setattr(tk, "gluon_eligible", lambda *a: False)  # the Triton fp16-dot tile instead
    triton_tokens = run()
    same = sum(a == b for x, y in zip(graphs, triton_tokens) for a, b in zip(x, y))
    assert same >= 0.9 * sum(len(x) for x in graphs), (graphs, triton_tokens)


if __name__ == "__main__":
    import json
    import sys
    if "--compile-sm90" in sys.argv:
        print(json.dumps(_compile_sm90()))
