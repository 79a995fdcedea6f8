"""The same-host step link (``distributed/shm_channel.py``) under ``comm.StepChannel``, two local ranks
over gloo: messages arrive in order and intact (plain pickles, ``torch.save`` objects with tensors, a
message longer than the buffer through the general path, the stop message); a worker that is gone makes
rank 0's post raise through ``check_worker`` instead of waiting for it; a busy one is waited for, with warnings."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from longflash.distributed import comm
from longflash.distributed.launch import _context, run_ranks
from longflash.distributed.shm_channel import LocalLink

MESSAGES = [("plain", {"a": np.arange(5), "b": [1, 2]}), ("torch", (torch.arange(7), {"x": torch.ones(2, 3)})),
            ("plain", list(range(400))), ("torch", None)]   # the list's pickle is longer than the 256-byte buffer


def _ranks(rank, world, port, link, out):
    comm.init_distributed(rank, world, port, timeout_s=30)
    ps = comm.initialize_model_parallel(world, 1)
    ch = comm.StepChannel(ps.tp, link=link if rank == 0 else link.for_worker(rank))
    got = []
    for kind, msg in MESSAGES:
        if rank == 0:
            ch.post(msg, plain=kind == "plain")
        else:
            got.append(ch.recv())
    if rank == 1:
        ok = (np.array_equal(got[0]["a"], np.arange(5)) and got[0]["b"] == [1, 2]
              and torch.equal(got[1][0], torch.arange(7)) and torch.equal(got[1][1]["x"], torch.ones(2, 3))
              and got[2] == list(range(400)) and got[3] is None)
        torch.save(ok, out)
    comm.destroy_distributed()


def test_link_carries_every_kind_of_message_in_order(tmp_path):
    link = LocalLink.create(_context(), 1, capacity=256)
    out = str(tmp_path / "ok.pt")
    assert run_ranks(_ranks, 2, (link, out), timeout_s=120) == [0, 0]
    assert torch.load(out) is True


def test_post_to_a_worker_that_is_gone_raises_naming_it():
    """One process plays rank 0 with no worker reading: the first post fills the buffer, the next waits
    for the worker's ``free`` semaphore, and ``check_worker`` names the worker that is gone."""
    link = LocalLink.create(_context(), 1, capacity=64)

    def gone(rank):
        raise RuntimeError(f"TP/DCP worker rank {rank} exited")
    assert link.write(b"x" * 10, 5.0, gone) is True
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        link.write(b"y" * 10, 5.0, gone)


def test_post_waits_for_a_busy_worker_and_warns_naming_it(caplog):
    """A worker that is alive but takes the previous message only after several warning periods is
    waited for (no error: at start-up a worker can lag rank 0 by minutes, found on 4 H200s), and each
    period logs a warning naming it; the message then arrives intact."""
    link = LocalLink.create(_context(), 1, capacity=64)
    worker = link.for_worker(1)
    assert link.write(b"first", 0.5, lambda rank: None) is True
    got = []
    reader = threading.Timer(1.8, lambda: got.append(worker.read(lambda: None)))
    reader.start()
    with caplog.at_level(logging.WARNING, logger="longflash.distributed.shm_channel"):
        assert link.write(b"second", 0.5, lambda rank: None) is True
    reader.join()
    assert got == [b"first"]
    assert worker.read(lambda: None) == b"second"
    warnings = [r.getMessage() for r in caplog.records if "has not taken the previous step" in r.getMessage()]
    assert len(warnings) >= 2 and all("rank 1" in m and "alive" in m for m in warnings)


def test_a_message_longer_than_the_buffer_is_refused():
    link = LocalLink.create(_context(), 1, capacity=64)
    assert link.write(b"z" * 65, 5.0, lambda rank: None) is False
    assert link.for_worker(1).read(lambda: None) is None      # the worker is told to take the general path


def _ready_ranks(rank, world, port, out):
    import time as _time
    comm.init_distributed(rank, world, port, timeout_s=30)
    if rank == 1:
        _time.sleep(1.6)              # "loading" for several warning periods
        comm.mark_ready(rank)
    else:
        msgs = []
        handler = logging.Handler()
        handler.emit = lambda rec: msgs.append(rec.getMessage())
        logging.getLogger("longflash.distributed.comm").addHandler(handler)
        t0 = _time.monotonic()
        comm.wait_until_ready(world, lambda: None, warn_after_s=0.5)
        torch.save((_time.monotonic() - t0, msgs), out)
    comm.dist.barrier()
    comm.destroy_distributed()


def test_rank0_waits_for_workers_still_loading(tmp_path):
    """Rank 0 waits (no deadline while the worker is alive) until a worker that loads slowly marks itself
    ready, warning each period (on 4 H200s an fp32 -tp 4 engine's workers lagged rank 0 by > 120 s)."""
    out = str(tmp_path / "ready.pt")
    assert run_ranks(_ready_ranks, 2, (out,), timeout_s=120) == [0, 0]
    waited, msgs = torch.load(out)
    assert waited >= 1.4
    assert len(msgs) >= 2 and all("still loading" in m for m in msgs)
