"""Byte-level BPE tokenizer for the default model (HF `tokenizers`), saved in the HF format so that
`transformers.AutoTokenizer.from_pretrained(dir)` loads it offline.

Pre-tokenization: every digit is its own token (`Digits(individual_digits=True)`, as in Llama), then
GPT-2 byte-level splitting. Single digits make pass-key copying a clean token-level copy.
No BOS is added by `encode`; documents are separated by `<|endoftext|>` in training.

Special tokens (ids fixed, in this order, before the learned merges):
  0 `<|endoftext|>` (eos, bos, pad), 1 `<|im_start|>`, 2 `<|im_end|>`, 3 `<|mask|>`.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"

# ChatML; `add_generation_prompt` opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Train the byte-level BPE on an iterable of documents. Returns a `tokenizers.Tokenizer` whose
    ids 0..3 are SPECIAL_TOKENS; the 256 byte symbols are always in the vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_chunks(texts), trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def _chunks(texts: Iterable[str], size: int = 1 << 16) -> Iterator[str]:
    for t in texts:
        for i in range(0, len(t), size):
            yield t[i : i + size]


def save_tokenizer(tok: Tokenizer, out_dir: str, model_max_length: int = 4096) -> None:
    """Write tokenizer.json and tokenizer_config.json (ChatML chat_template, special tokens)."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i, s in enumerate(SPECIAL_TOKENS)
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"],
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "mask_token": MASK_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "mask_token": MASK_TOKEN,
                   "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"]}, f, indent=2)


def load_tokenizer(path: str) -> Tokenizer:
    """Load `tokenizers.Tokenizer` from a directory or a tokenizer.json path."""
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return Tokenizer.from_file(path)


def token_byte_lengths(tok: Tokenizer) -> list[int]:
    """Number of UTF-8 bytes each token id stands for (0 for special tokens), for bits/byte."""
    vocab = tok.get_vocab()
    out = [0] * tok.get_vocab_size()
    specials = set(SPECIAL_TOKENS)
    for s, i in vocab.items():
        out[i] = 0 if s in specials else len(s)  # byte-level: one symbol per byte
    return out
