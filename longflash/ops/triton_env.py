"""Facts of the run environment that the Triton kernels' launchers share: whether Triton's interpreter
runs the kernels (``TRITON_INTERPRET``: CPU tests), and the SM count their grids are sized by."""

from __future__ import annotations

import os

import torch

_SM_COUNT: dict[int, int] = {}


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is set to anything but "" or "0" (kernels run on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def sm_count(device: torch.device, cpu: int = 8) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached per device index); ``cpu`` for any other
    device (the interpreter runs programs one after the other, so it only shapes test grids)."""
    if device.type != "cuda":
        return cpu
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]
