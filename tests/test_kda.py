"""KDA (Kimi Delta Attention): chunked == recurrent; Kimi-Linear engine output equals HF transformers'
``KimiLinearForCausalLM`` (prefill logits, greedy, batching, chunked prefill, preemption); A_log layouts."""

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from longflash import LLM, SamplingParams
from longflash.layers.kda import kda_chunked, kda_gate, kda_recurrent, l2norm

HF_CFG = dict(architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", vocab_size=256, hidden_size=64,
              intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, mla_use_nope=True, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
              first_k_dense_replace=1, moe_layer_freq=1, moe_renormalize=True, routed_scaling_factor=2.0,
              num_expert_group=1, topk_group=1, use_grouped_topk=True, moe_router_activation_func="sigmoid",
              hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0,
              # 1-based: layers 0, 1, 3 are KDA, layer 2 is MLA
              linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2, "head_dim": 16,
                                  "short_conv_kernel_size": 4})
PROMPTS = [list(range(3, 40)), [7, 9, 11], [100 + (i * 37) % 150 for i in range(23)], [5] * 17, [42]]
GREEDY32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---- the two forms ----------------------------------------------------------------------------------
@pytest.mark.parametrize("T,chunk", [(0, 4), (1, 64), (5, 4), (37, 16), (64, 64), (70, 64), (33, 7)])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunked_equals_recurrent(T, chunk, lower_bound):
    g = torch.Generator().manual_seed(T * 100 + chunk)
    H, dk, dv = 3, 8, 12
    q = l2norm(torch.randn(T, H, dk, generator=g))
    k = l2norm(torch.randn(T, H, dk, generator=g))
    v = torch.randn(T, H, dv, generator=g)
    f = torch.randn(T, H * dk, generator=g)
    gate = kda_gate(f, torch.randn(H, generator=g) * 0.5, torch.randn(H * dk, generator=g), dk, lower_bound)
    assert gate.shape == (T, H, dk) and (gate <= 0).all()
    beta = torch.rand(T, H, generator=g)
    S0 = torch.randn(H, dk, dv, generator=g)
    o1, s1 = kda_recurrent(q, k, v, gate, beta, S0, dk ** -0.5)
    o2, s2 = kda_chunked(q, k, v, gate, beta, S0, dk ** -0.5, chunk)
    assert o2.shape == (T, H, dv) and s2.shape == (H, dk, dv)
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, s1, rtol=1e-5, atol=1e-5)
    # a split in two pieces carries the state exactly like one pass
    h = T // 2
    oa, sa = kda_chunked(q[:h], k[:h], v[:h], gate[:h], beta[:h], S0, dk ** -0.5, chunk)
    ob, sb = kda_recurrent(q[h:], k[h:], v[h:], gate[h:], beta[h:], sa, dk ** -0.5)
    torch.testing.assert_close(torch.cat([oa, ob]), o1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sb, s1, rtol=1e-5, atol=1e-5)


# ---- Kimi-Linear against HF transformers ---------------------------------------------------------------
def hf_to_checkpoint(sd: dict, cfg: dict) -> dict:
    """HF ``KimiLinearForCausalLM`` state dict -> published checkpoint names (inverse of HF's
    ``conversion_mapping['kimi_linear']``): forget_gate.* -> self_attn.*, conv1d -> {q,k,v}_conv1d,
    mlp (MoE) -> block_sparse_moe, stacked experts -> experts.{e}.w1/w3/w2."""
    out = {}
    P = cfg["linear_attn_config"]["num_heads"] * cfg["linear_attn_config"]["head_dim"]
    for name, t in sd.items():
        t = t.detach().clone().contiguous()
        if ".forget_gate." in name:
            out[name.replace(".forget_gate.", ".")] = t
        elif name.endswith("self_attn.conv1d.weight"):
            for i, c in enumerate("qkv"):
                out[name.replace("conv1d", f"{c}_conv1d")] = t[i * P:(i + 1) * P].contiguous()
        elif ".mlp.experts.gate_up_proj" in name:
            pre = name.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts")
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.w1.weight"] = t[e, :inter].contiguous()
                out[f"{pre}.{e}.w3.weight"] = t[e, inter:].contiguous()
        elif ".mlp.experts.down_proj" in name:
            pre = name.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts")
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.w2.weight"] = t[e].contiguous()
        elif ".mlp.gate." in name or ".mlp.shared_experts." in name:
            out[name.replace(".mlp.", ".block_sparse_moe.")] = t
        else:
            out[name] = t
    return out


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    torch.manual_seed(0)
    hf = KimiLinearForCausalLM(KimiLinearConfig(**HF_CFG)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if p.dim() >= 2 and "conv1d" not in n:
                p.normal_(0, 0.15)  # spread logits so greedy ties cannot happen
        for m in hf.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.uniform_(0, 0.3)
            if type(m).__name__ == "KimiLinearRMSNormGated" or (hasattr(m, "variance_epsilon") and hasattr(m, "weight")):
                m.weight.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("kimi_linear")
    (path / "config.json").write_text(json.dumps(HF_CFG))
    sd = hf_to_checkpoint(hf.state_dict(), HF_CFG)
    assert tuple(sd["model.layers.0.self_attn.A_log"].shape) == (1, 1, 2, 1)  # the legacy layout
    save_file(sd, str(path / "model.safetensors"))
    return str(path), hf


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_kimi_linear_prefill_logits_equal_hf(kimi_linear):
    path, hf = kimi_linear
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=128)
    for p in PROMPTS + [[(i * 7919) % 250 + 3 for i in range(150)]]:  # 150 tokens: three KDA chunks of 64
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].float()
        assert _rel(llm.engine.score(p), want) <= 1e-4
        assert _rel(llm.engine.score(p, chunk_size=5), want) <= 1e-4  # state carried across chunks


def test_kimi_linear_greedy_batched_chunked_preempted_equal_hf(kimi_linear, caplog):
    path, hf = kimi_linear
    refs = [_hf_greedy(hf, p, 32) for p in PROMPTS]
    kw = dict(skip_tokenizer_init=True, dtype="float32", block_size=4)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with caplog.at_level(logging.INFO, logger="longflash"):
        alone = LLM(path, num_gpu_blocks=128, **kw)
    assert [alone.generate([p], GREEDY32)[0].outputs[0].token_ids for p in prompts] == refs
    # hybrid prefix-cache policy (issue 12): off, with exactly one log line saying why
    assert not alone.engine.block_manager.enable_prefix_caching
    assert sum("prefix caching disabled" in r.getMessage() for r in caplog.records) == 1
    # 3 KDA layers x (fp32 state 2 heads x 16 x 16 + fp32 conv state 3*32 channels x 3)
    assert alone.engine.startup_report()["recurrent_state_bytes_per_request"] == 3 * (2 * 16 * 16 * 4 + 3 * 32 * 3 * 4)
    from longflash.runner.state_pool import state_bytes_per_request
    assert state_bytes_per_request(alone.engine.model.recurrent_state_layers(), torch.float32) == 3 * 3200
    batched = LLM(path, num_gpu_blocks=128, max_num_batched_tokens=5, **kw)  # chunked prefill, 5-token budget
    assert [o.outputs[0].token_ids for o in batched.generate(prompts, GREEDY32)] == refs
    small = LLM(path, num_gpu_blocks=24, max_num_batched_tokens=16, **kw)  # forces preemption (recompute)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, GREEDY32)] == refs
    assert small.engine.scheduler.num_preemptions > 0
    pool = small.engine.runner.state_pool
    assert len(pool._free) == pool.num_slots  # every slot returned


def test_a_log_layouts(kimi_linear):
    from longflash.layers.kda import KimiDeltaAttention
    m = KimiDeltaAttention(16, 4, 8)
    want = torch.arange(4.0)
    for t in (want, want.view(1, 1, 4, 1), torch.cat([want, torch.full((4,), 99.0)])):
        m._A_log_loaded = False
        m.A_log.zero_()
        m.load_checkpoint_tensor("A_log", t)
        assert torch.equal(m.A_log, want) and not m.missing_checkpoint_tensors()
    with pytest.raises(ValueError, match="A_log"):
        m.load_checkpoint_tensor("A_log", torch.zeros(3))
