"""Kimi-K3 text model: engine logits equal the full-sequence reference written from the spec
(``longflash.training.model``, no paging, no reuse); Block AttnRes mixer and bank bookkeeping."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from longflash import LLM, SamplingParams
from longflash.layers.attn_res import attn_res_mix
from longflash.training.config import default_model_config
from longflash.training.model import KimiK3TrainModel

# 7 layers, block size 3: NB = 3 bank slots, last block (layer 6) partial.
SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=7, attn_res_block_size=3, intermediate_size=96,
             moe_intermediate_size=32, routed_expert_hidden_size=32, num_attention_heads=2, q_lora_rank=32,
             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


def _save_random(path, cfg, nested=False, seed=0):
    torch.manual_seed(seed)
    ref = KimiK3TrainModel(cfg).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)  # non-uniform mixing, so a wrong bank slot changes logits
        for m in ref.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.uniform_(0, 0.3)
    sd = ref.export_state_dict(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    if nested:
        top = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
               "text_config": dict(cfg, architectures=["KimiLinearForCausalLM"], model_type="kimi_linear")}
        (path / "config.json").write_text(json.dumps(top))
        sd = {"language_model." + k: v for k, v in sd.items()}
        sd["vision_tower.patch_embed.weight"] = torch.zeros(4, 4)
    else:
        (path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(path / "model.safetensors"))
    return ref


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3") / "flat"
    ref = _save_random(path, default_model_config(**SMALL))
    return str(path), ref


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


PROMPTS = [list(range(3, 40)), [7, 9, 11], [100 + (i * 37) % 400 for i in range(23)], [5] * 17]


def test_prefill_and_chunked_logits_equal_reference(k3):
    path, ref = k3
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=128)
    for p in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([p]))[0]
        assert _rel(llm.engine.score(p), want) <= 1e-4
        assert _rel(llm.engine.score(p, chunk_size=5), want) <= 1e-4


def test_batched_decode_equals_reference_greedy(k3):
    """Batched prefill + absorbed decode steps reproduce the reference's greedy continuation."""
    path, ref = k3
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=128,
              max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == ref.generate_greedy(p, 12)


def test_nested_conditional_generation_checkpoint_loads(tmp_path, caplog):
    cfg = default_model_config(**SMALL)
    ref = _save_random(tmp_path / "nested", cfg, nested=True, seed=1)
    with caplog.at_level("WARNING", logger="longflash"):
        llm = LLM(str(tmp_path / "nested"), skip_tokenizer_init=True, dtype="float32", num_gpu_blocks=64)
    assert sum("non-text towers" in r.message for r in caplog.records) == 1
    p = PROMPTS[0]
    with torch.no_grad():
        want = ref(torch.tensor([p]))[0]
    assert _rel(llm.engine.score(p), want) <= 1e-4


def test_overlapping_kda_and_full_attn_lists_are_rejected(tmp_path):
    # KDA layers themselves are supported (tests/test_kda*.py); the 1-based lists must partition the layers.
    cfg = default_model_config(**SMALL)
    _save_random(tmp_path / "kda", cfg)
    cfg["linear_attn_config"]["kda_layers"] = [1, 2]
    (tmp_path / "kda" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="must partition"):
        LLM(str(tmp_path / "kda"), skip_tokenizer_init=True, dtype="float32", num_gpu_blocks=16)


def test_mixer_hand_computed():
    # Two sources, H = 2, g = 1, w = [1, 0], eps = 0.
    a = torch.tensor([[3.0, 4.0]])    # rms = sqrt(12.5); key = a / rms; score = 3/sqrt(12.5)
    b = torch.tensor([[1.0, -1.0]])   # rms = 1; score = 1
    s_a, s_b = 3 / math.sqrt(12.5), 1.0
    p_a = math.exp(s_a) / (math.exp(s_a) + math.exp(s_b))
    want = p_a * a + (1 - p_a) * b
    got = attn_res_mix([a, b], torch.ones(2), torch.tensor([[1.0, 0.0]]), eps=0.0)
    assert torch.allclose(got, want, atol=1e-6)
    # Scores ignore the scale of a row (keys are normalised) but values do not.
    got2 = attn_res_mix([10 * a, b], torch.ones(2), torch.tensor([[1.0, 0.0]]), eps=0.0)
    assert torch.allclose(got2, p_a * 10 * a + (1 - p_a) * b, atol=1e-5)


def test_mixer_one_source_identity():
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    assert torch.equal(attn_res_mix([x], torch.randn(16), torch.randn(1, 16), 1e-5), x)


def test_each_layer_sees_right_number_of_bank_slots(k3, monkeypatch):
    import longflash.models.kimi_k3 as k3mod
    path, _ = k3
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks=64)
    seen = []
    real = k3mod.attn_res_mix

    def spy(sources, *a, **k):
        seen.append(len(sources))
        return real(sources, *a, **k)

    monkeypatch.setattr(k3mod, "attn_res_mix", spy)
    llm.engine.score([3, 4, 5])
    L, bs = SMALL["num_hidden_layers"], SMALL["attn_res_block_size"]
    want = []
    for l in range(L):
        n, wr = math.ceil(l / bs), int(l % bs == 0)
        want += [n + 1, n + wr + 1]
    want.append(math.ceil(L / bs) + 1)  # output mixture: all NB slots + the (partial) last block
    assert seen == want
