"""Auxiliary hidden-state taps of a target model for the DFlash drafter.

Two conventions (``shared/specs/dflash.md``, ``attnres_kimi.md`` "The tap for a speculative drafter"):
- ``layer_output`` (DeepSeek, Qwen3): the residual stream after layer i (HF ``hidden_states[i + 1]``);
  the last layer's tap is taken before the final norm. Captured as layer i's output (x + residual for a
  layer that returns its residual stream apart, ``DecoderStack``).
- ``attn_res_mixture`` (Kimi-K3 / AttnRes targets): the pre-norm AttnRes mixture that the next
  sublayer sees, i.e. the input of layer i+1's ``input_layernorm``; for the last layer, the output
  mixture, i.e. the input of ``model.norm``. Tapping the raw prefix instead would silently lower
  acceptance.
Taps are captured with forward hooks (no model code changes) and cloned, because AttnRes storage
reuse may overwrite the tensor later in the same forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def resolve_mode(model: nn.Module, mode: str) -> str:
    if mode != "auto":
        if mode not in ("layer_output", "attn_res_mixture"):
            raise ValueError(f"unknown aux_hidden_state_mode {mode!r}")
        return mode
    return "attn_res_mixture" if hasattr(model.model, "output_attn_res_norm") else "layer_output"


class AuxTapper:
    """Registers hooks on ``model`` that record the taps of ``layer_ids`` while capturing.

    ``capture()`` yields a dict layer_id -> tensor [T, H]; ``concat(taps)`` gives [T, K·H] in the
    listed order. Raises ValueError for a layer id outside the model.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], mode: str = "auto"):
        layers = model.model.layers
        L = len(layers)
        for i in layer_ids:
            if not 0 <= i < L:
                raise ValueError(f"tap layer {i} is outside the target's {L} layers")
        self.layer_ids = list(layer_ids)
        self.mode = resolve_mode(model, mode)
        self._store: dict[int, torch.Tensor] | None = None
        self._consumer = None
        self._handles = []
        for i in set(layer_ids):
            if self.mode == "layer_output":
                self._handles.append(layers[i].register_forward_hook(self._post_hook(i)))
            elif i + 1 < L:
                self._handles.append(layers[i + 1].input_layernorm.register_forward_pre_hook(self._pre_hook(i)))
            else:
                self._handles.append(model.model.norm.register_forward_pre_hook(self._pre_hook(i)))

    def _record(self, i: int, t: torch.Tensor) -> None:
        if self._consumer is not None:
            # Consumed at once (e.g. quantized into the staged MXFP8 input); nothing is retained.
            for k, layer_id in enumerate(self.layer_ids):
                if layer_id == i:
                    self._consumer(k, t.detach())
        elif self._store is not None:
            self._store[i] = t.detach().clone()

    def _post_hook(self, i):
        def hook(module, args, output):
            if isinstance(output, tuple):  # a layer that carries its residual: hidden = x + residual
                output = output[0] + output[1]
            self._record(i, output)
        return hook

    def _pre_hook(self, i):
        def hook(module, args):
            self._record(i, args[0])
        return hook

    @property
    def in_layer_order(self) -> bool:
        """True when the listed ids are strictly increasing (taps then arrive in list order)."""
        return all(a < b for a, b in zip(self.layer_ids, self.layer_ids[1:]))

    @contextmanager
    def capture(self, consumer=None):
        """Record taps while the target runs. With ``consumer(tap_index, tensor)`` each tap is
        handed over as soon as the target produces it (tap_index = position in ``layer_ids``)
        and nothing is stored; otherwise a dict layer_id -> cloned tensor is yielded."""
        self._store, self._consumer = ({} if consumer is None else None), consumer
        try:
            yield self._store
        finally:
            self._store, self._consumer = None, None

    def concat(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([taps[i] for i in self.layer_ids], dim=-1)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
