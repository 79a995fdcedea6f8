"""Bandwidth roofline of a decode step: the bytes it must read, and the machine's copy bandwidth.

A decode (or verify) step of a memory-bound model must read, at least once: every weight it uses (all
parameters except the embedding table, of which only the step's token rows, and except the routed
experts, of which only those the step's tokens choose) and each running request's cached KV rows
(``seq_len x kv_bytes_per_token``, all layers). With DFlash the drafter's block forward adds its own
weights, the target's LM head again (the drafter's logits) and the draft pool rows of each context.
The roofline time is those bytes over the copy bandwidth; the fraction reported is roofline time /
measured step time (gpt-fast style; ``shared/DESIGN.md``, "Tests and benchmarks").

Routed experts chosen by T tokens with top-k of E are counted as ``E · (1 - (1 - k/E)^T)`` distinct
experts (the expectation for uniform, independent routing: exactly k at T = 1, nearly E at large T).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    out, seen = [], set()
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def routed_expert_groups(model: nn.Module) -> list[tuple[int, int, int]]:
    """(num_experts, top_k, bytes of all routed experts) of each MoE layer (modules with a router
    ``gate`` that has ``num_experts``/``top_k`` and ``experts``)."""
    groups = []
    for m in model.modules():
        gate, experts = getattr(m, "gate", None), getattr(m, "experts", None)
        if experts is not None and hasattr(gate, "num_experts") and hasattr(gate, "top_k"):
            groups.append((gate.num_experts, gate.top_k, _nbytes(_tensors(experts))))
    return groups


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """E · (1 - (1 - k/E)^T): distinct experts hit by T tokens routed uniformly and independently."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


class StepBytes:
    """The bytes model of one engine's decode steps, its static sums computed once.

    Args:
        model: the target CausalLM (a model built on the meta device works: only shapes and dtypes).
        kv_bytes_per_token: target KV bytes per cached token (all layers).
        drafter: the DFlash drafter module or None; draft_kv_bytes_per_token: its pool bytes per token.
    """

    def __init__(self, model: nn.Module, kv_bytes_per_token: int, drafter: nn.Module | None = None,
                 draft_kv_bytes_per_token: int = 0):
        self.groups = routed_expert_groups(model)
        dense = _nbytes(_tensors(model)) - sum(g[2] for g in self.groups)
        emb = getattr(getattr(model, "model", None), "embed_tokens", None)
        head = getattr(model, "lm_head", None)
        w = getattr(emb, "weight", None)
        self.embed_row = 0
        if w is not None and (head is None or getattr(head, "weight", None) is not w):  # untied: only T rows
            dense -= w.numel() * w.element_size()
            self.embed_row, self.vocab = w.shape[1] * w.element_size(), w.shape[0]
        self.dense = dense
        self.lm_head = _nbytes(_tensors(head)) if head is not None else 0
        self.kv_row = kv_bytes_per_token
        self.drafter = _nbytes(_tensors(drafter)) if drafter is not None else 0
        self.draft_kv_row = draft_kv_bytes_per_token

    @classmethod
    def of_engine(cls, engine) -> "StepBytes":
        p = engine.proposer
        return cls(engine.model, engine.model.kv_cache_spec().bytes_per_token(engine.kv_cache_dtype),
                   p.drafter if p is not None else None, p.kv_bytes_per_token() if p is not None else 0)

    def weights(self, num_tokens: int) -> int:
        """Target weight bytes a forward of ``num_tokens`` tokens reads (module docstring)."""
        n = self.dense
        for E, k, nbytes in self.groups:
            n += int(nbytes / E * min(E, expected_distinct_experts(E, k, num_tokens)))
        if self.embed_row:
            n += min(num_tokens, self.vocab) * self.embed_row
        return n

    def step(self, num_tokens: int, context_tokens: int, draft_requests: int = 0, draft_context_tokens: int = 0) -> int:
        """Bytes of a decode/verify step: target weights for ``num_tokens`` tokens and KV of
        ``context_tokens`` cached rows; with ``draft_requests`` drafting, the drafter's weights, the LM
        head again and the draft-pool rows of ``draft_context_tokens``."""
        n = self.weights(num_tokens) + context_tokens * self.kv_row
        if draft_requests and self.drafter:
            n += self.drafter + self.lm_head + draft_context_tokens * self.draft_kv_row
        return n


def decode_weight_bytes(model: nn.Module, num_tokens: int) -> int:
    """Weight bytes a forward of ``num_tokens`` tokens reads (``StepBytes.weights``)."""
    return StepBytes(model, 0).weights(num_tokens)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written, median of ``repeats``),
    on random data (METHOD.md: never time zeros). On the CPU a smaller buffer and a host clock."""
    if device.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
    n = nbytes // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * n * 4 / statistics.median(times) / 1e9
