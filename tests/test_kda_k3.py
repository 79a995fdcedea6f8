"""Hybrid Kimi-K3 (KDA + MLA, Block AttnRes, latent MoE with MXFP4 experts): the tiny config of
``shared/specs/kimi_k3_checkpoint.md`` §7 loads (396 tensors, padded A_log) and generates; batching, chunked
prefill and preemption change nothing; DFlash verify with KDA state rollback equals target-only greedy."""

import copy
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from longflash import LLM, SamplingParams
from longflash.layers.mxfp4 import quantize_mxfp4
from longflash.models.kimi_k3 import KimiK3ForCausalLM, text_config
from tiny_models import make_drafter

QCFG = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
        "kv_cache_scheme": None, "global_compression_ratio": None,
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"], "input_activations": None,
                                      "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                                                  "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8",
                                                  "observer": "minmax", "observer_kwargs": {}, "actorder": None,
                                                  "block_structure": None, "zp_dtype": None}}}}
TEXT = {
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "dtype": "bfloat16", "vocab_size": 1024,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 24,
    "mla_use_nope": True, "mla_use_output_gate": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 64,
    "routed_expert_hidden_size": 32, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
    "routed_scaling_factor": 1.0, "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "attn_res_block_size": 2, "rms_norm_eps": 1e-05, "max_position_embeddings": 4096, "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False, "use_cache": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6], "num_heads": 4, "head_dim": 32,
                           "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    "quantization_config": QCFG}
CONFIG = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "dtype": "bfloat16",
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False, "ignore_index": -100,
          "media_placeholder_token_id": 1000, "image_placeholder": "<|kimi_image_placeholder|>", "text_config": TEXT}
EXPERT = re.compile(r"(.*\.block_sparse_moe\.experts\.\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
PACKED = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
PROMPTS = [list(range(3, 40)), [7, 9, 11], [100 + (i * 37) % 900 for i in range(23)], [5] * 17]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def random_k3_checkpoint(seed: int = 0) -> dict:
    """Checkpoint tensors of the tiny config, names and shapes as published (MXFP4 experts, padded A_log)."""
    plain = copy.deepcopy(TEXT)
    del plain["quantization_config"]
    with torch.device("meta"):
        model = KimiK3ForCausalLM(plain)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("A_log"):
            # stored padded to head_dim (32 values, the first num_heads=4 used), as in Kimi-K3
            sd[name] = torch.log(torch.empty(32).uniform_(1, 16, generator=g))
        elif name.endswith("dt_bias"):
            sd[name] = torch.empty(p.shape).uniform_(-3, 0, generator=g)
        elif name.endswith("e_score_correction_bias"):
            sd[name] = torch.empty(p.shape).uniform_(0, 0.3, generator=g)
        elif "norm" in name:
            sd[name] = torch.empty(p.shape).uniform_(0.5, 1.5, generator=g)
        elif name.endswith("_res_proj.weight"):
            sd[name] = torch.randn(p.shape, generator=g) * 0.5
        elif "conv1d" in name:
            sd[name] = torch.randn(p.shape, generator=g) * 0.5
        else:
            sd[name] = torch.randn(p.shape, generator=g) * (0.3 if ".experts." in name else 0.15)
    out = {}
    for name, t in sd.items():
        m = EXPERT.match(name)
        if m:
            packed, scale = quantize_mxfp4(t)
            out[f"language_model.{m.group(1)}.{PACKED[m.group(2)]}.weight_packed"] = packed
            out[f"language_model.{m.group(1)}.{PACKED[m.group(2)]}.weight_scale"] = scale
        else:
            out["language_model." + name] = t
    return out


@pytest.fixture(scope="module")
def k3_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3_kda")
    sd = random_k3_checkpoint()
    assert len(sd) == 396  # kimi_k3_checkpoint.md §7 tensor count
    assert sd["language_model.model.layers.0.self_attn.A_log"].shape == (32,)
    assert sd["language_model.model.layers.0.self_attn.q_conv1d.weight"].shape == (128, 1, 4)
    assert sd["language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed"].dtype == torch.uint8
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file(sd, str(path / "model.safetensors"))
    return str(path)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


KW = dict(skip_tokenizer_init=True, dtype="float32", block_size=4)


def test_k3_tiny_loads_generates_and_batching_chunking_preemption_are_invisible(k3_tiny):
    alone = LLM(k3_tiny, num_gpu_blocks=128, **KW)
    model = alone.engine.model
    kinds = [type(layer.self_attn).__name__ for layer in model.model.layers]
    assert kinds == ["KimiDeltaAttention"] * 3 + ["MLAAttention", "KimiDeltaAttention", "MLAAttention"]
    assert model.kv_cache_spec().num_layers == 2
    from safetensors.torch import load_file
    stored = load_file(f"{k3_tiny}/model.safetensors")["language_model.model.layers.0.self_attn.A_log"]
    assert torch.equal(model.model.layers[0].self_attn.A_log, stored[:4])  # first num_heads of the padded 32
    refs = [_ids(alone.generate([{"prompt_token_ids": p}], GREEDY))[0] for p in PROMPTS]
    assert all(len(r) == 24 for r in refs) and len({tuple(r) for r in refs}) == len(refs)
    # prefill in 5-token chunks carries the KDA state: same logits as one chunk
    for p in PROMPTS:
        one, chunked = alone.engine.score(p), alone.engine.score(p, chunk_size=5)
        assert ((one - chunked).abs().max() / one.abs().max()).item() <= 1e-4
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    batched = LLM(k3_tiny, num_gpu_blocks=128, max_num_batched_tokens=5, **KW)
    assert _ids(batched.generate(prompts, GREEDY)) == refs
    small = LLM(k3_tiny, num_gpu_blocks=20, max_num_batched_tokens=16, **KW)
    assert _ids(small.generate(prompts, GREEDY)) == refs
    assert small.engine.scheduler.num_preemptions > 0


def test_k3_tiny_dflash_verify_with_state_rollback_equals_target_only(k3_tiny, tmp_path):
    target = text_config(CONFIG)
    base = LLM(k3_tiny, num_gpu_blocks=256, **KW)
    refs = _ids(base.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    d = make_drafter(str(tmp_path / "drafter"), target, block_size=4)
    spec = LLM(k3_tiny, speculative_config={"method": "dflash", "model": d}, num_gpu_blocks=256, **KW)
    assert _ids(spec.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)) == refs  # random drafter, batched
    # Every acceptance count 0..B-1: an oracle proposer that knows the continuation and corrupts draft j.
    eng = spec.engine
    B = eng.proposer.block_size
    full = PROMPTS[0] + refs[0]
    seen, calls = set(), iter(range(10_000))

    def oracle(reqs, masks=None):
        out = []
        for _, s, n, _ in reqs:
            j = next(calls) % B
            drafts = full[s + 1:s + 1 + n]
            drafts += [0] * (n - len(drafts))
            if j < n:
                drafts[j] = (drafts[j] + 1) % 1024
            seen.add(min(j, n))
            out.append(drafts)
        return out

    eng.proposer.propose = oracle
    assert _ids(spec.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY))[0] == refs[0]
    assert seen >= set(range(B))
    assert eng.stats.spec_num_accepted_tokens > 0
    pool = eng.runner.state_pool
    assert len(pool._free) == pool.num_slots and not pool._verify


def test_flat_kimi_linear_architecture_with_attn_res_is_built_as_k3(k3_tiny, tmp_path):
    """K3's text config on its own (architectures KimiLinearForCausalLM, no language_model. prefix) is the
    same model: the registry's build_kimi_linear dispatches on attn_res_block_size."""
    from safetensors.torch import load_file
    sd = {k[len("language_model."):]: v for k, v in load_file(f"{k3_tiny}/model.safetensors").items()}
    (tmp_path / "config.json").write_text(json.dumps(TEXT))
    save_file(sd, str(tmp_path / "model.safetensors"))
    flat = LLM(str(tmp_path), num_gpu_blocks=64, **KW)
    nested = LLM(k3_tiny, num_gpu_blocks=64, **KW)
    assert type(flat.engine.model).__name__ == "KimiK3ForCausalLM"
    p = PROMPTS[2]
    assert torch.equal(flat.engine.score(p), nested.engine.score(p))
