"""Per-request recurrent state of linear-attention (KDA) layers: a slot pool owned by the model runner.

Each running request holds one slot; a slot holds, for every KDA layer, the fp32 recurrent state
[H, dk, dv] and the conv state [3P, K-1] (model dtype). Lifecycle:
- a slot is taken when a request is first scheduled (``slot_for``) and returned with ``free`` when the
  request finishes, is aborted or is preempted (recompute restarts from position 0, where the layers
  start from zeros regardless of the slot's contents: ``context_len == 0`` means a fresh state);
- prefill chunks carry the state from one step to the next through the slot;
- speculative verify: the layers advance the state over all B verified tokens and record, per layer,
  the state before the verify and the delta-rule inputs of the B tokens (``record_verify``); ``commit``
  then replays the accepted prefix (n <= B tokens) with the recurrent form, so the slot holds the state
  after the last accepted token — the same recurrence, in the same order, as n target-only decode steps
  (the inputs come from the verify forward's projections; no extra model forward is needed).
  Memory of the record: one state copy per layer plus [B, 3P + H*(2*dk + dv + 1)] values, freed at commit.

Prefix caching is not possible for these models (states are not checkpointed at block boundaries);
the engine turns it off with one log line.
"""

from __future__ import annotations

import torch

from longflash.layers.kda import kda_recurrent


def state_bytes_per_request(layers: list, dtype: torch.dtype) -> int:
    """Bytes of recurrent (fp32) + conv (``dtype``) state of one request over ``layers`` (KDA modules)."""
    total = 0
    for layer in layers:
        rec_shape, conv_shape = layer.state_shapes()
        total += 4 * torch.Size(rec_shape).numel() + torch.empty((), dtype=dtype).element_size() * torch.Size(conv_shape).numel()
    return total


class RecurrentStatePool:
    """Slots of per-layer recurrent + conv state.

    Args:
        layers: the KDA modules (each provides ``state_shapes()``); their ``state_pool``/``state_layer``
            attributes are set here.
        num_slots: requests that can hold state at once (max_num_seqs + 1 for ``LLMEngine.score``).
        dtype: conv state dtype (the model dtype). device: where the state lives.
    Raises RuntimeError from ``slot_for`` when every slot is taken.
    """

    def __init__(self, layers: list, num_slots: int, dtype: torch.dtype, device: torch.device):
        self.num_slots = num_slots
        self.recurrent: list[torch.Tensor] = []
        self.conv: list[torch.Tensor] = []
        for i, layer in enumerate(layers):
            rec_shape, conv_shape = layer.state_shapes()
            self.recurrent.append(torch.zeros((num_slots, *rec_shape), dtype=torch.float32, device=device))
            self.conv.append(torch.zeros((num_slots, *conv_shape), dtype=dtype, device=device))
            layer.state_pool, layer.state_layer = self, i
        self.layers = layers
        self._slots: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._verify: dict[int, dict[int, tuple]] = {}  # slot -> layer -> recorded verify inputs

    @property
    def bytes_per_request(self) -> int:
        """State bytes one request holds over all KDA layers (independent of its length)."""
        return sum(r[0].numel() * r.element_size() + c[0].numel() * c.element_size()
                   for r, c in zip(self.recurrent, self.conv))

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_request * self.num_slots

    def slot_for(self, request_id: str) -> int:
        slot = self._slots.get(request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"recurrent state pool exhausted ({self.num_slots} slots)")
            slot = self._free.pop()
            self._slots[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        """Return a request's slot (no-op for a request without one; freeing twice is allowed)."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._verify.pop(slot, None)
            self._free.append(slot)

    # ---- used by the layers inside a forward ----------------------------------------------------------
    def read(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.recurrent[layer][slot], self.conv[layer][slot]

    def write(self, layer: int, slot: int, state: torch.Tensor, conv_state: torch.Tensor) -> None:
        self.recurrent[layer][slot].copy_(state)
        self.conv[layer][slot].copy_(conv_state)

    def record_verify(self, layer: int, slot: int, state0: torch.Tensor, conv0: torch.Tensor, raw: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        """Keep what ``commit`` needs to rebuild the state after any prefix of the B verified tokens:
        the state and conv state before them, their raw projections [B, 3P] and delta-rule inputs."""
        self._verify.setdefault(slot, {})[layer] = (state0.clone(), conv0.clone(), raw, k, v, g, beta)

    # ---- used by the engine after sampling --------------------------------------------------------------
    def commit(self, request_id: str, num_accepted: int) -> None:
        """After a verify forward: make the slot hold the state after the first ``num_accepted`` of the
        verified tokens (pending token + accepted drafts). No-op when all were accepted."""
        slot = self._slots.get(request_id)
        rec = self._verify.pop(slot, None) if slot is not None else None
        if not rec:
            return
        for layer, (S0, c0, raw, k, v, g, beta) in rec.items():
            n = num_accepted
            if n >= raw.shape[0]:
                continue
            km1 = c0.shape[1]
            xe = torch.cat([c0, raw[:n].t().to(c0.dtype)], dim=1)
            _, S = kda_recurrent(k[:n], k[:n], v[:n], g[:n], beta[:n], S0, 1.0)
            self.write(layer, slot, S, xe[:, xe.shape[1] - km1:])
