"""The same-host step link (``distributed/shm_channel.py``) under ``comm.StepChannel``, two local ranks
over gloo: messages arrive in order and intact (plain pickles, ``torch.save`` objects with tensors, a
message longer than the buffer through the general path, the stop message); a worker that is gone makes
rank 0's post raise through ``check_worker`` instead of waiting for it."""

from __future__ import annotations

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
    for the worker's ``free`` semaphore, and ``check_worker`` (or the timeout) names the worker."""
    link = LocalLink.create(_context(), 1, capacity=64)

    def gone(rank):
        raise RuntimeError(f"TP/DCP worker rank {rank} exited")
    assert link.write(b"x" * 10, 5.0, gone) is True
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        link.write(b"y" * 10, 5.0, gone)
    with pytest.raises(TimeoutError, match="rank 1"):
        link.write(b"y" * 10, 0.6, lambda rank: None)


def test_a_message_longer_than_the_buffer_is_refused():
    link = LocalLink.create(_context(), 1, capacity=64)
    assert link.write(b"z" * 65, 5.0, lambda rank: None) is False
    assert link.for_worker(1).read(lambda: None) is None      # the worker is told to take the general path
