"""Regenerated training data for the DFlash drafter (SpecForge recipe step 1, ``shared/specs/dflash.md``).

The drafter must learn the *target's* continuations, so prompts are random windows of the corpora and
the text after them is the target's own greedy output (KV-cached, ``kv_cache.greedy_generate``). The
token arrays are saved (``save_regen``) so that a later run can reuse them (``load_regen``); the
target's aux taps are recomputed from the tokens (``capture_taps``, one full forward per chunk).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Callable

import numpy as np
import torch

from longflash.spec_decode.taps import AuxTapper
from longflash.training.kv_cache import greedy_generate

SPLITS = ("code_train", "prose_train", "code_val", "prose_val")


def sample_prompts(tokens: np.ndarray, n: int, prompt_len: int, rng: np.random.Generator) -> np.ndarray:
    """n random windows [n, prompt_len] (int64) of a token stream. Raises ValueError when the stream
    is not longer than prompt_len."""
    if len(tokens) <= prompt_len:
        raise ValueError(f"token stream of {len(tokens)} tokens is too short for {prompt_len}-token prompts")
    starts = rng.integers(0, len(tokens) - prompt_len, size=n)
    return np.stack([tokens[s:s + prompt_len] for s in starts]).astype(np.int64)


def regenerate(target, prompts: np.ndarray, gen_len: int, batch: int, device: torch.device,
               budget_s: float | None = None, log: Callable[[str], None] = print) -> np.ndarray:
    """Greedy continuations of ``prompts`` [N, P] in batches of ``batch`` rows.

    The target runs in its own parameter dtype (bf16 on the GPU: the checkpoint's dtype). With
    ``budget_s``, no new batch starts once that many seconds have passed (at least one batch runs),
    so fewer than N rows may come back. Returns uint16 [N', P + gen_len].
    """
    t0 = time.time()
    out = []
    for b0 in range(0, prompts.shape[0], batch):
        if out and budget_s is not None and time.time() - t0 > budget_s:
            log(f"regeneration budget {budget_s:.0f}s reached after {b0} of {prompts.shape[0]} rows")
            break
        p = torch.from_numpy(prompts[b0:b0 + batch]).to(device)
        seqs = greedy_generate(target, p, gen_len)
        out.append(seqs.to(torch.int32).cpu().numpy().astype(np.uint16))
        log(f"  regenerated {b0 + p.shape[0]}/{prompts.shape[0]} rows of {seqs.shape[1]} tokens, "
            f"{time.time() - t0:.1f}s")
    return np.concatenate(out)


@torch.no_grad()
def capture_taps(target, tapper: AuxTapper, seqs: torch.Tensor, batch: int) -> torch.Tensor:
    """The target's aux taps of every position: seqs [N, T] int64 -> [N, T, K·H] bf16 (on seqs' device),
    written chunk by chunk into one preallocated tensor (no concatenation copy: tens of GiB on the GPU)."""
    out = None
    for b0 in range(0, seqs.shape[0], batch):
        with tapper.capture() as taps:
            target.hidden_states(seqs[b0:b0 + batch])
        f = tapper.concat(taps)
        if out is None:
            out = torch.empty(seqs.shape[0], seqs.shape[1], f.shape[-1], dtype=torch.bfloat16, device=seqs.device)
        out[b0:b0 + batch] = f
        del f, taps
    return out


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_regen(out_dir: str, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """Write ``code_train.npz``, ``prose_train.npz``, ``val.npz`` (code_val, prose_val; compressed
    uint16 token arrays [N, P + G]) and ``meta.json`` under out_dir (four files: what a device call
    can bring back is limited in files and bytes)."""
    os.makedirs(out_dir, exist_ok=True)
    for k in ("code_train", "prose_train"):
        np.savez_compressed(os.path.join(out_dir, f"{k}.npz"), tokens=arrays[k].astype(np.uint16))
    np.savez_compressed(os.path.join(out_dir, "val.npz"), code_val=arrays["code_val"].astype(np.uint16),
                        prose_val=arrays["prose_val"].astype(np.uint16))
    sizes = {f: os.path.getsize(os.path.join(out_dir, f)) for f in ("code_train.npz", "prose_train.npz", "val.npz")}
    meta = dict(meta, shapes={k: list(arrays[k].shape) for k in SPLITS}, file_bytes=sizes)
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)


def load_regen(in_dir: str) -> tuple[dict[str, np.ndarray], dict]:
    """Inverse of ``save_regen``. Raises FileNotFoundError / ValueError naming a missing or bad file."""
    with open(os.path.join(in_dir, "meta.json")) as f:
        meta = json.load(f)
    arrays = {}
    for k in ("code_train", "prose_train"):
        with np.load(os.path.join(in_dir, f"{k}.npz")) as z:
            arrays[k] = z["tokens"]
    with np.load(os.path.join(in_dir, "val.npz")) as z:
        arrays.update(code_val=z["code_val"], prose_val=z["prose_val"])
    T = meta["prompt_len"] + meta["gen_len"]
    for k, a in arrays.items():
        if a.ndim != 2 or a.shape[1] != T:
            raise ValueError(f"{in_dir}: {k} has shape {a.shape}, expected [N, {T}] (meta.json)")
    return arrays, meta
