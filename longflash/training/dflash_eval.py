"""Drafter metrics computed from the dense (training) forward, including what the engine will measure.

Three acceptance figures, from the least to the most faithful to ``longflash bench``:
- ``marginal_estimate``: SpecForge's 1 + Σ_k Π_{i≤k} acc_i over uniformly sampled anchors (slot
  accuracies multiplied as if independent; they are positively correlated, so this is pessimistic
  per anchor).
- ``anchor_mean``: the exact per-block acceptance 1 + (length of the matching prefix of the B−1
  drafts) averaged over every anchor (``shared/specs/dflash.md`` "One decode step": a = leading
  matches, acceptance a + 1).
- ``engine``: the engine's ``mean_acceptance_length`` of a greedy request: starting with the pending
  token right after the prompt, each step accepts τ(anchor) tokens and the next anchor is
  anchor + τ; steps near ``max_new`` draft fewer tokens (as ``LLMEngine._lookahead``); per request
  (generated − 1) / steps, then the mean over requests. Easy stretches are crossed in few steps, so
  this is the token-weighted (harmonic) mean and lies below ``anchor_mean``.
Exact for the engine when the engine's drafts equal the dense drafts (fp32 on the CPU:
``tests/test_dflash_training.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from longflash.spec_decode.dflash_dense import dense_forward


def draft_logits(drafter, target, aux: torch.Tensor, seqs: torch.Tensor, anchors: torch.Tensor,
                 block_size: int, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter logits of slots 1..B−1 for blocks ``[x_a, MASK × (B−1)]`` at each anchor a.

    Args:
        aux: [S, T, K·H] taps (any float dtype; cast to the drafter's dtype).
        seqs: [S, T] int64 tokens; anchors: [S, N] int64 with a + B <= T.
    Returns:
        logits [S, N, B−1, V] fp32 and labels [S, N, B−1] int64 (x_{a+1..a+B−1}).
    """
    S, N = anchors.shape
    B = block_size
    idx = anchors[:, :, None] + torch.arange(B, device=seqs.device)
    block_ids = torch.gather(seqs, 1, idx.view(S, -1)).view(S, N, B)
    inp = block_ids.clone()
    inp[:, :, 1:] = mask_id
    emb = drafter.embed_block(target.model.embed_tokens, inp.view(-1)).view(S, N, B, -1)
    dt = drafter.fc.weight.dtype
    with torch.autocast(seqs.device.type, dtype=torch.bfloat16, enabled=seqs.device.type == "cuda"):
        h = dense_forward(drafter, aux.to(dt), emb.to(dt), anchors)
        logits = target.lm_head(h[:, :, 1:].to(target.lm_head.weight.dtype)).float()
    return logits, block_ids[:, :, 1:]


def block_acceptance(drafts: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Exact acceptance per block: 1 + number of leading slots where drafts == labels. [..., B−1] -> [...] int64."""
    ok = (drafts == labels).long()
    return 1 + torch.cumprod(ok, dim=-1).sum(-1)


def expected_acceptance(acc: torch.Tensor) -> float:
    """SpecForge's marginal estimate 1 + Σ_k Π_{i≤k} acc_i from per-slot accuracies acc [B−1]."""
    return 1.0 + float(torch.cumprod(acc, 0).sum())


def engine_walk(tau: np.ndarray, max_new: int, block_size: int, visited: list | None = None) -> float:
    """The engine's mean acceptance length of one greedy request.

    Args:
        tau: [M] exact block acceptance at anchors P, P+1, ... (P = the pending token right after the
            prompt, i.e. the first generated token); M >= max_new − 1.
        max_new: the request's max_tokens (the first token comes from prefill).
        block_size: B (at most B − 1 drafts per step).
        visited: if a list, (anchor index, drafts verified) of every step is appended to it.
    Returns:
        (max_new − 1) / decode steps.
    """
    produced, a, steps = 1, 0, 0
    while produced < max_new:
        n = min(block_size - 1, max_new - produced - 1)
        t = min(int(tau[a]), n + 1) if n > 0 else 1
        if visited is not None:
            visited.append((a, n))
        steps += 1
        produced += t
        a += t
    return (max_new - 1) / steps if steps else 1.0


@torch.no_grad()
def evaluate(drafter, target, aux: torch.Tensor, seqs: torch.Tensor, prompt_len: int, block_size: int,
             mask_id: int, max_new: int = 128, chunk: int = 16) -> dict:
    """All three acceptance figures (module docstring) and per-slot accuracy over every anchor
    P..T−B of each sequence (P = prompt_len). aux [S, T, K·H], seqs [S, T] int64. Returns a dict."""
    S, T = seqs.shape
    B = block_size
    if T - B + 1 - prompt_len < max_new - 1:
        raise ValueError(f"sequences of {T} tokens after a {prompt_len}-token prompt are too short for max_new={max_new}")
    anchors_1d = torch.arange(prompt_len, T - B + 1, device=seqs.device)
    taus, oks = [], []
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        anchors = anchors_1d.expand(s1 - s0, -1)
        logits, labels = draft_logits(drafter, target, aux[s0:s1], seqs[s0:s1], anchors, B, mask_id)
        drafts = logits.argmax(-1)
        del logits
        taus.append(block_acceptance(drafts, labels).cpu())
        oks.append((drafts == labels).float().mean(1).cpu())  # [s, B−1]
    tau = torch.cat(taus)  # [S, M]
    acc = torch.cat(oks).mean(0)
    walk = [engine_walk(tau[i].numpy(), max_new, B) for i in range(S)]
    return {"slot_acc": [round(float(a), 4) for a in acc],
            "marginal_estimate": round(expected_acceptance(acc), 3),
            "anchor_mean": round(float(tau.float().mean()), 3),
            "engine": round(float(np.mean(walk)), 3),
            "engine_max_new": max_new, "sequences": S}
