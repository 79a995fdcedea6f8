"""Facts of the run environment that the Triton kernels' launchers share: whether Triton's interpreter
runs the kernels (``TRITON_INTERPRET``: CPU tests), the SM count their grids are sized by, and whether
a kernel may be launched with programmatic dependent launch."""

from __future__ import annotations

import os

import torch

_SM_COUNT: dict[int, int] = {}
_PDL_DEVICES: dict[int, bool] = {}

# Module switch for programmatic dependent launch (the benchmark's A/B; see :func:`pdl_enabled`).
PDL = True


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


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels written for it are launched with programmatic dependent launch (PDL, sm_90+:
    ``griddepcontrol``; Triton's ``launch_pdl`` and ``gdc_wait`` / ``gdc_launch_dependents``): the kernel
    may start while the previous one in the stream finishes, reads only weights until ``gdc_wait`` (which
    returns once that kernel has completed and its writes are visible), and lets the next PDL kernel
    start early. In a CUDA graph of a decode step this hides part of each launch gap behind the previous
    kernel (cuBLAS's Hopper kernels do the same). True on CUDA devices of compute capability ≥ 9 when
    ``PDL`` is on and the interpreter is off (it cannot run the inline PTX)."""
    if not PDL or device.type != "cuda" or interpreting():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL_DEVICES:
        _PDL_DEVICES[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _PDL_DEVICES[idx]
