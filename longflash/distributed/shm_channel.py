"""Same-host step transport for locally started TP/DCP workers: shared memory + semaphores.

The step channel (``comm.StepChannel``) sends each step from rank 0 to the workers. Its general path
(a rendezvous-store key the workers poll, then a length and the bytes as two gloo broadcasts over TCP
loopback) puts a few store and socket round trips on every step, and the workers' first collective
waits for them, so that latency lands on every TP/DCP decode step (``benchmarks/step_channel.py``).
When rank 0 starts the workers itself (one host), :class:`LocalLink` carries the bytes instead: one
shared buffer that rank 0 writes, and per worker a ``ready`` semaphore (rank 0 releases it after
writing) and a ``free`` one (the worker releases it once it copied the message out; rank 0 takes every
worker's before it writes the next). A semaphore wait is a futex: no polling delay, and the release /
acquire pair orders the buffer's bytes before their reader. A message longer than the buffer is
announced with length -1 and travels the general path (``comm.StepChannel``). torchrun-started
(possibly multi-host) ranks always use the general path.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 8 << 20    # bytes (a /dev/shm file): a uniform step of 64 requests x 32K blocks fits; larger take gloo
POLL_S = 0.5                  # a waiting side checks its peer's liveness this often (seconds)


class LocalLink:
    """Rank 0's end (``create``) or one worker's end (``for_worker``) of the shared step buffer.

    Attributes:
        capacity: buffer bytes. ready / free: rank 0: a list, one per worker; a worker: its own pair.
    """

    def __init__(self, data, length, ready, free, capacity: int):
        self._data, self._length = data, length
        self.ready, self.free = ready, free
        self.capacity = capacity

    @classmethod
    def create(cls, ctx, num_workers: int, capacity: int = DEFAULT_CAPACITY) -> "LocalLink":
        """Rank 0: allocate the buffer (``ctx.RawArray``: inherited by the workers' processes) and the
        semaphores, from the multiprocessing context ``ctx`` that will start the workers."""
        return cls(ctx.RawArray(ctypes.c_uint8, capacity), ctx.RawArray(ctypes.c_int64, 1),
                   [ctx.Semaphore(0) for _ in range(num_workers)], [ctx.Semaphore(1) for _ in range(num_workers)],
                   capacity)

    def for_worker(self, rank: int) -> "LocalLink":
        """Worker ``rank``'s end (1-based); pass it to that worker's process as an argument."""
        return LocalLink(self._data, self._length, self.ready[rank - 1], self.free[rank - 1], self.capacity)

    def write(self, data: memoryview | bytes, warn_after_s: float, check: Callable[[int], None],
              deadline_s: float | None = None) -> bool:
        """Rank 0: wait until every worker has read the previous message, then publish ``data``.
        Returns False (and publishes the length -1) when ``data`` is longer than the buffer: the caller
        then sends it on the general path. ``check(worker)`` is called every ``POLL_S`` of waiting (it
        raises when that worker is gone). A worker that is alive but still busy with an earlier step is
        waited for: rank 0 runs up to one message ahead of its workers, and a worker's step can take long
        where rank 0 waits on no collective (first-use kernel compiles; at start-up, before
        ``comm.wait_until_ready`` existed, its whole weight loading: a fixed 120 s deadline here failed a
        working fp32 3.3B -tp 4 engine). Every
        ``warn_after_s`` seconds of waiting logs a warning naming the worker (a worker stuck in a
        collective dies at the collective's own timeout, and ``check`` then raises). ``deadline_s``
        (the stop message at shutdown): raise TimeoutError naming the worker after that many seconds."""
        for w, sem in enumerate(self.free, start=1):
            t0 = time.monotonic()
            warned = 0
            while not sem.acquire(timeout=POLL_S):
                check(w)
                waited = time.monotonic() - t0
                if deadline_s is not None and waited > deadline_s:
                    raise TimeoutError(f"TP/DCP worker rank {w} did not take the previous step within {deadline_s:.0f} s")
                if waited >= (warned + 1) * warn_after_s:
                    warned += 1
                    logger.warning("TP/DCP worker rank %d has not taken the previous step for %.0f s; it is alive, "
                                   "still waiting", w, waited)
        n = len(data)
        fits = n <= self.capacity
        if fits:
            np.frombuffer(self._data, dtype=np.uint8, count=n)[:] = np.frombuffer(data, dtype=np.uint8)
        self._length[0] = n if fits else -1
        for sem in self.ready:
            sem.release()
        return fits

    def read(self, check: Callable[[], None]) -> bytes | None:
        """A worker: wait for the next message and return a copy of its bytes (None: it was too long
        for the buffer and comes on the general path). ``check()`` is called every ``POLL_S`` of
        waiting (it raises when rank 0 is gone)."""
        while not self.ready.acquire(timeout=POLL_S):
            check()
        n = int(self._length[0])
        out = None if n < 0 else bytes(np.frombuffer(self._data, dtype=np.uint8, count=n))
        self.free.release()
        return out
