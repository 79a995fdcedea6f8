"""CPU smoke tests of the training package (longflash/training) and the shipped default model."""
from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
import torch

from longflash.training.config import default_model_config
from longflash.training.data import (
    load_code,
    make_passkey_ids,
    make_passkey_prompt,
    passkey_answer_matches,
    tokenize_docs,
)
from longflash.training.model import KimiK3TrainModel, attn_res_mix, rms_norm
from longflash.training.tokenizer import SPECIAL_TOKENS, save_tokenizer, train_tokenizer
from longflash.training.train import BatchSampler, export, lm_loss, smoke_overrides, train_loop

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "..", "longflash", "default_model")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A 512-token BPE trained on a slice of the stdlib, and train/val token streams from it."""
    train_docs, val_docs = load_code()
    train_docs = [d for d in train_docs if 2_000 < len(d) < 40_000][:40]
    tok = train_tokenizer(train_docs, vocab_size=512)
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(tok, str(d))
    stream = tokenize_docs(tok, train_docs, eos_id=0)
    val = tokenize_docs(tok, val_docs[:3], eos_id=0)
    return tok, str(d), stream, val


def tiny_model(vocab: int, seed: int = 0) -> KimiK3TrainModel:
    torch.manual_seed(seed)
    return KimiK3TrainModel(default_model_config(vocab_size=vocab, **smoke_overrides()))


# ----------------------------------------------------------------------------- mixer


def test_mixer_one_source_is_identity():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 5, 64).to(dtype)
        out = attn_res_mix([x], torch.randn(64), torch.randn(1, 64), 1e-5)
        assert out.dtype == dtype
        assert torch.equal(out, x)


def test_mixer_matches_formula():
    torch.manual_seed(1)
    rows = [torch.randn(3, 32) * (i + 1) for i in range(4)]
    g, w = torch.randn(32), torch.randn(1, 32)
    st = torch.stack(rows, 0).double()  # [S, T, H]
    s = (w.double().reshape(-1) * g.double() * st / torch.sqrt((st**2).mean(-1, keepdim=True) + 1e-5)).sum(-1)
    p = torch.softmax(s, 0)
    ref = (p.unsqueeze(-1) * st).sum(0)
    torch.testing.assert_close(attn_res_mix(rows, g, w, 1e-5).double(), ref, rtol=1e-5, atol=1e-5)


def test_rms_norm_formula():
    x = torch.randn(4, 16)
    w = torch.randn(16)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


# ----------------------------------------------------------------------------- names


def test_state_dict_names_follow_checkpoint_spec():
    sd = KimiK3TrainModel(default_model_config()).state_dict()
    # 5 model-level + layer 0 (6 norm/AttnRes + 8 MLA + 3 dense) + 13 MoE layers (6 + 8 + 8 + 3*E)
    assert len(sd) == 5 + 17 + 13 * (22 + 3 * 8)
    for name, shape in {
        "model.embed_tokens.weight": (8192, 256),
        "lm_head.weight": (8192, 256),
        "model.output_attn_res_proj.weight": (1, 256),
        "model.layers.0.mlp.gate_proj.weight": (512, 256),
        "model.layers.3.self_attn.q_b_proj.weight": (4 * 48, 128),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": (64 + 16, 256),
        "model.layers.3.self_attn.kv_b_proj.weight": (4 * 64, 64),
        "model.layers.3.self_attn.g_proj.weight": (128, 256),
        "model.layers.13.block_sparse_moe.gate.e_score_correction_bias": (8,),
        "model.layers.13.block_sparse_moe.experts.7.w2.weight": (128, 128),
        "model.layers.13.block_sparse_moe.routed_expert_norm.weight": (128,),
        "model.layers.13.block_sparse_moe.shared_experts.down_proj.weight": (256, 128),
    }.items():
        assert tuple(sd[name].shape) == shape, name


# ----------------------------------------------------------------------------- tokenizer


def test_shipped_tokenizer_roundtrip_and_specials():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    assert [tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0 and tok.pad_token_id == 0
    assert tok.mask_token == "<|mask|>"
    for text in ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n", "ROMEO. O, she doth teach the torches!",
                 "ünïcødé 12345 \t\n  spaces"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.tokenize("key 905")[-3:] == ["9", "0", "5"]  # digits are single tokens


def test_passkey_prompt_ids_match_text():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(DEFAULT_MODEL, "tokenizer.json"))
    for n in (512, 2048):
        for seed in range(3):
            prompt, key = make_passkey_prompt(tok, n, seed)
            assert (prompt, key) == make_passkey_prompt(tok, n, seed)
            assert prompt.endswith("The pass key is") and key.isdigit() and len(key) in (5, 6)
            ids = tok.encode(prompt, add_special_tokens=False).ids
            assert n - 40 <= len(ids) <= n - 10
            rng = random.Random(f"passkey-{seed}-{n}")
            assert make_passkey_ids(tok, n, rng, with_answer=False) == ids
    assert passkey_answer_matches(" 71432.", "71432") and not passkey_answer_matches(" 714320", "71432")


# ----------------------------------------------------------------------------- training


def test_few_steps_decrease_loss(tiny_data):
    tok, _, stream, val = tiny_data
    model = tiny_model(tok.get_vocab_size())
    sampler = BatchSampler({"code": stream, "prose": stream}, tok, 0, seq_len=64, batch_size=8,
                           passkey_frac=0.25, code_frac=1.0, seed=0, passkey_min_len=48)
    held = torch.from_numpy(val[: 4 * 65].astype(np.int64)).view(4, 65)
    with torch.no_grad():
        before = float(lm_loss(model, held))
    losses = train_loop(model, sampler, steps=60, lr=3e-3, device=torch.device("cpu"), warmup=5, log_every=10,
                        log=lambda m: None)
    with torch.no_grad():
        after = float(lm_loss(model, held))
    assert math.isfinite(after)
    assert before > math.log(512) - 0.5  # starts near uniform
    assert after < before - 1.0, (before, after, losses)
    # the aux-loss-free balancing moved the router biases
    assert any(float(m.gate.e_score_correction_bias.abs().sum()) > 0 for m in model.moe_layers())


def test_export_reload_identical_logits(tiny_data, tmp_path):
    tok, tok_dir, stream, _ = tiny_data
    model = tiny_model(tok.get_vocab_size(), seed=3)
    with torch.no_grad():
        for m in model.moe_layers():
            m.gate.e_score_correction_bias.normal_(0, 0.1)
    export(model, str(tmp_path), tok_dir)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.exists(tmp_path / f)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["architectures"] == ["KimiK3ForCausalLM"] and cfg["model_type"] == "kimi_k3"
    reloaded = KimiK3TrainModel.from_pretrained(str(tmp_path))
    # the export is bf16 (router bias fp32): round the original the same way, then logits must be equal
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ids = torch.from_numpy(stream[:2 * 40].astype(np.int64)).view(2, 40)
    model.eval()
    with torch.no_grad():
        a, b = model(ids), reloaded(ids)
    assert a.dtype == torch.float32 and a.shape == (2, 40, tok.get_vocab_size())
    assert torch.equal(a, b)


def test_shipped_default_model_retrieves_passkey():
    from transformers import AutoTokenizer

    model = KimiK3TrainModel.from_pretrained(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    n = model.num_parameters()
    assert 8e6 < n["total"] < 15e6 and n["active"] < n["total"]
    prompt, key = make_passkey_prompt(tok, 512, 1)
    new = model.generate_greedy(tok.encode(prompt, add_special_tokens=False), 8, eos_token_id=0)
    assert passkey_answer_matches(tok.decode(new, skip_special_tokens=True), key)


def test_mla_matches_hf_deepseek_v3_attention():
    """MLA (gate off) with half-split RoPE equals HF transformers' DeepseekV3Attention with
    rope_interleave=False on the same weights (same tensor names, row layouts and softmax scale)."""
    M = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    from longflash.training.model import MLAAttention, rope_cos_sin

    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                           kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                           rope_interleave=False, rms_norm_eps=1e-5, vocab_size=100, num_hidden_layers=1,
                           max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    ref = M.DeepseekV3Attention(cfg, 0).eval()
    mine = MLAAttention(dict(hidden_size=64, num_attention_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8,
                             v_head_dim=12, q_lora_rank=32, kv_lora_rank=24, rms_norm_eps=1e-5, mla_use_nope=False,
                             rope_theta=10000.0, mla_use_output_gate=False)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    mine.load_state_dict(ref.state_dict(), strict=True)
    T = 10
    x = torch.randn(2, T, 64)
    cos, sin = M.DeepseekV3RotaryEmbedding(cfg)(x, torch.arange(T)[None].expand(2, -1))
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        y_ref = ref(x, (cos, sin), attention_mask=mask)[0]
        c2, s2 = rope_cos_sin(torch.arange(T), 8, 10000.0)
        y = mine(x, c2, s2)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
