"""Persistent step inputs: device tensors at fixed addresses, filled by one host -> device copy per step.

A decode/verify step's inputs (token ids, positions, slot mapping, query start locations, sequence
lengths, block table, ...) are written on the host into one pinned byte buffer through NumPy views,
then copied to the device with a single non-blocking copy. The device views never move, so a CUDA
graph captured on them replays with each step's values; on the CPU the host buffer *is* the device
buffer and the copy is skipped.
"""

from __future__ import annotations

import numpy as np
import torch


class StepInputs:
    """Named fixed-size fields of one pinned host buffer and its device twin.

    Args:
        fields: name -> (dtype, shape); dtypes int64 / int32 (laid out largest element first, so every
            field is aligned).
        device: where the device views live.
    Attributes:
        host: name -> NumPy view of the host field (write the step's values here).
        dev: name -> torch view of the device field (what the forward reads).
    """

    def __init__(self, fields: dict[str, tuple[torch.dtype, tuple[int, ...]]], device: torch.device):
        self.device = device
        order = sorted(fields, key=lambda n: -torch.empty((), dtype=fields[n][0]).element_size())
        offsets, nbytes = {}, 0
        for name in order:
            dtype, shape = fields[name]
            numel = int(np.prod(shape)) if shape else 1
            offsets[name] = nbytes
            nbytes += numel * torch.empty((), dtype=dtype).element_size()
        nbytes = (nbytes + 7) // 8 * 8
        cuda = device.type == "cuda"
        self.host_bytes = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.dev_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device) if cuda else self.host_bytes
        self.host: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        self._end: dict[str, int] = {}
        for name in order:
            dtype, shape = fields[name]
            size = (int(np.prod(shape)) if shape else 1) * torch.empty((), dtype=dtype).element_size()
            o = offsets[name]
            self.host[name] = self.host_bytes[o:o + size].view(dtype).view(shape).numpy()
            self.dev[name] = self.dev_bytes[o:o + size].view(dtype).view(shape)
            self._end[name] = o + size
        self.nbytes = nbytes
        self._copied: torch.cuda.Event | None = None

    def begin(self) -> None:
        """Wait until the previous step's copy has left the host buffer (it normally has: the step
        ended by reading its sampled tokens), so it may be overwritten."""
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()

    def copy_to_device(self) -> None:
        """One non-blocking host -> device copy of the whole buffer (a no-op on the CPU)."""
        if self.dev_bytes is self.host_bytes:
            return
        self.dev_bytes.copy_(self.host_bytes, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()


def to_device_async(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small list as a device tensor without a blocking copy: staged in pinned memory on CUDA
    (the caching host allocator keeps the staging block alive until the copy has run)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
