"""Stream the next weights into L2 on a side stream while a few-token decode step runs (CUDA).

Why: at batch 1 a decode step of the DeepSeek-V3-shaped benchmark model reads 1.96 GB of weights in a
1.73 ms CUDA graph, 0.27 of the H200's copy bandwidth (``benchmarks/NOTES.md``, session 28): each GEMV
waits out HBM latency with a few MB in flight, and between the GEMVs the attention, rotary, cache-write and
routing kernels leave HBM idle. Fusing launches did not help (session 28's RMSNorm fusions: 95 launches
fewer, the same graph time). Here, once decoder layer i's query projections have run (MLA's
``prefetch_hook``), a small kernel on a side stream (``ops/l2_prefetch.prefetch_ranges``: plain
``prefetch.global.L2`` instructions, 32 programs) asks HBM for the layer's later weights in the order the step
reads them (``layer.decode_weights()`` after the first ``SKIP``: W_UK, kv_b for W_UV, o_proj, the router and
the shared experts; then layer i + 1's q_a/kv_a), so that those kernels read L2 while rotary, cache write and
attention leave HBM idle. A first form that started at the layer's start, beside the q_a/kv_a and q_b GEMVs,
made the batch-1 graph slower: 1.800 against 1.690 ms (``benchmarks/results/e2e_decode_weight_prefetch_first
.h200.md``). The side stream forks from the main stream there and joins it at the layer's end (inside a CUDA
graph capture these are graph edges, so the prefetch runs beside the layer's kernels). It changes no value:
logits are bitwise those without it.

Applies to a :class:`~longflash.models.base.DecoderStack` whose layers have ``decode_weights()`` and an MLA
``self_attn`` (pre-norm layers of MLA / MoE / gated-MLP sub-layers), on CUDA, for at most ``MAX_TOKENS`` tokens per forward
(``ENABLED`` switches it; the baseline of ``benchmarks/e2e_decode.py --baselines no-weight-prefetch``).
"""

from __future__ import annotations

import torch

ENABLED = True
MAX_TOKENS = 2  # forwards of at most this many tokens (batch-1 / batch-2 decode) prefetch
MIN_BYTES = 1 << 16  # smaller tensors (norm weights, biases) are not worth a range
SKIP = 2  # a layer's first decode weights that are read before its prefetch starts (MLA's q_a/kv_a and q_b)


def plan_ranges(layers) -> list[list[torch.Tensor]] | None:
    """Per layer i, the tensors to prefetch once its query projections have run: its ``decode_weights()`` after
    the first ``SKIP`` (the q_a/kv_a and q_b weights, read before the prefetch starts), then layer i + 1's first.
    None when a layer has no ``decode_weights`` or lists none."""
    per_layer = []
    for layer in layers:
        fn = getattr(layer, "decode_weights", None)
        ws = fn() if fn is not None else None
        if not ws:
            return None
        per_layer.append(list(ws))
    return [per_layer[i][SKIP:] + (per_layer[i + 1][:1] if i + 1 < len(per_layer) else [])
            for i in range(len(per_layer))]


class WeightPrefetcher:
    """Per layer i, the tensors to prefetch once its query projections ran (``ranges[i]``, :func:`plan_ranges`).
    ``start(i)`` (through the attention's ``prefetch_hook``) / ``finish(i)`` fork and join the side stream."""

    def __init__(self, ranges: list[list[torch.Tensor]]):
        self.ranges = ranges
        self.stream: torch.cuda.Stream | None = None
        self._done: list[torch.cuda.Event | None] = [None] * len(ranges)
        self.active = False  # inside a forward that prefetches (DecoderStack.forward sets it)

    def hook(self, i: int):
        """The callable layer i's attention calls once its query projections ran (``MLAAttention.prefetch_hook``):
        launches layer i's prefetch when the current forward prefetches."""
        def run():
            if self.active:
                self.start(i)
        return run

    @classmethod
    def build(cls, layers) -> "WeightPrefetcher | None":
        """From decoder layers (:func:`plan_ranges`), keeping contiguous CUDA tensors of at least
        ``MIN_BYTES``, and sets each layer's ``self_attn.prefetch_hook``; None when a layer lists no weights,
        an attention has no ``prefetch_hook`` or nothing is left to prefetch."""
        plan = plan_ranges(layers)
        if plan is None:
            return None
        ranges = [[w for w in r if w.is_cuda and w.is_contiguous() and w.numel() * w.element_size() >= MIN_BYTES]
                  for r in plan]
        if not any(ranges) or not all(hasattr(layer.self_attn, "prefetch_hook") for layer in layers):
            return None
        pf = cls(ranges)
        for i, layer in enumerate(layers):
            layer.self_attn.prefetch_hook = pf.hook(i)
        return pf

    def applies(self, x: torch.Tensor) -> bool:
        """Whether a forward of hidden x [T, H] prefetches: ``ENABLED``, CUDA, T <= ``MAX_TOKENS``, and not in
        Triton's interpreter."""
        from longflash.ops.triton_env import interpreting
        return ENABLED and x.is_cuda and 0 < x.shape[0] <= MAX_TOKENS and not interpreting()

    def start(self, i: int) -> None:
        """Fork the side stream from the current stream and launch layer i's prefetch on it."""
        from longflash.ops.l2_prefetch import prefetch_ranges
        if not self.ranges[i]:
            return
        main = torch.cuda.current_stream()
        if self.stream is None or self.stream.device != main.device:
            self.stream = torch.cuda.Stream(device=main.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            prefetch_ranges(self.ranges[i])
            done = torch.cuda.Event()
            done.record(self.stream)
        self._done[i] = done

    def finish(self, i: int) -> None:
        """Join: the current stream waits for layer i's prefetch (a no-op if none was launched)."""
        done, self._done[i] = self._done[i], None
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
