"""The grid barrier of persistent Triton kernels (``longflash/ops/grid_sync.py``): a chain of phases in which
every program reads what *all* programs wrote in the previous phase (row i + 1 of a table = the max of row i
plus the program id + 1), so one stale read shows as a wrong value; the counter is 0 again after the launch.

- CPU (``TRITON_INTERPRET=1``, a subprocess: set before Triton is imported): one program (the interpreter
  runs programs one after another, so more would never pass a barrier), three launches in a row;
- GPU (skipped without CUDA): one program per SM, 64 phases, three launches in a row, and the chain of
  ``benchmarks/persistent_chain.py`` equal to step-by-step PyTorch.
"""

import os
import sys

import pytest
import torch
import triton
import triton.language as tl

from interpreter_run import run_interpreted
from longflash.ops.grid_sync import grid_arrive, grid_reset_if_last, grid_wait
from longflash.ops.triton_env import interpreting, sm_count

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@triton.jit
def _max_chain_phase(table_ptr, bar_ptr, i, P, pid, BLOCK_P: tl.constexpr):
    if i > 0:
        grid_wait(bar_ptr, i * P)
    idx = tl.arange(0, BLOCK_P)
    prev = tl.load(table_ptr + i * BLOCK_P + idx, mask=idx < P, other=0)
    tl.store(table_ptr + (i + 1) * BLOCK_P + pid, tl.max(prev, axis=0) + pid + 1)
    return grid_arrive(bar_ptr)


@triton.jit
def _max_chain_kernel(table_ptr, bar_ptr, L, BLOCK_P: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    before = 0
    if INTERPRET:  # a loop bounded by a run-time argument fails in the interpreter
        i = 0
        while i < L:
            before = _max_chain_phase(table_ptr, bar_ptr, i, P, pid, BLOCK_P)
            i += 1
    else:
        for i in range(0, L):
            before = _max_chain_phase(table_ptr, bar_ptr, i, P, pid, BLOCK_P)
    grid_reset_if_last(bar_ptr, before, L * P)


def _run_chain(programs: int, phases: int, device: str) -> dict:
    """Three launches of the chain; the table of the last, the expected table, the counter after each."""
    block_p = triton.next_power_of_2(programs)
    bar = torch.zeros(1, dtype=torch.int32, device=device)
    counters = []
    for _ in range(3):
        table = torch.zeros(phases + 1, block_p, dtype=torch.int32, device=device)
        _max_chain_kernel[(programs,)](table, bar, phases, BLOCK_P=block_p, INTERPRET=interpreting())
        counters.append(int(bar.item()))
    want = torch.zeros_like(table, device="cpu")
    for i in range(phases):
        want[i + 1, :programs] = want[i, :programs].max() + torch.arange(programs, dtype=torch.int32) + 1
    return {"equal": bool(torch.equal(table.cpu(), want)), "counters": counters}


def test_grid_barrier_chain_interpreter():
    got = run_interpreted("import json, sys; sys.path.insert(0, 'tests'); import test_grid_sync as t; "
                          "print('RESULT' + json.dumps(t._run_chain(1, 5, 'cpu')))")
    assert got == {"equal": True, "counters": [0, 0, 0]}, got


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grid_barrier_chain_gpu():
    got = _run_chain(sm_count(torch.device("cuda")), 64, "cuda")
    assert got == {"equal": True, "counters": [0, 0, 0]}, got


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_persistent_gemv_chain_gpu():
    sys.path.insert(0, os.path.join(_REPO, "benchmarks"))
    import persistent_chain as pc
    g = torch.Generator(device="cuda").manual_seed(0)
    L, d = 12, 2048
    block_n = pc.block_n_for(d, sm_count(torch.device("cuda")))  # one program per SM at most
    w = (torch.randn(L, d, d, device="cuda", generator=g) / d ** 0.5).to(torch.bfloat16)
    bar = torch.zeros(1, dtype=torch.int32, device="cuda")
    for prefetch in (True, False):
        ys = torch.zeros(L + 1, d, dtype=torch.bfloat16, device="cuda")
        ys[0] = torch.randn(d, device="cuda", generator=g).to(torch.bfloat16)
        pc.persistent_chain(w, ys, bar, block_n=block_n, prefetch=prefetch)
        assert pc.rel_err(w, ys) < 1e-2 and int(bar.item()) == 0
