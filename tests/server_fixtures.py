"""Fixtures for the server tests: a tiny random Qwen3 checkpoint with a real trained tokenizer, and a
``longflash serve`` subprocess on a free localhost port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello server!",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "Continuous batching lets many requests share one forward pass of the model.",
    "Paged attention stores keys and values in fixed-size blocks. 0123456789",
] * 20


def make_tiny_model(path: str, vocab_size: int = 512, seed: int = 0) -> str:
    """Write a random 2-layer Qwen3 (hidden 64) with a byte-level BPE tokenizer to ``path``.

    The tokenizer has ChatML special tokens, ``eos_token`` <|im_end|> and a ``chat_template``.
    Returns ``path``.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    os.makedirs(path, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     bos_token=None, unk_token=None)
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(path)
    eos = hf_tok.convert_tokens_to_ids("<|im_end|>")

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      eos_token_id=eos, pad_token_id=hf_tok.pad_token_id, tie_word_embeddings=False,
                      torch_dtype="float32")
    model = Qwen3ForCausalLM(cfg)
    # Larger logits than the default init so that greedy decoding is not a near-tie everywhere.
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)
    return path


@contextmanager
def running_engine(model_dir: str, max_model_len: int = 128, num_gpu_blocks: int = 32):
    """An in-process AsyncEngine over ``model_dir`` (started; shut down on exit), for ASGI-transport tests."""
    from longflash.config import EngineConfig
    from longflash.engine.llm_engine import LLMEngine
    from longflash.entrypoints.server.async_engine import AsyncEngine
    from longflash.entrypoints.server.metrics import ServerMetrics
    ae = AsyncEngine(LLMEngine(EngineConfig(model=model_dir, max_model_len=max_model_len,
                                            num_gpu_blocks=num_gpu_blocks)), ServerMetrics("m"))
    ae.start()
    try:
        yield ae
    finally:
        ae.shutdown()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``longflash serve`` in a subprocess; ``url`` is its base URL. Use as a context manager."""

    def __init__(self, model_dir: str, *extra: str, startup_timeout: float = 120.0, new_session: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "longflash.entrypoints.cli", "serve", model_dir, "--port", str(self.port),
               *extra]
        self.log_path = os.path.join(os.path.dirname(model_dir), f"server-{self.port}.log")
        self._log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # new_session: the server leads its own process group (a test can signal the group, as a terminal's
        # Ctrl-C does, without signalling pytest)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=new_session)
        deadline = time.time() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become healthy:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
