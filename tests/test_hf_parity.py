"""Engine logits and greedy generations equal HF transformers' on tiny random checkpoints."""

import pytest
import torch

from longflash import LLM, SamplingParams
from tiny_models import VARIANTS

PROMPTS = [
    [5, 17, 99, 3, 42, 7, 8, 200, 31],
    [12, 250, 4],
    [77] * 3 + list(range(20, 60)),
    [9, 8, 7, 6, 5, 4, 3, 2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 21],
    [100, 101],
    [33, 66, 99, 132, 165, 198, 231, 13, 46, 79, 112, 145, 178, 211, 244, 20, 53, 86, 119, 152, 185],
]


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_hf(tiny_model, variant):
    path = tiny_model(variant)
    hf = _hf(path)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=256)
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        got = llm.engine.score(prompt)
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-4, f"{variant}: prefill logits differ from HF (rel {rel:.2e})"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_matches_hf(tiny_model, variant):
    path = tiny_model(variant)
    hf = _hf(path)
    hf.generation_config.eos_token_id = None  # generate exactly 32 tokens, EOS included
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, f"{variant}: greedy tokens differ from HF for prompt {prompt[:5]}..."
        assert out.outputs[0].finish_reason == "length"
