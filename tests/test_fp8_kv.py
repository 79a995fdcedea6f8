"""FP8 KV cache in the engine: capacity, outputs close to the bf16 cache, --calculate-kv-scales
(amax/200 of the first batch, then frozen), checkpoint ``*.k_scale`` loading, CLI flags."""

import argparse
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from longflash import LLM, SamplingParams
from longflash.entrypoints.args import add_engine_args, engine_config_from_args

DSV3 = "dsv3-qlora-interleave-yarn"


def _prompts(n, seed=0, lo=8, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(2, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _greedy(llm, prompts, n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_fp8_cache_holds_twice_the_tokens(tiny_model):
    path = tiny_model(DSV3)
    kw = dict(skip_tokenizer_init=True, dtype="float32", block_size=16, kv_cache_memory="1MiB")
    bf = LLM(path, kv_cache_dtype="bfloat16", **kw).engine
    f8 = LLM(path, kv_cache_dtype="fp8", **kw).engine
    assert f8.runner.kv_caches[0].dtype == torch.float8_e4m3fn and f8.runner.kv_caches[0].element_size() == 1
    assert bf.kv_bytes_per_token == 2 * f8.kv_bytes_per_token == 2 * 3 * (32 + 8)  # 3 layers x 40-wide row
    rb, r8 = bf.startup_report(), f8.startup_report()
    assert r8["kv_cache_tokens"] == 2 * rb["kv_cache_tokens"]
    assert rb["kv_capacity_tokens_by_dtype"]["float8_e4m3fn"] == 2 * rb["kv_capacity_tokens_by_dtype"]["bfloat16"]
    assert r8["k_scales"] == [1.0, 1.0, 1.0] and r8["k_scale_source"] == "default"
    assert rb["k_scales"] is None


@pytest.mark.parametrize("variant", [DSV3, "qwen3-tied"])
def test_fp8_outputs_close_to_bf16_cache(tiny_model, variant):
    """Random tiny models have near-tied logits, so long greedy runs diverge under any perturbation;
    the 64-token / 20-prompt greedy criterion is checked on the trained default model
    (test_fp8_kv_default_model.py). Here: teacher-forced logits through the fp8 cache (context read
    back from it in 13-token chunks, tiny W) stay close, and short greedy continuations agree."""
    path = tiny_model(variant)
    kw = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=512)
    ref = LLM(path, **kw).engine  # fp32 cache
    bf = LLM(path, kv_cache_dtype="bfloat16", **kw)
    f8 = LLM(path, kv_cache_dtype="fp8", calculate_kv_scales=True, context_workspace_rows=8, **kw)
    prompts = _prompts(20, seed=1)
    p = prompts[0] + prompts[1]
    _greedy(f8, [p], 1)  # the first batch sets the scales
    want = ref.score(p)
    a, b = bf.engine.score(p, chunk_size=13), f8.engine.score(p, chunk_size=13)
    rel_bf, rel_f8 = (((x - want).abs().max() / want.abs().max()).item() for x in (a, b))
    assert rel_bf < rel_f8 < 0.1, (rel_bf, rel_f8)  # quantized (coarser than bf16) but close
    assert (b.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85
    same = sum(x == y for x, y in zip(_greedy(bf, prompts, 2), _greedy(f8, prompts, 2)))
    assert same >= 14, same


@pytest.mark.parametrize("variant", [DSV3, "qwen3-tied"])
def test_calculate_kv_scales_amax_over_200_then_frozen(tiny_model, variant):
    path = tiny_model(variant)
    kw = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=128)
    first, second = _prompts(2, seed=5)
    ref = LLM(path, **kw).engine  # fp32 cache, zero-initialised: its amax is the written rows' amax
    ref.score(first)
    want = [float(c.abs().max()) / 200 for c in ref.runner.kv_caches]
    llm = LLM(path, kv_cache_dtype="fp8", calculate_kv_scales=True, **kw)
    assert llm.engine.startup_report()["k_scale_source"].startswith("pending")
    _greedy(llm, [first], 1)  # prefill of `first` is the first batch
    layers = llm.engine.model.attention_layers()
    got = [m.k_scale for m in layers]
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    # Later layers see exactly the reference's inputs under MLA (prefill attends to this step's
    # unquantized latents); GQA prefill reads keys back from the fp8 cache, so they drift slightly.
    assert got == pytest.approx(want, rel=1e-6 if variant == DSV3 else 1e-2)
    assert all(g != 1.0 for g in got)
    _greedy(llm, [second, [c * 7 % 250 + 3 for c in second]], 4)
    assert [m.k_scale for m in layers] == got  # frozen
    rep = llm.engine.startup_report()
    assert rep["k_scale_source"] == "calculated" and rep["k_scales"] == got


def test_checkpoint_k_scales_are_loaded(tiny_model, tmp_path):
    src = tiny_model(DSV3)
    dst = tmp_path / "with_scales"
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    scales = [0.5, 0.25, 2.0]
    sd["model.layers.0.self_attn.k_scale"] = torch.tensor(scales[0])
    sd["model.layers.1.self_attn.attn.k_scale"] = torch.tensor([scales[1]])  # vLLM's inner-module naming
    sd["model.layers.2.self_attn.kv_scale"] = torch.tensor(scales[2])        # older name
    save_file(sd, str(dst / "model.safetensors"))
    llm = LLM(str(dst), skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=64,
              kv_cache_dtype="fp8")
    rep = llm.engine.startup_report()
    assert rep["k_scales"] == scales and rep["k_scale_source"] == "checkpoint"
    # The cache stores x / k_scale: dequantized rows match the fp32 cache's rows.
    p = _prompts(1, seed=9)[0]
    llm.engine.score(p)
    ref = LLM(src, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=64).engine
    ref.score(p)
    for s, c8, c32 in zip(scales, llm.engine.runner.kv_caches, ref.runner.kv_caches):
        deq = c8.float() * s
        assert torch.allclose(deq, c32, rtol=2 ** -3, atol=s * 2 ** -9)
        assert float(c8.float().abs().max()) <= 448


def test_cli_flags():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(["--model", "/x", "--kv-cache-dtype", "fp8", "--calculate-kv-scales",
                      "--max-context-workspace-rows", "4096"])
    cfg = engine_config_from_args(a)
    assert cfg.kv_cache_dtype == "fp8" and cfg.calculate_kv_scales and cfg.context_workspace_rows == 4096
    d = engine_config_from_args(p.parse_args(["--model", "/x"]))
    assert not d.calculate_kv_scales and d.context_workspace_rows == 65536
