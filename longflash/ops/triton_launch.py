"""Cached launch plans for Triton kernels called many times with the same argument layout.

Why: a Triton kernel launched from Python pays host time before the GPU sees it: the caller's argument
checks and config lookup, then Triton's launcher (binding and specializing every argument, building the
cache key, launch metadata, the hook chain). In the first H200 run six back-to-back MXFP8 quantize
launches took 0.26 ms for ~0.16 ms of GPU work, i.e. ~40 µs of host time per launch against a 25 µs
kernel, so the staged drafter input (one launch per tap) left the GPU idle (``benchmarks/NOTES.md``).

How: a caller builds a *layout key* from everything its checks and Triton's specialization depend on
except the pointer values: dtypes, shapes, strides, devices, scalar arguments, tile options, whether
each pointer is 16-byte aligned (Triton's only value-dependent pointer specialization), and the
current CUDA device. The first call with a key runs the full path (checks, ``kernel[grid](...)``) and
stores the compiled kernel, grid and scalar arguments it used; later calls with the same key launch
that compiled kernel directly on the current stream (``CompiledKernel.run``, what Triton itself calls
last). A hit therefore launches exactly what the full path would have launched for the same arguments.

Used only where it is safe and useful: CUDA tensors, eager mode (``torch.compile`` traces the plain
``kernel[grid]`` call as a user-defined Triton kernel), no Triton launch hooks installed (profilers),
``ENABLED`` true. Plans are per process, at most ``MAX_PLANS`` (the cache is cleared when full).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

# Module switch: the benchmark times the staged path with and without plans.
ENABLED = True
MAX_PLANS = 1024

_PLANS: dict[tuple, tuple] = {}
_TRITON = None  # (triton.knobs.runtime, triton.runtime.driver), imported on the first launch from a plan


# ``CompiledKernel.run``'s argument list is Triton-internal; plans are used only with the Triton
# release they were checked against (the lent H200's 3.6), other releases take the normal launch path.
CHECKED_TRITON = ("3.6.",)
_VERSION_OK: bool | None = None


def _version_ok() -> bool:
    global _VERSION_OK
    if _VERSION_OK is None:
        import triton
        _VERSION_OK = triton.__version__.startswith(CHECKED_TRITON)
    return _VERSION_OK


def usable(t: torch.Tensor) -> bool:
    """Whether a plan may be used for a launch on ``t``'s device now: enabled, CUDA, not compiling,
    and the Triton release the plans were checked with."""
    return ENABLED and t.is_cuda and not torch.compiler.is_compiling() and _version_ok()


def _triton():
    global _TRITON
    if _TRITON is None:
        from triton import knobs
        from triton.runtime import driver
        _TRITON = (knobs.runtime, driver)
    return _TRITON


def _hooks_installed(rt) -> bool:
    return bool(getattr(rt.launch_enter_hook, "calls", True)) or bool(getattr(rt.launch_exit_hook, "calls", True))


def layout_key(tag: str, tensors: Sequence[torch.Tensor], scalars: tuple) -> tuple:
    """The key of a launch: ``tag`` (kernel), each tensor's dtype/shape/strides/device/16-byte alignment,
    ``scalars`` (the caller's other arguments and options) and the current CUDA device."""
    parts = [tag, torch.cuda.current_device(), scalars]
    for t in tensors:
        parts += (t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % 16 == 0)
    return tuple(parts)


def launch(key: tuple, tensors: Sequence[torch.Tensor]) -> bool:
    """Launch the plan stored under ``key`` with ``tensors`` (same order as when stored) on the current
    stream; False (nothing launched) when there is no plan or launch hooks are installed."""
    plan = _PLANS.get(key)
    if plan is None:
        return False
    ck, grid, tail = plan
    rt, driver = _triton()
    if _hooks_installed(rt):
        return False
    stream = driver.active.get_current_stream(key[1])
    ck.run(grid[0], grid[1], grid[2], stream, ck.function, ck.packed_metadata, None, None, None, *tensors, *tail)
    return True


def store(key: tuple, compiled, grid: Sequence[int], tail: tuple) -> None:
    """Remember ``compiled`` (the ``CompiledKernel`` returned by ``kernel[grid](*tensors, *tail-as-args)``)
    for ``key``: ``grid`` padded to 3-D, ``tail`` = every kernel argument after the tensors, in the
    kernel's parameter order, constexprs included. Ignored when ``compiled`` is not a launchable
    compiled kernel (the interpreter returns None)."""
    if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")) or compiled.function is None:
        return
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    g = tuple(grid) + (1,) * (3 - len(grid))
    _PLANS[key] = (compiled, g, tuple(tail))


def clear() -> None:
    """Drop every plan."""
    _PLANS.clear()
