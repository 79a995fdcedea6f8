"""A grid-wide barrier for persistent Triton kernels: every program of the launch waits until all of them
have finished a phase, inside one kernel launch instead of between two launches.

Why: the batch-1 decode step of a DeepSeek-V3-shaped model is ~600 dependent launches, each costing
~1.5 µs of launch and drain whatever its bytes (``benchmarks/NOTES.md``, sessions 22-23;
``results/launch_floor.h200.md``). A persistent kernel replaces launch boundaries by barriers, and can
issue the next phase's weight loads (which do not depend on the previous phase) *before* waiting.
``benchmarks/persistent_chain.py`` measures both against the per-launch floor.

Protocol (the cooperative-groups grid sync, written with Triton atomics; counter = one int32 in global
memory, 0 when a launch starts):
- ``grid_arrive(bar_ptr)`` after a phase's stores: ``bar.sync`` (the program's threads are done), then
  one atomic add with release semantics at GPU scope (the phase's stores are visible before the count);
  returns the count before the add;
- ``grid_wait(bar_ptr, target)``: spins on acquire loads of the counter until it reaches ``target`` =
  (phases completed) × (programs), then ``bar.sync`` so the whole program proceeds together;
- the last arrival of the launch (the program whose add returns ``total - 1``) resets the counter to 0
  (``grid_reset_if_last``): every program has then passed its last wait, and the next launch in the
  stream starts after this one ends.
All programs must be resident at once (grid ≤ the SMs' capacity for the kernel): the caller sizes the
grid by :func:`longflash.ops.triton_env.sm_count`. In Triton's CPU interpreter the programs run one after
the other, so a barrier with more than one program would never open; launchers run one program there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def barrier_counter(device: torch.device) -> torch.Tensor:
    """A barrier counter (int32 [1]) on ``device``, made (zeroed) once and shared by the persistent launches
    on it: every launch that follows the protocol leaves it at 0 (:func:`grid_reset_if_last`), so reusing it
    costs no memset launch. Launches that share it must run one after the other (one stream)."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[device]


@triton.jit
def grid_arrive(bar_ptr):
    """Count this program's arrival at the barrier (after its stores of the phase); returns the count
    before this arrival (int32 scalar)."""
    tl.debug_barrier()
    return tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def grid_wait(bar_ptr, target):
    """Spin until the barrier counter at ``bar_ptr`` is >= ``target`` (int32), with acquire semantics:
    stores made before the counted arrivals are visible after it returns."""
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def grid_reset_if_last(bar_ptr, before, total):
    """Reset the counter to 0 when ``before`` (a :func:`grid_arrive` result) is ``total - 1``: the last
    arrival of the launch, after which no program reads the counter."""
    if before == total - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
