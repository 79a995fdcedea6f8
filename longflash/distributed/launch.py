"""Start ``world_size`` local rank processes (spawn) and wait for them with a deadline.

Used by the tests' multi-process harness and by the engine's single-host launch. Multi-host runs
use torchrun instead, and :func:`longflash.distributed.comm.init_distributed` reads its environment.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Callable


def _entry(fn: Callable, rank: int, world_size: int, port: int, args: tuple, num_threads: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    import torch
    torch.set_num_threads(num_threads)
    fn(rank, world_size, port, *args)


_PRELOAD = ["torch", "longflash.attention.ops", "longflash.distributed.comm", "longflash.distributed.dcp"]


def _context():
    """``forkserver`` where available: one server process imports torch once (seconds) and each rank
    forks from it, single-threaded and without any process-group state; ``spawn`` elsewhere."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return mp.get_context("spawn")


def run_ranks(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 60.0, grace_s: float = 20.0,
              port: int | None = None, num_threads: int = 1) -> list[int]:
    """Run ``fn(rank, world_size, port, *args)`` in ``world_size`` new processes (forkserver/spawn).

    ``fn`` must be importable (a module-level function). ``port`` (default: a free one) is the
    master port the ranks pass to ``comm.init_distributed``.
    Returns the exit codes in rank order once all processes have exited. When one process exits
    non-zero, the others get ``grace_s`` seconds to notice (their collectives raise) before they are
    killed (exit code then negative). Raises TimeoutError, after killing every process, when they
    have not all finished within ``timeout_s``.
    """
    from longflash.distributed.comm import free_port
    port = free_port() if port is None else port
    ctx = _context()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, num_threads), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    failed_at = None
    try:
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"ranks still running after {timeout_s:.0f} s: "
                                   f"{[r for r, p in enumerate(procs) if p.is_alive()]}")
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > grace_s:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [p.exitcode for p in procs]
