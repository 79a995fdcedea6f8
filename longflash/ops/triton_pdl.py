"""Programmatic dependent launch (PDL) for the Triton kernels that use it (GEMV, RMSNorm): the device
functions and the launch options, with a fallback for Triton releases without them.

A kernel written for PDL calls ``gdc_launch_dependents()`` (the next PDL kernel in the stream may start)
and ``gdc_wait()`` (returns once the previous kernel has completed and its writes are visible) under a
``PDL`` constexpr, reads only weights before the wait, and is launched with ``**launch_options(pdl)``.
``pdl_for(device)``: whether to do so (``triton_env.pdl_enabled`` and the functions exist). Triton's
``triton.language.extra.cuda`` provides them (3.6 here); without them PDL stays off and the names are
no-op device functions, so the kernels still compile.
"""

from __future__ import annotations

import torch
import triton

from longflash.ops.triton_env import pdl_enabled

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # an older Triton: PDL off, the calls are compiled out by the PDL constexpr anyway
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


def pdl_for(device: torch.device) -> bool:
    """Whether a PDL-ready kernel on ``device`` is launched with PDL (see the module docstring)."""
    return HAS_GDC and pdl_enabled(device)


def launch_options(pdl: bool) -> dict:
    """Keyword arguments of the kernel launch: ``launch_pdl=True`` only when PDL is on (an older Triton
    does not know the option)."""
    return {"launch_pdl": True} if pdl else {}
