"""The embedded default model (trained Kimi-K3 architecture) through the engine: logits equal the
training module's, pass-key retrieval at 512/1024/2048 tokens, the CLI main job, and packaging."""

import os
import subprocess
import sys
import zipfile

import pytest
import torch

from longflash import LLM, SamplingParams
from longflash.default_model_path import default_model_path
from longflash.training.data import load_code, make_passkey_prompt, passkey_answer_matches
from longflash.training.model import KimiK3TrainModel


@pytest.fixture(scope="module")
def llm():
    # Prefix caching and chunked prefill on (512-token step budget: 1024/2048 prompts are chunked).
    return LLM(max_num_batched_tokens=512, max_num_seqs=16, enable_prefix_caching=True)


def test_engine_logits_equal_training_module_on_held_out_text(llm):
    ref = KimiK3TrainModel.from_pretrained(default_model_path(), dtype=torch.float32)
    tok = llm.get_tokenizer()
    _, val = load_code(max_bytes_per_file=4000)
    prose = "KING. Now, my lords, what news from France? FIRST LORD. The French are come, my liege, and stand in arms."
    for text in (val[1], val[3], prose):
        ids = tok.encode(text, add_special_tokens=False)[:300]
        with torch.no_grad():
            want = ref(torch.tensor([ids]))[0]
        got = llm.engine.score(ids, chunk_size=100)  # chunked: later chunks read cached context
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel <= 1e-4, rel


@pytest.mark.parametrize("length", [512, 2048])  # 1024 lies between them (27 s of CI time)
def test_passkey_retrieval_through_engine(llm, length):
    tok = llm.get_tokenizer()
    prompts, keys = [], []
    for seed in range(50):
        p, k = make_passkey_prompt(tok, length, seed)
        prompts.append(p)
        keys.append(k)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    hits = sum(passkey_answer_matches(o.outputs[0].text, k) for o, k in zip(outs, keys))
    print(f"passkey@{length}: {hits}/50")
    assert hits >= 45, f"passkey retrieval at {length} tokens: {hits}/50"
    assert llm.engine.block_manager.prefix_cache_hits > 0  # the shared instruction prefix was reused


def test_generate_cli_main_job():
    r = subprocess.run([sys.executable, "-m", "longflash.entrypoints.cli", "generate", "--prompt",
                        "def fibonacci(n):", "--max-tokens", "64", "--temperature", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("def fibonacci(n):") and len(r.stdout) > 80
    for line in ("model loaded in", "KV cache:", "maximum concurrency", "64 tokens in"):
        assert line in r.stderr


def test_wheel_ships_the_default_model_and_drafter(tmp_path):
    root = os.path.join(os.path.dirname(__file__), "..")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                        root], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    names = set(zipfile.ZipFile(tmp_path / wheel).namelist())
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "drafter/config.json", "drafter/model.safetensors"):
        assert f"longflash/default_model/{f}" in names, f
    total = sum(i.file_size for i in zipfile.ZipFile(tmp_path / wheel).infolist() if "default_model" in i.filename)
    assert total <= 40 * 2**20  # the whole shipped bundle stays under 40 MiB
