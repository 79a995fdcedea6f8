"""Every loading error names the problem (issue: engine core)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from longflash import LLM
from longflash.models.loader import ModelLoadError


@pytest.fixture
def broken(tiny_model, tmp_path):
    """A fresh copy of a tiny DeepSeek-V3 checkpoint to break."""
    src = tiny_model("dsv3-qlora-interleave-yarn")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _load(path):
    return LLM(str(path), skip_tokenizer_init=True, dtype="float32", num_gpu_blocks=16)


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_architecture_lists_supported(broken):
    _edit_config(broken, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"unsupported architecture LlamaForCausalLM.*DeepseekV3ForCausalLM.*Qwen3ForCausalLM"):
        _load(broken)


def test_missing_tensor_is_named(broken):
    sd = load_file(broken / "model.safetensors")
    del sd["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(sd, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.self_attn\.kv_b_proj\.weight'"):
        _load(broken)


def test_shape_mismatch_names_tensor_and_shapes(broken):
    sd = load_file(broken / "model.safetensors")
    sd["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 60)
    save_file(sd, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight' has shape \[64, 60\] .*expected \[64, 64\]"):
        _load(broken)


def test_unsupported_config_value(broken):
    _edit_config(broken, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match=r"unsupported config value hidden_act='gelu_pytorch_tanh'"):
        _load(broken)
    _edit_config(broken, hidden_act="silu", rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"unsupported config value rope_scaling.type='longrope'"):
        _load(broken)


def test_no_safetensors(broken):
    os.remove(broken / "model.safetensors")
    (broken / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights .*only safetensors"):
        _load(broken)


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json") as e:
        _load(tmp_path)
    assert "Hugging Face Hub" not in str(e.value)   # the directory exists: no hub hint


def test_a_hub_name_says_only_local_directories_load(tmp_path):
    """``LLM("gpt2")`` (a hub id, no such directory): the error says checkpoints are loaded from local
    directories and how to download one (found by a fresh user)."""
    with pytest.raises(ModelLoadError, match="no directory 'gpt2'.*does not download from the Hugging Face Hub"):
        _load("gpt2")


def test_sharded_checkpoint_with_index_loads_and_missing_shard_is_named(broken):
    sd = load_file(broken / "model.safetensors")
    os.remove(broken / "model.safetensors")
    names = sorted(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, broken / fname)
        weight_map.update({k: fname for k in keys})
    (broken / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    llm = _load(broken)
    assert llm.engine.model.model.layers[1].self_attn.kv_b_proj.weight.shape == (4 * 32, 32)
    os.remove(broken / "model-00002-of-00002.safetensors")
    with pytest.raises(ModelLoadError, match="shard 'model-00002-of-00002.safetensors' .* is missing"):
        _load(broken)


def test_bad_prompts_raise(tiny_model):
    from longflash import SamplingParams
    llm = _load(tiny_model("dsv3-qlora-interleave-yarn"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 999999]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=-1)
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_reject_nan_and_make_tiny_temperatures_greedy():
    from longflash import SamplingParams
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=float("nan"))
    assert SamplingParams(temperature=1e-45).temperature == 0.0


def test_engine_budget_and_max_model_len_checks(tiny_model):
    path = tiny_model("dsv3-qlora-interleave-yarn")
    with pytest.raises(ValueError, match="exceeds the .* memory available"):
        LLM(path, skip_tokenizer_init=True, dtype="float32", kv_cache_memory="1000TiB")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(path, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks=4096, max_model_len=10_000)
